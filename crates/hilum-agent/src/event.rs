//! The event stream: the single record of what happened in a run. The CLI renders it, the
//! server streams and stores it, tests read it.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedSender;

use crate::tool::Artifact;
use hilum_llm::Usage;

/// A tool call as announced in a `decision`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallInfo {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// One step of a run. Durations are milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The model answered a turn: its text and the tool calls it asked for.
    Decision {
        round: usize,
        /// `act`, `critique`, `revise` or `synthesis`.
        phase: String,
        text: String,
        tool_calls: Vec<CallInfo>,
        llm_ms: f64,
        usage: Usage,
        /// Ids of the pictures the model was given as pixels in this turn (the question's
        /// images, tools' overlays `ovl_…`); empty when it read ids only.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<String>,
    },
    ToolStarted {
        round: usize,
        call_id: String,
        name: String,
        arguments: Value,
    },
    ToolFinished {
        round: usize,
        call_id: String,
        name: String,
        ms: f64,
        summary: String,
        data: Value,
        artifacts: Vec<Artifact>,
    },
    ToolFailed {
        round: usize,
        call_id: String,
        name: String,
        ms: f64,
        kind: String,
        error: String,
    },
    /// A streamed fragment of model text.
    Token {
        text: String,
    },
    Final {
        answer: String,
        /// Why the loop stopped: `answered`, or the budget that ran out.
        reason: String,
        /// Whether every number and named tool of the answer was found in the tool results,
        /// the question or the image metadata; `null` when the check is turned off.
        #[serde(default)]
        grounded: Option<bool>,
        /// What the answer states that nothing supports (empty when grounded).
        #[serde(default)]
        unsupported: Vec<String>,
        /// Whether the answer addresses every part of the question a tool result covered;
        /// `null` when the question names no known topic (or is multiple choice).
        #[serde(default)]
        answers_question: Option<bool>,
        /// Parts the model's answer left out, stated by Hilum from the tool results instead.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        unanswered: Vec<String>,
        /// Parts no installed tool covers: the answer says so and names the install command.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        cannot_assess: Vec<String>,
        /// Sentences of the model's answer removed because they speak of a finding no tool
        /// result of the run covers.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        dropped: Vec<String>,
    },
    Error {
        message: String,
    },
    Complete {
        ok: bool,
        rounds: usize,
        tool_calls: usize,
        total_ms: f64,
        llm_ms: f64,
        tool_ms: f64,
        usage: Usage,
        /// The model's name (`openai:gpt-4o`, `local-vlm:medgemma-4b-it-q4_k_m.gguf`).
        #[serde(default)]
        model: String,
        /// Every picture the model was given as pixels in the run, by id.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images_seen: Vec<String>,
    },
}

/// An event with the time since the run started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunEvent {
    pub t_ms: f64,
    #[serde(flatten)]
    pub event: Event,
}

/// Where events go. Sending never blocks; a receiver that went away is ignored.
pub type EventSender = UnboundedSender<RunEvent>;
