//! Gemma 3's multimodal model (MedGemma 4B's architecture) against transformers 4.57.6, on a
//! seeded tiny `Gemma3ForConditionalGeneration` written by scripts/fixtures/make_gemma3_vlm_fixtures.py
//! (tests/fixtures/gemma3_vlm/tiny): the image processor's pixel values, the image features
//! (SigLIP tower + projector), the logits of every position of a prompt with two images and a
//! text-only turn (token ids: the tiny vocabulary has no tokenizer), and greedy tokens; and
//! MedGemma 4B's parameter names and shapes from transformers' model built with its config.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use candle_core::{Device, IndexOp, Tensor};
use hilum_llm_local::model::{argmax, MatmulMode, Precision};
use hilum_llm_local::vlm::{check_parameters, Gemma3Vlm, VlmConfig};
use serde_json::Value;

const TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma3_vlm")
}

/// The tiny snapshot in f32 (the fixtures are transformers' f32 outputs) on the CPU.
fn tiny(max_positions: usize) -> Gemma3Vlm {
    Gemma3Vlm::load(
        &fixtures().join("tiny"),
        max_positions,
        Precision::Dense,
        &Device::Cpu,
    )
    .expect("load tiny model")
}

fn reference() -> (HashMap<String, Tensor>, Value) {
    let dir = fixtures().join("tiny");
    let t = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
        .expect("reference.safetensors");
    let j: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"),
    )
    .expect("reference json");
    (t, j)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// The two test images as the processor's inputs: (bytes, width, height, channels).
fn images(r: &HashMap<String, Tensor>) -> Vec<(Vec<u8>, usize, usize, usize)> {
    let rgb = &r["image0_rgb"];
    let (h, w, c) = rgb.dims3().unwrap();
    let grey = &r["image1_grey"];
    let (gh, gw) = grey.dims2().unwrap();
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    vec![(bytes(rgb), w, h, c), (bytes(grey), gw, gh, 1)]
}

#[test]
fn tiny_model_matches_transformers() {
    let (r, j) = reference();
    let mut vlm = tiny(256);

    // Pixel values: the processor's resize and normalisation.
    let want_px = &r["pixel_values"];
    let mut feats = Vec::new();
    let mut px_diff = 0f32;
    let mut feat_diff = 0f32;
    for (i, (bytes, w, h, c)) in images(&r).iter().enumerate() {
        let px = vlm.pixel_values(bytes, *w, *h, *c).expect("pixel values");
        px_diff = px_diff.max(max_diff(&px, &want_px.i(i).unwrap()));
        // Features from the reference's own pixel values, so this compares the networks alone.
        let f = vlm
            .image_features(&want_px.i(i).unwrap())
            .expect("image features");
        feat_diff = feat_diff.max(max_diff(&f, &r["image_features"].i(i).unwrap()));
        feats.push(vlm.image_features(&px).expect("image features"));
    }
    eprintln!("pixel values: max |diff| {px_diff:e}; image features: max |diff| {feat_diff:e}");
    assert!(px_diff <= TOL, "pixel values differ by {px_diff}");
    assert!(feat_diff <= TOL, "image features differ by {feat_diff}");

    // Logits of every position of the two-image prompt.
    let prompt = ids(&j["prompt_ids"]);
    let logits = vlm.prefill(&prompt, &feats).expect("prefill");
    let logit_diff = max_diff(&logits, &r["logits"]);
    eprintln!(
        "logits ({} positions): max |diff| {logit_diff:e} (transformers without the image mask differs by {})",
        prompt.len(),
        j["causal_only_max_logit_diff"]
    );
    assert!(logit_diff <= TOL, "logits differ by {logit_diff}");

    // Greedy continuation: the prefill's last position, then one token at a time.
    let want = ids(&j["greedy"]);
    let mut got = vec![argmax(&logits.i(prompt.len() - 1).unwrap()).unwrap()];
    while got.len() < want.len() {
        let last = *got.last().unwrap();
        let l = vlm.decoder_mut().forward(&[last]).expect("decode step");
        got.push(argmax(&l).unwrap());
    }
    assert_eq!(
        got, want,
        "greedy tokens differ from transformers' generate"
    );
}

/// A prompt run in two calls (the text before the first image, then the rest with both
/// images) gives the one-call logits: image blocks are placed at their absolute positions.
#[test]
fn prefill_after_cached_text_matches() {
    let (r, j) = reference();
    let mut vlm = tiny(256);
    let prompt = ids(&j["prompt_ids"]);
    let feats: Vec<Tensor> = (0..2)
        .map(|i| {
            vlm.image_features(&r["pixel_values"].i(i).unwrap())
                .unwrap()
        })
        .collect();
    let k = 4; // <bos><start_of_turn>user\n
    let first = vlm.prefill(&prompt[..k], &[]).expect("text prefix");
    let rest = vlm.prefill(&prompt[k..], &feats).expect("the rest");
    let d1 = max_diff(&first, &r["logits"].narrow(0, 0, k).unwrap());
    let d2 = max_diff(&rest, &r["logits"].narrow(0, k, prompt.len() - k).unwrap());
    eprintln!("two-call prefill: max |diff| {d1:e} / {d2:e}");
    assert!(d1 <= TOL && d2 <= TOL);
}

/// llama.cpp's pair of files (text GGUF + mmproj, written from the same tiny model by the
/// fixture script with the `gguf` package) give what the safetensors snapshot gives.
#[test]
fn gguf_and_mmproj_match_the_safetensors_model() {
    let (r, j) = reference();
    let dir = fixtures().join("tiny");
    let dev = Device::Cpu;
    let mut st = tiny(256);
    let mut gg = Gemma3Vlm::load_gguf(
        &dir.join("text.gguf"),
        &dir.join("mmproj.gguf"),
        256,
        MatmulMode::Dense,
        &dev,
    )
    .expect("gguf + mmproj");
    // llama.cpp derives the query scale from the head size (equal to query_pre_attn_scalar on
    // every published Gemma 3 but 27B); the tiny model's differs on purpose.
    assert_eq!(gg.cfg.text.query_pre_attn_scalar.round(), 20.0);
    gg.decoder_mut().cfg.attn_scale = 1.0 / 24f64.sqrt();
    assert_eq!(
        (
            gg.cfg.image_token,
            gg.cfg.boi_token,
            gg.cfg.eoi_token,
            gg.cfg.mm_tokens_per_image
        ),
        (
            st.cfg.image_token,
            st.cfg.boi_token,
            st.cfg.eoi_token,
            st.cfg.mm_tokens_per_image
        )
    );
    let mut feats = Vec::new();
    let mut feat_diff = 0f32;
    for i in 0..2 {
        let px = r["pixel_values"].i(i).unwrap();
        let a = st.image_features(&px).unwrap();
        let b = gg.image_features(&px).unwrap();
        feat_diff = feat_diff.max(max_diff(&a, &b));
        feats.push(b);
    }
    let prompt = ids(&j["prompt_ids"]);
    let la = st.prefill(&prompt, &feats).unwrap();
    let lb = gg.prefill(&prompt, &feats).unwrap();
    let logit_diff = max_diff(&la, &lb);
    let ref_diff = max_diff(&lb, &r["logits"]);
    eprintln!(
        "gguf vs safetensors: features {feat_diff:e}, logits {logit_diff:e}; gguf vs transformers: logits {ref_diff:e}"
    );
    assert!(feat_diff <= 1e-5 && logit_diff <= 1e-5 && ref_diff <= TOL);
    let want = ids(&j["greedy"]);
    let mut got = vec![argmax(&lb.i(prompt.len() - 1).unwrap()).unwrap()];
    while got.len() < want.len() {
        let l = gg.decoder_mut().forward(&[*got.last().unwrap()]).unwrap();
        got.push(argmax(&l).unwrap());
    }
    assert_eq!(got, want);
}

#[test]
fn wrong_image_count_is_a_clear_error() {
    let (r, j) = reference();
    let mut vlm = tiny(256);
    let f = vlm
        .image_features(&r["pixel_values"].i(0).unwrap())
        .unwrap();
    let Err(err) = vlm.prefill(&ids(&j["prompt_ids"]), &[f]) else {
        panic!("one image for two blocks must fail");
    };
    let err = err.to_string();
    assert!(
        err.contains("32 image tokens but 1 image(s) of 16"),
        "{err}"
    );
}

#[test]
fn image_placeholders_expand_as_the_processor() {
    let vlm = tiny(64);
    let text = "<start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n";
    let soft = "<image_soft_token>".repeat(16);
    assert_eq!(
        vlm.expand_image_placeholders(text),
        format!(
            "<start_of_turn>user\n\n\n<start_of_image>{soft}<end_of_image>\n\nWhat is this?<end_of_turn>\n"
        )
    );
}

fn medgemma_config() -> (VlmConfig, Value) {
    let text = std::fs::read_to_string(fixtures().join("medgemma_4b_config.json")).unwrap();
    let cfg = VlmConfig::from_json(&text).expect("MedGemma 4B config");
    (cfg, serde_json::from_str(&text).unwrap())
}

#[test]
fn medgemma_4b_parameter_list_matches_transformers() {
    let (cfg, json) = medgemma_config();
    let want: Vec<(String, Vec<usize>)> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("medgemma_4b_params.json")).unwrap(),
    )
    .expect("params json");
    let mut got = cfg.parameters();
    got.sort();
    let mut want_sorted = want.clone();
    want_sorted.sort();
    assert_eq!(got.len(), want_sorted.len());
    for (g, w) in got.iter().zip(&want_sorted) {
        assert_eq!(g, w);
    }
    let total: usize = got.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
    assert_eq!(total, 4_300_079_472);
    let found: BTreeMap<String, Vec<usize>> = want.into_iter().collect();
    check_parameters(&cfg.parameters(), &found).expect("the loader's check accepts it");

    // The published config.json has no `layer_types` (older transformers): the pattern gives
    // the same layers (every sixth global).
    let mut old = json.clone();
    old["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("layer_types");
    let from_pattern = VlmConfig::from_json(&old.to_string()).unwrap();
    assert_eq!(from_pattern, cfg);
    let globals: Vec<usize> = (0..34).filter(|&i| !cfg.text.local[i]).collect();
    assert_eq!(globals, [5, 11, 17, 23, 29]);
    assert_eq!(cfg.text.rope_linear_factor, 8.0);
    assert_eq!(
        (cfg.vision.patches_per_side(), cfg.tokens_per_side()),
        (64, 16)
    );
}

#[test]
fn loader_names_what_is_wrong_with_a_checkpoint() {
    let (cfg, _) = medgemma_config();
    let mut found: BTreeMap<String, Vec<usize>> = cfg.parameters().into_iter().collect();
    found.remove("multi_modal_projector.mm_soft_emb_norm.weight");
    found.insert("language_model.model.norm.weight".into(), vec![2304]);
    found.insert("lm_head.weight".into(), vec![262_208, 2560]);
    let err = check_parameters(&cfg.parameters(), &found).unwrap_err();
    for part in [
        "missing multi_modal_projector.mm_soft_emb_norm.weight",
        "language_model.model.norm.weight is [2304], expected [2560]",
        "unexpected lm_head.weight",
    ] {
        assert!(err.contains(part), "{err}");
    }
}
