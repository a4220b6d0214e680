//! The image store's torchxrayvision variant (`Preprocess::xrv(224)`) against torchxrayvision
//! 1.5.7's own pipeline on real radiographs (tests/fixtures/xrv_parity, written by
//! scripts/fixtures/make_xrv_parity_fixtures.py). The scores and the PSPNet/MedSAM inputs are checked in
//! `cargo test -p hilum-models --test it xrv_parity::`.

use std::path::PathBuf;

use hilum_imaging::{decode, prepare, Preprocess};

/// On torchxrayvision's [-1024, 1024] scale, JPEG included: Hilum decodes JPEG with
/// libjpeg-turbo as Pillow does (jpeg_pillow.rs), so only the resize's rounding is left.
const XRV_TOL: f32 = 1e-3;

#[test]
fn xrv_224_variant_matches_torchxrayvision() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fixtures = root.join("tests/fixtures/xrv_parity");
    let text = std::fs::read_to_string(fixtures.join("manifest.json"))
        .expect("manifest: run scripts/fixtures/make_xrv_parity_fixtures.py");
    let m: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let images = m["images"].as_array().expect("images");
    assert!(images.len() >= 12);
    let mut worst = 0f32;
    for rec in images {
        let file = rec["file"].as_str().expect("file");
        let path = root.join("../shared/data/cxr/images").join(file);
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("real test data missing: {} ({e})", path.display()));
        let img = decode(&bytes, file, 100_000_000).expect("decodes");
        let want: Vec<f32> = std::fs::read(fixtures.join(rec["xrv224"].as_str().expect("name")))
            .expect("fixture")
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let got = prepare(&img, &Preprocess::xrv(224)).expect("prepare");
        assert_eq!(got.data.len(), want.len());
        let d = got
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!("{file:45} max |diff| {d:.2e}");
        assert!(d <= XRV_TOL, "{file}: the 224 px variant differs by {d}");
        worst = worst.max(d);
    }
    println!("worst {worst:.2e}");
}
