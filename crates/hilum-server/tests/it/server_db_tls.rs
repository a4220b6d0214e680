//! PostgreSQL over TLS. scripts/setup_postgres.sh gives its test cluster a throwaway CA and a
//! certificate for 127.0.0.1 and localhost (HILUM_TEST_POSTGRES_CA): a server whose every
//! connection is verified TLS, `require` without a CA, and the refusals: `require` against a
//! PostgreSQL without TLS, and `verify-full` with another CA or another host name.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use hilum_server::Db;

/// Fails when the connection `Db` uses for one-shot commands is not encrypted.
const ASSERT_TLS: &str =
    "DO $$ BEGIN IF NOT (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()) \
                          THEN RAISE EXCEPTION 'this connection is plain text'; END IF; END $$";

/// The test database and the cluster's CA; `None` (and why) when either is missing.
fn tls_db() -> Option<(TestDb, String)> {
    let db = TestDb::postgres()?;
    match std::env::var("HILUM_TEST_POSTGRES_CA") {
        Ok(ca) if !ca.is_empty() => Some((db, ca)),
        _ => {
            eprintln!(
                "\n*** SKIPPED: HILUM_TEST_POSTGRES_CA is not set. Run \
                 `eval \"$(scripts/setup_postgres.sh)\"`, which prints it. ***\n"
            );
            None
        }
    }
}

/// The test database's URL without its query, with `query` instead.
fn with_query(db: &TestDb, query: &str) -> String {
    let base = db.url.split('?').next().unwrap_or(&db.url);
    format!("{base}?{query}")
}

fn open_err(url: &str) -> String {
    match Db::open(url) {
        Ok(_) => panic!("{url} must be refused"),
        Err(e) => e.to_string(),
    }
}

/// (encrypted, plain) connections of `hilum-serve` to the database `name`.
async fn server_connections(url: &str, name: &str) -> (i64, i64) {
    let admin = url.split('?').next().unwrap_or(url);
    let (client, connection) = tokio_postgres::connect(admin, tokio_postgres::NoTls)
        .await
        .expect("admin connection");
    tokio::spawn(connection);
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl)
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.datname = $1 AND a.application_name = 'hilum-serve'",
            &[&name],
        )
        .await
        .expect("pg_stat_ssl");
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn a_server_runs_over_verified_tls() {
    let Some((db, _ca)) = tls_db() else {
        return;
    };
    assert!(db.url.contains("sslmode=verify-full"), "{}", db.url);
    let srv = start(config_url(&db.url, None)).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let ses = new_session(&client, &srv, &tok).await;
    let sessions = get_json(&client, srv.url("/v1/sessions"), &tok).await;
    assert!(sessions.to_string().contains(&ses), "{sessions}");

    // The pool's connections (requests) and the one-shot ones (tokens, SQL) are encrypted.
    let name = db.url.split('?').next().and_then(|u| u.rsplit('/').next());
    let (tls, plain) = server_connections(&db.url, name.expect("a database name")).await;
    assert!(
        tls >= 1 && plain == 0,
        "{tls} TLS and {plain} plain connections"
    );
    srv.state.db().execute_sql(ASSERT_TLS).expect("over TLS");

    // The check can fail: a plain connection does.
    let plain = Db::open(&with_query(&db, "sslmode=disable")).expect("open plain");
    let err = plain.execute_sql(ASSERT_TLS).expect_err("plain text");
    assert!(err.to_string().contains("plain text"), "{err}");
    srv.stop().await;
}

#[tokio::test]
async fn require_encrypts_without_verifying_the_certificate() {
    let Some((db, _ca)) = tls_db() else {
        return;
    };
    let d = Db::open(&with_query(&db, "sslmode=require")).expect("require without a CA");
    d.execute_sql(ASSERT_TLS).expect("over TLS");
    // The same server under verify-full without its CA: the public roots do not know it.
    let err = open_err(&with_query(&db, "sslmode=verify-full"));
    assert!(err.contains("sslrootcert"), "{err}");
}

#[tokio::test]
async fn verify_full_refuses_another_ca_and_another_host_name() {
    let Some((db, ca)) = tls_db() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let other = other_ca(dir.path());
    let err = open_err(&with_query(
        &db,
        &format!("sslmode=verify-full&sslrootcert={}", other.display()),
    ));
    assert!(
        err.contains("certificate") && err.contains("sslrootcert=PATH"),
        "{err}"
    );

    // The right CA, but a host name the certificate does not carry (the address stays the
    // cluster's): verify-full refuses, verify-ca accepts.
    let port = db
        .url
        .split('@')
        .nth(1)
        .and_then(|h| h.split('/').next())
        .and_then(|h| h.rsplit(':').next())
        .expect("a port in the URL")
        .to_string();
    let rename = |mode: &str| {
        let url = with_query(
            &db,
            &format!("hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={ca}"),
        );
        url.replacen(
            &format!("127.0.0.1:{port}"),
            &format!("db.invalid:{port}"),
            1,
        )
    };
    let err = open_err(&rename("verify-full"));
    assert!(err.contains("certificate"), "{err}");
    let d = Db::open(&rename("verify-ca")).expect("verify-ca ignores the name");
    d.execute_sql(ASSERT_TLS).expect("over TLS");
}

/// A CA that signed nothing the test cluster uses.
fn other_ca(dir: &Path) -> PathBuf {
    let crt = dir.join("other-ca.crt");
    let ok = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=Another CA", "-keyout"])
        .arg(dir.join("other-ca.key"))
        .arg("-out")
        .arg(&crt)
        .output()
        .expect("openssl (scripts/setup_postgres.sh needs it too)");
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    crt
}

#[test]
fn require_against_a_postgres_without_tls_is_refused_clearly() {
    let Some(pg) = PlainPostgres::start() else {
        return;
    };
    let url = format!(
        "postgres://postgres:s3cret@127.0.0.1:{}/postgres?sslmode=require",
        pg.port
    );
    let err = open_err(&url);
    assert!(
        err.contains(&format!("127.0.0.1:{}", pg.port)),
        "names the server: {err}"
    );
    assert!(err.contains("does not offer TLS"), "{err}");
    assert!(
        err.contains("ssl = on") && err.contains("sslmode=disable"),
        "says what to do: {err}"
    );
    assert!(!err.contains("s3cret"), "no password: {err}");
    // The same server is fine when TLS is not asked for.
    Db::open(&url.replace("sslmode=require", "sslmode=disable")).expect("plain");
}

/// A PostgreSQL of the test's own with `ssl = off`, in a temp dir (about two seconds);
/// stopped on drop.
struct PlainPostgres {
    bin: PathBuf,
    data: PathBuf,
    port: u16,
    _dir: tempfile::TempDir,
}

impl PlainPostgres {
    fn start() -> Option<PlainPostgres> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .ok()
            .and_then(|d| d.filter_map(|e| e.ok()).map(|e| e.path().join("bin")).max())
            .filter(|b| b.join("pg_ctl").exists());
        let Some(bin) = bin else {
            eprintln!("\n*** SKIPPED: no PostgreSQL binaries in /usr/lib/postgresql/*/bin (scripts/setup_postgres.sh installs them) ***\n");
            return None;
        };
        let dir = tempfile::tempdir().expect("tempdir");
        let data = dir.path().join("data");
        if is_root() {
            // PostgreSQL will not run as root.
            let ok = Command::new("chown")
                .args(["postgres:"])
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(ok.success(), "chown postgres {}", dir.path().display());
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let pg = PlainPostgres {
            bin,
            data,
            port,
            _dir: dir,
        };
        pg.as_postgres("initdb")
            .arg("-D")
            .arg(&pg.data)
            .args(["-U", "postgres", "--auth=trust", "--no-sync"])
            .output()
            .map(|o| {
                assert!(
                    o.status.success(),
                    "initdb: {}",
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .expect("initdb");
        let socket_dir = pg.data.display().to_string();
        let ok = pg
            .as_postgres("pg_ctl")
            .arg("-D")
            .arg(&pg.data)
            .args(["-w", "-t", "60", "-l"])
            .arg(pg.data.join("log"))
            .arg("-o")
            .arg(format!(
                "-p {port} -k {socket_dir} -c listen_addresses=127.0.0.1 -c ssl=off -c fsync=off"
            ))
            .arg("start")
            .output()
            .expect("pg_ctl start");
        assert!(
            ok.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
        Some(pg)
    }

    fn as_postgres(&self, tool: &str) -> Command {
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(self.bin.join(tool));
            c
        } else {
            Command::new(self.bin.join(tool))
        }
    }
}

impl Drop for PlainPostgres {
    fn drop(&mut self) {
        let _ = self
            .as_postgres("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(["-m", "immediate", "stop"])
            .output();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0\n"))
        .unwrap_or(false)
}
