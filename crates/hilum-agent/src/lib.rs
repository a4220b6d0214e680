//! The Hilum reasoning loop: tools and the toolbox, rounds whose tool calls run concurrently
//! (each with a timeout and panic isolation), the native and ReAct protocols, budgets,
//! reflexion, the grounding check on final answers, and the event stream. It knows nothing about
//! X-rays.

#![warn(missing_docs)]

mod agent;
mod checkpoint;
pub mod coverage;
mod event;
pub mod grounding;
pub mod protocol;
pub mod repair;
mod tool;
mod toolbox;

pub use agent::{
    Agent, AgentConfig, Mode, RunInput, RunOutcome, StopReason, ToolPolicy, DEFAULT_SYSTEM_PROMPT,
};
pub use checkpoint::{Checkpointer, Progress, Resume};
pub use coverage::{Capability, Coverage, Topic};
pub use event::{CallInfo, Event, EventSender, RunEvent};
pub use protocol::{ParsedTurn, Protocol};
pub use schemars;
pub use tool::{
    schema_of, Artifact, Environment, Requirements, Tool, ToolContext, ToolError, ToolOutput,
    ToolSpec, Typed, TypedTool,
};
pub use toolbox::{run_prepared, CallFailure, CallResult, FailureKind, PreparedCall, Toolbox};

pub use hilum_llm as llm;
pub use hilum_llm::{Llm, Message, ToolCall};
