//! What the result writers need to know about the image they describe: the Patient module
//! (PS3.3 C.7.1.1) and General Study module (PS3.3 C.7.2.1) to copy, so the results land in the
//! same patient and study, and the image facts to reference it (SOP Common C.12.1, General
//! Series C.7.3.1, Image Pixel C.7.6.3, Frame of Reference C.7.4.1, DX/CR acquisition
//! attributes).
//!
//! [`read_dicom`] reads a Part 10 file and also a bare data set without preamble or File Meta
//! (such as the shared `CR-MONO1-10-chest_noPart10header.dcm`), in implicit or explicit VR
//! little endian. [`SourceImage::from_object`] then takes the attributes; it never decodes pixels.

use std::panic::{catch_unwind, AssertUnwindSafe};

use dicom_dictionary_std::{tags, uids};
use dicom_object::{FileDicomObject, FileMetaTableBuilder, InMemDicomObject, Tag};
use dicom_transfer_syntax_registry::entries::{
    EXPLICIT_VR_LITTLE_ENDIAN, IMPLICIT_VR_LITTLE_ENDIAN,
};
use serde::{Deserialize, Serialize};

use crate::error::{PacsError, Result};

/// The Patient module attributes copied into every result object (all Type 2 there: written
/// empty when the source has none).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Patient {
    /// PatientName (0010,0010).
    pub name: Option<String>,
    /// PatientID (0010,0020).
    pub id: Option<String>,
    /// PatientBirthDate (0010,0030).
    pub birth_date: Option<String>,
    /// PatientSex (0010,0040).
    pub sex: Option<String>,
}

/// The General Study module attributes copied into every result object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Study {
    /// StudyInstanceUID (0020,000D).
    pub instance_uid: String,
    /// StudyDate (0008,0020).
    pub date: Option<String>,
    /// StudyTime (0008,0030).
    pub time: Option<String>,
    /// AccessionNumber (0008,0050).
    pub accession_number: Option<String>,
    /// ReferringPhysicianName (0008,0090).
    pub referring_physician_name: Option<String>,
    /// StudyID (0020,0010).
    pub id: Option<String>,
}

/// Where a pixel spacing came from. `PixelSpacing` (0028,0030) is in the patient (or, for
/// CR/DX, a calibrated) plane; `ImagerPixelSpacing` (0018,1164) is at the detector face, so
/// lengths from it include the projection's geometric magnification (PS3.3 C.8.11.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpacingSource {
    /// PixelSpacing (0028,0030): in the patient plane, or a calibrated one.
    PixelSpacing,
    /// ImagerPixelSpacing (0018,1164): at the detector face, magnification included.
    ImagerPixelSpacing,
}

/// Physical size of one pixel: `row_mm` between rows (vertical), `column_mm` between columns.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PixelSpacing {
    /// Distance between rows (vertical), in mm.
    pub row_mm: f64,
    /// Distance between columns (horizontal), in mm.
    pub column_mm: f64,
    /// The attribute it was read from.
    pub source: SpacingSource,
}

impl PixelSpacing {
    /// Area of one pixel in mm².
    pub fn pixel_area_mm2(&self) -> f64 {
        self.row_mm * self.column_mm
    }
}

/// The source image of a result set: what to copy and what to reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceImage {
    /// Patient module attributes to copy.
    pub patient: Patient,
    /// General Study module attributes to copy.
    pub study: Study,
    /// SOPClassUID (0008,0016), for references to the source.
    pub sop_class_uid: String,
    /// SOPInstanceUID (0008,0018), for references to the source.
    pub sop_instance_uid: String,
    /// SeriesInstanceUID (0020,000E), for references to the source.
    pub series_instance_uid: String,
    /// Rows (0028,0010).
    pub rows: u16,
    /// Columns (0028,0011).
    pub columns: u16,
    /// `PixelSpacing`, else `ImagerPixelSpacing`; `None` when absent or not positive (some
    /// archives write `0\0`), in which case areas are reported in pixels.
    pub pixel_spacing: Option<PixelSpacing>,
    /// FrameOfReferenceUID (0020,0052), copied into a SEG when present.
    pub frame_of_reference_uid: Option<String>,
    /// SliceThickness (0018,0050) in mm, when the source has a positive one.
    pub slice_thickness: Option<f64>,
    /// Modality (0008,0060), matched by protocols.
    pub modality: Option<String>,
    /// BodyPartExamined (0018,0015), matched by protocols.
    pub body_part_examined: Option<String>,
    /// ViewPosition (0018,5101), matched by protocols.
    pub view_position: Option<String>,
    /// `PatientOrientation` (0020,0020), e.g. `["L", "F"]`; copied into a SEG (Type 2C there
    /// when the source has no patient-space geometry).
    pub patient_orientation: Vec<String>,
    /// Whether the source's pixels went through lossy compression (LossyImageCompression "01"
    /// or a lossy transfer syntax): derived images must say so too (PS3.3 C.7.6.1.1.5).
    pub lossy: bool,
    /// The lossy methods (LossyImageCompressionMethod, or the one the transfer syntax implies:
    /// `ISO_10918_1` JPEG, `ISO_15444_1` JPEG 2000, ...), copied into derived images.
    pub lossy_methods: Vec<String>,
    /// Whether the source has patient-space geometry (ImagePositionPatient or
    /// ImageOrientationPatient), as cross-sectional images do. The SEG writer describes
    /// projection radiographs, which have none, and refuses such sources.
    pub has_patient_geometry: bool,
}

/// Reads a DICOM object from bytes: a Part 10 file (with or without the 128-byte preamble), or a
/// bare data set in implicit or explicit VR little endian, which gets a File Meta table built
/// from its own SOP class and instance. Malformed input is an error, never a panic.
pub fn read_dicom(bytes: &[u8]) -> Result<FileDicomObject<InMemDicomObject>> {
    let read = || -> Result<FileDicomObject<InMemDicomObject>> {
        let part10 =
            (bytes.len() >= 132 && &bytes[128..132] == b"DICM") || bytes.starts_with(b"DICM");
        if part10 {
            return dicom_object::from_reader(bytes).map_err(|e| PacsError::Read {
                reason: e.to_string(),
            });
        }
        let explicit = bare_dataset_is_explicit(bytes).ok_or_else(|| PacsError::Read {
            reason: "no DICM marker and the first bytes are not a group 0008 data element".into(),
        })?;
        let ts = if explicit {
            EXPLICIT_VR_LITTLE_ENDIAN.erased()
        } else {
            IMPLICIT_VR_LITTLE_ENDIAN.erased()
        };
        let obj =
            InMemDicomObject::read_dataset_with_ts(bytes, &ts).map_err(|e| PacsError::Read {
                reason: e.to_string(),
            })?;
        let class = text(&obj, tags::SOP_CLASS_UID).unwrap_or_default();
        let instance = text(&obj, tags::SOP_INSTANCE_UID).unwrap_or_default();
        let meta = FileMetaTableBuilder::new()
            .transfer_syntax(ts.uid())
            .media_storage_sop_class_uid(class)
            .media_storage_sop_instance_uid(instance);
        obj.with_meta(meta).map_err(|e| PacsError::Read {
            reason: format!("cannot complete the missing File Meta: {e}"),
        })
    };
    // dicom-rs may panic on some malformed structures: outside data never takes the process down.
    catch_unwind(AssertUnwindSafe(read)).unwrap_or_else(|_| {
        Err(PacsError::Read {
            reason: "malformed DICOM structure".into(),
        })
    })
}

/// `Some(true)` for explicit VR, `Some(false)` for implicit VR, `None` when the bytes do not
/// start like a data set (its first element is in group 0008, Identifying, as every image's is).
fn bare_dataset_is_explicit(bytes: &[u8]) -> Option<bool> {
    let head = bytes.get(..8)?;
    let group = u16::from_le_bytes([head[0], head[1]]);
    if group != 0x0008 {
        return None;
    }
    if head[4].is_ascii_uppercase() && head[5].is_ascii_uppercase() {
        return Some(true);
    }
    let len = u32::from_le_bytes([head[4], head[5], head[6], head[7]]) as usize;
    (len <= bytes.len()).then_some(false)
}

/// A string attribute, trimmed of padding; `None` when absent or empty.
pub(crate) fn text(obj: &InMemDicomObject, tag: Tag) -> Option<String> {
    let s = obj.get(tag)?.to_str().ok()?;
    let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
    (!s.is_empty()).then(|| s.to_string())
}

fn required(
    obj: &InMemDicomObject,
    tag: Tag,
    keyword: &'static str,
    tag_str: &'static str,
) -> Result<String> {
    text(obj, tag).ok_or(PacsError::MissingAttribute {
        keyword,
        tag: tag_str,
    })
}

fn dimension(
    obj: &InMemDicomObject,
    tag: Tag,
    keyword: &'static str,
    tag_str: &'static str,
) -> Result<u16> {
    let element = obj.get(tag).ok_or(PacsError::MissingAttribute {
        keyword,
        tag: tag_str,
    })?;
    let value: u16 = element.to_int().map_err(|e| PacsError::InvalidAttribute {
        keyword,
        tag: tag_str,
        value: element.to_str().map(|s| s.into_owned()).unwrap_or_default(),
        reason: format!("not an unsigned 16-bit integer ({e})"),
    })?;
    if value == 0 {
        return Err(PacsError::InvalidAttribute {
            keyword,
            tag: tag_str,
            value: "0".into(),
            reason: "an image has at least one row and one column".into(),
        });
    }
    Ok(value)
}

/// A positive, finite two-value spacing; anything else (absent, `0\0`, one value) is unknown.
fn spacing(obj: &InMemDicomObject, tag: Tag, source: SpacingSource) -> Option<PixelSpacing> {
    let values = obj.get(tag)?.to_multi_float64().ok()?;
    match values.as_slice() {
        [row, col] if row.is_finite() && col.is_finite() && *row > 0.0 && *col > 0.0 => {
            Some(PixelSpacing {
                row_mm: *row,
                column_mm: *col,
                source,
            })
        }
        _ => None,
    }
}

/// The lossy compression method (PS3.3 C.7.6.1.1.5.1 defined terms) of a lossy transfer
/// syntax; `None` for a lossless or unknown one.
fn lossy_transfer_syntax(uid: &str) -> Option<&'static str> {
    const LOSSY: [(&str, &str); 10] = [
        (uids::JPEG_BASELINE8_BIT, "ISO_10918_1"),
        (uids::JPEG_EXTENDED12_BIT, "ISO_10918_1"),
        (uids::JPEGLS_NEAR_LOSSLESS, "ISO_14495_1"),
        (uids::JPEG2000, "ISO_15444_1"),
        (uids::JPEG2000MC, "ISO_15444_1"),
        (uids::HTJ2K, "ISO_15444_15"),
        (uids::MPEG2MPML, "ISO_13818_2"),
        (uids::MPEG4HP41, "ISO_14496_10"),
        (uids::HEVCMP51, "ISO_23008_2"),
        (uids::JPEGXL, "ISO_18181_1"),
    ];
    let uid = uid.trim_end_matches('\0');
    LOSSY.iter().find(|(u, _)| *u == uid).map(|(_, m)| *m)
}

impl SourceImage {
    /// Takes the attributes from a source image. Fails, naming the attribute, when one that a
    /// result object needs to reference the image (study, series and SOP instance UIDs, SOP
    /// class, rows, columns) is absent; a multi-frame source is refused (the writers describe
    /// one projection radiograph).
    pub fn from_object(obj: &FileDicomObject<InMemDicomObject>) -> Result<Self> {
        let mut image = Self::from_dataset(obj)?;
        if let Some(method) = lossy_transfer_syntax(obj.meta().transfer_syntax()) {
            image.lossy = true;
            if !image.lossy_methods.iter().any(|m| m == method) {
                image.lossy_methods.push(method.to_string());
            }
        }
        Ok(image)
    }

    /// As [`SourceImage::from_object`], for a data set without File Meta (the transfer syntax,
    /// and so a lossy one, is then unknown: only LossyImageCompression says).
    pub fn from_dataset(obj: &InMemDicomObject) -> Result<Self> {
        if let Some(frames) = text(obj, tags::NUMBER_OF_FRAMES) {
            if frames.parse::<u32>().map_or(true, |n| n > 1) {
                return Err(PacsError::InvalidAttribute {
                    keyword: "NumberOfFrames",
                    tag: "(0028,0008)",
                    value: frames,
                    reason: "the result writers describe single-frame projection radiographs; \
                             send each frame as its own instance"
                        .into(),
                });
            }
        }
        let patient = Patient {
            name: text(obj, tags::PATIENT_NAME),
            id: text(obj, tags::PATIENT_ID),
            birth_date: text(obj, tags::PATIENT_BIRTH_DATE),
            sex: text(obj, tags::PATIENT_SEX),
        };
        let study = Study {
            instance_uid: required(
                obj,
                tags::STUDY_INSTANCE_UID,
                "StudyInstanceUID",
                "(0020,000D)",
            )?,
            date: text(obj, tags::STUDY_DATE),
            time: text(obj, tags::STUDY_TIME),
            accession_number: text(obj, tags::ACCESSION_NUMBER),
            referring_physician_name: text(obj, tags::REFERRING_PHYSICIAN_NAME),
            id: text(obj, tags::STUDY_ID),
        };
        let pixel_spacing =
            spacing(obj, tags::PIXEL_SPACING, SpacingSource::PixelSpacing).or_else(|| {
                spacing(
                    obj,
                    tags::IMAGER_PIXEL_SPACING,
                    SpacingSource::ImagerPixelSpacing,
                )
            });
        let patient_orientation = obj
            .get(tags::PATIENT_ORIENTATION)
            .and_then(|e| e.to_multi_str().ok().map(|v| v.to_vec()))
            .unwrap_or_default()
            .into_iter()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
        Ok(Self {
            patient,
            study,
            sop_class_uid: required(obj, tags::SOP_CLASS_UID, "SOPClassUID", "(0008,0016)")?,
            sop_instance_uid: required(
                obj,
                tags::SOP_INSTANCE_UID,
                "SOPInstanceUID",
                "(0008,0018)",
            )?,
            series_instance_uid: required(
                obj,
                tags::SERIES_INSTANCE_UID,
                "SeriesInstanceUID",
                "(0020,000E)",
            )?,
            rows: dimension(obj, tags::ROWS, "Rows", "(0028,0010)")?,
            columns: dimension(obj, tags::COLUMNS, "Columns", "(0028,0011)")?,
            pixel_spacing,
            frame_of_reference_uid: text(obj, tags::FRAME_OF_REFERENCE_UID),
            slice_thickness: obj
                .get(tags::SLICE_THICKNESS)
                .and_then(|e| e.to_float64().ok())
                .filter(|t| t.is_finite() && *t > 0.0),
            modality: text(obj, tags::MODALITY),
            body_part_examined: text(obj, tags::BODY_PART_EXAMINED),
            view_position: text(obj, tags::VIEW_POSITION),
            patient_orientation,
            lossy: text(obj, tags::LOSSY_IMAGE_COMPRESSION).as_deref() == Some("01"),
            lossy_methods: obj
                .get(tags::LOSSY_IMAGE_COMPRESSION_METHOD)
                .and_then(|e| e.to_multi_str().ok().map(|v| v.to_vec()))
                .unwrap_or_default()
                .into_iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            has_patient_geometry: obj.get(tags::IMAGE_POSITION_PATIENT).is_some()
                || obj.get(tags::IMAGE_ORIENTATION_PATIENT).is_some(),
        })
    }

    /// Number of pixels of the source image (`rows * columns`).
    pub fn pixel_count(&self) -> usize {
        usize::from(self.rows) * usize::from(self.columns)
    }
}
