//! Writes a full-size classifier checkpoint with seeded weights, for benchmarks on machines that
//! cannot download the published ones (`scripts/bench/bench_triton.sh` imports it with `--custom`):
//! `cargo run --release -p hilum-models --example seeded_classifier -- OUT.safetensors [densenet|resnet]`

use hilum_models::xrv::{self, XrvSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or("usage: seeded_classifier OUT.safetensors [densenet|resnet]")?;
    let spec = match args.next().as_deref() {
        None | Some("densenet") => XrvSpec::densenet121_res224_all(),
        Some("resnet") => XrvSpec::resnet50_res512_all(),
        Some(other) => {
            return Err(format!("unknown architecture `{other}`: densenet or resnet").into())
        }
    };
    let weights = xrv::synthetic_weights(&spec.arch, 3)?;
    candle_core::safetensors::save(&weights, &out)?;
    eprintln!("wrote {out}: {} tensors, seed 3", weights.len());
    Ok(())
}
