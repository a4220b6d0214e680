//! The derived overlay as this crate reads it back.

use dicom_dictionary_std::tags;
use hilum_pacs::{read_dicom, sc, to_bytes, Overlay, ResultSet};

use crate::common::{self, CR_NO_META, SIIM};
use crate::sr::results;

/// A synthetic overlay in the source's size: a colour gradient with a red frame.
pub fn overlay_results(name: &str, rows: u16, columns: u16) -> ResultSet {
    let mut rs = results(common::source(name));
    let (r, c) = (usize::from(rows), usize::from(columns));
    let mut rgb = vec![0u8; r * c * 3];
    for y in 0..r {
        for x in 0..c {
            let i = (y * c + x) * 3;
            let edge = y < 4 || x < 4 || y + 4 >= r || x + 4 >= c;
            rgb[i] = if edge { 255 } else { (x % 256) as u8 };
            rgb[i + 1] = if edge { 0 } else { (y % 256) as u8 };
            rgb[i + 2] = ((x + y) % 256) as u8;
        }
    }
    rs.overlay = Some(Overlay {
        rows,
        columns,
        rgb,
        description: "Lung masks and cardiothoracic ratio lines drawn by Hilum".into(),
    });
    rs
}

fn s(o: &hilum_pacs::InMemDicomObject, tag: dicom_object::Tag) -> String {
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
fn overlay_is_a_derived_secondary_capture_with_burned_in_annotation() {
    let rs = overlay_results(SIIM, 1024, 1024);
    let back = read_dicom(&to_bytes(&sc::write(&rs).unwrap()).unwrap()).unwrap();
    assert_eq!(s(&back, tags::SOP_CLASS_UID), "1.2.840.10008.5.1.4.1.1.7");
    assert_eq!(s(&back, tags::IMAGE_TYPE), "DERIVED\\SECONDARY");
    assert_eq!(s(&back, tags::BURNED_IN_ANNOTATION), "YES");
    assert_eq!(s(&back, tags::PHOTOMETRIC_INTERPRETATION), "RGB");
    assert_eq!(s(&back, tags::PIXEL_SPACING), "0.168\\0.168");
    assert_eq!(s(&back, tags::MODALITY), "CR");
    assert_eq!(s(&back, tags::BODY_PART_EXAMINED), "CHEST");
    assert!(
        back.get(tags::LATERALITY).is_none(),
        "the chest is not a paired body part"
    );
    assert_eq!(
        s(&back, tags::STUDY_INSTANCE_UID),
        rs.source.study.instance_uid
    );
    assert_eq!(
        s(&back, tags::SERIES_INSTANCE_UID),
        sc::uids(&rs).series_instance_uid
    );
    let source = &back
        .get(tags::SOURCE_IMAGE_SEQUENCE)
        .unwrap()
        .items()
        .unwrap()[0];
    assert_eq!(
        s(source, tags::REFERENCED_SOP_INSTANCE_UID),
        rs.source.sop_instance_uid
    );
    let pixels = back.get(tags::PIXEL_DATA).unwrap().to_bytes().unwrap();
    assert_eq!(&pixels[..], &rs.overlay.as_ref().unwrap().rgb[..]);
}

#[test]
fn a_resized_overlay_claims_no_spacing_and_odd_sizes_are_padded() {
    let rs = overlay_results(SIIM, 255, 333);
    let back = read_dicom(&to_bytes(&sc::write(&rs).unwrap()).unwrap()).unwrap();
    assert!(back.get(tags::PIXEL_SPACING).is_none());
    let pixels = back.get(tags::PIXEL_DATA).unwrap().to_bytes().unwrap();
    assert_eq!(pixels.len(), 255 * 333 * 3 + 1);
}

#[test]
fn overlay_of_the_wrong_length_is_refused() {
    let mut rs = overlay_results(CR_NO_META, 440, 440);
    if let Some(o) = rs.overlay.as_mut() {
        o.rgb.truncate(100);
    }
    let err = sc::write(&rs).unwrap_err().to_string();
    assert!(
        err.contains("440 rows x 440 columns") && err.contains("580800"),
        "{err}"
    );
    rs.overlay = None;
    assert!(sc::write(&rs)
        .unwrap_err()
        .to_string()
        .contains("ResultSet.overlay"));
}
