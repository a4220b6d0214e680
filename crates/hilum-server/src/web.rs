//! The place of the web UI (issue 8): static assets under `/` and `/ui/*`. For now one page
//! that points at the API; the UI will replace `INDEX` and add its assets here.

use axum::response::Html;
use axum::routing::get;
use axum::Router;

use crate::AppState;

const INDEX: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Hilum</title></head>
<body><h1>Hilum</h1>
<p>Chest X-ray analysis service. API description: <a href="/openapi.json">/openapi.json</a>.
Health: <a href="/healthz">/healthz</a>. MCP (streamable HTTP): <code>/mcp</code>.</p>
</body></html>"#;

pub fn routes() -> Router<AppState> {
    Router::new().route("/", get(|| async { Html(INDEX) }))
}
