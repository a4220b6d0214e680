//! A real OpenAI-protocol server on 127.0.0.1 (chat completions, SSE streaming) that plays a
//! model taking a quiz: for each question it first calls `image_info` on the question's image,
//! then, once the tool result is back, answers with the letter it was given for that question.
//! It logs which question each request was for, so tests see what was (re-)asked.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

#[derive(Clone)]
pub struct Quiz {
    /// (question id, text that identifies the question, reply text).
    pub answers: Arc<Vec<(String, String, String)>>,
    /// (question id, `call` or `answer`, messages in the request) per request, in order.
    pub log: Arc<Mutex<Vec<(String, String, usize)>>>,
    pub delay: Duration,
}

fn text_of(m: &Value) -> String {
    match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

fn sse(chunks: Vec<Value>) -> Response {
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

async fn completions(State(q): State<Quiz>, Json(req): Json<Value>) -> Response {
    tokio::time::sleep(q.delay).await;
    let messages = req["messages"].as_array().cloned().unwrap_or_default();
    let last_user = messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .map(text_of)
        .unwrap_or_default();
    let Some((id, _, reply)) = q
        .answers
        .iter()
        .find(|(_, key, _)| last_user.contains(key.as_str()))
    else {
        return sse(vec![
            json!({"choices": [{"index": 0, "delta": {"content": "unknown question"}, "finish_reason": "stop"}]}),
        ]);
    };
    let after_tool = messages.last().is_some_and(|m| m["role"] == "tool");
    let image = last_user
        .split("Images: ")
        .nth(1)
        .and_then(|s| s.split([',', ' ', '\n']).next())
        .map(str::to_string);
    let usage = json!({"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 7}});
    match (after_tool, image) {
        (false, Some(img)) => {
            q.log
                .lock()
                .expect("lock")
                .push((id.clone(), "call".into(), messages.len()));
            sse(vec![
                json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": "image_info", "arguments": json!({"image": img}).to_string()}}]}, "finish_reason": null}]}),
                json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
                usage,
            ])
        }
        _ => {
            q.log
                .lock()
                .expect("lock")
                .push((id.clone(), "answer".into(), messages.len()));
            sse(vec![
                json!({"choices": [{"index": 0, "delta": {"content": reply}, "finish_reason": null}]}),
                json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                usage,
            ])
        }
    }
}

/// Starts the server on a free port of 127.0.0.1; returns it and its base URL (`.../v1`).
pub async fn start(answers: Vec<(String, String, String)>, delay: Duration) -> (Quiz, String) {
    let quiz = Quiz {
        answers: Arc::new(answers),
        log: Arc::new(Mutex::new(Vec::new())),
        delay,
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(quiz.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (quiz, format!("http://{addr}/v1"))
}
