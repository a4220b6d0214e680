//! Language-model backends for Hilum: the chat vocabulary shared by every backend, the [`Llm`]
//! trait, and its implementations (OpenAI-compatible HTTP, scripted replay). In-process GGUF
//! models implement the trait in `hilum-llm-local`.
//!
//! The message types live here rather than in `hilum-agent` because every backend must speak
//! them; the agent crate re-exports them.

#![warn(missing_docs)]

mod error;
mod message;
mod openai;
pub mod script;
mod stream;

pub use error::LlmError;
pub use message::{
    is_overlay_id, AssistantTurn, Capabilities, ChatDelta, ChatRequest, FinishReason, ImagePayload,
    Message, ToolCall, ToolSpec, Usage, OVERLAY_ID_PREFIX,
};
pub use openai::{base64_encode, is_loopback_url, Completion, OpenAiConfig, OpenAiLlm};
pub use script::ScriptLlm;
pub use stream::{collect_turn, DeltaStream};

use async_trait::async_trait;

/// A chat model. `chat` returns a stream of deltas; [`collect_turn`] assembles them.
#[async_trait]
pub trait Llm: Send + Sync {
    /// Starts one completion. Errors before the first delta (connection, 401, 404) are returned
    /// here; errors mid-stream arrive as items of the stream.
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError>;

    /// What this backend can do; the agent picks a protocol from it.
    fn capabilities(&self) -> Capabilities;

    /// A short name for logs and events, e.g. `openai:gpt-4o`.
    fn name(&self) -> String;
}
