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
