//! `answer_visual_question`: a free-text question about one radiograph, answered by a served
//! vision-language model (CheXagent, MedGemma, MAIRA-2, Qwen2.5-VL, LLaVA-Med) that sees the
//! pixels.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{Environment, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use hilum_imaging::ImageStore;
use serde_json::{json, Value};

use crate::common::{image_arg, load_image};
use crate::vlm::{self, VlmSettings};

pub const NAME: &str = "answer_visual_question";

const SYSTEM: &str = "You are an expert radiology assistant. Answer the question about the chest \
    X-ray concisely, from what is visible in the image. Say so when the image does not allow an \
    answer.";

pub struct AnswerVisualQuestion {
    spec: ToolSpec,
    store: Arc<ImageStore>,
    settings: Arc<VlmSettings>,
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
        }
    }
}

#[async_trait]
impl Tool for AnswerVisualQuestion {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn available(&self, _env: &Environment) -> bool {
        // A broken configuration stays visible so that the call can say what is wrong.
        !matches!(self.settings.endpoint(NAME), Ok(None))
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
