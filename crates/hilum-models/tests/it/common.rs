//! Helpers the test modules share.

use std::path::Path;

use hilum_models::{ImportOptions, ModelRegistry};

/// The program's part, done here: hand the models crate the ONNX Runtime library named by
/// `ORT_DYLIB_PATH` (the crate reads no environment variables).
pub fn use_ort_from_env() {
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        hilum_models::onnx::use_runtime(p.into());
    }
}

/// Whether ONNX Runtime loads; prints why the test is skipped when it does not.
pub fn ort_ready() -> bool {
    use_ort_from_env();
    if hilum_models::onnx::available() {
        return true;
    }
    let why = match hilum_models::onnx::dylib_path() {
        None => "ORT_DYLIB_PATH is not set".to_string(),
        Some(p) => format!("ONNX Runtime does not load from {}", p.display()),
    };
    eprintln!(
        "SKIPPED: {why}; run `eval \"$(scripts/setup_onnxruntime.sh)\"` (scripts/test.sh does) to \
         test the ONNX Runtime backend"
    );
    false
}

/// `registry` with `id`'s manifest configured as `config` (its `[config]` table, e.g. a small
/// fixture network) and `weights` of that configuration imported as a site checkpoint.
pub fn with_custom(
    registry: ModelRegistry,
    id: &str,
    config: &impl serde::Serialize,
    weights: &Path,
) -> ModelRegistry {
    let mut manifest = registry.manifest(id).expect("manifest").clone();
    manifest.config = match toml::Value::try_from(config).expect("config to toml") {
        toml::Value::Table(t) => t,
        other => panic!("not a table: {other}"),
    };
    let registry = registry.with_manifest(manifest);
    let opts = ImportOptions {
        custom: true,
        ..Default::default()
    };
    hilum_models::import(&registry, id, weights, &opts).expect("import");
    registry
}

/// `hilum models export-triton` of `id` alone, configured as `config` with `weights` (see
/// [`with_custom`]), into a new folder: one model written with dynamic batching up to 16, its
/// `config.pbtxt` holding every line of `want`; returns the folder and the written graph on
/// ONNX Runtime (2 threads), as Triton's ONNX Runtime would load it.
pub fn export_one(
    id: &str,
    config: &impl serde::Serialize,
    weights: &Path,
    want: &[&str],
) -> (tempfile::TempDir, hilum_models::onnx::OnnxModel) {
    use hilum_models::triton::{export_triton, ExportOptions, Exported};
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
    let registry = with_custom(registry, id, config, weights);
    let repo = dir.path().join("repo");
    let done = export_triton(
        &registry,
        &repo,
        &[id.to_string()],
        &ExportOptions::default(),
    )
    .expect("export");
    assert!(
        matches!(
            &done[..],
            [Exported::Written {
                max_batch_size: 16,
                ..
            }]
        ),
        "{done:?}"
    );
    let text = std::fs::read_to_string(repo.join(id).join("config.pbtxt")).expect("config.pbtxt");
    for line in [
        format!("name: \"{id}\""),
        "platform: \"onnxruntime_onnx\"".into(),
        "dynamic_batching".into(),
    ]
    .iter()
    .map(String::as_str)
    .chain(want.iter().copied())
    {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }
    let graph = repo.join(id).join("1/model.onnx");
    let served = hilum_models::onnx::OnnxModel::load(&graph, 2).expect("load the exported graph");
    (dir, served)
}
