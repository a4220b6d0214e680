//! Gemma 3's image processor (transformers' `Gemma3ImageProcessor`, without pan-and-scan):
//! grey to RGB, PIL's `BILINEAR` resize of the 8-bit image to the model's square input,
//! rescale by 1/255, normalise with mean 0.5 and std 0.5, channels first.
//!
//! The resize reproduces Pillow's 8-bit resampler to the bit (fixed-point coefficients with 22
//! fractional bits, a horizontal then a vertical pass, each rounded to 8 bits), so the pixel
//! values equal the reference's exactly rather than within a grey level.

/// Fractional bits of Pillow's fixed-point filter coefficients for 8-bit images.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// One output sample's input range and fixed-point weights.
struct Taps {
    start: usize,
    weights: Vec<i64>,
}

/// Pillow's `precompute_coeffs` for the triangle filter (support 1, widened by the downscale
/// factor), then `normalize_coeffs_8bpc`.
fn taps(in_size: usize, out_size: usize) -> Vec<Taps> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale; // bilinear support 1.0 x filterscale
    (0..out_size)
        .map(|o| {
            let center = (o as f64 + 0.5) * scale;
            // C's (int) truncation toward zero of a value >= -0.5 + ...: clamp at 0 first.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64)
                .min(in_size as i64)
                .max(lo as i64) as usize;
            let w: Vec<f64> = (lo..hi)
                .map(|i| {
                    let x = ((i as f64 - center + 0.5) / filterscale).abs();
                    if x < 1.0 {
                        1.0 - x
                    } else {
                        0.0
                    }
                })
                .collect();
            let sum: f64 = w.iter().sum();
            let one = (1i64 << PRECISION_BITS) as f64;
            let weights = w
                .iter()
                .map(|&v| {
                    let v = if sum != 0.0 { v / sum } else { v };
                    if v < 0.0 {
                        (-0.5 + v * one) as i64
                    } else {
                        (0.5 + v * one) as i64
                    }
                })
                .collect();
            Taps { start: lo, weights }
        })
        .collect()
}

/// Pillow's `clip8`: the fixed-point sum back to a byte.
fn clip8(acc: i64) -> u8 {
    if acc >= (1i64 << PRECISION_BITS) << 8 {
        255
    } else if acc <= 0 {
        0
    } else {
        (acc >> PRECISION_BITS) as u8
    }
}

/// Pillow's 8-bit `Image.resize(..., BILINEAR)` of an interleaved image with `channels` bands.
pub fn resize_bilinear_u8(
    src: &[u8],
    width: usize,
    height: usize,
    channels: usize,
    new_width: usize,
    new_height: usize,
) -> Vec<u8> {
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut cur = src.to_vec();
    let mut w = width;
    if new_width != width {
        let t = taps(width, new_width);
        let mut out = vec![0u8; new_width * height * channels];
        for y in 0..height {
            let row = &cur[y * w * channels..(y + 1) * w * channels];
            for (x, tap) in t.iter().enumerate() {
                for c in 0..channels {
                    let mut acc = half;
                    for (k, &wt) in tap.weights.iter().enumerate() {
                        acc += row[(tap.start + k) * channels + c] as i64 * wt;
                    }
                    out[(y * new_width + x) * channels + c] = clip8(acc);
                }
            }
        }
        cur = out;
        w = new_width;
    }
    if new_height != height {
        let t = taps(height, new_height);
        let mut out = vec![0u8; w * new_height * channels];
        for (y, tap) in t.iter().enumerate() {
            for x in 0..w * channels {
                let mut acc = half;
                for (k, &wt) in tap.weights.iter().enumerate() {
                    acc += cur[(tap.start + k) * w * channels + x] as i64 * wt;
                }
                out[y * w * channels + x] = clip8(acc);
            }
        }
        cur = out;
    }
    cur
}

/// The model input of an 8-bit image (`channels` 1 = grey, 3 = RGB, interleaved, row-major):
/// (3, size, size) channels-first values in [-1, 1].
pub fn pixel_values(
    src: &[u8],
    width: usize,
    height: usize,
    channels: usize,
    size: usize,
) -> Result<Vec<f32>, String> {
    if channels != 1 && channels != 3 {
        return Err(format!(
            "images with {channels} channels are not supported (grey or RGB)"
        ));
    }
    if width == 0 || height == 0 || src.len() != width * height * channels {
        return Err(format!(
            "image buffer of {} bytes does not hold {width}x{height}x{channels}",
            src.len()
        ));
    }
    // Grey to RGB replicates the band, and the resize treats bands alike: resize once.
    let resized = resize_bilinear_u8(src, width, height, channels, size, size);
    let plane = size * size;
    let mut out = vec![0f32; 3 * plane];
    for c in 0..3 {
        let band = if channels == 1 { 0 } else { c };
        for p in 0..plane {
            // transformers rescales in float64, casts to float32, then normalises in float32.
            let v = (resized[p * channels + band] as f64 * (1.0 / 255.0)) as f32;
            out[c * plane + p] = (v - 0.5) / 0.5;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_the_identity() {
        let src: Vec<u8> = (0..60).map(|i| (i * 7 % 256) as u8).collect();
        assert_eq!(resize_bilinear_u8(&src, 5, 4, 3, 5, 4), src);
    }

    #[test]
    fn a_flat_image_stays_flat_at_any_size() {
        let src = vec![77u8; 9 * 5 * 3];
        for (w, h) in [(4, 3), (20, 11), (9, 2)] {
            assert!(resize_bilinear_u8(&src, 9, 5, 3, w, h)
                .iter()
                .all(|&v| v == 77));
        }
    }

    #[test]
    fn grey_becomes_three_equal_planes() {
        let px = pixel_values(&[0, 255, 128, 64], 2, 2, 1, 2).unwrap();
        assert_eq!(px.len(), 12);
        assert_eq!(&px[..4], &px[4..8]);
        assert_eq!(px[0], -1.0);
        assert_eq!(px[1], 1.0);
    }
}
