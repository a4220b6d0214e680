//! The loop's failure paths, budgets, protocols and modes, with the script backend.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{event_types, run};
use hilum::agent::{
    AgentConfig, Event, Message, Mode, Protocol, RunOutcome, StopReason, ToolPolicy,
};
use hilum::llm::ScriptLlm;

fn script(json: &str) -> Arc<ScriptLlm> {
    Arc::new(ScriptLlm::from_json(json).expect("valid script"))
}

fn tool_messages(messages: &[Message]) -> Vec<(String, String, bool)> {
    messages
        .iter()
        .filter_map(|m| match m {
            Message::Tool {
                tool_call_id,
                content,
                is_error,
                ..
            } => Some((tool_call_id.clone(), content.clone(), *is_error)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn failing_calls_keep_other_results_and_call_order() {
    let llm = script(
        r#"[
        {"tool_calls": [
            {"id": "c1", "name": "fast", "arguments": {"x": 1}},
            {"id": "c2", "name": "no_such_tool", "arguments": {"x": 1}},
            {"id": "c3", "name": "fast", "arguments": {"x": "one"}},
            {"id": "c4", "name": "crash", "arguments": {"x": 1}},
            {"id": "c5", "name": "broken", "arguments": {"x": 7}},
            {"id": "c6", "name": "fast", "arguments": "{x: 21,"}
        ]},
        {"content": "done"}
    ]"#,
    );
    let (out, events) = run(llm, AgentConfig::default(), "q").await;
    assert_eq!(out.reason, StopReason::Answered);
    assert_eq!(out.answer.as_deref(), Some("done"));
    let tools = tool_messages(&out.messages);
    let ids: Vec<&str> = tools.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(ids, ["c1", "c2", "c3", "c4", "c5", "c6"]);

    assert!(!tools[0].2 && tools[0].1.contains("fast saw x=1"));
    assert!(
        tools[1].2 && tools[1].1.starts_with("ERROR (unknown_tool)"),
        "{}",
        tools[1].1
    );
    assert!(
        tools[1].1.contains("Available tools: fast"),
        "{}",
        tools[1].1
    );
    assert!(
        tools[2].1.starts_with("ERROR (invalid_arguments)"),
        "{}",
        tools[2].1
    );
    assert!(
        tools[2].1.contains("/x"),
        "names the bad field: {}",
        tools[2].1
    );
    assert!(tools[3].1.starts_with("ERROR (panic)"), "{}", tools[3].1);
    assert!(tools[3].1.contains("boom in crash"), "{}", tools[3].1);
    assert!(
        tools[4].1.starts_with("ERROR (tool_error)"),
        "{}",
        tools[4].1
    );
    assert!(
        tools[4].1.contains("x=7 cannot be processed"),
        "{}",
        tools[4].1
    );
    // Almost-valid JSON is repaired, run, and the model is told.
    assert!(!tools[5].2, "{}", tools[5].1);
    assert!(
        tools[5].1.contains("x=21") && tools[5].1.contains("repaired"),
        "{}",
        tools[5].1
    );

    let kinds: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolFailed { kind, .. } => Some(kind.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        kinds,
        ["unknown_tool", "invalid_arguments", "panic", "tool_error"]
    );
}

#[tokio::test]
async fn slow_call_times_out_and_others_finish() {
    let llm = script(
        r#"[
        {"tool_calls": [{"id": "h", "name": "hang", "arguments": {"x": 1}},
                        {"id": "f", "name": "fast", "arguments": {"x": 2}}]},
        {"content": "answer"}
    ]"#,
    );
    let config = AgentConfig {
        tool_timeout: Duration::from_millis(150),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let (out, _) = run(llm, config, "q").await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the hanging tool was not stopped"
    );
    let tools = tool_messages(&out.messages);
    assert!(tools[0].1.starts_with("ERROR (timeout)"), "{}", tools[0].1);
    assert!(
        tools[0].1.contains("0.1 s") || tools[0].1.contains("0.2 s"),
        "{}",
        tools[0].1
    );
    assert!(tools[1].1.contains("fast saw x=2"));
    assert_eq!(out.answer.as_deref(), Some("answer"));
}

#[tokio::test]
async fn round_budget_ends_in_synthesis_without_tools() {
    // The model keeps asking for tools; after 2 rounds it must answer from what it has.
    let llm = script(
        r#"[
        {"tool_calls": [{"name": "fast", "arguments": {"x": 1}}]},
        {"tool_calls": [{"name": "fast", "arguments": {"x": 2}}]},
        {"content": "From the two results: x doubled is 2 and 4.",
         "tool_calls": [{"name": "fast", "arguments": {"x": 3}}]}
    ]"#,
    );
    let config = AgentConfig {
        max_rounds: 2,
        ..Default::default()
    };
    let (out, events) = run(llm.clone(), config, "q").await;
    assert_eq!(out.reason, StopReason::MaxRounds);
    assert_eq!(out.rounds, 2);
    assert_eq!(out.tool_calls, 2, "the synthesis call must not run tools");
    assert!(out
        .answer
        .as_deref()
        .unwrap_or_default()
        .contains("2 and 4"));
    assert_eq!(llm.calls(), 3);
    let last_user = last_user_text(&out);
    assert!(last_user.contains("limit of 2 tool rounds"), "{last_user}");
    let types = event_types(&events);
    assert_eq!(types.last().map(String::as_str), Some("complete"));
    assert!(types.contains(&"final".to_string()));
}

#[tokio::test]
async fn a_synthesis_without_words_is_asked_once_more_then_fails_clearly() {
    // Asked for the answer, the model writes a call again (no words): one plainer request.
    let llm = script(
        r#"[
        {"tool_calls": [{"name": "fast", "arguments": {"x": 1}}]},
        {"tool_calls": [{"name": "fast", "arguments": {"x": 1}}]},
        {"tool_calls": [{"name": "fast", "arguments": {"x": 1}}]},
        {"content": "x doubled is 2."}
    ]"#,
    );
    let (out, _) = run(llm.clone(), AgentConfig::default(), "q").await;
    assert_eq!(out.error, None);
    assert_eq!(out.reason, StopReason::RepeatedCalls);
    assert_eq!(out.answer.as_deref(), Some("x doubled is 2."));
    assert_eq!(out.tool_calls, 2);
    assert_eq!(llm.calls(), 4);
    let last_user = last_user_text(&out);
    assert!(last_user.contains("plain sentences"), "{last_user}");

    // Still no words: a clear error, not an empty answer.
    let llm = script(
        r#"[
        {"tool_calls": [{"name": "fast", "arguments": {"x": 1}}]},
        {"tool_calls": [{"name": "fast", "arguments": {"x": 2}}]},
        {"tool_calls": [{"name": "fast", "arguments": {"x": 3}}]},
        {"content": "  "}
    ]"#,
    );
    let config = AgentConfig {
        max_rounds: 2,
        ..Default::default()
    };
    let (out, _) = run(llm.clone(), config, "q").await;
    assert_eq!(out.reason, StopReason::Error);
    let err = out.error.unwrap_or_default();
    assert!(
        err.contains("gave no answer in words") && err.contains("max_rounds"),
        "{err}"
    );
    assert_eq!(llm.calls(), 4);
}

#[tokio::test]
async fn tool_call_budget_refuses_extra_calls() {
    let llm = script(
        r#"[
        {"tool_calls": [{"id": "a", "name": "fast", "arguments": {"x": 1}},
                        {"id": "b", "name": "fast", "arguments": {"x": 2}},
                        {"id": "c", "name": "fast", "arguments": {"x": 3}}]},
        {"content": "partial answer"}
    ]"#,
    );
    let config = AgentConfig {
        max_tool_calls: 2,
        ..Default::default()
    };
    let (out, _) = run(llm, config, "q").await;
    let tools = tool_messages(&out.messages);
    assert!(!tools[0].2 && !tools[1].2);
    assert!(tools[2].1.starts_with("ERROR (budget)"), "{}", tools[2].1);
    assert_eq!(out.tool_calls, 2);
    assert_eq!(out.reason, StopReason::MaxToolCalls);
    assert_eq!(out.answer.as_deref(), Some("partial answer"));
}

#[tokio::test]
async fn deadline_stops_tools_and_still_answers() {
    let llm = script(
        r#"[
        {"tool_calls": [{"name": "hang", "arguments": {"x": 1}}]},
        {"content": "Could not finish the analysis in time."}
    ]"#,
    );
    let config = AgentConfig {
        deadline: Duration::from_millis(300),
        ..Default::default()
    };
    let (out, _) = run(llm, config, "q").await;
    assert_eq!(out.reason, StopReason::Deadline);
    let tools = tool_messages(&out.messages);
    assert!(tools[0].1.starts_with("ERROR (timeout)"), "{}", tools[0].1);
    assert_eq!(
        out.answer.as_deref(),
        Some("Could not finish the analysis in time.")
    );
}

#[tokio::test]
async fn llm_error_ends_the_run_with_an_error_event() {
    let llm = script(r#"[{"error": "backend exploded"}]"#);
    let (out, events) = run(llm, AgentConfig::default(), "q").await;
    assert_eq!(out.reason, StopReason::Error);
    assert!(out.error.unwrap_or_default().contains("backend exploded"));
    assert_eq!(event_types(&events), ["error", "complete"]);
    match &events.last().map(|e| &e.event) {
        Some(Event::Complete { ok, .. }) => assert!(!ok),
        other => panic!("expected complete, got {other:?}"),
    }
}

#[tokio::test]
async fn react_protocol_runs_parallel_actions_and_reports_malformed_blocks() {
    let llm = script(
        r#"[
        {"content": "Thought: look\nAction: fast\nAction Input: {\"x\": 4}\nAction: slow_a\nAction Input: {'x': 5}\nAction: fast\n"},
        {"content": "Thought: enough\nFinal Answer: x doubled is 8."}
    ]"#,
    );
    let config = AgentConfig {
        protocol: Protocol::React,
        ..Default::default()
    };
    let (out, events) = run(llm, config, "q").await;
    assert_eq!(out.answer.as_deref(), Some("x doubled is 8."));
    let tools = tool_messages(&out.messages);
    assert_eq!(tools.len(), 2);
    assert_eq!(tools[0].0, "react_1_0");
    assert!(tools[1].1.contains("slow_a saw x=5"));
    let problem = out
        .messages
        .iter()
        .find(|m| {
            m.text()
                .starts_with("Observation: your last turn could not be read")
        })
        .expect("malformed block reported");
    assert!(
        problem.text().contains("Action Input"),
        "{}",
        problem.text()
    );
    let types = event_types(&events);
    assert_eq!(
        types,
        [
            "decision",
            "tool_started",
            "tool_started",
            "tool_finished",
            "tool_finished",
            "decision",
            "final",
            "complete"
        ]
    );
}

#[tokio::test]
async fn reflexion_critiques_then_revises_with_more_tools() {
    let llm = script(
        r#"[
        {"tool_calls": [{"id": "call_1", "name": "fast", "arguments": {"x": 1}}]},
        {"content": "Draft: x is 1."},
        {"content": "Missing: the doubled value was not checked. Superfluous: nothing."},
        {"tool_calls": [{"id": "call_2", "name": "fast", "arguments": {"x": 2}}]},
        {"content": "x is 1 [call_1]; doubled 2 is 4 [call_2]."}
    ]"#,
    );
    let config = AgentConfig {
        mode: Mode::Reflexion,
        ..Default::default()
    };
    let (out, events) = run(llm.clone(), config, "q").await;
    assert_eq!(
        out.answer.as_deref(),
        Some("x is 1 [call_1]; doubled 2 is 4 [call_2].")
    );
    assert_eq!(llm.calls(), 5);
    assert_eq!(out.tool_calls, 2);
    let phases: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::Decision { phase, .. } => Some(phase.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(phases, ["act", "act", "critique", "revise", "revise"]);
    // The critique call had no tools, and the draft is in the transcript.
    assert!(out.messages.iter().any(|m| m.text() == "Draft: x is 1."));
}

#[tokio::test]
async fn events_carry_timings_and_serialize_as_ndjson() {
    let llm = script(
        r#"[{"content": "Checking.", "tool_calls": [{"id": "k", "name": "slow_a", "arguments": {"x": 1}}]},
            {"content": "Done."}]"#,
    );
    let (_, events) = run(llm, AgentConfig::default(), "q").await;
    let finished = events
        .iter()
        .find_map(|e| match &e.event {
            Event::ToolFinished { ms, data, .. } => Some((*ms, data.clone(), e.t_ms)),
            _ => None,
        })
        .expect("tool_finished");
    assert!(finished.0 >= 290.0, "tool ms {}", finished.0);
    assert_eq!(finished.1["doubled"], 2);
    assert!(finished.2 >= finished.0);
    let line = serde_json::to_string(events.last().expect("events")).expect("json");
    let v: serde_json::Value = serde_json::from_str(&line).expect("parse back");
    assert_eq!(v["type"], "complete");
    assert_eq!(v["ok"], true);
    assert!(v["tool_ms"].as_f64().unwrap_or(0.0) >= 290.0);
    assert!(events
        .iter()
        .any(|e| matches!(&e.event, Event::Token { text } if text.contains("Checking"))));
}

/// The text of the run's last user message (the agent's own prompts are user messages).
fn last_user_text(out: &RunOutcome) -> String {
    out.messages
        .iter()
        .rev()
        .find(|m| matches!(m, Message::User { .. }))
        .map(|m| m.text().to_string())
        .unwrap_or_default()
}

#[tokio::test]
async fn the_script_backend_is_held_to_the_tool_policy_and_the_grounding_check() {
    let invented = r#"{"content": "The image shows an effusion of 240 ml with 87% certainty."}"#;
    let llm = script(&format!("[{invented}, {invented}, {invented}]"));
    let (out, events) = run(llm.clone(), AgentConfig::default(), "Is there an effusion?").await;
    // Sent back for tools, then for a revision, then returned marked.
    assert_eq!(llm.calls(), 3);
    assert_eq!(out.grounded, Some(false));
    assert_eq!(out.unsupported.len(), 2, "{:?}", out.unsupported);
    assert!(
        out.unsupported[0].starts_with("240 "),
        "{:?}",
        out.unsupported
    );
    assert!(
        out.unsupported[1].starts_with("87%"),
        "{:?}",
        out.unsupported
    );
    let last = events
        .iter()
        .find_map(|e| match &e.event {
            Event::Final { grounded, .. } => Some(*grounded),
            _ => None,
        })
        .expect("final");
    assert_eq!(last, Some(false));

    // Both turned off: the first answer is taken as it comes and is not judged.
    let llm = script(&format!("[{invented}]"));
    let config = AgentConfig {
        require_tools: ToolPolicy::Never,
        grounding: false,
        ..Default::default()
    };
    let (out, _) = run(llm.clone(), config, "Is there an effusion?").await;
    assert_eq!(llm.calls(), 1);
    assert_eq!(out.grounded, None);
    assert!(out.answer.unwrap_or_default().contains("240 ml"));
}
