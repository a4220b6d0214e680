//! The native LLaVA against transformers 4.57.6 on tiny seeded models
//! (`scripts/fixtures/make_llava_fixtures.py`, fixtures in `tests/fixtures/llava/`): a Llama text model
//! with centre-cropped input and a Mistral text model with pad-to-square input, both with a
//! CLIP vision tower, grouped-query attention and a real radiograph.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, IndexOp, Tensor};
use candle_nn::VarBuilder;
use hilum_models::llava::{self, AspectMode, Config, Llava, Precision};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llava")
}

struct Fixture {
    model: Llava,
    cfg: Config,
    reference: BTreeMap<String, Tensor>,
    meta: serde_json::Value,
    dir: PathBuf,
}

fn load(name: &str, precision: Precision) -> Fixture {
    let dir = fixtures().join(name);
    let cfg = Config::from_json_file(&dir.join("config.json")).expect("config.json");
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[dir.join("model.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .expect("weights");
    let model = Llava::load(vb, &cfg, precision).expect("load");
    let reference = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
        .expect("reference")
        .into_iter()
        .collect();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"),
    )
    .expect("json");
    Fixture {
        model,
        cfg,
        reference,
        meta,
        dir,
    }
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::U32))
        .and_then(|t| t.to_vec1::<u32>())
        .expect("ids")
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff")
}

fn check_logits_and_greedy(name: &str) {
    let f = load(name, Precision::Dense);
    let px = &f.reference["pixel_values"];
    let input_ids = ids(&f.reference["input_ids"]);
    // The prompt logits of the full forward.
    let logits = f.model.forward(&input_ids, Some(px)).expect("forward");
    let d = max_abs_diff(&logits, &f.reference["logits"]);
    eprintln!("{name}: prompt logits max abs diff {d:e}");
    assert!(d < 1e-4, "{name}: prompt logits differ by {d}");

    // Greedy decoding with the KV cache, token for token.
    let expected = ids(&f.reference["greedy_ids"]);
    let mut seen = Vec::new();
    let g = f
        .model
        .generate(&input_ids, Some(px), expected.len(), &[2], |t| seen.push(t))
        .expect("generate");
    assert_eq!(g.ids, expected, "{name}: greedy ids");
    assert_eq!(seen, expected);
    assert_eq!(g.prompt_tokens, input_ids.len());

    // The cached decode steps give the logits of a full forward over prompt + continuation.
    let full: Vec<u32> = input_ids
        .iter()
        .chain(&expected[..expected.len() - 1])
        .copied()
        .collect();
    let full_logits = f.model.forward(&full, Some(px)).expect("full forward");
    let d = max_abs_diff(&full_logits, &f.reference["greedy_logits"]);
    eprintln!("{name}: prompt+continuation logits max abs diff {d:e}");
    assert!(d < 1e-4, "{name}: prompt+continuation logits differ by {d}");
    let mut cache = llava::KvCache::default();
    let feats = f
        .model
        .encode_images(px)
        .and_then(|x| Ok(x.flatten_to(1)?))
        .expect("features");
    let e = f.model.embed(&input_ids, Some(&feats)).expect("embed");
    f.model.forward_embeds(&e, &mut cache).expect("prefill");
    for (step, &tok) in expected[..expected.len() - 1].iter().enumerate() {
        let e = f.model.embed(&[tok], None).expect("embed");
        let l = f.model.forward_embeds(&e, &mut cache).expect("step");
        let pos = input_ids.len() + step;
        let r = f.reference["greedy_logits"]
            .i((.., pos..pos + 1))
            .expect("slice");
        let d = max_abs_diff(&l, &r);
        assert!(d < 1e-4, "{name}: cached step {step} logits differ by {d}");
    }
    let _ = (&f.cfg, &f.meta, &f.dir);
}

#[test]
fn llama_llava_matches_transformers_logits_and_greedy_decode() {
    check_logits_and_greedy("tiny_llama");
}

#[test]
fn mistral_llava_matches_transformers_logits_and_greedy_decode() {
    check_logits_and_greedy("tiny_mistral");
}

#[test]
fn tokenizer_and_image_token_expansion_match_the_hf_processor() {
    for name in ["tiny_llama", "tiny_mistral"] {
        let f = load(name, Precision::Dense);
        let tok =
            tokenizers::Tokenizer::from_file(f.dir.join("tokenizer.json")).expect("tokenizer");
        let prompt = f.meta["prompt"].as_str().expect("prompt");
        let enc = tok.encode(prompt, true).expect("encode");
        assert_eq!(
            enc.get_ids(),
            ids(&f.reference["prompt_ids"]).as_slice(),
            "{name}"
        );
        let expanded = llava::expand_image_tokens(
            enc.get_ids(),
            f.cfg.image_token_index,
            f.cfg.image_seq_length(),
        );
        assert_eq!(expanded, ids(&f.reference["input_ids"]), "{name}");
        let answer = tok
            .decode(&ids(&f.reference["greedy_ids"]), true)
            .expect("decode");
        assert_eq!(answer, f.meta["answer"].as_str().expect("answer"), "{name}");
    }
}

#[test]
fn preprocessing_matches_the_clip_image_processor() {
    for name in ["tiny_llama", "tiny_mistral"] {
        let f = load(name, Precision::Dense);
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(f.meta["image"].as_str().expect("image"));
        // PIL's convert("RGB") of this grey radiograph stored as RGB: all channels equal.
        let rgb = image::open(&path).expect("radiograph").to_rgb8();
        assert!(rgb.pixels().all(|p| p[0] == p[1] && p[1] == p[2]));
        let gray: Vec<u8> = rgb.pixels().map(|p| p[0]).collect();
        let mode = match f.meta["image_aspect_ratio"].as_str() {
            Some("pad") => AspectMode::Pad,
            _ => AspectMode::Crop,
        };
        let size = f.cfg.vision_config.image_size;
        let px = llava::preprocess(
            &gray,
            rgb.width() as usize,
            rgb.height() as usize,
            size,
            mode,
            &Device::Cpu,
        )
        .expect("preprocess");
        let d = max_abs_diff(&px, &f.reference["pixel_values"]);
        eprintln!("{name} ({mode:?}): pixel values max abs diff {d:e}");
        assert!(d < 1e-5, "{name} ({mode:?}): pixel values differ by {d}");
    }
}

#[test]
fn quantized_decoder_stays_close_to_the_reference() {
    let f = load("tiny_llama", Precision::Q8_0);
    let input_ids = ids(&f.reference["input_ids"]);
    let logits = f
        .model
        .forward(&input_ids, Some(&f.reference["pixel_values"]))
        .expect("forward");
    let d = max_abs_diff(&logits, &f.reference["logits"]);
    let scale = max_abs_diff(
        &f.reference["logits"],
        &f.reference["logits"].zeros_like().expect("zeros"),
    );
    eprintln!("Q8_0 prompt logits: max abs diff {d} (logit range {scale})");
    assert!(d > 0.0, "the linear layers were not quantized");
    assert!(d < 0.1 * scale, "Q8_0 logits drift by {d} of {scale}");
}

#[test]
fn full_size_parameter_lists_match_transformers_one_to_one() {
    let text = std::fs::read_to_string(fixtures().join("full_size_params.json")).expect("list");
    let all: serde_json::Value = serde_json::from_str(&text).expect("json");
    for name in ["llava-1.5-7b", "llava-med-v1.5-mistral-7b"] {
        let entry = &all[name];
        let cfg = Config::from_json(&entry["config"].to_string()).expect("config");
        let expected: BTreeMap<String, Vec<usize>> =
            serde_json::from_value(entry["params"].clone()).expect("params");
        let ours = cfg.expected_params().expect("expected_params");
        hilum_models::weights::compare(&ours, &expected).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(ours.len() > 600, "{name}: {}", ours.len());
    }
}

#[test]
fn tiny_checkpoints_hold_exactly_the_expected_parameters() {
    for name in ["tiny_llama", "tiny_mistral"] {
        let f = load(name, Precision::Dense);
        let actual =
            hilum_models::weights::shapes(&f.dir.join("model.safetensors")).expect("shapes");
        hilum_models::weights::compare(&f.cfg.expected_params().expect("params"), &actual)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn generation_ends_at_the_last_position_instead_of_failing() {
    let f = load("tiny_mistral", Precision::Dense);
    let input_ids = ids(&f.reference["input_ids"]);
    let room = 128 - input_ids.len(); // max_position_embeddings of the tiny config
    let g = f
        .model
        .generate(
            &input_ids,
            Some(&f.reference["pixel_values"]),
            1000,
            &[2],
            |_| {},
        )
        .expect("generate");
    assert!(g.ids.len() <= room, "{} > {room}", g.ids.len());
    assert!(g.stopped || g.ids.len() == room, "{g:?}");
    // The first tokens are the reference greedy decode.
    let expected = ids(&f.reference["greedy_ids"]);
    assert_eq!(&g.ids[..expected.len()], expected.as_slice());
}
