//! The chest X-ray tools of Hilum. Each tool is one file: a [`hilum_agent::TypedTool`] (name,
//! description written for a model, typed arguments whose JSON Schema is generated, declared
//! requirements) and one async function. [`default_toolbox`] registers them all.

mod classify;
mod common;
mod dicom_info;
pub mod ground;
mod image_info;
pub mod localize;
pub mod measure;
pub mod report;
pub mod segment_anatomy;
mod segment_lungs;
pub mod segment_region;
pub mod remote;
pub mod topics;
mod visualize;
pub mod vlm;
pub mod vlm_local;
pub mod vqa;

use std::collections::BTreeMap;
use std::sync::Arc;

use hilum_agent::{Environment, Requirements, Tool, Toolbox};
use hilum_imaging::ImageStore;
pub use hilum_models::{ModelPool, ModelSettings};

pub use classify::{parse_backends, ClassifyChestXray};
pub use common::{image_arg, ImageId};
pub use dicom_info::DicomInfo;
pub use ground::GroundPhrase;
pub use image_info::ImageInfo;
pub use localize::LocalizeFinding;
pub use measure::MeasureChest;
pub use report::GenerateReport;
pub use segment_anatomy::SegmentAnatomy;
pub use segment_lungs::SegmentLungs;
pub use segment_region::SegmentRegion;
pub use visualize::Visualize;
pub use vlm::VlmSettings;
pub use vqa::AnswerVisualQuestion;

/// Everything the tools share: the image store, the model pool and their settings.
#[derive(Clone)]
pub struct ToolDeps {
    pub images: Arc<ImageStore>,
    pub models: Arc<ModelPool>,
    /// Served VLM endpoints (`[vlm]` table, `HILUM_VLM_*`).
    pub vlm: Arc<VlmSettings>,
    pub settings: ToolSettings,
}

/// Backend choices of the model tools, filled by the program (the CLI reads
/// `HILUM_BACKEND`, `HILUM_LUNG_UNET_BACKEND`, `--backend` and the config file).
#[derive(Clone, Debug)]
pub struct ToolSettings {
    /// `segment_lungs`' U-Net backend; `None`: chosen per machine (`unet::auto_backend`).
    /// `kserve` sends it to the inference server of the pool's settings.
    pub lung_unet_backend: Option<hilum_models::Backend>,
    /// `classify_chest_xray`'s backend per model id (`*`: every model); empty: the device's
    /// default. An `Err` is a setting that did not parse: each classifier call reports it and
    /// the other tools keep working.
    pub classifier_backends: Result<BTreeMap<String, hilum_models::Backend>, String>,
    /// Where `segment_region` runs MedSAM's image encoder; `None`: `sam::auto_backend` (ONNX
    /// Runtime on the CPU where it loads, else candle). `onnx` and `kserve` run the graph
    /// `Sam::encoder_onnx` writes; the decoder stays in candle.
    pub medsam_backend: Option<hilum_models::Backend>,
}

impl ToolSettings {
    /// `kserve` for every classifier: the lung U-Net and MedSAM's image encoder go to the
    /// inference server too, unless their backends were chosen on their own — a served
    /// deployment serves every network it exported.
    pub fn serve_every_network(&mut self) {
        let kserve = hilum_models::Backend::Kserve;
        self.lung_unet_backend.get_or_insert(kserve);
        self.medsam_backend.get_or_insert(kserve);
    }
}

impl Default for ToolSettings {
    fn default() -> Self {
        ToolSettings {
            lung_unet_backend: None,
            classifier_backends: Ok(BTreeMap::new()),
            medsam_backend: None,
        }
    }
}

impl ToolDeps {
    /// The tools over `images` and the process's model pool (built by the program from its
    /// settings, e.g. `ModelPool::from_settings`). No VLM is configured; see
    /// [`ToolDeps::with_vlm`].
    pub fn new(images: Arc<ImageStore>, models: Arc<ModelPool>) -> Self {
        ToolDeps {
            images,
            models,
            vlm: Arc::new(VlmSettings::default()),
            settings: ToolSettings::default(),
        }
    }

    /// Classifier backends per model id (`*`: every model), replacing the settings' ones.
    /// `*` = kserve serves the other networks too ([`ToolSettings::serve_every_network`]).
    pub fn with_backends(mut self, backends: BTreeMap<String, hilum_models::Backend>) -> Self {
        if backends.get("*") == Some(&hilum_models::Backend::Kserve) {
            self.settings.serve_every_network();
        }
        self.settings.classifier_backends = Ok(backends);
        self
    }

    pub fn with_settings(mut self, settings: ToolSettings) -> Self {
        self.settings = settings;
        self
    }

    pub fn with_models(mut self, models: Arc<ModelPool>) -> Self {
        self.models = models;
        self
    }

    pub fn with_vlm(mut self, vlm: Arc<VlmSettings>) -> Self {
        self.vlm = vlm;
        self
    }
}

/// How a tool is made from the shared dependencies. Each tool file implements it, next to the
/// tool; registering the tool is then one line in [`Registry::builtin`] (or in a program's own
/// registry, see `hilum_cli::main_with`).
pub trait BuildTool {
    fn build(deps: &ToolDeps) -> Arc<dyn Tool>;
}

/// Makes one tool over the shared dependencies ([`BuildTool::build`]).
type Builder = fn(&ToolDeps) -> Arc<dyn Tool>;

/// The tools a program offers, in the order a model should consider them.
#[derive(Clone, Default)]
pub struct Registry {
    builders: Vec<Builder>,
}

impl Registry {
    /// No tools.
    pub fn empty() -> Self {
        Registry::default()
    }

    /// All Hilum tools.
    pub fn builtin() -> Self {
        Registry::empty()
            .with::<ImageInfo>()
            .with::<DicomInfo>()
            .with::<ClassifyChestXray>()
            .with::<SegmentLungs>()
            .with::<SegmentAnatomy>()
            .with::<SegmentRegion>()
            .with::<MeasureChest>()
            .with::<LocalizeFinding>()
            .with::<GroundPhrase>()
            .with::<AnswerVisualQuestion>()
            .with::<GenerateReport>()
            .with::<Visualize>()
    }

    /// Adds a tool (a tool of the same name registered earlier is replaced).
    pub fn with<T: BuildTool>(mut self) -> Self {
        self.builders.push(T::build);
        self
    }

    /// Builds every registered tool over `deps`.
    pub fn toolbox(&self, deps: &ToolDeps) -> Result<Toolbox, String> {
        let mut tb = Toolbox::new();
        tb.set_vocabulary(topics::vocabulary());
        for build in &self.builders {
            tb.register(build(deps))?;
        }
        Ok(tb)
    }
}

/// All Hilum tools ([`Registry::builtin`]) over `deps`.
pub fn default_toolbox(deps: &ToolDeps) -> Result<Toolbox, String> {
    Registry::builtin().toolbox(deps)
}

/// The facts [`hilum_agent::Requirements`] are checked against: which models are installed,
/// whether a VLM is configured, whether a DICOM image is among `inputs`.
pub fn environment(deps: &ToolDeps, inputs: &[String]) -> Environment {
    let mut env = Environment::default();
    let registry = deps.models.registry();
    for manifest in registry.manifests() {
        if registry.installed(&manifest.id).is_ok() {
            env = env.with(Requirements::model_fact(&manifest.id), "installed");
        } else {
            let fix = if manifest.source.download_url().is_some() {
                format!("hilum models fetch {}", manifest.id)
            } else {
                format!("hilum models import {} PATH", manifest.id)
            };
            env = env.with(Requirements::install_fact(&manifest.id), fix);
        }
    }
    let vlm = [ground::NAME, vqa::NAME]
        .iter()
        .any(|tool| matches!(deps.vlm.backend(tool), Ok(Some(_))));
    if vlm {
        env = env.with(Requirements::VLM_FACT, "configured");
    }
    let dicom = inputs
        .iter()
        .filter_map(|id| deps.images.get(id).ok())
        .any(|img| img.meta.format == "dicom");
    if dicom {
        env = env.with(Requirements::DICOM_FACT, "yes");
    }
    env
}
