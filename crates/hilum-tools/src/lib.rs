//! The chest X-ray tools of Hilum. Each tool is one file: a spec (name, description written
//! for a model, JSON Schema) and one async function. [`default_toolbox`] registers them all.

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
mod visualize;
pub mod vlm;
pub mod vqa;

use std::sync::Arc;

use hilum_agent::Toolbox;
use hilum_imaging::ImageStore;
use hilum_models::ModelPool;

pub use classify::{parse_backends, ClassifyChestXray};
pub use common::image_arg;
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

/// Everything the tools share: the image store and the model pool.
#[derive(Clone)]
pub struct ToolDeps {
    pub images: Arc<ImageStore>,
    pub models: Arc<ModelPool>,
    /// Served VLM endpoints (`[vlm]` table, `HILUM_VLM_*`).
    pub vlm: Arc<VlmSettings>,
    /// Classifier backend per model id (`*`: every model); empty: `HILUM_BACKEND`, else the
    /// device's default.
    pub backends: std::collections::BTreeMap<String, hilum_models::Backend>,
}

impl ToolDeps {
    /// Models come from `HILUM_MODELS_DIR` (or the user's data dir); see [`ToolDeps::with_models`].
    pub fn new(images: Arc<ImageStore>) -> Self {
        ToolDeps {
            images,
            models: Arc::new(ModelPool::from_env_or_empty()),
            vlm: Arc::new(VlmSettings::from_env_and_file_or_broken()),
            backends: Default::default(),
        }
    }

    pub fn with_backends(
        mut self,
        backends: std::collections::BTreeMap<String, hilum_models::Backend>,
    ) -> Self {
        self.backends = backends;
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

/// All Hilum tools, registered in the order a model should consider them.
pub fn default_toolbox(deps: &ToolDeps) -> Result<Toolbox, String> {
    let mut tb = Toolbox::new();
    tb.register(Arc::new(ImageInfo::new(deps.images.clone())))?;
    tb.register(Arc::new(DicomInfo::new(deps.images.clone())))?;
    let mut classify = ClassifyChestXray::new(deps.images.clone(), deps.models.clone());
    if !deps.backends.is_empty() {
        classify = classify.with_backends(deps.backends.clone());
    }
    tb.register(Arc::new(classify))?;
    tb.register(Arc::new(SegmentLungs::new(
        deps.images.clone(),
        deps.models.clone(),
    )))?;
    tb.register(Arc::new(SegmentAnatomy::new(
        deps.images.clone(),
        deps.models.clone(),
    )))?;
    tb.register(Arc::new(SegmentRegion::new(
        deps.images.clone(),
        deps.models.clone(),
    )))?;
    tb.register(Arc::new(MeasureChest::new(
        deps.images.clone(),
        deps.models.clone(),
    )))?;
    tb.register(Arc::new(LocalizeFinding::new(
        deps.images.clone(),
        deps.models.clone(),
    )))?;
    tb.register(Arc::new(GroundPhrase::new(
        deps.images.clone(),
        deps.vlm.clone(),
    )))?;
    tb.register(Arc::new(
        AnswerVisualQuestion::new(deps.images.clone(), deps.vlm.clone())
            .with_models(deps.models.clone()),
    ))?;
    tb.register(Arc::new(GenerateReport::new(
        deps.images.clone(),
        deps.models.clone(),
    )))?;
    tb.register(Arc::new(Visualize::new(deps.images.clone())))?;
    Ok(tb)
}
