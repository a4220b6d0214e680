//! What the tests and examples take from the environment: the library reads none, so this does
//! what the `hilum` binary does for them.
// Each test binary and example uses a part of this.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use hilum_llm_local::LocalConfig;

/// `$HILUM_MODELS_DIR`, else `<user data dir>/hilum/models` (`$XDG_DATA_HOME` or
/// `~/.local/share`), as the `hilum` binary resolves it.
pub fn models_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("HILUM_MODELS_DIR") {
        return PathBuf::from(d);
    }
    match var("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".local/share")))
    {
        Some(d) => d.join("hilum/models"),
        None => PathBuf::from(".hilum/models"),
    }
}

/// The installed default model, if any.
pub fn default_model_path() -> Option<PathBuf> {
    hilum_llm_local::default_model_path(&models_dir())
}

/// `LocalConfig::new(path)` with `HILUM_LOCAL_MATMUL`, `HILUM_LOCAL_SIMD` and
/// `CANDLE_NUM_THREADS` applied, as the binary applies them.
pub fn local_config(path: &Path) -> LocalConfig {
    let mut cfg = LocalConfig::new(path);
    if let Ok(v) = std::env::var("HILUM_LOCAL_MATMUL") {
        cfg.matmul = v.parse().expect("HILUM_LOCAL_MATMUL");
    }
    if let Ok(v) = std::env::var("HILUM_LOCAL_SIMD") {
        cfg.simd = v.parse().expect("HILUM_LOCAL_SIMD");
    }
    if let Ok(v) = std::env::var("CANDLE_NUM_THREADS") {
        cfg.quantized_threads = Some(v.parse().expect("CANDLE_NUM_THREADS is a number"));
    }
    cfg
}
