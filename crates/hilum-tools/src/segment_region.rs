//! `segment_region`: MedSAM (SAM ViT-B fine-tuned on medical images) segments the region inside
//! a box, or at points, given in original-image pixels. The encoder's 1024 px input comes from
//! the image store (`Runner::recipe`, computed once per image) and the image embedding (the
//! expensive encoder pass) is cached per image and model copy, so further prompts on the same
//! image only run the small prompt encoder and mask decoder.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use candle_core::Tensor;
use hilum_agent::{
    Artifact, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::{Box2d, CxrImage, ImageStore, MaskLayer, Overlay, Rgb};
use hilum_models::runner::Runner;
use hilum_models::sam::{self, Prompt, Sam};
use hilum_models::{Backend, BackendChoice, Device, ModelError, ModelPool, Placed};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;

use crate::common::{choice, round2, run_blocking, run_model, Choice, Fail, ImageId};

/// The MedSAM checkpoint the tool runs.
pub const MODEL_ID: &str = "medsam-vit-b";
/// Smallest image side MedSAM is run on (it is stretched to 1024 px).
pub const MIN_SIDE: u32 = 64;
/// Smallest box side, in original pixels, after clipping to the image.
pub const MIN_BOX: f64 = 2.0;
/// Image embeddings kept (4 MiB each for ViT-B).
pub const CACHE_CAPACITY: usize = 16;
const THRESHOLD: f32 = 0.5;
const OVERLAY_MAX_SIDE: u32 = 1024;

/// One cached embedding per (image id, loaded model copy); concurrent first calls share one
/// encoder pass: the first holds the lock while it encodes, the others wait for its result.
type Slot = Arc<Mutex<Option<Tensor>>>;

/// A bounded, least-recently-used map from (image id, model instance) to its image embedding.
pub struct EmbeddingCache {
    capacity: usize,
    entries: Mutex<VecDeque<((String, u64), Slot)>>,
}

impl EmbeddingCache {
    /// An empty cache holding at most `capacity` embeddings (at least one).
    pub fn new(capacity: usize) -> Self {
        EmbeddingCache {
            capacity: capacity.max(1),
            entries: Mutex::new(VecDeque::new()),
        }
    }

    fn slot(&self, image: &str, instance: u64) -> Slot {
        let mut e = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = e.iter().position(|(k, _)| k.0 == image && k.1 == instance) {
            if let Some(hit) = e.remove(i) {
                let slot = hit.1.clone();
                e.push_back(hit);
                return slot;
            }
        }
        let slot = Slot::default();
        e.push_back(((image.to_string(), instance), slot.clone()));
        while e.len() > self.capacity {
            e.pop_front();
        }
        slot
    }

    /// Embeddings held (computed or being computed).
    pub fn len(&self) -> usize {
        self.entries.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no embedding is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A prompt in original-image pixels, checked against the image.
#[derive(Clone, Debug, PartialEq)]
pub struct RegionPrompt {
    /// [x0, y0, x1, y1], clipped to the image.
    pub bbox: Option<[f64; 4]>,
    /// (x, y, label): 1 inside the region, 0 outside.
    pub points: Vec<(f64, f64, f32)>,
    /// What was changed or is worth knowing (clipping, point-only prompts).
    pub caveats: Vec<String>,
}

// The prompt arguments as the model sends them: lengths and labels are checked by
// `parse_prompt`, against the image, so a wrong prompt gets an answer that says what to send
// instead. (A plain comment and no doc lint: a doc comment would become the description of
// the whole schema.)
#[allow(missing_docs)]
#[derive(Clone, Debug, Default, Deserialize, JsonSchema)]
pub struct PromptArgs {
    /// [x0, y0, x1, y1] around the region, original-image pixels
    #[serde(default, rename = "box")]
    #[schemars(length(min = 4, max = 4))]
    pub bbox: Option<Vec<f64>>,
    /// [[x, y], ...] in original-image pixels (optional, with or instead of the box)
    #[serde(default)]
    #[schemars(inner(length(min = 2, max = 2)))]
    pub points: Option<Vec<Vec<f64>>>,
    /// Per point: 1 inside the region, 0 outside (default all 1)
    #[serde(default)]
    #[schemars(schema_with = "point_labels")]
    pub point_labels: Option<Vec<f64>>,
}

/// Labels are 0 or 1; read as numbers so that a `1.0` is a label too.
fn point_labels(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "array", "items": {"type": "integer", "enum": [0, 1]}})
}

/// Checks `box` / `points` / `point_labels` against an image of `w` x `h` pixels: a box
/// partly outside is clipped (with a caveat); a box outside the image, empty or inverted, and
/// points outside the image are errors that say what to send instead.
pub fn parse_prompt(args: &PromptArgs, w: u32, h: u32) -> Result<RegionPrompt, ToolError> {
    let (wf, hf) = (w as f64, h as f64);
    let mut caveats = Vec::new();
    let bbox = match &args.bbox {
        None => None,
        Some(b) => {
            let [x0, y0, x1, y1] = b[..] else {
                return Err(ToolError::InvalidArguments(format!(
                    "`box` must be [x0, y0, x1, y1] in image pixels, got {} numbers",
                    b.len()
                )));
            };
            if x1 <= x0 || y1 <= y0 {
                return Err(ToolError::InvalidArguments(format!(
                    "box [{x0}, {y0}, {x1}, {y1}] is empty or inverted: send [x0, y0, x1, y1] with \
                     x1 > x0 and y1 > y0 (top-left, then bottom-right corner, in pixels)"
                )));
            }
            if x1 <= 0.0 || y1 <= 0.0 || x0 >= wf || y0 >= hf {
                return Err(ToolError::InvalidArguments(format!(
                    "box [{x0}, {y0}, {x1}, {y1}] lies outside the {w}x{h} image: coordinates are \
                     original-image pixels, 0 <= x < {w}, 0 <= y < {h}"
                )));
            }
            let c = [x0.max(0.0), y0.max(0.0), x1.min(wf), y1.min(hf)];
            if c != [x0, y0, x1, y1] {
                caveats.push(format!(
                    "box [{x0}, {y0}, {x1}, {y1}] extended past the {w}x{h} image and was \
                     clipped to [{}, {}, {}, {}]",
                    c[0], c[1], c[2], c[3]
                ));
            }
            if c[2] - c[0] < MIN_BOX || c[3] - c[1] < MIN_BOX {
                return Err(ToolError::InvalidArguments(format!(
                    "box [{}, {}, {}, {}] is smaller than {MIN_BOX} px inside the image: draw a \
                     box around the whole region",
                    c[0], c[1], c[2], c[3]
                )));
            }
            Some(c)
        }
    };
    let mut points = Vec::new();
    if let Some(list) = &args.points {
        let labels = match &args.point_labels {
            Some(l) => l.clone(),
            None => vec![1.0; list.len()],
        };
        if labels.len() != list.len() {
            return Err(ToolError::InvalidArguments(format!(
                "{} points but {} point_labels: give one label (1 inside, 0 outside) per point",
                list.len(),
                labels.len()
            )));
        }
        for (p, &l) in list.iter().zip(&labels) {
            let [x, y] = p[..] else {
                return Err(ToolError::InvalidArguments(
                    "each point must be [x, y] in image pixels".into(),
                ));
            };
            if !(0.0..wf).contains(&x) || !(0.0..hf).contains(&y) {
                return Err(ToolError::InvalidArguments(format!(
                    "point [{x}, {y}] is outside the {w}x{h} image"
                )));
            }
            if l != 0.0 && l != 1.0 {
                return Err(ToolError::InvalidArguments(format!(
                    "point label {l} is not 1 (inside the region) or 0 (outside)"
                )));
            }
            points.push((x, y, l as f32));
        }
    }
    if bbox.is_none() && points.is_empty() {
        return Err(ToolError::InvalidArguments(
            "give a `box` [x0, y0, x1, y1] around the region (preferred), or `points`".into(),
        ));
    }
    if bbox.is_none() {
        caveats.push(
            "point-only prompt: MedSAM was trained with boxes, so the mask may be less reliable; \
             a box around the region is better"
                .into(),
        );
    }
    Ok(RegionPrompt {
        bbox,
        points,
        caveats,
    })
}

impl RegionPrompt {
    /// The prompt in the encoder's frame: MedSAM scales by `size / W` and `size / H` (the image
    /// is stretched, not padded).
    pub fn to_model(&self, w: u32, h: u32, size: usize) -> Prompt {
        let (sx, sy) = (size as f64 / w as f64, size as f64 / h as f64);
        Prompt {
            points: self
                .points
                .iter()
                .map(|&(x, y, l)| ((x * sx) as f32, (y * sy) as f32, l))
                .collect(),
            bbox: self.bbox.map(|[x0, y0, x1, y1]| {
                [
                    (x0 * sx) as f32,
                    (y0 * sy) as f32,
                    (x1 * sx) as f32,
                    (y1 * sy) as f32,
                ]
            }),
            mask: None,
        }
    }
}

/// The region's probability map at the original resolution and the model's predicted IoU.
pub struct RegionMap {
    /// Probability per pixel, row-major at the image's size.
    pub prob: Vec<f32>,
    /// The model's own estimate of the mask's IoU.
    pub predicted_iou: f32,
}

/// The encoder input for a whole image (MedSAM preprocessing, [`sam::recipe`]) outside an image
/// store; the tool asks its store instead.
pub fn prepare(model: &Sam, img: &CxrImage) -> Vec<f32> {
    sam::preprocess(
        &img.pixels,
        img.width as usize,
        img.height as usize,
        img.max_value(),
        model.config().image_size,
    )
}

/// Prompt encoder + mask decoder on a cached embedding; sigmoid and bilinear resize of the
/// low-resolution logits to the original size (MedSAM's postprocessing).
pub fn decode(
    model: &Sam,
    embedding: &Tensor,
    img: &CxrImage,
    prompt: &RegionPrompt,
) -> Result<RegionMap, ModelError> {
    let cfg = model.config();
    let p = prompt.to_model(img.width, img.height, cfg.image_size);
    let (logits, iou) = model.predict_low_res(embedding, &p)?;
    let probs: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let n = cfg.low_res();
    Ok(RegionMap {
        prob: sam::interpolate_bilinear(&probs, n, n, img.width as usize, img.height as usize),
        predicted_iou: iou,
    })
}

/// Where the model comes from: the registry's installed MedSAM, or a given network (tests,
/// benchmarks, applications that load their own checkpoint).
enum Source {
    Pool {
        models: Arc<ModelPool>,
        /// `None`: each call routed across the pool's devices.
        pin: Option<Device>,
        /// The image encoder's backend over the models' settings; empty: the settings', else
        /// [`sam::auto_backend`]. `kserve` sends it to the inference server of the pool's
        /// settings (the graph `hilum models export-triton` wrote).
        backends: Choice,
    },
    Fixed(Arc<Sam>),
}

/// The `segment_region` tool: the mask of a region the model points at with a box or
/// points (MedSAM).
pub struct SegmentRegion {
    store: Arc<ImageStore>,
    source: Source,
    cache: Arc<EmbeddingCache>,
}

// The arguments of `segment_region` as the model sends them.
// (A plain comment and no doc lint: a doc comment would become the schema's description.)
#[allow(missing_docs)]
#[derive(Deserialize, JsonSchema)]
#[schemars(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    #[serde(flatten)]
    prompt: PromptArgs,
    /// What the region is, for the overlay legend (e.g. "opacity")
    #[serde(default)]
    #[schemars(length(max = 60))]
    label: Option<String>,
}

impl SegmentRegion {
    /// The tool, ready to register (its schema generated from its arguments' type).
    pub fn new(store: Arc<ImageStore>, models: Arc<ModelPool>) -> Typed<Self> {
        Self::on_device(store, models, None, None)
    }

    /// `pin`: one device for every call; `None`: routed across the pool's devices. `backend`:
    /// where the image encoder runs (`None`: [`sam::auto_backend`]).
    pub fn on_device(
        store: Arc<ImageStore>,
        models: Arc<ModelPool>,
        pin: Option<Device>,
        backend: Option<Backend>,
    ) -> Typed<Self> {
        let backends = Ok(backend.map(BackendChoice::every).unwrap_or_default());
        Self::build(
            store,
            Source::Pool {
                models,
                pin,
                backends,
            },
        )
    }

    /// The tool over an already loaded network instead of the registry's `medsam-vit-b`.
    pub fn with_model(store: Arc<ImageStore>, model: Arc<Sam>) -> Typed<Self> {
        Self::build(store, Source::Fixed(model))
    }

    /// The image embeddings kept between calls.
    pub fn cache(&self) -> &EmbeddingCache {
        &self.cache
    }

    fn build(store: Arc<ImageStore>, source: Source) -> Typed<Self> {
        Typed::new(SegmentRegion {
            store,
            source,
            cache: Arc::new(EmbeddingCache::new(CACHE_CAPACITY)),
        })
    }
}

impl crate::BuildTool for SegmentRegion {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(SegmentRegion::build(
            deps.images.clone(),
            Source::Pool {
                models: deps.models.clone(),
                pin: None,
                backends: deps.settings.backends.clone(),
            },
        ))
    }
}

/// The embedding of `image` from the cache, or encoded now (blocking) from the input the store
/// prepared for the model's recipe; and whether it was cached.
fn embedding(
    cache: &EmbeddingCache,
    model: &Sam,
    store: &ImageStore,
    image: &ImageId,
) -> Result<(Tensor, bool), Fail> {
    let slot = cache.slot(&image.0, model.instance());
    let mut held = slot.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = held.as_ref() {
        return Ok((e.clone(), true));
    }
    let x = image.prepared(store, &model.recipe())?;
    let e = model.run(&x)?;
    *held = Some(e.clone());
    Ok((e, false))
}

#[async_trait]
impl TypedTool for SegmentRegion {
    type Args = Args;
    const NAME: &'static str = "segment_region";

    fn description(&self) -> String {
        "Segments one region you point at with a box (or points) on a chest \
         radiograph, with MedSAM (Segment Anything ViT-B fine-tuned on medical images). \
         Use it to outline a finding whose location you already have — a box from \
         localize_finding or ground_phrase, or a region you chose — to get its exact \
         mask, area (px, and cm² when the pixel spacing is known), bounding box and \
         centroid, plus an overlay. Coordinates are original-image pixels, box = \
         [x0, y0, x1, y1]; draw the box snugly around the whole region. Several calls \
         on the same image are cheap after the first (the image encoding is cached). \
         For named anatomy use segment_anatomy or segment_lungs instead."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            models: &["medsam-vit-b"],
            ..Requirements::NONE
        }
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let id = args.image.0.clone();
        if img.width < MIN_SIDE || img.height < MIN_SIDE {
            return Err(ToolError::Unprocessable(format!(
                "{id} is {}x{} px: region segmentation needs at least {MIN_SIDE} px per side",
                img.width, img.height
            )));
        }
        let prompt = parse_prompt(&args.prompt, img.width, img.height)?;
        let label = args
            .label
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| "region".into());

        // Encoder (when the image is not cached) and decoder, on the device, in one go; their
        // errors stay the model's, so a device failure moves a pooled call.
        let t0 = Instant::now();
        let (cache, store, image, p, image_id) = (
            self.cache.clone(),
            self.store.clone(),
            img.clone(),
            prompt.clone(),
            args.image.clone(),
        );
        let work = move |model: &Sam| -> Result<(RegionMap, Timing), Fail> {
            let (embedding, cached) = embedding(&cache, model, &store, &image_id)?;
            let encode_ms = t0.elapsed().as_secs_f64() * 1e3;
            let t1 = Instant::now();
            let map = decode(model, &embedding, &image, &p)?;
            let timing = Timing {
                cached,
                encode_ms,
                decode_ms: t1.elapsed().as_secs_f64() * 1e3,
            };
            Ok((map, timing))
        };
        let ((map, timing, backend), fallback) = match &self.source {
            Source::Pool {
                models,
                pin,
                backends,
            } => {
                let work = move |p: Placed<'_, Sam>, _: &_| {
                    let b = p.model.backend();
                    work(p.model).map(|(m, t)| (m, t, b))
                };
                run_model(models, MODEL_ID, *pin, &choice(backends)?, work).await?
            }
            Source::Fixed(m) => {
                let model = m.clone();
                let tool_error = |e: Fail| match e {
                    Fail::Model(e) => ToolError::Internal(e.to_string()),
                    Fail::Tool(e) => e,
                };
                let b = model.backend();
                let done = run_blocking(move || work(&model).map_err(tool_error)).await?;
                ((done.0, done.1, b), None)
            }
        };
        let mut out = assemble(&id, &img, &prompt, &map, &label, timing)?;
        out.data["backend"] = json!(backend);
        if let Some(why) = fallback {
            out.data["fallback"] = json!(why);
        }
        Ok(out)
    }
}

/// How a call spent its time, and whether the image embedding came from the cache.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Whether the embedding came from the cache.
    pub cached: bool,
    /// Milliseconds until the image embedding was ready (from the cache or the encoder).
    pub encode_ms: f64,
    /// Milliseconds spent decoding the mask from the prompt.
    pub decode_ms: f64,
}

/// Summary, data and artifacts (mask PNG at original resolution, overlay) of one region.
pub fn assemble(
    id: &str,
    img: &CxrImage,
    prompt: &RegionPrompt,
    map: &RegionMap,
    label: &str,
    timing: Timing,
) -> Result<ToolOutput, ToolError> {
    let w = img.width as usize;
    let (mut n, mut sx, mut sy, mut sp) = (0usize, 0f64, 0f64, 0f64);
    let (mut x0, mut y0, mut x1, mut y1) = (usize::MAX, usize::MAX, 0, 0);
    let mut in_box = 0usize;
    for (i, &p) in map.prob.iter().enumerate() {
        if p > THRESHOLD {
            let (x, y) = (i % w, i / w);
            n += 1;
            sx += x as f64;
            sy += y as f64;
            sp += p as f64;
            (x0, y0, x1, y1) = (x0.min(x), y0.min(y), x1.max(x), y1.max(y));
            if let Some([bx0, by0, bx1, by1]) = prompt.bbox {
                let (fx, fy) = (x as f64 + 0.5, y as f64 + 0.5);
                if fx >= bx0 && fx <= bx1 && fy >= by0 && fy <= by1 {
                    in_box += 1;
                }
            }
        }
    }
    let mut caveats = prompt.caveats.clone();
    let spacing = img.meta.pixel_spacing_mm;
    let view = img.meta.view_position.as_deref().unwrap_or("unknown");
    if matches!(
        view.to_ascii_uppercase().as_str(),
        "LL" | "RL" | "LAT" | "LATERAL"
    ) {
        caveats.push("lateral view: MedSAM works on any view, but check the mask".into());
    }
    let mut region = json!({"found": n > 0, "area_px": n});
    if n == 0 {
        caveats.push("no region above the 0.5 threshold: try a tighter or larger box".into());
    } else {
        let (bw, bh) = (x1 - x0 + 1, y1 - y0 + 1);
        region = json!({
            "found": true,
            "area_px": n,
            "bbox": [x0, y0, bw, bh],
            "centroid": [round2(sx / n as f64), round2(sy / n as f64)],
            "confidence": round2(sp / n as f64),
        });
        if let Some([bx0, by0, bx1, by1]) = prompt.bbox {
            let box_area = (bx1 - bx0) * (by1 - by0);
            region["fraction_of_box"] = json!(round2(in_box as f64 / box_area.max(1.0)));
            if (in_box as f64) < 0.5 * n as f64 {
                caveats.push(
                    "most of the mask lies outside the box: the box may not enclose the region"
                        .into(),
                );
            }
        }
        if let Some((row, col)) = spacing {
            region["area_cm2"] = json!(round2(n as f64 * row * col / 100.0));
            region["width_cm"] = json!(round2(bw as f64 * col / 10.0));
            region["height_cm"] = json!(round2(bh as f64 * row / 10.0));
        }
    }
    if spacing.is_none() {
        caveats.push("pixel spacing unknown: area in pixels only".into());
    }
    let area = match region.get("area_cm2") {
        Some(a) => format!("{n} px = {a} cm²"),
        None => format!("{n} px"),
    };
    let prompt_text = match (&prompt.bbox, prompt.points.len()) {
        (Some(b), 0) => format!("box [{:.0}, {:.0}, {:.0}, {:.0}]", b[0], b[1], b[2], b[3]),
        (Some(b), k) => format!(
            "box [{:.0}, {:.0}, {:.0}, {:.0}] + {k} points",
            b[0], b[1], b[2], b[3]
        ),
        (None, k) => format!("{k} points"),
    };
    let summary = if n > 0 {
        format!(
            "{id}: {label} from {prompt_text}: {area}, bbox {}, confidence {}, predicted IoU {:.2}{}{}",
            region["bbox"],
            region["confidence"],
            map.predicted_iou,
            if timing.cached { " (cached image encoding)" } else { "" },
            if caveats.is_empty() { String::new() } else { format!(". Notes: {}", caveats.join("; ")) }
        )
    } else {
        format!(
            "{id}: {label} from {prompt_text}: nothing segmented. Notes: {}",
            caveats.join("; ")
        )
    };
    let data = json!({
        "image": id,
        "width": img.width,
        "height": img.height,
        "model": MODEL_ID,
        "label": label,
        "prompt": {
            "box": prompt.bbox,
            "points": prompt.points.iter().map(|p| json!([p.0, p.1, p.2])).collect::<Vec<_>>(),
        },
        "region": region,
        "predicted_iou": round2(map.predicted_iou as f64),
        "threshold": THRESHOLD,
        "areas": if spacing.is_some() { "px and cm² (pixel spacing from the file)" } else { "px only (pixel spacing unknown)" },
        "pixel_spacing_mm": spacing,
        "caveats": caveats,
        "embedding_cached": timing.cached,
        "latency_ms": {"encode": round2(timing.encode_ms), "decode": round2(timing.decode_ms)},
    });
    let mask: Vec<f32> = map
        .prob
        .iter()
        .map(|&p| if p > THRESHOLD { 1.0 } else { 0.0 })
        .collect();
    let mask_bytes: Vec<u8> = mask
        .iter()
        .map(|&m| if m > 0.0 { 255 } else { 0 })
        .collect();
    let mask_png = hilum_imaging::encode_png(img.width, img.height, &mask_bytes, 1)
        .map_err(|e| ToolError::Internal(format!("mask PNG: {e}")))?;
    let mut boxes = Vec::new();
    if let Some([bx0, by0, bx1, by1]) = prompt.bbox {
        boxes.push(Box2d {
            x: bx0,
            y: by0,
            w: bx1 - bx0,
            h: by1 - by0,
            label: "prompt".into(),
            score: None,
            color: Some(Rgb(80, 160, 255)),
        });
    }
    let r = (img.width.max(img.height) as f64 / 200.0).max(2.0);
    for &(x, y, l) in &prompt.points {
        boxes.push(Box2d {
            x: x - r,
            y: y - r,
            w: 2.0 * r,
            h: 2.0 * r,
            label: if l > 0.5 { "+" } else { "-" }.into(),
            score: None,
            color: Some(if l > 0.5 {
                Rgb(0, 200, 0)
            } else {
                Rgb(230, 40, 40)
            }),
        });
    }
    let overlay = Overlay {
        masks: vec![MaskLayer {
            label: label.to_string(),
            width: img.width,
            height: img.height,
            data: mask,
            color: Some(Rgb(250, 210, 30)),
            alpha: 0.35,
        }],
        boxes,
        max_side: Some(OVERLAY_MAX_SIDE),
        legend: true,
        ..Default::default()
    }
    .render_png(img)
    .map_err(|e| ToolError::Internal(format!("overlay: {e}")))?;
    Ok(ToolOutput::new(summary, data)
        .with_artifact(Artifact::png("region_overlay.png", "overlay", overlay))
        .with_artifact(Artifact::png("region_mask.png", "mask", mask_png)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// The prompt arguments of `v` checked against a 100x80 image; a type error is refused by
    /// deserialisation (the schema, for the model), the rest by `parse_prompt`.
    fn prompt(v: &Value, w: u32, h: u32) -> Result<RegionPrompt, String> {
        let args: PromptArgs = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
        parse_prompt(&args, w, h).map_err(|e| e.to_string())
    }

    #[test]
    fn boxes_are_clipped_or_refused_with_reasons() {
        let parse_prompt = prompt;
        let p = parse_prompt(&json!({"box": [10, 20, 50, 60]}), 100, 80).unwrap();
        assert_eq!(p.bbox, Some([10.0, 20.0, 50.0, 60.0]));
        assert!(p.caveats.is_empty());
        let p = parse_prompt(&json!({"box": [-5, 10, 150, 60]}), 100, 80).unwrap();
        assert_eq!(p.bbox, Some([0.0, 10.0, 100.0, 60.0]));
        assert!(p.caveats[0].contains("clipped"), "{:?}", p.caveats);
        for (bad, why) in [
            (json!({"box": [50, 20, 10, 60]}), "inverted"),
            (json!({"box": [10, 20, 10, 60]}), "empty"),
            (json!({"box": [200, 200, 300, 300]}), "outside"),
            (json!({"box": [-50, -50, -10, -10]}), "outside"),
            (json!({"box": [99.5, 10, 120, 60]}), "smaller than"),
            (json!({"box": [1, 2, 3]}), "[x0, y0, x1, y1]"),
            (json!({"box": [1, 2, "a", 4]}), "invalid type"),
            (json!({}), "give a `box`"),
            (json!({"points": [[500, 5]]}), "outside"),
            (
                json!({"points": [[5, 5]], "point_labels": [1, 0]}),
                "point_labels",
            ),
            (json!({"points": [[5, 5]], "point_labels": [3]}), "not 1"),
        ] {
            let e = parse_prompt(&bad, 100, 80).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let p = parse_prompt(
            &json!({"points": [[5, 6], [50, 60]], "point_labels": [1, 0]}),
            100,
            80,
        )
        .unwrap();
        assert_eq!(p.points, vec![(5.0, 6.0, 1.0), (50.0, 60.0, 0.0)]);
        assert!(p.caveats[0].contains("trained with boxes"));
    }

    #[test]
    fn prompt_is_scaled_like_medsam() {
        // box_1024 = box / [W, H, W, H] * 1024
        let p = prompt(&json!({"box": [100, 50, 300, 150]}), 400, 200).unwrap();
        let m = p.to_model(400, 200, 1024);
        assert_eq!(m.bbox, Some([256.0, 256.0, 768.0, 768.0]));
    }

    #[test]
    fn cache_is_bounded_and_least_recently_used() {
        let c = EmbeddingCache::new(2);
        let a = c.slot("img_a", 1);
        let _b = c.slot("img_b", 1);
        assert!(Arc::ptr_eq(&a, &c.slot("img_a", 1)));
        let _c = c.slot("img_c", 1); // evicts img_b, the least recently used
        assert_eq!(c.len(), 2);
        assert!(Arc::ptr_eq(&a, &c.slot("img_a", 1)));
        assert!(!Arc::ptr_eq(&a, &c.slot("img_a", 2)), "another model copy");
    }
}
