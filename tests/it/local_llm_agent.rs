//! End to end with the in-process local model: Qwen2.5-Coder-0.5B-Instruct (GGUF, candle), real
//! tools (`image_info`; `segment_lungs` with the real lung U-Net imported from
//! ../shared/data/models/lung_seg_unet) and real radiographs from ../shared/data.
//!
//! Needs the model from `scripts/fetch_local_llm.sh` (or `HILUM_LOCAL_LLM=path.gguf`); without
//! it the tests print why and check nothing. ~1-2 min on 2 cores.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use hilum::agent::{
    Agent, AgentConfig, Environment, Message, RunInput, RunOutcome, StopReason, Toolbox,
};
use hilum::llm_local::LocalLlm;
use hilum::tools::{ImageInfo, SegmentLungs};
use hilum_imaging::ImageStore;
use hilum_models::{ImportOptions, ModelPool, ModelRegistry};
use serde_json::Value;

// The models folder and the local settings from the environment, as the `hilum` binary reads them.
#[path = "../../crates/hilum-llm-local/tests/it/common/mod.rs"]
mod common;
use common::default_model_path;

pub(crate) fn shared_data() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data");
    assert!(
        d.join("cxr/images").is_dir(),
        "{} is missing: the shared CXR data must be at ../shared/data (see its README)",
        d.display()
    );
    d
}

pub(crate) fn shared_image(name: &str) -> PathBuf {
    shared_data().join("cxr/images").join(name)
}

/// One loaded model for the whole binary, used by one test at a time (it holds one KV cache).
pub(crate) fn llm() -> Option<Arc<LocalLlm>> {
    static LLM: OnceLock<Option<Arc<LocalLlm>>> = OnceLock::new();
    LLM.get_or_init(|| {
        let path = match std::env::var_os("HILUM_LOCAL_LLM") {
            Some(p) => PathBuf::from(p),
            None => match default_model_path() {
                Some(p) => p,
                None => {
                    eprintln!("SKIPPED: local model not installed; run scripts/fetch_local_llm.sh");
                    return None;
                }
            },
        };
        let mut cfg = common::local_config(&path);
        cfg.context = 4096;
        Some(Arc::new(
            LocalLlm::load(cfg).expect("the installed GGUF loads"),
        ))
    })
    .clone()
}

pub(crate) async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    LOCK.lock().await
}

/// The real lung U-Net, imported into a models folder of this test run.
pub(crate) fn lung_models() -> Arc<ModelPool> {
    static POOL: OnceLock<(tempfile::TempDir, Arc<ModelPool>)> = OnceLock::new();
    POOL.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        let h5 = shared_data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
        let opts = ImportOptions::default();
        hilum_models::import(&reg, "lung-unet", &h5, &opts).expect("import lung-unet");
        (dir, Arc::new(ModelPool::new(Arc::new(reg))))
    })
    .1
    .clone()
}

async fn ask(llm: Arc<LocalLlm>, toolbox: Toolbox, question: &str, id: &str) -> RunOutcome {
    // Each test starts from an empty KV cache, as a new `hilum analyze` does, so that it does not
    // depend on which test ran before (reused prefixes change float rounding a little).
    llm.reset_cache();
    // As `hilum analyze` runs a local model: short observations (the summary line and the
    // first part of the data), which a 0.5B model quotes instead of getting lost in them.
    let config = AgentConfig {
        max_rounds: 3,
        max_tokens: Some(200),
        max_observation_chars: 600,
        ..AgentConfig::default()
    };
    let agent = Agent::new(llm, Arc::new(toolbox), Environment::default(), config);
    agent
        .run(
            RunInput {
                question: question.into(),
                images: vec![id.to_string()],
                ..Default::default()
            },
            None,
        )
        .await
}

/// Decimal numbers written in `text` (digit runs with an optional fraction), as written.
fn numbers_in(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for c in text.chars().chain([' ']) {
        if c.is_ascii_digit() || (c == '.' && !cur.is_empty() && !cur.contains('.')) {
            cur.push(c);
        } else {
            let n = cur.trim_end_matches('.').to_string();
            if !n.is_empty() {
                out.push(n);
            }
            cur.clear();
        }
    }
    out
}

/// Numbers of an answer, thousands separators removed, image ids left out.
fn answer_numbers(answer: &str, id: &str) -> Vec<String> {
    let cleaned = answer.replace(id, " ");
    let mut joined = String::new();
    let chars: Vec<char> = cleaned.chars().collect();
    for (i, &c) in chars.iter().enumerate() {
        let between_digits = i > 0
            && i + 1 < chars.len()
            && chars[i - 1].is_ascii_digit()
            && chars[i + 1].is_ascii_digit();
        if (c == ',' || c == '\u{202f}') && between_digits {
            continue;
        }
        joined.push(c);
    }
    numbers_in(&joined)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_model_segments_the_lungs_and_quotes_the_tool_numbers() {
    let Some(llm) = llm() else { return };
    let _one_at_a_time = serial().await;
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&shared_image("covid_pneumocystis-pneumonia-1.jpg"))
        .expect("real radiograph decodes");
    // What `hilum analyze` offers a local model with only the lung U-Net installed.
    let mut toolbox = Toolbox::new();
    toolbox
        .register(Arc::new(ImageInfo::new(store.clone())))
        .unwrap();
    toolbox
        .register(Arc::new(SegmentLungs::new(store.clone(), lung_models())))
        .unwrap();

    let out = ask(llm, toolbox, "How large are the lungs in this image?", &id).await;
    let answer = out.answer.clone().unwrap_or_default();
    eprintln!(
        "answer after {} round(s), {} call(s) ({:?}): {answer}",
        out.rounds, out.tool_calls, out.reason
    );
    assert!(
        matches!(
            out.reason,
            StopReason::Answered | StopReason::MaxRounds | StopReason::RepeatedCalls
        ),
        "{:?} {:?}",
        out.reason,
        out.error
    );
    let seg: Vec<_> = out
        .results
        .iter()
        .filter(|r| r.call.name == "segment_lungs" && !r.repaired)
        .filter_map(|r| {
            let args = r.arguments.as_ref()?;
            Some((args, r.result.as_ref().ok()?))
        })
        .collect();
    assert!(
        !seg.is_empty(),
        "no valid, successful segment_lungs call: {:#?}",
        out.messages
    );
    assert_eq!(seg[0].0["image"], id.as_str());
    assert!(
        seg[0].1.data["lungs_found"].as_u64().unwrap_or(0) >= 1,
        "{}",
        seg[0].1.summary
    );

    // The answer is prose, not a tool call written as text.
    let trimmed = answer.trim_start();
    assert!(
        !trimmed.is_empty() && !trimmed.starts_with('{') && !trimmed.contains("<tool_call>"),
        "the answer is not prose: {answer:?}"
    );
    // And it quotes the tool: some number of the lung measurements appears in it.
    let mut quoted = Vec::new();
    for (_, output) in &seg {
        quoted.extend(numbers_in(&output.summary.replace(id.as_str(), " ")));
        for side in ["right_lung", "left_lung"] {
            if let Some(lung) = output.data[side].as_object() {
                for key in ["area_px", "height_px", "width_px", "area_cm2"] {
                    if let Some(v) = lung.get(key).filter(|v| v.is_number()) {
                        quoted.push(v.to_string());
                    }
                }
            }
        }
        if let Some(r) = output.data["left_right_area_ratio"].as_f64() {
            quoted.push(r.to_string());
        }
    }
    // Single digits (e.g. "2 lung fields") say nothing about the tool's measurements.
    quoted.retain(|n| n.len() >= 2);
    let said = answer_numbers(&answer, &id);
    assert!(
        said.iter().any(|n| quoted.contains(n)),
        "the answer quotes none of the tool's numbers {quoted:?}: {answer:?}"
    );
    // No identical call twice: the local backend turns a repeat into the answer.
    let mut calls: Vec<(String, Value)> = Vec::new();
    for r in &out.results {
        let key = (
            r.call.name.clone(),
            serde_json::from_str(&r.call.arguments).unwrap_or(Value::Null),
        );
        assert!(!calls.contains(&key), "repeated call {key:?}");
        calls.push(key);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_model_calls_image_info_and_quotes_its_numbers() {
    let Some(llm) = llm() else { return };
    let _one_at_a_time = serial().await;
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
    let out = ask(
        llm,
        toolbox,
        "What are the width and height of this image in pixels?",
        &id,
    )
    .await;
    // A 0.5B model may keep calling tools until the round budget; the agent then asks it to
    // answer without tools, which is still an answer from the tool's results.
    assert!(
        matches!(
            out.reason,
            StopReason::Answered | StopReason::MaxRounds | StopReason::RepeatedCalls
        ),
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
    let said = answer_numbers(&answer, &id);
    assert!(
        said.contains(&w.to_string()) || said.contains(&h.to_string()),
        "the answer does not quote the tool's size {w}x{h}: {answer:?}\n{:#?}",
        out.messages
    );
    assert!(out.messages.iter().any(|m| matches!(
        m,
        Message::Tool {
            is_error: false,
            ..
        }
    )));
}

#[test]
fn numbers_are_read_as_written() {
    assert_eq!(
        answer_numbers(
            "right 12,345 px, left 0.93; 41% of img_5d41402abc4b.",
            "img_5d41402abc4b"
        ),
        vec!["12345", "0.93", "41"]
    );
}
