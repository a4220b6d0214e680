//! A question in a session: the agent runs on its own task, each event is stored and then
//! streamed to the client (NDJSON or SSE). A client that goes away cancels the run, unless it
//! asked with `?detach=true` (the web UI does): then the run goes on, `GET …/runs/{run_id}/stream`
//! follows it from its first event and `POST …/runs/{run_id}/cancel` stops it.
//!
//! Runs are durable: the question, each decision and each tool result are stored as they
//! happen (see [`hilum_agent::Checkpointer`]). A run whose server stopped is `interrupted`
//! and `POST …/runs/{run_id}/resume` continues it without running a finished call again.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tracing::Instrument;
use utoipa::{IntoParams, ToSchema};

use hilum_agent::llm::ImagePayload;
use hilum_agent::{
    Agent, CallFailure, CallResult, Checkpointer, Event, FailureKind, Message, Progress, Resume,
    RunEvent, RunInput, RunOutcome, StopReason, ToolCall, ToolOutput,
};

use crate::api::{owned_session, prepare_artifacts};
use crate::db::{new_id, AuditEntry, Caller, StoredCall, ToolCallRecord};
use crate::deid::{deidentify, enumerated_strings};
use crate::error::ApiError;
use crate::{AppState, Space};

#[derive(Deserialize, ToSchema)]
pub struct Ask {
    pub question: String,
    /// Ids of the caller's images the question is about.
    #[serde(default)]
    pub images: Vec<String>,
}

#[derive(Deserialize, IntoParams)]
pub struct StreamQuery {
    /// `ndjson` (default) or `sse`; `Accept: text/event-stream` also selects SSE.
    pub format: Option<String>,
    /// `true`: the run goes on when this response is closed (follow it again with
    /// `GET …/runs/{run_id}/stream`, stop it with `POST …/runs/{run_id}/cancel`).
    pub detach: Option<bool>,
}

/// The longest question accepted, in characters: checked before the model is reached, so a
/// pasted report cannot overflow the model's context and break the session.
pub const MAX_QUESTION_CHARS: usize = 8_000;

/// Refuses an empty or too long question with a message that says what to do.
pub(crate) fn check_question(question: &str) -> Result<(), ApiError> {
    if question.trim().is_empty() {
        return Err(ApiError::BadRequest("`question` is empty".into()));
    }
    let n = question.chars().count();
    if n > MAX_QUESTION_CHARS {
        return Err(ApiError::PayloadTooLarge(format!(
            "the question is {} characters; the limit is {} characters: shorten it or ask it in parts",
            thousands(n),
            thousands(MAX_QUESTION_CHARS)
        )));
    }
    Ok(())
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[utoipa::path(post, path = "/v1/sessions/{id}/messages", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), StreamQuery),
    request_body = Ask,
    responses(
        (status = 200, description = "The run's events, one JSON object per line (`type`: run_started, decision, tool_started, tool_finished, tool_failed, token, final, error, complete, heartbeat, cancelled, interrupted); or the same as SSE",
            content_type = "application/x-ndjson"),
        (status = 400, description = "The question is empty"),
        (status = 403, description = "The policy forbids the configured model endpoint"),
        (status = 404, description = "No such session or image for this token"),
        (status = 413, description = "The question is longer than MAX_QUESTION_CHARS (8,000 characters)"),
        (status = 503, description = "No reasoning model is configured, or the server is shutting down"),
    ),
    security(("bearer" = [])))]
pub async fn ask(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(session_id): Path<String>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
    Json(ask): Json<Ask>,
) -> Result<Response, ApiError> {
    owned_session(&state, &caller, &session_id).await?;
    check_question(&ask.question)?;
    state.runs.refuse_when_draining()?;
    let space = state.space(&caller).await?;
    state.ensure_images(&caller, &space, &ask.images).await?;
    for id in &ask.images {
        if space.images.get(id).is_err() {
            return Err(ApiError::not_found("image", id));
        }
    }
    let llm = build_llm(&state)?;
    let start = new_run(
        &state,
        caller,
        space,
        &llm,
        session_id,
        ask.question,
        ask.images,
    )
    .await?;
    Ok(start_run(&state, llm, start, stream_mode(&q, &headers)))
}

/// Records a new run of `question` in the session and gathers what it starts from (history,
/// pixels where allowed, image metadata).
async fn new_run(
    state: &AppState,
    caller: Caller,
    space: Arc<Space>,
    llm: &Arc<dyn hilum_agent::Llm>,
    session_id: String,
    question: String,
    images: Vec<String>,
) -> Result<Start, ApiError> {
    let history = to_messages(state.db.history(session_id.clone()).await?)?;
    let (image_payloads, image_metadata) =
        image_inputs(state, &space, &images, llm.capabilities()).await?;
    let run_id = new_id("run");
    state
        .db
        .insert_run(
            session_id.clone(),
            run_id.clone(),
            question.clone(),
            images.clone(),
            llm.name(),
            state.replica.clone(),
        )
        .await?;
    let input = RunInput {
        question,
        images,
        image_payloads,
        history,
        session_id: session_id.clone(),
        image_metadata,
    };
    Ok(Start {
        caller,
        space,
        session_id,
        run_id,
        input,
        resume: None,
        seq: 0,
    })
}

#[utoipa::path(post, path = "/v1/sessions/{id}/runs/{run_id}/resume", tag = "sessions",
    params(("id" = String, Path, description = "Session id"),
           ("run_id" = String, Path, description = "Id of an interrupted run"), StreamQuery),
    responses(
        (status = 200, description = "The rest of the run's events, as from `POST …/messages`: the run continues from its last stored step; finished tool calls are reused, not run again",
            content_type = "application/x-ndjson"),
        (status = 404, description = "No such session or run for this token"),
        (status = 409, description = "The run is not interrupted (running, completed, failed or cancelled)"),
        (status = 503, description = "No reasoning model is configured, or the server is shutting down"),
    ),
    security(("bearer" = [])))]
pub async fn resume(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((session_id, run_id)): Path<(String, String)>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    owned_session(&state, &caller, &session_id).await?;
    state.runs.refuse_when_draining()?;
    let stored = state
        .db
        .stored_run(session_id.clone(), run_id.clone())
        .await?
        .ok_or_else(|| ApiError::not_found("run", &run_id))?;
    if stored.run.status != "interrupted" {
        return Err(ApiError::Conflict(format!(
            "run `{run_id}` is {}: only an interrupted run can be resumed",
            stored.run.status
        )));
    }
    let space = state.space(&caller).await?;
    state
        .ensure_images(&caller, &space, &stored.run.images)
        .await?;
    let llm = build_llm(&state)?;
    let (image_payloads, image_metadata) =
        image_inputs(&state, &space, &stored.run.images, llm.capabilities()).await?;
    let resume = Resume {
        messages: to_messages(stored.messages)?,
        results: stored.calls.into_iter().map(call_result).collect(),
        progress: match stored.progress {
            Some(p) => serde_json::from_value(p).map_err(|e| {
                ApiError::Internal(format!("the stored progress of `{run_id}` is corrupt: {e}"))
            })?,
            None => Progress::default(),
        },
    };
    let history = to_messages(stored.history)?;
    let seq = state
        .db
        .events(session_id.clone(), run_id.clone())
        .await?
        .len() as i64;
    // Last: from here the run is this process's, and nothing below can fail.
    if !state
        .db
        .claim_interrupted(session_id.clone(), run_id.clone(), state.replica.clone())
        .await?
    {
        return Err(ApiError::Conflict(format!(
            "run `{run_id}` is no longer interrupted: another request resumed it"
        )));
    }
    let input = RunInput {
        question: stored.run.question,
        images: stored.run.images,
        image_payloads,
        history,
        session_id: session_id.clone(),
        image_metadata,
    };
    let start = Start {
        caller,
        space,
        session_id,
        run_id,
        input,
        resume: Some(resume),
        seq,
    };
    Ok(start_run(&state, llm, start, stream_mode(&q, &headers)))
}

/// The run's model, if the server has one and the policy allows it.
/// Runs a question as an ordinary durable run of `caller`'s session, without a client: the
/// DICOM node's protocol plans run this way (stored, audited and shown like any other run).
/// Returns the run id and its events.
pub(crate) async fn run_unattended(
    state: &AppState,
    caller: Caller,
    llm: Arc<dyn hilum_agent::Llm>,
    session_id: String,
    question: String,
    images: Vec<String>,
) -> Result<(String, Vec<Value>), ApiError> {
    state.runs.refuse_when_draining()?;
    let space = state.space(&caller).await?;
    let start = new_run(state, caller, space, &llm, session_id, question, images).await?;
    let run_id = start.run_id.clone();
    // The body streams until the run's last event; reading it to the end is waiting for the run.
    let body = start_run(state, llm, start, StreamMode::default()).into_body();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .map_err(|e| ApiError::Internal(format!("the run's event stream broke: {e}")))?;
    let events = bytes
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| serde_json::from_slice(l).ok())
        .collect();
    Ok((run_id, events))
}

fn build_llm(state: &AppState) -> Result<std::sync::Arc<dyn hilum_agent::Llm>, ApiError> {
    let factory = state.cfg.llm.clone().ok_or_else(|| {
        ApiError::LlmUnavailable(
            "this server has no reasoning model: start it with --llm (e.g. --llm script:FILE or --llm openai:MODEL)".into(),
        )
    })?;
    if !factory.local && !state.cfg.allow_remote_llm {
        return Err(ApiError::Forbidden(format!(
            "the policy forbids sending image pixels or metadata to the non-local model endpoint `{}`; \
             use a model on this machine or start the server with --allow-remote-llm",
            factory.name
        )));
    }
    (factory.build)().map_err(ApiError::LlmUnavailable)
}

/// How a run's response streams: SSE or NDJSON, and whether closing it cancels the run.
#[derive(Clone, Copy, Default)]
struct StreamMode {
    sse: bool,
    detach: bool,
}

fn stream_mode(q: &StreamQuery, headers: &HeaderMap) -> StreamMode {
    StreamMode {
        sse: wants_sse(q.format.as_deref(), headers),
        detach: q.detach.unwrap_or(false),
    }
}

pub(crate) fn wants_sse(format: Option<&str>, headers: &HeaderMap) -> bool {
    format == Some("sse")
        || headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/event-stream"))
}

fn to_messages(values: Vec<Value>) -> Result<Vec<Message>, ApiError> {
    values
        .into_iter()
        .map(|v| {
            serde_json::from_value(v)
                .map_err(|e| ApiError::Internal(format!("a stored message is corrupt: {e}")))
        })
        .collect()
}

/// A stored tool call as the loop's result: enough to reuse it (repeat detection, grounding).
fn call_result(c: StoredCall) -> (usize, CallResult) {
    let result = if c.ok {
        Ok(ToolOutput::new(
            c.result["summary"].as_str().unwrap_or_default(),
            c.result["data"].clone(),
        ))
    } else {
        Err(CallFailure {
            kind: c
                .error_kind
                .as_deref()
                .and_then(FailureKind::from_name)
                .unwrap_or(FailureKind::ToolError),
            message: c.result["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        })
    };
    let call = ToolCall {
        id: c.call_id,
        name: c.tool,
        arguments: c.arguments.to_string(),
    };
    let round = usize::try_from(c.round).unwrap_or(0);
    (
        round,
        CallResult {
            call,
            arguments: Some(c.arguments),
            repaired: false,
            result,
            ms: c.ms,
        },
    )
}

/// Pixels for a model that reads them (a model in this process always: they stay in it;
/// another only on request, and, checked before, only to a remote endpoint when the policy
/// allows it), and the images' size, spacing and view: numbers an answer may quote besides the
/// tool results.
async fn image_inputs(
    state: &AppState,
    space: &Space,
    images: &[String],
    caps: hilum_llm::Capabilities,
) -> Result<(Vec<ImagePayload>, Vec<Value>), ApiError> {
    let payloads = if caps.images && (state.cfg.send_pixels || caps.in_process) {
        let store = space.images.clone();
        let ids = images.to_vec();
        tokio::task::spawn_blocking(move || {
            ids.iter()
                .map(|id| pixel_payload(&store, id))
                .collect::<Result<Vec<_>, String>>()
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(ApiError::Unprocessable)?
    } else {
        Vec::new()
    };
    let metadata = images
        .iter()
        .filter_map(|id| space.images.get(id).ok())
        .map(|img| json!({"width": img.width, "height": img.height, "meta": img.meta}))
        .collect();
    Ok((payloads, metadata))
}

/// A run about to start or continue.
struct Start {
    caller: Caller,
    space: Arc<Space>,
    session_id: String,
    run_id: String,
    input: RunInput,
    resume: Option<Resume>,
    /// The last event seq already stored for the run.
    seq: i64,
}

/// Starts the run on its own task and returns the response streaming its events.
fn start_run(
    state: &AppState,
    llm: Arc<dyn hilum_agent::Llm>,
    s: Start,
    mode: StreamMode,
) -> Response {
    let (client_tx, client_rx) = mpsc::unbounded_channel::<Value>();
    // Dropping the response body (client gone) drops `cancel_tx`, which cancels the run.
    let (cancel_tx, cancel_rx) = oneshot::channel::<()>();
    let model = llm.name();
    let agent = Agent::new(
        llm,
        s.space.toolbox.clone(),
        state.cfg.env.clone(),
        state.cfg.agent.clone(),
    );
    let stored_messages = s.resume.as_ref().map_or(0, |r| r.messages.len());
    let recorder = Arc::new(Recorder {
        state: state.clone(),
        caller: s.caller.clone(),
        space: s.space.clone(),
        session_id: s.session_id.clone(),
        run_id: s.run_id.clone(),
        refs: Mutex::new(HashMap::new()),
        saved: AtomicUsize::new(stored_messages),
    });
    let history_len = s.input.history.len();
    let run = RunCtx {
        state: state.clone(),
        caller: s.caller,
        session_id: s.session_id,
        run_id: s.run_id,
        model,
        seq: s.seq,
        client: client_tx,
        recorder: recorder.clone(),
        resumed: s.resume.is_some(),
    };
    let active = state.runs.enter(state.clone());
    let user_cancel = state.runs.register(&run.run_id);
    // A child of the request's span: the run's lines (tool calls included) carry its id
    // after the response has started streaming.
    let span = tracing::info_span!("run", run_id = %run.run_id, resumed = run.resumed);
    tokio::spawn(
        drive(
            run,
            agent,
            s.input,
            s.resume,
            history_len,
            Cancels {
                client: cancel_rx,
                detached: mode.detach,
                user: user_cancel,
            },
            active,
        )
        .instrument(span),
    );
    stream_response(client_rx, cancel_tx, mode.sse)
}

/// The run's events as NDJSON (default) or SSE. The stream holds `cancel_tx`: when the client
/// goes away, the body is dropped and the run is cancelled.
fn stream_response(
    client_rx: mpsc::UnboundedReceiver<Value>,
    cancel_tx: oneshot::Sender<()>,
    sse: bool,
) -> Response {
    values_response(UnboundedReceiverStream::new(client_rx), cancel_tx, sse)
}

/// Events as NDJSON or SSE; the body holds `alive` until the client goes away.
pub(crate) fn values_response<S, K>(stream: S, alive: K, sse: bool) -> Response
where
    S: futures::Stream<Item = Value> + Send + 'static,
    K: Send + Sync + 'static,
{
    let cancel_tx = alive;
    if sse {
        let events = stream.map(move |v| {
            let _alive = &cancel_tx;
            let kind = v["type"].as_str().unwrap_or("event").to_string();
            let ev = if kind == "heartbeat" {
                SseEvent::default().comment("heartbeat")
            } else {
                SseEvent::default().event(kind).data(v.to_string())
            };
            Ok::<_, Infallible>(ev)
        });
        Sse::new(events).into_response()
    } else {
        let lines = stream.map(move |v| {
            let _alive = &cancel_tx;
            let mut line = v.to_string();
            line.push('\n');
            Ok::<_, Infallible>(Bytes::from(line))
        });
        (
            [
                (header::CONTENT_TYPE, "application/x-ndjson"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(lines),
        )
            .into_response()
    }
}

/// The image as the reasoning model sees it (`hilum_imaging::model_view_png`).
fn pixel_payload(store: &hilum_imaging::ImageStore, id: &str) -> Result<ImagePayload, String> {
    let img = store.get(id).map_err(|e| e.to_string())?;
    let png = hilum_imaging::model_view_png(&img).map_err(|e| e.to_string())?;
    Ok(ImagePayload::png(id, &png))
}

/// The runs this process drives, for the drain on shutdown.
pub(crate) struct Runs {
    /// How many runs this process is driving now.
    active: watch::Sender<usize>,
    /// Set when the drain window is over: the runs still going stop and become `interrupted`.
    stop: watch::Sender<bool>,
    draining: AtomicBool,
    /// The cancel switch of each run this process drives, by run id.
    cancels: Mutex<HashMap<String, watch::Sender<bool>>>,
}

impl Default for Runs {
    fn default() -> Self {
        Runs {
            active: watch::channel(0).0,
            stop: watch::channel(false).0,
            draining: AtomicBool::new(false),
            cancels: Mutex::new(HashMap::new()),
        }
    }
}

impl Runs {
    /// From now on, new runs and resumes are refused.
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Whether the server is shutting down (no new work starts).
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    fn refuse_when_draining(&self) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(ApiError::Unavailable(
                "the server is shutting down: ask again on another replica or once it has restarted".into(),
            ));
        }
        Ok(())
    }

    fn enter(&self, state: AppState) -> ActiveRun {
        self.active.send_modify(|n| *n += 1);
        ActiveRun(state)
    }

    fn cancels(&self) -> std::sync::MutexGuard<'_, HashMap<String, watch::Sender<bool>>> {
        self.cancels.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The run's cancel switch; the entry goes when the run ends (its receiver is dropped).
    fn register(&self, run_id: &str) -> watch::Receiver<bool> {
        let (tx, rx) = watch::channel(false);
        let mut map = self.cancels();
        map.retain(|_, tx| !tx.is_closed());
        map.insert(run_id.to_string(), tx);
        rx
    }

    /// Cancels a run this process drives; false when it drives no such run.
    pub(crate) fn cancel(&self, run_id: &str) -> bool {
        match self.cancels().remove(run_id) {
            Some(tx) => tx.send(true).is_ok(),
            None => false,
        }
    }
}

/// Counts a run as active while it lives.
struct ActiveRun(AppState);

impl Drop for ActiveRun {
    fn drop(&mut self) {
        self.0.runs.active.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// What stops a run besides the server's shutdown: its client closing the response (unless
/// detached) and `POST …/cancel`.
struct Cancels {
    client: oneshot::Receiver<()>,
    detached: bool,
    user: watch::Receiver<bool>,
}

/// The drain: lets running runs finish for up to `drain`, then stops the rest (each marks
/// itself `interrupted`) and waits until they have.
pub(crate) async fn drain(state: &AppState) {
    let mut active = state.runs.active.subscribe();
    let running = *active.borrow();
    tracing::info!(
        runs = running,
        drain_secs = state.cfg.drain.as_secs_f64(),
        "shutting down: running runs may finish"
    );
    let finished = tokio::time::timeout(state.cfg.drain, async {
        let _ = active.wait_for(|n| *n == 0).await;
    })
    .await;
    if finished.is_err() {
        let left = *active.borrow();
        tracing::warn!(
            runs = left,
            "drain window over: stopping the remaining runs as interrupted"
        );
        state.runs.stop.send_replace(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), async {
            let _ = active.wait_for(|n| *n == 0).await;
        })
        .await;
    }
}

/// Stores a durable run's steps as they happen: messages with the loop's progress, and each
/// tool result with its tool message, artifacts and audit row in one transaction.
struct Recorder {
    state: AppState,
    caller: Caller,
    space: Arc<Space>,
    session_id: String,
    run_id: String,
    /// Artifact references of stored results by call id, for their `tool_finished` event.
    refs: Mutex<HashMap<String, Value>>,
    /// How many of the run's messages are stored.
    saved: AtomicUsize,
}

impl Recorder {
    fn deid(&self, tool: &str, args: &Value) -> Value {
        let allowed = self
            .space
            .toolbox
            .get(tool)
            .map(|t| enumerated_strings(&t.spec().parameters))
            .unwrap_or_default();
        deidentify(args, &allowed)
    }

    fn take_refs(&self, call_id: &str) -> Option<Value> {
        self.refs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(call_id)
    }
}

#[async_trait]
impl Checkpointer for Recorder {
    async fn messages(&self, new: &[Message], progress: &Progress) -> Result<(), String> {
        let bodies = new
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let progress = serde_json::to_value(progress).map_err(|e| e.to_string())?;
        self.state
            .db
            .save_messages(
                self.session_id.clone(),
                self.run_id.clone(),
                bodies,
                progress,
            )
            .await
            .map_err(|e| {
                self.state.metrics.error("db");
                e.to_string()
            })?;
        self.saved.fetch_add(new.len(), Ordering::SeqCst);
        Ok(())
    }

    async fn tool_result(
        &self,
        round: usize,
        r: &CallResult,
        message: &Message,
    ) -> Result<(), String> {
        let args = r.arguments.clone().unwrap_or_else(|| {
            serde_json::from_str(&r.call.arguments)
                .unwrap_or_else(|_| Value::String(r.call.arguments.clone()))
        });
        let name = r.call.name.as_str();
        let call_id = r.call.id.as_str();
        let (ok, kind, result, rows, refs) = match &r.result {
            Ok(out) => {
                let (rows, refs) = prepare_artifacts(
                    &self.caller,
                    Some(&self.session_id),
                    Some(&self.run_id),
                    call_id,
                    name,
                    &out.artifacts,
                );
                let refs = serde_json::to_value(&refs).unwrap_or(Value::Null);
                (
                    true,
                    "ok".to_string(),
                    json!({"summary": out.summary, "data": out.data}),
                    rows,
                    Some(refs),
                )
            }
            Err(f) => (
                false,
                f.kind.as_str().to_string(),
                json!({"error": {"kind": f.kind.as_str(), "message": f.message}}),
                Vec::new(),
                None,
            ),
        };
        let record = ToolCallRecord {
            token_id: self.caller.token_id.clone(),
            session_id: Some(self.session_id.clone()),
            run_id: Some(self.run_id.clone()),
            call_id: call_id.to_string(),
            tool: name.to_string(),
            arguments: args.clone(),
            ok,
            error_kind: (!ok).then(|| kind.clone()),
            ms: r.ms,
            result,
            round: Some(round as i64),
        };
        let audit = AuditEntry {
            actor: self.caller.token_id.clone(),
            session_id: Some(self.session_id.clone()),
            run_id: Some(self.run_id.clone()),
            kind: "tool_call",
            name: name.to_string(),
            arguments: self.deid(name, &args),
            outcome: kind,
            duration_ms: r.ms,
        };
        let message = serde_json::to_value(message).map_err(|e| e.to_string())?;
        // Fail closed: the result, its tool message and its audit row are one transaction. A
        // call that cannot be recorded is not done: the loop stops and the run fails, so its
        // result reaches neither the model nor the client.
        self.state
            .db
            .record_tool_call(record, rows, audit, Some(message))
            .await
            .map_err(|e| {
                self.state.metrics.error("audit");
                tracing::error!(tool = name, error = %e, "tool call not recorded: the run stops");
                format!("the call and its audit row could not be recorded, so it does not count as done ({e})")
            })?;
        self.saved.fetch_add(1, Ordering::SeqCst);
        if let Some(refs) = refs {
            self.refs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(call_id.to_string(), refs);
        }
        Ok(())
    }
}

struct RunCtx {
    state: AppState,
    caller: Caller,
    session_id: String,
    run_id: String,
    model: String,
    seq: i64,
    client: mpsc::UnboundedSender<Value>,
    recorder: Arc<Recorder>,
    resumed: bool,
}

impl RunCtx {
    /// Stores the event, then sends it to the client (which may be gone: ignored).
    async fn publish(&mut self, event: Value) {
        self.seq += 1;
        let kind = event["type"].as_str().unwrap_or("event").to_string();
        if let Err(e) = self
            .state
            .db
            .insert_event(self.run_id.clone(), self.seq, kind, event.clone())
            .await
        {
            tracing::error!(error = %e, "cannot store event");
            self.state.metrics.error("db");
        }
        let _ = self.client.send(event);
    }

    fn audit(
        &self,
        kind: &'static str,
        name: &str,
        arguments: Value,
        outcome: &str,
        ms: f64,
    ) -> AuditEntry {
        AuditEntry {
            actor: self.caller.token_id.clone(),
            session_id: Some(self.session_id.clone()),
            run_id: Some(self.run_id.clone()),
            kind,
            name: name.to_string(),
            arguments,
            outcome: outcome.to_string(),
            duration_ms: ms,
        }
    }

    /// Records what an event says happened, and returns the JSON to stream. Tool results
    /// were stored by the recorder before their events were sent. An error: the event's
    /// audit row could not be written, and the run must stop.
    async fn handle(&mut self, ev: RunEvent) -> Result<Value, ()> {
        let mut out = serde_json::to_value(&ev)
            .unwrap_or_else(|e| json!({"type": "error", "message": e.to_string()}));
        match &ev.event {
            Event::Decision {
                tool_calls,
                llm_ms,
                round,
                phase,
                usage,
                ..
            } => {
                self.state.metrics.llm_call(&self.model, *llm_ms);
                let entry = self.audit(
                    "llm_call",
                    &self.model.clone(),
                    json!({"round": round, "phase": phase, "tool_calls": tool_calls.len(),
                           "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}),
                    "ok",
                    *llm_ms,
                );
                self.store_audit(entry).await?;
            }
            Event::ToolFinished {
                call_id, name, ms, ..
            } => {
                self.state.metrics.tool_call(name, "ok", *ms);
                out["artifacts"] = self
                    .recorder
                    .take_refs(call_id)
                    .unwrap_or_else(|| json!([]));
            }
            Event::ToolFailed { name, ms, kind, .. } => {
                self.state.metrics.tool_call(name, kind, *ms);
            }
            Event::Error { .. } => {
                self.state.metrics.error("run");
                let entry =
                    self.audit("llm_call", &self.model.clone(), json!({}), "error", ev.t_ms);
                self.store_audit(entry).await?;
            }
            _ => {}
        }
        Ok(out)
    }

    async fn store_audit(&self, entry: AuditEntry) -> Result<(), ()> {
        self.state.db.append_audit(entry).await.map_err(|e| {
            tracing::error!(error = %e, "cannot append to the audit log");
            self.state.metrics.error("audit");
        })
    }

    /// Ends a run that stopped before its outcome (`cancelled`, `interrupted`, or `failed`
    /// when its audit log could not be written): the event, the audit row, then the status
    /// (last, so that a run that reads stopped has all its records).
    async fn stop(&mut self, status: &'static str, reason: &str, ms: f64) {
        self.seq += 1;
        let ev = if status == "failed" {
            json!({"type": "error", "t_ms": ms, "message": reason})
        } else {
            json!({"type": status, "t_ms": ms, "reason": reason})
        };
        let _ = self
            .state
            .db
            .insert_event(self.run_id.clone(), self.seq, status.into(), ev.clone())
            .await;
        let _ = self.client.send(ev);
        let kind = match status {
            "cancelled" => "run_cancelled",
            "failed" => "run_failed",
            _ => "run_interrupted",
        };
        let entry = self.audit(kind, &self.model.clone(), json!({}), status, ms);
        // Logged when it fails; the run is ending either way.
        let _ = self.store_audit(entry).await;
        let stored = if status != "interrupted" {
            self.state
                .db
                .finish_run(
                    self.session_id.clone(),
                    self.run_id.clone(),
                    status,
                    None,
                    Some(reason.to_string()),
                    Vec::new(),
                )
                .await
        } else {
            self.state
                .db
                .interrupt_run(self.run_id.clone(), reason.to_string())
                .await
                .map(|_| ())
        };
        if let Err(e) = stored {
            tracing::error!(error = %e, "cannot store the run's status");
            self.state.metrics.error("db");
        }
        self.state.metrics.run_ended(status);
        tracing::info!(status, reason, "run stopped");
    }
}

/// Runs the agent, stores and forwards its events, and ends the run: completed, failed,
/// cancelled (the client went away) or interrupted (the server shut down). The `complete`
/// event is forwarded only after the run's messages are stored.
#[allow(clippy::too_many_arguments)]
async fn drive(
    mut run: RunCtx,
    agent: Agent,
    input: RunInput,
    resume: Option<Resume>,
    history_len: usize,
    mut cancels: Cancels,
    _active: ActiveRun,
) {
    let started = Instant::now();
    run.state.metrics.run_started();
    let mut stop = run.state.runs.stop.subscribe();
    run.publish(json!({
        "type": "run_started",
        "t_ms": 0.0,
        "run_id": run.run_id,
        "session_id": run.session_id,
        "model": run.model,
        "resumed": run.resumed,
    }))
    .await;
    tracing::info!(model = %run.model, "run started");
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<RunEvent>();
    let recorder: Arc<dyn Checkpointer> = run.recorder.clone();
    // Boxed so that a stopped run's future can be dropped (and the loop stopped) at once.
    let mut agent_run = Box::pin(agent.run_durable(input, resume, recorder, Some(ev_tx)));
    let mut heartbeat =
        tokio::time::interval(run.state.cfg.heartbeat.max(Duration::from_millis(50)));
    heartbeat.tick().await;
    let mut outcome: Option<RunOutcome> = None;
    let mut complete: Option<Value> = None;
    let mut stopped: Option<(&'static str, &'static str)> = None;
    loop {
        tokio::select! {
            biased;
            ev = ev_rx.recv() => match ev {
                Some(ev) => {
                    let is_complete = matches!(ev.event, Event::Complete { .. });
                    let handled = alongside(run.handle(ev), &mut agent_run, &mut outcome).await;
                    let Ok(value) = handled else {
                        // Fail closed: what cannot be audited does not go on.
                        stopped = Some(("failed", "the audit log cannot be written: the run was stopped"));
                        break;
                    };
                    if is_complete {
                        complete = Some(value);
                    } else {
                        alongside(run.publish(value), &mut agent_run, &mut outcome).await;
                    }
                }
                // The agent finished and dropped its sender: every event has been handled.
                None => break,
            },
            out = agent_run.as_mut(), if outcome.is_none() => outcome = Some(out),
            _ = &mut cancels.client, if !cancels.detached => {
                stopped = Some(("cancelled", "client disconnected"));
                break;
            }
            _ = async { let _ = cancels.user.wait_for(|c| *c).await; } => {
                stopped = Some(("cancelled", "cancelled by the user"));
                break;
            }
            // The watch's guard is not Send: it is dropped inside.
            _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                stopped = Some(("interrupted", "the server shut down before the run finished; POST .../resume continues it"));
                break;
            }
            _ = heartbeat.tick() => {
                let _ = run.client.send(json!({"type": "heartbeat", "t_ms": started.elapsed().as_secs_f64() * 1e3}));
            }
        }
    }
    if let Some((status, reason)) = stopped {
        // Dropping the agent's future stops the loop; running tool tasks finish on their own
        // and their results are not stored: a resume runs them again.
        drop(agent_run);
        run.stop(status, reason, started.elapsed().as_secs_f64() * 1e3)
            .await;
        return;
    }
    let Some(outcome) = outcome else {
        // The event channel closed before the future was polled to completion: cannot
        // happen (the sender lives in the future), but never leave a run open.
        let _ = run
            .state
            .db
            .finish_run(
                run.session_id.clone(),
                run.run_id.clone(),
                "failed",
                None,
                Some("run ended without an outcome".into()),
                Vec::new(),
            )
            .await;
        run.state.metrics.run_ended("failed");
        return;
    };
    let status = if outcome.reason == StopReason::Error {
        "failed"
    } else {
        "completed"
    };
    // The messages the recorder stored are in the database already; the rest (prompts the
    // loop added after the last stored step) and the answer are appended here.
    let saved = run.recorder.saved.load(Ordering::SeqCst);
    let mut messages: Vec<Message> = outcome
        .messages
        .iter()
        .skip(1 + history_len + saved)
        .cloned()
        .collect();
    if let Some(answer) = &outcome.answer {
        messages.push(Message::assistant(answer.clone(), vec![]));
    }
    let new_messages: Vec<Value> = messages
        .iter()
        .filter_map(|m| serde_json::to_value(m).ok())
        .collect();
    if let Err(e) = run
        .state
        .db
        .finish_run(
            run.session_id.clone(),
            run.run_id.clone(),
            status,
            outcome.answer.clone(),
            outcome.error.clone(),
            new_messages,
        )
        .await
    {
        tracing::error!(error = %e, "cannot store the run's messages");
        run.state.metrics.error("db");
        run.publish(
            json!({"type": "error", "message": format!("the answer could not be stored: {e}")}),
        )
        .await;
    }
    if let Some(c) = complete {
        run.publish(c).await;
    }
    run.state.metrics.run_ended(status);
    tracing::info!(
        status,
        rounds = outcome.rounds,
        tool_calls = outcome.tool_calls,
        duration_ms = started.elapsed().as_secs_f64() * 1e3,
        "run finished"
    );
}

/// Awaits `work` (an event's database writes) while the agent's future goes on being polled.
/// The agent may itself be inside a database job (the recorder storing a tool result) holding
/// a pooled connection; left unpolled while `work` waits for a connection, it would never
/// finish that job, and with as many runs as the pool has connections every run would wait
/// for every other (seen with 30 sessions on a 16-connection PostgreSQL pool).
async fn alongside<W: std::future::Future, A: std::future::Future + ?Sized>(
    work: W,
    agent: &mut std::pin::Pin<Box<A>>,
    outcome: &mut Option<A::Output>,
) -> W::Output {
    tokio::pin!(work);
    loop {
        tokio::select! {
            biased;
            r = &mut work => return r,
            out = agent.as_mut(), if outcome.is_none() => *outcome = Some(out),
        }
    }
}
