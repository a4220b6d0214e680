//! `intensity_at`: the mean stored value of a DICOM image in a square around a point.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool};
use hilum_imaging::ImageStore;
use hilum_tools::{BuildTool, ImageId, ToolDeps};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

pub struct IntensityAt {
    store: Arc<ImageStore>,
}

impl BuildTool for IntensityAt {
    fn build(deps: &ToolDeps) -> Arc<dyn Tool> {
        Arc::new(Typed::new(IntensityAt {
            store: deps.images.clone(),
        }))
    }
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// Column of the centre, original-image pixels.
    x: u32,
    /// Row of the centre, original-image pixels.
    y: u32,
    /// Half-width of the square in pixels (0: the one pixel).
    #[schemars(range(max = 50))]
    #[serde(default)]
    radius: u32,
}

#[async_trait]
impl TypedTool for IntensityAt {
    type Args = Args;
    const NAME: &'static str = "intensity_at";

    fn description(&self) -> String {
        "Mean stored value (after the DICOM window) of a DICOM image in a square around a point."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            dicom_input: true,
            ..Requirements::NONE
        }
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        if img.meta.format != "dicom" {
            return Err(ToolError::Unprocessable(format!(
                "{} is a {} image; intensity_at reads DICOM images only",
                args.image.0, img.meta.format
            )));
        }
        let (w, h) = (img.width as u64, img.height as u64);
        let (x, y, r) = (args.x as u64, args.y as u64, args.radius as u64);
        if x >= w || y >= h {
            return Err(ToolError::InvalidArguments(format!(
                "({x}, {y}) is outside the {w}x{h} image"
            )));
        }
        let (x0, x1) = (x.saturating_sub(r), (x + r).min(w - 1));
        let (y0, y1) = (y.saturating_sub(r), (y + r).min(h - 1));
        let mut sum = 0f64;
        let mut n = 0u64;
        for row in y0..=y1 {
            for col in x0..=x1 {
                sum += f64::from(img.pixels[(row * w + col) as usize]);
                n += 1;
            }
        }
        let mean = sum / n.max(1) as f64;
        Ok(ToolOutput::new(
            format!("mean {mean:.1} over {n} px around ({x}, {y})"),
            json!({"image": args.image.0, "mean": mean, "pixels": n}),
        ))
    }
}
