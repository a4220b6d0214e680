//! De-identification: a subset of the DICOM PS3.15 Basic Application Level Confidentiality
//! Profile. What leaves the machine (cloud LLM, export) is this form only.
//!
//! - names (every PN attribute), patient ID, birth date, addresses, phone numbers,
//!   institution, physicians, operators, accession number, study ID, station, device serial,
//!   free-text comments and descriptions: removed, or replaced by a dummy (name, patient ID);
//! - every instance UID (any UI attribute that is not a SOP class / transfer syntax / coding
//!   scheme): replaced by `2.25.<hash>` of a secret salt and the original, so the same study
//!   keeps the same new UID within one salt;
//! - dates (DA, DT): shifted by a fixed number of days, or removed;
//! - private attributes and overlay/curve groups (may hold burned-in text): removed;
//! - sequences: the same rules, recursively;
//! - Patient Identity Removed = YES and De-identification Method are added.
//!
//! Pixels are kept as they are: a file flagged `BurnedInAnnotation = YES` is reported.

use std::hash::{BuildHasher, Hasher};

use dicom_core::header::Header;
use dicom_core::{DataElement, PrimitiveValue, Tag, VR};
use dicom_dictionary_std::tags;
use dicom_object::InMemDicomObject;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::dicom::{looks_like_dicom, parse};
use crate::ImagingError;

/// How to de-identify.
#[derive(Clone, Debug)]
pub struct DeidOptions {
    /// Secret mixed into replacement UIDs and patient IDs. Keep it the same across a site's
    /// exports to keep studies linked; never publish it (short IDs could be brute-forced).
    pub salt: String,
    /// Shift every date by this many days (negative = earlier); `None` removes dates.
    pub date_shift_days: Option<i64>,
    /// Keep Patient's Sex and Age (ages of 90 and above become `090Y`).
    pub keep_age_sex: bool,
}

impl Default for DeidOptions {
    /// A random per-process salt (a site that links exports sets its own `salt`); dates
    /// shifted by -100 days.
    fn default() -> Self {
        let salt = {
            let s = std::collections::hash_map::RandomState::new();
            let mut a = s.build_hasher();
            a.write_u64(std::process::id() as u64);
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default();
            a.write_u128(t);
            let mut b = std::collections::hash_map::RandomState::new().build_hasher();
            b.write_u64(a.finish());
            format!("{:016x}{:016x}", a.finish(), b.finish())
        };
        DeidOptions {
            salt,
            date_shift_days: Some(-100),
            keep_age_sex: true,
        }
    }
}

/// What de-identification did (attribute keywords or tags, never values).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeidReport {
    pub removed: Vec<String>,
    pub replaced: Vec<String>,
    pub uids_remapped: usize,
    pub dates_shifted: usize,
    pub warnings: Vec<String>,
}

/// Attributes removed outright (where they are not caught by the PN rule).
const REMOVE: &[Tag] = &[
    tags::PATIENT_BIRTH_DATE,
    tags::PATIENT_BIRTH_TIME,
    tags::PATIENT_ADDRESS,
    tags::PATIENT_TELEPHONE_NUMBERS,
    Tag(0x0010, 0x1000), // Other Patient IDs (retired)
    tags::OTHER_PATIENT_I_DS_SEQUENCE,
    tags::ISSUER_OF_PATIENT_ID,
    Tag(0x0010, 0x1090), // Medical Record Locator (retired)
    tags::MILITARY_RANK,
    tags::BRANCH_OF_SERVICE,
    Tag(0x0010, 0x2160), // Ethnic Group (retired)
    tags::OCCUPATION,
    tags::ADDITIONAL_PATIENT_HISTORY,
    tags::PATIENT_COMMENTS,
    tags::PATIENT_STATE,
    tags::PATIENT_INSTITUTION_RESIDENCE,
    tags::RESPONSIBLE_ORGANIZATION,
    tags::INSTITUTION_NAME,
    tags::INSTITUTION_ADDRESS,
    tags::INSTITUTIONAL_DEPARTMENT_NAME,
    tags::REFERRING_PHYSICIAN_ADDRESS,
    tags::REFERRING_PHYSICIAN_TELEPHONE_NUMBERS,
    tags::ACCESSION_NUMBER,
    tags::STUDY_ID,
    tags::STATION_NAME,
    tags::DEVICE_SERIAL_NUMBER,
    tags::ADMISSION_ID,
    tags::REQUESTED_PROCEDURE_ID,
    tags::PERFORMED_PROCEDURE_STEP_ID,
    tags::SCHEDULED_PROCEDURE_STEP_ID,
    tags::PLACER_ORDER_NUMBER_IMAGING_SERVICE_REQUEST,
    tags::FILLER_ORDER_NUMBER_IMAGING_SERVICE_REQUEST,
    tags::REQUEST_ATTRIBUTES_SEQUENCE,
    tags::REFERENCED_PATIENT_SEQUENCE,
    tags::IMAGE_COMMENTS,
    tags::STUDY_DESCRIPTION,
    tags::SERIES_DESCRIPTION,
    tags::PROTOCOL_NAME,
];

/// UI attributes that name a class or a syntax, not an instance: kept.
const KEEP_UIDS: &[Tag] = &[
    tags::SOP_CLASS_UID,
    tags::REFERENCED_SOP_CLASS_UID,
    tags::AFFECTED_SOP_CLASS_UID,
    tags::REFERENCED_SOP_CLASS_UID_IN_FILE,
    tags::CODING_SCHEME_UID,
    tags::TRANSFER_SYNTAX_UID,
    tags::MEDIA_STORAGE_SOP_CLASS_UID,
];

fn keyword(tag: Tag) -> String {
    use dicom_core::dictionary::{DataDictionary, DataDictionaryEntry};
    dicom_dictionary_std::StandardDataDictionary
        .by_tag(tag)
        .map(|e| e.alias().to_string())
        .unwrap_or_else(|| format!("({:04X},{:04X})", tag.group(), tag.element()))
}

fn salted_hash(salt: &str, value: &str) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(salt.as_bytes());
    h.update([0u8]);
    h.update(value.as_bytes());
    h.finalize().into()
}

/// `2.25.` + a 128-bit decimal derived from the original UID (PS3.5 B.2 UUID-derived form).
fn remap_uid(salt: &str, uid: &str) -> String {
    let d = salted_hash(salt, uid.trim_end_matches(['\0', ' ']));
    let mut n = [0u8; 16];
    n.copy_from_slice(&d[..16]);
    format!("2.25.{}", u128::from_be_bytes(n))
}

/// Shifts `YYYYMMDD` (and the date part of a DT); `None` if it is not a valid date.
fn shift_date(value: &str, days: i64) -> Option<String> {
    let v = value.trim();
    let head = v.get(..8)?;
    let date = chrono::NaiveDate::parse_from_str(head, "%Y%m%d").ok()?;
    let shifted = date.checked_add_signed(chrono::TimeDelta::try_days(days)?)?;
    Some(format!("{}{}", shifted.format("%Y%m%d"), &v[8..]))
}

/// De-identifies a dataset in place (recursing into sequences).
pub fn deidentify(obj: &mut InMemDicomObject, opts: &DeidOptions) -> DeidReport {
    let mut report = DeidReport::default();
    if obj
        .get(tags::BURNED_IN_ANNOTATION)
        .and_then(|e| e.to_str().ok())
        .is_some_and(|v| v.trim() == "YES")
    {
        report.warnings.push(
            "Burned In Annotation = YES: the pixels may show identifying text; review before sharing"
                .into(),
        );
    }
    deid_dataset(obj, opts, &mut report);
    let shifted = opts.date_shift_days.is_some();
    obj.put(DataElement::new(
        tags::PATIENT_IDENTITY_REMOVED,
        VR::CS,
        PrimitiveValue::from("YES"),
    ));
    obj.put(DataElement::new(
        tags::DEIDENTIFICATION_METHOD,
        VR::LO,
        PrimitiveValue::from(if shifted {
            "Hilum: PS3.15 Basic Profile subset; UIDs remapped; dates shifted"
        } else {
            "Hilum: PS3.15 Basic Profile subset; UIDs remapped; dates removed"
        }),
    ));
    obj.put(DataElement::new(
        tags::LONGITUDINAL_TEMPORAL_INFORMATION_MODIFIED,
        VR::CS,
        PrimitiveValue::from(if shifted { "MODIFIED" } else { "REMOVED" }),
    ));
    report.removed.sort();
    report.removed.dedup();
    report.replaced.sort();
    report.replaced.dedup();
    report
}

fn deid_dataset(obj: &mut InMemDicomObject, opts: &DeidOptions, report: &mut DeidReport) {
    let entries: Vec<(Tag, VR)> = obj.iter().map(|e| (e.tag(), e.vr())).collect();
    for (tag, vr) in entries {
        let remove = tag.group() % 2 == 1
            || (0x5000..=0x50FF).contains(&tag.group())
            || (0x6000..=0x60FF).contains(&tag.group())
            || REMOVE.contains(&tag);
        if remove {
            obj.remove_element(tag);
            report.removed.push(keyword(tag));
            continue;
        }
        if tag == tags::PATIENT_ID {
            let old = obj
                .get(tag)
                .and_then(|e| e.to_str().ok())
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            let h = salted_hash(&opts.salt, &old);
            let hex: String = h.iter().take(6).map(|b| format!("{b:02X}")).collect();
            obj.put(DataElement::new(
                tag,
                VR::LO,
                PrimitiveValue::from(format!("ANON{hex}")),
            ));
            report.replaced.push(keyword(tag));
            continue;
        }
        match vr {
            VR::PN if tag == tags::PATIENT_NAME => {
                obj.put(DataElement::new(
                    tag,
                    VR::PN,
                    PrimitiveValue::from("ANONYMIZED"),
                ));
                report.replaced.push(keyword(tag));
            }
            VR::PN => {
                obj.remove_element(tag);
                report.removed.push(keyword(tag));
            }
            VR::UI if !KEEP_UIDS.contains(&tag) => {
                let old: Vec<String> = obj
                    .get(tag)
                    .and_then(|e| e.to_str().ok())
                    .map(|s| s.split('\\').map(str::to_string).collect())
                    .unwrap_or_default();
                let new: Vec<String> = old.iter().map(|u| remap_uid(&opts.salt, u)).collect();
                obj.put(DataElement::new(
                    tag,
                    VR::UI,
                    PrimitiveValue::Strs(new.into_iter().collect()),
                ));
                report.uids_remapped += 1;
            }
            VR::DA | VR::DT => {
                let shifted: Option<Vec<String>> = opts.date_shift_days.and_then(|days| {
                    let v = obj.get(tag)?.to_str().ok()?.to_string();
                    v.split('\\')
                        .filter(|s| !s.trim().is_empty())
                        .map(|s| shift_date(s, days))
                        .collect()
                });
                match shifted {
                    Some(values) if !values.is_empty() => {
                        obj.put(DataElement::new(
                            tag,
                            vr,
                            PrimitiveValue::Strs(values.into_iter().collect()),
                        ));
                        report.dates_shifted += 1;
                    }
                    _ => {
                        obj.remove_element(tag);
                        report.removed.push(keyword(tag));
                    }
                }
            }
            VR::AS if tag == tags::PATIENT_AGE && opts.keep_age_sex => {
                let age = obj
                    .get(tag)
                    .and_then(|e| e.to_str().ok())
                    .map(|s| s.to_string());
                if let Some(a) = age {
                    let years = a
                        .trim()
                        .strip_suffix('Y')
                        .and_then(|n| n.parse::<u32>().ok());
                    if years.is_some_and(|y| y >= 90) {
                        obj.put(DataElement::new(tag, VR::AS, PrimitiveValue::from("090Y")));
                        report.replaced.push(keyword(tag));
                    }
                }
            }
            VR::SQ => {
                obj.update_value(tag, |value| {
                    if let Some(items) = value.items_mut() {
                        for item in items.iter_mut() {
                            deid_dataset(item, opts, report);
                        }
                    }
                });
            }
            _ => {}
        }
        if !opts.keep_age_sex && (tag == tags::PATIENT_AGE || tag == tags::PATIENT_SEX) {
            obj.remove_element(tag);
            report.removed.push(keyword(tag));
        }
    }
}

/// Parses a DICOM file, de-identifies it and writes it as a Part 10 file (with preamble and
/// File Meta, whatever the input had).
pub fn export_deidentified(
    bytes: &[u8],
    what: &str,
    opts: &DeidOptions,
) -> Result<(Vec<u8>, DeidReport), ImagingError> {
    if !looks_like_dicom(bytes) {
        return Err(ImagingError::NotDicom {
            what: what.to_string(),
        });
    }
    let (mut file, warnings) = parse(bytes, what)?;
    let mut report = deidentify(&mut file, opts);
    report.warnings.extend(warnings);
    let new_instance = file
        .get(tags::SOP_INSTANCE_UID)
        .and_then(|e| e.to_str().ok())
        .map(|s| s.trim_end_matches(['\0', ' ']).to_string());
    {
        let meta = file.meta_mut();
        meta.media_storage_sop_instance_uid = match new_instance {
            Some(uid) => uid,
            None => remap_uid(&opts.salt, &meta.media_storage_sop_instance_uid),
        };
        meta.source_application_entity_title = None;
        meta.sending_application_entity_title = None;
        meta.receiving_application_entity_title = None;
        meta.private_information_creator_uid = None;
        meta.private_information = None;
    }
    let mut out = Vec::with_capacity(bytes.len() + 1024);
    file.write_all(&mut out).map_err(|e| ImagingError::Encode {
        what: what.to_string(),
        reason: e.to_string(),
    })?;
    Ok((out, report))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn date_shift_crosses_month_and_leap_years() {
        assert_eq!(shift_date("20240301", -1).as_deref(), Some("20240229"));
        assert_eq!(shift_date("20231231", 1).as_deref(), Some("20240101"));
        assert_eq!(shift_date("20000101", -100).as_deref(), Some("19990923"));
        assert_eq!(
            shift_date("20200102123000", 1).as_deref(),
            Some("20200103123000")
        );
        assert_eq!(shift_date("garbage", 1), None);
        assert_eq!(shift_date("20230231", 1), None);
    }

    #[test]
    fn uid_remap_is_consistent_per_salt_and_valid() {
        let a = remap_uid("s1", "1.2.3.4");
        assert_eq!(a, remap_uid("s1", "1.2.3.4\0"));
        assert_ne!(a, remap_uid("s2", "1.2.3.4"));
        assert_ne!(a, remap_uid("s1", "1.2.3.5"));
        assert!(a.len() <= 64 && a.starts_with("2.25."));
        assert!(a[5..].chars().all(|c| c.is_ascii_digit()));
    }
}
