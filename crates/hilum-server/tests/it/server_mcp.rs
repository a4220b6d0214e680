//! MCP over streamable HTTP (`/mcp`) and stdio, checked with raw JSON-RPC and with the
//! official MCP Python SDK (scripts/mcp_client_check.py) when its venv exists
//! (`bash scripts/setup_mcp_client.sh`; set HILUM_REQUIRE_MCP_CLIENT=1 to fail without it).

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};

const IMG: &str = "nih_00000001_000_cardiomegaly.png";

/// The JSON-RPC message in a response that is either JSON or an SSE stream.
fn rpc_body(text: &str) -> Value {
    if let Ok(v) = serde_json::from_str(text) {
        return v;
    }
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
        .find(|v| v.get("id").is_some())
        .unwrap_or_else(|| panic!("no JSON-RPC response in: {text}"))
}

#[tokio::test]
async fn mcp_http_lists_and_calls_tools_with_structured_results() {
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(config(&dir.path().join("h.db"), None)).await;
    let tok = token(&srv.state, "alice");
    let client = reqwest::Client::new();
    let (img, row) = upload_id(&client, &srv, &tok, IMG).await;

    let post = |body: Value, session: Option<String>| {
        let mut req = client
            .post(srv.url("/mcp"))
            .bearer_auth(&tok)
            .header("accept", "application/json, text/event-stream")
            .json(&body);
        if let Some(s) = session {
            req = req.header("mcp-session-id", s);
        }
        req.send()
    };
    let init = post(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "hilum-test", "version": "0"}}}),
        None,
    )
    .await
    .expect("initialize");
    assert_eq!(init.status(), 200);
    let session = init
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let init = rpc_body(&init.text().await.expect("body"));
    assert_eq!(init["result"]["serverInfo"]["name"], "hilum");
    let _ = post(
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        session.clone(),
    )
    .await
    .expect("initialized");

    let list = post(
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
        session.clone(),
    )
    .await
    .expect("tools/list");
    let list = rpc_body(&list.text().await.expect("body"));
    let names: Vec<&str> = list["result"]["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(
        names.contains(&"image_info") && names.contains(&"load_image"),
        "{names:?}"
    );

    // The uploaded image is visible to MCP calls with the same token.
    let call = post(
        json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
               "params": {"name": "image_info", "arguments": {"image": img}}}),
        session.clone(),
    )
    .await
    .expect("tools/call");
    let call = rpc_body(&call.text().await.expect("body"));
    assert_eq!(call["result"]["isError"], false, "{call}");
    assert_eq!(call["result"]["structuredContent"]["width"], row["width"]);

    // Artifacts come back as image content.
    let thumb = post(
        json!({"jsonrpc": "2.0", "id": 4, "method": "tools/call",
               "params": {"name": "thumbnail", "arguments": {"image": img}}}),
        session,
    )
    .await
    .expect("tools/call");
    let thumb = rpc_body(&thumb.text().await.expect("body"));
    let content = thumb["result"]["content"].as_array().expect("content");
    let png = content
        .iter()
        .find(|c| c["type"] == "image")
        .expect("image content");
    assert_eq!(png["mimeType"], "image/png");
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(png["data"].as_str().expect("data"))
        .expect("base64");
    assert_eq!(image::load_from_memory(&bytes).expect("png").width(), 64);

    // MCP calls are audited like REST calls.
    let audit = srv.state.db().audit_since(0, 100).expect("audit");
    assert_eq!(audit.iter().filter(|a| a.kind == "tool_call").count(), 2);
    srv.stop().await;
}

fn sdk_python() -> Option<PathBuf> {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/.venv-mcp/bin/python");
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

fn check_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/mcp_client_check.py")
}

fn run_check(py: &Path, args: &[String]) -> Value {
    let out = std::process::Command::new(py)
        .arg(check_script())
        .args(args)
        .output()
        .expect("run the MCP client check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "MCP client check failed:\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.lines().last().unwrap_or("")).expect("JSON summary")
}

#[tokio::test]
async fn mcp_python_sdk_over_streamable_http() {
    let Some(py) = sdk_python() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let srv = start(config(&dir.path().join("h.db"), None)).await;
    let tok = token(&srv.state, "alice");
    let image_path = data_dir().join("cxr/images").join(IMG);
    let args = vec![
        "http".to_string(),
        "--url".into(),
        srv.url("/mcp"),
        "--token".into(),
        tok,
        "--image".into(),
        image_path.display().to_string(),
    ];
    let summary = tokio::task::spawn_blocking(move || run_check(&py, &args))
        .await
        .expect("join");
    assert_eq!(summary["ok"], true);
    let real = image::open(&image_path).expect("decode");
    assert_eq!(summary["width"], real.width());
    srv.stop().await;
}

#[test]
fn mcp_python_sdk_over_stdio() {
    let Some(py) = sdk_python() else { return };
    let image_path = data_dir().join("cxr/images").join(IMG);
    let summary = run_check(
        &py,
        &[
            "stdio".to_string(),
            "--hilum".into(),
            env!("CARGO_BIN_EXE_hilum-mcp").to_string(),
            "--image".into(),
            image_path.display().to_string(),
        ],
    );
    assert_eq!(summary["ok"], true);
    let real = image::open(&image_path).expect("decode");
    assert_eq!(summary["height"], real.height());
}
