//! The source attributes of every shared DICOM, checked against dcmdump's reading of them.

use hilum_pacs::{read_dicom, source::SpacingSource, PacsError, SourceImage};

use crate::common::{self, CR_NO_META, MONO1, RG1, SIIM};

#[test]
fn jpeg_baseline_secondary_capture_with_pixel_spacing() {
    let s = common::source(SIIM);
    assert_eq!(s.sop_class_uid, "1.2.840.10008.5.1.4.1.1.7");
    assert_eq!(
        s.sop_instance_uid,
        "1.2.276.0.7230010.3.1.4.8323329.6904.1517875201.850819"
    );
    assert_eq!(
        s.series_instance_uid,
        "1.2.276.0.7230010.3.1.3.8323329.6904.1517875201.850817"
    );
    assert_eq!(
        s.study.instance_uid,
        "1.2.276.0.7230010.3.1.2.8323329.6904.1517875201.850818"
    );
    assert_eq!((s.rows, s.columns), (1024, 1024));
    let spacing = s.pixel_spacing.expect("PixelSpacing 0.168\\0.168");
    assert_eq!((spacing.row_mm, spacing.column_mm), (0.168, 0.168));
    assert_eq!(spacing.source, SpacingSource::PixelSpacing);
    assert_eq!(
        s.patient.id.as_deref(),
        Some("16d7f894-55d7-4d95-8957-d18987f0e981")
    );
    assert_eq!(s.patient.sex.as_deref(), Some("M"));
    assert_eq!(s.patient.birth_date, None);
    assert_eq!(s.study.date.as_deref(), Some("19010101"));
    assert_eq!(s.study.accession_number, None);
    assert_eq!(s.modality.as_deref(), Some("CR"));
    assert_eq!(s.body_part_examined.as_deref(), Some("CHEST"));
    assert_eq!(s.view_position.as_deref(), Some("PA"));
    assert_eq!(s.frame_of_reference_uid, None);
    assert!(s.lossy, "JPEG baseline is lossy");
    assert_eq!(s.lossy_methods, vec!["ISO_10918_1".to_string()]);
    assert!(!s.has_patient_geometry);
}

#[test]
fn jpeg2000_cr_with_zero_spacing_has_no_spacing() {
    let s = common::source(RG1);
    assert_eq!(s.sop_class_uid, "1.2.840.10008.5.1.4.1.1.1");
    assert_eq!((s.rows, s.columns), (1955, 1841));
    // PixelSpacing is written as 0.000\0.000: unknown, so areas go out in pixels.
    assert_eq!(s.pixel_spacing, None);
    assert_eq!(s.patient.name.as_deref(), Some("CompressedSamples^RG1"));
    assert_eq!(s.patient.id.as_deref(), Some("9RG1"));
    assert_eq!(s.patient.birth_date.as_deref(), Some("19400305"));
    assert_eq!(s.patient.sex.as_deref(), Some("F"));
    assert_eq!(s.study.time.as_deref(), Some("185059"));
    assert_eq!(s.study.accession_number.as_deref(), Some("exam Number"));
    assert_eq!(s.study.referring_physician_name.as_deref(), Some("ward"));
    assert_eq!(s.study.id.as_deref(), Some("9RG1"));
    assert_eq!(
        s.patient_orientation,
        vec!["L".to_string(), "F".to_string()]
    );
    assert!(s.lossy, "JPEG 2000 (1.2.840.10008.1.2.4.91) is lossy");
    assert_eq!(s.lossy_methods, vec!["ISO_15444_1".to_string()]);
}

#[test]
fn bare_dataset_without_preamble_or_meta_is_read() {
    let file = common::read(CR_NO_META);
    assert_eq!(
        file.meta().transfer_syntax().trim_end_matches('\0'),
        "1.2.840.10008.1.2"
    );
    let s = SourceImage::from_object(&file).unwrap();
    assert_eq!(s.sop_class_uid, "1.2.840.10008.5.1.4.1.1.1");
    assert_eq!(s.sop_instance_uid, "1.2.392.200036.9125.0.19950720112207");
    assert_eq!(
        s.study.instance_uid,
        "1.2.392.200036.9125.0.199302241758.16"
    );
    assert_eq!((s.rows, s.columns), (440, 440));
    assert_eq!(s.pixel_spacing, None);
    assert_eq!(s.patient.name.as_deref(), Some("Anonymized"));
    assert_eq!(s.patient.id, None);
    assert_eq!(s.study.accession_number.as_deref(), Some("FUJI95714"));
    assert!(!s.lossy);
    assert!(s.lossy_methods.is_empty());
}

#[test]
fn monochrome1_variant_reads_like_its_original() {
    let a = common::source(SIIM);
    let b = common::source(MONO1);
    assert_eq!(a, b);
}

#[test]
fn missing_required_attribute_is_named() {
    let mut file = common::read(SIIM);
    file.remove_element(dicom_dictionary_std::tags::STUDY_INSTANCE_UID);
    let err = SourceImage::from_object(&file).unwrap_err();
    assert!(
        matches!(
            err,
            PacsError::MissingAttribute {
                keyword: "StudyInstanceUID",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("(0020,000D)"), "{err}");
}

#[test]
fn garbage_and_truncated_input_are_errors_not_panics() {
    for bytes in [
        &b"not a dicom file at all"[..],
        &[][..],
        &[0x08, 0x00, 0x05, 0x00, 0xff, 0xff, 0xff, 0x7f][..],
    ] {
        assert!(matches!(read_dicom(bytes), Err(PacsError::Read { .. })));
    }
    let full = std::fs::read(common::dicom_dir().join(RG1)).unwrap();
    for cut in [140, 400, 2000] {
        let result = read_dicom(&full[..cut]).and_then(|f| SourceImage::from_object(&f));
        assert!(result.is_err(), "truncated at {cut}");
    }
}
