//! Runs a question set through the agent: `jobs` units at once (a unit is one question, or one
//! case's questions in order under `--memory case`), a record appended to `run.jsonl` as each
//! question finishes, and `resume` skipping every question the file already holds.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::Value;
use sha2::{Digest, Sha256};

use hilum_agent::{
    Agent, AgentConfig, Environment, Event, Llm, Message, RunEvent, RunInput, StopReason, Toolbox,
};
use hilum_imaging::ImageStore;

use crate::bench::{load_bench, AnswerKind, Question};
use crate::extract::{
    names_an_option, option_by_number, option_in_answer, option_named_by_text, option_texts,
    relevant_clause, score_response,
};
use crate::record::{read_run, CallRecord, QuestionRecord, RunHeader, RunLog, RunWriter, Status};
use crate::EvalError;

/// Whether questions of one case share a conversation (as MedRAX ran ChestAgentBench).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    /// One conversation per case.
    Case,
    /// Each question alone.
    Question,
}

impl Memory {
    /// `case` or `question`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Memory::Case => "case",
            Memory::Question => "question",
        }
    }
}

impl std::str::FromStr for Memory {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "case" => Ok(Memory::Case),
            "question" => Ok(Memory::Question),
            other => Err(format!("unknown memory `{other}`: use case or question")),
        }
    }
}

/// The model for a question (one shared model, or per-question scripts).
pub type LlmFor = Arc<dyn Fn(&Question) -> Result<Arc<dyn Llm>, String> + Send + Sync>;
/// The tools offered for a question, given its image ids.
pub type ToolboxFor = Arc<dyn Fn(&[String]) -> Arc<Toolbox> + Send + Sync>;

/// What to run and how; recorded in the run's header.
#[derive(Clone, Debug)]
pub struct EvalConfig {
    /// The question file.
    pub bench: PathBuf,
    /// The folder the questions' image paths are relative to.
    pub images_dir: PathBuf,
    /// The run's folder.
    pub out: PathBuf,
    /// Questions (or cases) run at once.
    pub jobs: usize,
    /// Whether a case shares one conversation.
    pub memory: Memory,
    /// Accept only a lone letter.
    pub strict: bool,
    /// Continue the run in `out`.
    pub resume: bool,
    /// Only the first this many questions.
    pub limit: Option<usize>,
    /// Keep questions with any of these categories (lower case); empty keeps all.
    pub categories: Vec<String>,
    /// The agent's budgets and protocol.
    pub agent: AgentConfig,
    /// The model's name (recorded).
    pub model: String,
    /// The `--llm` spec (recorded).
    pub llm_spec: String,
    /// The local model's sampler seed (recorded).
    pub seed: Option<u64>,
    /// The tools offered (recorded).
    pub tools: Vec<String>,
    /// The Hilum version (recorded).
    pub hilum_version: String,
    /// Appended to a multiple-choice question (MedRAX asked for the letter only).
    pub choice_instruction: String,
    /// When a choice answer opens with no letter and holds no standalone one: read the one
    /// option whose text it contains, else ask the same model once, in the same conversation,
    /// which option its answer matches (see [`letter_step`]).
    pub letter_step: bool,
    /// Send the questions' pixels (as `hilum_imaging::model_view_png` shows them) to a model
    /// that reads images even when it runs outside this process; a model in the process always
    /// gets them.
    pub send_pixels: bool,
}

/// The default [`EvalConfig::choice_instruction`] (MedRAX's).
pub const CHOICE_INSTRUCTION: &str =
    "Answer with the letter of the correct option (A-F) first, then one short sentence.";

/// Sent after each finished question.
pub struct Progress<'a> {
    /// Questions finished.
    pub done: usize,
    /// Questions in the run.
    pub total: usize,
    /// Right answers among all finished questions (resumed ones included).
    pub correct: usize,
    /// The question just finished.
    pub record: &'a QuestionRecord,
}

/// Called after each finished question.
pub type OnProgress = Arc<dyn Fn(&Progress) + Send + Sync>;

/// The questions a run covers, after `categories` and `limit`, in file order.
pub fn select(
    questions: Vec<Question>,
    categories: &[String],
    limit: Option<usize>,
) -> Vec<Question> {
    questions
        .into_iter()
        .filter(|q| categories.is_empty() || q.categories.iter().any(|c| categories.contains(c)))
        .take(limit.unwrap_or(usize::MAX))
        .collect()
}

fn sha256_file(path: &Path) -> Result<String, EvalError> {
    let bytes = std::fs::read(path).map_err(|source| EvalError::Read {
        path: path.display().to_string(),
        source,
    })?;
    Ok(format!("{:x}", Sha256::digest(&bytes)))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Every image must exist before anything runs: a wrong `--images-dir` would otherwise turn the
/// whole benchmark into errors.
fn check_images(questions: &[Question], dir: &Path) -> Result<(), EvalError> {
    let missing: Vec<String> = questions
        .iter()
        .flat_map(|q| q.images.iter().map(move |i| (q, i)))
        .filter(|(_, i)| !dir.join(i).is_file())
        .map(|(q, i)| {
            format!(
                "{} (question {}, line {})",
                dir.join(i).display(),
                q.id,
                q.line
            )
        })
        .collect();
    if let Some(first) = missing.first() {
        return Err(EvalError::Invalid(format!(
            "{} image(s) not found, e.g. {first}; images are resolved against --images-dir {}",
            missing.len(),
            dir.display()
        )));
    }
    Ok(())
}

fn header(cfg: &EvalConfig, questions: &[Question], sha: String) -> RunHeader {
    RunHeader {
        record: "header".into(),
        hilum_version: cfg.hilum_version.clone(),
        bench: cfg.bench.display().to_string(),
        bench_sha256: sha,
        images_dir: cfg.images_dir.display().to_string(),
        question_ids: questions.iter().map(|q| q.id.clone()).collect(),
        question_categories: questions
            .iter()
            .map(|q| (q.id.clone(), q.categories.clone()))
            .collect(),
        model: cfg.model.clone(),
        llm: cfg.llm_spec.clone(),
        temperature: cfg.agent.temperature,
        seed: cfg.seed,
        tools: cfg.tools.clone(),
        memory: cfg.memory.as_str().into(),
        strict: cfg.strict,
        protocol: format!("{:?}", cfg.agent.protocol).to_lowercase(),
        mode: format!("{:?}", cfg.agent.mode).to_lowercase(),
        max_rounds: cfg.agent.max_rounds,
        max_tool_calls: cfg.agent.max_tool_calls,
        deadline_s: cfg.agent.deadline.as_secs_f64(),
        tool_timeout_s: cfg.agent.tool_timeout.as_secs_f64(),
        limit: cfg.limit,
        categories: cfg.categories.clone(),
        started_unix: unix_now(),
        letter_step: cfg.letter_step,
        send_pixels: cfg.send_pixels,
    }
}

/// A resumed run must ask the same questions the same way; anything else would mix two runs.
fn check_resumable(old: &RunHeader, new: &RunHeader) -> Result<(), EvalError> {
    let mut diffs = Vec::new();
    if old.bench_sha256 != new.bench_sha256 {
        diffs.push("the question file changed".to_string());
    }
    if old.question_ids != new.question_ids {
        diffs.push("the selected questions differ (--limit / --categories)".into());
    }
    for (what, a, b) in [
        ("model", &old.model, &new.model),
        ("--memory", &old.memory, &new.memory),
        ("protocol", &old.protocol, &new.protocol),
        ("mode", &old.mode, &new.mode),
    ] {
        if a != b {
            diffs.push(format!("{what} was {a}, now {b}"));
        }
    }
    if old.strict != new.strict {
        diffs.push(format!("--strict was {}, now {}", old.strict, new.strict));
    }
    if old.temperature != new.temperature {
        diffs.push(format!(
            "temperature was {:?}, now {:?}",
            old.temperature, new.temperature
        ));
    }
    if diffs.is_empty() {
        Ok(())
    } else {
        Err(EvalError::Invalid(format!(
            "cannot resume: {}; run again with the same settings, or start a new run with another --out",
            diffs.join("; ")
        )))
    }
}

struct Shared {
    cfg: EvalConfig,
    store: Arc<ImageStore>,
    llm_for: LlmFor,
    toolbox_for: ToolboxFor,
    writer: Mutex<RunWriter>,
    counts: Mutex<(usize, usize)>,
    total: usize,
    on_progress: OnProgress,
}

/// The letter step: a small model often answers in words ("the patient's left lung is larger")
/// and never writes a letter. The same model, in the same conversation (its tool results and
/// tools included, so a local model reuses its cached state), is asked once which option its
/// answer matches, with the options' texts as the closed set of replies (`ChatRequest::choices`:
/// a local model must write one of them; a server writes freely and the cascade reads it).
/// Returns the reply and the time it took; `None` when the model could not be asked.
/// The loop's final answer is not always part of its message list; a conversation that goes on
/// (the letter step, the next question of a case) must see it, as in a chat.
fn push_final_answer(messages: &mut Vec<Message>, answer: &str) {
    if !matches!(messages.last(), Some(Message::Assistant { tool_calls, .. }) if tool_calls.is_empty())
    {
        messages.push(Message::assistant(answer.to_string(), vec![]));
    }
}

/// The words every closed reply of the letter step opens with (taken off before matching).
const CHOICE_LEAD: &str = "The matching option is: ";

async fn letter_step(
    llm: &Arc<dyn Llm>,
    messages: &[Message],
    tools: Vec<hilum_agent::llm::ToolSpec>,
    answer: &str,
    said: &str,
    options: &[(char, String)],
    temperature: Option<f32>,
) -> Option<(String, f64)> {
    let t0 = Instant::now();
    let mut messages = messages.to_vec();
    push_final_answer(&mut messages, answer);
    let listed: Vec<String> = options.iter().map(|(l, o)| format!("{l}) {o}")).collect();
    // The answer is restated after the options, its clause about the question only (`said`): a
    // small model leans to whatever it read last.
    messages.push(Message::user(
        format!(
            "Options:\n{}\n\nYour answer: {said}\nWhich option matches your answer? Reply with the option only.",
            listed.join("\n")
        ),
        vec![],
    ));
    let req = hilum_agent::llm::ChatRequest {
        messages,
        tools,
        temperature,
        max_tokens: Some(32),
        // Every choice opens with the same words, so that the first token that differs is one of
        // content: a bare choice's first token competes with the prior of a list's "1".
        choices: options
            .iter()
            .map(|(_, o)| format!("{CHOICE_LEAD}{o}"))
            .collect(),
        ..Default::default()
    };
    let stream = llm.chat(req).await.ok()?;
    let turn = hilum_agent::llm::collect_turn(stream, |_| {}).await.ok()?;
    let reply = turn.text.trim_start();
    let reply = reply.strip_prefix(CHOICE_LEAD).unwrap_or(reply).to_string();
    Some((reply, t0.elapsed().as_secs_f64() * 1e3))
}

fn prompt(q: &Question, instruction: &str) -> String {
    match q.kind {
        AnswerKind::Choice if !instruction.is_empty() => format!("{}\n\n{instruction}", q.question),
        AnswerKind::Number => format!("{}\n\nAnswer with the number first.", q.question),
        _ => q.question.clone(),
    }
}

/// What the event stream says about one question.
#[derive(Default)]
struct Observed {
    calls: Vec<CallRecord>,
    parallel_rounds: usize,
    llm_ms: f64,
    tool_ms: f64,
    agent_ms: Option<f64>,
    prompt_tokens: u64,
    completion_tokens: u64,
    grounded: Option<Value>,
    unsupported: Option<Value>,
    answers_question: Option<Value>,
}

fn observe(events: Vec<RunEvent>) -> Observed {
    let mut o = Observed::default();
    let mut started: BTreeMap<usize, usize> = BTreeMap::new();
    for e in events {
        match e.event {
            Event::ToolStarted { round, .. } => *started.entry(round).or_default() += 1,
            Event::ToolFinished {
                round,
                call_id,
                name,
                ms,
                ..
            } => o.calls.push(CallRecord {
                round,
                id: call_id,
                name,
                ms,
                ok: true,
                error: None,
            }),
            Event::ToolFailed {
                round,
                call_id,
                name,
                ms,
                error,
                ..
            } => o.calls.push(CallRecord {
                round,
                id: call_id,
                name,
                ms,
                ok: false,
                error: Some(error),
            }),
            Event::Complete {
                total_ms,
                llm_ms,
                tool_ms,
                usage,
                ..
            } => {
                o.agent_ms = Some(total_ms);
                o.llm_ms = llm_ms;
                o.tool_ms = tool_ms;
                o.prompt_tokens = usage.prompt_tokens as u64;
                o.completion_tokens = usage.completion_tokens as u64;
            }
            ev @ Event::Final { .. } => {
                // Read through JSON so fields added to `final` later are picked up when present.
                if let Ok(v) = serde_json::to_value(&ev) {
                    o.grounded = v.get("grounded").cloned().filter(|g| !g.is_null());
                    o.unsupported = v.get("unsupported").cloned().filter(|g| !g.is_null());
                    o.answers_question =
                        v.get("answers_question").cloned().filter(|g| !g.is_null());
                }
            }
            _ => {}
        }
    }
    o.parallel_rounds = started.values().filter(|n| **n >= 2).count();
    o
}

async fn ingest(store: &Arc<ImageStore>, dir: &Path, q: &Question) -> Result<Vec<String>, String> {
    let store = store.clone();
    let paths: Vec<PathBuf> = q.images.iter().map(|i| dir.join(i)).collect();
    tokio::task::spawn_blocking(move || {
        paths
            .iter()
            .map(|p| {
                store
                    .ingest_file(p)
                    .map_err(|e| format!("cannot use image {}: {e}", p.display()))
            })
            .collect()
    })
    .await
    .map_err(|e| format!("image intake failed: {e}"))?
}

/// A question's record before anything ran: an error until the run says otherwise.
fn blank_record(q: &Question) -> QuestionRecord {
    QuestionRecord {
        record: "question".into(),
        id: q.id.clone(),
        case_id: q.case_id.clone(),
        categories: q.categories.clone(),
        expected: q.answer.clone(),
        response: None,
        extracted: None,
        correct: false,
        status: Status::Error,
        stop_reason: "error".into(),
        error: None,
        latency_ms: 0.0,
        llm_ms: 0.0,
        tool_ms: 0.0,
        ingest_ms: 0.0,
        overhead_ms: 0.0,
        rounds: 0,
        parallel_rounds: 0,
        tool_calls: vec![],
        prompt_tokens: 0,
        completion_tokens: 0,
        grounded: None,
        unsupported: None,
        answers_question: None,
        tools_offered: vec![],
        letter_reply: None,
        option_in_answer: None,
        messages: None,
    }
}

/// The agent's input for a question: its prompt, images, history, and what it may be shown of
/// the images.
fn run_input(
    sh: &Shared,
    q: &Question,
    ids: Vec<String>,
    llm: &dyn Llm,
    history: Vec<Message>,
) -> RunInput {
    // Size, spacing and view: numbers an answer may quote besides the tool results.
    let image_metadata = ids
        .iter()
        .filter_map(|id| sh.store.get(id).ok())
        .map(|img| serde_json::json!({"width": img.width, "height": img.height, "meta": img.meta}))
        .collect();
    // A model in this process that reads images gets their pixels (they stay in the process);
    // one outside it only with `send_pixels`.
    let caps = llm.capabilities();
    let image_payloads = if caps.images && (caps.in_process || sh.cfg.send_pixels) {
        ids.iter()
            .filter_map(|id| {
                let img = sh.store.get(id).ok()?;
                let png = hilum_imaging::model_view_png(&img).ok()?;
                Some(hilum_agent::llm::ImagePayload::png(id.clone(), &png))
            })
            .collect()
    } else {
        vec![]
    };
    RunInput {
        question: prompt(q, &sh.cfg.choice_instruction),
        images: ids,
        image_payloads,
        history,
        session_id: q.id.clone(),
        image_metadata,
    }
}

/// Scores an answer: its letter, else (with the letter step) the one option it names in words
/// or states a percentage of, else the letter the model gives when asked once which option its
/// answer matches. Returns the milliseconds the letter step took (0 when not asked).
async fn score(
    sh: &Shared,
    q: &Question,
    rec: &mut QuestionRecord,
    llm: &Arc<dyn Llm>,
    messages: &[Message],
    tool_specs: Vec<hilum_agent::llm::ToolSpec>,
    answer: &str,
) -> f64 {
    let mut letter_ms = 0.0;
    let (got, right) = score_response(q, answer, sh.cfg.strict);
    rec.extracted = got;
    rec.correct = right && rec.status == Status::Answered;
    let options = option_texts(&q.question);
    let unnamed = sh.cfg.letter_step
        && q.kind == AnswerKind::Choice
        && rec.status == Status::Answered
        && !names_an_option(answer)
        && !options.is_empty();
    // An answer in words is read as an option when it holds one option's text (in
    // the whole answer or in its clause about the question) or states a percentage
    // that one range option holds; only then is no letter step needed.
    // The answer's clause about the question: read for an option here, and
    // restated in the letter step.
    let said = relevant_clause(answer, &q.question);
    let in_answer = if unnamed && !sh.cfg.strict {
        option_in_answer(answer, &options)
            .or_else(|| option_in_answer(&said, &options))
            .or_else(|| option_by_number(&said, &options))
    } else {
        None
    };
    if let Some(l) = in_answer {
        rec.extracted = Some(l.to_string());
        rec.correct = rec.extracted.as_deref() == Some(q.answer.as_str());
        rec.option_in_answer = options
            .iter()
            .find(|(o, _)| *o == l)
            .map(|(_, t)| t.clone());
    } else if unnamed {
        let asked = letter_step(
            llm,
            messages,
            tool_specs,
            answer,
            &said,
            &options,
            sh.cfg.agent.temperature,
        )
        .await;
        if let Some((reply, ms)) = asked {
            rec.llm_ms += ms;
            letter_ms = ms;
            let (got, right) = match option_named_by_text(&reply, &options) {
                Some(l) => {
                    let l = l.to_string();
                    let right = l == q.answer;
                    (Some(l), right)
                }
                None => score_response(q, &reply, sh.cfg.strict),
            };
            if got.is_some() {
                rec.extracted = got;
                rec.correct = right;
            }
            rec.letter_reply = Some(reply);
        }
    }
    letter_ms
}

/// Asks one question; never fails: every failure is a record with status `error`.
async fn ask(sh: &Shared, q: &Question, history: Vec<Message>) -> QuestionRecord {
    let t0 = Instant::now();
    let mut rec = blank_record(q);
    let prepared = async {
        let t_ingest = Instant::now();
        let ids = ingest(&sh.store, &sh.cfg.images_dir, q).await?;
        rec.ingest_ms = t_ingest.elapsed().as_secs_f64() * 1e3;
        let llm = (sh.llm_for)(q)?;
        Ok::<_, String>((ids, llm))
    }
    .await;
    let (ids, llm) = match prepared {
        Ok(p) => p,
        Err(e) => {
            rec.error = Some(e);
            rec.latency_ms = t0.elapsed().as_secs_f64() * 1e3;
            rec.overhead_ms = rec.latency_ms;
            return rec;
        }
    };
    let toolbox = (sh.toolbox_for)(&ids);
    rec.tools_offered = toolbox.names();
    // The letter step offers the same tools so that the prompt up to its question is the
    // agent's own.
    let tool_specs = if sh.cfg.agent.protocol == hilum_agent::Protocol::Native {
        toolbox.specs(&Environment::default())
    } else {
        vec![]
    };
    let agent = Agent::new(
        llm.clone(),
        toolbox,
        Environment::default(),
        sh.cfg.agent.clone(),
    );
    let history_len = history.len();
    let input = run_input(sh, q, ids, llm.as_ref(), history);
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // The agent keeps its own deadline and a grace period for the final answer; this bound only
    // catches a run that ignores both.
    let hard = sh.cfg.agent.deadline + Duration::from_secs(60);
    let outcome = tokio::time::timeout(hard, agent.run(input, Some(tx))).await;
    let mut letter_ms = 0.0;
    let mut events = Vec::new();
    while let Ok(e) = rx.try_recv() {
        events.push(e);
    }
    let seen = observe(events);
    rec.tool_calls = seen.calls;
    rec.parallel_rounds = seen.parallel_rounds;
    rec.llm_ms = seen.llm_ms;
    rec.tool_ms = seen.tool_ms;
    rec.prompt_tokens = seen.prompt_tokens;
    rec.completion_tokens = seen.completion_tokens;
    rec.grounded = seen.grounded;
    rec.unsupported = seen.unsupported;
    rec.answers_question = seen.answers_question;
    match outcome {
        Err(_) => {
            rec.status = Status::Timeout;
            rec.stop_reason = "deadline".into();
            rec.error = Some(format!(
                "no answer within {:.0} s (the deadline plus 60 s)",
                hard.as_secs_f64()
            ));
        }
        Ok(out) => {
            rec.rounds = out.rounds;
            rec.stop_reason = out.reason.as_str().into();
            rec.response = out.answer.clone();
            let timed_out = out.reason == StopReason::Deadline
                || out
                    .error
                    .as_deref()
                    .is_some_and(|e| e.contains("time budget"));
            rec.status = if timed_out {
                Status::Timeout
            } else if out.reason == StopReason::Error {
                Status::Error
            } else {
                Status::Answered
            };
            rec.error = out.error.clone();
            if let Some(answer) = &out.answer {
                letter_ms = score(sh, q, &mut rec, &llm, &out.messages, tool_specs, answer).await;
            }
            if sh.cfg.memory == Memory::Case {
                let mut added: Vec<Message> =
                    out.messages.iter().skip(1 + history_len).cloned().collect();
                if let Some(answer) = &out.answer {
                    push_final_answer(&mut added, answer);
                }
                rec.messages = Some(added);
            }
        }
    }
    rec.latency_ms = t0.elapsed().as_secs_f64() * 1e3;
    rec.overhead_ms =
        (rec.latency_ms - seen.agent_ms.unwrap_or(rec.latency_ms) - rec.ingest_ms - letter_ms)
            .max(0.0);
    rec
}

fn finish(sh: &Shared, rec: &QuestionRecord) -> Result<(), EvalError> {
    sh.writer
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .append(rec)?;
    let (done, correct) = {
        let mut c = sh.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.0 += 1;
        c.1 += rec.correct as usize;
        *c
    };
    (sh.on_progress)(&Progress {
        done,
        total: sh.total,
        correct,
        record: rec,
    });
    Ok(())
}

/// One unit: its questions in order, carrying the conversation under `--memory case`.
async fn run_unit(
    sh: &Shared,
    unit: Vec<Question>,
    finished: &BTreeMap<String, QuestionRecord>,
) -> Result<(), EvalError> {
    let mut history: Vec<Message> = Vec::new();
    for q in &unit {
        if let Some(done) = finished.get(&q.id) {
            if sh.cfg.memory == Memory::Case {
                history.extend(done.messages.clone().unwrap_or_default());
                // The conversation may refer to this question's images by id.
                let _ = ingest(&sh.store, &sh.cfg.images_dir, q).await;
            }
            continue;
        }
        let hist = match sh.cfg.memory {
            Memory::Case => history.clone(),
            Memory::Question => vec![],
        };
        let rec = ask(sh, q, hist).await;
        if let Some(m) = &rec.messages {
            history.extend(m.iter().cloned());
        }
        finish(sh, &rec)?;
    }
    Ok(())
}

/// Runs (or resumes) an evaluation and returns the run as written.
pub async fn run_eval(
    cfg: EvalConfig,
    store: Arc<ImageStore>,
    llm_for: LlmFor,
    toolbox_for: ToolboxFor,
    on_progress: OnProgress,
) -> Result<RunLog, EvalError> {
    if cfg.jobs == 0 {
        return Err(EvalError::Invalid("--jobs must be at least 1".into()));
    }
    let questions = select(load_bench(&cfg.bench)?, &cfg.categories, cfg.limit);
    if questions.is_empty() {
        return Err(EvalError::Invalid(format!(
            "no question of {} has any of the categories {:?}",
            cfg.bench.display(),
            cfg.categories
        )));
    }
    check_images(&questions, &cfg.images_dir)?;
    let new_header = header(&cfg, &questions, sha256_file(&cfg.bench)?);
    let (writer, finished) = if cfg.resume {
        let (old, _cut) = read_run(&cfg.out)?;
        check_resumable(&old.header, &new_header)?;
        let finished: BTreeMap<String, QuestionRecord> =
            old.records.into_iter().map(|r| (r.id.clone(), r)).collect();
        (RunWriter::resume(&cfg.out)?, finished)
    } else {
        (RunWriter::create(&cfg.out, &new_header)?, BTreeMap::new())
    };
    let ids: HashSet<&str> = questions.iter().map(|q| q.id.as_str()).collect();
    let already = finished.keys().filter(|k| ids.contains(k.as_str())).count();
    let already_right = finished
        .values()
        .filter(|r| ids.contains(r.id.as_str()) && r.correct)
        .count();

    let mut units: Vec<Vec<Question>> = Vec::new();
    match cfg.memory {
        Memory::Question => units.extend(questions.iter().map(|q| vec![q.clone()])),
        Memory::Case => {
            let mut index: BTreeMap<String, usize> = BTreeMap::new();
            for q in &questions {
                let i = *index.entry(q.case_id.clone()).or_insert_with(|| {
                    units.push(Vec::new());
                    units.len() - 1
                });
                units[i].push(q.clone());
            }
        }
    }
    units.retain(|u| u.iter().any(|q| !finished.contains_key(&q.id)));

    let jobs = cfg.jobs;
    let out = cfg.out.clone();
    let shared = Shared {
        total: questions.len(),
        cfg,
        store,
        llm_for,
        toolbox_for,
        writer: Mutex::new(writer),
        counts: Mutex::new((already, already_right)),
        on_progress,
    };
    let sh = &shared;
    let fin = &finished;
    let results: Vec<Result<(), EvalError>> = futures::stream::iter(units)
        .map(|u| async move { run_unit(sh, u, fin).await })
        .buffer_unordered(jobs)
        .collect()
        .await;
    results.into_iter().collect::<Result<Vec<()>, _>>()?;
    let (log, _) = read_run(&out)?;
    Ok(log)
}
