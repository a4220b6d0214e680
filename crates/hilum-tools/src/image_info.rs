//! `image_info`: dimensions, bit depth and intensity statistics of an image.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool};
use hilum_imaging::{CxrImage, ImageStore};
use serde_json::{json, Value};

use crate::common::{run_blocking, ImageArgs};
use crate::{BuildTool, ToolDeps};

/// The `image_info` tool: size, bit depth, format and intensity statistics of an image.
pub struct ImageInfo {
    store: Arc<ImageStore>,
}

impl ImageInfo {
    /// The tool, ready to register (its schema generated from its arguments' type).
    pub fn new(store: Arc<ImageStore>) -> Typed<Self> {
        Typed::new(ImageInfo { store })
    }
}

impl BuildTool for ImageInfo {
    fn build(deps: &ToolDeps) -> Arc<dyn Tool> {
        Arc::new(ImageInfo::new(deps.images.clone()))
    }
}

/// Intensity statistics on the image's own scale.
pub fn stats(img: &CxrImage) -> Value {
    let n = img.pixels.len().max(1) as f64;
    let mean = img.pixels.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = img
        .pixels
        .iter()
        .map(|&v| (v as f64 - mean).powi(2))
        .sum::<f64>()
        / n;
    let max_value = img.max_value() as f64;
    let bins = 16usize;
    let mut hist = vec![0u64; bins];
    for &v in &img.pixels {
        let b = ((v as f64 / (max_value + 1.0)) * bins as f64) as usize;
        hist[b.min(bins - 1)] += 1;
    }
    // Percentiles from a 4096-bin histogram: exact enough, no sort of millions of pixels.
    let fine = 4096usize;
    let mut fine_hist = vec![0u64; fine];
    for &v in &img.pixels {
        let b = ((v as f64 / (max_value + 1.0)) * fine as f64) as usize;
        fine_hist[b.min(fine - 1)] += 1;
    }
    let pct = |p: f64| {
        let target = (p / 100.0 * n).ceil() as u64;
        let mut acc = 0u64;
        for (i, c) in fine_hist.iter().enumerate() {
            acc += c;
            if acc >= target.max(1) {
                return ((i as f64 + 0.5) / fine as f64 * (max_value + 1.0)).round();
            }
        }
        max_value
    };
    let fractions: Vec<f64> = hist
        .iter()
        .map(|&c| ((c as f64 / n) * 1e4).round() / 1e4)
        .collect();
    json!({
        "mean": (mean * 100.0).round() / 100.0,
        "std": (var.sqrt() * 100.0).round() / 100.0,
        "min": img.pixels.iter().cloned().fold(f32::INFINITY, f32::min),
        "max": img.pixels.iter().cloned().fold(f32::NEG_INFINITY, f32::max),
        "p1": pct(1.0),
        "p50": pct(50.0),
        "p99": pct(99.0),
        "histogram16": fractions,
    })
}

#[async_trait]
impl TypedTool for ImageInfo {
    type Args = ImageArgs;
    const NAME: &'static str = "image_info";

    fn description(&self) -> String {
        "Size, bit depth, format and intensity statistics (mean, standard deviation, \
         percentiles, a 16-bin histogram) of an image. Use it to check what an image is before \
         analysing it, e.g. whether it is 16-bit, very dark, or small."
            .into()
    }

    async fn run(&self, _ctx: &ToolContext, args: ImageArgs) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let id = args.image.0;
        let pixels = img.clone();
        let s = run_blocking(move || Ok(stats(&pixels))).await?;
        let m = &img.meta;
        let data = json!({
            "image": id,
            "width": img.width,
            "height": img.height,
            "bit_depth": m.bit_depth,
            "format": m.format,
            "source_channels": m.source_channels,
            "pixel_spacing_mm": m.pixel_spacing_mm,
            "view_position": m.view_position,
            "photometric": m.photometric,
            "modality": m.modality,
            // Values are bright = dense: MONOCHROME1 was inverted, a DICOM window applied.
            "inverted": m.inverted,
            "window_applied": m.window_applied,
            "warnings": m.warnings,
            "stats": s,
        });
        // Spelled in the words questions use ("pixel dimensions", "bit depth"), so a reader,
        // human or small model, finds the fact without translating "1736x2022 px".
        let summary = format!(
            "{id}: {} x {} pixels (width x height), bit depth {} ({}-bit {}), mean {} (of max {}), std {}",
            img.width,
            img.height,
            m.bit_depth,
            m.bit_depth,
            m.format,
            data["stats"]["mean"],
            img.max_value(),
            data["stats"]["std"]
        );
        Ok(ToolOutput::new(summary, data))
    }
}
