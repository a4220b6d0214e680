//! The chest X-ray tools of Hilum. Each tool is one file: a spec (name, description written
//! for a model, JSON Schema) and one async function. [`default_toolbox`] registers them all.

mod common;
mod image_info;

use std::sync::Arc;

use hilum_agent::Toolbox;
use hilum_imaging::ImageStore;

pub use common::image_arg;
pub use image_info::ImageInfo;

/// Everything the tools share: the image store (and, as they land, the model pool).
#[derive(Clone)]
pub struct ToolDeps {
    pub images: Arc<ImageStore>,
}

impl ToolDeps {
    pub fn new(images: Arc<ImageStore>) -> Self {
        ToolDeps { images }
    }
}

/// All Hilum tools, registered in the order a model should consider them.
pub fn default_toolbox(deps: &ToolDeps) -> Result<Toolbox, String> {
    let mut tb = Toolbox::new();
    tb.register(Arc::new(ImageInfo::new(deps.images.clone())))?;
    Ok(tb)
}
