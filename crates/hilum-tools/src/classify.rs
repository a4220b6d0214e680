//! `classify_chest_xray`: the 18 pathology scores of torchxrayvision's classifiers
//! (DenseNet-121 `densenet121-res224-all` by default, or ResNet-50 `resnet50-res512-all`),
//! calibrated so that 0.5 is each label's published operating point.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use hilum_agent::{Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use hilum_imaging::ImageStore;
use hilum_models::xrv::{Classifier, LabelScore};
use hilum_models::{Device, ModelPool};
use serde_json::{json, Value};

use crate::common::{image_arg, load_image, model_error, reserve};

pub const DEFAULT_MODEL: &str = "densenet121-res224-all";
pub const MODELS: [&str; 2] = ["densenet121-res224-all", "resnet50-res512-all"];

pub struct ClassifyChestXray {
    spec: ToolSpec,
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    device: Device,
}

impl ClassifyChestXray {
    pub fn new(store: Arc<ImageStore>, models: Arc<ModelPool>) -> Self {
        ClassifyChestXray {
            spec: ToolSpec {
                name: "classify_chest_xray".into(),
                description: "Scores 18 findings on a frontal chest radiograph with a torchxrayvision \
                    classifier: Atelectasis, Consolidation, Infiltration, Pneumothorax, Edema, Emphysema, \
                    Fibrosis, Effusion, Pneumonia, Pleural_Thickening, Cardiomegaly, Nodule, Mass, Hernia, \
                    Lung Lesion, Fracture, Lung Opacity, Enlarged Cardiomediastinum. Scores are calibrated \
                    so that 0.5 is the model's published operating point; `findings` lists the labels at or \
                    above it, highest first. A screening aid trained on public datasets, not a diagnosis; \
                    unreliable on lateral and pediatric images."
                    .into(),
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "image": image_arg(),
                        "model": {
                            "type": "string",
                            "enum": MODELS,
                            "default": DEFAULT_MODEL,
                            "description": "densenet121-res224-all (default, 224 px) or resnet50-res512-all (512 px)"
                        }
                    },
                    "required": ["image"],
                    "additionalProperties": false
                }),
            },
            store,
            models,
            device: Device::Cpu,
        }
    }

    pub fn on_device(mut self, device: Device) -> Self {
        self.device = device;
        self
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

#[async_trait]
impl Tool for ClassifyChestXray {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        let (image_id, img) = load_image(&self.store, &args, "image")?;
        let model_id = args
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or(DEFAULT_MODEL)
            .to_string();
        if !MODELS.contains(&model_id.as_str()) {
            return Err(ToolError::InvalidArguments(format!(
                "unknown model `{model_id}`; use one of {}",
                MODELS.join(", ")
            )));
        }
        // Fail fast, before taking a device permit, when the weights are absent.
        let (_, _permit) = reserve(&self.models, &model_id, self.device).await?;
        let (models, device, mid) = (self.models.clone(), self.device, model_id.clone());
        let image = img.clone();
        let (scores, custom, backend, infer_ms, load_ms) = tokio::task::spawn_blocking(move || {
            let t_load = Instant::now();
            let model = models
                .get_or_load::<Classifier>(&mid, device)
                .map_err(|e| model_error(&models, e))?;
            let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            let scores = model
                .classify(
                    &image.pixels,
                    image.width as usize,
                    image.height as usize,
                    image.max_value(),
                )
                .map_err(|e| ToolError::Internal(e.to_string()))?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            Ok::<_, ToolError>((scores, model.custom, model.backend(), ms, load_ms))
        })
        .await
        .map_err(|e| ToolError::Internal(e.to_string()))??;
        drop(_permit);

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
        let data = json!({
            "image": image_id,
            "model": model_id,
            "custom": custom,
            "backend": format!("{backend:?}").to_lowercase(),
            "device": format!("{:?}", self.device).to_lowercase(),
            "calibration": "torchxrayvision op_norm: 0.5 = published operating point",
            "findings": findings.iter().map(|s| s.label.clone()).collect::<Vec<_>>(),
            "scores": scores.iter().map(score_json).collect::<Vec<_>>(),
            "latency_ms": (infer_ms * 10.0).round() / 10.0,
            "load_ms": (load_ms * 10.0).round() / 10.0,
        });
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

    /// A site's own checkpoint (here seeded weights of the full DenseNet-121) imported with
    /// `--custom`: the tool runs it on a real radiograph and says it is custom.
    #[tokio::test]
    async fn custom_checkpoint_scores_a_real_radiograph_and_is_flagged() {
        use hilum_models::xrv::{self, XrvSpec};
        let dir = tempfile::tempdir().expect("tempdir");
        let w =
            xrv::synthetic_weights(&XrvSpec::densenet121_res224_all().arch, 3).expect("weights");
        let ckpt = dir.path().join("site_densenet.safetensors");
        candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
        let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
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
        let tool = ClassifyChestXray::new(store, pool);
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
}
