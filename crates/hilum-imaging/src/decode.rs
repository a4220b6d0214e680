//! One entry point for every input: PNG, JPEG or DICOM bytes in, one canonical image out.
//! Raster formats are decoded here, DICOM by [`crate::dicom`]; both build the types of
//! [`crate::canonical`], so neither module imports this one back.

use crate::canonical::{check_size, CxrImage, DecodeOptions, ImageMeta};
use crate::jpeg::{decode_jpeg_samples, JpegSamples};
use crate::{dicom, ImagingError};

/// The container format of some bytes, from their first bytes only.
pub fn sniff_format(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("png")
    } else if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("jpeg")
    } else if dicom::looks_like_dicom(bytes) {
        Some("dicom")
    } else {
        None
    }
}

/// Decodes an image file's bytes with the default window (the file's). `what` names the input
/// in errors (no paths of patients' files are logged; the caller chooses what to show).
pub fn decode(bytes: &[u8], what: &str, max_pixels: u64) -> Result<CxrImage, ImagingError> {
    decode_with(
        bytes,
        what,
        &DecodeOptions {
            max_pixels,
            ..Default::default()
        },
    )
}

/// Decodes PNG (8/16-bit, gray, RGB, RGBA, palette), JPEG or DICOM bytes.
pub fn decode_with(
    bytes: &[u8],
    what: &str,
    opts: &DecodeOptions,
) -> Result<CxrImage, ImagingError> {
    if bytes.is_empty() {
        return Err(ImagingError::Empty {
            what: what.to_string(),
            width: 0,
            height: 0,
        });
    }
    match sniff_format(bytes) {
        Some("dicom") => dicom::decode_dicom(bytes, what, opts),
        Some("jpeg") => match decode_jpeg_samples(bytes, what, opts.max_pixels)? {
            Some(decoded) => jpeg_image(decoded, what),
            // CMYK/YCCK: the `image` crate's decoder converts them to RGB.
            None => decode_raster(bytes, what, "jpeg", opts.max_pixels),
        },
        Some(format) => decode_raster(bytes, what, format, opts.max_pixels),
        None => Err(ImagingError::Decode {
            what: what.to_string(),
            reason: "not a PNG, JPEG or DICOM file".into(),
        }),
    }
}

/// libjpeg-turbo's samples as the `image` crate's picture, so that RGB becomes luminance by the
/// same conversion as RGB PNGs (and as before libjpeg-turbo decoded JPEG).
fn jpeg_image(decoded: JpegSamples, what: &str) -> Result<CxrImage, ImagingError> {
    let JpegSamples {
        width,
        height,
        channels,
        samples,
    } = decoded;
    let img = if channels == 3 {
        image::RgbImage::from_raw(width, height, samples).map(image::DynamicImage::ImageRgb8)
    } else {
        image::GrayImage::from_raw(width, height, samples).map(image::DynamicImage::ImageLuma8)
    };
    let img = img.ok_or_else(|| ImagingError::Decode {
        what: what.to_string(),
        reason: format!("decoded buffer does not hold {width}x{height} pixels"),
    })?;
    Ok(raster_image(img, "jpeg"))
}

fn decode_raster(
    bytes: &[u8],
    what: &str,
    format: &str,
    max_pixels: u64,
) -> Result<CxrImage, ImagingError> {
    let err = |reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason,
    };
    let image_format = if format == "png" {
        image::ImageFormat::Png
    } else {
        image::ImageFormat::Jpeg
    };
    let reader = || {
        let mut r = image::ImageReader::with_format(std::io::Cursor::new(bytes), image_format);
        // Defence in depth: the decoder itself refuses to allocate beyond the budget too.
        let mut limits = image::Limits::default();
        limits.max_alloc = Some(max_pixels.saturating_mul(8).max(1 << 20));
        r.limits(limits);
        r
    };
    // Header only: the bomb check happens before any pixel buffer exists.
    let (w, h) = reader().into_dimensions().map_err(|e| err(e.to_string()))?;
    check_size(what, w as u64, h as u64, 1, max_pixels)?;
    let img = reader().decode().map_err(|e| err(e.to_string()))?;
    Ok(raster_image(img, format))
}

/// A decoded picture as the canonical luminance plane (16-bit stays 16-bit).
fn raster_image(img: image::DynamicImage, format: &str) -> CxrImage {
    let (w, h) = (img.width(), img.height());
    let color = img.color();
    let channels = color.channel_count();
    let sixteen = color.bytes_per_pixel() / channels >= 2;
    let (bit_depth, pixels): (u8, Vec<f32>) = if sixteen {
        (
            16,
            img.into_luma16()
                .into_raw()
                .into_iter()
                .map(f32::from)
                .collect(),
        )
    } else {
        (
            8,
            img.into_luma8()
                .into_raw()
                .into_iter()
                .map(f32::from)
                .collect(),
        )
    };
    CxrImage {
        width: w,
        height: h,
        pixels,
        meta: ImageMeta {
            format: format.into(),
            width: w,
            height: h,
            bit_depth,
            source_channels: channels,
            photometric: Some(format!("{color:?}")),
            ..Default::default()
        },
    }
}
