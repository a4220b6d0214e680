//! The two database engines behind [`super::Db`]: SQLite (one connection, rusqlite, on
//! tokio's blocking pool) and PostgreSQL (tokio-postgres on the server's runtime, pooled by
//! deadpool, TLS by rustls). Both are driven through the async [`Exec`], so every query of
//! the server is written once, with `?1`-style placeholders that become `$1` for PostgreSQL.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use bytes::BytesMut;
use deadpool_postgres::{
    Client, GenericClient, Manager, ManagerConfig, Pool, PoolError, RecyclingMethod,
};
use rusqlite::types::{ToSqlOutput, ValueRef};
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql as PgToSql, Type};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::tls::{self, SslMode};
use super::{now_ms, DbError};

/// One schema version in both dialects. The version list is this one list.
struct Migration {
    version: i64,
    sqlite: &'static str,
    postgres: &'static str,
}

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        sqlite: include_str!("../../migrations/0001_init.sql"),
        postgres: include_str!("../../migrations/postgres/0001_init.sql"),
    },
    Migration {
        version: 2,
        sqlite: include_str!("../../migrations/0002_durable_runs.sql"),
        postgres: include_str!("../../migrations/postgres/0002_durable_runs.sql"),
    },
    Migration {
        version: 3,
        sqlite: include_str!("../../migrations/0003_pacs.sql"),
        postgres: include_str!("../../migrations/postgres/0003_pacs.sql"),
    },
];

/// Serialises migrations of replicas starting at once, and audit appends (so that audit
/// `seq` order is commit order and an export `since` a seq never misses a later commit).
const MIGRATION_LOCK: i64 = 0x6869_6c75_6d01;
pub(super) const AUDIT_LOCK: i64 = 0x6869_6c75_6d02;

/// Connections one server keeps open to PostgreSQL at most.
const PG_MAX_CONNECTIONS: usize = 16;

// ---- values ----

/// A query parameter.
#[derive(Clone, Debug)]
pub(crate) enum P {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

impl From<i64> for P {
    fn from(v: i64) -> Self {
        P::Int(v)
    }
}
impl From<bool> for P {
    fn from(v: bool) -> Self {
        P::Int(v as i64)
    }
}
impl From<f64> for P {
    fn from(v: f64) -> Self {
        P::Real(v)
    }
}
impl From<String> for P {
    fn from(v: String) -> Self {
        P::Text(v)
    }
}
impl From<&String> for P {
    fn from(v: &String) -> Self {
        P::Text(v.clone())
    }
}
impl From<&str> for P {
    fn from(v: &str) -> Self {
        P::Text(v.to_string())
    }
}
impl From<Vec<u8>> for P {
    fn from(v: Vec<u8>) -> Self {
        P::Blob(v)
    }
}
impl<T: Into<P>> From<Option<T>> for P {
    fn from(v: Option<T>) -> Self {
        v.map_or(P::Null, Into::into)
    }
}

/// Parameters of a query: `args![a, b, c]`.
macro_rules! args {
    ($($x:expr),* $(,)?) => { [$($crate::db::backend::P::from($x)),*] };
}
pub(crate) use args;

impl rusqlite::ToSql for P {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self {
            P::Null => ValueRef::Null,
            P::Int(v) => ValueRef::Integer(*v),
            P::Real(v) => ValueRef::Real(*v),
            P::Text(s) => ValueRef::Text(s.as_bytes()),
            P::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

impl PgToSql for P {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            P::Null => Ok(IsNull::Yes),
            P::Int(v) => match *ty {
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                Type::FLOAT8 => (*v as f64).to_sql(ty, out),
                Type::BOOL => (*v != 0).to_sql(ty, out),
                _ => v.to_sql(ty, out),
            },
            P::Real(v) => match *ty {
                Type::FLOAT4 => (*v as f32).to_sql(ty, out),
                _ => v.to_sql(ty, out),
            },
            P::Text(s) => s.as_str().to_sql(ty, out),
            P::Blob(b) => b.as_slice().to_sql(ty, out),
        }
    }

    // Each value checks the column type in `to_sql`; NULL fits any column.
    fn accepts(_ty: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

/// One value of a result row.
#[derive(Clone, Debug)]
pub(crate) enum Cell {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

/// A result row; values are taken out by index with [`Row::get`].
pub(crate) struct Row(Vec<Cell>);

pub(crate) trait FromCell: Sized {
    fn from_cell(c: Cell) -> Result<Self, String>;
}

impl FromCell for i64 {
    fn from_cell(c: Cell) -> Result<Self, String> {
        match c {
            Cell::Int(v) => Ok(v),
            other => Err(format!("expected an integer, found {other:?}")),
        }
    }
}
impl FromCell for bool {
    fn from_cell(c: Cell) -> Result<Self, String> {
        i64::from_cell(c).map(|v| v != 0)
    }
}
impl FromCell for f64 {
    fn from_cell(c: Cell) -> Result<Self, String> {
        match c {
            Cell::Real(v) => Ok(v),
            Cell::Int(v) => Ok(v as f64),
            other => Err(format!("expected a number, found {other:?}")),
        }
    }
}
impl FromCell for String {
    fn from_cell(c: Cell) -> Result<Self, String> {
        match c {
            Cell::Text(s) => Ok(s),
            other => Err(format!("expected text, found {other:?}")),
        }
    }
}
impl FromCell for Vec<u8> {
    fn from_cell(c: Cell) -> Result<Self, String> {
        match c {
            Cell::Blob(b) => Ok(b),
            Cell::Text(s) => Ok(s.into_bytes()),
            other => Err(format!("expected bytes, found {other:?}")),
        }
    }
}
impl<T: FromCell> FromCell for Option<T> {
    fn from_cell(c: Cell) -> Result<Self, String> {
        match c {
            Cell::Null => Ok(None),
            c => T::from_cell(c).map(Some),
        }
    }
}

impl Row {
    /// Takes column `i` out of the row as a `T`.
    pub(crate) fn get<T: FromCell>(&mut self, i: usize) -> Result<T, DbError> {
        let cell = self
            .0
            .get_mut(i)
            .map(|c| std::mem::replace(c, Cell::Null))
            .ok_or_else(|| DbError::Corrupt(format!("result has no column {i}")))?;
        T::from_cell(cell).map_err(|e| DbError::Corrupt(format!("column {i}: {e}")))
    }
}

// ---- executing ----

/// What a query needs from a connection or transaction of either engine.
#[async_trait]
pub(crate) trait Exec: Send {
    /// Runs a statement; returns the number of rows changed.
    async fn execute(&mut self, sql: &str, args: &[P]) -> Result<u64, DbError>;
    async fn query(&mut self, sql: &str, args: &[P]) -> Result<Vec<Row>, DbError>;
    /// `sqlite` or `postgres`, for the few statements that differ.
    fn engine(&self) -> Engine;

    async fn query_opt(&mut self, sql: &str, args: &[P]) -> Result<Option<Row>, DbError> {
        Ok(self.query(sql, args).await?.into_iter().next())
    }

    async fn query_one(&mut self, sql: &str, args: &[P]) -> Result<Row, DbError> {
        self.query_opt(sql, args)
            .await?
            .ok_or_else(|| DbError::Corrupt("the query returned no row".into()))
    }
}

/// The work of one `Db` call on one connection: `|c| Box::pin(async move { ... })`.
pub(crate) type Job<'c, R> = Pin<Box<dyn Future<Output = Result<R, DbError>> + Send + 'c>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    Sqlite,
    Postgres,
}

/// The SQLite connection, seen through [`Exec`]. Its futures never wait: each query runs to
/// the end when first polled.
pub(crate) struct SqliteExec<'a>(&'a mut rusqlite::Connection);

#[async_trait]
impl Exec for SqliteExec<'_> {
    async fn execute(&mut self, sql: &str, args: &[P]) -> Result<u64, DbError> {
        let mut st = self.0.prepare_cached(sql)?;
        Ok(st.execute(rusqlite::params_from_iter(args.iter()))? as u64)
    }

    async fn query(&mut self, sql: &str, args: &[P]) -> Result<Vec<Row>, DbError> {
        let mut st = self.0.prepare_cached(sql)?;
        let n = st.column_count();
        let mut rows = st.query(rusqlite::params_from_iter(args.iter()))?;
        let mut out = Vec::new();
        while let Some(r) = rows.next()? {
            let mut cells = Vec::with_capacity(n);
            for i in 0..n {
                cells.push(match r.get_ref(i)? {
                    ValueRef::Null => Cell::Null,
                    ValueRef::Integer(v) => Cell::Int(v),
                    ValueRef::Real(v) => Cell::Real(v),
                    ValueRef::Text(t) => Cell::Text(String::from_utf8_lossy(t).into_owned()),
                    ValueRef::Blob(b) => Cell::Blob(b.to_vec()),
                });
            }
            out.push(Row(cells));
        }
        Ok(out)
    }

    fn engine(&self) -> Engine {
        Engine::Sqlite
    }
}

/// Runs `job` on the SQLite connection, in one transaction if `tx`. Blocking (the job's
/// futures complete when first polled).
pub(crate) fn run_sqlite<R>(
    conn: &mut rusqlite::Connection,
    tx: bool,
    job: impl for<'c> FnOnce(&'c mut dyn Exec) -> Job<'c, R>,
) -> Result<R, DbError> {
    // A job that panicked mid-transaction left it open: end it before anything else.
    if !conn.is_autocommit() {
        conn.execute_batch("ROLLBACK")?;
    }
    if !tx {
        return futures::executor::block_on(job(&mut SqliteExec(conn)));
    }
    // BEGIN/COMMIT by hand: rusqlite's `Transaction` borrows the connection shared, which
    // is not `Send`, and every `Exec` must be.
    conn.execute_batch("BEGIN")?;
    let result = futures::executor::block_on(job(&mut SqliteExec(conn))).and_then(|r| {
        conn.execute_batch("COMMIT")
            .map(|()| r)
            .map_err(DbError::from)
    });
    if result.is_err() && !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    result
}

/// `?1` → `$1`: the server's queries use SQLite's numbered placeholders, which PostgreSQL
/// spells with a dollar. (None of the queries has a `?` inside a string literal.)
fn pg_sql(sql: &str) -> String {
    sql.replace('?', "$")
}

/// A pooled PostgreSQL connection or a transaction on it, seen through [`Exec`]; statements
/// are prepared once per connection (deadpool's statement cache).
pub(crate) struct PgExec<'a, C: GenericClient>(&'a C);

fn pg_params(args: &[P]) -> Vec<&(dyn PgToSql + Sync)> {
    args.iter().map(|a| a as &(dyn PgToSql + Sync)).collect()
}

#[async_trait]
impl<C: GenericClient> Exec for PgExec<'_, C> {
    async fn execute(&mut self, sql: &str, args: &[P]) -> Result<u64, DbError> {
        let st = self.0.prepare_cached(&pg_sql(sql)).await?;
        Ok(self.0.execute(&st, &pg_params(args)).await?)
    }

    async fn query(&mut self, sql: &str, args: &[P]) -> Result<Vec<Row>, DbError> {
        let st = self.0.prepare_cached(&pg_sql(sql)).await?;
        let rows = self.0.query(&st, &pg_params(args)).await?;
        rows.iter().map(pg_row).collect()
    }

    fn engine(&self) -> Engine {
        Engine::Postgres
    }
}

fn pg_row(r: &tokio_postgres::Row) -> Result<Row, DbError> {
    let mut cells = Vec::with_capacity(r.len());
    for (i, col) in r.columns().iter().enumerate() {
        let ty = col.type_();
        let cell = match *ty {
            Type::INT8 => r.try_get::<_, Option<i64>>(i)?.map(Cell::Int),
            Type::INT4 => r.try_get::<_, Option<i32>>(i)?.map(|v| Cell::Int(v.into())),
            Type::INT2 => r.try_get::<_, Option<i16>>(i)?.map(|v| Cell::Int(v.into())),
            Type::BOOL => r
                .try_get::<_, Option<bool>>(i)?
                .map(|v| Cell::Int(v.into())),
            Type::FLOAT8 => r.try_get::<_, Option<f64>>(i)?.map(Cell::Real),
            Type::FLOAT4 => r
                .try_get::<_, Option<f32>>(i)?
                .map(|v| Cell::Real(v.into())),
            Type::TEXT | Type::VARCHAR | Type::NAME | Type::BPCHAR => {
                r.try_get::<_, Option<String>>(i)?.map(Cell::Text)
            }
            Type::BYTEA => r.try_get::<_, Option<Vec<u8>>>(i)?.map(Cell::Blob),
            _ => {
                return Err(DbError::Corrupt(format!(
                    "column `{}` has the unexpected type {ty}",
                    col.name()
                )))
            }
        };
        cells.push(cell.unwrap_or(Cell::Null));
    }
    Ok(Row(cells))
}

/// Runs `job` on a connection, in one transaction if `tx`. A transaction dropped unfinished
/// (the caller went away) is rolled back by tokio-postgres before the connection is reused.
pub(crate) async fn run_pg<R>(
    client: &mut Client,
    tx: bool,
    job: impl for<'c> FnOnce(&'c mut dyn Exec) -> Job<'c, R>,
) -> Result<R, DbError> {
    if !tx {
        return job(&mut PgExec(&*client)).await;
    }
    let t = client.transaction().await?;
    let r = job(&mut PgExec(&t)).await?;
    t.commit().await?;
    Ok(r)
}

// ---- PostgreSQL pool ----

/// A bounded pool of connections (deadpool) on the runtime that uses them.
pub(crate) struct PgPool {
    pool: Pool,
    config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
    mode: SslMode,
    /// What to show in messages: the URL without its password.
    pub(crate) display: String,
}

impl PgPool {
    pub(crate) fn new(url: &str) -> Result<PgPool, DbError> {
        let display = redact(url);
        let open_err = |reason: String| DbError::Open {
            path: display.clone(),
            reason,
        };
        let (pg_url, opts) = tls::split_url(url).map_err(open_err)?;
        let mut config = tokio_postgres::Config::from_str(&pg_url).map_err(|e| {
            open_err(format!(
                "not a PostgreSQL URL ({e}); use postgres://USER@HOST:PORT/DB"
            ))
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        if config.get_application_name().is_none() {
            config.application_name("hilum-serve");
        }
        config.ssl_mode(opts.mode.negotiation());
        let tls = tls::connector(&opts).map_err(open_err)?;
        let pool = new_pool(&config, &tls, PG_MAX_CONNECTIONS).map_err(open_err)?;
        Ok(PgPool {
            pool,
            config,
            tls,
            mode: opts.mode,
            display,
        })
    }

    /// Runs `job` on a pooled connection, in one transaction if `tx`.
    pub(crate) async fn with<R>(
        &self,
        tx: bool,
        job: impl for<'c> FnOnce(&'c mut dyn Exec) -> Job<'c, R>,
    ) -> Result<R, DbError> {
        let mut client = self.pool.get().await.map_err(|e| self.pool_error(e))?;
        run_pg(&mut client, tx, job).await
    }

    /// Runs `job` on a connection of its own, on a runtime of its own, and closes both:
    /// for the blocking entry points (one-shot CLI commands, migrations at startup), which
    /// must not use pooled connections whose tasks run on a runtime they may be blocking.
    pub(crate) fn with_own_connection<R: Send>(
        &self,
        job: impl for<'c> FnOnce(&'c mut Client) -> Job<'c, R> + Send,
    ) -> Result<R, DbError> {
        super::off_runtime(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| DbError::Task(format!("cannot start a runtime: {e}")))?;
            // A pool of one, so that the job sees the same client type as pooled jobs do.
            let pool = new_pool(&self.config, &self.tls, 1).map_err(|reason| DbError::Open {
                path: self.display.clone(),
                reason,
            })?;
            rt.block_on(async {
                let mut client = pool.get().await.map_err(|e| self.pool_error(e))?;
                job(&mut client).await
            })
        })
    }

    fn pool_error(&self, e: PoolError) -> DbError {
        match e {
            PoolError::Backend(e) => self.connect_error(&e),
            other => DbError::Open {
                path: self.display.clone(),
                reason: other.to_string(),
            },
        }
    }

    /// A failed connection, with what to do about it.
    fn connect_error(&self, e: &tokio_postgres::Error) -> DbError {
        let msg = pg_message(e);
        let reason = if msg.contains("server does not support TLS") {
            format!(
                "the server does not offer TLS, and sslmode={} requires it: turn `ssl = on` with a \
                 certificate in its postgresql.conf (scripts/setup_postgres.sh does so for the test \
                 cluster), or, on a network you trust, connect with sslmode=disable",
                self.mode
            )
        } else if msg.contains("certificate") {
            format!(
                "{msg} (sslmode={} refused the server's TLS certificate: give the CA that signed it \
                 with sslrootcert=PATH in the URL or --db-ca-file, and connect to a host name the \
                 certificate names)",
                self.mode
            )
        } else {
            format!(
                "{msg} (is PostgreSQL running and does the database exist? scripts/setup_postgres.sh starts a local one for tests)"
            )
        };
        DbError::Open {
            path: self.display.clone(),
            reason,
        }
    }
}

fn new_pool(
    config: &tokio_postgres::Config,
    tls: &MakeRustlsConnect,
    size: usize,
) -> Result<Pool, String> {
    let manager = Manager::from_config(
        config.clone(),
        tls.clone(),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        .build()
        .map_err(|e| format!("cannot build the connection pool: {e}"))
}

/// The message of a PostgreSQL error, with the server's own text when there is one.
pub(crate) fn pg_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{}: {}", db.severity(), db.message()),
        None => {
            let mut msg = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            msg
        }
    }
}

/// The URL without a password (in the user part or a `password=` option), for messages and
/// logs.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => {
            let kept: Vec<&str> = q
                .split('&')
                .filter(|p| !p.starts_with("password="))
                .collect();
            (r, format!("?{}", kept.join("&")))
        }
        None => (rest, String::new()),
    };
    let query = if query == "?" { String::new() } else { query };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{host}{query}")
        }
        None => format!("{scheme}://{rest}{query}"),
    }
}

// ---- migrations ----

pub(crate) fn migrate_sqlite(conn: &rusqlite::Connection) -> Result<(), DbError> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_ms INTEGER NOT NULL)",
    )?;
    let current: i64 = conn.query_row(
        "SELECT COALESCE(MAX(version), 0) FROM schema_migrations",
        [],
        |r| r.get(0),
    )?;
    for m in MIGRATIONS.iter().filter(|m| m.version > current) {
        conn.execute_batch(&format!(
            "BEGIN; {}; INSERT INTO schema_migrations (version, applied_ms) VALUES ({}, {}); COMMIT;",
            m.sqlite,
            m.version,
            now_ms()
        ))?;
    }
    Ok(())
}

pub(crate) fn migrate_postgres(pool: &PgPool) -> Result<(), DbError> {
    pool.with_own_connection(|client| {
        Box::pin(async move {
            let t = client.transaction().await?;
            // Replicas starting together: one migrates, the others wait and then see it done.
            t.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
                .await?;
            t.batch_execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_ms BIGINT NOT NULL)",
            )
            .await?;
            let current: i64 = t
                .query_one(
                    "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_migrations",
                    &[],
                )
                .await?
                .try_get(0)?;
            for m in MIGRATIONS.iter().filter(|m| m.version > current) {
                t.batch_execute(m.postgres).await?;
                t.execute(
                    "INSERT INTO schema_migrations (version, applied_ms) VALUES ($1, $2)",
                    &[&m.version, &now_ms()],
                )
                .await?;
            }
            t.commit().await?;
            Ok(())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migration_versions_are_one_list_counting_from_one() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i as i64 + 1);
            assert!(!m.sqlite.trim().is_empty() && !m.postgres.trim().is_empty());
        }
    }

    #[test]
    fn placeholders_and_passwords() {
        assert_eq!(
            pg_sql("SELECT a FROM t WHERE b = ?1 AND (?2 IS NULL OR c = ?2)"),
            "SELECT a FROM t WHERE b = $1 AND ($2 IS NULL OR c = $2)"
        );
        assert_eq!(
            redact("postgres://hilum:s3cret@db.local:5432/hilum"),
            "postgres://hilum@db.local:5432/hilum"
        );
        assert_eq!(
            redact("postgres://hilum@db.local/hilum"),
            "postgres://hilum@db.local/hilum"
        );
        assert_eq!(
            redact("postgres://hilum@db.local/h?password=s3cret&sslmode=require"),
            "postgres://hilum@db.local/h?sslmode=require"
        );
        assert_eq!(
            redact("postgres://db.local/h?password=x"),
            "postgres://db.local/h"
        );
    }
}
