//! Answers that answer the question: the coverage check before the first round and the
//! relevance check on the final answer, with a scripted model and tools that declare what they
//! can answer.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::coverage::Topic;
use hilum_agent::llm::ScriptLlm;
use hilum_agent::{
    Agent, AgentConfig, Capability, Environment, Event, Requirements, RunInput, RunOutcome, Tool,
    ToolContext, ToolError, ToolOutput, ToolSpec, Toolbox,
};
use serde_json::{json, Value};

static LUNGS: Topic = Topic {
    id: "lung_size",
    label: "the size of the lungs",
    terms: &["lung+larg*", "lung+size"],
    answer_terms: &[&["cover*"], &["area*", "px"]],
};
static NODULE: Topic = Topic {
    id: "nodule",
    label: "nodules",
    terms: &["nodul*"],
    answer_terms: &[],
};
static PNEUMOPERITONEUM: Topic = Topic {
    id: "pneumoperitoneum",
    label: "free air under the diaphragm",
    terms: &["free air"],
    answer_terms: &[],
};

/// A tool answering one topic with a fixed result.
struct Fixed {
    spec: ToolSpec,
    models: &'static [&'static str],
    topic: &'static Topic,
    summary: &'static str,
    data: Value,
}

#[async_trait]
impl Tool for Fixed {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn requirements(&self) -> Requirements {
        Requirements {
            models: self.models,
            ..Requirements::NONE
        }
    }
    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::new(self.topic, &[])]
    }
    fn state(&self, _c: &Capability, out: &ToolOutput) -> Option<String> {
        out.data["statement"].as_str().map(str::to_string)
    }
    async fn call(&self, _ctx: &ToolContext, _args: Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::new(self.summary, self.data.clone()))
    }
}

fn tool(
    name: &str,
    models: &'static [&'static str],
    topic: &'static Topic,
    summary: &'static str,
    data: Value,
) -> Arc<dyn Tool> {
    Arc::new(Fixed {
        spec: ToolSpec {
            name: name.into(),
            description: format!("{name} answers {}", topic.label),
            parameters: json!({"type": "object", "properties": {"image": {"type": "string"}}}),
        },
        models,
        topic,
        summary,
        data,
    })
}

/// Lungs measured (model installed); the nodule classifier's model missing.
fn toolbox() -> Arc<Toolbox> {
    let mut tb = Toolbox::new();
    tb.register(tool(
        "segment_lungs",
        &["lung-unet"],
        &LUNGS,
        "the patient's left lung is larger: 120 vs 100 px",
        json!({"statement": "the lungs cover 34.0% of the image; right 100 px, left 120 px"}),
    ))
    .expect("register");
    tb.register(tool(
        "classify",
        &["classifier"],
        &NODULE,
        "Nodule 0.10",
        json!({}),
    ))
    .expect("register");
    tb.set_vocabulary(vec![&LUNGS, &NODULE, &PNEUMOPERITONEUM]);
    Arc::new(tb)
}

fn env() -> Environment {
    Environment::default()
        .with(Requirements::model_fact("lung-unet"), "installed")
        .with(
            Requirements::install_fact("classifier"),
            "hilum models fetch classifier",
        )
}

async fn ask(question: &str, turns: Value) -> (RunOutcome, Vec<Event>) {
    let llm = Arc::new(ScriptLlm::from_json(&turns.to_string()).expect("script"));
    let config = AgentConfig {
        grounding: false,
        ..AgentConfig::default()
    };
    let agent = Agent::new(llm, toolbox(), env(), config);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let outcome = agent
        .run(
            RunInput {
                question: question.into(),
                images: vec!["img_1".into()],
                ..Default::default()
            },
            Some(tx),
        )
        .await;
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e.event);
    }
    (outcome, events)
}

fn call_lungs() -> Value {
    json!({"content": "", "tool_calls": [{"id": "c1", "name": "segment_lungs", "arguments": {"image": "img_1"}}]})
}

#[tokio::test]
async fn a_question_no_installed_tool_covers_is_answered_by_hilum_without_the_model() {
    // An empty script: any model turn would fail the run.
    let (out, events) = ask("Are there any nodules?", json!([])).await;
    let answer = out.answer.expect("answered");
    assert_eq!(
        answer,
        "I cannot assess nodules: no installed model covers it. `hilum models fetch classifier` installs the model classify needs for it."
    );
    assert_eq!(out.cannot_assess, ["nodules"]);
    assert_eq!(out.answers_question, Some(true));
    assert!(!events.iter().any(|e| matches!(e, Event::Decision { .. })));
    let fin = events
        .iter()
        .find(|e| matches!(e, Event::Final { .. }))
        .expect("final event");
    let v = serde_json::to_value(fin).expect("json");
    assert_eq!(v["cannot_assess"], json!(["nodules"]));

    let (out, _) = ask("Is there free air under the diaphragm?", json!([])).await;
    assert_eq!(
        out.answer.as_deref(),
        Some("I cannot assess free air under the diaphragm: none of Hilum's tools answers it.")
    );
}

#[tokio::test]
async fn a_tool_whose_model_is_missing_is_not_offered() {
    let tb = toolbox();
    let offered: Vec<String> = tb.specs(&env()).into_iter().map(|s| s.name).collect();
    assert_eq!(offered, ["segment_lungs"]);
    // An environment that says nothing about models withholds nothing.
    assert_eq!(tb.specs(&Environment::default()).len(), 2);
}

#[tokio::test]
async fn an_irrelevant_answer_gets_one_revision_request_then_hilums_statement_and_the_flag() {
    let lead =
        "According to the segment_lungs result: the patient's left lung is larger: 120 vs 100 px.";
    let (out, events) = ask(
        "How large are the lungs, and are there nodules?",
        json!([call_lungs(), {"content": lead}, {"content": lead}]),
    )
    .await;
    let answer = out.answer.expect("answered");
    // The revision request named the part the answer left out.
    let requests: Vec<&str> = out
        .messages
        .iter()
        .filter_map(|m| match m {
            hilum_agent::Message::User { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .filter(|c| c.contains("does not address"))
        .collect();
    assert_eq!(requests.len(), 1, "{:?}", out.messages);
    // It names the part and what the tool says about it.
    assert!(
        requests[0].contains("- The size of the lungs: the lungs cover 34.0% of the image"),
        "{}",
        requests[0]
    );
    // The model did not fix it: its sentence about the part (no tool figure in it) goes, Hilum
    // states the part from the tool result, and says what it cannot assess.
    assert!(!answer.contains("larger"), "{answer}");
    assert_eq!(out.dropped, [lead]);
    assert!(
        answer.starts_with("The size of the lungs: the lungs cover 34.0% of the image; right 100 px, left 120 px (segment_lungs)."),
        "{answer}"
    );
    assert!(answer.contains("I cannot assess nodules"), "{answer}");
    assert_eq!(out.answers_question, Some(false));
    assert_eq!(out.unanswered, ["the size of the lungs"]);
    let v = serde_json::to_value(events.iter().find(|e| matches!(e, Event::Final { .. })))
        .expect("json");
    assert_eq!(v["answers_question"], json!(false));
    assert_eq!(v["unanswered"], json!(["the size of the lungs"]));
}

#[tokio::test]
async fn a_revised_answer_that_addresses_the_part_stands() {
    let (out, _) = ask(
        "How large are the lungs?",
        json!([
            call_lungs(),
            {"content": "The left lung is larger."},
            {"content": "The lungs cover 34% of the image; right area 100 px, left 120 px."}
        ]),
    )
    .await;
    assert_eq!(
        out.answer.as_deref(),
        Some("The lungs cover 34% of the image; right area 100 px, left 120 px.")
    );
    assert_eq!(out.answers_question, Some(true));
    assert!(out.unanswered.is_empty());
}

#[tokio::test]
async fn a_finding_no_tool_result_covers_is_removed_from_the_answer() {
    let (out, _) = ask(
        "How large are the lungs?",
        json!([
            call_lungs(),
            {"content": "The lungs cover 34% of the image; areas 100 px and 120 px. There is a small nodule in the right lung."}
        ]),
    )
    .await;
    let answer = out.answer.expect("answered");
    assert!(!answer.contains("nodule"), "{answer}");
    assert_eq!(out.dropped, ["There is a small nodule in the right lung."]);
    assert_eq!(out.answers_question, Some(true));
}

#[tokio::test]
async fn a_multiple_choice_question_is_left_to_the_model() {
    let (out, _) = ask(
        "Which is present? A) Nodule B) Free air C) Neither",
        json!([call_lungs(), {"content": "C"}]),
    )
    .await;
    assert_eq!(out.answer.as_deref(), Some("C"));
    assert_eq!(out.answers_question, None);
}
