//! Rendering of results on the original image: masks (per-structure colours, alpha, outline),
//! boxes with labels, heatmaps, and a legend; written as RGB PNG.

use serde::{Deserialize, Serialize};

use crate::font::{glyph, text_width};
use crate::transform::{resize, Filter};
use crate::{CxrImage, ImagingError};

/// An 8-bit colour: red, green, blue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    /// The conventional colour of a structure (left lung blue, right lung green, heart red, …),
    /// else a distinct colour from a fixed palette by `index`.
    pub fn for_label(label: &str, index: usize) -> Rgb {
        let l = label.to_ascii_lowercase().replace(['_', '-'], " ");
        let known: &[(&str, Rgb)] = &[
            ("left lung", Rgb(66, 133, 244)),
            ("right lung", Rgb(52, 168, 83)),
            ("lung", Rgb(0, 200, 200)),
            ("heart", Rgb(234, 67, 53)),
            ("cardio", Rgb(234, 67, 53)),
            ("mediastinum", Rgb(234, 67, 53)),
            ("airway", Rgb(0, 229, 255)),
            ("trachea", Rgb(0, 229, 255)),
            ("opacit", Rgb(251, 188, 5)),
            ("effusion", Rgb(171, 71, 188)),
            ("tube", Rgb(255, 64, 255)),
            ("line", Rgb(255, 64, 255)),
            ("clavicle", Rgb(255, 255, 255)),
            ("rib", Rgb(200, 200, 200)),
        ];
        if let Some((_, c)) = known.iter().find(|(k, _)| l.contains(k)) {
            return *c;
        }
        const PALETTE: [Rgb; 8] = [
            Rgb(255, 99, 71),
            Rgb(60, 179, 113),
            Rgb(30, 144, 255),
            Rgb(255, 215, 0),
            Rgb(238, 130, 238),
            Rgb(0, 206, 209),
            Rgb(255, 140, 0),
            Rgb(154, 205, 50),
        ];
        PALETTE[index % PALETTE.len()]
    }
}

/// A mask over the image: values in 0..=1 at any resolution, drawn where > 0.5.
#[derive(Clone, Debug, PartialEq)]
pub struct MaskLayer {
    /// What the mask shows (legend text).
    pub label: String,
    /// Columns of `data`.
    pub width: u32,
    /// Rows of `data`.
    pub height: u32,
    /// `width * height` values, row-major.
    pub data: Vec<f32>,
    /// Its colour; by label when `None`.
    pub color: Option<Rgb>,
    /// Fill opacity, 0..=1 (the outline is opaque).
    pub alpha: f32,
}

/// A box in original-image pixels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Box2d {
    /// Left edge.
    pub x: f64,
    /// Top edge.
    pub y: f64,
    /// Width.
    pub w: f64,
    /// Height.
    pub h: f64,
    /// What the box shows (drawn beside it).
    pub label: String,
    /// A score shown after the label.
    #[serde(default)]
    pub score: Option<f64>,
    /// Its colour; by label when `None`.
    #[serde(default)]
    pub color: Option<Rgb>,
}

/// How a heatmap's values become colours.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Colormap {
    /// Blue to red through green and yellow.
    #[default]
    Jet,
    /// Black to white through red and yellow.
    Hot,
}

/// `t` in 0..=1 to a colour.
pub fn colormap(map: Colormap, t: f32) -> Rgb {
    let t = t.clamp(0.0, 1.0);
    let c = |v: f32| (v.clamp(0.0, 1.0) * 255.0).round() as u8;
    match map {
        Colormap::Jet => Rgb(
            c(1.5 - (4.0 * t - 3.0).abs()),
            c(1.5 - (4.0 * t - 2.0).abs()),
            c(1.5 - (4.0 * t - 1.0).abs()),
        ),
        Colormap::Hot => Rgb(c(3.0 * t), c(3.0 * t - 1.0), c(3.0 * t - 2.0)),
    }
}

/// A heatmap (class activation, saliency): any values at any resolution, normalised to their
/// own min..max; values below `threshold` (after normalisation) are not drawn.
#[derive(Clone, Debug, PartialEq)]
pub struct Heatmap {
    /// What the map shows (legend text).
    pub label: String,
    /// Columns of `data`.
    pub width: u32,
    /// Rows of `data`.
    pub height: u32,
    /// `width * height` values, row-major.
    pub data: Vec<f32>,
    /// Its colours.
    pub colormap: Colormap,
    /// Opacity, 0..=1.
    pub alpha: f32,
    /// Normalised values below this are not drawn.
    pub threshold: f32,
}

/// What to draw and how big.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overlay {
    /// Masks, drawn first.
    pub masks: Vec<MaskLayer>,
    /// Boxes, drawn last.
    pub boxes: Vec<Box2d>,
    /// Heatmaps, drawn over the masks.
    pub heatmaps: Vec<Heatmap>,
    /// Longest side of the output (the image is downscaled, never upscaled); `None` keeps it.
    pub max_side: Option<u32>,
    /// Draw a legend of the labels.
    pub legend: bool,
    /// Display window on the canonical values; `None` = 0.5th..99.5th percentile.
    pub window: Option<(f32, f32)>,
}

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<[u8; 3]>,
}

impl Canvas {
    fn blend(&mut self, x: usize, y: usize, c: Rgb, a: f32) {
        if x < self.w && y < self.h {
            let p = &mut self.px[y * self.w + x];
            let mix = |o: u8, n: u8| (o as f32 * (1.0 - a) + n as f32 * a).round() as u8;
            *p = [mix(p[0], c.0), mix(p[1], c.1), mix(p[2], c.2)];
        }
    }

    fn fill(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb, a: f32) {
        let (x0, x1) = (x0.max(0) as usize, (x1.max(0) as usize).min(self.w));
        let (y0, y1) = (y0.max(0) as usize, (y1.max(0) as usize).min(self.h));
        for y in y0..y1 {
            for x in x0..x1 {
                self.blend(x, y, c, a);
            }
        }
    }

    fn text(&mut self, x: i64, y: i64, s: &str, scale: u32, c: Rgb) {
        let sc = scale as i64;
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch);
            for (row, bits) in g.iter().enumerate() {
                for col in 0..5 {
                    if bits & (0x10 >> col) != 0 {
                        let px = x + (i as i64 * 6 + col) * sc;
                        let py = y + row as i64 * sc;
                        self.fill(px, py, px + sc, py + sc, c, 1.0);
                    }
                }
            }
        }
    }
}

impl Overlay {
    /// Renders onto the image; returns (width, height, RGB bytes).
    pub fn render(&self, img: &CxrImage) -> Result<(u32, u32, Vec<u8>), ImagingError> {
        let (sw, sh) = (img.width as usize, img.height as usize);
        if sw == 0 || sh == 0 || img.pixels.len() < sw * sh {
            return Err(ImagingError::InvalidTransform(
                "the image has no pixels".into(),
            ));
        }
        let s = match self.max_side {
            Some(m) if (m as usize) < sw.max(sh) && m > 0 => m as f64 / sw.max(sh) as f64,
            _ => 1.0,
        };
        let (w, h) = (
            ((sw as f64 * s).round() as usize).max(1),
            ((sh as f64 * s).round() as usize).max(1),
        );
        let base = resize(&img.pixels, sw, sh, w, h, Filter::Area);
        let (lo, hi) = self
            .window
            .unwrap_or_else(|| percentiles(&base, img.max_value()));
        let span = (hi - lo).max(1e-6);
        let mut cv = Canvas {
            w,
            h,
            px: base
                .iter()
                .map(|&v| {
                    let g = (((v - lo) / span).clamp(0.0, 1.0) * 255.0).round() as u8;
                    [g, g, g]
                })
                .collect(),
        };
        let mut legend: Vec<(String, Rgb)> = Vec::new();

        for hm in &self.heatmaps {
            let map = layer_at(&hm.data, hm.width, hm.height, w, h, &hm.label)?;
            let (mn, mx) = map
                .iter()
                .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
            let range = (mx - mn).max(1e-12);
            for (i, &v) in map.iter().enumerate() {
                let t = (v - mn) / range;
                if t >= hm.threshold {
                    cv.blend(
                        i % w,
                        i / w,
                        colormap(hm.colormap, t),
                        hm.alpha.clamp(0.0, 1.0),
                    );
                }
            }
            legend.push((
                format!("{} (heatmap)", hm.label),
                colormap(hm.colormap, 1.0),
            ));
        }

        for (k, m) in self.masks.iter().enumerate() {
            let color = m.color.unwrap_or_else(|| Rgb::for_label(&m.label, k));
            let map = layer_at(&m.data, m.width, m.height, w, h, &m.label)?;
            let on = |x: usize, y: usize| map[y * w + x] > 0.5;
            for y in 0..h {
                for x in 0..w {
                    if !on(x, y) {
                        continue;
                    }
                    let edge = x == 0
                        || y == 0
                        || x + 1 == w
                        || y + 1 == h
                        || !on(x - 1, y)
                        || !on(x + 1, y)
                        || !on(x, y - 1)
                        || !on(x, y + 1);
                    cv.blend(
                        x,
                        y,
                        color,
                        if edge { 1.0 } else { m.alpha.clamp(0.0, 1.0) },
                    );
                }
            }
            legend.push((m.label.clone(), color));
        }

        let scale_text = ((w.max(h) as f64 / 500.0).round() as u32).max(1);
        let thick = (w.max(h) / 400).max(2) as i64;
        for (k, b) in self.boxes.iter().enumerate() {
            let color = b
                .color
                .unwrap_or_else(|| Rgb::for_label(&b.label, k + self.masks.len()));
            let (x0, y0) = ((b.x * s).round() as i64, (b.y * s).round() as i64);
            let (x1, y1) = (
                ((b.x + b.w) * s).round() as i64,
                ((b.y + b.h) * s).round() as i64,
            );
            cv.fill(x0, y0, x1, y0 + thick, color, 1.0);
            cv.fill(x0, y1 - thick, x1, y1, color, 1.0);
            cv.fill(x0, y0, x0 + thick, y1, color, 1.0);
            cv.fill(x1 - thick, y0, x1, y1, color, 1.0);
            let text = match b.score {
                Some(p) => format!("{} {:.2}", b.label, p),
                None => b.label.clone(),
            };
            let th = 7 * scale_text as i64 + 4;
            let ty = if y0 - th >= 0 { y0 - th } else { y1 };
            let tw = text_width(&text, scale_text) as i64 + 4;
            cv.fill(x0, ty, x0 + tw, ty + th, Rgb(0, 0, 0), 0.7);
            cv.text(x0 + 2, ty + 2, &text, scale_text, color);
            if !legend.iter().any(|(l, _)| *l == b.label) {
                legend.push((b.label.clone(), color));
            }
        }

        if self.legend && !legend.is_empty() {
            let line = 9 * scale_text as i64 + 4;
            let widest = legend
                .iter()
                .map(|(l, _)| text_width(l, scale_text))
                .max()
                .unwrap_or(0) as i64;
            let (px, py) = (6i64, 6i64);
            let box_w = widest + line + 12;
            cv.fill(
                px,
                py,
                px + box_w,
                py + line * legend.len() as i64 + 6,
                Rgb(0, 0, 0),
                0.6,
            );
            for (i, (label, color)) in legend.iter().enumerate() {
                let y = py + 4 + i as i64 * line;
                let sq = 7 * scale_text as i64;
                cv.fill(px + 4, y, px + 4 + sq, y + sq, *color, 1.0);
                cv.text(px + 8 + sq, y, label, scale_text, Rgb(255, 255, 255));
            }
        }
        let bytes = cv.px.into_iter().flatten().collect();
        Ok((w as u32, h as u32, bytes))
    }

    /// Renders and encodes as PNG.
    pub fn render_png(&self, img: &CxrImage) -> Result<Vec<u8>, ImagingError> {
        let (w, h, rgb) = self.render(img)?;
        encode_png(w, h, &rgb, 3)
    }
}

/// Encodes 8-bit gray (`channels` 1) or RGB (3) pixels as PNG.
pub fn encode_png(w: u32, h: u32, data: &[u8], channels: u8) -> Result<Vec<u8>, ImagingError> {
    let color = match channels {
        1 => image::ExtendedColorType::L8,
        3 => image::ExtendedColorType::Rgb8,
        n => {
            return Err(ImagingError::Encode {
                what: "png".into(),
                reason: format!("{n} channels"),
            })
        }
    };
    let mut out = Vec::new();
    image::ImageEncoder::write_image(
        image::codecs::png::PngEncoder::new(&mut out),
        data,
        w,
        h,
        color,
    )
    .map_err(|e| ImagingError::Encode {
        what: "png".into(),
        reason: e.to_string(),
    })?;
    Ok(out)
}

/// A layer resampled to the canvas size.
fn layer_at(
    data: &[f32],
    lw: u32,
    lh: u32,
    w: usize,
    h: usize,
    label: &str,
) -> Result<Vec<f32>, ImagingError> {
    let (lw, lh) = (lw as usize, lh as usize);
    if lw == 0 || lh == 0 || data.len() != lw * lh {
        return Err(ImagingError::InvalidTransform(format!(
            "layer `{label}` has {} values for {lw}x{lh}",
            data.len()
        )));
    }
    Ok(resize(data, lw, lh, w, h, Filter::Bilinear))
}

/// 0.5th and 99.5th percentiles (a robust display window), from a 4096-bin histogram.
fn percentiles(px: &[f32], max: f32) -> (f32, f32) {
    let bins = 4096usize;
    let mut hist = vec![0u64; bins];
    let scale = bins as f32 / (max + 1.0);
    for &v in px {
        hist[((v.max(0.0) * scale) as usize).min(bins - 1)] += 1;
    }
    let n = px.len() as u64;
    let find = |q: f64| {
        let target = ((n as f64) * q).ceil() as u64;
        let mut acc = 0;
        for (i, c) in hist.iter().enumerate() {
            acc += c;
            if acc >= target.max(1) {
                return i as f32 / scale;
            }
        }
        max
    };
    let (lo, hi) = (find(0.005), find(0.995));
    if hi - lo < 1.0 {
        (0.0, max)
    } else {
        (lo, hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ImageMeta;

    fn gray(w: u32, h: u32, v: f32) -> CxrImage {
        CxrImage {
            width: w,
            height: h,
            pixels: vec![v; (w * h) as usize],
            meta: ImageMeta {
                bit_depth: 8,
                ..Default::default()
            },
        }
    }

    #[test]
    fn mask_is_tinted_in_its_colour_and_outside_untouched() {
        let img = gray(40, 40, 100.0);
        let mut data = vec![0.0; 100];
        for y in 2..8 {
            for x in 2..8 {
                data[y * 10 + x] = 1.0;
            }
        }
        let o = Overlay {
            masks: vec![MaskLayer {
                label: "heart".into(),
                width: 10,
                height: 10,
                data,
                color: None,
                alpha: 0.5,
            }],
            window: Some((0.0, 255.0)),
            ..Default::default()
        };
        let (w, _, rgb) = o.render(&img).unwrap();
        let at = |x: usize, y: usize| &rgb[(y * w as usize + x) * 3..(y * w as usize + x) * 3 + 3];
        // Inside: red dominates; outside: the gray value 100.
        let inside = at(20, 20);
        assert!(inside[0] > inside[1] + 50, "{inside:?}");
        assert_eq!(at(2, 37), &[100, 100, 100]);
    }

    #[test]
    fn box_outline_and_label_drawn_and_png_decodes() {
        let img = gray(200, 100, 0.0);
        let o = Overlay {
            boxes: vec![Box2d {
                x: 50.0,
                y: 40.0,
                w: 100.0,
                h: 50.0,
                label: "Nodule".into(),
                score: Some(0.9),
                color: Some(Rgb(0, 255, 0)),
            }],
            legend: true,
            ..Default::default()
        };
        let png = o.render_png(&img).unwrap();
        let back = image::load_from_memory(&png).unwrap().to_rgb8();
        assert_eq!(back.dimensions(), (200, 100));
        assert_eq!(back.get_pixel(100, 40).0, [0, 255, 0]);
        assert_eq!(back.get_pixel(100, 65).0, [0, 0, 0]);
        // Label text pixels exist above the box.
        let green_above = (50..150)
            .flat_map(|x| (26..40).map(move |y| (x, y)))
            .filter(|&(x, y)| back.get_pixel(x, y).0 == [0, 255, 0])
            .count();
        assert!(green_above > 20, "{green_above}");
    }

    #[test]
    fn jet_runs_blue_to_red() {
        let lo = colormap(Colormap::Jet, 0.0);
        let hi = colormap(Colormap::Jet, 1.0);
        assert!(lo.2 > 100 && lo.0 == 0);
        assert!(hi.0 > 100 && hi.2 == 0);
    }
}
