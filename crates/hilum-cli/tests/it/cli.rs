//! The `hilum` binary end to end, on real radiographs from ../shared/data.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn data(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(rel);
    assert!(
        p.exists(),
        "missing test data {} (../shared/data beside the checkout)",
        p.display()
    );
    p
}

/// Fails the test with hilum's stderr when the command did not succeed.
fn assert_succeeded(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn hilum() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    // Tests must not pick up a developer's key or config.
    c.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_CONFIG")
        .env("HOME", "/nonexistent-hilum-home")
        .env("HILUM_MODELS_DIR", "/nonexistent-hilum-models");
    c
}

#[test]
fn analyze_json_streams_events_ending_with_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("script.json");
    std::fs::write(
        &script,
        r#"[{"content":"Checking.","tool_calls":[{"id":"c1","name":"image_info","arguments":{"image":"$IMAGE"}}]},
            {"content":"The image is 512x512."}]"#,
    )
    .expect("write script");
    let out = hilum()
        .args(["analyze", "--json", "--question", "How big is it?", "--llm"])
        .arg(format!("script:{}", script.display()))
        .arg(data("cxr/images/nih_00000001_000_cardiomegaly.png"))
        .output()
        .expect("run hilum");
    assert_succeeded(&out);
    let events: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect();
    let types: Vec<&str> = events
        .iter()
        .filter_map(|e| e["type"].as_str())
        .filter(|t| *t != "token")
        .collect();
    assert_eq!(
        types,
        [
            "decision",
            "tool_started",
            "tool_finished",
            "decision",
            "final",
            "complete"
        ]
    );
    let finished = &events
        .iter()
        .find(|e| e["type"] == "tool_finished")
        .expect("finished")["data"];
    assert_eq!(finished["width"], 512, "images.csv says 512x512");
    assert_eq!(finished["height"], 512);
    assert!(finished["image"].as_str().unwrap_or("").starts_with("img_"));
    assert_eq!(events.last().expect("events")["ok"], true);
    // No file name reaches the model or the events.
    assert!(!String::from_utf8_lossy(&out.stdout).contains("cardiomegaly.png"));
}

#[test]
fn tools_call_fills_the_image_argument() {
    let out = hilum()
        .args(["tools", "call", "image_info", "--image"])
        .arg(data("cxr/images/kermany_IM-0025-0001_normal.jpeg"))
        .output()
        .expect("run hilum");
    assert_succeeded(&out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON output");
    assert_eq!(v["tool"], "image_info");
    assert!(v["data"]["width"].as_u64().unwrap_or(0) > 500);
    assert_eq!(v["data"]["bit_depth"], 8);
}

#[test]
fn failing_tool_call_exits_non_zero_with_the_reason() {
    let out = hilum()
        .args([
            "tools",
            "call",
            "image_info",
            "--args",
            r#"{"image": "img_000000000000"}"#,
        ])
        .output()
        .expect("run hilum");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no image with id") && err.contains("tool_error"),
        "{err}"
    );

    let out = hilum()
        .args([
            "tools",
            "call",
            "image_info",
            "--args",
            r#"{"image": "../../etc/passwd"}"#,
        ])
        .output()
        .expect("run hilum");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid_arguments"));
}

#[test]
fn analyze_without_a_model_says_how_to_configure_one() {
    let out = hilum()
        .args(["analyze"])
        .arg(data("cxr/images/nih_00000001_000_cardiomegaly.png"))
        .output()
        .expect("run hilum");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--llm"), "{err}");
}

#[test]
fn the_config_files_models_table_sets_the_models_dir_and_a_variable_wins() {
    let dir = tempfile::tempdir().expect("tmp");
    let from_file = dir.path().join("site-models");
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!("[models]\ndir = {:?}\n", from_file.display().to_string()),
    )
    .expect("write config");
    let listed_dir = |out: std::process::Output| {
        assert_succeeded(&out);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.lines()
            .next()
            .and_then(|l| l.strip_prefix("models directory: "))
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no models directory line in: {text}"))
    };
    let out = hilum()
        .env_remove("HILUM_MODELS_DIR")
        .env("HILUM_CONFIG", &config)
        .args(["models", "list"])
        .output()
        .expect("run hilum");
    assert_eq!(listed_dir(out), from_file.display().to_string());
    let out = hilum()
        .env("HILUM_CONFIG", &config)
        .args(["models", "list"])
        .output()
        .expect("run hilum");
    assert_eq!(listed_dir(out), "/nonexistent-hilum-models");
    std::fs::write(&config, "[models]\ndirr = \"x\"\n").expect("write config");
    let out = hilum()
        .env("HILUM_CONFIG", &config)
        .args(["models", "list"])
        .output()
        .expect("run hilum");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown field `dirr`"), "{err}");
}

#[test]
fn tools_list_json_has_schemas() {
    let out = hilum()
        .args(["tools", "list", "--json"])
        .output()
        .expect("run hilum");
    assert!(out.status.success());
    let v: Vec<Value> = serde_json::from_slice(&out.stdout).expect("JSON");
    let info = v
        .iter()
        .find(|t| t["name"] == "image_info")
        .expect("image_info listed");
    assert_eq!(info["parameters"]["required"][0], "image");
}

#[test]
fn bench_reports_percentiles_and_the_parallel_round() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plot = dir.path().join("bench.png");
    let out = hilum()
        .args([
            "bench",
            "--json",
            "-n",
            "3",
            "--warmup",
            "0",
            "--tool",
            "image_info",
            "--tool",
            "visualize",
            "--tool",
            "dicom_info",
            "--image",
        ])
        .arg(data("cxr/images/nih_00000001_000_cardiomegaly.png"))
        .arg("--plot")
        .arg(&plot)
        .output()
        .expect("run hilum");
    assert_succeeded(&out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let tools = v["tools"].as_array().expect("tools");
    assert_eq!(tools.len(), 3);
    assert_eq!(tools[0]["tool"], "image_info");
    assert_eq!(tools[0]["iterations"], 3);
    assert!(tools[0]["p50_ms"].as_f64().unwrap_or(-1.0) > 0.0);
    assert!(tools[0]["p99_ms"].as_f64() >= tools[0]["p50_ms"].as_f64());
    // A PNG has no DICOM metadata: that tool is reported as failed, the others still run.
    assert_eq!(tools[2]["ok"], false);
    assert!(tools[2]["error"]
        .as_str()
        .unwrap_or("")
        .contains("not DICOM"));
    assert_eq!(v["round"]["calls"], 2);
    assert!(v["round"]["parallel_ms"].as_f64().unwrap_or(0.0) > 0.0);
    assert!(v["peak_rss_mib"].as_f64().unwrap_or(0.0) > 1.0);

    // The figure: per-tool bars and the parallel-vs-serial panel, drawn (not a blank canvas).
    let png = image::open(&plot)
        .expect("bench --plot wrote a PNG")
        .to_rgb8();
    assert_eq!(png.dimensions(), (1200, 520));
    let ink = png.pixels().filter(|p| p.0 != [255, 255, 255]).count();
    assert!(
        ink > 5_000,
        "the figure is almost empty: {ink} non-white pixels"
    );
}

#[test]
fn bench_times_the_classifier_per_backend_and_batch_and_names_missing_weights() {
    let out = hilum()
        .args([
            "bench",
            "--json",
            "-n",
            "1",
            "--tool",
            "classify_chest_xray",
            "--backend",
            "native,onnx",
            "--batch",
            "1,4",
            "--image",
        ])
        .arg(data("cxr/images/nih_00000001_000_cardiomegaly.png"))
        .output()
        .expect("run hilum");
    assert_succeeded(&out);
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let tools = v["tools"].as_array().expect("tools");
    let backends: Vec<&str> = tools.iter().filter_map(|t| t["backend"].as_str()).collect();
    assert_eq!(backends, ["native", "onnx"]);
    // No weights in this models dir: every row says how to install them.
    let batched = v["batched"].as_array().expect("batched rows");
    assert_eq!(batched.len(), 2, "one error row per backend: {batched:?}");
    for row in tools.iter().chain(batched) {
        assert_eq!(row["ok"], false);
        let e = row["error"].as_str().unwrap_or("");
        assert!(e.contains("densenet121-res224-all"), "{e}");
    }
    assert!(v["cpu_threads"].as_u64().unwrap_or(0) >= 1);

    let bad = hilum()
        .args(["bench", "--tool", "classify_chest_xray", "--backend", "tpu"])
        .arg("--image")
        .arg(data("cxr/images/nih_00000001_000_cardiomegaly.png"))
        .output()
        .expect("run hilum");
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("native, candle, onnx or kserve"), "{err}");
}

/// A models dir holding the real lung U-Net with its ONNX graph, imported by `hilum models
/// import` (the .h5 is read in Rust: no Python).
fn lung_unet_models_dir(dir: &std::path::Path) -> PathBuf {
    let models = dir.join("models");
    for file in ["lung_seg_valiou_088.h5", "lung_seg_valiou_088.onnx"] {
        let out = hilum()
            .env("HILUM_MODELS_DIR", &models)
            .args(["models", "import", "lung-unet"])
            .arg(data(&format!("models/lung_seg_unet/{file}")))
            .output()
            .expect("run hilum");
        assert_succeeded(&out);
    }
    models
}

#[test]
fn export_triton_writes_the_repository_and_a_down_server_is_a_clear_error_or_the_fallback() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = lung_unet_models_dir(dir.path());
    let repo = dir.path().join("repo");
    let out = hilum()
        .env("HILUM_MODELS_DIR", &models)
        .args([
            "models",
            "export-triton",
            "--gpus",
            "2",
            "--max-batch-size",
            "8",
        ])
        .arg(&repo)
        .output()
        .expect("run hilum");
    assert_succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("wrote lung-unet"), "{stdout}");
    assert!(
        stdout.contains("skipped densenet121-res224-all: not installed"),
        "{stdout}"
    );
    let config = std::fs::read_to_string(repo.join("lung-unet/config.pbtxt")).expect("config");
    for want in [
        "platform: \"onnxruntime_onnx\"",
        "max_batch_size: 8",
        "name: \"input\"",
        "dims: [ 256, 256, 3 ]",
        "name: \"activation_51\"",
        "data_type: TYPE_FP32",
        "dynamic_batching",
        "gpus: [ 1 ]",
    ] {
        assert!(config.contains(want), "{want} missing:\n{config}");
    }
    assert!(repo.join("lung-unet/1/model.onnx").is_file());

    // HILUM_BACKEND=kserve sends the lung U-Net to the server; this one is not there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let call = |fallback: &str| {
        hilum()
            .env("HILUM_MODELS_DIR", &models)
            .env("HILUM_BACKEND", "kserve")
            .env("HILUM_KSERVE_URL", format!("http://127.0.0.1:{closed}"))
            .env("HILUM_KSERVE_RETRIES", "0")
            .env("HILUM_KSERVE_FALLBACK", fallback)
            .args(["tools", "call", "segment_lungs", "--image"])
            .arg(data("cxr/images/nih_00000001_000_cardiomegaly.png"))
            .output()
            .expect("run hilum")
    };
    let down = call("");
    assert!(!down.status.success());
    let err = String::from_utf8_lossy(&down.stderr);
    assert!(
        err.contains("is not answering") && err.contains("HILUM_KSERVE_URL"),
        "{err}"
    );
    let fell = call("native");
    assert_succeeded(&fell);
    let v: Value = serde_json::from_slice(&fell.stdout).expect("JSON output");
    assert_eq!(v["data"]["backend"], "native");
    assert!(
        v["data"]["fallback"]
            .as_str()
            .is_some_and(|f| f.contains("did not answer")),
        "{}",
        v["data"]
    );
}

#[test]
fn deid_writes_deidentified_copies_with_the_chosen_options() {
    let help = hilum()
        .args(["deid", "--help"])
        .output()
        .expect("run hilum");
    assert_succeeded(&help);
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--retain-modified-dates",
        "--date-shift-days",
        "--retain-patient-characteristics",
        "--retain-device-identity",
        "--allow-burned-in",
        "E.1-1",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let inputs = [
        "cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm",
        "cxr/dicom/CR-MONO1-10-chest_noPart10header.dcm",
    ];
    let out = hilum()
        .arg("deid")
        .args(inputs.iter().map(|p| data(p)))
        .arg("--out")
        .arg(dir.path())
        .args(["--salt", "cli-test", "--retain-modified-dates"])
        .args([
            "--date-shift-days",
            "-7",
            "--retain-patient-characteristics",
        ])
        .output()
        .expect("run hilum");
    assert_succeeded(&out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    for rel in inputs {
        let name = PathBuf::from(rel);
        let written = std::fs::read(dir.path().join(name.file_name().expect("name")))
            .expect("a copy per input");
        assert_eq!(&written[128..132], b"DICM");
        let text = String::from_utf8_lossy(&written);
        assert!(
            text.contains("PS3.15 E 2026c Basic; Rtn Modif Dates; Rtn Pat Chars"),
            "{rel}: the method names the options"
        );
        let img =
            hilum_imaging::decode_with(&written, rel, &hilum_imaging::DecodeOptions::default())
                .expect("the copy still decodes");
        assert!(img.width > 0);
    }
    // Writing over the inputs is refused.
    let again = hilum()
        .args(["deid", "--out"])
        .arg(dir.path())
        .arg(
            dir.path()
                .join("siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm"),
        )
        .output()
        .expect("run hilum");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("overwrite its own input"));
}
