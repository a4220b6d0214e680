//! The logs of `hilum serve`, `hilum mcp` and `hilum analyze -v` hold no PHI. A real DICOM
//! radiograph is given a patient name, id and birth date (and is uploaded under a file name
//! and asked about in a question that carry markers too); a session runs `dicom_info` and
//! `image_info` on it through a real `hilum serve` with `RUST_LOG=trace`, in both log formats.
//! No log line and no row of the audit export holds any marker, and every line written for a
//! request carries that request's id (`x-request-id` taken when sane, made otherwise, and
//! returned). MCP on stdio logs to stderr only.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dicom_core::{DataElement, PrimitiveValue, VR};
use dicom_dictionary_std::tags;
use serde_json::{json, Value};

const DICOM: &str = "cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm";
const PATIENT_NAME: &str = "PHIMARKNAME^ZELDA";
const PATIENT_ID: &str = "PHIMRN-44170917";
const BIRTH_DATE: &str = "19380517";
const FILE_NAME: &str = "PHIFILE-DOE-ZELDA.dcm";
const QUESTION: &str = "Zelda PHIQUESTION-5521 asks: is this a PA view?";

/// Strings that must appear in no log line and no audit row: the DICOM's patient fields
/// (and the parts of the name, and the birth date as a date), the file name, the question.
const MARKERS: &[&str] = &[
    "PHIMARKNAME",
    "ZELDA",
    "Zelda",
    PATIENT_ID,
    BIRTH_DATE,
    "1938-05-17",
    "PHIFILE",
    "PHIQUESTION",
];

fn data(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(rel)
}

/// The real file with the patient's name, id and birth date set.
fn dicom_with_phi(dir: &Path) -> PathBuf {
    let bytes = std::fs::read(data(DICOM)).expect("test DICOM (../shared/data)");
    let mut obj = dicom_object::from_reader(&bytes[..]).expect("parse the test DICOM");
    for (tag, vr, v) in [
        (tags::PATIENT_NAME, VR::PN, PATIENT_NAME),
        (tags::PATIENT_ID, VR::LO, PATIENT_ID),
        (tags::PATIENT_BIRTH_DATE, VR::DA, BIRTH_DATE),
    ] {
        obj.put(DataElement::new(tag, vr, PrimitiveValue::from(v)));
    }
    let mut out = Vec::new();
    obj.write_all(&mut out).expect("write the DICOM");
    let path = dir.join(FILE_NAME);
    std::fs::write(&path, &out).expect("write");
    // The markers really are in the file: a test that could not find them proves nothing.
    for m in [PATIENT_NAME, PATIENT_ID, BIRTH_DATE] {
        assert!(out.windows(m.len()).any(|w| w == m.as_bytes()), "{m}");
    }
    path
}

fn hilum(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_DB")
        .env("HILUM_CONFIG", "/dev/null")
        .env("HILUM_MODELS_DIR", dir.join("models"))
        .env("RUST_LOG", "trace");
    c
}

fn script(dir: &Path) -> PathBuf {
    let path = dir.join("script.json");
    let turns = json!([
        {"content": "Checking the file.", "tool_calls": [
            {"name": "dicom_info", "arguments": {"image": "$IMAGE"}},
            {"name": "image_info", "arguments": {"image": "$IMAGE"}}
        ]},
        {"content": "The DICOM metadata and the image size were read."}
    ]);
    std::fs::write(&path, turns.to_string()).expect("write script");
    path
}

/// Every stderr line of a child, collected by a thread until the pipe closes.
struct Lines {
    lines: Arc<Mutex<Vec<String>>>,
    reader: std::thread::JoinHandle<()>,
}

impl Lines {
    fn collect(stderr: std::process::ChildStderr, first: std::sync::mpsc::Sender<String>) -> Self {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let base = rest.split_whitespace().next().unwrap_or_default();
                    let _ = first.send(base.trim_end_matches('"').to_string());
                }
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
        Lines { lines, reader }
    }

    fn finish(self) -> Vec<String> {
        let _ = self.reader.join();
        let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        lines.clone()
    }
}

struct Serve {
    child: Child,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn token(dir: &Path, db: &str) -> String {
    let out = hilum(dir)
        .args([
            "serve", "token", "create", "--name", "ops", "--admin", "--db", db,
        ])
        .output()
        .expect("token create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// What a session left: the server's stderr lines, the audit export (HTTP and CLI), and the
/// request ids the server returned for requests sent without a sane one.
struct Session {
    lines: Vec<String>,
    audit: String,
    made_ids: Vec<String>,
}

/// Ids the test sends; each must be returned and must mark that request's lines.
const UPLOAD: &str = "logtest-upload";
const SESSION: &str = "logtest-session";
const ASK: &str = "logtest-ask";
const AUDIT: &str = "logtest-audit";

async fn session(format: &str) -> Session {
    let dir = tempfile::tempdir().expect("tempdir");
    let dcm = dicom_with_phi(dir.path());
    let db = format!("sqlite://{}", dir.path().join("hilum.db").display());
    let tok = token(dir.path(), &db);
    let script = script(dir.path());
    let mut child = hilum(dir.path())
        .args(["serve", "--db", &db, "--bind", "127.0.0.1:0"])
        .arg("--llm")
        .arg(format!("script:{}", script.display()))
        .args(["--log-format", format])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start hilum serve");
    let (tx, rx) = std::sync::mpsc::channel();
    let lines = Lines::collect(child.stderr.take().expect("stderr"), tx);
    let mut srv = Serve { child };
    let base = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("hilum serve is listening");
    let url = |p: &str| format!("{base}{p}");
    let client = reqwest::Client::new();
    let returned = |r: &reqwest::Response| {
        r.headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };

    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(std::fs::read(&dcm).expect("dicom"))
            .file_name(FILE_NAME)
            .mime_str("application/dicom")
            .expect("mime"),
    );
    let up = client
        .post(url("/v1/images"))
        .bearer_auth(&tok)
        .header("x-request-id", UPLOAD)
        .multipart(form)
        .send()
        .await
        .expect("upload");
    assert_eq!(up.status(), 201);
    assert_eq!(returned(&up), UPLOAD);
    let body: Value = up.json().await.expect("json");
    let img = body["images"][0]["id"].as_str().expect("id").to_string();

    let ses = client
        .post(url("/v1/sessions"))
        .bearer_auth(&tok)
        .header("x-request-id", SESSION)
        .json(&json!({"title": "logs"}))
        .send()
        .await
        .expect("session");
    assert_eq!(returned(&ses), SESSION);
    let ses: Value = ses.json().await.expect("json");
    let ses = ses["id"].as_str().expect("id").to_string();

    let ask = client
        .post(url(&format!("/v1/sessions/{ses}/messages")))
        .bearer_auth(&tok)
        .header("x-request-id", ASK)
        .json(&json!({"question": QUESTION, "images": [img]}))
        .send()
        .await
        .expect("ask");
    assert_eq!(ask.status(), 200);
    assert_eq!(returned(&ask), ASK);
    let events = ask.text().await.expect("events");
    assert!(events.contains("\"type\":\"final\""), "{events}");
    assert!(events.contains("\"tool_finished\""), "{events}");

    // No id, and an id a log line could be forged with: the server makes its own.
    let mut made_ids = Vec::new();
    for sent in [None, Some("two words\tand a tab"), Some(&*"x".repeat(129))] {
        let mut req = client
            .post(url("/v1/tools/dicom_info:call"))
            .bearer_auth(&tok)
            .json(&json!({"image": img}));
        if let Some(id) = sent {
            req = req.header("x-request-id", id);
        }
        let resp = req.send().await.expect("direct call");
        assert_eq!(resp.status(), 200);
        let id = returned(&resp);
        assert!(
            id.starts_with("req_") && id.len() == 28,
            "a made id, not {id:?}"
        );
        assert!(!made_ids.contains(&id), "ids are unique");
        made_ids.push(id);
    }

    let export = client
        .get(url("/v1/audit"))
        .bearer_auth(&tok)
        .header("x-request-id", AUDIT)
        .send()
        .await
        .expect("audit");
    assert_eq!(returned(&export), AUDIT);
    let mut audit = export.text().await.expect("audit text");
    let tool_rows = audit
        .lines()
        .filter(|l| l.contains("\"tool_call\"") && l.contains("dicom_info"))
        .count();
    assert_eq!(
        tool_rows, 4,
        "the run's call and three direct calls: {audit}"
    );

    // SIGTERM: the server drains and exits, so every line it had to write is written.
    let term = Command::new("kill")
        .args(["-TERM", &srv.child.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(term.success());
    let status = srv.child.wait().expect("wait");
    assert!(status.success(), "hilum serve exited with {status}");
    let lines = lines.finish();

    let cli = hilum(dir.path())
        .args(["serve", "audit", "export", "--db", &db])
        .output()
        .expect("audit export");
    assert!(cli.status.success());
    audit.push_str(&String::from_utf8_lossy(&cli.stdout));
    Session {
        lines,
        audit,
        made_ids,
    }
}

fn assert_no_phi(what: &str, text: &str) {
    for m in MARKERS {
        assert!(!text.contains(m), "{what} holds `{m}`:\n{text}");
    }
}

/// Lines that belong to the process or to a connection (which carries many requests), not to
/// one request: what the operator is told at start and stop, and axum's own lines (accepted
/// connections, the shutdown signal).
fn process_line(target: &str, message: &str) -> bool {
    target == "axum::serve"
        || message.starts_with("hilum serve")
        || message.starts_with("shutting down")
        || message.starts_with("drain window over")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_hold_no_phi_and_every_request_line_its_id() {
    let s = session("text").await;
    assert_no_phi("the audit export", &s.audit);
    assert!(s.lines.len() > 10, "{:#?}", s.lines);
    for line in &s.lines {
        assert_no_phi("a log line", line);
        // Outside a span: `TIME LEVEL target: message fields`; notices are the message alone.
        let (head, message) = line.split_once(": ").unwrap_or(("", line));
        let target = head.rsplit(' ').next().unwrap_or_default();
        assert!(
            line.contains("request_id=") || process_line(target, message) || process_line("", line),
            "a line without a request id: {line}"
        );
    }
    let of = |id: &str| -> Vec<&String> {
        s.lines
            .iter()
            .filter(|l| l.contains(&format!("request_id={id}")))
            .collect()
    };
    for id in [UPLOAD, SESSION, ASK, AUDIT] {
        assert!(
            of(id).iter().any(|l| l.contains("request answered")),
            "{id}: {:#?}",
            s.lines
        );
    }
    for id in &s.made_ids {
        let lines = of(id);
        assert!(
            lines.iter().any(|l| l.contains("tool call finished")),
            "{id}: {lines:#?}"
        );
    }
    for tool in ["dicom_info", "image_info"] {
        let done = of(ASK)
            .into_iter()
            .find(|l| l.contains("tool call finished") && l.contains(&format!("tool=\"{tool}\"")))
            .unwrap_or_else(|| panic!("no finished {tool} call of the run: {:#?}", s.lines));
        assert!(
            done.contains("duration_ms=")
                && done.contains("outcome=\"ok\"")
                && done.contains("run{"),
            "{done}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_hold_no_phi_and_every_request_line_its_id() {
    let s = session("json").await;
    assert_no_phi("the audit export", &s.audit);
    assert!(s.lines.len() > 10, "{:#?}", s.lines);
    let mut by_request: std::collections::HashMap<String, Vec<Value>> = Default::default();
    for line in &s.lines {
        assert_no_phi("a log line", line);
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a line that is not JSON ({e}): {line}"));
        let message = v["fields"]["message"].as_str().unwrap_or_default();
        let request = v["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|s| s["request_id"].as_str());
        match request {
            Some(id) => by_request
                .entry(id.to_string())
                .or_default()
                .push(v.clone()),
            None => assert!(
                process_line(v["target"].as_str().unwrap_or_default(), message),
                "a line without a request id: {line}"
            ),
        }
    }
    for id in [UPLOAD, SESSION, ASK, AUDIT] {
        let lines = by_request.get(id).cloned().unwrap_or_default();
        assert!(
            lines
                .iter()
                .any(|l| l["fields"]["message"] == "request answered"
                    && l["fields"]["status"].is_u64()
                    && l["fields"]["duration_ms"].is_f64()),
            "{id}: {lines:#?}"
        );
    }
    let run = by_request.get(ASK).cloned().unwrap_or_default();
    for tool in ["dicom_info", "image_info"] {
        let done = run
            .iter()
            .find(|l| {
                l["fields"]["message"] == "tool call finished"
                    && l["spans"]
                        .as_array()
                        .is_some_and(|s| s.iter().any(|s| s["tool"] == tool))
            })
            .unwrap_or_else(|| panic!("no finished {tool} call of the run: {run:#?}"));
        assert_eq!(done["fields"]["outcome"], "ok", "{done}");
        assert!(done["fields"]["duration_ms"].is_f64(), "{done}");
        let spans: Vec<&str> = done["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["name"].as_str())
            .collect();
        assert_eq!(spans, ["request", "run", "tool_call"], "{done}");
    }
    for id in &s.made_ids {
        assert!(by_request.contains_key(id), "{id}");
    }
}

/// `hilum mcp` answers on stdout and logs on stderr only; rmcp's trace lines (which hold whole
/// messages: the file's path here) are never written.
#[test]
fn mcp_logs_to_stderr_only_and_holds_no_phi() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dcm = dicom_with_phi(dir.path());
    let mut child = hilum(dir.path())
        .args(["mcp", "--log-format", "json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start hilum mcp");
    let (tx, _rx) = std::sync::mpsc::channel();
    let lines = Lines::collect(child.stderr.take().expect("stderr"), tx);
    let mut stdin = child.stdin.take().expect("stdin");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut out = Vec::new();
    let mut send = |msg: Value, answer: bool| -> Value {
        writeln!(stdin, "{msg}").expect("write");
        stdin.flush().expect("flush");
        if !answer {
            return Value::Null;
        }
        let mut line = String::new();
        stdout.read_line(&mut line).expect("read");
        out.push(line.clone());
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("stdout is MCP only ({e}): {line}"))
    };
    mcp_session(&mut send, &dcm);
    drop(stdin);
    let status = child.wait().expect("wait");
    assert!(status.success(), "{status}");
    let lines = lines.finish();
    for line in &out {
        assert!(line.contains("\"jsonrpc\""), "{line}");
    }
    assert!(
        lines
            .iter()
            .any(|l| l.contains("tool call finished") && l.contains("dicom_info")),
        "{lines:#?}"
    );
    for line in &lines {
        assert_no_phi("a log line", line);
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v["level"].is_string(), "{line}");
    }
}

/// Initialises, loads the file by its path and reads its DICOM metadata.
fn mcp_session(send: &mut impl FnMut(Value, bool) -> Value, dcm: &Path) {
    send(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "hilum-test", "version": "0"}}}),
        true,
    );
    send(
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        false,
    );
    let loaded = send(
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "load_image", "arguments": {"path": dcm.display().to_string()}}}),
        true,
    );
    let img = loaded["result"]["structuredContent"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{loaded}"))
        .to_string();
    let info = send(
        json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
            "name": "dicom_info", "arguments": {"image": img}}}),
        true,
    );
    assert_eq!(info["result"]["isError"], false, "{info}");
}

/// `hilum analyze` logs only with -v; its log lines hold no PHI either.
#[test]
fn analyze_logs_only_with_verbose() {
    let dir = tempfile::tempdir().expect("tempdir");
    let dcm = dicom_with_phi(dir.path());
    let script = script(dir.path());
    let run = |extra: &[&str]| {
        let out = hilum(dir.path())
            .arg("analyze")
            .arg(&dcm)
            .arg("--llm")
            .arg(format!("script:{}", script.display()))
            .args(["--question", QUESTION, "--log-format", "json"])
            .args(extra)
            .output()
            .expect("hilum analyze");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["level"].is_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(run(&[]), Vec::<Value>::new(), "no log lines without -v");
    let logs = run(&["-v"]);
    assert!(
        logs.iter()
            .any(|l| l["fields"]["message"] == "tool call finished"),
        "{logs:#?}"
    );
    for l in &logs {
        assert_no_phi("a log line", &l.to_string());
    }
}
