//! The MedSAM (SAM ViT) image encoder's ONNX graph, written by Hilum from the weights, on ONNX
//! Runtime: the seeded small configuration against segment-anything's own embedding (fixture
//! from scripts/fixtures/make_medsam_fixtures.py) and against candle; ViT-B's full width (768 channels,
//! 12 heads, 14-px windows padded) at a smaller image against candle; a free batch; and
//! `export-triton` writing the graph for `medsam-vit-b`.
//!
//! Needs ORT_DYLIB_PATH (scripts/setup_onnxruntime.sh prints it); without it the tests say so
//! and pass without checking anything.

use std::path::PathBuf;

use candle_core::Tensor;
use hilum_models::onnx::OnnxModel;
use hilum_models::onnx_graph::{graph_io, INPUT};
use hilum_models::sam::{self, Config, Sam, ONNX_EMBEDDINGS};
use hilum_models::Device;

use crate::common::{export_one, ort_ready};

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/medsam");
    assert!(p.is_dir(), "{} missing", p.display());
    p
}

fn small_config() -> Config {
    serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sam_small_config.json")).expect("config"),
    )
    .expect("config parses")
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_vec1())
        .expect("f32 values")
}

/// Largest difference relative to the larger magnitude of `want` (at least 1).
fn rel_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

/// A (b, 3, s, s) input with structure (not constant per channel).
fn image(batch: usize, s: usize) -> Vec<f32> {
    (0..batch * 3 * s * s)
        .map(|i| {
            let (y, x) = ((i / s) % s, i % s);
            (((x * 7 + y * 13 + i / (s * s) * 5) % 17) as f32 / 16.0).powf(1.5)
        })
        .collect()
}

/// candle's embeddings of a batch.
fn by_candle(model: &Sam, input: &[f32], batch: usize) -> Vec<f32> {
    let s = model.config().image_size;
    let x = Tensor::from_slice(input, (batch, 3, s, s), model.device()).expect("input");
    flat(&model.embed_image(&x).expect("candle"))
}

/// The model's graph on ONNX Runtime and candle on one batch: (ONNX Runtime's values, candle's,
/// ONNX Runtime's output shape).
fn run_both(model: &Sam, input: &[f32], batch: usize) -> (Vec<f32>, Vec<f32>, Vec<usize>) {
    let s = model.config().image_size;
    let graph = model.encoder_onnx().expect("graph");
    let ort = OnnxModel::from_memory(&graph, "sam encoder", 2, Device::Cpu).expect("ORT loads");
    let (shape, got) = ort.run(&[batch, 3, s, s], input).expect("ORT run");
    (got, by_candle(model, input, batch), shape)
}

#[test]
fn small_sam_encoder_graph_matches_segment_anything_and_candle() {
    if !ort_ready() {
        return;
    }
    let cfg = small_config();
    let dir = fixtures();
    let model = sam::load_file(&dir.join("sam_small.safetensors"), &cfg, Device::Cpu)
        .expect("small weights load");
    let io = candle_core::safetensors::load(
        dir.join("sam_small_io.safetensors"),
        &candle_core::Device::Cpu,
    )
    .expect("io fixture");
    let input = flat(&io["image"]);
    let (got, by_candle, shape) = run_both(&model, &input, 1);
    let g = cfg.grid();
    assert_eq!(shape, vec![1, cfg.prompt_embed_dim, g, g]);
    let reference = flat(&io["embedding"]);
    let (d_ref, d_candle) = (rel_diff(&got, &reference), rel_diff(&got, &by_candle));
    eprintln!(
        "small SAM encoder ({g}x{g} grid, window {} padded): ONNX Runtime vs segment-anything \
         {d_ref:.2e}, vs candle {d_candle:.2e} (relative)",
        cfg.window_size
    );
    assert!(d_ref < 1e-4 && d_candle < 1e-5, "{d_ref} {d_candle}");
}

/// ViT-B's width, heads and window at 256 px (a 16 x 16 grid, so the 14-px windows are padded
/// to 28), one windowed and one global block, seeded weights.
#[test]
fn vit_b_width_encoder_graph_matches_candle_with_a_free_batch() {
    if !ort_ready() {
        return;
    }
    let cfg = Config {
        image_size: 256,
        encoder_depth: 2,
        global_attn_indexes: vec![1],
        ..Config::vit_b()
    };
    let model = sam::random(&cfg, 5, Device::Cpu).expect("seeded ViT-B slice");
    let graph = model.encoder_onnx().expect("graph");
    let io = graph_io(&graph).expect("parses");
    assert_eq!(io.inputs.len(), 1);
    assert_eq!(io.inputs[0].name, INPUT);
    assert_eq!(io.inputs[0].dims, vec![None, Some(3), Some(256), Some(256)]);
    assert_eq!(io.outputs[0].name, ONNX_EMBEDDINGS);
    assert_eq!(
        io.outputs[0].dims,
        vec![None, Some(256), Some(16), Some(16)]
    );

    let input = image(2, 256);
    let (got, want, shape) = run_both(&model, &input, 2);
    assert_eq!(shape, vec![2, 256, 16, 16]);
    let d = rel_diff(&got, &want);
    let half = got.len() / 2;
    let apart = rel_diff(&got[..half], &got[half..]);
    eprintln!("ViT-B width, 256 px, batch 2: ONNX Runtime vs candle {d:.2e} (relative); the two images' embeddings differ by {apart:.2e}");
    assert!(d < 1e-4, "{d}");
    assert!(apart > 1e-2, "the batch's images gave the same embedding");
}

#[test]
fn export_triton_writes_the_medsam_encoder() {
    if !ort_ready() {
        return;
    }
    let cfg = small_config();
    let weights = fixtures().join("sam_small.safetensors");
    let want = [
        "name: \"x\"",
        "dims: [ 3, 128, 128 ]",
        "name: \"embeddings\"",
        "dims: [ 32, 8, 8 ]",
    ];
    let (_dir, served) = export_one("medsam-vit-b", &cfg, &weights, &want);
    let model = sam::load_file(&weights, &cfg, Device::Cpu).expect("load");
    let input = image(1, 128);
    let (_, got) = served.run(&[1, 3, 128, 128], &input).expect("run");
    let d = rel_diff(&got, &by_candle(&model, &input, 1));
    assert!(d < 1e-5, "exported graph differs by {d}");
}

/// Full-size ViT-B (seeded) at 1024 px: ONNX Runtime vs candle, agreement and time, the two
/// alternated twice on the same input (`HILUM_CPU_THREADS` threads for ONNX Runtime, candle's
/// pool of all cores). Minutes and ~6 GB on a 2-core machine, so run on request:
/// `cargo test --release -p hilum-models --test it medsam_onnx::full -- --ignored --nocapture`
#[test]
#[ignore]
fn full_vit_b_encoder_graph_matches_candle() {
    if !ort_ready() {
        return;
    }
    let cfg = Config::vit_b();
    let model = sam::random(&cfg, 9, Device::Cpu).expect("seeded ViT-B");
    let graph = model.encoder_onnx().expect("graph");
    let threads = std::env::var("HILUM_CPU_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let ort = OnnxModel::from_memory(&graph, "ViT-B encoder", threads, Device::Cpu).expect("ORT");
    let input = image(1, 1024);
    let x = Tensor::from_slice(&input, (1, 3, 1024, 1024), model.device()).expect("input");
    let (mut t_ort, mut t_candle) = (Vec::new(), Vec::new());
    let (mut got, mut want) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let t = std::time::Instant::now();
        got = ort.run(&[1, 3, 1024, 1024], &input).expect("ORT run").1;
        t_ort.push(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        want = flat(&model.embed_image(&x).expect("candle"));
        t_candle.push(t.elapsed().as_secs_f64());
    }
    let d = rel_diff(&got, &want);
    eprintln!(
        "ViT-B 1024 px ({} MB graph): ONNX Runtime vs candle {d:.2e} (relative); seconds ONNX \
         Runtime {t_ort:.2?} ({threads} threads), candle {t_candle:.2?}",
        graph.len() >> 20
    );
    assert!(d < 1e-4, "{d}");
}
