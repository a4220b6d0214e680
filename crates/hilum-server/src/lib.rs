//! The Hilum service: an HTTP API (axum) that stores images, runs the agent and streams its
//! events as NDJSON or SSE, persists everything in SQLite or PostgreSQL (shared by replicas)
//! with an append-only audit log, authenticates callers by bearer token, and serves the
//! toolbox over MCP.
//!
//! Routing is in [`router`], top to bottom; handlers are in `api` and `run`.

#![warn(missing_docs)]

mod api;
mod auth;
pub mod db;
pub mod deid;
mod error;
mod image_meta;
mod live;
pub mod mcp;
mod metrics;
pub mod openapi;
pub mod pacs;
mod request_id;
mod run;
mod web;

use std::collections::HashMap;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::Mutex as AsyncMutex;

use hilum_agent::{AgentConfig, Environment, Llm, Toolbox};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_tools::{Registry, ToolDeps};

pub use auth::RateLimit;
pub use db::{Caller, Db, DbError, TokenRow};
pub use error::ApiError;
pub use metrics::Metrics;
pub use request_id::{RequestId, REQUEST_ID_HEADER};

/// Builds the reasoning model for one run (a fresh one per run: a script replays from its
/// first turn, an HTTP client is cheap to make).
#[derive(Clone)]
pub struct LlmFactory {
    /// For logs, the audit log and run records, e.g. `openai:gpt-4o`.
    pub name: String,
    /// Whether the endpoint runs on this machine (so nothing leaves it).
    pub local: bool,
    /// Makes the model, or says why it cannot (missing key, unreadable script, …).
    pub build: Arc<dyn Fn() -> Result<Arc<dyn Llm>, String> + Send + Sync>,
}

impl LlmFactory {
    /// Replays a script file (`hilum_llm::ScriptLlm`) for every run.
    pub fn script(path: std::path::PathBuf) -> Self {
        LlmFactory {
            name: format!("script:{}", path.display()),
            local: true,
            build: Arc::new(move || {
                hilum_llm::ScriptLlm::from_file(&path)
                    .map(|l| Arc::new(l) as Arc<dyn Llm>)
                    .map_err(|e| e.to_string())
            }),
        }
    }
}

/// Makes the toolbox for one tenant's image store.
pub type ToolboxFactory = Arc<dyn Fn(Arc<ImageStore>) -> Result<Toolbox, String> + Send + Sync>;

/// Toolboxes of `registry` that share everything in `shared` but the image store: one model
/// pool (one copy of each model, one set of device permits) and one VLM configuration serve
/// every tenant; a tenant owns only its images and its sessions.
pub fn toolbox_factory(registry: Registry, shared: ToolDeps) -> ToolboxFactory {
    Arc::new(move |images| {
        registry.toolbox(&ToolDeps {
            images,
            ..shared.clone()
        })
    })
}

/// Hilum's own tools over `models`, the process's one model pool (the program builds it from
/// its settings).
pub fn default_toolbox_factory(models: Arc<hilum_tools::ModelPool>) -> ToolboxFactory {
    toolbox_factory(
        Registry::builtin(),
        ToolDeps::new(Arc::new(ImageStore::default()), models),
    )
}

/// How the service runs: where it listens, its database, its limits and policies.
#[derive(Clone)]
pub struct ServerConfig {
    /// 127.0.0.1 by default: exposing the service is an explicit choice.
    pub bind: SocketAddr,
    /// `sqlite://PATH` or `postgres://USER@HOST:PORT/DB`.
    pub db_url: String,
    /// Largest upload (the whole multipart body), bytes.
    pub max_upload_bytes: usize,
    /// Largest JSON request body, bytes.
    pub max_json_bytes: usize,
    /// Requests per second and burst allowed to each token.
    pub rate_limit: RateLimit,
    /// Memory each token's images may hold (files, decoded pixels, preprocessed variants);
    /// least recently used images are dropped and read again from the database when named.
    /// 0: no bound.
    pub max_image_memory_bytes: u64,
    /// `None`: sessions cannot ask questions (tools and uploads still work).
    pub llm: Option<LlmFactory>,
    /// The policy switch: unless true, no run may send pixels or image metadata (which tool
    /// results carry) to a model endpoint that is not on this machine.
    pub allow_remote_llm: bool,
    /// Attach the images' pixels to model requests when the model accepts images. Off by
    /// default; a non-local endpoint additionally needs `allow_remote_llm`.
    pub send_pixels: bool,
    /// Browser origins allowed by CORS; empty = CORS off.
    pub cors_origins: Vec<String>,
    /// The agent loop's settings (rounds, budgets) for every run.
    pub agent: AgentConfig,
    /// What the tools may use (threads, device, model directory).
    pub env: Environment,
    /// Makes each tenant's toolbox over its own image store.
    pub toolbox: ToolboxFactory,
    /// The process's one model pool, when the server knows it (reported in `/metrics`).
    pub models: Option<Arc<hilum_tools::ModelPool>>,
    /// Budget of a direct tool call (`tools/{name}:call`, MCP).
    pub tool_timeout: Duration,
    /// Interval of keep-alive lines in event streams; a write to a gone client fails and
    /// cancels its run.
    pub heartbeat: Duration,
    /// How often the server looks for revoked tokens: the longest a token revoked elsewhere
    /// (the CLI, another replica) stays usable here through the authentication cache.
    pub revocation_poll: Duration,
    /// On SIGTERM/SIGINT, how long running runs may take to finish before they are stopped
    /// and marked `interrupted`.
    pub drain: Duration,
    /// How often this process renews the heartbeat of the runs it is running.
    pub run_heartbeat: Duration,
    /// A `running` run whose heartbeat is older than this was left by a process that died:
    /// any server marks it `interrupted`. Keep it several heartbeats long.
    pub run_stale_after: Duration,
    /// The DICOM node (`--dicom-port`): C-STORE in, protocol runs, results to the PACS.
    pub pacs: Option<pacs::PacsSettings>,
}

impl ServerConfig {
    /// Defaults for everything but the database: 127.0.0.1:8080, Hilum's own tools, no model.
    pub fn new(db_url: impl Into<String>) -> Self {
        // Default settings; a program sets `toolbox` and `models` from its own.
        let models = hilum_tools::ModelPool::from_settings(Default::default());
        let shared = ToolDeps::new(Arc::new(ImageStore::default()), Arc::new(models));
        ServerConfig {
            bind: SocketAddr::from(([127, 0, 0, 1], 8080)),
            db_url: db_url.into(),
            max_upload_bytes: 64 << 20,
            max_json_bytes: 1 << 20,
            rate_limit: RateLimit::default(),
            max_image_memory_bytes: 256 << 20,
            llm: None,
            allow_remote_llm: false,
            send_pixels: false,
            cors_origins: Vec::new(),
            agent: AgentConfig::default(),
            env: Environment::default(),
            models: Some(shared.models.clone()),
            toolbox: toolbox_factory(Registry::builtin(), shared),
            tool_timeout: Duration::from_secs(300),
            heartbeat: Duration::from_secs(5),
            revocation_poll: Duration::from_secs(1),
            drain: Duration::from_secs(30),
            run_heartbeat: Duration::from_secs(5),
            run_stale_after: Duration::from_secs(30),
            pacs: None,
        }
    }
}

/// One tenant's images and the toolbox that sees only them.
pub struct Space {
    /// The tenant's images.
    pub images: Arc<ImageStore>,
    /// The tools, seeing only those images.
    pub toolbox: Arc<Toolbox>,
}

/// What [`AppState`] holds.
pub struct Inner {
    pub(crate) cfg: ServerConfig,
    pub(crate) db: Db,
    pub(crate) metrics: Metrics,
    pub(crate) limiter: auth::Limiter,
    pub(crate) auth_cache: auth::AuthCache,
    spaces: AsyncMutex<HashMap<String, Arc<Space>>>,
    /// This process among the replicas sharing the database: the owner of the runs it runs.
    pub(crate) replica: String,
    pub(crate) runs: run::Runs,
}

/// Shared state of all handlers.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    /// Opens (creating and migrating) the configured database; nothing listens yet.
    pub fn new(cfg: ServerConfig) -> Result<Self, DbError> {
        let db = Db::open(&cfg.db_url)?;
        Ok(AppState(Arc::new(Inner {
            limiter: auth::Limiter::new(cfg.rate_limit),
            cfg,
            db,
            metrics: Metrics::default(),
            auth_cache: auth::AuthCache::default(),
            spaces: AsyncMutex::new(HashMap::new()),
            replica: db::new_id("srv"),
            runs: run::Runs::default(),
        })))
    }

    /// The service's database.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// The caller's space. Its images are read from the database when first named (after a
    /// start, after an eviction) and dropped, least recently used first, beyond
    /// `max_image_memory_bytes`.
    pub async fn space(&self, caller: &Caller) -> Result<Arc<Space>, ApiError> {
        let mut spaces = self.spaces.lock().await;
        if let Some(s) = spaces.get(&caller.token_id) {
            return Ok(s.clone());
        }
        let bound = match self.cfg.max_image_memory_bytes {
            0 => u64::MAX,
            n => n,
        };
        let limits = StoreLimits {
            cache_bytes: bound,
            ..StoreLimits::default()
        };
        let (db, token) = (self.db.clone(), caller.token_id.clone());
        let loader: hilum_imaging::ImageLoader = Arc::new(move |id: &str| {
            db.image_bytes_blocking(token.clone(), id.to_string())
                .map(|b| b.map(bytes::Bytes::from))
                .map_err(|e| e.to_string())
        });
        let images = Arc::new(ImageStore::with_loader(limits, loader));
        let stored = self.db.list_images(caller.token_id.clone()).await?;
        images.add_known(stored.into_iter().map(|r| r.id));
        let toolbox = (self.cfg.toolbox)(images.clone()).map_err(ApiError::Internal)?;
        let space = Arc::new(Space {
            images,
            toolbox: Arc::new(toolbox),
        });
        spaces.insert(caller.token_id.clone(), space.clone());
        Ok(space)
    }

    /// The caller's image `id`, brought into memory if it was evicted; 404 when the caller
    /// does not own it.
    pub(crate) async fn owned_image(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<Arc<hilum_imaging::CxrImage>, ApiError> {
        let space = self.space(caller).await?;
        self.ensure_images(caller, &space, &[id.to_string()])
            .await?;
        space
            .images
            .get(id)
            .map_err(|_| ApiError::not_found("image", id))
    }

    /// Brings the given image ids into memory if the caller owns them (evicted, or uploaded
    /// through another replica), decoding off the runtime; tools would otherwise read them
    /// through the store's blocking loader. Ids the caller does not own stay unknown.
    pub(crate) async fn ensure_images(
        &self,
        caller: &Caller,
        space: &Space,
        ids: &[String],
    ) -> Result<(), ApiError> {
        let missing: Vec<String> = ids
            .iter()
            .filter(|id| !space.images.is_resident(id))
            .cloned()
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let stored = self
            .db
            .image_bytes_by_id(caller.token_id.clone(), missing)
            .await?;
        load_images(&space.images, stored).await
    }

    /// Images in memory over all tokens: (images, bytes held, images evicted, reloads,
    /// reattached).
    pub(crate) async fn image_memory(&self) -> (u64, u64, u64, u64, u64) {
        let spaces = self.spaces.lock().await;
        spaces.values().fold((0, 0, 0, 0, 0), |acc, s| {
            let st = s.images.stats();
            (
                acc.0 + st.resident_images,
                acc.1 + st.cached_bytes + st.source_bytes,
                acc.2 + st.images_evicted,
                acc.3 + st.reloads,
                acc.4 + st.reattached,
            )
        })
    }

    /// Revokes a token in the database and at once in this server's cache.
    pub fn revoke_token(&self, token_id: &str) -> Result<bool, DbError> {
        let changed = self.db.revoke_token(token_id)?;
        self.auth_cache.forget(&[token_id.to_string()]);
        Ok(changed)
    }

    /// Forgets cached tokens that were revoked (by `hilum serve token revoke`, another
    /// replica or this one) and returns how many it forgot.
    pub async fn apply_revocations(&self) -> Result<usize, DbError> {
        let revoked = self.db.revoked_token_ids().await?;
        Ok(self.auth_cache.forget(&revoked))
    }
}

/// Decodes stored image files into a store.
async fn load_images(
    store: &Arc<ImageStore>,
    stored: Vec<(String, Vec<u8>)>,
) -> Result<(), ApiError> {
    for (id, bytes) in stored {
        let store = store.clone();
        let span = tracing::Span::current();
        let loaded = tokio::task::spawn_blocking(move || {
            let _request = span.enter();
            store.ingest_bytes(bytes::Bytes::from(bytes), "stored image")
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
        if let Err(e) = loaded {
            // A file that decoded at upload but not now (a decoder change) stays listed;
            // tools will report it as unknown.
            tracing::warn!(image = %id, error = %e, "stored image no longer decodes");
        }
    }
    Ok(())
}

/// Every `img_…` string in tool arguments.
pub(crate) fn image_ids_in(args: &serde_json::Value, out: &mut Vec<String>) {
    match args {
        serde_json::Value::String(s) if s.starts_with("img_") => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|v| image_ids_in(v, out)),
        serde_json::Value::Object(o) => o.values().for_each(|v| image_ids_in(v, out)),
        _ => {}
    }
}

/// Every `interval`, drops revoked tokens from the authentication cache, so a revocation
/// made anywhere (the CLI, another replica) takes effect here within one interval, and
/// prunes the rate limiter's idle buckets.
async fn watch_revocations(state: AppState) {
    let mut tick = tokio::time::interval(state.cfg.revocation_poll);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match state.apply_revocations().await {
            Ok(0) => {}
            Ok(n) => tracing::info!(tokens = n, "revoked tokens dropped from the cache"),
            Err(e) => tracing::warn!(error = %e, "cannot read revoked tokens"),
        }
        // Idle tokens' rate buckets (full again) go, so the map holds only active tokens.
        state.limiter.prune();
    }
}

/// Every route of the service. `/v1/*` and `/mcp` need a bearer token; `/healthz`,
/// `/metrics`, `/openapi.json` and the web UI do not.
pub fn router(state: AppState) -> Router {
    let upload_limit = state.cfg.max_upload_bytes;
    let api = Router::new()
        .route(
            "/v1/images",
            post(api::upload_image)
                // Uploads get their own, larger limit than JSON bodies.
                .layer(DefaultBodyLimit::max(upload_limit))
                .get(api::list_images),
        )
        .route("/v1/images/{id}/pixels", get(api::image_pixels))
        .route("/v1/images/{id}/info", get(image_meta::image_info))
        .route(
            "/v1/sessions",
            post(api::create_session).get(api::list_sessions),
        )
        .route("/v1/sessions/{id}", get(api::get_session))
        .route(
            "/v1/sessions/{id}/messages",
            post(run::ask).get(api::list_messages),
        )
        .route("/v1/sessions/{id}/runs", get(api::list_runs))
        .route("/v1/sessions/{id}/runs/{run_id}/resume", post(run::resume))
        .route("/v1/sessions/{id}/runs/{run_id}/stream", get(live::follow))
        .route("/v1/sessions/{id}/runs/{run_id}/cancel", post(live::cancel))
        .route(
            "/v1/sessions/{id}/runs/{run_id}/events",
            get(api::run_events),
        )
        .route("/v1/sessions/{id}/artifacts", get(api::session_artifacts))
        .route("/v1/artifacts/{id}", get(api::get_artifact))
        .route("/v1/tools", get(api::list_tools))
        // `{name}:call` is one path segment; the handler checks the `:call` suffix.
        .route("/v1/tools/{call}", post(api::call_tool))
        .route("/v1/audit", get(api::export_audit))
        .route("/v1/pacs/jobs", get(pacs::list_jobs))
        .route("/v1/pacs/jobs/{id}/retry", post(pacs::retry_job))
        .route("/v1/pacs/jobs/{id}/events", get(pacs::job_events))
        .route("/v1/pacs/pull", post(pacs::pull))
        .route(
            "/dicomweb/studies",
            post(pacs::stow).layer(DefaultBodyLimit::max(upload_limit)),
        )
        .nest_service("/mcp", mcp::http_service(state.clone()))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    let public = Router::new()
        .route("/healthz", get(api::healthz))
        .route("/metrics", get(api::metrics))
        .route("/openapi.json", get(openapi::serve));
    let mut app = Router::new()
        .merge(api)
        .merge(public)
        .merge(web::routes())
        .layer(DefaultBodyLimit::max(state.cfg.max_json_bytes))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ));
    if !state.cfg.cors_origins.is_empty() {
        let origins: Vec<axum::http::HeaderValue> = state
            .cfg
            .cors_origins
            .iter()
            .filter_map(|o| o.parse().ok())
            .collect();
        app = app.layer(
            tower_http::cors::CorsLayer::new()
                .allow_origin(origins)
                .allow_methods(tower_http::cors::Any)
                .allow_headers(tower_http::cors::Any),
        );
    }
    // Outermost: one span per request, with its id; handlers, runs and tool calls log inside it.
    app.layer(middleware::from_fn(request_id::with_request_id))
        .with_state(state)
}

async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    request_id::record_route(&req);
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().to_string();
    let resp = next.run(req).await;
    state
        .metrics
        .request(&method, &route, resp.status().as_u16());
    resp
}

/// Renews the heartbeat of this process's runs and marks `interrupted` the runs whose
/// process died (their heartbeat went stale), every `run_heartbeat`.
async fn keep_runs(state: AppState) {
    let mut tick = tokio::time::interval(state.cfg.run_heartbeat.max(Duration::from_millis(50)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = state.db.heartbeat(state.replica.clone()).await {
            tracing::warn!(error = %e, "cannot renew the heartbeat of running runs");
        }
        interrupt_stale_runs(&state).await;
    }
}

async fn interrupt_stale_runs(state: &AppState) {
    let stale_before = db::now_ms() - state.cfg.run_stale_after.as_millis() as i64;
    match state
        .db
        .interrupt_stale_runs(state.replica.clone(), stale_before)
        .await
    {
        Ok(0) => {}
        Ok(n) => tracing::info!(
            runs = n,
            "runs left running by a stopped server marked interrupted"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot mark runs of stopped servers"),
    }
}

/// Binds and serves until `shutdown` resolves, then drains: no new connections or runs,
/// running runs get `drain` to finish, the rest are stopped and marked `interrupted`.
/// Returns the bound address through `bound` (useful with port 0).
pub async fn serve(
    state: AppState,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    bound: Option<tokio::sync::oneshot::Sender<SocketAddr>>,
) -> std::io::Result<()> {
    // Runs a dead process left `running` (heartbeat stale) become resumable now.
    interrupt_stale_runs(&state).await;
    let listener = tokio::net::TcpListener::bind(state.cfg.bind).await?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "listening on a non-loopback address: put TLS in front of it");
    }
    tracing::info!(%addr, "hilum serve listening");
    if let Some(settings) = state.cfg.pacs.clone() {
        pacs::start(state.clone(), settings).map_err(std::io::Error::other)?;
    }
    if let Some(tx) = bound {
        let _ = tx.send(addr);
    }
    let watcher = tokio::spawn(watch_revocations(state.clone()));
    let keeper = tokio::spawn(keep_runs(state.clone()));
    let (signalled_tx, signalled) = tokio::sync::oneshot::channel::<()>();
    let draining = state.clone();
    let signal = async move {
        shutdown.await;
        // New questions and resumes are refused from here on.
        draining.runs.start_draining();
        let _ = signalled_tx.send(());
    };
    // On its own task, so that it stops accepting and closes idle connections during the drain.
    let mut server = tokio::spawn(
        axum::serve(listener, router(state.clone()))
            .with_graceful_shutdown(signal)
            .into_future(),
    );
    let joined = tokio::select! {
        biased;
        joined = &mut server => joined,
        _ = signalled => {
            run::drain(&state).await;
            // The stopped runs' streams have ended; a client that keeps an idle connection
            // open does not hold the exit.
            match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
                Ok(joined) => joined,
                Err(_) => {
                    server.abort();
                    Ok(Ok(()))
                }
            }
        }
    };
    let served = joined.unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
    watcher.abort();
    keeper.abort();
    served
}
