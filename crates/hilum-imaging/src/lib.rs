//! Decoding of chest radiographs into one canonical image, the content-addressed
//! [`ImageStore`] through which every tool reads them, the preprocessing transforms the models
//! use (with their inverse mapping), DICOM de-identification, and overlay rendering.
//!
//! The canonical image ([`CxrImage`]) is one luminance channel of `f32` values in
//! `0..=2^bit_depth - 1`, bright = dense, whatever the source: RGB/palette become luminance,
//! 16-bit stays 16-bit, MONOCHROME1 is inverted, and a DICOM file's window (VOI) is applied
//! when [`DecodeOptions::voi`] asks for it (the store's default: the file's own window).
//!
//! Models do not resize pixels themselves: they ask the store for a variant,
//! `store.prepared(id, &Preprocess::xrv(224))`, which is computed once per (image, transform)
//! and shared by every tool of a round; the returned [`Prepared`] carries the [`Geometry`] to map
//! boxes and masks back onto the original image.

#![warn(missing_docs)]

mod canonical;
mod decode;
mod deid;
mod dicom;
mod dicom_tags;
pub mod font;
mod jpeg;
mod model_view;
pub mod regions;
mod render;
pub mod skresize;
mod store;
mod transform;

pub use canonical::{CxrImage, DecodeOptions, ImageMeta, Voi};
pub use decode::{decode, decode_with, sniff_format};
pub use deid::{
    annex_e, deidentify, export_deidentified, AnnexE, AnnexERow, DeidOptions, DeidReport,
    ProfileOption,
};
pub use dicom::{read_dicom, DicomSummary};
pub use dicom_tags::{dicom_tags, DicomTag, StudyContext};
pub use jpeg::{decode_jpeg_samples, JpegSamples};
pub use model_view::{model_view_png, model_view_size, MODEL_VIEW_MAX_SIDE};
pub use render::{colormap, encode_png, Box2d, Colormap, Heatmap, MaskLayer, Overlay, Rgb};
pub use store::{ImageLoader, ImageStore, Layer, StoreLimits, StoreStats};
pub use transform::{
    prepare, prepare_values, resize, resize_pil_u8, Filter, Fit, Geometry, Layout, Norm, PilKernel,
    Prepared, Preprocess, CLIP_MEAN, CLIP_STD,
};

use thiserror::Error;

/// Why an image could not be read, prepared, de-identified or written; each message says what to do.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ImagingError {
    /// No image has this id.
    #[error("unknown image id `{0}`: ids come from an upload or from `--image`; check the id")]
    UnknownId(String),
    /// The file is not an image Hilum can decode.
    #[error("cannot read {what}: {reason}")]
    Decode {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// Why.
        reason: String,
    },
    /// More pixels than the store accepts.
    #[error("{what} is {width}x{height} pixels, above the limit of {limit} pixels (raise HILUM_MAX_PIXELS if this is a real image)")]
    TooLarge {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// Columns.
        width: u64,
        /// Rows.
        height: u64,
        /// The limit.
        limit: u64,
    },
    /// A bigger file than the store accepts.
    #[error("{what} is {bytes} bytes, above the limit of {limit} bytes")]
    FileTooLarge {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// Its size, in bytes.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// The file could not be read.
    #[error("cannot read file {path}: {reason}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The image has no pixels.
    #[error("{what} has no pixels ({width}x{height}); the file is empty or its header is wrong")]
    Empty {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// Columns.
        width: u64,
        /// Rows.
        height: u64,
    },
    /// A DICOM compression Hilum cannot decode.
    #[error("{what} uses the DICOM transfer syntax {uid} ({name}), which Hilum cannot decode; convert it to an uncompressed, JPEG or JPEG 2000 transfer syntax (e.g. `gdcmconv --raw`)")]
    UnsupportedTransferSyntax {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// The transfer syntax UID.
        uid: String,
        /// Its name.
        name: String,
    },
    /// A DICOM object without an image (SR, SEG, …).
    #[error("{what} is a DICOM {kind} object, which holds no image to analyse; give the radiograph (CR/DX) instead")]
    NotAnImage {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// The object's kind (SR, SEG, …).
        kind: String,
    },
    /// DICOM metadata asked of a file that is not DICOM.
    #[error("{what} is not a DICOM file, so it has no DICOM metadata; use `image_info` instead")]
    NotDicom {
        /// The input concerned (a file name or a description, never a path).
        what: String,
    },
    /// A preprocessing recipe that cannot be run.
    #[error("invalid transform: {0}")]
    InvalidTransform(String),
    /// An output (PNG, DICOM) could not be written.
    #[error("cannot write {what}: {reason}")]
    Encode {
        /// The input concerned (a file name or a description, never a path).
        what: String,
        /// Why.
        reason: String,
    },
    /// Export refused: the file says its pixels may show identifying text.
    #[error("{what} says Burned In Annotation = YES: its pixels may show names or IDs that de-identification cannot remove; look at the image, and export it only if it shows none, with the override (`hilum deid --allow-burned-in`, `DeidOptions::allow_burned_in_annotation`)")]
    BurnedInAnnotation {
        /// The input concerned (a file name or a description, never a path).
        what: String,
    },
    /// The built-in de-identification table is malformed.
    #[error("the de-identification table (data/annex_e.tsv) is malformed: {0}; regenerate it with scripts/fixtures/gen_annex_e.py")]
    DeidTable(String),
}

/// The crate's result.
pub type Result<T, E = ImagingError> = std::result::Result<T, E>;
