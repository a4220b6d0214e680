//! The chest X-ray tools of Hilum. Each tool is one file: a [`hilum_agent::TypedTool`] (name,
//! description written for a model, typed arguments whose JSON Schema is generated, declared
//! requirements) and one async function. [`default_toolbox`] registers them all.

#![warn(missing_docs)]

mod classify;
mod common;
mod dicom_info;
pub mod ground;
mod image_info;
pub mod localize;
pub mod measure;
pub mod remote;
pub mod report;
pub mod segment_anatomy;
mod segment_lungs;
pub mod segment_region;
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
    /// The images the tools read and write.
    pub images: Arc<ImageStore>,
    /// The model pool the tools run their networks on.
    pub models: Arc<ModelPool>,
    /// Served VLM endpoints (`[vlm]` table, `HILUM_VLM_*`).
    pub vlm: Arc<VlmSettings>,
    /// The tools' own settings (backend choices over the models' settings).
    pub settings: ToolSettings,
}

/// The tools' settings beside the models' own.
#[derive(Clone, Debug)]
pub struct ToolSettings {
    /// Backends per model id (`*`: every model that runs on it) over the pool's settings
    /// (`[models.backend]`): a command's `--backend` flags. Empty: the models' settings decide.
    /// An `Err` is a setting that did not parse: each model call reports it and tools without
    /// a model keep working.
    pub backends: Result<hilum_models::BackendChoice, String>,
}

impl Default for ToolSettings {
    fn default() -> Self {
        ToolSettings {
            backends: Ok(hilum_models::BackendChoice::default()),
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

    /// Backends per model id (`*`: every model that runs on it) over the models' settings,
    /// replacing the tool settings' ones: a command's `--backend` flags.
    pub fn with_backends(mut self, backends: BTreeMap<String, hilum_models::Backend>) -> Self {
        self.settings.backends = Ok(backends.into());
        self
    }

    /// Replaces the tool settings (e.g. backends read from a config file).
    pub fn with_settings(mut self, settings: ToolSettings) -> Self {
        self.settings = settings;
        self
    }

    /// Replaces the model pool the tools run on.
    pub fn with_models(mut self, models: Arc<ModelPool>) -> Self {
        self.models = models;
        self
    }

    /// Replaces the served-VLM settings (`[vlm]` table, `HILUM_VLM_*`).
    pub fn with_vlm(mut self, vlm: Arc<VlmSettings>) -> Self {
        self.vlm = vlm;
        self
    }
}

/// How a tool is made from the shared dependencies. Each tool file implements it, next to the
/// tool; registering the tool is then one line in [`Registry::builtin`] (or in a program's own
/// registry, see `hilum_cli::main_with`).
pub trait BuildTool {
    /// The tool over `deps`, ready to register.
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
