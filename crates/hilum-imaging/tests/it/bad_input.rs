//! Bad input is a clear error naming the file and the reason, never a panic or a huge
//! allocation.

use std::path::PathBuf;
use std::time::Instant;

use dicom_core::{DataElement, PrimitiveValue, VR};
use dicom_dictionary_std::tags;
use dicom_object::{FileMetaTableBuilder, InMemDicomObject};
use hilum_imaging::{decode_with, DecodeOptions, ImageStore, ImagingError, Voi};

fn data(rel: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/cxr")
        .join(rel);
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "real test data missing: {} ({e}); it lives beside the repository",
            path.display()
        )
    })
}

fn opts() -> DecodeOptions {
    DecodeOptions {
        max_pixels: 50_000_000,
        voi: Voi::FromFile,
    }
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = 0xFFFF_FFFFu32;
    for &b in bytes {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], body: &[u8]) {
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    let mut c = kind.to_vec();
    c.extend_from_slice(body);
    out.extend_from_slice(&c);
    out.extend_from_slice(&crc32(&c).to_be_bytes());
}

/// A PNG whose header claims `w` x `h` gray pixels, with a tiny (wrong) IDAT.
fn png_claiming(w: u32, h: u32) -> Vec<u8> {
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 0, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(
        &mut out,
        b"IDAT",
        &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01],
    );
    chunk(&mut out, b"IEND", &[]);
    out
}

#[test]
fn decompression_bomb_is_refused_before_allocating() {
    let bomb = png_claiming(100_000, 100_000);
    let t = Instant::now();
    let err = decode_with(&bomb, "bomb.png", &opts()).unwrap_err();
    assert!(t.elapsed().as_millis() < 500, "took {:?}", t.elapsed());
    match &err {
        ImagingError::TooLarge {
            what,
            width,
            height,
            limit,
        } => {
            assert_eq!(
                (what.as_str(), *width, *height, *limit),
                ("bomb.png", 100_000, 100_000, 50_000_000)
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(err.to_string().contains("bomb.png"));
    // The limit is configurable: a small budget refuses a real 1024x1024 radiograph.
    let real = data("images/nih_00009745_000_cardiomegaly.png");
    let small = DecodeOptions {
        max_pixels: 1000 * 1000,
        voi: Voi::None,
    };
    assert!(matches!(
        decode_with(&real, "nih.png", &small),
        Err(ImagingError::TooLarge { .. })
    ));
}

#[test]
fn dicom_bomb_is_refused_from_its_header() {
    let bytes = data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
    let mut obj = dicom_object::from_reader(&bytes[..]).unwrap();
    obj.put(DataElement::new(
        tags::ROWS,
        VR::US,
        PrimitiveValue::from(60000u16),
    ));
    obj.put(DataElement::new(
        tags::COLUMNS,
        VR::US,
        PrimitiveValue::from(60000u16),
    ));
    let mut out = Vec::new();
    obj.write_all(&mut out).unwrap();
    let err = decode_with(&out, "big.dcm", &opts()).unwrap_err();
    assert!(
        matches!(
            err,
            ImagingError::TooLarge {
                width: 60000,
                height: 60000,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_jpeg_frame_of_another_size_than_the_header_is_an_error() {
    // Rows says 1000; the JPEG inside is 1024x1024. Decoding it into a 1000-row image would
    // silently drop or misplace pixels.
    let bytes = data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
    let mut obj = dicom_object::from_reader(&bytes[..]).unwrap();
    obj.put(DataElement::new(
        tags::ROWS,
        VR::US,
        PrimitiveValue::from(1000u16),
    ));
    let mut out = Vec::new();
    obj.write_all(&mut out).unwrap();
    let err = decode_with(&out, "rows.dcm", &opts()).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("rows.dcm") && msg.contains("1024x1024") && msg.contains("1024x1000"),
        "{msg}"
    );
}

#[test]
fn zero_size_images_are_refused() {
    let err = decode_with(&png_claiming(0, 10), "zero.png", &opts()).unwrap_err();
    assert!(err.to_string().contains("zero.png"), "{err}");
    let bytes = data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
    let mut obj = dicom_object::from_reader(&bytes[..]).unwrap();
    obj.put(DataElement::new(
        tags::ROWS,
        VR::US,
        PrimitiveValue::from(0u16),
    ));
    let mut out = Vec::new();
    obj.write_all(&mut out).unwrap();
    let err = decode_with(&out, "zero.dcm", &opts()).unwrap_err();
    assert!(matches!(err, ImagingError::Empty { .. }), "{err:?}");
}

#[test]
fn truncated_files_are_errors_not_panics() {
    for rel in [
        "images/nih_00009745_000_cardiomegaly.png",
        "images/covid_2c35005f.jpg",
        "images/derived_CR-MONO1-10-chest_16bit.png",
        "dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm",
        "dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm",
        "dicom/CR-MONO1-10-chest_noPart10header.dcm",
    ] {
        let bytes = data(rel);
        for cut in [bytes.len() / 2, bytes.len() - 100, 200, 40] {
            let name = format!("{rel}[..{cut}]");
            match decode_with(&bytes[..cut], &name, &opts()) {
                Err(e) => assert!(e.to_string().contains(&name), "{e}"),
                // A JPEG decoder may fill a cut-off tail with grey; it must still be the right size.
                Ok(img) => assert_eq!(
                    img.pixels.len(),
                    (img.width * img.height) as usize,
                    "{name}"
                ),
            }
        }
    }
}

#[test]
fn unsupported_transfer_syntax_is_named() {
    let bytes = data("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm");
    let mut obj = dicom_object::from_reader(&bytes[..]).unwrap();
    // JPEG-LS lossless: no pure-Rust decoder is built in.
    obj.meta_mut().transfer_syntax = "1.2.840.10008.1.2.4.80".into();
    let mut out = Vec::new();
    obj.write_all(&mut out).unwrap();
    let err = decode_with(&out, "jpegls.dcm", &opts()).unwrap_err();
    match &err {
        ImagingError::UnsupportedTransferSyntax { what, uid, .. } => {
            assert_eq!(
                (what.as_str(), uid.as_str()),
                ("jpegls.dcm", "1.2.840.10008.1.2.4.80")
            )
        }
        other => panic!("expected UnsupportedTransferSyntax, got {other:?}"),
    }
}

#[test]
fn non_image_dicom_is_refused() {
    for (modality, sop) in [
        ("SR", "1.2.840.10008.5.1.4.1.1.88.11"),
        ("RTSTRUCT", "1.2.840.10008.5.1.4.1.1.481.3"),
    ] {
        let obj = InMemDicomObject::from_element_iter([
            DataElement::new(tags::SOP_CLASS_UID, VR::UI, PrimitiveValue::from(sop)),
            DataElement::new(
                tags::SOP_INSTANCE_UID,
                VR::UI,
                PrimitiveValue::from("2.25.1234"),
            ),
            DataElement::new(tags::MODALITY, VR::CS, PrimitiveValue::from(modality)),
        ]);
        let file = obj
            .with_meta(FileMetaTableBuilder::new().transfer_syntax("1.2.840.10008.1.2.1"))
            .unwrap();
        let mut out = Vec::new();
        file.write_all(&mut out).unwrap();
        let err = decode_with(&out, "report.dcm", &opts()).unwrap_err();
        assert!(
            matches!(&err, ImagingError::NotAnImage { kind, .. } if kind == modality),
            "{err:?}"
        );
        // The store refuses it at ingest, so no tool ever sees it.
        assert!(ImageStore::default()
            .ingest_bytes(out.into(), "report.dcm")
            .is_err());
    }
}

#[test]
fn garbage_after_dicom_magic_is_an_error() {
    let mut bytes = vec![0u8; 128];
    bytes.extend_from_slice(b"DICM");
    bytes.extend((0..5000u32).map(|i| (i * 7919 % 251) as u8));
    let err = decode_with(&bytes, "noise.dcm", &opts()).unwrap_err();
    assert!(err.to_string().contains("noise.dcm"), "{err}");
}

/// A deterministic stand-in for the fuzzer in every test run: byte flips, zeroed runs and
/// truncations of real files must give an image or an error, never a panic.
#[test]
fn mutated_real_files_never_panic() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let opts = DecodeOptions {
        max_pixels: 4_000_000,
        voi: Voi::FromFile,
    };
    for rel in [
        "dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm",
        "dicom/CR-MONO1-10-chest_noPart10header.dcm",
        "images/kermany_person1946_bacteria_4874.jpeg",
        "images/derived_CR-MONO1-10-chest_16bit.png",
    ] {
        let original = data(rel);
        for round in 0..40 {
            let mut bytes = original.clone();
            // Headers matter most: aim half of the damage at the first 2 KiB.
            let span = if round % 2 == 0 {
                bytes.len().min(2048)
            } else {
                bytes.len()
            };
            for _ in 0..(1 + next() % 8) {
                let at = (next() as usize) % span;
                match next() % 3 {
                    0 => bytes[at] ^= 1 << (next() % 8),
                    1 => bytes[at] = 0xFF,
                    _ => {
                        let end = (at + (next() % 64) as usize).min(bytes.len());
                        bytes[at..end].fill(0);
                    }
                }
            }
            if round % 5 == 4 {
                bytes.truncate((next() as usize) % bytes.len());
            }
            let t0 = Instant::now();
            let r = decode_with(&bytes, rel, &opts);
            // A corrupt length must not make the parser reserve and zero gigabytes.
            assert!(
                t0.elapsed().as_secs_f64() < 2.0,
                "{rel} #{round}: {:?}",
                t0.elapsed()
            );
            if let Ok(img) = r {
                assert_eq!(
                    img.pixels.len(),
                    (img.width * img.height) as usize,
                    "{rel} #{round}"
                );
            }
            let _ = hilum_imaging::read_dicom(&bytes, rel);
        }
    }
}
