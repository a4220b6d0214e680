//! `run.jsonl`: a header line (what ran, with which model and settings), then one line per
//! finished question, appended and flushed as each finishes, so a killed run loses only the
//! questions in flight and `--resume` continues from the file.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::EvalError;

/// How a question ended. Anything but `answered` counts as wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// The agent answered (possibly after a round or tool-call budget ran out).
    Answered,
    /// The run's wall-clock budget ran out.
    Timeout,
    /// The model or the run failed.
    Error,
}

/// What ran: the first line of `run.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunHeader {
    /// Always `"header"`.
    pub record: String,
    /// The Hilum version that ran it.
    pub hilum_version: String,
    /// The question file.
    pub bench: String,
    /// sha256 of the question file, so a resumed run is known to read the same questions.
    pub bench_sha256: String,
    /// The folder the questions' image paths are relative to.
    pub images_dir: String,
    /// The question ids of this run (after `--limit` / `--categories`): the denominator.
    pub question_ids: Vec<String>,
    /// The categories of each question, so never-run questions count in their categories too.
    #[serde(default)]
    pub question_categories: std::collections::BTreeMap<String, Vec<String>>,
    /// The model's name.
    pub model: String,
    /// The `--llm` spec.
    pub llm: String,
    /// Sampling temperature sent with each request.
    pub temperature: Option<f32>,
    /// The sampler's seed where the backend takes one (the local model); `None` otherwise.
    pub seed: Option<u64>,
    /// The tools offered.
    pub tools: Vec<String>,
    /// `case` (one conversation per case, as MedRAX ran) or `question`.
    pub memory: String,
    /// Only a lone letter was accepted.
    pub strict: bool,
    /// `native` or `react`.
    pub protocol: String,
    /// The agent's mode (`react` or `reflexion`).
    pub mode: String,
    /// Tool rounds per question.
    pub max_rounds: usize,
    /// Tool calls per question.
    pub max_tool_calls: usize,
    /// Seconds per question.
    pub deadline_s: f64,
    /// Seconds per tool call.
    pub tool_timeout_s: f64,
    /// `--limit`.
    pub limit: Option<usize>,
    /// `--categories`.
    pub categories: Vec<String>,
    /// Seconds since the Unix epoch when the run (first) started.
    pub started_unix: u64,
    /// Whether a choice answer with no letter was followed by the letter step.
    #[serde(default)]
    pub letter_step: bool,
    /// Whether the questions' pixels were sent to a model outside the process.
    #[serde(default)]
    pub send_pixels: bool,
}

/// One tool call of a question, from the event stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// The round it ran in (1-based).
    pub round: usize,
    /// The call's id.
    pub id: String,
    /// The tool.
    pub name: String,
    /// How long it took.
    pub ms: f64,
    /// Whether it succeeded.
    pub ok: bool,
    /// Why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One finished question.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuestionRecord {
    /// Always `"question"`.
    pub record: String,
    /// The question's id.
    pub id: String,
    /// Its case.
    pub case_id: String,
    /// Its categories.
    pub categories: Vec<String>,
    /// The right answer.
    pub expected: String,
    /// The model's answer.
    pub response: Option<String>,
    /// The letter (or number) read from the response; `None` when nothing could be read.
    pub extracted: Option<String>,
    /// Whether it was right.
    pub correct: bool,
    /// Answered, timed out or failed.
    pub status: Status,
    /// Why the agent stopped (`answered`, `max_rounds`, `deadline`, ...).
    pub stop_reason: String,
    /// Why it failed, when it did.
    #[serde(default)]
    pub error: Option<String>,
    /// Wall clock of the question, image intake included.
    pub latency_ms: f64,
    /// Time in the model.
    pub llm_ms: f64,
    /// Time in tools.
    pub tool_ms: f64,
    /// Decoding the question's images into the store (what `hilum analyze` does too).
    #[serde(default)]
    pub ingest_ms: f64,
    /// The evaluation's own time: outside the agent's run, the image intake and the letter step
    /// (building the run, records, scoring).
    pub overhead_ms: f64,
    /// Tool rounds.
    pub rounds: usize,
    /// Rounds that ran two or more tool calls at once.
    pub parallel_rounds: usize,
    /// Every tool call, in order.
    pub tool_calls: Vec<CallRecord>,
    /// Prompt tokens over all requests.
    pub prompt_tokens: u64,
    /// Tokens the model wrote.
    pub completion_tokens: u64,
    /// From the `final` event when the agent reports them (claims checked against tool results).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grounded: Option<Value>,
    /// From the `final` event: claims no tool result supports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unsupported: Option<Value>,
    /// From the `final` event: whether the answer addressed each covered part of the question.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answers_question: Option<Value>,
    /// The tools the model was offered.
    pub tools_offered: Vec<String>,
    /// The model's reply to the letter step, when it was asked (the letter is read from it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub letter_reply: Option<String>,
    /// The option an answer in words that names no letter was read as, without a letter step:
    /// the only option whose text it contains (in the whole answer or in its clause about the
    /// question), or the only range option holding the percentage that clause states.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub option_in_answer: Option<String>,
    /// The messages this question added to its case's conversation (`--memory case` only), so a
    /// resumed run continues the same conversation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub messages: Option<Vec<hilum_agent::Message>>,
}

/// A run as read back from its folder.
#[derive(Clone, Debug)]
pub struct RunLog {
    /// The run's folder.
    pub dir: PathBuf,
    /// Its header.
    pub header: RunHeader,
    /// Its finished questions, in the order they finished.
    pub records: Vec<QuestionRecord>,
}

impl RunLog {
    /// The record of question `id`.
    pub fn record(&self, id: &str) -> Option<&QuestionRecord> {
        self.records.iter().find(|r| r.id == id)
    }
}

/// The run's file in its folder.
pub const RUN_FILE: &str = "run.jsonl";

/// Reads `DIR/run.jsonl` (or the file itself). A last line cut off by a kill is dropped and
/// reported in the second value; a bad line elsewhere is an error naming the line.
pub fn read_run(path: &Path) -> Result<(RunLog, Option<usize>), EvalError> {
    let (dir, file) = if path.is_dir() {
        (path.to_path_buf(), path.join(RUN_FILE))
    } else {
        (
            path.parent().map(Path::to_path_buf).unwrap_or_default(),
            path.to_path_buf(),
        )
    };
    let text = std::fs::read_to_string(&file).map_err(|source| EvalError::Read {
        path: file.display().to_string(),
        source,
    })?;
    let lines: Vec<&str> = text.lines().collect();
    let complete = text.ends_with('\n');
    let malformed = |line: usize, message: String| EvalError::Malformed {
        path: file.display().to_string(),
        line,
        message,
    };
    let header_line = lines
        .first()
        .ok_or_else(|| malformed(1, "empty: not a run of `hilum eval`".into()))?;
    let header: RunHeader = serde_json::from_str(header_line)
        .map_err(|e| malformed(1, format!("not a `hilum eval` run header: {e}")))?;
    let mut records: Vec<QuestionRecord> = Vec::new();
    let mut cut = None;
    for (i, l) in lines.iter().enumerate().skip(1) {
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<QuestionRecord>(l) {
            Ok(r) => {
                // A question finished twice (should not happen) counts once: the last record.
                records.retain(|old| old.id != r.id);
                records.push(r);
            }
            Err(_) if i + 1 == lines.len() && !complete => cut = Some(i + 1),
            Err(e) => return Err(malformed(i + 1, format!("not a question record: {e}"))),
        }
    }
    Ok((
        RunLog {
            dir,
            header,
            records,
        },
        cut,
    ))
}

/// Appends records to `run.jsonl`, one flushed and synced line each.
pub struct RunWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl RunWriter {
    /// Starts a new run file with its header; refuses to overwrite an existing run.
    pub fn create(dir: &Path, header: &RunHeader) -> Result<RunWriter, EvalError> {
        let path = dir.join(RUN_FILE);
        let write_err = |source| EvalError::Write {
            path: path.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(write_err)?;
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    EvalError::Invalid(format!(
                        "{} already holds a run: pass --resume to continue it, or another --out",
                        path.display()
                    ))
                } else {
                    write_err(e)
                }
            })?;
        let mut w = RunWriter { path, file };
        w.append(header)?;
        Ok(w)
    }

    /// Opens an existing run for appending; a line cut off by a kill is removed first.
    pub fn resume(dir: &Path) -> Result<RunWriter, EvalError> {
        let path = dir.join(RUN_FILE);
        let write_err = |source| EvalError::Write {
            path: path.display().to_string(),
            source,
        };
        let text = std::fs::read(&path).map_err(write_err)?;
        let keep = text.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(write_err)?;
        if keep < text.len() {
            file.set_len(keep as u64).map_err(write_err)?;
        }
        drop(file);
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(write_err)?;
        Ok(RunWriter { path, file })
    }

    /// Appends one JSON line and flushes it to disk.
    pub fn append<T: Serialize>(&mut self, record: &T) -> Result<(), EvalError> {
        let write_err = |source| EvalError::Write {
            path: self.path.display().to_string(),
            source,
        };
        let mut line = serde_json::to_vec(record)
            .map_err(|e| EvalError::Invalid(format!("cannot encode a record: {e}")))?;
        line.push(b'\n');
        // One write per line: a kill leaves whole lines and at most one partial last line.
        self.file.write_all(&line).map_err(write_err)?;
        self.file.sync_data().map_err(write_err)
    }
}
