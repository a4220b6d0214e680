//! The workstation web UI (issue 8): plain HTML, CSS and JavaScript modules embedded in the
//! binary, served without a token at `/` and `/ui/*` (the API calls they make carry the
//! token the user enters). No bundler: the files under `web/` are what the browser runs.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::AppState;

/// (path under `/ui/`, media type, bytes).
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_str!("../web/index.html"),
    ),
    (
        "app.css",
        "text/css; charset=utf-8",
        include_str!("../web/app.css"),
    ),
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/app.js"),
    ),
    (
        "api.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/api.js"),
    ),
    (
        "viewer.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/viewer.js"),
    ),
    (
        "overlays.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/overlays.js"),
    ),
    (
        "export.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/export.js"),
    ),
];

/// Scripts only from this origin, images also from blobs (artifacts fetched with the token).
const CSP: &str = "default-src 'self'; img-src 'self' blob: data:; style-src 'self'; \
                   script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; \
                   frame-ancestors 'none'";

fn asset(name: &str) -> Response {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, media_type, body)) => {
            let mut resp = (*body).into_response();
            let h = resp.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type));
            // Assets change with the binary; revalidate so an upgrade is seen at once.
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            h.insert(
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            );
            h.insert(
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            );
            resp
        }
        None => (
            StatusCode::NOT_FOUND,
            format!("no UI file `{name}`; the UI starts at /"),
        )
            .into_response(),
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/", get(|| async { asset("index.html") }))
        .route(
            "/ui/{file}",
            get(|Path(file): Path<String>| async move { asset(&file) }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_the_page_imports_is_served() {
        // app.js imports the other modules by relative path; a missing entry breaks the UI.
        let app = ASSETS
            .iter()
            .find(|(n, _, _)| *n == "app.js")
            .map(|a| a.2)
            .unwrap_or_default();
        for line in app.lines().filter(|l| l.starts_with("import ")) {
            let Some(start) = line.find("\"./") else {
                continue;
            };
            let rest = &line[start + 3..];
            let name = &rest[..rest.find('"').unwrap_or(rest.len())];
            assert!(
                ASSETS.iter().any(|(n, _, _)| *n == name),
                "app.js imports {name}, which web.rs does not serve"
            );
        }
        let index = asset("index.html");
        assert_eq!(index.status(), StatusCode::OK);
        assert_eq!(asset("nope.js").status(), StatusCode::NOT_FOUND);
    }
}
