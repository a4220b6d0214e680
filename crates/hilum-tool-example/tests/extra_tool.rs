//! A tool added by another crate: listed with its generated schema, its arguments checked by
//! the agent, offered to a local model only when its requirement (a DICOM input) holds.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use hilum_imaging::ImageStore;
use hilum_tool_example::intensity_at::IntensityAt;
use hilum_tools::{Registry, ToolDeps};
use serde_json::Value;

fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/cxr")
        .join(rel)
}

fn example() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum-example"));
    // No user configuration leaks into the test.
    c.env("HILUM_CONFIG", "/dev/null")
        .env_remove("OPENAI_API_KEY");
    c
}

#[test]
fn the_tool_is_listed_with_its_generated_schema() {
    let out = example()
        .args(["tools", "list", "--json"])
        .output()
        .expect("run hilum-example");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tools: Vec<Value> = serde_json::from_slice(&out.stdout).expect("JSON list");
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    assert!(names.contains(&"image_info") && names.contains(&"segment_lungs"));
    let tool = tools
        .iter()
        .find(|t| t["name"] == "intensity_at")
        .expect("intensity_at listed");
    let params = &tool["parameters"];
    assert_eq!(params["type"], "object");
    assert_eq!(params["additionalProperties"], false);
    assert_eq!(params["properties"]["radius"]["maximum"], 50);
    assert_eq!(
        params["properties"]["x"]["description"],
        "Column of the centre, original-image pixels."
    );
    assert_eq!(
        params["properties"]["image"]["pattern"],
        "^img_[0-9a-f]{6,64}$"
    );
    let mut required: Vec<&str> = params["required"]
        .as_array()
        .expect("required")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    required.sort();
    assert_eq!(required, ["image", "x", "y"]);
    assert_eq!(tool["requirements"]["dicom_input"], true);
    assert_eq!(tool["unmet"][0], "no DICOM image among the inputs");
}

#[test]
fn the_agent_rejects_arguments_that_break_the_schema_and_runs_good_ones() {
    let dir = std::env::temp_dir().join(format!("hilum-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let script = dir.join("script.json");
    std::fs::write(
        &script,
        r#"[
          {"content": "", "tool_calls": [
            {"name": "intensity_at", "arguments": {"image": "$IMAGE", "x": 10, "y": 10, "radius": 500}},
            {"name": "intensity_at", "arguments": {"image": "$IMAGE", "x": 100, "y": 120, "radius": 2}}
          ]},
          {"content": "done"}
        ]"#,
    )
    .expect("script");
    let out = example()
        .arg("analyze")
        .arg(data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm"))
        .args(["--question", "intensity?", "--json", "--llm"])
        .arg(format!("script:{}", script.display()))
        .output()
        .expect("run hilum-example");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let events: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let failed = events
        .iter()
        .find(|e| e["type"] == "tool_failed")
        .expect("the out-of-range call fails");
    assert_eq!(failed["kind"], "invalid_arguments", "{failed}");
    assert!(failed.to_string().contains("radius"), "{failed}");
    let finished = events
        .iter()
        .find(|e| e["type"] == "tool_finished" && e["name"] == "intensity_at")
        .expect("the valid call runs");
    assert_eq!(finished["data"]["pixels"], 25, "{finished}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_local_model_is_offered_the_tool_only_with_a_dicom_input() {
    let store = Arc::new(ImageStore::default());
    let png = store
        .ingest_file(&data("images/nih_00000001_000_cardiomegaly.png"))
        .expect("png");
    let dcm = store
        .ingest_file(&data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm"))
        .expect("dicom");
    let models = Arc::new(hilum_tools::ModelPool::from_settings(Default::default()));
    let deps = ToolDeps::new(store, models);
    let toolbox = Registry::builtin()
        .with::<IntensityAt>()
        .toolbox(&deps)
        .expect("toolbox");
    let offered = |ids: &[String]| {
        toolbox
            .runnable(&hilum_tools::environment(&deps, ids))
            .names()
    };
    assert!(!offered(std::slice::from_ref(&png)).contains(&"intensity_at".to_string()));
    assert!(offered(&[png, dcm]).contains(&"intensity_at".to_string()));
}
