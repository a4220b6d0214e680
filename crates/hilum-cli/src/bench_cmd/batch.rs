//! Batched forward passes of the classifiers (the models with a batched forward): latency per
//! batch and images/s, per backend, on the preprocessed benchmark images.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use hilum_imaging::ImageStore;
use hilum_models::xrv;
use hilum_models::Backend;
use hilum_models::{Device, ModelPool};

use super::{finite, percentile};

/// What to time: each model on each backend at each batch size.
pub struct Plan {
    pub models: Vec<String>,
    pub backends: Vec<Backend>,
    pub batches: Vec<usize>,
    /// Timed forwards at batch 1; larger batches run `max(3, ceil(iterations / batch))`.
    pub iterations: usize,
    pub warmup: usize,
}

/// One JSON row per (model, backend, batch); a model that does not load gives one row with
/// its error.
pub fn run(plan: &Plan, pool: &ModelPool, store: &ImageStore, ids: &[String]) -> Vec<Value> {
    let mut rows = Vec::new();
    for model in &plan.models {
        for &backend in &plan.backends {
            let t0 = Instant::now();
            let c = match xrv::pooled(pool, model, Device::Cpu, Some(backend)) {
                Ok(c) => c,
                Err(e) => {
                    rows.push(json!({
                        "model": model, "backend": backend.name(), "ok": false,
                        "error": e.to_string(),
                    }));
                    continue;
                }
            };
            let load_ms = t0.elapsed().as_secs_f64() * 1e3;
            let size = c.spec.resolution;
            // The benchmark images, preprocessed once, cycled to fill a batch.
            let inputs: Vec<Vec<f32>> = ids
                .iter()
                .filter_map(|id| store.get(id).ok())
                .map(|img| {
                    let (w, h) = (img.width as usize, img.height as usize);
                    xrv::preprocess(&img.pixels, w, h, img.max_value(), size)
                })
                .collect();
            if inputs.is_empty() {
                continue;
            }
            for &b in &plan.batches {
                let x: Vec<f32> = inputs.iter().cycle().take(b).flatten().copied().collect();
                rows.push(time_batch(&c, model, backend, b, &x, plan, load_ms));
            }
        }
    }
    rows
}

fn time_batch(
    c: &Arc<xrv::Classifier>,
    model: &str,
    backend: Backend,
    batch: usize,
    x: &[f32],
    plan: &Plan,
    load_ms: f64,
) -> Value {
    let iters = plan.iterations.div_ceil(batch).max(3);
    let mut times = Vec::with_capacity(iters);
    for i in 0..plan.warmup.max(1) + iters {
        let t = Instant::now();
        if let Err(e) = c.logits(x, batch) {
            return json!({
                "model": model, "backend": backend.name(), "batch": batch, "ok": false,
                "error": e.to_string(),
            });
        }
        if i >= plan.warmup.max(1) {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let p50 = percentile(&times, 50.0);
    json!({
        "model": model,
        "backend": backend.name(),
        "batch": batch,
        "ok": true,
        "iterations": times.len(),
        "p50_ms": finite(p50),
        "p95_ms": finite(percentile(&times, 95.0)),
        "min_ms": finite(times[0]),
        "mean_ms": finite(mean),
        "ms_per_image": finite(p50 / batch as f64),
        "images_per_s": finite(1e3 * batch as f64 / p50),
        "load_ms": finite(load_ms),
    })
}

/// The table of [`run`]'s rows.
pub fn print(rows: &[Value], threads: usize) {
    if rows.is_empty() {
        return;
    }
    println!("\nbatched forward, preprocessed input, {threads} CPU threads (HILUM_CPU_THREADS)");
    println!(
        "{:<24} {:<8} {:>5} {:>9} {:>9} {:>9} {:>8}  note",
        "model", "backend", "batch", "p50 ms", "p95 ms", "ms/img", "img/s"
    );
    for r in rows {
        let f = |k: &str| {
            r[k].as_f64()
                .map(|v| format!("{v:.1}"))
                .unwrap_or_else(|| "-".into())
        };
        let batch = r["batch"]
            .as_u64()
            .map(|b| b.to_string())
            .unwrap_or_else(|| "-".into());
        let note = r["error"]
            .as_str()
            .map(|e| e.chars().take(90).collect::<String>())
            .unwrap_or_default();
        println!(
            "{:<24} {:<8} {:>5} {:>9} {:>9} {:>9} {:>8}  {}",
            r["model"].as_str().unwrap_or(""),
            r["backend"].as_str().unwrap_or(""),
            batch,
            f("p50_ms"),
            f("p95_ms"),
            f("ms_per_image"),
            f("images_per_s"),
            note
        );
    }
}
