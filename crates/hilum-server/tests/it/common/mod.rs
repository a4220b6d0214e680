//! Shared helpers of the server tests: a real server on 127.0.0.1, a database per test
//! (SQLite, or a real PostgreSQL server when HILUM_TEST_POSTGRES_URL is set), tokens, real
//! radiographs, and two test tools (an artifact-producing thumbnail and a slow call).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use hilum_agent::{Artifact, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use hilum_imaging::ImageStore;
use hilum_server::{AppState, LlmFactory, RateLimit, ServerConfig, ToolboxFactory};
use hilum_tools::{default_toolbox, ToolDeps};
use serde_json::{json, Value};
use tokio::sync::oneshot;

pub fn data_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        dir.join("cxr/images").is_dir(),
        "real test data missing: expected {} (the shared data folder beside the repository)",
        dir.display()
    );
    dir
}

pub fn image(name: &str) -> Vec<u8> {
    let p = data_dir().join("cxr/images").join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()))
}

/// A 64-px-wide PNG thumbnail of an image: a real artifact to store and fetch.
pub struct Thumbnail {
    spec: ToolSpec,
    store: Arc<ImageStore>,
}

#[async_trait]
impl Tool for Thumbnail {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    async fn call(&self, _ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        let id = args["image"].as_str().unwrap_or_default();
        let img = self
            .store
            .get(id)
            .map_err(|e| ToolError::NotFound(e.to_string()))?;
        let w = 64u32;
        let h = ((img.height as u64 * 64) / img.width.max(1) as u64).max(1) as u32;
        let max = img.max_value();
        let mut out = image::GrayImage::new(w, h);
        for y in 0..h {
            for x in 0..w {
                let sx = (x as u64 * img.width as u64 / w as u64) as usize;
                let sy = (y as u64 * img.height as u64 / h as u64) as usize;
                let v = img.pixels[sy * img.width as usize + sx] / max * 255.0;
                out.put_pixel(x, y, image::Luma([v.clamp(0.0, 255.0) as u8]));
            }
        }
        let mut png = Vec::new();
        out.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png)
            .map_err(|e| ToolError::Internal(e.to_string()))?;
        Ok(ToolOutput::new(
            format!("thumbnail {w}x{h}"),
            json!({"width": w, "height": h}),
        )
        .with_artifact(Artifact::png("thumbnail.png", "overlay", png)))
    }
}

/// Sleeps `seconds`: a run that is still busy when its client goes away.
pub struct Sleep {
    spec: ToolSpec,
}

#[async_trait]
impl Tool for Sleep {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    async fn call(&self, _ctx: &ToolContext, args: Value) -> Result<ToolOutput, ToolError> {
        let s = args["seconds"].as_f64().unwrap_or(1.0);
        tokio::time::sleep(Duration::from_secs_f64(s)).await;
        Ok(ToolOutput::new("slept", json!({"seconds": s})))
    }
}

/// The `sleep` tool on its own, to add to another toolbox.
pub fn sleep_tool() -> Arc<dyn Tool> {
    Arc::new(Sleep {
        spec: ToolSpec {
            name: "sleep".into(),
            description: "Waits.".into(),
            parameters: json!({"type": "object", "properties": {"seconds": {"type": "number"}}}),
        },
    })
}

pub fn test_toolbox() -> ToolboxFactory {
    Arc::new(|store: Arc<ImageStore>| {
        let models = Arc::new(hilum_tools::ModelPool::from_settings(Default::default()));
        let mut tb = default_toolbox(&ToolDeps::new(store.clone(), models))?;
        tb.register(Arc::new(Thumbnail {
            spec: ToolSpec {
                name: "thumbnail".into(),
                description: "A small PNG of the image.".into(),
                parameters: json!({"type": "object", "properties": {"image": {"type": "string"}}, "required": ["image"]}),
            },
            store,
        }))?;
        tb.register(Arc::new(Sleep {
            spec: ToolSpec {
                name: "sleep".into(),
                description: "Waits.".into(),
                parameters: json!({"type": "object", "properties": {"seconds": {"type": "number"}}}),
            },
        }))?;
        Ok(tb)
    })
}

pub struct Server {
    pub addr: SocketAddr,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Stops the server and waits until it has let go of the database.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

/// A config for tests: port 0, the test toolbox, a script LLM if given, no rate limit.
pub fn config(db: &Path, script: Option<&Path>) -> ServerConfig {
    config_url(&format!("sqlite://{}", db.display()), script)
}

/// The same for any database URL.
pub fn config_url(db_url: &str, script: Option<&Path>) -> ServerConfig {
    let mut cfg = ServerConfig::new(db_url);
    cfg.bind = "127.0.0.1:0".parse().expect("addr");
    cfg.toolbox = test_toolbox();
    cfg.rate_limit = RateLimit {
        per_sec: 0.0,
        burst: 0.0,
    };
    cfg.heartbeat = Duration::from_millis(100);
    cfg.llm = script.map(|p| LlmFactory::script(p.to_path_buf()));
    cfg
}

pub async fn start(cfg: ServerConfig) -> Server {
    let state = AppState::new(cfg).expect("open database");
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let (addr_tx, addr_rx) = oneshot::channel();
    let task = tokio::spawn(hilum_server::serve(
        state.clone(),
        async move {
            let _ = stop_rx.await;
        },
        Some(addr_tx),
    ));
    let addr = addr_rx.await.expect("server bound");
    Server {
        addr,
        state,
        stop: Some(stop_tx),
        task: Some(task),
    }
}

pub fn token(state: &AppState, name: &str) -> String {
    state.db().create_token(name, false).expect("token").1
}

pub fn write_script(dir: &Path, turns: Value) -> PathBuf {
    let p = dir.join("script.json");
    std::fs::write(&p, turns.to_string()).expect("write script");
    p
}

pub async fn upload(
    client: &reqwest::Client,
    srv: &Server,
    token: &str,
    name: &str,
) -> reqwest::Response {
    let part = reqwest::multipart::Part::bytes(image(name))
        .file_name(name.to_string())
        .mime_str("image/png")
        .expect("mime");
    let form = reqwest::multipart::Form::new().part("file", part);
    client
        .post(srv.url("/v1/images"))
        .bearer_auth(token)
        .multipart(form)
        .send()
        .await
        .expect("upload request")
}

pub async fn upload_id(
    client: &reqwest::Client,
    srv: &Server,
    token: &str,
    name: &str,
) -> (String, Value) {
    let resp = upload(client, srv, token, name).await;
    assert_eq!(resp.status(), 201, "upload of {name}");
    let body: Value = resp.json().await.expect("json");
    let row = body["images"][0].clone();
    (row["id"].as_str().expect("id").to_string(), row)
}

pub async fn new_session(client: &reqwest::Client, srv: &Server, token: &str) -> String {
    let resp = client
        .post(srv.url("/v1/sessions"))
        .bearer_auth(token)
        .json(&json!({"title": "test"}))
        .send()
        .await
        .expect("session");
    assert_eq!(resp.status(), 201);
    let v: Value = resp.json().await.expect("json");
    v["id"].as_str().expect("id").to_string()
}

/// Posts a question and reads the whole NDJSON stream.
pub async fn ask_ndjson(
    client: &reqwest::Client,
    srv: &Server,
    token: &str,
    session: &str,
    question: &str,
    images: &[&str],
) -> Vec<Value> {
    let resp = client
        .post(srv.url(&format!("/v1/sessions/{session}/messages")))
        .bearer_auth(token)
        .json(&json!({"question": question, "images": images}))
        .send()
        .await
        .expect("ask");
    assert_eq!(resp.status(), 200, "ask");
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap_or(""),
        "application/x-ndjson"
    );
    let text = resp.text().await.expect("body");
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad NDJSON line {l}: {e}")))
        .filter(|v: &Value| v["type"] != "heartbeat")
        .collect()
}

/// A database of its own for one test, and a temp dir beside it for scripts.
pub struct TestDb {
    pub dir: tempfile::TempDir,
    pub url: String,
    /// PostgreSQL: the server's URL (to drop the database) and the database's name.
    pg: Option<(String, String)>,
}

impl TestDb {
    /// A SQLite file in a temp dir.
    pub fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("h.db").display());
        TestDb { dir, url, pg: None }
    }

    /// A fresh database on the PostgreSQL server named by `HILUM_TEST_POSTGRES_URL`; `None`
    /// (and a loud note) when it is not set.
    pub fn postgres() -> Option<TestDb> {
        let Ok(base) = std::env::var("HILUM_TEST_POSTGRES_URL") else {
            eprintln!(
                "\n*** SKIPPED on PostgreSQL: HILUM_TEST_POSTGRES_URL is not set. Run \
                 `eval \"$(scripts/setup_postgres.sh)\"` (or scripts/test.sh) to test against a real server. ***\n"
            );
            return None;
        };
        let name = format!("hilum_t_{}", hex_id());
        pg_admin(&base, &format!("CREATE DATABASE {name}"))
            .unwrap_or_else(|e| panic!("HILUM_TEST_POSTGRES_URL: {e}"));
        let url = with_test_tls(&with_database(&base, &name));
        Some(TestDb {
            dir: tempfile::tempdir().expect("tempdir"),
            url,
            pg: Some((base, name)),
        })
    }

    /// Runs SQL on this PostgreSQL database with a plain client of the test's own.
    #[allow(dead_code)]
    pub fn pg_batch(&self, sql: &str) -> Result<(), String> {
        let (base, name) = self.pg.as_ref().ok_or("not a PostgreSQL test database")?;
        pg_admin(&with_database(base, name), sql)
    }

    pub fn is_postgres(&self) -> bool {
        self.pg.is_some()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some((base, name)) = self.pg.take() {
            // Best effort (this may run while a failed test unwinds).
            if let Err(e) = pg_admin(
                &base,
                &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            ) {
                eprintln!("cannot drop test database {name}: {e}");
            }
        }
    }
}

fn hex_id() -> String {
    let n: u64 = rand_u64();
    format!("{n:016x}")
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// The same server URL with another database name (the path after the host).
fn with_database(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let host_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    format!("{}/{db}{query}", &base[..host_end])
}

/// Runs SQL outside any transaction (CREATE/DROP DATABASE) on a thread and runtime of its
/// own: it runs in `Drop`, possibly inside a test's runtime.
fn pg_admin(url: &str, sql: &str) -> Result<(), String> {
    let (url, sql) = (url.to_string(), sql.to_string());
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        rt.block_on(async {
            let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .map_err(|e| format!("cannot connect to {url}: {e}"))?;
            tokio::spawn(connection);
            client
                .batch_execute(&sql)
                .await
                .map_err(|e| format!("{sql}: {e:?}"))
        })
    })
    .join()
    .map_err(|_| "the PostgreSQL admin thread panicked".to_string())?
}

/// `url` with `sslmode=verify-full` and the test cluster's CA when `HILUM_TEST_POSTGRES_CA`
/// names it (scripts/setup_postgres.sh prints both), so that the tests run over verified TLS.
pub fn with_test_tls(url: &str) -> String {
    match std::env::var("HILUM_TEST_POSTGRES_CA") {
        Ok(ca) if !ca.is_empty() => {
            let sep = if url.contains('?') { '&' } else { '?' };
            format!("{url}{sep}sslmode=verify-full&sslrootcert={ca}")
        }
        _ => {
            eprintln!("note: HILUM_TEST_POSTGRES_CA is not set: PostgreSQL tests run without verified TLS");
            url.to_string()
        }
    }
}

/// Runs an async test `fn NAME(db: &TestDb)` twice: `NAME::sqlite` and `NAME::postgres` (which
/// says loudly that it skipped when HILUM_TEST_POSTGRES_URL is not set).
#[allow(unused_macros)]
macro_rules! on_both_databases {
    ($name:ident) => {
        mod $name {
            #[tokio::test]
            async fn sqlite() {
                let db = crate::common::TestDb::sqlite();
                super::$name(&db).await;
            }

            #[tokio::test]
            async fn postgres() {
                let Some(db) = crate::common::TestDb::postgres() else {
                    return;
                };
                super::$name(&db).await;
            }
        }
    };
}

/// GET `url` with a bearer token and parse the JSON body (the request must succeed).
pub async fn get_json(client: &reqwest::Client, url: String, token: &str) -> Value {
    let resp = client
        .get(&url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    resp.json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"))
}

/// POST `args` to `/v1/tools/{name}:call` with a bearer token (the request must be sent).
pub async fn call_tool(
    client: &reqwest::Client,
    srv: &Server,
    token: &str,
    name: &str,
    args: &Value,
) -> reqwest::Response {
    client
        .post(srv.url(&format!("/v1/tools/{name}:call")))
        .bearer_auth(token)
        .json(args)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {name}:call: {e}"))
}
