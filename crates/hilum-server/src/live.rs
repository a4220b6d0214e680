//! Runs that no page owns: a client follows a run it did not start (a reloaded page, another
//! tab) from its first stored event to its end, and cancels it explicitly. The stored events
//! are the source, so a run driven by another replica is followed the same way.

use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::api::owned_session;
use crate::db::Caller;
use crate::error::ApiError;
use crate::run::{values_response, wants_sse, StreamQuery};
use crate::AppState;

/// How often a follower looks for new events.
const POLL: Duration = Duration::from_millis(200);
/// Polls a follower waits, after the run stopped, for the events written after its status.
const GRACE_POLLS: u32 = 5;

/// Events after which a run has nothing more to say.
fn is_last(ev: &Value) -> bool {
    matches!(
        ev["type"].as_str(),
        Some("complete" | "cancelled" | "interrupted")
    )
}

async fn run_status(state: &AppState, session: &str, run_id: &str) -> Result<String, ApiError> {
    state
        .db
        .runs(session.to_string())
        .await?
        .into_iter()
        .find(|r| r.id == run_id)
        .map(|r| r.status)
        .ok_or_else(|| ApiError::not_found("run", run_id))
}

#[utoipa::path(get, path = "/v1/sessions/{id}/runs/{run_id}/stream", tag = "sessions",
    params(("id" = String, Path, description = "Session id"),
           ("run_id" = String, Path, description = "Run id"), StreamQuery),
    responses(
        (status = 200, description = "The run's events from its first, then live until it ends, as from `POST …/messages` (NDJSON or SSE). Closing this stream does not cancel the run",
            content_type = "application/x-ndjson"),
        (status = 404, description = "No such session or run for this token"),
    ),
    security(("bearer" = [])))]
pub async fn follow(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((session_id, run_id)): Path<(String, String)>,
    Query(q): Query<StreamQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    owned_session(&state, &caller, &session_id).await?;
    run_status(&state, &session_id, &run_id).await?;
    let (tx, rx) = mpsc::unbounded_channel::<Value>();
    tokio::spawn(pump(state, session_id, run_id, tx));
    let sse = wants_sse(q.format.as_deref(), &headers);
    Ok(values_response(UnboundedReceiverStream::new(rx), (), sse))
}

/// Sends the run's stored events in order, then new ones as they are stored, until the run's
/// last event (or, for a run that ended without one, a few polls after it stopped).
async fn pump(state: AppState, session: String, run_id: String, tx: mpsc::UnboundedSender<Value>) {
    let mut sent = 0usize;
    let mut stopped_polls = 0u32;
    loop {
        // The status first: events stored before a stop are then read below.
        let status = run_status(&state, &session, &run_id).await;
        let events = state.db.events(session.clone(), run_id.clone()).await;
        let (Ok(status), Ok(events)) = (status, events) else {
            let _ = tx.send(json!({"type": "error", "message": "the run's events cannot be read"}));
            return;
        };
        for ev in events.iter().skip(sent) {
            if tx.send(ev.clone()).is_err() {
                return; // the follower went away; the run goes on
            }
            if is_last(ev) {
                return;
            }
        }
        let fresh = events.len() > sent;
        sent = events.len();
        if status != "running" {
            stopped_polls = if fresh { 0 } else { stopped_polls + 1 };
            if stopped_polls >= GRACE_POLLS {
                return;
            }
        } else if !fresh && tx.send(json!({"type": "heartbeat"})).is_err() {
            return;
        }
        tokio::time::sleep(POLL).await;
    }
}

#[utoipa::path(post, path = "/v1/sessions/{id}/runs/{run_id}/cancel", tag = "sessions",
    params(("id" = String, Path, description = "Session id"),
           ("run_id" = String, Path, description = "Id of a running run")),
    responses(
        (status = 202, description = "The run is stopping; it ends `cancelled` (its events say so)"),
        (status = 404, description = "No such session or run for this token"),
        (status = 409, description = "The run is not running, or another replica drives it"),
    ),
    security(("bearer" = [])))]
pub async fn cancel(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((session_id, run_id)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    owned_session(&state, &caller, &session_id).await?;
    let status = run_status(&state, &session_id, &run_id).await?;
    if status != "running" {
        return Err(ApiError::Conflict(format!(
            "run `{run_id}` is {status}: only a running run can be cancelled"
        )));
    }
    if !state.runs.cancel(&run_id) {
        return Err(ApiError::Conflict(format!(
            "run `{run_id}` is driven by another replica: cancel it there"
        )));
    }
    tracing::info!(run_id = %run_id, "run cancelled by the user");
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({"run_id": run_id, "status": "cancelling"})),
    )
        .into_response())
}
