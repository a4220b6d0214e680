//! The derived overlay image: a Secondary Capture Image (PS3.3 A.8.1, SOP class
//! 1.2.840.10008.5.1.4.1.1.7) holding the RGB picture the caller drew (masks, lines, labels),
//! marked as derived with burned-in annotation.
//!
//! Modules: Patient and General Study copied from the source; General Series (the source's
//! modality and body part, so the overlay hangs beside the radiograph; `OT` when the modality
//! is unknown; Laterality absent for the unpaired chest, empty when the body part is unknown);
//! SC Equipment
//! (C.8.6.1, ConversionType `WSD`, a workstation); General Image (C.7.6.1: ImageType
//! `DERIVED\SECONDARY`, DerivationDescription, SourceImageSequence with purpose "Source image for
//! image processing operation", BurnedInAnnotation `YES`, LossyImageCompression copied from the
//! source, PatientOrientation copied, ImageComments with the research-only statement when asked);
//! Image Pixel (C.7.6.3: 8-bit RGB, interleaved); SC Image (C.8.6.2: PixelSpacing copied when the
//! overlay has the source's size and the source has a PixelSpacing).

use dicom_core::value::PrimitiveValue;
use dicom_core::{DataElement, VR};
use dicom_dictionary_std::{tags, uids};
use dicom_object::{FileDicomObject, InMemDicomObject};

use crate::codes;
use crate::dataset::{self, clip, put_code, put_seq, put_str, put_strs, put_u16, sop_ref};
use crate::error::{PacsError, Result};
use crate::result::{Overlay, ResultSet, RESEARCH_ONLY_STATEMENT};
use crate::source::SpacingSource;
use crate::uid::{ObjectKind, ResultUids};

/// Series Number of the overlay series.
pub const SERIES_NUMBER: u32 = 9003;

/// The overlay's UIDs for this result set.
pub fn uids(rs: &ResultSet) -> ResultUids {
    ResultUids::derive(
        &rs.source.study.instance_uid,
        &rs.source.sop_instance_uid,
        &rs.protocol,
        ObjectKind::Sc,
        &rs.models,
    )
}

fn check_overlay(rs: &ResultSet) -> Result<&Overlay> {
    let overlay = rs.overlay.as_ref().ok_or_else(|| {
        PacsError::InvalidResult(
            "no overlay: set ResultSet.overlay to the RGB image to send".into(),
        )
    })?;
    let expected = usize::from(overlay.rows) * usize::from(overlay.columns) * 3;
    if overlay.rows == 0 || overlay.columns == 0 || overlay.rgb.len() != expected {
        return Err(PacsError::InvalidResult(format!(
            "the overlay is {} rows x {} columns but has {} bytes: give {expected} bytes, \
             R, G, B per pixel, row-major",
            overlay.rows,
            overlay.columns,
            overlay.rgb.len()
        )));
    }
    Ok(overlay)
}

/// Writes the derived secondary-capture overlay of `rs.overlay`.
pub fn write(rs: &ResultSet) -> Result<FileDicomObject<InMemDicomObject>> {
    rs.validate()?;
    let overlay = check_overlay(rs)?;
    let ResultUids {
        series_instance_uid,
        sop_instance_uid,
    } = uids(rs);
    let class = uids::SECONDARY_CAPTURE_IMAGE_STORAGE;
    let s = &rs.source;
    let mut o = InMemDicomObject::new_empty();
    dataset::sop_common(&mut o, class, &sop_instance_uid, &rs.created);
    dataset::patient_and_study(&mut o, rs);
    dataset::series(
        &mut o,
        s.modality.as_deref().unwrap_or("OT"),
        &series_instance_uid,
        SERIES_NUMBER,
        &format!("Hilum overlay ({})", rs.protocol),
        &rs.created,
    );
    // The body part copied, so that hanging protocols place the overlay with the source; then
    // Laterality (General Series, Type 2C, for paired body parts: not the chest) stays absent.
    // Without a body part, Laterality is present and empty: unknown.
    match &s.body_part_examined {
        Some(part) => put_str(&mut o, tags::BODY_PART_EXAMINED, VR::CS, &clip(part, 16)),
        None => put_str(&mut o, tags::LATERALITY, VR::CS, ""),
    }
    dataset::equipment(&mut o, rs);
    put_str(&mut o, tags::CONVERSION_TYPE, VR::CS, "WSD");

    // General Image.
    put_str(&mut o, tags::INSTANCE_NUMBER, VR::IS, "1");
    let orientation: Vec<&str> = s.patient_orientation.iter().map(String::as_str).collect();
    if orientation.len() == 2 && (overlay.rows, overlay.columns) == (s.rows, s.columns) {
        put_strs(&mut o, tags::PATIENT_ORIENTATION, VR::CS, &orientation);
    } else {
        put_str(&mut o, tags::PATIENT_ORIENTATION, VR::CS, "");
    }
    put_str(&mut o, tags::CONTENT_DATE, VR::DA, &rs.created.date);
    put_str(&mut o, tags::CONTENT_TIME, VR::TM, &rs.created.time);
    put_strs(&mut o, tags::IMAGE_TYPE, VR::CS, &["DERIVED", "SECONDARY"]);
    put_str(
        &mut o,
        tags::DERIVATION_DESCRIPTION,
        VR::ST,
        &clip(&overlay.description, 1024),
    );
    let mut source = sop_ref(&s.sop_class_uid, &s.sop_instance_uid);
    put_code(
        &mut source,
        tags::PURPOSE_OF_REFERENCE_CODE_SEQUENCE,
        &codes::source_image_for_processing(),
    );
    put_seq(&mut o, tags::SOURCE_IMAGE_SEQUENCE, vec![source]);
    put_str(&mut o, tags::BURNED_IN_ANNOTATION, VR::CS, "YES");
    dataset::lossy_compression(&mut o, s);
    if rs.research_only {
        put_str(
            &mut o,
            tags::IMAGE_COMMENTS,
            VR::LT,
            RESEARCH_ONLY_STATEMENT,
        );
    }

    // SC Image: the spacing holds only when the overlay is the source's size.
    put_str(
        &mut o,
        tags::DATE_OF_SECONDARY_CAPTURE,
        VR::DA,
        &rs.created.date,
    );
    put_str(
        &mut o,
        tags::TIME_OF_SECONDARY_CAPTURE,
        VR::TM,
        &rs.created.time,
    );
    if let Some(spacing) = s
        .pixel_spacing
        .filter(|sp| sp.source == SpacingSource::PixelSpacing)
        .filter(|_| (overlay.rows, overlay.columns) == (s.rows, s.columns))
    {
        let values = [dataset::ds(spacing.row_mm), dataset::ds(spacing.column_mm)];
        put_strs(
            &mut o,
            tags::PIXEL_SPACING,
            VR::DS,
            &[values[0].as_str(), values[1].as_str()],
        );
    }

    // Image Pixel: 8-bit RGB, colour-by-pixel.
    put_u16(&mut o, tags::SAMPLES_PER_PIXEL, 3);
    put_str(&mut o, tags::PHOTOMETRIC_INTERPRETATION, VR::CS, "RGB");
    put_u16(&mut o, tags::PLANAR_CONFIGURATION, 0);
    put_u16(&mut o, tags::ROWS, overlay.rows);
    put_u16(&mut o, tags::COLUMNS, overlay.columns);
    put_u16(&mut o, tags::BITS_ALLOCATED, 8);
    put_u16(&mut o, tags::BITS_STORED, 8);
    put_u16(&mut o, tags::HIGH_BIT, 7);
    put_u16(&mut o, tags::PIXEL_REPRESENTATION, 0);
    let mut pixels = overlay.rgb.clone();
    if !pixels.len().is_multiple_of(2) {
        pixels.push(0);
    }
    o.put(DataElement::new(
        tags::PIXEL_DATA,
        VR::OB,
        PrimitiveValue::U8(pixels.into()),
    ));
    dataset::into_file(o, class, &sop_instance_uid)
}
