//! `--device` / `HILUM_DEVICE` / `[models] device` reach the process's one model pool: the
//! tools and `hilum bench`'s batched classifier forward run where the list says, the flag wins,
//! and a list that does not parse stops the command naming where it came from.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(rel)
}

fn hilum(models: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_DEVICE")
        .env("HILUM_CONFIG", "/dev/null")
        .env("HOME", "/nonexistent-hilum-home")
        .env("HILUM_MODELS_DIR", models);
    c
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `hilum tools call segment_lungs` on one radiograph, with `flags`; its JSON output without
/// the timings.
fn segment(cmd: &mut Command, flags: &[&str]) -> Result<Value, String> {
    let out = cmd
        .args(["tools", "call", "segment_lungs", "--image"])
        .arg(data("cxr/images/covid_2c35005f.jpg"))
        .args(flags)
        .output()
        .expect("run hilum");
    if !out.status.success() {
        return Err(stderr(&out));
    }
    let mut v: Value = serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())?;
    strip_ms(&mut v);
    Ok(v)
}

fn strip_ms(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|k, _| k != "ms" && !k.ends_with("_ms"));
            m.values_mut().for_each(strip_ms);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_ms),
        _ => {}
    }
}

#[test]
fn the_device_list_reaches_the_tools_and_bad_lists_stop_the_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = dir.path().join("models");
    let out = hilum(&models)
        .args(["models", "import", "lung-unet"])
        .arg(data("models/lung_seg_unet/lung_seg_valiou_088.h5"))
        .output()
        .expect("run hilum models import");
    assert!(out.status.success(), "import: {}", stderr(&out));

    let plain = segment(&mut hilum(&models), &[]).expect("no --device");
    let cpu = segment(&mut hilum(&models), &["--device", "cpu"]).expect("--device cpu");
    assert_eq!(plain, cpu);

    // A GPU no machine here has: the call fails on that device, so the list reached the pool.
    let err = segment(hilum(&models).env("HILUM_DEVICE", "cuda:7"), &[]).expect_err("cuda:7");
    assert!(err.contains("cuda:7"), "{err}");
    // The flag wins over the variable.
    let flag = segment(
        hilum(&models).env("HILUM_DEVICE", "cuda:7"),
        &["--device", "cpu"],
    )
    .expect("--device cpu over HILUM_DEVICE");
    assert_eq!(flag, plain);

    let err = segment(&mut hilum(&models), &["--device", "cuda:0,cuda:0"]).expect_err("dup");
    assert!(
        err.contains("--device:") && err.contains("listed twice"),
        "{err}"
    );
    let err = segment(hilum(&models).env("HILUM_DEVICE", "cpu,cuda:1"), &[]).expect_err("mixed");
    assert!(
        err.contains("HILUM_DEVICE:") && err.contains("different kinds"),
        "{err}"
    );
    let config = dir.path().join("config.toml");
    std::fs::write(&config, "[models]\ndevice = \"tpu:0\"\n").expect("write config");
    let err = segment(hilum(&models).env("HILUM_CONFIG", &config), &[]).expect_err("file");
    assert!(
        err.contains("[models] device") && err.contains("tpu:0"),
        "{err}"
    );
}

/// `hilum bench --batch` on the classifier with `--device`: the batched forward's rows.
fn batched(models: &Path, device: &str) -> Vec<Value> {
    let out = hilum(models)
        .args(["bench", "--json", "-n", "1", "--warmup", "0", "--no-round"])
        .args([
            "--tool",
            "classify_chest_xray",
            "--batch",
            "2",
            "--device",
            device,
        ])
        .arg("--image")
        .arg(data("cxr/images/covid_2c35005f.jpg"))
        .output()
        .expect("run hilum bench");
    assert!(out.status.success(), "bench: {}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    v["batched"].as_array().cloned().unwrap_or_default()
}

#[test]
fn bench_batches_run_on_the_device_list() {
    let dir = tempfile::tempdir().expect("tempdir");
    let models = dir.path().join("models");
    // A site checkpoint with seeded weights: the batched forward needs a classifier installed.
    let arch = hilum_models::xrv::XrvSpec::densenet121_res224_all().arch;
    let w = hilum_models::xrv::synthetic_weights(&arch, 3).expect("weights");
    let ckpt = dir.path().join("site_densenet.safetensors");
    candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
    let out = hilum(&models)
        .args(["models", "import", "densenet121-res224-all", "--custom"])
        .arg(&ckpt)
        .output()
        .expect("run hilum models import");
    assert!(out.status.success(), "import: {}", stderr(&out));

    let rows = batched(&models, "cpu");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["ok"], true, "{rows:?}");
    assert_eq!(rows[0]["device"], "cpu", "{rows:?}");
    // A GPU no machine here has: the batched forward fails there, so it went through the list.
    let rows = batched(&models, "cuda:7");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["ok"], false, "{rows:?}");
    let e = rows[0]["error"].as_str().unwrap_or("");
    assert!(e.contains("cuda:7"), "{e}");
}
