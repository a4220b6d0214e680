//! The models' settings as one value. This crate reads no environment variables: the program
//! builds a [`ModelSettings`] and passes it to `ModelPool::from_settings`, which hands it to
//! every model it loads. [`ModelSettings::from_vars`] maps the documented variables
//! (`HILUM_MODELS_DIR`, `HILUM_CPU_*`, `ORT_DYLIB_PATH`, ...) onto it from a lookup the program
//! gives: Hilum's CLI (its config module), `hilum-mcp`, the benchmarks and examples then spell
//! them the same way, and the mapping is tested without touching the process's environment.
//!
//! Two parts are process-wide by nature and are applied once by
//! [`ModelSettings::apply_process_wide`] at start-up: the CPU kernels' tuning knobs (see
//! [`hilum_kernels::configure`]) and the ONNX Runtime library (ONNX Runtime allows one
//! environment per process).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use crate::registry::ModelRegistry;
use crate::Backend;
use crate::{BackendChoice, BatchSettings, Device, DeviceSet, KserveSettings};

/// How long a device that failed is passed over while another can take its calls.
pub const DEFAULT_DEVICE_COOLDOWN: Duration = Duration::from_secs(30);

/// Everything a model pool and its models may be told. `Default`: the user's data dir, the CPU
/// only, all cores, one forward pass per GPU, no ONNX Runtime, each manifest's own quantization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSettings {
    /// Where installed weights live.
    pub models_dir: PathBuf,
    /// The CPU kernels' settings; `cpu.threads` is given to each network as it loads.
    pub cpu: hilum_kernels::CpuSettings,
    /// Forward passes at once on the CPU; `None`: the number of cores.
    pub cpu_concurrency: Option<usize>,
    /// Forward passes at once per GPU; `None`: 1 (a GPU is never oversubscribed).
    pub gpu_concurrency: Option<usize>,
    /// The ONNX Runtime shared library (`libonnxruntime.so`); `None`: the ONNX Runtime backend
    /// is unavailable and says how to install it.
    pub ort_dylib: Option<PathBuf>,
    /// Quantization of a LLaVA's text decoder (`none`, `q8_0`, `q4k`) over its manifest's
    /// `[postprocessing] quantize`. Kept as text and parsed when a LLaVA loads, so a bad value
    /// fails that model only.
    pub llava_quantize: Option<String>,
    /// The KServe v2 inference server of the kserve backend; `None`: that backend says how to
    /// configure one.
    pub remote: Option<KserveSettings>,
    /// The devices the pool places models on and routes calls across (`--device`).
    pub devices: DeviceSet,
    /// Copies of one model at most, one per device; `None`: one on every device of `devices`.
    pub max_replicas: Option<usize>,
    /// How long a failed device is passed over (see [`DEFAULT_DEVICE_COOLDOWN`]).
    pub device_cooldown: Duration,
    /// Listed devices whose copies load on another device: calls are routed, counted and
    /// permitted per listed device, but each copy is made on its stand-in (`cuda:1` → `cpu`).
    /// For testing the routing on a machine without those GPUs; empty: each device is itself.
    pub stand_ins: BTreeMap<Device, Device>,
    /// Listed devices whose forward passes fail with a device error once the copy has loaded
    /// (the PSPNet's, SAM's and the lung U-Net's check): for testing, with `stand_ins`, that
    /// such a failure moves the call. Empty: none.
    pub forward_faults: BTreeSet<Device>,
    /// How concurrent calls of one model are gathered into one forward pass (see
    /// [`crate::batch`]); default: not at all.
    pub batch: BatchSettings,
    /// The backend of each model id (`*`: every model that runs on it); a model not named runs
    /// on its architecture's default. `Err`: a setting that did not parse, reported by every
    /// model call.
    pub backends: Result<BackendChoice, String>,
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            models_dir: ModelRegistry::default_dir(),
            cpu: hilum_kernels::CpuSettings::default(),
            cpu_concurrency: None,
            gpu_concurrency: None,
            ort_dylib: None,
            llava_quantize: None,
            remote: None,
            devices: DeviceSet::default(),
            max_replicas: None,
            device_cooldown: DEFAULT_DEVICE_COOLDOWN,
            stand_ins: BTreeMap::new(),
            forward_faults: BTreeSet::new(),
            batch: BatchSettings::default(),
            backends: Ok(BackendChoice::default()),
        }
    }
}

impl ModelSettings {
    /// The settings named by variables, looked up with `var` (empty values count as unset):
    /// `HILUM_MODELS_DIR`, the CPU kernels' variables (see
    /// [`CpuSettings::from_vars`](hilum_kernels::CpuSettings::from_vars)),
    /// `HILUM_CPU_CONCURRENCY`, `HILUM_GPU_CONCURRENCY`, `ORT_DYLIB_PATH`,
    /// `HILUM_LLAVA_QUANTIZE`, `HILUM_MAX_REPLICAS`, `HILUM_BATCH_MAX_SIZE` with
    /// `HILUM_BATCH_DELAY_MS` (dynamic batching, see [`crate::batch`]), the backends (`HILUM_BACKEND`:
    /// `MODEL=BACKEND` pairs or one backend for every model, see [`BackendChoice::parse`];
    /// `HILUM_LUNG_UNET_BACKEND` and `HILUM_MEDSAM_BACKEND` name one model's and win over it),
    /// and the kserve backend's `HILUM_KSERVE_URL`
    /// with `HILUM_KSERVE_TIMEOUT_SECS`, `HILUM_KSERVE_RETRIES` and `HILUM_KSERVE_FALLBACK` (an
    /// in-process backend; values that do not parse are left at their defaults). The device list
    /// is the program's to parse (a typo there must stop it, not fall back): Hilum's CLI takes
    /// `--device` / `HILUM_DEVICE`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |k: &str| var(k).filter(|v| !v.is_empty());
        let number = |k: &str| set(k).and_then(|v| v.parse::<usize>().ok());
        ModelSettings {
            models_dir: set("HILUM_MODELS_DIR")
                .map_or_else(ModelRegistry::default_dir, PathBuf::from),
            cpu: hilum_kernels::CpuSettings::from_vars(&var),
            cpu_concurrency: number("HILUM_CPU_CONCURRENCY"),
            gpu_concurrency: number("HILUM_GPU_CONCURRENCY"),
            ort_dylib: set("ORT_DYLIB_PATH").map(PathBuf::from),
            llava_quantize: set("HILUM_LLAVA_QUANTIZE"),
            remote: set("HILUM_KSERVE_URL").map(|url| {
                let mut r = KserveSettings::bounded(
                    url,
                    number("HILUM_KSERVE_TIMEOUT_SECS").map(|n| n as u64),
                    number("HILUM_KSERVE_RETRIES").map(|n| n as u64),
                );
                r.fallback = set("HILUM_KSERVE_FALLBACK")
                    .and_then(|b| b.parse().ok())
                    .filter(|b| *b != crate::Backend::Kserve);
                r
            }),
            max_replicas: number("HILUM_MAX_REPLICAS"),
            batch: batch_from_vars(&number),
            backends: backends_from_vars(&set),
            ..Default::default()
        }
    }

    /// The backend chosen for model `id` by these settings (not the architecture's default).
    pub fn backend_of(&self, id: &str) -> Option<Backend> {
        self.backends.as_ref().ok().and_then(|b| b.get(id))
    }

    /// Sets the process-wide parts: the CPU kernels' knobs and the ONNX Runtime library. Call
    /// it once, before the first model loads (ONNX Runtime's library cannot change once
    /// loaded).
    pub fn apply_process_wide(&self) {
        hilum_kernels::configure(&self.cpu);
        #[cfg(feature = "onnx")]
        if let Some(path) = &self.ort_dylib {
            crate::onnx::use_runtime(path.clone());
        }
    }

    /// How many forward passes may run at once on `device`: one per GPU unless told otherwise
    /// (a GPU is never oversubscribed), and on the CPU the number of cores.
    pub fn concurrency(&self, device: Device) -> usize {
        match device {
            Device::Cpu => self
                .cpu_concurrency
                .unwrap_or_else(hilum_kernels::all_cores),
            _ => self.gpu_concurrency.unwrap_or(1),
        }
        .max(1)
    }

    /// Where a copy routed to `device` is made: its stand-in, else itself.
    pub fn runs_on(&self, device: Device) -> Device {
        self.stand_ins.get(&device).copied().unwrap_or(device)
    }

    /// How many devices may hold one model at once: `max_replicas` within 1..=devices.
    pub fn replica_budget(&self) -> usize {
        self.max_replicas
            .unwrap_or(self.devices.len())
            .clamp(1, self.devices.len().max(1))
    }
}

/// `HILUM_BATCH_MAX_SIZE` (unset or 1: no batching) and `HILUM_BATCH_DELAY_MS`.
fn batch_from_vars(number: &dyn Fn(&str) -> Option<usize>) -> BatchSettings {
    let Some(size) = number("HILUM_BATCH_MAX_SIZE") else {
        return BatchSettings::default();
    };
    let delay = number("HILUM_BATCH_DELAY_MS").map(|ms| Duration::from_millis(ms as u64));
    BatchSettings::new(size, delay.unwrap_or(crate::batch::DEFAULT_BATCH_DELAY))
}

/// The backend variables: `HILUM_BACKEND`, then the one-model variables over it.
fn backends_from_vars(set: &dyn Fn(&str) -> Option<String>) -> Result<BackendChoice, String> {
    let mut choice = match set("HILUM_BACKEND") {
        Some(spec) => BackendChoice::parse(&spec).map_err(|e| format!("HILUM_BACKEND: {e}"))?,
        None => BackendChoice::default(),
    };
    for (var, id) in [
        ("HILUM_LUNG_UNET_BACKEND", "lung-unet"),
        ("HILUM_MEDSAM_BACKEND", "medsam-vit-b"),
    ] {
        if let Some(v) = set(var) {
            let b: Backend = v.parse().map_err(|e| format!("{var}: {e}"))?;
            choice.set(id, b);
        }
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrency_defaults_to_cores_and_one_per_gpu_and_is_never_zero() {
        let s = ModelSettings::default();
        assert_eq!(s.concurrency(Device::Cpu), hilum_kernels::all_cores());
        assert_eq!(s.concurrency(Device::Cuda(0)), 1);
        let zero = ModelSettings {
            cpu_concurrency: Some(0),
            gpu_concurrency: Some(3),
            ..Default::default()
        };
        assert_eq!(zero.concurrency(Device::Cpu), 1);
        assert_eq!(zero.concurrency(Device::Cuda(0)), 3);
    }

    #[test]
    fn variables_map_onto_settings_and_empty_ones_are_unset() {
        let vars = [
            ("HILUM_MODELS_DIR", "/srv/models"),
            ("HILUM_CPU_THREADS", "2"),
            ("HILUM_CPU_CONCURRENCY", "3"),
            ("HILUM_GPU_CONCURRENCY", "x"),
            ("ORT_DYLIB_PATH", ""),
            ("HILUM_LLAVA_QUANTIZE", "q4k"),
            ("HILUM_KSERVE_URL", "http://triton:8000"),
            ("HILUM_KSERVE_RETRIES", "4"),
            ("HILUM_KSERVE_FALLBACK", "native"),
            ("HILUM_MAX_REPLICAS", "2"),
            ("HILUM_BATCH_MAX_SIZE", "16"),
            ("HILUM_BATCH_DELAY_MS", "5"),
        ];
        let s = ModelSettings::from_vars(|k| {
            vars.iter()
                .find(|(name, _)| *name == k)
                .map(|(_, v)| v.to_string())
        });
        assert_eq!(s.models_dir, PathBuf::from("/srv/models"));
        assert_eq!(s.cpu.threads(), 2);
        assert_eq!(s.concurrency(Device::Cpu), 3);
        assert_eq!(s.concurrency(Device::Cuda(0)), 1);
        assert_eq!(s.ort_dylib, None);
        assert_eq!(s.llava_quantize.as_deref(), Some("q4k"));
        let remote = s.remote.clone().expect("HILUM_KSERVE_URL");
        assert_eq!(remote.url, "http://triton:8000");
        assert_eq!(remote.retries, 4);
        assert_eq!(remote.fallback, Some(crate::Backend::Native));
        assert_eq!(s.max_replicas, Some(2));
        assert_eq!(s.batch, BatchSettings::new(16, Duration::from_millis(5)));
        assert!(s.batch.enabled() && !ModelSettings::default().batch.enabled());
        // One device: one copy, whatever the budget says.
        assert_eq!(s.replica_budget(), 1);
        assert_eq!(ModelSettings::from_vars(|_| None), ModelSettings::default());
    }
}
