//! Tools for end-to-end tests of the loop: real async tools with controllable behaviour.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hilum::agent::{
    Agent, AgentConfig, Environment, RunEvent, RunInput, RunOutcome, Tool, ToolContext, ToolError,
    ToolOutput, ToolSpec, Toolbox,
};
use hilum::llm::Llm;
use serde_json::{json, Value};

pub enum Behaviour {
    Sleep(Duration),
    Panic,
    Fail,
}

pub struct TestTool {
    spec: ToolSpec,
    behaviour: Behaviour,
}

impl TestTool {
    pub fn shared(name: &str, behaviour: Behaviour) -> Arc<dyn Tool> {
        Arc::new(TestTool {
            spec: ToolSpec {
                name: name.into(),
                description: format!("test tool {name}"),
                parameters: json!({
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                    "additionalProperties": false
                }),
            },
            behaviour,
        })
    }
}

#[async_trait]
impl Tool for TestTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    async fn call(&self, _ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        let x = args["x"].as_i64().unwrap_or_default();
        match self.behaviour {
            Behaviour::Sleep(d) => {
                tokio::time::sleep(d).await;
                Ok(ToolOutput::new(
                    format!("{} saw x={x}", self.spec.name),
                    json!({"x": x, "doubled": x * 2}),
                ))
            }
            Behaviour::Panic => panic!("boom in {}", self.spec.name),
            Behaviour::Fail => Err(ToolError::Unprocessable(format!(
                "x={x} cannot be processed"
            ))),
        }
    }
}

pub fn toolbox() -> Arc<Toolbox> {
    let mut tb = Toolbox::new();
    for t in [
        TestTool::shared("fast", Behaviour::Sleep(Duration::ZERO)),
        TestTool::shared("slow_a", Behaviour::Sleep(Duration::from_millis(300))),
        TestTool::shared("slow_b", Behaviour::Sleep(Duration::from_millis(300))),
        TestTool::shared("slow_c", Behaviour::Sleep(Duration::from_millis(300))),
        TestTool::shared("hang", Behaviour::Sleep(Duration::from_secs(30))),
        TestTool::shared("crash", Behaviour::Panic),
        TestTool::shared("broken", Behaviour::Fail),
    ] {
        tb.register(t).expect("valid schema");
    }
    Arc::new(tb)
}

/// Runs the agent and returns the outcome and every event.
pub async fn run(
    llm: Arc<dyn Llm>,
    config: AgentConfig,
    question: &str,
) -> (RunOutcome, Vec<RunEvent>) {
    run_with(llm, toolbox(), config, question).await
}

/// [`run`] with a toolbox of the test's own.
pub async fn run_with(
    llm: Arc<dyn Llm>,
    toolbox: Arc<Toolbox>,
    config: AgentConfig,
    question: &str,
) -> (RunOutcome, Vec<RunEvent>) {
    let agent = Agent::new(llm, toolbox, Environment::default(), config);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let outcome = agent
        .run(
            RunInput {
                question: question.into(),
                images: vec!["img_abcdef123456".into()],
                ..Default::default()
            },
            Some(tx),
        )
        .await;
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    (outcome, events)
}

pub fn event_types(events: &[RunEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| {
            let v = serde_json::to_value(e).ok()?;
            let t = v["type"].as_str()?.to_string();
            (t != "token").then_some(t)
        })
        .collect()
}
