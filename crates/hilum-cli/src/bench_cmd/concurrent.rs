//! Bursts of N `classify_chest_xray` calls at once, per backend, without and with the pool's
//! dynamic batching (`hilum_models::batch`), every side interleaved burst by burst so all see
//! the same machine state. Without batching the calls share the device's permits (one forward
//! per core, one per GPU); with it they are gathered into a few batched forwards; with the
//! kserve backend they all go to the server, whose own dynamic batcher batches them.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use hilum_agent::{Tool, ToolContext};
use hilum_imaging::ImageStore;
use hilum_models::{Backend, BatchSettings, ModelPool};
use hilum_tools::ClassifyChestXray;

use super::{finite, percentile};

/// One burst: the wall time of `n` concurrent calls, each call's own time and the size of the
/// batch it ran in (1 without batching), or the first error.
async fn burst(
    tool: &Arc<dyn Tool>,
    ids: &[String],
    n: usize,
) -> Result<(f64, Vec<(f64, usize)>), String> {
    let started = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..n {
        let (tool, id) = (tool.clone(), ids[i % ids.len()].clone());
        calls.spawn(async move {
            let t = Instant::now();
            tool.call(&ToolContext::default(), json!({ "image": id }))
                .await
                .map(|out| {
                    let size = out.data["batch"].as_u64().unwrap_or(1) as usize;
                    (t.elapsed().as_secs_f64() * 1e3, size)
                })
                .map_err(|e| e.to_string())
        });
    }
    let mut each = Vec::with_capacity(n);
    while let Some(done) = calls.join_next().await {
        each.push(done.map_err(|e| e.to_string())??);
    }
    Ok((started.elapsed().as_secs_f64() * 1e3, each))
}

/// The two pools compared: the process's settings with batching off, and with it on (the
/// configured batching, else gathering up to `n` calls for the default delay). Each loads its
/// own copy of the model.
pub fn pools(base: &ModelPool, n: usize) -> Vec<(String, Arc<ModelPool>)> {
    let mut off = base.settings().clone();
    off.batch = BatchSettings::default();
    let mut on = base.settings().clone();
    if !on.batch.enabled() {
        on.batch = BatchSettings::new(n.max(2), hilum_models::batch::DEFAULT_BATCH_DELAY);
    }
    let label = format!(
        "max {}, {:.1} ms",
        on.batch.max_size,
        on.batch.max_delay.as_secs_f64() * 1e3
    );
    vec![
        ("off".to_string(), Arc::new(ModelPool::from_settings(off))),
        (label, Arc::new(ModelPool::from_settings(on))),
    ]
}

/// One side of the comparison: a backend with or without batching.
struct Side {
    backend: Backend,
    batching: String,
    tool: Arc<dyn Tool>,
    walls: Vec<f64>,
    calls: Vec<f64>,
    sizes: Vec<usize>,
    error: Option<String>,
}

/// `bursts` timed bursts of `n` calls per side after one warm-up burst each; one JSON row per
/// side. The kserve backend is timed once (its server batches, not the pool).
pub async fn run(
    store: Arc<ImageStore>,
    pools: &[(String, Arc<ModelPool>)],
    ids: &[String],
    backends: &[Backend],
    n: usize,
    bursts: usize,
) -> Vec<Value> {
    let mut sides: Vec<Side> = Vec::new();
    for &backend in backends {
        for (k, (batching, pool)) in pools.iter().enumerate() {
            if backend == Backend::Kserve && k > 0 {
                continue;
            }
            let tool = ClassifyChestXray::with_backend(store.clone(), pool.clone(), backend);
            sides.push(Side {
                backend,
                batching: if backend == Backend::Kserve {
                    "server".into()
                } else {
                    batching.clone()
                },
                tool: Arc::new(tool),
                walls: Vec::new(),
                calls: Vec::new(),
                sizes: Vec::new(),
                error: None,
            });
        }
    }
    for round in 0..=bursts {
        for side in sides.iter_mut().filter(|s| s.error.is_none()) {
            match burst(&side.tool, ids, n).await {
                // Round 0 warms up (model loads, server connection).
                Ok(_) if round == 0 => {}
                Ok((wall, each)) => {
                    side.walls.push(wall);
                    side.calls.extend(each.iter().map(|(ms, _)| ms));
                    side.sizes.extend(each.iter().map(|(_, size)| size));
                }
                Err(e) => side.error = Some(e),
            }
        }
    }
    sides.iter().map(|s| row(s, n)).collect()
}

fn row(side: &Side, n: usize) -> Value {
    let (mut w, mut c) = (side.walls.clone(), side.calls.clone());
    w.sort_by(|a, b| a.total_cmp(b));
    c.sort_by(|a, b| a.total_cmp(b));
    let p50 = percentile(&w, 50.0);
    let mean_batch = side.sizes.iter().sum::<usize>() as f64 / side.sizes.len().max(1) as f64;
    json!({
        "backend": side.backend.name(),
        "batching": side.batching,
        "concurrent": n,
        "bursts": w.len(),
        "ok": side.error.is_none(),
        "error": side.error,
        "burst_p50_ms": finite(p50),
        "burst_min_ms": finite(w.first().copied().unwrap_or(f64::NAN)),
        "calls_per_s": finite(n as f64 * 1e3 / p50),
        "call_p50_ms": finite(percentile(&c, 50.0)),
        "call_p95_ms": finite(percentile(&c, 95.0)),
        "mean_batch": finite(mean_batch),
    })
}

/// The table under the per-tool one.
pub fn print(rows: &[Value]) {
    let Some(first) = rows.first() else {
        return;
    };
    println!(
        "\n{} concurrent classify_chest_xray calls per burst (sides interleaved):",
        first["concurrent"]
    );
    println!(
        "{:<8} {:<18} {:>6} {:>13} {:>9} {:>12} {:>12} {:>10}  note",
        "backend",
        "batching",
        "bursts",
        "burst p50 ms",
        "calls/s",
        "call p50 ms",
        "call p95 ms",
        "mean batch"
    );
    for r in rows {
        let f = |k: &str| {
            r[k].as_f64()
                .map(|v| format!("{v:.1}"))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "{:<8} {:<18} {:>6} {:>13} {:>9} {:>12} {:>12} {:>10}  {}",
            r["backend"].as_str().unwrap_or(""),
            r["batching"].as_str().unwrap_or(""),
            r["bursts"],
            f("burst_p50_ms"),
            f("calls_per_s"),
            f("call_p50_ms"),
            f("call_p95_ms"),
            f("mean_batch"),
            r["error"]
                .as_str()
                .map(|e| e.chars().take(90).collect::<String>())
                .unwrap_or_default()
        );
    }
}
