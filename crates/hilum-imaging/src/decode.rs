use serde::{Deserialize, Serialize};

use crate::ImagingError;

/// What is known about where an image came from. Holds no patient identifiers.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ImageMeta {
    /// `png`, `jpeg`, `dicom`.
    pub format: String,
    pub width: u32,
    pub height: u32,
    /// Bits per sample of the stored pixels (8, 10, 12, 15, 16).
    pub bit_depth: u8,
    /// Channels in the file before conversion to one luminance channel.
    pub source_channels: u8,
    /// (row, column) spacing in millimetres, when the file says.
    pub pixel_spacing_mm: Option<(f64, f64)>,
    /// `PA`, `AP`, `LL`, … when the file says.
    pub view_position: Option<String>,
    pub photometric: Option<String>,
}

/// One canonical radiograph: a single luminance channel, row-major, values in
/// `0..=2^bit_depth - 1`, bright = dense (bone white), whatever the source encoding.
#[derive(Clone, Debug, PartialEq)]
pub struct CxrImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<f32>,
    pub meta: ImageMeta,
}

impl CxrImage {
    /// The largest value a pixel can take.
    pub fn max_value(&self) -> f32 {
        ((1u32 << self.meta.bit_depth.min(31)) - 1) as f32
    }
}

/// Decodes an image file's bytes. `what` names the input in errors (no paths of patients'
/// files are logged; the caller chooses what to show).
pub fn decode(bytes: &[u8], what: &str, max_pixels: u64) -> Result<CxrImage, ImagingError> {
    let err = |reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason,
    };
    let reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| err(e.to_string()))?;
    let format = match reader.format() {
        Some(image::ImageFormat::Png) => "png",
        Some(image::ImageFormat::Jpeg) => "jpeg",
        Some(other) => return Err(err(format!("unsupported image format {other:?}"))),
        None => return Err(err("not a PNG, JPEG or DICOM file".into())),
    };
    let (w, h) = reader.into_dimensions().map_err(|e| err(e.to_string()))?;
    if (w as u64) * (h as u64) > max_pixels {
        return Err(ImagingError::TooLarge {
            what: what.to_string(),
            width: w as u64,
            height: h as u64,
            limit: max_pixels,
        });
    }
    let img = image::load_from_memory(bytes).map_err(|e| err(e.to_string()))?;
    let channels = img.color().channel_count();
    let sixteen = matches!(
        img.color(),
        image::ColorType::L16
            | image::ColorType::La16
            | image::ColorType::Rgb16
            | image::ColorType::Rgba16
    );
    let (bit_depth, pixels): (u8, Vec<f32>) = if sixteen {
        (
            16,
            img.to_luma16()
                .into_raw()
                .into_iter()
                .map(f32::from)
                .collect(),
        )
    } else {
        (
            8,
            img.to_luma8()
                .into_raw()
                .into_iter()
                .map(f32::from)
                .collect(),
        )
    };
    Ok(CxrImage {
        width: w,
        height: h,
        pixels,
        meta: ImageMeta {
            format: format.into(),
            width: w,
            height: h,
            bit_depth,
            source_channels: channels,
            ..Default::default()
        },
    })
}
