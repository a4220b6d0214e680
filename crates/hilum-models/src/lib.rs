//! Hilum's neural networks and the machinery to run them: devices, the model registry
//! (manifests in `models/`, weights under a models directory), a pool that loads models lazily
//! and keeps them warm, and fetch/import/verify of weights. On the CPU the CNNs run on
//! `hilum-kernels`, built from weights that [`native`] reads from the checkpoints.
//!
//! The crate reads no environment variables: its settings are one [`ModelSettings`] value the
//! program builds and passes to the pool (see the `settings` module for what is process-wide).

pub mod architecture;
mod backend;
pub mod batch;
pub mod checkpoint;
pub mod densenet;
pub mod devcheck;
mod device;
mod fault;
mod fetch;
mod import;
pub mod kserve;
pub mod llava;
mod manifest;
pub mod native;
#[cfg(feature = "onnx")]
pub mod onnx;
pub mod onnx_graph;
mod pool;
pub mod pspnet;
mod registry;
pub mod report;
pub mod resnet;
pub mod runner;
pub mod sam;
mod settings;
pub mod triton;
pub mod unet;
pub mod weights;
pub mod xrv;

pub use architecture::{Architecture, Architectures};
pub use backend::{Backend, BackendChoice, Engine};
pub use batch::{BatchOutput, BatchSettings, Batched};
pub use device::{Device, DeviceSet};
pub use fetch::{fetch, FetchOptions, FetchProgress, HfToken, NoProgress, DEFAULT_HUB_ENDPOINT};
/// The CPU engines the CNNs run on (their settings are part of the models' settings).
pub use hilum_kernels as kernels;
pub use import::{import, import_with_progress, ImportOptions, ImportProgress};
pub use kserve::KserveSettings;
pub use manifest::{InstallRecord, InstalledModel, Manifest, Source};
pub use pool::{is_device_failure, DeviceStats, Lease, Model, ModelPool, Placed};
pub use registry::{ModelRegistry, ModelStatus, VerifyReport};
pub use settings::{ModelSettings, DEFAULT_DEVICE_COOLDOWN};

use thiserror::Error;

#[derive(Clone, Debug, Error)]
pub enum ModelError {
    #[error("unknown device `{0}`: use cpu, cuda, cuda:N or metal")]
    BadDevice(String),
    #[error("bad device list `{list}`: {reason}; use --device auto, cpu, cuda:N or a list such as cuda:0,cuda:1")]
    BadDeviceList { list: String, reason: String },
    #[error("cannot use device {device}: {reason}")]
    Device { device: String, reason: String },
    #[error("unknown model `{id}`; known models: {known} (see `hilum models list`)")]
    UnknownModel { id: String, known: String },
    #[error(
        "model `{id}` is not installed in {dir}: run `hilum models fetch {id}`, or on a machine \
         without internet `hilum models import {id} PATH` (set HILUM_MODELS_DIR to use another directory)"
    )]
    NotInstalled { id: String, dir: String },
    #[error("the installed weights of `{id}` are unusable ({reason}); reinstall them with `hilum models fetch {id}` or `hilum models import {id} PATH`")]
    Corrupt { id: String, reason: String },
    #[error("{what} does not fit architecture `{architecture}`: {details}")]
    WeightsMismatch {
        what: String,
        architecture: String,
        details: String,
    },
    #[error("sha256 of {what} is {actual}, expected {expected}: {hint}")]
    Checksum {
        what: String,
        expected: String,
        actual: String,
        hint: String,
    },
    #[error("bad manifest for `{id}`: {reason}")]
    Manifest { id: String, reason: String },
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("cannot convert {what}: {reason}")]
    Convert { what: String, reason: String },
    #[error("no download source is known for `{id}`{detail}: copy the weights here another way and run `hilum models import {id} PATH`")]
    NoDownload { id: String, detail: String },
    #[error("download of {url} failed: {reason}")]
    Fetch { url: String, reason: String },
    #[error("model computation failed: {0}")]
    Compute(String),
    #[error("ONNX Runtime: {0}")]
    Onnx(String),
    /// The inference server of the kserve backend does not answer (down, unreachable, timing
    /// out, or failing with 5xx after the retries): the one remote failure worth a fallback.
    #[error(
        "the KServe v2 inference server at {url} is not answering ({reason}): start it (Triton: \
         `tritonserver --model-repository DIR` on the repository `hilum models export-triton DIR` \
         wrote), fix the URL ([remote] url in the config file or HILUM_KSERVE_URL), set \
         [remote] fallback = \"native\" (HILUM_KSERVE_FALLBACK=native) to run in process while it \
         is down, or use --backend native"
    )]
    RemoteDown { url: String, reason: String },
    #[error(
        "the kserve backend has no inference server configured: set [remote] url = \
         \"http://HOST:8000\" in the config file or HILUM_KSERVE_URL"
    )]
    NoRemote,
    /// The inference server answers but not as Hilum needs (no such model, other tensors, a
    /// malformed reply).
    #[error("the KServe v2 inference server at {url}: {reason}")]
    Remote { url: String, reason: String },
    /// A backend setting (`[models.backend]`, `HILUM_BACKEND`) that did not parse: every model
    /// call reports it, nothing runs on a guess.
    #[error("bad backend setting: {0}")]
    BadSetting(String),
    #[error("{what} does not run on the {backend} backend: use {supported}")]
    Backend {
        what: String,
        backend: Backend,
        supported: String,
    },
}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Compute(e.to_string())
    }
}

impl ModelError {
    pub(crate) fn io(path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        ModelError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    }
}

/// Lowercase hex sha256 of a file, streamed.
pub fn sha256_file(path: &std::path::Path) -> Result<String, ModelError> {
    sha256_file_with(path, &mut |_| {})
}

/// [`sha256_file`], telling `read` how many bytes each chunk held (for a progress bar).
pub(crate) fn sha256_file_with(
    path: &std::path::Path,
    read: &mut dyn FnMut(u64),
) -> Result<String, ModelError> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| ModelError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        read(n as u64);
    }
    Ok(hex(&h.finalize()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
