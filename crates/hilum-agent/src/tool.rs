//! What a tool is: a spec (data) plus one async function.

use std::collections::BTreeMap;

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

pub use hilum_llm::ToolSpec;

/// Facts about the running environment that decide which tools are offered to the model
/// (for instance `models.lung-unet = installed`, `vlm.endpoint = configured`).
#[derive(Clone, Debug, Default)]
pub struct Environment {
    pub facts: BTreeMap<String, String>,
}

impl Environment {
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.facts.insert(key.into(), value.into());
        self
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.facts.get(key).map(String::as_str)
    }
}

/// Per-call context handed to a tool.
#[derive(Clone, Debug, Default)]
pub struct ToolContext {
    pub session_id: String,
    pub call_id: String,
    pub round: usize,
}

/// A file a tool produced (mask, overlay, boxes). Bytes stay in memory; the caller decides
/// where they go (a folder for the CLI, the database for the server).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Artifact {
    /// A file name, unique within one tool output: `overlay.png`, `mask_left_lung.png`.
    pub name: String,
    /// `image/png`, `application/json`, …
    pub media_type: String,
    /// What it shows, for people and UIs: `overlay`, `mask`, `heatmap`, `boxes`.
    pub kind: String,
    #[serde(skip)]
    pub bytes: Bytes,
}

impl Artifact {
    pub fn png(name: impl Into<String>, kind: impl Into<String>, bytes: Vec<u8>) -> Self {
        Artifact {
            name: name.into(),
            media_type: "image/png".into(),
            kind: kind.into(),
            bytes: Bytes::from(bytes),
        }
    }
}

/// What a successful call returns: a short text for the model, JSON for programs, and files.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolOutput {
    pub summary: String,
    pub data: Value,
    #[serde(default)]
    pub artifacts: Vec<Artifact>,
}

impl ToolOutput {
    pub fn new(summary: impl Into<String>, data: Value) -> Self {
        ToolOutput {
            summary: summary.into(),
            data,
            artifacts: Vec::new(),
        }
    }

    pub fn with_artifact(mut self, artifact: Artifact) -> Self {
        self.artifacts.push(artifact);
        self
    }
}

/// Why a tool failed, in words the model (and the user) can act on.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum ToolError {
    /// Arguments that pass the schema but make no sense (box outside the image, …).
    #[error("invalid arguments: {0}")]
    InvalidArguments(String),
    /// An image id or other reference that does not resolve.
    #[error("not found: {0}")]
    NotFound(String),
    /// Weights are not installed; `fix` is the command that installs them.
    #[error("model `{model}` is not installed: run `{fix}`")]
    ModelMissing { model: String, fix: String },
    /// The input cannot be processed (corrupt image, lateral view for a PA-only measure, …).
    #[error("{0}")]
    Unprocessable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

#[async_trait]
pub trait Tool: Send + Sync {
    fn spec(&self) -> &ToolSpec;

    /// Whether the tool is offered to the model in this environment.
    fn available(&self, _env: &Environment) -> bool {
        true
    }

    /// Runs the call. `args` already passed the spec's JSON Schema.
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError>;
}
