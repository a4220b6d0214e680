//! `localize_finding`: where the torchxrayvision DenseNet-121 sees one of its 18 pathologies,
//! as a class activation map (Zhou et al., "Learning Deep Features for Discriminative
//! Localization", CVPR 2016): the classifier weights of that class times the last feature map
//! (after `norm5` and ReLU), upsampled to the image, thresholded into boxes, and drawn as a
//! heatmap overlay.
//!
//! With a global-average-pool + linear head, Grad-CAM (Selvaraju et al., ICCV 2017) on that
//! feature map is `ReLU(CAM) / (h * w)`: after normalisation the two maps are identical, so
//! only CAM is computed.
//!
//! The classifier computes the map itself ([`Classifier::class_activation`]): this tool loads
//! no network of its own, and asks the pool for the classifier on its candle backend.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{
    Artifact, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::{prepare, CxrImage, ImageStore, Prepared};
use hilum_models::xrv::{self, Classifier};
use hilum_models::{Device, ModelError, ModelPool, Placed};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::common::{run_model, ImageId};
use crate::ground::{base_canvas, draw_boxes, encode_png, PixelBox};

/// The tool's name, as models call it.
pub const NAME: &str = "localize_finding";
/// The classifier whose last feature map gives the class activation maps.
pub const MODEL_ID: &str = "densenet121-res224-all";
/// At most this many boxes are reported, strongest first.
const MAX_BOXES: usize = 5;
/// Regions smaller than this fraction of the analysed square are specks, not boxes.
const MIN_REGION_FRACTION: f64 = 0.002;
/// Side of the upsampled map: the 7x7 CAM holds no detail finer than this on any image.
const HEAT_MAX_SIDE: usize = 1024;

pub use hilum_models::xrv::Cam;

/// Bilinear resize (half-pixel centres, edges clamped, as `F.interpolate(align_corners=False)`)
/// of an (h, w) map to (out_h, out_w).
pub fn upsample(values: &[f32], h: usize, w: usize, out_h: usize, out_w: usize) -> Vec<f32> {
    let taps = |n: usize, m: usize| -> Vec<(usize, usize, f32)> {
        (0..m)
            .map(|o| {
                let x = ((o as f64 + 0.5) * n as f64 / m as f64 - 0.5).clamp(0.0, (n - 1) as f64);
                let i = x.floor() as usize;
                (i, (i + 1).min(n - 1), (x - i as f64) as f32)
            })
            .collect()
    };
    let (ty, tx) = (taps(h, out_h), taps(w, out_w));
    let mut out = vec![0f32; out_h * out_w];
    for (oy, &(y0, y1, fy)) in ty.iter().enumerate() {
        let (r0, r1) = (&values[y0 * w..(y0 + 1) * w], &values[y1 * w..(y1 + 1) * w]);
        let row = &mut out[oy * out_w..(oy + 1) * out_w];
        for (o, &(x0, x1, fx)) in row.iter_mut().zip(&tx) {
            let top = r0[x0] * (1.0 - fx) + r0[x1] * fx;
            let bot = r1[x0] * (1.0 - fx) + r1[x1] * fx;
            *o = top * (1.0 - fy) + bot * fy;
        }
    }
    out
}

/// `ReLU(cam) / max`: 0..1, all zero when nothing is positive.
pub fn normalise(values: &[f32]) -> Vec<f32> {
    let max = values.iter().fold(0f32, |m, &v| m.max(v));
    if max <= 0.0 {
        return vec![0.0; values.len()];
    }
    values.iter().map(|&v| v.max(0.0) / max).collect()
}

/// A connected region of the thresholded map.
#[derive(Clone, Debug, PartialEq)]
pub struct HeatBox {
    /// Corners in map pixels, `[x1, x2) x [y1, y2)`.
    pub x1: usize,
    /// Top edge.
    pub y1: usize,
    /// Right edge (exclusive).
    pub x2: usize,
    /// Bottom edge (exclusive).
    pub y2: usize,
    /// Pixels in the region.
    pub area: usize,
    /// Highest map value in the region.
    pub peak: f32,
}

/// Connected regions (4-connectivity) of `map >= threshold`, strongest peak first; regions
/// under `min_area` pixels are dropped.
pub fn boxes_from_map(
    map: &[f32],
    w: usize,
    h: usize,
    threshold: f32,
    min_area: usize,
) -> Vec<HeatBox> {
    let mut out = Vec::new();
    for pixels in hilum_imaging::regions::components(w, h, |i| map[i] >= threshold) {
        let mut b = HeatBox {
            x1: usize::MAX,
            y1: usize::MAX,
            x2: 0,
            y2: 0,
            area: 0,
            peak: 0.0,
        };
        for p in pixels {
            let (x, y) = (p % w, p / w);
            b.x1 = b.x1.min(x);
            b.y1 = b.y1.min(y);
            b.x2 = b.x2.max(x + 1);
            b.y2 = b.y2.max(y + 1);
            b.area += 1;
            b.peak = b.peak.max(map[p]);
        }
        if b.area >= min_area.max(1) {
            out.push(b);
        }
    }
    out.sort_by(|a, b| b.peak.total_cmp(&a.peak).then(b.area.cmp(&a.area)));
    out
}

/// Everything `localize_finding` computes for one image and class.
#[derive(Clone, Debug)]
pub struct Localization {
    /// The class activation map at feature-map resolution.
    pub cam: Cam,
    /// The classifier's probability for the class.
    pub probability: f32,
    /// Side and top-left corner of the centre square the model saw, in image pixels.
    pub crop: usize,
    /// Left edge of the square, in image pixels.
    pub crop_x: usize,
    /// Top edge of the square, in image pixels.
    pub crop_y: usize,
    /// Normalised CAM upsampled to `heat_side` x `heat_side` over the centre square
    /// (`heat_side` = the square's side, at most 1024).
    pub heat: Vec<f32>,
    /// Side of `heat`.
    pub heat_side: usize,
    /// Boxes in original-image pixels, strongest first.
    pub boxes: Vec<(HeatBox, PixelBox)>,
}

/// Runs the CAM of `class` on `img` and turns it into boxes (blocking; candle forward).
pub fn localize(
    net: &Classifier,
    img: &CxrImage,
    class: usize,
    threshold: f32,
) -> Result<Localization, ModelError> {
    let input = prepare(img, &net.spec.recipe()).map_err(|e| ModelError::Compute(e.to_string()))?;
    localize_on(net, &input, class, threshold)
}

/// [`localize`] on the network's input as the store prepared it (shared with
/// `classify_chest_xray`, which takes the same recipe).
pub fn localize_on(
    net: &Classifier,
    input: &Prepared,
    class: usize,
    threshold: f32,
) -> Result<Localization, ModelError> {
    let res = net.spec.resolution;
    if input.data.len() != res * res {
        return Err(ModelError::Compute(format!(
            "CAM input has {} values, expected {res} x {res}",
            input.data.len()
        )));
    }
    let (w, h) = (
        input.geometry.src_width as usize,
        input.geometry.src_height as usize,
    );
    let cam = net.class_activation(&input.data, class)?;
    // The same centre square as `Preprocess::xrv`.
    let crop = w.min(h);
    let (crop_x, crop_y) = (w / 2 - crop / 2, h / 2 - crop / 2);
    let g = crop.min(HEAT_MAX_SIDE);
    let heat = upsample(&normalise(&cam.values), cam.h, cam.w, g, g);
    let min_area = (MIN_REGION_FRACTION * (g * g) as f64) as usize;
    let to_px = |v: usize| (v * crop) as f64 / g as f64;
    let label = net.spec.labels.get(class).cloned().unwrap_or_default();
    let boxes = boxes_from_map(&heat, g, g, threshold, min_area)
        .into_iter()
        .take(MAX_BOXES)
        .map(|b| {
            let p = PixelBox {
                label: label.clone(),
                x1: crop_x as f64 + to_px(b.x1),
                y1: crop_y as f64 + to_px(b.y1),
                x2: crop_x as f64 + to_px(b.x2),
                y2: crop_y as f64 + to_px(b.y2),
            };
            (b, p)
        })
        .collect();
    Ok(Localization {
        probability: xrv::sigmoid(cam.logit),
        cam,
        crop,
        crop_x,
        crop_y,
        heat,
        heat_side: g,
        boxes,
    })
}

/// Jet-like colour for t in 0..1 (blue → cyan → yellow → red).
fn jet(t: f32) -> [f32; 3] {
    let t = t.clamp(0.0, 1.0);
    let c = |x: f32| (1.5 - (4.0 * t - x).abs()).clamp(0.0, 1.0) * 255.0;
    [c(3.0), c(2.0), c(1.0)]
}

/// The radiograph with the heat blended in (weaker heat more transparent) and the boxes drawn.
pub fn overlay_png(img: &CxrImage, loc: &Localization) -> Result<Vec<u8>, ToolError> {
    let (mut canvas, scale) = base_canvas(img)?;
    let (cw, ch) = (canvas.width(), canvas.height());
    for cy in 0..ch {
        let oy = ((cy as f64 + 0.5) / scale) as usize;
        if oy < loc.crop_y || oy >= loc.crop_y + loc.crop {
            continue;
        }
        for cx in 0..cw {
            let ox = ((cx as f64 + 0.5) / scale) as usize;
            if ox < loc.crop_x || ox >= loc.crop_x + loc.crop {
                continue;
            }
            let (g, c) = (loc.heat_side, loc.crop);
            let t = loc.heat[(oy - loc.crop_y) * g / c * g + (ox - loc.crop_x) * g / c];
            if t < 0.1 {
                continue;
            }
            let a = 0.55 * t;
            let col = jet(t);
            let px = canvas.get_pixel_mut(cx, cy);
            for (v, c) in px.0.iter_mut().zip(col) {
                *v = (*v as f32 * (1.0 - a) + c * a).round() as u8;
            }
        }
    }
    let boxes: Vec<PixelBox> = loc.boxes.iter().map(|(_, p)| p.clone()).collect();
    draw_boxes(&mut canvas, &boxes, scale);
    encode_png(canvas)
}

/// The `localize_finding` tool: where in the image the classifier saw a finding (Grad-CAM
/// boxes).
pub struct LocalizeFinding {
    store: Arc<ImageStore>,
    models: Arc<ModelPool>,
    /// `None`: each call routed across the pool's devices.
    pin: Option<Device>,
}

// The arguments of `localize_finding` as the model sends them.
// (A plain comment and no doc lint: a doc comment would become the schema's description.)
#[allow(missing_docs)]
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// The pathology, as the classifier names it
    #[schemars(schema_with = "label")]
    finding: String,
    /// Fraction of the map's peak above which a pixel is inside a box
    #[serde(default = "half")]
    #[schemars(range(min = 0.1, max = 0.95))]
    threshold: f32,
}

/// One of the classifier's 18 labels (the names live in `xrv::LABELS`).
fn label(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "enum": xrv::LABELS})
}

fn half() -> f32 {
    0.5
}

impl LocalizeFinding {
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
        Typed::new(LocalizeFinding { store, models, pin })
    }
}

/// Index of `finding` among the labels: exact, then ignoring case, spaces and underscores.
pub fn class_index(labels: &[String], finding: &str) -> Option<usize> {
    let key = |s: &str| -> String {
        s.chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(char::to_lowercase)
            .collect()
    };
    let f = key(finding);
    labels
        .iter()
        .position(|l| l == finding)
        .or_else(|| labels.iter().position(|l| key(l) == f))
}

impl crate::BuildTool for LocalizeFinding {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(LocalizeFinding::new(
            deps.images.clone(),
            deps.models.clone(),
        ))
    }
}

#[async_trait]
impl TypedTool for LocalizeFinding {
    type Args = Args;
    const NAME: &'static str = NAME;

    fn description(&self) -> String {
        "Shows where the chest X-ray classifier (torchxrayvision DenseNet-121) \
         finds evidence for one of its 18 pathologies: a class activation map over the \
         image, thresholded into boxes (original-image pixels) and drawn as a heatmap \
         overlay. It explains the classifier's score; it is coarse (32-pixel grid at \
         224 px) and not a segmentation. Use it to answer \"where?\" when no grounding \
         model is available."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            models: &["densenet121-res224-all"],
            ..Requirements::NONE
        }
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let (store, image_id) = (self.store.clone(), args.image.clone());
        let id = args.image.0;
        let (finding, threshold) = (args.finding, args.threshold);
        // The CAM reads the classifier's last feature map, which its candle network has (the
        // native plan and the graphs end at the logits): on a GPU that is the copy
        // classify_chest_xray uses; on the CPU a candle copy of the same weights.
        let mut candle = hilum_models::BackendChoice::default();
        candle.set(MODEL_ID, hilum_models::Backend::Candle);
        let ((loc, label, installed, t0), _) = run_model(
            &self.models,
            MODEL_ID,
            self.pin,
            &candle,
            move |p: Placed<'_, Classifier>, installed| {
                let net = p.model;
                let class = class_index(&net.spec.labels, &finding).ok_or_else(|| {
                    ToolError::InvalidArguments(format!(
                        "`{finding}` is not one of the model's labels: {}",
                        net.spec.labels.join(", ")
                    ))
                })?;
                let input = image_id.prepared(&store, &net.spec.recipe())?;
                let loc = localize_on(net, &input, class, threshold)?;
                Ok((
                    loc,
                    net.spec.labels[class].clone(),
                    installed.clone(),
                    p.since,
                ))
            },
        )
        .await?;
        let png = overlay_png(&img, &loc)?;
        let r2 = |v: f64| (v * 100.0).round() / 100.0;
        let boxes: Vec<Value> = loc
            .boxes
            .iter()
            .map(|(h, p)| {
                let mut v = p.to_json();
                v["peak"] = json!(r2(h.peak as f64));
                v["area_px"] = json!(h.area);
                v
            })
            .collect();
        let summary = if loc.boxes.is_empty() {
            format!(
                "{id}: no region of the map for {label} reaches {threshold} of its peak \
                 (probability {:.2})",
                loc.probability
            )
        } else {
            let list: Vec<String> = loc
                .boxes
                .iter()
                .map(|(_, p)| {
                    format!(
                        "x={:.0} y={:.0} w={:.0} h={:.0}",
                        p.x1,
                        p.y1,
                        p.x2 - p.x1,
                        p.y2 - p.y1
                    )
                })
                .collect();
            format!(
                "{id}: {label} (probability {:.2}) evidence strongest at {}{}",
                loc.probability,
                list.join("; "),
                if installed.record.custom {
                    " (custom site checkpoint)"
                } else {
                    ""
                }
            )
        };
        let data = json!({
            "image": id,
            "finding": label,
            "method": "CAM (= normalised Grad-CAM for this head) on the last dense block",
            "model": MODEL_ID,
            "model_custom": installed.record.custom,
            "probability": r2(loc.probability as f64),
            "logit": loc.cam.logit,
            "threshold": threshold,
            "boxes": boxes,
            "grid": [loc.cam.h, loc.cam.w],
            "cam": normalise(&loc.cam.values).iter().map(|v| r2(*v as f64)).collect::<Vec<_>>(),
            "analysed_square": [loc.crop_x, loc.crop_y, loc.crop, loc.crop],
            "latency_ms": r2(t0.elapsed().as_secs_f64() * 1e3),
            "coordinates": "original-image pixels; the model sees only the centre square",
        });
        Ok(ToolOutput::new(summary, data).with_artifact(Artifact::png(
            "cam_overlay.png",
            "heatmap",
            png,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upsample_keeps_constant_and_interpolates() {
        let up = upsample(&[1.0; 4], 2, 2, 5, 7);
        assert!(up.iter().all(|v| (v - 1.0).abs() < 1e-6));
        // 1x2 → 1x4 with half-pixel centres: 0, 0.25, 0.75, 1.
        let up = upsample(&[0.0, 1.0], 1, 2, 1, 4);
        assert_eq!(up, vec![0.0, 0.25, 0.75, 1.0]);
    }

    #[test]
    fn boxes_follow_thresholded_regions() {
        // 6x4 map: a strong 2x2 blob, a weak 1x3 blob, a one-pixel speck.
        #[rustfmt::skip]
        let map = [
            0.9, 1.0, 0.0, 0.0, 0.0, 0.6,
            0.8, 0.7, 0.0, 0.0, 0.0, 0.0,
            0.0, 0.0, 0.0, 0.55, 0.6, 0.52,
            0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        ];
        let b = boxes_from_map(&map, 6, 4, 0.5, 2);
        assert_eq!(b.len(), 2);
        assert_eq!(
            (b[0].x1, b[0].y1, b[0].x2, b[0].y2, b[0].area),
            (0, 0, 2, 2, 4)
        );
        assert_eq!(
            (b[1].x1, b[1].y1, b[1].x2, b[1].y2, b[1].area),
            (3, 2, 6, 3, 3)
        );
        assert_eq!(boxes_from_map(&map, 6, 4, 0.95, 1).len(), 1);
    }

    #[test]
    fn labels_match_loosely() {
        let labels: Vec<String> = xrv::LABELS.iter().map(|s| s.to_string()).collect();
        assert_eq!(class_index(&labels, "Effusion"), Some(7));
        assert_eq!(class_index(&labels, "pleural thickening"), Some(9));
        assert_eq!(class_index(&labels, "enlarged_cardiomediastinum"), Some(17));
        assert_eq!(class_index(&labels, "Infiltrate"), None);
    }
}
