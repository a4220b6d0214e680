//! Cost per token of a few-token pass (a grammar-forced batch, a draft check) against one-token
//! steps, after a prompt of agent size.
//!
//!     cargo run --release -p hilum-llm-local --example bench_steps -- [MODEL.gguf] [PREFIX]

use std::time::Instant;

use candle_core::Device;
use hilum_llm_local::model::{MatmulMode, Model};

#[path = "../tests/it/common/mod.rs"]
mod common;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let path: std::path::PathBuf = match args.get(1) {
        Some(p) => p.into(),
        None => common::default_model_path().ok_or("no model: run scripts/fetch_local_llm.sh")?,
    };
    let prefix: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(950);
    let mut f = std::fs::File::open(&path)?;
    let ct = candle_core::quantized::gguf_file::Content::read(&mut f)?;
    let mut m = Model::load(&ct, &mut f, 4096, MatmulMode::Hybrid, &Device::Cpu)?;
    let toks: Vec<u32> = (0..prefix as u32)
        .map(|i| 1000 + (i * 7919) % 20000)
        .collect();
    let t = Instant::now();
    for c in toks.chunks(256) {
        m.forward(c)?;
    }
    eprintln!("prefix {prefix}: {:.2} s", t.elapsed().as_secs_f64());
    // An optional third argument times that batch size alone, many times (for a profiler).
    let only: Option<usize> = args.get(3).map(|s| s.parse()).transpose()?;
    let sizes = only.map_or(vec![1usize, 2, 4, 8, 12, 13, 16, 24, 32], |n| vec![n]);
    let reps = if only.is_some() { 30 } else { 3 };
    for &n in &sizes {
        let mut best = f64::MAX;
        let mut first = None;
        for _ in 0..reps {
            m.truncate_cache(prefix)?;
            let batch: Vec<u32> = (0..n as u32).map(|i| 3000 + i).collect();
            let t = Instant::now();
            m.forward(&batch)?;
            let secs = t.elapsed().as_secs_f64();
            first.get_or_insert(secs);
            best = best.min(secs);
        }
        println!(
            "{{\"tokens\": {n}, \"ms\": {:.1}, \"ms_per_token\": {:.1}, \"first_ms\": {:.1}}}",
            best * 1e3,
            best * 1e3 / n as f64,
            first.unwrap_or(best) * 1e3
        );
    }
    Ok(())
}
