//! The OpenAI-compatible backend against a real HTTP server on 127.0.0.1 speaking the
//! chat-completions protocol with SSE streaming.

mod common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::{Json, Router};
use common::run;
use hilum::agent::{AgentConfig, Event, StopReason};
use hilum::llm::{OpenAiConfig, OpenAiLlm};
use serde_json::{json, Value};

/// What the server does for one request.
#[derive(Clone)]
enum Reply {
    /// SSE chunks (JSON payloads), then `[DONE]` when `done`; the connection closes after.
    Stream {
        chunks: Vec<Value>,
        done: bool,
    },
    Status(u16, &'static str),
    /// A raw event-stream body, sent as is.
    Raw(&'static str),
    /// The same text chunk forever, one per millisecond, as a model stuck in a loop.
    Endless(&'static str),
}

#[derive(Clone, Default)]
struct Server {
    replies: Arc<Mutex<VecDeque<Reply>>>,
    requests: Arc<Mutex<Vec<Value>>>,
    /// Chunks an endless reply has produced so far.
    endless_sent: Arc<AtomicUsize>,
}

async fn completions(State(s): State<Server>, Json(body): Json<Value>) -> Response {
    s.requests.lock().expect("lock").push(body);
    let reply = s.replies.lock().expect("lock").pop_front();
    match reply {
        Some(Reply::Status(code, text)) => Response::builder()
            .status(code)
            .body(Body::from(text))
            .expect("response"),
        Some(Reply::Raw(body)) => Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .body(Body::from(body))
            .expect("response"),
        Some(Reply::Endless(chunk)) => {
            let event = format!("data: {}\n\n", text(chunk));
            let sent = s.endless_sent.clone();
            let body = futures::stream::unfold((), move |()| {
                let (event, sent) = (event.clone(), sent.clone());
                async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    sent.fetch_add(1, Ordering::SeqCst);
                    Some((Ok::<_, std::io::Error>(event), ()))
                }
            });
            Response::builder()
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(Body::from_stream(body))
                .expect("response")
        }
        Some(Reply::Stream { chunks, done }) => {
            let mut text = String::new();
            for c in chunks {
                text.push_str(&format!("data: {c}\n\n"));
            }
            if done {
                text.push_str("data: [DONE]\n\n");
            }
            // Deliver the chunks as separate frames so the client reassembles across reads.
            let parts: Vec<Result<String, std::io::Error>> = text
                .as_bytes()
                .chunks(37)
                .map(|b| Ok(String::from_utf8_lossy(b).to_string()))
                .collect();
            Response::builder()
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(Body::from_stream(futures::stream::iter(parts)))
                .expect("response")
        }
        None => Response::builder()
            .status(StatusCode::INTERNAL_SERVER_ERROR)
            .body(Body::from("test server ran out of replies"))
            .expect("response"),
    }
}

async fn start(replies: Vec<Reply>) -> (Server, String) {
    let server = Server {
        replies: Arc::new(Mutex::new(replies.into())),
        ..Default::default()
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .with_state(server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    (server, format!("http://{addr}/v1"))
}

fn llm(base_url: &str) -> Arc<OpenAiLlm> {
    Arc::new(
        OpenAiLlm::new(OpenAiConfig {
            base_url: base_url.into(),
            model: "test-model".into(),
            api_key: Some("sk-test".into()),
            timeout: Duration::from_secs(10),
            backoff: Duration::from_millis(20),
            ..Default::default()
        })
        .expect("client"),
    )
}

fn tool_call_chunk(index: usize, id: &str, name: &str, args: &str) -> Value {
    json!({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": args}}
    ]}, "finish_reason": null}]})
}

fn finish(reason: &str) -> Value {
    json!({"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]})
}

fn text(t: &str) -> Value {
    json!({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": null}]})
}

fn answer(t: &str) -> Reply {
    Reply::Stream {
        chunks: vec![
            text(t),
            finish("stop"),
            json!({"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 5}}),
        ],
        done: true,
    }
}

#[tokio::test]
async fn three_parallel_calls_overlap_and_return_their_ids() {
    // Arguments of the second call arrive split across two chunks, as real servers send them.
    let first = Reply::Stream {
        chunks: vec![
            text("Running three tools."),
            tool_call_chunk(0, "call_a", "slow_a", "{\"x\": 1}"),
            tool_call_chunk(1, "call_b", "slow_b", "{\"x\":"),
            json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 1, "function": {"arguments": " 2}"}}]}}]}),
            tool_call_chunk(2, "call_c", "slow_c", "{\"x\": 3}"),
            finish("tool_calls"),
        ],
        done: true,
    };
    let (server, url) = start(vec![first, answer("All three ran.")]).await;
    let (out, events) = run(llm(&url), AgentConfig::default(), "run them").await;
    assert_eq!(out.error, None);
    assert_eq!(out.answer.as_deref(), Some("All three ran."));

    let requests = server.requests.lock().expect("lock").clone();
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[0]["model"], "test-model");
    assert_eq!(requests[0]["stream"], true);
    assert!(requests[0]["tools"]
        .as_array()
        .is_some_and(|t| t.len() == 7));
    let msgs = requests[1]["messages"].as_array().expect("messages");
    let assistant = msgs
        .iter()
        .find(|m| m["role"] == "assistant")
        .expect("assistant turn");
    assert_eq!(assistant["tool_calls"].as_array().map(Vec::len), Some(3));
    let tool_msgs: Vec<&Value> = msgs.iter().filter(|m| m["role"] == "tool").collect();
    let ids: Vec<&str> = tool_msgs
        .iter()
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(ids, ["call_a", "call_b", "call_c"]);
    assert!(tool_msgs[1]["content"]
        .as_str()
        .unwrap_or("")
        .contains("slow_b saw x=2"));

    // The calls overlapped: three 300 ms tools in one round take well under their 900 ms sum.
    let (mut first_start, mut last_end) = (f64::MAX, 0.0f64);
    for e in &events {
        match &e.event {
            Event::ToolStarted { .. } => first_start = first_start.min(e.t_ms),
            Event::ToolFinished { .. } => last_end = last_end.max(e.t_ms),
            _ => {}
        }
    }
    let round_ms = last_end - first_start;
    assert!(
        round_ms >= 290.0,
        "round took {round_ms} ms: tools did not run?"
    );
    assert!(
        round_ms < 600.0,
        "round took {round_ms} ms: calls did not overlap"
    );
}

#[tokio::test]
async fn http_500_is_retried_then_succeeds() {
    let (server, url) = start(vec![
        Reply::Status(500, "overloaded"),
        Reply::Status(503, "still overloaded"),
        answer("fine now"),
    ])
    .await;
    let (out, _) = run(llm(&url), AgentConfig::default(), "q").await;
    assert_eq!(out.answer.as_deref(), Some("fine now"), "{:?}", out.error);
    assert_eq!(server.requests.lock().expect("lock").len(), 3);
}

#[tokio::test]
async fn retries_run_out_with_the_servers_message() {
    let (server, url) = start(vec![Reply::Status(500, "down for maintenance"); 4]).await;
    let (out, _) = run(llm(&url), AgentConfig::default(), "q").await;
    let err = out.error.expect("error");
    assert!(
        err.contains("HTTP 500") && err.contains("down for maintenance"),
        "{err}"
    );
    assert_eq!(
        server.requests.lock().expect("lock").len(),
        4,
        "1 try + 3 retries"
    );
}

#[tokio::test]
async fn stream_cut_mid_tool_call_runs_no_tool() {
    let cut = Reply::Stream {
        chunks: vec![tool_call_chunk(0, "call_a", "fast", "{\"x\": ")],
        done: false,
    };
    let (_, url) = start(vec![cut]).await;
    let (out, events) = run(llm(&url), AgentConfig::default(), "q").await;
    assert_eq!(out.reason, StopReason::Error);
    let err = out.error.expect("error");
    assert!(
        err.contains("ended early") && err.contains("tool call"),
        "{err}"
    );
    assert!(!events
        .iter()
        .any(|e| matches!(e.event, Event::ToolStarted { .. })));
}

#[tokio::test]
async fn client_errors_are_clear_and_not_retried() {
    let (server, url) = start(vec![Reply::Status(401, "bad key")]).await;
    let (out, _) = run(llm(&url), AgentConfig::default(), "q").await;
    assert!(out.error.unwrap_or_default().contains("OPENAI_API_KEY"));
    assert_eq!(server.requests.lock().expect("lock").len(), 1);

    let (_, url) = start(vec![Reply::Status(404, "no such model")]).await;
    let (out, _) = run(llm(&url), AgentConfig::default(), "q").await;
    let err = out.error.unwrap_or_default();
    assert!(err.contains("404") && err.contains("test-model"), "{err}");
}

#[tokio::test]
async fn malformed_stream_is_a_bad_response() {
    let (_, url) = start(vec![Reply::Raw(
        "data: {\"choices\": [{\"delta\": {\"content\": \"hi\"}}]}\n\ndata: {not json\n\n",
    )])
    .await;
    let (out, _) = run(llm(&url), AgentConfig::default(), "q").await;
    let err = out.error.expect("error");
    assert!(
        err.contains("malformed") && err.contains("not JSON"),
        "{err}"
    );

    // A stream that closes before any finish is cut, not an empty answer.
    let (_, url) = start(vec![Reply::Stream {
        chunks: vec![text("partial")],
        done: false,
    }])
    .await;
    let (out, _) = run(llm(&url), AgentConfig::default(), "q").await;
    assert!(out.error.unwrap_or_default().contains("ended early"));
}

#[tokio::test]
async fn a_model_stuck_in_a_loop_is_stopped_and_its_request_closed() {
    let (server, url) = start(vec![Reply::Endless("Findings: no effusion. ")]).await;
    let started = std::time::Instant::now();
    let (out, events) = run(llm(&url), AgentConfig::default(), "q").await;
    assert_eq!(out.reason, StopReason::Error);
    let err = out.error.expect("error");
    assert!(err.contains("repeated the same 23-byte text"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the loop ran {:?}",
        started.elapsed()
    );
    // The text streamed before the stop was shown; no tool ran.
    assert!(events
        .iter()
        .any(|e| matches!(&e.event, Event::Token { text } if text.contains("no effusion"))));
    // Dropping the stream closed the connection: the server stops producing.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_stop = server.endless_sent.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = server.endless_sent.load(Ordering::SeqCst);
    assert!(
        later <= after_stop + 1,
        "server still streaming: {after_stop} then {later} chunks"
    );
    assert!(after_stop < 200, "{after_stop} chunks sent before the stop");
}

#[tokio::test]
async fn a_model_that_only_repeats_calls_is_made_to_answer() {
    let calls = |list: &[(&str, &str)]| Reply::Stream {
        chunks: list
            .iter()
            .enumerate()
            .map(|(i, (id, args))| tool_call_chunk(i, id, "fast", args))
            .chain([finish("tool_calls")])
            .collect(),
        done: true,
    };
    let (server, url) = start(vec![
        calls(&[("c1", "{\"x\": 1}")]),
        // One repeat (spacing differs; its id reused, as servers writing calls as text do) and
        // one new call: the new one runs, the round goes on.
        calls(&[("c1", "{ \"x\":1 }"), ("c3", "{\"x\": 2}")]),
        // Only repeats: not run, and the next turn has no tools.
        calls(&[("c4", "{\"x\": 2}")]),
        answer("x=1 doubled is 2 and x=2 doubled is 4."),
    ])
    .await;
    let (out, events) = run(llm(&url), AgentConfig::default(), "double them").await;
    assert_eq!(out.error, None);
    assert_eq!(out.reason, StopReason::RepeatedCalls);
    assert_eq!(
        out.answer.as_deref(),
        Some("x=1 doubled is 2 and x=2 doubled is 4.")
    );
    let started: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolStarted { call_id, .. } => Some(call_id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(started, ["c1", "c3"]);
    let repeated: Vec<(&str, &str)> = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolFailed {
                call_id,
                kind,
                error,
                ..
            } if kind == "repeated" => Some((call_id.as_str(), error.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(repeated.len(), 2, "{repeated:?}");
    assert_eq!(repeated[0].0, "c1_r2", "a reused id is made unique");
    assert!(repeated[0].1.contains("c1 (round 1)"), "{}", repeated[0].1);
    assert!(repeated[1].1.contains("c3 (round 2)"), "{}", repeated[1].1);

    let requests = server.requests.lock().expect("lock").clone();
    assert_eq!(requests.len(), 4);
    assert!(requests[2]["tools"]
        .as_array()
        .is_some_and(|t| !t.is_empty()));
    assert!(
        requests[3]["tools"].as_array().is_none_or(|t| t.is_empty()),
        "{}",
        requests[3]["tools"]
    );
    let last_user = requests[3]["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .expect("user message");
    assert!(last_user["content"]
        .as_str()
        .unwrap_or("")
        .contains("results you already have"));
    // The repeat-only turn is not part of the conversation the model answers from.
    let msgs = requests[3]["messages"].as_array().expect("messages");
    assert!(!msgs.iter().any(|m| m.to_string().contains("c4")));
    let ids: Vec<&str> = msgs
        .iter()
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(ids, ["c1", "c1_r2", "c3"]);
}

#[tokio::test]
async fn unreachable_endpoint_says_so() {
    // Bind then drop a listener: nothing listens on that port any more.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let client = Arc::new(
        OpenAiLlm::new(OpenAiConfig {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            max_retries: 1,
            backoff: Duration::from_millis(10),
            ..Default::default()
        })
        .expect("client"),
    );
    let (out, _) = run(client, AgentConfig::default(), "q").await;
    let err = out.error.expect("error");
    assert!(
        err.contains("could not reach") && err.contains(&port.to_string()),
        "{err}"
    );
}
