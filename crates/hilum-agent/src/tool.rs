//! What a tool is: a spec (data) plus one async function.

use std::collections::BTreeMap;

use async_trait::async_trait;
use bytes::Bytes;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use thiserror::Error;

pub use hilum_llm::ToolSpec;

use crate::coverage::Capability;

/// Facts about the running environment that decide which tools are offered to the model
/// (for instance `models.lung-unet = installed`, `vlm.endpoint = configured`).
#[derive(Clone, Debug, Default)]
pub struct Environment {
    /// Key-value facts (`models.lung-unet` → `installed`).
    pub facts: BTreeMap<String, String>,
}

impl Environment {
    /// With one more fact.
    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.facts.insert(key.into(), value.into());
        self
    }

    /// The fact for `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.facts.get(key).map(String::as_str)
    }
}

/// Per-call context handed to a tool.
#[derive(Clone, Debug, Default)]
pub struct ToolContext {
    /// The session the call belongs to.
    pub session_id: String,
    /// The call's id.
    pub call_id: String,
    /// The round it runs in.
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
    /// The file's bytes (not serialised).
    #[serde(skip)]
    pub bytes: Bytes,
}

impl Artifact {
    /// A PNG artifact.
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
    /// One line for the model.
    pub summary: String,
    /// The result as JSON.
    pub data: Value,
    /// Files it produced.
    #[serde(default)]
    pub artifacts: Vec<Artifact>,
}

impl ToolOutput {
    /// An output without files.
    pub fn new(summary: impl Into<String>, data: Value) -> Self {
        ToolOutput {
            summary: summary.into(),
            data,
            artifacts: Vec::new(),
        }
    }

    /// With one more file.
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
    ModelMissing {
        /// The model's id.
        model: String,
        /// The command that installs it.
        fix: String,
    },
    /// The input cannot be processed (corrupt image, lateral view for a PA-only measure, …).
    #[error("{0}")]
    Unprocessable(String),
    /// A bug or an environment failure.
    #[error("internal error: {0}")]
    Internal(String),
}

/// What a tool needs before it can run, declared once by the tool and read by every front
/// end (the CLI, the server, MCP, the local model's tool offer) through [`Environment`] facts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Requirements {
    /// Model ids; the tool runs when at least one of them is installed (empty: no model).
    pub models: &'static [&'static str],
    /// A served VLM endpoint (or a native VLM) must be configured.
    pub vlm: bool,
    /// Only meaningful when a DICOM image is in the question.
    pub dicom_input: bool,
    /// Draws for the user and informs no answer (not offered to small local models).
    pub presentation: bool,
}

impl Requirements {
    /// Needs nothing.
    pub const NONE: Requirements = Requirements {
        models: &[],
        vlm: false,
        dicom_input: false,
        presentation: false,
    };

    /// The fact key saying that model `id` is installed.
    pub fn model_fact(id: &str) -> String {
        format!("model:{id}")
    }
    /// The fact key whose value is the command that installs model `id` (set for the models
    /// that are not installed).
    pub fn install_fact(id: &str) -> String {
        format!("install:{id}")
    }
    /// The fact key saying that a VLM is configured.
    pub const VLM_FACT: &'static str = "vlm";
    /// The fact key saying that a DICOM image is among the inputs.
    pub const DICOM_FACT: &'static str = "input:dicom";

    /// Whether every model the tool could use is known to be missing: `env` names the command
    /// that installs each ([`Requirements::install_fact`]) and none is installed. An
    /// environment that says nothing about a model (a program that never asked the registry)
    /// withholds nothing.
    pub fn models_missing(&self, env: &Environment) -> bool {
        models_missing(self.models, env)
    }

    /// What does not hold in `env`, in words; empty when the tool can run and inform an answer.
    pub fn unmet(&self, env: &Environment) -> Vec<String> {
        let mut unmet = Vec::new();
        if !self.models.is_empty()
            && !self
                .models
                .iter()
                .any(|m| env.get(&Self::model_fact(m)).is_some())
        {
            unmet.push(format!("none of the models {:?} is installed", self.models));
        }
        if self.vlm && env.get(Self::VLM_FACT).is_none() {
            unmet.push("no VLM is configured".into());
        }
        if self.dicom_input && env.get(Self::DICOM_FACT).is_none() {
            unmet.push("no DICOM image among the inputs".into());
        }
        if self.presentation {
            unmet.push("draws for the user only".into());
        }
        unmet
    }
}

/// See [`Requirements::models_missing`].
pub(crate) fn models_missing(models: &[&str], env: &Environment) -> bool {
    !models.is_empty()
        && models.iter().all(|m| {
            env.get(&Requirements::model_fact(m)).is_none()
                && env.get(&Requirements::install_fact(m)).is_some()
        })
}

/// A tool the agent can call: its spec and one async function.
#[async_trait]
pub trait Tool: Send + Sync {
    /// Name, description and argument schema, as the model sees them.
    fn spec(&self) -> &ToolSpec;

    /// What the tool needs; see [`Requirements`].
    fn requirements(&self) -> Requirements {
        Requirements::NONE
    }

    /// Whether the tool is offered to the model in this environment (a configuration problem
    /// a call should report stays offered; requirements decide the strict offer, see
    /// [`crate::Toolbox::runnable`]).
    fn available(&self, _env: &Environment) -> bool {
        true
    }

    /// The topics the tool can answer (see [`crate::coverage`]); empty: it speaks to none in
    /// particular (image metadata, drawings).
    fn capabilities(&self) -> Vec<Capability> {
        Vec::new()
    }

    /// What a result of this tool says about one of its capabilities, in one sentence without
    /// the tool's name; `None`: its summary says it.
    fn state(&self, _capability: &Capability, _out: &ToolOutput) -> Option<String> {
        None
    }

    /// Runs the call. `args` already passed the spec's JSON Schema.
    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError>;
}

/// A tool with typed arguments: the JSON Schema the model reads and the agent validates against
/// is generated from `Args` (its doc comments become descriptions, `#[schemars(range(..))]`
/// the bounds), so checks live in one place. Wrap it in [`Typed`] to get a [`Tool`].
#[async_trait]
pub trait TypedTool: Send + Sync + 'static {
    /// The arguments; their schema is what the model reads.
    type Args: DeserializeOwned + JsonSchema + Send;
    /// The name the model calls it by.
    const NAME: &'static str;

    /// The description the model reads.
    fn description(&self) -> String;

    /// See [`Tool::requirements`].
    fn requirements(&self) -> Requirements {
        Requirements::NONE
    }

    /// See [`Tool::available`].
    fn available(&self, _env: &Environment) -> bool {
        true
    }

    /// See [`Tool::capabilities`].
    fn capabilities(&self) -> Vec<Capability> {
        Vec::new()
    }

    /// See [`Tool::state`].
    fn state(&self, _capability: &Capability, _out: &ToolOutput) -> Option<String> {
        None
    }

    /// Runs the call with arguments that passed the schema.
    async fn run(&self, ctx: &ToolContext, args: Self::Args) -> Result<ToolOutput, ToolError>;
}

/// The JSON Schema of `T` as tools publish it: subschemas inlined (models and grammar
/// compilers handle no `$ref`), an optional field is its inner type left out of `required`,
/// no `$schema`/`title` noise.
pub fn schema_of<T: JsonSchema>() -> Value {
    let mut settings = schemars::generate::SchemaSettings::draft07();
    settings.inline_subschemas = true;
    let schema = settings.into_generator().into_root_schema_for::<T>();
    let mut value = schema.to_value();
    if let Some(obj) = value.as_object_mut() {
        obj.remove("$schema");
        obj.remove("title");
        obj.remove("definitions");
        obj.remove("$defs");
    }
    drop_null(&mut value);
    value
}

/// `"type": ["number", "null"]` → `"type": "number"`, `{"type": "null"}` out of `anyOf`, `null`
/// out of `enum`: an absent optional field is how a model leaves a value out, and a `null` it
/// could write instead would only be one more way to be wrong.
fn drop_null(v: &mut Value) {
    match v {
        Value::Object(obj) => {
            if let Some(Value::Array(types)) = obj.get_mut("type") {
                types.retain(|t| t != "null");
                if types.len() == 1 {
                    let only = types.remove(0);
                    obj.insert("type".into(), only);
                }
            }
            if let Some(Value::Array(values)) = obj.get_mut("enum") {
                values.retain(|v| !v.is_null());
            }
            if let Some(Value::Array(any)) = obj.get_mut("anyOf") {
                any.retain(|s| s.get("type").is_none_or(|t| t != "null"));
                if any.len() == 1 {
                    let only = any.remove(0);
                    obj.remove("anyOf");
                    if let Value::Object(inner) = only {
                        for (k, val) in inner {
                            obj.entry(k).or_insert(val);
                        }
                    }
                }
            }
            if obj.get("default") == Some(&Value::Null) {
                obj.remove("default");
            }
            for child in obj.values_mut() {
                drop_null(child);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(drop_null),
        _ => {}
    }
}

/// A [`TypedTool`] as a [`Tool`]: the spec is generated once; arguments are checked against it
/// and deserialised into `Args` (a mismatch is an `invalid_arguments` error).
pub struct Typed<T: TypedTool> {
    spec: ToolSpec,
    /// The spec's schema, compiled. The toolbox checks calls the model makes; this checks the
    /// ones a program makes directly, so the bounds in `Args` are the only ones a tool needs.
    validator: Option<jsonschema::Validator>,
    inner: T,
}

impl<T: TypedTool> Typed<T> {
    /// Wraps `inner`, generating its spec from `T::Args`.
    pub fn new(inner: T) -> Self {
        let parameters = schema_of::<T::Args>();
        // A schema that does not compile is reported by `Toolbox::register`.
        let validator = jsonschema::validator_for(&parameters).ok();
        Typed {
            spec: ToolSpec {
                name: T::NAME.into(),
                description: inner.description(),
                parameters,
            },
            validator,
            inner,
        }
    }

    /// The wrapped tool.
    pub fn inner(&self) -> &T {
        &self.inner
    }
}

impl<T: TypedTool> std::ops::Deref for Typed<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.inner
    }
}

#[async_trait]
impl<T: TypedTool> Tool for Typed<T> {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn requirements(&self) -> Requirements {
        self.inner.requirements()
    }

    fn available(&self, env: &Environment) -> bool {
        self.inner.available(env)
    }

    fn capabilities(&self) -> Vec<Capability> {
        self.inner.capabilities()
    }

    fn state(&self, capability: &Capability, out: &ToolOutput) -> Option<String> {
        self.inner.state(capability, out)
    }

    async fn call(&self, ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        if let Some(validator) = &self.validator {
            let problems: Vec<String> = validator
                .iter_errors(&args)
                .map(|e| {
                    let path = e.instance_path.to_string();
                    if path.is_empty() {
                        e.to_string()
                    } else {
                        format!("{path}: {e}")
                    }
                })
                .collect();
            if !problems.is_empty() {
                return Err(ToolError::InvalidArguments(format!(
                    "{}: {}",
                    T::NAME,
                    problems.join("; ")
                )));
            }
        }
        let args: T::Args = serde_json::from_value(args)
            .map_err(|e| ToolError::InvalidArguments(format!("{}: {e}", T::NAME)))?;
        self.inner.run(ctx, args).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Deserialize, JsonSchema)]
    #[serde(rename_all = "lowercase")]
    enum Side {
        Left,
        Right,
    }

    #[derive(Deserialize, JsonSchema)]
    #[serde(deny_unknown_fields)]
    struct Args {
        /// Which side
        #[serde(default)]
        side: Option<Side>,
        #[schemars(range(min = 1, max = 3))]
        count: u32,
    }

    struct Count;

    #[async_trait]
    impl TypedTool for Count {
        type Args = Args;
        const NAME: &'static str = "count";

        fn description(&self) -> String {
            "counts".into()
        }

        async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
            let side = match args.side {
                Some(Side::Left) => "left",
                Some(Side::Right) => "right",
                None => "none",
            };
            Ok(ToolOutput::new(
                format!("{} {side}", args.count),
                Value::Null,
            ))
        }
    }

    #[test]
    fn an_optional_enum_offers_no_null() {
        let s = schema_of::<Args>();
        assert_eq!(s["properties"]["side"]["enum"], json!(["left", "right"]));
        assert_eq!(s["properties"]["side"]["type"], "string");
        assert_eq!(s["required"], json!(["count"]));
    }

    /// A program calling the tool directly gets the bounds the agent enforces.
    #[tokio::test]
    async fn direct_calls_are_checked_against_the_schema() {
        let tool = Typed::new(Count);
        let ctx = ToolContext::default();
        let out = tool.call(&ctx, json!({"count": 2, "side": "left"})).await;
        assert_eq!(out.map(|o| o.summary), Ok("2 left".to_string()));
        for bad in [
            json!({"count": 9}),
            json!({"count": 1, "side": "up"}),
            json!({}),
        ] {
            let e = tool.call(&ctx, bad.clone()).await.expect_err("refused");
            assert!(
                matches!(&e, ToolError::InvalidArguments(m) if m.starts_with("count: ")),
                "{bad}: {e}"
            );
        }
    }
}
