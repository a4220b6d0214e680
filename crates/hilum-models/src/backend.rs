//! Which implementation runs a network: one enum for every model, part of the pool's key; the
//! per-model choice of the models' settings ([`BackendChoice`], `[models.backend]`), resolved
//! for every model by [`crate::ModelPool::backend_for`]; and the one holder every model keeps
//! its network in ([`Engine`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::architecture::Architecture;
use crate::{Device, InstalledModel, ModelError, ModelPool};

/// Which implementation runs a network (`--backend native|candle|onnx|kserve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Hilum's own CPU kernels (`hilum-kernels`): the default for the CNNs on the CPU, where
    /// they are as fast as ONNX Runtime and need no runtime library.
    Native,
    /// candle tensors: the default on CUDA and Metal, and the only backend of the
    /// transformer models; on the CPU the (slow) reference path for the CNNs.
    Candle,
    /// ONNX Runtime (`ort`, loaded at run time), on a graph built from the same safetensors
    /// ([`crate::onnx_graph`]) or an imported `model.onnx`; CPU, or TensorRT/CUDA with the
    /// `onnx-gpu` feature.
    Onnx,
    /// A KServe v2 inference server (NVIDIA Triton, KServe, MLServer) runs the forward pass of
    /// the graph `hilum models export-triton` wrote; pre- and postprocessing stay here, so the
    /// output is the one the in-process backends give (see [`crate::kserve`]).
    Kserve,
}

impl Backend {
    /// Every backend, in the order `hilum` lists them.
    pub const ALL: [Backend; 4] = [
        Backend::Native,
        Backend::Candle,
        Backend::Onnx,
        Backend::Kserve,
    ];
    /// The backends that run the network in this process.
    pub const IN_PROCESS: [Backend; 3] = [Backend::Native, Backend::Candle, Backend::Onnx];

    /// Native on the CPU (measured as fast as ONNX Runtime there, with nothing to install),
    /// candle on GPUs; ONNX Runtime only when asked for.
    pub fn default_for(device: Device) -> Backend {
        if device.is_gpu() {
            Backend::Candle
        } else {
            Backend::Native
        }
    }

    /// The name used in settings and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::Candle => "candle",
            Backend::Onnx => "onnx",
            Backend::Kserve => "kserve",
        }
    }

    /// An error unless this backend is one of `supported` (for `what`, a model's name).
    pub fn expect(self, supported: &[Backend], what: &str) -> Result<(), ModelError> {
        if supported.contains(&self) {
            return Ok(());
        }
        let names: Vec<&str> = supported.iter().map(|b| b.name()).collect();
        Err(ModelError::Backend {
            what: what.to_string(),
            backend: self,
            supported: names.join(", "),
        })
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Backend {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "native" => Ok(Backend::Native),
            "candle" => Ok(Backend::Candle),
            "onnx" | "ort" | "onnxruntime" => Ok(Backend::Onnx),
            "kserve" | "triton" | "remote" => Ok(Backend::Kserve),
            other => Err(ModelError::Compute(format!(
                "unknown backend `{other}`: use native, candle, onnx or kserve"
            ))),
        }
    }
}

/// Backends chosen per model id (`[models.backend]`, `--backend MODEL=BACKEND`,
/// `HILUM_BACKEND`); `*` stands for every model whose architecture runs on that backend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendChoice(BTreeMap<String, Backend>);

impl BackendChoice {
    /// `BACKEND` (every model) or `MODEL=BACKEND` pairs, comma-separated
    /// (`lung-unet=kserve,densenet121-res224-all=onnx`). Model ids are not checked here: the
    /// program checks them against its registry ([`BackendChoice::unknown_models`]).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let mut out = BTreeMap::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (model, name) = part.split_once('=').unwrap_or(("*", part));
            let backend = name.parse::<Backend>().map_err(|e| e.to_string())?;
            out.insert(model.trim().to_string(), backend);
        }
        Ok(BackendChoice(out))
    }

    /// `backend` for every model that runs on it.
    pub fn every(backend: Backend) -> Self {
        BackendChoice([("*".to_string(), backend)].into_iter().collect())
    }

    /// Chooses `backend` for `id` (`*`: every model).
    pub fn set(&mut self, id: &str, backend: Backend) {
        self.0.insert(id.to_string(), backend);
    }

    /// The backend chosen for `id` itself.
    pub fn get(&self, id: &str) -> Option<Backend> {
        self.0.get(id).copied()
    }

    /// The backend chosen for every model (`*`).
    pub fn every_model(&self) -> Option<Backend> {
        self.get("*")
    }

    /// Whether no model has a backend chosen.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every choice: model id (`*`: every model) and backend.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Backend)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// This choice over `base`: its entries win, `base` fills in the rest.
    pub fn over(&self, base: &BackendChoice) -> BackendChoice {
        let mut out = base.0.clone();
        out.extend(self.0.iter().map(|(k, v)| (k.clone(), *v)));
        BackendChoice(out)
    }

    /// The ids named that are not in `known` (`*` is always known).
    pub fn unknown_models<'a>(&'a self, known: &[&str]) -> Vec<&'a str> {
        self.0
            .keys()
            .map(String::as_str)
            .filter(|k| *k != "*" && !known.contains(k))
            .collect()
    }

    /// The backend of model `id` of architecture `arch`: the one chosen for it, else the one
    /// chosen for every model when `arch` runs on it, else the architecture's default.
    pub fn resolve(
        &self,
        id: &str,
        arch: &dyn Architecture,
        installed: &InstalledModel,
        device: Device,
    ) -> Backend {
        if let Some(b) = self.get(id) {
            return b;
        }
        match self.every_model() {
            Some(b) if arch.supports(b, installed) => b,
            _ => arch.default_backend(installed, device),
        }
    }
}

impl From<BTreeMap<String, Backend>> for BackendChoice {
    fn from(map: BTreeMap<String, Backend>) -> Self {
        BackendChoice(map)
    }
}

impl ModelPool {
    /// The backend model `id` runs on when its copy is made on `device`: `over` (a command's
    /// flags, a tool's own need) first, then the settings' [`BackendChoice`], then the
    /// architecture's default. A setting that did not parse is this call's error.
    pub fn backend_for(
        &self,
        id: &str,
        installed: &InstalledModel,
        device: Device,
        over: &BackendChoice,
    ) -> Result<Backend, ModelError> {
        let settings = self
            .settings()
            .backends
            .as_ref()
            .map_err(|e| ModelError::BadSetting(e.clone()))?;
        let manifest = self.registry().manifest(id)?;
        let arch = self.registry().architectures().of(manifest)?;
        Ok(over.over(settings).resolve(id, arch, installed, device))
    }
}

/// The one holder of a network on its backend: Hilum's native CPU plan `N`, the candle model
/// `C` on its device, a graph on ONNX Runtime, or a KServe v2 server's model. Each model keeps
/// its network in one of these instead of an enum of its own, so every model reports its
/// backend, runs its graph and checks the graph's output the same way.
pub enum Engine<N, C> {
    /// Hilum's native CPU plan.
    Native(N),
    /// A candle model and the device its weights live on.
    Candle(C, candle_core::Device),
    /// A graph in an ONNX Runtime session.
    #[cfg(feature = "onnx")]
    Onnx(crate::onnx::OnnxModel),
    /// A model served by a KServe v2 inference server.
    Kserve(crate::kserve::KserveModel),
}

impl<N, C> std::fmt::Debug for Engine<N, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Engine({})", self.backend())
    }
}

impl<N, C> Engine<N, C> {
    /// The backend this engine runs on.
    pub fn backend(&self) -> Backend {
        match self {
            Engine::Native(_) => Backend::Native,
            Engine::Candle(..) => Backend::Candle,
            #[cfg(feature = "onnx")]
            Engine::Onnx(_) => Backend::Onnx,
            Engine::Kserve(_) => Backend::Kserve,
        }
    }

    /// The graph's output `(shape, values)` for `input` of `shape`, on ONNX Runtime or the
    /// server; an error for the in-process networks (the caller runs `N` or `C` itself).
    pub fn run_graph(
        &self,
        shape: &[usize],
        input: &[f32],
    ) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        match self {
            #[cfg(feature = "onnx")]
            Engine::Onnx(g) => g.run(shape, input),
            Engine::Kserve(m) => m.infer(shape, input),
            _ => Err(ModelError::Compute(format!(
                "the {} backend runs no graph",
                self.backend()
            ))),
        }
    }

    /// The network on ONNX Runtime from a serialised graph (`what` names it in errors), with
    /// `threads` intra-op threads on `device`.
    #[cfg_attr(not(feature = "onnx"), allow(unused_variables))]
    pub fn onnx(
        graph: &[u8],
        what: &str,
        threads: usize,
        device: Device,
    ) -> Result<Self, ModelError> {
        #[cfg(feature = "onnx")]
        {
            Ok(Engine::Onnx(crate::onnx::OnnxModel::from_memory(
                graph, what, threads, device,
            )?))
        }
        #[cfg(not(feature = "onnx"))]
        Err(ModelError::Onnx(
            "this hilum was built without the `onnx` feature; rebuild with the default features \
             or use --backend native"
                .into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn installed(onnx: bool) -> InstalledModel {
        InstalledModel {
            weights: "model.safetensors".into(),
            onnx: onnx.then(|| "model.onnx".into()),
            record: crate::InstallRecord {
                id: "lung-unet".into(),
                sha256: String::new(),
                source_sha256: String::new(),
                source: "test".into(),
                custom: false,
                installed_at: 0,
                hilum_version: "test".into(),
                onnx_sha256: None,
            },
            size: 0,
        }
    }

    #[test]
    fn every_model_choice_skips_models_it_cannot_run() {
        let unet = crate::unet::LungUnetArch;
        let report = crate::report::ReportArch;
        let onnx = BackendChoice::every(Backend::Onnx);
        // The U-Net runs on ONNX Runtime only with its imported graph.
        let with = onnx.resolve("lung-unet", &unet, &installed(true), Device::Cpu);
        assert_eq!(with, Backend::Onnx);
        let without = onnx.resolve("lung-unet", &unet, &installed(false), Device::Cpu);
        assert_eq!(
            without,
            crate::unet::auto_backend(&installed(false), Device::Cpu)
        );
        // A candle-only model stays on candle; naming it is the caller's explicit choice.
        let kserve = BackendChoice::every(Backend::Kserve);
        let r = kserve.resolve(
            "chexpert-report-findings",
            &report,
            &installed(false),
            Device::Cpu,
        );
        assert_eq!(r, Backend::Candle);
        let named = BackendChoice::parse("chexpert-report-findings=onnx").expect("parses");
        let r = named.resolve(
            "chexpert-report-findings",
            &report,
            &installed(false),
            Device::Cpu,
        );
        assert_eq!(r, Backend::Onnx);
    }

    #[test]
    fn a_bad_setting_is_every_model_calls_error() {
        let settings = crate::ModelSettings::from_vars(|k| {
            (k == "HILUM_BACKEND").then(|| "lung-unet=tensorflow".to_string())
        });
        let err = settings.backends.clone().expect_err("does not parse");
        assert!(err.starts_with("HILUM_BACKEND:"), "{err}");
        let dir = tempfile::tempdir().expect("tempdir");
        let registry = crate::ModelRegistry::new(dir.path()).expect("registry");
        let pool = ModelPool::with_settings(std::sync::Arc::new(registry), settings);
        let e = pool.backend_for(
            "lung-unet",
            &installed(false),
            Device::Cpu,
            &BackendChoice::default(),
        );
        assert!(matches!(e, Err(ModelError::BadSetting(_))), "{e:?}");
        let one = crate::ModelSettings::from_vars(|k| {
            (k == "HILUM_LUNG_UNET_BACKEND").then(|| "kserve".to_string())
        });
        assert_eq!(one.backend_of("lung-unet"), Some(Backend::Kserve));
    }

    #[test]
    fn choices_layer_and_every_model_applies_where_it_runs() {
        let base = BackendChoice::parse("kserve,lung-unet=onnx").expect("parses");
        let flags = BackendChoice::parse("lung-unet=native").expect("parses");
        let both = flags.over(&base);
        assert_eq!(both.get("lung-unet"), Some(Backend::Native));
        assert_eq!(both.every_model(), Some(Backend::Kserve));
        assert!(BackendChoice::parse("lung-unet=gpu").is_err());
        assert_eq!(both.unknown_models(&["lung-unet"]), Vec::<&str>::new());
        assert_eq!(
            BackendChoice::parse("nope=candle")
                .expect("parses")
                .unknown_models(&["lung-unet"]),
            vec!["nope"]
        );
    }

    #[test]
    fn parses_names_and_aliases_and_rejects_others() {
        for b in Backend::ALL {
            assert_eq!(b.name().parse::<Backend>().ok(), Some(b));
        }
        assert_eq!(" ORT ".parse::<Backend>().ok(), Some(Backend::Onnx));
        assert_eq!("Triton".parse::<Backend>().ok(), Some(Backend::Kserve));
        assert!("tensorflow".parse::<Backend>().is_err());
    }

    #[test]
    fn unsupported_backend_names_the_supported_ones() {
        let err = Backend::Onnx
            .expect(&[Backend::Native, Backend::Candle], "chestx-det-pspnet")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("native, candle"), "{err}");
        assert!(Backend::Candle.expect(&[Backend::Candle], "sam").is_ok());
    }
}
