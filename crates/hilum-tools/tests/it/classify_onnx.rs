//! The classifier tool on ONNX Runtime against the native engine, on a real radiograph with a
//! site checkpoint (seeded DenseNet-121 weights imported with `--custom`).

use std::path::PathBuf;
use std::sync::Arc;

use hilum_agent::{Tool, ToolContext};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_models::xrv::{self, XrvSpec};
use hilum_models::{Backend, ModelPool, ModelRegistry};
use hilum_tools::ClassifyChestXray;
use serde_json::{json, Value};

fn shared_image() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/images");
    let first = std::fs::read_dir(&p)
        .unwrap_or_else(|e| panic!("real radiographs missing in {}: {e}", p.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "png" || x == "jpg"))
        .min();
    first.unwrap_or_else(|| panic!("no PNG/JPEG in {}", p.display()))
}

/// The same radiograph through the tool on ONNX Runtime and natively: the output names the
/// backend and the scores agree.
#[tokio::test]
async fn onnx_backend_gives_the_native_scores_and_says_so() {
    // The program's part: hand the models crate the library ORT_DYLIB_PATH names.
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        hilum_models::onnx::use_runtime(p.into());
    }
    if !hilum_models::onnx::available() {
        eprintln!(
            "SKIPPED: ONNX Runtime not loadable (ORT_DYLIB_PATH unset?); run `eval \
             \"$(scripts/setup_onnxruntime.sh)\"`"
        );
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let w = xrv::synthetic_weights(&XrvSpec::densenet121_res224_all().arch, 3).expect("weights");
    let ckpt = dir.path().join("site_densenet.safetensors");
    candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
    let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
    let opts = hilum_models::ImportOptions {
        custom: true,
        ..Default::default()
    };
    hilum_models::import(&registry, "densenet121-res224-all", &ckpt, &opts).expect("custom import");
    let pool = Arc::new(ModelPool::new(Arc::new(registry)));
    let store = Arc::new(ImageStore::new(StoreLimits::default()));
    let id = store
        .ingest_file(&shared_image())
        .expect("real image decodes");

    let mut data = Vec::new();
    for backend in [Backend::Onnx, Backend::Native] {
        let tool = ClassifyChestXray::with_backend(store.clone(), pool.clone(), backend);
        let out = tool
            .call(&ToolContext::default(), json!({"image": id}))
            .await
            .expect("classifies");
        assert_eq!(out.data["backend"], backend.name());
        data.push(out.data);
    }
    assert_eq!(
        data[0]["onnx_graph"],
        "built from the installed safetensors"
    );
    assert!(data[1]["onnx_graph"].is_null());
    let probs = |d: &Value| -> Vec<f64> {
        d["scores"]
            .as_array()
            .expect("scores")
            .iter()
            .map(|s| s["probability"].as_f64().expect("p"))
            .collect()
    };
    let (a, b) = (probs(&data[0]), probs(&data[1]));
    assert_eq!(a.len(), 18);
    for (x, y) in a.iter().zip(&b) {
        // Rounded to 4 decimals in the output.
        assert!((x - y).abs() <= 2e-4, "onnx {x} vs native {y}");
    }
    assert_eq!(data[0]["findings"], data[1]["findings"]);
}
