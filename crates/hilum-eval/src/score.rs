//! Scores of a run: accuracy over every question of the run (unparsed, failed and never-run
//! questions are wrong), per-category accuracy with 95% Wilson intervals, latency percentiles,
//! rounds, tool calls, parallel rounds and tokens.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::{RunLog, Status};

/// z for a two-sided 95% interval.
const Z95: f64 = 1.959_963_984_540_054;

/// The 95% Wilson score interval of `k` successes in `n` trials; `(0, 1)` for `n = 0`.
pub fn wilson_interval(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (k, n) = (k as f64, n as f64);
    let p = k / n;
    let z2 = Z95 * Z95;
    let denom = 1.0 + z2 / n;
    let center = (p + z2 / (2.0 * n)) / denom;
    let half = Z95 * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / denom;
    ((center - half).max(0.0), (center + half).min(1.0))
}

/// Nearest-rank percentile (`q` in 0..=100) of unsorted values; `None` when empty.
pub fn percentile(values: &[f64], q: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    Some(v[rank.min(v.len()) - 1])
}

/// An accuracy with its 95% Wilson interval.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Accuracy {
    /// Questions.
    pub n: usize,
    /// Right answers.
    pub correct: usize,
    /// `correct / n` (0 when `n` is 0).
    pub accuracy: f64,
    /// Lower end of the interval.
    pub ci_low: f64,
    /// Upper end of the interval.
    pub ci_high: f64,
}

impl Accuracy {
    /// `correct` of `n`.
    pub fn new(correct: usize, n: usize) -> Accuracy {
        let (ci_low, ci_high) = wilson_interval(correct, n);
        Accuracy {
            n,
            correct,
            accuracy: if n == 0 {
                0.0
            } else {
                correct as f64 / n as f64
            },
            ci_low,
            ci_high,
        }
    }
}

/// Percentiles of a time, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Latency {
    /// Median.
    pub p50_ms: f64,
    /// 95th percentile.
    pub p95_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Mean.
    pub mean_ms: f64,
    /// Longest.
    pub max_ms: f64,
}

impl Latency {
    fn of(values: &[f64]) -> Option<Latency> {
        Some(Latency {
            p50_ms: percentile(values, 50.0)?,
            p95_ms: percentile(values, 95.0)?,
            p99_ms: percentile(values, 99.0)?,
            mean_ms: values.iter().sum::<f64>() / values.len() as f64,
            max_ms: values.iter().copied().fold(f64::MIN, f64::max),
        })
    }
}

/// Everything `report.md` / `report.json` show.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Every question of the run: the denominator.
    pub overall: Accuracy,
    /// Questions with a record (the rest were never run: a run that was stopped).
    pub finished: usize,
    /// Questions never run.
    pub not_run: usize,
    /// Answered, but no letter/number could be read.
    pub unparsed: usize,
    /// Questions past their deadline.
    pub timeouts: usize,
    /// Questions that failed.
    pub errors: usize,
    /// Accuracy per category.
    pub categories: BTreeMap<String, Accuracy>,
    /// Time per question.
    pub latency: Option<Latency>,
    /// Time spent outside the agent per question (intake and records).
    pub overhead: Option<Latency>,
    /// Tool rounds per question.
    pub rounds_mean: f64,
    /// Tool calls per question.
    pub tool_calls_mean: f64,
    /// Rounds with two or more calls among rounds with any call.
    pub parallel_round_share: f64,
    /// Prompt tokens, all questions.
    pub prompt_tokens: u64,
    /// Tokens the model wrote, all questions.
    pub completion_tokens: u64,
    /// Tool calls by tool: count and p50 latency.
    pub tools: BTreeMap<String, ToolStats>,
}

/// One tool's calls in a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolStats {
    /// Calls.
    pub calls: usize,
    /// Failed calls.
    pub failed: usize,
    /// Median time.
    pub p50_ms: f64,
    /// 95th percentile of the time.
    pub p95_ms: f64,
}

/// Scores a run over the question ids in its header.
pub fn summarize(run: &RunLog) -> Summary {
    let ids = &run.header.question_ids;
    let mut correct = 0;
    let mut cats: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let (mut unparsed, mut timeouts, mut errors, mut finished) = (0, 0, 0, 0);
    let mut latencies = Vec::new();
    let mut overheads = Vec::new();
    let (mut rounds, mut calls, mut tool_rounds, mut parallel) = (0usize, 0usize, 0usize, 0usize);
    let (mut prompt_tokens, mut completion_tokens) = (0u64, 0u64);
    let mut tool_ms: BTreeMap<String, (Vec<f64>, usize)> = BTreeMap::new();
    for id in ids {
        let record = run.record(id);
        let ok = record.is_some_and(|r| r.correct && r.status == Status::Answered);
        let categories = run
            .header
            .question_categories
            .get(id)
            .or(record.map(|r| &r.categories));
        for c in categories.into_iter().flatten() {
            let e = cats.entry(c.clone()).or_default();
            e.0 += ok as usize;
            e.1 += 1;
        }
        let Some(r) = record else {
            continue;
        };
        finished += 1;
        correct += ok as usize;
        match r.status {
            Status::Answered if r.extracted.is_none() => unparsed += 1,
            Status::Answered => {}
            Status::Timeout => timeouts += 1,
            Status::Error => errors += 1,
        }
        latencies.push(r.latency_ms);
        overheads.push(r.overhead_ms);
        rounds += r.rounds;
        calls += r.tool_calls.len();
        let mut per_round: BTreeMap<usize, usize> = BTreeMap::new();
        for c in &r.tool_calls {
            *per_round.entry(c.round).or_default() += 1;
            let e = tool_ms.entry(c.name.clone()).or_default();
            e.0.push(c.ms);
            e.1 += (!c.ok) as usize;
        }
        tool_rounds += per_round.len();
        parallel += per_round.values().filter(|n| **n >= 2).count();
        prompt_tokens += r.prompt_tokens;
        completion_tokens += r.completion_tokens;
    }
    let per = |x: usize| {
        if finished == 0 {
            0.0
        } else {
            x as f64 / finished as f64
        }
    };
    Summary {
        overall: Accuracy::new(correct, ids.len()),
        finished,
        not_run: ids.len() - finished,
        unparsed,
        timeouts,
        errors,
        categories: cats
            .into_iter()
            .map(|(c, (k, n))| (c, Accuracy::new(k, n)))
            .collect(),
        latency: Latency::of(&latencies),
        overhead: Latency::of(&overheads),
        rounds_mean: per(rounds),
        tool_calls_mean: per(calls),
        parallel_round_share: if tool_rounds == 0 {
            0.0
        } else {
            parallel as f64 / tool_rounds as f64
        },
        prompt_tokens,
        completion_tokens,
        tools: tool_ms
            .into_iter()
            .map(|(name, (ms, failed))| {
                let stats = ToolStats {
                    calls: ms.len(),
                    failed,
                    p50_ms: percentile(&ms, 50.0).unwrap_or(0.0),
                    p95_ms: percentile(&ms, 95.0).unwrap_or(0.0),
                };
                (name, stats)
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_hand_values() {
        // 8 of 10: center (0.8 + 1.9208/10)/1.38415 = 0.71674, half 0.21233 (by hand).
        let (lo, hi) = wilson_interval(8, 10);
        assert!(
            (lo - 0.4902).abs() < 1e-4 && (hi - 0.9433).abs() < 1e-4,
            "{lo} {hi}"
        );
        let (lo, hi) = wilson_interval(0, 5);
        assert!(lo == 0.0 && (hi - 0.4345).abs() < 1e-4, "{hi}");
        assert_eq!(wilson_interval(0, 0), (0.0, 1.0));
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 95.0), Some(95.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&[3.0], 99.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
