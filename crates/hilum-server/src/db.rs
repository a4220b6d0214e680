//! Persistence: tokens, images, sessions, runs, messages, events, tool calls, artifacts and
//! the append-only audit log, in SQLite (`sqlite://PATH`, the default) or PostgreSQL
//! (`postgres://USER@HOST:PORT/DB`, shared by several replicas). Both have the same schema,
//! migrations and queries (see `backend`). Every write is committed before the server
//! acknowledges it, so a restart loses nothing that a client was told had happened.

pub(crate) mod backend;
mod pacs;
pub(crate) mod tls;

pub use pacs::{JobUpdate, PacsInstance, PacsJob, JOB_STATES};

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use thiserror::Error;

use backend::{args, Engine, Exec, Job, PgPool, Row, AUDIT_LOCK};

/// Why a database operation failed.
#[derive(Debug, Error)]
pub enum DbError {
    /// The URL is neither SQLite nor PostgreSQL.
    #[error("unsupported database URL `{0}`: use sqlite://PATH or postgres://USER@HOST:PORT/DB")]
    UnsupportedUrl(String),
    /// The database cannot be opened or migrated.
    #[error("cannot open the database {path}: {reason}")]
    Open {
        /// The database, as shown (without a password).
        path: String,
        /// Why, in words.
        reason: String,
    },
    /// An SQLite error.
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A PostgreSQL error (its message without the password).
    #[error("database error: {}", backend::pg_message(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// No token has this id.
    #[error("no token `{0}`: `hilum serve token list` shows the ids")]
    UnknownToken(String),
    /// The blocking database thread panicked or was cancelled.
    #[error("database task failed: {0}")]
    Task(String),
    /// A stored row does not parse (JSON of a message, an event, …).
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A random id with a readable prefix: `ses_9f2c…`.
pub fn new_id(prefix: &str) -> String {
    let bytes: [u8; 12] = rand::random();
    format!("{prefix}_{}", hex::encode(bytes))
}

/// Tokens are 256-bit random secrets, so one SHA-256 is enough at rest (no password
/// stretching needed: there is nothing to brute-force).
pub fn hash_token(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Which database `--db` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DbUrl {
    /// An SQLite file path.
    Sqlite(PathBuf),
    /// A `postgres://` or `postgresql://` URL, as given.
    Postgres(String),
}

/// A database URL as messages and logs may show it: without its password.
pub fn shown_url(url: &str) -> String {
    backend::redact(url)
}

/// Parses `--db`: `sqlite://PATH`, `sqlite:PATH`, a bare path, or `postgres://...`.
pub fn parse_url(url: &str) -> Result<DbUrl, DbError> {
    if let Some(rest) = url.strip_prefix("sqlite://") {
        Ok(DbUrl::Sqlite(PathBuf::from(rest)))
    } else if let Some(rest) = url.strip_prefix("sqlite:") {
        Ok(DbUrl::Sqlite(PathBuf::from(rest)))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(DbUrl::Postgres(url.to_string()))
    } else if url.contains("://") {
        Err(DbError::UnsupportedUrl(backend::redact(url)))
    } else {
        Ok(DbUrl::Sqlite(PathBuf::from(url)))
    }
}

/// The caller behind a bearer token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The token's id (not its secret).
    pub token_id: String,
    /// The name given when the token was created.
    pub name: String,
    /// Whether the token may manage tokens and read every caller's data.
    pub admin: bool,
}

/// An uploaded image, as listed (its bytes are in the image store).
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ImageRow {
    /// The image id (`img_…`).
    pub id: String,
    /// The MIME type it was uploaded as.
    pub media_type: String,
    /// Its size in bytes.
    pub size: i64,
    /// Width in pixels.
    pub width: i64,
    /// Height in pixels.
    pub height: i64,
    /// Bits per pixel sample.
    pub bit_depth: i64,
    /// The decoded format (`png`, `jpeg`, `dicom`, …).
    pub format: String,
    /// When it was uploaded, ms since the epoch.
    pub created_ms: i64,
}

/// A session: a conversation of runs about images.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct SessionRow {
    /// The session id (`ses_…`).
    pub id: String,
    /// Its title, as given.
    pub title: String,
    /// When it was created, ms since the epoch.
    pub created_ms: i64,
    /// When a run last changed it, ms since the epoch.
    pub updated_ms: i64,
}

/// One run of the agent: a question and its answer.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct RunRow {
    /// The run id (`run_…`).
    pub id: String,
    /// The question asked.
    pub question: String,
    /// The ids of the images the question is about.
    pub images: Vec<String>,
    /// The model that answers.
    pub model: String,
    /// `running`, `completed`, `failed`, `cancelled`, or `interrupted` (its server stopped
    /// before it finished: `POST …/runs/{run_id}/resume` continues it).
    pub status: String,
    /// The final answer, once completed.
    pub answer: Option<String>,
    /// Why the run failed, if it did.
    pub error: Option<String>,
    /// When it started, ms since the epoch.
    pub started_ms: i64,
    /// When it ended, ms since the epoch; none while running.
    pub finished_ms: Option<i64>,
}

/// One message of a session's conversation.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct MessageRow {
    /// Its position in the session, increasing.
    pub seq: i64,
    /// The run that added it.
    pub run_id: String,
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message as the model saw it (`role`, `content`, `tool_calls`, …).
    #[schema(value_type = Object)]
    pub message: Value,
    /// When it was stored, ms since the epoch.
    pub created_ms: i64,
}

/// A file a tool made (a mask, an overlay, a report, …), as listed.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ArtifactRow {
    /// The artifact id (`art_…`).
    pub id: String,
    /// The session it belongs to, if any.
    pub session_id: Option<String>,
    /// The run that made it, if any.
    pub run_id: Option<String>,
    /// The tool call that made it.
    pub call_id: String,
    /// The tool that made it.
    pub tool: String,
    /// Its file name.
    pub name: String,
    /// Its MIME type.
    pub media_type: String,
    /// What it is (`mask`, `overlay`, …), as the tool says.
    pub kind: String,
    /// Its size in bytes.
    pub size: i64,
    /// When it was stored, ms since the epoch.
    pub created_ms: i64,
}

/// One row of the audit log.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct AuditRow {
    /// Its position in the log, increasing.
    pub seq: i64,
    /// When it happened, ms since the epoch.
    pub ts_ms: i64,
    /// The token id (never the token) that acted.
    pub actor: String,
    /// The session it happened in, if any.
    pub session_id: Option<String>,
    /// The run it happened in, if any.
    pub run_id: Option<String>,
    /// `tool_call`, `llm_call`, `run_cancelled`, `run_failed`, `upload`.
    pub kind: String,
    /// The tool or model name.
    pub name: String,
    /// De-identified arguments.
    #[schema(value_type = Object)]
    pub arguments: Value,
    /// `ok` or the failure kind.
    pub outcome: String,
    /// How long it took, in milliseconds.
    pub duration_ms: f64,
}

/// What is appended to the audit log.
#[derive(Clone, Debug)]
pub struct AuditEntry {
    /// The token id that acted.
    pub actor: String,
    /// The session it happened in, if any.
    pub session_id: Option<String>,
    /// The run it happened in, if any.
    pub run_id: Option<String>,
    /// `tool_call`, `llm_call`, `run_cancelled`, `run_failed`, `upload`.
    pub kind: &'static str,
    /// The tool or model name.
    pub name: String,
    /// The arguments, de-identified before they are stored.
    pub arguments: Value,
    /// `ok` or the failure kind.
    pub outcome: String,
    /// How long it took, in milliseconds.
    pub duration_ms: f64,
}

/// A tool call to record.
#[derive(Clone, Debug)]
pub struct ToolCallRecord {
    /// The token id that called.
    pub token_id: String,
    /// The session of the call, if any.
    pub session_id: Option<String>,
    /// The run of the call, if any.
    pub run_id: Option<String>,
    /// The model's id of the call.
    pub call_id: String,
    /// The tool called.
    pub tool: String,
    /// Its arguments.
    pub arguments: Value,
    /// Whether the tool succeeded.
    pub ok: bool,
    /// The kind of its error, if it failed.
    pub error_kind: Option<String>,
    /// How long it took, in milliseconds.
    pub ms: f64,
    /// What the tool returned.
    pub result: Value,
    /// The round of a run's call.
    pub round: Option<i64>,
}

/// What a stopped run stored, to continue it.
#[derive(Clone, Debug)]
pub struct StoredRun {
    /// The run, as stored.
    pub run: RunRow,
    /// The loop's counters at the last stored step (JSON), if any step was stored.
    pub progress: Option<Value>,
    /// The run's messages in the order they were stored.
    pub messages: Vec<Value>,
    /// The session's conversation before the run (finished runs only).
    pub history: Vec<Value>,
    /// The run's finished tool calls: (round, call id, tool, arguments, ok, error kind, ms,
    /// result).
    pub calls: Vec<StoredCall>,
}

/// A finished tool call of a run, as stored.
#[derive(Clone, Debug)]
pub struct StoredCall {
    /// The round of the run the call was made in.
    pub round: i64,
    /// The model's id of the call.
    pub call_id: String,
    /// The tool called.
    pub tool: String,
    /// Its arguments.
    pub arguments: Value,
    /// Whether the tool succeeded.
    pub ok: bool,
    /// The kind of its error, if it failed.
    pub error_kind: Option<String>,
    /// How long it took, in milliseconds.
    pub ms: f64,
    /// What the tool returned.
    pub result: Value,
}

/// An artifact to store.
#[derive(Clone, Debug)]
pub struct NewArtifact {
    /// The artifact id (`art_…`).
    pub id: String,
    /// The token that owns it.
    pub token_id: String,
    /// The session it belongs to, if any.
    pub session_id: Option<String>,
    /// The run that made it, if any.
    pub run_id: Option<String>,
    /// The tool call that made it.
    pub call_id: String,
    /// The tool that made it.
    pub tool: String,
    /// Its file name.
    pub name: String,
    /// Its MIME type.
    pub media_type: String,
    /// What it is (`mask`, `overlay`, …).
    pub kind: String,
    /// The file's bytes.
    pub bytes: Vec<u8>,
}

/// A token as listed: never its secret, nor its hash.
#[derive(Clone, Debug, Serialize)]
pub struct TokenRow {
    /// The token id.
    pub id: String,
    /// The name given when it was created.
    pub name: String,
    /// Whether it may manage tokens and read every caller's data.
    pub admin: bool,
    /// When it was created, ms since the epoch.
    pub created_ms: i64,
    /// When it was revoked, ms since the epoch; none while valid.
    pub revoked_ms: Option<i64>,
}

#[derive(Clone)]
enum Backend {
    /// One connection; writes are serialised by the mutex.
    Sqlite(Arc<Mutex<rusqlite::Connection>>),
    Postgres(Arc<PgPool>),
}

/// The database. Cheap to clone. SQLite: queries run one at a time on its connection, on
/// tokio's blocking pool. PostgreSQL: queries run concurrently on a pool of connections, as
/// futures of the caller's runtime.
#[derive(Clone)]
pub struct Db {
    backend: Backend,
}

/// Runs `f` on a plain thread when called from async code, whose runtime must not be blocked
/// (nor a second runtime started on its thread).
fn off_runtime<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if tokio::runtime::Handle::try_current().is_err() {
        return f();
    }
    std::thread::scope(|s| match s.spawn(f).join() {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

impl Db {
    /// Opens (creating if needed) and migrates the database at `url`: `sqlite://PATH` or
    /// `postgres://USER@HOST:PORT/DB` (with `?sslmode=...&sslrootcert=PATH` as in libpq).
    pub fn open(url: &str) -> Result<Db, DbError> {
        match parse_url(url)? {
            DbUrl::Sqlite(path) => Self::open_path(&path),
            DbUrl::Postgres(url) => Self::open_postgres(&url),
        }
    }

    /// Opens (creating if needed) and migrates the SQLite database at `path`.
    pub fn open_path(path: &Path) -> Result<Db, DbError> {
        let open_err = |e: &dyn std::fmt::Display| DbError::Open {
            path: path.display().to_string(),
            reason: format!("{e} (check the path and its permissions)"),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| open_err(&e))?;
        }
        let conn = rusqlite::Connection::open(path).map_err(|e| open_err(&e))?;
        // WAL lets readers proceed during writes; FULL syncs each commit so an acknowledged
        // write survives a crash of the machine, not only of the process.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        backend::migrate_sqlite(&conn)?;
        Ok(Db {
            backend: Backend::Sqlite(Arc::new(Mutex::new(conn))),
        })
    }

    fn open_postgres(url: &str) -> Result<Db, DbError> {
        let pool = PgPool::new(url)?;
        backend::migrate_postgres(&pool)?;
        Ok(Db {
            backend: Backend::Postgres(Arc::new(pool)),
        })
    }

    /// `sqlite` or `postgres`.
    pub fn engine_name(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres(_) => "postgres",
        }
    }

    /// Runs `job`, in one transaction if `tx`.
    async fn run<R, F>(&self, tx: bool, job: F) -> Result<R, DbError>
    where
        F: for<'c> FnOnce(&'c mut dyn Exec) -> Job<'c, R> + Send + 'static,
        R: Send + 'static,
    {
        match &self.backend {
            Backend::Sqlite(conn) => {
                let conn = conn.clone();
                tokio::task::spawn_blocking(move || {
                    let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
                    backend::run_sqlite(&mut guard, tx, job)
                })
                .await
                .map_err(|e| DbError::Task(e.to_string()))?
            }
            Backend::Postgres(pool) => pool.with(tx, job).await,
        }
    }

    /// Runs `job` on the calling thread (the CLI's one-shot commands, tests).
    fn run_sync<R: Send + 'static>(
        &self,
        tx: bool,
        job: impl for<'c> FnOnce(&'c mut dyn Exec) -> Job<'c, R> + Send + 'static,
    ) -> Result<R, DbError> {
        match &self.backend {
            Backend::Sqlite(conn) => {
                let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
                backend::run_sqlite(&mut guard, tx, job)
            }
            Backend::Postgres(pool) => pool.with_own_connection(move |client| {
                Box::pin(async move { backend::run_pg(client, tx, job).await })
            }),
        }
    }

    /// Runs one SQL statement without parameters and returns the number of rows it changed.
    /// For maintenance and tests; the server itself never builds SQL from input. (Each `?`
    /// becomes `$` on PostgreSQL, as in every query here.)
    pub fn execute_sql(&self, sql: &str) -> Result<u64, DbError> {
        let sql = sql.to_string();
        self.run_sync(false, move |c| {
            Box::pin(async move { c.execute(&sql, &[]).await })
        })
    }

    // ---- tokens ----

    /// Creates a token and returns `(token id, secret)`. The secret is shown once and
    /// stored only as its hash.
    pub fn create_token(&self, name: &str, admin: bool) -> Result<(String, String), DbError> {
        let id = new_id("tok");
        let secret = format!("hlm_{}", hex::encode(rand::random::<[u8; 32]>()));
        let hash = hash_token(&secret);
        let (id2, name) = (id.clone(), name.to_string());
        self.run_sync(false, move |c| Box::pin(async move {
            c.execute(
                "INSERT INTO tokens (id, name, hash, admin, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                &args![id2, name, hash, admin, now_ms()],
            ).await?;
            Ok(())
        }))?;
        Ok((id, secret))
    }

    /// Every token, oldest first, without secrets.
    pub fn list_tokens(&self) -> Result<Vec<TokenRow>, DbError> {
        self.run_sync(false, move |c| Box::pin(async move {
            c.query(
                "SELECT id, name, admin, created_ms, revoked_ms FROM tokens ORDER BY created_ms, id",
                &[],
            ).await?
            .into_iter()
            .map(|mut r| {
                Ok(TokenRow {
                    id: r.get(0)?,
                    name: r.get(1)?,
                    admin: r.get(2)?,
                    created_ms: r.get(3)?,
                    revoked_ms: r.get(4)?,
                })
            })
            .collect()
        }))
    }

    /// Revokes a token for good. `Ok(false)` if it was already revoked.
    pub fn revoke_token(&self, id: &str) -> Result<bool, DbError> {
        let id = id.to_string();
        self.run_sync(true, move |c| {
            Box::pin(async move {
                let changed = c
                    .execute(
                        "UPDATE tokens SET revoked_ms = ?2 WHERE id = ?1 AND revoked_ms IS NULL",
                        &args![&id, now_ms()],
                    )
                    .await?;
                if changed > 0 {
                    return Ok(true);
                }
                match c
                    .query_opt("SELECT id FROM tokens WHERE id = ?1", &args![&id])
                    .await?
                {
                    Some(_) => Ok(false),
                    None => Err(DbError::UnknownToken(id)),
                }
            })
        })
    }

    /// Ids of revoked tokens (for servers to drop them from their authentication caches).
    pub async fn revoked_token_ids(&self) -> Result<Vec<String>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query("SELECT id FROM tokens WHERE revoked_ms IS NOT NULL", &[])
                    .await?
                    .into_iter()
                    .map(|mut r| r.get(0))
                    .collect()
            })
        })
        .await
    }

    /// The caller behind a token hash; none for an unknown or revoked token.
    pub async fn caller_for_hash(&self, hash: String) -> Result<Option<Caller>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query_opt(
                    "SELECT id, name, admin FROM tokens WHERE hash = ?1 AND revoked_ms IS NULL",
                    &args![hash],
                )
                .await?
                .map(|mut r| {
                    Ok(Caller {
                        token_id: r.get(0)?,
                        name: r.get(1)?,
                        admin: r.get(2)?,
                    })
                })
                .transpose()
            })
        })
        .await
    }

    // ---- images ----

    /// Stores an uploaded image and its audit row in one transaction: an upload whose audit
    /// row cannot be written is not stored.
    pub async fn insert_image(
        &self,
        token_id: String,
        row: ImageRow,
        bytes: Vec<u8>,
        audit: AuditEntry,
    ) -> Result<(), DbError> {
        self.run(true, move |c| Box::pin(async move {
            c.execute(
                "INSERT INTO images (token_id, image_id, media_type, size, width, height, bit_depth, format, bytes, created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) ON CONFLICT DO NOTHING",
                &args![
                    token_id, row.id, row.media_type, row.size, row.width, row.height,
                    row.bit_depth, row.format, bytes, row.created_ms
                ],
            ).await?;
            insert_audit(c, &audit, now_ms()).await
        }))
        .await
    }

    /// The images a token uploaded, oldest first.
    pub async fn list_images(&self, token_id: String) -> Result<Vec<ImageRow>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query(
                "SELECT image_id, media_type, size, width, height, bit_depth, format, created_ms
                 FROM images WHERE token_id = ?1 ORDER BY created_ms, image_id",
                &args![token_id],
            ).await?
            .into_iter()
            .map(|mut r| {
                Ok(ImageRow {
                    id: r.get(0)?,
                    media_type: r.get(1)?,
                    size: r.get(2)?,
                    width: r.get(3)?,
                    height: r.get(4)?,
                    bit_depth: r.get(5)?,
                    format: r.get(6)?,
                    created_ms: r.get(7)?,
                })
            })
            .collect()
            })
        })
        .await
    }

    /// The bytes of one of a token's images, on the calling thread (an image store's loader
    /// runs inside tool code, which is not async). `None` when the token has no such image.
    pub fn image_bytes_blocking(
        &self,
        token_id: String,
        image_id: String,
    ) -> Result<Option<Vec<u8>>, DbError> {
        self.run_sync(false, move |c| {
            Box::pin(async move { image_bytes(c, &token_id, &image_id).await })
        })
    }

    /// The bytes of those of `ids` the token owns (to bring evicted images back before a call).
    pub async fn image_bytes_by_id(
        &self,
        token_id: String,
        ids: Vec<String>,
    ) -> Result<Vec<(String, Vec<u8>)>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                let mut out = Vec::new();
                for id in ids {
                    if let Some(b) = image_bytes(c, &token_id, &id).await? {
                        out.push((id, b));
                    }
                }
                Ok(out)
            })
        })
        .await
    }

    // ---- sessions, runs, messages, events ----

    /// Creates a session owned by `token_id`.
    pub async fn create_session(
        &self,
        token_id: String,
        title: String,
    ) -> Result<SessionRow, DbError> {
        self.run(false, move |c| Box::pin(async move {
            let now = now_ms();
            let row = SessionRow {
                id: new_id("ses"),
                title,
                created_ms: now,
                updated_ms: now,
            };
            c.execute(
                "INSERT INTO sessions (id, token_id, title, created_ms, updated_ms) VALUES (?1, ?2, ?3, ?4, ?4)",
                &args![&row.id, token_id, &row.title, now],
            ).await?;
            Ok(row)
        }))
        .await
    }

    /// A session, if it exists and belongs to the token.
    pub async fn session(
        &self,
        token_id: String,
        id: String,
    ) -> Result<Option<SessionRow>, DbError> {
        self.run(false, move |c| Box::pin(async move {
            c.query_opt(
                "SELECT id, title, created_ms, updated_ms FROM sessions WHERE id = ?1 AND token_id = ?2",
                &args![id, token_id],
            ).await?
            .map(session_row)
            .transpose()
        }))
        .await
    }

    /// The sessions a token owns, oldest first.
    pub async fn list_sessions(&self, token_id: String) -> Result<Vec<SessionRow>, DbError> {
        self.run(false, move |c| Box::pin(async move {
            c.query(
                "SELECT id, title, created_ms, updated_ms FROM sessions WHERE token_id = ?1 ORDER BY created_ms, id",
                &args![token_id],
            ).await?
            .into_iter()
            .map(session_row)
            .collect()
        }))
        .await
    }

    /// A new run, `running` and owned by the server process `owner`.
    pub async fn insert_run(
        &self,
        session_id: String,
        run_id: String,
        question: String,
        images: Vec<String>,
        model: String,
        owner: String,
    ) -> Result<(), DbError> {
        self.run(false, move |c| Box::pin(async move {
            let images =
                serde_json::to_string(&images).map_err(|e| DbError::Corrupt(e.to_string()))?;
            let now = now_ms();
            c.execute(
                "INSERT INTO runs (id, session_id, question, images, model, status, started_ms, owner, heartbeat_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'running', ?6, ?7, ?6)",
                &args![run_id, session_id, question, images, model, now, owner],
            ).await?;
            Ok(())
        }))
        .await
    }

    /// Appends messages of a running run and records its progress, in one transaction.
    pub async fn save_messages(
        &self,
        session_id: String,
        run_id: String,
        messages: Vec<Value>,
        progress: Value,
    ) -> Result<(), DbError> {
        self.run(true, move |c| {
            Box::pin(async move {
                let now = now_ms();
                append_messages(c, &session_id, &run_id, &messages, now).await?;
                c.execute(
                    "UPDATE runs SET progress = ?2 WHERE id = ?1",
                    &args![&run_id, progress.to_string()],
                )
                .await?;
                Ok(())
            })
        })
        .await
    }

    /// Refreshes the heartbeat of the runs `owner` is running. Returns how many it touched.
    pub async fn heartbeat(&self, owner: String) -> Result<u64, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.execute(
                    "UPDATE runs SET heartbeat_ms = ?2 WHERE owner = ?1 AND status = 'running'",
                    &args![owner, now_ms()],
                )
                .await
            })
        })
        .await
    }

    /// Marks `interrupted` the running runs of other processes whose heartbeat is older than
    /// `stale_before` (ms since the epoch): their server died. Returns how many.
    pub async fn interrupt_stale_runs(
        &self,
        owner: String,
        stale_before: i64,
    ) -> Result<u64, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.execute(
                    "UPDATE runs SET status = 'interrupted', finished_ms = ?3,
                        error = 'the server running it stopped; POST .../resume continues it'
                 WHERE status = 'running' AND (owner IS NULL OR owner <> ?1)
                   AND (heartbeat_ms IS NULL OR heartbeat_ms < ?2)",
                    &args![owner, stale_before, now_ms()],
                )
                .await
            })
        })
        .await
    }

    /// Marks one running run `interrupted` (a shutdown stopped it). `Ok(false)` if it was
    /// not running.
    pub async fn interrupt_run(&self, run_id: String, reason: String) -> Result<bool, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                let n = c
                    .execute(
                        "UPDATE runs SET status = 'interrupted', error = ?2, finished_ms = ?3
                 WHERE id = ?1 AND status = 'running'",
                        &args![run_id, reason, now_ms()],
                    )
                    .await?;
                Ok(n > 0)
            })
        })
        .await
    }

    /// Takes an interrupted run of the session for `owner` to continue: `Ok(false)` if it is
    /// not (or no longer) interrupted.
    pub async fn claim_interrupted(
        &self,
        session_id: String,
        run_id: String,
        owner: String,
    ) -> Result<bool, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                let now = now_ms();
                let n = c.execute(
                "UPDATE runs SET status = 'running', owner = ?3, heartbeat_ms = ?4, error = NULL,
                        finished_ms = NULL
                 WHERE id = ?1 AND session_id = ?2 AND status = 'interrupted'",
                &args![run_id, session_id, owner, now],
            ).await?;
                Ok(n > 0)
            })
        })
        .await
    }

    /// What a run stored: its row, progress, messages, finished calls, and the session's
    /// conversation before it. `None` if the run is not the session's.
    pub async fn stored_run(
        &self,
        session_id: String,
        run_id: String,
    ) -> Result<Option<StoredRun>, DbError> {
        self.run(false, move |c| Box::pin(async move {
            let Some(mut r) = c.query_opt(
                "SELECT id, question, images, model, status, answer, error, started_ms, finished_ms, progress
                 FROM runs WHERE id = ?1 AND session_id = ?2",
                &args![&run_id, &session_id],
            ).await?
            else {
                return Ok(None);
            };
            let progress: Option<String> = r.get(9)?;
            let progress = match progress {
                Some(p) => Some(
                    serde_json::from_str(&p)
                        .map_err(|e| DbError::Corrupt(format!("progress of {run_id}: {e}")))?,
                ),
                None => None,
            };
            let run = run_row(r)?;
            let mut first_seq = i64::MAX;
            let mut messages = Vec::new();
            for mut m in c.query(
                "SELECT seq, body FROM messages WHERE session_id = ?1 AND run_id = ?2 ORDER BY seq",
                &args![&session_id, &run_id],
            ).await? {
                let seq: i64 = m.get(0)?;
                first_seq = first_seq.min(seq);
                let body: String = m.get(1)?;
                messages.push(
                    serde_json::from_str(&body)
                        .map_err(|e| DbError::Corrupt(format!("message {seq}: {e}")))?,
                );
            }
            let history = history_rows(c, &session_id, first_seq).await?;
            let mut calls = Vec::new();
            for mut t in c.query(
                "SELECT round, call_id, tool, arguments, ok, error_kind, ms, result
                 FROM tool_calls WHERE run_id = ?1 ORDER BY id",
                &args![&run_id],
            ).await? {
                let round: Option<i64> = t.get(0)?;
                let arguments: String = t.get(3)?;
                let result: String = t.get(7)?;
                calls.push(StoredCall {
                    round: round.unwrap_or(0),
                    call_id: t.get(1)?,
                    tool: t.get(2)?,
                    arguments: serde_json::from_str(&arguments).unwrap_or(Value::String(arguments)),
                    ok: t.get(4)?,
                    error_kind: t.get(5)?,
                    ms: t.get(6)?,
                    result: serde_json::from_str(&result)
                        .map_err(|e| DbError::Corrupt(format!("tool call result: {e}")))?,
                });
            }
            Ok(Some(StoredRun {
                run,
                progress,
                messages,
                history,
                calls,
            }))
        }))
        .await
    }

    /// The session's conversation as a new question sees it: the messages of its finished
    /// (completed or failed) runs, in order.
    pub async fn history(&self, session_id: String) -> Result<Vec<Value>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move { history_rows(c, &session_id, i64::MAX).await })
        })
        .await
    }

    /// Ends a run and appends its new messages, in one transaction.
    pub async fn finish_run(
        &self,
        session_id: String,
        run_id: String,
        status: &'static str,
        answer: Option<String>,
        error: Option<String>,
        new_messages: Vec<Value>,
    ) -> Result<(), DbError> {
        self.run(true, move |c| Box::pin(async move {
            let now = now_ms();
            append_messages(c, &session_id, &run_id, &new_messages, now).await?;
            c.execute(
                "UPDATE runs SET status = ?2, answer = ?3, error = ?4, finished_ms = ?5 WHERE id = ?1",
                &args![run_id.clone(), status, answer, error, now],
            ).await?;
            Ok(())
        }))
        .await
    }

    /// A session's runs, oldest first.
    pub async fn runs(&self, session_id: String) -> Result<Vec<RunRow>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query(
                "SELECT id, question, images, model, status, answer, error, started_ms, finished_ms
                 FROM runs WHERE session_id = ?1 ORDER BY started_ms, id",
                &args![session_id],
            ).await?
            .into_iter()
            .map(run_row)
            .collect()
            })
        })
        .await
    }

    /// A session's conversation, in order.
    pub async fn messages(&self, session_id: String) -> Result<Vec<MessageRow>, DbError> {
        self.run(false, move |c| Box::pin(async move {
            c.query(
                "SELECT seq, run_id, role, body, created_ms FROM messages WHERE session_id = ?1 ORDER BY seq",
                &args![session_id],
            ).await?
            .into_iter()
            .map(|mut r| {
                let seq: i64 = r.get(0)?;
                let body: String = r.get(3)?;
                let message = serde_json::from_str(&body)
                    .map_err(|e| DbError::Corrupt(format!("message {seq}: {e}")))?;
                Ok(MessageRow {
                    seq,
                    run_id: r.get(1)?,
                    role: r.get(2)?,
                    message,
                    created_ms: r.get(4)?,
                })
            })
            .collect()
        }))
        .await
    }

    /// Stores a run's event `seq` (what its stream sent), so a reconnecting client can replay it.
    pub async fn insert_event(
        &self,
        run_id: String,
        seq: i64,
        kind: String,
        body: Value,
    ) -> Result<(), DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.execute(
                    "INSERT INTO events (run_id, seq, type, body) VALUES (?1, ?2, ?3, ?4)",
                    &args![run_id, seq, kind, body.to_string()],
                )
                .await?;
                Ok(())
            })
        })
        .await
    }

    /// Events of a run of the session (none if the run is not the session's).
    pub async fn events(&self, session_id: String, run_id: String) -> Result<Vec<Value>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move {
                c.query(
                    "SELECT e.body FROM events e JOIN runs r ON r.id = e.run_id
                 WHERE e.run_id = ?1 AND r.session_id = ?2 ORDER BY e.seq",
                    &args![run_id, session_id],
                )
                .await?
                .into_iter()
                .map(|mut r| {
                    let body: String = r.get(0)?;
                    serde_json::from_str(&body).map_err(|e| DbError::Corrupt(e.to_string()))
                })
                .collect()
            })
        })
        .await
    }

    // ---- tool calls, artifacts, audit ----

    /// Records a tool call, its artifacts, its audit row and, for a run's call, the tool
    /// message the model reads (`message`), in one transaction.
    pub async fn record_tool_call(
        &self,
        call: ToolCallRecord,
        artifacts: Vec<NewArtifact>,
        audit: AuditEntry,
        message: Option<Value>,
    ) -> Result<(), DbError> {
        self.run(true, move |c| Box::pin(async move {
            let now = now_ms();
            if let (Some(m), Some(session_id), Some(run_id)) =
                (&message, &call.session_id, &call.run_id)
            {
                append_messages(c, session_id, run_id, std::slice::from_ref(m), now).await?;
            }
            c.execute(
                "INSERT INTO tool_calls (token_id, session_id, run_id, call_id, tool, arguments, ok, error_kind, ms, result, created_ms, round)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
                &args![
                    call.token_id, call.session_id, call.run_id, call.call_id, call.tool,
                    call.arguments.to_string(), call.ok, call.error_kind, call.ms,
                    call.result.to_string(), now, call.round
                ],
            ).await?;
            for a in artifacts {
                c.execute(
                    "INSERT INTO artifacts (id, token_id, session_id, run_id, call_id, tool, name, media_type, kind, bytes, created_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                    &args![
                        a.id, a.token_id, a.session_id, a.run_id, a.call_id, a.tool, a.name,
                        a.media_type, a.kind, a.bytes, now
                    ],
                ).await?;
            }
            // Last: on PostgreSQL the audit lock is then held only until the commit.
            insert_audit(c, &audit, now).await
        }))
        .await
    }

    /// Appends one entry to the audit log.
    pub async fn append_audit(&self, entry: AuditEntry) -> Result<(), DbError> {
        self.run(true, move |c| {
            Box::pin(async move { insert_audit(c, &entry, now_ms()).await })
        })
        .await
    }

    /// Artifact metadata of a token, optionally of one session.
    pub async fn list_artifacts(
        &self,
        token_id: String,
        session_id: Option<String>,
    ) -> Result<Vec<ArtifactRow>, DbError> {
        self.run(false, move |c| Box::pin(async move {
            c.query(
                "SELECT id, session_id, run_id, call_id, tool, name, media_type, kind, length(bytes), created_ms
                 FROM artifacts WHERE token_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR session_id = ?2) ORDER BY created_ms, id",
                &args![token_id, session_id],
            ).await?
            .into_iter()
            .map(artifact_row)
            .collect()
        }))
        .await
    }

    /// An artifact and its bytes, if the token owns it.
    pub async fn artifact(
        &self,
        token_id: String,
        id: String,
    ) -> Result<Option<(ArtifactRow, Vec<u8>)>, DbError> {
        self.run(false, move |c| Box::pin(async move {
            c.query_opt(
                "SELECT id, session_id, run_id, call_id, tool, name, media_type, kind, length(bytes), created_ms, bytes
                 FROM artifacts WHERE token_id = ?1 AND id = ?2",
                &args![token_id, id],
            ).await?
            .map(|mut r| {
                let bytes: Vec<u8> = r.get(10)?;
                Ok((artifact_row(r)?, bytes))
            })
            .transpose()
        }))
        .await
    }

    /// Audit rows after `since` (a `seq`), oldest first.
    pub fn audit_since(&self, since: i64, limit: i64) -> Result<Vec<AuditRow>, DbError> {
        self.run_sync(false, move |c| {
            Box::pin(async move { audit_rows(c, since, limit).await })
        })
    }

    /// Audit rows after `since`, on the blocking pool.
    pub async fn audit_since_async(
        &self,
        since: i64,
        limit: i64,
    ) -> Result<Vec<AuditRow>, DbError> {
        self.run(false, move |c| {
            Box::pin(async move { audit_rows(c, since, limit).await })
        })
        .await
    }
}

fn run_row(mut r: Row) -> Result<RunRow, DbError> {
    let images: String = r.get(2)?;
    Ok(RunRow {
        id: r.get(0)?,
        question: r.get(1)?,
        images: serde_json::from_str(&images).unwrap_or_default(),
        model: r.get(3)?,
        status: r.get(4)?,
        answer: r.get(5)?,
        error: r.get(6)?,
        started_ms: r.get(7)?,
        finished_ms: r.get(8)?,
    })
}

/// Appends messages of a run to its session; call inside a transaction. The session's row is
/// updated first so that on PostgreSQL its lock orders runs of one session writing at once on
/// different replicas (message seqs stay unique).
async fn append_messages(
    c: &mut dyn Exec,
    session_id: &str,
    run_id: &str,
    messages: &[Value],
    now: i64,
) -> Result<(), DbError> {
    c.execute(
        "UPDATE sessions SET updated_ms = ?2 WHERE id = ?1",
        &args![session_id, now],
    )
    .await?;
    if messages.is_empty() {
        return Ok(());
    }
    let next: i64 = c
        .query_one(
            "SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = ?1",
            &args![session_id],
        )
        .await?
        .get(0)?;
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("unknown");
        c.execute(
            "INSERT INTO messages (session_id, seq, run_id, role, body, created_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            &args![session_id, next + 1 + i as i64, run_id, role, m.to_string(), now],
        ).await?;
    }
    Ok(())
}

/// Messages of the session's completed runs before `before_seq`, in order: what a question
/// sees of the conversation. Running, cancelled and interrupted runs leave gaps (a decision
/// without its results would confuse a model), and so do failed ones: a run that failed on the
/// model's context (a pasted report, a long tool result) would make every later one fail too.
async fn history_rows(
    c: &mut dyn Exec,
    session_id: &str,
    before_seq: i64,
) -> Result<Vec<Value>, DbError> {
    c.query(
        "SELECT m.seq, m.body FROM messages m JOIN runs r ON r.id = m.run_id
         WHERE m.session_id = ?1 AND m.seq < ?2 AND r.status = 'completed'
         ORDER BY m.seq",
        &args![session_id, before_seq],
    )
    .await?
    .into_iter()
    .map(|mut r| {
        let seq: i64 = r.get(0)?;
        let body: String = r.get(1)?;
        serde_json::from_str(&body).map_err(|e| DbError::Corrupt(format!("message {seq}: {e}")))
    })
    .collect()
}

fn session_row(mut r: Row) -> Result<SessionRow, DbError> {
    Ok(SessionRow {
        id: r.get(0)?,
        title: r.get(1)?,
        created_ms: r.get(2)?,
        updated_ms: r.get(3)?,
    })
}

fn artifact_row(mut r: Row) -> Result<ArtifactRow, DbError> {
    Ok(ArtifactRow {
        id: r.get(0)?,
        session_id: r.get(1)?,
        run_id: r.get(2)?,
        call_id: r.get(3)?,
        tool: r.get(4)?,
        name: r.get(5)?,
        media_type: r.get(6)?,
        kind: r.get(7)?,
        size: r.get(8)?,
        created_ms: r.get(9)?,
    })
}

async fn audit_rows(c: &mut dyn Exec, since: i64, limit: i64) -> Result<Vec<AuditRow>, DbError> {
    c.query(
        "SELECT seq, ts_ms, actor, session_id, run_id, kind, name, arguments, outcome, duration_ms
         FROM audit WHERE seq > ?1 ORDER BY seq LIMIT ?2",
        &args![since, limit],
    )
    .await?
    .into_iter()
    .map(|mut r| {
        let args: String = r.get(7)?;
        Ok(AuditRow {
            seq: r.get(0)?,
            ts_ms: r.get(1)?,
            actor: r.get(2)?,
            session_id: r.get(3)?,
            run_id: r.get(4)?,
            kind: r.get(5)?,
            name: r.get(6)?,
            arguments: serde_json::from_str(&args).unwrap_or(Value::Null),
            outcome: r.get(8)?,
            duration_ms: r.get(9)?,
        })
    })
    .collect()
}

/// Appends an audit row; call inside a transaction. On PostgreSQL appends take a lock held
/// to the commit, so rows become visible in `seq` order and an export that resumes after a
/// seq never skips a row committed later by another replica.
async fn insert_audit(c: &mut dyn Exec, a: &AuditEntry, now: i64) -> Result<(), DbError> {
    if c.engine() == Engine::Postgres {
        c.execute("SELECT pg_advisory_xact_lock(?1)", &args![AUDIT_LOCK])
            .await?;
    }
    c.execute(
        "INSERT INTO audit (ts_ms, actor, session_id, run_id, kind, name, arguments, outcome, duration_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        &args![
            now,
            &a.actor,
            a.session_id.clone(),
            a.run_id.clone(),
            a.kind,
            &a.name,
            a.arguments.to_string(),
            &a.outcome,
            a.duration_ms
        ],
    ).await?;
    Ok(())
}

async fn image_bytes(
    c: &mut dyn Exec,
    token_id: &str,
    image_id: &str,
) -> Result<Option<Vec<u8>>, DbError> {
    let rows = c
        .query(
            "SELECT bytes FROM images WHERE token_id = ?1 AND image_id = ?2",
            &args![token_id, image_id],
        )
        .await?;
    match rows.into_iter().next() {
        Some(mut r) => Ok(Some(r.get(0)?)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> AuditEntry {
        AuditEntry {
            actor: "tok_x".into(),
            session_id: None,
            run_id: None,
            kind: "tool_call",
            name: "image_info".into(),
            arguments: serde_json::json!({"image": "img_abc"}),
            outcome: "ok".into(),
            duration_ms: 1.0,
        }
    }

    #[test]
    fn audit_rows_cannot_be_changed_or_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Db::open_path(&dir.path().join("a.db")).expect("open");
        db.run_sync(true, |c| {
            Box::pin(async move { insert_audit(c, &entry(), 1).await })
        })
        .expect("insert");
        let upd = db.execute_sql("UPDATE audit SET outcome = 'x'");
        assert!(upd.is_err(), "update must be refused");
        let del = db.execute_sql("DELETE FROM audit");
        assert!(del.is_err(), "delete must be refused");
        assert_eq!(db.audit_since(0, 10).expect("read").len(), 1);
    }

    #[test]
    fn reopening_does_not_rerun_migrations() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("m.db");
        let db = Db::open_path(&path).expect("open");
        let (id, secret) = db.create_token("alice", false).expect("token");
        drop(db);
        let db = Db::open_path(&path).expect("reopen");
        let hash = hash_token(&secret);
        let found: String = db
            .run_sync(false, move |c| {
                Box::pin(async move {
                    c.query_one("SELECT id FROM tokens WHERE hash = ?1", &args![hash])
                        .await?
                        .get(0)
                })
            })
            .expect("lookup");
        assert_eq!(found, id);
        // The secret itself is nowhere in the file.
        let raw = std::fs::read(&path).expect("read db");
        let needle = secret.as_bytes();
        assert!(!raw.windows(needle.len()).any(|w| w == needle));
    }

    #[test]
    fn database_urls() {
        assert_eq!(
            parse_url("sqlite://a/b.db").expect("sqlite"),
            DbUrl::Sqlite("a/b.db".into())
        );
        assert_eq!(
            parse_url("b.db").expect("path"),
            DbUrl::Sqlite("b.db".into())
        );
        assert!(matches!(
            parse_url("postgresql://u@127.0.0.1:5432/h"),
            Ok(DbUrl::Postgres(_))
        ));
        let err = match Db::open("mysql://root:pw@localhost/hilum") {
            Err(e) => e.to_string(),
            Ok(_) => panic!("mysql must be refused"),
        };
        assert!(
            err.contains("sqlite://PATH") && err.contains("postgres://"),
            "{err}"
        );
        assert!(!err.contains("pw"), "no password in messages: {err}");
    }

    #[test]
    fn an_unreachable_postgres_names_the_fix_without_the_password() {
        // Port 1 on loopback: nothing listens there.
        let err = match Db::open("postgres://hilum:topsecret@127.0.0.1:1/hilum?connect_timeout=5") {
            Err(e) => e.to_string(),
            Ok(_) => panic!("nothing listens on port 1"),
        };
        assert!(err.contains("setup_postgres.sh"), "{err}");
        assert!(!err.contains("topsecret"), "{err}");
    }
}
