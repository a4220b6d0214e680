//! The torchxrayvision classifiers against reference outputs of the original Python code
//! (tests/fixtures/classifier, written by scripts/fixtures/make_fixtures.py), on both backends.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hilum_models::xrv::{self, Arch, Classifier, XrvSpec};
use hilum_models::Backend;
use hilum_models::{densenet, resnet};

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/classifier");
    assert!(
        p.join("small_configs.json").exists(),
        "fixtures missing in {}: run scripts/fixtures/make_fixtures.py",
        p.display()
    );
    p
}

fn json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join(name)).expect("fixture readable");
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn load_io(name: &str) -> (Vec<f32>, usize, usize, Vec<f32>) {
    let t =
        candle_core::safetensors::load(fixtures().join(name), &Device::Cpu).expect("io fixture");
    let input = &t["input"];
    let (b, _, h, _) = input.dims4().expect("4-d input");
    let x = input
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("input");
    let y = t["logits"]
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("logits");
    (x, b, h, y)
}

fn vb(name: &str) -> VarBuilder<'static> {
    let path = fixtures().join(name);
    // SAFETY: the fixture is not modified while the test runs.
    unsafe {
        VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu).expect("weights")
    }
}

fn small_spec(arch: Arch, size: usize) -> XrvSpec {
    XrvSpec {
        resolution: size,
        arch,
        ..XrvSpec::densenet121_res224_all()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "output lengths differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_small(arch: Arch, weights: &str, io: &str) {
    let (x, batch, size, want) = load_io(io);
    for backend in [Backend::Candle, Backend::Native] {
        for threads in [1, 2] {
            let c = Classifier::new(
                vb(weights),
                small_spec(arch.clone(), size),
                backend,
                threads,
            )
            .expect("model builds");
            let got = c.logits(&x, batch).expect("forward");
            let d = max_abs_diff(&got, &want);
            assert!(
                d <= 1e-4,
                "{backend:?} with {threads} threads: max abs diff {d} to PyTorch"
            );
            if backend == Backend::Candle {
                break;
            }
        }
    }
}

#[test]
fn small_densenet_matches_torchxrayvision_on_both_backends() {
    let cfg: densenet::Config =
        serde_json::from_value(json("small_configs.json")["densenet"].clone()).expect("config");
    check_small(
        Arch::DenseNet(cfg),
        "densenet_small.safetensors",
        "densenet_small_io.safetensors",
    );
}

#[test]
fn small_resnet_matches_torchvision_on_both_backends() {
    let cfg: resnet::Config =
        serde_json::from_value(json("small_configs.json")["resnet"].clone()).expect("config");
    check_small(
        Arch::ResNet(cfg),
        "resnet_small.safetensors",
        "resnet_small_io.safetensors",
    );
}

#[test]
fn op_norm_matches_torchxrayvision() {
    let cases = json("op_norm.json");
    for case in cases.as_array().expect("cases") {
        let th: Vec<Option<f32>> = case["op_threshs"]
            .as_array()
            .expect("thresholds")
            .iter()
            .map(|v| v.as_f64().map(|f| f as f32))
            .collect();
        let spec = match case["model"].as_str() {
            Some("densenet121-res224-all") => XrvSpec::densenet121_res224_all(),
            Some("resnet50-res512-all") => XrvSpec::resnet50_res512_all(),
            other => panic!("unexpected model {other:?}"),
        };
        // The built-in thresholds are the published ones.
        assert_eq!(spec.op_threshs, th, "{}", spec.id);
        let probs = case["probs"].as_array().expect("probs");
        let outs = case["outputs"].as_array().expect("outputs");
        for (p_row, o_row) in probs.iter().zip(outs) {
            for ((p, o), t) in p_row
                .as_array()
                .expect("row")
                .iter()
                .zip(o_row.as_array().expect("row"))
                .zip(&th)
            {
                let (p, o) = (p.as_f64().expect("p") as f32, o.as_f64().expect("o") as f32);
                let got = xrv::op_norm(p, *t);
                assert!(
                    (got - o).abs() <= 1e-6,
                    "op_norm({p}, {t:?}) = {got}, torchxrayvision {o}"
                );
            }
        }
    }
}

/// The full-size networks read exactly the published checkpoints' parameters.
fn check_names(arch: Arch, list: &str) {
    let published: BTreeMap<String, Vec<usize>> = json(list)
        .as_array()
        .expect("list")
        .iter()
        .filter(|p| {
            !p["name"]
                .as_str()
                .unwrap_or("")
                .ends_with(".num_batches_tracked")
        })
        .map(|p| {
            let name = p["name"].as_str().expect("name").to_string();
            let shape = p["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_u64().expect("dim") as usize)
                .collect();
            (name, shape)
        })
        .collect();
    let ours = xrv::expected_params(&arch).expect("records");
    let missing: Vec<_> = published
        .keys()
        .filter(|k| !ours.contains_key(*k))
        .collect();
    let extra: Vec<_> = ours
        .keys()
        .filter(|k| !published.contains_key(*k))
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "not read by Hilum: {missing:?}; not in the checkpoint: {extra:?}"
    );
    for (k, shape) in &published {
        assert_eq!(&ours[k], shape, "shape of {k}");
    }
    assert!(
        published.len() > 250,
        "{list} lists only {} tensors",
        published.len()
    );
}

#[test]
fn densenet121_reads_exactly_the_published_parameters() {
    check_names(
        Arch::DenseNet(densenet::Config::densenet121_res224_all()),
        "densenet121-res224-all.params.json",
    );
}

#[test]
fn resnet50_reads_exactly_the_published_parameters() {
    check_names(
        Arch::ResNet(resnet::Config::resnet50_res512_all()),
        "resnet50-res512-all.params.json",
    );
}

fn native_matches_candle(spec: XrvSpec, batch: usize) {
    let w = xrv::synthetic_weights(&spec.arch, 7).expect("weights");
    let size = spec.resolution;
    let x: Vec<f32> = (0..batch * size * size)
        .map(|i| ((i * 7919) % 2048) as f32 / 1024.0 - 1.0)
        .collect();
    let mk = |b| {
        let vb = VarBuilder::from_tensors(w.clone(), DType::F32, &Device::Cpu);
        Classifier::new(vb, spec.clone(), b, 2).expect("builds")
    };
    let want = mk(Backend::Candle).logits(&x, batch).expect("candle");
    let got = mk(Backend::Native).logits(&x, batch).expect("native");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(scale > 1e-3, "degenerate test: logits all near zero");
    let d = max_abs_diff(&got, &want);
    assert!(
        d <= 1e-4 * scale.max(1.0),
        "native vs candle max abs diff {d} (logits up to {scale})"
    );
}

#[test]
fn native_densenet121_matches_candle_at_224() {
    native_matches_candle(XrvSpec::densenet121_res224_all(), 2);
}

#[test]
fn native_resnet50_matches_candle() {
    // 512 px on candle's CPU conv takes seconds; 128 px exercises the same layers.
    let spec = XrvSpec {
        resolution: 128,
        ..XrvSpec::resnet50_res512_all()
    };
    native_matches_candle(spec, 1);
}

#[test]
fn preprocess_crops_the_centre_and_scales_to_xrv_range() {
    // 300 x 200 image: left and right 50 columns are 0, the centre square is a gradient.
    let (w, h) = (300usize, 200usize);
    let px: Vec<f32> = (0..w * h)
        .map(|i| {
            let (x, y) = (i % w, i / w);
            if (50..250).contains(&x) {
                (y as f32 / 199.0) * 255.0
            } else {
                0.0
            }
        })
        .collect();
    let out = xrv::preprocess(&px, w, h, 255.0, 224);
    assert_eq!(out.len(), 224 * 224);
    // Top row near -1024, bottom row near 1024 (200 -> 224 enlarges, and skimage's linear
    // interpolation blends the outermost samples with its mid-grey padding by ~5%); no black
    // border columns survived the crop.
    let row = |y: usize| out[y * 224..(y + 1) * 224].iter().sum::<f32>() / 224.0;
    assert!(
        row(0) < -950.0 && row(223) > 950.0 && row(1) < -1000.0 && row(222) > 1000.0,
        "{} {}",
        row(0),
        row(223)
    );
    let col_min = (0..224)
        .map(|y| out[y * 224 + 112])
        .fold(f32::MAX, f32::min);
    assert!(
        (0..224).all(|y| (out[y * 224] - out[y * 224 + 223]).abs() < 1e-3),
        "crop is off-centre"
    );
    assert!(col_min >= -1024.0 && out.iter().all(|v| (-1024.0..=1024.0).contains(v)));
    // The resize keeps the mean of a symmetric ramp.
    let mean = out.iter().sum::<f32>() / out.len() as f32;
    assert!(mean.abs() < 5.0, "mean {mean}");
}
