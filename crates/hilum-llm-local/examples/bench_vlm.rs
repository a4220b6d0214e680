//! Speed of Gemma 3 multimodal at MedGemma 4B's size, on placeholder weights (random, f32; no
//! MedGemma download):
//!
//!     cargo run --release -p hilum-llm-local --example bench_vlm -- \
//!         [DECODER_LAYERS] [VOCAB] [PRECISION] [--no-vision]
//!
//! - the SigLIP tower and projector on one 896 px picture (MedGemma's input; all 27 layers):
//!   preprocessing, then encoding to 256 soft tokens (`--no-vision` skips them, ~2 min here, and
//!   prefills placeholder features instead);
//! - the decoder: a prompt of one picture and a short question, then greedy one-token steps
//!   (tokens/s). MedGemma 4B has 34 decoder layers and 262,208 tokens; in f32 that is ~17 GB, so
//!   by default the decoder is cut to DECODER_LAYERS (default 4, the layer pattern kept) and the
//!   vocabulary to VOCAB (default the full 262,208: the output layer is part of each step's
//!   cost); the per-layer time scales the result to 34 layers, which the output states as an
//!   estimate. PRECISION (`none` default, `q8_0`, `q4k`) quantizes the decoder at load as a
//!   snapshot's is (`HILUM_VLM_QUANTIZE`); quantized, all 34 layers fit in memory (~4.6 GB).
//!
//! Prints one JSON object.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use hilum_llm_local::model::Precision;
use hilum_llm_local::vlm::{Gemma3Vlm, VlmConfig};

const CONFIG: &str = include_str!("../tests/fixtures/gemma3_vlm/medgemma_4b_config.json");
const PROMPT_TEXT_TOKENS: usize = 32;
const DECODE_STEPS: usize = 32;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let all: Vec<String> = std::env::args().collect();
    let vision = !all.iter().any(|a| a == "--no-vision");
    let args: Vec<&String> = all.iter().filter(|a| !a.starts_with("--")).collect();
    let layers: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(4);
    let full = VlmConfig::from_json(CONFIG)?;
    let vocab: usize = args
        .get(2)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(full.text.vocab);
    let precision: Precision = args.get(3).map_or(Ok(Precision::Dense), |s| s.parse())?;
    let mut cfg = full.clone();
    cfg.text.layers = layers.clamp(1, full.text.layers);
    cfg.text.local.truncate(cfg.text.layers);
    // The special tokens must be inside the vocabulary.
    cfg.text.vocab = vocab.max(cfg.image_token as usize + 1);
    let dev = Device::Cpu;
    let t = Instant::now();
    let mut get = |name: &str| -> candle_core::Result<Tensor> {
        let shape = cfg
            .parameters()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s)
            .ok_or_else(|| candle_core::Error::Msg(format!("no parameter {name}")))?;
        // Small random weights: finite activations through every layer.
        Tensor::randn(0f32, 0.02, shape, &dev)?.to_dtype(DType::F32)
    };
    let mut vlm = Gemma3Vlm::from_weights(cfg.clone(), &mut get, 1024, precision, &dev)?;
    let load_s = t.elapsed().as_secs_f64();

    // One 1024 x 1024 grey picture (a gradient), resized to 896 px as the processor does.
    let side = 1024;
    let grey: Vec<u8> = (0..side * side)
        .map(|i| ((i % side + i / side) % 256) as u8)
        .collect();
    let (feats, preprocess_s, encode_s) = if vision {
        let t = Instant::now();
        let px = vlm.pixel_values(&grey, side, side, 1)?;
        let preprocess_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let feats = vlm.image_features(&px)?;
        (feats, Some(preprocess_s), Some(t.elapsed().as_secs_f64()))
    } else {
        let shape = (cfg.mm_tokens_per_image, cfg.text.hidden);
        (Tensor::randn(0f32, 1.0, shape, &dev)?, None, None)
    };

    let mut ids: Vec<u32> = vec![2, 105, 10];
    ids.extend(std::iter::repeat_n(
        cfg.image_token,
        cfg.mm_tokens_per_image,
    ));
    ids.extend((0..PROMPT_TEXT_TOKENS as u32).map(|i| 1000 + i));
    let t = Instant::now();
    let logits = vlm.prefill(&ids, &[feats])?;
    let prefill_s = t.elapsed().as_secs_f64();
    let mut next = hilum_llm_local::model::argmax(&logits.get(ids.len() - 1)?)?;
    let t = Instant::now();
    for _ in 0..DECODE_STEPS {
        let l = vlm.decoder_mut().forward(&[next])?;
        next = hilum_llm_local::model::argmax(&l)?;
    }
    let decode_s = t.elapsed().as_secs_f64();
    let tok_s = DECODE_STEPS as f64 / decode_s;
    // Per-step cost without the output layer's share is not separable here: scale the whole
    // step by the layer count (an upper bound on the 34-layer step time's estimate).
    let est_34 = tok_s * cfg.text.layers as f64 / full.text.layers as f64;
    let weights = match precision {
        Precision::Dense => "placeholder (random f32)".to_string(),
        p => format!("placeholder (random f32, decoder quantized to {p:?} at load)"),
    };
    println!(
        "{}",
        serde_json::json!({
            "weights": weights,
            "vision": {"image_size": cfg.vision.image_size, "layers": cfg.vision.layers,
                       "soft_tokens": cfg.mm_tokens_per_image,
                       "preprocess_s": preprocess_s, "encode_s": encode_s},
            "decoder": {"layers": cfg.text.layers, "of_layers": full.text.layers,
                        "vocab": cfg.text.vocab, "prompt_tokens": ids.len(),
                        "prefill_s": prefill_s, "decode_steps": DECODE_STEPS,
                        "decode_tok_s": tok_s,
                        "decode_tok_s_34_layers_estimate": est_34},
            "load_s": load_s,
            "peak_rss_gib": peak_rss_gib(),
            "threads": std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    );
    Ok(())
}

/// The process's peak resident memory (Linux `VmHWM`), in GiB.
fn peak_rss_gib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / (1024.0 * 1024.0))
}
