//! Forward-pass latency of the torchxrayvision classifiers: Hilum's native CPU kernels (the
//! default on CPU), ONNX Runtime on the graph Hilum writes from the same weights (when
//! ORT_DYLIB_PATH is set: `eval "$(scripts/setup_onnxruntime.sh)"`) and the candle path, on
//! seeded weights of the full-size networks (speed does not depend on the weights' values).
//! Threads: `HILUM_CPU_THREADS`, else all cores — the same for native and ONNX Runtime.
//! Compare with `scripts/bench/bench_torch.py` (PyTorch, same threads, same machine).
//!
//! `cargo bench --bench classifier` (add `-- native` or `-- onnx` for one backend).

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::{Backend, ModelSettings};

fn input(batch: usize, size: usize) -> Vec<f32> {
    (0..batch * size * size)
        .map(|i| ((i * 7919) % 2048) as f32 - 1024.0)
        .collect()
}

fn model(spec: &XrvSpec, backend: Backend, threads: usize) -> Classifier {
    let w = xrv::synthetic_weights(&spec.arch, 7).expect("weights");
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    Classifier::new(vb, spec.clone(), backend, threads).expect("model")
}

fn bench(c: &mut Criterion) {
    // The same variables as `hilum` (HILUM_CPU_*, ORT_DYLIB_PATH).
    let settings = ModelSettings::from_vars(|k| std::env::var(k).ok());
    settings.apply_process_wide();
    let threads = settings.cpu.threads();
    for (spec, batches) in [
        (XrvSpec::densenet121_res224_all(), vec![1, 16]),
        (XrvSpec::resnet50_res512_all(), vec![1]),
    ] {
        let mut g = c.benchmark_group(format!("{}/{threads}threads", spec.id));
        g.sample_size(10);
        for backend in Backend::IN_PROCESS {
            if backend == Backend::Onnx && !hilum_models::onnx::available() {
                eprintln!("onnx: skipped, ONNX Runtime not loadable (set ORT_DYLIB_PATH)");
                continue;
            }
            let m = model(&spec, backend, threads);
            for &b in &batches {
                // candle's CPU conv is ~10x slower: batch 1 is enough to show it.
                if backend == Backend::Candle && b > 1 {
                    continue;
                }
                let x = input(b, spec.resolution);
                let name = backend.name();
                g.bench_with_input(BenchmarkId::new(name, format!("batch{b}")), &x, |bch, x| {
                    bch.iter(|| m.logits(x, b).expect("forward"))
                });
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
