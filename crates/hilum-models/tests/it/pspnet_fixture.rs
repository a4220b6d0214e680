//! ChestX-Det PSPNet against torchxrayvision's reference blocks (fixtures from
//! scripts/fixtures/make_anatomy_fixtures.py): seeded small configuration to 1e-4, and the full-size
//! published parameter names and shapes one to one.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use candle_core::{Device, Module};
use hilum_models::pspnet::{self, AnatomySegmenter, Config};
use hilum_models::Backend;

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/anatomy");
    assert!(
        p.is_dir(),
        "{} missing: run scripts/fixtures/make_anatomy_fixtures.py",
        p.display()
    );
    p
}

/// The small seeded PSPNet's configuration and its reference input/logits.
fn small_config_and_io() -> (Config, HashMap<String, candle_core::Tensor>) {
    let dir = fixtures();
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("pspnet_small_config.json")).expect("config"),
    )
    .expect("config parses");
    let io = candle_core::safetensors::load(dir.join("pspnet_small_io.safetensors"), &Device::Cpu)
        .expect("io fixture");
    (cfg, io)
}

/// The small seeded PSPNet on `backend`, 2 native threads.
fn small_model(cfg: &Config, backend: Backend) -> AnatomySegmenter {
    pspnet::load_file(
        &fixtures().join("pspnet_small.safetensors"),
        cfg,
        hilum_models::Device::Cpu,
        backend,
        2,
    )
    .expect("small weights load")
}

#[test]
fn small_pspnet_matches_reference_logits() {
    let (cfg, io) = small_config_and_io();
    let vb = hilum_models::weights::var_builder(
        &fixtures().join("pspnet_small.safetensors"),
        hilum_models::Device::Cpu,
    )
    .expect("weights");
    let model = pspnet::PspNet::load(vb, &cfg).expect("small weights load");
    let y = model.forward(&io["input"]).expect("forward");
    assert_eq!(y.dims(), io["logits"].dims());
    let diff: f32 = (y - &io["logits"])
        .expect("sub")
        .abs()
        .expect("abs")
        .max_all()
        .expect("max")
        .to_scalar()
        .expect("scalar");
    let scale: f32 = io["logits"]
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap();
    println!("max abs diff {diff:e} (logits up to {scale})");
    assert!(diff < 1e-4, "max abs diff {diff}");
}

/// The native CPU kernels (dilated gathers, pyramid pooling, bilinear resizes) on the same
/// fixture, and the default `probabilities` path, which runs them on the CPU.
#[test]
fn small_pspnet_native_matches_reference_logits() {
    let (cfg, io) = small_config_and_io();
    let model = small_model(&cfg, Backend::default_for(hilum_models::Device::Cpu));
    let input = io["input"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want = io["logits"]
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let native = model
        .native()
        .expect("the CPU default runs the native plan");
    let got = native.forward(&input, 1).expect("native forward");
    assert_eq!(got.len(), want.len());
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    println!("native: max abs diff {diff:e}");
    assert!(diff < 1e-4, "native max abs diff {diff}");

    assert_eq!(model.backend(), Backend::Native);
    let probs = model.probabilities(&input).expect("probabilities");
    let hw = cfg.input_size * cfg.input_size;
    assert_eq!(probs.len(), cfg.n_classes);
    let worst = probs
        .iter()
        .flatten()
        .zip(&want)
        .map(|(p, l)| (p - 1.0 / (1.0 + (-l).exp())).abs())
        .fold(0f32, f32::max);
    assert!(worst < 1e-5, "probabilities differ by {worst}");
    assert!(probs.iter().all(|m| m.len() == hw));

    // Batch of two (second image flipped) equals two single runs.
    let flipped: Vec<f32> = input.iter().rev().copied().collect();
    let both = native
        .forward(&[input.clone(), flipped.clone()].concat(), 2)
        .expect("batch");
    let second = native.forward(&flipped, 1).expect("single");
    let n = want.len();
    let d0 = both[..n]
        .iter()
        .zip(&got)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let d1 = both[n..]
        .iter()
        .zip(&second)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d0 < 1e-5 && d1 < 1e-5, "batch differs: {d0} {d1}");
}

#[test]
fn full_size_parameters_match_the_published_checkpoint() {
    let json: BTreeMap<String, Vec<usize>> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("pspnet_full_params.json")).expect("list"),
    )
    .expect("list parses");
    // The checkpoint also holds BN counters and the training-only auxiliary head.
    let published: BTreeMap<String, Vec<usize>> = json
        .into_iter()
        .filter(|(k, _)| {
            !k.ends_with("num_batches_tracked")
                && !k.starts_with("convbnrelu4_aux.")
                && !k.starts_with("aux_cls.")
        })
        .collect();
    let ours = pspnet::expected_params(&Config::chestx_det()).expect("names");
    hilum_models::weights::compare(&published, &ours).unwrap_or_else(|e| panic!("{e}"));
    println!("{} parameters match", published.len());
    assert!(published.len() > 500);
}

/// Full-size forward at 512 px, native kernels then candle's CPU ops (random weights; only the
/// time matters). Slow (about a minute for candle):
/// `cargo test -p hilum-models --release --test it pspnet_fixture:: -- --ignored --nocapture`
/// (`HILUM_CPU_THREADS` sets the native threads).
#[test]
#[ignore]
fn full_size_forward_time() {
    let cfg = Config::chestx_det();
    let map = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&map, candle_core::DType::F32, &Device::Cpu);
    let threads = std::env::var("HILUM_CPU_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let x = vec![0.1f32; 3 * cfg.input_size * cfg.input_size];
    let t = std::time::Instant::now();
    let native =
        AnatomySegmenter::new(vb.clone(), &cfg, Backend::Native, threads).expect("native plan");
    println!(
        "PSPNet native plan (fold weights): {:.1} s",
        t.elapsed().as_secs_f64()
    );
    let mut native_s = f64::MAX;
    for _ in 0..2 {
        let t = std::time::Instant::now();
        let p = native.probabilities(&x).expect("native forward");
        native_s = native_s.min(t.elapsed().as_secs_f64());
        assert_eq!(p.len(), 14);
    }
    let candle =
        AnatomySegmenter::new(vb, &cfg, Backend::Candle, threads).expect("full-size model");
    let t = std::time::Instant::now();
    let p = candle.probabilities(&x).expect("forward");
    let candle_s = t.elapsed().as_secs_f64();
    println!(
        "PSPNet 512 px forward on CPU: native {native_s:.2} s (best of 2), candle {candle_s:.1} s, \
         ratio {:.1}x",
        candle_s / native_s
    );
    assert_eq!(p.len(), 14);
    assert_eq!(p[0].len(), cfg.input_size * cfg.input_size);
}
