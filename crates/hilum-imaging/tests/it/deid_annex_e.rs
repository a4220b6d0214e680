//! De-identification by the whole of PS3.15 Table E.1-1: a synthetic dataset sets every
//! attribute of the table to a marker value, at the top level and again inside a sequence item,
//! and the export is searched for every marker.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use dicom_core::dictionary::{DataDictionary, DataDictionaryEntry};
use dicom_core::header::Header;
use dicom_core::value::DataSetSequence;
use dicom_core::{DataElement, PrimitiveValue, Tag, VR};
use dicom_dictionary_std::{tags, StandardDataDictionary};
use dicom_object::mem::InMemElement;
use dicom_object::meta::FileMetaTableBuilder;
use dicom_object::InMemDicomObject;
use hilum_imaging::{
    annex_e, decode_with, export_deidentified, AnnexERow, DecodeOptions, DeidOptions, DeidReport,
    ImagingError, ProfileOption, Voi,
};

const SHIFT: i64 = -100;
/// A sequence the table does not list: kept, and searched inside.
const WRAPPER: Tag = tags::ANATOMIC_REGION_SEQUENCE;

fn vr_of(row: &AnnexERow, tag: Tag) -> Option<VR> {
    row.vr
        .or_else(|| StandardDataDictionary.by_tag(tag).map(|e| e.vr().relaxed()))
}

fn is_binary(vr: VR) -> bool {
    matches!(
        vr,
        VR::OB | VR::OW | VR::OF | VR::OD | VR::OL | VR::OV | VR::UN
    )
}

/// How a value is compared: its text, or its bytes for binary VRs.
fn repr(e: &InMemElement) -> String {
    if is_binary(e.vr()) {
        e.to_bytes()
            .map(|b| String::from_utf8_lossy(&b[..]).into_owned())
            .unwrap_or_default()
    } else {
        e.to_str()
            .map(|s| s.trim_end_matches(['\0', ' ']).to_string())
            .unwrap_or_default()
    }
}

/// A week apart, so that no shift by `SHIFT` (not a multiple of 7) lands on another marker.
fn marker_date(i: usize) -> chrono::NaiveDate {
    chrono::NaiveDate::from_ymd_opt(1971, 1, 1).expect("date")
        + chrono::TimeDelta::days(7 * i as i64)
}

/// A value of `vr` that names row `i` and nothing else.
fn marker(i: usize, tag: Tag, vr: VR) -> InMemElement {
    let text = |s: String| DataElement::new(tag, vr, PrimitiveValue::from(s));
    match vr {
        VR::AE | VR::CS | VR::LO | VR::LT | VR::PN | VR::SH | VR::ST | VR::UC | VR::UR | VR::UT => {
            text(format!("MK{i:04}"))
        }
        VR::UI => text(format!("1.2.999.{i}")),
        VR::DA => text(marker_date(i).format("%Y%m%d").to_string()),
        VR::DT => text(format!("{}040506", marker_date(i).format("%Y%m%d"))),
        VR::TM => text(format!("05{:02}{:02}", i / 60, i % 60)),
        VR::AS => text(format!("{:03}W", i % 1000)),
        VR::IS => text(format!("{}", 900_000 + i)),
        VR::DS => text(format!("{}.5", 900_000 + i)),
        VR::US => DataElement::new(tag, vr, PrimitiveValue::from(30_000 + i as u16)),
        VR::SS => DataElement::new(tag, vr, PrimitiveValue::from(30_000 + i as i16)),
        VR::UL => DataElement::new(tag, vr, PrimitiveValue::from(3_000_000 + i as u32)),
        VR::SL => DataElement::new(tag, vr, PrimitiveValue::from(3_000_000 + i as i32)),
        VR::UV => DataElement::new(tag, vr, PrimitiveValue::from(3_000_000 + i as u64)),
        VR::SV => DataElement::new(tag, vr, PrimitiveValue::from(3_000_000 + i as i64)),
        VR::FL => DataElement::new(tag, vr, PrimitiveValue::from(30_000.25 + i as f32)),
        VR::FD => DataElement::new(tag, vr, PrimitiveValue::from(30_000.25 + i as f64)),
        VR::AT => DataElement::new(
            tag,
            vr,
            PrimitiveValue::Tags([Tag(0x7777, i as u16)].into_iter().collect()),
        ),
        VR::SQ => {
            let item = InMemDicomObject::from_element_iter([DataElement::new(
                tags::CODE_MEANING,
                VR::LO,
                PrimitiveValue::from(format!("MKSQ{i:04}")),
            )]);
            DataElement::new(tag, vr, DataSetSequence::from(vec![item]))
        }
        _ => {
            let mut b = format!("MKBIN{i:04}").into_bytes();
            b.resize(16, b'_');
            DataElement::new(tag, vr, PrimitiveValue::from(b))
        }
    }
}

struct Synthetic {
    obj: InMemDicomObject,
    /// Marker value -> the attribute that carried it.
    markers: HashMap<String, Tag>,
    /// The table's rows that were set, by tag.
    rows: HashMap<Tag, AnnexERow>,
}

/// Every attribute of the table with a marker (File Meta and command groups excepted: export
/// writes its own File Meta), the same again inside a sequence item, plus private, overlay and
/// curve attributes.
fn synthetic() -> Synthetic {
    let table = annex_e().expect("shipped table");
    let mut elements = Vec::new();
    let mut markers = HashMap::new();
    let mut rows = HashMap::new();
    for (i, row) in table.rows().iter().enumerate() {
        let Some(tag) = row.tag else { continue };
        if tag.group() == 0x0000 || tag.group() == 0x0002 {
            continue;
        }
        let vr = vr_of(row, tag).unwrap_or_else(|| panic!("no VR for {}", row.name));
        let e = marker(i, tag, vr);
        for r in marker_reprs(&e) {
            assert!(
                markers.insert(r, tag).is_none(),
                "marker of {} not unique",
                row.name
            );
        }
        rows.insert(tag, row.clone());
        elements.push(e);
    }
    let extra = [
        DataElement::new(
            Tag(0x0009, 0x0010),
            VR::LO,
            PrimitiveValue::from("MKCREATOR"),
        ),
        DataElement::new(
            Tag(0x0009, 0x1001),
            VR::LO,
            PrimitiveValue::from("MKPRIVATE"),
        ),
        DataElement::new(
            Tag(0x6002, 0x0022),
            VR::LO,
            PrimitiveValue::from("MKOVERLAY"),
        ),
        DataElement::new(Tag(0x5000, 0x0022), VR::LO, PrimitiveValue::from("MKCURVE")),
    ];
    for e in extra {
        markers.insert(repr(&e), e.tag());
        elements.push(e);
    }
    let item = InMemDicomObject::from_element_iter(elements.clone());
    let mut obj = InMemDicomObject::from_element_iter(elements);
    obj.put(DataElement::new(
        WRAPPER,
        VR::SQ,
        DataSetSequence::from(vec![item]),
    ));
    Synthetic { obj, markers, rows }
}

/// A sequence marker is found by its item's text.
fn marker_reprs(e: &InMemElement) -> Vec<String> {
    match e.items() {
        Some(items) => items
            .iter()
            .flat_map(|it| it.iter().map(repr).collect::<Vec<_>>())
            .collect(),
        None => vec![repr(e)],
    }
}

fn walk(obj: &InMemDicomObject, f: &mut impl FnMut(&InMemElement)) {
    for e in obj {
        match e.items() {
            Some(items) => items.iter().for_each(|it| walk(it, f)),
            None => f(e),
        }
    }
}

/// The attributes whose marker is still somewhere in `obj`.
fn survivors(obj: &InMemDicomObject, markers: &HashMap<String, Tag>) -> BTreeSet<Tag> {
    let mut found = BTreeSet::new();
    walk(obj, &mut |e| {
        if let Some(t) = markers.get(&repr(e)) {
            found.insert(*t);
        }
    });
    found
}

fn part10(obj: InMemDicomObject) -> Vec<u8> {
    let file = obj
        .with_meta(
            FileMetaTableBuilder::new()
                .transfer_syntax("1.2.840.10008.1.2.1")
                .media_storage_sop_class_uid("1.2.840.10008.5.1.4.1.1.1")
                .media_storage_sop_instance_uid("1.2.999.424242"),
        )
        .expect("meta");
    let mut out = Vec::new();
    file.write_all(&mut out).expect("write synthetic");
    out
}

fn export(obj: InMemDicomObject, opts: &DeidOptions) -> (Vec<u8>, InMemDicomObject, DeidReport) {
    let (out, report) = export_deidentified(&part10(obj), "synthetic.dcm", opts).expect("export");
    let back = dicom_object::from_reader(&out[..]).expect("exported file reads back");
    (out, back.into_inner(), report)
}

fn opts() -> DeidOptions {
    DeidOptions {
        salt: "annex-e-test".into(),
        ..Default::default()
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The rows an option keeps (`K`), among those the synthetic dataset set.
fn kept_by(s: &Synthetic, option: ProfileOption) -> BTreeSet<Tag> {
    s.rows
        .iter()
        .filter(|(_, r)| r.option(option) == Some('K'))
        .map(|(t, _)| *t)
        .collect()
}

#[test]
fn no_marker_survives_the_basic_profile() {
    let s = synthetic();
    assert!(s.rows.len() > 600, "{}", s.rows.len());
    let (out, back, report) = export(s.obj.clone(), &opts());
    assert_eq!(survivors(&back, &s.markers), BTreeSet::new());
    for needle in [&b"MK"[..], b"1.2.999."] {
        assert!(
            !contains(&out, needle),
            "{:?} in the bytes",
            String::from_utf8_lossy(needle)
        );
    }
    // The wrapper stays (it is not in the table) and was searched: its item is still there.
    let wrapper = back.element(WRAPPER).expect("wrapper kept");
    assert_eq!(wrapper.items().map(|i| i.len()), Some(1));
    let text = |t| {
        back.element(t)
            .ok()
            .and_then(|e| e.to_str().ok().map(|s| s.trim().to_string()))
    };
    assert_eq!(text(tags::PATIENT_IDENTITY_REMOVED).as_deref(), Some("YES"));
    assert_eq!(
        text(tags::LONGITUDINAL_TEMPORAL_INFORMATION_MODIFIED).as_deref(),
        Some("REMOVED")
    );
    assert!(report.uids_remapped > 100, "{}", report.uids_remapped);
    assert!(report.removed.len() > 300, "{}", report.removed.len());
    // The markers were there to find before the export.
    assert_eq!(
        survivors(&s.obj, &s.markers).len(),
        s.markers.values().collect::<BTreeSet<_>>().len()
    );
}

#[test]
fn retain_patient_characteristics_keeps_exactly_its_attributes() {
    let s = synthetic();
    let expected = kept_by(&s, ProfileOption::RetainPatientCharacteristics);
    assert!(expected.contains(&tags::PATIENT_SEX) && expected.contains(&tags::PATIENT_AGE));
    let o = DeidOptions {
        retain_patient_characteristics: true,
        ..opts()
    };
    let (_, back, _) = export(s.obj.clone(), &o);
    assert_eq!(survivors(&back, &s.markers), expected);
}

#[test]
fn retain_device_identity_keeps_exactly_its_attributes() {
    let s = synthetic();
    let expected = kept_by(&s, ProfileOption::RetainDeviceIdentity);
    assert!(
        expected.contains(&tags::DEVICE_SERIAL_NUMBER) && expected.contains(&tags::STATION_NAME)
    );
    let o = DeidOptions {
        retain_device_identity: true,
        ..opts()
    };
    let (_, back, _) = export(s.obj.clone(), &o);
    assert_eq!(survivors(&back, &s.markers), expected);
}

#[test]
fn modified_dates_option_shifts_every_date_and_keeps_times() {
    let s = synthetic();
    let o = DeidOptions {
        date_shift_days: Some(SHIFT),
        ..opts()
    };
    let (_, back, report) = export(s.obj.clone(), &o);
    let cleaned: Vec<(&Tag, &AnnexERow)> = s
        .rows
        .iter()
        .filter(|(_, r)| r.option(ProfileOption::RetainLongModifiedDates) == Some('C'))
        .collect();
    let times: BTreeSet<Tag> = cleaned
        .iter()
        .filter(|(t, r)| vr_of(r, **t) == Some(VR::TM))
        .map(|(t, _)| **t)
        .collect();
    assert!(times.contains(&tags::STUDY_TIME));
    // Times keep their value; dates no longer carry theirs.
    assert_eq!(survivors(&back, &s.markers), times);
    let table = annex_e().expect("table");
    let mut shifted = 0;
    for (tag, row) in &cleaned {
        let i = table.rows().iter().position(|r| r == *row).expect("row");
        let day = (marker_date(i) + chrono::TimeDelta::days(SHIFT)).format("%Y%m%d");
        let want = match vr_of(row, **tag) {
            Some(VR::DA) => day.to_string(),
            Some(VR::DT) => format!("{day}040506"),
            _ => continue,
        };
        let got = back.element(**tag).map(repr).unwrap_or_default();
        assert_eq!(got, want, "{}", row.name);
        shifted += 1;
    }
    assert!(shifted > 50 && report.dates_shifted >= shifted, "{shifted}");
    // Patient's Birth Date is not a longitudinal date: emptied (Z) all the same.
    let birth = back.element(tags::PATIENT_BIRTH_DATE).map(repr);
    assert_eq!(birth.as_deref().unwrap_or(""), "");
}

#[test]
fn uids_map_consistently_across_a_series() {
    let s = synthetic();
    let mut second = s.obj.clone();
    second.put(DataElement::new(
        tags::SOP_INSTANCE_UID,
        VR::UI,
        PrimitiveValue::from("1.2.999.77777"),
    ));
    let uid = |o: &InMemDicomObject, t| o.element(t).map(repr).expect("uid present");
    let (_, a, _) = export(s.obj.clone(), &opts());
    let (_, b, _) = export(second, &opts());
    for t in [
        tags::STUDY_INSTANCE_UID,
        tags::SERIES_INSTANCE_UID,
        tags::FRAME_OF_REFERENCE_UID,
    ] {
        assert_eq!(uid(&a, t), uid(&b, t));
        assert_ne!(uid(&a, t), uid(&s.obj, t));
        assert!(uid(&a, t).starts_with("2.25."));
    }
    assert_ne!(
        uid(&a, tags::SOP_INSTANCE_UID),
        uid(&b, tags::SOP_INSTANCE_UID)
    );
    // Another salt, another mapping.
    let other = DeidOptions {
        salt: "another-site".into(),
        ..opts()
    };
    let (_, c, _) = export(s.obj.clone(), &other);
    assert_ne!(
        uid(&a, tags::STUDY_INSTANCE_UID),
        uid(&c, tags::STUDY_INSTANCE_UID)
    );
}

#[test]
fn burned_in_annotation_is_refused_unless_overridden() {
    let mut obj = InMemDicomObject::from_element_iter([
        DataElement::new(tags::PATIENT_NAME, VR::PN, PrimitiveValue::from("DOE^JANE")),
        DataElement::new(
            tags::BURNED_IN_ANNOTATION,
            VR::CS,
            PrimitiveValue::from("YES"),
        ),
    ]);
    let bytes = part10(obj.clone());
    let err = export_deidentified(&bytes, "burned.dcm", &opts()).unwrap_err();
    assert!(
        matches!(err, ImagingError::BurnedInAnnotation { .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("burned.dcm") && msg.contains("--allow-burned-in"),
        "{msg}"
    );
    let o = DeidOptions {
        allow_burned_in_annotation: true,
        ..opts()
    };
    let (out, report) = export_deidentified(&bytes, "burned.dcm", &o).expect("overridden");
    assert!(report
        .warnings
        .iter()
        .any(|w| w.contains("Burned In Annotation")));
    assert!(!contains(&out, b"DOE"));
    // NO is no reason to refuse.
    obj.put(DataElement::new(
        tags::BURNED_IN_ANNOTATION,
        VR::CS,
        PrimitiveValue::from("NO"),
    ));
    assert!(export_deidentified(&part10(obj), "clean.dcm", &opts()).is_ok());
}

#[test]
fn shared_dicoms_decode_to_the_same_pixels_after_export() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/dicom");
    let files = [
        "CR-MONO1-10-chest_noPart10header.dcm",
        "RG1_chest_cr_pa_jpeg2000_lossy.dcm",
        "fake_monochrome1_variant.dcm",
        "siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm",
    ];
    let raw = DecodeOptions {
        voi: Voi::None,
        ..Default::default()
    };
    for name in files {
        let path = dir.join(name);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{} ({e}): ../shared/data beside the checkout",
                path.display()
            )
        });
        let o = DeidOptions {
            date_shift_days: Some(SHIFT),
            retain_patient_characteristics: true,
            retain_device_identity: true,
            ..opts()
        };
        for opts in [opts(), o] {
            let (out, _) = export_deidentified(&bytes, name, &opts).expect(name);
            let before = decode_with(&bytes, name, &raw).expect(name);
            let after = decode_with(&out, name, &raw).expect(name);
            assert_eq!(
                (before.width, before.height),
                (after.width, after.height),
                "{name}"
            );
            assert!(before.pixels == after.pixels, "{name}: pixels changed");
        }
    }
}
