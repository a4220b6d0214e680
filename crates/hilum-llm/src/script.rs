//! A backend that replays assistant turns from a JSON file: for tests, demos and benchmarks
//! that must not depend on a model.
//!
//! The file is a JSON array; each element is one assistant turn:
//! ```json
//! [
//!   {"content": "Let me look.", "tool_calls": [{"name": "image_info", "arguments": {"image": "$IMAGE"}}]},
//!   {"content": "The image is 1024x1024."}
//! ]
//! ```
//! `$IMAGE` (or `$IMAGE1`, `$IMAGE2`, …) in string arguments is replaced by the ids of the images
//! the user attached, in order, so one script works for any input file. An element
//! `{"error": "message"}` makes that call fail, to exercise error paths.

use std::path::Path;
use std::sync::Mutex;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::Value;

use crate::{
    Capabilities, ChatDelta, ChatRequest, DeltaStream, FinishReason, Llm, LlmError, Message, Usage,
};

/// One scripted assistant turn (`--llm script:FILE`).
#[derive(Clone, Debug, Deserialize)]
pub struct ScriptTurn {
    /// The turn's text.
    #[serde(default)]
    pub content: String,
    /// The tool calls it makes.
    #[serde(default)]
    pub tool_calls: Vec<ScriptCall>,
    /// Fail this turn with this message instead.
    #[serde(default)]
    pub error: Option<String>,
}

/// One tool call of a scripted turn.
#[derive(Clone, Debug, Deserialize)]
pub struct ScriptCall {
    /// The call's id (made up when absent).
    #[serde(default)]
    pub id: Option<String>,
    /// The tool's name.
    pub name: String,
    /// An object, or a string holding (possibly malformed) JSON text, sent as written.
    #[serde(default)]
    pub arguments: Value,
}

/// Replays a fixed list of turns, one per `chat` call.
pub struct ScriptLlm {
    turns: Vec<ScriptTurn>,
    next: Mutex<usize>,
    label: String,
}

impl ScriptLlm {
    /// Replays `turns` in order.
    pub fn new(turns: Vec<ScriptTurn>) -> Self {
        ScriptLlm {
            turns,
            next: Mutex::new(0),
            label: "script".into(),
        }
    }

    /// The turns of a JSON array.
    pub fn from_json(text: &str) -> Result<Self, LlmError> {
        let turns: Vec<ScriptTurn> = serde_json::from_str(text).map_err(|e| {
            LlmError::Script(format!(
                "not a JSON array of turns ({e}); see `hilum analyze --help`"
            ))
        })?;
        Ok(Self::new(turns))
    }

    /// The turns of a JSON file.
    pub fn from_file(path: &Path) -> Result<Self, LlmError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| LlmError::Script(format!("cannot read {}: {e}", path.display())))?;
        let mut llm = Self::from_json(&text)?;
        llm.label = format!("script:{}", path.display());
        Ok(llm)
    }

    /// How many turns were replayed so far.
    pub fn calls(&self) -> usize {
        *self.next.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn image_ids(messages: &[Message]) -> Vec<String> {
    messages
        .iter()
        .filter_map(|m| match m {
            Message::User { images, .. } => Some(images.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

fn substitute(value: &Value, ids: &[String]) -> Value {
    match value {
        Value::String(s) => {
            let mut out = s.clone();
            // Longest placeholders first so `$IMAGE1` is not read as `$IMAGE` + "1".
            for (i, id) in ids.iter().enumerate().rev() {
                out = out.replace(&format!("$IMAGE{}", i + 1), id);
            }
            if let Some(first) = ids.first() {
                out = out.replace("$IMAGE", first);
            }
            Value::String(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(|v| substitute(v, ids)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (k.clone(), substitute(v, ids)))
                .collect(),
        ),
        other => other.clone(),
    }
}

#[async_trait]
impl Llm for ScriptLlm {
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError> {
        let index = {
            let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
            let i = *next;
            *next += 1;
            i
        };
        let turn = self.turns.get(index).ok_or_else(|| {
            LlmError::Script(format!(
                "the script has {} turn(s) and the agent asked for turn {}",
                self.turns.len(),
                index + 1
            ))
        })?;
        if let Some(e) = &turn.error {
            return Err(LlmError::Script(e.clone()));
        }
        let ids = image_ids(&req.messages);
        let mut deltas: Vec<Result<ChatDelta, LlmError>> = Vec::new();
        // Stream text word by word, as a real backend would.
        for piece in turn.content.split_inclusive(' ') {
            deltas.push(Ok(ChatDelta::Text(piece.to_string())));
        }
        // With tools withheld (final synthesis) a scripted tool call would be invalid: drop it.
        let calls: &[ScriptCall] = if req.tools.is_empty() {
            &[]
        } else {
            &turn.tool_calls
        };
        for (i, call) in calls.iter().enumerate() {
            let arguments = match substitute(&call.arguments, &ids) {
                Value::String(raw) => raw,
                Value::Null => "{}".to_string(),
                v => v.to_string(),
            };
            deltas.push(Ok(ChatDelta::ToolCall {
                index: i,
                id: Some(
                    call.id
                        .clone()
                        .unwrap_or_else(|| format!("call_{}_{}", index, i)),
                ),
                name: Some(call.name.clone()),
                arguments,
            }));
        }
        let reason = if calls.is_empty() {
            FinishReason::Stop
        } else {
            FinishReason::ToolCalls
        };
        let completion_tokens = turn.content.split_whitespace().count() as u32;
        deltas.push(Ok(ChatDelta::Finish {
            reason,
            usage: Some(Usage {
                prompt_tokens: 0,
                completion_tokens,
            }),
        }));
        Ok(Box::pin(futures::stream::iter(deltas)))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_tools: true,
            parallel_tool_calls: true,
            images: false,
            local: true,
            in_process: true,
        }
    }

    fn name(&self) -> String {
        self.label.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{collect_turn, ToolSpec};
    use serde_json::json;

    fn req_with_tools() -> ChatRequest {
        ChatRequest {
            messages: vec![Message::user("q", vec!["img_aaa".into(), "img_bbb".into()])],
            tools: vec![ToolSpec {
                name: "t".into(),
                description: String::new(),
                parameters: json!({}),
            }],
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn placeholders_become_image_ids() {
        let llm = ScriptLlm::from_json(
            r#"[{"tool_calls":[{"name":"t","arguments":{"a":"$IMAGE","b":"$IMAGE2"}}]}]"#,
        )
        .unwrap();
        let turn = collect_turn(llm.chat(req_with_tools()).await.unwrap(), |_| {})
            .await
            .unwrap();
        let args: Value = serde_json::from_str(&turn.tool_calls[0].arguments).unwrap();
        assert_eq!(args, json!({"a": "img_aaa", "b": "img_bbb"}));
    }

    #[tokio::test]
    async fn running_out_of_turns_is_an_error() {
        let llm = ScriptLlm::from_json(r#"[{"content":"done"}]"#).unwrap();
        assert!(llm.chat(req_with_tools()).await.is_ok());
        let err = match llm.chat(req_with_tools()).await {
            Err(e) => e,
            Ok(_) => panic!("expected an error"),
        };
        assert!(err.to_string().contains("1 turn(s)"), "{err}");
    }
}
