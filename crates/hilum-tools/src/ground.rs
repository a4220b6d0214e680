//! `ground_phrase`: boxes for a finding phrase from a served grounding VLM (MAIRA-2,
//! Qwen2.5-VL, or a generic model), mapped to original-image pixels and drawn on the image.
//!
//! Output formats read:
//! - MAIRA-2 (Bannur et al., "MAIRA-2: Grounded Radiology Report Generation", 2024; the
//!   `MAIRA2Processor` of the `microsoft/maira-2` Hub repository): a grounded phrase is
//!   `<obj>phrase</obj>` followed by zero or more `<box><xA><yB><xC><yD></box>`, where A..D are
//!   bins 0..=99 of x_low, y_low, x_high, y_high. A bin stands for its centre,
//!   `(bin + 0.5) / 100`, relative to the square the processor crops from the centre of the
//!   image (shortest side resized to 518, then centre crop 518x518), which is what its
//!   `adjust_box_for_original_image_size` undoes. Plain text without `<obj>` means no box.
//!   (The processor code lives on the Hub, unreachable from here: the format is implemented
//!   from its model card and paper and should be checked against it when the Hub is reachable.)
//! - Qwen2.5-VL (Qwen team, "Qwen2.5-VL Technical Report", 2025): a JSON list
//!   `[{"bbox_2d": [x1, y1, x2, y2], "label": "…"}]`, often inside a ```json fence, in absolute
//!   pixels of the model's resized input. Hilum sends the image already at the size
//!   `smart_resize` gives, so those are the pixels sent.
//!
//! There is no native grounding: the native backend runs LLaVA-family models (LLaVA-Med v1.5),
//! which were not trained to output boxes and do not emit them reliably. With
//! `backend = "native"` the tool is hidden from the model (`localize_finding` answers "where?"
//! for the classifier's findings) and a direct call says to configure a served grounding model.

use std::sync::Arc;

use async_trait::async_trait;
use hilum_agent::{
    Artifact, Environment, Requirements, Tool, ToolContext, ToolError, ToolOutput, Typed, TypedTool,
};
use hilum_imaging::ImageStore;
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{json, Value};
use thiserror::Error;

use crate::common::ImageId;
use crate::vlm::{self, Family, SentImage, VlmSettings};

/// The tool's name, as models call it.
pub const NAME: &str = "ground_phrase";
/// MAIRA-2's number of coordinate bins per axis.
pub const MAIRA2_BINS: u32 = 100;
/// Longest side of the rendered PNG.
pub(crate) const RENDER_MAX_SIDE: u32 = 1024;

/// A box in original-image pixels, corners inclusive-exclusive: `[x1, x2) x [y1, y2)`.
#[derive(Clone, Debug, PartialEq)]
pub struct PixelBox {
    /// The phrase the box is for.
    pub label: String,
    /// Left edge.
    pub x1: f64,
    /// Top edge.
    pub y1: f64,
    /// Right edge.
    pub x2: f64,
    /// Bottom edge.
    pub y2: f64,
}

impl PixelBox {
    /// The box as the tool reports it, corners rounded to a tenth of a pixel.
    pub fn to_json(&self) -> Value {
        let r = |v: f64| (v * 10.0).round() / 10.0;
        json!({
            "label": self.label,
            "x": r(self.x1), "y": r(self.y1),
            "w": r(self.x2 - self.x1), "h": r(self.y2 - self.y1),
            "x1": r(self.x1), "y1": r(self.y1), "x2": r(self.x2), "y2": r(self.y2),
        })
    }
}

/// The model's text could not be read as grounding output.
#[derive(Debug, Error, PartialEq)]
#[error("the {family} grounding output could not be read: {reason} (model said: {excerpt:?})")]
pub struct ParseError {
    /// The model family whose output this was.
    pub family: &'static str,
    /// What was wrong with it.
    pub reason: String,
    /// The start of the output, to show what the model said.
    pub excerpt: String,
}

fn perr(family: Family, text: &str, reason: impl Into<String>) -> ParseError {
    ParseError {
        family: family.as_str(),
        reason: reason.into(),
        excerpt: text.chars().take(160).collect(),
    }
}

/// A phrase with boxes relative to MAIRA-2's centre crop (0..1).
#[derive(Clone, Debug, PartialEq)]
pub struct Maira2Phrase {
    /// The phrase as the model wrote it.
    pub phrase: String,
    /// Its boxes, `[x1, y1, x2, y2]` as fractions of the image's size (bin centres).
    pub boxes: Vec<[f64; 4]>,
}

/// Splits text into `<tag>` tokens and the text between them.
fn tokens(text: &str) -> Vec<(bool, &str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find('<') {
        match rest[start..].find('>') {
            Some(len) => {
                if start > 0 {
                    out.push((false, &rest[..start]));
                }
                out.push((true, &rest[start..start + len + 1]));
                rest = &rest[start + len + 1..];
            }
            None => break,
        }
    }
    if !rest.is_empty() {
        out.push((false, rest));
    }
    out
}

fn coord_bin(tag: &str, axis: char) -> Option<u32> {
    let inner = tag.strip_prefix('<')?.strip_suffix('>')?;
    let n = inner.strip_prefix(axis)?;
    n.parse().ok().filter(|&b| b < MAIRA2_BINS)
}

/// Parses MAIRA-2's grounded output. Phrases without boxes are kept with an empty list.
pub fn parse_maira2(text: &str) -> Result<Vec<Maira2Phrase>, ParseError> {
    let f = Family::Maira2;
    let toks = tokens(text);
    let mut out: Vec<Maira2Phrase> = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match toks[i] {
            (true, "<obj>") => {
                let mut phrase = String::new();
                i += 1;
                loop {
                    match toks.get(i) {
                        Some((false, t)) => phrase.push_str(t),
                        Some((true, "</obj>")) => break,
                        Some((true, t)) => {
                            return Err(perr(f, text, format!("unexpected {t} inside <obj>")))
                        }
                        None => return Err(perr(f, text, "<obj> is never closed by </obj>")),
                    }
                    i += 1;
                }
                i += 1;
                out.push(Maira2Phrase {
                    phrase: phrase.trim().to_string(),
                    boxes: Vec::new(),
                });
            }
            (true, "<box>") => {
                let Some(last) = out.last_mut() else {
                    return Err(perr(f, text, "<box> before any <obj>phrase</obj>"));
                };
                let want = ['x', 'y', 'x', 'y'];
                let mut bins = [0u32; 4];
                for (k, axis) in want.iter().enumerate() {
                    let tag = match toks.get(i + 1 + k) {
                        Some((true, t)) if *t != "</box>" => *t,
                        _ => {
                            return Err(perr(
                                f,
                                text,
                                "a <box> must hold four coordinate tokens <x..><y..><x..><y..>",
                            ))
                        }
                    };
                    bins[k] = coord_bin(tag, *axis).ok_or_else(|| {
                        perr(
                            f,
                            text,
                            format!(
                                "{tag} is not a <{axis}N> token with N in 0..{}",
                                MAIRA2_BINS - 1
                            ),
                        )
                    })?;
                }
                if toks.get(i + 5) != Some(&(true, "</box>")) {
                    return Err(perr(
                        f,
                        text,
                        "<box> is not closed by </box> after 4 tokens",
                    ));
                }
                if bins[0] > bins[2] || bins[1] > bins[3] {
                    return Err(perr(f, text, "box has x_low > x_high or y_low > y_high"));
                }
                let rel = |b: u32| (b as f64 + 0.5) / MAIRA2_BINS as f64;
                last.boxes
                    .push([rel(bins[0]), rel(bins[1]), rel(bins[2]), rel(bins[3])]);
                i += 6;
            }
            (true, t @ ("</obj>" | "</box>")) => {
                return Err(perr(f, text, format!("{t} without its opening tag")))
            }
            // Free text between grounded phrases, and special tokens such as </s>.
            _ => i += 1,
        }
    }
    Ok(out)
}

/// Original-image pixels of a MAIRA-2 box (relative to the centre square of the image).
pub fn maira2_to_pixels(rel: [f64; 4], width: u32, height: u32) -> [f64; 4] {
    let side = width.min(height) as f64;
    let (ox, oy) = ((width as f64 - side) / 2.0, (height as f64 - side) / 2.0);
    [
        ox + rel[0] * side,
        oy + rel[1] * side,
        ox + rel[2] * side,
        oy + rel[3] * side,
    ]
}

/// The JSON part of a model answer: a ```json fence, else the outermost `[...]` or `{...}`.
fn json_part(text: &str) -> Option<&str> {
    if let Some(start) = text.find("```") {
        let after = &text[start + 3..];
        let body = after.strip_prefix("json").unwrap_or(after);
        if let Some(end) = body.find("```") {
            return Some(body[..end].trim());
        }
    }
    let open = text.find(['[', '{'])?;
    let close = text.rfind([']', '}'])?;
    (close > open).then(|| &text[open..=close])
}

/// Parses Qwen2.5-VL JSON boxes: (label, [x1, y1, x2, y2]) in the pixels of the input.
pub fn parse_qwen_boxes(text: &str, family: Family) -> Result<Vec<(String, [f64; 4])>, ParseError> {
    let part = json_part(text)
        .ok_or_else(|| perr(family, text, "no JSON list of {\"bbox_2d\": [...]} found"))?;
    let v: Value = serde_json::from_str(part)
        .map_err(|e| perr(family, text, format!("the JSON is not valid: {e}")))?;
    let items = match v {
        Value::Array(a) => a,
        obj @ Value::Object(_) => vec![obj],
        _ => return Err(perr(family, text, "expected a JSON list of boxes")),
    };
    items
        .iter()
        .map(|it| {
            let b = it
                .get("bbox_2d")
                .or_else(|| it.get("bbox"))
                .and_then(Value::as_array)
                .ok_or_else(|| perr(family, text, "an item has no \"bbox_2d\" list"))?;
            let c: Vec<f64> = b.iter().filter_map(Value::as_f64).collect();
            if c.len() != 4 || b.len() != 4 {
                return Err(perr(family, text, "\"bbox_2d\" must hold 4 numbers"));
            }
            if c[0] > c[2] || c[1] > c[3] || c.iter().any(|v| !v.is_finite() || *v < 0.0) {
                return Err(perr(
                    family,
                    text,
                    format!("box {c:?} is not [x1, y1, x2, y2] with x1 <= x2, y1 <= y2"),
                ));
            }
            let label = it
                .get("label")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            Ok((label, [c[0], c[1], c[2], c[3]]))
        })
        .collect()
}

/// Reads the model's answer as boxes in original-image pixels.
pub fn boxes_from_output(
    text: &str,
    family: Family,
    sent: &SentImage,
    phrase: &str,
) -> Result<Vec<PixelBox>, ParseError> {
    let (ow, oh) = (sent.orig_width as f64, sent.orig_height as f64);
    let clamp = |label: String, b: [f64; 4]| PixelBox {
        label,
        x1: b[0].clamp(0.0, ow),
        y1: b[1].clamp(0.0, oh),
        x2: b[2].clamp(0.0, ow),
        y2: b[3].clamp(0.0, oh),
    };
    let maira = |text: &str| -> Result<Vec<PixelBox>, ParseError> {
        Ok(parse_maira2(text)?
            .into_iter()
            .flat_map(|p| {
                let label = if p.phrase.is_empty() {
                    phrase.to_string()
                } else {
                    p.phrase
                };
                p.boxes.into_iter().map(move |b| (label.clone(), b))
            })
            .map(|(l, b)| clamp(l, maira2_to_pixels(b, sent.orig_width, sent.orig_height)))
            .collect())
    };
    let (sx, sy) = (ow / sent.width as f64, oh / sent.height as f64);
    let qwen = |text: &str, family: Family| -> Result<Vec<PixelBox>, ParseError> {
        let boxes = parse_qwen_boxes(text, family)?;
        // Generic models sometimes answer in 0..1; Qwen never does.
        let relative = family == Family::Generic
            && !boxes.is_empty()
            && boxes.iter().all(|(_, b)| b.iter().all(|v| *v <= 1.0));
        let (fx, fy) = if relative { (ow, oh) } else { (sx, sy) };
        Ok(boxes
            .into_iter()
            .map(|(l, b)| {
                let label = if l.is_empty() { phrase.to_string() } else { l };
                clamp(label, [b[0] * fx, b[1] * fy, b[2] * fx, b[3] * fy])
            })
            .collect())
    };
    match family {
        Family::Maira2 => maira(text),
        Family::Qwen25Vl => qwen(text, family),
        Family::Generic if text.contains("<box>") || text.contains("<obj>") => maira(text),
        Family::Generic => qwen(text, family),
    }
}

/// Colour of the n-th box.
pub(crate) fn palette(i: usize) -> [u8; 3] {
    const P: [[u8; 3]; 6] = [
        [255, 64, 64],
        [64, 200, 255],
        [255, 200, 0],
        [80, 255, 120],
        [255, 96, 255],
        [255, 140, 40],
    ];
    P[i % P.len()]
}

/// Draws rectangle outlines (original-pixel corners) on an RGB image of `scale` x the original.
pub(crate) fn draw_boxes(canvas: &mut image::RgbImage, boxes: &[PixelBox], scale: f64) {
    let (w, h) = (canvas.width() as i64, canvas.height() as i64);
    let t = (w.max(h) / 300).max(2);
    for (i, b) in boxes.iter().enumerate() {
        let c = image::Rgb(palette(i));
        let x1 = (b.x1 * scale).round() as i64;
        let y1 = (b.y1 * scale).round() as i64;
        let x2 = ((b.x2 * scale).round() as i64 - 1).max(x1);
        let y2 = ((b.y2 * scale).round() as i64 - 1).max(y1);
        let mut put = |x: i64, y: i64| {
            if (0..w).contains(&x) && (0..h).contains(&y) {
                canvas.put_pixel(x as u32, y as u32, c);
            }
        };
        for d in 0..t {
            for x in x1..=x2 {
                put(x, y1 + d);
                put(x, y2 - d);
            }
            for y in y1..=y2 {
                put(x1 + d, y);
                put(x2 - d, y);
            }
        }
    }
}

/// The radiograph, grey, at most `RENDER_MAX_SIDE` on its longest side, and the scale used.
pub(crate) fn base_canvas(
    img: &hilum_imaging::CxrImage,
) -> Result<(image::RgbImage, f64), ToolError> {
    let gray = vlm::to_gray8(img)?;
    let scale = (RENDER_MAX_SIDE as f64 / img.width.max(img.height) as f64).min(1.0);
    let gray = if scale < 1.0 {
        let w = ((img.width as f64 * scale).round() as u32).max(1);
        let h = ((img.height as f64 * scale).round() as u32).max(1);
        image::imageops::resize(&gray, w, h, image::imageops::FilterType::Triangle)
    } else {
        gray
    };
    Ok((image::DynamicImage::ImageLuma8(gray).to_rgb8(), scale))
}

pub(crate) fn encode_png(img: image::RgbImage) -> Result<Vec<u8>, ToolError> {
    let mut buf = std::io::Cursor::new(Vec::new());
    image::DynamicImage::ImageRgb8(img)
        .write_to(&mut buf, image::ImageFormat::Png)
        .map_err(|e| ToolError::Internal(format!("PNG encoding: {e}")))?;
    Ok(buf.into_inner())
}

/// The prompt for `family`: MAIRA-2's phrase-grounding task, or a Qwen-style JSON request.
pub fn grounding_prompt(family: Family, phrase: &str) -> (Option<&'static str>, String) {
    match family {
        Family::Maira2 => (
            Some("You are an expert radiology assistant tasked with interpreting a chest X-ray study."),
            format!(
                "Repeat the following finding as a grounded phrase with bounding boxes, if \
                 applicable. {phrase}"
            ),
        ),
        Family::Qwen25Vl | Family::Generic => (
            None,
            format!(
                "Locate every region of this chest X-ray showing: {phrase}. Output the bounding \
                 box coordinates in JSON format, as [{{\"bbox_2d\": [x1, y1, x2, y2], \"label\": \
                 \"...\"}}]. Output [] if it is not present."
            ),
        ),
    }
}

/// The `ground_phrase` tool: boxes around a finding named in words, from a grounding VLM.
pub struct GroundPhrase {
    store: Arc<ImageStore>,
    settings: Arc<VlmSettings>,
}

// The arguments of `ground_phrase` as the model sends them.
// (A plain comment and no doc lint: a doc comment would become the schema's description.)
#[allow(missing_docs)]
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Args {
    image: ImageId,
    /// The finding to localise, in a few words
    #[schemars(length(min = 2, max = 300))]
    phrase: String,
}

impl GroundPhrase {
    /// The tool, ready to register (its schema generated from its arguments' type).
    pub fn new(store: Arc<ImageStore>, settings: Arc<VlmSettings>) -> Typed<Self> {
        Typed::new(GroundPhrase { store, settings })
    }
}

impl crate::BuildTool for GroundPhrase {
    fn build(deps: &crate::ToolDeps) -> Arc<dyn Tool> {
        Arc::new(GroundPhrase::new(deps.images.clone(), deps.vlm.clone()))
    }
}

#[async_trait]
impl TypedTool for GroundPhrase {
    type Args = Args;
    const NAME: &'static str = NAME;

    fn description(&self) -> String {
        "Finds where a finding described in words is on a chest radiograph \
         (phrase grounding with a served vision-language model such as MAIRA-2 or \
         Qwen2.5-VL). Give one short finding phrase, e.g. \"left pleural effusion\" or \
         \"right upper lobe opacity\". Returns boxes in original-image pixels (x, y, w, \
         h) and an image with the boxes drawn. No box means the model did not localise \
         it; it is not proof of absence."
            .into()
    }

    fn requirements(&self) -> Requirements {
        Requirements {
            vlm: true,
            ..Requirements::NONE
        }
    }

    fn available(&self, _env: &Environment) -> bool {
        // A broken configuration stays visible so that the call can say what is wrong.
        !matches!(
            self.settings.backend(NAME),
            Ok(None) | Ok(Some(vlm::Backend::Native(_) | vlm::Backend::LocalVlm(_)))
        )
    }

    async fn run(&self, _ctx: &ToolContext, args: Args) -> Result<ToolOutput, ToolError> {
        let img = args.image.load(&self.store)?;
        let id = args.image.0;
        let phrase = args.phrase.trim().to_string();
        if phrase.is_empty() {
            return Err(ToolError::InvalidArguments(
                "`phrase` must be a finding".into(),
            ));
        }
        let native = match self.settings.backend(NAME)? {
            Some(vlm::Backend::Native(n)) => Some(format!("`{}` (LLaVA family)", n.model)),
            Some(vlm::Backend::LocalVlm(m)) => Some(format!(
                "`{}{}` (Gemma 3 multimodal)",
                vlm::LOCAL_VLM_PREFIX,
                m.spec
            )),
            _ => None,
        };
        if let Some(model) = native {
            return Err(ToolError::Unprocessable(format!(
                "ground_phrase has no native backend: {model} does not output boxes \
                 reliably. Configure a served grounding model (MAIRA-2 or Qwen2.5-VL) in \
                 [vlm.tools.ground_phrase] with backend = \"served\", base_url, model and family; \
                 for the classifier's 18 findings localize_finding gives boxes natively"
            )));
        }
        let client = vlm::client_for(&self.settings, NAME)?;
        let family = client.endpoint.family;
        let sent = vlm::prepare_image_blocking(img.clone(), client.endpoint.clone()).await?;
        let (system, prompt) = grounding_prompt(family, &phrase);
        let answer = client.ask(&sent, system, &prompt).await?;
        let boxes = boxes_from_output(&answer.text, family, &sent, &phrase)
            .map_err(|e| ToolError::Unprocessable(e.to_string()))?;

        let (mut canvas, scale) = base_canvas(&img)?;
        draw_boxes(&mut canvas, &boxes, scale);
        let png = encode_png(canvas)?;
        let summary = if boxes.is_empty() {
            format!(
                "{id}: {} did not localise \"{phrase}\" (no box)",
                answer.model
            )
        } else {
            let list: Vec<String> = boxes
                .iter()
                .map(|b| {
                    format!(
                        "{} at x={:.0} y={:.0} w={:.0} h={:.0}",
                        b.label,
                        b.x1,
                        b.y1,
                        b.x2 - b.x1,
                        b.y2 - b.y1
                    )
                })
                .collect();
            format!(
                "{id}: {} box(es) for \"{phrase}\" from {}: {}",
                boxes.len(),
                answer.model,
                list.join("; ")
            )
        };
        let data = json!({
            "image": id,
            "phrase": phrase,
            "width": img.width,
            "height": img.height,
            "boxes": boxes.iter().map(PixelBox::to_json).collect::<Vec<_>>(),
            "model": answer.model,
            "family": family.as_str(),
            "raw_output": answer.text,
            "sent_size": [sent.width, sent.height],
            "completion_tokens": answer.completion_tokens,
            "latency_ms": (answer.latency_ms * 100.0).round() / 100.0,
            "coordinates": "original-image pixels; x, y = top-left corner",
        });
        Ok(ToolOutput::new(summary, data).with_artifact(Artifact::png(
            "grounding_boxes.png",
            "boxes",
            png,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maira2_tokens_parse_to_bin_centres() {
        let p = parse_maira2(
            "<obj>Left pleural effusion.</obj><box><x55><y60><x90><y95></box> \
             <obj>Cardiomegaly.</obj><box><x20><y40><x80><y85></box><box><x0><y0><x99><y99></box>\
             <obj>No pneumothorax.</obj></s>",
        )
        .expect("valid");
        assert_eq!(p.len(), 3);
        assert_eq!(p[0].phrase, "Left pleural effusion.");
        assert_eq!(p[0].boxes, vec![[0.555, 0.605, 0.905, 0.955]]);
        assert_eq!(p[1].boxes.len(), 2);
        assert_eq!(p[1].boxes[1], [0.005, 0.005, 0.995, 0.995]);
        assert!(p[2].boxes.is_empty());
    }

    #[test]
    fn maira2_box_maps_to_centre_square_of_original() {
        // 2000 wide, 1000 high: the centre square is x in [500, 1500).
        let b = maira2_to_pixels([0.0, 0.5, 1.0, 1.0], 2000, 1000);
        assert_eq!(b, [500.0, 500.0, 1500.0, 1000.0]);
    }

    #[test]
    fn malformed_maira2_output_is_a_clear_error() {
        for bad in [
            "<obj>effusion</obj><box><x10><y20><x30></box>",
            "<obj>effusion</obj><box><x10><y20><x300><y40></box>",
            "<obj>effusion<box><x10><y20><x30><y40></box>",
            "<box><x10><y20><x30><y40></box>",
            "<obj>effusion</obj><box><x50><y20><x30><y40></box>",
        ] {
            let e = parse_maira2(bad).expect_err(bad);
            assert_eq!(e.family, "maira2");
            assert!(e.to_string().contains("could not be read"), "{e}");
        }
    }

    #[test]
    fn qwen_json_in_fence_parses_and_bad_json_fails() {
        let ok =
            "```json\n[\n\t{\"bbox_2d\": [120, 300, 410, 700], \"label\": \"effusion\"}\n]\n```";
        let b = parse_qwen_boxes(ok, Family::Qwen25Vl).expect("valid");
        assert_eq!(
            b,
            vec![("effusion".to_string(), [120.0, 300.0, 410.0, 700.0])]
        );
        assert!(parse_qwen_boxes("[]", Family::Qwen25Vl)
            .expect("empty")
            .is_empty());
        for bad in [
            "The effusion is at the left base.",
            "[{\"bbox_2d\": [1, 2, 3]}]",
            "[{\"box\": [1, 2, 3, 4]}]",
            "[{\"bbox_2d\": [400, 2, 3, 4]}]",
            "```json\n[{\"bbox_2d\": [1, 2, 3, 4],]\n```",
        ] {
            let e = parse_qwen_boxes(bad, Family::Qwen25Vl).expect_err(bad);
            assert_eq!(e.family, "qwen2.5-vl", "{bad}");
        }
    }
}
