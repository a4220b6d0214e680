//! Hilum's results as DICOM objects that go back into the source study: a TID 1500
//! Comprehensive SR (measurements, findings with probabilities, the agent's answer), a binary
//! Segmentation (one coded segment per structure) and a derived Secondary Capture overlay, with
//! UIDs derived from the source study, the protocol and the model versions so that a resend
//! replaces rather than duplicates.
//!
//! The flow: [`read_dicom`] the source, take its attributes with [`SourceImage::from_object`],
//! fill a [`ResultSet`], then write each object ([`sr::write`], [`seg::write`], [`sc::write`]);
//! each returns a [`FileDicomObject`] in Explicit VR Little Endian, and [`to_bytes`] gives the
//! Part 10 file. Every object copies the source's Patient and General Study modules and starts a
//! new series of its own type.
//!
//! Standards followed, module by module: [`source`] (PS3.3 C.7.1.1 Patient, C.7.2.1 General
//! Study), [`uid`] (PS3.5 9.1 and B.2, `2.25.` UIDs), [`codes`] (PS3.16 coding schemes, a private
//! `99HILUM` scheme where PS3.16 has no concept), [`sr`] (PS3.3 A.35.3 Comprehensive SR IOD,
//! PS3.16 TID 1500/1501/300/1600/1001/1004/4019), [`seg`] (PS3.3 A.51 Segmentation IOD, C.8.20,
//! CID 7150/7151), [`sc`] (PS3.3 A.8.1 Secondary Capture Image IOD).
//!
//! Independent readers prove the objects: the crate's integration tests read them with highdicom
//! (`scripts/pacs_check.py`), dicom3tools' `dciodvfy` and dcmtk's `dsrdump`
//! (`scripts/setup_pacs_tools.sh` installs them); docs/pacs.md says how to run the same checks,
//! and `cargo run -p hilum-pacs --example demo_results -- SOURCE.dcm OUT_DIR` writes the three
//! objects with synthetic results to check by hand.
//!
//! The DICOM node, [`scp`], receives studies: a Storage SCP (C-STORE, C-ECHO) on dicom-rs's
//! upper layer (`dicom-ul`) that refuses unknown AE titles and hosts, limits associations and
//! object sizes, and stores each instance atomically before it answers success (PS3.4 Annex B,
//! PS3.7 9.1.1 and 9.3.1, PS3.8 upper layer through dicom-ul); `cargo run -p hilum-pacs --example
//! scp -- PORT DIR` runs one.
//!
//! The crate reads no environment variables and never panics on outside data: malformed DICOM
//! is a [`PacsError::Read`], a missing attribute names itself, an inconsistent result set names
//! the field to fix.

#![warn(missing_docs)]

pub mod codes;
mod dataset;
pub mod dicomweb;
pub mod error;
pub mod multipart;
pub mod protocol;
pub mod result;
pub mod sc;
pub mod scp;
pub mod seg;
pub mod source;
pub mod sr;
pub mod uid;

pub use dataset::to_bytes;
pub use dicom_object::{FileDicomObject, InMemDicomObject};
pub use error::PacsError;
pub use result::{
    Device, Finding, Measurement, ModelInfo, Overlay, Quantity, ResultSet, Segment, Side,
    Timestamp, RESEARCH_ONLY_SHORT, RESEARCH_ONLY_STATEMENT,
};
pub use source::{read_dicom, PixelSpacing, SourceImage, SpacingSource};
pub use uid::{ObjectKind, ResultUids};
