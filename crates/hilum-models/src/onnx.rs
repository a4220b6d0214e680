//! The ONNX Runtime backend (`ort` with `load-dynamic`): the runtime library is loaded at run
//! time from the path the program gives [`use_runtime`] (Hilum's CLI: `ORT_DYLIB_PATH`;
//! scripts/setup_onnxruntime.sh installs the PyPI `onnxruntime` wheel and prints the path), so
//! builds never download binaries.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::session::builder::SessionBuilder;
use ort::session::Session;
use ort::value::TensorRef;

use crate::{Device, ModelError};

/// The library given to [`use_runtime`]: one per process, like the environment it loads.
static RUNTIME: OnceLock<PathBuf> = OnceLock::new();

/// Loads ONNX Runtime from `path` when the backend is first used. Process-wide, as ONNX
/// Runtime allows one environment per process: the first call wins; returns whether this one
/// did.
pub fn use_runtime(path: PathBuf) -> bool {
    RUNTIME.set(path).is_ok()
}

/// The process-wide ONNX Runtime environment (ONNX Runtime allows one per process).
fn environment() -> Result<&'static ort::environment::Environment, ModelError> {
    static ENV: OnceLock<Result<ort::environment::Environment, String>> = OnceLock::new();
    // Not cached while no library is configured: `use_runtime` may still come.
    if ENV.get().is_none() && dylib_path().is_none() {
        return Err(ModelError::Onnx(
            "no ONNX Runtime library is configured (ORT_DYLIB_PATH is not set): run \
             scripts/setup_onnxruntime.sh and export the ORT_DYLIB_PATH it prints (the \
             libonnxruntime.so of onnxruntime 1.31.1)"
                .to_string(),
        ));
    }
    ENV.get_or_init(|| {
        let path = dylib_path().ok_or("no ONNX Runtime library is configured")?;
        ort::init_from(&path)
            .map_err(|e| format!("cannot load {}: {e}", path.display()))?
            .with_name("hilum")
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| ModelError::Onnx(e.clone()))
}

/// The library given to [`use_runtime`], if any (empty paths count as none).
pub fn dylib_path() -> Option<PathBuf> {
    RUNTIME.get().filter(|p| !p.as_os_str().is_empty()).cloned()
}

/// Whether ONNX Runtime can be used in this process (for `available()` checks and tests).
pub fn available() -> bool {
    environment().is_ok()
}

/// One ONNX graph, ready to run. `ort` sessions need `&mut` to run: calls are serialised.
pub struct OnnxModel {
    session: Mutex<Session>,
    input: String,
    output: String,
}

impl OnnxModel {
    /// Loads `path` on the CPU execution provider with `threads` intra-op threads (0 = ONNX
    /// Runtime's default).
    pub fn load(path: &Path, threads: usize) -> Result<Self, ModelError> {
        if !path.is_file() {
            return Err(ModelError::io(path, "no such file"));
        }
        Self::commit(&path.display().to_string(), threads, Device::Cpu, |b| {
            b.commit_from_file(path)
        })
    }

    /// Loads a serialised graph (e.g. from [`crate::onnx_graph`]) for `device`: the CPU
    /// execution provider, or on `cuda:N` TensorRT then CUDA (with the CPU for what they do not
    /// run). `what` names the graph in errors.
    pub fn from_memory(
        bytes: &[u8],
        what: &str,
        threads: usize,
        device: Device,
    ) -> Result<Self, ModelError> {
        Self::commit(what, threads, device, |b| b.commit_from_memory(bytes))
    }

    fn commit(
        what: &str,
        threads: usize,
        device: Device,
        commit: impl FnOnce(&mut SessionBuilder) -> ort::Result<Session>,
    ) -> Result<Self, ModelError> {
        let env = environment()?;
        let onnx = |e: ort::Error| ModelError::Onnx(format!("{what}: {e}"));
        let mut builder = Session::builder(env).map_err(onnx)?;
        if threads > 0 {
            builder = builder
                .with_intra_threads(threads)
                .map_err(|e| ModelError::Onnx(e.to_string()))?;
        }
        builder = with_providers(builder, device)?;
        let session = commit(&mut builder).map_err(onnx)?;
        let name_of = |outlets: &[ort::value::Outlet], kind: &str| {
            outlets
                .first()
                .map(|o| o.name().to_string())
                .ok_or_else(|| ModelError::Onnx(format!("{what}: graph has no {kind}")))
        };
        let input = name_of(session.inputs(), "input")?;
        let output = name_of(session.outputs(), "output")?;
        Ok(OnnxModel {
            session: Mutex::new(session),
            input,
            output,
        })
    }

    /// Runs the graph on one f32 tensor; returns the first output's shape and values.
    pub fn run(&self, shape: &[usize], data: &[f32]) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let err = |e: ort::Error| ModelError::Onnx(e.to_string());
        let tensor = TensorRef::from_array_view((shape.to_vec(), data)).map_err(err)?;
        let mut session = self.session.lock().unwrap_or_else(|p| p.into_inner());
        let outputs = session
            .run(ort::inputs![self.input.as_str() => tensor])
            .map_err(err)?;
        let value = outputs
            .get(&self.output)
            .ok_or_else(|| ModelError::Onnx(format!("no output `{}`", self.output)))?;
        let (out_shape, values) = value.try_extract_tensor::<f32>().map_err(err)?;
        let out_shape = out_shape.iter().map(|&d| d.max(0) as usize).collect();
        Ok((out_shape, values.to_vec()))
    }
}

/// The execution providers for `device`. On a GPU they need a build with the `onnx-gpu` feature
/// and the `onnxruntime-gpu` wheel's library in `ORT_DYLIB_PATH`.
fn with_providers(builder: SessionBuilder, device: Device) -> Result<SessionBuilder, ModelError> {
    match device {
        Device::Cpu => Ok(builder),
        #[cfg(feature = "onnx-gpu")]
        Device::Cuda(n) => {
            use ort::ep::{TensorRT, CUDA};
            let id = i32::try_from(n).map_err(|_| ModelError::BadDevice(device.to_string()))?;
            builder
                .with_execution_providers([
                    TensorRT::default().with_device_id(id).build(),
                    CUDA::default().with_device_id(id).build(),
                ])
                .map_err(|e| ModelError::Onnx(e.to_string()))
        }
        other => Err(ModelError::Device {
            device: other.to_string(),
            reason: "ONNX Runtime runs here on the CPU only: on CUDA it needs Hilum built with \
                     `--features onnx-gpu` and ORT_DYLIB_PATH pointing at the onnxruntime-gpu \
                     wheel's libonnxruntime.so; or use the candle backend"
                .into(),
        }),
    }
}
