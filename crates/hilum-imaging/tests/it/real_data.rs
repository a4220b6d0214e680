//! Decoding of every real radiograph in ../shared/data/cxr: dimensions, bit depth, and for DICOM
//! agreement with the reference decoder's pixels.

use std::path::PathBuf;

use hilum_imaging::{decode_with, read_dicom, CxrImage, DecodeOptions, ImagingError, Voi};
use sha2::{Digest, Sha256};

fn data_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr");
    assert!(
        dir.join("images").is_dir(),
        "real test data missing: expected {} (the shared data folder beside the repository)",
        dir.display()
    );
    dir
}

fn read(path: &PathBuf) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

fn raw(voi: Voi) -> DecodeOptions {
    DecodeOptions {
        max_pixels: 100_000_000,
        voi,
    }
}

/// Rows of a CSV whose free-text columns are sometimes unquoted: fields are located relative
/// to the sha256 column, which is always a 64-digit hex string.
fn csv_rows(path: &PathBuf) -> Vec<Vec<String>> {
    let text = String::from_utf8(read(path)).expect("utf-8 csv");
    text.lines()
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut fields = Vec::new();
            let mut cur = String::new();
            let mut quoted = false;
            for c in line.chars() {
                match c {
                    '"' => quoted = !quoted,
                    ',' if !quoted => fields.push(std::mem::take(&mut cur)),
                    _ => cur.push(c),
                }
            }
            fields.push(cur);
            fields
        })
        .collect()
}

fn is_sha(s: &str) -> bool {
    s.len() == 64 && s.chars().all(|c| c.is_ascii_hexdigit())
}

#[test]
fn every_image_decodes_with_its_listed_size_and_depth() {
    let dir = data_dir();
    let rows = csv_rows(&dir.join("images.csv"));
    assert!(rows.len() >= 37, "images.csv lists {} files", rows.len());
    let mut seen = 0;
    for row in rows {
        let s = row.iter().position(|f| is_sha(f)).expect("sha256 column");
        let (file, mode) = (&row[0], &row[s - 5]);
        let (w, h, bits): (u32, u32, u8) = (
            row[s - 4].parse().unwrap(),
            row[s - 3].parse().unwrap(),
            row[s - 2].parse().unwrap(),
        );
        let bytes = read(&dir.join("images").join(file));
        assert_eq!(hex(&Sha256::digest(&bytes)), row[s], "{file}: file changed");
        let img = decode_with(&bytes, file, &raw(Voi::FromFile))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!((img.width, img.height), (w, h), "{file}");
        assert_eq!(img.pixels.len(), (w * h) as usize, "{file}");
        assert_eq!(img.meta.bit_depth, bits, "{file}");
        let channels = match mode.as_str() {
            "RGB" => 3,
            "RGBA" => 4,
            _ => 1,
        };
        assert_eq!(img.meta.source_channels, channels, "{file} ({mode})");
        let (lo, hi) = min_max(&img);
        assert!(lo >= 0.0 && hi <= img.max_value(), "{file}: {lo}..{hi}");
        // Real radiographs span hundreds of grey levels (10-bit data in a 16-bit PNG too).
        assert!(hi - lo > 100.0, "{file}: flat image {lo}..{hi}");
        seen += 1;
    }
    assert_eq!(seen, std::fs::read_dir(dir.join("images")).unwrap().count());
}

#[test]
fn sixteen_bit_png_keeps_full_depth() {
    let dir = data_dir();
    let img = decode_with(
        &read(&dir.join("images/derived_RG1_chest_pa_16bit.png")),
        "rg1.png",
        &raw(Voi::FromFile),
    )
    .unwrap();
    assert_eq!(img.meta.bit_depth, 16);
    // images.csv: value range 988-26460, i.e. well beyond 8 bits.
    assert_eq!(min_max(&img), (988.0, 26460.0));
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn min_max(img: &CxrImage) -> (f32, f32) {
    img.pixels
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)))
}

fn reference(name: &str) -> (u32, u32, Vec<f32>) {
    let path = data_dir().join("dicom/reference_decode").join(name);
    let img = image::load_from_memory(&read(&path)).unwrap();
    let (w, h) = (img.width(), img.height());
    let px = img.into_luma16().into_raw();
    // 8-bit references widen to 16 bits as v * 257.
    let eight = name.contains("jpegbaseline") || name.contains("monochrome1_variant");
    (
        w,
        h,
        px.into_iter()
            .map(|v| if eight { (v / 257) as f32 } else { v as f32 })
            .collect(),
    )
}

/// Max abs difference and the fraction of pixels that differ at all.
fn compare(ours: &[f32], expected: &[f32]) -> (f32, f64) {
    assert_eq!(ours.len(), expected.len());
    let mut max = 0.0f32;
    let mut differ = 0usize;
    for (a, b) in ours.iter().zip(expected) {
        let d = (a - b).abs();
        max = max.max(d);
        differ += (d > 0.0) as usize;
    }
    (max, differ as f64 / ours.len() as f64)
}

#[test]
fn dicom_pixels_agree_with_reference_decode() {
    let dir = data_dir();
    // (file, photometric, bits stored, tolerance). The JPEG references are pydicom's decode
    // with Pillow (libjpeg-turbo), which Hilum's JPEG Baseline path reproduces exactly.
    let cases = [
        (
            "siim_pneumothorax_neg_cr_pa_jpegbaseline",
            "MONOCHROME2",
            8u8,
            0.0f32,
        ),
        ("fake_monochrome1_variant", "MONOCHROME1", 8, 0.0),
        ("CR-MONO1-10-chest_noPart10header", "MONOCHROME1", 10, 0.0),
    ];
    for (name, photometric, bits, tol) in cases {
        let bytes = read(&dir.join(format!("dicom/{name}.dcm")));
        let img =
            decode_with(&bytes, name, &raw(Voi::None)).unwrap_or_else(|e| panic!("{name}: {e}"));
        let (w, h, reference) = reference(&format!("{name}.pixels.png"));
        assert_eq!((img.width, img.height), (w, h), "{name}");
        assert_eq!(img.meta.bit_depth, bits, "{name}");
        assert_eq!(img.meta.photometric.as_deref(), Some(photometric), "{name}");
        let max = img.max_value();
        // The reference holds stored values; MONOCHROME1 must come out inverted.
        let expected: Vec<f32> = if photometric == "MONOCHROME1" {
            reference.iter().map(|v| max - v).collect()
        } else {
            reference
        };
        let (diff, frac) = compare(&img.pixels, &expected);
        assert!(diff <= tol, "{name}: max diff {diff} > {tol}");
        assert!(frac < 0.05, "{name}: {frac} of pixels differ");
        assert_eq!(img.meta.inverted, photometric == "MONOCHROME1", "{name}");
    }
}

#[test]
fn jpeg2000_dicom_matches_reference_exactly() {
    let dir = data_dir();
    let name = "RG1_chest_cr_pa_jpeg2000_lossy";
    let bytes = read(&dir.join(format!("dicom/{name}.dcm")));
    let img = decode_with(&bytes, name, &raw(Voi::None)).unwrap();
    assert_eq!(
        (img.width, img.height, img.meta.bit_depth),
        (1841, 1955, 15)
    );
    let info: serde_json::Value = serde_json::from_slice(&read(
        &dir.join(format!("dicom/reference_decode/{name}.pixels.json")),
    ))
    .unwrap();
    // Undo the MONOCHROME1 inversion to get the stored values back, then hash them as u16 LE.
    let max = img.max_value();
    let stored: Vec<u8> = img
        .pixels
        .iter()
        .flat_map(|&v| ((max - v) as u16).to_le_bytes())
        .collect();
    assert_eq!(
        hex(&Sha256::digest(&stored)),
        info["sha256_full_decoded_u16le"].as_str().unwrap()
    );
    // And the centre crop PNG pixel by pixel.
    let (cw, ch, crop) = reference(&format!("{name}.pixels.png"));
    let (r0, c0) = (
        info["crop_origin_row_col"][0].as_u64().unwrap() as usize,
        info["crop_origin_row_col"][1].as_u64().unwrap() as usize,
    );
    let w = img.width as usize;
    let ours: Vec<f32> = (0..ch as usize)
        .flat_map(|r| (0..cw as usize).map(move |c| (r, c)))
        .map(|(r, c)| max - img.pixels[(r0 + r) * w + c0 + c])
        .collect();
    assert_eq!(compare(&ours, &crop).0, 0.0);
}

#[test]
fn monochrome1_is_inverted() {
    let dir = data_dir();
    let m2 = decode_with(
        &read(&dir.join("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm")),
        "m2",
        &raw(Voi::None),
    )
    .unwrap();
    let m1 = decode_with(
        &read(&dir.join("dicom/fake_monochrome1_variant.dcm")),
        "m1",
        &raw(Voi::None),
    )
    .unwrap();
    // Same stored pixels, opposite photometric interpretation.
    assert!(m2
        .pixels
        .iter()
        .zip(&m1.pixels)
        .all(|(a, b)| a + b == 255.0));
    assert!(!m2.meta.inverted && m1.meta.inverted);
}

#[test]
fn file_without_part10_header_reads_with_a_warning() {
    let dir = data_dir();
    let bytes = read(&dir.join("dicom/CR-MONO1-10-chest_noPart10header.dcm"));
    let s = read_dicom(&bytes, "noheader").unwrap();
    assert_eq!((s.rows, s.columns, s.bits_stored), (440, 440, 10));
    assert!(
        s.warnings.iter().any(|w| w.contains("File Meta")),
        "{:?}",
        s.warnings
    );
    assert_eq!(s.windows.first().copied(), Some((550.0, 1024.0)));
}

#[test]
fn window_from_file_is_applied_then_inverted() {
    let dir = data_dir();
    let bytes = read(&dir.join("dicom/CR-MONO1-10-chest_noPart10header.dcm"));
    let img = decode_with(&bytes, "cr", &raw(Voi::FromFile)).unwrap();
    assert_eq!(img.meta.window_applied, Some((550.0, 1024.0)));
    let (_, _, stored) = reference("CR-MONO1-10-chest_noPart10header.pixels.png");
    let max = 1023.0f32;
    // DICOM LINEAR window (c=550, w=1024) on the stored values, then MONOCHROME1 inversion.
    for (ours, &s) in img.pixels.iter().zip(&stored) {
        let (c, w) = (549.5f32, 1023.0f32);
        let y = if s <= c - w / 2.0 {
            0.0
        } else if s > c + w / 2.0 {
            max
        } else {
            ((s - c) / w + 0.5) * max
        };
        assert!(
            (ours - (max - y)).abs() < 1e-2,
            "stored {s}: {ours} vs {}",
            max - y
        );
    }
    // A given window overrides the file's.
    let narrow = decode_with(
        &bytes,
        "cr",
        &raw(Voi::Window {
            center: 500.0,
            width: 100.0,
        }),
    )
    .unwrap();
    let saturated = narrow
        .pixels
        .iter()
        .filter(|&&v| v == 0.0 || v == max)
        .count();
    assert!(saturated > narrow.pixels.len() / 2, "{saturated}");
}

#[test]
fn dicom_metadata_is_read() {
    let dir = data_dir();
    let img = decode_with(
        &read(&dir.join("dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm")),
        "siim",
        &raw(Voi::FromFile),
    )
    .unwrap();
    let m = &img.meta;
    assert_eq!(m.format, "dicom");
    assert_eq!(m.view_position.as_deref(), Some("PA"));
    assert_eq!(m.modality.as_deref(), Some("CR"));
    assert_eq!(m.pixel_spacing_mm, Some((0.168, 0.168)));
    assert_eq!(
        m.transfer_syntax.as_ref().map(|t| t.0.as_str()),
        Some("1.2.840.10008.1.2.4.50")
    );
    let rg1 = read_dicom(
        &read(&dir.join("dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm")),
        "rg1",
    )
    .unwrap();
    // "[0.000, 0.000]" in the file means unknown, not zero.
    assert_eq!(rg1.pixel_spacing_mm, None);
    assert_eq!(rg1.windows.first().copied(), Some((15000.0, 30000.0)));
}

#[test]
fn errors_name_the_file() {
    let e = decode_with(b"hello world, not an image", "notes.txt", &raw(Voi::None)).unwrap_err();
    assert!(e.to_string().contains("notes.txt"), "{e}");
    assert!(matches!(
        decode_with(b"", "empty.png", &raw(Voi::None)),
        Err(ImagingError::Empty { .. })
    ));
}
