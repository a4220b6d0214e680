//! End-to-end parity with the Python reference pipelines on real radiographs: Hilum decodes the
//! shared files (../shared/data/cxr/images) and preprocesses them as `classify_chest_xray`,
//! `segment_anatomy` and `segment_region` do; the fixtures (tests/fixtures/xrv_parity, written by
//! scripts/fixtures/make_xrv_parity_fixtures.py with torchxrayvision 1.5.7, scikit-image 0.26 and torch
//! 2.15) hold what torchxrayvision's own pipeline and MedSAM_Inference.py produce from the same
//! files, and the scores of a full-size DenseNet-121 with Hilum's seeded weights.
//!
//! `cargo test -p hilum-models --release --test it xrv_parity:: -- --nocapture` prints the per-image
//! differences.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use hilum_imaging::{decode, CxrImage};
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::{pspnet, Backend};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// On torchxrayvision's [-1024, 1024] scale (1e-6 of the range, about 16 f32 ulps at 1024),
/// for PNG and JPEG alike: JPEG is decoded by libjpeg-turbo as Pillow decodes it (with
/// zune-jpeg the IDCTs differed by one level on some pixels: up to 3.3 at 224 px, 6.9 at 512).
const XRV_TOL: f32 = 1e-3;

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len().max(1) as f32
}
/// On the calibrated scores and on the logits.
const SCORE_TOL: f32 = 1e-3;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/xrv_parity")
}

fn manifest() -> Value {
    let path = fixtures().join("manifest.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run scripts/fixtures/make_xrv_parity_fixtures.py",
            path.display()
        )
    });
    serde_json::from_str(&text).expect("manifest is JSON")
}

fn image(file: &str) -> CxrImage {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/images");
    let path = dir.join(file);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "real test data missing: {} ({e}); the shared data folder sits beside the repository",
            path.display()
        )
    });
    decode(&bytes, file, 100_000_000).expect("decodes")
}

fn f32s(name: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixtures().join(name)).expect("fixture readable");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn rows(v: &Value) -> Vec<usize> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("row") as usize)
        .collect()
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// `rows` of a `width`-wide plane, concatenated.
fn pick_rows(plane: &[f32], width: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&y| plane[y * width..(y + 1) * width].iter().copied())
        .collect()
}

fn images(m: &Value) -> &Vec<Value> {
    let list = m["images"].as_array().expect("images");
    assert!(list.len() >= 12, "fewer than 12 images in the manifest");
    list
}

#[test]
fn xrv_224_inputs_match_torchxrayvision() {
    let m = manifest();
    let mut worst = 0f32;
    for rec in images(&m) {
        let file = rec["file"].as_str().expect("file");
        let img = image(file);
        assert_eq!(
            (img.width as u64, img.height as u64),
            (
                rec["width"].as_u64().expect("w"),
                rec["height"].as_u64().expect("h")
            )
        );
        assert_eq!(
            img.max_value() as f64,
            rec["max_value"].as_f64().expect("max")
        );
        let want = f32s(rec["xrv224"].as_str().expect("xrv224"));
        // What classify_chest_xray feeds the network, and the image store's cached variant.
        let got = xrv::preprocess(
            &img.pixels,
            img.width as usize,
            img.height as usize,
            img.max_value(),
            224,
        );
        let d = max_abs_diff(&got, &want);
        let stored =
            hilum_imaging::prepare(&img, &hilum_imaging::Preprocess::xrv(224)).expect("prepare");
        let ds = max_abs_diff(&stored.data, &want);
        let kind = rec["kind"].as_str().unwrap_or("");
        let mean = mean_abs_diff(&got, &want);
        println!("{file:45} {kind:9} xrv224 max |diff| {d:.2e} mean {mean:.2e} (store {ds:.2e})");
        assert!(
            d.max(ds) <= XRV_TOL,
            "{file}: 224 px input differs by {}",
            d.max(ds)
        );
        worst = worst.max(d).max(ds);
    }
    println!("xrv224: worst {worst:.2e}");
}

/// Hilum's seeded DenseNet-121 (`xrv::synthetic_weights`) with the fixture's classifier scale,
/// after checking that they are the weights the generator ported.
fn seeded_classifier(m: &Value) -> Classifier {
    let spec = XrvSpec::densenet121_res224_all();
    let seed = m["seed"].as_u64().expect("seed");
    let mut w = xrv::synthetic_weights(&spec.arch, seed).expect("weights");
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let mut sha = Sha256::new();
    for n in &names {
        let v = w[*n]
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect("tensor");
        for x in v {
            sha.update(x.to_le_bytes());
        }
    }
    let checks = &m["weights"];
    assert_eq!(
        names.len() as u64,
        checks["tensors"].as_u64().expect("tensors")
    );
    assert_eq!(
        format!("{:x}", sha.finalize()),
        checks["sha256"].as_str().expect("sha256"),
        "the generator's port of weights::seeded drifted from Hilum's"
    );
    let scale = m["classifier_scale"].as_f64().expect("scale");
    for name in ["classifier.weight", "classifier.bias"] {
        let t: &Tensor = &w[name];
        let scaled = t.affine(scale, 0.0).expect("scale");
        w.insert(name.to_string(), scaled);
    }
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    Classifier::new(vb, spec, Backend::Native, 2).expect("builds")
}

#[test]
fn classify_scores_match_torchxrayvision() {
    let m = manifest();
    let model = seeded_classifier(&m);
    let (mut worst_score, mut worst_logit) = (0f32, 0f32);
    for rec in images(&m) {
        let file = rec["file"].as_str().expect("file");
        let img = image(file);
        // The tool's path: Classifier::classify on the decoded pixels.
        let scores = model
            .classify(
                &img.pixels,
                img.width as usize,
                img.height as usize,
                img.max_value(),
            )
            .expect("classify");
        let got: Vec<f32> = scores.iter().map(|s| s.score.unwrap_or(0.5)).collect();
        let want = floats(&rec["scores"]);
        let x = xrv::preprocess(
            &img.pixels,
            img.width as usize,
            img.height as usize,
            img.max_value(),
            224,
        );
        let logits = model.logits(&x, 1).expect("logits");
        let ds = max_abs_diff(&got, &want);
        let dl = max_abs_diff(&logits, &floats(&rec["logits"]));
        println!("{file:45} scores max |diff| {ds:.2e}, logits {dl:.2e}");
        worst_score = worst_score.max(ds);
        worst_logit = worst_logit.max(dl);
    }
    assert!(
        worst_score <= SCORE_TOL,
        "scores differ by up to {worst_score}"
    );
    assert!(
        worst_logit <= SCORE_TOL,
        "logits differ by up to {worst_logit}"
    );
}

#[test]
fn pspnet_512_inputs_match_torchxrayvision() {
    let m = manifest();
    let mut worst = 0f32;
    for rec in images(&m) {
        let file = rec["file"].as_str().expect("file");
        let img = image(file);
        let x = pspnet::preprocess(
            &img.pixels,
            img.width as usize,
            img.height as usize,
            img.max_value(),
            512,
        );
        // Channel 0, the sampled rows; its scale is ImageNet-normalised [0, 1] (x 4.4).
        let got = pick_rows(&x[..512 * 512], 512, &rows(&rec["psp512_rows"]));
        let want = f32s(rec["psp512"].as_str().expect("psp512"));
        let d = max_abs_diff(&got, &want);
        // On the xrv scale: the plane is ((x + 1024) / 2048 - 0.485) / 0.229.
        let d_xrv = d * 0.229 * 2048.0;
        println!("{file:45} psp512 max |diff| {d:.2e} (xrv scale {d_xrv:.2e})");
        assert!(
            d_xrv <= XRV_TOL,
            "{file}: 512 px PSPNet input differs by {d_xrv} on the xrv scale"
        );
        worst = worst.max(d_xrv);
    }
    println!("psp512: worst {worst:.2e} on the xrv scale");
}

#[test]
fn medsam_1024_inputs_match_medsam_inference() {
    let m = manifest();
    let (mut off, mut total, mut worst) = (0usize, 0usize, 0f32);
    for rec in images(&m) {
        let Some(name) = rec["medsam1024"].as_str() else {
            continue; // 16-bit files: MedSAM_Inference.py wraps them modulo 256.
        };
        let file = rec["file"].as_str().expect("file");
        let img = image(file);
        let x = hilum_models::sam::preprocess(
            &img.pixels,
            img.width as usize,
            img.height as usize,
            img.max_value(),
            1024,
        );
        let got = pick_rows(&x[..1024 * 1024], 1024, &rows(&rec["medsam1024_rows"]));
        let (lo, hi) = (
            rec["medsam1024_min"].as_f64().expect("min") as f32,
            rec["medsam1024_max"].as_f64().expect("max") as f32,
        );
        let bytes = std::fs::read(fixtures().join(name)).expect("fixture readable");
        let want: Vec<f32> = bytes
            .iter()
            .map(|&b| (b as f32 - lo) / (hi - lo).max(1e-8))
            .collect();
        let d = max_abs_diff(&got, &want);
        // One 8-bit step of the reference, after its min-max scaling.
        let step = 1.0 / (hi - lo).max(1.0);
        let n_off = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| (*a - *b).abs() > 1e-6)
            .count();
        println!(
            "{file:45} medsam1024 max |diff| {d:.2e} ({:.2} steps), {n_off} of {} sampled pixels differ",
            d / step,
            got.len()
        );
        // Nothing may differ, resized or not (PNG and JPEG decode alike; at 1024 -> 1024 scipy
        // returns the input unchanged).
        assert_eq!(n_off, 0, "{file}: MedSAM input differs on {n_off} pixels");
        off += n_off;
        total += got.len();
        worst = worst.max(d / step);
    }
    println!("medsam1024: {off} of {total} sampled pixels differ, by up to {worst:.2} 8-bit steps");
}
