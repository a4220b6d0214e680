//! API errors: each becomes a status code and a JSON body `{"error": {"code", "message"}}`
//! whose message tells the caller what to do.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use thiserror::Error;

use crate::db::DbError;

/// Why a request failed, as the caller is told.
#[derive(Debug, Error)]
pub enum ApiError {
    /// No valid bearer token came with the request (401).
    #[error("missing or invalid bearer token: send `Authorization: Bearer <token>` with a token from `hilum serve token create`")]
    Unauthorized,
    /// The token is valid but not allowed this (403).
    #[error("this token may not do that: {0}")]
    Forbidden(String),
    /// Nothing by that id for this token (404).
    #[error("{0}")]
    NotFound(String),
    /// The request is malformed (400).
    #[error("{0}")]
    BadRequest(String),
    /// The body is over its limit (413).
    #[error("{0}")]
    PayloadTooLarge(String),
    /// Well-formed but unusable, e.g. an image that does not decode (422).
    #[error("{0}")]
    Unprocessable(String),
    /// The token is over its rate limit (429, with `Retry-After`).
    #[error("too many requests for this token: retry in {retry_after_secs} s")]
    RateLimited {
        /// Seconds until a request will be accepted.
        retry_after_secs: u64,
    },
    /// No reasoning model is configured or it cannot be built (503).
    #[error("the reasoning model is not available: {0}")]
    LlmUnavailable(String),
    /// The request clashes with the current state: cancelling a run not running (409).
    #[error("{0}")]
    Conflict(String),
    /// A part this needs is not configured, e.g. the DICOM node is off (503).
    #[error("{0}")]
    Unavailable(String),
    /// A peer (the PACS) could not be reached or answered wrongly.
    #[error("{0}")]
    BadGateway(String),
    /// A fault of the service itself (500); it is logged.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    /// The HTTP status the error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unprocessable(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::LlmUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The stable machine-readable code of the JSON body (`not_found`, …).
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound(_) => "not_found",
            ApiError::BadRequest(_) => "bad_request",
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::Unprocessable(_) => "unprocessable",
            ApiError::RateLimited { .. } => "rate_limited",
            ApiError::LlmUnavailable(_) => "llm_unavailable",
            ApiError::Conflict(_) => "conflict",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::BadGateway(_) => "bad_gateway",
            ApiError::Internal(_) => "internal",
        }
    }

    /// A 404 for the `what` with id `id`, which this token does not have.
    pub fn not_found(what: &str, id: &str) -> Self {
        ApiError::NotFound(format!("no {what} `{id}` for this token"))
    }
}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> Self {
        tracing::error!(error = %e, "database error");
        ApiError::Internal(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = json!({"error": {"code": self.code(), "message": self.to_string()}});
        let mut resp = (status, Json(body)).into_response();
        if let ApiError::RateLimited { retry_after_secs } = self {
            if let Ok(v) = HeaderValue::from_str(&retry_after_secs.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
