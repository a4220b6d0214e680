//! The classifiers on ONNX Runtime, from graphs Hilum writes from the same safetensors the
//! native path loads: native and ONNX Runtime outputs agree to 1e-4 on the committed fixtures
//! (and ONNX Runtime matches the PyTorch reference outputs there), and on the full-size
//! networks with seeded weights at batch 2.
//!
//! Needs ONNX Runtime: `eval "$(scripts/setup_onnxruntime.sh)"` exports ORT_DYLIB_PATH
//! (scripts/test.sh does). Without it every test here says it skipped and why.

use std::path::PathBuf;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hilum_models::xrv::{self, Arch, Classifier, OnnxSource, XrvSpec};
use hilum_models::Backend;
use hilum_models::{densenet, resnet, ModelRegistry};

use crate::common::ort_ready;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/classifier")
}

fn fixture_vb(name: &str) -> VarBuilder<'static> {
    let path = fixtures().join(name);
    // SAFETY: the fixture is not modified while the test runs.
    unsafe {
        VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).expect("weights")
    }
}

fn small_config(key: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("small_configs.json"))
        .expect("fixtures present (scripts/fixtures/make_fixtures.py)");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    v[key].clone()
}

/// Input and PyTorch logits of a fixture.
fn load_io(name: &str) -> (Vec<f32>, usize, usize, Vec<f32>) {
    let t = candle_core::safetensors::load(fixtures().join(name), &Device::Cpu).expect("io");
    let (b, _, h, _) = t["input"].dims4().expect("4-d input");
    let flat = |k: &str| {
        t[k].flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .expect(k)
    };
    (flat("input"), b, h, flat("logits"))
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "output lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_fixture(arch: Arch, weights: &str, io: &str) {
    let (x, batch, size, torch) = load_io(io);
    let spec = XrvSpec {
        resolution: size,
        arch,
        ..XrvSpec::densenet121_res224_all()
    };
    let native = Classifier::new(fixture_vb(weights), spec.clone(), Backend::Native, 2)
        .expect("native")
        .logits(&x, batch)
        .expect("native forward");
    let ort = Classifier::new(fixture_vb(weights), spec, Backend::Onnx, 2).expect("onnx graph");
    assert_eq!(ort.backend(), Backend::Onnx);
    assert_eq!(ort.onnx_source, Some(OnnxSource::Built));
    let got = ort.logits(&x, batch).expect("onnx forward");
    let d = max_abs_diff(&got, &native);
    assert!(d <= 1e-4, "ONNX Runtime vs native: max abs diff {d}");
    let d = max_abs_diff(&got, &torch);
    assert!(d <= 1e-4, "ONNX Runtime vs PyTorch: max abs diff {d}");
}

#[test]
fn small_densenet_onnx_matches_native_and_torchxrayvision() {
    if !ort_ready() {
        return;
    }
    let cfg: densenet::Config = serde_json::from_value(small_config("densenet")).expect("cfg");
    check_fixture(
        Arch::DenseNet(cfg),
        "densenet_small.safetensors",
        "densenet_small_io.safetensors",
    );
}

#[test]
fn small_resnet_onnx_matches_native_and_torchvision() {
    if !ort_ready() {
        return;
    }
    let cfg: resnet::Config = serde_json::from_value(small_config("resnet")).expect("cfg");
    check_fixture(
        Arch::ResNet(cfg),
        "resnet_small.safetensors",
        "resnet_small_io.safetensors",
    );
}

/// Full-size architecture, seeded weights, batch 2: ONNX Runtime vs native.
fn full_size_parity(spec: XrvSpec) {
    let batch = 2;
    let w = xrv::synthetic_weights(&spec.arch, 11).expect("weights");
    let size = spec.resolution;
    // Two different images in [-1, 1) (seeded weights give logits of order 10 there; the
    // xrv range [-1024, 1024] would scale them, and the rounding error, by ~1000).
    let x: Vec<f32> = (0..batch * size * size)
        .map(|i| ((i * 7919 + i / (size * size) * 104_729) % 2048) as f32 / 1024.0 - 1.0)
        .collect();
    let mk = |b| {
        let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
        Classifier::new(vb, spec.clone(), b, 2).expect("builds")
    };
    let native = mk(Backend::Native).logits(&x, batch).expect("native");
    let ort = mk(Backend::Onnx).logits(&x, batch).expect("onnx");
    let scale = native.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 1e-3, "degenerate test: logits all near zero");
    let (a, b) = native.split_at(spec.labels.len());
    assert!(
        max_abs_diff(a, b) > 1e-4,
        "the two images gave the same logits"
    );
    let d = max_abs_diff(&ort, &native);
    assert!(
        d <= 1e-4 * scale.max(1.0),
        "{}: ONNX Runtime vs native max abs diff {d} (logits up to {scale})",
        spec.id
    );
    eprintln!(
        "{}: batch {batch}, ONNX Runtime vs native max abs diff {d:.2e}, logits up to {scale:.2}",
        spec.id
    );
}

#[test]
fn densenet121_onnx_matches_native_at_224_batch2() {
    if !ort_ready() {
        return;
    }
    full_size_parity(XrvSpec::densenet121_res224_all());
}

#[test]
fn resnet50_onnx_matches_native_at_512_batch2() {
    if !ort_ready() {
        return;
    }
    full_size_parity(XrvSpec::resnet50_res512_all());
}

/// Through the registry and the pool, as the tool loads it: an installed model (seeded
/// weights imported as a site's checkpoint) on ONNX Runtime and natively, one warm copy each.
#[test]
fn installed_model_runs_on_both_backends_from_the_pool() {
    if !ort_ready() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = XrvSpec::densenet121_res224_all();
    let w = xrv::synthetic_weights(&spec.arch, 5).expect("weights");
    let ckpt = dir.path().join("site.safetensors");
    candle_core::safetensors::save(&w, &ckpt).expect("save");
    let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
    let opts = hilum_models::ImportOptions {
        custom: true,
        ..Default::default()
    };
    hilum_models::import(&registry, &spec.id, &ckpt, &opts).expect("import");
    let pool = hilum_models::ModelPool::new(std::sync::Arc::new(registry));
    let cpu = hilum_models::Device::Cpu;
    let ort = xrv::pooled(&pool, &spec.id, cpu, Some(Backend::Onnx)).expect("onnx");
    let native = xrv::pooled(&pool, &spec.id, cpu, None).expect("default");
    assert_eq!(ort.backend(), Backend::Onnx);
    assert_eq!(
        native.backend(),
        Backend::Native,
        "native is the CPU default"
    );
    assert!(ort.custom && native.custom);
    let again = xrv::pooled(&pool, &spec.id, cpu, Some(Backend::Onnx)).expect("warm");
    assert!(std::sync::Arc::ptr_eq(&ort, &again), "kept warm");
    let x = vec![0.25f32; 224 * 224];
    let d = max_abs_diff(
        &ort.logits(&x, 1).expect("onnx"),
        &native.logits(&x, 1).expect("native"),
    );
    assert!(d <= 1e-3, "max abs diff {d}");
}
