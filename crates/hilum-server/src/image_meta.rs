//! An image's reading context for the local reader: its decoded metadata (size, pixel
//! spacing, window, view) and, for DICOM, the study context and the tag list. The patient's
//! name and id are in this response only: the runs' model input carries no PHI and nothing
//! here is logged.

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::db::Caller;
use crate::error::ApiError;
use crate::AppState;

#[derive(Serialize, ToSchema)]
pub struct ImageInfo {
    pub id: String,
    /// The decoder's metadata: size, bit depth, pixel spacing (mm), view, file window, …
    #[schema(value_type = Object)]
    pub meta: Value,
    /// DICOM only: patient, study date and time, modality, view (PHI: for the local reader).
    #[schema(value_type = Object)]
    pub study: Option<Value>,
    /// DICOM only: every top-level attribute (`tag`, `vr`, `name`, `value`).
    #[schema(value_type = Vec<Object>)]
    pub tags: Vec<Value>,
}

#[utoipa::path(get, path = "/v1/images/{id}/info", tag = "images",
    params(("id" = String, Path, description = "Image id")),
    responses(
        (status = 200, description = "The image's metadata and, for DICOM, its study context and tags (PHI: not cached, not logged)", body = ImageInfo),
        (status = 404, description = "No such image for this token"),
    ),
    security(("bearer" = [])))]
pub async fn image_info(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let img = state.owned_image(&caller, &id).await?;
    let meta = serde_json::to_value(&img.meta).map_err(|e| ApiError::Internal(e.to_string()))?;
    let (mut study, mut tags) = (None, Vec::new());
    if img.meta.format == "dicom" {
        let bytes = state
            .db
            .image_bytes_by_id(caller.token_id.clone(), vec![id.clone()])
            .await?
            .into_iter()
            .next()
            .map(|(_, b)| b)
            .ok_or_else(|| ApiError::not_found("image", &id))?;
        let read = tokio::task::spawn_blocking(move || hilum_imaging::dicom_tags(&bytes, "image"))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        // A file that decoded but whose tags cannot be listed still has its metadata.
        if let Ok((ctx, rows)) = read {
            study = serde_json::to_value(ctx).ok();
            tags = rows
                .into_iter()
                .filter_map(|r| serde_json::to_value(r).ok())
                .collect();
        }
    }
    let body = ImageInfo {
        id,
        meta,
        study,
        tags,
    };
    Ok(([(header::CACHE_CONTROL, "private, no-store")], Json(body)).into_response())
}
