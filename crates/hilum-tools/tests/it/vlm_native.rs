//! `answer_visual_question` on the native backend: the tiny LLaVA-Med-style fixture
//! (Mistral text model, pad-to-square, `[INST]` prompt; `tests/fixtures/llava/tiny_mistral`,
//! made by `scripts/fixtures/make_llava_fixtures.py`) imported into a temporary models directory
//! through `hilum models import`'s code path, run in-process on a real radiograph. Its answer
//! must be transformers' greedy decode, decoded.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hilum_agent::{Environment, Tool, ToolContext, ToolError};
use hilum_imaging::ImageStore;
use hilum_models::{ImportOptions, ModelPool, ModelRegistry, ModelSettings};
use hilum_tools::vlm::{Backend, VlmSettings};
use hilum_tools::{AnswerVisualQuestion, GroundPhrase};
use serde_json::{json, Value};

const MODEL: &str = "llava-med-v1.5";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture() -> PathBuf {
    root().join("tests/fixtures/llava/tiny_mistral")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixture().join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("json")
}

/// A pool over `registry`. The fixture's weights are f32 and tiny: run them unquantized, as
/// transformers did.
fn unquantized(registry: ModelRegistry) -> Arc<ModelPool> {
    let settings = ModelSettings {
        llava_quantize: Some("none".into()),
        ..Default::default()
    };
    Arc::new(ModelPool::with_settings(Arc::new(registry), settings))
}

fn native_settings(tool_max_tokens: u32) -> Arc<VlmSettings> {
    let s = VlmSettings::from_config_text(&format!(
        r#"
        [vlm]
        base_url = "http://127.0.0.1:9/v1"
        model = "microsoft/maira-2"
        family = "maira2"
        [vlm.tools.answer_visual_question]
        backend = "native"
        model = "{MODEL}"
        max_tokens = {tool_max_tokens}
        "#
    ))
    .expect("config");
    Arc::new(s)
}

fn store_with_reference_image() -> (Arc<ImageStore>, String) {
    let store = Arc::new(ImageStore::default());
    let rel = reference()["image"].as_str().expect("image").to_string();
    let path = root().join(&rel);
    assert!(
        path.is_file(),
        "real test image missing: {}",
        path.display()
    );
    let id = store.ingest_file(&path).expect("ingest");
    (store, id)
}

#[test]
fn native_backend_is_configured_per_tool() {
    let s = native_settings(12);
    match s.backend("answer_visual_question").expect("ok") {
        Some(Backend::Native(n)) => {
            assert_eq!(n.model, MODEL);
            assert_eq!(n.max_tokens, 12);
        }
        other => panic!("expected native, got {other:?}"),
    }
    assert!(matches!(
        s.backend("ground_phrase").expect("ok"),
        Some(Backend::Served(_))
    ));
    let bad = VlmSettings::from_config_text("[vlm]\nbackend = \"onnx\"\n").expect("parses");
    let e = bad
        .backend("answer_visual_question")
        .expect_err("bad backend");
    assert!(e.to_string().contains("served or native"), "{e}");
}

#[tokio::test]
async fn native_answer_is_the_transformers_greedy_decode() {
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = ModelRegistry::new(dir.path()).expect("registry");
    hilum_models::import(
        &registry,
        MODEL,
        &fixture().join("model.safetensors"),
        &ImportOptions::default(),
    )
    .expect("import of the tiny checkpoint with its tokenizer.json and config.json");
    let pool = unquantized(registry);
    let r = reference();
    let max_tokens = r["greedy_ids"].as_array().expect("ids").len() as u32;
    let (store, id) = store_with_reference_image();
    let tool = AnswerVisualQuestion::with_models(store, native_settings(max_tokens), pool);
    assert!(tool.available(&Environment::default()));
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "question": r["question"]}),
        )
        .await
        .expect("native answer");
    let expected = r["answer"].as_str().expect("answer").trim();
    assert_eq!(out.data["answer"], expected, "{}", out.data);
    assert_eq!(out.data["backend"], "native");
    assert_eq!(out.data["completion_tokens"], max_tokens);
    assert_eq!(out.data["model"], MODEL);
    // The prompt: [INST] <image>\n{question} [/INST] with one token per image patch.
    assert!(out.data["prompt_tokens"].as_u64().expect("prompt tokens") > 16);
    assert!(out.summary.contains(expected), "{}", out.summary);
}

#[tokio::test]
async fn missing_native_weights_name_the_install_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = unquantized(ModelRegistry::new(dir.path()).expect("registry"));
    let (store, id) = store_with_reference_image();
    let tool = AnswerVisualQuestion::with_models(store, native_settings(8), pool);
    let err = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "question": "is the heart enlarged?"}),
        )
        .await
        .expect_err("not installed");
    assert!(matches!(err, ToolError::ModelMissing { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("hilum models import llava-med-v1.5"), "{msg}");
    assert!(msg.contains("scripts/convert_llava.py"), "{msg}");
}

#[test]
fn import_refuses_llava_weights_without_their_tokenizer() {
    let src = tempfile::tempdir().expect("tempdir");
    let lone = src.path().join("model.safetensors");
    std::fs::copy(fixture().join("model.safetensors"), &lone).expect("copy");
    std::fs::copy(
        fixture().join("config.json"),
        src.path().join("config.json"),
    )
    .expect("copy");
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = ModelRegistry::new(dir.path()).expect("registry");
    let err = hilum_models::import(&registry, MODEL, &lone, &ImportOptions::default())
        .expect_err("no tokenizer.json");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    assert!(registry.installed(MODEL).is_err());
}

#[tokio::test]
async fn ground_phrase_on_the_native_backend_says_it_needs_a_grounding_model() {
    let s = VlmSettings::from_config_text("[vlm]\nbackend = \"native\"\n").expect("config");
    let (store, id) = store_with_reference_image();
    let tool = GroundPhrase::new(store, Arc::new(s));
    // Hidden from the model, which has localize_finding for "where?".
    assert!(!tool.available(&Environment::default()));
    let err = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "phrase": "left pleural effusion"}),
        )
        .await
        .expect_err("no native grounding");
    let msg = err.to_string();
    assert!(msg.contains("served grounding model"), "{msg}");
    assert!(msg.contains("localize_finding"), "{msg}");
}
