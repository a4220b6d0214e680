//! `segment_lungs`: lung fields with the real lung U-Net; mask, per-lung areas and sizes,
//! left/right ratio, and an overlay.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use hilum_agent::{
    Artifact, Capability, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::{CxrImage, ImageStore};
use hilum_models::runner::Runner;
use hilum_models::unet::{self, LungSegmenter};
use hilum_models::{BackendChoice, Device, ModelPool, Placed};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::common::{choice, round2, run_model, Choice, ImageId};

pub const MODEL_ID: &str = "lung-unet";
/// Longest side of the overlay PNG (the mask artifact keeps the original resolution).
const OVERLAY_MAX_SIDE: u32 = 1024;

/// The `segment_lungs` tool: lung fields from the lung U-Net, with areas and masks.
pub struct SegmentLungs {
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    /// `None`: each call routed across the pool's devices.
    pin: Option<Device>,
    /// The U-Net's backend over the models' settings; empty: the settings', else
    /// [`unet::auto_backend`] — the native CPU kernels where their AVX2/AVX-512 engine runs,
    /// else ONNX Runtime when installed, else the native kernels (candle on GPUs).
    backends: Choice,
}

#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// Probability above which a pixel is lung (default 0.5)
    #[serde(default = "half")]
    #[schemars(range(min = 0.05, max = 0.95))]
    threshold: f32,
}

fn half() -> f32 {
    0.5
}

impl SegmentLungs {
    /// The tool on the pool's devices, its backend chosen per machine.
    pub fn new(store: Arc<ImageStore>, models: Arc<ModelPool>) -> Typed<Self> {
        Self::on_device(store, models, None, None)
    }

    /// The tool with its U-Net on `backend`.
    pub fn with_backend(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        backend: hilum_models::Backend,
    ) -> Typed<Self> {
        Self::on_device(store, models, None, Some(backend))
    }

    /// `pin`: one device for every call; `None`: routed across the pool's devices.
    pub fn on_device(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        pin: Option<Device>,
        backend: Option<hilum_models::Backend>,
    ) -> Typed<Self> {
        let backends = Ok(backend.map(BackendChoice::every).unwrap_or_default());
        Self::with_choice(store, models, pin, backends)
    }

    /// `backends`: over the models' settings (a command's flags).
    pub(crate) fn with_choice(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        pin: Option<Device>,
        backends: Choice,
    ) -> Typed<Self> {
        Typed::new(SegmentLungs {
            store,
            models,
            pin,
            backends,
        })
    }
}

/// Measurements of one connected lung region.
#[derive(Clone, Debug, PartialEq)]
pub struct Region {
    pub area_px: usize,
    pub min_x: usize,
    pub max_x: usize,
    pub min_y: usize,
    pub max_y: usize,
    pub centroid_x: f64,
}

/// Connected regions (4-connectivity) of a mask, largest first.
pub fn regions(mask: &[bool], width: usize, height: usize) -> Vec<(Region, Vec<usize>)> {
    let mut out: Vec<(Region, Vec<usize>)> =
        hilum_imaging::regions::components(width, height, |i| mask[i])
            .into_iter()
            .map(|pixels| (region_of(&pixels, width), pixels))
            .collect();
    out.sort_by_key(|r| std::cmp::Reverse(r.0.area_px));
    out
}

fn region_of(pixels: &[usize], width: usize) -> Region {
    let xs = pixels.iter().map(|p| p % width);
    let ys = pixels.iter().map(|p| p / width);
    Region {
        area_px: pixels.len(),
        min_x: xs.clone().min().unwrap_or(0),
        max_x: xs.clone().max().unwrap_or(0),
        min_y: ys.clone().min().unwrap_or(0),
        max_y: ys.max().unwrap_or(0),
        centroid_x: xs.map(|x| x as f64).sum::<f64>() / pixels.len().max(1) as f64,
    }
}

/// Two lungs the mask joins (across the mediastinum, often at the apices or the diaphragm) come
/// out as one region across the image's middle, beside at most a speck. That region is cut at
/// the column of its middle third with the fewest of its pixels, so each lung is measured on
/// its own instead of one lung against a speck.
fn split_joined_lungs(
    mut regs: Vec<(Region, Vec<usize>)>,
    width: usize,
) -> Vec<(Region, Vec<usize>)> {
    let Some((first, _)) = regs.first() else {
        return regs;
    };
    let alone = regs
        .get(1)
        .is_none_or(|(r, _)| r.area_px * 4 < first.area_px);
    let across = first.min_x * 10 < width * 4 && first.max_x * 10 > width * 6;
    if !(alone && across) {
        return regs;
    }
    let (r, pixels) = regs.remove(0);
    let span = r.max_x - r.min_x + 1;
    let (lo, hi) = (r.min_x + span / 3, r.max_x - span / 3);
    let mut per_col = vec![0usize; span];
    for p in &pixels {
        per_col[p % width - r.min_x] += 1;
    }
    let cut = (lo..=hi)
        .min_by_key(|&x| per_col[x - r.min_x])
        .unwrap_or(lo);
    let (a, b): (Vec<usize>, Vec<usize>) = pixels.into_iter().partition(|p| p % width < cut);
    for part in [a, b] {
        if !part.is_empty() {
            regs.push((region_of(&part, width), part));
        }
    }
    regs.sort_by_key(|r| std::cmp::Reverse(r.0.area_px));
    regs
}

fn lung_json(r: &Region, spacing: Option<(f64, f64)>) -> Value {
    let h = r.max_y - r.min_y + 1;
    let w = r.max_x - r.min_x + 1;
    let mut v = json!({
        "area_px": r.area_px,
        "height_px": h,
        "width_px": w,
        "bbox": [r.min_x, r.min_y, w, h],
    });
    if let Some((row_mm, col_mm)) = spacing {
        v["area_cm2"] = json!(round2(r.area_px as f64 * row_mm * col_mm / 100.0));
        v["height_cm"] = json!(round2(h as f64 * row_mm / 10.0));
        v["width_cm"] = json!(round2(w as f64 * col_mm / 10.0));
    }
    v
}

fn encode_png(img: image::DynamicImage) -> Result<Vec<u8>, ToolError> {
    let mut buf = std::io::Cursor::new(Vec::new());
    img.write_to(&mut buf, image::ImageFormat::Png)
        .map_err(|e| ToolError::Internal(format!("PNG encoding: {e}")))?;
    Ok(buf.into_inner())
}

/// The radiograph in grey with the patient's right lung tinted red and the left blue.
fn overlay(img: &CxrImage, right: &[usize], left: &[usize]) -> Result<Vec<u8>, ToolError> {
    let (w, h) = (img.width as usize, img.height as usize);
    let scale = 255.0 / img.max_value().max(1.0);
    let mut rgb: Vec<u8> = img
        .pixels
        .iter()
        .flat_map(|&v| {
            let g = (v * scale).round().clamp(0.0, 255.0) as u8;
            [g, g, g]
        })
        .collect();
    let tint = |rgb: &mut [u8], pixels: &[usize], color: [u8; 3]| {
        for &p in pixels {
            for c in 0..3 {
                let v = &mut rgb[p * 3 + c];
                *v = ((*v as u16 * 3 + color[c] as u16 * 2) / 5) as u8;
            }
        }
    };
    tint(&mut rgb, right, [255, 60, 60]);
    tint(&mut rgb, left, [60, 120, 255]);
    let buf = image::RgbImage::from_raw(w as u32, h as u32, rgb)
        .ok_or_else(|| ToolError::Internal("overlay buffer size".into()))?;
    let mut out = image::DynamicImage::ImageRgb8(buf);
    if img.width.max(img.height) > OVERLAY_MAX_SIDE {
        out = out.resize(
            OVERLAY_MAX_SIDE,
            OVERLAY_MAX_SIDE,
            image::imageops::FilterType::Triangle,
        );
    }
    encode_png(out)
}

impl crate::BuildTool for SegmentLungs {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(SegmentLungs::with_choice(
            deps.images.clone(),
            deps.models.clone(),
            None,
            deps.settings.backends.clone(),
        ))
    }
}

#[async_trait]
impl TypedTool for SegmentLungs {
    type Args = Args;
    const NAME: &'static str = "segment_lungs";

    fn description(&self) -> String {
        "Segments both lung fields on a frontal (PA/AP) chest radiograph with a \
         trained U-Net. Returns per-lung area (pixels, and cm² when the pixel spacing is \
         known), lung heights and widths, the left/right area ratio and the lung fraction of \
         the image, plus a mask and an overlay. Right/left follow the radiological \
         convention: the patient's right lung is on the image's left. Not meaningful on \
         lateral views."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            models: &["lung-unet"],
            ..Requirements::NONE
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        vec![Capability::new(&crate::topics::LUNG_SIZE, &[])]
    }

    fn state(&self, _capability: &Capability, out: &ToolOutput) -> Option<String> {
        lung_size_statement(&out.data)
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let (store, image_id) = (self.store.clone(), args.image.clone());
        let id = args.image.0;
        let threshold = args.threshold;
        let (w, h) = (img.width as usize, img.height as usize);
        let ((mask, infer_ms, installed, backend, t0), fallback) = run_model(
            &self.models,
            MODEL_ID,
            self.pin,
            &choice(&self.backends)?,
            move |p: Placed<'_, LungSegmenter>, installed| {
                // Latency counts from when the device was ours, not from the queue.
                let t0 = p.since;
                let t = Instant::now();
                let x = image_id.prepared(&store, &p.model.recipe())?;
                let prob = p.model.run(&x)?;
                let ms = (t.elapsed() + p.load).as_secs_f64() * 1e3;
                let size = p.model.config().input_size;
                let mask = unet::mask_at(&prob, size, w, h, threshold);
                Ok((mask, ms, installed.clone(), p.model.backend(), t0))
            },
        )
        .await?;

        let (w, h) = (img.width as usize, img.height as usize);
        let regs = split_joined_lungs(regions(&mask, w, h), w);
        // The two largest regions are the lungs; specks are ignored in the measurements.
        let mut lungs: Vec<&(Region, Vec<usize>)> = regs
            .iter()
            .take(2)
            .filter(|(r, _)| r.area_px * 50 >= w * h / 100)
            .collect();
        lungs.sort_by(|a, b| a.0.centroid_x.total_cmp(&b.0.centroid_x));
        let spacing = img.meta.pixel_spacing_mm;
        let total_px = mask.iter().filter(|m| **m).count();
        let (right, left) = match lungs.as_slice() {
            [r, l] => (Some(*r), Some(*l)),
            [one] if one.0.centroid_x < w as f64 / 2.0 => (Some(*one), None),
            [one] => (None, Some(*one)),
            _ => (None, None),
        };
        let ratio = match (right, left) {
            (Some(r), Some(l)) => Some(round2(l.0.area_px as f64 / r.0.area_px as f64)),
            _ => None,
        };
        let record = &installed.record;
        let mut data = json!({
            "image": id,
            "width": w,
            "height": h,
            "model": MODEL_ID,
            "model_custom": record.custom,
            "model_sha256": record.sha256,
            "backend": backend,
            "threshold": threshold,
            "lung_fraction": round2(total_px as f64 / (w * h).max(1) as f64 * 100.0) / 100.0,
            "lungs_found": lungs.len(),
            "right_lung": right.map(|r| lung_json(&r.0, spacing)),
            "left_lung": left.map(|l| lung_json(&l.0, spacing)),
            "left_right_area_ratio": ratio,
            "pixel_spacing_mm": spacing,
            "inference_ms": round2(infer_ms),
            "latency_ms": round2(t0.elapsed().as_secs_f64() * 1e3),
            "convention": "right_lung is the patient's right (image left on a PA/AP view)",
        });
        if spacing.is_none() {
            data["note"] = json!("pixel spacing unknown: areas in pixels only");
        }
        if let Some(why) = fallback {
            data["fallback"] = json!(why);
        }

        let mask_png = encode_png(image::DynamicImage::ImageLuma8(
            image::GrayImage::from_raw(
                w as u32,
                h as u32,
                mask.iter().map(|&m| if m { 255 } else { 0 }).collect(),
            )
            .ok_or_else(|| ToolError::Internal("mask buffer size".into()))?,
        ))?;
        let empty = Vec::new();
        let overlay_png = overlay(
            &img,
            right.map_or(&empty, |r| &r.1),
            left.map_or(&empty, |l| &l.1),
        )?;

        let area = |v: Option<&(Region, Vec<usize>)>| match (v, spacing) {
            (Some(r), Some((a, b))) => format!("{:.1} cm²", r.0.area_px as f64 * a * b / 100.0),
            (Some(r), None) => format!("{} px", thousands(r.0.area_px)),
            (None, _) => "not found".into(),
        };
        // With both lungs the comparison alone, in the patient's terms: a small model answers
        // from the first words of an observation, misreads a bare ratio, and copies what it
        // reads into its answer, so the per-side list and ratio (in `data`) would only repeat
        // the comparison's numbers at the cost of prompt and answer tokens.
        let fields = match (right, left) {
            (Some(r), Some(l)) => compare_sides(
                l.0.area_px as f64,
                r.0.area_px as f64,
                &area(left),
                &area(right),
            ),
            _ => format!(
                "{} lung field(s); patient's right {}, left {}",
                lungs.len(),
                area(right),
                area(left)
            ),
        };
        let summary = format!(
            "{id}: {fields}; lungs cover {:.1}% of the image{}",
            total_px as f64 / (w * h).max(1) as f64 * 100.0,
            if record.custom {
                " (custom site checkpoint of lung-unet)"
            } else {
                ""
            }
        );
        Ok(ToolOutput::new(summary, data)
            .with_artifact(Artifact::png("lung_mask.png", "mask", mask_png))
            .with_artifact(Artifact::png("lung_overlay.png", "overlay", overlay_png)))
    }
}

/// The lungs' coverage of the image and both areas, in cm² when the pixel spacing is known,
/// else in pixels with the reason.
fn lung_size_statement(d: &Value) -> Option<String> {
    let fraction = d["lung_fraction"].as_f64()?;
    let area = |side: &Value| -> Option<String> {
        match side["area_cm2"].as_f64() {
            Some(cm2) => Some(format!("{cm2:.1} cm²")),
            None => Some(format!(
                "{} px",
                thousands(side["area_px"].as_u64()? as usize)
            )),
        }
    };
    let sides = match (area(&d["right_lung"]), area(&d["left_lung"])) {
        (Some(r), Some(l)) => format!("; the patient's right lung's area is {r}, the left's {l}"),
        (Some(r), None) => format!("; only the patient's right lung was found ({r})"),
        (None, Some(l)) => format!("; only the patient's left lung was found ({l})"),
        (None, None) => "; no lung field was found".to_string(),
    };
    let unit_note = if d["pixel_spacing_mm"].is_null() {
        " (areas in pixels: the image states no pixel spacing)"
    } else {
        ""
    };
    Some(format!(
        "the lungs cover {:.1}% of the image{sides}{unit_note}",
        fraction * 100.0
    ))
}

/// `686311` → `686,311`.
pub(crate) fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// "the patient's left lung is larger: 686,311 vs 676,398 px, +1.5%" from the two areas (any
/// unit) and their printed forms.
pub(crate) fn compare_sides(left: f64, right: f64, left_text: &str, right_text: &str) -> String {
    if left == right {
        return format!("both lungs have the same area ({left_text})");
    }
    let (side, big, small, big_text, small_text) = if left > right {
        ("left", left, right, left_text, right_text)
    } else {
        ("right", right, left, right_text, left_text)
    };
    let unit_free = |t: &str| {
        t.rsplit_once(' ')
            .map_or(t.to_string(), |(n, _)| n.to_string())
    };
    let unit = big_text.rsplit_once(' ').map_or("", |(_, u)| u);
    format!(
        "the patient's {side} lung is larger: {} vs {} {unit}, +{:.1}%",
        unit_free(big_text),
        unit_free(small_text),
        (big - small) / small.max(f64::MIN_POSITIVE) * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparison_is_in_the_patients_terms() {
        assert_eq!(thousands(686_311), "686,311");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(
            compare_sides(686_311.0, 676_398.0, "686,311 px", "676,398 px"),
            "the patient's left lung is larger: 686,311 vs 676,398 px, +1.5%"
        );
        assert_eq!(
            compare_sides(90.0, 100.0, "90.0 cm²", "100.0 cm²"),
            "the patient's right lung is larger: 100.0 vs 90.0 cm², +11.1%"
        );
        assert!(compare_sides(5.0, 5.0, "5 px", "5 px").starts_with("both lungs"));
    }

    #[test]
    fn joined_lungs_are_cut_at_the_mediastinum() {
        // Two 4-column lungs joined by a one-row bridge at the top, on a 13x6 image, plus a speck.
        let w = 13;
        let mut mask = vec![false; w * 6];
        for y in 0..6 {
            for x in (1..5).chain(7..11) {
                mask[y * w + x] = true;
            }
        }
        mask[5..7].fill(true);
        mask[12] = true;
        let regs = split_joined_lungs(regions(&mask, w, 6), w);
        let big: Vec<_> = regs.iter().filter(|r| r.0.area_px > 1).collect();
        assert_eq!(
            big.len(),
            2,
            "{:?}",
            regs.iter().map(|r| &r.0).collect::<Vec<_>>()
        );
        assert!(big.iter().all(|r| (24..=26).contains(&r.0.area_px)));
        // Two separate lungs are left alone.
        let mut apart = mask.clone();
        apart[5..7].fill(false);
        let regs = split_joined_lungs(regions(&apart, w, 6), w);
        assert_eq!(regs[0].0.area_px, 24);
        assert_eq!(regs[1].0.area_px, 24);
    }

    #[test]
    fn regions_are_separated_and_sorted() {
        // Two blobs: 2x2 at the left, 3x2 at the right of a 7x3 image.
        let w = 7;
        let mut mask = vec![false; w * 3];
        for (x, y) in [
            (0, 0),
            (1, 0),
            (0, 1),
            (1, 1),
            (4, 1),
            (5, 1),
            (6, 1),
            (4, 2),
            (5, 2),
            (6, 2),
        ] {
            mask[y * w + x] = true;
        }
        let r = regions(&mask, w, 3);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].0.area_px, 6);
        assert_eq!(
            (r[0].0.min_x, r[0].0.max_x, r[0].0.min_y, r[0].0.max_y),
            (4, 6, 1, 2)
        );
        assert_eq!(r[1].0.area_px, 4);
        assert!((r[1].0.centroid_x - 0.5).abs() < 1e-9);
    }

    #[test]
    fn lung_json_converts_with_spacing() {
        let r = Region {
            area_px: 10_000,
            min_x: 0,
            max_x: 99,
            min_y: 0,
            max_y: 199,
            centroid_x: 50.0,
        };
        let v = lung_json(&r, Some((0.2, 0.1)));
        assert_eq!(v["area_cm2"], json!(2.0)); // 10_000 * 0.02 mm² = 200 mm²
        assert_eq!(v["height_cm"], json!(4.0));
        assert_eq!(v["width_cm"], json!(1.0));
        assert!(lung_json(&r, None).get("area_cm2").is_none());
    }
}
