//! Persistence in SQLite: tokens, images, sessions, runs, messages, events, tool calls,
//! artifacts and the append-only audit log. Every write is committed before the server
//! acknowledges it, so a restart loses nothing that a client was told had happened.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use thiserror::Error;

/// Migrations in order; the version of each is its position + 1.
const MIGRATIONS: &[&str] = &[include_str!("../migrations/0001_init.sql")];

#[derive(Debug, Error)]
pub enum DbError {
    #[error("unsupported database URL `{0}`: use sqlite://PATH (PostgreSQL is not supported by this build yet)")]
    UnsupportedUrl(String),
    #[error("cannot open the database {path}: {reason} (check the path and its permissions)")]
    Open { path: String, reason: String },
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("database task failed: {0}")]
    Task(String),
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

/// Where the database lives, parsed from `--db`.
pub fn sqlite_path(url: &str) -> Result<PathBuf, DbError> {
    if let Some(rest) = url.strip_prefix("sqlite://") {
        Ok(PathBuf::from(rest))
    } else if let Some(rest) = url.strip_prefix("sqlite:") {
        Ok(PathBuf::from(rest))
    } else if url.contains("://") {
        Err(DbError::UnsupportedUrl(url.to_string()))
    } else {
        Ok(PathBuf::from(url))
    }
}

/// The caller behind a bearer token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub token_id: String,
    pub name: String,
    pub admin: bool,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ImageRow {
    pub id: String,
    pub media_type: String,
    pub size: i64,
    pub width: i64,
    pub height: i64,
    pub bit_depth: i64,
    pub format: String,
    pub created_ms: i64,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct SessionRow {
    pub id: String,
    pub title: String,
    pub created_ms: i64,
    pub updated_ms: i64,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct RunRow {
    pub id: String,
    pub question: String,
    pub images: Vec<String>,
    pub model: String,
    /// `running`, `completed`, `failed` or `cancelled`.
    pub status: String,
    pub answer: Option<String>,
    pub error: Option<String>,
    pub started_ms: i64,
    pub finished_ms: Option<i64>,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct MessageRow {
    pub seq: i64,
    pub run_id: String,
    pub role: String,
    /// The message as the model saw it (`role`, `content`, `tool_calls`, …).
    #[schema(value_type = Object)]
    pub message: Value,
    pub created_ms: i64,
}

#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ArtifactRow {
    pub id: String,
    pub session_id: Option<String>,
    pub run_id: Option<String>,
    pub call_id: String,
    pub tool: String,
    pub name: String,
    pub media_type: String,
    pub kind: String,
    pub size: i64,
    pub created_ms: i64,
}

/// One row of the audit log.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct AuditRow {
    pub seq: i64,
    pub ts_ms: i64,
    /// The token id (never the token) that acted.
    pub actor: String,
    pub session_id: Option<String>,
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
    pub duration_ms: f64,
}

/// What is appended to the audit log.
#[derive(Clone, Debug)]
pub struct AuditEntry {
    pub actor: String,
    pub session_id: Option<String>,
    pub run_id: Option<String>,
    pub kind: &'static str,
    pub name: String,
    pub arguments: Value,
    pub outcome: String,
    pub duration_ms: f64,
}

/// A tool call to record.
#[derive(Clone, Debug)]
pub struct ToolCallRecord {
    pub token_id: String,
    pub session_id: Option<String>,
    pub run_id: Option<String>,
    pub call_id: String,
    pub tool: String,
    pub arguments: Value,
    pub ok: bool,
    pub error_kind: Option<String>,
    pub ms: f64,
    pub result: Value,
}

/// An artifact to store.
#[derive(Clone, Debug)]
pub struct NewArtifact {
    pub id: String,
    pub token_id: String,
    pub session_id: Option<String>,
    pub run_id: Option<String>,
    pub call_id: String,
    pub tool: String,
    pub name: String,
    pub media_type: String,
    pub kind: String,
    pub bytes: Vec<u8>,
}

/// The database. Cheap to clone; calls run on the blocking pool, one at a time.
#[derive(Clone)]
pub struct Db {
    conn: Arc<Mutex<Connection>>,
}

impl Db {
    /// Opens (creating if needed) and migrates the database at `url`.
    pub fn open(url: &str) -> Result<Db, DbError> {
        let path = sqlite_path(url)?;
        Self::open_path(&path)
    }

    pub fn open_path(path: &Path) -> Result<Db, DbError> {
        let open_err = |e: &dyn std::fmt::Display| DbError::Open {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| open_err(&e))?;
        }
        let conn = Connection::open(path).map_err(|e| open_err(&e))?;
        // WAL lets readers proceed during writes; FULL syncs each commit so an acknowledged
        // write survives a crash of the machine, not only of the process.
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        migrate(&conn)?;
        Ok(Db {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    /// Runs `f` with the connection on the blocking pool.
    pub async fn call<R, F>(&self, f: F) -> Result<R, DbError>
    where
        F: FnOnce(&mut Connection) -> Result<R, DbError> + Send + 'static,
        R: Send + 'static,
    {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut guard)
        })
        .await
        .map_err(|e| DbError::Task(e.to_string()))?
    }

    /// Runs `f` on the calling thread (for the CLI's one-shot commands).
    pub fn call_sync<R>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<R, DbError>,
    ) -> Result<R, DbError> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    // ---- tokens ----

    /// Creates a token and returns `(token id, secret)`. The secret is shown once and
    /// stored only as its hash.
    pub fn create_token(&self, name: &str, admin: bool) -> Result<(String, String), DbError> {
        let id = new_id("tok");
        let secret = format!("hlm_{}", hex::encode(rand::random::<[u8; 32]>()));
        let hash = hash_token(&secret);
        let name = name.to_string();
        let id2 = id.clone();
        self.call_sync(move |c| {
            c.execute(
                "INSERT INTO tokens (id, name, hash, admin, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)",
                params![id2, name, hash, admin as i64, now_ms()],
            )?;
            Ok(())
        })?;
        Ok((id, secret))
    }

    pub async fn caller_for_hash(&self, hash: String) -> Result<Option<Caller>, DbError> {
        self.call(move |c| {
            Ok(c.query_row(
                "SELECT id, name, admin FROM tokens WHERE hash = ?1 AND revoked_ms IS NULL",
                params![hash],
                |r| {
                    Ok(Caller {
                        token_id: r.get(0)?,
                        name: r.get(1)?,
                        admin: r.get::<_, i64>(2)? != 0,
                    })
                },
            )
            .optional()?)
        })
        .await
    }

    // ---- images ----

    pub async fn insert_image(
        &self,
        token_id: String,
        row: ImageRow,
        bytes: Vec<u8>,
    ) -> Result<(), DbError> {
        self.call(move |c| {
            c.execute(
                "INSERT OR IGNORE INTO images (token_id, image_id, media_type, size, width, height, bit_depth, format, bytes, created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
                params![
                    token_id, row.id, row.media_type, row.size, row.width, row.height,
                    row.bit_depth, row.format, bytes, row.created_ms
                ],
            )?;
            Ok(())
        })
        .await
    }

    pub async fn list_images(&self, token_id: String) -> Result<Vec<ImageRow>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare(
                "SELECT image_id, media_type, size, width, height, bit_depth, format, created_ms
                 FROM images WHERE token_id = ?1 ORDER BY created_ms, image_id",
            )?;
            let rows = st
                .query_map(params![token_id], |r| {
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
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .await
    }

    /// The bytes of every image a token owns (to rebuild its image store after a restart).
    pub async fn image_bytes_of(
        &self,
        token_id: String,
    ) -> Result<Vec<(String, Vec<u8>)>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare("SELECT image_id, bytes FROM images WHERE token_id = ?1")?;
            let rows = st
                .query_map(params![token_id], |r| Ok((r.get(0)?, r.get(1)?)))?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .await
    }

    // ---- sessions, runs, messages, events ----

    pub async fn create_session(
        &self,
        token_id: String,
        title: String,
    ) -> Result<SessionRow, DbError> {
        self.call(move |c| {
            let now = now_ms();
            let row = SessionRow {
                id: new_id("ses"),
                title,
                created_ms: now,
                updated_ms: now,
            };
            c.execute(
                "INSERT INTO sessions (id, token_id, title, created_ms, updated_ms) VALUES (?1, ?2, ?3, ?4, ?4)",
                params![row.id, token_id, row.title, now],
            )?;
            Ok(row)
        })
        .await
    }

    /// A session, if it exists and belongs to the token.
    pub async fn session(
        &self,
        token_id: String,
        id: String,
    ) -> Result<Option<SessionRow>, DbError> {
        self.call(move |c| {
            Ok(c.query_row(
                "SELECT id, title, created_ms, updated_ms FROM sessions WHERE id = ?1 AND token_id = ?2",
                params![id, token_id],
                |r| {
                    Ok(SessionRow {
                        id: r.get(0)?,
                        title: r.get(1)?,
                        created_ms: r.get(2)?,
                        updated_ms: r.get(3)?,
                    })
                },
            )
            .optional()?)
        })
        .await
    }

    pub async fn list_sessions(&self, token_id: String) -> Result<Vec<SessionRow>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare(
                "SELECT id, title, created_ms, updated_ms FROM sessions WHERE token_id = ?1 ORDER BY created_ms, id",
            )?;
            let rows = st
                .query_map(params![token_id], |r| {
                    Ok(SessionRow {
                        id: r.get(0)?,
                        title: r.get(1)?,
                        created_ms: r.get(2)?,
                        updated_ms: r.get(3)?,
                    })
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .await
    }

    pub async fn insert_run(
        &self,
        session_id: String,
        run_id: String,
        question: String,
        images: Vec<String>,
        model: String,
    ) -> Result<(), DbError> {
        self.call(move |c| {
            let images =
                serde_json::to_string(&images).map_err(|e| DbError::Corrupt(e.to_string()))?;
            c.execute(
                "INSERT INTO runs (id, session_id, question, images, model, status, started_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'running', ?6)",
                params![run_id, session_id, question, images, model, now_ms()],
            )?;
            Ok(())
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
        self.call(move |c| {
            let tx = c.transaction()?;
            let now = now_ms();
            tx.execute(
                "UPDATE runs SET status = ?2, answer = ?3, error = ?4, finished_ms = ?5 WHERE id = ?1",
                params![run_id, status, answer, error, now],
            )?;
            let next: i64 = tx.query_row(
                "SELECT COALESCE(MAX(seq), 0) FROM messages WHERE session_id = ?1",
                params![session_id],
                |r| r.get(0),
            )?;
            for (i, m) in new_messages.iter().enumerate() {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("unknown");
                tx.execute(
                    "INSERT INTO messages (session_id, seq, run_id, role, body, created_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                    params![session_id, next + 1 + i as i64, run_id, role, m.to_string(), now],
                )?;
            }
            tx.execute(
                "UPDATE sessions SET updated_ms = ?2 WHERE id = ?1",
                params![session_id, now],
            )?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    pub async fn runs(&self, session_id: String) -> Result<Vec<RunRow>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare(
                "SELECT id, question, images, model, status, answer, error, started_ms, finished_ms
                 FROM runs WHERE session_id = ?1 ORDER BY started_ms, id",
            )?;
            let rows = st
                .query_map(params![session_id], |r| {
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
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .await
    }

    pub async fn messages(&self, session_id: String) -> Result<Vec<MessageRow>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare(
                "SELECT seq, run_id, role, body, created_ms FROM messages WHERE session_id = ?1 ORDER BY seq",
            )?;
            let rows = st
                .query_map(params![session_id], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get::<_, String>(3)?, r.get(4)?))
                })?
                .collect::<Result<Vec<(i64, String, String, String, i64)>, _>>()?;
            rows.into_iter()
                .map(|(seq, run_id, role, body, created_ms)| {
                    let message = serde_json::from_str(&body)
                        .map_err(|e| DbError::Corrupt(format!("message {seq}: {e}")))?;
                    Ok(MessageRow {
                        seq,
                        run_id,
                        role,
                        message,
                        created_ms,
                    })
                })
                .collect()
        })
        .await
    }

    pub async fn insert_event(
        &self,
        run_id: String,
        seq: i64,
        kind: String,
        body: Value,
    ) -> Result<(), DbError> {
        self.call(move |c| {
            c.execute(
                "INSERT INTO events (run_id, seq, type, body) VALUES (?1, ?2, ?3, ?4)",
                params![run_id, seq, kind, body.to_string()],
            )?;
            Ok(())
        })
        .await
    }

    /// Events of a run of the session (none if the run is not the session's).
    pub async fn events(&self, session_id: String, run_id: String) -> Result<Vec<Value>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare(
                "SELECT e.body FROM events e JOIN runs r ON r.id = e.run_id
                 WHERE e.run_id = ?1 AND r.session_id = ?2 ORDER BY e.seq",
            )?;
            let rows = st
                .query_map(params![run_id, session_id], |r| r.get::<_, String>(0))?
                .collect::<Result<Vec<_>, _>>()?;
            rows.iter()
                .map(|b| serde_json::from_str(b).map_err(|e| DbError::Corrupt(e.to_string())))
                .collect()
        })
        .await
    }

    // ---- tool calls, artifacts, audit ----

    /// Records a tool call, its artifacts and its audit row in one transaction.
    pub async fn record_tool_call(
        &self,
        call: ToolCallRecord,
        artifacts: Vec<NewArtifact>,
        audit: AuditEntry,
    ) -> Result<(), DbError> {
        self.call(move |c| {
            let tx = c.transaction()?;
            let now = now_ms();
            tx.execute(
                "INSERT INTO tool_calls (token_id, session_id, run_id, call_id, tool, arguments, ok, error_kind, ms, result, created_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    call.token_id, call.session_id, call.run_id, call.call_id, call.tool,
                    call.arguments.to_string(), call.ok as i64, call.error_kind, call.ms,
                    call.result.to_string(), now
                ],
            )?;
            for a in &artifacts {
                tx.execute(
                    "INSERT INTO artifacts (id, token_id, session_id, run_id, call_id, tool, name, media_type, kind, bytes, created_ms)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                    params![
                        a.id, a.token_id, a.session_id, a.run_id, a.call_id, a.tool, a.name,
                        a.media_type, a.kind, a.bytes, now
                    ],
                )?;
            }
            insert_audit(&tx, &audit, now)?;
            tx.commit()?;
            Ok(())
        })
        .await
    }

    pub async fn append_audit(&self, entry: AuditEntry) -> Result<(), DbError> {
        self.call(move |c| insert_audit(c, &entry, now_ms())).await
    }

    /// Artifact metadata of a token, optionally of one session.
    pub async fn list_artifacts(
        &self,
        token_id: String,
        session_id: Option<String>,
    ) -> Result<Vec<ArtifactRow>, DbError> {
        self.call(move |c| {
            let mut st = c.prepare(
                "SELECT id, session_id, run_id, call_id, tool, name, media_type, kind, length(bytes), created_ms
                 FROM artifacts WHERE token_id = ?1 AND (?2 IS NULL OR session_id = ?2) ORDER BY created_ms, id",
            )?;
            let rows = st
                .query_map(params![token_id, session_id], artifact_row)?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
        .await
    }

    /// An artifact and its bytes, if the token owns it.
    pub async fn artifact(
        &self,
        token_id: String,
        id: String,
    ) -> Result<Option<(ArtifactRow, Vec<u8>)>, DbError> {
        self.call(move |c| {
            Ok(c.query_row(
                "SELECT id, session_id, run_id, call_id, tool, name, media_type, kind, length(bytes), created_ms, bytes
                 FROM artifacts WHERE token_id = ?1 AND id = ?2",
                params![token_id, id],
                |r| Ok((artifact_row(r)?, r.get(10)?)),
            )
            .optional()?)
        })
        .await
    }

    /// Audit rows after `since` (a `seq`), oldest first.
    pub fn audit_since(&self, since: i64, limit: i64) -> Result<Vec<AuditRow>, DbError> {
        self.call_sync(|c| {
            let mut st = c.prepare(
                "SELECT seq, ts_ms, actor, session_id, run_id, kind, name, arguments, outcome, duration_ms
                 FROM audit WHERE seq > ?1 ORDER BY seq LIMIT ?2",
            )?;
            let rows = st
                .query_map(params![since, limit], |r| {
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
                })?
                .collect::<Result<Vec<_>, _>>()?;
            Ok(rows)
        })
    }

    /// Audit rows after `since`, on the blocking pool.
    pub async fn audit_since_async(
        &self,
        since: i64,
        limit: i64,
    ) -> Result<Vec<AuditRow>, DbError> {
        let db = self.clone();
        tokio::task::spawn_blocking(move || db.audit_since(since, limit))
            .await
            .map_err(|e| DbError::Task(e.to_string()))?
    }
}

fn artifact_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ArtifactRow> {
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

fn insert_audit(c: &Connection, a: &AuditEntry, now: i64) -> Result<(), DbError> {
    c.execute(
        "INSERT INTO audit (ts_ms, actor, session_id, run_id, kind, name, arguments, outcome, duration_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![
            now,
            a.actor,
            a.session_id,
            a.run_id,
            a.kind,
            a.name,
            a.arguments.to_string(),
            a.outcome,
            a.duration_ms
        ],
    )?;
    Ok(())
}

fn migrate(conn: &Connection) -> Result<(), DbError> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_ms INTEGER NOT NULL)",
    )?;
    let current: i64 = conn.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
        [],
        |r| r.get(0),
    )?;
    for (i, sql) in MIGRATIONS.iter().enumerate() {
        let version = i as i64 + 1;
        if version <= current {
            continue;
        }
        conn.execute_batch(&format!(
            "BEGIN; {sql}; INSERT INTO schema_migrations (version, applied_ms) VALUES ({version}, {}); COMMIT;",
            now_ms()
        ))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_rows_cannot_be_changed_or_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Db::open_path(&dir.path().join("a.db")).expect("open");
        let entry = AuditEntry {
            actor: "tok_x".into(),
            session_id: None,
            run_id: None,
            kind: "tool_call",
            name: "image_info".into(),
            arguments: serde_json::json!({"image": "img_abc"}),
            outcome: "ok".into(),
            duration_ms: 1.0,
        };
        db.call_sync(|c| insert_audit(c, &entry, 1))
            .expect("insert");
        let upd = db.call_sync(|c| Ok(c.execute("UPDATE audit SET outcome = 'x'", [])?));
        assert!(upd.is_err(), "update must be refused");
        let del = db.call_sync(|c| Ok(c.execute("DELETE FROM audit", [])?));
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
        let found = db
            .call_sync(move |c| {
                Ok(c.query_row(
                    "SELECT id FROM tokens WHERE hash = ?1",
                    params![hash],
                    |r| r.get::<_, String>(0),
                )?)
            })
            .expect("lookup");
        assert_eq!(found, id);
        // The secret itself is nowhere in the file.
        let raw = std::fs::read(&path).expect("read db");
        let needle = secret.as_bytes();
        assert!(!raw.windows(needle.len()).any(|w| w == needle));
    }

    #[test]
    fn postgres_urls_are_refused_with_a_clear_message() {
        let err = match Db::open("postgres://localhost/hilum") {
            Err(e) => e.to_string(),
            Ok(_) => panic!("postgres must be refused"),
        };
        assert!(err.contains("sqlite://PATH"), "{err}");
    }
}
