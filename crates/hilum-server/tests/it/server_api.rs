//! End-to-end tests of `hilum serve` over real sockets on 127.0.0.1, with real radiographs
//! from ../shared/data and the script LLM. Tests marked `on_both_databases!` run on SQLite and
//! on a real PostgreSQL server (HILUM_TEST_POSTGRES_URL, see scripts/setup_postgres.sh).

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const IMG: &str = "nih_00000001_000_cardiomegaly.png";
const IMG2: &str = "kermany_person1946_bacteria_4874.jpeg";

fn two_round_script() -> Value {
    json!([
        {"content": "Let me look at the image.", "tool_calls": [
            {"name": "image_info", "arguments": {"image": "$IMAGE"}},
            {"name": "thumbnail", "arguments": {"image": "$IMAGE"}}
        ]},
        {"content": "The image was measured; see the thumbnail."}
    ])
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("?").to_string())
        .collect()
}

on_both_databases!(upload_session_streamed_answer_and_artifacts);
async fn upload_session_streamed_answer_and_artifacts(db: &TestDb) {
    let script = write_script(db.dir.path(), two_round_script());
    let srv = start(config_url(&db.url, Some(&script))).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();

    let (img, row) = upload_id(&client, &srv, &tok, IMG).await;
    let real = image::load_from_memory(&image(IMG)).expect("decode reference");
    assert_eq!(row["width"], real.width());
    assert_eq!(row["height"], real.height());

    let listed: Value = get_json(&client, srv.url("/v1/images"), &tok).await;
    assert_eq!(listed["images"][0]["id"], img.as_str());

    let ses = new_session(&client, &srv, &tok).await;
    let events = ask_ndjson(
        &client,
        &srv,
        &tok,
        &ses,
        "How large is this image?",
        &[&img],
    )
    .await;
    let t = types(&events);
    assert_eq!(t.first().map(String::as_str), Some("run_started"), "{t:?}");
    assert_eq!(t.last().map(String::as_str), Some("complete"), "{t:?}");
    assert_eq!(
        t.iter().filter(|x| *x == "tool_finished").count(),
        2,
        "{t:?}"
    );
    assert!(t.contains(&"final".to_string()), "{t:?}");

    let info = events
        .iter()
        .find(|e| e["type"] == "tool_finished" && e["name"] == "image_info")
        .expect("image_info result");
    assert_eq!(info["data"]["width"], real.width());

    // The artifact announced in the stream is fetchable, and is the PNG the tool made.
    let thumb = events
        .iter()
        .find(|e| e["type"] == "tool_finished" && e["name"] == "thumbnail")
        .expect("thumbnail result");
    let url = thumb["artifacts"][0]["url"].as_str().expect("artifact url");
    let resp = client
        .get(srv.url(url))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("artifact");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "image/png");
    let png = image::load_from_memory(&resp.bytes().await.expect("bytes")).expect("png");
    assert_eq!(png.width(), 64);
    assert_eq!(png.height(), (real.height() * 64) / real.width());

    let arts: Value = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/artifacts")),
        &tok,
    )
    .await;
    assert_eq!(arts["artifacts"].as_array().map(Vec::len), Some(1));

    let msgs: Value = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/messages")),
        &tok,
    )
    .await;
    let roles: Vec<&str> = msgs["messages"]
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|m| m["role"].as_str())
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool", "tool", "assistant"]);
    let last = &msgs["messages"][4]["message"]["content"];
    assert_eq!(last, "The image was measured; see the thumbnail.");

    // Every tool call and model turn of the run is in the audit log, without the question.
    let audit = srv.state.db().audit_since(0, 1000).expect("audit");
    let kinds: Vec<&str> = audit.iter().map(|a| a.kind.as_str()).collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "tool_call").count(),
        2,
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "llm_call").count(),
        2,
        "{kinds:?}"
    );
    let dump = serde_json::to_string(&audit).expect("json");
    assert!(
        !dump.contains("How large"),
        "the question must not be audited"
    );
    srv.stop().await;
}

#[tokio::test]
async fn sse_stream_carries_the_same_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = write_script(dir.path(), two_round_script());
    let srv = start(config(&dir.path().join("h.db"), Some(&script))).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let (img, _) = upload_id(&client, &srv, &tok, IMG).await;
    let ses = new_session(&client, &srv, &tok).await;
    let resp = client
        .post(srv.url(&format!("/v1/sessions/{ses}/messages")))
        .bearer_auth(&tok)
        .header("accept", "text/event-stream")
        .json(&json!({"question": "size?", "images": [img]}))
        .send()
        .await
        .expect("ask");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap_or("")
        .starts_with("text/event-stream"));
    let text = resp.text().await.expect("body");
    let names: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(names.first(), Some(&"run_started"), "{names:?}");
    assert_eq!(names.last(), Some(&"complete"), "{names:?}");
    assert!(names.contains(&"final"));
    // The stored events equal what was streamed (heartbeats are not stored).
    let runs: Value = get_json(&client, srv.url(&format!("/v1/sessions/{ses}/runs")), &tok).await;
    let run_id = runs["runs"][0]["id"].as_str().expect("run id");
    assert_eq!(runs["runs"][0]["status"], "completed");
    let stored: Value = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/runs/{run_id}/events")),
        &tok,
    )
    .await;
    let stored_types: Vec<&str> = stored["events"]
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|e| e["type"].as_str())
        .collect();
    assert_eq!(stored_types, names);
    srv.stop().await;
}

on_both_databases!(restart_on_the_same_database_keeps_sessions_and_images);
async fn restart_on_the_same_database_keeps_sessions_and_images(db: &TestDb) {
    let script = write_script(db.dir.path(), two_round_script());
    let client = reqwest::Client::new();

    let srv = start(config_url(&db.url, Some(&script))).await;
    let tok = token(&srv.state, "alice");
    let (img, _) = upload_id(&client, &srv, &tok, IMG).await;
    let ses = new_session(&client, &srv, &tok).await;
    let first = ask_ndjson(&client, &srv, &tok, &ses, "size?", &[&img]).await;
    assert_eq!(types(&first).last().map(String::as_str), Some("complete"));
    srv.stop().await;

    let srv = start(config_url(&db.url, Some(&script))).await;
    let resp = client
        .get(srv.url(&format!("/v1/sessions/{ses}")))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("session");
    assert_eq!(resp.status(), 200, "the session survives a restart");
    let msgs: Value = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/messages")),
        &tok,
    )
    .await;
    assert_eq!(msgs["messages"].as_array().map(Vec::len), Some(5));

    // Resume: the image is usable again and the conversation continues after message 5.
    let second = ask_ndjson(&client, &srv, &tok, &ses, "and again?", &[&img]).await;
    let info = second
        .iter()
        .find(|e| e["type"] == "tool_finished" && e["name"] == "image_info")
        .expect("image_info after restart");
    assert!(info["data"]["width"].as_u64().is_some());
    let msgs: Value = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/messages")),
        &tok,
    )
    .await;
    let seqs: Vec<i64> = msgs["messages"]
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|m| m["seq"].as_i64())
        .collect();
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
    srv.stop().await;
}

#[tokio::test]
async fn missing_or_wrong_token_is_401() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(config(&dir.path().join("h.db"), None)).await;
    let _ = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let none = client.get(srv.url("/v1/images")).send().await.expect("req");
    assert_eq!(none.status(), 401);
    assert_eq!(none.headers()["www-authenticate"], "Bearer");
    let wrong = client
        .get(srv.url("/v1/sessions"))
        .bearer_auth("hlm_0000")
        .send()
        .await
        .expect("req");
    assert_eq!(wrong.status(), 401);
    let body: Value = wrong.json().await.expect("json");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("hilum serve token create"));
    let mcp = client
        .post(srv.url("/mcp"))
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))
        .send()
        .await
        .expect("req");
    assert_eq!(mcp.status(), 401, "MCP needs a token too");
    // Public endpoints stay open.
    let health = client.get(srv.url("/healthz")).send().await.expect("req");
    assert_eq!(health.status(), 200);
    srv.stop().await;
}

on_both_databases!(another_tokens_images_sessions_and_artifacts_are_404);
async fn another_tokens_images_sessions_and_artifacts_are_404(db: &TestDb) {
    let script = write_script(db.dir.path(), two_round_script());
    let srv = start(config_url(&db.url, Some(&script))).await;
    let alice = token(&srv.state, "alice");
    let bob = token(&srv.state, "bob");
    let client = reqwest::Client::new();
    let (img, _) = upload_id(&client, &srv, &alice, IMG).await;
    let ses = new_session(&client, &srv, &alice).await;
    let events = ask_ndjson(&client, &srv, &alice, &ses, "size?", &[&img]).await;
    let art_url = events
        .iter()
        .find_map(|e| e["artifacts"][0]["url"].as_str())
        .expect("artifact")
        .to_string();

    let get = |path: String| {
        let client = client.clone();
        let bob = bob.clone();
        let url = srv.url(&path);
        async move {
            client
                .get(url)
                .bearer_auth(bob)
                .send()
                .await
                .expect("req")
                .status()
        }
    };
    assert_eq!(get(art_url.clone()).await, 404);
    assert_eq!(get(format!("/v1/sessions/{ses}")).await, 404);
    assert_eq!(get(format!("/v1/sessions/{ses}/messages")).await, 404);
    assert_eq!(get(format!("/v1/sessions/{ses}/artifacts")).await, 404);

    // Bob's own session cannot use Alice's image, neither in a question nor in a direct call.
    let bob_ses = new_session(&client, &srv, &bob).await;
    let ask = client
        .post(srv.url(&format!("/v1/sessions/{bob_ses}/messages")))
        .bearer_auth(&bob)
        .json(&json!({"question": "size?", "images": [img]}))
        .send()
        .await
        .expect("req");
    assert_eq!(ask.status(), 404);
    let call = call_tool(&client, &srv, &bob, "image_info", &json!({"image": img})).await;
    assert_eq!(call.status(), 422);
    let body: Value = call.json().await.expect("json");
    assert_eq!(body["ok"], false);
    let listed: Value = get_json(&client, srv.url("/v1/images"), &bob).await;
    assert_eq!(listed["images"].as_array().map(Vec::len), Some(0));
    // Alice still sees hers.
    let own = client
        .get(srv.url(&art_url))
        .bearer_auth(&alice)
        .send()
        .await
        .expect("req");
    assert_eq!(own.status(), 200);
    srv.stop().await;
}

#[tokio::test]
async fn oversized_upload_is_413() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&dir.path().join("h.db"), None);
    cfg.max_upload_bytes = 100 * 1024;
    let srv = start(cfg).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let big = image(IMG);
    assert!(
        big.len() > 100 * 1024,
        "the test image must exceed the limit"
    );
    let resp = upload(&client, &srv, &tok, IMG).await;
    assert_eq!(resp.status(), 413);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["error"]["code"], "payload_too_large");
    // A file under the limit still goes through.
    let small = image(IMG2);
    assert!(small.len() < 100 * 1024);
    let ok = upload(&client, &srv, &tok, IMG2).await;
    assert_eq!(ok.status(), 201);
    srv.stop().await;
}

on_both_databases!(direct_tool_calls_are_recorded_audited_and_measured);
async fn direct_tool_calls_are_recorded_audited_and_measured(db: &TestDb) {
    let srv = start(config_url(&db.url, None)).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let (img, row) = upload_id(&client, &srv, &tok, IMG2).await;
    let n = 5;
    for _ in 0..n {
        let resp = call_tool(&client, &srv, &tok, "image_info", &json!({"image": img})).await;
        assert_eq!(resp.status(), 200);
        let body: Value = resp.json().await.expect("json");
        assert_eq!(body["data"]["width"], row["width"]);
    }
    let bad = call_tool(&client, &srv, &tok, "image_info", &json!({"image": 42})).await;
    assert_eq!(bad.status(), 422);
    let unknown = call_tool(&client, &srv, &tok, "no_such_tool", &json!({})).await;
    assert_eq!(unknown.status(), 404);
    let no_suffix = client
        .post(srv.url("/v1/tools/image_info"))
        .bearer_auth(&tok)
        .json(&json!({"image": img}))
        .send()
        .await
        .expect("call");
    assert_eq!(no_suffix.status(), 404);

    let audit = srv.state.db().audit_since(0, 1000).expect("audit");
    let calls: Vec<_> = audit.iter().filter(|a| a.kind == "tool_call").collect();
    assert_eq!(calls.len(), n + 1, "every executed call is audited once");
    assert_eq!(calls.iter().filter(|a| a.outcome == "ok").count(), n);

    let metrics = client
        .get(srv.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    let count_line = metrics
        .lines()
        .find(|l| {
            l.starts_with("hilum_tool_call_duration_seconds_count")
                && l.contains("tool=\"image_info\"")
                && l.contains("outcome=\"ok\"")
        })
        .expect("histogram count");
    assert!(count_line.ends_with(&format!(" {n}")), "{count_line}");
    assert!(metrics.contains("route=\"/v1/tools/{call}\",status=\"200\""));
    srv.stop().await;
}

on_both_databases!(audit_export_needs_an_admin_token_and_is_json_lines);
async fn audit_export_needs_an_admin_token_and_is_json_lines(db: &TestDb) {
    let srv = start(config_url(&db.url, None)).await;
    let user = token(&srv.state, "alice");
    let (_, admin) = srv.state.db().create_token("ops", true).expect("admin");
    let client = reqwest::Client::new();
    let (img, _) = upload_id(&client, &srv, &user, IMG2).await;
    let _ = call_tool(&client, &srv, &user, "image_info", &json!({"image": img})).await;
    let denied = client
        .get(srv.url("/v1/audit"))
        .bearer_auth(&user)
        .send()
        .await
        .expect("req");
    assert_eq!(denied.status(), 403);
    let resp = client
        .get(srv.url("/v1/audit"))
        .bearer_auth(&admin)
        .send()
        .await
        .expect("req");
    assert_eq!(resp.status(), 200);
    let text = resp.text().await.expect("text");
    let rows: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert_eq!(rows[0]["kind"], "upload");
    assert_eq!(rows[1]["kind"], "tool_call");
    assert_eq!(rows[1]["arguments"]["image"], img.as_str());
    let since: Value = serde_json::from_str(
        client
            .get(srv.url(&format!("/v1/audit?since={}", rows[0]["seq"])))
            .bearer_auth(&admin)
            .send()
            .await
            .expect("req")
            .text()
            .await
            .expect("text")
            .trim(),
    )
    .expect("one row");
    assert_eq!(since["seq"], rows[1]["seq"]);
    srv.stop().await;
}

#[tokio::test]
async fn client_disconnect_cancels_the_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = write_script(
        dir.path(),
        json!([
            {"content": "Waiting.", "tool_calls": [{"name": "sleep", "arguments": {"seconds": 30}}]},
            {"content": "done"}
        ]),
    );
    let srv = start(config(&dir.path().join("h.db"), Some(&script))).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let ses = new_session(&client, &srv, &tok).await;
    let mut resp = client
        .post(srv.url(&format!("/v1/sessions/{ses}/messages")))
        .bearer_auth(&tok)
        .json(&json!({"question": "wait"}))
        .send()
        .await
        .expect("ask");
    // Read until the slow tool has started, then hang up.
    let mut seen = String::new();
    while !seen.contains("tool_started") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
            .await
            .expect("events in time")
            .expect("chunk")
            .expect("stream open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(resp);
    drop(client);

    let client = reqwest::Client::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        let runs: Value =
            get_json(&client, srv.url(&format!("/v1/sessions/{ses}/runs")), &tok).await;
        let status = runs["runs"][0]["status"].as_str().unwrap_or("").to_string();
        if status != "running" || std::time::Instant::now() > deadline {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        status, "cancelled",
        "the run must stop well before the 30 s tool"
    );
    let audit = srv.state.db().audit_since(0, 100).expect("audit");
    assert!(audit.iter().any(|a| a.kind == "run_cancelled"));
    srv.stop().await;
}

/// `?detach=true`: the run outlives its client, `GET …/stream` follows it from its first event
/// to its answer, and `POST …/cancel` stops another run; a too-long question is refused first.
#[tokio::test]
async fn detached_run_outlives_its_client_and_is_followed_or_cancelled() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = write_script(
        dir.path(),
        json!([
            {"content": "Waiting.", "tool_calls": [{"name": "sleep", "arguments": {"seconds": 1.5}}]},
            {"content": "done waiting"}
        ]),
    );
    let srv = start(config(&dir.path().join("h.db"), Some(&script))).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let ses = new_session(&client, &srv, &tok).await;
    let ask = |q: String| {
        client
            .post(srv.url(&format!("/v1/sessions/{ses}/messages?detach=true")))
            .bearer_auth(&tok)
            .json(&json!({"question": q}))
            .send()
    };
    let long = ask("x".repeat(8_001)).await.expect("ask");
    assert_eq!(long.status(), 413);
    let body: Value = long.json().await.expect("json");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("the limit is 8,000 characters"));
    // Hang up as soon as the run has an id.
    let mut resp = ask("wait".into()).await.expect("ask");
    let first = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
        .await
        .expect("events in time")
        .expect("chunk")
        .expect("stream open");
    let started: Value = serde_json::from_slice(first.split(|b| *b == b'\n').next().unwrap_or(&[]))
        .expect("run_started line");
    let run = started["run_id"].as_str().expect("run id").to_string();
    drop(resp);
    let followed = client
        .get(srv.url(&format!("/v1/sessions/{ses}/runs/{run}/stream")))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("follow")
        .text()
        .await
        .expect("body");
    let events: Vec<Value> = followed
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &Value| v["type"] != "heartbeat")
        .collect();
    assert_eq!(
        events.first().map(|e| e["type"].clone()),
        Some(json!("run_started"))
    );
    assert!(events
        .iter()
        .any(|e| e["type"] == "final" && e["answer"] == "done waiting"));
    assert_eq!(
        events.last().map(|e| e["type"].clone()),
        Some(json!("complete"))
    );
    // Another run, cancelled by request while its tool sleeps.
    let mut resp = ask("wait again".into()).await.expect("ask");
    let mut seen = String::new();
    while !seen.contains("tool_started") {
        let chunk = tokio::time::timeout(Duration::from_secs(10), resp.chunk())
            .await
            .expect("events in time")
            .expect("chunk")
            .expect("stream open");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let second: Value = serde_json::from_str(seen.lines().next().unwrap_or("")).expect("json");
    let run2 = second["run_id"].as_str().expect("run id").to_string();
    let cancel = client
        .post(srv.url(&format!("/v1/sessions/{ses}/runs/{run2}/cancel")))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("cancel");
    assert_eq!(cancel.status(), 202);
    let rest = resp.text().await.expect("rest of the stream");
    assert!(rest.contains("\"cancelled\""), "{rest}");
    let again = client
        .post(srv.url(&format!("/v1/sessions/{ses}/runs/{run2}/cancel")))
        .bearer_auth(&tok)
        .send()
        .await
        .expect("cancel");
    assert_eq!(again.status(), 409, "a stopped run cannot be cancelled");
    srv.stop().await;
}

#[tokio::test]
async fn policy_forbids_non_local_model_endpoints_by_default() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script = write_script(dir.path(), two_round_script());
    let mut cfg = config(&dir.path().join("h.db"), Some(&script));
    if let Some(llm) = cfg.llm.as_mut() {
        // The same backend, declared remote: what an openai: endpoint off this machine is.
        llm.local = false;
        llm.name = "openai:gpt-4o".into();
    }
    let srv = start(cfg.clone()).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let (img, _) = upload_id(&client, &srv, &tok, IMG2).await;
    let ses = new_session(&client, &srv, &tok).await;
    let resp = client
        .post(srv.url(&format!("/v1/sessions/{ses}/messages")))
        .bearer_auth(&tok)
        .json(&json!({"question": "size?", "images": [img]}))
        .send()
        .await
        .expect("ask");
    assert_eq!(resp.status(), 403);
    let body: Value = resp.json().await.expect("json");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("--allow-remote-llm"));
    srv.stop().await;

    cfg.allow_remote_llm = true;
    let srv = start(cfg).await;
    let ses = new_session(&client, &srv, &tok).await;
    let events = ask_ndjson(&client, &srv, &tok, &ses, "size?", &[&img]).await;
    assert_eq!(types(&events).last().map(String::as_str), Some("complete"));
    srv.stop().await;
}

#[tokio::test]
async fn rate_limit_is_per_token() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = config(&dir.path().join("h.db"), None);
    cfg.rate_limit = hilum_server::RateLimit {
        per_sec: 0.5,
        burst: 3.0,
    };
    let srv = start(cfg).await;
    let a = token(&srv.state, "alice");
    let b = token(&srv.state, "bob");
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let r = client
            .get(srv.url("/v1/sessions"))
            .bearer_auth(&a)
            .send()
            .await
            .expect("req");
        statuses.push(r.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let r = client
        .get(srv.url("/v1/sessions"))
        .bearer_auth(&b)
        .send()
        .await
        .expect("req");
    assert_eq!(r.status(), 200, "bob has his own budget");
    srv.stop().await;
}

#[tokio::test]
async fn openapi_document_matches_the_served_routes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(config(&dir.path().join("h.db"), None)).await;
    let client = reqwest::Client::new();
    let doc: Value = client
        .get(srv.url("/openapi.json"))
        .send()
        .await
        .expect("doc")
        .json()
        .await
        .expect("json");
    let paths = doc["paths"].as_object().expect("paths");
    let mut documented = Vec::new();
    for (path, item) in paths {
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_some() {
                documented.push((method.to_string(), path.clone()));
            }
        }
    }
    documented.sort();
    let mut table: Vec<(String, String)> = hilum_server::openapi::ROUTES
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    table.sort();
    assert_eq!(
        documented, table,
        "the served document and the route table differ"
    );

    // Every documented operation is routed: no 405, and a 404 only from a handler (JSON body).
    for (method, path) in &documented {
        let concrete = path
            .replace("{id}", "ses_0")
            .replace("{run_id}", "run_0")
            .replace("{name}", "image_info");
        let req = match method.as_str() {
            "get" => client.get(srv.url(&concrete)),
            _ => client.post(srv.url(&concrete)).json(&json!({})),
        };
        let resp = req.send().await.expect("req");
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap_or_default();
        assert_ne!(status, 405, "{method} {path}");
        if status == 404 {
            assert!(body.contains("\"error\""), "{method} {path} is not routed");
        }
    }
    // And a route that is not documented is not served.
    let stray = client
        .get(srv.url("/v1/nothing"))
        .send()
        .await
        .expect("req");
    assert_eq!(stray.status(), 404);
    srv.stop().await;
}

/// A model that accepts images and records the pixels it was sent, then replays a script.
struct Recording {
    inner: hilum_agent::llm::ScriptLlm,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Vec<String>>>>,
}

#[async_trait::async_trait]
impl hilum_agent::Llm for Recording {
    async fn chat(
        &self,
        req: hilum_agent::llm::ChatRequest,
    ) -> Result<hilum_agent::llm::DeltaStream, hilum_agent::llm::LlmError> {
        let urls = req.images.iter().map(|p| p.data_url.clone()).collect();
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(urls);
        self.inner.chat(req).await
    }
    fn capabilities(&self) -> hilum_agent::llm::Capabilities {
        hilum_agent::llm::Capabilities {
            native_tools: true,
            parallel_tool_calls: true,
            images: true,
            local: true,
            // A model on this machine but outside the process: pixels only when allowed.
            in_process: false,
        }
    }
    fn name(&self) -> String {
        "recording".into()
    }
}

#[tokio::test]
async fn pixels_reach_a_multimodal_model_only_when_enabled() {
    use base64::Engine;
    let dir = tempfile::tempdir().expect("tempdir");
    let script = write_script(dir.path(), two_round_script());
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Vec<String>>::new()));
    let mut cfg = config(&dir.path().join("h.db"), None);
    let (s2, p2) = (seen.clone(), script.clone());
    cfg.llm = Some(hilum_server::LlmFactory {
        name: "recording".into(),
        local: true,
        build: std::sync::Arc::new(move || {
            let inner = hilum_agent::llm::ScriptLlm::from_file(&p2).map_err(|e| e.to_string())?;
            Ok(std::sync::Arc::new(Recording {
                inner,
                seen: s2.clone(),
            }) as std::sync::Arc<dyn hilum_agent::Llm>)
        }),
    });
    for send_pixels in [false, true] {
        seen.lock().expect("lock").clear();
        cfg.send_pixels = send_pixels;
        let srv = start(cfg.clone()).await;
        let tok = token(&srv.state, "alice");
        let client = reqwest::Client::new();
        // A 3056x2544 radiograph: the payload is scaled to at most 1024 px.
        let (img, row) = upload_id(&client, &srv, &tok, "medrax_normal3.jpg").await;
        let ses = new_session(&client, &srv, &tok).await;
        let events = ask_ndjson(&client, &srv, &tok, &ses, "size?", &[&img]).await;
        assert_eq!(types(&events).last().map(String::as_str), Some("complete"));
        let requests = seen.lock().expect("lock").clone();
        assert_eq!(requests.len(), 2, "two model turns");
        if !send_pixels {
            assert!(
                requests.iter().all(Vec::is_empty),
                "no pixels unless enabled"
            );
        } else {
            let url = &requests[0][0];
            let b64 = url
                .strip_prefix("data:image/png;base64,")
                .expect("PNG data URL");
            let png = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .expect("base64");
            let small = image::load_from_memory(&png).expect("png");
            let (w, h) = (
                row["width"].as_u64().unwrap_or(0),
                row["height"].as_u64().unwrap_or(0),
            );
            assert_eq!(
                u64::from(small.width().max(small.height())),
                1024.min(w.max(h))
            );
            let aspect = |a: u64, b: u64| a as f64 / b as f64;
            assert!(
                (aspect(small.width().into(), small.height().into()) - aspect(w, h)).abs() < 0.01
            );
        }
        srv.stop().await;
    }
}

/// Uploads a file from ../shared/data/cxr by its path under that folder.
async fn upload_file(client: &reqwest::Client, srv: &Server, tok: &str, rel: &str) -> Value {
    let bytes = std::fs::read(data_dir().join("cxr").join(rel)).expect("read test file");
    let part = reqwest::multipart::Part::bytes(bytes).file_name(rel.to_string());
    let resp = client
        .post(srv.url("/v1/images"))
        .bearer_auth(tok)
        .multipart(reqwest::multipart::Form::new().part("file", part))
        .send()
        .await
        .expect("upload");
    assert_eq!(resp.status(), 201, "upload of {rel}");
    let body: Value = resp.json().await.expect("json");
    body["images"][0].clone()
}

#[tokio::test]
async fn pixels_route_serves_the_canonical_values_at_full_depth() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(config(&dir.path().join("h.db"), None)).await;
    let alice = token(&srv.state, "alice");
    let bob = token(&srv.state, "bob");
    let client = reqwest::Client::new();
    for rel in [
        "dicom/CR-MONO1-10-chest_noPart10header.dcm",
        "images/derived_RG1_chest_pa_16bit.png",
    ] {
        let row = upload_file(&client, &srv, &alice, rel).await;
        let id = row["id"].as_str().expect("id");
        let bits = row["bit_depth"].as_u64().expect("bit_depth");
        assert!(bits > 8, "{rel}: expected a deep image, got {bits} bits");

        let resp = client
            .get(srv.url(&format!("/v1/images/{id}/pixels")))
            .bearer_auth(&alice)
            .send()
            .await
            .expect("pixels");
        assert_eq!(resp.status(), 200, "{rel}");
        assert_eq!(resp.headers()["content-type"], "image/png");
        assert_eq!(
            resp.headers()["x-hilum-bit-depth"],
            bits.to_string().as_str()
        );
        let png = image::load_from_memory(&resp.bytes().await.expect("bytes")).expect("png");
        let png = match png {
            image::DynamicImage::ImageLuma16(p) => p,
            other => panic!("{rel}: expected 16-bit grayscale, got {:?}", other.color()),
        };
        assert_eq!(u64::from(png.width()), row["width"].as_u64().expect("w"));
        assert_eq!(u64::from(png.height()), row["height"].as_u64().expect("h"));

        // The same values as the decoder's canonical image, not an 8-bit rendering.
        let store = hilum_imaging::ImageStore::default();
        let bytes = std::fs::read(data_dir().join("cxr").join(rel)).expect("read");
        let canon = store
            .get(&store.ingest_bytes(bytes.into(), rel).expect("decode"))
            .expect("get");
        let served: Vec<u16> = png.into_raw();
        assert_eq!(served.len(), canon.pixels.len());
        assert!(served
            .iter()
            .zip(&canon.pixels)
            .all(|(&s, &c)| f32::from(s) == c.round()));
        let max = served.iter().copied().max().unwrap_or(0);
        assert!(max > 255, "{rel}: max value {max} fits in 8 bits");
        assert!(
            u64::from(max) < 1 << bits,
            "{rel}: {max} exceeds {bits} bits"
        );

        // Another token does not see the image; no token is refused.
        let other = client
            .get(srv.url(&format!("/v1/images/{id}/pixels")))
            .bearer_auth(&bob)
            .send()
            .await
            .expect("pixels as bob");
        assert_eq!(other.status(), 404);
        let anon = client
            .get(srv.url(&format!("/v1/images/{id}/pixels")))
            .send()
            .await
            .expect("pixels without token");
        assert_eq!(anon.status(), 401);
    }
    srv.stop().await;
}

/// Makes every `tool_call` audit row fail to insert, as a full disk or a lost connection
/// would, with a real trigger in the real database.
fn break_tool_call_audit(db: &TestDb, srv: &Server) {
    let sql: &[&str] = if db.is_postgres() {
        &[
            "CREATE FUNCTION hilum_test_audit_fails() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'audit storage failed (test trigger)'; END $$",
            "CREATE TRIGGER audit_fails BEFORE INSERT ON audit FOR EACH ROW
             WHEN (NEW.kind = 'tool_call') EXECUTE FUNCTION hilum_test_audit_fails()",
        ]
    } else {
        &[
            "CREATE TRIGGER audit_fails BEFORE INSERT ON audit WHEN NEW.kind = 'tool_call'
           BEGIN SELECT RAISE(ABORT, 'audit storage failed (test trigger)'); END",
        ]
    };
    for s in sql {
        srv.state
            .db()
            .execute_sql(s)
            .expect("install the failing trigger");
    }
}

on_both_databases!(a_tool_call_whose_audit_row_cannot_be_written_is_not_done);
async fn a_tool_call_whose_audit_row_cannot_be_written_is_not_done(db: &TestDb) {
    let script = write_script(db.dir.path(), two_round_script());
    let srv = start(config_url(&db.url, Some(&script))).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let (img, _) = upload_id(&client, &srv, &tok, IMG).await;
    break_tool_call_audit(db, &srv);

    // In a run: no result is streamed or stored, the model never sees one, the run fails.
    let ses = new_session(&client, &srv, &tok).await;
    let events = ask_ndjson(&client, &srv, &tok, &ses, "How large is it?", &[&img]).await;
    let t = types(&events);
    assert!(t.contains(&"tool_started".to_string()), "{t:?}");
    assert!(
        !t.iter()
            .any(|k| k == "tool_finished" || k == "tool_failed" || k == "final"),
        "an unaudited call must not count as done: {t:?}"
    );
    let error = events
        .iter()
        .find(|e| e["type"] == "error")
        .unwrap_or_else(|| panic!("no error event: {t:?}"));
    let message = error["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("audit row could not be recorded") && message.contains("test trigger"),
        "{message}"
    );
    let runs = get_json(&client, srv.url(&format!("/v1/sessions/{ses}/runs")), &tok).await;
    assert_eq!(runs["runs"][0]["status"], "failed", "{runs}");
    let messages = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/messages")),
        &tok,
    )
    .await;
    let stored = messages["messages"].as_array().cloned().unwrap_or_default();
    assert!(
        !stored.is_empty() && stored.iter().all(|m| m["role"] != "tool"),
        "no tool message is stored: {messages}"
    );
    let artifacts = get_json(
        &client,
        srv.url(&format!("/v1/sessions/{ses}/artifacts")),
        &tok,
    )
    .await;
    assert_eq!(
        artifacts["artifacts"].as_array().map(Vec::len),
        Some(0),
        "the thumbnail is not stored: {artifacts}"
    );

    // A direct call: the tool runs, but its result is withheld.
    let resp = call_tool(&client, &srv, &tok, "image_info", &json!({"image": img})).await;
    assert_eq!(resp.status(), 500);
    let body: Value = resp.json().await.expect("json");
    assert!(body.get("data").is_none(), "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("result is withheld")),
        "{body}"
    );
    let audit = srv.state.db().audit_since(0, 1000).expect("audit");
    assert!(audit.iter().all(|a| a.kind != "tool_call"), "{audit:?}");
    let metrics = client
        .get(srv.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    assert!(
        !metrics.contains("tool=\"image_info\",outcome=\"ok\""),
        "an unrecorded call is not counted as done"
    );

    // The same call goes through once the audit log can be written again.
    srv.state
        .db()
        .execute_sql("DROP TRIGGER audit_fails")
        .or_else(|_| {
            srv.state
                .db()
                .execute_sql("DROP TRIGGER audit_fails ON audit")
        })
        .expect("drop the trigger");
    let resp = call_tool(&client, &srv, &tok, "image_info", &json!({"image": img})).await;
    assert_eq!(resp.status(), 200);
    let audit = srv.state.db().audit_since(0, 1000).expect("audit");
    assert_eq!(audit.iter().filter(|a| a.kind == "tool_call").count(), 1);
    srv.stop().await;
}

/// One line of the `/metrics` text, as a number.
async fn metric(client: &reqwest::Client, srv: &Server, name: &str) -> f64 {
    let text = client
        .get(srv.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
}

on_both_databases!(image_memory_is_bounded_per_token_and_evicted_images_come_back);
async fn image_memory_is_bounded_per_token_and_evicted_images_come_back(db: &TestDb) {
    let script_path = db.path("script.json");
    let mut cfg = config_url(&db.url, Some(&script_path));
    // Room for two decoded 1024x1024 radiographs (4 MiB of f32 each, plus their files).
    let bound = 10u64 << 20;
    cfg.max_image_memory_bytes = bound;
    let srv = start(cfg).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let names = [
        "nih_00009745_000_cardiomegaly.png",
        "nih_00015649_000_mass.png",
        "nih_00000284_000_hernia.png",
        "nih_00000353_000_emphysema.png",
        "nih_00001968_000_pneumothorax.png",
        "nih_00004296_000_atelectasis.png",
    ];
    let (first, _) = upload_id(&client, &srv, &tok, names[0]).await;
    let info = |img: String| {
        let (client, srv, tok) = (&client, &srv, &tok);
        async move {
            let resp = call_tool(client, srv, tok, "image_info", &json!({"image": img})).await;
            assert_eq!(resp.status(), 200);
            let body: Value = resp.json().await.expect("json");
            assert!(body["data"]["width"].is_number(), "{body}");
            (body["summary"].clone(), body["data"].clone())
        }
    };
    let before = info(first.clone()).await;
    let mut ids = vec![first.clone()];
    for n in &names[1..] {
        ids.push(upload_id(&client, &srv, &tok, n).await.0);
        let resident = metric(&client, &srv, "hilum_images_resident").await;
        let bytes = metric(&client, &srv, "hilum_image_memory_bytes").await;
        assert!(resident <= 2.0, "{resident} images resident");
        assert!(bytes <= bound as f64, "{bytes} bytes resident");
    }
    assert!(metric(&client, &srv, "hilum_image_evictions_total").await >= 4.0);
    let reloads = metric(&client, &srv, "hilum_image_reloads_total").await;

    // A direct call naming the evicted image reads it back: same id, same pixels, same stats.
    assert_eq!(info(first.clone()).await, before);
    assert_eq!(
        metric(&client, &srv, "hilum_image_reloads_total").await,
        reloads + 1.0
    );
    // Every image is still listed.
    let listed: Value = get_json(&client, srv.url("/v1/images"), &tok).await;
    assert_eq!(listed["images"].as_array().map(Vec::len), Some(names.len()));

    // Another token cannot bring it back through its own space.
    let eve = token(&srv.state, "eve");
    let stolen = call_tool(&client, &srv, &eve, "image_info", &json!({"image": first})).await;
    // As for any id the caller does not own (see another_tokens_…_are_404).
    assert_eq!(stolen.status(), 422);

    // A run whose model names an evicted image the question did not list: the tool reads it
    // through the store's loader (the blocking path) and gets the same result.
    let second = ids[1].clone();
    write_script(
        db.dir.path(),
        json!([
            {"content": "", "tool_calls": [{"name": "image_info", "arguments": {"image": second}}]},
            {"content": "done"}
        ]),
    );
    assert_eq!(script_path, db.path("script.json"));
    let direct_second = info(second.clone()).await;
    // Evict it again by touching the two newest images.
    info(ids[5].clone()).await;
    info(ids[4].clone()).await;
    let reloads = metric(&client, &srv, "hilum_image_reloads_total").await;
    let ses = new_session(&client, &srv, &tok).await;
    let events = ask_ndjson(&client, &srv, &tok, &ses, "Describe it.", &[]).await;
    assert_eq!(
        metric(&client, &srv, "hilum_image_reloads_total").await,
        reloads + 1.0
    );
    let done = events
        .iter()
        .find(|e| e["type"] == "tool_finished" && e["name"] == "image_info")
        .unwrap_or_else(|| panic!("no image_info result: {events:?}"));
    assert_eq!(done["data"], direct_second.1, "{done}");
    assert!(metric(&client, &srv, "hilum_images_resident").await <= 2.0);
    srv.stop().await;
}
