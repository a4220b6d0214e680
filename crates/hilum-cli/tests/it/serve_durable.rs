//! Durable runs of a real `hilum serve` process. A run is killed with SIGKILL during a tool
//! call, between rounds and while the model streams its answer (on SQLite, and on PostgreSQL
//! when HILUM_TEST_POSTGRES_URL is set); a restarted server marks it `interrupted`, its stored
//! messages and audit rows hold exactly what finished, and `resume` ends with the answer of an
//! uninterrupted run without running a finished call again. SIGTERM drains: a run that can
//! finish in the window does, one that cannot is marked `interrupted`, and the process exits 0.
//!
//! The reasoning model and the VLM behind `answer_visual_question` are one OpenAI-compatible
//! server on 127.0.0.1 in this test process. It answers from the conversation it is sent (so a
//! resumed run meets the same model) and holds a request open where the test wants the server
//! stopped: the kill points are that held request, not timing.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::{watch, Notify};

const IMAGE: &str = "cxr/images/nih_00004387_000_effusion.png";
const QUESTION: &str = "Is there a pleural effusion?";

fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(rel)
}

// ---- the model server ----

/// Where the model holds a request open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    /// The VLM request of `answer_visual_question` (a tool call in progress).
    Tool,
    /// The model's decision after the first round's results (between rounds).
    BetweenRounds,
    /// The final answer, after its first streamed chunk.
    Answer,
}

struct Hold {
    point: Point,
    /// Only requests whose user question contains this.
    tag: String,
    /// Released by [`Model::release`]; otherwise held until the client goes away.
    releasable: bool,
}

#[derive(Default)]
struct ModelState {
    holds: Mutex<Vec<Hold>>,
    held: Notify,
    released: Mutex<Option<watch::Sender<bool>>>,
    /// VLM requests answered (tool executions that finished on the model's side).
    vlm_answered: Mutex<usize>,
    /// The messages of each request answered with a final answer.
    finals: Mutex<Vec<Value>>,
}

#[derive(Clone, Default)]
struct Model(Arc<ModelState>);

impl Model {
    async fn start() -> (Model, String) {
        let model = Model::default();
        *model.0.released.lock().expect("lock") = Some(watch::channel(false).0);
        let app = Router::new()
            .route("/v1/chat/completions", post(completions))
            .with_state(model.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        (model, format!("http://{addr}/v1"))
    }

    fn hold(&self, point: Point, tag: &str, releasable: bool) {
        self.0.holds.lock().expect("lock").push(Hold {
            point,
            tag: tag.into(),
            releasable,
        });
    }

    fn clear_holds(&self) {
        self.0.holds.lock().expect("lock").clear();
    }

    fn release(&self) {
        if let Some(tx) = self.0.released.lock().expect("lock").as_ref() {
            tx.send_replace(true);
        }
    }

    async fn wait_held(&self) {
        tokio::time::timeout(Duration::from_secs(60), self.0.held.notified())
            .await
            .expect("the server reached the kill point within 60 s");
    }

    fn vlm_answered(&self) -> usize {
        *self.0.vlm_answered.lock().expect("lock")
    }

    /// The conversation of the last request answered with a final answer, without the VLM's
    /// latencies (which differ from run to run).
    fn last_final(&self) -> Value {
        let mut conversation = self
            .0
            .finals
            .lock()
            .expect("lock")
            .last()
            .cloned()
            .expect("a final answer was asked for");
        for m in conversation.as_array_mut().into_iter().flatten() {
            let Some(content) = m["content"].as_str().map(str::to_string) else {
                continue;
            };
            let Some((summary, data)) = content.split_once('\n') else {
                continue;
            };
            if let Ok(mut data) = serde_json::from_str::<Value>(data) {
                if let Some(o) = data.as_object_mut() {
                    o.remove("latency_ms");
                }
                m["content"] = Value::String(format!("{summary}\n{data}"));
            }
        }
        conversation
    }

    /// Holds the request if a hold matches: until released, or for ever (the server that
    /// sent it is about to be killed). Returns at once otherwise.
    async fn maybe_hold(&self, point: Point, question: &str) {
        let releasable = {
            let holds = self.0.holds.lock().expect("lock");
            match holds
                .iter()
                .find(|h| h.point == point && question.contains(&h.tag))
            {
                Some(h) => h.releasable,
                None => return,
            }
        };
        self.0.held.notify_one();
        let rx = self
            .0
            .released
            .lock()
            .expect("lock")
            .as_ref()
            .map(|tx| tx.subscribe());
        match rx {
            Some(mut rx) if releasable => {
                let _ = rx.wait_for(|r| *r).await;
            }
            _ => std::future::pending::<()>().await,
        }
    }
}

fn text_of(m: &Value) -> String {
    match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

async fn completions(State(model): State<Model>, Json(req): Json<Value>) -> Response {
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let texts: Vec<String> = messages.iter().map(text_of).collect();
    if req["model"] == "vlm" {
        let asked = texts.join("\n");
        model.maybe_hold(Point::Tool, &asked).await;
        *model.0.vlm_answered.lock().expect("lock") += 1;
        let answer = if asked.contains("heart") {
            "No. The heart is not enlarged."
        } else {
            "Yes. There is a moderate left pleural effusion."
        };
        return Json(json!({
            "id": "vlm-1", "object": "chat.completion", "model": "vlm",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 10}
        }))
        .into_response();
    }
    // The reasoning model: the first user message is the question, with its image ids.
    let question = messages
        .iter()
        .find(|m| m["role"] == "user")
        .map(text_of)
        .unwrap_or_default();
    let image = question
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| w.starts_with("img_"))
        .unwrap_or_default()
        .to_string();
    let user_question = question.split("\n\nImages:").next().unwrap_or_default();
    let results: Vec<&Value> = messages.iter().filter(|m| m["role"] == "tool").collect();
    match results.len() {
        0 => sse_calls(&[
            ("call_1", "image_info", json!({"image": image})),
            (
                "call_2",
                "answer_visual_question",
                json!({"image": image, "question": user_question}),
            ),
        ]),
        2 => {
            model.maybe_hold(Point::BetweenRounds, &question).await;
            sse_calls(&[(
                "call_3",
                "answer_visual_question",
                json!({"image": image, "question": "Is the heart enlarged?"}),
            )])
        }
        _ => {
            model
                .0
                .finals
                .lock()
                .expect("lock")
                .push(Value::Array(messages.clone()));
            // The answer quotes the VLM's answers as the model read them: a conversation
            // rebuilt wrongly on resume gives another answer.
            let quoted: Vec<String> = results
                .iter()
                .filter(|m| m["tool_call_id"] == "call_2" || m["tool_call_id"] == "call_3")
                .filter_map(|m| {
                    let text = text_of(m);
                    let first = text.lines().next().unwrap_or_default();
                    first.split_once("): ").map(|(_, said)| said.to_string())
                })
                .collect();
            let answer = format!(
                "From the tool results: {} This supports the reading; a radiologist confirms it.",
                quoted.join(" ")
            );
            let held = model
                .0
                .holds
                .lock()
                .expect("lock")
                .iter()
                .any(|h| h.point == Point::Answer && question.contains(&h.tag));
            sse_answer(model.clone(), answer, held)
        }
    }
}

fn sse(chunks: Vec<Value>, then_hold: Option<Model>) -> Response {
    let mut lines: Vec<Result<String, std::convert::Infallible>> = chunks
        .into_iter()
        .map(|c| Ok(format!("data: {c}\n\n")))
        .collect();
    let body = if let Some(model) = then_hold {
        // The first chunk goes out, then the stream stalls: the model is "still writing".
        lines.truncate(1);
        let stall = futures::stream::once(async move {
            model.0.held.notify_one();
            std::future::pending::<()>().await;
            Ok(String::new())
        });
        Body::from_stream(futures::StreamExt::chain(
            futures::stream::iter(lines),
            stall,
        ))
    } else {
        lines.push(Ok("data: [DONE]\n\n".to_string()));
        Body::from_stream(futures::stream::iter(lines))
    };
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

fn sse_calls(calls: &[(&str, &str, Value)]) -> Response {
    let calls: Vec<Value> = calls
        .iter()
        .enumerate()
        .map(|(i, (id, name, args))| {
            json!({"index": i, "id": id, "type": "function",
                   "function": {"name": name, "arguments": args.to_string()}})
        })
        .collect();
    sse(
        vec![
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": calls}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
                   "usage": {"prompt_tokens": 100, "completion_tokens": 20}}),
        ],
        None,
    )
}

fn sse_answer(model: Model, answer: String, hold: bool) -> Response {
    let mid = answer.len() / 2;
    let cut = (mid..answer.len())
        .find(|&i| answer.is_char_boundary(i))
        .unwrap_or(answer.len());
    let (a, b) = answer.split_at(cut);
    sse(
        vec![
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": a}}]}),
            json!({"choices": [{"index": 0, "delta": {"content": b}}]}),
            json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 100, "completion_tokens": 20}}),
        ],
        hold.then_some(model),
    )
}

// ---- the hilum serve process ----

struct Serve {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Serve {
    fn start(db: &str, model_url: &str, dir: &Path, extra: &[&str]) -> Serve {
        let mut child = hilum(dir, model_url)
            .args(["serve", "--db", db, "--bind", "127.0.0.1:0"])
            .args(["--llm", "openai:reasoner", "--base-url", model_url])
            .args(["--run-heartbeat-secs", "0.2", "--run-stale-secs", "1"])
            .args(extra)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("start hilum serve");
        let stderr = child.stderr.take().expect("stderr");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = log.clone();
        // Keeps draining stderr so the server never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !sent {
                    if let Some(rest) = line.split("listening on ").nth(1) {
                        let base = rest.split_whitespace().next().unwrap_or_default();
                        let _ = tx.send(base.to_string());
                        sent = true;
                    }
                }
                let mut log = sink.lock().unwrap_or_else(|p| p.into_inner());
                log.push_str(&line);
                log.push('\n');
            }
        });
        let base = rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_else(|_| {
                panic!(
                    "hilum serve did not start listening: {}",
                    log.lock().unwrap_or_else(|p| p.into_inner())
                )
            });
        Serve { child, base, log }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }

    fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn hilum(dir: &Path, model_url: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_DB")
        .env("HILUM_CONFIG", "/dev/null")
        .env("HILUM_MODELS_DIR", dir.join("models"))
        .env("HILUM_VLM_BASE_URL", model_url)
        .env("HILUM_VLM_MODEL", "vlm")
        .env("HILUM_VLM_FAMILY", "generic");
    c
}

fn token(db: &str, dir: &Path, admin: bool) -> String {
    crate::common::create_token(hilum(dir, "http://127.0.0.1:9/v1"), db, admin)
}

// ---- API helpers ----

struct Api {
    client: reqwest::Client,
    token: String,
}

impl Api {
    async fn get(&self, url: String) -> Value {
        let resp = self
            .client
            .get(&url)
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        assert!(resp.status().is_success(), "GET {url}: {}", resp.status());
        resp.json().await.expect("json")
    }

    async fn upload(&self, srv: &Serve) -> String {
        let png = std::fs::read(data(IMAGE)).expect("test image (../shared/data)");
        let form = reqwest::multipart::Form::new().part(
            "file",
            reqwest::multipart::Part::bytes(png)
                .file_name("chest.png")
                .mime_str("image/png")
                .expect("mime"),
        );
        let resp = self
            .client
            .post(srv.url("/v1/images"))
            .bearer_auth(&self.token)
            .multipart(form)
            .send()
            .await
            .expect("upload");
        assert_eq!(resp.status(), 201);
        let body: Value = resp.json().await.expect("json");
        body["images"][0]["id"]
            .as_str()
            .expect("image id")
            .to_string()
    }

    async fn session(&self, srv: &Serve) -> String {
        let resp = self
            .client
            .post(srv.url("/v1/sessions"))
            .bearer_auth(&self.token)
            .json(&json!({"title": "durable"}))
            .send()
            .await
            .expect("session");
        let body: Value = resp.json().await.expect("json");
        body["id"].as_str().expect("session id").to_string()
    }

    /// POSTs and reads the NDJSON events to the end of the stream (or until it breaks).
    async fn stream(&self, url: String, body: Option<Value>) -> Vec<Value> {
        let mut req = self.client.post(&url).bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let mut resp = req
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {url}: {e}"));
        assert!(resp.status().is_success(), "POST {url}: {}", resp.status());
        let mut text = String::new();
        while let Ok(Some(chunk)) = resp.chunk().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    async fn ask(&self, srv: &Serve, ses: &str, img: &str) -> Vec<Value> {
        self.stream(
            srv.url(&format!("/v1/sessions/{ses}/messages")),
            Some(json!({"question": QUESTION, "images": [img]})),
        )
        .await
    }

    async fn run(&self, srv: &Serve, ses: &str) -> Value {
        let runs = self.get(srv.url(&format!("/v1/sessions/{ses}/runs"))).await;
        runs["runs"][0].clone()
    }

    /// Polls until the session's run has `status` (a server marks it within a heartbeat or
    /// two of the stale limit).
    async fn wait_status(&self, srv: &Serve, ses: &str, status: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let run = self.run(srv, ses).await;
            if run["status"] == status {
                return run;
            }
            assert!(
                Instant::now() < deadline,
                "run never became {status}: {run}\n{}",
                srv.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn messages(&self, srv: &Serve, ses: &str) -> Vec<Value> {
        let body = self
            .get(srv.url(&format!("/v1/sessions/{ses}/messages")))
            .await;
        body["messages"].as_array().cloned().unwrap_or_default()
    }

    /// Waits until the session's stored messages satisfy `ok`.
    async fn wait_messages(&self, srv: &Serve, ses: &str, ok: impl Fn(&[Value]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ok(&self.messages(srv, ses).await) {
            assert!(Instant::now() < deadline, "messages never arrived");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn tool_audit(&self, srv: &Serve, run_id: &str) -> Vec<String> {
        let resp = self
            .client
            .get(srv.url("/v1/audit"))
            .bearer_auth(&self.token)
            .send()
            .await
            .expect("audit");
        assert!(resp.status().is_success(), "audit: {}", resp.status());
        resp.text()
            .await
            .expect("audit text")
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|r| r["kind"] == "tool_call" && r["run_id"] == run_id)
            .map(|r| r["name"].as_str().unwrap_or_default().to_string())
            .collect()
    }
}

fn tool_names(messages: &[Value]) -> Vec<String> {
    let mut names: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            m["message"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    names.sort();
    names
}

fn final_answer(events: &[Value]) -> String {
    events
        .iter()
        .find(|e| e["type"] == "final")
        .and_then(|e| e["answer"].as_str())
        .unwrap_or_else(|| panic!("no final event in {events:?}"))
        .to_string()
}

// ---- databases ----

struct TestDb {
    dir: tempfile::TempDir,
    url: String,
    pg: Option<(String, String)>,
}

impl TestDb {
    fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("sqlite://{}", dir.path().join("hilum.db").display());
        TestDb { dir, url, pg: None }
    }

    fn postgres() -> Option<TestDb> {
        let Ok(base) = std::env::var("HILUM_TEST_POSTGRES_URL") else {
            eprintln!(
                "\n*** SKIPPED on PostgreSQL: HILUM_TEST_POSTGRES_URL is not set. Run \
                 `eval \"$(scripts/setup_postgres.sh)\"` (or scripts/test.sh). ***\n"
            );
            return None;
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let name = format!("hilum_durable_{}_{nanos}", std::process::id());
        pg_admin(&base, &format!("CREATE DATABASE {name}"));
        let (head, query) = match base.split_once('?') {
            Some((b, q)) => (b.to_string(), format!("?{q}")),
            None => (base.clone(), String::new()),
        };
        let host_end = head.rfind('/').expect("a database in the URL");
        let mut url = format!("{}/{name}{query}", &head[..host_end]);
        // Over verified TLS when the test cluster's CA is known (scripts/setup_postgres.sh).
        if let Ok(ca) = std::env::var("HILUM_TEST_POSTGRES_CA") {
            let sep = if query.is_empty() { '?' } else { '&' };
            url = format!("{url}{sep}sslmode=verify-full&sslrootcert={ca}");
        }
        Some(TestDb {
            dir: tempfile::tempdir().expect("tempdir"),
            url,
            pg: Some((base, name)),
        })
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let Some((base, name)) = self.pg.take() {
            pg_admin(
                &base,
                &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
            );
        }
    }
}

/// CREATE/DROP DATABASE, on a thread and runtime of its own (it runs in `Drop`).
fn pg_admin(url: &str, sql: &str) {
    let (url, sql) = (url.to_string(), sql.to_string());
    let done = std::thread::spawn(move || {
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
                .map_err(|e| format!("{sql}: {e}"))
        })
    })
    .join();
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("HILUM_TEST_POSTGRES_URL: {e}"),
        Err(_) => eprintln!("the PostgreSQL admin thread panicked"),
    }
}

// ---- the tests ----

/// What must be stored when the server dies at `point`: the tool results that finished.
fn finished_before(point: Point) -> Vec<&'static str> {
    match point {
        Point::Tool => vec!["image_info"],
        Point::BetweenRounds => vec!["answer_visual_question", "image_info"],
        Point::Answer => vec![
            "answer_visual_question",
            "answer_visual_question",
            "image_info",
        ],
    }
}

async fn kill_at_three_points_then_resume(db: &TestDb) {
    let dir = db.dir.path();
    let (model, model_url) = Model::start().await;
    let admin = token(&db.url, dir, true);
    let api = Api {
        client: reqwest::Client::new(),
        token: admin,
    };
    let mut srv = Serve::start(&db.url, &model_url, dir, &[]);
    let img = api.upload(&srv).await;

    // The answer of an uninterrupted run, and the conversation its model was asked to answer.
    let ses = api.session(&srv).await;
    let events = api.ask(&srv, &ses, &img).await;
    let expected = final_answer(&events);
    assert!(expected.contains("pleural effusion"), "{expected}");
    assert!(expected.contains("not enlarged"), "{expected}");
    let expected_conversation = model.last_final();
    let run = api.wait_status(&srv, &ses, "completed").await;
    assert_eq!(
        api.tool_audit(&srv, run["id"].as_str().unwrap_or_default())
            .await
            .len(),
        3
    );

    for point in [Point::Tool, Point::BetweenRounds, Point::Answer] {
        let ses = api.session(&srv).await;
        model.hold(point, "", false);
        let vlm_before = model.vlm_answered();
        let asking = {
            let client = api.client.clone();
            let url = srv.url(&format!("/v1/sessions/{ses}/messages"));
            let token = api.token.clone();
            let img = img.clone();
            // The stream breaks when the server dies; what it got is not needed.
            tokio::spawn(async move {
                let resp = client
                    .post(url)
                    .bearer_auth(token)
                    .json(&json!({"question": QUESTION, "images": [img]}))
                    .send()
                    .await;
                if let Ok(mut resp) = resp {
                    while let Ok(Some(_)) = resp.chunk().await {}
                }
            })
        };
        model.wait_held().await;
        let must_have = finished_before(point);
        match point {
            // image_info ends at once; the VLM call is held. Kill once its result is stored.
            Point::Tool => {
                api.wait_messages(&srv, &ses, |m| tool_names(m) == ["image_info"])
                    .await
            }
            // The answer's first tokens reached the server (its events are stored as sent).
            Point::Answer => {
                let run_id = api.run(&srv, &ses).await["id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let ev = api
                        .get(srv.url(&format!("/v1/sessions/{ses}/runs/{run_id}/events")))
                        .await;
                    let streamed = ev["events"]
                        .as_array()
                        .is_some_and(|e| e.iter().any(|e| e["type"] == "token"));
                    if streamed {
                        break;
                    }
                    assert!(Instant::now() < deadline, "no token streamed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            // The model is asked for round 2 only after round 1's results are stored.
            Point::BetweenRounds => {}
        }
        srv.kill();
        asking.abort();
        model.clear_holds();

        srv = Serve::start(&db.url, &model_url, dir, &[]);
        let run = api.wait_status(&srv, &ses, "interrupted").await;
        let run_id = run["id"].as_str().unwrap_or_default().to_string();
        let messages = api.messages(&srv, &ses).await;
        assert_eq!(messages[0]["role"], "user", "{point:?}: question first");
        assert!(
            messages[0]["message"]["content"]
                .as_str()
                .is_some_and(|c| c.starts_with(QUESTION)),
            "{point:?}: {}",
            messages[0]
        );
        assert_eq!(
            tool_names(&messages),
            must_have,
            "{point:?}: stored results"
        );
        let mut audited = api.tool_audit(&srv, &run_id).await;
        audited.sort();
        assert_eq!(
            audited, must_have,
            "{point:?}: one audit row per executed call"
        );

        let vlm_at_kill = model.vlm_answered();
        let events = api
            .stream(
                srv.url(&format!("/v1/sessions/{ses}/runs/{run_id}/resume")),
                None,
            )
            .await;
        assert_eq!(events[0]["type"], "run_started", "{point:?}");
        assert_eq!(events[0]["resumed"], true, "{point:?}");
        assert_eq!(final_answer(&events), expected, "{point:?}: same answer");
        assert_eq!(
            model.last_final(),
            expected_conversation,
            "{point:?}: the model saw the same conversation as without the kill"
        );
        let run = api.wait_status(&srv, &ses, "completed").await;
        assert_eq!(run["answer"].as_str(), Some(expected.as_str()));
        // Every call ran exactly once: no finished call ran again.
        let mut audited = api.tool_audit(&srv, &run_id).await;
        audited.sort();
        assert_eq!(
            audited,
            [
                "answer_visual_question",
                "answer_visual_question",
                "image_info"
            ],
            "{point:?}"
        );
        let vqa_done_before = must_have
            .iter()
            .filter(|n| **n == "answer_visual_question")
            .count();
        assert_eq!(vlm_at_kill - vlm_before, vqa_done_before, "{point:?}");
        assert_eq!(
            model.vlm_answered() - vlm_at_kill,
            2 - vqa_done_before,
            "{point:?}: the VLM answered each question once"
        );
        // A completed run is not resumable.
        let again = api
            .client
            .post(srv.url(&format!("/v1/sessions/{ses}/runs/{run_id}/resume")))
            .bearer_auth(&api.token)
            .send()
            .await
            .expect("resume again");
        assert_eq!(again.status(), 409);
        // The stored conversation reads as one run's: question, decisions, results, answer.
        let messages = api.messages(&srv, &ses).await;
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            roles,
            [
                "user",
                "assistant",
                "tool",
                "tool",
                "assistant",
                "tool",
                "assistant"
            ],
            "{point:?}"
        );
    }
    drop(srv);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_three_points_then_resume_on_sqlite() {
    kill_at_three_points_then_resume(&TestDb::sqlite()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_at_three_points_then_resume_on_postgres() {
    if let Some(db) = TestDb::postgres() {
        kill_at_three_points_then_resume(&db).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_then_interrupts_and_exits_zero() {
    let db = TestDb::sqlite();
    let dir = db.dir.path();
    let (model, model_url) = Model::start().await;
    let api = Api {
        client: reqwest::Client::new(),
        token: token(&db.url, dir, true),
    };
    let srv = Serve::start(&db.url, &model_url, dir, &["--drain-secs", "5"]);
    let img = api.upload(&srv).await;
    let fast = api.session(&srv).await;
    let slow = api.session(&srv).await;
    // The fast run waits between rounds until released; the slow one's VLM call never ends.
    model.hold(Point::BetweenRounds, "", true);
    model.hold(Point::Tool, "slow", false);
    let ask = |ses: String, question: &'static str| {
        let client = api.client.clone();
        let url = srv.url(&format!("/v1/sessions/{ses}/messages"));
        let token = api.token.clone();
        let img = img.clone();
        tokio::spawn(async move {
            let mut resp = client
                .post(url)
                .bearer_auth(token)
                .json(&json!({"question": question, "images": [img]}))
                .send()
                .await
                .expect("ask");
            let mut text = String::new();
            while let Ok(Some(chunk)) = resp.chunk().await {
                text.push_str(&String::from_utf8_lossy(&chunk));
            }
            text
        })
    };
    let fast_events = ask(fast.clone(), "fast: Is there a pleural effusion?");
    model.wait_held().await;
    let slow_events = ask(slow.clone(), "slow: Is there a pleural effusion?");
    model.wait_held().await;

    let pid = srv.child.id().to_string();
    let term = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill -TERM");
    assert!(term.success());
    // Release the fast run only once the server is draining: it finishes inside the window.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !srv.log().contains("shutting down") {
        assert!(Instant::now() < deadline, "no drain: {}", srv.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    model.release();

    let fast_events = tokio::time::timeout(Duration::from_secs(60), fast_events)
        .await
        .expect("the fast run's stream ends")
        .expect("join");
    assert!(
        fast_events.contains("\"type\":\"complete\""),
        "{fast_events}"
    );
    let slow_events = tokio::time::timeout(Duration::from_secs(60), slow_events)
        .await
        .expect("the slow run's stream ends")
        .expect("join");
    assert!(
        slow_events.contains("\"type\":\"interrupted\""),
        "{slow_events}"
    );

    let mut srv = srv;
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = srv.child.try_wait().expect("wait") {
            break status;
        }
        assert!(Instant::now() < deadline, "still running: {}", srv.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "exit {status:?}: {}", srv.log());

    // The database says the same, read by a new server; the interrupted run resumes.
    let srv = Serve::start(&db.url, &model_url, dir, &[]);
    model.clear_holds();
    assert_eq!(api.run(&srv, &fast).await["status"], "completed");
    let run = api.run(&srv, &slow).await;
    assert_eq!(run["status"], "interrupted", "{run}");
    let run_id = run["id"].as_str().unwrap_or_default();
    let events = api
        .stream(
            srv.url(&format!("/v1/sessions/{slow}/runs/{run_id}/resume")),
            None,
        )
        .await;
    assert!(final_answer(&events).contains("pleural effusion"));
    api.wait_status(&srv, &slow, "completed").await;
}
