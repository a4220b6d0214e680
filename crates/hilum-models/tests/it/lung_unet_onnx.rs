//! Two backends, one answer: the lung U-Net on candle (weights converted from the Keras .h5)
//! and on ONNX Runtime (the published .onnx of the same network) agree to 1e-4.
//!
//! Needs ORT_DYLIB_PATH (scripts/setup_onnxruntime.sh prints it); without it the tests say so
//! and pass without checking anything.

use std::path::{Path, PathBuf};

use hilum_models::onnx::OnnxModel;
use hilum_models::unet::{self, LungSegmenter};
use hilum_models::{Device, ImportOptions, ModelPool, ModelRegistry};

use crate::common::ort_ready;

fn data() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        d.join("models/lung_seg_unet").is_dir(),
        "real test data missing: expected {}",
        d.display()
    );
    d
}

fn import_opts() -> ImportOptions {
    ImportOptions::default()
}

fn candle_model(dir: &Path) -> std::sync::Arc<LungSegmenter> {
    let reg = ModelRegistry::new(dir).expect("registry");
    let h5 = data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
    hilum_models::import(&reg, "lung-unet", &h5, &import_opts()).expect("import lung-unet");
    let pool = ModelPool::new(std::sync::Arc::new(reg));
    pool.get_or_load::<LungSegmenter>("lung-unet", Device::Cpu, hilum_models::Backend::Native)
        .expect("load")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

#[test]
fn candle_and_onnx_runtime_agree_on_real_images() {
    if !ort_ready() {
        return;
    }
    let onnx = OnnxModel::load(
        &data().join("models/lung_seg_unet/lung_seg_valiou_088.onnx"),
        2,
    )
    .expect("load onnx");
    let dir = tempfile::tempdir().expect("tempdir");
    let candle = candle_model(dir.path());

    for file in ["nih_00000001_000_cardiomegaly.png", "covid_2c35005f.jpg"] {
        let img = image::open(data().join("cxr/images").join(file))
            .expect("decode")
            .to_rgb8();
        let (w, h) = img.dimensions();
        let rgb: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
        let x = unet::preprocess_rgb(&rgb, w as usize, h as usize, 256);
        let (shape, ort_out) = onnx.run(&[1, 256, 256, 3], &x).expect("onnx run");
        assert_eq!(shape, vec![1, 256, 256, 1]);
        let candle_out = candle.predict(&[x]).expect("candle").remove(0);
        let d = max_diff(&candle_out, &ort_out);
        eprintln!("{file}: candle vs ONNX Runtime max abs diff {d:.2e}");
        assert!(d <= 1e-4, "{file}: {d}");
        // Not a trivial agreement: the map has both lung and background.
        assert!(ort_out.iter().any(|p| *p > 0.9) && ort_out.iter().any(|p| *p < 0.1));
    }
}

#[test]
fn missing_graph_is_a_clear_error() {
    if !ort_ready() {
        return;
    }
    let err = OnnxModel::load(Path::new("/nonexistent/model.onnx"), 1).err();
    let msg = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("/nonexistent/model.onnx"), "{msg}");
}

#[test]
fn imported_graph_runs_through_the_pool_and_auto_picks_onnx() {
    if !ort_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let graph = data().join("models/lung_seg_unet/lung_seg_valiou_088.onnx");
    // The graph is added to installed weights, not installed alone.
    let err = hilum_models::import(&reg, "lung-unet", &graph, &import_opts()).err();
    let msg = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        msg.contains("first run `hilum models import lung-unet"),
        "{msg}"
    );

    let h5 = data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
    let inst = hilum_models::import(&reg, "lung-unet", &h5, &import_opts()).expect("h5");
    assert_eq!(
        unet::auto_backend(&inst, Device::Cpu),
        hilum_models::Backend::Native
    );
    let inst = hilum_models::import(&reg, "lung-unet", &graph, &import_opts()).expect("onnx");
    assert!(inst.onnx.is_some());
    // With the graph installed, ONNX Runtime is the default only where the native direct
    // kernels do not run (they are faster than it).
    let want = if hilum_kernels::unet_direct_engine() {
        hilum_models::Backend::Native
    } else {
        hilum_models::Backend::Onnx
    };
    assert_eq!(unet::auto_backend(&inst, Device::Cpu), want);
    assert!(reg.verify("lung-unet").expect("verify").ok);

    let pool = ModelPool::new(std::sync::Arc::new(reg));
    let ort = pool
        .get_or_load::<LungSegmenter>("lung-unet", Device::Cpu, hilum_models::Backend::Onnx)
        .expect("onnx model");
    let candle = pool
        .get_or_load::<LungSegmenter>("lung-unet", Device::Cpu, hilum_models::Backend::Native)
        .expect("candle model");
    // A batch of two real radiographs (out-of-distribution noise amplifies float differences).
    let batch: Vec<Vec<f32>> = ["nih_00000100_000_effusion_multi.png", "covid_0a7faa2a.jpg"]
        .iter()
        .map(|f| {
            let img = image::open(data().join("cxr/images").join(f))
                .expect("decode")
                .to_rgb8();
            let (w, h) = img.dimensions();
            let rgb: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
            unet::preprocess_rgb(&rgb, w as usize, h as usize, 256)
        })
        .collect();
    let a = ort.predict(&batch).expect("ort batch");
    let b = candle.predict(&batch).expect("candle batch");
    for (p, q) in a.iter().zip(&b) {
        let d = max_diff(p, q);
        eprintln!("batched candle vs ONNX Runtime via the pool: max abs diff {d:.2e}");
        assert!(d <= 1e-4, "{d}");
    }
}

/// Latency of one 256x256 forward, candle vs ONNX Runtime, median of 10 after a warm-up.
/// Run: `eval "$(scripts/setup_onnxruntime.sh)"; cargo test -p hilum-models --release --test
/// lung_unet_onnx -- --ignored --nocapture` (dependencies are optimised even in test builds).
#[test]
#[ignore = "timing, not a check"]
fn forward_latency_candle_vs_onnx_runtime() {
    if !ort_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let candle = candle_model(dir.path());
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let ort = OnnxModel::load(
        &data().join("models/lung_seg_unet/lung_seg_valiou_088.onnx"),
        threads,
    )
    .expect("onnx");
    let (_, x) = {
        let img = image::open(data().join("cxr/images/nih_00000001_000_cardiomegaly.png"))
            .expect("decode")
            .to_rgb8();
        let rgb: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
        ((), unet::preprocess_rgb(&rgb, 512, 512, 256))
    };
    let median = |f: &dyn Fn()| {
        f();
        let mut t: Vec<f64> = (0..10)
            .map(|_| {
                let s = std::time::Instant::now();
                f();
                s.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[5]
    };
    let c = median(&|| {
        candle.predict(std::slice::from_ref(&x)).expect("candle");
    });
    let o = median(&|| {
        ort.run(&[1, 256, 256, 3], &x).expect("ort");
    });
    eprintln!(
        "lung U-Net 256x256 batch 1, {threads} threads: candle {c:.1} ms, ONNX Runtime {o:.1} ms, ratio {:.1}x",
        c / o
    );
}
