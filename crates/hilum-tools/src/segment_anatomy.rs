//! `segment_anatomy`: the 14 ChestX-Det structures with torchxrayvision's PSPNet; per structure a
//! mask at the original resolution and its measurements, plus one overlay with a legend.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{
    Artifact, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::{CxrImage, ImageStore, MaskLayer, Overlay, Prepared, Rgb};
use hilum_models::pspnet::{AnatomySegmenter, TARGETS};
use hilum_models::runner::Runner;
use hilum_models::{BackendChoice, Device, ModelError, ModelPool, Placed};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::common::{choice, round2, run_model, Choice, ImageId};
use crate::common::{ChestMasks, MIN_SIDE};

/// The ChestX-Det PSPNet: 14 anatomical structures.
pub const MODEL_ID: &str = "chestx-det-pspnet";
const OVERLAY_MAX_SIDE: u32 = 1024;
const THRESHOLD: f32 = 0.5;

/// One structure's probability map at the original resolution.
pub struct StructureMap {
    /// Index of the structure in the model's outputs.
    pub index: usize,
    /// Its name.
    pub name: &'static str,
    /// Probability per pixel, row-major at the image's size.
    pub prob: Vec<f32>,
}

/// `name` (case, `_`/`-` and spaces ignored) to its output index.
pub fn structure_index(name: &str) -> Option<usize> {
    let norm = |s: &str| {
        s.chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase()
    };
    let n = norm(name);
    TARGETS.iter().position(|t| norm(t) == n)
}

/// Output indices of the `structures` argument (all 14 when absent); unknown names fail
/// listing the valid ones.
pub fn parse_structures(names: Option<&[String]>) -> Result<Vec<usize>, ToolError> {
    let Some(list) = names else {
        return Ok((0..TARGETS.len()).collect());
    };
    let mut out = Vec::new();
    for name in list {
        let i = structure_index(name).ok_or_else(|| {
            ToolError::InvalidArguments(format!(
                "unknown structure `{name}`; valid structures: {}",
                TARGETS.join(", ")
            ))
        })?;
        if !out.contains(&i) {
            out.push(i);
        }
    }
    if out.is_empty() {
        return Err(ToolError::InvalidArguments(format!(
            "`structures` is empty; leave it out for all, or choose from: {}",
            TARGETS.join(", ")
        )));
    }
    Ok(out)
}

/// Runs the network on the whole image (its input as the store prepared it, shared with
/// `measure_chest`) and brings the chosen maps back to the image's `(width, height)`. Its errors
/// are the model's, so a device failure in the pass can move the call.
pub fn run(
    model: &AnatomySegmenter,
    input: &Prepared,
    which: &[usize],
) -> Result<Vec<StructureMap>, ModelError> {
    let (w, h) = (
        input.geometry.src_width as usize,
        input.geometry.src_height as usize,
    );
    let s = model.config().input_size;
    let probs = model.run(input)?;
    which
        .iter()
        .map(|&i| {
            let p = probs.get(i).ok_or_else(|| ModelError::WeightsMismatch {
                what: format!("{MODEL_ID}'s output"),
                architecture: "pspnet".into(),
                details: format!("it has no channel {i} ({} maps)", probs.len()),
            })?;
            Ok(StructureMap {
                index: i,
                name: TARGETS[i],
                prob: hilum_models::unet::resize_bilinear(p, s, s, 1, w, h),
            })
        })
        .collect()
}

/// The masks `measure_chest` needs: both lungs, heart and mediastinum.
pub fn anatomy_masks(model: &AnatomySegmenter, input: &Prepared) -> Result<ChestMasks, ModelError> {
    let idx = |n: &str| structure_index(n).unwrap_or(0);
    let which = [
        idx("Left Lung"),
        idx("Right Lung"),
        idx("Heart"),
        idx("Mediastinum"),
    ];
    let maps = run(model, input, &which)?;
    let mask = |m: &StructureMap| m.prob.iter().map(|&p| p > THRESHOLD).collect::<Vec<bool>>();
    let lungs = mask(&maps[0])
        .into_iter()
        .zip(mask(&maps[1]))
        .map(|(a, b)| a || b)
        .collect();
    Ok(ChestMasks {
        width: input.geometry.src_width as usize,
        height: input.geometry.src_height as usize,
        lungs,
        heart: Some(mask(&maps[2])),
        mediastinum: Some(mask(&maps[3])),
    })
}

/// Measurements of one structure: area, centroid, bbox, size, mean intensity, confidence.
pub fn describe(m: &StructureMap, img: &CxrImage) -> Value {
    let w = img.width as usize;
    let spacing = img.meta.pixel_spacing_mm;
    let (mut n, mut sx, mut sy, mut si, mut sp) = (0usize, 0f64, 0f64, 0f64, 0f64);
    let (mut x0, mut y0, mut x1, mut y1) = (usize::MAX, usize::MAX, 0, 0);
    for (i, &p) in m.prob.iter().enumerate() {
        if p > THRESHOLD {
            let (x, y) = (i % w, i / w);
            n += 1;
            sx += x as f64;
            sy += y as f64;
            si += img.pixels.get(i).copied().unwrap_or(0.0) as f64;
            sp += p as f64;
            (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x), y1.max(y));
        }
    }
    if n == 0 {
        return json!({"structure": m.name, "found": false, "area_px": 0});
    }
    let (bw, bh) = (x1 - x0 + 1, y1 - y0 + 1);
    let mut v = json!({
        "structure": m.name,
        "found": true,
        "area_px": n,
        "centroid": [round2(sx / n as f64), round2(sy / n as f64)],
        "bbox": [x0, y0, bw, bh],
        "width_px": bw,
        "height_px": bh,
        // Fraction of the image's full range, so 8- and 16-bit images compare.
        "mean_intensity": round2(si / n as f64 / img.max_value().max(1.0) as f64 * 100.0) / 100.0,
        "confidence": round2(sp / n as f64 * 100.0) / 100.0,
    });
    if let Some((row, col)) = spacing {
        v["area_cm2"] = json!(round2(n as f64 * row * col / 100.0));
        v["width_cm"] = json!(round2(bw as f64 * col / 10.0));
        v["height_cm"] = json!(round2(bh as f64 * row / 10.0));
    }
    v
}

/// One PNG with every structure's mask and a legend.
pub fn overlay_png(img: &CxrImage, maps: &[StructureMap]) -> Result<Vec<u8>, ToolError> {
    let ov = Overlay {
        masks: maps
            .iter()
            .map(|m| MaskLayer {
                label: m.name.to_string(),
                width: img.width,
                height: img.height,
                data: m
                    .prob
                    .iter()
                    .map(|&p| if p > THRESHOLD { 1.0 } else { 0.0 })
                    .collect(),
                color: Some(Rgb::for_label(m.name, m.index)),
                alpha: 0.3,
            })
            .collect(),
        max_side: Some(OVERLAY_MAX_SIDE),
        legend: true,
        ..Default::default()
    };
    ov.render_png(img)
        .map_err(|e| ToolError::Internal(format!("overlay: {e}")))
}

/// The structure's mask (probability above the threshold) as a grey PNG of `w` x `h`.
pub fn mask_png(m: &StructureMap, w: u32, h: u32) -> Result<Vec<u8>, ToolError> {
    let px: Vec<u8> = m
        .prob
        .iter()
        .map(|&p| if p > THRESHOLD { 255 } else { 0 })
        .collect();
    hilum_imaging::encode_png(w, h, &px, 1)
        .map_err(|e| ToolError::Internal(format!("mask PNG: {e}")))
}

/// The `segment_anatomy` tool: masks, areas and boxes of the chest structures.
pub struct SegmentAnatomy {
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    /// `None`: each call routed across the pool's devices.
    pin: Option<Device>,
    /// The PSPNet's backend over the models' settings.
    backends: Choice,
}

// The arguments of `segment_anatomy` as the model sends them.
// (A plain comment and no doc lint: a doc comment would become the schema's description.)
#[allow(missing_docs)]
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// Subset of structures (default: all 14)
    #[serde(default)]
    #[schemars(schema_with = "structure_names")]
    structures: Option<Vec<String>>,
}

/// A list of the model's structure names (the names live in `pspnet::TARGETS`).
fn structure_names(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "array", "items": {"type": "string", "enum": TARGETS}})
}

impl SegmentAnatomy {
    /// The tool, ready to register (its schema generated from its arguments' type).
    pub fn new(store: Arc<ImageStore>, models: Arc<ModelPool>) -> Typed<Self> {
        Self::on_device(store, models, None)
    }

    /// `pin`: one device for every call; `None`: routed across the pool's devices.
    pub fn on_device(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        pin: Option<Device>,
    ) -> Typed<Self> {
        Typed::new(SegmentAnatomy {
            store,
            models,
            pin,
            backends: Ok(BackendChoice::default()),
        })
    }
}

impl crate::BuildTool for SegmentAnatomy {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(Typed::new(SegmentAnatomy {
            store: deps.images.clone(),
            models: deps.models.clone(),
            pin: None,
            backends: deps.settings.backends.clone(),
        }))
    }
}

#[async_trait]
impl TypedTool for SegmentAnatomy {
    type Args = Args;
    const NAME: &'static str = "segment_anatomy";

    fn description(&self) -> String {
        format!(
            "Segments anatomical structures on a frontal chest radiograph with the \
             ChestX-Det PSPNet: {}. Per structure: mask at the original resolution, area \
             (px, and cm² when the pixel spacing is known), centroid, bounding box, \
             width/height, mean intensity and a confidence (mean probability inside the \
             mask); plus one overlay with a legend. Use it to locate a finding relative \
             to anatomy or before measuring; for the cardiothoracic ratio use \
             measure_chest. Left/Right are the patient's.",
            TARGETS.join(", ")
        )
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            models: &["chestx-det-pspnet"],
            ..Requirements::NONE
        }
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let (store, image_id) = (self.store.clone(), args.image.clone());
        let id = args.image.0;
        let which = parse_structures(args.structures.as_deref())?;
        if img.width < MIN_SIDE || img.height < MIN_SIDE {
            return Err(ToolError::Unprocessable(format!(
                "{id} is {}x{} px: anatomy segmentation needs at least {MIN_SIDE} px per side",
                img.width, img.height
            )));
        }
        let ((maps, t0, backend), fallback) = run_model(
            &self.models,
            MODEL_ID,
            self.pin,
            &choice(&self.backends)?,
            move |p: Placed<'_, AnatomySegmenter>, _| {
                let input = image_id.prepared(&store, &p.model.recipe())?;
                let maps = run(p.model, &input, &which)?;
                Ok((maps, p.since, p.model.backend()))
            },
        )
        .await?;
        let latency = t0.elapsed().as_secs_f64() * 1e3;
        let mut out = assemble(&id, &img, &maps, latency)?;
        out.data["backend"] = json!(backend);
        if let Some(why) = fallback {
            out.data["fallback"] = json!(why);
        }
        Ok(out)
    }
}

/// Summary, data and artifacts from the maps.
pub fn assemble(
    id: &str,
    img: &CxrImage,
    maps: &[StructureMap],
    latency_ms: f64,
) -> Result<ToolOutput, ToolError> {
    let structures: Vec<Value> = maps.iter().map(|m| describe(m, img)).collect();
    let spacing = img.meta.pixel_spacing_mm;
    let view = img.meta.view_position.as_deref().unwrap_or("unknown");
    let mut notes = vec![];
    if matches!(
        view.to_ascii_uppercase().as_str(),
        "LL" | "RL" | "LAT" | "LATERAL"
    ) {
        notes.push("lateral view: the model was trained on frontal views; masks are unreliable");
    }
    if spacing.is_none() {
        notes.push("pixel spacing unknown: areas and sizes in pixels only");
    }
    let found: Vec<String> = structures
        .iter()
        .filter(|s| s["found"] == json!(true))
        .map(|s| {
            let area = match s.get("area_cm2") {
                Some(a) => format!("{a} cm²"),
                None => format!("{} px", s["area_px"]),
            };
            format!(
                "{} {area} (conf {})",
                s["structure"].as_str().unwrap_or(""),
                s["confidence"]
            )
        })
        .collect();
    let missing: Vec<&str> = maps
        .iter()
        .zip(&structures)
        .filter(|(_, s)| s["found"] != json!(true))
        .map(|(m, _)| m.name)
        .collect();
    let summary = format!(
        "{id}: {} of {} structures found: {}{}{}",
        found.len(),
        maps.len(),
        found.join("; "),
        if missing.is_empty() {
            String::new()
        } else {
            format!(". Not found: {}", missing.join(", "))
        },
        if notes.is_empty() {
            String::new()
        } else {
            format!(". Notes: {}", notes.join("; "))
        }
    );
    let data = json!({
        "image": id,
        "width": img.width,
        "height": img.height,
        "model": MODEL_ID,
        "threshold": THRESHOLD,
        "structures": structures,
        "areas": if spacing.is_some() { "px and cm² (pixel spacing from the file)" } else { "px only (pixel spacing unknown)" },
        "pixel_spacing_mm": spacing,
        "view": view,
        "notes": notes,
        "convention": "Left/Right are the patient's (Right is on the image's left on PA/AP)",
        "latency_ms": round2(latency_ms),
    });
    let mut out = ToolOutput::new(summary, data).with_artifact(Artifact::png(
        "anatomy_overlay.png",
        "overlay",
        overlay_png(img, maps)?,
    ));
    for m in maps {
        let name = format!("{}_mask.png", m.name.to_ascii_lowercase().replace(' ', "_"));
        out = out.with_artifact(Artifact::png(
            name,
            "mask",
            mask_png(m, img.width, img.height)?,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structure_names_are_forgiving_but_unknown_ones_fail() {
        assert_eq!(structure_index("heart"), Some(8));
        assert_eq!(structure_index("left_lung"), Some(4));
        assert_eq!(structure_index("Right Hilus Pulmonis"), Some(7));
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ok = parse_structures(Some(&names(&["Heart", "heart", "spine"]))).unwrap();
        assert_eq!(ok, vec![8, 13]);
        let e = parse_structures(Some(&names(&["liver"]))).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("liver") && msg.contains("Facies Diaphragmatica"),
            "{msg}"
        );
        assert!(parse_structures(Some(&[])).is_err());
        assert_eq!(parse_structures(None).unwrap().len(), 14);
    }
}
