//! Request ids: every request runs inside a `request` span whose `request_id` is the caller's
//! `x-request-id` when it is sane (printable ASCII, at most 128 characters) and a new one
//! otherwise, and the response returns it. Every log line of the request, of the run it
//! starts and of the tool calls in that run carries it, so a line in a log, an event and an
//! audit row can be tied together.
//!
//! The span holds the method and the route's template (`/v1/sessions/{id}/messages`), never
//! the path itself or its query, nor any header or body.

use std::time::Instant;

use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

/// The header that carries a request's id, both ways.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Longest request id taken from a caller.
const MAX_LEN: usize = 128;

/// A request's id, in the request's extensions for handlers that leave the request's task
/// (MCP over HTTP runs its calls on the session's task).
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

/// The caller's id if it is sane: 1 to 128 printable ASCII characters, no spaces (a log line
/// cannot be forged with a newline or padded with a huge header).
fn sane(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    (!s.is_empty() && s.len() <= MAX_LEN && s.bytes().all(|b| b.is_ascii_graphic()))
        .then(|| s.to_string())
}

/// The outermost layer: takes or makes the id, runs the request inside its span, logs the
/// outcome and returns the id.
pub(crate) async fn with_request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(sane)
        .unwrap_or_else(|| crate::db::new_id("req"));
    let span = tracing::info_span!(
        "request",
        request_id = %id,
        method = %req.method(),
        route = tracing::field::Empty,
    );
    req.extensions_mut().insert(RequestId(id.clone()));
    let started = Instant::now();
    let mut resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    let ms = started.elapsed().as_secs_f64() * 1e3;
    span.in_scope(|| {
        // A streamed run goes on after this: its lines carry the same id.
        if status >= 500 {
            tracing::warn!(status, duration_ms = ms, "request answered");
        } else {
            tracing::info!(status, duration_ms = ms, "request answered");
        }
    });
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut()
            .insert(HeaderName::from_static(REQUEST_ID_HEADER), v);
    }
    resp
}

/// Records the matched route's template in the request's span (the route is known only
/// after routing, inside the router).
pub(crate) fn record_route(req: &Request) {
    if let Some(p) = req.extensions().get::<MatchedPath>() {
        tracing::Span::current().record("route", p.as_str());
    }
}

/// A span for work done on behalf of a request outside its task.
pub(crate) fn span_for(id: Option<&RequestId>) -> tracing::Span {
    match id {
        Some(RequestId(id)) => tracing::info_span!("request", request_id = %id),
        None => tracing::Span::none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_short_printable_ids_are_taken() {
        let ok = |s: &str| sane(&HeaderValue::from_str(s).expect("header value"));
        assert_eq!(ok("abc-123_X.y").as_deref(), Some("abc-123_X.y"));
        assert_eq!(ok(&"a".repeat(128)).map(|s| s.len()), Some(128));
        assert_eq!(ok(&"a".repeat(129)), None);
        assert_eq!(ok(""), None);
        assert_eq!(ok("two words"), None);
        assert_eq!(ok("tab\there"), None);
        let bytes = HeaderValue::from_bytes(b"caf\xc3\xa9").expect("opaque header");
        assert_eq!(sane(&bytes), None);
    }
}
