//! Speed of the native LLaVA's text decoder on seeded weights at Mistral-7B width (hidden 4096,
//! GQA 32/8, MLP 14336, vocabulary 32064) with a few layers, f32 and Q8_0: prefill of a
//! text-only prompt and greedy decode, alternating the two precisions.
//!
//!     cargo run -p hilum-models --example llava_decode -- [PROMPT] [NEW] [LAYERS] [ROUNDS]
//!
//! Defaults: 128 prompt tokens, 32 new tokens, 2 layers, 2 rounds. Random weights: the numbers
//! are per-layer costs, not answers.

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hilum_models::llava::{self, Llava, Precision};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (prompt, new, layers, rounds) = (arg(1, 128), arg(2, 32), arg(3, 2), arg(4, 2));
    let vocab = 32064;
    let cfg = llava::Config::from_json(
        &serde_json::json!({
            "image_token_index": vocab - 64,
            "model_type": "llava",
            "projector_hidden_act": "gelu",
            "text_config": {
                "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
                "max_position_embeddings": 4096, "model_type": "mistral",
                "num_attention_heads": 32, "num_hidden_layers": layers,
                "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "sliding_window": null, "vocab_size": vocab
            },
            "vision_config": {
                "hidden_act": "quick_gelu", "hidden_size": 64, "image_size": 28,
                "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1,
                "patch_size": 14, "projection_dim": 64
            }
        })
        .to_string(),
    )?;
    let weights = hilum_models::weights::seeded(&cfg.expected_params()?, 7);
    let ids: Vec<u32> = (0..prompt as u32).map(|i| 1 + (i * 7919) % 30000).collect();
    let models = [Precision::Dense, Precision::Q8_0].map(|p| {
        let vb = VarBuilder::from_tensors(weights.clone(), DType::F32, &Device::Cpu);
        Llava::load(vb, &cfg, p).map(|m| (p, m))
    });
    drop(weights);
    for round in 0..rounds {
        for m in &models {
            let (p, model) = m.as_ref().map_err(|e| e.to_string())?;
            let g = model.generate(&ids, None, new, &[], |_| {})?;
            let per = g.decode_secs * 1000.0 / (g.ids.len().max(2) - 1) as f64;
            println!(
                "round {round} {p:?}: prefill {prompt} tokens {:.2} s, decode {:.1} ms/token \
                 ({} tokens, first ids {:?})",
                g.prefill_secs,
                per,
                g.ids.len(),
                &g.ids[..g.ids.len().min(4)]
            );
        }
    }
    Ok(())
}
