//! The toolbox: registered tools, argument checking, and isolated execution of one call.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use serde::Serialize;
use serde_json::Value;
use tracing::Instrument;

use crate::coverage::Topic;
use crate::repair::parse_lenient;
use crate::tool::{Environment, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use hilum_llm::ToolCall;

/// Why a call produced no output. Each kind gets its own message for the model.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The model named a tool that is not offered.
    UnknownTool,
    /// The arguments do not fit the schema or make no sense.
    InvalidArguments,
    /// The call ran past its budget.
    Timeout,
    /// The tool panicked.
    Panic,
    /// The tool reported an error.
    ToolError,
    /// The run's call budget was spent.
    Budget,
    /// Not run: the same tool with the same arguments already succeeded in this run.
    Repeated,
}

impl FailureKind {
    /// The kind's name in events and records.
    pub fn as_str(&self) -> &'static str {
        match self {
            FailureKind::UnknownTool => "unknown_tool",
            FailureKind::InvalidArguments => "invalid_arguments",
            FailureKind::Timeout => "timeout",
            FailureKind::Panic => "panic",
            FailureKind::ToolError => "tool_error",
            FailureKind::Budget => "budget",
            FailureKind::Repeated => "repeated",
        }
    }

    /// The kind named by [`FailureKind::as_str`] (for results read back from storage).
    pub fn from_name(name: &str) -> Option<FailureKind> {
        [
            FailureKind::UnknownTool,
            FailureKind::InvalidArguments,
            FailureKind::Timeout,
            FailureKind::Panic,
            FailureKind::ToolError,
            FailureKind::Budget,
            FailureKind::Repeated,
        ]
        .into_iter()
        .find(|k| k.as_str() == name)
    }
}

/// A failed call: its kind and a message written for the model.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CallFailure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// What happened, for the model.
    pub message: String,
}

/// The outcome of one tool call.
#[derive(Clone, Debug)]
pub struct CallResult {
    /// The call as the model made it.
    pub call: ToolCall,
    /// Arguments as executed (after repair), when they could be read.
    pub arguments: Option<Value>,
    /// Whether the arguments needed repair to be read.
    pub repaired: bool,
    /// Its output or why there is none.
    pub result: Result<ToolOutput, CallFailure>,
    /// How long it took.
    pub ms: f64,
}

/// A call whose tool and arguments have been checked, ready to run.
pub struct PreparedCall {
    /// The call as the model made it.
    pub call: ToolCall,
    /// The tool it names.
    pub tool: Arc<dyn Tool>,
    /// The checked arguments.
    pub arguments: Value,
    /// They needed repair to be read.
    pub repaired: bool,
}

#[derive(Clone)]
struct Entry {
    tool: Arc<dyn Tool>,
    validator: Option<Arc<jsonschema::Validator>>,
    /// Left out of the offer by [`Toolbox::runnable`]; still known for the capability table.
    withheld: bool,
}

/// The registered tools, in registration order, and the vocabulary of topics a question can
/// ask about (see [`crate::coverage`]).
#[derive(Default)]
pub struct Toolbox {
    order: Vec<String>,
    tools: BTreeMap<String, Entry>,
    vocabulary: Vec<&'static Topic>,
}

impl Toolbox {
    /// An empty toolbox.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a tool; a tool with the same name replaces the earlier one.
    /// A schema that does not compile is a programming error reported here, not at call time.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), String> {
        let spec = tool.spec().clone();
        let validator = jsonschema::validator_for(&spec.parameters)
            .map_err(|e| format!("tool `{}` has an invalid JSON Schema: {e}", spec.name))?;
        if !self.tools.contains_key(&spec.name) {
            self.order.push(spec.name.clone());
        }
        self.tools.insert(
            spec.name,
            Entry {
                tool,
                validator: Some(Arc::new(validator)),
                withheld: false,
            },
        );
        Ok(())
    }

    /// The topics questions are matched against before the first round; empty: no coverage
    /// check.
    pub fn set_vocabulary(&mut self, topics: Vec<&'static Topic>) {
        self.vocabulary = topics;
    }

    /// The topics a question can ask about.
    pub fn vocabulary(&self) -> &[&'static Topic] {
        &self.vocabulary
    }

    /// Every registered tool, offered or not, in registration order (the capability table's
    /// rows, [`crate::coverage::capability_table`]).
    pub fn all_tools(&self) -> Vec<Arc<dyn Tool>> {
        self.order
            .iter()
            .filter_map(|n| self.tools.get(n))
            .map(|e| e.tool.clone())
            .collect()
    }

    fn offered(&self, name: &str) -> Option<&Entry> {
        self.tools.get(name).filter(|e| !e.withheld)
    }

    /// With `tool` registered.
    pub fn with(mut self, tool: Arc<dyn Tool>) -> Result<Self, String> {
        self.register(tool)?;
        Ok(self)
    }

    /// The offered tool of that name.
    pub fn get(&self, name: &str) -> Option<Arc<dyn Tool>> {
        self.offered(name).map(|e| e.tool.clone())
    }

    /// Names of the offered tools, in registration order.
    pub fn names(&self) -> Vec<String> {
        self.order
            .iter()
            .filter(|n| self.offered(n).is_some())
            .cloned()
            .collect()
    }

    /// Specs of the tools offered in `env`, in registration order: available, and with a
    /// model installed where the tool needs one. Every front end (CLI, server, MCP, eval)
    /// offers these; a tool whose model is missing is named by the coverage check where a
    /// question needs it, not offered to fail.
    pub fn specs(&self, env: &Environment) -> Vec<ToolSpec> {
        self.order
            .iter()
            .filter_map(|n| self.offered(n))
            .filter(|e| e.tool.available(env) && !e.tool.requirements().models_missing(env))
            .map(|e| e.tool.spec().clone())
            .collect()
    }

    /// The tools whose declared [`crate::Requirements`] hold in `env` (models installed, VLM
    /// configured, DICOM input present, not presentation-only): the offer for a small local
    /// model, which calls whatever it is shown.
    /// The others stay known to the capability table (withheld, not offered).
    pub fn runnable(&self, env: &Environment) -> Toolbox {
        let mut kept = Toolbox {
            order: self.order.clone(),
            tools: BTreeMap::new(),
            vocabulary: self.vocabulary.clone(),
        };
        for (name, entry) in &self.tools {
            let runs = entry.tool.available(env) && entry.tool.requirements().unmet(env).is_empty();
            let mut entry = entry.clone();
            entry.withheld |= !runs;
            kept.tools.insert(name.clone(), entry);
        }
        kept
    }

    /// Resolves the tool and reads and validates the arguments.
    pub fn prepare(&self, call: &ToolCall, env: &Environment) -> Result<PreparedCall, CallFailure> {
        let entry = self
            .offered(&call.name)
            .filter(|e| e.tool.available(env))
            .ok_or_else(|| CallFailure {
                kind: FailureKind::UnknownTool,
                message: format!(
                    "there is no tool named `{}`. Available tools: {}.",
                    call.name,
                    self.specs(env)
                        .iter()
                        .map(|s| s.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            })?;
        let parsed = parse_lenient(&call.arguments).map_err(|e| CallFailure {
            kind: FailureKind::InvalidArguments,
            message: format!(
                "the arguments of `{}` are not valid JSON ({e}). Send one JSON object matching the tool's schema.",
                call.name
            ),
        })?;
        if let Some(validator) = &entry.validator {
            let problems: Vec<String> = validator
                .iter_errors(&parsed.value)
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
                return Err(CallFailure {
                    kind: FailureKind::InvalidArguments,
                    message: format!(
                        "the arguments of `{}` do not match its schema: {}. Schema: {}",
                        call.name,
                        problems.join("; "),
                        entry.tool.spec().parameters
                    ),
                });
            }
        }
        Ok(PreparedCall {
            call: call.clone(),
            tool: entry.tool.clone(),
            arguments: parsed.value,
            repaired: parsed.repaired,
        })
    }

    /// Prepares and runs one call with a timeout and panic isolation. Used by the agent's
    /// rounds and by direct calls (`hilum tools call`, the server's `tools/{name}:call`).
    pub async fn execute(
        &self,
        call: &ToolCall,
        env: &Environment,
        ctx: ToolContext,
        timeout: Duration,
    ) -> CallResult {
        let started = Instant::now();
        match self.prepare(call, env) {
            Ok(prepared) => run_prepared(prepared, ctx, timeout).await,
            Err(failure) => {
                let result = CallResult {
                    call: call.clone(),
                    arguments: None,
                    repaired: false,
                    result: Err(failure),
                    ms: started.elapsed().as_secs_f64() * 1e3,
                };
                log_rejected(ctx.round, &result);
                result
            }
        }
    }
}

/// The span of one tool call: the tool, the call id and the round. Never its arguments or
/// results (they may name a patient or carry pixels). An id the model made up is logged only
/// when it looks like one.
fn tool_span(name: &str, call_id: &str, round: usize) -> tracing::Span {
    tracing::info_span!(
        "tool_call",
        tool = loggable(name),
        call_id = loggable(call_id),
        round
    )
}

/// Logs a call that failed before it ran (unknown tool, invalid arguments, a budget). The
/// name of a tool that does not exist is the model's free text: it is not logged.
pub(crate) fn log_rejected(round: usize, r: &CallResult) {
    let unknown = matches!(&r.result, Err(f) if f.kind == FailureKind::UnknownTool);
    let name = if unknown {
        "(unknown)"
    } else {
        r.call.name.as_str()
    };
    log_outcome(&tool_span(name, &r.call.id, round), r);
}

/// Logs a finished call inside its span: how long it took and whether it worked.
fn log_outcome(span: &tracing::Span, r: &CallResult) {
    let ms = r.ms;
    span.in_scope(|| match &r.result {
        Ok(_) => tracing::info!(duration_ms = ms, outcome = "ok", "tool call finished"),
        Err(f) => tracing::warn!(
            duration_ms = ms,
            outcome = "error",
            error_kind = f.kind.as_str(),
            "tool call failed"
        ),
    });
}

/// `s` when it is a short identifier (a tool name, a call id), else a placeholder: what a
/// model sends as a name is free text.
fn loggable(s: &str) -> &str {
    let ident = s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ident && !s.is_empty() {
        s
    } else {
        "(not an identifier)"
    }
}

/// Runs a prepared call on its own task: a panic or a timeout becomes this call's failure and
/// nothing else is affected.
pub async fn run_prepared(
    prepared: PreparedCall,
    ctx: ToolContext,
    timeout: Duration,
) -> CallResult {
    let started = Instant::now();
    let PreparedCall {
        call,
        tool,
        arguments,
        repaired,
    } = prepared;
    let name = call.name.clone();
    let args = arguments.clone();
    let span = tool_span(&call.name, &call.id, ctx.round);
    // The tool's own lines carry the call's span (and the request's, when there is one).
    let task = tokio::spawn(
        async move {
            let fut = std::panic::AssertUnwindSafe(tool.call(&ctx, args)).catch_unwind();
            tokio::time::timeout(timeout, fut).await
        }
        .instrument(span.clone()),
    );
    let result = match task.await {
        Ok(Ok(Ok(Ok(output)))) => Ok(output),
        Ok(Ok(Ok(Err(e)))) => Err(CallFailure {
            kind: FailureKind::ToolError,
            message: tool_error_message(&name, &e),
        }),
        Ok(Ok(Err(panic))) => Err(panic_failure(&name, panic_text(&*panic))),
        Ok(Err(_elapsed)) => Err(CallFailure {
            kind: FailureKind::Timeout,
            message: format!(
                "`{name}` did not finish within {:.1} s and was stopped. Try fewer or smaller inputs, or answer without it.",
                timeout.as_secs_f64()
            ),
        }),
        Err(join) if join.is_panic() => Err(panic_failure(&name, panic_text(&*join.into_panic()))),
        Err(join) => Err(CallFailure {
            kind: FailureKind::Panic,
            message: format!("`{name}` was cancelled: {join}"),
        }),
    };
    let result = CallResult {
        call,
        arguments: Some(arguments),
        repaired,
        result,
        ms: started.elapsed().as_secs_f64() * 1e3,
    };
    log_outcome(&span, &result);
    result
}

fn tool_error_message(name: &str, e: &ToolError) -> String {
    format!("`{name}` failed: {e}")
}

fn panic_failure(name: &str, what: String) -> CallFailure {
    CallFailure {
        kind: FailureKind::Panic,
        message: format!(
            "`{name}` crashed ({what}). This is a bug in the tool, not in your request; do not retry it with the same input."
        ),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}
