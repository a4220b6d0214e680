//! The SR as this crate reads it back: structure, values, UIDs, determinism.

use dicom_dictionary_std::tags;
use hilum_pacs::{
    read_dicom, sr, to_bytes, Device, Finding, InMemDicomObject, Measurement, ModelInfo, PacsError,
    ResultSet, Side, SourceImage, Timestamp,
};

use crate::common::{self, CR_NO_META, SIIM};

pub fn models() -> Vec<ModelInfo> {
    vec![
        ModelInfo {
            id: "densenet121-res224-all".into(),
            sha256: "1".repeat(64),
        },
        ModelInfo {
            id: "lung-unet".into(),
            sha256: "2".repeat(64),
        },
    ]
}

/// The result set the reader tests also use: two lung areas, a CTR, three findings, an answer.
pub fn results(source: SourceImage) -> ResultSet {
    let mut rs = ResultSet::new(
        source,
        "cxr-pa-default",
        Device::hilum("0.1.0", "test-site"),
        models(),
    );
    rs.created = Timestamp {
        date: "20261207".into(),
        time: "120000".into(),
    };
    rs.measurements = vec![
        Measurement::lung_area(Side::Right, 61_234, "lung-unet"),
        Measurement::lung_area(Side::Left, 52_101, "lung-unet"),
        Measurement::cardiothoracic_ratio(0.4871, "lung-unet"),
    ];
    rs.findings = vec![
        Finding::new("Effusion", 0.8125, "densenet121-res224-all"),
        Finding::new("Pneumothorax", 0.0625, "densenet121-res224-all"),
        Finding::new(
            "Atelectasis",
            0.123_456_789_012_345_6,
            "densenet121-res224-all",
        ),
    ];
    rs.question = Some("Is there a pleural effusion?".into());
    rs.answer =
        Some("Probably a right pleural effusion (p = 0.81); no pneumothorax. Ünïcödé ✓".into());
    rs.research_only = true;
    rs
}

fn str_of(o: &InMemDicomObject, tag: dicom_object::Tag) -> String {
    o.get(tag)
        .map(|e| {
            e.to_str()
                .unwrap()
                .trim_end_matches(['\0', ' '])
                .to_string()
        })
        .unwrap_or_default()
}

#[test]
fn sr_copies_patient_and_study_and_references_the_source() {
    let source = common::source(SIIM);
    let rs = results(source.clone());
    let file = sr::write(&rs).unwrap();
    let back = read_dicom(&to_bytes(&file).unwrap()).unwrap();
    assert_eq!(
        back.meta().transfer_syntax().trim_end_matches('\0'),
        "1.2.840.10008.1.2.1"
    );
    assert_eq!(
        str_of(&back, tags::SOP_CLASS_UID),
        "1.2.840.10008.5.1.4.1.1.88.33"
    );
    assert_eq!(str_of(&back, tags::MODALITY), "SR");
    assert_eq!(
        str_of(&back, tags::STUDY_INSTANCE_UID),
        source.study.instance_uid
    );
    assert_eq!(
        str_of(&back, tags::PATIENT_ID),
        source.patient.id.clone().unwrap()
    );
    assert_eq!(str_of(&back, tags::PATIENT_SEX), "M");
    assert_ne!(
        str_of(&back, tags::SERIES_INSTANCE_UID),
        source.series_instance_uid
    );
    let uids = sr::uids(&rs);
    assert_eq!(str_of(&back, tags::SOP_INSTANCE_UID), uids.sop_instance_uid);
    assert_eq!(
        str_of(&back, tags::SERIES_INSTANCE_UID),
        uids.series_instance_uid
    );
    // Evidence: study > series > the source instance.
    let evidence = back
        .get(tags::CURRENT_REQUESTED_PROCEDURE_EVIDENCE_SEQUENCE)
        .and_then(|e| e.items())
        .unwrap();
    let series = evidence[0]
        .get(tags::REFERENCED_SERIES_SEQUENCE)
        .unwrap()
        .items()
        .unwrap();
    assert_eq!(
        str_of(&series[0], tags::SERIES_INSTANCE_UID),
        source.series_instance_uid
    );
    let sop = series[0]
        .get(tags::REFERENCED_SOP_SEQUENCE)
        .unwrap()
        .items()
        .unwrap();
    assert_eq!(
        str_of(&sop[0], tags::REFERENCED_SOP_INSTANCE_UID),
        source.sop_instance_uid
    );
}

#[test]
fn resending_the_same_results_gives_the_same_bytes() {
    let rs = results(common::source(SIIM));
    let a = to_bytes(&sr::write(&rs).unwrap()).unwrap();
    let b = to_bytes(&sr::write(&rs).unwrap()).unwrap();
    assert_eq!(a, b);
    let mut other = rs.clone();
    other.models[0].sha256 = "3".repeat(64);
    assert_ne!(sr::uids(&other), sr::uids(&rs));
}

#[test]
fn bare_dataset_source_gives_an_sr_in_pixels() {
    let rs = results(common::source(CR_NO_META));
    let bytes = to_bytes(&sr::write(&rs).unwrap()).unwrap();
    // The UCUM pixel unit is in the file, mm2 is not.
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"{pixels}"));
    assert!(!has(b"mm2"));
}

#[test]
fn inconsistent_results_are_refused_with_the_field_to_fix() {
    let source = common::source(SIIM);
    let mut rs = results(source.clone());
    rs.findings[0].model_id = "unknown-model".into();
    let err = sr::write(&rs).unwrap_err();
    assert!(matches!(err, PacsError::InvalidResult(_)));
    assert!(err.to_string().contains("ResultSet.models"), "{err}");

    let mut rs = results(source.clone());
    rs.findings[1].probability = 1.5;
    assert!(sr::write(&rs).unwrap_err().to_string().contains("0..=1"));

    let mut rs = results(source.clone());
    rs.models[0].sha256 = "abc".into();
    assert!(sr::write(&rs).unwrap_err().to_string().contains("SHA-256"));

    let mut rs = results(source);
    rs.measurements.clear();
    rs.findings.clear();
    rs.answer = None;
    assert!(sr::write(&rs)
        .unwrap_err()
        .to_string()
        .contains("nothing to report"));
}
