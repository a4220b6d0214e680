//! Two runs on the same questions: accuracy of each on the questions both finished, the
//! difference, McNemar's exact test on the discordant pairs, and the per-category table.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::record::{QuestionRecord, RunLog, Status};
use crate::score::Accuracy;

/// Two-sided exact McNemar p-value: `b` questions right only in A, `c` right only in B.
/// Under the null each discordant pair is a fair coin: p = min(1, 2·P(X ≤ min(b, c))),
/// X ~ Binomial(b + c, ½).
pub fn mcnemar_exact(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // Sum in log space: C(n, i) / 2^n underflows for the benchmark's 2,500 questions.
    let ln_half_n = -(n as f64) * std::f64::consts::LN_2;
    let mut ln_c = 0.0; // ln C(n, 0)
    let mut tail = 0.0;
    for i in 0..=k {
        if i > 0 {
            ln_c += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        tail += (ln_c + ln_half_n).exp();
    }
    (2.0 * tail).min(1.0)
}

/// One category's accuracy in each run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CategoryPair {
    /// Run A.
    pub a: Accuracy,
    /// Run B.
    pub b: Accuracy,
}

/// Two runs compared on the questions both finished.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Run A's folder.
    pub run_a: String,
    /// Run B's folder.
    pub run_b: String,
    /// Run A's model.
    pub model_a: String,
    /// Run B's model.
    pub model_b: String,
    /// Questions both runs finished.
    pub shared: usize,
    /// Run A's accuracy on the shared questions.
    pub a: Accuracy,
    /// Run B's accuracy on the shared questions.
    pub b: Accuracy,
    /// Accuracy of B minus accuracy of A.
    pub difference: f64,
    /// Right in A only.
    pub a_only: usize,
    /// Right in B only.
    pub b_only: usize,
    /// McNemar's exact two-sided p on the questions only one run got right.
    pub p_value: f64,
    /// The same per category.
    pub categories: BTreeMap<String, CategoryPair>,
}

fn right(r: &QuestionRecord) -> bool {
    r.correct && r.status == Status::Answered
}

/// Compares two runs on the questions both finished (matched by question id).
pub fn compare_runs(a: &RunLog, b: &RunLog) -> Comparison {
    let mut pairs = Vec::new();
    for ra in &a.records {
        if let Some(rb) = b.record(&ra.id) {
            pairs.push((ra, rb));
        }
    }
    let ka = pairs.iter().filter(|(x, _)| right(x)).count();
    let kb = pairs.iter().filter(|(_, y)| right(y)).count();
    let a_only = pairs.iter().filter(|(x, y)| right(x) && !right(y)).count();
    let b_only = pairs.iter().filter(|(x, y)| !right(x) && right(y)).count();
    let mut cats: BTreeMap<String, (usize, usize, usize)> = BTreeMap::new();
    for (x, y) in &pairs {
        for c in &x.categories {
            let e = cats.entry(c.clone()).or_default();
            e.0 += right(x) as usize;
            e.1 += right(y) as usize;
            e.2 += 1;
        }
    }
    let n = pairs.len();
    let acc_a = Accuracy::new(ka, n);
    let acc_b = Accuracy::new(kb, n);
    Comparison {
        run_a: a.dir.display().to_string(),
        run_b: b.dir.display().to_string(),
        model_a: a.header.model.clone(),
        model_b: b.header.model.clone(),
        shared: n,
        difference: acc_b.accuracy - acc_a.accuracy,
        a: acc_a,
        b: acc_b,
        a_only,
        b_only,
        p_value: mcnemar_exact(a_only, b_only),
        categories: cats
            .into_iter()
            .map(|(c, (ka, kb, n))| {
                let pair = CategoryPair {
                    a: Accuracy::new(ka, n),
                    b: Accuracy::new(kb, n),
                };
                (c, pair)
            })
            .collect(),
    }
}

impl Comparison {
    /// A Markdown table for the terminal and for pasting into a report.
    pub fn to_markdown(&self) -> String {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        let mut s = format!(
            "# hilum eval compare\n\nA: {} ({})\nB: {} ({})\n\n\
             On the {} questions both runs finished: A {} ({}/{}), B {} ({}/{}), \
             difference B − A {:+.1} points.\n\
             Right in A only: {}; right in B only: {}; McNemar exact two-sided p = {:.4}.\n\n\
             | category | n | A | B | B − A |\n|---|---:|---:|---:|---:|\n",
            self.run_a,
            self.model_a,
            self.run_b,
            self.model_b,
            self.shared,
            pct(self.a.accuracy),
            self.a.correct,
            self.shared,
            pct(self.b.accuracy),
            self.b.correct,
            self.shared,
            self.difference * 100.0,
            self.a_only,
            self.b_only,
            self.p_value
        );
        for (c, p) in &self.categories {
            s.push_str(&format!(
                "| {c} | {} | {} | {} | {:+.1} |\n",
                p.a.n,
                pct(p.a.accuracy),
                pct(p.b.accuracy),
                (p.b.accuracy - p.a.accuracy) * 100.0
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcnemar_hand_values() {
        // b = 1, c = 6: n = 7, P(X <= 1) = (1 + 7) / 128, two-sided 16 / 128.
        assert!((mcnemar_exact(1, 6) - 0.125).abs() < 1e-12);
        assert!((mcnemar_exact(6, 1) - 0.125).abs() < 1e-12);
        // b = 0, c = 5: 2 / 32.
        assert!((mcnemar_exact(0, 5) - 0.0625).abs() < 1e-12);
        // Balanced discordance is capped at 1.
        assert_eq!(mcnemar_exact(3, 3), 1.0);
        assert_eq!(mcnemar_exact(0, 0), 1.0);
        // Large n stays finite: 1000 vs 1100 discordant pairs.
        let p = mcnemar_exact(1000, 1100);
        assert!(p > 0.0 && p < 0.05, "{p}");
    }
}
