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
use hilum_models::Backend;
use hilum_models::{Device, ModelPool, Placed};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::common::{run_model_on, ImageId};

pub const DEFAULT_MODEL: &str = "densenet121-res224-all";
pub const MODELS: [&str; 2] = ["densenet121-res224-all", "resnet50-res512-all"];

pub struct ClassifyChestXray {
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    /// `None`: each call routed across the pool's devices.
    pin: Option<Device>,
    /// Backend per model id (`*`: every model); absent: the device's default. An `Err` is a
    /// setting that did not parse, reported by each call.
    backends: Result<BTreeMap<String, Backend>, String>,
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

/// Parses backend choices: `onnx` (every model) or `MODEL=BACKEND` pairs, comma-separated
/// (`densenet121-res224-all=onnx,resnet50-res512-all=native`). Backends: native, candle, onnx,
/// kserve (a KServe v2 inference server such as Triton).
pub fn parse_backends(spec: &str) -> Result<BTreeMap<String, Backend>, String> {
    let mut out = BTreeMap::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (model, name) = part.split_once('=').unwrap_or(("*", part));
        let model = model.trim();
        if model != "*" && !MODELS.contains(&model) {
            return Err(format!(
                "backend for unknown model `{model}`: use one of {} (or no MODEL= for all)",
                MODELS.join(", ")
            ));
        }
        let backend = name.parse::<Backend>().map_err(|e| e.to_string())?;
        out.insert(model.to_string(), backend);
    }
    Ok(out)
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
            backends,
        })
    }

    /// The configured backend of `model`, if any.
    fn backend_for(&self, model: &str) -> Result<Option<Backend>, ToolError> {
        let map = self.backends.as_ref().map_err(|e| {
            ToolError::Internal(format!(
                "{e}; fix the variable (e.g. HILUM_BACKEND=onnx or {model}=native)"
            ))
        })?;
        Ok(map.get(model).or_else(|| map.get("*")).copied())
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

impl crate::BuildTool for ClassifyChestXray {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(ClassifyChestXray::on_device(
            deps.images.clone(),
            deps.models.clone(),
            None,
            deps.settings.classifier_backends.clone(),
        ))
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
        let backend = self.backend_for(&model_id)?;
        let ((scores, custom, model, infer_ms, load_ms, device), fallback) = run_model_on(
            &self.models,
            &model_id,
            self.pin,
            backend,
            |_, d| Backend::default_for(d),
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
}
