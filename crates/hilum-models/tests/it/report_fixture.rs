//! The SwinV2 + BERT report model against Hugging Face transformers 4.57.6 on tiny seeded
//! configurations (`scripts/fixtures/make_report_fixtures.py` → `tests/fixtures/report/`): encoder output
//! and decoder logits to 1e-4, greedy and beam-search tokens exactly, detokenised text exactly,
//! and the full-size parameter list one to one.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::{DType, Tensor};
use hilum_models::report::{self, Config, GenerationConfig, ReportModel};
use hilum_models::Device;
use serde_json::Value;

const CASES: [&str; 2] = ["tiny_pad", "tiny_proj"];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/report")
}

fn load(case: &str) -> (ReportModel, BTreeMap<String, Tensor>, Value) {
    let dir = fixtures().join(case);
    let model = ReportModel::load_files(&dir.join("model.safetensors"), None, 0, Device::Cpu)
        .unwrap_or_else(|e| panic!("{case}: {e}"));
    let reference = candle_core::safetensors::load(
        dir.join("reference.safetensors"),
        &candle_core::Device::Cpu,
    )
    .expect("reference tensors");
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"),
    )
    .expect("reference json");
    (model, reference.into_iter().collect(), json)
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("difference")
}

#[test]
fn encoder_output_matches_transformers() {
    for case in CASES {
        let (model, r, _) = load(case);
        let out = model.net.encode(&r["pixel_values"]).expect("encode");
        let d = max_abs_diff(&out, &r["encoder_output"]);
        eprintln!("{case}: encoder max abs diff {d:e}");
        assert!(d < 1e-4, "{case}: encoder max abs diff {d}");
    }
}

#[test]
fn decoder_logits_match_transformers() {
    for case in CASES {
        let (model, r, _) = load(case);
        let states = model.net.encode(&r["pixel_values"]).expect("encode");
        let ids = r["prefix_ids"].to_dtype(DType::U32).expect("ids");
        let logits = model.net.logits(&states, &ids).expect("logits");
        let d = max_abs_diff(&logits, &r["logits"]);
        eprintln!("{case}: logits max abs diff {d:e}");
        assert!(d < 1e-4, "{case}: logits max abs diff {d}");
    }
}

/// Incremental decoding with the KV cache gives the same logits as the whole prefix at once.
#[test]
fn cached_decoding_equals_full_prefix() {
    let (model, r, _) = load("tiny_pad");
    let states = model.net.encode(&r["pixel_values"]).expect("encode");
    let ids = r["prefix_ids"].to_dtype(DType::U32).expect("ids");
    let full = model.net.logits(&states, &ids).expect("logits");
    let cross = model.net.cross_kv(&states).expect("cross");
    let mut cache = report::KvCache::default();
    let t = ids.dim(1).expect("len");
    for i in 0..t {
        let step = ids.narrow(1, i, 1).expect("narrow");
        let l = model
            .net
            .decoder
            .forward(&step, &mut cache, &cross)
            .expect("step");
        let d = max_abs_diff(&l, &full.narrow(1, i, 1).expect("narrow"));
        assert!(d < 1e-4, "position {i}: {d}");
    }
    assert_eq!(cache.len(), t);
}

#[test]
fn greedy_and_beam_tokens_match_transformers() {
    let mut eos_seen = false;
    let mut max_len_seen = false;
    for case in CASES {
        let (model, r, json) = load(case);
        let runs = json["generation"].as_array().expect("runs");
        for run in runs {
            let s = &run["settings"];
            let cfg = GenerationConfig {
                num_beams: s["num_beams"].as_u64().expect("num_beams") as usize,
                max_length: s["max_length"].as_u64().expect("max_length") as usize,
                length_penalty: s["length_penalty"].as_f64().unwrap_or(1.0) as f32,
                early_stopping: s["early_stopping"].as_bool().unwrap_or(false),
                decoder_start_token_id: json["cls"].as_u64().expect("cls") as u32,
                eos_token_id: Some(json["sep"].as_u64().expect("sep") as u32),
            };
            let want: Vec<u32> = run["ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect();
            let got = model
                .net
                .generate(&r["pixel_values"], &cfg)
                .expect("generate");
            assert_eq!(got.ids, want, "{case} {s}");
            let text = model.decode(&got.ids).expect("decode");
            assert_eq!(text, run["text"].as_str().expect("text"), "{case} {s}");
            eos_seen |= run["ended_with_eos"] == true && cfg.num_beams > 1;
            max_len_seen |= want.len() == cfg.max_length && cfg.num_beams > 1;
        }
    }
    // The fixtures exercise both ways a beam search ends.
    assert!(eos_seen && max_len_seen);
}

#[test]
fn decoding_strips_special_tokens_like_transformers() {
    let (model, _, json) = load("tiny_proj");
    let ids: Vec<u32> = json["decode_check"]["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("id") as u32)
        .collect();
    let text = model.decode(&ids).expect("decode");
    assert_eq!(text, json["decode_check"]["text"].as_str().expect("text"));
    assert!(!text.contains("[CLS]") && !text.contains("[SEP]"));
}

#[test]
fn full_size_parameter_list_matches_transformers() {
    let json: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("full_size_params.json")).expect("params json"),
    )
    .expect("json");
    let vocab = json["vocab_size"].as_u64().expect("vocab") as usize;
    let want: BTreeMap<String, Vec<usize>> = json["params"]
        .as_object()
        .expect("params")
        .iter()
        .map(|(k, v)| {
            let s = v
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_u64().expect("dim") as usize)
                .collect();
            (k.clone(), s)
        })
        .collect();
    let got = report::expected_params(&Config::chexpert_plus_baseline(vocab));
    hilum_models::weights::compare(&got, &want).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got.len(), want.len());
}

#[test]
fn mismatched_weights_are_refused_with_the_difference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = fixtures().join("tiny_pad");
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy");
    }
    // tiny_proj's config over tiny_pad's weights.
    std::fs::copy(
        fixtures().join("tiny_proj/config.json"),
        dir.path().join("config.json"),
    )
    .expect("copy");
    let err = ReportModel::load_files(&dir.path().join("model.safetensors"), None, 32, Device::Cpu)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("swinv2-bert"), "{err}");
    assert!(err.contains("missing") || err.contains("shape"), "{err}");
}

/// The published repositories ship `vocab.txt`, not `tokenizer.json`: the tokenizer built from
/// it decodes like the one transformers saved.
#[test]
fn vocab_txt_tokenizer_decodes_like_tokenizer_json() {
    let src = fixtures().join("tiny_pad");
    let tj: Value = serde_json::from_str(
        &std::fs::read_to_string(src.join("tokenizer.json")).expect("tokenizer.json"),
    )
    .expect("json");
    let mut vocab: Vec<(u64, String)> = tj["model"]["vocab"]
        .as_object()
        .expect("vocab")
        .iter()
        .map(|(k, v)| (v.as_u64().expect("id"), k.clone()))
        .collect();
    vocab.sort();
    let dir = tempfile::tempdir().expect("tempdir");
    let lines: Vec<String> = vocab.into_iter().map(|(_, t)| t).collect();
    std::fs::write(dir.path().join("vocab.txt"), lines.join("\n") + "\n").expect("write");
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(src.join(f), dir.path().join(f)).expect("copy");
    }
    let from_vocab =
        ReportModel::load_files(&dir.path().join("model.safetensors"), None, 32, Device::Cpu)
            .expect("loads with vocab.txt");
    let (from_json, _, json) = load("tiny_pad");
    let mut checked = 0;
    for run in json["generation"].as_array().expect("runs") {
        let ids: Vec<u32> = run["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let a = from_vocab.decode(&ids).expect("decode");
        assert_eq!(a, from_json.decode(&ids).expect("decode"));
        assert_eq!(a, run["text"].as_str().expect("text"));
        checked += 1;
    }
    assert!(checked > 0);
    // Without any tokenizer the error says how to get one.
    std::fs::remove_file(dir.path().join("vocab.txt")).expect("rm");
    let err = ReportModel::load_files(&dir.path().join("model.safetensors"), None, 32, Device::Cpu)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("scripts/convert_report.py"), "{err}");
}

/// The report models' recipe on real radiographs (a PNG and a JPEG) against transformers'
/// ViTImageProcessor as the checkpoints configure it (`scripts/fixtures/make_report_preprocess_fixtures.py`
/// wrote its planes back as bytes): equal byte for byte.
#[test]
fn the_recipe_is_the_vit_image_processor() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = root.join("tests/fixtures/report_preprocess");
    let manifest: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("manifest.json")).expect("manifest"),
    )
    .expect("manifest json");
    let store = hilum_imaging::ImageStore::default();
    for rec in manifest.as_array().expect("list") {
        let file = rec["file"].as_str().expect("file");
        let want = std::fs::read(dir.join(rec["plane"].as_str().expect("plane"))).expect("plane");
        let id = store
            .ingest_file(&root.join("../shared/data").join(file))
            .expect("radiograph");
        let for_variant = |recipe: hilum_imaging::Preprocess| {
            let x = store.prepared(&id, &recipe).expect("prepared");
            assert_eq!(x.shape(), [3, 224, 224]);
            // Back to the processor's bytes: v * std + mean, times 255 (red channel).
            let off = x.data[..224 * 224]
                .iter()
                .zip(&want)
                .map(|(v, &b)| ((v * 0.229 + 0.485) * 255.0 - b as f32).abs())
                .fold(0f32, f32::max);
            off
        };
        let recipe = report::recipe(224);
        let off = for_variant(recipe);
        let float = for_variant(hilum_imaging::Preprocess::imagenet(224));
        eprintln!("{file}: recipe off by {off:.2e} levels; a float bilinear resize by {float:.2}");
        assert!(off < 1e-3, "{file}: {off} levels from ViTImageProcessor");
    }
}
