//! Prometheus metrics in the text exposition format: request counts, tool and LLM latency
//! histograms, errors, runs in flight. Small enough to keep by hand.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

/// `hilum_model_loads_total`: how often each model was loaded by the process's one pool.
pub fn model_loads(loads: &BTreeMap<(String, String), u64>) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP hilum_model_loads_total Model loads by the process-wide model pool."
    );
    let _ = writeln!(out, "# TYPE hilum_model_loads_total counter");
    for ((model, device), n) in loads {
        let _ = writeln!(
            out,
            "hilum_model_loads_total{{model=\"{}\",device=\"{}\"}} {n}",
            esc(model),
            esc(device)
        );
    }
    out
}

/// The images held in memory over all tokens (see `ServerConfig::max_image_memory_bytes`):
/// images, bytes, whole images evicted, images read again from the database, evicted pixels
/// or variants handed out again because a running tool still held them.
pub fn image_memory(
    (images, bytes, evicted, reloads, reattached): (u64, u64, u64, u64, u64),
) -> String {
    let mut out = String::new();
    for (name, kind, help, v) in [
        (
            "hilum_images_resident",
            "gauge",
            "Images in memory, all tokens.",
            images,
        ),
        (
            "hilum_image_memory_bytes",
            "gauge",
            "Bytes those images hold (files, pixels, variants).",
            bytes,
        ),
        (
            "hilum_image_evictions_total",
            "counter",
            "Images dropped from memory over the per-token bound.",
            evicted,
        ),
        (
            "hilum_image_reloads_total",
            "counter",
            "Images read again from the database when named.",
            reloads,
        ),
        (
            "hilum_image_reattached_total",
            "counter",
            "Evicted pixels or variants handed out again (a running tool still held them).",
            reattached,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {v}");
    }
    out
}

/// Histogram bucket upper bounds in seconds: 1 ms … 5 min, for tools and models alike.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

#[derive(Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        for (i, le) in BUCKETS.iter().enumerate() {
            if secs <= *le {
                self.counts[i] += 1;
            }
        }
        self.sum += secs;
        self.count += 1;
    }
}

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(String, String, u16), u64>,
    tool_latency: BTreeMap<(String, String), Histogram>,
    llm_latency: BTreeMap<String, Histogram>,
    errors: BTreeMap<String, u64>,
    runs_active: i64,
    runs_total: BTreeMap<String, u64>,
}

/// The service's counters and histograms, rendered at `/metrics`.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one answered request by method, matched route and status.
    pub fn request(&self, method: &str, route: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((method.to_string(), route.to_string(), status))
            .or_default() += 1;
    }

    /// `outcome` is `ok` or the failure kind.
    pub fn tool_call(&self, tool: &str, outcome: &str, ms: f64) {
        let mut g = self.lock();
        g.tool_latency
            .entry((tool.to_string(), outcome.to_string()))
            .or_default()
            .observe(ms / 1e3);
        if outcome != "ok" {
            *g.errors.entry(format!("tool_{outcome}")).or_default() += 1;
        }
    }

    /// Records one model call's latency.
    pub fn llm_call(&self, model: &str, ms: f64) {
        self.lock()
            .llm_latency
            .entry(model.to_string())
            .or_default()
            .observe(ms / 1e3);
    }

    /// Counts one error of `kind`.
    pub fn error(&self, kind: &str) {
        *self.lock().errors.entry(kind.to_string()).or_default() += 1;
    }

    /// Counts a run as in flight.
    pub fn run_started(&self) {
        self.lock().runs_active += 1;
    }

    /// Counts a run as ended with `status` and no longer in flight.
    pub fn run_ended(&self, status: &str) {
        let mut g = self.lock();
        g.runs_active -= 1;
        *g.runs_total.entry(status.to_string()).or_default() += 1;
    }

    /// The text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let g = self.lock();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP hilum_http_requests_total HTTP requests by route and status."
        );
        let _ = writeln!(out, "# TYPE hilum_http_requests_total counter");
        for ((method, route, status), n) in &g.requests {
            let _ = writeln!(
                out,
                "hilum_http_requests_total{{method=\"{}\",route=\"{}\",status=\"{status}\"}} {n}",
                esc(method),
                esc(route)
            );
        }
        let _ = writeln!(
            out,
            "# HELP hilum_tool_call_duration_seconds Tool call latency by tool and outcome."
        );
        let _ = writeln!(out, "# TYPE hilum_tool_call_duration_seconds histogram");
        for ((tool, outcome), h) in &g.tool_latency {
            let labels = format!("tool=\"{}\",outcome=\"{}\"", esc(tool), esc(outcome));
            histogram(&mut out, "hilum_tool_call_duration_seconds", &labels, h);
        }
        let _ = writeln!(
            out,
            "# HELP hilum_llm_call_duration_seconds Reasoning-model latency per turn."
        );
        let _ = writeln!(out, "# TYPE hilum_llm_call_duration_seconds histogram");
        for (model, h) in &g.llm_latency {
            let labels = format!("model=\"{}\"", esc(model));
            histogram(&mut out, "hilum_llm_call_duration_seconds", &labels, h);
        }
        let _ = writeln!(out, "# HELP hilum_errors_total Errors by kind.");
        let _ = writeln!(out, "# TYPE hilum_errors_total counter");
        for (kind, n) in &g.errors {
            let _ = writeln!(out, "hilum_errors_total{{kind=\"{}\"}} {n}", esc(kind));
        }
        let _ = writeln!(out, "# HELP hilum_runs_active Agent runs in progress.");
        let _ = writeln!(out, "# TYPE hilum_runs_active gauge");
        let _ = writeln!(out, "hilum_runs_active {}", g.runs_active);
        let _ = writeln!(
            out,
            "# HELP hilum_runs_total Finished agent runs by status."
        );
        let _ = writeln!(out, "# TYPE hilum_runs_total counter");
        for (status, n) in &g.runs_total {
            let _ = writeln!(out, "hilum_runs_total{{status=\"{}\"}} {n}", esc(status));
        }
        out
    }
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    for (i, le) in BUCKETS.iter().enumerate() {
        let c = h.counts.get(i).copied().unwrap_or(0);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        m.tool_call("image_info", "ok", 3.0);
        m.tool_call("image_info", "ok", 200.0);
        let text = m.render();
        let line = |le: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with("hilum_tool_call_duration_seconds_bucket")
                        && l.contains(&format!("le=\"{le}\""))
                })
                .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
        };
        assert_eq!(line("0.001").as_deref(), Some("0"));
        assert_eq!(line("0.005").as_deref(), Some("1"));
        assert_eq!(line("0.25").as_deref(), Some("2"));
        assert_eq!(line("+Inf").as_deref(), Some("2"));
    }
}
