//! The OpenAI-compatible backend against a real HTTP server on 127.0.0.1 speaking the
//! chat-completions protocol with SSE streaming.

use crate::common;

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
use hilum::agent::{AgentConfig, Event, StopReason, ToolPolicy};
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
    // An answer without tools is what this test needs: no "use the tools first" round.
    let config = AgentConfig {
        require_tools: ToolPolicy::Never,
        ..Default::default()
    };
    let (out, _) = run(llm(&url), config, "q").await;
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

// ---------------------------------------------------------------------------------------------
// Grounded answers (issue 20): what a small model served without a tool-call parser writes,
// replayed by the server. Each output becomes a call, a tool error or a revision; no final
// answer carries a number that no tool produced without being marked `grounded: false`.

/// A lung segmentation with fixed results: left 24321 px, right 32456 px, 0.2 mm pixels.
struct Lungs {
    spec: hilum::agent::ToolSpec,
}

#[async_trait::async_trait]
impl hilum::agent::Tool for Lungs {
    fn spec(&self) -> &hilum::agent::ToolSpec {
        &self.spec
    }

    async fn call(
        &self,
        _ctx: &hilum::agent::ToolContext,
        args: Value,
    ) -> Result<hilum::agent::ToolOutput, hilum::agent::ToolError> {
        Ok(hilum::agent::ToolOutput::new(
            "2 lung field(s); right 13.0 cm², left 9.7 cm²",
            json!({"image": args["image"], "right_lung": {"area_px": 32456, "area_cm2": 12.98},
                   "left_lung": {"area_px": 24321, "area_cm2": 9.73}, "pixel_spacing_mm": [0.2, 0.2]}),
        ))
    }
}

const IMAGE: &str = "img_abcdef123456";
const QUESTION: &str = "Which lung has the larger area on this radiograph, the patient's left or the patient's right? Answer 'left' or 'right' and give both areas.";

fn lungs_toolbox() -> Arc<hilum::agent::Toolbox> {
    let mut tb = hilum::agent::Toolbox::new();
    tb.register(Arc::new(Lungs {
        spec: hilum::agent::ToolSpec {
            name: "segment_lungs".into(),
            description: "Segments both lungs; areas in px and cm².".into(),
            parameters: json!({"type": "object", "properties": {"image": {"type": "string"}},
                               "required": ["image"], "additionalProperties": false}),
        },
    }))
    .expect("schema");
    Arc::new(tb)
}

async fn ask_lungs(
    replies: Vec<Reply>,
) -> (
    Server,
    hilum::agent::RunOutcome,
    Vec<hilum::agent::RunEvent>,
) {
    let (server, url) = start(replies).await;
    let (out, events) =
        common::run_with(llm(&url), lungs_toolbox(), AgentConfig::default(), QUESTION).await;
    (server, out, events)
}

fn started_tools(events: &[hilum::agent::RunEvent]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolStarted { name, .. } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

/// The final event's grounding fields.
fn verdict(events: &[hilum::agent::RunEvent]) -> (Option<bool>, Vec<String>) {
    events
        .iter()
        .find_map(|e| match &e.event {
            Event::Final {
                grounded,
                unsupported,
                ..
            } => Some((*grounded, unsupported.clone())),
            _ => None,
        })
        .expect("a final event")
}

/// Every message text of request `i` as the server received it.
fn request_text(server: &Server, i: usize) -> String {
    server.requests.lock().expect("lock")[i]["messages"].to_string()
}

const RIGHT_ANSWER: &str = "Right: the right lung is larger, 32,456 px (13.0 cm²) against 24,321 px (9.7 cm²) for the left.";

#[tokio::test]
async fn imagined_tools_markup_with_an_imagined_result_becomes_a_call() {
    let imagined = format!(
        "<tools><tool name=\"segment_lungs\" arguments='{{\"image\": \"{IMAGE}\"}}'><output>{{\"area_left\": 32456, \"area_right\": 24321}}</output></tool></tools> The left lung has an area of 32456 pixels and the right lung 24321 pixels, so the left lung is larger."
    );
    let (server, out, events) = ask_lungs(vec![answer(&imagined), answer(RIGHT_ANSWER)]).await;
    assert_eq!(out.error, None);
    assert_eq!(started_tools(&events), ["segment_lungs"]);
    assert_eq!(out.answer.as_deref(), Some(RIGHT_ANSWER));
    assert_eq!(verdict(&events), (Some(true), vec![]));
    // The model is told its result was dropped; its imagined numbers and answer are gone.
    let second = request_text(&server, 1);
    assert!(
        second.contains("tool result you wrote yourself"),
        "{second}"
    );
    assert!(!second.contains("so the left lung is larger"), "{second}");
    let assistant = &server.requests.lock().expect("lock")[1]["messages"][2];
    assert_eq!(
        assistant["tool_calls"][0]["function"]["name"],
        "segment_lungs"
    );
    assert_eq!(assistant["content"], "");
}

#[tokio::test]
async fn doubled_braces_are_a_call_and_an_unreadable_call_is_a_tool_error() {
    let doubled = format!(
        "<tools>{{{{\"name\": \"segment_lungs\", \"arguments\": {{{{\"image\": \"{IMAGE}\"}}}}}}}}}}\n</tools>"
    );
    let (_, out, events) = ask_lungs(vec![answer(&doubled), answer(RIGHT_ANSWER)]).await;
    assert_eq!(started_tools(&events), ["segment_lungs"], "{:?}", out.error);
    assert_eq!(verdict(&events), (Some(true), vec![]));

    let broken =
        "<tools>{{\"name\": \"segment_lungs\", \"arguments\": {{image: the image}}}}}\n</tools>";
    let call = Reply::Stream {
        chunks: vec![
            tool_call_chunk(
                0,
                "c1",
                "segment_lungs",
                &format!("{{\"image\": \"{IMAGE}\"}}"),
            ),
            finish("tool_calls"),
        ],
        done: true,
    };
    let (server, out, events) = ask_lungs(vec![answer(broken), call, answer(RIGHT_ANSWER)]).await;
    assert_eq!(out.answer.as_deref(), Some(RIGHT_ANSWER));
    assert_eq!(started_tools(&events), ["segment_lungs"]);
    // The unreadable call came back as a tool error naming the exact form to use.
    let second = request_text(&server, 1);
    assert!(
        second.contains("could not be read") && second.contains("<tool_call>"),
        "{second}"
    );
}

#[tokio::test]
async fn fenced_json_after_prose_is_a_call_and_converted_areas_are_grounded() {
    let fenced = format!(
        "I will measure both lungs first.\n```json\n{{\"name\": \"segment_lungs\", \"arguments\": {{\"image\": \"{IMAGE}\"}}}}\n```"
    );
    // cm² from the pixel areas and the 0.2 mm spacing: 32456 px = 12.98 cm², 24321 px = 9.73.
    let converted = "The right lung is larger: 12.98 cm² (right) against 9.73 cm² (left); in pixels 32k and 24k.";
    let (_, out, events) = ask_lungs(vec![answer(&fenced), answer(converted)]).await;
    assert_eq!(started_tools(&events), ["segment_lungs"]);
    assert_eq!(out.answer.as_deref(), Some(converted));
    assert_eq!(verdict(&events), (Some(true), vec![]));
}

#[tokio::test]
async fn a_call_with_a_wrong_tool_name_is_a_tool_error() {
    let wrong = format!(
        "Let me measure. {{\"name\": \"lung_area\", \"arguments\": {{\"image\": \"{IMAGE}\"}}}}"
    );
    let right =
        format!("{{\"name\": \"segment_lungs\", \"arguments\": {{\"image\": \"{IMAGE}\"}}}}");
    let (server, out, events) =
        ask_lungs(vec![answer(&wrong), answer(&right), answer(RIGHT_ANSWER)]).await;
    let failed: Vec<(String, String)> = events
        .iter()
        .filter_map(|e| match &e.event {
            Event::ToolFailed { name, kind, .. } => Some((name.clone(), kind.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        failed,
        [("lung_area".to_string(), "unknown_tool".to_string())]
    );
    assert!(request_text(&server, 1).contains("segment_lungs"));
    assert_eq!(out.answer.as_deref(), Some(RIGHT_ANSWER));
    assert_eq!(verdict(&events), (Some(true), vec![]));
}

#[tokio::test]
async fn invented_areas_without_tools_are_sent_back_then_marked_ungrounded() {
    let invented = "Left lung: 21.5 cm², Right lung: 38.6 cm². The right lung is larger, as confirmed by the tool `lung_area`.";
    let (server, out, events) =
        ask_lungs(vec![answer(invented), answer(invented), answer(invented)]).await;
    assert_eq!(out.error, None);
    assert!(started_tools(&events).is_empty());
    let requests = server.requests.lock().expect("lock").clone();
    assert_eq!(requests.len(), 3);
    // Round 1 answered without a tool: sent back with tool_choice "required".
    assert!(requests[0].get("tool_choice").is_none());
    assert_eq!(requests[1]["tool_choice"], "required");
    assert!(requests[1]["messages"]
        .to_string()
        .contains("Use the tools first"));
    // Round 2 still invented: one revision request listing what nothing supports.
    let revision = requests[2]["messages"].to_string();
    assert!(
        revision.contains("21.5 cm²") && revision.contains("lung_area"),
        "{revision}"
    );
    assert!(requests[2].get("tool_choice").is_none());
    // Still invented: returned, marked.
    let (grounded, unsupported) = verdict(&events);
    assert_eq!(grounded, Some(false));
    assert!(
        unsupported.iter().any(|u| u.starts_with("21.5 cm²")),
        "{unsupported:?}"
    );
    assert!(
        unsupported.iter().any(|u| u.starts_with("38.6 cm²")),
        "{unsupported:?}"
    );
    assert!(
        unsupported
            .iter()
            .any(|u| u.contains("`lung_area` (no such tool)")),
        "{unsupported:?}"
    );
    assert_eq!(out.grounded, Some(false));
}

#[tokio::test]
async fn a_revision_that_uses_the_tool_is_grounded_and_a_swapped_side_is_caught() {
    let invented = "The left lung is larger: 32,456 px against 24,321 px.";
    let call = format!(
        "<tool_call>\n{{\"name\": \"segment_lungs\", \"arguments\": {{\"image\": \"{IMAGE}\"}}}}\n</tool_call>"
    );
    // Numbers right, sides swapped: caught even though each number is in the results.
    let swapped = "Left. The left lung is larger: left 32,456 px, right 24,321 px.";
    let (server, out, events) = ask_lungs(vec![
        answer(invented),
        answer(&call),
        answer(swapped),
        answer(RIGHT_ANSWER),
    ])
    .await;
    assert_eq!(started_tools(&events), ["segment_lungs"]);
    let revision = request_text(&server, 3);
    assert!(
        revision.contains("says the left lung is larger")
            && revision.contains("but the tool results give left"),
        "{revision}"
    );
    assert_eq!(out.answer.as_deref(), Some(RIGHT_ANSWER));
    assert_eq!(verdict(&events), (Some(true), vec![]));
}

#[tokio::test]
async fn a_server_that_refuses_tool_choice_required_is_asked_without_it() {
    let call = Reply::Stream {
        chunks: vec![
            tool_call_chunk(
                0,
                "c1",
                "segment_lungs",
                &format!("{{\"image\": \"{IMAGE}\"}}"),
            ),
            finish("tool_calls"),
        ],
        done: true,
    };
    let (server, out, _) = ask_lungs(vec![
        answer("The right lung."),
        Reply::Status(400, "tool_choice 'required' is not supported"),
        call,
        answer(RIGHT_ANSWER),
    ])
    .await;
    assert_eq!(out.answer.as_deref(), Some(RIGHT_ANSWER), "{:?}", out.error);
    let requests = server.requests.lock().expect("lock").clone();
    assert_eq!(requests[1]["tool_choice"], "required");
    assert!(requests[2].get("tool_choice").is_none());
    assert_eq!(requests[2]["messages"], requests[1]["messages"]);
}

#[tokio::test]
async fn an_honest_answer_without_measurements_is_grounded() {
    let call =
        format!("{{\"name\": \"segment_lungs\", \"arguments\": {{\"image\": \"{IMAGE}\"}}}}");
    let honest = "No area can be given: the segmentation did not return a usable measurement for this image.";
    let (_, out, events) = ask_lungs(vec![answer(&call), answer(honest)]).await;
    assert_eq!(out.answer.as_deref(), Some(honest));
    assert_eq!(verdict(&events), (Some(true), vec![]));
}
