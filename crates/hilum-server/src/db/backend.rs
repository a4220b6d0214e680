//! The two database engines behind [`super::Db`]: SQLite (one connection, rusqlite) and
//! PostgreSQL (a small pool of synchronous `postgres` clients). Both run on tokio's blocking
//! pool, and both are driven through [`Exec`], so every query of the server is written once,
//! with `?1`-style placeholders that become `$1` for PostgreSQL.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use postgres::types::{to_sql_checked, IsNull, ToSql as PgToSql, Type};
use rusqlite::types::{ToSqlOutput, ValueRef};

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
pub(crate) trait Exec {
    /// Runs a statement; returns the number of rows changed.
    fn execute(&mut self, sql: &str, args: &[P]) -> Result<u64, DbError>;
    fn query(&mut self, sql: &str, args: &[P]) -> Result<Vec<Row>, DbError>;
    /// `sqlite` or `postgres`, for the few statements that differ.
    fn engine(&self) -> Engine;

    fn query_opt(&mut self, sql: &str, args: &[P]) -> Result<Option<Row>, DbError> {
        Ok(self.query(sql, args)?.into_iter().next())
    }

    fn query_one(&mut self, sql: &str, args: &[P]) -> Result<Row, DbError> {
        self.query_opt(sql, args)?
            .ok_or_else(|| DbError::Corrupt("the query returned no row".into()))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Engine {
    Sqlite,
    Postgres,
}

/// The SQLite connection (or a transaction on it), seen through [`Exec`].
pub(crate) struct SqliteExec<'a>(pub(crate) &'a rusqlite::Connection);

impl Exec for SqliteExec<'_> {
    fn execute(&mut self, sql: &str, args: &[P]) -> Result<u64, DbError> {
        let mut st = self.0.prepare_cached(sql)?;
        Ok(st.execute(rusqlite::params_from_iter(args.iter()))? as u64)
    }

    fn query(&mut self, sql: &str, args: &[P]) -> Result<Vec<Row>, DbError> {
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

/// `?1` → `$1`: the server's queries use SQLite's numbered placeholders, which PostgreSQL
/// spells with a dollar. (None of the queries has a `?` inside a string literal.)
fn pg_sql(sql: &str) -> String {
    sql.replace('?', "$")
}

/// A PostgreSQL connection with its prepared statements (one round trip per query after the
/// first).
pub(crate) struct PgConn {
    client: postgres::Client,
    statements: HashMap<String, postgres::Statement>,
}

/// A PostgreSQL connection or transaction, seen through [`Exec`].
pub(crate) struct PgExec<'a, C: postgres::GenericClient> {
    client: &'a mut C,
    statements: &'a mut HashMap<String, postgres::Statement>,
}

impl<C: postgres::GenericClient> PgExec<'_, C> {
    fn statement(&mut self, sql: &str) -> Result<postgres::Statement, DbError> {
        if let Some(st) = self.statements.get(sql) {
            return Ok(st.clone());
        }
        let st = self.client.prepare(&pg_sql(sql))?;
        self.statements.insert(sql.to_string(), st.clone());
        Ok(st)
    }

    fn params(args: &[P]) -> Vec<&(dyn PgToSql + Sync)> {
        args.iter().map(|a| a as &(dyn PgToSql + Sync)).collect()
    }
}

impl<C: postgres::GenericClient> Exec for PgExec<'_, C> {
    fn execute(&mut self, sql: &str, args: &[P]) -> Result<u64, DbError> {
        let st = self.statement(sql)?;
        Ok(self.client.execute(&st, &Self::params(args))?)
    }

    fn query(&mut self, sql: &str, args: &[P]) -> Result<Vec<Row>, DbError> {
        let st = self.statement(sql)?;
        let rows = self.client.query(&st, &Self::params(args))?;
        rows.iter().map(pg_row).collect()
    }

    fn engine(&self) -> Engine {
        Engine::Postgres
    }
}

fn pg_row(r: &postgres::Row) -> Result<Row, DbError> {
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

// ---- PostgreSQL pool ----

/// A bounded pool of connections. Clients hold a small tokio runtime of their own, which
/// must not be dropped on an async thread: the pool hands its clients to a plain thread when
/// it goes away.
pub(crate) struct PgPool {
    config: postgres::Config,
    /// What to show in messages: the URL without its password.
    pub(crate) display: String,
    state: Mutex<PoolState>,
    freed: Condvar,
}

struct PoolState {
    idle: Vec<PgConn>,
    open: usize,
}

impl PgPool {
    pub(crate) fn new(url: &str) -> Result<PgPool, DbError> {
        let mut config = postgres::Config::from_str(url).map_err(|e| DbError::Open {
            path: redact(url),
            reason: format!("not a PostgreSQL URL ({e}); use postgres://USER@HOST:PORT/DB"),
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        if config.get_application_name().is_none() {
            config.application_name("hilum-serve");
        }
        let pool = PgPool {
            config,
            display: redact(url),
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
            }),
            freed: Condvar::new(),
        };
        Ok(pool)
    }

    fn connect(&self) -> Result<PgConn, DbError> {
        let client = self
            .config
            .connect(postgres::NoTls)
            .map_err(|e| DbError::Open {
                path: self.display.clone(),
                reason: format!(
                    "{} (is PostgreSQL running and does the database exist? scripts/setup_postgres.sh starts a local one for tests)",
                    pg_message(&e)
                ),
            })?;
        Ok(PgConn {
            client,
            statements: HashMap::new(),
        })
    }

    /// Runs `f` on a pooled connection, inside a transaction if `tx`. Blocking.
    pub(crate) fn with<R>(
        &self,
        tx: bool,
        f: impl FnOnce(&mut dyn Exec) -> Result<R, DbError>,
    ) -> Result<R, DbError> {
        let mut conn = self.take()?;
        let result = run_pg(&mut conn, tx, f);
        self.give_back(conn);
        result
    }

    fn take(&self) -> Result<PgConn, DbError> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(c) = st.idle.pop() {
                return Ok(c);
            }
            if st.open < PG_MAX_CONNECTIONS {
                st.open += 1;
                drop(st);
                return self.connect().inspect_err(|_| {
                    let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    st.open -= 1;
                    self.freed.notify_one();
                });
            }
            st = self.freed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn give_back(&self, conn: PgConn) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if conn.client.is_closed() {
            // A broken connection is dropped here (a blocking thread) and replaced on demand.
            st.open -= 1;
            drop(st);
            drop(conn);
        } else {
            st.idle.push(conn);
            drop(st);
        }
        self.freed.notify_one();
    }
}

impl Drop for PgPool {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let idle = std::mem::take(&mut st.idle);
        if !idle.is_empty() {
            // Dropping a client drops its runtime, which panics on an async thread.
            let _ = std::thread::Builder::new()
                .name("hilum-pg-close".into())
                .spawn(move || drop(idle));
        }
    }
}

fn run_pg<R>(
    conn: &mut PgConn,
    tx: bool,
    f: impl FnOnce(&mut dyn Exec) -> Result<R, DbError>,
) -> Result<R, DbError> {
    if !tx {
        return f(&mut PgExec {
            client: &mut conn.client,
            statements: &mut conn.statements,
        });
    }
    let mut t = conn.client.transaction()?;
    let r = f(&mut PgExec {
        client: &mut t,
        statements: &mut conn.statements,
    })?;
    t.commit()?;
    Ok(r)
}

/// The message of a PostgreSQL error, with the server's own text when there is one.
pub(crate) fn pg_message(e: &postgres::Error) -> String {
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

/// The URL without a password, for messages and logs.
pub(crate) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{host}")
        }
        None => url.to_string(),
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
    let mut conn = pool.take()?;
    let result = (|| {
        let mut t = conn.client.transaction()?;
        // Replicas starting together: one migrates, the others wait and then see it done.
        t.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
        t.batch_execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version BIGINT PRIMARY KEY, applied_ms BIGINT NOT NULL)",
        )?;
        let current: i64 = t
            .query_one(
                "SELECT COALESCE(MAX(version), 0)::BIGINT FROM schema_migrations",
                &[],
            )?
            .try_get(0)?;
        for m in MIGRATIONS.iter().filter(|m| m.version > current) {
            t.batch_execute(m.postgres)?;
            t.execute(
                "INSERT INTO schema_migrations (version, applied_ms) VALUES ($1, $2)",
                &[&m.version, &now_ms()],
            )?;
        }
        t.commit()?;
        Ok::<_, DbError>(())
    })();
    pool.give_back(conn);
    result
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
    }
}
