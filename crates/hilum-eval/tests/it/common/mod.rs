//! Shared parts of the eval tests: the project's benchmark, real radiographs from
//! ../shared/data, and a run configuration.

#![allow(dead_code)]

pub mod quiz;

use std::path::PathBuf;
use std::sync::Arc;

use hilum_agent::{AgentConfig, Toolbox};
use hilum_eval::runner::{OnProgress, ToolboxFor};
use hilum_eval::{EvalConfig, Memory};
use hilum_imaging::ImageStore;

pub fn data_dir() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        p.join("cxr").exists(),
        "missing test data {} (../shared/data beside the checkout)",
        p.display()
    );
    p
}

pub fn cxr_bench() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/cxr_bench/metadata.jsonl")
}

/// The real tools over one store (image_info and dicom_info run without model weights).
pub fn tools(store: &Arc<ImageStore>) -> ToolboxFor {
    let models = Arc::new(hilum_tools::ModelPool::from_settings(Default::default()));
    let deps = hilum_tools::ToolDeps::new(store.clone(), models);
    let tb: Arc<Toolbox> = Arc::new(hilum_tools::default_toolbox(&deps).expect("toolbox"));
    Arc::new(move |_: &[String]| tb.clone())
}

pub fn quiet() -> OnProgress {
    Arc::new(|_: &hilum_eval::Progress| {})
}

pub fn config(bench: PathBuf, images_dir: PathBuf, out: PathBuf) -> EvalConfig {
    EvalConfig {
        bench,
        images_dir,
        out,
        jobs: 1,
        memory: Memory::Question,
        strict: false,
        resume: false,
        limit: None,
        categories: vec![],
        agent: AgentConfig::default(),
        model: "test".into(),
        llm_spec: "test".into(),
        seed: None,
        tools: vec!["image_info".into()],
        hilum_version: "test".into(),
        choice_instruction: hilum_eval::runner::CHOICE_INSTRUCTION.into(),
        letter_step: false,
        send_pixels: false,
    }
}

/// The project benchmark's lines as plain JSON, in file order.
pub fn bench_lines() -> Vec<serde_json::Value> {
    std::fs::read_to_string(cxr_bench())
        .expect("the project benchmark (tests/fixtures/cxr_bench/metadata.jsonl)")
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect()
}

/// A plain-format question set of `n` six-option questions about real radiographs (three
/// images in turn; question 0 has none), three questions per case. Returns the file and, per
/// question, (id, identifying text, right letter).
pub fn plain_bench(dir: &std::path::Path, n: usize) -> (PathBuf, Vec<(String, String, char)>) {
    let images = [
        "cxr/images/nih_00000001_000_cardiomegaly.png",
        "cxr/images/medrax_normal1.jpg",
        "cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm",
    ];
    let mut text = String::new();
    let mut keys = Vec::new();
    for i in 0..n {
        let right = (b'A' + (i % 6) as u8) as char;
        let key = format!("Quiz question number {i}.");
        let imgs: Vec<&str> = if i == 0 { vec![] } else { vec![images[i % 3]] };
        let line = serde_json::json!({
            "id": format!("q{i}"),
            "case_id": format!("case{}", i / 3),
            "images": imgs,
            "question": format!("{key} Which option is right?"),
            "options": ["one", "two", "three", "four", "five", "six"],
            "answer": right.to_string(),
            "categories": if i % 2 == 0 { "even,all" } else { "odd,all" },
        });
        text.push_str(&line.to_string());
        text.push('\n');
        keys.push((format!("q{i}"), key, right));
    }
    let path = dir.join("plain.jsonl");
    std::fs::write(&path, text).expect("write bench");
    (path, keys)
}
