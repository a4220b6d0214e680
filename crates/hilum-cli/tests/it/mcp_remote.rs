//! Remote tools from other MCP servers, end to end: a real `hilum` process whose agent (a
//! scripted model) calls the tools of a server written with the official MCP Python SDK
//! (scripts/mcp_fixture_server.py, over stdio and streamable HTTP) and of a second Hilum
//! (`hilum serve`'s `/mcp`, with a bearer token), beside its own tools in the same round.
//! Failures (a server down at start, killed mid-call, malformed or 10 MB results, a schema
//! that does not compile, a wrong token) and privacy (what bytes reach the server) too.
//!
//! Needs scripts/.venv-mcp (`bash scripts/setup_mcp_client.sh`); skipped without it unless
//! HILUM_REQUIRE_MCP_CLIENT is set.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

const IMAGE: &str = "cxr/images/nih_00000001_000_cardiomegaly.png";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn data(rel: &str) -> PathBuf {
    repo().join("../shared/data").join(rel)
}

fn python() -> Option<PathBuf> {
    let py = repo().join("scripts/.venv-mcp/bin/python");
    if py.exists() {
        return Some(py);
    }
    assert!(
        std::env::var("HILUM_REQUIRE_MCP_CLIENT").is_err(),
        "the MCP Python SDK venv is missing: run `bash scripts/setup_mcp_client.sh`"
    );
    eprintln!("skipping: no scripts/.venv-mcp (run `bash scripts/setup_mcp_client.sh`)");
    None
}

fn fixture() -> String {
    repo()
        .join("scripts/mcp_fixture_server.py")
        .display()
        .to_string()
}

fn hilum(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_DB")
        .env("HILUM_CONFIG", "/dev/null")
        .env("HILUM_MODELS_DIR", dir.join("models"));
    c
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A child process killed when the test ends.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The fixture over streamable HTTP on `port`, ready for connections.
fn http_fixture(py: &Path, port: u16, token: &str, record: &Path) -> Proc {
    let child = Command::new(py)
        .arg(fixture())
        .args(["--http", &port.to_string(), "--token", token])
        .arg("--record")
        .arg(record)
        .stdout(Stdio::null())
        .spawn()
        .expect("start the fixture server");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "fixture server never listened");
        std::thread::sleep(Duration::from_millis(100));
    }
    Proc(child)
}

/// The stdio fixture's `[[mcp.servers]]` entry, named `name`.
fn stdio_entry(py: &Path, name: &str, extra_args: &[&str], allow_pixels: bool) -> String {
    let mut args = vec![fixture()];
    args.extend(extra_args.iter().map(|s| s.to_string()));
    format!(
        "[[mcp.servers]]\nname = \"{name}\"\ncommand = {}\nargs = {}\nenv = {{ PYTHONCOERCECLOCALE = \"0\", SITE_SETTING = \"on\" }}\nallow_pixels = {allow_pixels}\n",
        json!(py.display().to_string()),
        json!(args),
    )
}

struct Run {
    events: Vec<Value>,
    stderr: String,
    ok: bool,
}

impl Run {
    fn finished(&self, name: &str) -> &Value {
        self.events
            .iter()
            .find(|e| e["type"] == "tool_finished" && e["name"] == name)
            .unwrap_or_else(|| panic!("no result of {name}: {:#?}\n{}", self.events, self.stderr))
    }

    fn failed(&self, name: &str) -> String {
        self.events
            .iter()
            .find(|e| e["type"] == "tool_failed" && e["name"] == name)
            .and_then(|e| e["error"].as_str())
            .unwrap_or_else(|| panic!("{name} did not fail: {:#?}", self.events))
            .to_string()
    }

    fn final_event(&self) -> &Value {
        self.events
            .iter()
            .find(|e| e["type"] == "final")
            .unwrap_or_else(|| panic!("no final event: {:#?}\n{}", self.events, self.stderr))
    }
}

/// `hilum analyze --json` of the test image with a scripted model and `config`.
fn analyze_with(dir: &Path, config: &str, turns: Value, spawned: impl FnOnce(&Child)) -> Run {
    let cfg = dir.join(format!("config-{}.toml", free_port()));
    std::fs::write(&cfg, config).expect("config");
    let script = dir.join(format!("script-{}.json", free_port()));
    std::fs::write(&script, turns.to_string()).expect("script");
    let mut child = hilum(dir)
        .arg("analyze")
        .arg(data(IMAGE))
        .args([
            "--question",
            "How wide is the image, and what does the RIS lookup give?",
            "--json",
        ])
        .arg("--config")
        .arg(&cfg)
        .arg("--llm")
        .arg(format!("script:{}", script.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("hilum analyze");
    spawned(&child);
    let stdout = child.stdout.take().expect("stdout");
    let events: Vec<Value> = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    let out = child.wait_with_output().expect("wait");
    Run {
        events,
        stderr: String::from_utf8_lossy(&out.stderr).to_string(),
        ok: out.status.success(),
    }
}

fn analyze(dir: &Path, config: &str, turns: Value) -> Run {
    analyze_with(dir, config, turns, |_| {})
}

fn call(name: &str) -> Value {
    json!({"name": name, "arguments": {"image": "$IMAGE"}})
}

/// The round a finished or failed call ran in.
fn round_of(run: &Run, name: &str) -> u64 {
    run.events
        .iter()
        .find(|e| e["name"] == name && (e["type"] == "tool_finished" || e["type"] == "tool_failed"))
        .and_then(|e| e["round"].as_u64())
        .unwrap_or_else(|| panic!("{name} never ran"))
}

fn check_remote_and_native(run: &Run) {
    assert!(run.ok, "{}", run.stderr);
    let info = run.finished("image_info");
    let prior = run.finished("site__prior_report");
    assert_eq!(
        round_of(run, "image_info"),
        round_of(run, "site__prior_report")
    );
    assert!(
        prior["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("0.47"),
        "{prior}"
    );
    assert_eq!(info["data"]["width"], 512);
    // Both numbers reach the answer, and the remote one counts as tool-produced.
    let fin = run.final_event();
    let answer = fin["answer"].as_str().unwrap_or_default();
    assert!(
        answer.contains("512") && answer.contains("0.47"),
        "{answer}"
    );
    assert_eq!(fin["grounded"], true, "{fin}");
}

fn two_tool_script() -> Value {
    json!([
        {"tool_calls": [call("image_info"), call("site__prior_report")]},
        {"content": "The image is 512 pixels wide; the RIS lookup gave an index of 0.47."}
    ])
}

#[test]
fn stdio_remote_tool_and_native_tool_share_a_round() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let run = analyze(
        dir.path(),
        &stdio_entry(&py, "site", &[], false),
        two_tool_script(),
    );
    check_remote_and_native(&run);
}

#[test]
fn http_remote_tool_with_a_token_and_native_tool_share_a_round() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let _server = http_fixture(&py, port, "s3cret", &dir.path().join("record"));
    let config = format!(
        "[[mcp.servers]]\nname = \"site\"\nurl = \"http://127.0.0.1:{port}/mcp\"\ntoken = \"s3cret\"\n"
    );
    let run = analyze(dir.path(), &config, two_tool_script());
    check_remote_and_native(&run);
    let record = std::fs::read(dir.path().join("record")).expect("record");
    assert!(String::from_utf8_lossy(&record).contains("Bearer s3cret"));
}

#[test]
fn a_wrong_token_leaves_the_server_out_and_the_rest_works() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let port = free_port();
    let _server = http_fixture(&py, port, "s3cret", &dir.path().join("record"));
    let config = format!(
        "[[mcp.servers]]\nname = \"site\"\nurl = \"http://127.0.0.1:{port}/mcp\"\ntoken = \"wrong\"\n"
    );
    let run = analyze(
        dir.path(),
        &config,
        json!([
            {"tool_calls": [call("image_info"), call("site__prior_report")]},
            {"content": "The image is 512 pixels wide."}
        ]),
    );
    assert!(run.ok, "{}", run.stderr);
    assert!(
        run.stderr.contains("MCP server `site` left out") && run.stderr.contains("401"),
        "{}",
        run.stderr
    );
    assert_eq!(run.finished("image_info")["data"]["width"], 512);
    let e = run.failed("site__prior_report");
    assert!(e.contains("site__prior_report"), "{e}");
}

/// A server down at start, a tool whose schema does not compile, a malformed result and a
/// 10 MB result: each is reported, and the other calls of the same round keep their results.
#[test]
fn broken_servers_and_results_cost_only_themselves() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = stdio_entry(&py, "site", &["--broken-schema"], false);
    config.push_str(&format!(
        "[[mcp.servers]]\nname = \"down\"\nurl = \"http://127.0.0.1:{}/mcp\"\nconnect_timeout_secs = 5\n",
        free_port()
    ));
    let run = analyze(
        dir.path(),
        &config,
        json!([
            {"tool_calls": [call("image_info"), call("site__prior_report"),
                            call("site__malformed_image"), call("site__huge_report"),
                            call("down__anything")]},
            {"content": "The image is 512 pixels wide; the RIS lookup gave an index of 0.47."}
        ]),
    );
    assert!(run.ok, "{}", run.stderr);
    assert!(
        run.stderr.contains("MCP server `down` left out"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("site__broken_schema") && run.stderr.contains("invalid JSON Schema"),
        "{}",
        run.stderr
    );
    let malformed = run.failed("site__malformed_image");
    assert!(
        malformed.contains("malformed content") && malformed.contains("not base64"),
        "{malformed}"
    );
    let huge = run.failed("site__huge_report");
    assert!(
        huge.contains("MB from `huge_report`, over its 4.0 MB limit"),
        "{huge}"
    );
    // The model called a tool of the server that is down: an unknown tool, named as such.
    assert!(run
        .failed("down__anything")
        .contains("no tool named `down__anything`"));
    check_remote_and_native(&run);
}

/// The server is killed in the middle of a call: that call fails with a clear error, the
/// round's other call keeps its result, and the next round's call reconnects.
#[test]
fn a_server_killed_mid_call_fails_that_call_and_is_reconnected() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let pid_file = dir.path().join("slow.pid");
    let pid_arg = pid_file.display().to_string();
    let config = stdio_entry(&py, "site", &["--pid-file", &pid_arg], false);
    let watched = pid_file.clone();
    let run = analyze_with(
        dir.path(),
        &config,
        json!([
            {"tool_calls": [call("image_info"), call("site__slow_report")]},
            {"tool_calls": [call("site__prior_report")]},
            {"content": "The image is 512 pixels wide; the RIS lookup gave an index of 0.47."}
        ]),
        move |_| {
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(60);
                let pid = loop {
                    if let Ok(p) = std::fs::read_to_string(&watched) {
                        if !p.trim().is_empty() {
                            break p.trim().to_string();
                        }
                    }
                    if Instant::now() > deadline {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                };
                let _ = Command::new("kill").args(["-9", &pid]).status();
            });
        },
    );
    assert!(run.ok, "{}", run.stderr);
    let e = run.failed("site__slow_report");
    assert!(
        e.contains("MCP server `site` failed during the call"),
        "{e}"
    );
    assert_eq!(run.finished("image_info")["data"]["width"], 512);
    // The next round's call to the same server reconnects (a new child process).
    assert!(round_of(&run, "site__prior_report") > round_of(&run, "site__slow_report"));
    let prior = run.finished("site__prior_report");
    assert!(
        prior["summary"]
            .as_str()
            .unwrap_or_default()
            .contains("0.47"),
        "{prior}"
    );
    let fin = run.final_event();
    assert_eq!(fin["grounded"], true, "{fin}");
}

/// Every byte the server receives is recorded. Without `allow_pixels` no PNG (raw or base64)
/// and nothing of the image's size reaches it; with it, exactly the de-identified PNG does.
/// The stdio server sees only the environment its entry names.
#[test]
fn pixels_reach_only_a_server_that_is_allowed_them() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let turns = json!([
        {"tool_calls": [call("site__prior_report"), call("site__image_bytes"),
                        {"name": "site__environment", "arguments": {}}]},
        {"content": "The RIS lookup gave an index of 0.47."}
    ]);
    let png_magic_b64 = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n");
    let png_magic_b64 = &png_magic_b64[..10];
    let image_bytes = std::fs::read(data(IMAGE)).expect("image");

    let closed = dir.path().join("closed.rec");
    let rec = closed.display().to_string();
    let run = analyze(
        dir.path(),
        &stdio_entry(&py, "site", &["--record", &rec], false),
        turns.clone(),
    );
    assert!(run.ok, "{}", run.stderr);
    let received = std::fs::read(&closed).expect("record");
    let text = String::from_utf8_lossy(&received);
    assert!(
        text.contains("prior_report") && text.contains("img_"),
        "{text}"
    );
    assert!(!received.windows(4).any(|w| w == b"\x89PNG"));
    assert!(
        !text.contains(png_magic_b64),
        "base64 PNG reached the server"
    );
    assert!(
        received.len() < 16 * 1024 && received.len() < image_bytes.len() / 10,
        "{} bytes reached the server",
        received.len()
    );
    let held = run.finished("site__image_bytes");
    assert!(
        held["summary"]
            .as_str()
            .unwrap_or_default()
            .ends_with("holds 0 bytes."),
        "{held}"
    );
    // Only what the entry names (Python adds nothing with PYTHONCOERCECLOCALE=0).
    let env: Value = serde_json::from_str(
        run.finished("site__environment")["summary"]
            .as_str()
            .unwrap_or_default(),
    )
    .expect("environment JSON");
    assert_eq!(env["names"], json!(["PYTHONCOERCECLOCALE", "SITE_SETTING"]));

    let open = dir.path().join("open.rec");
    let rec = open.display().to_string();
    let run = analyze(
        dir.path(),
        &stdio_entry(&py, "site", &["--record", &rec], true),
        turns,
    );
    assert!(run.ok, "{}", run.stderr);
    let received = String::from_utf8_lossy(&std::fs::read(&open).expect("record")).to_string();
    assert!(received.contains(png_magic_b64), "no PNG was sent");
    // The server got an image of its own, and names it by our id in its answer.
    let held = run.finished("site__image_bytes");
    let summary = held["summary"].as_str().unwrap_or_default();
    assert!(
        summary.starts_with("img_") && !summary.contains("img_site"),
        "{summary}"
    );
    assert!(!summary.ends_with("holds 0 bytes."), "{summary}");
    // What was sent is the de-identified 8-bit PNG: no text chunk, the image's size.
    let b64 = received
        .split("\"data_base64\":\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("the upload in the record");
    let png = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .expect("base64");
    assert!(!png
        .windows(4)
        .any(|w| w == b"tEXt" || w == b"iTXt" || w == b"zTXt"));
    let decoded = image::load_from_memory(&png).expect("png");
    assert_eq!((decoded.width(), decoded.height()), (512, 512));
}

// ---- a second Hilum ----

fn start_serve(dir: &Path, db: &str, extra: &[String]) -> (Proc, String) {
    let mut child = hilum(dir)
        .args(["serve", "--db", db, "--bind", "127.0.0.1:0"])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start hilum serve");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut sent = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if !sent {
                if let Some(rest) = line.split("listening on ").nth(1) {
                    let _ = tx.send(
                        rest.split_whitespace()
                            .next()
                            .unwrap_or_default()
                            .to_string(),
                    );
                    sent = true;
                }
            }
        }
    });
    let base = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("hilum serve listens");
    (Proc(child), base)
}

fn create_token(dir: &Path, db: &str, admin: bool) -> String {
    crate::common::create_token(hilum(dir), db, admin)
}

/// `hilum serve` with a remote server: a run's remote and native calls are both audited and
/// both stored with the run.
#[tokio::test]
async fn serve_audits_and_stores_remote_calls_beside_native_ones() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let db = format!("sqlite://{}", dir.path().join("h.db").display());
    let token = create_token(dir.path(), &db, true);
    let cfg = dir.path().join("serve.toml");
    std::fs::write(&cfg, stdio_entry(&py, "site", &[], false)).expect("config");
    let script = dir.path().join("serve.json");
    std::fs::write(&script, two_tool_script().to_string()).expect("script");
    let extra = [
        "--config".to_string(),
        cfg.display().to_string(),
        "--llm".to_string(),
        format!("script:{}", script.display()),
    ];
    let (_srv, base) = start_serve(dir.path(), &db, &extra);
    let client = reqwest::Client::new();
    let png = std::fs::read(data(IMAGE)).expect("image");
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(png)
            .file_name("chest.png")
            .mime_str("image/png")
            .expect("mime"),
    );
    let up: Value = client
        .post(format!("{base}/v1/images"))
        .bearer_auth(&token)
        .multipart(form)
        .send()
        .await
        .expect("upload")
        .json()
        .await
        .expect("json");
    let img = up["images"][0]["id"]
        .as_str()
        .expect("image id")
        .to_string();
    let ses: Value = client
        .post(format!("{base}/v1/sessions"))
        .bearer_auth(&token)
        .json(&json!({"title": "remote"}))
        .send()
        .await
        .expect("session")
        .json()
        .await
        .expect("json");
    let ses = ses["id"].as_str().expect("session id").to_string();
    let text = client
        .post(format!("{base}/v1/sessions/{ses}/messages"))
        .bearer_auth(&token)
        .json(&json!({"question": "How wide is the image, and what does the RIS lookup give?", "images": [img]}))
        .send()
        .await
        .expect("ask")
        .text()
        .await
        .expect("events");
    let run = Run {
        events: text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
        stderr: String::new(),
        ok: true,
    };
    check_remote_and_native(&run);

    let get = |path: String| {
        let req = client.get(format!("{base}{path}")).bearer_auth(&token);
        async move { req.send().await.expect("GET").text().await.expect("text") }
    };
    let runs: Value =
        serde_json::from_str(&get(format!("/v1/sessions/{ses}/runs")).await).expect("runs");
    let run_id = runs["runs"][0]["id"].as_str().expect("run id").to_string();
    assert_eq!(runs["runs"][0]["status"], "completed", "{runs}");
    let messages: Value =
        serde_json::from_str(&get(format!("/v1/sessions/{ses}/messages")).await).expect("messages");
    let mut stored: Vec<String> = messages["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            m["message"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect();
    stored.sort();
    assert_eq!(stored, ["image_info", "site__prior_report"]);
    let mut audited: Vec<String> = get("/v1/audit".into())
        .await
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r["kind"] == "tool_call" && r["run_id"] == run_id.as_str())
        .map(|r| r["name"].as_str().unwrap_or_default().to_string())
        .collect();
    audited.sort();
    assert_eq!(audited, ["image_info", "site__prior_report"]);
}

fn import_lung_unet(dir: &Path) {
    let out = hilum(dir)
        .args(["models", "import", "lung-unet"])
        .arg(data("models/lung_seg_unet/lung_seg_valiou_088.h5"))
        .output()
        .expect("import");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A workstation's agent calls a GPU server's `segment_lungs` through `hilum serve`'s `/mcp`
/// with a token; the image goes with the call (allow_pixels) and the result equals the local
/// tool's on the same image.
#[test]
fn a_remote_hilums_segment_lungs_equals_the_local_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    import_lung_unet(dir.path());
    let db = format!("sqlite://{}", dir.path().join("gpu.db").display());
    let token = create_token(dir.path(), &db, false);
    let (_gpu, base) = start_serve(dir.path(), &db, &[]);

    let config = format!(
        "[[mcp.servers]]\nname = \"gpu\"\nurl = \"{base}/mcp\"\ntoken_env = \"GPU_TOKEN\"\nallow_pixels = true\n"
    );
    let cfg = dir.path().join("ws.toml");
    std::fs::write(&cfg, &config).expect("config");
    let list = hilum(dir.path())
        .args(["tools", "list", "--json"])
        .env("HILUM_CONFIG", &cfg)
        .env("GPU_TOKEN", &token)
        .output()
        .expect("tools list");
    let listed: Value = serde_json::from_slice(&list.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&list.stderr)));
    let remote = listed
        .as_array()
        .expect("array")
        .iter()
        .find(|t| t["name"] == "gpu__segment_lungs")
        .expect("gpu__segment_lungs listed");
    assert_eq!(remote["server"], "gpu");
    // What each remote tool answers came in its `_meta` (hilum/capabilities), checked against
    // the GPU server's models: not read off its description, which for `measure_chest` and
    // `dicom_info` names the cardiothoracic ratio that only a heart model could measure.
    let topics = |name: &str| {
        listed
            .as_array()
            .and_then(|a| a.iter().find(|t| t["name"] == name))
            .map(|t| t["capabilities"].clone())
            .unwrap_or_else(|| panic!("{name} not listed"))
    };
    assert_eq!(topics("gpu__segment_lungs"), json!(["lung_size"]));
    assert_eq!(topics("gpu__segment_lungs"), topics("segment_lungs"));
    assert_eq!(topics("gpu__measure_chest"), json!(["lung_size"]));
    assert!(topics("measure_chest")
        .as_array()
        .is_some_and(|a| a.contains(&json!("ctr"))));
    assert_eq!(topics("gpu__dicom_info"), json!([]));
    assert!(!listed
        .as_array()
        .expect("array")
        .iter()
        .any(|t| t["name"] == "gpu__load_image"));

    let turns = json!([
        {"tool_calls": [call("segment_lungs"), call("gpu__segment_lungs")]},
        {"content": "Both lungs were segmented."}
    ]);
    let script = dir.path().join("ws.json");
    std::fs::write(&script, turns.to_string()).expect("script");
    let out = hilum(dir.path())
        .arg("analyze")
        .arg(data(IMAGE))
        .args(["--json", "--question", "Segment the lungs."])
        .arg("--config")
        .arg(&cfg)
        .arg("--llm")
        .arg(format!("script:{}", script.display()))
        .env("GPU_TOKEN", &token)
        .output()
        .expect("analyze");
    let run = Run {
        events: String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect(),
        stderr: String::from_utf8_lossy(&out.stderr).to_string(),
        ok: out.status.success(),
    };
    assert!(run.ok, "{}", run.stderr);
    let local = run.finished("segment_lungs");
    let remote = run.finished("gpu__segment_lungs");
    assert_eq!(
        round_of(&run, "segment_lungs"),
        round_of(&run, "gpu__segment_lungs")
    );
    // Equal but for the timings; the remote result speaks of the image by our id.
    let untimed = |v: &Value| {
        let mut v = v["data"].clone();
        if let Some(m) = v.as_object_mut() {
            m.remove("inference_ms");
            m.remove("latency_ms");
        }
        v
    };
    assert_eq!(
        untimed(remote),
        untimed(local),
        "remote and local results differ"
    );
    assert!(local["data"]["left_lung"]["area_px"].as_u64().unwrap_or(0) > 1000);
    // The overlay came back as an artifact.
    let pngs = |v: &Value| {
        v["artifacts"]
            .as_array()
            .map(|a| a.iter().filter(|x| x["media_type"] == "image/png").count())
    };
    assert_eq!(pngs(remote), pngs(local));
    assert!(pngs(remote) > Some(0));
}
