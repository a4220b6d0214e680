//! `measure_chest`: cardiothoracic ratio, mediastinal width and lung area ratio from masks, with
//! the measured lines drawn on an overlay. The geometry ([`measure`]) is pure and works on any
//! masks; the tool gets them from the anatomy PSPNet when installed, else from the lung U-Net.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use hilum_agent::{
    Artifact, Capability, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::{Box2d, CxrImage, ImageStore, MaskLayer, Overlay, Rgb};
use hilum_models::pspnet::AnatomySegmenter;
use hilum_models::runner::Runner;
use hilum_models::unet::{self, LungSegmenter};
use hilum_models::{Backend, BackendChoice, Device, ModelPool, Placed};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::common::{choice, run_model, Choice, Fail, ImageId};
pub use crate::common::{ChestMasks, MIN_SIDE};
use crate::segment_lungs::regions;

/// The anatomy model that gives the heart and mediastinum.
pub const ANATOMY_MODEL_ID: &str = "chestx-det-pspnet";
/// The lung model that gives the lung fields.
pub const LUNG_MODEL_ID: &str = "lung-unet";
/// A lung region smaller than this fraction of the image is a speck, not a lung.
const MIN_LUNG_FRACTION: f64 = 0.005;
const OVERLAY_MAX_SIDE: u32 = 1024;

/// A horizontal segment on row `y` from `x0` to `x1`, both inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Span {
    /// Row.
    pub y: usize,
    /// First column.
    pub x0: usize,
    /// Last column.
    pub x1: usize,
}

impl Span {
    /// Columns covered, both ends included.
    pub fn width(&self) -> usize {
        self.x1 + 1 - self.x0
    }
}

/// What [`measure`] found; `None` fields could not be measured (`missing` says why).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ChestMeasurements {
    /// Widest row of the heart.
    pub heart: Option<Span>,
    /// Widest row between the outer edges of the two lung fields.
    pub thorax: Option<Span>,
    /// Cardiothoracic ratio: heart width over thorax width.
    pub ctr: Option<f64>,
    /// Widest row of the mediastinum.
    pub mediastinum: Option<Span>,
    /// How the mediastinum row was found (from its own mask or from the lungs).
    pub mediastinum_method: Option<&'static str>,
    /// The patient's right lung is on the image's left.
    pub right_lung_px: Option<usize>,
    /// Area of the patient's left lung, in pixels.
    pub left_lung_px: Option<usize>,
    /// Left lung area over right lung area.
    pub left_right_area_ratio: Option<f64>,
    /// Why each absent measurement could not be made.
    pub missing: Vec<String>,
}

/// (min x, max x) of a row.
type Extent = (usize, usize);

/// Per row, the (min x, max x) of `pixels`.
fn row_extents(pixels: &[usize], width: usize, height: usize) -> Vec<Option<(usize, usize)>> {
    let mut rows: Vec<Option<(usize, usize)>> = vec![None; height];
    for &p in pixels {
        let (x, y) = (p % width, p / width);
        let r = &mut rows[y];
        *r = Some(match *r {
            Some((a, b)) => (a.min(x), b.max(x)),
            None => (x, x),
        });
    }
    rows
}

/// The widest span of `rows` within `range`; ties go to the lowest row.
fn widest(rows: impl Iterator<Item = (usize, Option<(usize, usize)>)>) -> Option<Span> {
    let mut best: Option<Span> = None;
    for (y, r) in rows {
        if let Some((x0, x1)) = r {
            let s = Span { y, x0, x1 };
            if best.is_none_or(|b| s.width() >= b.width()) {
                best = Some(s);
            }
        }
    }
    best
}

/// Pixels of the largest connected region of `mask` (specks and fragments are dropped).
fn largest(mask: &[bool], width: usize, height: usize) -> Option<Vec<usize>> {
    regions(mask, width, height)
        .into_iter()
        .next()
        .map(|(_, p)| p)
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// Cardiothoracic ratio (widest heart row / widest row between the lungs' outer edges),
/// superior mediastinal width and the left/right lung area ratio, to the pixel.
pub fn measure(m: &ChestMasks) -> ChestMeasurements {
    let (w, h) = (m.width, m.height);
    let mut out = ChestMeasurements::default();
    if w == 0 || h == 0 || m.lungs.len() != w * h {
        out.missing.push("lung mask has the wrong size".into());
        return out;
    }
    let min_area = ((w * h) as f64 * MIN_LUNG_FRACTION) as usize;
    let mut lungs: Vec<_> = regions(&m.lungs, w, h)
        .into_iter()
        .take(2)
        .filter(|(r, _)| r.area_px >= min_area.max(1))
        .collect();
    lungs.sort_by(|a, b| a.0.centroid_x.total_cmp(&b.0.centroid_x));

    let heart_px = m
        .heart
        .as_ref()
        .filter(|hm| hm.len() == w * h)
        .and_then(|hm| largest(hm, w, h));
    if let Some(px) = &heart_px {
        out.heart = widest(row_extents(px, w, h).into_iter().enumerate());
    } else {
        out.missing.push(if m.heart.is_some() {
            "heart: the heart mask is empty".into()
        } else {
            "heart: no heart mask (needs the anatomy model chestx-det-pspnet)".into()
        });
    }

    let (right, left) = match lungs.as_slice() {
        [r, l] => (r, l),
        _ => {
            out.missing.push(format!(
                "thoracic width and lung area ratio: {} lung field(s) found, two are needed",
                lungs.len()
            ));
            return out;
        }
    };
    out.right_lung_px = Some(right.0.area_px);
    out.left_lung_px = Some(left.0.area_px);
    out.left_right_area_ratio = Some(round3(left.0.area_px as f64 / right.0.area_px as f64));
    let rr = row_extents(&right.1, w, h);
    let lr = row_extents(&left.1, w, h);
    // Rows where both lungs are present: outer edges give the internal thoracic width.
    let both: Vec<(usize, Extent, Extent)> =
        (0..h).filter_map(|y| Some((y, rr[y]?, lr[y]?))).collect();
    out.thorax = widest(both.iter().map(|&(y, r, l)| (y, Some((r.0, l.1)))));
    if out.thorax.is_none() {
        out.missing
            .push("thoracic width: the lung fields share no row".into());
    }
    if let (Some(hs), Some(ts)) = (out.heart, out.thorax) {
        out.ctr = Some(round3(hs.width() as f64 / ts.width() as f64));
    }

    let heart_top = heart_px
        .as_ref()
        .and_then(|px| px.iter().map(|p| p / w).min());
    let med_px = m
        .mediastinum
        .as_ref()
        .filter(|mm| mm.len() == w * h)
        .and_then(|mm| largest(mm, w, h));
    if let Some(px) = med_px {
        // The superior mediastinum: rows above the heart (else the upper half of the mask).
        let rows = row_extents(&px, w, h);
        let top = px.iter().map(|p| p / w).min().unwrap_or(0);
        let bottom = px.iter().map(|p| p / w).max().unwrap_or(0);
        let limit = match heart_top {
            Some(t) if t > top => t,
            _ => top + (bottom - top) / 2 + 1,
        };
        out.mediastinum = widest(rows.into_iter().enumerate().take(limit));
        out.mediastinum_method = Some("mediastinum mask, widest row above the heart");
    } else if let (Some(first), Some(last)) = (both.first(), both.last()) {
        // Approximation: the gap between the lungs' inner edges from 1/6 to 1/3 of the way
        // down the lung fields (below the apices, above the heart).
        let span = last.0 - first.0;
        let (a, b) = (first.0 + span / 6, first.0 + span / 3);
        out.mediastinum = widest(
            both.iter()
                .filter(|(y, r, l)| (a..=b).contains(y) && r.1 + 1 < l.0)
                .map(|&(y, r, l)| (y, Some((r.1 + 1, l.0 - 1)))),
        );
        out.mediastinum_method =
            Some("gap between the lungs' inner edges in the upper third (approximation)");
    }
    if out.mediastinum.is_none() {
        out.missing
            .push("mediastinal width: no mediastinum found".into());
    }
    out
}

/// The view as far as it matters here, from the argument or the DICOM header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum View {
    Pa,
    Ap,
    Lateral,
    Unknown,
}

fn parse_view(s: &str) -> View {
    match s.trim().to_ascii_uppercase().as_str() {
        "PA" => View::Pa,
        "AP" | "AP SUPINE" | "SUPINE" => View::Ap,
        "LL" | "RL" | "LAT" | "LATERAL" | "LLD" | "RLD" => View::Lateral,
        _ => View::Unknown,
    }
}

/// Lung mask at the original resolution from the lung U-Net, on the input `segment_lungs`
/// shares through the store.
fn lung_unet_mask(
    model: &LungSegmenter,
    store: &ImageStore,
    id: &ImageId,
    (w, h): (usize, usize),
) -> Result<Vec<bool>, Fail> {
    let x = id.prepared(store, &model.recipe())?;
    let prob = model.run(&x)?;
    Ok(unet::mask_at(&prob, model.config().input_size, w, h, 0.5))
}

/// The overlay: masks, then the measured lines labelled with their widths.
pub fn overlay_png(
    img: &CxrImage,
    masks: &ChestMasks,
    r: &ChestMeasurements,
) -> Result<Vec<u8>, ToolError> {
    let layer = |label: &str, m: &[bool], color: Rgb| MaskLayer {
        label: label.into(),
        width: masks.width as u32,
        height: masks.height as u32,
        data: m.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect(),
        color: Some(color),
        alpha: 0.2,
    };
    let mut ov = Overlay {
        max_side: Some(OVERLAY_MAX_SIDE),
        legend: true,
        ..Default::default()
    };
    ov.masks
        .push(layer("lungs", &masks.lungs, Rgb(0, 200, 200)));
    if let Some(hm) = &masks.heart {
        ov.masks.push(layer("heart", hm, Rgb(234, 67, 53)));
    }
    if let Some(mm) = &masks.mediastinum {
        ov.masks.push(layer("mediastinum", mm, Rgb(255, 64, 255)));
    }
    let line = |s: &Span, label: String, color: Rgb| Box2d {
        x: s.x0 as f64,
        y: s.y as f64,
        w: s.width() as f64,
        h: 0.0,
        label,
        score: None,
        color: Some(color),
    };
    if let Some(s) = &r.thorax {
        ov.boxes.push(line(
            s,
            format!("thorax {} px", s.width()),
            Rgb(255, 215, 0),
        ));
    }
    if let Some(s) = &r.heart {
        ov.boxes
            .push(line(s, format!("heart {} px", s.width()), Rgb(255, 64, 64)));
    }
    if let Some(s) = &r.mediastinum {
        ov.boxes.push(line(
            s,
            format!("mediastinum {} px", s.width()),
            Rgb(255, 64, 255),
        ));
    }
    ov.render_png(img)
        .map_err(|e| ToolError::Internal(format!("overlay: {e}")))
}

fn mask_png(m: &[bool], w: usize, h: usize) -> Result<Vec<u8>, ToolError> {
    let px: Vec<u8> = m.iter().map(|&b| if b { 255 } else { 0 }).collect();
    hilum_imaging::encode_png(w as u32, h as u32, &px, 1)
        .map_err(|e| ToolError::Internal(format!("mask PNG: {e}")))
}

/// The `measure_chest` tool: cardiothoracic ratio, mediastinal width and lung areas from
/// the segmentation masks.
pub struct MeasureChest {
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    /// `None`: each call routed across the pool's devices.
    pin: Option<Device>,
    /// The models' backends over the models' settings (the same as `segment_lungs` and
    /// `segment_anatomy` use).
    backends: Choice,
}

/// The projection as the model may state it.
// No doc lint on the variants: a doc comment on one would turn the schema's `enum` of names
// into a `oneOf` of described subschemas.
#[allow(missing_docs)]
#[derive(Clone, Copy, Debug, Deserialize, JsonSchema)]
pub enum ViewArg {
    #[serde(rename = "PA")]
    Pa,
    #[serde(rename = "AP")]
    Ap,
    #[serde(rename = "lateral")]
    Lateral,
}

// The arguments of `measure_chest` as the model sends them.
// (A plain comment and no doc lint: a doc comment would become the schema's description.)
#[allow(missing_docs)]
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// Projection, when known and not in the DICOM header
    #[serde(default)]
    view: Option<ViewArg>,
    /// True for a child: adult CTR thresholds do not apply
    #[serde(default)]
    pediatric: bool,
}

impl MeasureChest {
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
        Typed::new(MeasureChest {
            store,
            models,
            pin,
            backends: Ok(BackendChoice::default()),
        })
    }
}

impl crate::BuildTool for MeasureChest {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(Typed::new(MeasureChest {
            store: deps.images.clone(),
            models: deps.models.clone(),
            pin: None,
            backends: deps.settings.backends.clone(),
        }))
    }
}

#[async_trait]
impl TypedTool for MeasureChest {
    type Args = Args;
    const NAME: &'static str = "measure_chest";

    fn description(&self) -> String {
        "Measures a frontal chest radiograph: cardiothoracic ratio (widest \
         heart width / widest internal thoracic width between the lungs' outer edges; \
         > 0.50 on a PA view suggests cardiomegaly), superior mediastinal width and the \
         left/right lung area ratio, with the measured lines drawn on an overlay. Use it \
         for 'is the heart enlarged?', 'is the mediastinum widened?'. Says which masks it \
         used and what it could not measure; on AP views the CTR overestimates the heart, \
         lateral views are refused."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            models: &["chestx-det-pspnet", "lung-unet"],
            ..Requirements::NONE
        }
    }

    fn capabilities(&self) -> Vec<Capability> {
        use crate::topics::{CARDIOMEGALY, CTR, LUNG_SIZE, MEDIASTINUM};
        vec![
            Capability::new(&LUNG_SIZE, &[]),
            Capability::new(&CTR, &[ANATOMY_MODEL_ID]),
            Capability::new(&CARDIOMEGALY, &[ANATOMY_MODEL_ID]),
            Capability::new(&MEDIASTINUM, &[ANATOMY_MODEL_ID]),
        ]
    }

    fn state(&self, capability: &Capability, out: &ToolOutput) -> Option<String> {
        let d = &out.data;
        match capability.topic.id {
            "lung_size" => {
                let (r, l) = (d["right_lung_px"].as_u64()?, d["left_lung_px"].as_u64()?);
                let image = d["width"].as_u64()? * d["height"].as_u64()?;
                let t = |n: u64| crate::segment_lungs::thousands(n as usize);
                Some(format!(
                    "the lungs cover {:.1}% of the image; the patient's right lung's area is {} px, the left's {} px",
                    (r + l) as f64 / image.max(1) as f64 * 100.0,
                    t(r),
                    t(l)
                ))
            }
            "ctr" | "cardiomegaly" => {
                let ctr = d["cardiothoracic_ratio"].as_f64()?;
                let why = d["ctr_interpretation"].as_str().unwrap_or("");
                Some(format!(
                    "the cardiothoracic ratio is {ctr:.2} (threshold 0.50 on a PA view: {why})"
                ))
            }
            "mediastinum" => {
                let px = d["mediastinal_width_px"].as_u64()?;
                Some(format!("the superior mediastinum measures {px} px wide"))
            }
            _ => None,
        }
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let view = checked_view(&args.image.0, &img, args.view)?;
        let masks = self.masks(&img, &args.image).await?;
        let r = measure(&masks.masks);
        let notes = Notes::new(view, args.pediatric, masks.anatomy);
        let data = report_data(&args.image.0, &img, &masks, &r, &notes);
        let summary = summary_text(&args.image.0, &masks, &r, &notes);
        outputs(summary, data, &img, &masks.masks, &r)
    }
}

/// The view the measurement is read for (the argument, else the DICOM header); lateral views
/// and images too small to measure are refused.
fn checked_view(id: &str, img: &CxrImage, arg: Option<ViewArg>) -> Result<View, ToolError> {
    if img.width < MIN_SIDE || img.height < MIN_SIDE {
        return Err(ToolError::Unprocessable(format!(
            "{id} is {}x{} px: chest measurements need at least {MIN_SIDE} px per side",
            img.width, img.height
        )));
    }
    let view = match arg {
        Some(ViewArg::Pa) => View::Pa,
        Some(ViewArg::Ap) => View::Ap,
        Some(ViewArg::Lateral) => View::Lateral,
        None => img
            .meta
            .view_position
            .as_deref()
            .map_or(View::Unknown, parse_view),
    };
    if view == View::Lateral {
        return Err(ToolError::Unprocessable(format!(
            "{id} is a lateral view: the cardiothoracic ratio and lung widths are defined on \
             frontal (PA/AP) views only"
        )));
    }
    Ok(view)
}

/// The masks one measurement is made on and where they came from.
struct Masks {
    masks: ChestMasks,
    /// "anatomy model chestx-det-pspnet" or "lung U-Net lung-unet (no heart mask)".
    source: String,
    /// Whether the anatomy model gave them (heart and mediastinum too).
    anatomy: bool,
    /// The backend that ran the model, and why it was a fallback if it was.
    backend: Backend,
    fallback: Option<String>,
    /// When the device became the call's.
    since: Instant,
}

impl MeasureChest {
    /// The anatomy model's masks (heart, lungs, mediastinum) when it is installed, else the
    /// lung U-Net's (lungs only), each on its model's backend.
    async fn masks(&self, img: &Arc<CxrImage>, image_id: &ImageId) -> Result<Masks, ToolError> {
        let reg = self.models.registry();
        let anatomy = reg.installed(ANATOMY_MODEL_ID).is_ok();
        if !anatomy && reg.installed(LUNG_MODEL_ID).is_err() {
            return Err(ToolError::ModelMissing {
                model: format!("{ANATOMY_MODEL_ID} (or {LUNG_MODEL_ID} for lungs only)"),
                fix: format!(
                    "hilum models fetch {ANATOMY_MODEL_ID}` or `hilum models import {LUNG_MODEL_ID} PATH"
                ),
            });
        }
        let over = choice(&self.backends)?;
        let (store, id) = (self.store.clone(), image_id.clone());
        let ((masks, backend, since), fallback) = if anatomy {
            let work = move |p: Placed<'_, AnatomySegmenter>, _: &_| {
                let input = id.prepared(&store, &p.model.recipe())?;
                let a = crate::segment_anatomy::anatomy_masks(p.model, &input)?;
                Ok((a, p.model.backend(), p.since))
            };
            run_model(&self.models, ANATOMY_MODEL_ID, self.pin, &over, work).await?
        } else {
            let image = img.clone();
            let work = move |p: Placed<'_, LungSegmenter>, _: &_| {
                let (width, height) = (image.width as usize, image.height as usize);
                let lungs = lung_unet_mask(p.model, &store, &id, (width, height))?;
                let m = ChestMasks {
                    width,
                    height,
                    lungs,
                    heart: None,
                    mediastinum: None,
                };
                Ok((m, p.model.backend(), p.since))
            };
            run_model(&self.models, LUNG_MODEL_ID, self.pin, &over, work).await?
        };
        let source = if anatomy {
            format!("anatomy model {ANATOMY_MODEL_ID}")
        } else {
            format!("lung U-Net {LUNG_MODEL_ID} (no heart mask)")
        };
        Ok(Masks {
            masks,
            source,
            anatomy,
            backend,
            fallback,
            since,
        })
    }
}

/// What the view, the patient's age and the masks mean for the reading.
struct Notes {
    view: View,
    pediatric: bool,
    anatomy: bool,
    /// The view's effect on the CTR threshold (said only where a CTR was measured).
    view_note: Option<String>,
    pediatric_note: Option<String>,
    heart_note: Option<String>,
}

impl Notes {
    fn new(view: View, pediatric: bool, anatomy: bool) -> Self {
        let view_note = match view {
            View::Ap => Some(
                "AP projection: the heart is magnified, so the CTR overestimates (the 0.50 \
                 threshold is for PA views)"
                    .into(),
            ),
            View::Unknown => Some(
                "view not stated: the 0.50 CTR threshold assumes PA; on AP the CTR overestimates"
                    .into(),
            ),
            _ => None,
        };
        let pediatric_note = pediatric.then(|| {
            "pediatric patient: adult thresholds do not apply (CTR up to ~0.60 can be normal in \
             infants; the thymus widens the mediastinum)"
                .to_string()
        });
        let heart_note = (!anatomy).then(|| {
            format!(
                "no heart mask: install {ANATOMY_MODEL_ID} (`hilum models fetch {ANATOMY_MODEL_ID}`) \
                 to measure the CTR"
            )
        });
        Notes {
            view,
            pediatric,
            anatomy,
            view_note,
            pediatric_note,
            heart_note,
        }
    }

    fn all(&self) -> Vec<&String> {
        [&self.view_note, &self.pediatric_note, &self.heart_note]
            .into_iter()
            .flatten()
            .collect()
    }

    /// What a measured CTR means here.
    fn interpretation(&self, ctr: Option<f64>) -> Option<&'static str> {
        ctr.map(|c| {
            if self.pediatric {
                "pediatric: interpret against age norms"
            } else if c > 0.5 && self.view == View::Ap {
                "above 0.50 on an AP view: may be magnification; confirm on PA"
            } else if c > 0.5 {
                "above 0.50: enlarged cardiac silhouette"
            } else {
                "0.50 or below: heart size within normal limits"
            }
        })
    }
}

/// The tool's structured output.
fn report_data(id: &str, img: &CxrImage, m: &Masks, r: &ChestMeasurements, notes: &Notes) -> Value {
    let spacing = img.meta.pixel_spacing_mm;
    let cm = |s: &Option<Span>| match (s, spacing) {
        (Some(s), Some((_, col))) => {
            json!((s.width() as f64 * col / 10.0 * 100.0).round() / 100.0)
        }
        _ => Value::Null,
    };
    let mut data = json!({
        "image": id,
        "width": img.width,
        "height": img.height,
        "masks_source": m.source,
        "backend": m.backend,
        "view": format!("{:?}", notes.view),
        "cardiothoracic_ratio": r.ctr,
        "ctr_interpretation": notes.interpretation(r.ctr),
        "heart_width_px": r.heart.map(|s| s.width()),
        "heart_width_cm": cm(&r.heart),
        "heart_line": r.heart,
        "thoracic_width_px": r.thorax.map(|s| s.width()),
        "thoracic_width_cm": cm(&r.thorax),
        "thoracic_line": r.thorax,
        "mediastinal_width_px": r.mediastinum.map(|s| s.width()),
        "mediastinal_width_cm": cm(&r.mediastinum),
        "mediastinal_line": r.mediastinum,
        "mediastinal_method": r.mediastinum_method,
        "right_lung_px": r.right_lung_px,
        "left_lung_px": r.left_lung_px,
        "left_right_lung_area_ratio": r.left_right_area_ratio,
        "not_measured": r.missing,
        "notes": notes.all(),
        "pixel_spacing_mm": spacing,
        "lengths": if spacing.is_some() { "px and cm (pixel spacing from the file)" } else { "px only (pixel spacing unknown)" },
        "convention": "right lung = patient's right = image left; lines are [x0, x1] inclusive on row y",
        "latency_ms": (m.since.elapsed().as_secs_f64() * 1e4).round() / 10.0,
    });
    if let Some(why) = &m.fallback {
        data["fallback"] = json!(why);
    }
    data
}

/// The summary for the model: only what was measured, each number once. A small model copies
/// the observation it answers from, so every repeated or inapplicable clause costs prompt and
/// answer tokens. The view's note only with a CTR; the missing heart mask is said in the CTR's
/// place.
fn summary_text(id: &str, m: &Masks, r: &ChestMeasurements, notes: &Notes) -> String {
    let px =
        |s: Option<Span>| s.map_or("not measured".to_string(), |s| format!("{} px", s.width()));
    let said: Vec<&str> = [
        r.ctr.and(notes.view_note.as_ref()),
        notes.pediatric_note.as_ref(),
    ]
    .into_iter()
    .flatten()
    .map(String::as_str)
    .collect();
    let heart = match (r.ctr, notes.anatomy) {
        (Some(c), _) => format!(
            "CTR {c:.2}{}; heart {}, ",
            notes
                .interpretation(r.ctr)
                .map_or(String::new(), |i| format!(" ({i})")),
            px(r.heart)
        ),
        (None, false) => {
            format!("CTR not measured (no heart mask: `hilum models fetch {ANATOMY_MODEL_ID}`); ")
        }
        (None, true) => format!("CTR not measured; heart {}, ", px(r.heart)),
    };
    let lungs = match (r.left_lung_px, r.right_lung_px) {
        (Some(l), Some(rt)) => {
            let t = crate::segment_lungs::thousands;
            crate::segment_lungs::compare_sides(
                l as f64,
                rt as f64,
                &format!("{} px", t(l)),
                &format!("{} px", t(rt)),
            )
        }
        _ => "lung areas not measured".into(),
    };
    format!(
        "{id}: {heart}thorax {}, mediastinum {}; {lungs}.{}{}",
        px(r.thorax),
        px(r.mediastinum),
        if notes.anatomy {
            format!(" Masks: {}.", m.source)
        } else {
            String::new()
        },
        if said.is_empty() {
            String::new()
        } else {
            format!(" Notes: {}", said.join("; "))
        }
    )
}

/// The output with its overlay and mask artifacts.
fn outputs(
    summary: String,
    data: Value,
    img: &CxrImage,
    masks: &ChestMasks,
    r: &ChestMeasurements,
) -> Result<ToolOutput, ToolError> {
    let overlay = overlay_png(img, masks, r)?;
    let mut out = ToolOutput::new(summary, data)
        .with_artifact(Artifact::png("chest_measurements.png", "overlay", overlay))
        .with_artifact(Artifact::png(
            "lungs_mask.png",
            "mask",
            mask_png(&masks.lungs, masks.width, masks.height)?,
        ));
    if let Some(hm) = &masks.heart {
        out = out.with_artifact(Artifact::png(
            "heart_mask.png",
            "mask",
            mask_png(hm, masks.width, masks.height)?,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ellipse(m: &mut [bool], w: usize, cx: f64, cy: f64, rx: f64, ry: f64) {
        for (i, v) in m.iter_mut().enumerate() {
            let (x, y) = ((i % w) as f64, (i / w) as f64);
            if ((x - cx) / rx).powi(2) + ((y - cy) / ry).powi(2) <= 1.0 {
                *v = true;
            }
        }
    }

    fn rect(m: &mut [bool], w: usize, x0: usize, x1: usize, y0: usize, y1: usize) {
        for y in y0..=y1 {
            for x in x0..=x1 {
                m[y * w + x] = true;
            }
        }
    }

    #[test]
    fn ctr_is_exact_on_drawn_masks() {
        let (w, h) = (300, 260);
        let mut lungs = vec![false; w * h];
        // Right lung (image left) outer edge at x=20, left lung outer edge at x=279 on rows
        // 40..=200; the widest row is a one-row bulge at y=150 reaching x=15..=284.
        rect(&mut lungs, w, 20, 120, 40, 200);
        rect(&mut lungs, w, 180, 279, 40, 200);
        rect(&mut lungs, w, 15, 19, 150, 150);
        rect(&mut lungs, w, 280, 284, 150, 150);
        let mut heart = vec![false; w * h];
        // Heart ellipse: widest row y=170, x from 110 to 210 (101 px wide).
        ellipse(&mut heart, w, 160.0, 170.0, 50.0, 30.0);
        let m = ChestMasks {
            width: w,
            height: h,
            lungs,
            heart: Some(heart),
            mediastinum: None,
        };
        let r = measure(&m);
        let t = r.thorax.expect("thorax measured");
        assert_eq!((t.y, t.x0, t.x1, t.width()), (150, 15, 284, 270));
        let hs = r.heart.expect("heart measured");
        assert_eq!((hs.y, hs.x0, hs.x1, hs.width()), (170, 110, 210, 101));
        assert_eq!(r.ctr, Some(round3(101.0 / 270.0)));
        // Areas: the bulges add 5 px to each lung.
        assert_eq!(r.right_lung_px, Some(101 * 161 + 5));
        assert_eq!(r.left_lung_px, Some(100 * 161 + 5));
        // Mediastinum from the lungs' inner edges: gap 121..=179.
        let md = r.mediastinum.expect("mediastinum");
        assert_eq!((md.x0, md.x1), (121, 179));
        assert!(r.missing.is_empty(), "{:?}", r.missing);
    }

    #[test]
    fn mediastinum_mask_is_measured_above_the_heart() {
        let (w, h) = (200, 200);
        let mut lungs = vec![false; w * h];
        rect(&mut lungs, w, 10, 80, 20, 180);
        rect(&mut lungs, w, 120, 190, 20, 180);
        let mut heart = vec![false; w * h];
        rect(&mut heart, w, 70, 150, 120, 170);
        let mut med = vec![false; w * h];
        rect(&mut med, w, 90, 110, 30, 170);
        rect(&mut med, w, 85, 116, 60, 60); // widest above the heart: 32 px
        rect(&mut med, w, 60, 160, 140, 140); // wider, but at heart level: ignored
        let r = measure(&ChestMasks {
            width: w,
            height: h,
            lungs,
            heart: Some(heart),
            mediastinum: Some(med),
        });
        let md = r.mediastinum.expect("mediastinum");
        assert_eq!((md.y, md.width()), (60, 32));
        assert_eq!(r.heart.map(|s| s.width()), Some(81));
    }

    #[test]
    fn one_lung_or_no_heart_is_reported_not_guessed() {
        let (w, h) = (100, 100);
        let mut lungs = vec![false; w * h];
        rect(&mut lungs, w, 10, 40, 10, 90);
        let r = measure(&ChestMasks {
            width: w,
            height: h,
            lungs,
            heart: None,
            mediastinum: None,
        });
        assert_eq!(r.ctr, None);
        assert_eq!(r.thorax, None);
        assert_eq!(r.missing.len(), 2, "{:?}", r.missing);
        assert!(r.missing[0].contains("heart"));
        assert!(r.missing[1].contains("1 lung field"));
        let bad = measure(&ChestMasks {
            width: 10,
            height: 10,
            lungs: vec![true; 5],
            ..Default::default()
        });
        assert!(bad.missing[0].contains("wrong size"));
    }

    #[test]
    fn views_are_parsed() {
        assert_eq!(parse_view("pa"), View::Pa);
        assert_eq!(parse_view("AP"), View::Ap);
        assert_eq!(parse_view("LL"), View::Lateral);
        assert_eq!(parse_view("lateral"), View::Lateral);
        assert_eq!(parse_view("?"), View::Unknown);
    }
}
