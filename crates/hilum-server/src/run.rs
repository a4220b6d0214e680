//! A question in a session: the agent runs on its own task, each event is stored and then
//! streamed to the client (NDJSON or SSE). A client that goes away cancels the run.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::{Duration, Instant};

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
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use utoipa::{IntoParams, ToSchema};

use base64::Engine;
use hilum_agent::llm::ImagePayload;
use hilum_agent::{Agent, Event, Message, RunEvent, RunInput, RunOutcome, StopReason};

use crate::api::{owned_session, prepare_artifacts};
use crate::db::{new_id, AuditEntry, Caller, ToolCallRecord};
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
}

#[utoipa::path(post, path = "/v1/sessions/{id}/messages", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), StreamQuery),
    request_body = Ask,
    responses(
        (status = 200, description = "The run's events, one JSON object per line (`type`: run_started, decision, tool_started, tool_finished, tool_failed, token, final, error, complete, heartbeat, cancelled); or the same as SSE",
            content_type = "application/x-ndjson"),
        (status = 403, description = "The policy forbids the configured model endpoint"),
        (status = 404, description = "No such session or image for this token"),
        (status = 503, description = "No reasoning model is configured"),
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
    let space = state.space(&caller).await?;
    state.ensure_images(&caller, &space, &ask.images).await?;
    for id in &ask.images {
        if space.images.get(id).is_err() {
            return Err(ApiError::not_found("image", id));
        }
    }
    if ask.question.trim().is_empty() {
        return Err(ApiError::BadRequest("`question` is empty".into()));
    }
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
    let llm = (factory.build)().map_err(ApiError::LlmUnavailable)?;
    let history: Vec<Message> = state
        .db
        .messages(session_id.clone())
        .await?
        .into_iter()
        .filter_map(|m| serde_json::from_value(m.message).ok())
        .collect();
    let run_id = new_id("run");
    state
        .db
        .insert_run(
            session_id.clone(),
            run_id.clone(),
            ask.question.clone(),
            ask.images.clone(),
            llm.name(),
        )
        .await?;

    let sse = q.format.as_deref() == Some("sse")
        || headers
            .get(header::ACCEPT)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|a| a.contains("text/event-stream"));
    let (client_tx, client_rx) = mpsc::unbounded_channel::<Value>();
    // Dropping the response body (client gone) drops `cancel_tx`, which cancels the run.
    let (cancel_tx, cancel_rx) = oneshot::channel::<()>();
    let model = llm.name();
    let agent_reads_images = llm.capabilities().images;
    let agent = Agent::new(
        llm,
        space.toolbox.clone(),
        state.cfg.env.clone(),
        state.cfg.agent.clone(),
    );
    let history_len = history.len();
    // Pixels leave only on request, to a model that reads them, and (checked above) only to a
    // remote endpoint when the policy allows it.
    let image_payloads = if state.cfg.send_pixels && agent_reads_images {
        let store = space.images.clone();
        let ids = ask.images.clone();
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
    // Size, spacing and view: numbers an answer may quote besides the tool results.
    let image_metadata = ask
        .images
        .iter()
        .filter_map(|id| space.images.get(id).ok())
        .map(|img| json!({"width": img.width, "height": img.height, "meta": img.meta}))
        .collect();
    let input = RunInput {
        question: ask.question,
        images: ask.images,
        image_payloads,
        history,
        session_id: session_id.clone(),
        image_metadata,
    };
    let run = RunCtx {
        state: state.clone(),
        caller,
        space,
        session_id,
        run_id,
        model,
        seq: 0,
        args: HashMap::new(),
        client: client_tx,
    };
    tokio::spawn(drive(run, agent, input, history_len, cancel_rx));

    let stream = UnboundedReceiverStream::new(client_rx);
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
        Ok(Sse::new(events).into_response())
    } else {
        let lines = stream.map(move |v| {
            let _alive = &cancel_tx;
            let mut line = v.to_string();
            line.push('\n');
            Ok::<_, Infallible>(Bytes::from(line))
        });
        Ok((
            [
                (header::CONTENT_TYPE, "application/x-ndjson"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::from_stream(lines),
        )
            .into_response())
    }
}

/// An 8-bit grayscale PNG of the image as a data URL, longest side at most 1024 px.
fn pixel_payload(store: &hilum_imaging::ImageStore, id: &str) -> Result<ImagePayload, String> {
    let img = store.get(id).map_err(|e| e.to_string())?;
    let scale = 255.0 / img.max_value().max(1.0);
    let step = (img.width.max(img.height) as f64 / 1024.0).max(1.0);
    let w = ((img.width as f64 / step) as u32).max(1);
    let h = ((img.height as f64 / step) as u32).max(1);
    let mut gray = image::GrayImage::new(w, h);
    for y in 0..h {
        for x in 0..w {
            let sx = ((x as f64 * step) as usize).min(img.width as usize - 1);
            let sy = ((y as f64 * step) as usize).min(img.height as usize - 1);
            let v = img.pixels[sy * img.width as usize + sx] * scale;
            gray.put_pixel(x, y, image::Luma([v.round().clamp(0.0, 255.0) as u8]));
        }
    }
    let mut png = Vec::new();
    gray.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
        .map_err(|e| format!("cannot encode {id} as PNG: {e}"))?;
    Ok(ImagePayload {
        id: id.to_string(),
        data_url: format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(&png)
        ),
    })
}

struct RunCtx {
    state: AppState,
    caller: Caller,
    space: std::sync::Arc<Space>,
    session_id: String,
    run_id: String,
    model: String,
    seq: i64,
    /// Arguments of calls by call id, from `decision` and `tool_started`, for the records.
    args: HashMap<String, Value>,
    client: mpsc::UnboundedSender<Value>,
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
            tracing::error!(run = %self.run_id, error = %e, "cannot store event");
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

    fn deid(&self, tool: &str, args: &Value) -> Value {
        let allowed = self
            .space
            .toolbox
            .get(tool)
            .map(|t| enumerated_strings(&t.spec().parameters))
            .unwrap_or_default();
        deidentify(args, &allowed)
    }

    /// Records what an event says happened, and returns the JSON to stream.
    async fn handle(&mut self, ev: RunEvent) -> Value {
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
                for c in tool_calls {
                    let args = serde_json::from_str(&c.arguments)
                        .unwrap_or_else(|_| Value::String(c.arguments.clone()));
                    self.args.insert(c.id.clone(), args);
                }
                let entry = self.audit(
                    "llm_call",
                    &self.model.clone(),
                    json!({"round": round, "phase": phase, "tool_calls": tool_calls.len(),
                           "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}),
                    "ok",
                    *llm_ms,
                );
                self.store_audit(entry).await;
            }
            Event::ToolStarted {
                call_id, arguments, ..
            } => {
                self.args.insert(call_id.clone(), arguments.clone());
            }
            Event::ToolFinished {
                call_id,
                name,
                ms,
                summary,
                data,
                artifacts,
                ..
            } => {
                self.state.metrics.tool_call(name, "ok", *ms);
                let (rows, refs) = prepare_artifacts(
                    &self.caller,
                    Some(&self.session_id),
                    Some(&self.run_id),
                    call_id,
                    name,
                    artifacts,
                );
                out["artifacts"] = serde_json::to_value(&refs).unwrap_or(Value::Null);
                let args = self.args.get(call_id).cloned().unwrap_or(Value::Null);
                let record = ToolCallRecord {
                    token_id: self.caller.token_id.clone(),
                    session_id: Some(self.session_id.clone()),
                    run_id: Some(self.run_id.clone()),
                    call_id: call_id.clone(),
                    tool: name.clone(),
                    arguments: args.clone(),
                    ok: true,
                    error_kind: None,
                    ms: *ms,
                    result: json!({"summary": summary, "data": data}),
                };
                let audit = self.audit("tool_call", name, self.deid(name, &args), "ok", *ms);
                self.store_call(record, rows, audit).await;
            }
            Event::ToolFailed {
                call_id,
                name,
                ms,
                kind,
                error,
                ..
            } => {
                self.state.metrics.tool_call(name, kind, *ms);
                let args = self.args.get(call_id).cloned().unwrap_or(Value::Null);
                let record = ToolCallRecord {
                    token_id: self.caller.token_id.clone(),
                    session_id: Some(self.session_id.clone()),
                    run_id: Some(self.run_id.clone()),
                    call_id: call_id.clone(),
                    tool: name.clone(),
                    arguments: args.clone(),
                    ok: false,
                    error_kind: Some(kind.clone()),
                    ms: *ms,
                    result: json!({"error": {"kind": kind, "message": error}}),
                };
                let audit = self.audit("tool_call", name, self.deid(name, &args), kind, *ms);
                self.store_call(record, Vec::new(), audit).await;
            }
            Event::Error { .. } => {
                self.state.metrics.error("run");
                let entry =
                    self.audit("llm_call", &self.model.clone(), json!({}), "error", ev.t_ms);
                self.store_audit(entry).await;
            }
            _ => {}
        }
        out
    }

    async fn store_call(
        &self,
        record: ToolCallRecord,
        rows: Vec<crate::db::NewArtifact>,
        audit: AuditEntry,
    ) {
        if let Err(e) = self.state.db.record_tool_call(record, rows, audit).await {
            tracing::error!(run = %self.run_id, error = %e, "cannot record tool call");
            self.state.metrics.error("db");
        }
    }

    async fn store_audit(&self, entry: AuditEntry) {
        if let Err(e) = self.state.db.append_audit(entry).await {
            tracing::error!(run = %self.run_id, error = %e, "cannot append to the audit log");
            self.state.metrics.error("db");
        }
    }
}

/// Runs the agent, stores and forwards its events, and ends the run: completed, failed or
/// cancelled. The `complete` event is forwarded only after the run's messages are stored.
async fn drive(
    mut run: RunCtx,
    agent: Agent,
    input: RunInput,
    history_len: usize,
    mut cancel: oneshot::Receiver<()>,
) {
    let started = Instant::now();
    run.state.metrics.run_started();
    run.publish(json!({
        "type": "run_started",
        "t_ms": 0.0,
        "run_id": run.run_id,
        "session_id": run.session_id,
        "model": run.model,
    }))
    .await;
    let (ev_tx, mut ev_rx) = mpsc::unbounded_channel::<RunEvent>();
    // Boxed so that a cancelled run's future can be dropped (and the loop stopped) at once.
    let mut agent_run = Box::pin(agent.run(input, Some(ev_tx)));
    let mut heartbeat =
        tokio::time::interval(run.state.cfg.heartbeat.max(Duration::from_millis(50)));
    heartbeat.tick().await;
    let mut outcome: Option<RunOutcome> = None;
    let mut complete: Option<Value> = None;
    let mut cancelled = false;
    loop {
        tokio::select! {
            biased;
            ev = ev_rx.recv() => match ev {
                Some(ev) => {
                    let is_complete = matches!(ev.event, Event::Complete { .. });
                    let value = run.handle(ev).await;
                    if is_complete {
                        complete = Some(value);
                    } else {
                        run.publish(value).await;
                    }
                }
                // The agent finished and dropped its sender: every event has been handled.
                None => break,
            },
            out = agent_run.as_mut(), if outcome.is_none() => outcome = Some(out),
            _ = &mut cancel => { cancelled = true; break; }
            _ = heartbeat.tick() => {
                let _ = run.client.send(json!({"type": "heartbeat", "t_ms": started.elapsed().as_secs_f64() * 1e3}));
            }
        }
    }
    if cancelled {
        // Dropping the agent's future stops the loop; running tool tasks finish on their own.
        drop(agent_run);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        run.seq += 1;
        let ev = json!({"type": "cancelled", "t_ms": ms, "reason": "client disconnected"});
        let _ = run
            .state
            .db
            .insert_event(run.run_id.clone(), run.seq, "cancelled".into(), ev)
            .await;
        let entry = run.audit(
            "run_cancelled",
            &run.model.clone(),
            json!({}),
            "cancelled",
            ms,
        );
        run.store_audit(entry).await;
        // The status goes last: a run that reads `cancelled` has all its records.
        let _ = run
            .state
            .db
            .finish_run(
                run.session_id.clone(),
                run.run_id.clone(),
                "cancelled",
                None,
                Some("client disconnected".into()),
                Vec::new(),
            )
            .await;
        run.state.metrics.run_ended("cancelled");
        tracing::info!(run = %run.run_id, "run cancelled: client disconnected");
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
    // The agent's messages end with the last observation; the answer is appended here so a
    // resumed session sees it.
    let mut messages: Vec<Message> = outcome
        .messages
        .iter()
        .skip(1 + history_len)
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
        tracing::error!(run = %run.run_id, error = %e, "cannot store the run's messages");
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
}
