//! The VOI LUT Sequence (a table instead of a window) of a DICOM file is applied after the
//! modality rescale, wins over the file's windows, loses to a window the caller gives, and an
//! unusable table falls back to the window with a warning.

use dicom_core::value::DataSetSequence;
use dicom_core::{DataElement, PrimitiveValue, VR};
use dicom_dictionary_std::tags;
use dicom_object::{FileMetaTableBuilder, InMemDicomObject};
use hilum_imaging::{decode_with, DecodeOptions, Voi};

const W: u16 = 8;
const H: u16 = 4;
/// Rescale: value = 2 * stored - 100.
const SLOPE: f64 = 2.0;
const INTERCEPT: f64 = -100.0;
/// The table covers rescaled values -100 ..= 4000 (2051 entries, 12 bits out).
const FIRST: i64 = -100;
const ENTRIES: usize = 2051;

fn stored() -> Vec<u16> {
    // 12-bit stored values across the range, including both ends.
    (0..W as u32 * H as u32)
        .map(|i| ((i * 4095) / (W as u32 * H as u32 - 1)) as u16)
        .collect()
}

/// A deliberately non-linear table (square root shape), so a window could not mimic it.
fn table() -> Vec<u16> {
    (0..ENTRIES)
        .map(|i| ((i as f64 / (ENTRIES - 1) as f64).sqrt() * 4095.0).round() as u16)
        .collect()
}

fn dicom(lut_entries: &[u16], descriptor_count: u16) -> Vec<u8> {
    let item = InMemDicomObject::from_element_iter([
        DataElement::new(
            tags::LUT_DESCRIPTOR,
            VR::SS,
            PrimitiveValue::I16(vec![descriptor_count as i16, FIRST as i16, 12].into()),
        ),
        DataElement::new(
            tags::LUT_DATA,
            VR::US,
            PrimitiveValue::U16(lut_entries.to_vec().into()),
        ),
    ]);
    let px: Vec<u8> = stored().iter().flat_map(|v| v.to_le_bytes()).collect();
    let obj = InMemDicomObject::from_element_iter([
        DataElement::new(
            tags::SOP_CLASS_UID,
            VR::UI,
            PrimitiveValue::from("1.2.840.10008.5.1.4.1.1.1"),
        ),
        DataElement::new(
            tags::SOP_INSTANCE_UID,
            VR::UI,
            PrimitiveValue::from("1.2.3.4"),
        ),
        DataElement::new(tags::MODALITY, VR::CS, PrimitiveValue::from("CR")),
        DataElement::new(tags::SAMPLES_PER_PIXEL, VR::US, PrimitiveValue::from(1u16)),
        DataElement::new(
            tags::PHOTOMETRIC_INTERPRETATION,
            VR::CS,
            PrimitiveValue::from("MONOCHROME2"),
        ),
        DataElement::new(tags::ROWS, VR::US, PrimitiveValue::from(H)),
        DataElement::new(tags::COLUMNS, VR::US, PrimitiveValue::from(W)),
        DataElement::new(tags::BITS_ALLOCATED, VR::US, PrimitiveValue::from(16u16)),
        DataElement::new(tags::BITS_STORED, VR::US, PrimitiveValue::from(12u16)),
        DataElement::new(tags::HIGH_BIT, VR::US, PrimitiveValue::from(11u16)),
        DataElement::new(
            tags::PIXEL_REPRESENTATION,
            VR::US,
            PrimitiveValue::from(0u16),
        ),
        DataElement::new(tags::WINDOW_CENTER, VR::DS, PrimitiveValue::from("2000")),
        DataElement::new(tags::WINDOW_WIDTH, VR::DS, PrimitiveValue::from("4000")),
        DataElement::new(
            tags::RESCALE_INTERCEPT,
            VR::DS,
            PrimitiveValue::from("-100"),
        ),
        DataElement::new(tags::RESCALE_SLOPE, VR::DS, PrimitiveValue::from("2")),
        DataElement::new(
            tags::VOILUT_SEQUENCE,
            VR::SQ,
            DataSetSequence::from(vec![item]),
        ),
        DataElement::new(tags::PIXEL_DATA, VR::OW, PrimitiveValue::from(px)),
    ]);
    let file = obj
        .with_meta(
            FileMetaTableBuilder::new()
                .transfer_syntax("1.2.840.10008.1.2.1")
                .media_storage_sop_class_uid("1.2.840.10008.5.1.4.1.1.1")
                .media_storage_sop_instance_uid("1.2.3.4"),
        )
        .expect("file meta");
    let mut out = Vec::new();
    file.write_all(&mut out).expect("write");
    out
}

fn opts(voi: Voi) -> DecodeOptions {
    DecodeOptions {
        voi,
        ..Default::default()
    }
}

#[test]
fn voi_lut_table_is_applied_after_the_rescale() {
    let lut = table();
    let img = decode_with(
        &dicom(&lut, ENTRIES as u16),
        "lut.dcm",
        &opts(Voi::FromFile),
    )
    .expect("decode");
    assert!(img.meta.voi_lut_applied, "{:?}", img.meta);
    assert_eq!(img.meta.window_applied, None);
    for (&s, &got) in stored().iter().zip(&img.pixels) {
        let x = s as f64 * SLOPE + INTERCEPT;
        let i = ((x.round() as i64 - FIRST).clamp(0, ENTRIES as i64 - 1)) as usize;
        // 12-bit table output on a 12-bit image: the entry itself.
        assert!(
            (got - lut[i] as f32).abs() < 1e-3,
            "stored {s}: got {got}, table says {}",
            lut[i]
        );
    }
    // Values past the table's end take its last entry (stored 4095 -> 8090 > 4000).
    assert_eq!(*img.pixels.last().expect("pixels"), lut[ENTRIES - 1] as f32);
}

#[test]
fn a_window_given_by_the_caller_wins_over_the_table() {
    let img = decode_with(
        &dicom(&table(), ENTRIES as u16),
        "lut.dcm",
        &opts(Voi::Window {
            center: 2000.0,
            width: 4000.0,
        }),
    )
    .expect("decode");
    assert!(!img.meta.voi_lut_applied);
    assert_eq!(img.meta.window_applied, Some((2000.0, 4000.0)));
    // Pixel 8 is stored 1056, rescaled 2012: at the window's centre it lands mid-range, where
    // the table (whose input range it has passed) would give its last entry, 4095.
    let s = stored()[8];
    assert_eq!(s as f64 * SLOPE + INTERCEPT, 2012.0);
    let mid = img.pixels[8];
    assert!((1900.0..2200.0).contains(&mid), "{mid}");
}

#[test]
fn a_short_table_falls_back_to_the_window_with_a_warning() {
    // The descriptor promises more entries than the data holds.
    let img = decode_with(
        &dicom(&table()[..100], ENTRIES as u16),
        "bad.dcm",
        &opts(Voi::FromFile),
    )
    .expect("decode");
    assert!(!img.meta.voi_lut_applied);
    assert_eq!(img.meta.window_applied, Some((2000.0, 4000.0)));
    assert!(
        img.meta.warnings.iter().any(|w| w.contains("VOI LUT")),
        "{:?}",
        img.meta.warnings
    );
}
