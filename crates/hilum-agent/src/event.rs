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
    /// The call's id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// The arguments' JSON text, as the model wrote them.
    pub arguments: String,
}

/// One step of a run. Durations are milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The model answered a turn: its text and the tool calls it asked for.
    Decision {
        /// The round (1-based).
        round: usize,
        /// `act`, `critique`, `revise` or `synthesis`.
        phase: String,
        /// The text.
        text: String,
        /// Tool calls made.
        tool_calls: Vec<CallInfo>,
        /// Milliseconds in the model.
        llm_ms: f64,
        /// Tokens.
        usage: Usage,
        /// Ids of the pictures the model was given as pixels in this turn (the question's
        /// images, tools' overlays `ovl_…`); empty when it read ids only.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<String>,
    },
    /// A tool call started.
    ToolStarted {
        /// The round (1-based).
        round: usize,
        /// The call's id.
        call_id: String,
        /// The tool.
        name: String,
        /// The arguments.
        arguments: Value,
    },
    /// A tool call succeeded.
    ToolFinished {
        /// The round (1-based).
        round: usize,
        /// The call's id.
        call_id: String,
        /// The tool.
        name: String,
        /// Milliseconds the call took.
        ms: f64,
        /// The tool's one-line summary.
        summary: String,
        /// The tool's JSON result.
        data: Value,
        /// Files it produced.
        artifacts: Vec<Artifact>,
    },
    /// A tool call failed.
    ToolFailed {
        /// The round (1-based).
        round: usize,
        /// The call's id.
        call_id: String,
        /// The tool.
        name: String,
        /// Milliseconds the call took.
        ms: f64,
        /// The failure's kind (`timeout`, `tool_error`, …).
        kind: String,
        /// What happened.
        error: String,
    },
    /// A streamed fragment of model text.
    Token {
        /// The text.
        text: String,
    },
    /// The answer.
    Final {
        /// The answer's text.
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
    /// The run failed.
    Error {
        /// What failed.
        message: String,
    },
    /// The run is over: totals.
    Complete {
        /// Whether the run ended with an answer.
        ok: bool,
        /// Tool rounds run.
        rounds: usize,
        /// Tool calls made.
        tool_calls: usize,
        /// Milliseconds of the run.
        total_ms: f64,
        /// Milliseconds in the model.
        llm_ms: f64,
        /// Milliseconds in tools.
        tool_ms: f64,
        /// Tokens.
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
    /// Milliseconds since the run started.
    pub t_ms: f64,
    /// What happened.
    #[serde(flatten)]
    pub event: Event,
}

/// Where events go. Sending never blocks; a receiver that went away is ignored.
pub type EventSender = UnboundedSender<RunEvent>;
