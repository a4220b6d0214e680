use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One message of a conversation, in the order the model sees them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    /// The instructions the conversation starts with.
    System {
        /// The text.
        content: String,
    },
    /// A user turn. `images` holds image ids (`img_…`), never paths or pixels.
    User {
        /// The text.
        content: String,
        /// Ids of the images it is about.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        images: Vec<String>,
    },
    /// A model turn: its text and the tool calls it asked for.
    Assistant {
        /// The text.
        #[serde(default)]
        content: String,
        /// The tool calls it asked for.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
    },
    /// The result of one tool call, tied to it by `tool_call_id`.
    Tool {
        /// The call it answers.
        tool_call_id: String,
        /// The tool.
        name: String,
        /// The text.
        content: String,
        /// The call failed; `content` says why.
        #[serde(default)]
        is_error: bool,
    },
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Message::System {
            content: content.into(),
        }
    }

    /// A user turn naming `images` by id.
    pub fn user(content: impl Into<String>, images: Vec<String>) -> Self {
        Message::User {
            content: content.into(),
            images,
        }
    }

    /// An assistant turn.
    pub fn assistant(content: impl Into<String>, tool_calls: Vec<ToolCall>) -> Self {
        Message::Assistant {
            content: content.into(),
            tool_calls,
        }
    }

    /// The text of the message, whatever its role.
    pub fn text(&self) -> &str {
        match self {
            Message::System { content }
            | Message::User { content, .. }
            | Message::Assistant { content, .. }
            | Message::Tool { content, .. } => content,
        }
    }
}

/// A tool call requested by the model. `arguments` is the JSON text exactly as the model wrote
/// it: it is parsed (and repaired when almost valid) by the agent, which reports what was wrong.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The id the tool's result refers to.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments' JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// A call with `arguments` written as JSON text.
    pub fn new(id: impl Into<String>, name: impl Into<String>, arguments: &Value) -> Self {
        ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.to_string(),
        }
    }
}

/// What a model is told about a tool: name, description written for a model, JSON Schema.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The name the model calls it by.
    pub name: String,
    /// What it does and when to use it, for the model.
    pub description: String,
    /// JSON Schema (draft 2020-12 subset) of the arguments object.
    pub parameters: Value,
}

/// Ids of pictures a tool drew (overlays, masks) shown to a model start with this; they name
/// no image a tool can take.
pub const OVERLAY_ID_PREFIX: &str = "ovl_";

/// Whether `id` names a tool's drawing rather than an image of the question.
pub fn is_overlay_id(id: &str) -> bool {
    id.starts_with(OVERLAY_ID_PREFIX)
}

/// Pixels that may be shown to a multimodal model, only when the user allowed it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ImagePayload {
    /// The image id the conversation refers to.
    pub id: String,
    /// `data:image/png;base64,…`
    pub data_url: String,
}

impl ImagePayload {
    /// The payload of PNG bytes (for an image of the question, those of
    /// `hilum_imaging::model_view_png`): one encoding for every front.
    pub fn png(id: impl Into<String>, png: &[u8]) -> Self {
        ImagePayload {
            id: id.into(),
            data_url: format!("data:image/png;base64,{}", crate::base64_encode(png)),
        }
    }
}

/// One completion request.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChatRequest {
    /// The conversation so far.
    pub messages: Vec<Message>,
    /// Empty when the model must answer without tools (final synthesis).
    pub tools: Vec<ToolSpec>,
    /// Sampling temperature (the backend's default when `None`).
    pub temperature: Option<f32>,
    /// Most tokens the reply may have.
    pub max_tokens: Option<u32>,
    /// Pixels of the images the conversation mentions; empty unless sending pixels is allowed.
    pub images: Vec<ImagePayload>,
    /// Text that ends generation (used by the text protocols).
    pub stop: Vec<String>,
    /// The model must call a tool in this turn (OpenAI `tool_choice: "required"`). A hint:
    /// backends that cannot force a call ignore it.
    #[serde(default)]
    pub require_tool: bool,
    /// The reply must be exactly one of these texts (a closed question's options). Backends
    /// that cannot constrain their output (OpenAI-protocol servers) ignore it; the caller reads
    /// the free reply then. Tools, when given, are only part of the prompt: no call is made.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<String>,
    /// The tools a text protocol (ReAct) describes in the prompt, `tools` being empty then: a
    /// backend that constrains its output may hold the model's `Action:` blocks to them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub text_tools: Vec<ToolSpec>,
}

/// Token accounting as reported by the backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the prompt.
    pub prompt_tokens: u32,
    /// Tokens the model wrote.
    pub completion_tokens: u32,
}

/// Why a completion ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model ended its turn.
    #[default]
    Stop,
    /// The turn ended with tool calls.
    ToolCalls,
    /// The token budget ran out.
    Length,
    /// Any other reason the backend gave.
    Other,
}

/// One piece of a streamed completion.
#[derive(Clone, Debug, PartialEq)]
pub enum ChatDelta {
    /// Text of the reply.
    Text(String),
    /// A fragment of the tool call at `index`; `id` and `name` usually come with the first
    /// fragment, `arguments` is appended.
    ToolCall {
        /// Which call of the turn.
        index: usize,
        /// The call's id.
        id: Option<String>,
        /// The tool.
        name: Option<String>,
        /// A piece of the arguments' JSON text.
        arguments: String,
    },
    /// The end of the completion: why, and what it cost.
    Finish {
        /// Why it ended.
        reason: FinishReason,
        /// What it cost, when the backend says.
        usage: Option<Usage>,
    },
}

/// A whole assistant turn, assembled from deltas.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AssistantTurn {
    /// The reply's text.
    pub text: String,
    /// The tool calls it asked for, in order.
    pub tool_calls: Vec<ToolCall>,
    /// Why it ended.
    pub finish: FinishReason,
    /// What it cost.
    pub usage: Usage,
}

/// What a backend supports; the agent chooses its protocol from it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// OpenAI-style function calling.
    pub native_tools: bool,
    /// Several tool calls in one assistant message.
    pub parallel_tool_calls: bool,
    /// Accepts image pixels.
    pub images: bool,
    /// Runs on this machine (nothing leaves it).
    pub local: bool,
    /// Runs inside this process. Such a model gets the question's pixels and the tools' overlays
    /// without being allowed to: they never leave the process. A loopback server is `local` but
    /// not this (its port may be a tunnel to another machine), so it gets pixels only with
    /// `--send-pixels`.
    pub in_process: bool,
}
