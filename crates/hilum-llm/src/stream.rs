use std::collections::BTreeMap;
use std::pin::Pin;

use futures::{Stream, StreamExt};

use crate::{AssistantTurn, ChatDelta, LlmError, ToolCall};

/// The stream a backend returns.
pub type DeltaStream = Pin<Box<dyn Stream<Item = Result<ChatDelta, LlmError>> + Send>>;

#[derive(Default)]
struct PartialCall {
    id: Option<String>,
    name: Option<String>,
    arguments: String,
}

/// Assembles a delta stream into one turn, calling `on_token` for every text fragment.
///
/// A stream that ends without a `Finish` delta was cut (dropped connection, killed server):
/// that is an error, because a half-written tool call must never be executed.
pub async fn collect_turn(
    mut stream: DeltaStream,
    mut on_token: impl FnMut(&str) + Send,
) -> Result<AssistantTurn, LlmError> {
    let mut turn = AssistantTurn::default();
    let mut calls: BTreeMap<usize, PartialCall> = BTreeMap::new();
    let mut finished = false;
    while let Some(delta) = stream.next().await {
        match delta? {
            ChatDelta::Text(t) => {
                on_token(&t);
                turn.text.push_str(&t);
            }
            ChatDelta::ToolCall {
                index,
                id,
                name,
                arguments,
            } => {
                let call = calls.entry(index).or_default();
                if let Some(id) = id.filter(|s| !s.is_empty()) {
                    call.id = Some(id);
                }
                if let Some(name) = name.filter(|s| !s.is_empty()) {
                    call.name = Some(name);
                }
                call.arguments.push_str(&arguments);
            }
            ChatDelta::Finish { reason, usage } => {
                turn.finish = reason;
                if let Some(u) = usage {
                    turn.usage = u;
                }
                finished = true;
            }
        }
    }
    if !finished {
        let what = if calls.is_empty() {
            "before the model finished its answer".to_string()
        } else {
            format!("in the middle of {} tool call(s)", calls.len())
        };
        return Err(LlmError::StreamCut(what));
    }
    for (index, call) in calls {
        let name = call.name.ok_or_else(|| {
            LlmError::BadResponse(format!(
                "tool call #{index} arrived without a function name"
            ))
        })?;
        turn.tool_calls.push(ToolCall {
            id: call.id.unwrap_or_else(|| format!("call_{index}")),
            name,
            arguments: call.arguments,
        });
    }
    if turn.tool_calls.is_empty() {
        text_tool_calls(&mut turn);
    }
    Ok(turn)
}

/// Servers that render a model's own chat template without a tool-call parser (llama.cpp's
/// Python server with the GGUF template, vLLM without `--tool-call-parser`) return Hermes/Qwen
/// calls as text: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. Those that
/// parse become tool calls; anything else stays text.
fn text_tool_calls(turn: &mut AssistantTurn) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    if !turn.text.contains(OPEN) {
        // The whole answer one bare (or fenced) call object: the same call with its
        // `<tool_call>` markers dropped by the server's detokenizer.
        let t = turn.text.trim();
        let t = t
            .strip_prefix("```json")
            .or_else(|| t.strip_prefix("```"))
            .and_then(|r| r.trim_end().strip_suffix("```"))
            .unwrap_or(t)
            .trim();
        if t.starts_with('{') {
            if let Some(call) = call_object(t, 0) {
                turn.text.clear();
                turn.tool_calls = vec![call];
                turn.finish = crate::FinishReason::ToolCalls;
            }
        }
        return;
    }
    let mut free = String::new();
    let mut calls = Vec::new();
    let mut rest = turn.text.as_str();
    while let Some(i) = rest.find(OPEN) {
        free.push_str(&rest[..i]);
        let after = &rest[i + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(j) => (&after[..j], &after[j + CLOSE.len()..]),
            None => (after, ""),
        };
        match call_object(body.trim(), calls.len()) {
            Some(call) => calls.push(call),
            None => {
                free.push_str(OPEN);
                free.push_str(body);
                if next.len() < after.len() - body.len() {
                    free.push_str(CLOSE);
                }
            }
        }
        rest = next;
    }
    free.push_str(rest);
    if !calls.is_empty() {
        turn.text = free.trim().to_string();
        turn.tool_calls = calls;
        turn.finish = crate::FinishReason::ToolCalls;
    }
}

/// `{"name": "...", "arguments": {...}}` as a call (arguments may also be a JSON string).
fn call_object(text: &str, index: usize) -> Option<ToolCall> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments")? {
        serde_json::Value::String(s) => s.clone(),
        other @ serde_json::Value::Object(_) => other.to_string(),
        _ => return None,
    };
    Some(ToolCall {
        id: format!("call_text_{index}"),
        name,
        arguments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FinishReason;

    fn stream_of(items: Vec<Result<ChatDelta, LlmError>>) -> DeltaStream {
        Box::pin(futures::stream::iter(items))
    }

    #[tokio::test]
    async fn fragments_are_joined_per_index() {
        let s = stream_of(vec![
            Ok(ChatDelta::Text("Hel".into())),
            Ok(ChatDelta::Text("lo".into())),
            Ok(ChatDelta::ToolCall {
                index: 1,
                id: Some("b".into()),
                name: Some("two".into()),
                arguments: "{\"x\":".into(),
            }),
            Ok(ChatDelta::ToolCall {
                index: 0,
                id: Some("a".into()),
                name: Some("one".into()),
                arguments: "{}".into(),
            }),
            Ok(ChatDelta::ToolCall {
                index: 1,
                id: None,
                name: None,
                arguments: "1}".into(),
            }),
            Ok(ChatDelta::Finish {
                reason: FinishReason::ToolCalls,
                usage: None,
            }),
        ]);
        let mut tokens = Vec::new();
        let turn = collect_turn(s, |t| tokens.push(t.to_string()))
            .await
            .unwrap();
        assert_eq!(turn.text, "Hello");
        assert_eq!(tokens, vec!["Hel", "lo"]);
        assert_eq!(turn.tool_calls.len(), 2);
        assert_eq!(turn.tool_calls[0].id, "a");
        assert_eq!(turn.tool_calls[1].arguments, "{\"x\":1}");
    }

    #[tokio::test]
    async fn stream_without_finish_is_cut() {
        let s = stream_of(vec![Ok(ChatDelta::ToolCall {
            index: 0,
            id: Some("a".into()),
            name: Some("one".into()),
            arguments: "{\"x\"".into(),
        })]);
        let err = collect_turn(s, |_| {}).await.unwrap_err();
        assert!(matches!(err, LlmError::StreamCut(_)), "{err}");
        assert!(err.to_string().contains("tool call"));
    }

    #[tokio::test]
    async fn hermes_calls_written_as_text_become_tool_calls() {
        let text = "Checking.\n<tool_call>\n{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_ab12cd\"}}\n</tool_call>\n<tool_call>\nnot json\n</tool_call>";
        let s = stream_of(vec![
            Ok(ChatDelta::Text(text.into())),
            Ok(ChatDelta::Finish {
                reason: FinishReason::Stop,
                usage: None,
            }),
        ]);
        let turn = collect_turn(s, |_| {}).await.unwrap();
        assert_eq!(turn.tool_calls.len(), 1);
        assert_eq!(turn.tool_calls[0].name, "image_info");
        assert_eq!(turn.tool_calls[0].arguments, "{\"image\":\"img_ab12cd\"}");
        assert_eq!(turn.finish, FinishReason::ToolCalls);
        // The unreadable block stays visible as text.
        assert_eq!(
            turn.text,
            "Checking.\n\n<tool_call>\nnot json\n</tool_call>"
        );
    }

    #[tokio::test]
    async fn a_bare_call_object_as_the_whole_answer_is_a_call() {
        for text in [
            "{\n  \"name\": \"image_info\",\n  \"arguments\": {\"image\": \"img_ab12cd\"}\n}",
            "```json\n{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_ab12cd\"}}\n```",
        ] {
            let s = stream_of(vec![
                Ok(ChatDelta::Text(text.into())),
                Ok(ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: None,
                }),
            ]);
            let turn = collect_turn(s, |_| {}).await.unwrap();
            assert_eq!(turn.tool_calls.len(), 1, "{text}");
            assert_eq!(turn.tool_calls[0].arguments, "{\"image\":\"img_ab12cd\"}");
            assert!(turn.text.is_empty());
        }
        // Prose that merely contains JSON stays prose; so does an object that is not a call.
        for text in ["The result was {\"a\": 1}.", "{\"area\": 12}"] {
            let s = stream_of(vec![
                Ok(ChatDelta::Text(text.into())),
                Ok(ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: None,
                }),
            ]);
            let turn = collect_turn(s, |_| {}).await.unwrap();
            assert!(turn.tool_calls.is_empty(), "{text}");
            assert_eq!(turn.text, text);
        }
    }
}
