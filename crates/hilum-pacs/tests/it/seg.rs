//! The SEG as this crate reads it back: codes, frames, bits, references, refusals.

use dicom_dictionary_std::tags;
use hilum_pacs::{read_dicom, seg, to_bytes, ResultSet, Segment, SourceImage};

use crate::common::{self, CR_NO_META, RG1, SIIM};
use crate::sr::results;

/// Known synthetic masks in the source's size: a right lung with holes, a left lung, a heart
/// overlapping neither (or, with `overlap`, both lungs).
pub fn masks(source: &SourceImage, overlap: bool) -> Vec<Segment> {
    let (r, c) = (usize::from(source.rows), usize::from(source.columns));
    let mut right = vec![0u8; r * c];
    let mut left = vec![0u8; r * c];
    let mut heart = vec![0u8; r * c];
    for y in 0..r {
        for x in 0..c {
            let i = y * c + x;
            if y > r / 5 && y < 4 * r / 5 && x > c / 8 && x < c / 2 - 3 && (x * 3 + y) % 11 != 0 {
                right[i] = 1;
            }
            if y > r / 5 && y < 4 * r / 5 && x > c / 2 + 3 && x < 7 * c / 8 {
                left[i] = 255;
            }
            let (lo, hi) = if overlap {
                (c / 4, 3 * c / 4)
            } else {
                (c / 2 - 2, c / 2 + 2)
            };
            if y > r / 2 && y < 3 * r / 4 && x > lo && x < hi {
                heart[i] = 1;
            }
        }
    }
    vec![
        Segment::right_lung(right, "lung-unet"),
        Segment::left_lung(left, "lung-unet"),
        Segment::heart(heart, "lung-unet"),
    ]
}

pub fn seg_results(name: &str, overlap: bool) -> ResultSet {
    let source = common::source(name);
    let mut rs = results(source.clone());
    rs.segments = masks(&source, overlap);
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

/// Unpacks frame `f` of a 1-bit pixel stream.
fn unpack(bits: &[u8], f: usize, n: usize) -> Vec<u8> {
    (f * n..(f + 1) * n)
        .map(|i| (bits[i / 8] >> (i % 8)) & 1)
        .collect()
}

#[test]
fn seg_frames_hold_the_masks_bit_for_bit() {
    // RG1: 1955 x 1841 pixels, an odd count, so frames start mid-byte.
    for name in [SIIM, RG1, CR_NO_META] {
        let rs = seg_results(name, false);
        let back = read_dicom(&to_bytes(&seg::write(&rs).unwrap()).unwrap()).unwrap();
        assert_eq!(
            s(&back, tags::SOP_CLASS_UID),
            "1.2.840.10008.5.1.4.1.1.66.4"
        );
        assert_eq!(s(&back, tags::NUMBER_OF_FRAMES), "3");
        assert_eq!(s(&back, tags::SEGMENTS_OVERLAP), "NO");
        let bits = back.get(tags::PIXEL_DATA).unwrap().to_bytes().unwrap();
        let n = rs.source.pixel_count();
        assert!(bits.len() * 8 >= 3 * n && bits.len().is_multiple_of(2));
        for (f, segment) in rs.segments.iter().enumerate() {
            let want: Vec<u8> = segment.mask.iter().map(|&v| u8::from(v != 0)).collect();
            assert!(unpack(&bits, f, n) == want, "{name}: frame {f} differs");
        }
    }
}

#[test]
fn segments_carry_the_standard_codes_and_reference_the_source() {
    let rs = seg_results(SIIM, false);
    let back = read_dicom(&to_bytes(&seg::write(&rs).unwrap()).unwrap()).unwrap();
    let segments = back.get(tags::SEGMENT_SEQUENCE).unwrap().items().unwrap();
    let types: Vec<String> = segments
        .iter()
        .map(|i| {
            let t = &i
                .get(tags::SEGMENTED_PROPERTY_TYPE_CODE_SEQUENCE)
                .unwrap()
                .items()
                .unwrap()[0];
            format!(
                "{} {}",
                s(t, tags::CODE_VALUE),
                s(t, tags::CODING_SCHEME_DESIGNATOR)
            )
        })
        .collect();
    assert_eq!(types, ["3341006 SCT", "44029006 SCT", "80891009 SCT"]);
    for item in segments {
        let c = &item
            .get(tags::SEGMENTED_PROPERTY_CATEGORY_CODE_SEQUENCE)
            .unwrap()
            .items()
            .unwrap()[0];
        assert_eq!(s(c, tags::CODE_VALUE), "91723000");
        assert_eq!(s(item, tags::SEGMENT_ALGORITHM_TYPE), "AUTOMATIC");
    }
    let frames = back
        .get(tags::PER_FRAME_FUNCTIONAL_GROUPS_SEQUENCE)
        .unwrap()
        .items()
        .unwrap();
    for frame in frames {
        let derivation = &frame
            .get(tags::DERIVATION_IMAGE_SEQUENCE)
            .unwrap()
            .items()
            .unwrap()[0];
        let src = &derivation
            .get(tags::SOURCE_IMAGE_SEQUENCE)
            .unwrap()
            .items()
            .unwrap()[0];
        assert_eq!(
            s(src, tags::REFERENCED_SOP_INSTANCE_UID),
            rs.source.sop_instance_uid
        );
    }
    let series = back
        .get(tags::REFERENCED_SERIES_SEQUENCE)
        .unwrap()
        .items()
        .unwrap();
    assert_eq!(
        s(&series[0], tags::SERIES_INSTANCE_UID),
        rs.source.series_instance_uid
    );
    assert_eq!(
        s(&back, tags::STUDY_INSTANCE_UID),
        rs.source.study.instance_uid
    );
    assert_eq!(
        s(&back, tags::SERIES_INSTANCE_UID),
        seg::uids(&rs).series_instance_uid
    );
    assert_eq!(s(&back, tags::LOSSY_IMAGE_COMPRESSION), "01");
    assert_eq!(
        s(&back, tags::CONTENT_DESCRIPTION),
        hilum_pacs::RESEARCH_ONLY_SHORT
    );
}

#[test]
fn overlapping_segments_say_so() {
    let rs = seg_results(CR_NO_META, true);
    let back = read_dicom(&to_bytes(&seg::write(&rs).unwrap()).unwrap()).unwrap();
    assert_eq!(s(&back, tags::SEGMENTS_OVERLAP), "YES");
}

#[test]
fn wrong_mask_size_or_no_segment_is_refused() {
    let mut rs = seg_results(CR_NO_META, false);
    rs.segments[1].mask.pop();
    let err = seg::write(&rs).unwrap_err().to_string();
    assert!(
        err.contains("Left lung") && err.contains("440 rows x 440 columns"),
        "{err}"
    );
    rs.segments.clear();
    assert!(seg::write(&rs)
        .unwrap_err()
        .to_string()
        .contains("no segments"));
    let mut rs = seg_results(CR_NO_META, false);
    rs.segments[0].model_id = "medsam".into();
    assert!(seg::write(&rs)
        .unwrap_err()
        .to_string()
        .contains("ResultSet.models"));
}

#[test]
fn seg_uids_differ_from_the_sr_and_repeat_on_resend() {
    let rs = seg_results(SIIM, false);
    assert_ne!(seg::uids(&rs), hilum_pacs::sr::uids(&rs));
    let a = to_bytes(&seg::write(&rs).unwrap()).unwrap();
    let b = to_bytes(&seg::write(&rs).unwrap()).unwrap();
    assert_eq!(a, b);
}
