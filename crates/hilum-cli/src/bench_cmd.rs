//! `hilum bench`: per-tool latency on real images, the classifiers' batched forward at several
//! batch sizes on each backend, bursts of concurrent classifier calls without and with dynamic
//! batching, and one round of parallel calls against the same calls one after another.

mod batch;
mod concurrent;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde_json::{json, Value};

use hilum_agent::{
    Agent, AgentConfig, Environment, Event, RunInput, ToolCall, ToolContext, Toolbox,
};
use hilum_imaging::ImageStore;
use hilum_llm::script::{ScriptCall, ScriptTurn};
use hilum_llm::ScriptLlm;
use hilum_models::xrv;
use hilum_models::Backend;
use hilum_tools::ClassifyChestXray;

use crate::tools_cmd::fill_image_args;

#[derive(Args)]
#[command(after_help = "Examples:\n  hilum bench --image chest.png\n  \
hilum bench --image chest.png --tool segment_lungs --tool classify_chest_xray -n 20 --json\n  \
hilum bench --image chest.png --tool localize_finding --args 'localize_finding={\"pathology\":\"Effusion\"}'\n\n\
The first call of each tool includes loading its model (reported as first_ms); the timed calls \
follow the warm-up calls. Tools that need arguments besides the image are skipped unless --args \
gives them. Tools whose model is not installed are listed with the error.\n\n\
Classifiers: `--backend native,onnx` times classify_chest_xray once per backend, and the batched \
forward (preprocessed images, no decoding) runs at each `--batch` size on each backend \
(`hilum bench --image chest.png --tool classify_chest_xray --backend native,onnx --batch 1,4,16`). \
Threads: HILUM_CPU_THREADS (native and ONNX Runtime alike).\n\n\
Concurrent calls: `--concurrent 16` also times bursts of 16 concurrent classify_chest_xray calls \
per backend, without and with the pool's dynamic batching (HILUM_BATCH_MAX_SIZE / \
HILUM_BATCH_DELAY_MS when set, else up to 16 calls for 2 ms), all sides interleaved: throughput \
and p50/p95 call latency side by side. With `--backend native,kserve` (HILUM_KSERVE_URL or \
[remote] url) the server's own dynamic batching batches a burst.")]
pub struct BenchArgs {
    #[command(flatten)]
    pub devices: crate::config::DeviceFlag,
    /// Image file(s) to run the tools on; calls cycle over them.
    #[arg(long, required = true)]
    pub image: Vec<PathBuf>,
    /// Tools to time (default: every tool that needs only an image).
    #[arg(long)]
    pub tool: Vec<String>,
    /// Extra arguments for a tool: NAME=JSON (merged with the image argument).
    #[arg(long)]
    pub args: Vec<String>,
    /// Timed calls per tool.
    #[arg(short = 'n', long, default_value_t = 10)]
    pub iterations: usize,
    /// Untimed calls per tool after the first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Batch sizes for the classifiers' batched forward (empty: skip it).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batch: Vec<usize>,
    /// Classifier backends to time: native, candle, onnx, kserve (default: the CPU's default,
    /// native).
    #[arg(long, value_delimiter = ',')]
    pub backend: Vec<String>,
    /// Also time bursts of this many concurrent classify_chest_xray calls on each classifier
    /// backend, without and with dynamic batching (0: skip).
    #[arg(long, default_value_t = 0)]
    pub concurrent: usize,
    /// Skip the round benchmark (parallel round vs serial calls).
    #[arg(long)]
    pub no_round: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also draw the latencies as a PNG: per tool p50/p95, parallel round vs one by one.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

struct ToolResult {
    name: String,
    /// The classifier backend this row ran on, when `--backend` chose one.
    backend: Option<Backend>,
    first_ms: f64,
    times: Vec<f64>,
    error: Option<String>,
    /// Decode speed of generating tools (their `tokens_per_second`), per timed call.
    tokens_per_s: Vec<f64>,
    /// Routed calls per device during this row (the pool's leases).
    devices: Vec<(String, u64)>,
}

/// Routed calls so far per device of the pool.
fn calls_per_device(pool: &hilum_models::ModelPool) -> Vec<(String, u64)> {
    pool.device_stats()
        .iter()
        .map(|s| (s.device.to_string(), s.calls))
        .collect()
}

/// The pool's devices: calls, time busy, the most calls at once, failures and models held.
fn device_rows(pool: &hilum_models::ModelPool) -> Vec<Value> {
    pool.device_stats()
        .iter()
        .map(|s| {
            let busy_ms = s.busy.as_secs_f64() * 1e3;
            json!({
                "device": s.device.to_string(),
                "calls": s.calls,
                "busy_ms": finite(busy_ms),
                "mean_ms": finite(busy_ms / s.calls as f64),
                "peak": s.peak,
                "failures": s.failures,
                "models": s.models,
            })
        })
        .collect()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Peak resident memory of this process (Linux), in MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

async fn call(
    toolbox: &Toolbox,
    env: &Environment,
    name: &str,
    args: &Value,
) -> Result<f64, String> {
    call_tps(toolbox, env, name, args).await.map(|(ms, _)| ms)
}

/// A call's time, and the tokens/s a generating tool reports in its data.
async fn call_tps(
    toolbox: &Toolbox,
    env: &Environment,
    name: &str,
    args: &Value,
) -> Result<(f64, Option<f64>), String> {
    let started = Instant::now();
    let r = toolbox
        .execute(
            &ToolCall::new("bench", name, args),
            env,
            ToolContext::default(),
            Duration::from_secs(600),
        )
        .await;
    match r.result {
        Ok(out) => Ok((
            started.elapsed().as_secs_f64() * 1e3,
            out.data["tokens_per_second"].as_f64(),
        )),
        Err(f) => Err(f.message),
    }
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let store = Arc::new(ImageStore::default());
    let mut ids = Vec::new();
    for p in &args.image {
        ids.push(
            store
                .ingest_file(p)
                .with_context(|| format!("cannot use {}", p.display()))?,
        );
    }
    // Tools run with the configured classifier backends (HILUM_BACKEND, the config file's
    // [backends]); `--backend` below times the classifier on each backend it lists.
    let file = crate::config::load_file(None)?;
    let deps = hilum_tools::ToolDeps::new(store.clone(), crate::model_pool())
        .with_settings(crate::config::tool_settings())
        .with_backends(crate::config::resolve_backends(&[], &file.backends)?);
    let toolbox = Arc::new(crate::toolbox(&deps)?);
    let env = Environment::default();
    let extra = extra_args(&args.args)?;
    let names = tool_names(&toolbox, &env, &args.tool, &extra);
    let backends = args
        .backend
        .iter()
        .map(|b| b.parse::<Backend>())
        .collect::<Result<Vec<_>, _>>()?;
    // classify_chest_xray once per chosen backend (its own one-tool toolbox); others once.
    let mut jobs: Vec<(String, Option<Backend>, Arc<Toolbox>)> = Vec::new();
    for name in &names {
        if name == CLASSIFY && !backends.is_empty() {
            for &b in &backends {
                let tool = ClassifyChestXray::with_backend(store.clone(), deps.models.clone(), b);
                let tb = Toolbox::new()
                    .with(Arc::new(tool))
                    .map_err(anyhow::Error::msg)?;
                jobs.push((name.clone(), Some(b), Arc::new(tb)));
            }
        } else {
            jobs.push((name.clone(), None, toolbox.clone()));
        }
    }
    let mut results = Vec::new();
    for job in &jobs {
        results.push(time_tool(&args, job, &store, &ids, &extra, &deps.models).await?);
    }

    // What the classifier runs on without `--backend`: the default for the pool's devices.
    let pool = &deps.models;
    let default_backend = Backend::default_for(pool.settings().runs_on(pool.devices().first()));
    let classifier_backends = if backends.is_empty() {
        vec![default_backend]
    } else {
        backends.clone()
    };
    let classifies = names.iter().any(|n| n == CLASSIFY);
    let batched = if classifies && !args.batch.is_empty() {
        if !args.json {
            eprintln!("timing the batched classifier forward …");
        }
        let model = extra
            .get(CLASSIFY)
            .and_then(|a| a["model"].as_str())
            .map(str::to_string)
            .unwrap_or_else(|| xrv::XrvSpec::densenet121_res224_all().id);
        let plan = batch::Plan {
            models: vec![model],
            backends: classifier_backends.clone(),
            batches: args.batch.clone(),
            iterations: args.iterations,
            warmup: args.warmup,
        };
        batch::run(&plan, &deps.models, &store, &ids).await
    } else {
        Vec::new()
    };

    let bursts = if args.concurrent > 0 {
        if !args.json {
            eprintln!(
                "timing bursts of {} concurrent calls, without and with batching …",
                args.concurrent
            );
        }
        let pools = concurrent::pools(&deps.models, args.concurrent);
        let n = args.iterations.max(3);
        let (c, on) = (args.concurrent, &classifier_backends);
        concurrent::run(store.clone(), &pools, &ids, on, c, n).await
    } else {
        Vec::new()
    };

    // One call per tool in the round, whatever the backends timed above.
    let mut seen = std::collections::HashSet::new();
    let ok: Vec<&ToolResult> = results
        .iter()
        .filter(|r| r.error.is_none() && seen.insert(r.name.clone()))
        .collect();
    let round = if args.no_round || ok.len() < 2 {
        None
    } else {
        Some(round_bench(toolbox.clone(), &ids[0], &ok, &extra).await?)
    };

    let rows: Vec<Value> = results.iter().map(tool_row).collect();
    let report = json!({
        "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "images": ids,
        "cpu_threads": crate::model_settings().cpu.threads(),
        "tools": rows,
        "batched": batched,
        "concurrent": bursts,
        "round": round,
        "devices": device_rows(&deps.models),
        "peak_rss_mib": peak_rss_mib(),
    });
    if let Some(path) = &args.plot {
        write_plot(path, &rows, &report)?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_report(&rows, &report);
    Ok(())
}

/// `--args NAME=JSON` as a map from tool name to its extra arguments.
fn extra_args(args: &[String]) -> anyhow::Result<HashMap<String, Value>> {
    let mut extra = HashMap::new();
    for a in args {
        let (name, json) = a
            .split_once('=')
            .with_context(|| format!("--args `{a}` must look like NAME=JSON"))?;
        let v: Value =
            serde_json::from_str(json).with_context(|| format!("--args for {name} is not JSON"))?;
        extra.insert(name.to_string(), v);
    }
    Ok(extra)
}

/// The tools to time: `--tool`, else every tool that needs only an image (or gets its other
/// arguments from `--args`).
fn tool_names(
    toolbox: &Toolbox,
    env: &Environment,
    chosen: &[String],
    extra: &HashMap<String, Value>,
) -> Vec<String> {
    if !chosen.is_empty() {
        return chosen.to_vec();
    }
    toolbox
        .specs(env)
        .iter()
        .filter(|s| {
            let required: Vec<&str> = s.parameters["required"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            extra.contains_key(&s.name) || required.iter().all(|r| r.starts_with("image"))
        })
        .map(|s| s.name.clone())
        .collect()
}

/// One tool (on one classifier backend, if chosen): its first call, the warm-up calls, then
/// the timed ones, cycling over the images; and the routed calls per device meanwhile.
async fn time_tool(
    args: &BenchArgs,
    (name, backend, toolbox): &(String, Option<Backend>, Arc<Toolbox>),
    store: &ImageStore,
    ids: &[String],
    extra: &HashMap<String, Value>,
    pool: &hilum_models::ModelPool,
) -> anyhow::Result<ToolResult> {
    let toolbox = toolbox.as_ref();
    let env = Environment::default();
    if !args.json {
        match backend {
            Some(b) => eprintln!("timing {name} on {b} …"),
            None => eprintln!("timing {name} …"),
        }
    }
    let mut per_image = Vec::new();
    for id in ids {
        let mut a = extra.get(name).cloned().unwrap_or_else(|| json!({}));
        fill_image_args(toolbox, &env, name, &mut a, std::slice::from_ref(id))?;
        // segment_region needs a prompt: default to the central half of the image.
        if name == "segment_region" && a.get("box").is_none() && a.get("points").is_none() {
            let img = store.get(id)?;
            let (w, h) = (img.width as f64, img.height as f64);
            a["box"] = json!([w / 4.0, h / 4.0, 3.0 * w / 4.0, 3.0 * h / 4.0]);
        }
        per_image.push(a);
    }
    let mut res = ToolResult {
        name: name.clone(),
        backend: *backend,
        first_ms: f64::NAN,
        times: Vec::new(),
        error: None,
        tokens_per_s: Vec::new(),
        devices: Vec::new(),
    };
    let before = calls_per_device(pool);
    match call(toolbox, &env, name, &per_image[0]).await {
        Err(e) => res.error = Some(e),
        Ok(ms) => {
            res.first_ms = ms;
            for i in 0..args.warmup {
                let _ = call(toolbox, &env, name, &per_image[i % per_image.len()]).await;
            }
            for i in 0..args.iterations {
                match call_tps(toolbox, &env, name, &per_image[i % per_image.len()]).await {
                    Ok((ms, tps)) => {
                        res.times.push(ms);
                        res.tokens_per_s.extend(tps);
                    }
                    Err(e) => {
                        res.error = Some(e);
                        break;
                    }
                }
            }
        }
    }
    res.devices = calls_per_device(pool)
        .into_iter()
        .zip(before)
        .map(|((d, n), (_, was))| (d, n.saturating_sub(was)))
        .filter(|(_, n)| *n > 0)
        .collect();
    Ok(res)
}

/// One tool's JSON row: percentiles, throughput, the load estimate, tokens/s, devices.
fn tool_row(r: &ToolResult) -> Value {
    let mut t = r.times.clone();
    t.sort_by(|a, b| a.total_cmp(b));
    let mut tps = r.tokens_per_s.clone();
    tps.sort_by(|a, b| a.total_cmp(b));
    let mean = if t.is_empty() {
        f64::NAN
    } else {
        t.iter().sum::<f64>() / t.len() as f64
    };
    json!({
        "tool": r.name,
        "backend": r.backend.map(Backend::name),
        "ok": r.error.is_none(),
        "error": r.error,
        "first_ms": finite(r.first_ms),
        "iterations": t.len(),
        "p50_ms": finite(percentile(&t, 50.0)),
        "p95_ms": finite(percentile(&t, 95.0)),
        "p99_ms": finite(percentile(&t, 99.0)),
        "mean_ms": finite(mean),
        "images_per_s": finite(1e3 / mean),
        "load_ms_estimate": finite(r.first_ms - percentile(&t, 50.0)),
        "tokens_per_s_p50": finite(percentile(&tps, 50.0)),
        "devices": r.devices.iter().map(|(d, n)| (d.clone(), json!(n))).collect::<serde_json::Map<_, _>>(),
    })
}

/// `--plot`: per tool p50/p95, and the round's parallel and serial times.
fn write_plot(path: &std::path::Path, rows: &[Value], report: &Value) -> anyhow::Result<()> {
    let tools: Vec<(String, f64, f64)> = rows
        .iter()
        .filter_map(|r| {
            let name = match r["backend"].as_str() {
                Some(b) => format!("{} {b}", r["tool"].as_str()?),
                None => r["tool"].as_str()?.to_string(),
            };
            Some((name, r["p50_ms"].as_f64()?, r["p95_ms"].as_f64()?))
        })
        .collect();
    let round = report["round"]
        .as_object()
        .and_then(|r| Some((r["parallel_ms"].as_f64()?, r["serial_ms"].as_f64()?)));
    let png = hilum_eval::plot::bench_figure(&tools, round)?;
    std::fs::write(path, png).with_context(|| format!("cannot write {}", path.display()))?;
    eprintln!("hilum: wrote {}", path.display());
    Ok(())
}

/// The tables: per tool, per device, the batched forward, the bursts, the round, peak memory.
fn print_report(rows: &[Value], report: &Value) {
    println!(
        "{:<28} {:>9} {:>9} {:>9} {:>9} {:>8}  note",
        "tool", "first ms", "p50 ms", "p95 ms", "p99 ms", "img/s"
    );
    for r in rows {
        let f = |k: &str| {
            r[k].as_f64()
                .map(|v| format!("{v:.1}"))
                .unwrap_or_else(|| "-".into())
        };
        let note = r["error"]
            .as_str()
            .map(|e| e.chars().take(90).collect::<String>())
            .or_else(|| {
                r["tokens_per_s_p50"]
                    .as_f64()
                    .map(|v| format!("{v:.1} tokens/s"))
            })
            .unwrap_or_default();
        let tool = match r["backend"].as_str() {
            Some(b) => format!("{}[{b}]", r["tool"].as_str().unwrap_or("")),
            None => r["tool"].as_str().unwrap_or("").to_string(),
        };
        println!(
            "{:<28} {:>9} {:>9} {:>9} {:>9} {:>8}  {}",
            tool,
            f("first_ms"),
            f("p50_ms"),
            f("p95_ms"),
            f("p99_ms"),
            f("images_per_s"),
            note
        );
    }
    print_devices(&report["devices"]);
    let rows_of = |k: &str| report[k].as_array().cloned().unwrap_or_default();
    batch::print(&rows_of("batched"), crate::model_settings().cpu.threads());
    concurrent::print(&rows_of("concurrent"));
    if let Some(r) = &report["round"].as_object() {
        println!(
            "\nround of {} calls: parallel {:.1} ms, serial {:.1} ms, serial/parallel {:.2}x",
            r["calls"],
            r["parallel_ms"].as_f64().unwrap_or(0.0),
            r["serial_ms"].as_f64().unwrap_or(0.0),
            r["speedup"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(rss) = peak_rss_mib() {
        println!("peak RSS {rss:.0} MiB");
    }
}

const CLASSIFY: &str = "classify_chest_xray";

/// The per-device table, when there are several devices (one device took every call).
fn print_devices(devices: &Value) {
    let Some(rows) = devices.as_array().filter(|r| r.len() > 1) else {
        return;
    };
    println!(
        "\n{:<10} {:>7} {:>10} {:>9} {:>5} {:>8}  models",
        "device", "calls", "busy ms", "mean ms", "peak", "failures"
    );
    for r in rows {
        let f = |k: &str| r[k].as_f64().map_or("-".into(), |v| format!("{v:.1}"));
        let models: Vec<&str> = r["models"]
            .as_array()
            .map(|m| m.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        println!(
            "{:<10} {:>7} {:>10} {:>9} {:>5} {:>8}  {}",
            r["device"].as_str().unwrap_or(""),
            r["calls"],
            f("busy_ms"),
            f("mean_ms"),
            r["peak"],
            r["failures"],
            models.join(", ")
        );
    }
}

fn finite(v: f64) -> Value {
    if v.is_finite() {
        json!((v * 100.0).round() / 100.0)
    } else {
        Value::Null
    }
}

/// The same tool calls through the agent loop: all in one round, then one per round.
/// Reports the tool time of each (model time excluded: the script backend answers at once).
async fn round_bench(
    toolbox: Arc<Toolbox>,
    image: &str,
    tools: &[&ToolResult],
    extra: &HashMap<String, Value>,
) -> anyhow::Result<Value> {
    let calls: Vec<ScriptCall> = tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut a = extra.get(&t.name).cloned().unwrap_or_else(|| json!({}));
            if let Some(o) = a.as_object_mut() {
                o.insert("image".into(), json!("$IMAGE"));
            }
            ScriptCall {
                id: Some(format!("c{i}")),
                name: t.name.clone(),
                arguments: a,
            }
        })
        .collect();
    let answer = ScriptTurn {
        content: "done".into(),
        tool_calls: vec![],
        error: None,
    };
    let parallel = vec![
        ScriptTurn {
            content: String::new(),
            tool_calls: calls.clone(),
            error: None,
        },
        answer.clone(),
    ];
    let mut serial: Vec<ScriptTurn> = calls
        .iter()
        .map(|c| ScriptTurn {
            content: String::new(),
            tool_calls: vec![c.clone()],
            error: None,
        })
        .collect();
    serial.push(answer);
    let mut tool_ms = Vec::new();
    for turns in [parallel, serial] {
        let agent = Agent::new(
            Arc::new(ScriptLlm::new(turns)),
            toolbox.clone(),
            Environment::default(),
            AgentConfig {
                max_rounds: calls.len() + 1,
                ..Default::default()
            },
        );
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let out = agent
            .run(
                RunInput {
                    question: "bench".into(),
                    images: vec![image.to_string()],
                    ..Default::default()
                },
                Some(tx),
            )
            .await;
        if let Some(e) = out.error {
            anyhow::bail!("round benchmark failed: {e}");
        }
        let mut ms = 0.0;
        while let Ok(ev) = rx.try_recv() {
            if let Event::Complete { tool_ms, .. } = ev.event {
                ms = tool_ms;
            }
        }
        tool_ms.push(ms);
    }
    Ok(json!({
        "calls": calls.len(),
        "tools": calls.iter().map(|c| c.name.clone()).collect::<Vec<_>>(),
        "parallel_ms": (tool_ms[0] * 10.0).round() / 10.0,
        "serial_ms": (tool_ms[1] * 10.0).round() / 10.0,
        "speedup": ((tool_ms[1] / tool_ms[0].max(1e-9)) * 100.0).round() / 100.0,
    }))
}
