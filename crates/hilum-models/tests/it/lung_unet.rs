//! The real lung U-Net (../shared/data/models/lung_seg_unet): import of the published Keras
//! checkpoint, fidelity to the reference output, and Dice against ground-truth lung masks.
//! The .h5 is read in Rust: no Python.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use hilum_models::unet::{self, LungSegmenter};
use hilum_models::Backend;
use hilum_models::{Device, ImportOptions, ModelError, ModelPool, ModelRegistry};

fn data() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        d.join("models/lung_seg_unet").is_dir(),
        "real test data missing: expected {} (the shared data directory beside the repository)",
        d.display()
    );
    d
}

fn h5() -> PathBuf {
    data().join("models/lung_seg_unet/lung_seg_valiou_088.h5")
}

fn import_opts(custom: bool) -> ImportOptions {
    ImportOptions {
        custom,
        origin: None,
    }
}

/// One models directory with the published checkpoint imported, shared by the tests.
fn pool() -> &'static Arc<ModelPool> {
    static POOL: OnceLock<(tempfile::TempDir, Arc<ModelPool>)> = OnceLock::new();
    &POOL
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("tempdir");
            let reg = ModelRegistry::new(dir.path()).expect("registry");
            hilum_models::import(&reg, "lung-unet", &h5(), &import_opts(false))
                .unwrap_or_else(|e| panic!("importing {}: {e}", h5().display()));
            (dir, Arc::new(ModelPool::new(Arc::new(reg))))
        })
        .1
}

/// The warm lung U-Net on `backend` (the CPU default of the tools is the native engine).
fn model_on(backend: Backend) -> Arc<LungSegmenter> {
    pool()
        .get_or_load::<LungSegmenter>("lung-unet", Device::Cpu, backend)
        .expect("load lung-unet")
}

fn model() -> Arc<LungSegmenter> {
    model_on(Backend::default_for(Device::Cpu))
}

/// Reads a little-endian float32 .npy file: (shape, values).
fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&bytes[..6], b"\x93NUMPY", "{} is not .npy", path.display());
    let (hlen, start) = if bytes[6] == 1 {
        (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10)
    } else {
        (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        )
    };
    let header = std::str::from_utf8(&bytes[start..start + hlen]).expect("header");
    assert!(header.contains("'<f4'"), "expected float32: {header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape_str = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .expect("shape");
    let shape: Vec<usize> = shape_str
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().expect("dim"))
        .collect();
    let values: Vec<f32> = bytes[start + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(values.len(), shape.iter().product::<usize>());
    (shape, values)
}

fn reference(kind: &str) -> (Vec<usize>, Vec<f32>) {
    read_npy(&data().join(format!(
        "models/lung_seg_unet/reference_outputs/lung_seg_{kind}_nih_00000001_000_cardiomegaly.npy"
    )))
}

fn dice(a: &[bool], b: &[bool]) -> f64 {
    let inter = a.iter().zip(b).filter(|(x, y)| **x && **y).count() as f64;
    let total = (a.iter().filter(|x| **x).count() + b.iter().filter(|x| **x).count()) as f64;
    if total == 0.0 {
        1.0
    } else {
        2.0 * inter / total
    }
}

/// Original-resolution lung mask for an image file, through the reference pipeline.
fn segment_file(path: &Path) -> (Vec<bool>, u32, u32) {
    let img = image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_rgb8();
    let (w, h) = img.dimensions();
    let rgb: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
    let x = unet::preprocess_rgb(&rgb, w as usize, h as usize, 256);
    let prob = model().predict(&[x]).expect("predict").remove(0);
    (unet::mask_at(&prob, 256, w as usize, h as usize, 0.5), w, h)
}

fn read_mask(path: &Path) -> Vec<bool> {
    let m = image::open(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .to_luma8();
    m.as_raw().iter().map(|&v| v > 127).collect()
}

#[test]
fn import_records_published_sha256_and_verifies() {
    let reg = pool().registry();
    let inst = reg.installed("lung-unet").expect("installed");
    assert!(!inst.record.custom);
    assert_eq!(
        Some(inst.record.source_sha256.as_str()),
        reg.manifest("lung-unet")
            .expect("manifest")
            .source
            .sha256
            .as_deref()
    );
    let report = reg.verify("lung-unet").expect("verify");
    assert!(report.ok, "{:?}", report.problems);
}

#[test]
fn another_file_needs_custom_and_must_fit_the_architecture() {
    let reg = pool().registry();
    let installed = reg.installed("lung-unet").expect("installed").weights;
    let dir = tempfile::tempdir().expect("tempdir");
    let other = ModelRegistry::new(dir.path()).expect("registry");

    // Same architecture, not the published file: refused without --custom, accepted with it.
    let err = hilum_models::import(&other, "lung-unet", &installed, &import_opts(false))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("--custom"), "{err}");
    let inst = hilum_models::import(&other, "lung-unet", &installed, &import_opts(true))
        .expect("custom import of a well-formed checkpoint");
    assert!(inst.record.custom);
    assert!(other.verify("lung-unet").expect("verify").ok);

    // Wrong architecture: the ONNX file is not a checkpoint; a truncated safetensors is refused.
    let bad = dir.path().join("bad.safetensors");
    let bytes = std::fs::read(&installed).expect("read");
    std::fs::write(&bad, &bytes[..bytes.len() / 2]).expect("write");
    let err = hilum_models::import(&other, "lung-unet", &bad, &import_opts(true)).err();
    assert!(err.is_some(), "a truncated checkpoint must be refused");
}

/// Records each step of an import and the bytes it reported.
#[derive(Default)]
struct Steps(Vec<(String, Option<u64>, u64)>);

impl hilum_models::ImportProgress for Steps {
    fn step(&mut self, what: &str, total: Option<u64>) {
        self.0.push((what.to_string(), total, 0));
    }
    fn advance(&mut self, bytes: u64) {
        if let Some(last) = self.0.last_mut() {
            last.2 += bytes;
        }
    }
}

#[test]
fn import_reports_each_step_with_its_bytes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let mut steps = Steps::default();
    let inst = hilum_models::import_with_progress(
        &reg,
        "lung-unet",
        &h5(),
        &import_opts(false),
        &mut steps,
    )
    .expect("import");
    let names: Vec<&str> = steps.0.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "checking the file's sha256",
            "converting to safetensors",
            "checking tensor names and shapes",
            "checking the converted weights' sha256",
            "installing",
        ]
    );
    let h5_len = std::fs::metadata(h5()).expect("h5").len();
    // Byte steps announce their size and report all of it; the others have no size.
    let sizes: Vec<(Option<u64>, u64)> = steps.0.iter().map(|s| (s.1, s.2)).collect();
    assert_eq!(
        sizes,
        [
            (Some(h5_len), h5_len),
            (None, 0),
            (None, 0),
            (Some(inst.size), inst.size),
            (Some(inst.size), inst.size),
        ]
    );

    // A safetensors file is installed as it is, so it is hashed once, and not converted.
    let again = tempfile::tempdir().expect("tempdir");
    let other = ModelRegistry::new(again.path()).expect("registry");
    let mut steps = Steps::default();
    let custom = hilum_models::import_with_progress(
        &other,
        "lung-unet",
        &inst.weights,
        &import_opts(true),
        &mut steps,
    )
    .expect("custom import");
    let names: Vec<&str> = steps.0.iter().map(|s| s.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "checking the file's sha256",
            "checking tensor names and shapes",
            "installing"
        ]
    );
    assert_eq!(custom.record.sha256, custom.record.source_sha256);
    assert_eq!(custom.record.sha256, inst.record.sha256);
}

#[test]
fn verify_detects_a_changed_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    hilum_models::import(&reg, "lung-unet", &h5(), &import_opts(false)).expect("import");
    let w = reg.installed("lung-unet").expect("installed").weights;
    let mut bytes = std::fs::read(&w).expect("read");
    let n = bytes.len();
    bytes[n - 1] ^= 0x40; // flip a bit in the last weight
    std::fs::write(&w, bytes).expect("write");
    let report = reg.verify("lung-unet").expect("verify");
    assert!(!report.ok);
    assert!(
        report.problems[0].contains("sha256"),
        "{:?}",
        report.problems
    );
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn output_matches_keras_reference_to_1e4() {
    let (shape, input) = reference("input");
    assert_eq!(shape, vec![1, 256, 256, 3]);
    let (_, expected) = reference("output");
    let mut outs = Vec::new();
    for backend in [Backend::Native, Backend::Candle] {
        let got = model_on(backend)
            .predict(std::slice::from_ref(&input))
            .expect("predict")
            .remove(0);
        let max = max_diff(&got, &expected);
        eprintln!("lung-unet {backend:?} vs reference: max abs diff {max:.2e}");
        assert!(max <= 1e-4, "{backend:?}: max abs diff {max}");
        outs.push(got);
    }
    let max = max_diff(&outs[0], &outs[1]);
    eprintln!("lung-unet native vs candle: max abs diff {max:.2e}");
    assert!(max <= 1e-4, "native vs candle: {max}");
    // On the CPU the default runs the native kernels.
    let m = model();
    assert_eq!(m.backend(), Backend::Native);
    assert_eq!(m.predict(&[input]).expect("predict").remove(0), outs[0]);
}

#[test]
fn batched_forward_equals_single() {
    let (_, input) = reference("input");
    let flipped: Vec<f32> = input.iter().rev().copied().collect();
    for backend in [Backend::Native, Backend::Candle] {
        let m = model_on(backend);
        let both = m.predict(&[input.clone(), flipped.clone()]).expect("batch");
        let one = m
            .predict(std::slice::from_ref(&input))
            .expect("single")
            .remove(0);
        let two = m
            .predict(std::slice::from_ref(&flipped))
            .expect("single")
            .remove(0);
        let max = max_diff(&both[0], &one).max(max_diff(&both[1], &two));
        assert!(max < 1e-5, "{backend:?}: {max}");
        assert_ne!(both[0], both[1]);
    }
}

#[test]
fn preprocessing_matches_reference_input() {
    let path = data().join("cxr/images/nih_00000001_000_cardiomegaly.png");
    let img = image::open(&path).expect("decode").to_luma8();
    let (w, h) = img.dimensions();
    let gray: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
    let x = unet::preprocess_gray(&gray, w as usize, h as usize, 256);
    let (_, expected) = reference("input");
    let diffs: Vec<f32> = x
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .collect();
    let max = diffs.iter().copied().fold(0f32, f32::max);
    let off = diffs.iter().filter(|d| **d > 0.0).count() as f64 / diffs.len() as f64;
    eprintln!(
        "preprocessing vs reference: max {max}, {:.2}% of values differ",
        off * 100.0
    );
    // The reference is Pillow's fixed-point bilinear on the 8-bit file: equal, value for value.
    assert_eq!(max, 0.0, "max diff {max}, {off} of the values differ");
}

#[test]
fn dice_against_ground_truth_lung_masks() {
    let gt = data().join("cxr/ground_truth/lung_masks");
    let csv = std::fs::read_to_string(gt.join("pairs.csv")).expect("pairs.csv");
    let mut n = 0;
    for line in csv.lines().skip(1).filter(|l| !l.trim().is_empty()) {
        let cols: Vec<&str> = line.split(',').collect();
        let (mask, w, h) = segment_file(&data().join("cxr/images").join(cols[0]));
        assert_eq!(
            (w.to_string(), h.to_string()),
            (cols[2].into(), cols[3].into())
        );
        let d = dice(&mask, &read_mask(&gt.join(cols[1])));
        eprintln!("dice {}: {d:.4}", cols[0]);
        assert!(d >= 0.82, "{}: Dice {d:.4} < 0.82", cols[0]);
        n += 1;
    }
    assert_eq!(n, 4);
}

#[test]
fn dice_on_imlab_masks_is_reported() {
    let dir = data().join("cxr/ground_truth/lung_masks_imlab");
    for i in 1..=4 {
        let (mask, _, _) = segment_file(&dir.join(format!("imlab_{i}.jpg")));
        let d = dice(&mask, &read_mask(&dir.join(format!("imlab_{i}.mask.png"))));
        eprintln!("dice imlab_{i}: {d:.4} (reference pipeline 0.81-0.89)");
        // Reported; a floor well under the reference only catches a broken pipeline.
        assert!(d >= 0.75, "imlab_{i}: Dice {d:.4}");
    }
}

#[test]
fn missing_weights_error_names_the_commands() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = ModelPool::new(Arc::new(ModelRegistry::new(dir.path()).expect("registry")));
    match pool.get_or_load::<LungSegmenter>("lung-unet", Device::Cpu, Backend::Native) {
        Err(e @ ModelError::NotInstalled { .. }) => {
            let s = e.to_string();
            assert!(s.contains("hilum models import lung-unet"), "{s}");
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("loaded a model that is not installed"),
    }
}

/// The U-Net's recipe (`unet::recipe`, what the image store prepares for `segment_lungs` and
/// `measure_chest`) is the PIL-on-8-bit resize value for value: it equals the U-Net's own
/// interleaved RGB resize of the grey image scaled to 0..255, on 8-bit PNG, JPEG and 16-bit
/// inputs.
#[test]
fn the_store_recipe_is_the_u8_resize_exactly() {
    for name in [
        "nih_00000001_000_cardiomegaly.png",
        "covid_0a7faa2a.jpg",
        "derived_RG1_chest_pa_16bit.png",
    ] {
        let bytes = std::fs::read(data().join("cxr/images").join(name)).expect("image");
        let img = hilum_imaging::decode(&bytes, name, 1 << 26).expect("decode");
        let (w, h) = (img.width as usize, img.height as usize);
        let scale = 255.0 / img.max_value();
        let rgb: Vec<f32> = img.pixels.iter().flat_map(|v| [v * scale; 3]).collect();
        let expected = unet::preprocess_rgb(&rgb, w, h, 256);
        let prepared = hilum_imaging::prepare(&img, &unet::recipe(256)).expect("prepare");
        assert_eq!(prepared.shape(), [256, 256, 3], "{name}");
        assert!(
            prepared.data == expected,
            "{name}: the recipe differs from the u8 resize"
        );
        let gray: Vec<f32> = img.pixels.iter().map(|v| v * scale).collect();
        assert!(
            unet::preprocess_gray(&gray, w, h, 256) == expected,
            "{name}"
        );
    }
}
