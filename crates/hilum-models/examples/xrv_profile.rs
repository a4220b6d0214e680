//! Where the native CPU path spends its time, per kind of layer.
//! `cargo run --release -p hilum-models --example xrv_profile -- [densenet|resnet] [batch] [iters]`
//! (threads: `HILUM_CPU_THREADS`, default all cores).

use std::time::Instant;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hilum_models::xrv::{self, Backend, Classifier, XrvSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let spec = match args.get(1).map(String::as_str) {
        Some("resnet") => XrvSpec::resnet50_res512_all(),
        _ => XrvSpec::densenet121_res224_all(),
    };
    let batch: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let iters: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(20);
    let w = xrv::synthetic_weights(&spec.arch, 7)?;
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    let m = Classifier::new(vb, spec.clone(), Backend::Native, xrv::default_threads())?;
    let x = vec![0.5f32; batch * spec.resolution * spec.resolution];
    m.logits(&x, batch)?;
    let mut times = Vec::new();
    for _ in 0..iters {
        let t = Instant::now();
        m.logits(&x, batch)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    println!(
        "{} native, batch {batch}, {} threads: median {:.2} ms, min {:.2} ms over {iters} runs",
        spec.id,
        xrv::default_threads(),
        times[times.len() / 2],
        times[0]
    );
    std::env::set_var("HILUM_CPU_PROFILE", "1");
    m.logits(&x, batch)?;
    Ok(())
}
