//! Batched forward passes of the classifiers (the models with a batched forward): latency per
//! batch and images/s, per backend, on the preprocessed benchmark images. Each (model, backend,
//! batch) is one call through the pool's routing, like a tool's: it runs on a device of
//! `--device`, holding that device's permit, and moves to another device if that one fails.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use hilum_imaging::{CxrImage, ImageStore};
use hilum_models::xrv;
use hilum_models::{Backend, ModelError, ModelPool, Placed};

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

/// One JSON row per (model, backend, batch), naming the device it ran on; a model that does
/// not load gives one row with its error.
pub async fn run(
    plan: &Plan,
    pool: &Arc<ModelPool>,
    store: &ImageStore,
    ids: &[String],
) -> Vec<Value> {
    let images: Arc<Vec<Arc<CxrImage>>> =
        Arc::new(ids.iter().filter_map(|id| store.get(id).ok()).collect());
    let mut rows = Vec::new();
    if images.is_empty() {
        return rows;
    }
    for model in &plan.models {
        for &backend in &plan.backends {
            for &b in &plan.batches {
                // Set once the copy is loaded: an error before it is the load's.
                let loaded = Arc::new(AtomicBool::new(false));
                let (images, seen, name) = (images.clone(), loaded.clone(), model.clone());
                let (iterations, warmup) = (plan.iterations, plan.warmup);
                let work = move |p: Placed<'_, xrv::Classifier>| {
                    seen.store(true, Ordering::Relaxed);
                    // The benchmark images, preprocessed, cycled to fill a batch.
                    let size = p.model.spec.resolution;
                    let x: Vec<f32> = images
                        .iter()
                        .map(|img| {
                            let (w, h) = (img.width as usize, img.height as usize);
                            xrv::preprocess(&img.pixels, w, h, img.max_value(), size)
                        })
                        .cycle()
                        .take(b)
                        .flatten()
                        .collect();
                    let load_ms = p.load.as_secs_f64() * 1e3;
                    let mut row = time_batch(p.model, b, &x, iterations, warmup)?;
                    row["model"] = json!(name);
                    row["backend"] = json!(backend.name());
                    row["device"] = json!(p.device.to_string());
                    row["load_ms"] = finite(load_ms);
                    Ok(row)
                };
                match pool.run_on(model, None, backend, work).await {
                    Ok(row) => rows.push(row),
                    Err(e) if loaded.load(Ordering::Relaxed) => rows.push(json!({
                        "model": model, "backend": backend.name(), "batch": b, "ok": false,
                        "error": e.to_string(),
                    })),
                    Err(e) => {
                        rows.push(json!({
                            "model": model, "backend": backend.name(), "ok": false,
                            "error": e.to_string(),
                        }));
                        break;
                    }
                }
            }
        }
    }
    rows
}

/// Times `iterations`-scaled forwards of one batch after `warmup` untimed ones (at least one).
fn time_batch(
    c: &xrv::Classifier,
    batch: usize,
    x: &[f32],
    iterations: usize,
    warmup: usize,
) -> Result<Value, ModelError> {
    let iters = iterations.div_ceil(batch).max(3);
    let mut times = Vec::with_capacity(iters);
    for i in 0..warmup.max(1) + iters {
        let t = Instant::now();
        c.logits(x, batch)?;
        if i >= warmup.max(1) {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let p50 = percentile(&times, 50.0);
    Ok(json!({
        "batch": batch,
        "ok": true,
        "iterations": times.len(),
        "p50_ms": finite(p50),
        "p95_ms": finite(percentile(&times, 95.0)),
        "min_ms": finite(times[0]),
        "mean_ms": finite(mean),
        "ms_per_image": finite(p50 / batch as f64),
        "images_per_s": finite(1e3 * batch as f64 / p50),
    }))
}

/// The table of [`run`]'s rows.
pub fn print(rows: &[Value], threads: usize) {
    if rows.is_empty() {
        return;
    }
    println!("\nbatched forward, preprocessed input, {threads} CPU threads (HILUM_CPU_THREADS)");
    println!(
        "{:<24} {:<8} {:<8} {:>5} {:>9} {:>9} {:>9} {:>8}  note",
        "model", "backend", "device", "batch", "p50 ms", "p95 ms", "ms/img", "img/s"
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
            "{:<24} {:<8} {:<8} {:>5} {:>9} {:>9} {:>9} {:>8}  {}",
            r["model"].as_str().unwrap_or(""),
            r["backend"].as_str().unwrap_or(""),
            r["device"].as_str().unwrap_or("-"),
            batch,
            f("p50_ms"),
            f("p95_ms"),
            f("ms_per_image"),
            f("images_per_s"),
            note
        );
    }
}
