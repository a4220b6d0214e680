//! A DICOM file's attributes for the person reading it: the study context a viewer shows in
//! its corners (patient, study date, view) and every top-level attribute as text for a tag
//! view. These carry PHI: they are for the local reader's screen, never for a model or a log.

use dicom_core::dictionary::{DataDictionary, DataDictionaryEntry};
use dicom_core::value::Value;
use dicom_core::Tag;
use dicom_dictionary_std::{tags, StandardDataDictionary};
use serde::Serialize;

use crate::dicom::{looks_like_dicom, parse, DicomFile};
use crate::ImagingError;

/// The longest value text a tag row carries (long texts and binary values are cut).
const MAX_VALUE_CHARS: usize = 160;

/// One top-level attribute as text.
#[derive(Clone, Debug, Serialize)]
pub struct DicomTag {
    /// `(gggg,eeee)`.
    pub tag: String,
    /// The value representation (`DA`, `PN`, …).
    pub vr: String,
    /// The dictionary keyword (`StudyDate`), empty for private or unknown tags.
    pub name: String,
    /// The value as text (sequences and pixel data summarised, long values cut).
    pub value: String,
}

/// What a reading viewer shows beside the image. Dates are `YYYY-MM-DD`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StudyContext {
    /// Patient's Name as written (`FAMILY^GIVEN`).
    pub patient_name: Option<String>,
    /// Initials of the patient's name (`DOE^JOHN` → `J.D.`), when it reads as a name.
    pub patient_initials: Option<String>,
    /// Patient ID.
    pub patient_id: Option<String>,
    /// Patient's Sex.
    pub patient_sex: Option<String>,
    /// Patient's Birth Date.
    pub patient_birth_date: Option<String>,
    /// Study Date (else Series or Acquisition Date).
    pub study_date: Option<String>,
    /// Study Time as `HH:MM`.
    pub study_time: Option<String>,
    /// Study Description.
    pub study_description: Option<String>,
    /// Accession Number.
    pub accession_number: Option<String>,
    /// Institution Name.
    pub institution: Option<String>,
    /// Modality (`CR`, `DX`, …).
    pub modality: Option<String>,
    /// View Position (`PA`, `AP`, `LL`, …).
    pub view_position: Option<String>,
    /// Image Laterality, else Laterality.
    pub laterality: Option<String>,
    /// Body Part Examined.
    pub body_part: Option<String>,
    /// Series Description.
    pub series_description: Option<String>,
}

fn text(obj: &DicomFile, tag: Tag) -> Option<String> {
    let s = obj.get(tag)?.to_str().ok()?;
    let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
    (!s.is_empty()).then(|| s.to_string())
}

/// `YYYYMMDD` as `YYYY-MM-DD`; anything else as written.
fn date(s: Option<String>) -> Option<String> {
    s.map(|d| {
        let b = d.as_bytes();
        if b.len() == 8 && b.iter().all(u8::is_ascii_digit) {
            format!("{}-{}-{}", &d[..4], &d[4..6], &d[6..])
        } else {
            d
        }
    })
}

/// `HHMMSS(.frac)` as `HH:MM`.
fn time(s: Option<String>) -> Option<String> {
    s.map(|t| {
        let b = t.as_bytes();
        if b.len() >= 4 && b[..4].iter().all(u8::is_ascii_digit) {
            format!("{}:{}", &t[..2], &t[2..4])
        } else {
            t
        }
    })
}

/// `FAMILY^GIVEN^MIDDLE` → `G.M.F.`; `None` for a name that is not letters (an id or a hash).
fn initials(name: &str) -> Option<String> {
    let parts: Vec<&str> = name.split('^').map(str::trim).collect();
    let family = parts.first().copied().unwrap_or_default();
    let order = parts.iter().skip(1).chain(std::iter::once(&family));
    let letters: Vec<char> = order
        .filter_map(|p| p.chars().next())
        .filter(|c| c.is_alphabetic())
        .collect();
    let wordy = parts
        .iter()
        .all(|p| p.chars().all(|c| c.is_alphabetic() || c == ' ' || c == '-'));
    (wordy && !letters.is_empty()).then(|| {
        letters
            .iter()
            .map(|c| format!("{}.", c.to_uppercase()))
            .collect()
    })
}

fn context(obj: &DicomFile) -> StudyContext {
    let patient_name = text(obj, tags::PATIENT_NAME);
    StudyContext {
        patient_initials: patient_name.as_deref().and_then(initials),
        patient_name,
        patient_id: text(obj, tags::PATIENT_ID),
        patient_sex: text(obj, tags::PATIENT_SEX),
        patient_birth_date: date(text(obj, tags::PATIENT_BIRTH_DATE)),
        study_date: date(
            text(obj, tags::STUDY_DATE)
                .or_else(|| text(obj, tags::SERIES_DATE))
                .or_else(|| text(obj, tags::ACQUISITION_DATE)),
        ),
        study_time: time(text(obj, tags::STUDY_TIME)),
        study_description: text(obj, tags::STUDY_DESCRIPTION),
        accession_number: text(obj, tags::ACCESSION_NUMBER),
        institution: text(obj, tags::INSTITUTION_NAME),
        modality: text(obj, tags::MODALITY),
        view_position: text(obj, tags::VIEW_POSITION),
        laterality: text(obj, tags::IMAGE_LATERALITY).or_else(|| text(obj, tags::LATERALITY)),
        body_part: text(obj, tags::BODY_PART_EXAMINED),
        series_description: text(obj, tags::SERIES_DESCRIPTION),
    }
}

fn cut(s: &str) -> String {
    let s = s.trim_matches(|c: char| c.is_whitespace() || c == '\0');
    if s.chars().count() > MAX_VALUE_CHARS {
        let head: String = s.chars().take(MAX_VALUE_CHARS).collect();
        format!("{head}…")
    } else {
        s.to_string()
    }
}

fn tag_rows(obj: &DicomFile) -> Vec<DicomTag> {
    obj.iter()
        .map(|e| {
            let tag = e.header().tag;
            let value = match e.value() {
                Value::Sequence(seq) => format!("(sequence of {} item(s))", seq.items().len()),
                Value::PixelSequence(seq) => {
                    format!(
                        "(encapsulated pixel data, {} fragment(s))",
                        seq.fragments().len()
                    )
                }
                Value::Primitive(p) if tag == tags::PIXEL_DATA => {
                    format!("(pixel data, {} bytes)", p.calculate_byte_len())
                }
                Value::Primitive(p) => cut(&p.to_str()),
            };
            DicomTag {
                tag: format!("({:04X},{:04X})", tag.group(), tag.element()),
                vr: e.vr().to_string().to_string(),
                name: StandardDataDictionary
                    .by_tag(tag)
                    .map(|d| d.alias().to_string())
                    .unwrap_or_default(),
                value,
            }
        })
        .collect()
}

/// The study context and the top-level attributes of a DICOM file (`what` names it in errors).
pub fn dicom_tags(bytes: &[u8], what: &str) -> Result<(StudyContext, Vec<DicomTag>), ImagingError> {
    if !looks_like_dicom(bytes) {
        return Err(ImagingError::NotDicom {
            what: what.to_string(),
        });
    }
    let (obj, _warnings) = parse(bytes, what)?;
    Ok((context(&obj), tag_rows(&obj)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initials_read_names_and_skip_ids() {
        assert_eq!(initials("DOE^JOHN").as_deref(), Some("J.D."));
        assert_eq!(initials("CompressedSamples^RG1"), None);
        assert_eq!(initials("16d7f894-55d7-4d95"), None);
        assert_eq!(initials("Anonymized").as_deref(), Some("A."));
    }

    #[test]
    fn real_file_gives_its_study_date_view_and_tags() {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/data/cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
        let Ok(bytes) = std::fs::read(&p) else {
            panic!("real test data missing: {}", p.display());
        };
        let (ctx, rows) = dicom_tags(&bytes, "siim").expect("tags");
        assert_eq!(ctx.study_date.as_deref(), Some("1901-01-01"));
        assert_eq!(ctx.view_position.as_deref(), Some("PA"));
        assert_eq!(ctx.modality.as_deref(), Some("CR"));
        let spacing = rows
            .iter()
            .find(|r| r.name == "PixelSpacing")
            .expect("spacing row");
        assert_eq!(spacing.tag, "(0028,0030)");
        assert!(spacing.value.contains("0.168"), "{}", spacing.value);
        assert!(rows
            .iter()
            .any(|r| r.tag == "(7FE0,0010)" && r.value.contains("pixel data")));
    }
}
