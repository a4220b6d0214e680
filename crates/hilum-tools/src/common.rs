use std::sync::Arc;
use std::time::Instant;

use hilum_agent::ToolError;
use hilum_imaging::{CxrImage, ImageStore, ImagingError, Prepared, Preprocess};
use hilum_models::{
    Backend, BackendChoice, Device, InstalledModel, Model, ModelError, ModelPool, Placed,
};
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
        store
            .get(&self.0)
            .map_err(|e| image_error(store, &self.0, e))
    }

    /// The image as a model's input (`Runner::recipe`), computed once per image and recipe by
    /// the store and shared with every other tool that asks for the same.
    pub fn prepared(
        &self,
        store: &ImageStore,
        recipe: &Preprocess,
    ) -> Result<Arc<Prepared>, ToolError> {
        store
            .prepared(&self.0, recipe)
            .map_err(|e| image_error(store, &self.0, e))
    }
}

fn image_error(store: &ImageStore, id: &str, e: ImagingError) -> ToolError {
    match e {
        ImagingError::UnknownId(_) => ToolError::NotFound(format!(
            "no image with id `{id}` in this session; use one of: {}",
            store.ids().join(", ")
        )),
        other => ToolError::Unprocessable(other.to_string()),
    }
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

/// What a tool's model work fails with: a model error, which may say that the device failed
/// (the call then moves to another device holding the model), or the tool's own error.
pub(crate) enum Fail {
    Model(ModelError),
    Tool(ToolError),
}

impl From<ModelError> for Fail {
    fn from(e: ModelError) -> Self {
        Fail::Model(e)
    }
}

impl From<ToolError> for Fail {
    fn from(e: ToolError) -> Self {
        Fail::Tool(e)
    }
}

/// The way every tool runs a model. It checks that `id` is installed (failing fast, naming
/// the install command, before waiting for a device) and takes the model's backend from the
/// pool ([`ModelPool::backend_for`]: `over`, then the models' settings — `[models.backend]` —
/// then the architecture's default), so every tool that uses a model runs it on the same
/// backend. In process the pool places the call ([`ModelPool::run_on`]): routed to the
/// least-loaded of its devices holding the model (`pin: None`), or on the pinned device, with
/// that device's permit, the model loaded there once, and `work` on a blocking thread; a device
/// failure moves the call to another device, other errors are the call's. With the kserve
/// backend the forward pass goes to the inference server without a local device permit (the
/// server queues and batches); when that server does not answer and the pool's settings name
/// a fallback (`[remote] fallback`), the call runs here on that backend instead, routed like
/// any other, and the second value says why.
pub(crate) async fn run_model<M, R, F>(
    models: &Arc<ModelPool>,
    id: &str,
    pin: Option<Device>,
    over: &BackendChoice,
    work: F,
) -> Result<(R, Option<String>), ToolError>
where
    M: Model,
    R: Send + 'static,
    F: Fn(Placed<'_, M>, &InstalledModel) -> Result<R, Fail> + Send + Sync + 'static,
{
    let installed = models
        .registry()
        .installed(id)
        .map_err(|e| model_error(models, e))?;
    let made_on = models
        .settings()
        .runs_on(pin.unwrap_or(models.devices().first()));
    let mut backend = models
        .backend_for(id, &installed, made_on, over)
        .map_err(|e| model_error(models, e))?;
    let work = Arc::new(work);
    let mut note = None;
    if backend == Backend::Kserve {
        let (pool, w, mid, inst) = (
            models.clone(),
            work.clone(),
            id.to_string(),
            installed.clone(),
        );
        let device = pin.unwrap_or(models.devices().first());
        let served = run_blocking(move || {
            let since = Instant::now();
            let served =
                pool.with_copy::<M, _>(&mid, device, Backend::Kserve, since, |p| w(p, &inst));
            Ok(served.unwrap_or_else(|e| Err(Fail::Model(e))))
        })
        .await?;
        let fallback = models.settings().remote.as_ref().and_then(|r| r.fallback);
        match (served, fallback) {
            (Ok(r), _) => return Ok((r, None)),
            (Err(Fail::Model(ModelError::RemoteDown { url, reason })), Some(b)) => {
                note = Some(format!(
                    "the inference server at {url} did not answer ({reason}); ran in process on \
                     the {b} backend ([remote] fallback)"
                ));
                backend = b;
            }
            (Err(Fail::Model(e)), _) => return Err(model_error(models, e)),
            (Err(Fail::Tool(e)), _) => return Err(e),
        }
    }
    // A tool's own error is a result to the pool, so only model errors can move the call.
    let r = models
        .run_on::<M, _, _>(id, pin, backend, move |p| match work(p, &installed) {
            Ok(r) => Ok(Ok(r)),
            Err(Fail::Model(e)) => Err(e),
            Err(Fail::Tool(e)) => Ok(Err(e)),
        })
        .await
        .map_err(|e| model_error(models, e))??;
    Ok((r, note))
}

/// A tool's backend choice over the models' settings, or the error of one that did not parse.
pub(crate) type Choice = Result<BackendChoice, String>;

/// The choice itself, or the tool error of a setting that did not parse.
pub(crate) fn choice(c: &Choice) -> Result<BackendChoice, ToolError> {
    c.clone().map_err(|e| {
        ToolError::Internal(format!(
            "{e}; fix the backend setting (e.g. HILUM_BACKEND=onnx or lung-unet=native)"
        ))
    })
}

/// Runs `work` on a blocking thread (decoding, drawing: work that needs no device permit).
pub(crate) async fn run_blocking<R, F>(work: F) -> Result<R, ToolError>
where
    R: Send + 'static,
    F: FnOnce() -> Result<R, ToolError> + Send + 'static,
{
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ToolError::Internal(e.to_string()))?
}

/// Smallest side, in pixels, on which a measurement means anything.
pub const MIN_SIDE: u32 = 64;

/// Binary masks at one resolution (row-major, `width * height`).
#[derive(Clone, Debug, Default)]
pub struct ChestMasks {
    /// Columns.
    pub width: usize,
    /// Rows.
    pub height: usize,
    /// Both lung fields (one mask or the union of the left and right masks).
    pub lungs: Vec<bool>,
    /// The heart, when the model segments it.
    pub heart: Option<Vec<bool>>,
    /// The mediastinum, when the model segments it.
    pub mediastinum: Option<Vec<bool>>,
}

/// `v` rounded to two decimals, as tool outputs report measurements.
pub(crate) fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}
