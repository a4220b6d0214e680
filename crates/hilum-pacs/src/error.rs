//! The one error type of the result writers. Each message says what was wrong and what to do.

/// Why a source could not be read or a result object could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PacsError {
    /// The bytes are not a DICOM object this crate can read.
    #[error(
        "cannot read the DICOM object: {reason}. Give a DICOM Part 10 file, or a bare data set \
         in implicit or explicit VR little endian"
    )]
    Read {
        /// What the DICOM reader reported.
        reason: String,
    },

    /// A required attribute of the source image is absent or empty.
    #[error(
        "the source image has no {keyword} {tag}: results cannot be placed in its study without \
         it; check that the object is an image as the modality stored it (not de-identified \
         beyond the DICOM basic profile)"
    )]
    MissingAttribute {
        /// The attribute's keyword, e.g. `StudyInstanceUID`.
        keyword: &'static str,
        /// Its tag, e.g. `(0020,000D)`.
        tag: &'static str,
    },

    /// An attribute of the source image has a value the writers cannot use.
    #[error("the source image's {keyword} {tag} is {value:?}: {reason}")]
    InvalidAttribute {
        /// The attribute's keyword.
        keyword: &'static str,
        /// Its tag.
        tag: &'static str,
        /// The value found.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },

    /// The result set given to a writer is not consistent; the message names the field to fix.
    #[error("invalid result set: {0}")]
    InvalidResult(String),

    /// dicom-rs could not build or encode the object (a defect of this crate: please report it
    /// with the message).
    #[error("cannot encode the DICOM object: {0}")]
    Encode(String),

    /// A multipart/related body (DICOMweb STOW-RS request, WADO-RS response) is malformed; the
    /// message says how.
    #[error("malformed multipart/related body: {0}")]
    Multipart(crate::multipart::MultipartError),
}

/// The crate's result type, [`PacsError`] by default.
pub type Result<T, E = PacsError> = std::result::Result<T, E>;
