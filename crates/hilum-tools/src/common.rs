use std::sync::Arc;

use hilum_agent::ToolError;
use hilum_imaging::{CxrImage, ImageStore, ImagingError};
use hilum_models::{Backend, Device, InstalledModel, ModelError, ModelPool};
use schemars::JsonSchema;
use serde_json::{json, Value};

const IMAGE_ID_PATTERN: &str = "^img_[0-9a-f]{6,64}$";
const IMAGE_ID_DESCRIPTION: &str = "Id of an image in this session, e.g. img_3fa2c1b4d5e6";

/// JSON Schema of an image argument: an id from the store, never a path.
pub fn image_arg() -> Value {
    json!({
        "type": "string",
        "pattern": IMAGE_ID_PATTERN,
        "description": IMAGE_ID_DESCRIPTION
    })
}

/// An image argument of a typed tool: an id from the store, never a path. Its schema is
/// [`image_arg`]'s (leave the field without a doc comment so that description stays).
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(transparent)]
pub struct ImageId(pub String);

impl JsonSchema for ImageId {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "ImageId".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": IMAGE_ID_PATTERN,
            "description": IMAGE_ID_DESCRIPTION
        })
    }
}

/// The arguments of a tool that takes one image and nothing else.
#[derive(serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ImageArgs {
    pub image: ImageId,
}

impl ImageId {
    /// Resolves the id through the store.
    pub fn load(&self, store: &ImageStore) -> Result<Arc<CxrImage>, ToolError> {
        resolve(store, &self.0)
    }
}

fn resolve(store: &ImageStore, id: &str) -> Result<Arc<CxrImage>, ToolError> {
    store.get(id).map_err(|e| match e {
        ImagingError::UnknownId(_) => ToolError::NotFound(format!(
            "no image with id `{id}` in this session; use one of: {}",
            store.ids().join(", ")
        )),
        other => ToolError::Unprocessable(other.to_string()),
    })
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

/// The way every tool runs a model: check that `id` is installed (failing fast, naming the
/// install command, before waiting for the device), take a work permit on `device` so parallel
/// calls never oversubscribe it, and run `work` (weights load, forward pass) on a blocking
/// thread with the pool and the installed model.
pub(crate) async fn run_model<R, F>(
    models: &Arc<ModelPool>,
    id: &str,
    device: Device,
    work: F,
) -> Result<R, ToolError>
where
    R: Send + 'static,
    F: FnOnce(&ModelPool, InstalledModel) -> Result<R, ToolError> + Send + 'static,
{
    let installed = models
        .registry()
        .installed(id)
        .map_err(|e| model_error(models, e))?;
    let pool = models.clone();
    run_blocking(Some((models, device)), move || work(&pool, installed)).await
}

/// [`run_model`] for a network that may be served: `work` gets the backend to load (`None`: the
/// tool's own choice). With the kserve backend the forward pass goes to the inference server
/// without a local device permit (the server queues and batches); when that server does not
/// answer and the pool's settings name a fallback (`[remote] fallback`), the call runs here on
/// that backend instead, with the device permit, and the second value says why.
pub(crate) async fn run_model_on<R, F>(
    models: &Arc<ModelPool>,
    id: &str,
    device: Device,
    backend: Option<Backend>,
    work: F,
) -> Result<(R, Option<String>), ToolError>
where
    R: Send + 'static,
    F: Fn(&ModelPool, InstalledModel, Option<Backend>) -> Result<R, ModelError>
        + Send
        + Sync
        + 'static,
{
    let work = Arc::new(work);
    let mut local = backend;
    let mut note = None;
    if backend == Some(Backend::Kserve) {
        let installed = models
            .registry()
            .installed(id)
            .map_err(|e| model_error(models, e))?;
        let (pool, w) = (models.clone(), work.clone());
        let served = run_blocking(None, move || Ok(w(&pool, installed, backend))).await?;
        let fallback = models.settings().remote.as_ref().and_then(|r| r.fallback);
        match (served, fallback) {
            (Ok(r), _) => return Ok((r, None)),
            (Err(ModelError::RemoteDown { url, reason }), Some(b)) => {
                note = Some(format!(
                    "the inference server at {url} did not answer ({reason}); ran in process on \
                     the {b} backend ([remote] fallback)"
                ));
                local = Some(b);
            }
            (Err(e), _) => return Err(model_error(models, e)),
        }
    }
    let r = run_model(models, id, device, move |pool, installed| {
        work(pool, installed, local).map_err(|e| model_error(pool, e))
    })
    .await?;
    Ok((r, note))
}

/// Runs `work` on a blocking thread, holding a work permit on the device when one is given.
/// The permit moves into the thread: a call that times out stops waiting, but the device stays
/// taken until the work it started has finished.
pub(crate) async fn run_blocking<R, F>(
    device: Option<(&ModelPool, Device)>,
    work: F,
) -> Result<R, ToolError>
where
    R: Send + 'static,
    F: FnOnce() -> Result<R, ToolError> + Send + 'static,
{
    let permit = match device {
        Some((models, device)) => Some(
            models
                .acquire(device)
                .await
                .map_err(|e| ToolError::Internal(e.to_string()))?,
        ),
        None => None,
    };
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        work()
    })
    .await
    .map_err(|e| ToolError::Internal(e.to_string()))?
}

/// Smallest side, in pixels, on which a measurement means anything.
pub const MIN_SIDE: u32 = 64;

/// Binary masks at one resolution (row-major, `width * height`).
#[derive(Clone, Debug, Default)]
pub struct ChestMasks {
    pub width: usize,
    pub height: usize,
    /// Both lung fields (one mask or the union of the left and right masks).
    pub lungs: Vec<bool>,
    pub heart: Option<Vec<bool>>,
    pub mediastinum: Option<Vec<bool>>,
}

/// `v` rounded to two decimals, as tool outputs report measurements.
pub(crate) fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}
