//! The ChestX-Det PSPNet's ONNX graph (written by Hilum from the weights) on ONNX Runtime gives
//! the probabilities of the native engine and of candle to 1e-5: the small seeded fixture
//! network at 96 px, and the full-size ChestX-Det configuration with seeded weights at 128 px.
//!
//! Needs ORT_DYLIB_PATH (scripts/setup_onnxruntime.sh prints it); without it the tests say so
//! and pass without checking anything.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::Tensor;
use hilum_models::onnx::OnnxModel;
use hilum_models::onnx_graph::{graph_io, INPUT};
use hilum_models::pspnet::{self, AnatomySegmenter, Config, PspNet, ONNX_OUTPUT};
use hilum_models::{Backend, Device};

use crate::common::{export_one, ort_ready};

/// Tighter than the 1e-4 asked for: the probabilities here stay near 0.5, where sampling the
/// pyramid's resizes with align_corners=True instead moves them by only ~2e-4.
const TOL: f32 = 1e-5;

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/anatomy");
    assert!(p.is_dir(), "{} missing", p.display());
    p
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0f32, f32::max)
}

/// Share of probabilities strictly between 0.05 and 0.95, printed with their range: the
/// comparison is made neither on saturated outputs only nor on a flat map.
fn unsaturated(p: &[Vec<f32>]) -> f32 {
    let n = p.iter().map(Vec::len).sum::<usize>() as f32;
    let (lo, hi) = p
        .iter()
        .flatten()
        .fold((1f32, 0f32), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    let share = p
        .iter()
        .flatten()
        .filter(|v| **v > 0.05 && **v < 0.95)
        .count() as f32
        / n;
    eprintln!(
        "probabilities from {lo:.4} to {hi:.4}, {:.0}% in (0.05, 0.95)",
        100.0 * share
    );
    assert!(hi - lo > 0.05, "flat output: {lo} to {hi}");
    share
}

fn small() -> (Config, Vec<f32>, PathBuf) {
    let dir = fixtures();
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("pspnet_small_config.json")).expect("config"),
    )
    .expect("config parses");
    let io = candle_core::safetensors::load(
        dir.join("pspnet_small_io.safetensors"),
        &candle_core::Device::Cpu,
    )
    .expect("io fixture");
    let input = io["input"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    (cfg, input, dir.join("pspnet_small.safetensors"))
}

#[test]
fn small_pspnet_onnx_runtime_matches_native_and_candle() {
    if !ort_ready() {
        return;
    }
    let (cfg, input, weights) = small();
    let load = |b| pspnet::load_file(&weights, &cfg, Device::Cpu, b, 2).expect("load");
    let (native, candle, ort) = (
        load(Backend::Native),
        load(Backend::Candle),
        load(Backend::Onnx),
    );
    assert_eq!(ort.backend(), Backend::Onnx);
    let want = native.probabilities(&input).expect("native");
    let got = ort.probabilities(&input).expect("onnx runtime");
    let by_candle = candle.probabilities(&input).expect("candle");
    let (d_native, d_candle) = (max_diff(&got, &want), max_diff(&got, &by_candle));
    let u = unsaturated(&want);
    eprintln!(
        "small PSPNet, 96 px: ONNX Runtime vs native max abs diff {d_native:.2e}, vs candle \
         {d_candle:.2e} ({:.0}% of probabilities in (0.05, 0.95))",
        100.0 * u
    );
    assert!(d_native <= TOL && d_candle <= TOL, "{d_native} {d_candle}");
    assert!(u > 0.1, "outputs mostly saturated: {u}");
}

/// The graph as written: one free batch dimension, and a batch of two equals two single runs.
#[test]
fn small_pspnet_graph_has_a_free_batch() {
    if !ort_ready() {
        return;
    }
    let (cfg, input, weights) = small();
    let vb = hilum_models::weights::var_builder(&weights, Device::Cpu).expect("weights");
    let graph = PspNet::load(vb, &cfg)
        .expect("load")
        .to_onnx(cfg.input_size)
        .expect("graph");
    let io = graph_io(&graph).expect("parses");
    let s = Some(cfg.input_size);
    assert_eq!(io.inputs.len(), 1);
    assert_eq!(io.inputs[0].name, INPUT);
    assert_eq!(io.inputs[0].dims, vec![None, Some(3), s, s]);
    assert_eq!(io.outputs[0].name, ONNX_OUTPUT);
    assert_eq!(io.outputs[0].dims, vec![None, Some(cfg.n_classes), s, s]);

    let model = OnnxModel::from_memory(&graph, "small pspnet", 2, Device::Cpu).expect("ORT loads");
    let n = input.len();
    let flipped: Vec<f32> = input.iter().rev().copied().collect();
    let (shape, both) = model
        .run(
            &[2, 3, cfg.input_size, cfg.input_size],
            &[input.clone(), flipped.clone()].concat(),
        )
        .expect("batch of two");
    assert_eq!(
        shape,
        vec![2, cfg.n_classes, cfg.input_size, cfg.input_size]
    );
    let one = |x: &[f32]| {
        model
            .run(&[1, 3, cfg.input_size, cfg.input_size], x)
            .expect("run")
            .1
    };
    let m = both.len() / 2;
    let d = max_diff(
        &[both[..m].to_vec(), both[m..].to_vec()],
        &[one(&input), one(&flipped)],
    );
    assert!(d <= 1e-6, "batch differs by {d}");
    assert_eq!(m, n / 3 * cfg.n_classes);
}

/// Seeded weights for every parameter of `cfg` (xorshift, fixed seed), scaled so activations
/// stay moderate through the 33 bottlenecks.
fn seeded_weights(cfg: &Config) -> HashMap<String, Tensor> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut uniform = move |lo: f32, hi: f32| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        lo + (hi - lo) * ((state >> 40) as f32 / (1u64 << 24) as f32)
    };
    pspnet::expected_params(cfg)
        .expect("names")
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let (lo, hi) = if shape.len() == 4 {
                let fan_in: usize = shape[1..].iter().product();
                let a = (3.0 / fan_in as f32).sqrt();
                // A wide classifier spreads the logits over several units.
                let a = if name.starts_with("classification") {
                    8.0 * a
                } else {
                    a
                };
                (-a, a)
            } else if name.ends_with("running_var") {
                (0.5, 1.5)
            } else if name.ends_with("running_mean") || name.ends_with("bias") {
                (-0.1, 0.1)
            } else {
                // BN scales: small, so the residual sums do not blow up.
                (0.1, 0.5)
            };
            let values: Vec<f32> = (0..n).map(|_| uniform(lo, hi)).collect();
            let t = Tensor::from_vec(values, shape, &candle_core::Device::Cpu).expect("tensor");
            (name, t)
        })
        .collect()
}

#[test]
fn full_size_pspnet_onnx_runtime_matches_native() {
    // 128 px keeps the test quick on two cores; the graph is the same but for the sizes.
    full_size_at(128);
}

/// At the published 512 px (slow on two cores: `-- --ignored`).
#[test]
#[ignore]
fn full_size_pspnet_onnx_runtime_matches_native_at_512() {
    full_size_at(512);
}

fn full_size_at(size: usize) {
    if !ort_ready() {
        return;
    }
    let mut cfg = Config::chestx_det();
    cfg.input_size = size;
    let weights = seeded_weights(&cfg);
    let vb = || {
        candle_nn::VarBuilder::from_tensors(
            weights.clone(),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
    };
    let native = AnatomySegmenter::new(vb(), &cfg, Backend::Native, 2).expect("native");
    let ort = AnatomySegmenter::new(vb(), &cfg, Backend::Onnx, 2).expect("ORT loads the graph");
    // A radiograph-like input: a smooth gradient with a bright blob, ImageNet-normalised range.
    let s = cfg.input_size;
    let input: Vec<f32> = (0..3 * s * s)
        .map(|i| {
            let (y, x) = ((i / s) % s, i % s);
            let (dy, dx) = (y as f32 - 0.4 * s as f32, x as f32 - 0.6 * s as f32);
            -1.5 + 2.0 * (x as f32 / s as f32) + 1.5 * (-(dx * dx + dy * dy) / 200.0).exp()
        })
        .collect();
    let want = native.probabilities(&input).expect("native");
    let got = ort.probabilities(&input).expect("onnx runtime");
    let d = max_diff(&got, &want);
    let u = unsaturated(&want);
    eprintln!(
        "full-size PSPNet, seeded, {size} px: ONNX Runtime vs native max abs diff {d:.2e} ({:.0}% \
         of probabilities in (0.05, 0.95))",
        100.0 * u
    );
    assert!(d <= TOL, "max abs diff {d}");
    assert!(u > 0.1, "outputs mostly saturated: {u}");
}

/// `export-triton` writes the PSPNet's graph for a site's configuration (here the small
/// network as `chestx-det-pspnet`): config.pbtxt with the graph's tensors and dynamic batching,
/// and a model.onnx that ONNX Runtime runs to the native probabilities.
#[test]
fn export_triton_writes_the_pspnet_graph() {
    if !ort_ready() {
        return;
    }
    let (cfg, input, weights) = small();
    let want = [
        "name: \"x\"",
        "dims: [ 3, 96, 96 ]",
        "name: \"probabilities\"",
        "dims: [ 14, 96, 96 ]",
    ];
    let (_dir, served) = export_one("chestx-det-pspnet", &cfg, &weights, &want);
    let s = cfg.input_size;
    let (_, got) = served.run(&[1, 3, s, s], &input).expect("run");
    let native = pspnet::load_file(&weights, &cfg, Device::Cpu, Backend::Native, 2)
        .expect("native")
        .probabilities(&input)
        .expect("native run")
        .concat();
    let d = max_diff(&[got], &[native]);
    assert!(d <= TOL, "exported graph differs by {d}");
}

/// A KServe v2 server (JSON tensors only, like a server without the binary extension) that
/// serves `graph` as `name` on ONNX Runtime; returns its URL.
fn kserve_mock(name: &'static str, graph: Vec<u8>, size: usize, classes: usize) -> String {
    use axum::routing::{get, post};
    use axum::Json;
    use serde_json::{json, Value};
    use std::sync::Arc;

    let model = Arc::new(OnnxModel::from_memory(&graph, name, 2, Device::Cpu).expect("ORT"));
    let (s, c) = (size as i64, classes as i64);
    let meta = json!({
        "name": name,
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": INPUT, "datatype": "FP32", "shape": [-1, 3, s, s]}],
        "outputs": [{"name": ONNX_OUTPUT, "datatype": "FP32", "shape": [-1, c, s, s]}],
    });
    let infer = move |Json(req): Json<Value>| {
        let model = model.clone();
        async move {
            let input = &req["inputs"][0];
            let shape: Vec<usize> = input["shape"]
                .as_array()
                .expect("shape")
                .iter()
                .map(|d| d.as_u64().expect("dim") as usize)
                .collect();
            let data: Vec<f32> = input["data"]
                .as_array()
                .expect("data")
                .iter()
                .map(|v| v.as_f64().expect("number") as f32)
                .collect();
            let (out_shape, values) = model.run(&shape, &data).expect("run");
            Json(json!({"outputs": [{
                "name": ONNX_OUTPUT, "datatype": "FP32", "shape": out_shape, "data": values,
            }]}))
        }
    };
    let app = axum::Router::new()
        .route("/v2/health/ready", get(|| async { "" }))
        .route(
            &format!("/v2/models/{name}"),
            get(move || async move { Json(meta) }),
        )
        .route(&format!("/v2/models/{name}/ready"), get(|| async { "" }))
        .route(&format!("/v2/models/{name}/infer"), post(infer));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr")).expect("send");
            let _ = axum::serve(listener, app).await;
        });
    });
    format!("http://{}", rx.recv().expect("address"))
}

/// `--backend kserve`: the PSPNet's graph served by a KServe v2 server gives the native
/// probabilities through `AnatomySegmenter::kserve`.
#[test]
fn kserve_backend_runs_the_served_pspnet_graph() {
    if !ort_ready() {
        return;
    }
    let (cfg, input, weights) = small();
    let vb = hilum_models::weights::var_builder(&weights, Device::Cpu).expect("weights");
    let graph = PspNet::load(vb, &cfg)
        .expect("load")
        .to_onnx(cfg.input_size)
        .expect("graph");
    let url = kserve_mock("chestx-det-pspnet", graph, cfg.input_size, cfg.n_classes);
    let settings = hilum_models::KserveSettings::new(url);
    let remote = AnatomySegmenter::kserve("chestx-det-pspnet", &cfg, &settings).expect("connect");
    assert_eq!(remote.backend(), Backend::Kserve);
    let got = remote.probabilities(&input).expect("remote run");
    let want = pspnet::load_file(&weights, &cfg, Device::Cpu, Backend::Native, 2)
        .expect("native")
        .probabilities(&input)
        .expect("native run");
    let d = max_diff(&got, &want);
    eprintln!("served PSPNet graph vs native max abs diff {d:.2e}");
    assert!(d <= TOL, "served graph differs by {d}");
    // A server whose model declares other shapes is refused at connection.
    let mut other = cfg.clone();
    other.input_size += 8;
    let err = AnatomySegmenter::kserve("chestx-det-pspnet", &other, &settings)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("[-1, 3, 96, 96]"), "{err}");
}
