//! Decode speed of the Gemma 3 decoder: the one-token path against the tensor path on the same
//! weights, alternated, greedy over `STEPS` tokens after a short prompt.
//!
//!     cargo run --release -p hilum-llm-local --example bench_gemma3 -- [MODEL.gguf] [REPS]
//!
//! scripts/bench/bench_llm.sh's llama.cpp side is for chat models; compare Gemma with llama.cpp by
//! `llama_cpp.Llama(MODEL, n_threads=2).create_completion(PROMPT, max_tokens=128)` and its perf
//! counters (docs/models.md, "Gemma 3", has the exact command).

use std::time::Instant;

use candle_core::quantized::gguf_file;
use candle_core::Device;
use hilum_llm_local::gemma3::Gemma3;
use hilum_llm_local::model::{argmax, MatmulMode};
use hilum_llm_local::GgufTokenizer;

#[path = "../tests/it/common/mod.rs"]
mod common;

const PROMPT: &str = "A chest X-ray report lists its findings one per line:\n1.";
const STEPS: usize = 128;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path = match args.get(1) {
        Some(p) => p.into(),
        None => common::models_dir().join("llm/gemma-3-270m-q4_k_m.gguf"),
    };
    let reps: usize = args.get(2).and_then(|r| r.parse().ok()).unwrap_or(3);
    let tok = GgufTokenizer::from_file(&path)?;
    let mut prompt = vec![tok.bos.ok_or("the GGUF has no BOS token")?];
    prompt.extend(tok.encode(PROMPT)?);
    let mut f = std::fs::File::open(&path)?;
    let ct = gguf_file::Content::read(&mut f)?;
    let mut m = Gemma3::load(&ct, &mut f, 1024, MatmulMode::Hybrid, &Device::Cpu)?;
    if !m.uses_one_token_path() {
        return Err("this GGUF's block types have no one-token kernels".into());
    }
    for rep in 1..=reps {
        for one_token in [true, false] {
            m.set_one_token_path(one_token);
            m.truncate_cache(0)?;
            let mut logits = m.forward(&prompt)?;
            let started = Instant::now();
            for _ in 0..STEPS {
                let t = argmax(&logits)?;
                logits = m.forward(&[t])?;
            }
            let s = started.elapsed().as_secs_f64();
            let path = if one_token { "one-token" } else { "tensor" };
            println!(
                "{{\"rep\":{rep},\"path\":\"{path}\",\"prompt_tokens\":{},\"decode_tokens\":{STEPS},\"decode_tok_s\":{:.1}}}",
                prompt.len(),
                STEPS as f64 / s
            );
        }
    }
    Ok(())
}
