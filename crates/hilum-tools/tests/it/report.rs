//! `generate_report` end to end on a real radiograph, with the tiny seeded report models of
//! `tests/fixtures/report` installed under the real model ids in a temporary models directory.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hilum_agent::{Tool, ToolContext, ToolError, Typed};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_models::report::ReportModel;
use hilum_models::{Device, ImportOptions, ModelPool, ModelRegistry};
use hilum_tools::report::{FINDINGS_MODEL, IMPRESSION_MODEL};
use hilum_tools::GenerateReport;
use serde_json::json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn radiograph() -> PathBuf {
    let p = root().join("../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png");
    assert!(p.is_file(), "real radiograph missing: {}", p.display());
    p
}

/// Imports a fixture checkpoint as model `id`, with its config.json and tokenizer.json beside
/// the installed weights.
fn install(reg: &ModelRegistry, id: &str, fixture: &str) {
    let src = root().join("tests/fixtures/report").join(fixture);
    hilum_models::import(
        reg,
        id,
        &src.join("model.safetensors"),
        &ImportOptions::default(),
    )
    .unwrap_or_else(|e| panic!("import {id}: {e}"));
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), reg.model_dir(id).join(f)).expect("copy companion");
    }
}

fn setup(
    dir: &Path,
    with_models: bool,
) -> (
    Typed<GenerateReport>,
    String,
    Arc<ModelPool>,
    Arc<ImageStore>,
) {
    let reg = ModelRegistry::new(dir).expect("registry");
    if with_models {
        install(&reg, FINDINGS_MODEL, "tiny_pad");
        install(&reg, IMPRESSION_MODEL, "tiny_proj");
    }
    let pool = Arc::new(ModelPool::new(Arc::new(reg)));
    let store = Arc::new(ImageStore::new(StoreLimits::default()));
    let id = store
        .ingest_file(&radiograph())
        .expect("real image decodes");
    (
        GenerateReport::new(store.clone(), pool.clone()),
        id,
        pool,
        store,
    )
}

#[tokio::test]
async fn missing_weights_name_the_fetch_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tool, id, _, _) = setup(dir.path(), false);
    let err = tool
        .call(&ToolContext::default(), json!({"image": id}))
        .await
        .err();
    match err {
        Some(ToolError::ModelMissing { model, fix }) => {
            assert_eq!(model, FINDINGS_MODEL);
            assert_eq!(fix, format!("hilum models fetch {FINDINGS_MODEL}"));
        }
        other => panic!("expected ModelMissing, got {other:?}"),
    }
}

#[tokio::test]
async fn writes_both_sections_as_the_models_decode_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tool, id, pool, store) = setup(dir.path(), true);
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "max_length": 24}),
        )
        .await
        .expect("report");
    let d = &out.data;
    assert_eq!(d["models"], json!([FINDINGS_MODEL, IMPRESSION_MODEL]));
    assert!(out.summary.contains("FINDINGS:"), "{}", out.summary);
    assert!(out.summary.contains("IMPRESSION:"), "{}", out.summary);
    assert!(out.summary.contains("tokens/s"), "{}", out.summary);
    let tokens = d["tokens_generated"].as_u64().expect("tokens");
    assert!((2..=2 * 23).contains(&tokens), "{tokens}");
    assert!(d["tokens_per_second"].as_f64().expect("rate") > 0.0);

    // The same text as the model decoding the same prepared pixels directly.
    for (section, model_id) in [
        ("findings", FINDINGS_MODEL),
        ("impression", IMPRESSION_MODEL),
    ] {
        let model = pool
            .get_or_load::<ReportModel>(model_id, Device::Cpu, hilum_models::Backend::Candle)
            .expect("warm model");
        let px = store.prepared(&id, &model.recipe()).expect("prepared");
        assert_eq!(
            model.recipe(),
            hilum_models::report::recipe(model.input_size)
        );
        let gen = model
            .generate_from(&px, &model.generation(1, 24))
            .expect("generate");
        assert_eq!(
            d[section].as_str().expect("text"),
            model.decode(&gen.ids).expect("decode"),
            "{section}"
        );
        assert_eq!(
            d[format!("{section}_detail")]["tokens"].as_u64(),
            Some(gen.new_tokens() as u64)
        );
    }
}

#[tokio::test]
async fn one_section_with_beam_search() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tool, id, _, _) = setup(dir.path(), true);
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "sections": "impression", "num_beams": 3, "max_length": 16}),
        )
        .await
        .expect("report");
    let d = &out.data;
    assert_eq!(d["num_beams"], 3);
    assert!(d.get("findings").is_none());
    assert!(d["impression"].is_string());
    assert!(!out.summary.contains("FINDINGS:"));
    assert!(d["tokens_generated"].as_u64().expect("tokens") <= 15);
}

#[tokio::test]
async fn max_length_past_the_position_table_is_capped_not_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (tool, id, pool, _) = setup(dir.path(), true);
    let limit = pool
        .get_or_load::<ReportModel>(FINDINGS_MODEL, Device::Cpu, hilum_models::Backend::Candle)
        .expect("warm model")
        .max_length_limit();
    // The default max_length (128) is longer than the tiny models' position tables.
    assert!(limit < 128, "fixture limit {limit}");
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "sections": "findings"}),
        )
        .await
        .expect("generation ends at the table's end");
    let detail = &out.data["findings_detail"];
    assert_eq!(detail["max_length_used"].as_u64(), Some(limit as u64));
    assert!(
        detail["tokens"].as_u64().expect("tokens") < limit as u64,
        "{detail}"
    );
    assert!(out.summary.contains("capped at"), "{}", out.summary);
}
