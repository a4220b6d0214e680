//! Hilum's neural networks and the machinery to run them: devices, the model registry
//! (manifests in `models/`, weights under a models directory), a pool that loads models lazily
//! and keeps them warm, and fetch/import/verify of weights. On the CPU the CNNs run on
//! `hilum-kernels`, built from weights that [`native`] reads from the checkpoints.
//!
//! The crate reads no environment variables: its settings are one [`ModelSettings`] value the
//! program builds and passes to the pool (see the `settings` module for what is process-wide).

#![warn(missing_docs)]

pub mod architecture;
mod backend;
pub mod batch;
mod bn_fold;
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

/// Everything that can go wrong finding, installing, loading or running a model; each message
/// says what to do next.
#[derive(Clone, Debug, Error)]
pub enum ModelError {
    /// A device name that is none of cpu, cuda, cuda:N or metal.
    #[error("unknown device `{0}`: use cpu, cuda, cuda:N or metal")]
    BadDevice(String),
    /// A device list (`--device`) that did not parse.
    #[error("bad device list `{list}`: {reason}; use --device auto, cpu, cuda:N or a list such as cuda:0,cuda:1")]
    BadDeviceList {
        /// The list as given.
        list: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A device that exists by name but cannot be opened or used (not compiled in, no driver).
    #[error("cannot use device {device}: {reason}")]
    Device {
        /// The device's name.
        device: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A model id that no manifest names.
    #[error("unknown model `{id}`; known models: {known} (see `hilum models list`)")]
    UnknownModel {
        /// The id asked for.
        id: String,
        /// The known ids, comma-separated.
        known: String,
    },
    /// A known model whose weights are not in the models directory.
    #[error(
        "model `{id}` is not installed in {dir}: run `hilum models fetch {id}`, or on a machine \
         without internet `hilum models import {id} PATH` (set HILUM_MODELS_DIR to use another directory)"
    )]
    NotInstalled {
        /// The model's id.
        id: String,
        /// The models directory looked in.
        dir: String,
    },
    /// Installed weights that cannot be read or do not match their install record.
    #[error("the installed weights of `{id}` are unusable ({reason}); reinstall them with `hilum models fetch {id}` or `hilum models import {id} PATH`")]
    Corrupt {
        /// The model's id.
        id: String,
        /// What is wrong with the weights.
        reason: String,
    },
    /// Weights whose tensors (names, shapes) do not fit the architecture they are loaded into.
    #[error("{what} does not fit architecture `{architecture}`: {details}")]
    WeightsMismatch {
        /// The weights (a file or model id).
        what: String,
        /// The architecture they were loaded into.
        architecture: String,
        /// Which tensors are missing or misshapen.
        details: String,
    },
    /// A file whose sha256 differs from the one the manifest or install record expects.
    #[error("sha256 of {what} is {actual}, expected {expected}: {hint}")]
    Checksum {
        /// The file checked.
        what: String,
        /// The expected lowercase hex digest.
        expected: String,
        /// The digest the file has.
        actual: String,
        /// What to do about it.
        hint: String,
    },
    /// A model manifest that does not parse or contradicts itself.
    #[error("bad manifest for `{id}`: {reason}")]
    Manifest {
        /// The model's id.
        id: String,
        /// What is wrong with the manifest.
        reason: String,
    },
    /// A file or directory that could not be read or written.
    #[error("{path}: {reason}")]
    Io {
        /// The path involved.
        path: String,
        /// The operating system's error.
        reason: String,
    },
    /// A checkpoint that could not be converted to the installed format.
    #[error("cannot convert {what}: {reason}")]
    Convert {
        /// The checkpoint converted.
        what: String,
        /// Why it failed.
        reason: String,
    },
    /// A model with no download source: it can only be imported.
    #[error("no download source is known for `{id}`{detail}: copy the weights here another way and run `hilum models import {id} PATH`")]
    NoDownload {
        /// The model's id.
        id: String,
        /// More on why, with its leading separator (may be empty).
        detail: String,
    },
    /// A download that failed (network, HTTP status, interrupted transfer).
    #[error("download of {url} failed: {reason}")]
    Fetch {
        /// The URL downloaded.
        url: String,
        /// Why it failed.
        reason: String,
    },
    /// A failure while running a model (a tensor operation, a shape, the device).
    #[error("model computation failed: {0}")]
    Compute(String),
    /// An error reported by ONNX Runtime.
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
    RemoteDown {
        /// The server's base URL.
        url: String,
        /// The last failure seen.
        reason: String,
    },
    /// The kserve backend was chosen but no server URL is configured.
    #[error(
        "the kserve backend has no inference server configured: set [remote] url = \
         \"http://HOST:8000\" in the config file or HILUM_KSERVE_URL"
    )]
    NoRemote,
    /// The inference server answers but not as Hilum needs (no such model, other tensors, a
    /// malformed reply).
    #[error("the KServe v2 inference server at {url}: {reason}")]
    Remote {
        /// The server's base URL.
        url: String,
        /// What was wrong with its answer.
        reason: String,
    },
    /// A backend setting (`[models.backend]`, `HILUM_BACKEND`) that did not parse: every model
    /// call reports it, nothing runs on a guess.
    #[error("bad backend setting: {0}")]
    BadSetting(String),
    /// A model or operation the chosen backend cannot run.
    #[error("{what} does not run on the {backend} backend: use {supported}")]
    Backend {
        /// The model or operation.
        what: String,
        /// The backend chosen.
        backend: Backend,
        /// The backends that do run it.
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
