//! `visualize`: renders an image with masks, heatmaps and labelled boxes to a PNG artifact.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{
    Artifact, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::{Box2d, Colormap, Heatmap, ImageStore, Layer, MaskLayer, Overlay};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use crate::common::{run_blocking, ImageId};

/// The `visualize` tool: draws other tools' masks, heatmaps and boxes on an image as a PNG.
pub struct Visualize {
    store: Arc<ImageStore>,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// Layer ids (masks, heatmaps) returned by other tools; omit for all layers of the image
    #[serde(default)]
    #[schemars(inner(pattern("^lyr_[0-9a-f]{6,64}$")))]
    layers: Option<Vec<String>>,
    #[serde(default)]
    #[schemars(length(max = 50))]
    boxes: Vec<BoxArg>,
    #[serde(default = "yes")]
    legend: bool,
    #[serde(default = "default_side")]
    #[schemars(range(min = 64, max = 4096))]
    max_side: u32,
    #[serde(default = "default_alpha")]
    #[schemars(range(min = 0, max = 1))]
    alpha: f64,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct BoxArg {
    x: f64,
    y: f64,
    #[schemars(extend("exclusiveMinimum" = 0))]
    w: f64,
    #[schemars(extend("exclusiveMinimum" = 0))]
    h: f64,
    #[schemars(length(max = 60))]
    label: String,
    #[serde(default)]
    #[schemars(range(min = 0, max = 1))]
    score: Option<f64>,
}

fn yes() -> bool {
    true
}
fn default_side() -> u32 {
    1024
}
fn default_alpha() -> f64 {
    0.35
}

impl Visualize {
    /// The tool, ready to register (its schema generated from its arguments' type).
    pub fn new(store: Arc<ImageStore>) -> Typed<Self> {
        Typed::new(Visualize { store })
    }
}

impl crate::BuildTool for Visualize {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(Visualize::new(deps.images.clone()))
    }
}

#[async_trait]
impl TypedTool for Visualize {
    type Args = Args;
    const NAME: &'static str = "visualize";

    fn description(&self) -> String {
        "Draws results on a chest X-ray and returns a PNG for the user: segmentation \
         masks and heatmaps produced by other tools (by their layer ids, `lyr_...`; omit `layers` \
         to draw every layer of the image) in per-structure colours, and boxes with labels given \
         in original-image pixels (x, y = top-left corner). Use it to show the user where a \
         finding is. Returns no new findings."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            presentation: true,
            ..Requirements::NONE
        }
    }

    async fn run(&self, _ctx: &ToolContext, a: Args) -> Result<ToolOutput, ToolError> {
        let img = a.image.load(&self.store)?;
        let id = a.image.0.clone();
        let layer_ids = a.layers.unwrap_or_else(|| self.store.layers_of(&id));
        let mut overlay = Overlay {
            legend: a.legend,
            max_side: Some(a.max_side.clamp(64, 4096)),
            ..Default::default()
        };
        for lid in &layer_ids {
            let (owner, layer) = self.store.layer(lid).map_err(|_| {
                ToolError::NotFound(format!(
                    "no layer `{lid}`; layers of {id}: {}",
                    self.store.layers_of(&id).join(", ")
                ))
            })?;
            if owner != id {
                return Err(ToolError::InvalidArguments(format!(
                    "layer `{lid}` belongs to {owner}, not {id}"
                )));
            }
            match layer.as_ref().clone() {
                Layer::Mask {
                    label,
                    width,
                    height,
                    data,
                } => overlay.masks.push(MaskLayer {
                    label,
                    width,
                    height,
                    data,
                    color: None,
                    alpha: a.alpha as f32,
                }),
                Layer::Heatmap {
                    label,
                    width,
                    height,
                    data,
                } => overlay.heatmaps.push(Heatmap {
                    label,
                    width,
                    height,
                    data,
                    colormap: Colormap::Jet,
                    alpha: (a.alpha as f32).max(0.3),
                    threshold: 0.2,
                }),
            }
        }
        let (w, h) = (img.width as f64, img.height as f64);
        for b in &a.boxes {
            if b.x >= w || b.y >= h || b.x + b.w <= 0.0 || b.y + b.h <= 0.0 {
                return Err(ToolError::InvalidArguments(format!(
                    "box `{}` ({}, {}, {}x{}) lies outside the {}x{} image",
                    b.label, b.x, b.y, b.w, b.h, img.width, img.height
                )));
            }
            overlay.boxes.push(Box2d {
                x: b.x,
                y: b.y,
                w: b.w,
                h: b.h,
                label: b.label.clone(),
                score: b.score,
                color: None,
            });
        }
        let n_masks = overlay.masks.len();
        let n_heat = overlay.heatmaps.len();
        let n_boxes = overlay.boxes.len();
        let png = run_blocking(move || {
            overlay
                .render_png(&img)
                .map_err(|e| ToolError::Unprocessable(e.to_string()))
        })
        .await?;
        let summary = format!(
            "rendered {id} with {n_masks} mask(s), {n_heat} heatmap(s) and {n_boxes} box(es) as visualization.png"
        );
        let data = json!({
            "image": id,
            "layers": layer_ids,
            "masks": n_masks,
            "heatmaps": n_heat,
            "boxes": n_boxes,
            "artifact": "visualization.png",
        });
        Ok(ToolOutput::new(summary, data).with_artifact(Artifact::png(
            "visualization.png",
            "overlay",
            png,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn data(rel: &str) -> Vec<u8> {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/cxr")
            .join(rel);
        std::fs::read(&p)
            .unwrap_or_else(|e| panic!("real test data missing: {} ({e})", p.display()))
    }

    #[tokio::test]
    async fn draws_layers_and_boxes_on_a_real_image() {
        let store = Arc::new(ImageStore::default());
        let id = store
            .ingest_bytes(
                data("images/nih_00009745_000_cardiomegaly.png").into(),
                "nih.png",
            )
            .unwrap();
        // A 64x64 "heart" mask covering the middle of the image.
        let mask: Vec<f32> = (0..64 * 64)
            .map(|i| {
                let (x, y) = (i % 64, i / 64);
                ((20..44).contains(&x) && (28..52).contains(&y)) as u8 as f32
            })
            .collect();
        let lid = store
            .put_layer(
                &id,
                Layer::Mask {
                    label: "heart".into(),
                    width: 64,
                    height: 64,
                    data: mask,
                },
            )
            .unwrap();
        let tool = Visualize::new(store.clone());
        let out = tool
            .call(
                &ToolContext::default(),
                json!({"image": id, "boxes": [{"x": 600, "y": 300, "w": 200, "h": 150, "label": "Cardiomegaly", "score": 0.8}], "max_side": 512}),
            )
            .await
            .unwrap();
        assert_eq!(out.data["layers"], json!([lid]));
        let png = &out.artifacts[0].bytes;
        let img = image::load_from_memory(png).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (512, 512));
        // Mask centre is tinted red (heart colour); a far corner of the radiograph stays grey.
        let p = img.get_pixel(256, 320).0;
        assert!(p[0] as i32 - p[1] as i32 > 40, "{p:?}");
        let q = img.get_pixel(30, 500).0;
        assert!(q[0] == q[1] && q[1] == q[2], "{q:?}");
        // Box outside the image is refused with a reason.
        let err = tool
            .call(
                &ToolContext::default(),
                json!({"image": id, "boxes": [{"x": 5000, "y": 0, "w": 10, "h": 10, "label": "x"}]}),
            )
            .await
            .unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
    }
}
