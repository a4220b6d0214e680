//! `answer_visual_question`: a free-text question about one radiograph, answered by a
//! vision-language model that sees the pixels: a served one (CheXagent, MedGemma, MAIRA-2,
//! Qwen2.5-VL, LLaVA-Med behind an OpenAI-compatible endpoint), or one run in-process with
//! `[vlm] backend = "native"`: a LLaVA (e.g. LLaVA-Med v1.5 from the model registry) or, with
//! `model = "local-vlm:PATH"`, Gemma 3 multimodal (MedGemma 4B). Both native paths give the same
//! output: the model that answered, `backend = "native"`, the device and the token counts.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{
    Capability, Environment, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed,
    TypedTool,
};
use hilum_imaging::{CxrImage, ImageStore};
use hilum_models::llava::NativeVlm;
use hilum_models::{ModelPool, Placed};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::common::{run_model, ImageId};
use crate::vlm::{self, Backend, LocalVlmModel, NativeModel, VlmSettings};

/// The tool's name, as models call it.
pub const NAME: &str = "answer_visual_question";

const SYSTEM: &str = "You are an expert radiology assistant. Answer the question about the chest \
    X-ray concisely, from what is visible in the image. Say so when the image does not allow an \
    answer.";

/// The `answer_visual_question` tool: a VLM's answer to one question about the image.
pub struct AnswerVisualQuestion {
    store: Arc<ImageStore>,
    settings: Arc<VlmSettings>,
    /// Where a native VLM is loaded from; `None`: served endpoints only.
    models: Option<Arc<ModelPool>>,
}

// The arguments of `answer_visual_question` as the model sends them.
// (A plain comment and no doc lint: a doc comment would become the schema's description.)
#[allow(missing_docs)]
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// One question about this image
    #[schemars(length(min = 3, max = 1000))]
    question: String,
}

impl AnswerVisualQuestion {
    /// The tool over served endpoints (see [`AnswerVisualQuestion::with_models`] for native).
    pub fn new(store: Arc<ImageStore>, settings: Arc<VlmSettings>) -> Typed<Self> {
        Typed::new(AnswerVisualQuestion {
            store,
            settings,
            models: None,
        })
    }

    /// The tool with the pool native models are loaded from (the toolbox's, so a model loads
    /// once).
    pub fn with_models(
        store: Arc<ImageStore>,
        settings: Arc<VlmSettings>,
        models: Arc<ModelPool>,
    ) -> Typed<Self> {
        Typed::new(AnswerVisualQuestion {
            store,
            settings,
            models: Some(models),
        })
    }

    async fn ask_native(
        &self,
        native: &NativeModel,
        id: &str,
        question: &str,
    ) -> Result<(String, Value), ToolError> {
        let models = self.models.as_ref().ok_or_else(|| {
            ToolError::Internal(format!(
                "the native VLM `{}` needs the model pool: build the tool with \
                 AnswerVisualQuestion::with_models",
                native.model
            ))
        })?;
        let spec = native.clone();
        let q = question.to_string();
        // The tower's input comes from the store, shared with any other call on this image.
        let (store, image_id) = (self.store.clone(), ImageId(id.to_string()));
        let ((answer, load_ms, device), _) = run_model(
            models,
            &native.model,
            native.device,
            &hilum_models::BackendChoice::default(),
            move |p: Placed<'_, NativeVlm>, _| {
                let (m, load_ms) = (p.model, p.load.as_secs_f64() * 1e3);
                let input = image_id.prepared(&store, &m.recipe())?;
                let a = m.answer(&input, &q, Some(spec.max_tokens as usize))?;
                Ok((a, load_ms, p.device))
            },
        )
        .await
        // A LLaVA snapshot is sharded: say how to turn it into the one file `import` takes.
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
        let g = &answer.generation;
        let data = json!({
            "model": native.model,
            "backend": "native",
            "device": device.to_string(),
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

    /// Gemma 3 multimodal in this process (`model = "local-vlm:PATH"`): the same prompt as a
    /// served generic-family model, the picture as a PNG that never leaves the process.
    async fn ask_local(
        &self,
        local: &LocalVlmModel,
        id: &str,
        img: Arc<CxrImage>,
        question: &str,
    ) -> Result<(String, Value), ToolError> {
        let (model, load) = self
            .settings
            .local_models
            .get(&local.spec, local.device)
            .await?;
        let max_side = local.max_side;
        let sent =
            crate::common::run_blocking(move || Ok(vlm::prepare_image_max_side(&img, max_side)?))
                .await?;
        let a = model
            .ask(SYSTEM, id, sent.data_url(), question, local.max_tokens)
            .await?;
        let s = &a.stats;
        let rate = (s.decode_tokens > 0).then(|| r2(s.decode_tokens_per_sec()));
        let data = json!({
            "model": a.model,
            "backend": "native",
            "device": local.device.to_string(),
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": a.completion_tokens,
            "stopped": if a.finish == hilum_llm::FinishReason::Length { "max_tokens" } else { "stop_token" },
            "prefill_ms": r2(s.prefill_secs * 1e3),
            "decode_ms": r2(s.decode_secs * 1e3),
            "tokens_per_second": rate,
            "load_ms": r2(load.as_secs_f64() * 1e3),
            // The picture's soft tokens in the prompt: proof that the model read it.
            "image_tokens": s.image_tokens,
        });
        Ok((a.text, data))
    }
}

/// Two decimals, for milliseconds and rates.
fn r2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

impl crate::BuildTool for AnswerVisualQuestion {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(AnswerVisualQuestion::with_models(
            deps.images.clone(),
            deps.vlm.clone(),
            deps.models.clone(),
        ))
    }
}

#[async_trait]
impl TypedTool for AnswerVisualQuestion {
    type Args = Args;
    const NAME: &'static str = NAME;

    fn description(&self) -> String {
        "Asks a vision-language model that looks at the chest radiograph \
         itself a question about it, e.g. \"Is there a pleural effusion?\", \"Where is \
         the tip of the endotracheal tube?\", \"Describe the cardiac silhouette.\" \
         Returns its free-text answer. The answer is a model's reading, less reliable \
         than the dedicated classifiers and measurements: prefer those for what they \
         cover and use this for everything else."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            vlm: true,
            ..Requirements::NONE
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        // It takes any question about the image.
        vec![Capability::new(&hilum_agent::coverage::ANY_TOPIC, &[])]
    }

    fn available(&self, _env: &Environment) -> bool {
        // A broken configuration stays visible so that the call can say what is wrong.
        !matches!(self.settings.backend(NAME), Ok(None))
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let id = args.image.0;
        let question = args.question.trim().to_string();
        if question.is_empty() {
            return Err(ToolError::InvalidArguments(
                "`question` must be a question".into(),
            ));
        }
        let native = match self.settings.backend(NAME)? {
            Some(Backend::Native(native)) => Some(self.ask_native(&native, &id, &question).await?),
            Some(Backend::LocalVlm(local)) => {
                Some(self.ask_local(&local, &id, img.clone(), &question).await?)
            }
            _ => None,
        };
        if let Some((text, mut data)) = native {
            let model = data["model"].as_str().unwrap_or_default().to_string();
            if text.is_empty() {
                return Err(ToolError::Unprocessable(format!(
                    "the native VLM `{model}` returned an empty answer; rephrase the question"
                )));
            }
            data["image"] = json!(id);
            data["question"] = json!(question);
            data["answer"] = json!(text);
            return Ok(ToolOutput::new(
                format!("{id} ({model}, native): {text}"),
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
