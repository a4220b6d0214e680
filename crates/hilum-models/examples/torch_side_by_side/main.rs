//! Hilum's side of `scripts/gpu_vs_torch.sh`: each network's forward pass (or greedy decode) on
//! seeded weights written here, timed, its output written for the agreement check against
//! PyTorch on the same weights and inputs.
//!
//! ```text
//! torch_side_by_side weights ARCH OUT.safetensors      # seeded weights; prints the config (JSON)
//! torch_side_by_side run ARCH SIZE WEIGHTS INPUT OUT DEVICE BACKEND ITERS
//! torch_side_by_side decode ARCH WEIGHTS DEVICE PROMPT NEW ITERS OUT
//! ```
//! `run` ARCH: densenet121 | resnet50 (INPUT `input` (b, 1, S, S), OUT `output` logits (b, 18)),
//! lung-unet (`input` (b, S, S, 3) NHWC 0..255, `output` (b, S, S, 1) probabilities), sam-vit-b |
//! sam-tiny (`input` (1, 3, S, S), `output` the image embedding (1, e, S/p, S/p)). It prints one
//! JSON line: the median and minimum ms of ITERS timed calls after one warm-up. BACKEND
//! `candle-f16` runs the CNNs' candle forward in f16 (`Classifier::candle_with_dtype`).
//! `decode` ARCH: qwen2-0.5b | qwen2-tiny | gemma3-4b-slice | gemma3-tiny: PROMPT seeded tokens,
//! then NEW greedy tokens, ITERS times after a warm-up; OUT gets the prompt's last logits, the
//! JSON line the tokens, prefill ms and decode ms/token (medians).
//! Build with `--features cuda` for DEVICE cuda:N.

mod cnn;
mod lm;
mod sam;
mod unet;

use std::collections::HashMap;
use std::time::Instant;

use candle_core::Tensor;
use hilum_models::{Backend, Device};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("weights") if args.len() == 3 => {
            let (arch, out) = (args[1].as_str(), std::path::Path::new(&args[2]));
            let config = match arch {
                "lung-unet" => unet::weights(out)?,
                a if a.starts_with("sam-") => sam::weights(a, out)?,
                a if lm::is_decoder(a) => lm::weights(a, out)?,
                a => cnn::weights(a, out)?,
            };
            println!("{config}");
            Ok(())
        }
        Some("run") if args.len() == 9 => run(&args[1..]),
        Some("decode") if args.len() == 8 => lm::decode(&args[1..]),
        _ => Err(
            "usage: torch_side_by_side weights ARCH OUT | run ARCH SIZE WEIGHTS INPUT OUT \
                  DEVICE BACKEND ITERS | decode ARCH WEIGHTS DEVICE PROMPT NEW ITERS OUT"
                .into(),
        ),
    }
}

/// One network ready to run on a flat input of `batch` items.
pub trait Forward {
    /// The output values and their shape.
    fn forward(&self, x: &[f32], batch: usize) -> Res<(Vec<f32>, Vec<usize>)>;
}

fn run(a: &[String]) -> Res<()> {
    let size: usize = a[1].parse()?;
    let weights = std::path::Path::new(&a[2]);
    let device: Device = a[5].parse()?;
    let (backend, f16) = match a[6].strip_suffix("-f16") {
        Some(b) => (b.parse::<Backend>()?, true),
        None => (a[6].parse::<Backend>()?, false),
    };
    let iters: usize = a[7].parse::<usize>()?.max(1);
    let net: Box<dyn Forward> = match a[0].as_str() {
        _ if f16 && !cnn::is_cnn(&a[0]) => {
            return Err(format!("{} has no f16 path here (the CNNs have)", a[0]).into())
        }
        "lung-unet" => Box::new(unet::load(size, weights, device, backend)?),
        s if s.starts_with("sam-") => Box::new(sam::load(s, size, weights, device)?),
        arch => Box::new(cnn::load(arch, size, weights, device, backend, f16)?),
    };
    let input = candle_core::safetensors::load(&a[3], &candle_core::Device::Cpu)?;
    let x = input.get("input").ok_or("INPUT holds no tensor `input`")?;
    let batch = x.dim(0)?;
    let x: Vec<f32> = x.flatten_all()?.to_vec1()?;
    let mut times = Vec::with_capacity(iters);
    // Every forward copies its result back to the host: the device work is finished.
    let mut out = net.forward(&x, batch)?;
    for _ in 0..iters {
        let t = Instant::now();
        out = net.forward(&x, batch)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let (median, min) = median_min(&mut times);
    let (values, shape) = out;
    save_output(&a[4], values, &shape, HashMap::new())?;
    println!(
        "{{\"median_ms\": {median:.4}, \"min_ms\": {min:.4}, \"iters\": {iters}, \
         \"backend\": \"{backend}\", \"dtype\": \"{}\", \"device\": \"{device}\"}}",
        if f16 { "f16" } else { "f32" }
    );
    Ok(())
}

/// (median, minimum) of `times`, sorted in place.
fn median_min(times: &mut [f64]) -> (f64, f64) {
    times.sort_by(|a, b| a.total_cmp(b));
    (times[times.len() / 2], times[0])
}

/// Writes `values` as tensor `output` (and `extra`) to a safetensors file.
fn save_output(
    path: &str,
    values: Vec<f32>,
    shape: &[usize],
    mut extra: HashMap<String, Tensor>,
) -> Res<()> {
    let t = Tensor::from_vec(values, shape, &candle_core::Device::Cpu)?;
    extra.insert("output".into(), t);
    candle_core::safetensors::save(&extra, path)?;
    Ok(())
}

/// `n` values uniform in [-amp, amp) from `state` (xorshift64; the PyTorch side only reads them).
fn uniform(state: &mut u64, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            ((*state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}
