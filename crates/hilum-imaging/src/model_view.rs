//! What a reasoning model is shown of an image: one function, called by the CLI
//! (`analyze --send-pixels`, in-process models), the server and eval, so that every front shows
//! a model the same picture of one image.
//!
//! The policy, and why:
//! - **Pixels only.** The canonical image (the file's window applied, MONOCHROME1 inverted,
//!   bright = dense) as an 8-bit grey PNG with no text or time chunks: no DICOM header, no file
//!   name, nothing the source file said about the patient. Text burned into the pixels is not
//!   detected here; sending pixels to a model outside the process stays an explicit opt-in.
//! - **Longest side at most [`MODEL_VIEW_MAX_SIDE`] px.** Multimodal models downscale what they
//!   get to their own input size, which is below this, so more pixels add upload and prompt
//!   bytes (sent again every turn) but no detail the model sees. 1024 keeps the common public
//!   radiograph size (NIH ChestX-ray14) untouched; a 3000 px CR is sent as about a ninth of its
//!   pixels.
//! - **Area averaging when shrinking.** Each output pixel is the mean of the source pixels it
//!   covers: thin lines (tubes, wires, rib edges) stay continuous and faint opacities keep their
//!   density, where nearest-neighbour drops or breaks them. The image is averaged in its own
//!   bit depth, then rounded to 8 bits once.

use crate::{encode_png, resize, CxrImage, Filter, ImagingError};

/// The longest side, in pixels, of the image a reasoning model is shown.
pub const MODEL_VIEW_MAX_SIDE: u32 = 1024;

/// The size an image of `width` x `height` is shown at: unchanged up to
/// [`MODEL_VIEW_MAX_SIDE`], else shrunk to it with the aspect ratio kept.
pub fn model_view_size(width: u32, height: u32) -> (u32, u32) {
    let longest = width.max(height);
    if longest <= MODEL_VIEW_MAX_SIDE {
        return (width, height);
    }
    let scale = MODEL_VIEW_MAX_SIDE as f64 / longest as f64;
    let side = |v: u32| ((v as f64 * scale).round() as u32).clamp(1, MODEL_VIEW_MAX_SIDE);
    (side(width), side(height))
}

/// The PNG bytes a multimodal reasoning model is sent for `img` (see the module doc for the
/// policy). The same image always gives the same bytes.
pub fn model_view_png(img: &CxrImage) -> Result<Vec<u8>, ImagingError> {
    let (w, h) = (img.width as usize, img.height as usize);
    if w == 0 || h == 0 || img.pixels.len() != w * h {
        return Err(ImagingError::Encode {
            what: "the image for the model".into(),
            reason: format!(
                "{} pixels for a {}x{} image",
                img.pixels.len(),
                img.width,
                img.height
            ),
        });
    }
    let (dw, dh) = model_view_size(img.width, img.height);
    let shrunk;
    let values: &[f32] = if (dw, dh) == (img.width, img.height) {
        &img.pixels
    } else {
        shrunk = resize(&img.pixels, w, h, dw as usize, dh as usize, Filter::Area);
        &shrunk
    };
    let scale = 255.0 / img.max_value().max(1.0);
    let grey: Vec<u8> = values
        .iter()
        .map(|&v| (v * scale).round().clamp(0.0, 255.0) as u8)
        .collect();
    encode_png(dw, dh, &grey, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ImageMeta;

    fn image(width: u32, height: u32, bit_depth: u8, f: impl Fn(u32, u32) -> f32) -> CxrImage {
        let pixels = (0..height)
            .flat_map(|y| (0..width).map(move |x| (x, y)))
            .map(|(x, y)| f(x, y))
            .collect();
        CxrImage {
            width,
            height,
            pixels,
            meta: ImageMeta {
                bit_depth,
                ..ImageMeta::default()
            },
        }
    }

    fn decode(png: &[u8]) -> image::GrayImage {
        image::load_from_memory(png).expect("png").to_luma8()
    }

    #[test]
    fn small_images_keep_their_size_and_large_ones_shrink_to_the_bound() {
        assert_eq!(model_view_size(1024, 1024), (1024, 1024));
        assert_eq!(model_view_size(640, 480), (640, 480));
        assert_eq!(model_view_size(2048, 1536), (1024, 768));
        assert_eq!(model_view_size(1841, 1955), (964, 1024));
        assert_eq!(model_view_size(30000, 2), (1024, 1));
    }

    #[test]
    fn a_thin_line_survives_the_shrink() {
        // A one-pixel vertical line every 8 columns of a 4096 px image: nearest-neighbour at
        // 4x would keep only every other line (or none); averaging keeps each as grey.
        let img = image(4096, 64, 8, |x, _| if x % 8 == 0 { 255.0 } else { 0.0 });
        let out = decode(&model_view_png(&img).expect("png"));
        assert_eq!(out.dimensions(), (1024, 16));
        let row: Vec<u8> = (0..1024).map(|x| out.get_pixel(x, 8)[0]).collect();
        for pair in row.chunks(2) {
            assert!(pair.iter().any(|&v| v > 0), "a line vanished near {row:?}");
        }
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / row.len() as f64;
        assert!((mean - 255.0 / 8.0).abs() < 1.0, "mean density {mean}");
    }

    #[test]
    fn sixteen_bit_pixels_are_scaled_to_eight_and_the_png_holds_only_pixels() {
        let img = image(3, 1, 16, |x, _| [0.0, 32767.5, 65535.0][x as usize]);
        let png = model_view_png(&img).expect("png");
        let out = decode(&png);
        assert_eq!(out.as_raw(), &vec![0, 128, 255]);
        let text_chunk = |name: &[u8]| png.windows(4).any(|w| w == name);
        assert!(!text_chunk(b"tEXt") && !text_chunk(b"iTXt") && !text_chunk(b"zTXt"));
        assert_eq!(
            png,
            model_view_png(&img).expect("png"),
            "same bytes each time"
        );
    }

    #[test]
    fn a_pixel_buffer_that_does_not_match_the_size_is_an_error() {
        let mut img = image(4, 4, 8, |_, _| 1.0);
        img.pixels.pop();
        assert!(matches!(
            model_view_png(&img),
            Err(ImagingError::Encode { .. })
        ));
    }
}
