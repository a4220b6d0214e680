//! `classify_chest_xray`: the 18 pathology scores of torchxrayvision's classifiers
//! (DenseNet-121 `densenet121-res224-all` by default, or ResNet-50 `resnet50-res512-all`),
//! calibrated so that 0.5 is each label's published operating point.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use hilum_agent::{
    Capability, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::ImageStore;

use hilum_models::runner::Runner;
use hilum_models::xrv::{self, LabelScore, OnnxSource};
use hilum_models::{Backend, BackendChoice};
use hilum_models::{Device, ModelPool, Placed};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::common::{choice, run_model, Choice, ImageId};

pub const DEFAULT_MODEL: &str = "densenet121-res224-all";
pub const MODELS: [&str; 2] = ["densenet121-res224-all", "resnet50-res512-all"];

/// The `classify_chest_xray` tool: scores 18 findings with a torchxrayvision classifier.
pub struct ClassifyChestXray {
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    /// `None`: each call routed across the pool's devices.
    pin: Option<Device>,
    /// Backend per model id (`*`: every model) over the models' settings; absent: the
    /// settings', else the device's default. An `Err` is a setting that did not parse,
    /// reported by each call.
    backends: Choice,
}

/// The torchxrayvision classifiers this tool runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum Classifier {
    #[default]
    #[serde(rename = "densenet121-res224-all")]
    DenseNet121,
    #[serde(rename = "resnet50-res512-all")]
    ResNet50,
}

impl Classifier {
    pub fn id(self) -> &'static str {
        match self {
            Classifier::DenseNet121 => DEFAULT_MODEL,
            Classifier::ResNet50 => MODELS[1],
        }
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// densenet121-res224-all (default, 224 px) or resnet50-res512-all (512 px)
    #[serde(default)]
    model: Classifier,
}

/// Parses backend choices for Hilum's models: `onnx` (every model that runs on it) or
/// `MODEL=BACKEND` pairs, comma-separated (`lung-unet=kserve,densenet121-res224-all=onnx`).
/// Backends: native, candle, onnx, kserve (a KServe v2 inference server such as Triton).
pub fn parse_backends(spec: &str) -> Result<BTreeMap<String, Backend>, String> {
    let choice = BackendChoice::parse(spec)?;
    let registry = hilum_models::ModelRegistry::new("").map_err(|e| e.to_string())?;
    let known: Vec<&str> = registry.manifests().map(|m| m.id.as_str()).collect();
    if let Some(model) = choice.unknown_models(&known).first() {
        return Err(format!(
            "backend for unknown model `{model}`: use one of {} (or no MODEL= for all)",
            known.join(", ")
        ));
    }
    Ok(choice.iter().map(|(m, b)| (m.to_string(), b)).collect())
}

impl ClassifyChestXray {
    /// The tool on the pool's devices with each model on the device's default backend.
    pub fn new(store: Arc<ImageStore>, models: Arc<ModelPool>) -> Typed<Self> {
        Self::on_device(store, models, None, Ok(BTreeMap::new()))
    }

    /// Every model on `backend`.
    pub fn with_backend(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        backend: Backend,
    ) -> Typed<Self> {
        let all = [("*".to_string(), backend)].into_iter().collect();
        Self::on_device(store, models, None, Ok(all))
    }

    /// Backends per model id (`*`: every model); see [`crate::ToolSettings`]. `pin`: one
    /// device for every call; `None`: routed across the pool's devices.
    pub fn on_device(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        pin: Option<Device>,
        backends: Result<BTreeMap<String, Backend>, String>,
    ) -> Typed<Self> {
        Typed::new(ClassifyChestXray {
            store,
            models,
            pin,
            backends: backends.map(BackendChoice::from),
        })
    }
}

fn r4(v: f32) -> f64 {
    (v as f64 * 1e4).round() / 1e4
}

fn score_json(s: &LabelScore) -> Value {
    json!({
        "label": s.label,
        "score": s.score.map(r4),
        "probability": r4(s.probability),
        "threshold": s.threshold.map(r4),
        "positive": s.positive(),
    })
}

/// What one classification gives the tool's output: scores, custom weights, the copy that ran,
/// forward ms, load ms, device.
type Classified = (
    Vec<LabelScore>,
    bool,
    Arc<xrv::Classifier>,
    f64,
    f64,
    Device,
);

impl ClassifyChestXray {
    /// With the pool's dynamic batching on and an in-process backend: the call gathered with
    /// concurrent calls of the same model into one forward pass ([`ModelPool::run_batched`];
    /// the image prepared first, outside the device), and the size of that pass. `None`:
    /// batching is off or the backend is a server (which batches on its own).
    async fn batched(
        &self,
        image: &ImageId,
        id: &str,
        over: &BackendChoice,
    ) -> Result<Option<(Classified, usize)>, ToolError> {
        let models = &self.models;
        if !models.settings().batch.enabled() {
            return Ok(None);
        }
        let fail = |e| crate::common::model_error(models, e);
        let installed = models.registry().installed(id).map_err(fail)?;
        let made_on = models
            .settings()
            .runs_on(self.pin.unwrap_or(models.devices().first()));
        let backend = models
            .backend_for(id, &installed, made_on, over)
            .map_err(fail)?;
        if backend == Backend::Kserve {
            return Ok(None);
        }
        let spec = models
            .registry()
            .manifest(id)
            .and_then(xrv::XrvSpec::from_manifest)
            .map_err(fail)?;
        let (store, image) = (self.store.clone(), image.clone());
        let input =
            crate::common::run_blocking(move || image.prepared(&store, &spec.recipe())).await?;
        let out = models
            .run_batched::<xrv::Classifier>(id, self.pin, backend, input)
            .await
            .map_err(fail)?;
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let custom = out.model.custom;
        let r = (
            out.output,
            custom,
            out.model,
            ms(out.forward),
            ms(out.load),
            out.device,
        );
        Ok(Some((r, out.size)))
    }
}

impl crate::BuildTool for ClassifyChestXray {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(Typed::new(ClassifyChestXray {
            store: deps.images.clone(),
            models: deps.models.clone(),
            pin: None,
            backends: deps.settings.backends.clone(),
        }))
    }
}

#[async_trait]
impl TypedTool for ClassifyChestXray {
    type Args = Args;
    const NAME: &'static str = "classify_chest_xray";

    fn description(&self) -> String {
        "Scores 18 findings on a frontal chest radiograph with a torchxrayvision \
         classifier: Atelectasis, Consolidation, Infiltration, Pneumothorax, Edema, Emphysema, \
         Fibrosis, Effusion, Pneumonia, Pleural_Thickening, Cardiomegaly, Nodule, Mass, Hernia, \
         Lung Lesion, Fracture, Lung Opacity, Enlarged Cardiomediastinum. Scores are calibrated \
         so that 0.5 is the model's published operating point; `findings` lists the labels at or \
         above it, highest first. A screening aid trained on public datasets, not a diagnosis; \
         unreliable on lateral and pediatric images."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            models: &["densenet121-res224-all"],
            ..Requirements::NONE
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        crate::topics::CLASSIFIER_LABELS
            .iter()
            .map(|(label, topic)| Capability::keyed(topic, &[], label))
            .collect()
    }

    fn state(&self, capability: &Capability, out: &ToolOutput) -> Option<String> {
        let score = out.data["scores"]
            .as_array()?
            .iter()
            .find(|s| s["label"] == capability.key)?;
        let value = score["score"].as_f64()?;
        let model = out.data["model"].as_str().unwrap_or("the classifier");
        let side = if score["positive"].as_bool() == Some(true) {
            "at or above"
        } else {
            "below"
        };
        Some(format!(
            "{} scores {value:.2} on {model}, {side} its operating point 0.5 (a screening score, not a diagnosis)",
            capability.key
        ))
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        // Unknown ids fail here, before waiting for a device.
        args.image.load(&self.store)?;
        let store = self.store.clone();
        let image = args.image.clone();
        let image_id = args.image.0;
        let model_id = args.model.id().to_string();
        let over = choice(&self.backends)?;
        let batched = self.batched(&image, &model_id, &over).await?;
        let (((scores, custom, model, infer_ms, load_ms, device), fallback), batch) = match batched
        {
            Some((r, size)) => ((r, None), Some(size)),
            None => {
                let r = run_model(
                    &self.models,
                    &model_id,
                    self.pin,
                    &over,
                    move |p: Placed<'_, xrv::Classifier>, _| {
                        let (model, load_ms) = (p.model.clone(), p.load.as_secs_f64() * 1e3);
                        let t = Instant::now();
                        let input = image.prepared(&store, &model.recipe())?;
                        let scores = model.run(&input)?;
                        let ms = t.elapsed().as_secs_f64() * 1e3;
                        Ok((scores, model.custom, model, ms, load_ms, p.device))
                    },
                )
                .await?;
                (r, None)
            }
        };

        let mut findings: Vec<&LabelScore> = scores.iter().filter(|s| s.positive()).collect();
        findings.sort_by(|a, b| b.score.unwrap_or(0.0).total_cmp(&a.score.unwrap_or(0.0)));
        let mut others: Vec<&LabelScore> = scores
            .iter()
            .filter(|s| !s.positive() && s.score.is_some())
            .collect();
        others.sort_by(|a, b| b.score.unwrap_or(0.0).total_cmp(&a.score.unwrap_or(0.0)));
        let list = |v: &[&LabelScore]| {
            v.iter()
                .map(|s| format!("{} {:.2}", s.label, s.score.unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let tag = if custom {
            " (site's custom weights)"
        } else {
            ""
        };
        let summary = if findings.is_empty() {
            format!(
                "{image_id}, {model_id}{tag}: no finding at or above its operating point (0.5); highest: {}",
                list(&others[..others.len().min(3)])
            )
        } else {
            format!(
                "{image_id}, {model_id}{tag}: at or above operating point (0.5): {}; next: {}",
                list(&findings),
                list(&others[..others.len().min(2)])
            )
        };
        let mut data = json!({
            "image": image_id,
            "model": model_id,
            "custom": custom,
            "backend": model.backend().name(),
            "onnx_graph": model.onnx_source.map(|s| match s {
                OnnxSource::Built => "built from the installed safetensors",
                OnnxSource::Imported => "imported model.onnx",
            }),
            "device": format!("{device:?}").to_lowercase(),
            "calibration": "torchxrayvision op_norm: 0.5 = published operating point",
            "findings": findings.iter().map(|s| s.label.clone()).collect::<Vec<_>>(),
            "scores": scores.iter().map(score_json).collect::<Vec<_>>(),
            "latency_ms": (infer_ms * 10.0).round() / 10.0,
            "load_ms": (load_ms * 10.0).round() / 10.0,
        });
        if let Some(why) = fallback {
            data["fallback"] = json!(why);
        }
        if let Some(n) = batch {
            data["batch"] = json!(n);
        }
        Ok(ToolOutput::new(summary, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hilum_imaging::StoreLimits;
    use hilum_models::ModelRegistry;
    use std::path::PathBuf;

    fn shared_image() -> PathBuf {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/images");
        let first = std::fs::read_dir(&p)
            .unwrap_or_else(|e| panic!("real radiographs missing in {}: {e}", p.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "png" || x == "jpg"))
            .min();
        first.unwrap_or_else(|| panic!("no PNG/JPEG in {}", p.display()))
    }

    #[tokio::test]
    async fn missing_model_names_the_fetch_command() {
        let dir = tempfile::tempdir().expect("tempdir");
        let registry = ModelRegistry::new(dir.path()).expect("registry with built-in manifests");
        let pool = Arc::new(ModelPool::new(Arc::new(registry)));
        let store = Arc::new(ImageStore::new(StoreLimits::default()));
        let id = store
            .ingest_file(&shared_image())
            .expect("real image decodes");
        let tool = ClassifyChestXray::new(store, pool);
        let err = tool
            .call(&ToolContext::default(), json!({"image": id}))
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("hilum models fetch densenet121-res224-all"),
            "{err}"
        );
    }

    /// A pool with seeded weights of the full DenseNet-121 imported as a site's checkpoint,
    /// and a store holding one real radiograph.
    fn custom_install(dir: &std::path::Path) -> (Arc<ImageStore>, Arc<ModelPool>, String) {
        use hilum_models::xrv::{self, XrvSpec};
        let w =
            xrv::synthetic_weights(&XrvSpec::densenet121_res224_all().arch, 3).expect("weights");
        let ckpt = dir.join("site_densenet.safetensors");
        candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
        let registry = ModelRegistry::new(dir.join("models")).expect("registry");
        let opts = hilum_models::ImportOptions {
            custom: true,
            ..Default::default()
        };
        hilum_models::import(&registry, DEFAULT_MODEL, &ckpt, &opts).expect("custom import");
        let pool = Arc::new(ModelPool::new(Arc::new(registry)));
        let store = Arc::new(ImageStore::new(StoreLimits::default()));
        let id = store
            .ingest_file(&shared_image())
            .expect("real image decodes");
        (store, pool, id)
    }

    /// A site's own checkpoint (here seeded weights of the full DenseNet-121) imported with
    /// `--custom`: the tool runs it on a real radiograph and says it is custom.
    #[tokio::test]
    async fn custom_checkpoint_scores_a_real_radiograph_and_is_flagged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, pool, id) = custom_install(dir.path());
        let tool = ClassifyChestXray::with_backend(store, pool, Backend::Native);
        let out = tool
            .call(&ToolContext::default(), json!({"image": id}))
            .await
            .expect("classifies");
        let d = &out.data;
        assert_eq!(d["model"], DEFAULT_MODEL);
        assert_eq!(d["custom"], true);
        assert_eq!(d["backend"], "native");
        assert!(out.summary.contains("custom"), "{}", out.summary);
        let scores = d["scores"].as_array().expect("scores");
        assert_eq!(scores.len(), 18);
        assert_eq!(scores[10]["label"], "Cardiomegaly");
        for s in scores {
            let (score, p) = (
                s["score"].as_f64().expect("score"),
                s["probability"].as_f64().expect("p"),
            );
            assert!(
                (0.0..=1.0).contains(&score) && (0.0..=1.0).contains(&p),
                "{s}"
            );
            // Calibration is monotone around the threshold.
            let t = s["threshold"].as_f64().expect("threshold");
            assert_eq!(score >= 0.5, p >= t, "{s}");
            assert_eq!(s["positive"].as_bool(), Some(score >= 0.5));
        }
        let findings = d["findings"].as_array().expect("findings");
        let positives = scores.iter().filter(|s| s["positive"] == true).count();
        assert_eq!(findings.len(), positives);
        assert!(d["latency_ms"].as_f64().expect("latency") > 0.0);
    }

    #[tokio::test]
    async fn unknown_model_is_rejected_with_the_choices() {
        let dir = tempfile::tempdir().expect("tempdir");
        let registry = ModelRegistry::new(dir.path()).expect("registry");
        let pool = Arc::new(ModelPool::new(Arc::new(registry)));
        let store = Arc::new(ImageStore::new(StoreLimits::default()));
        let id = store
            .ingest_file(&shared_image())
            .expect("real image decodes");
        let tool = ClassifyChestXray::new(store, pool);
        let err = tool
            .call(
                &ToolContext::default(),
                json!({"image": id, "model": "vgg"}),
            )
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("resnet50-res512-all"), "{err}");
    }

    #[test]
    fn backend_choices_parse_per_model_and_for_all() {
        let all = parse_backends("onnx").expect("all");
        assert_eq!(all.get("*"), Some(&Backend::Onnx));
        let per = parse_backends("densenet121-res224-all=native, resnet50-res512-all=onnx")
            .expect("per model");
        assert_eq!(per.get("densenet121-res224-all"), Some(&Backend::Native));
        assert_eq!(per.get("resnet50-res512-all"), Some(&Backend::Onnx));
        let err = parse_backends("vgg=onnx").err().unwrap_or_default();
        assert!(err.contains("densenet121-res224-all"), "{err}");
        let err = parse_backends("tensorflow").err().unwrap_or_default();
        assert!(err.contains("native, candle, onnx or kserve"), "{err}");
    }

    /// With dynamic batching on, concurrent calls run as one pass and answer what the same
    /// call answers without batching.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_calls_batch_into_one_pass_with_the_unbatched_scores() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, plain, id) = custom_install(dir.path());
        let settings = hilum_models::ModelSettings {
            // Far above the test: the pass leaves because it is full.
            batch: hilum_models::BatchSettings::new(3, std::time::Duration::from_secs(3600)),
            ..Default::default()
        };
        let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
        let batching = Arc::new(ModelPool::with_settings(Arc::new(registry), settings));
        let tool = Arc::new(ClassifyChestXray::with_backend(
            store.clone(),
            batching,
            Backend::Native,
        ));
        let calls: Vec<_> = (0..3)
            .map(|_| {
                let (tool, id) = (tool.clone(), id.clone());
                tokio::spawn(async move {
                    tool.call(&ToolContext::default(), json!({ "image": id }))
                        .await
                })
            })
            .collect();
        let alone = ClassifyChestXray::with_backend(store, plain, Backend::Native)
            .call(&ToolContext::default(), json!({ "image": id }))
            .await
            .expect("unbatched call");
        assert!(alone.data.get("batch").is_none());
        for c in calls {
            let out = c.await.expect("task").expect("batched call");
            assert_eq!(out.data["batch"], 3);
            assert_eq!(out.data["scores"], alone.data["scores"]);
            assert_eq!(out.summary, alone.summary);
        }
    }
}
