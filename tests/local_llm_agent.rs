//! End to end with the in-process local model: Qwen2.5-Coder-0.5B-Instruct (GGUF, candle),
//! the real `image_info` tool and a real radiograph from ../shared/data.
//!
//! Needs the model from `scripts/fetch_local_llm.sh` (or `HILUM_LOCAL_LLM=path.gguf`); without
//! it the test prints why and checks nothing. Takes ~1 min on 2 cores.

use std::path::PathBuf;
use std::sync::Arc;

use hilum::agent::{Agent, AgentConfig, Environment, Message, RunInput, StopReason, Toolbox};
use hilum::llm::local::{default_model_path, LocalConfig, LocalLlm};
use hilum::tools::ImageInfo;
use hilum_imaging::ImageStore;

fn shared_image(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/data/cxr/images")
        .join(name);
    assert!(
        p.is_file(),
        "{} is missing: the shared CXR data must be at ../shared/data (see its README)",
        p.display()
    );
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_model_calls_image_info_and_quotes_its_numbers() {
    let path = match std::env::var_os("HILUM_LOCAL_LLM") {
        Some(p) => PathBuf::from(p),
        None => match default_model_path() {
            Some(p) => p,
            None => {
                eprintln!("SKIPPED: local model not installed; run scripts/fetch_local_llm.sh");
                return;
            }
        },
    };
    let mut cfg = LocalConfig::new(path);
    cfg.context = 4096;
    let llm = Arc::new(LocalLlm::load(cfg).expect("the installed GGUF loads"));

    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&shared_image("covid_pneumocystis-pneumonia-1.jpg"))
        .expect("real radiograph decodes");
    let img = store.get(&id).unwrap();
    let (w, h) = (img.width, img.height);
    let mut toolbox = Toolbox::new();
    toolbox
        .register(Arc::new(ImageInfo::new(store.clone())))
        .unwrap();
    let config = AgentConfig {
        max_rounds: 2,
        max_tokens: Some(160),
        ..AgentConfig::default()
    };
    let agent = Agent::new(
        llm.clone(),
        Arc::new(toolbox),
        Environment::default(),
        config,
    );
    let out = agent
        .run(
            RunInput {
                question: "What are the width and height of this image in pixels?".into(),
                images: vec![id.clone()],
                ..Default::default()
            },
            None,
        )
        .await;
    // A 0.5B model may keep calling tools until the round budget; the agent then asks it to
    // answer without tools, which is still an answer from the tool's results.
    assert!(
        matches!(out.reason, StopReason::Answered | StopReason::MaxRounds),
        "{:?} {:?}",
        out.reason,
        out.error
    );
    eprintln!("answer ({:?}): {:?}", out.reason, out.answer);
    let ok_calls: Vec<_> = out
        .results
        .iter()
        .filter(|r| r.call.name == "image_info" && r.result.is_ok() && !r.repaired)
        .collect();
    assert!(
        !ok_calls.is_empty(),
        "no valid image_info call: {:?}",
        out.messages
    );
    assert_eq!(
        ok_calls[0].arguments.as_ref().unwrap()["image"],
        id.as_str()
    );
    let answer = out.answer.unwrap_or_default();
    assert!(
        answer.contains(&w.to_string()) || answer.contains(&h.to_string()),
        "the answer does not quote the tool's size {w}x{h}: {answer:?}"
    );
    assert!(out.messages.iter().any(|m| matches!(
        m,
        Message::Tool {
            is_error: false,
            ..
        }
    )));
}
