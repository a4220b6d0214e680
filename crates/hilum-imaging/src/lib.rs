//! Decoding of chest radiographs into one canonical image, and the content-addressed
//! [`ImageStore`] through which every tool reads them.

mod decode;
mod store;

pub use decode::{decode, CxrImage, ImageMeta};
pub use store::{ImageStore, StoreLimits};

use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum ImagingError {
    #[error("unknown image id `{0}`: ids come from an upload or from `--image`; check the id")]
    UnknownId(String),
    #[error("cannot read {what}: {reason}")]
    Decode { what: String, reason: String },
    #[error("{what} is {width}x{height} pixels, above the limit of {limit} pixels (raise HILUM_MAX_PIXELS if this is a real image)")]
    TooLarge {
        what: String,
        width: u64,
        height: u64,
        limit: u64,
    },
    #[error("{what} is {bytes} bytes, above the limit of {limit} bytes")]
    FileTooLarge {
        what: String,
        bytes: u64,
        limit: u64,
    },
    #[error("cannot read file {path}: {reason}")]
    Io { path: String, reason: String },
}
