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

/// Bytes of recent output the loop guard looks at.
const LOOP_WINDOW: usize = 768;
/// Longest repeated unit it recognises: a loop must repeat at least six times.
const LOOP_MAX_PERIOD: usize = 128;

/// Watches a model's output (text and call arguments, in arrival order) for a loop: the last
/// [`LOOP_WINDOW`] bytes made of one unit of at most [`LOOP_MAX_PERIOD`] bytes repeated. A
/// served model has no repetition guard of its own, and one stuck in a loop would otherwise run
/// until the server's token limit or the run's deadline.
#[derive(Default)]
struct LoopGuard {
    tail: Vec<u8>,
}

impl LoopGuard {
    /// The period of the loop the output has fallen into, if any.
    fn push(&mut self, fragment: &str) -> Option<usize> {
        self.tail.extend_from_slice(fragment.as_bytes());
        if self.tail.len() > 2 * LOOP_WINDOW {
            self.tail.drain(..self.tail.len() - LOOP_WINDOW);
        }
        if self.tail.len() < LOOP_WINDOW {
            return None;
        }
        let t = &self.tail[self.tail.len() - LOOP_WINDOW..];
        (1..=LOOP_MAX_PERIOD).find(|&p| (p..LOOP_WINDOW).all(|i| t[i] == t[i - p]))
    }
}

/// Assembles a delta stream into one turn, calling `on_token` for every text fragment.
///
/// A stream that ends without a `Finish` delta was cut (dropped connection, killed server):
/// that is an error, because a half-written tool call must never be executed. Output that falls
/// into a loop is an error too; the stream is dropped, which closes the request.
pub async fn collect_turn(
    mut stream: DeltaStream,
    mut on_token: impl FnMut(&str) + Send,
) -> Result<AssistantTurn, LlmError> {
    let mut turn = AssistantTurn::default();
    let mut calls: BTreeMap<usize, PartialCall> = BTreeMap::new();
    let mut finished = false;
    let mut guard = LoopGuard::default();
    let looping = |period| LlmError::Repetition {
        period,
        window: LOOP_WINDOW,
    };
    while let Some(delta) = stream.next().await {
        match delta? {
            ChatDelta::Text(t) => {
                on_token(&t);
                turn.text.push_str(&t);
                if let Some(period) = guard.push(&t) {
                    return Err(looping(period));
                }
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
                if let Some(period) = guard.push(&arguments) {
                    return Err(looping(period));
                }
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
        // Call objects at the start of the answer, bare or fenced: the same calls with their
        // `<tool_call>` markers dropped by the server's detokenizer.
        let t = turn.text.trim();
        let t = t
            .strip_prefix("```json")
            .or_else(|| t.strip_prefix("```"))
            .map(|r| r.trim_end().strip_suffix("```").unwrap_or(r))
            .unwrap_or(t)
            .trim();
        if !t.starts_with('{') {
            return;
        }
        let mut values = serde_json::Deserializer::from_str(t).into_iter::<serde_json::Value>();
        let (mut calls, mut end) = (Vec::new(), 0);
        while let Some(Ok(v)) = values.next() {
            match call_value(&v, calls.len()) {
                Some(call) => calls.push(call),
                None => break,
            }
            end = values.byte_offset();
        }
        if calls.is_empty() {
            return;
        }
        // What follows the calls stays as text unless it is only JSON: a small model often
        // goes on to write the result it expects, which must not pass for an answer.
        let rest = t[end..].trim();
        let only_json = serde_json::Deserializer::from_str(rest)
            .into_iter::<serde_json::Value>()
            .all(|v| v.is_ok());
        turn.text = if only_json {
            String::new()
        } else {
            rest.to_string()
        };
        turn.tool_calls = calls;
        turn.finish = crate::FinishReason::ToolCalls;
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
    call_value(&serde_json::from_str(text).ok()?, index)
}

fn call_value(v: &serde_json::Value, index: usize) -> Option<ToolCall> {
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

    /// The turn a stream of one text fragment and a normal finish gives.
    async fn turn_of(text: &str) -> AssistantTurn {
        let s = stream_of(vec![
            Ok(ChatDelta::Text(text.into())),
            Ok(ChatDelta::Finish {
                reason: FinishReason::Stop,
                usage: None,
            }),
        ]);
        collect_turn(s, |_| {}).await.unwrap()
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
    async fn a_looping_answer_is_stopped_and_ordinary_text_is_not() {
        // An endless stream: only the guard can end it.
        let endless = |unit: &'static str| -> DeltaStream {
            Box::pin(futures::stream::repeat_with(move || {
                Ok(ChatDelta::Text(unit.to_string()))
            }))
        };
        let unit = "The right lung is clear. ";
        let err = collect_turn(endless(unit), |_| {}).await.unwrap_err();
        match err {
            LlmError::Repetition { period, .. } => assert_eq!(period, unit.len()),
            other => panic!("{other}"),
        }
        let err = collect_turn(endless("\n"), |_| {}).await.unwrap_err();
        assert!(err.to_string().contains("repeated"), "{err}");

        // Endless arguments of a call are a loop too.
        let args: DeltaStream = Box::pin(futures::stream::repeat_with(|| {
            Ok(ChatDelta::ToolCall {
                index: 0,
                id: None,
                name: Some("segment_lungs".into()),
                arguments: "[1, 2], ".into(),
            })
        }));
        let err = collect_turn(args, |_| {}).await.unwrap_err();
        assert!(
            matches!(err, LlmError::Repetition { period: 8, .. }),
            "{err}"
        );

        // A long answer that repeats words and phrases, but never one unit six times in a
        // row, passes; so does a unit repeated five times (below the guard's window).
        let mut long = String::new();
        for i in 0..200 {
            long.push_str(&format!("Region {i}: area {} px. ", 1000 + i * 7));
        }
        long.push_str(&"| --- | --- | --- |\n".repeat(5));
        let s = stream_of(
            long.as_bytes()
                .chunks(13)
                .map(|c| Ok(ChatDelta::Text(String::from_utf8_lossy(c).to_string())))
                .chain([Ok(ChatDelta::Finish {
                    reason: FinishReason::Stop,
                    usage: None,
                })])
                .collect(),
        );
        let turn = collect_turn(s, |_| {}).await.unwrap();
        assert_eq!(turn.text, long);
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
            let turn = turn_of(text).await;
            assert_eq!(turn.tool_calls.len(), 1, "{text}");
            assert_eq!(turn.tool_calls[0].arguments, "{\"image\":\"img_ab12cd\"}");
            assert!(turn.text.is_empty());
        }
        // A call followed by the result the model imagined: the call runs, the imagined result
        // is dropped; prose after a call stays as the turn's text.
        for (text, rest) in [
            (
                "{\"name\": \"image_info\", \"arguments\": \"{\\\"image\\\":\\\"img_ab12cd\\\"}\"}\n{\"width\": 1600, \"height\": 1600}",
                "",
            ),
            (
                "{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_ab12cd\"}} then I will measure.",
                "then I will measure.",
            ),
        ] {
            let turn = turn_of(text).await;
            assert_eq!(turn.tool_calls.len(), 1, "{text}");
            assert_eq!(turn.tool_calls[0].arguments, "{\"image\":\"img_ab12cd\"}");
            assert_eq!(turn.text, rest);
        }
        // Prose that merely contains JSON stays prose; so does an object that is not a call.
        for text in [
            "The result was {\"a\": 1}.",
            "{\"area\": 12}",
            "{\"area\": 12} {\"name\": \"image_info\", \"arguments\": {}}",
        ] {
            let turn = turn_of(text).await;
            assert!(turn.tool_calls.is_empty(), "{text}");
            assert_eq!(turn.text, text);
        }
    }
}
