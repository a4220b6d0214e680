//! One image, three fronts, one picture: `hilum analyze --send-pixels`, `hilum serve
//! --send-pixels` and `hilum eval --send-pixels` send a real OpenAI-protocol server on 127.0.0.1
//! the same PNG bytes for one radiograph (a 1841x1955 15-bit JPEG 2000 CR, shown at most 1024
//! px on its longest side), the bytes of `hilum_imaging::model_view_png`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

const IMAGE: &str = "cxr/dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm";

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data")
}

fn hilum(dir: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_hilum"));
    c.env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("HILUM_LLM")
        .env_remove("HILUM_DB")
        .env("HILUM_CONFIG", "/dev/null")
        .env("HOME", "/nonexistent-hilum-home")
        .env("HILUM_MODELS_DIR", dir.join("models"));
    c
}

/// Request bodies the model server received, in order.
type Recorded = Arc<Mutex<Vec<Value>>>;

/// Records each request and answers with one letter and a sentence, no tool call.
async fn completions(State(seen): State<Recorded>, Json(req): Json<Value>) -> Response {
    seen.lock().expect("lock").push(req);
    let chunks = [
        json!({"choices": [{"index": 0, "delta": {"content": "A) the picture was seen"}, "finish_reason": null}]}),
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
        json!({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5}}),
    ];
    let mut body = String::new();
    for c in chunks {
        body.push_str(&format!("data: {c}\n\n"));
    }
    body.push_str("data: [DONE]\n\n");
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from(body))
        .expect("response")
}

async fn model_server() -> (Recorded, String) {
    let seen = Recorded::default();
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (seen, format!("http://{addr}/v1"))
}

/// The image URLs of the requests received since `from`.
fn image_urls(seen: &Recorded, from: usize) -> Vec<String> {
    let seen = seen.lock().expect("lock");
    seen[from..]
        .iter()
        .flat_map(|req| req["messages"].as_array().cloned().unwrap_or_default())
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|part| part["image_url"]["url"].as_str().map(str::to_string))
        .collect()
}

fn succeeded(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn analyze(dir: &Path, url: &str) {
    let out = hilum(dir)
        .args(["analyze", "--send-pixels", "--question", "What is shown?"])
        .args(["--llm", "openai:recorder", "--base-url", url])
        .arg(data_dir().join(IMAGE))
        .output()
        .expect("run hilum analyze");
    succeeded(&out, "hilum analyze");
}

fn eval(dir: &Path, url: &str) {
    let bench = dir.join("one.jsonl");
    let line = json!({"id": "q1", "images": [IMAGE], "question": "Which view is this?",
        "options": ["PA", "AP"], "answer": "A"});
    std::fs::write(&bench, format!("{line}\n")).expect("write bench");
    let out = hilum(dir)
        .arg("eval")
        .arg(&bench)
        .arg("--images-dir")
        .arg(data_dir())
        .args(["--llm", "openai:recorder", "--base-url", url])
        .args(["--send-pixels", "--quiet", "--out"])
        .arg(dir.join("run"))
        .output()
        .expect("run hilum eval");
    succeeded(&out, "hilum eval");
}

struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn serve(dir: &Path, url: &str) {
    let db = format!("sqlite://{}", dir.join("hilum.db").display());
    let out = hilum(dir)
        .args(["serve", "token", "create", "--name", "t", "--db", &db])
        .output()
        .expect("token create");
    succeeded(&out, "hilum serve token create");
    let tok = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let mut child = hilum(dir)
        .args([
            "serve",
            "--db",
            &db,
            "--bind",
            "127.0.0.1:0",
            "--send-pixels",
        ])
        .args(["--llm", "openai:recorder", "--base-url", url])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("start hilum serve");
    let stderr = child.stderr.take().expect("stderr");
    let _srv = Serve(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(rest) = line.split("listening on ").nth(1) {
                let base = rest.split_whitespace().next().unwrap_or_default();
                let _ = tx.send(base.trim_end_matches('"').to_string());
            }
        }
    });
    let base = rx
        .recv_timeout(Duration::from_secs(120))
        .expect("hilum serve is listening");
    let client = reqwest::Client::new();
    let file = std::fs::read(data_dir().join(IMAGE)).expect("test image (../shared/data)");
    let form = reqwest::multipart::Form::new().part(
        "file",
        reqwest::multipart::Part::bytes(file).file_name("image.dcm"),
    );
    let up = client
        .post(format!("{base}/v1/images"))
        .bearer_auth(&tok)
        .multipart(form)
        .send()
        .await
        .expect("upload");
    assert_eq!(up.status(), 201);
    let up: Value = up.json().await.expect("json");
    let img = up["images"][0]["id"]
        .as_str()
        .expect("image id")
        .to_string();
    let ses: Value = client
        .post(format!("{base}/v1/sessions"))
        .bearer_auth(&tok)
        .json(&json!({"title": "pixels"}))
        .send()
        .await
        .expect("session")
        .json()
        .await
        .expect("json");
    let ses = ses["id"].as_str().expect("session id");
    let ask = client
        .post(format!("{base}/v1/sessions/{ses}/messages"))
        .bearer_auth(&tok)
        .json(&json!({"question": "What is shown?", "images": [img]}))
        .send()
        .await
        .expect("ask");
    assert!(ask.status().is_success(), "ask: {}", ask.status());
    // The answer streams; reading it to the end waits for the model's request.
    let body = ask.text().await.expect("answer");
    assert!(body.contains("complete"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_server_and_eval_show_the_model_the_same_png() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (seen, url) = model_server().await;

    analyze(dir.path(), &url);
    let from_cli = image_urls(&seen, 0);
    let mark = seen.lock().expect("lock").len();
    serve(dir.path(), &url).await;
    let from_server = image_urls(&seen, mark);
    let mark = seen.lock().expect("lock").len();
    eval(dir.path(), &url);
    let from_eval = image_urls(&seen, mark);

    let first = |urls: &[String], who: &str| -> String {
        urls.first()
            .unwrap_or_else(|| panic!("{who} sent no picture"))
            .clone()
    };
    let cli = first(&from_cli, "hilum analyze");
    assert_eq!(cli, first(&from_server, "hilum serve"), "CLI and server");
    assert_eq!(cli, first(&from_eval, "hilum eval"), "CLI and eval");

    // The bytes are the model view of the image: decoded as the store decodes it.
    let store = hilum_imaging::ImageStore::default();
    let id = store.ingest_file(&data_dir().join(IMAGE)).expect("ingest");
    let png = hilum_imaging::model_view_png(&store.get(&id).expect("image")).expect("png");
    assert_eq!(cli, hilum_llm::ImagePayload::png(&id, &png).data_url);
    let shown = image::load_from_memory(&png).expect("png");
    assert_eq!((shown.width(), shown.height()), (964, 1024));
}
