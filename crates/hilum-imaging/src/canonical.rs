//! The canonical image and how to decode one: what the decoder's entry point returns for every
//! format and the DICOM reader fills in. A module of its own so that the entry point can call
//! the DICOM reader without the reader importing the entry point back.

use serde::{Deserialize, Serialize};

use crate::ImagingError;

/// What is known about where an image came from. Holds no patient identifiers: it is what a
/// model may be shown.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ImageMeta {
    /// `png`, `jpeg`, `dicom`.
    pub format: String,
    /// Size of the original image (the canonical image keeps it).
    pub width: u32,
    /// Height of the original image.
    pub height: u32,
    /// Significant bits per sample of the canonical pixels (8, 10, 12, 15, 16).
    pub bit_depth: u8,
    /// Channels in the file before conversion to one luminance channel.
    pub source_channels: u8,
    /// (row, column) spacing in millimetres, when the file says.
    pub pixel_spacing_mm: Option<(f64, f64)>,
    /// `PA`, `AP`, `LL`, … when the file says.
    pub view_position: Option<String>,
    /// `MONOCHROME1`, `MONOCHROME2`, `RGB`, … (DICOM), or the raster colour type.
    pub photometric: Option<String>,
    /// DICOM modality (`CR`, `DX`, …).
    #[serde(default)]
    pub modality: Option<String>,
    /// DICOM Body Part Examined (`CHEST`, …).
    #[serde(default)]
    pub body_part: Option<String>,
    /// DICOM transfer syntax UID and its name.
    #[serde(default)]
    pub transfer_syntax: Option<(String, String)>,
    /// Bits allocated per sample in the DICOM file.
    #[serde(default)]
    pub bits_allocated: Option<u8>,
    /// (slope, intercept) of the DICOM modality rescale.
    #[serde(default)]
    pub rescale: Option<(f64, f64)>,
    /// The first window (centre, width) the file recommends, in rescaled units.
    #[serde(default)]
    pub file_window: Option<(f64, f64)>,
    /// The window (centre, width) applied to produce the canonical pixels, if any.
    #[serde(default)]
    pub window_applied: Option<(f64, f64)>,
    /// True when the file's VOI LUT table (VOI LUT Sequence) produced the canonical pixels.
    #[serde(default)]
    pub voi_lut_applied: bool,
    /// True when stored values were inverted (MONOCHROME1) so that bright = dense.
    #[serde(default)]
    pub inverted: bool,
    /// Frames in the DICOM file (the first is decoded).
    #[serde(default)]
    pub frames: Option<u32>,
    /// Things a careful reader should know (missing File Meta, extra frames ignored, …).
    #[serde(default)]
    pub warnings: Vec<String>,
}

/// One canonical radiograph: a single luminance channel, row-major, values in
/// `0..=2^bit_depth - 1`, bright = dense (bone white), whatever the source encoding.
#[derive(Clone, Debug, PartialEq)]
pub struct CxrImage {
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
    /// `width * height` values, row-major.
    pub pixels: Vec<f32>,
    /// Where it came from (no patient identifiers).
    pub meta: ImageMeta,
}

impl CxrImage {
    /// The largest value a pixel can take.
    pub fn max_value(&self) -> f32 {
        ((1u64 << self.meta.bit_depth.min(32)) - 1) as f32
    }

    /// Bytes held by the pixels (for cache accounting).
    pub fn size_bytes(&self) -> usize {
        self.pixels.len() * std::mem::size_of::<f32>()
    }
}

/// Which VOI (window) transformation to apply to DICOM pixels. Raster images have none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Voi {
    /// Keep the full stored range (only MONOCHROME1 inversion and the sign offset).
    None,
    /// The first window the file recommends (LINEAR, LINEAR_EXACT or SIGMOID as it says);
    /// the full stored range when it recommends none.
    #[default]
    FromFile,
    /// This window, in rescaled (modality) units.
    Window {
        /// Window centre.
        center: f64,
        /// Window width.
        width: f64,
    },
}

/// How to decode.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeOptions {
    /// Largest accepted width x height (x frames), checked before any pixel is allocated.
    pub max_pixels: u64,
    /// The window applied to DICOM pixels.
    pub voi: Voi,
}

impl Default for DecodeOptions {
    fn default() -> Self {
        DecodeOptions {
            max_pixels: 100_000_000,
            voi: Voi::FromFile,
        }
    }
}

/// Refuses an image above the pixel budget or with no pixels; called before allocating.
pub(crate) fn check_size(
    what: &str,
    width: u64,
    height: u64,
    frames: u64,
    max_pixels: u64,
) -> Result<(), ImagingError> {
    if width == 0 || height == 0 || frames == 0 {
        return Err(ImagingError::Empty {
            what: what.to_string(),
            width,
            height,
        });
    }
    if width.saturating_mul(height).saturating_mul(frames) > max_pixels {
        return Err(ImagingError::TooLarge {
            what: what.to_string(),
            width,
            height,
            limit: max_pixels,
        });
    }
    Ok(())
}
