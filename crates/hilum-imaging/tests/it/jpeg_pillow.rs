//! JPEG pixels equal Pillow's, bit for bit: every JPEG in ../shared/data and the synthetic ones
//! in tests/fixtures/jpeg (gray and colour, baseline and progressive, 4:4:4/4:2:2/4:2:0),
//! against the checksums `scripts/fixtures/make_jpeg_fixtures.py` wrote from Pillow's decode.
//! Run: `cargo test -p hilum-imaging --test it jpeg_pillow::`.

use std::path::{Path, PathBuf};

use hilum_imaging::{decode, decode_jpeg_samples, ImagingError};
use serde_json::Value;
use sha2::{Digest, Sha256};

const MAX_PIXELS: u64 = 50_000_000;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn shared_data() -> PathBuf {
    manifest_dir().join("../../../shared/data")
}

fn fixture(rel: &str) -> PathBuf {
    match rel.strip_prefix("shared/") {
        Some(rest) => shared_data().join(rest),
        None => manifest_dir().join("tests").join(rel),
    }
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "test data missing: {} ({e}); shared/ lives beside the repository",
            path.display()
        )
    })
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn manifest() -> Value {
    let path = manifest_dir().join("tests/fixtures/jpeg/pillow.json");
    serde_json::from_slice(&read(&path)).expect("pillow.json is JSON")
}

fn entries() -> Vec<Value> {
    manifest()["files"]
        .as_array()
        .expect("pillow.json has a files list")
        .clone()
}

#[test]
fn samples_and_gray_equal_pillows() {
    let mut failures = Vec::new();
    let mut compared = 0;
    for e in entries() {
        let rel = e["file"].as_str().expect("file");
        let mode = e["mode"].as_str().expect("mode");
        let bytes = read(&fixture(rel));
        let samples = decode_jpeg_samples(&bytes, rel, MAX_PIXELS)
            .unwrap_or_else(|err| panic!("{rel}: {err}"));
        let image = decode(&bytes, rel, MAX_PIXELS).unwrap_or_else(|err| panic!("{rel}: {err}"));
        let size = (e["width"].as_u64(), e["height"].as_u64());
        assert_eq!(
            (Some(image.width as u64), Some(image.height as u64)),
            size,
            "{rel}"
        );
        if mode == "CMYK" {
            // Left to the `image` crate: this decoder says so instead of guessing.
            assert!(samples.is_none(), "{rel}: CMYK should fall back");
            // The `image` crate converts CMYK to RGB, then to luminance.
            assert_eq!(image.meta.photometric.as_deref(), Some("Rgb8"), "{rel}");
            assert_eq!(image.pixels.len(), (image.width * image.height) as usize);
            continue;
        }
        let samples = samples.unwrap_or_else(|| panic!("{rel}: {mode} fell back"));
        let channels = if mode == "L" { 1 } else { 3 };
        assert_eq!(samples.channels, channels, "{rel}");
        assert_eq!(image.meta.source_channels, channels, "{rel}");
        let sum: u64 = samples.samples.iter().map(|&v| u64::from(v)).sum();
        let sha = sha256_hex(&samples.samples);
        if sha != e["samples_sha256"].as_str().expect("sha") {
            failures.push(format!(
                "{rel}: samples differ from Pillow's (sum {sum} vs {})",
                e["samples_sum"]
            ));
        }
        // The canonical image is the samples (gray) or the `image` crate's luminance of them
        // (RGB, as for RGB PNGs).
        let expected: Vec<f32> = if channels == 1 {
            samples.samples.iter().map(|&v| f32::from(v)).collect()
        } else {
            let rgb = image::RgbImage::from_raw(samples.width, samples.height, samples.samples)
                .expect("RGB buffer of the right size");
            let gray = image::DynamicImage::ImageRgb8(rgb).into_luma8().into_raw();
            gray.into_iter().map(f32::from).collect()
        };
        if image.pixels != expected {
            failures.push(format!(
                "{rel}: canonical image is not the decoded samples' gray"
            ));
        }
        compared += 1;
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(compared >= 20, "only {compared} files compared");
}

/// Every JPEG under shared/data is in the manifest, so a new one is not silently untested.
#[test]
fn manifest_covers_every_shared_jpeg() {
    let listed: Vec<String> = entries()
        .iter()
        .filter_map(|e| {
            e["file"]
                .as_str()?
                .strip_prefix("shared/")
                .map(String::from)
        })
        .collect();
    let mut stack = vec![shared_data()];
    let mut found = Vec::new();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("shared/data readable") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .and_then(|x| x.to_str())
                .is_some_and(|x| x.eq_ignore_ascii_case("jpg") || x.eq_ignore_ascii_case("jpeg"))
            {
                let rel = path.strip_prefix(shared_data()).expect("under shared");
                found.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    found.sort();
    assert!(found.len() >= 18, "{found:?}");
    let missing: Vec<_> = found.iter().filter(|f| !listed.contains(f)).collect();
    assert!(
        missing.is_empty(),
        "not in pillow.json (rerun scripts/fixtures/make_jpeg_fixtures.py): {missing:?}"
    );
}

fn decode_error(bytes: &[u8], what: &str) -> String {
    match decode_jpeg_samples(bytes, what, MAX_PIXELS) {
        Err(ImagingError::Decode { what: w, reason }) => {
            assert_eq!(w, what);
            reason
        }
        other => panic!("{what}: expected a decode error, got {other:?}"),
    }
}

#[test]
fn cut_off_and_corrupt_files_are_errors() {
    let bytes = read(&fixture("fixtures/jpeg/synth_rgb_420_progressive.jpg"));
    // Cut inside the scans: libjpeg would pad with grey; Pillow and Hilum refuse.
    let reason = decode_error(&bytes[..bytes.len() * 2 / 3], "cut.jpg");
    assert!(reason.to_lowercase().contains("premature end"), "{reason}");
    // Cut inside the header.
    let reason = decode_error(&bytes[..30], "head.jpg");
    assert!(!reason.is_empty());
    // A start-of-frame with zero width.
    let mut zero = bytes.clone();
    let sof = zero
        .windows(2)
        .position(|w| w == [0xFF, 0xC2])
        .expect("progressive SOF");
    zero[sof + 7] = 0;
    zero[sof + 8] = 0;
    let reason = decode_error(&zero, "zero.jpg");
    assert!(
        reason.contains("Empty JPEG image") || reason.contains("image"),
        "{reason}"
    );
}

#[test]
fn size_limit_is_checked_from_the_header() {
    let bytes = read(&fixture("fixtures/jpeg/synth_gray_baseline.jpg"));
    match decode_jpeg_samples(&bytes, "small.jpg", 67 * 45 - 1) {
        Err(ImagingError::TooLarge { width, height, .. }) => {
            assert_eq!((width, height), (67, 45))
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(decode_jpeg_samples(&bytes, "small.jpg", 67 * 45).is_ok());
}

/// The file with its last scan repeated `times` more times before the end marker.
fn with_repeated_last_scan(bytes: &[u8], times: usize) -> Vec<u8> {
    // 0xFF 0xDA can only be a marker: entropy-coded 0xFF bytes are followed by 0x00.
    let sos = bytes
        .windows(2)
        .rposition(|w| w == [0xFF, 0xDA])
        .expect("a scan");
    let eoi = bytes.len() - 2;
    assert_eq!(&bytes[eoi..], &[0xFF, 0xD9]);
    let mut out = bytes[..eoi].to_vec();
    for _ in 0..times {
        out.extend_from_slice(&bytes[sos..eoi]);
    }
    out.extend_from_slice(&bytes[eoi..]);
    out
}

#[test]
fn endless_progressive_scans_are_refused() {
    let bytes = read(&fixture("fixtures/jpeg/synth_gray_progressive.jpg"));
    // A few repeated refinement scans are odd but decodable (libjpeg warns, nothing more).
    let few = with_repeated_last_scan(&bytes, 20);
    assert!(decode_jpeg_samples(&few, "few.jpg", MAX_PIXELS).is_ok());
    let many = with_repeated_last_scan(&bytes, 1200);
    let reason = decode_error(&many, "many.jpg");
    assert!(reason.contains("progressive scans"), "{reason}");
}
