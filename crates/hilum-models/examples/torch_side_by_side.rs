//! Hilum's side of `scripts/gpu_vs_torch.sh`: the torchxrayvision CNNs' forward pass on given
//! seeded weights and inputs, timed, the logits written for the agreement check against
//! PyTorch on the same weights.
//!
//! ```text
//! torch_side_by_side weights ARCH OUT.safetensors            # seeded weights (seed 3)
//! torch_side_by_side run ARCH SIZE WEIGHTS INPUT OUT DEVICE BACKEND ITERS
//! ```
//! ARCH: densenet121 | resnet50. INPUT holds `input` (batch, 1, SIZE, SIZE), f32; OUT gets
//! `logits` (batch, 18). `run` prints one JSON line: the median and minimum ms of ITERS timed
//! forwards after one warm-up. Build with `--features cuda` for DEVICE cuda:N.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::Tensor;
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::{Backend, Device};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn spec(arch: &str) -> Res<XrvSpec> {
    match arch {
        "densenet121" => Ok(XrvSpec::densenet121_res224_all()),
        "resnet50" => Ok(XrvSpec::resnet50_res512_all()),
        other => Err(format!("unknown architecture `{other}`: densenet121 or resnet50").into()),
    }
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("weights") if args.len() == 3 => {
            let weights = xrv::synthetic_weights(&spec(&args[1])?.arch, 3)?;
            candle_core::safetensors::save(&weights, &args[2])?;
            Ok(())
        }
        Some("run") if args.len() == 9 => run(&args[1..]),
        _ => Err(
            "usage: torch_side_by_side weights ARCH OUT | run ARCH SIZE WEIGHTS INPUT OUT \
                  DEVICE BACKEND ITERS"
                .into(),
        ),
    }
}

fn run(a: &[String]) -> Res<()> {
    let size: usize = a[1].parse()?;
    let device: Device = a[5].parse()?;
    let backend: Backend = a[6].parse()?;
    let iters: usize = a[7].parse::<usize>()?.max(1);
    let spec = XrvSpec {
        resolution: size,
        ..spec(&a[0])?
    };
    let vb = hilum_models::weights::var_builder(std::path::Path::new(&a[2]), device)?;
    let threads = hilum_models::kernels::all_cores();
    let net = Classifier::new(vb, spec, backend, threads)?;
    let input = candle_core::safetensors::load(&a[3], &candle_core::Device::Cpu)?;
    let x = input.get("input").ok_or("INPUT holds no tensor `input`")?;
    let batch = x.dims4()?.0;
    let x: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut logits = net.logits(&x, batch)?;
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        // `logits` copies the result back to the host: the device work is finished.
        logits = net.logits(&x, batch)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let k = logits.len() / batch;
    let out = Tensor::from_vec(logits, (batch, k), &candle_core::Device::Cpu)?;
    candle_core::safetensors::save(&HashMap::from([("logits".to_string(), out)]), &a[4])?;
    println!(
        "{{\"median_ms\": {:.4}, \"min_ms\": {:.4}, \"iters\": {iters}, \"backend\": \"{backend}\", \"device\": \"{device}\"}}",
        times[times.len() / 2],
        times[0]
    );
    Ok(())
}
