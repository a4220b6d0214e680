//! ChestX-Det PSPNet against torchxrayvision's reference blocks (fixtures from
//! scripts/make_anatomy_fixtures.py): seeded small configuration to 1e-4, and the full-size
//! published parameter names and shapes one to one.

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::Device;
use hilum_models::pspnet::{self, Config};

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/anatomy");
    assert!(
        p.is_dir(),
        "{} missing: run scripts/make_anatomy_fixtures.py",
        p.display()
    );
    p
}

#[test]
fn small_pspnet_matches_reference_logits() {
    let dir = fixtures();
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("pspnet_small_config.json")).expect("config"),
    )
    .expect("config parses");
    let model = pspnet::load_file(
        &dir.join("pspnet_small.safetensors"),
        &cfg,
        hilum_models::Device::Cpu,
    )
    .expect("small weights load");
    let io = candle_core::safetensors::load(dir.join("pspnet_small_io.safetensors"), &Device::Cpu)
        .expect("io fixture");
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
    let only_ref: Vec<_> = published
        .keys()
        .filter(|k| !ours.contains_key(*k))
        .collect();
    let only_ours: Vec<_> = ours
        .keys()
        .filter(|k| !published.contains_key(*k))
        .collect();
    assert!(
        only_ref.is_empty() && only_ours.is_empty(),
        "missing {only_ref:?}, extra {only_ours:?}"
    );
    for (k, shape) in &published {
        assert_eq!(&ours[k], shape, "{k}");
    }
    println!("{} parameters match", published.len());
    assert!(published.len() > 500);
}

/// Full-size forward at 512 px on candle's CPU ops (random weights; only the time matters).
/// Slow (tens of seconds): `cargo test -p hilum-models --release --test pspnet_fixture -- --ignored --nocapture`
#[test]
#[ignore]
fn full_size_forward_time() {
    let cfg = Config::chestx_det();
    let map = candle_nn::VarMap::new();
    let vb = candle_nn::VarBuilder::from_varmap(&map, candle_core::DType::F32, &Device::Cpu);
    let model = pspnet::PspNet::load(vb, &cfg).expect("full-size model");
    let x = vec![0.1f32; 3 * cfg.input_size * cfg.input_size];
    let t = std::time::Instant::now();
    let p = model.probabilities(&x).expect("forward");
    println!(
        "PSPNet 512 px forward on candle CPU: {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(p.len(), 14);
    assert_eq!(p[0].len(), cfg.input_size * cfg.input_size);
}
