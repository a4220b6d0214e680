//! Bursts of N `classify_chest_xray` calls at once, per backend, the backends interleaved
//! burst by burst so both sides see the same machine state. In process the calls share the
//! device's permits (one forward per core); with the kserve backend they all go to the server,
//! whose dynamic batcher turns a burst into a few batched forwards.

use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};

use hilum_agent::{Tool, ToolContext};
use hilum_imaging::ImageStore;
use hilum_models::{Backend, ModelPool};
use hilum_tools::ClassifyChestXray;

use super::{finite, percentile};

/// One burst: the wall time of `n` concurrent calls and each call's own time, or the first
/// error.
async fn burst(tool: &Arc<dyn Tool>, ids: &[String], n: usize) -> Result<(f64, Vec<f64>), String> {
    let started = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..n {
        let (tool, id) = (tool.clone(), ids[i % ids.len()].clone());
        calls.spawn(async move {
            let t = Instant::now();
            tool.call(&ToolContext::default(), json!({ "image": id }))
                .await
                .map(|_| t.elapsed().as_secs_f64() * 1e3)
                .map_err(|e| e.to_string())
        });
    }
    let mut each = Vec::with_capacity(n);
    while let Some(done) = calls.join_next().await {
        each.push(done.map_err(|e| e.to_string())??);
    }
    Ok((started.elapsed().as_secs_f64() * 1e3, each))
}

/// `bursts` timed bursts of `n` calls per backend after one warm-up burst each; one JSON row
/// per backend.
pub async fn run(
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    ids: &[String],
    backends: &[Backend],
    n: usize,
    bursts: usize,
) -> Vec<Value> {
    let tools: Vec<(Backend, Arc<dyn Tool>)> = backends
        .iter()
        .map(|&b| {
            let t: Arc<dyn Tool> = Arc::new(ClassifyChestXray::with_backend(
                store.clone(),
                models.clone(),
                b,
            ));
            (b, t)
        })
        .collect();
    let mut walls = vec![Vec::new(); tools.len()];
    let mut calls = vec![Vec::new(); tools.len()];
    let mut errors: Vec<Option<String>> = vec![None; tools.len()];
    for round in 0..=bursts {
        for (k, (_, tool)) in tools.iter().enumerate() {
            if errors[k].is_some() {
                continue;
            }
            match burst(tool, ids, n).await {
                // Round 0 warms up (model loads, server connection).
                Ok(_) if round == 0 => {}
                Ok((wall, each)) => {
                    walls[k].push(wall);
                    calls[k].extend(each);
                }
                Err(e) => errors[k] = Some(e),
            }
        }
    }
    tools
        .iter()
        .enumerate()
        .map(|(k, (b, _))| {
            let (mut w, mut c) = (walls[k].clone(), calls[k].clone());
            w.sort_by(|a, b| a.total_cmp(b));
            c.sort_by(|a, b| a.total_cmp(b));
            let p50 = percentile(&w, 50.0);
            json!({
                "backend": b.name(),
                "concurrent": n,
                "bursts": w.len(),
                "ok": errors[k].is_none(),
                "error": errors[k],
                "burst_p50_ms": finite(p50),
                "burst_min_ms": finite(w.first().copied().unwrap_or(f64::NAN)),
                "calls_per_s": finite(n as f64 * 1e3 / p50),
                "call_p50_ms": finite(percentile(&c, 50.0)),
                "call_p95_ms": finite(percentile(&c, 95.0)),
            })
        })
        .collect()
}

/// The table under the per-tool one.
pub fn print(rows: &[Value]) {
    let Some(first) = rows.first() else {
        return;
    };
    println!(
        "\n{} concurrent classify_chest_xray calls per burst (backends interleaved):",
        first["concurrent"]
    );
    println!(
        "{:<10} {:>7} {:>14} {:>10} {:>13} {:>13}  note",
        "backend", "bursts", "burst p50 ms", "calls/s", "call p50 ms", "call p95 ms"
    );
    for r in rows {
        let f = |k: &str| {
            r[k].as_f64()
                .map(|v| format!("{v:.1}"))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "{:<10} {:>7} {:>14} {:>10} {:>13} {:>13}  {}",
            r["backend"].as_str().unwrap_or(""),
            r["bursts"],
            f("burst_p50_ms"),
            f("calls_per_s"),
            f("call_p50_ms"),
            f("call_p95_ms"),
            r["error"]
                .as_str()
                .map(|e| e.chars().take(90).collect::<String>())
                .unwrap_or_default()
        );
    }
}
