//! The binary Segmentation (PS3.3 A.51 Segmentation IOD, SOP class
//! 1.2.840.10008.5.1.4.1.1.66.4; modules C.8.20 Segmentation Series and Segmentation Image,
//! C.7.6.16 Multi-frame Functional Groups, C.7.6.17 Multi-frame Dimension).
//!
//! One frame per segment, in the source's geometry (same rows and columns), 1 bit per pixel
//! packed least significant bit first (PS3.5 8.1.1), frames back to back. Each segment carries
//! Anatomical Structure (91723000, SCT) as category (CID 7150) and its structure as type
//! (CID 7151: Right lung 3341006, Left lung 44029006, Heart 80891009, Lung 39607008), algorithm
//! type AUTOMATIC, and the model as algorithm (family Artificial Intelligence, name = model id,
//! version = the weights' sha256).
//!
//! Projection radiographs (CR, DX, secondary captures of them) have no patient-space geometry,
//! so, as highdicom does for a source without a usable frame of reference, the frames carry no
//! Plane Position / Plane Orientation; they reference the source through DerivationImageSequence
//! (SpatialLocationsPreserved YES) and the General Image module's PatientOrientation is copied.
//! A FrameOfReferenceUID of the source is copied; see `pixel_measures` (below) for why pixel spacing
//! is written only with one.

use dicom_core::value::PrimitiveValue;
use dicom_core::{DataElement, VR};
use dicom_dictionary_std::{tags, uids};
use dicom_object::{FileDicomObject, InMemDicomObject};

use crate::codes::{self, PRIVATE_SCHEME};
use crate::dataset::{self, clip, put_code, put_seq, put_str, put_strs, put_u16, sop_ref};
use crate::error::{PacsError, Result};
use crate::result::{ResultSet, Segment, RESEARCH_ONLY_SHORT};
use crate::source::SpacingSource;
use crate::uid::{child_uid, ObjectKind, ResultUids};

/// Series Number of the SEG series.
pub const SERIES_NUMBER: u32 = 9002;

/// The SEG's UIDs for this result set.
pub fn uids(rs: &ResultSet) -> ResultUids {
    ResultUids::derive(
        &rs.source.study.instance_uid,
        &rs.source.sop_instance_uid,
        &rs.protocol,
        ObjectKind::Seg,
        &rs.models,
    )
}

/// Packs masks (one byte per pixel, non-zero = inside) into DICOM's 1-bit layout: bit `i` of the
/// stream is pixel `i` of frame after frame, least significant bit first in each byte; the
/// result is padded to an even length.
pub fn pack_bits<'a>(frames: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    let mut bit = 0usize;
    for frame in frames {
        for &v in frame {
            if bit.is_multiple_of(8) {
                out.push(0);
            }
            if v != 0 {
                if let Some(last) = out.last_mut() {
                    *last |= 1 << (bit % 8);
                }
            }
            bit += 1;
        }
    }
    if !out.len().is_multiple_of(2) {
        out.push(0);
    }
    out
}

fn check_segments(rs: &ResultSet) -> Result<()> {
    if rs.segments.is_empty() {
        return Err(PacsError::InvalidResult(
            "no segments: a SEG needs at least one structure's mask".into(),
        ));
    }
    if rs.source.has_patient_geometry {
        return Err(PacsError::InvalidResult(
            "the source has patient-space geometry (ImagePositionPatient / \
             ImageOrientationPatient): the SEG writer describes projection radiographs only"
                .into(),
        ));
    }
    let expected = rs.source.pixel_count();
    for s in &rs.segments {
        if s.mask.len() != expected {
            return Err(PacsError::InvalidResult(format!(
                "segment {:?} has a mask of {} values; the source image is {} rows x {} columns \
                 = {expected}: give one value per source pixel, row-major, in the source's size",
                s.label,
                s.mask.len(),
                rs.source.rows,
                rs.source.columns
            )));
        }
    }
    Ok(())
}

fn overlap(segments: &[Segment]) -> bool {
    let n = segments.first().map_or(0, |s| s.mask.len());
    (0..n).any(|i| segments.iter().filter(|s| s.mask[i] != 0).count() > 1)
}

fn segment_item(rs: &ResultSet, number: u16, s: &Segment) -> Result<InMemDicomObject> {
    let model = rs.model(&s.model_id, &format!("segment {:?}", s.label))?;
    let mut algorithm = InMemDicomObject::new_empty();
    put_code(
        &mut algorithm,
        tags::ALGORITHM_FAMILY_CODE_SEQUENCE,
        &codes::artificial_intelligence(),
    );
    put_str(
        &mut algorithm,
        tags::ALGORITHM_NAME,
        VR::LO,
        &clip(&model.id, 64),
    );
    put_str(
        &mut algorithm,
        tags::ALGORITHM_VERSION,
        VR::LO,
        &clip(&model.sha256, 64),
    );

    let mut o = InMemDicomObject::new_empty();
    put_u16(&mut o, tags::SEGMENT_NUMBER, number);
    put_str(&mut o, tags::SEGMENT_LABEL, VR::LO, &clip(&s.label, 64));
    put_code(
        &mut o,
        tags::SEGMENTED_PROPERTY_CATEGORY_CODE_SEQUENCE,
        &s.category,
    );
    put_code(
        &mut o,
        tags::SEGMENTED_PROPERTY_TYPE_CODE_SEQUENCE,
        &s.property_type,
    );
    put_str(&mut o, tags::SEGMENT_ALGORITHM_TYPE, VR::CS, "AUTOMATIC");
    put_str(
        &mut o,
        tags::SEGMENT_ALGORITHM_NAME,
        VR::LO,
        &clip(&model.id, 64),
    );
    put_seq(
        &mut o,
        tags::SEGMENTATION_ALGORITHM_IDENTIFICATION_SEQUENCE,
        vec![algorithm],
    );
    Ok(o)
}

/// A frame's functional groups: derived from the source image, dimension index = segment.
fn per_frame_item(rs: &ResultSet, number: u16) -> InMemDicomObject {
    let mut source = sop_ref(&rs.source.sop_class_uid, &rs.source.sop_instance_uid);
    put_str(
        &mut source,
        tags::SPATIAL_LOCATIONS_PRESERVED,
        VR::CS,
        "YES",
    );
    put_code(
        &mut source,
        tags::PURPOSE_OF_REFERENCE_CODE_SEQUENCE,
        &codes::source_image_for_processing(),
    );
    let mut derivation = InMemDicomObject::new_empty();
    put_seq(&mut derivation, tags::SOURCE_IMAGE_SEQUENCE, vec![source]);
    put_code(
        &mut derivation,
        tags::DERIVATION_CODE_SEQUENCE,
        &codes::segmentation_derivation(),
    );

    let mut content = InMemDicomObject::new_empty();
    content.put(DataElement::new(
        tags::DIMENSION_INDEX_VALUES,
        VR::UL,
        PrimitiveValue::from(u32::from(number)),
    ));
    let mut identification = InMemDicomObject::new_empty();
    put_u16(&mut identification, tags::REFERENCED_SEGMENT_NUMBER, number);

    let mut o = InMemDicomObject::new_empty();
    put_seq(&mut o, tags::DERIVATION_IMAGE_SEQUENCE, vec![derivation]);
    put_seq(&mut o, tags::FRAME_CONTENT_SEQUENCE, vec![content]);
    put_seq(
        &mut o,
        tags::SEGMENT_IDENTIFICATION_SEQUENCE,
        vec![identification],
    );
    o
}

/// The shared Pixel Measures functional group, where the standard and highdicom agree on one.
///
/// PS3.3 C.7.6.16.2.1 (as amended by CP 1426) makes SliceThickness Type 1C, required in a SEG
/// exactly when a Frame of Reference is present; highdicom 0.28.2's reader refuses a Pixel
/// Measures item without SliceThickness, and dciodvfy refuses one with SliceThickness (even
/// empty) when there is no Frame of Reference. So: with a Frame of Reference, the source's
/// PixelSpacing and SliceThickness; without one (CR, DX and their secondary captures here), no
/// Pixel Measures — the frames keep the source's geometry (SpatialLocationsPreserved YES), and
/// the SR's image library carries the spacing. ImagerPixelSpacing (at the detector) is never
/// written as PixelSpacing.
fn pixel_measures(s: &crate::source::SourceImage) -> Option<InMemDicomObject> {
    s.frame_of_reference_uid.as_ref()?;
    let spacing = s
        .pixel_spacing
        .filter(|sp| sp.source == SpacingSource::PixelSpacing)?;
    let thickness = s.slice_thickness?;
    let mut measures = InMemDicomObject::new_empty();
    let values = [dataset::ds(spacing.row_mm), dataset::ds(spacing.column_mm)];
    put_strs(
        &mut measures,
        tags::PIXEL_SPACING,
        VR::DS,
        &[values[0].as_str(), values[1].as_str()],
    );
    put_str(
        &mut measures,
        tags::SLICE_THICKNESS,
        VR::DS,
        &dataset::ds(thickness),
    );
    Some(measures)
}

/// Multi-frame Dimension module: one dimension, the referenced segment number.
fn dimensions(o: &mut InMemDicomObject, instance_uid: &str) {
    let organization_uid = child_uid(instance_uid, "dimension organization");
    let mut organization = InMemDicomObject::new_empty();
    put_str(
        &mut organization,
        tags::DIMENSION_ORGANIZATION_UID,
        VR::UI,
        &organization_uid,
    );
    put_seq(o, tags::DIMENSION_ORGANIZATION_SEQUENCE, vec![organization]);

    let mut index = InMemDicomObject::new_empty();
    put_str(
        &mut index,
        tags::DIMENSION_ORGANIZATION_UID,
        VR::UI,
        &organization_uid,
    );
    index.put(DataElement::new(
        tags::DIMENSION_INDEX_POINTER,
        VR::AT,
        PrimitiveValue::Tags(vec![tags::REFERENCED_SEGMENT_NUMBER].into()),
    ));
    index.put(DataElement::new(
        tags::FUNCTIONAL_GROUP_POINTER,
        VR::AT,
        PrimitiveValue::Tags(vec![tags::SEGMENT_IDENTIFICATION_SEQUENCE].into()),
    ));
    put_str(
        &mut index,
        tags::DIMENSION_DESCRIPTION_LABEL,
        VR::LO,
        "Referenced Segment Number",
    );
    put_seq(o, tags::DIMENSION_INDEX_SEQUENCE, vec![index]);
}

/// Writes the binary SEG of `rs.segments`. Fails when there are no segments, a mask is not the
/// source's size, or a segment names a model missing from `rs.models`.
pub fn write(rs: &ResultSet) -> Result<FileDicomObject<InMemDicomObject>> {
    rs.validate()?;
    check_segments(rs)?;
    let ResultUids {
        series_instance_uid,
        sop_instance_uid,
    } = uids(rs);
    let class = uids::SEGMENTATION_STORAGE;
    let s = &rs.source;
    let mut o = InMemDicomObject::new_empty();
    dataset::sop_common(&mut o, class, &sop_instance_uid, &rs.created);
    let private_codes = rs.segments.iter().any(|seg| {
        seg.category.scheme == PRIVATE_SCHEME || seg.property_type.scheme == PRIVATE_SCHEME
    });
    if private_codes {
        dataset::declare_private_scheme(&mut o);
    }
    dataset::patient_and_study(&mut o, rs);
    dataset::series(
        &mut o,
        "SEG",
        &series_instance_uid,
        SERIES_NUMBER,
        &format!("Hilum segmentation ({})", rs.protocol),
        &rs.created,
    );
    dataset::equipment(&mut o, rs);
    if let Some(frame_of_reference) = &s.frame_of_reference_uid {
        put_str(
            &mut o,
            tags::FRAME_OF_REFERENCE_UID,
            VR::UI,
            frame_of_reference,
        );
        put_str(&mut o, tags::POSITION_REFERENCE_INDICATOR, VR::LO, "");
    }

    // General Image, Segmentation Image.
    put_str(&mut o, tags::INSTANCE_NUMBER, VR::IS, "1");
    let orientation: Vec<&str> = s.patient_orientation.iter().map(String::as_str).collect();
    if orientation.len() == 2 {
        put_strs(&mut o, tags::PATIENT_ORIENTATION, VR::CS, &orientation);
    } else {
        put_str(&mut o, tags::PATIENT_ORIENTATION, VR::CS, "");
    }
    put_str(&mut o, tags::CONTENT_DATE, VR::DA, &rs.created.date);
    put_str(&mut o, tags::CONTENT_TIME, VR::TM, &rs.created.time);
    put_strs(&mut o, tags::IMAGE_TYPE, VR::CS, &["DERIVED", "PRIMARY"]);
    put_str(&mut o, tags::CONTENT_LABEL, VR::CS, "HILUM_SEG");
    let description = if rs.research_only {
        RESEARCH_ONLY_SHORT
    } else {
        "Automatic segmentation by Hilum"
    };
    put_str(&mut o, tags::CONTENT_DESCRIPTION, VR::LO, description);
    put_str(&mut o, tags::CONTENT_CREATOR_NAME, VR::PN, "");
    put_str(&mut o, tags::SEGMENTATION_TYPE, VR::CS, "BINARY");
    put_str(
        &mut o,
        tags::SEGMENTS_OVERLAP,
        VR::CS,
        if overlap(&rs.segments) { "YES" } else { "NO" },
    );
    let items = rs
        .segments
        .iter()
        .enumerate()
        .map(|(i, seg)| segment_item(rs, (i + 1) as u16, seg))
        .collect::<Result<Vec<_>>>()?;
    put_seq(&mut o, tags::SEGMENT_SEQUENCE, items);
    dataset::lossy_compression(&mut o, s);

    // Image Pixel: 1 bit, MONOCHROME2, one frame per segment.
    put_u16(&mut o, tags::SAMPLES_PER_PIXEL, 1);
    put_str(
        &mut o,
        tags::PHOTOMETRIC_INTERPRETATION,
        VR::CS,
        "MONOCHROME2",
    );
    put_u16(&mut o, tags::ROWS, s.rows);
    put_u16(&mut o, tags::COLUMNS, s.columns);
    put_u16(&mut o, tags::BITS_ALLOCATED, 1);
    put_u16(&mut o, tags::BITS_STORED, 1);
    put_u16(&mut o, tags::HIGH_BIT, 0);
    put_u16(&mut o, tags::PIXEL_REPRESENTATION, 0);
    put_str(&mut o, tags::PRESENTATION_LUT_SHAPE, VR::CS, "IDENTITY");
    put_str(
        &mut o,
        tags::NUMBER_OF_FRAMES,
        VR::IS,
        &rs.segments.len().to_string(),
    );
    let pixels = pack_bits(rs.segments.iter().map(|seg| seg.mask.as_slice()));
    o.put(DataElement::new(
        tags::PIXEL_DATA,
        VR::OB,
        PrimitiveValue::U8(pixels.into()),
    ));

    // Multi-frame Functional Groups and Dimension.
    let mut shared = InMemDicomObject::new_empty();
    if let Some(measures) = pixel_measures(s) {
        put_seq(&mut shared, tags::PIXEL_MEASURES_SEQUENCE, vec![measures]);
    }
    put_seq(
        &mut o,
        tags::SHARED_FUNCTIONAL_GROUPS_SEQUENCE,
        vec![shared],
    );
    let per_frame = (1..=rs.segments.len())
        .map(|n| per_frame_item(rs, n as u16))
        .collect();
    put_seq(
        &mut o,
        tags::PER_FRAME_FUNCTIONAL_GROUPS_SEQUENCE,
        per_frame,
    );
    dimensions(&mut o, &sop_instance_uid);

    // Common Instance Reference, and the source as the image's source.
    let mut series = InMemDicomObject::new_empty();
    put_str(
        &mut series,
        tags::SERIES_INSTANCE_UID,
        VR::UI,
        &s.series_instance_uid,
    );
    put_seq(
        &mut series,
        tags::REFERENCED_INSTANCE_SEQUENCE,
        vec![sop_ref(&s.sop_class_uid, &s.sop_instance_uid)],
    );
    put_seq(&mut o, tags::REFERENCED_SERIES_SEQUENCE, vec![series]);
    put_seq(
        &mut o,
        tags::SOURCE_IMAGE_SEQUENCE,
        vec![sop_ref(&s.sop_class_uid, &s.sop_instance_uid)],
    );
    dataset::into_file(o, class, &sop_instance_uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_packed_lsb_first_across_frames_and_padded_even() {
        // Two frames of 5 pixels: bits continue across the frame boundary.
        let a = [1u8, 0, 0, 0, 1];
        let b = [0u8, 0, 0, 1, 1];
        let packed = pack_bits([&a[..], &b[..]]);
        // Bits 0..10: 1 0 0 0 1 | 0 0 0 1 1  -> byte0 = 0b0001_0001, byte1 = 0b0000_0011.
        assert_eq!(packed, vec![0b0001_0001, 0b0000_0011]);
        let odd = pack_bits([&[1u8; 9][..]]);
        assert_eq!(odd, vec![0xff, 0x01]);
        let padded = pack_bits([&[255u8; 3][..]]);
        assert_eq!(padded, vec![0b0000_0111, 0]);
    }
}
