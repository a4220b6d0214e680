//! Small helpers to build data sets: typed puts, code and reference items, the modules every
//! result object shares (Patient, General Study, SOP Common), the File Meta, and the bytes.

use dicom_core::value::{DataSetSequence, PrimitiveValue};
use dicom_core::{DataElement, Length, VR};
use dicom_dictionary_std::{tags, uids};
use dicom_object::{FileDicomObject, FileMetaTableBuilder, InMemDicomObject, Tag};

use crate::codes::{self, Code};
use crate::error::{PacsError, Result};
use crate::result::{ResultSet, Timestamp};
use crate::uid;

/// Hilum's File Meta ImplementationClassUID: a fixed UID under 2.25 (derived once from the
/// crate's name), as PS3.7 D.3.3.2 asks of an implementation without a registered root.
pub(crate) fn implementation_class_uid() -> String {
    uid::derive_uid(&["hilum implementation class"])
}

/// ImplementationVersionName (SH, at most 16 characters).
pub(crate) fn implementation_version_name() -> String {
    let v = format!("HILUM_{}", env!("CARGO_PKG_VERSION"));
    v.chars().take(16).collect()
}

/// Truncates to at most `n` characters (the VR's limit: LO 64, SH 16, CS 16).
pub(crate) fn clip(s: &str, n: usize) -> String {
    s.chars().take(n).collect()
}

pub(crate) fn put_str(o: &mut InMemDicomObject, tag: Tag, vr: VR, value: &str) {
    o.put(DataElement::new(tag, vr, PrimitiveValue::from(value)));
}

/// A Type 2 attribute: its value when known, else present and empty.
pub(crate) fn put_opt(o: &mut InMemDicomObject, tag: Tag, vr: VR, value: Option<&str>) {
    match value {
        Some(v) => put_str(o, tag, vr, v),
        None => {
            o.put(DataElement::new(tag, vr, PrimitiveValue::Empty));
        }
    }
}

pub(crate) fn put_strs(o: &mut InMemDicomObject, tag: Tag, vr: VR, values: &[&str]) {
    let values: Vec<String> = values.iter().map(|s| s.to_string()).collect();
    o.put(DataElement::new(
        tag,
        vr,
        PrimitiveValue::Strs(values.into()),
    ));
}

pub(crate) fn put_u16(o: &mut InMemDicomObject, tag: Tag, value: u16) {
    o.put(DataElement::new(tag, VR::US, PrimitiveValue::from(value)));
}

pub(crate) fn put_seq(o: &mut InMemDicomObject, tag: Tag, items: Vec<InMemDicomObject>) {
    o.put(DataElement::new(
        tag,
        VR::SQ,
        DataSetSequence::new(items, Length::UNDEFINED),
    ));
}

/// A DS value (at most 16 characters, PS3.5 6.2): the shortest decimal that reads back as the
/// same `f64` when it fits, else the closest that fits.
pub(crate) fn ds(v: f64) -> String {
    let shortest = format!("{v}");
    if shortest.len() <= 16 {
        return shortest;
    }
    if (1e-4..1e15).contains(&v.abs()) {
        for decimals in (0..=15).rev() {
            let s = format!("{v:.decimals$}");
            if s.len() <= 16 {
                return if s.contains('.') {
                    s.trim_end_matches('0').trim_end_matches('.').to_string()
                } else {
                    s
                };
            }
        }
    }
    for digits in (0..=10).rev() {
        let s = format!("{v:.digits$e}");
        if s.len() <= 16 {
            return s;
        }
    }
    // Unreachable for finite values: "-1.0e-308" is 9 characters.
    format!("{v:e}")
}

/// A Code Sequence Macro item (PS3.3 Table 8.8-1).
pub(crate) fn code_item(code: &Code) -> InMemDicomObject {
    let mut o = InMemDicomObject::new_empty();
    put_str(&mut o, tags::CODE_VALUE, VR::SH, &code.value);
    put_str(&mut o, tags::CODING_SCHEME_DESIGNATOR, VR::SH, &code.scheme);
    put_str(&mut o, tags::CODE_MEANING, VR::LO, &clip(&code.meaning, 64));
    o
}

/// A code sequence of one item.
pub(crate) fn put_code(o: &mut InMemDicomObject, tag: Tag, code: &Code) {
    put_seq(o, tag, vec![code_item(code)]);
}

/// An SOP Instance Reference Macro item (PS3.3 Table 10-11).
pub(crate) fn sop_ref(class_uid: &str, instance_uid: &str) -> InMemDicomObject {
    let mut o = InMemDicomObject::new_empty();
    put_str(&mut o, tags::REFERENCED_SOP_CLASS_UID, VR::UI, class_uid);
    put_str(
        &mut o,
        tags::REFERENCED_SOP_INSTANCE_UID,
        VR::UI,
        instance_uid,
    );
    o
}

/// Patient (C.7.1.1) and General Study (C.7.2.1) modules copied from the source, so the object
/// files under the same patient and study. Type 2 attributes the source lacks are written empty.
/// Lossy Image Compression (and its methods) copied from the source: an object derived from a
/// lossy image says so (PS3.3 C.7.6.1.1.5).
pub(crate) fn lossy_compression(o: &mut InMemDicomObject, s: &crate::source::SourceImage) {
    put_str(
        o,
        tags::LOSSY_IMAGE_COMPRESSION,
        VR::CS,
        if s.lossy { "01" } else { "00" },
    );
    if s.lossy && !s.lossy_methods.is_empty() {
        let methods: Vec<&str> = s.lossy_methods.iter().map(String::as_str).collect();
        put_strs(o, tags::LOSSY_IMAGE_COMPRESSION_METHOD, VR::CS, &methods);
    }
}

pub(crate) fn patient_and_study(o: &mut InMemDicomObject, rs: &ResultSet) {
    let p = &rs.source.patient;
    put_opt(o, tags::PATIENT_NAME, VR::PN, p.name.as_deref());
    put_opt(o, tags::PATIENT_ID, VR::LO, p.id.as_deref());
    put_opt(o, tags::PATIENT_BIRTH_DATE, VR::DA, p.birth_date.as_deref());
    put_opt(o, tags::PATIENT_SEX, VR::CS, p.sex.as_deref());
    let s = &rs.source.study;
    put_str(o, tags::STUDY_INSTANCE_UID, VR::UI, &s.instance_uid);
    put_opt(o, tags::STUDY_DATE, VR::DA, s.date.as_deref());
    put_opt(o, tags::STUDY_TIME, VR::TM, s.time.as_deref());
    put_opt(
        o,
        tags::ACCESSION_NUMBER,
        VR::SH,
        s.accession_number.as_deref(),
    );
    put_opt(
        o,
        tags::REFERRING_PHYSICIAN_NAME,
        VR::PN,
        s.referring_physician_name.as_deref(),
    );
    put_opt(o, tags::STUDY_ID, VR::SH, s.id.as_deref());
}

/// The new series of this object: Modality, Series Instance UID and Number, and a description
/// naming the protocol (General Series C.7.3.1 / SR Document Series C.17.1 / Segmentation
/// Series C.8.20.1).
pub(crate) fn series(
    o: &mut InMemDicomObject,
    modality: &str,
    series_uid: &str,
    number: u32,
    description: &str,
    created: &Timestamp,
) {
    put_str(o, tags::MODALITY, VR::CS, modality);
    put_str(o, tags::SERIES_INSTANCE_UID, VR::UI, series_uid);
    put_str(o, tags::SERIES_NUMBER, VR::IS, &number.to_string());
    put_str(o, tags::SERIES_DATE, VR::DA, &created.date);
    put_str(o, tags::SERIES_TIME, VR::TM, &created.time);
    put_str(o, tags::SERIES_DESCRIPTION, VR::LO, &clip(description, 64));
}

/// General Equipment (C.7.5.1) and the Type 1 attributes of Enhanced General Equipment
/// (C.7.5.2), from the device.
pub(crate) fn equipment(o: &mut InMemDicomObject, rs: &ResultSet) {
    let d = &rs.device;
    put_str(o, tags::MANUFACTURER, VR::LO, &clip(&d.manufacturer, 64));
    put_str(
        o,
        tags::MANUFACTURER_MODEL_NAME,
        VR::LO,
        &clip(&d.model_name, 64),
    );
    put_str(
        o,
        tags::DEVICE_SERIAL_NUMBER,
        VR::LO,
        &clip(&d.serial_number, 64),
    );
    put_str(
        o,
        tags::SOFTWARE_VERSIONS,
        VR::LO,
        &clip(&d.software_version, 64),
    );
}

/// SOP Common (C.12.1): UTF-8 text (ISO_IR 192), creation time, SOP class and instance.
pub(crate) fn sop_common(
    o: &mut InMemDicomObject,
    class_uid: &str,
    instance_uid: &str,
    created: &Timestamp,
) {
    put_str(o, tags::SPECIFIC_CHARACTER_SET, VR::CS, "ISO_IR 192");
    put_str(o, tags::INSTANCE_CREATION_DATE, VR::DA, &created.date);
    put_str(o, tags::INSTANCE_CREATION_TIME, VR::TM, &created.time);
    put_str(o, tags::SOP_CLASS_UID, VR::UI, class_uid);
    put_str(o, tags::SOP_INSTANCE_UID, VR::UI, instance_uid);
}

/// Coding Scheme Identification Sequence (SOP Common, PS3.3 C.12.1.1.9): declares the private
/// `99HILUM` scheme for readers that meet its codes.
pub(crate) fn declare_private_scheme(o: &mut InMemDicomObject) {
    let mut item = InMemDicomObject::new_empty();
    put_str(
        &mut item,
        tags::CODING_SCHEME_DESIGNATOR,
        VR::SH,
        codes::PRIVATE_SCHEME,
    );
    put_str(
        &mut item,
        tags::CODING_SCHEME_NAME,
        VR::ST,
        "Hilum private concepts",
    );
    put_str(
        &mut item,
        tags::CODING_SCHEME_RESPONSIBLE_ORGANIZATION,
        VR::ST,
        "Hilum",
    );
    put_seq(o, tags::CODING_SCHEME_IDENTIFICATION_SEQUENCE, vec![item]);
}

/// Wraps a data set in a File Meta table: Explicit VR Little Endian, Hilum's implementation.
pub(crate) fn into_file(
    o: InMemDicomObject,
    class_uid: &str,
    instance_uid: &str,
) -> Result<FileDicomObject<InMemDicomObject>> {
    let meta = FileMetaTableBuilder::new()
        .transfer_syntax(uids::EXPLICIT_VR_LITTLE_ENDIAN)
        .media_storage_sop_class_uid(class_uid)
        .media_storage_sop_instance_uid(instance_uid)
        .implementation_class_uid(implementation_class_uid())
        .implementation_version_name(implementation_version_name());
    o.with_meta(meta)
        .map_err(|e| PacsError::Encode(format!("File Meta: {e}")))
}

/// The object as a DICOM Part 10 file (preamble, `DICM`, File Meta, data set).
pub fn to_bytes(file: &FileDicomObject<InMemDicomObject>) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    file.write_all(&mut out)
        .map_err(|e| PacsError::Encode(e.to_string()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ds_fits_sixteen_characters_and_reads_back() {
        for v in [
            0.0,
            1.0,
            0.5,
            1234.5,
            0.123_456_789_012_345_68,
            -0.000_012_345_678_901_234,
            123_456_789_012_345_680.0,
            1.0e-300,
            1.234_567_890_123_456_7e300,
            std::f64::consts::PI,
        ] {
            let s = ds(v);
            assert!(s.len() <= 16, "{v}: {s}");
            let back: f64 = s.parse().unwrap();
            let tolerance = v.abs() * 1e-9;
            assert!((back - v).abs() <= tolerance, "{v}: {s}");
        }
        assert_eq!(ds(1234.5), "1234.5");
        assert_eq!(ds(61_234.0 * 0.168 * 0.168), "1728.268416");
    }
}
