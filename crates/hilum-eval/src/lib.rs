//! Benchmarks for the Hilum agent: reads ChestAgentBench-format (`metadata.jsonl`) and plain
//! JSONL question sets, runs them through the agent, scores them the way MedRAX published its
//! numbers (letter cascade, every question in the denominator), and writes `run.jsonl`,
//! `report.md`, `report.json` and a PNG figure; `compare` pairs two runs with McNemar's test.
//!
//! Scoring, reports and comparison read only records, so they are tested without a model.

#![warn(missing_docs)]

pub mod bench;
pub mod compare;
pub mod extract;
pub mod plot;
pub mod record;
pub mod report;
pub mod runner;
pub mod score;

pub use bench::{load_bench, AnswerKind, Question};
pub use compare::{compare_runs, mcnemar_exact, Comparison};
pub use extract::{
    extract_letter, option_by_number, option_in_answer, option_named_by_text, option_texts,
    score_response,
};
pub use record::{read_run, QuestionRecord, RunHeader, RunLog, Status};
pub use report::{write_reports, Report};
pub use runner::{run_eval, EvalConfig, Memory, Progress};
pub use score::{percentile, summarize, wilson_interval, Summary};

/// Failures a user can act on; each names the file (and line) concerned.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A line of an input file is not what it should be.
    #[error("{path}:{line}: {message}")]
    Malformed {
        /// The file.
        path: String,
        /// Its line (1-based).
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A file could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A request that cannot be run, said in full.
    #[error("{0}")]
    Invalid(String),
}
