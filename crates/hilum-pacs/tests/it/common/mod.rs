//! Shared test helpers: the real DICOM files beside the checkout.

use std::path::PathBuf;

use hilum_pacs::{read_dicom, FileDicomObject, InMemDicomObject, SourceImage};

/// `../shared/data/cxr/dicom` relative to the repository root.
pub fn dicom_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/dicom")
}

pub fn read(name: &str) -> FileDicomObject<InMemDicomObject> {
    let path = dicom_dir().join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the shared radiographs live in ../shared/data beside the checkout)",
            path.display()
        )
    });
    read_dicom(&bytes).unwrap_or_else(|e| panic!("{name}: {e}"))
}

pub fn source(name: &str) -> SourceImage {
    SourceImage::from_object(&read(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

pub const SIIM: &str = "siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm";
pub const RG1: &str = "RG1_chest_cr_pa_jpeg2000_lossy.dcm";
pub const CR_NO_META: &str = "CR-MONO1-10-chest_noPart10header.dcm";
pub const MONO1: &str = "fake_monochrome1_variant.dcm";
