//! Handlers of the REST API (the streamed question is in `run`). Small functions with typed
//! extractors; authentication and limits are middleware.

use std::time::Instant;

use axum::body::Body;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::{IntoParams, ToSchema};

use hilum_agent::{Artifact, ToolCall, ToolContext, ToolSpec};

use crate::db::{
    new_id, now_ms, ArtifactRow, AuditEntry, Caller, ImageRow, MessageRow, NewArtifact, RunRow,
    SessionRow, ToolCallRecord,
};
use crate::deid::{deidentify, enumerated_strings};
use crate::error::ApiError;
use crate::{AppState, Space};

// ---- health, metrics ----

#[derive(Serialize, ToSchema)]
pub struct Health {
    pub status: String,
    pub version: String,
}

#[utoipa::path(get, path = "/healthz", tag = "service",
    responses((status = 200, description = "The service is up", body = Health)))]
pub async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
    })
}

#[utoipa::path(get, path = "/metrics", tag = "service",
    responses((status = 200, description = "Prometheus text exposition format", content_type = "text/plain")))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        {
            let mut text = state.metrics.render();
            if let Some(pool) = &state.cfg.models {
                text.push_str(&crate::metrics::model_loads(&pool.load_counts()));
            }
            text.push_str(&crate::metrics::image_memory(state.image_memory().await));
            text
        },
    )
        .into_response()
}

// ---- images ----

#[derive(Serialize, ToSchema)]
pub struct ImageList {
    pub images: Vec<ImageRow>,
}

/// A multipart upload: one or more parts named `file`.
#[allow(dead_code)]
#[derive(ToSchema)]
pub struct UploadForm {
    #[schema(format = Binary, value_type = String)]
    pub file: Vec<u8>,
}

#[utoipa::path(post, path = "/v1/images", tag = "images",
    request_body(content = UploadForm, content_type = "multipart/form-data"),
    responses(
        (status = 201, description = "Stored; ids are content hashes", body = ImageList),
        (status = 401, description = "Missing or invalid token"),
        (status = 413, description = "Upload larger than the server's limit"),
        (status = 422, description = "Not a readable image"),
    ),
    security(("bearer" = [])))]
pub async fn upload_image(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    mut form: Multipart,
) -> Result<(StatusCode, Json<ImageList>), ApiError> {
    let space = state.space(&caller).await?;
    let mut images = Vec::new();
    loop {
        let field = match form.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return Err(multipart_error(&state, e)),
        };
        if field.name() != Some("file") {
            continue;
        }
        let media_type = field
            .content_type()
            .unwrap_or("application/octet-stream")
            .to_string();
        let bytes = field
            .bytes()
            .await
            .map_err(|e| multipart_error(&state, e))?;
        images.push(ingest(&state, &caller, &space, bytes, media_type).await?);
    }
    if images.is_empty() {
        return Err(ApiError::BadRequest(
            "no multipart field named `file`: send the image as `file` (curl -F file=@chest.png)"
                .into(),
        ));
    }
    Ok((StatusCode::CREATED, Json(ImageList { images })))
}

/// Decodes and stores an uploaded file for the caller (image store, database, audit log).
pub(crate) async fn ingest(
    state: &AppState,
    caller: &Caller,
    space: &Space,
    bytes: bytes::Bytes,
    media_type: String,
) -> Result<ImageRow, ApiError> {
    let started = Instant::now();
    let store = space.images.clone();
    let data = bytes.clone();
    let span = tracing::Span::current();
    let (id, img) = tokio::task::spawn_blocking(move || {
        let _request = span.enter();
        let id = store.ingest_bytes(data, "upload")?;
        let img = store.get(&id)?;
        Ok::<_, hilum_imaging::ImagingError>((id, img))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
    .map_err(|e| ApiError::Unprocessable(e.to_string()))?;
    let row = ImageRow {
        id: id.clone(),
        media_type,
        size: bytes.len() as i64,
        width: img.width as i64,
        height: img.height as i64,
        bit_depth: img.meta.bit_depth as i64,
        format: img.meta.format.clone(),
        created_ms: now_ms(),
    };
    let audit = AuditEntry {
        actor: caller.token_id.clone(),
        session_id: None,
        run_id: None,
        kind: "upload",
        name: "image".into(),
        arguments: json!({"image": id, "size": row.size, "format": row.format}),
        outcome: "ok".into(),
        duration_ms: started.elapsed().as_secs_f64() * 1e3,
    };
    state
        .db
        .insert_image(caller.token_id.clone(), row.clone(), bytes.to_vec(), audit)
        .await?;
    Ok(row)
}

fn multipart_error(state: &AppState, e: axum::extract::multipart::MultipartError) -> ApiError {
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        state.metrics.error("upload_too_large");
        ApiError::PayloadTooLarge(format!(
            "the upload is larger than this server's limit of {} bytes (hilum serve --max-upload-mb)",
            state.cfg.max_upload_bytes
        ))
    } else {
        ApiError::BadRequest(format!("malformed multipart upload: {}", e.body_text()))
    }
}

#[utoipa::path(get, path = "/v1/images", tag = "images",
    responses((status = 200, description = "The caller's images", body = ImageList)),
    security(("bearer" = [])))]
pub async fn list_images(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<ImageList>, ApiError> {
    Ok(Json(ImageList {
        images: state.db.list_images(caller.token_id).await?,
    }))
}

/// Header naming the significant bits of the pixels route's 16-bit samples.
pub const BIT_DEPTH_HEADER: &str = "x-hilum-bit-depth";

#[utoipa::path(get, path = "/v1/images/{id}/pixels", tag = "images",
    params(("id" = String, Path, description = "Image id")),
    responses(
        (status = 200, description = "The canonical pixels at full depth: a 16-bit grayscale PNG \
            whose samples are the decoder's values, 0..2^bits-1 (bright = dense; a DICOM file's own \
            window already applied). The header x-hilum-bit-depth names bits (8, 10, 12, 15, 16). \
            Pixels only: no metadata.", content_type = "image/png"),
        (status = 404, description = "No such image for this token"),
    ),
    security(("bearer" = [])))]
pub async fn image_pixels(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let img = state.owned_image(&caller, &id).await?;
    let bits = img.meta.bit_depth;
    let png = tokio::task::spawn_blocking(move || encode_gray16(&img))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    Ok((
        [
            (header::CONTENT_TYPE, "image/png".to_string()),
            // Patient pixels: keep them out of shared caches and the disk cache.
            (header::CACHE_CONTROL, "private, no-store".to_string()),
            (
                header::HeaderName::from_static(BIT_DEPTH_HEADER),
                bits.to_string(),
            ),
        ],
        Body::from(png),
    )
        .into_response())
}

/// The canonical values as a 16-bit grayscale PNG, unscaled (an 8-bit image stays 0..255).
fn encode_gray16(img: &hilum_imaging::CxrImage) -> Result<Vec<u8>, ApiError> {
    let max = img.max_value().min(65535.0);
    let samples: Vec<u16> = img
        .pixels
        .iter()
        .map(|&v| {
            if v.is_finite() {
                v.round().clamp(0.0, max) as u16
            } else {
                0
            }
        })
        .collect();
    let buf =
        image::ImageBuffer::<image::Luma<u16>, Vec<u16>>::from_raw(img.width, img.height, samples)
            .ok_or_else(|| {
                ApiError::Internal("image size does not match its pixel count".into())
            })?;
    let mut out = std::io::Cursor::new(Vec::new());
    buf.write_to(&mut out, image::ImageFormat::Png)
        .map_err(|e| ApiError::Internal(format!("cannot encode the pixels as PNG: {e}")))?;
    Ok(out.into_inner())
}

// ---- sessions ----

#[derive(Deserialize, Default, ToSchema)]
pub struct CreateSession {
    #[serde(default)]
    pub title: String,
}

#[utoipa::path(post, path = "/v1/sessions", tag = "sessions",
    request_body = CreateSession,
    responses((status = 201, description = "Created", body = SessionRow)),
    security(("bearer" = [])))]
pub async fn create_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    body: Option<Json<CreateSession>>,
) -> Result<(StatusCode, Json<SessionRow>), ApiError> {
    let title = body.map(|b| b.0.title).unwrap_or_default();
    let row = state.db.create_session(caller.token_id, title).await?;
    Ok((StatusCode::CREATED, Json(row)))
}

#[derive(Serialize, ToSchema)]
pub struct SessionList {
    pub sessions: Vec<SessionRow>,
}

#[utoipa::path(get, path = "/v1/sessions", tag = "sessions",
    responses((status = 200, description = "The caller's sessions", body = SessionList)),
    security(("bearer" = [])))]
pub async fn list_sessions(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<SessionList>, ApiError> {
    Ok(Json(SessionList {
        sessions: state.db.list_sessions(caller.token_id).await?,
    }))
}

/// The session if the caller owns it; 404 otherwise (another token's ids do not exist for it).
pub(crate) async fn owned_session(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<SessionRow, ApiError> {
    state
        .db
        .session(caller.token_id.clone(), id.to_string())
        .await?
        .ok_or_else(|| ApiError::not_found("session", id))
}

#[utoipa::path(get, path = "/v1/sessions/{id}", tag = "sessions",
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = SessionRow), (status = 404, description = "No such session for this token")),
    security(("bearer" = [])))]
pub async fn get_session(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<SessionRow>, ApiError> {
    Ok(Json(owned_session(&state, &caller, &id).await?))
}

#[derive(Serialize, ToSchema)]
pub struct MessageList {
    pub messages: Vec<MessageRow>,
}

#[utoipa::path(get, path = "/v1/sessions/{id}/messages", tag = "sessions",
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = MessageList), (status = 404, description = "No such session for this token")),
    security(("bearer" = [])))]
pub async fn list_messages(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<MessageList>, ApiError> {
    owned_session(&state, &caller, &id).await?;
    Ok(Json(MessageList {
        messages: state.db.messages(id).await?,
    }))
}

#[derive(Serialize, ToSchema)]
pub struct RunList {
    pub runs: Vec<RunRow>,
}

#[utoipa::path(get, path = "/v1/sessions/{id}/runs", tag = "sessions",
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = RunList), (status = 404, description = "No such session for this token")),
    security(("bearer" = [])))]
pub async fn list_runs(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<RunList>, ApiError> {
    owned_session(&state, &caller, &id).await?;
    Ok(Json(RunList {
        runs: state.db.runs(id).await?,
    }))
}

#[derive(Serialize, ToSchema)]
pub struct EventList {
    #[schema(value_type = Vec<Object>)]
    pub events: Vec<Value>,
}

#[utoipa::path(get, path = "/v1/sessions/{id}/runs/{run_id}/events", tag = "sessions",
    params(("id" = String, Path, description = "Session id"), ("run_id" = String, Path, description = "Run id")),
    responses((status = 200, description = "The run's events as they were streamed", body = EventList),
        (status = 404, description = "No such session or run for this token")),
    security(("bearer" = [])))]
pub async fn run_events(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path((id, run_id)): Path<(String, String)>,
) -> Result<Json<EventList>, ApiError> {
    owned_session(&state, &caller, &id).await?;
    Ok(Json(EventList {
        events: state.db.events(id, run_id).await?,
    }))
}

// ---- artifacts ----

#[derive(Serialize, ToSchema)]
pub struct ArtifactList {
    pub artifacts: Vec<ArtifactRow>,
}

#[utoipa::path(get, path = "/v1/sessions/{id}/artifacts", tag = "artifacts",
    params(("id" = String, Path, description = "Session id")),
    responses((status = 200, body = ArtifactList), (status = 404, description = "No such session for this token")),
    security(("bearer" = [])))]
pub async fn session_artifacts(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Json<ArtifactList>, ApiError> {
    owned_session(&state, &caller, &id).await?;
    Ok(Json(ArtifactList {
        artifacts: state.db.list_artifacts(caller.token_id, Some(id)).await?,
    }))
}

#[utoipa::path(get, path = "/v1/artifacts/{id}", tag = "artifacts",
    params(("id" = String, Path, description = "Artifact id")),
    responses((status = 200, description = "The artifact's bytes with its media type (PNG overlay, mask, JSON)"),
        (status = 404, description = "No such artifact for this token")),
    security(("bearer" = [])))]
pub async fn get_artifact(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let (row, bytes) = state
        .db
        .artifact(caller.token_id, id.clone())
        .await?
        .ok_or_else(|| ApiError::not_found("artifact", &id))?;
    Ok((
        [
            (header::CONTENT_TYPE, row.media_type),
            (
                header::CONTENT_DISPOSITION,
                format!("inline; filename=\"{}\"", row.name.replace('"', "")),
            ),
        ],
        Body::from(bytes),
    )
        .into_response())
}

/// An artifact as announced in a tool result or event.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct ArtifactRef {
    pub id: String,
    pub name: String,
    pub media_type: String,
    pub kind: String,
    /// Where to fetch it (with the same token).
    pub url: String,
}

/// Gives a tool's artifacts ids and turns them into rows to store and references to return.
pub(crate) fn prepare_artifacts(
    caller: &Caller,
    session_id: Option<&str>,
    run_id: Option<&str>,
    call_id: &str,
    tool: &str,
    artifacts: &[Artifact],
) -> (Vec<NewArtifact>, Vec<ArtifactRef>) {
    artifacts
        .iter()
        .map(|a| {
            let id = new_id("art");
            let row = NewArtifact {
                id: id.clone(),
                token_id: caller.token_id.clone(),
                session_id: session_id.map(str::to_string),
                run_id: run_id.map(str::to_string),
                call_id: call_id.to_string(),
                tool: tool.to_string(),
                name: a.name.clone(),
                media_type: a.media_type.clone(),
                kind: a.kind.clone(),
                bytes: a.bytes.to_vec(),
            };
            let reference = ArtifactRef {
                url: format!("/v1/artifacts/{id}"),
                id,
                name: a.name.clone(),
                media_type: a.media_type.clone(),
                kind: a.kind.clone(),
            };
            (row, reference)
        })
        .unzip()
}

// ---- tools ----

#[derive(Serialize, ToSchema)]
pub struct ToolList {
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<ToolSpec>,
}

#[utoipa::path(get, path = "/v1/tools", tag = "tools",
    responses((status = 200, description = "Name, description and JSON Schema of each tool", body = ToolList)),
    security(("bearer" = [])))]
pub async fn list_tools(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<ToolList>, ApiError> {
    let space = state.space(&caller).await?;
    Ok(Json(ToolList {
        tools: space.toolbox.specs(&state.cfg.env),
    }))
}

/// The result of a direct tool call.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct DirectResult {
    pub call_id: String,
    pub tool: String,
    pub ok: bool,
    pub ms: f64,
    pub summary: String,
    #[schema(value_type = Object)]
    pub data: Value,
    pub artifacts: Vec<ArtifactRef>,
    /// `{kind, message}` when the call failed.
    #[schema(value_type = Option<Object>)]
    pub error: Option<Value>,
    /// Artifact bytes, for MCP (not serialised).
    #[serde(skip)]
    #[schema(ignore)]
    pub artifact_bytes: Vec<Artifact>,
}

/// Runs one tool call for a caller, records it (tool_calls, artifacts, audit) and returns it.
pub(crate) async fn direct_call(
    state: &AppState,
    caller: &Caller,
    name: &str,
    args: Value,
) -> Result<DirectResult, ApiError> {
    let space = state.space(caller).await?;
    let mut ids = Vec::new();
    crate::image_ids_in(&args, &mut ids);
    state.ensure_images(caller, &space, &ids).await?;
    let Some(tool) = space.toolbox.get(name) else {
        return Err(ApiError::NotFound(format!(
            "there is no tool named `{name}`; GET /v1/tools lists them"
        )));
    };
    let call_id = new_id("call");
    let call = ToolCall::new(call_id.clone(), name, &args);
    let ctx = ToolContext {
        session_id: String::new(),
        call_id: call_id.clone(),
        round: 0,
    };
    let result = space
        .toolbox
        .execute(&call, &state.cfg.env, ctx, state.cfg.tool_timeout)
        .await;
    let allowed = enumerated_strings(&tool.spec().parameters);
    let (ok, outcome, summary, data, artifacts, error) = match &result.result {
        Ok(out) => (
            true,
            "ok".to_string(),
            out.summary.clone(),
            out.data.clone(),
            out.artifacts.clone(),
            None,
        ),
        Err(f) => (
            false,
            f.kind.as_str().to_string(),
            String::new(),
            Value::Null,
            Vec::new(),
            Some(json!({"kind": f.kind.as_str(), "message": f.message})),
        ),
    };
    let (rows, refs) = prepare_artifacts(caller, None, None, &call_id, name, &artifacts);
    // Fail closed: the call, its artifacts and its audit row are one transaction, and a call
    // whose audit row cannot be written did not happen for the caller: no result.
    state
        .db
        .record_tool_call(
            ToolCallRecord {
                token_id: caller.token_id.clone(),
                session_id: None,
                run_id: None,
                call_id: call_id.clone(),
                tool: name.to_string(),
                arguments: args.clone(),
                ok,
                error_kind: error.as_ref().map(|_| outcome.clone()),
                ms: result.ms,
                result: json!({"summary": summary, "data": data, "error": error}),
                round: None,
            },
            rows,
            AuditEntry {
                actor: caller.token_id.clone(),
                session_id: None,
                run_id: None,
                kind: "tool_call",
                name: name.to_string(),
                arguments: deidentify(&args, &allowed),
                outcome: outcome.clone(),
                duration_ms: result.ms,
            },
            None,
        )
        .await
        .map_err(|e| unrecorded(state, name, e))?;
    state.metrics.tool_call(name, &outcome, result.ms);
    Ok(DirectResult {
        call_id,
        tool: name.to_string(),
        ok,
        ms: result.ms,
        summary,
        data,
        artifacts: refs,
        error,
        artifact_bytes: artifacts,
    })
}

/// The error of a call that ran but could not be recorded with its audit row.
fn unrecorded(state: &AppState, tool: &str, e: crate::db::DbError) -> ApiError {
    state.metrics.error("audit");
    tracing::error!(tool, error = %e, "tool call not recorded: its result is withheld");
    ApiError::Internal(format!(
        "`{tool}` ran, but the call and its audit row could not be recorded, so its result is withheld: {e}"
    ))
}

#[utoipa::path(post, path = "/v1/tools/{name}:call", tag = "tools",
    params(("name" = String, Path, description = "Tool name, e.g. image_info")),
    request_body(content = Object, description = "The tool's arguments, matching its JSON Schema"),
    responses(
        (status = 200, description = "The tool ran", body = DirectResult),
        (status = 404, description = "No such tool"),
        (status = 422, description = "Invalid arguments or the tool failed", body = DirectResult),
        (status = 504, description = "The tool timed out", body = DirectResult),
    ),
    security(("bearer" = [])))]
pub async fn call_tool(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(call): Path<String>,
    Json(args): Json<Value>,
) -> Result<(StatusCode, Json<DirectResult>), ApiError> {
    let Some(name) = call.strip_suffix(":call") else {
        return Err(ApiError::NotFound(format!(
            "no route for /v1/tools/{call}: call a tool with POST /v1/tools/NAME:call"
        )));
    };
    let result = direct_call(&state, &caller, name, args).await?;
    let status = match result.error.as_ref().and_then(|e| e["kind"].as_str()) {
        None => StatusCode::OK,
        Some("timeout") => StatusCode::GATEWAY_TIMEOUT,
        Some("panic") => StatusCode::INTERNAL_SERVER_ERROR,
        Some(_) => StatusCode::UNPROCESSABLE_ENTITY,
    };
    Ok((status, Json(result)))
}

// ---- audit ----

#[derive(Deserialize, IntoParams)]
pub struct AuditQuery {
    /// Return rows after this sequence number.
    #[serde(default)]
    pub since: i64,
    /// At most this many rows (default 10000).
    pub limit: Option<i64>,
}

#[utoipa::path(get, path = "/v1/audit", tag = "audit",
    params(AuditQuery),
    responses((status = 200, description = "Audit rows as JSON lines", content_type = "application/x-ndjson"),
        (status = 403, description = "Only admin tokens may export the audit log")),
    security(("bearer" = [])))]
pub async fn export_audit(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Query(q): Query<AuditQuery>,
) -> Result<Response, ApiError> {
    if !caller.admin {
        return Err(ApiError::Forbidden(
            "exporting the audit log needs an admin token (hilum serve token create --admin)"
                .into(),
        ));
    }
    let rows = state
        .db
        .audit_since_async(q.since, q.limit.unwrap_or(10_000).clamp(1, 100_000))
        .await?;
    let mut body = String::new();
    for r in rows {
        body.push_str(&serde_json::to_string(&r).map_err(|e| ApiError::Internal(e.to_string()))?);
        body.push('\n');
    }
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
}
