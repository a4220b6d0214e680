//! PNG figures drawn with plotters on a small in-memory RGB backend whose text is Hilum's 5x7
//! bitmap font: no font files, no fontconfig, so figures draw the same on a bare server.

use std::convert::Infallible;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters_backend::text_anchor::{HPos, VPos};
use plotters_backend::{
    BackendColor, BackendCoord, BackendTextStyle, DrawingBackend, DrawingErrorKind,
};

use crate::score::Summary;
use crate::EvalError;

/// An RGB pixel buffer that plotters draws on.
pub struct Canvas {
    w: u32,
    h: u32,
    rgb: Vec<u8>,
}

impl Canvas {
    /// A white canvas of `w` x `h` pixels.
    pub fn new(w: u32, h: u32) -> Canvas {
        Canvas {
            w,
            h,
            rgb: vec![255; w as usize * h as usize * 3],
        }
    }

    /// The canvas as PNG bytes.
    pub fn png(&self) -> Result<Vec<u8>, EvalError> {
        let img = image::RgbImage::from_raw(self.w, self.h, self.rgb.clone())
            .ok_or_else(|| EvalError::Invalid("figure buffer has the wrong size".into()))?;
        let mut out = std::io::Cursor::new(Vec::new());
        image::DynamicImage::ImageRgb8(img)
            .write_to(&mut out, image::ImageFormat::Png)
            .map_err(|e| EvalError::Invalid(format!("cannot encode the figure as PNG: {e}")))?;
        Ok(out.into_inner())
    }
}

/// Glyph scale for a requested font size in pixels (the font is 7 pixels tall).
fn scale_of(size: f64) -> i32 {
    ((size / 9.0).round() as i32).max(1)
}

impl DrawingBackend for &mut Canvas {
    type ErrorType = Infallible;

    fn get_size(&self) -> (u32, u32) {
        (self.w, self.h)
    }

    fn ensure_prepared(&mut self) -> Result<(), DrawingErrorKind<Infallible>> {
        Ok(())
    }

    fn present(&mut self) -> Result<(), DrawingErrorKind<Infallible>> {
        Ok(())
    }

    fn draw_pixel(
        &mut self,
        (x, y): BackendCoord,
        c: BackendColor,
    ) -> Result<(), DrawingErrorKind<Infallible>> {
        if x < 0 || y < 0 || x >= self.w as i32 || y >= self.h as i32 {
            return Ok(());
        }
        let i = (y as usize * self.w as usize + x as usize) * 3;
        let a = c.alpha.clamp(0.0, 1.0);
        for (k, v) in [c.rgb.0, c.rgb.1, c.rgb.2].into_iter().enumerate() {
            let old = self.rgb[i + k] as f64;
            self.rgb[i + k] = (old * (1.0 - a) + v as f64 * a).round() as u8;
        }
        Ok(())
    }

    fn draw_text<S: BackendTextStyle>(
        &mut self,
        text: &str,
        style: &S,
        pos: BackendCoord,
    ) -> Result<(), DrawingErrorKind<Infallible>> {
        let s = scale_of(style.size());
        let (w, h) = (text.chars().count() as i32 * 6 * s, 7 * s);
        let x0 = pos.0
            - match style.anchor().h_pos {
                HPos::Left => 0,
                HPos::Center => w / 2,
                HPos::Right => w,
            };
        let y0 = pos.1
            - match style.anchor().v_pos {
                VPos::Top => 0,
                VPos::Center => h / 2,
                VPos::Bottom => h,
            };
        let color = style.color();
        for (n, ch) in text.chars().enumerate() {
            let rows = hilum_imaging::font::glyph(ch);
            for (ry, bits) in rows.iter().enumerate() {
                for rx in 0..5 {
                    if bits & (0x10 >> rx) == 0 {
                        continue;
                    }
                    for dy in 0..s {
                        for dx in 0..s {
                            let x = x0 + n as i32 * 6 * s + rx * s + dx;
                            let y = y0 + ry as i32 * s + dy;
                            self.draw_pixel((x, y), color)?;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn estimate_text_size<S: BackendTextStyle>(
        &self,
        text: &str,
        style: &S,
    ) -> Result<(u32, u32), DrawingErrorKind<Infallible>> {
        let s = scale_of(style.size()) as u32;
        Ok((text.chars().count() as u32 * 6 * s, 7 * s))
    }
}

fn fig_err<E: std::fmt::Display>(e: E) -> EvalError {
    EvalError::Invalid(format!("cannot draw the figure: {e}"))
}

/// Horizontal bars with whiskers: `(label, value, low, high)` in percent.
fn bars_with_intervals(
    area: &DrawingArea<&mut Canvas, Shift>,
    title: &str,
    rows: &[(String, f64, f64, f64)],
    x_desc: &str,
) -> Result<(), EvalError> {
    let n = rows.len().max(1) as i32;
    let label_px = rows.iter().map(|r| r.0.len()).max().unwrap_or(4) as u32 * 6 + 12;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(label_px)
        .build_cartesian_2d(0f64..100f64, (0..n).into_segmented())
        .map_err(fig_err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(x_desc)
        .y_labels(rows.len() + 1)
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => rows
                .get(*i as usize)
                .map(|r| r.0.clone())
                .unwrap_or_default(),
            _ => String::new(),
        })
        .label_style(("sans-serif", 9))
        .draw()
        .map_err(fig_err)?;
    let bar = RGBColor(70, 120, 190);
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            let i = i as i32;
            let mut rect = Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (r.1, SegmentValue::Exact(i + 1)),
                ],
                bar.mix(0.8).filled(),
            );
            rect.set_margin(4, 4, 0, 0);
            rect
        }))
        .map_err(fig_err)?;
    chart
        .draw_series(rows.iter().enumerate().map(|(i, r)| {
            PathElement::new(
                vec![
                    (r.2, SegmentValue::CenterOf(i as i32)),
                    (r.3, SegmentValue::CenterOf(i as i32)),
                ],
                BLACK.stroke_width(2),
            )
        }))
        .map_err(fig_err)?;
    Ok(())
}

/// Counts per bin of `values` over `bins` equal bins from 0 to the maximum.
fn histogram(
    area: &DrawingArea<&mut Canvas, Shift>,
    title: &str,
    values: &[f64],
    x_desc: &str,
) -> Result<(), EvalError> {
    let bins = 20usize;
    let max = values.iter().copied().fold(0.0, f64::max).max(1e-9) * 1.05;
    let mut counts = vec![0u32; bins];
    for v in values {
        let b = ((v / max) * bins as f64).floor() as usize;
        counts[b.min(bins - 1)] += 1;
    }
    let top = counts.iter().copied().max().unwrap_or(1).max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(40)
        .build_cartesian_2d(0f64..max, 0u32..top + 1)
        .map_err(fig_err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("questions")
        .label_style(("sans-serif", 9))
        .draw()
        .map_err(fig_err)?;
    let w = max / bins as f64;
    chart
        .draw_series(counts.iter().enumerate().map(|(i, c)| {
            Rectangle::new(
                [(i as f64 * w, 0), ((i + 1) as f64 * w, *c)],
                RGBColor(200, 110, 60).mix(0.85).filled(),
            )
        }))
        .map_err(fig_err)?;
    Ok(())
}

/// The run's figure: accuracy per category (and overall) with 95% intervals; latency histogram.
pub fn eval_figure(s: &Summary, latencies_ms: &[f64]) -> Result<Vec<u8>, EvalError> {
    let mut canvas = Canvas::new(1200, 520);
    {
        let root = (&mut canvas).into_drawing_area();
        let (left, right) = root.split_horizontally(640);
        let mut rows: Vec<(String, f64, f64, f64)> = vec![(
            format!("overall n={}", s.overall.n),
            s.overall.accuracy * 100.0,
            s.overall.ci_low * 100.0,
            s.overall.ci_high * 100.0,
        )];
        rows.extend(s.categories.iter().map(|(c, a)| {
            (
                format!("{c} n={}", a.n),
                a.accuracy * 100.0,
                a.ci_low * 100.0,
                a.ci_high * 100.0,
            )
        }));
        rows.reverse(); // overall on top
        bars_with_intervals(&left, "Accuracy, 95% Wilson CI", &rows, "% correct")?;
        let secs: Vec<f64> = latencies_ms.iter().map(|m| m / 1e3).collect();
        histogram(&right, "Latency per question", &secs, "seconds")?;
        root.present().map_err(fig_err)?;
    }
    canvas.png()
}

/// `hilum bench --plot`: per-tool p50/p95 and the parallel round against the same calls one by
/// one. `tools` are `(name, p50_ms, p95_ms)`.
pub fn bench_figure(
    tools: &[(String, f64, f64)],
    parallel_ms: Option<(f64, f64)>,
) -> Result<Vec<u8>, EvalError> {
    let mut canvas = Canvas::new(1200, 520);
    {
        let root = (&mut canvas).into_drawing_area();
        let (left, right) = root.split_horizontally(760);
        let n = tools.len().max(1) as i32;
        let top = tools.iter().map(|t| t.2).fold(1.0, f64::max) * 1.1;
        let label_px = tools.iter().map(|t| t.0.len()).max().unwrap_or(4) as u32 * 6 + 12;
        let mut chart = ChartBuilder::on(&left)
            .caption("Tool latency: p50 (bar), p95 (line)", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(label_px)
            .build_cartesian_2d(0f64..top, (0..n).into_segmented())
            .map_err(fig_err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("ms")
            .y_labels(tools.len() + 1)
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => tools
                    .get(*i as usize)
                    .map(|t| t.0.clone())
                    .unwrap_or_default(),
                _ => String::new(),
            })
            .label_style(("sans-serif", 9))
            .draw()
            .map_err(fig_err)?;
        chart
            .draw_series(tools.iter().enumerate().map(|(i, t)| {
                let i = i as i32;
                let mut r = Rectangle::new(
                    [
                        (0.0, SegmentValue::Exact(i)),
                        (t.1, SegmentValue::Exact(i + 1)),
                    ],
                    RGBColor(70, 120, 190).mix(0.8).filled(),
                );
                r.set_margin(4, 4, 0, 0);
                r
            }))
            .map_err(fig_err)?;
        chart
            .draw_series(tools.iter().enumerate().map(|(i, t)| {
                PathElement::new(
                    vec![
                        (t.1, SegmentValue::CenterOf(i as i32)),
                        (t.2, SegmentValue::CenterOf(i as i32)),
                    ],
                    BLACK.stroke_width(2),
                )
            }))
            .map_err(fig_err)?;
        if let Some((parallel, sequential)) = parallel_ms {
            let rows = [
                ("one by one".to_string(), sequential),
                ("parallel round".to_string(), parallel),
            ];
            let top = sequential.max(parallel).max(1e-9) * 1.1;
            let mut chart = ChartBuilder::on(&right)
                .caption("One round of every tool", ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(100)
                .build_cartesian_2d(0f64..top, (0..2).into_segmented())
                .map_err(fig_err)?;
            chart
                .configure_mesh()
                .disable_y_mesh()
                .x_desc("ms")
                .y_labels(3)
                .y_label_formatter(&|v| match v {
                    SegmentValue::CenterOf(i) => rows
                        .get(*i as usize)
                        .map(|r| r.0.clone())
                        .unwrap_or_default(),
                    _ => String::new(),
                })
                .label_style(("sans-serif", 9))
                .draw()
                .map_err(fig_err)?;
            chart
                .draw_series(rows.iter().enumerate().map(|(i, r)| {
                    let i = i as i32;
                    let mut rect = Rectangle::new(
                        [
                            (0.0, SegmentValue::Exact(i)),
                            (r.1, SegmentValue::Exact(i + 1)),
                        ],
                        RGBColor(200, 110, 60).mix(0.85).filled(),
                    );
                    rect.set_margin(8, 8, 0, 0);
                    rect
                }))
                .map_err(fig_err)?;
        }
        root.present().map_err(fig_err)?;
    }
    canvas.png()
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters_backend::{FontFamily, FontTransform};

    struct Style;
    impl BackendTextStyle for Style {
        type FontError = Infallible;
        fn family(&self) -> FontFamily<'_> {
            FontFamily::SansSerif
        }
        fn size(&self) -> f64 {
            9.0
        }
        fn transform(&self) -> FontTransform {
            FontTransform::None
        }
        fn layout_box(&self, _: &str) -> Result<((i32, i32), (i32, i32)), Infallible> {
            Ok(((0, 0), (0, 0)))
        }
        fn draw<E, F: FnMut(i32, i32, BackendColor) -> Result<(), E>>(
            &self,
            _: &str,
            _: BackendCoord,
            _: F,
        ) -> Result<Result<(), E>, Infallible> {
            Ok(Ok(()))
        }
    }

    #[test]
    fn text_is_drawn_without_font_files() {
        let mut c = Canvas::new(40, 10);
        let mut b = &mut c;
        b.draw_text("1", &Style, (0, 0)).expect("draws");
        // '1' has its stem in column 2 of every middle row.
        let dark = |x: usize, y: usize| c.rgb[(y * 40 + x) * 3] < 128;
        assert!(dark(2, 3) && !dark(0, 3) && !dark(30, 3));
    }
}
