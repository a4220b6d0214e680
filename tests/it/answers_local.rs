//! Answers that answer the question, with the real local model (Qwen2.5-Coder-0.5B GGUF), the
//! real lung U-Net and a real radiograph: each plain question a new user asks is answered from
//! the right tool, or Hilum says it cannot assess that finding and names the install command.
//! Then the same finding questions with a classifier installed (seeded weights imported as a
//! site checkpoint): answered from `classify_chest_xray`'s scores, the model named.
//!
//! Without the local model (`scripts/fetch_local_llm.sh`) the tests print why and check nothing.

use std::sync::{Arc, OnceLock};

use hilum::agent::coverage::{self, Topic};
use hilum::agent::{Agent, AgentConfig, RunInput, RunOutcome};
use hilum::llm_local::LocalLlm;
use hilum::tools::{topics, Registry, ToolDeps};
use hilum_imaging::ImageStore;
use hilum_models::{ImportOptions, ModelPool, ModelRegistry};

use crate::local_llm_agent::{llm, lung_models, serial, shared_data, shared_image};

const IMAGE: &str = "nih_00000001_000_cardiomegaly.png";

/// As `hilum analyze` runs the local model: every tool registered, those whose requirements
/// do not hold withheld (but known to the capability table), short observations.
async fn ask(llm: Arc<LocalLlm>, models: Arc<ModelPool>, question: &str) -> RunOutcome {
    llm.reset_cache();
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&shared_image(IMAGE))
        .expect("real radiograph decodes");
    let deps = ToolDeps::new(store, models);
    let env = hilum::tools::environment(&deps, std::slice::from_ref(&id));
    let toolbox = Registry::builtin()
        .toolbox(&deps)
        .expect("toolbox")
        .runnable(&env);
    let config = AgentConfig {
        max_rounds: 3,
        max_tokens: Some(200),
        max_observation_chars: 600,
        ..AgentConfig::default()
    };
    let agent = Agent::new(llm, Arc::new(toolbox), env, config);
    let out = agent
        .run(
            RunInput {
                question: question.into(),
                images: vec![id],
                ..Default::default()
            },
            None,
        )
        .await;
    eprintln!(
        "Q: {question}\nA ({} round(s), answers_question {:?}, dropped {:?}): {}\n",
        out.rounds,
        out.answers_question,
        out.dropped,
        out.answer.as_deref().unwrap_or("-")
    );
    out
}

/// No sentence of `answer` claims something about a topic no successful tool result covers:
/// each one that names such a topic says it cannot be assessed.
fn claims_nothing_uncovered(answer: &str, uncovered: &[&Topic]) {
    for sentence in answer.split(['.', '\n']) {
        // The install command names a tool (`generate_report`), not a finding.
        if sentence.contains("hilum models ") {
            continue;
        }
        for topic in uncovered {
            if coverage::mentions(sentence, topic) {
                assert!(
                    coverage::states_inability(sentence),
                    "claims {} without a tool: {sentence:?} in {answer:?}",
                    topic.id
                );
            }
        }
    }
}

fn answer(out: &RunOutcome) -> String {
    assert!(out.error.is_none(), "{:?}", out.error);
    out.answer.clone().expect("an answer")
}

/// The finding questions with only the lung U-Net: Hilum declines each by name, with the
/// install command, and the model is never asked (no round).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_only_the_lung_unet_uncovered_findings_are_declined_with_the_install_command() {
    let Some(llm) = llm() else { return };
    let _one_at_a_time = serial().await;
    let cases: &[(&str, &Topic, &str)] = &[
        (
            "Is the heart enlarged?",
            &topics::CARDIOMEGALY,
            "chestx-det-pspnet",
        ),
        (
            "Is there cardiomegaly?",
            &topics::CARDIOMEGALY,
            "densenet121-res224-all",
        ),
        (
            "What is the cardiothoracic ratio?",
            &topics::CTR,
            "chestx-det-pspnet",
        ),
        ("What's the CTR here?", &topics::CTR, "chestx-det-pspnet"),
        (
            "Are there any nodules?",
            &topics::NODULE,
            "densenet121-res224-all",
        ),
        (
            "Do you see a nodule in the lungs?",
            &topics::NODULE,
            "densenet121-res224-all",
        ),
        (
            "Is there a pleural effusion?",
            &topics::EFFUSION,
            "densenet121-res224-all",
        ),
        (
            "Any fluid at the lung bases?",
            &topics::EFFUSION,
            "densenet121-res224-all",
        ),
        (
            "Is there a pneumothorax on the left?",
            &topics::PNEUMOTHORAX,
            "densenet121-res224-all",
        ),
        (
            "Is the right lung collapsed?",
            &topics::PNEUMOTHORAX,
            "densenet121-res224-all",
        ),
        (
            "Write a short radiology report",
            &topics::REPORT,
            "chexpert-report-findings",
        ),
        (
            "Generate a report for this image",
            &topics::REPORT,
            "chexpert-report-findings",
        ),
    ];
    for (question, topic, model) in cases {
        let out = ask(llm.clone(), lung_models(), question).await;
        let a = answer(&out);
        assert!(
            a.starts_with(&format!("I cannot assess {}", topic.label)),
            "{question}: {a}"
        );
        assert!(
            a.contains("hilum models ") && a.contains(model),
            "{question}: {a}"
        );
        assert_eq!(out.rounds, 0, "{question}: the model was asked");
        assert_eq!(out.cannot_assess, [topic.label], "{question}");
        claims_nothing_uncovered(&a, &[topic]);
    }
}

/// The lungs' size goes to the model, whose answer must give the coverage and both areas (from
/// the model, or stated by Hilum from segment_lungs when the model leaves them out); a
/// two-part question gets that and the sentence for the part no tool covers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_only_the_lung_unet_the_lungs_size_is_answered_with_coverage_and_both_areas() {
    let Some(llm) = llm() else { return };
    let _one_at_a_time = serial().await;
    let cases: &[(&str, Option<&Topic>)] = &[
        ("How large are the lungs in this image?", None),
        ("What is the size of the lungs?", None),
        (
            "How large are the lungs, and are there any nodules?",
            Some(&topics::NODULE),
        ),
        (
            "Is the heart enlarged, and what is the lung area?",
            Some(&topics::CARDIOMEGALY),
        ),
    ];
    for (question, uncovered) in cases {
        let out = ask(llm.clone(), lung_models(), question).await;
        let a = answer(&out);
        let seg = out
            .results
            .iter()
            .filter(|r| r.call.name == "segment_lungs" || r.call.name == "measure_chest")
            .find_map(|r| r.result.as_ref().ok())
            .unwrap_or_else(|| panic!("{question}: no lung tool ran: {a}"));
        assert!(a.contains("cover"), "{question}: no coverage in {a}");
        // Both areas as the tools print them (segment_lungs in px here: a PNG has no spacing).
        let areas: Vec<String> = out
            .results
            .iter()
            .filter_map(|r| r.result.as_ref().ok())
            .flat_map(|o| {
                // segment_lungs: `right_lung.area_px`; measure_chest: `right_lung_px`.
                ["right_lung", "left_lung"].into_iter().filter_map(|side| {
                    let px = o.data[side]["area_px"]
                        .as_u64()
                        .or_else(|| o.data[format!("{side}_px")].as_u64())?;
                    Some(px.to_string())
                })
            })
            .collect();
        assert!(areas.len() >= 2, "{question}: {}", seg.summary);
        // As written, thousands separators aside.
        let plain = a.replace(',', "");
        for area in &areas[..2] {
            assert!(
                plain.contains(area.as_str()),
                "{question}: area {area} missing in {a}"
            );
        }
        match uncovered {
            Some(topic) => {
                assert!(
                    a.contains(&format!("I cannot assess {}", topic.label)),
                    "{a}"
                );
                claims_nothing_uncovered(&a, &[topic]);
            }
            None => assert!(out.cannot_assess.is_empty(), "{:?}", out.cannot_assess),
        }
        claims_nothing_uncovered(
            &a,
            &[&topics::NODULE, &topics::EFFUSION, &topics::PNEUMOTHORAX],
        );
    }
}

/// The lung U-Net and a classifier with seeded weights, imported as a site checkpoint.
fn lung_and_classifier() -> Arc<ModelPool> {
    static POOL: OnceLock<(tempfile::TempDir, Arc<ModelPool>)> = OnceLock::new();
    POOL.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        let h5 = shared_data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
        hilum_models::import(&reg, "lung-unet", &h5, &ImportOptions::default())
            .expect("import lung-unet");
        let arch = hilum_models::xrv::XrvSpec::densenet121_res224_all().arch;
        let w = hilum_models::xrv::synthetic_weights(&arch, 3).expect("weights");
        let ckpt = dir.path().join("site_densenet.safetensors");
        candle_core::safetensors::save(&w, &ckpt).expect("save checkpoint");
        let custom = ImportOptions {
            custom: true,
            ..ImportOptions::default()
        };
        hilum_models::import(&reg, "densenet121-res224-all", &ckpt, &custom)
            .expect("import the seeded classifier");
        (dir, Arc::new(ModelPool::new(Arc::new(reg))))
    })
    .1
    .clone()
}

/// With the classifier installed the nodule and effusion questions are answered from its
/// scores, naming the model; the heart question too (the classifier scores cardiomegaly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_classifier_installed_findings_are_answered_from_its_scores() {
    let Some(llm) = llm() else { return };
    let _one_at_a_time = serial().await;
    let cases: &[(&str, &str)] = &[
        ("Are there any nodules?", "Nodule"),
        ("Is there a nodule in the lungs?", "Nodule"),
        ("Is there a pleural effusion?", "Effusion"),
        ("Any fluid at the lung bases?", "Effusion"),
    ];
    for (question, label) in cases {
        let out = ask(llm.clone(), lung_and_classifier(), question).await;
        let a = answer(&out);
        let scores = out
            .results
            .iter()
            .filter(|r| r.call.name == "classify_chest_xray")
            .find_map(|r| r.result.as_ref().ok())
            .unwrap_or_else(|| panic!("{question}: the classifier did not run: {a}"));
        let score = scores.data["scores"]
            .as_array()
            .and_then(|s| s.iter().find(|s| s["label"] == *label))
            .and_then(|s| s["score"].as_f64())
            .expect("the label's score");
        assert!(out.cannot_assess.is_empty(), "{question}: {a}");
        assert!(
            a.contains(&format!("{score:.2}")) || a.contains(&format!("{score:.3}")),
            "{question}: the {label} score {score} is not in {a}"
        );
        assert!(
            a.contains("densenet121-res224-all") || a.contains("classify_chest_xray"),
            "{question}: model not named in {a}"
        );
    }
}
