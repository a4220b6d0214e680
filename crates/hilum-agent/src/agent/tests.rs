use super::*;
use hilum_llm::{Capabilities, ChatRequest, DeltaStream, LlmError, ScriptLlm};

/// A backend that writes text only (as a local Gemma GGUF without `<tool_call>` tokens).
struct TextOnly(ScriptLlm);

#[async_trait::async_trait]
impl Llm for TextOnly {
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError> {
        self.0.chat(req).await
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_tools: false,
            ..self.0.capabilities()
        }
    }
    fn name(&self) -> String {
        "text-only".into()
    }
}

/// Counts calls per tool; `x` comes back doubled.
struct Counting {
    spec: crate::ToolSpec,
    calls: Arc<std::sync::atomic::AtomicUsize>,
}

#[async_trait::async_trait]
impl crate::Tool for Counting {
    fn spec(&self) -> &crate::ToolSpec {
        &self.spec
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        args: Value,
    ) -> Result<crate::ToolOutput, crate::ToolError> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let x = args["x"].as_i64().unwrap_or_default();
        Ok(crate::ToolOutput::new(
            format!("{} doubled it", self.spec.name),
            serde_json::json!({"doubled": x * 2}),
        ))
    }
}

fn counting(names: &[&str]) -> (Arc<Toolbox>, Vec<Arc<std::sync::atomic::AtomicUsize>>) {
    let mut tb = Toolbox::new();
    let mut counters = Vec::new();
    for name in names {
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        counters.push(calls.clone());
        let spec = crate::ToolSpec {
            name: name.to_string(),
            description: format!("doubles x ({name})"),
            parameters: serde_json::json!({"type": "object",
                "properties": {"x": {"type": "integer"}}, "required": ["x"]}),
        };
        tb.register(Arc::new(Counting { spec, calls }))
            .expect("register");
    }
    (Arc::new(tb), counters)
}

/// Reads pictures (in this process when `local`); records the picture ids of each request.
struct Pictures {
    script: ScriptLlm,
    local: bool,
    seen: std::sync::Mutex<Vec<Vec<String>>>,
}

#[async_trait::async_trait]
impl Llm for Pictures {
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError> {
        let ids = req.images.iter().map(|p| p.id.clone()).collect();
        self.seen.lock().expect("lock").push(ids);
        self.script.chat(req).await
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            images: true,
            local: self.local,
            in_process: self.local,
            ..self.script.capabilities()
        }
    }
    fn name(&self) -> String {
        "pictures".into()
    }
}

/// Draws an overlay.
struct Draw(crate::ToolSpec);

#[async_trait::async_trait]
impl crate::Tool for Draw {
    fn spec(&self) -> &crate::ToolSpec {
        &self.0
    }
    async fn call(
        &self,
        _ctx: &ToolContext,
        _args: Value,
    ) -> Result<crate::ToolOutput, crate::ToolError> {
        Ok(
            crate::ToolOutput::new("drew it", Value::Null).with_artifact(crate::Artifact::png(
                "o.png",
                "overlay",
                vec![137, 80, 78, 71],
            )),
        )
    }
}

/// Which pictures each request carried: (local model?, show_overlays).
async fn pictures_per_request(local: bool, show: Option<bool>) -> (Vec<Vec<String>>, bool) {
    let mut tb = Toolbox::new();
    tb.register(Arc::new(Draw(crate::ToolSpec {
        name: "draw".into(),
        description: "draws".into(),
        parameters: serde_json::json!({"type": "object"}),
    })))
    .expect("register");
    let turns = serde_json::json!([
        {"content": "", "tool_calls": [{"id": "c1", "name": "draw", "arguments": {}}]},
        {"content": "It drew it."}]);
    let llm = Arc::new(Pictures {
        script: ScriptLlm::from_json(&turns.to_string()).expect("script"),
        local,
        seen: Default::default(),
    });
    let config = AgentConfig {
        show_overlays: show,
        grounding: false,
        ..AgentConfig::default()
    };
    let agent = Agent::new(llm.clone(), Arc::new(tb), Environment::default(), config);
    let out = agent
        .run(
            RunInput {
                question: "draw".into(),
                images: vec!["img_1".into()],
                image_payloads: vec![ImagePayload {
                    id: "img_1".into(),
                    data_url: "data:image/png;base64,".into(),
                }],
                ..RunInput::default()
            },
            None,
        )
        .await;
    assert_eq!(out.reason, StopReason::Answered, "{:?}", out.error);
    let shown = out.messages.iter().any(|m| {
        matches!(m, Message::User { images, .. } if images.iter().any(|i| hilum_llm::is_overlay_id(i)))
    });
    let seen = llm.seen.lock().expect("lock").clone();
    (seen, shown)
}

/// A tool's overlay goes back as a picture only to a model in this process that reads
/// pictures, unless switched off; a remote model never gets one, whatever the setting.
#[tokio::test]
async fn overlays_go_only_to_a_local_model_that_reads_pictures() {
    let (seen, shown) = pictures_per_request(true, None).await;
    assert_eq!(
        seen,
        vec![
            vec!["img_1".to_string()],
            vec!["img_1".into(), "ovl_c1".into()]
        ]
    );
    assert!(shown);
    let (seen, shown) = pictures_per_request(true, Some(false)).await;
    assert_eq!(seen[1], vec!["img_1".to_string()]);
    assert!(!shown);
    let (seen, shown) = pictures_per_request(false, Some(true)).await;
    assert_eq!(seen[1], vec!["img_1".to_string()]);
    assert!(!shown);
}

/// Keeps what a durable run stores, as a database would.
#[derive(Default)]
struct Memory {
    messages: std::sync::Mutex<Vec<Message>>,
    results: std::sync::Mutex<Vec<(usize, CallResult)>>,
    progress: std::sync::Mutex<Progress>,
}

#[async_trait::async_trait]
impl Checkpointer for Memory {
    async fn messages(&self, new: &[Message], progress: &Progress) -> Result<(), String> {
        self.messages.lock().expect("lock").extend_from_slice(new);
        *self.progress.lock().expect("lock") = progress.clone();
        Ok(())
    }
    async fn tool_result(
        &self,
        round: usize,
        result: &CallResult,
        message: &Message,
    ) -> Result<(), String> {
        self.messages.lock().expect("lock").push(message.clone());
        self.results
            .lock()
            .expect("lock")
            .push((round, result.clone()));
        Ok(())
    }
}

fn script(turns: serde_json::Value) -> Arc<dyn Llm> {
    Arc::new(ScriptLlm::from_json(&turns.to_string()).expect("script"))
}

#[tokio::test]
async fn a_durable_run_stores_each_step_and_a_resume_reruns_only_unfinished_calls() {
    let (toolbox, counters) = counting(&["a", "b"]);
    let decision = serde_json::json!({"content": "", "tool_calls": [
        {"id": "c1", "name": "a", "arguments": {"x": 1}},
        {"id": "c2", "name": "b", "arguments": {"x": 2}}]});
    let answer = serde_json::json!({"content": "Both tools doubled their inputs."});
    let input = RunInput {
        question: "double them".into(),
        ..RunInput::default()
    };
    let agent = Agent::new(
        script(serde_json::json!([decision, answer])),
        toolbox.clone(),
        Environment::default(),
        AgentConfig::default(),
    );
    let memory = Arc::new(Memory::default());
    let whole = agent
        .run_durable(input.clone(), None, memory.clone(), None)
        .await;
    assert_eq!(
        whole.answer.as_deref(),
        Some("Both tools doubled their inputs.")
    );
    let stored = memory.messages.lock().expect("lock").clone();
    // Question, decision, then each result: the answer is the caller's to store.
    assert_eq!(stored.len(), 4);
    assert!(matches!(&stored[0], Message::User { content, .. } if content == "double them"));
    assert!(matches!(&stored[1], Message::Assistant { tool_calls, .. } if tool_calls.len() == 2));
    assert_eq!(memory.progress.lock().expect("lock").rounds, 1);

    // The process died after `a` finished: only `b` runs again, `a`'s result is reused.
    let a_done: Vec<Message> = stored
        .iter()
        .filter(|m| !matches!(m, Message::Tool { tool_call_id, .. } if tool_call_id == "c2"))
        .cloned()
        .collect();
    let results: Vec<(usize, CallResult)> = memory
        .results
        .lock()
        .expect("lock")
        .iter()
        .filter(|(_, r)| r.call.id == "c1")
        .cloned()
        .collect();
    let resume = Resume {
        messages: a_done,
        results,
        progress: memory.progress.lock().expect("lock").clone(),
    };
    let agent = Agent::new(
        script(serde_json::json!([answer])),
        toolbox,
        Environment::default(),
        AgentConfig::default(),
    );
    let again = Arc::new(Memory::default());
    let resumed = agent
        .run_durable(input, Some(resume), again.clone(), None)
        .await;
    assert_eq!(resumed.answer, whole.answer);
    assert_eq!(resumed.messages, whole.messages, "the same conversation");
    let counts: Vec<usize> = counters
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::SeqCst))
        .collect();
    assert_eq!(
        counts,
        [1, 2],
        "a ran once; b ran again (it had not finished)"
    );
    let rerun: Vec<String> = again
        .results
        .lock()
        .expect("lock")
        .iter()
        .map(|(_, r)| r.call.id.clone())
        .collect();
    assert_eq!(rerun, ["c2"]);
}

#[test]
fn a_model_without_native_tool_calls_gets_the_react_protocol() {
    let toolbox = Arc::new(Toolbox::new());
    let text_only = Agent::new(
        Arc::new(TextOnly(ScriptLlm::new(vec![]))),
        toolbox.clone(),
        Environment::default(),
        AgentConfig::default(),
    );
    assert_eq!(text_only.config().protocol, Protocol::React);
    let native = Agent::new(
        Arc::new(ScriptLlm::new(vec![])),
        toolbox,
        Environment::default(),
        AgentConfig::default(),
    );
    assert_eq!(native.config().protocol, Protocol::Native);
}
