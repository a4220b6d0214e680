//! `run_eval` against a real OpenAI-protocol server on 127.0.0.1: four questions at once, a
//! real tool round per question on real radiographs, tokens and timings recorded, and
//! `--memory case` carrying one conversation through each case.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use hilum_agent::Llm;
use hilum_eval::runner::LlmFor;
use hilum_eval::{run_eval, summarize, Memory, Question};
use hilum_imaging::ImageStore;
use hilum_llm::{OpenAiConfig, OpenAiLlm};

fn openai(url: &str) -> LlmFor {
    let llm: Arc<dyn Llm> = Arc::new(
        OpenAiLlm::new(OpenAiConfig {
            base_url: url.into(),
            model: "quiz-model".into(),
            api_key: None,
            ..OpenAiConfig::default()
        })
        .expect("client"),
    );
    Arc::new(move |_: &Question| Ok(llm.clone()))
}

/// The server's replies: right for questions not divisible by 3, a wrong letter otherwise.
fn replies(keys: &[(String, String, char)]) -> Vec<(String, String, String)> {
    keys.iter()
        .enumerate()
        .map(|(i, (id, key, right))| {
            let letter = if i % 3 == 0 {
                (b'A' + ((*right as u8 - b'A' + 1) % 6)) as char
            } else {
                *right
            };
            (
                id.clone(),
                key.clone(),
                format!("{letter}) because of the tool result"),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_model_runs_four_at_once_with_real_tools() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (bench, keys) = common::plain_bench(dir.path(), 12);
    let (quiz, url) = common::quiz::start(replies(&keys), Duration::from_millis(20)).await;
    let store = Arc::new(ImageStore::default());
    let mut cfg = common::config(bench, common::data_dir(), dir.path().join("run"));
    cfg.jobs = 4;
    let run = run_eval(
        cfg,
        store.clone(),
        openai(&url),
        common::tools(&store),
        common::quiet(),
    )
    .await
    .expect("run");
    let s = summarize(&run);
    // Questions 0, 3, 6, 9 get a wrong letter.
    assert_eq!((s.overall.correct, s.overall.n), (8, 12));
    assert_eq!(
        (s.categories["even"].correct, s.categories["even"].n),
        (4, 6)
    );
    assert_eq!((s.categories["odd"].correct, s.categories["odd"].n), (4, 6));
    assert_eq!(s.categories["all"].correct, 8);
    for r in &run.records {
        let with_image = r.id != "q0";
        assert_eq!(r.tool_calls.len(), with_image as usize, "{}", r.id);
        assert!(r.tool_calls.iter().all(|c| c.ok && c.name == "image_info"));
        // 100 + 7 tokens per model turn; two turns when a tool ran.
        let turns = 1 + with_image as u64;
        assert_eq!(
            (r.prompt_tokens, r.completion_tokens),
            (100 * turns, 7 * turns)
        );
        assert!(r.latency_ms >= 20.0 * turns as f64, "{}", r.latency_ms);
    }
    let log = quiz.log.lock().expect("lock").clone();
    assert_eq!(
        log.len(),
        23,
        "one call and one answer per question, q0 answers at once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn case_memory_keeps_one_conversation_per_case() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (bench, keys) = common::plain_bench(dir.path(), 6);
    let (quiz, url) = common::quiz::start(replies(&keys), Duration::from_millis(1)).await;
    let store = Arc::new(ImageStore::default());
    let mut cfg = common::config(bench, common::data_dir(), dir.path().join("run"));
    cfg.memory = Memory::Case;
    cfg.jobs = 2;
    let run = run_eval(
        cfg,
        store.clone(),
        openai(&url),
        common::tools(&store),
        common::quiet(),
    )
    .await
    .expect("run");
    assert_eq!(run.header.memory, "case");
    let log = quiz.log.lock().expect("lock").clone();
    let first_request = |id: &str| {
        log.iter()
            .find(|(q, _, _)| q == id)
            .map(|(_, _, n)| *n)
            .expect("asked")
    };
    // q0, q1, q2 form case0. q0 has no image (question, answer); q1 sees them; q2 also sees
    // q1's question, tool call, tool result and answer.
    assert_eq!(first_request("q0"), 2, "system + question");
    assert_eq!(first_request("q1"), 4);
    assert_eq!(first_request("q2"), 8);
    assert_eq!(
        first_request("q3"),
        2,
        "a new case starts a new conversation"
    );
    let r2 = run.record("q2").expect("q2");
    assert_eq!(r2.messages.as_ref().map(Vec::len), Some(4));
}
