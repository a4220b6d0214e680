//! Durable runs, after LangGraph's checkpointers: the loop hands every finished step (the
//! question, each round's decision, each tool result) to a [`Checkpointer`] and waits until it
//! is stored before it goes on, so what a run acted upon is what was written. A run that
//! stopped half-way (a crash, a shutdown) continues from what was stored with
//! [`crate::Agent::run_durable`] and a [`Resume`]: finished tool calls are reused, never rerun.

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::toolbox::CallResult;
use hilum_llm::Message;

/// The loop's counters at a checkpoint: with the stored messages and results, all a run needs
/// to continue.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Tool rounds run.
    pub rounds: usize,
    /// Tool calls made.
    pub tool_calls: usize,
    /// Reflexion critiques made.
    pub critiques: usize,
    /// `act`, `critique`, `revise` or `synthesis`.
    pub phase: String,
    /// The model was already asked once to call a tool.
    pub tools_requested: bool,
    /// A grounding revision was already asked for.
    pub revision_requested: bool,
}

/// Where a durable run writes its steps. An error stops the run: a step that cannot be
/// stored must not be acted upon.
#[async_trait]
pub trait Checkpointer: Send + Sync {
    /// Messages appended to the conversation since the last save (the question first; a
    /// round's decision last), with the counters as they stand after them.
    async fn messages(&self, new: &[Message], progress: &Progress) -> Result<(), String>;

    /// One tool call of `round` finished (or failed): its result and the tool message the
    /// model will read. Called as each call ends, in the order they end.
    async fn tool_result(
        &self,
        round: usize,
        result: &CallResult,
        message: &Message,
    ) -> Result<(), String>;
}

/// What a run stored before it stopped.
#[derive(Clone, Debug, Default)]
pub struct Resume {
    /// The run's stored messages in the order they were stored, its question first.
    pub messages: Vec<Message>,
    /// Tool calls that finished, each with its round.
    pub results: Vec<(usize, CallResult)>,
    /// The counters of the last checkpoint.
    pub progress: Progress,
}

/// Puts the tool messages that follow each decision in the order of its calls (they are
/// stored in the order the calls finished).
pub(crate) fn order_tool_messages(messages: &mut [Message]) {
    let mut i = 0;
    while i < messages.len() {
        let calls: Vec<String> = match &messages[i] {
            Message::Assistant { tool_calls, .. } if !tool_calls.is_empty() => {
                tool_calls.iter().map(|c| c.id.clone()).collect()
            }
            _ => {
                i += 1;
                continue;
            }
        };
        let start = i + 1;
        let mut end = start;
        while end < messages.len() && matches!(messages[end], Message::Tool { .. }) {
            end += 1;
        }
        messages[start..end].sort_by_key(|m| match m {
            Message::Tool { tool_call_id, .. } => calls
                .iter()
                .position(|c| c == tool_call_id)
                .unwrap_or(usize::MAX),
            _ => usize::MAX,
        });
        i = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hilum_llm::ToolCall;

    fn tool(id: &str) -> Message {
        Message::Tool {
            tool_call_id: id.into(),
            name: "t".into(),
            content: id.into(),
            is_error: false,
        }
    }

    #[test]
    fn tool_messages_follow_the_order_of_the_calls() {
        let calls = vec![
            ToolCall::new("a", "t", &serde_json::json!({})),
            ToolCall::new("b", "t", &serde_json::json!({})),
        ];
        let mut m = vec![
            Message::user("q", vec![]),
            Message::assistant("", calls),
            tool("b"),
            tool("a"),
            Message::user("next", vec![]),
        ];
        order_tool_messages(&mut m);
        let ids: Vec<String> = m
            .iter()
            .filter_map(|m| match m {
                Message::Tool { tool_call_id, .. } => Some(tool_call_id.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(ids, ["a", "b"]);
        assert!(matches!(&m[4], Message::User { content, .. } if content == "next"));
    }
}
