//! The OpenAPI document of the REST API, served at `/openapi.json`. A test checks that it
//! lists exactly the routes the router serves.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{api, image_meta, live, pacs, run};

/// The OpenAPI document: every route, its schemas and the bearer security scheme.
#[derive(OpenApi)]
#[openapi(
    info(title = "Hilum", description = "Chest X-ray analysis service: images, agent sessions with streamed events, tools, audit log. MCP (streamable HTTP) is served at /mcp."),
    paths(
        api::healthz,
        api::metrics,
        api::upload_image,
        api::list_images,
        api::image_pixels,
        image_meta::image_info,
        api::create_session,
        api::list_sessions,
        api::get_session,
        run::ask,
        run::resume,
        live::follow,
        live::cancel,
        api::list_messages,
        api::list_runs,
        api::run_events,
        api::session_artifacts,
        api::get_artifact,
        api::list_tools,
        api::call_tool,
        api::export_audit,
        pacs::list_jobs,
        pacs::retry_job,
        pacs::job_events,
        pacs::pull,
        pacs::stow,
        serve,
    ),
    components(schemas(
        api::Health, api::ImageList, api::CreateSession, api::SessionList, api::MessageList,
        api::RunList, api::EventList, api::ArtifactList, api::ArtifactRef, api::ToolList,
        api::DirectResult, run::Ask, image_meta::ImageInfo, pacs::JobList, pacs::JobEvents, pacs::Pull, pacs::Pulled, crate::db::PacsJob,
    )),
    modifiers(&BearerAuth),
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The routes as the router serves them: (method, path in OpenAPI syntax).
pub const ROUTES: &[(&str, &str)] = &[
    ("get", "/healthz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("post", "/v1/images"),
    ("get", "/v1/images"),
    ("get", "/v1/images/{id}/pixels"),
    ("get", "/v1/images/{id}/info"),
    ("post", "/v1/sessions"),
    ("get", "/v1/sessions"),
    ("get", "/v1/sessions/{id}"),
    ("post", "/v1/sessions/{id}/messages"),
    ("get", "/v1/sessions/{id}/messages"),
    ("get", "/v1/sessions/{id}/runs"),
    ("get", "/v1/sessions/{id}/runs/{run_id}/events"),
    ("post", "/v1/sessions/{id}/runs/{run_id}/resume"),
    ("get", "/v1/sessions/{id}/runs/{run_id}/stream"),
    ("post", "/v1/sessions/{id}/runs/{run_id}/cancel"),
    ("get", "/v1/sessions/{id}/artifacts"),
    ("get", "/v1/artifacts/{id}"),
    ("get", "/v1/tools"),
    ("post", "/v1/tools/{name}:call"),
    ("get", "/v1/audit"),
    ("get", "/v1/pacs/jobs"),
    ("post", "/v1/pacs/jobs/{id}/retry"),
    ("get", "/v1/pacs/jobs/{id}/events"),
    ("post", "/v1/pacs/pull"),
    ("post", "/dicomweb/studies"),
];

// GET /openapi.json: this document.
#[allow(missing_docs, reason = "a doc would become the OpenAPI summary")]
#[utoipa::path(get, path = "/openapi.json", tag = "service",
    responses((status = 200, description = "This document")))]
pub async fn serve() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// (method, path) pairs the document describes.
pub fn documented_routes() -> Vec<(String, String)> {
    let doc = ApiDoc::openapi();
    let mut out = Vec::new();
    for (path, item) in &doc.paths.paths {
        let ops = [
            ("get", item.get.is_some()),
            ("post", item.post.is_some()),
            ("put", item.put.is_some()),
            ("delete", item.delete.is_some()),
            ("patch", item.patch.is_some()),
        ];
        for (m, present) in ops {
            if present {
                out.push((m.to_string(), path.clone()));
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn document_lists_exactly_the_route_table() {
        let mut table: Vec<(String, String)> = ROUTES
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        table.sort();
        assert_eq!(documented_routes(), table);
    }
}
