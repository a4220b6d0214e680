use std::sync::Arc;

use hilum_agent::ToolError;
use hilum_imaging::{CxrImage, ImageStore, ImagingError};
use hilum_models::{Device, InstalledModel, ModelError, ModelPool};
use serde_json::{json, Value};
use tokio::sync::OwnedSemaphorePermit;

/// JSON Schema of an image argument: an id from the store, never a path.
pub fn image_arg() -> Value {
    json!({
        "type": "string",
        "pattern": "^img_[0-9a-f]{6,64}$",
        "description": "Id of an image in this session, e.g. img_3fa2c1b4d5e6"
    })
}

/// Resolves the image id in `args[key]` through the store.
pub fn load_image(
    store: &ImageStore,
    args: &Value,
    key: &str,
) -> Result<(String, Arc<CxrImage>), ToolError> {
    let id = args
        .get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ToolError::InvalidArguments(format!("`{key}` must be an image id")))?;
    let img = store.get(id).map_err(|e| match e {
        ImagingError::UnknownId(_) => ToolError::NotFound(format!(
            "no image with id `{id}` in this session; use one of: {}",
            store.ids().join(", ")
        )),
        other => ToolError::Unprocessable(other.to_string()),
    })?;
    Ok((id.to_string(), img))
}

/// A model failure as a tool error; a missing model names the command that installs it
/// (`fetch` when the manifest has a download, `import` otherwise).
pub(crate) fn model_error(models: &ModelPool, e: ModelError) -> ToolError {
    match e {
        ModelError::NotInstalled { id, .. } => {
            let fetchable = models
                .registry()
                .manifest(&id)
                .map(|m| m.source.download_url().is_some())
                .unwrap_or(false);
            let fix = if fetchable {
                format!("hilum models fetch {id}")
            } else {
                format!("hilum models import {id} PATH")
            };
            ToolError::ModelMissing { model: id, fix }
        }
        other => ToolError::Internal(other.to_string()),
    }
}

/// Checks that `id` is installed (failing fast, before waiting for the device) and then takes
/// a work permit on `device`, so parallel calls never oversubscribe it.
pub(crate) async fn reserve(
    models: &ModelPool,
    id: &str,
    device: Device,
) -> Result<(InstalledModel, OwnedSemaphorePermit), ToolError> {
    let installed = models
        .registry()
        .installed(id)
        .map_err(|e| model_error(models, e))?;
    let permit = models
        .acquire(device)
        .await
        .map_err(|e| ToolError::Internal(e.to_string()))?;
    Ok((installed, permit))
}
