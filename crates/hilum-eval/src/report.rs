//! `report.md` (for people), `report.json` (for programs) and `report.png` (accuracy per
//! category with 95% intervals, latency histogram), all from `run.jsonl`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::record::{RunHeader, RunLog};
use crate::score::{summarize, Summary};
use crate::EvalError;

/// What `report.md` and `report.json` hold.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// What ran.
    pub header: RunHeader,
    /// The scores.
    pub summary: Summary,
}

impl Report {
    /// The report of a run.
    pub fn of(run: &RunLog) -> Report {
        Report {
            header: run.header.clone(),
            summary: summarize(run),
        }
    }

    /// `report.md`.
    pub fn to_markdown(&self) -> String {
        let h = &self.header;
        let s = &self.summary;
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let mut md = format!(
            "# hilum eval: {}\n\n\
             Model {} · memory per {} · {} scoring · temperature {} · seed {} · Hilum {}\n\n\
             **Accuracy {} ({}/{}), 95% CI {}–{}.** Every question of the run is in the \
             denominator: unparsed answers ({}), timeouts ({}), errors ({}) and questions not run \
             ({}) count as wrong.\n\n",
            h.bench,
            h.model,
            h.memory,
            if h.strict {
                "strict (lone letter only)"
            } else {
                "MedRAX cascade"
            },
            h.temperature
                .map_or("backend default".into(), |t| t.to_string()),
            h.seed.map_or("n/a".into(), |t| t.to_string()),
            h.hilum_version,
            pct(s.overall.accuracy),
            s.overall.correct,
            s.overall.n,
            pct(s.overall.ci_low),
            pct(s.overall.ci_high),
            s.unparsed,
            s.timeouts,
            s.errors,
            s.not_run,
        );
        md.push_str("| category | n | correct | accuracy | 95% CI |\n|---|---:|---:|---:|---|\n");
        for (c, a) in &s.categories {
            md.push_str(&format!(
                "| {c} | {} | {} | {} | {}–{} |\n",
                a.n,
                a.correct,
                pct(a.accuracy),
                pct(a.ci_low),
                pct(a.ci_high)
            ));
        }
        if let Some(l) = &s.latency {
            md.push_str(&format!(
                "\n## Per question\n\nLatency p50 {:.0} ms, p95 {:.0} ms, p99 {:.0} ms (mean {:.0}, max {:.0}). \
                 Rounds {:.2}, tool calls {:.2} per question; {} of tool rounds ran calls in parallel. \
                 Tokens: {} prompt, {} completion.\n",
                l.p50_ms,
                l.p95_ms,
                l.p99_ms,
                l.mean_ms,
                l.max_ms,
                s.rounds_mean,
                s.tool_calls_mean,
                pct(s.parallel_round_share),
                s.prompt_tokens,
                s.completion_tokens
            ));
        }
        if let Some(o) = &s.overhead {
            md.push_str(&format!(
                "Evaluation overhead outside the agent: p50 {:.2} ms, p95 {:.2} ms per question.\n",
                o.p50_ms, o.p95_ms
            ));
        }
        if !s.tools.is_empty() {
            md.push_str(
                "\n| tool | calls | failed | p50 ms | p95 ms |\n|---|---:|---:|---:|---:|\n",
            );
            for (name, t) in &s.tools {
                md.push_str(&format!(
                    "| {name} | {} | {} | {:.1} | {:.1} |\n",
                    t.calls, t.failed, t.p50_ms, t.p95_ms
                ));
            }
        }
        md.push_str(&format!(
            "\nTools offered: {}. Budgets: {} rounds, {} tool calls, {:.0} s per question, {:.0} s per tool call; \
             protocol {}, mode {}.\n",
            h.tools.join(", "),
            h.max_rounds,
            h.max_tool_calls,
            h.deadline_s,
            h.tool_timeout_s,
            h.protocol,
            h.mode
        ));
        md
    }
}

/// Writes `report.md`, `report.json` and `report.png` into the run's folder; returns the paths.
pub fn write_reports(run: &RunLog) -> Result<(Report, Vec<PathBuf>), EvalError> {
    let report = Report::of(run);
    let write = |path: &Path, bytes: &[u8]| {
        std::fs::write(path, bytes).map_err(|source| EvalError::Write {
            path: path.display().to_string(),
            source,
        })
    };
    let md = run.dir.join("report.md");
    write(&md, report.to_markdown().as_bytes())?;
    let json = run.dir.join("report.json");
    let text = serde_json::to_vec_pretty(&report)
        .map_err(|e| EvalError::Invalid(format!("cannot encode the report: {e}")))?;
    write(&json, &text)?;
    let png = run.dir.join("report.png");
    let latencies: Vec<f64> = run.records.iter().map(|r| r.latency_ms).collect();
    let bytes = crate::plot::eval_figure(&report.summary, &latencies)?;
    write(&png, &bytes)?;
    Ok((report, vec![md, json, png]))
}
