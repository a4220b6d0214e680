//! Batch norm folded at load on the candle CNNs (DenseNet-121, ResNet-50, the ChestX-Det
//! PSPNet): the folded forward equals candle_nn's `BatchNorm` path (`forward_unfolded`) within
//! 1e-5 relative on the full-size networks with seeded weights whose running statistics are
//! far from 0/1, and runs fewer candle ops per forward (each op is a kernel launch on a GPU).
//!
//! The side-by-side timing on this machine's CPU is an ignored test:
//! `cargo test --release -p hilum-models --test it bn_folding::bench -- --ignored --nocapture`
//! (`HILUM_BENCH_ITERS`, default 5 per side).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Instant;

use candle_core::{DType, Device, Module, Result, Storage, Tensor, Var};
use candle_nn::VarBuilder;
use hilum_models::xrv::{self, Arch, Classifier, XrvSpec};
use hilum_models::{densenet, pspnet, resnet, weights, Backend};

/// Folded vs unfolded: max |a - b| over max |b|, which must stay below this.
const REL_TOL: f32 = 1e-5;
/// The f16 forward against the f32 one: max |a - b| over max |b| (measured 1.5e-3 on both
/// networks with seeded weights and inputs in [-1, 1]; f16 overflows past 65,504).
const F16_REL_TOL: f32 = 5e-3;

/// Seeded weights with running means of ±0.25 and variances spread over 0.37..2.7 (not 0/1,
/// so a fold that mixed up mean, variance or epsilon would show; 1/sqrt(var) averages about 1,
/// so activations stay in range through a hundred layers).
fn skewed_stats(mut w: HashMap<String, Tensor>) -> HashMap<String, Tensor> {
    for (name, t) in w.iter_mut() {
        if name.ends_with("running_mean") {
            *t = (&*t * 2.5).expect("mean");
        } else if name.ends_with("running_var") {
            // seeded gives 0.5..1.5; exp(2 (v - 1)) spreads it over 0.37..2.7.
            *t = ((&*t - 1.0).expect("var") * 2.0)
                .and_then(|v| v.exp())
                .expect("var");
        }
    }
    w
}

fn vb(w: HashMap<String, Tensor>) -> VarBuilder<'static> {
    VarBuilder::from_tensors(w, DType::F32, &Device::Cpu)
}

fn xrv_weights(arch: &Arch, seed: u64) -> HashMap<String, Tensor> {
    skewed_stats(xrv::synthetic_weights(arch, seed).expect("seeded weights"))
}

fn pspnet_weights(cfg: &pspnet::Config, seed: u64) -> HashMap<String, Tensor> {
    let params: BTreeMap<String, Vec<usize>> = pspnet::expected_params(cfg).expect("params");
    skewed_stats(weights::seeded(&params, seed))
}

/// A deterministic input with values in [-1, 1).
fn input(shape: (usize, usize, usize, usize)) -> Tensor {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let v: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).expect("input")
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("output")
}

/// Asserts folded ≈ unfolded within [`REL_TOL`] and that the output is not degenerate.
fn assert_close(what: &str, folded: &Tensor, unfolded: &Tensor) {
    let (a, b) = (flat(folded), flat(unfolded));
    assert_eq!(a.len(), b.len(), "{what}: output sizes differ");
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let (lo, hi) = b
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    assert!(
        scale.is_finite() && hi - lo > 1e-3 * scale,
        "{what}: degenerate output {lo}..{hi}"
    );
    let rel = diff / scale;
    println!("{what}: max |folded - unfolded| = {diff:.3e}, relative {rel:.3e}");
    assert!(
        rel <= REL_TOL,
        "{what}: folded vs unfolded relative {rel:.3e} > {REL_TOL:e}"
    );
}

#[test]
fn densenet121_folded_matches_batch_norm_path() {
    let arch = Arch::DenseNet(densenet::Config::densenet121_res224_all());
    let Arch::DenseNet(cfg) = &arch else {
        unreachable!()
    };
    let net = densenet::DenseNet::load(vb(xrv_weights(&arch, 5)), cfg).expect("load");
    let x = input((2, 1, 64, 64));
    let folded = net.forward(&x).expect("folded");
    assert_close(
        "densenet121 logits",
        &folded,
        &net.forward_unfolded(&x).expect("unfolded"),
    );
    // The CAM's feature map and the pooled features take the folded path too.
    let pooled = net
        .feature_map(&x)
        .and_then(|m| m.mean((2, 3)))
        .expect("map");
    assert_close(
        "densenet121 features",
        &pooled,
        &net.features(&x).expect("f"),
    );
}

#[test]
fn resnet50_folded_matches_batch_norm_path() {
    let arch = Arch::ResNet(resnet::Config::resnet50_res512_all());
    let Arch::ResNet(cfg) = &arch else {
        unreachable!()
    };
    let net = resnet::ResNet::load(vb(xrv_weights(&arch, 6)), cfg).expect("load");
    let x = input((2, 1, 96, 96));
    assert_close(
        "resnet50 logits",
        &net.forward(&x).expect("folded"),
        &net.forward_unfolded(&x).expect("unfolded"),
    );
}

#[test]
fn pspnet_folded_matches_batch_norm_path() {
    let cfg = pspnet::Config {
        input_size: 64,
        ..pspnet::Config::chestx_det()
    };
    let net = pspnet::PspNet::load(vb(pspnet_weights(&cfg, 8)), &cfg).expect("load");
    let x = input((1, 3, 64, 64));
    assert_close(
        "pspnet logits",
        &net.forward(&x).expect("folded"),
        &net.forward_unfolded(&x).expect("unfolded"),
    );
}

/// Candle ops per forward: the distinct buffers the ops that depend on the input write (a
/// view, reshape or broadcast writes none), plus the two ops candle_nn's `BatchNorm` runs on
/// `running_var` alone every call (`+ eps`, `sqrt`), `bn_weight_ops` of them.
fn candle_ops(
    forward: impl Fn(&Tensor) -> Result<Tensor>,
    x: &Tensor,
    bn_weight_ops: usize,
) -> usize {
    let var = Var::from_tensor(x).expect("var");
    let y = forward(var.as_tensor()).expect("forward");
    let mut buffers = HashSet::new();
    for node in y.sorted_nodes() {
        if node.is_variable() {
            continue;
        }
        let (storage, _) = node.storage_and_layout();
        let s: &Storage = &storage;
        buffers.insert(std::ptr::from_ref(s).addr());
    }
    buffers.len() + bn_weight_ops
}

fn batch_norms(w: &HashMap<String, Tensor>) -> usize {
    w.keys().filter(|k| k.ends_with("running_var")).count()
}

/// The folded forward runs at least 4 ops fewer per batch norm on DenseNet-121 (4 + 2 → a
/// mul + add, or the conv's bias add) and 5 fewer on ResNet-50 (every BN into its conv).
#[test]
fn folding_removes_ops_per_batch_norm() {
    let arch = Arch::DenseNet(densenet::Config::densenet121_res224_all());
    let Arch::DenseNet(cfg) = &arch else {
        unreachable!()
    };
    let w = xrv_weights(&arch, 5);
    let n_bn = batch_norms(&w);
    let net = densenet::DenseNet::load(vb(w), cfg).expect("load");
    let x = input((1, 1, 32, 32));
    let before = candle_ops(|x| net.forward_unfolded(x), &x, 2 * n_bn);
    let after = candle_ops(|x| net.forward(x), &x, 0);
    println!("densenet121: {n_bn} batch norms, candle ops per forward {before} → {after}");
    assert!(
        after + 4 * n_bn <= before,
        "densenet121: {before} → {after} ops"
    );

    let arch = Arch::ResNet(resnet::Config::resnet50_res512_all());
    let Arch::ResNet(cfg) = &arch else {
        unreachable!()
    };
    let w = xrv_weights(&arch, 6);
    let n_bn = batch_norms(&w);
    let net = resnet::ResNet::load(vb(w), cfg).expect("load");
    let x = input((1, 1, 64, 64));
    let before = candle_ops(|x| net.forward_unfolded(x), &x, 2 * n_bn);
    let after = candle_ops(|x| net.forward(x), &x, 0);
    println!("resnet50: {n_bn} batch norms, candle ops per forward {before} → {after}");
    assert_eq!(before - after, 5 * n_bn, "resnet50: {before} → {after} ops");
}

/// Half precision (opt-in) against the f32 folded forward: max |f16 - f32| / max |f32| of
/// the logits.
fn f16_rel_diff(f32_net: &dyn Module, f16_net: &dyn Module, x: &Tensor) -> f32 {
    let (a, b) = (
        flat(&f16_net.forward(x).expect("f16")),
        flat(&f32_net.forward(x).expect("f32")),
    );
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// The f16 forward (weights and activations in f16, logits back in f32) stays within
/// [`F16_REL_TOL`] of f32 on DenseNet-121 and ResNet-50 with seeded weights; bf16 is refused
/// with the reason.
#[test]
fn f16_forward_within_its_tolerance_and_bf16_refused() {
    let arch = Arch::DenseNet(densenet::Config::densenet121_res224_all());
    let Arch::DenseNet(cfg) = &arch else {
        unreachable!()
    };
    let w = xrv::synthetic_weights(&arch, 9).expect("weights");
    let net = densenet::DenseNet::load(vb(w), cfg).expect("load");
    let half = net.to_dtype(DType::F16).expect("f16");
    assert_eq!(half.dtype(), DType::F16);
    let x = input((2, 1, 64, 64));
    let logits = half.forward(&x).expect("f16 forward");
    assert_eq!(logits.dtype(), DType::F32, "logits come back in f32");
    let map = half.feature_map(&x).expect("f16 map");
    assert_eq!(
        map.dtype(),
        DType::F32,
        "the CAM's feature map comes back in f32"
    );
    let rel = f16_rel_diff(&net, &half, &x);
    println!("densenet121 f16 vs f32: relative {rel:.3e}");
    assert!(rel <= F16_REL_TOL, "densenet121 f16: {rel:.3e}");
    let err = net.to_dtype(DType::BF16).expect_err("bf16 is refused");
    assert!(err.to_string().contains("f16"), "{err}");

    let arch = Arch::ResNet(resnet::Config::resnet50_res512_all());
    let Arch::ResNet(cfg) = &arch else {
        unreachable!()
    };
    let w = xrv::synthetic_weights(&arch, 9).expect("weights");
    let net = resnet::ResNet::load(vb(w), cfg).expect("load");
    let half = net.to_dtype(DType::F16).expect("f16");
    let rel = f16_rel_diff(&net, &half, &input((2, 1, 64, 64)));
    println!("resnet50 f16 vs f32: relative {rel:.3e}");
    assert!(rel <= F16_REL_TOL, "resnet50 f16: {rel:.3e}");
}

/// `Classifier::candle_with_dtype(.., F16)`: the classifier's logits and its CAM within
/// [`F16_REL_TOL`] of the f32 candle classifier on the same seeded weights.
#[test]
fn classifier_f16_option_matches_f32() {
    let spec = XrvSpec {
        resolution: 64,
        ..XrvSpec::densenet121_res224_all()
    };
    let w = xrv::synthetic_weights(&spec.arch, 4).expect("weights");
    let full = Classifier::new(vb(w.clone()), spec.clone(), Backend::Candle, 1).expect("f32");
    let half = Classifier::candle_with_dtype(vb(w.clone()), spec.clone(), DType::F16).expect("f16");
    assert_eq!(half.backend(), Backend::Candle);
    let x = flat(&input((2, 1, 64, 64)));
    let rel = |a: &[f32], b: &[f32]| {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        d / scale
    };
    let (a, b) = (
        half.logits(&x, 2).expect("f16"),
        full.logits(&x, 2).expect("f32"),
    );
    let r = rel(&a, &b);
    println!("classifier f16 vs f32 logits: relative {r:.3e}");
    assert!(r <= F16_REL_TOL, "classifier f16 logits: {r:.3e}");
    let one = &x[..64 * 64];
    let (ca, cb) = (
        half.class_activation(one, 3).expect("f16 cam"),
        full.class_activation(one, 3).expect("f32 cam"),
    );
    let r = rel(&ca.values, &cb.values);
    println!("classifier f16 vs f32 CAM: relative {r:.3e}");
    assert!(r <= F16_REL_TOL, "classifier f16 CAM: {r:.3e}");
    let err = Classifier::candle_with_dtype(vb(w), spec, DType::BF16).err();
    assert!(err.is_some(), "bf16 is refused");
}

fn median_ms(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Folded vs unfolded candle forwards on the CPU, alternating on the same weights and input:
/// DenseNet-121 at 224 px and ResNet-50 at 512 px, batch 1.
#[test]
#[ignore = "benchmark: run with --release -- --ignored --nocapture"]
fn bench() {
    let iters: usize = std::env::var("HILUM_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let dense = densenet::Config::densenet121_res224_all();
    let res = resnet::Config::resnet50_res512_all();
    let d = densenet::DenseNet::load(vb(xrv_weights(&Arch::DenseNet(dense.clone()), 7)), &dense)
        .expect("densenet");
    let r =
        resnet::ResNet::load(vb(xrv_weights(&Arch::ResNet(res.clone()), 7)), &res).expect("resnet");
    type Fwd<'a> = Box<dyn Fn(&Tensor) -> Result<Tensor> + 'a>;
    let cases: [(&str, Tensor, Fwd, Fwd); 2] = [
        (
            "densenet121 224px b1",
            input((1, 1, 224, 224)),
            Box::new(|x| d.forward(x)),
            Box::new(|x| d.forward_unfolded(x)),
        ),
        (
            "resnet50 512px b1",
            input((1, 1, 512, 512)),
            Box::new(|x| r.forward(x)),
            Box::new(|x| r.forward_unfolded(x)),
        ),
    ];
    for (name, x, folded, unfolded) in &cases {
        folded(x).and_then(|_| unfolded(x)).expect("warm-up");
        let (mut f, mut u) = (Vec::new(), Vec::new());
        for _ in 0..iters {
            for (fwd, out) in [(folded, &mut f), (unfolded, &mut u)] {
                let t = Instant::now();
                fwd(x).expect("forward");
                out.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let (fm, um) = (median_ms(&mut f), median_ms(&mut u));
        println!(
            "{name}: unfolded {um:.1} ms, folded {fm:.1} ms (median of {iters}), \
             folded/unfolded {:.3}",
            fm / um
        );
    }
}
