//! `answer_visual_question`: a free-text question about one radiograph, answered by a
//! vision-language model that sees the pixels: a served one (CheXagent, MedGemma, MAIRA-2,
//! Qwen2.5-VL, LLaVA-Med behind an OpenAI-compatible endpoint) or a native LLaVA run
//! in-process (`[vlm] backend = "native"`, e.g. LLaVA-Med v1.5 from the model registry).

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{Environment, Requirements, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use hilum_imaging::{CxrImage, ImageStore};
use hilum_models::llava::NativeVlm;
use hilum_models::ModelPool;
use serde_json::{json, Value};

use crate::common::{image_arg, load_image, model_error, reserve};
use crate::vlm::{self, Backend, NativeModel, VlmSettings};

pub const NAME: &str = "answer_visual_question";

const SYSTEM: &str = "You are an expert radiology assistant. Answer the question about the chest \
    X-ray concisely, from what is visible in the image. Say so when the image does not allow an \
    answer.";

pub struct AnswerVisualQuestion {
    spec: ToolSpec,
    store: Arc<ImageStore>,
    settings: Arc<VlmSettings>,
    models: Arc<ModelPool>,
}

impl AnswerVisualQuestion {
    pub fn new(store: Arc<ImageStore>, settings: Arc<VlmSettings>) -> Self {
        AnswerVisualQuestion {
            spec: ToolSpec {
                name: NAME.into(),
                description: "Asks a vision-language model that looks at the chest radiograph \
                    itself a question about it, e.g. \"Is there a pleural effusion?\", \"Where is \
                    the tip of the endotracheal tube?\", \"Describe the cardiac silhouette.\" \
                    Returns its free-text answer. The answer is a model's reading, less reliable \
                    than the dedicated classifiers and measurements: prefer those for what they \
                    cover and use this for everything else."
                    .into(),
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "image": image_arg(),
                        "question": {
                            "type": "string", "minLength": 3, "maxLength": 1000,
                            "description": "One question about this image"
                        }
                    },
                    "required": ["image", "question"],
                    "additionalProperties": false
                }),
            },
            store,
            settings,
            models: Arc::new(ModelPool::from_settings(Default::default())),
        }
    }

    /// The pool native models are loaded from (share the toolbox's, so a model loads once).
    pub fn with_models(mut self, models: Arc<ModelPool>) -> Self {
        self.models = models;
        self
    }

    async fn ask_native(
        &self,
        native: &NativeModel,
        img: Arc<CxrImage>,
        question: &str,
    ) -> Result<(String, Value), ToolError> {
        // A LLaVA snapshot is sharded: say how to turn it into the one file `import` takes.
        let (_installed, permit) = reserve(&self.models, &native.model, native.device)
            .await
            .map_err(|e| match e {
                ToolError::ModelMissing { model, .. } => ToolError::ModelMissing {
                    fix: format!(
                        "python3 scripts/convert_llava.py HF_SNAPSHOT_DIR OUT_DIR && hilum models \
                         import {model} OUT_DIR/model.safetensors"
                    ),
                    model,
                },
                other => other,
            })?;
        let models = self.models.clone();
        let spec = native.clone();
        let q = question.to_string();
        let (answer, load_ms) = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let t0 = std::time::Instant::now();
            let m = models
                .get_or_load::<NativeVlm>(&spec.model, spec.device, hilum_models::Backend::Candle)
                .map_err(|e| model_error(&models, e))?;
            let load_ms = t0.elapsed().as_secs_f64() * 1e3;
            let gray = vlm::to_gray8(&img)?;
            let a = m
                .answer(
                    gray.as_raw(),
                    img.width as usize,
                    img.height as usize,
                    &q,
                    Some(spec.max_tokens as usize),
                )
                .map_err(|e| ToolError::Internal(e.to_string()))?;
            Ok::<_, ToolError>((a, load_ms))
        })
        .await
        .map_err(|e| ToolError::Internal(e.to_string()))??;
        let g = &answer.generation;
        let r2 = |v: f64| (v * 100.0).round() / 100.0;
        let data = json!({
            "model": native.model,
            "backend": "native",
            "device": native.device.to_string(),
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.ids.len(),
            "stopped": if g.stopped { "stop_token" } else { "max_tokens" },
            "prefill_ms": r2(g.prefill_secs * 1e3),
            "decode_ms": r2(g.decode_secs * 1e3),
            "tokens_per_second": answer.tokens_per_second().map(r2),
            "load_ms": r2(load_ms),
        });
        Ok((answer.text, data))
    }
}

impl crate::BuildTool for AnswerVisualQuestion {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(
            AnswerVisualQuestion::new(deps.images.clone(), deps.vlm.clone())
                .with_models(deps.models.clone()),
        )
    }
}

#[async_trait]
impl Tool for AnswerVisualQuestion {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            vlm: true,
            ..Requirements::NONE
        }
    }

    fn available(&self, _env: &Environment) -> bool {
        // A broken configuration stays visible so that the call can say what is wrong.
        !matches!(self.settings.backend(NAME), Ok(None))
    }

    async fn call(&self, _ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        let (id, img) = load_image(&self.store, &args, "image")?;
        let question = args
            .get("question")
            .and_then(Value::as_str)
            .map(str::trim)
            .filter(|q| !q.is_empty())
            .ok_or_else(|| ToolError::InvalidArguments("`question` must be a question".into()))?
            .to_string();
        if let Some(Backend::Native(native)) = self.settings.backend(NAME)? {
            let (text, mut data) = self.ask_native(&native, img, &question).await?;
            if text.is_empty() {
                return Err(ToolError::Unprocessable(format!(
                    "the native VLM `{}` returned an empty answer; rephrase the question",
                    native.model
                )));
            }
            data["image"] = json!(id);
            data["question"] = json!(question);
            data["answer"] = json!(text);
            return Ok(ToolOutput::new(
                format!("{id} ({}, native): {text}", native.model),
                data,
            ));
        }
        let client = vlm::client_for(&self.settings, NAME)?;
        let sent = vlm::prepare_image_blocking(img.clone(), client.endpoint.clone()).await?;
        let answer = client.ask(&sent, Some(SYSTEM), &question).await?;
        let text = answer.text.trim().to_string();
        if text.is_empty() {
            return Err(ToolError::Unprocessable(format!(
                "the VLM `{}` returned an empty answer; rephrase the question or check the server",
                answer.model
            )));
        }
        let data = json!({
            "image": id,
            "question": question,
            "answer": text,
            "model": answer.model,
            "family": client.endpoint.family.as_str(),
            "sent_size": [sent.width, sent.height],
            "completion_tokens": answer.completion_tokens,
            "latency_ms": (answer.latency_ms * 100.0).round() / 100.0,
        });
        Ok(ToolOutput::new(
            format!("{id} ({}): {text}", answer.model),
            data,
        ))
    }
}
