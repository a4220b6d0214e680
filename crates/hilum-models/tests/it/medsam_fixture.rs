//! SAM / MedSAM against facebookresearch/segment-anything (fixtures from
//! scripts/fixtures/make_medsam_fixtures.py): a seeded small configuration to 1e-4 for the image
//! embedding, the prompt embeddings, every mask token's low-res logits and the IoU predictions,
//! and the full-size ViT-B parameter names and shapes one to one.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use candle_core::{Device, Tensor};
use hilum_models::sam::{self, Config, Prompt};
use serde_json::Value;

fn fixtures() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/medsam");
    assert!(
        p.is_dir(),
        "{} missing: run scripts/fixtures/make_medsam_fixtures.py",
        p.display()
    );
    p
}

fn small() -> (sam::Sam, HashMap<String, Tensor>, Value) {
    let dir = fixtures();
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("sam_small_config.json")).expect("config"),
    )
    .expect("config parses");
    let model = sam::load_file(
        &dir.join("sam_small.safetensors"),
        &cfg,
        hilum_models::Device::Cpu,
    )
    .expect("small weights load");
    let io = candle_core::safetensors::load(dir.join("sam_small_io.safetensors"), &Device::Cpu)
        .expect("io fixture");
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("sam_small_cases.json")).expect("cases"),
    )
    .expect("cases parse");
    (model, io, cases)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .and_then(|d| d.abs())
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("diff")
}

fn max_abs(a: &Tensor) -> f32 {
    a.abs()
        .and_then(|d| d.flatten_all())
        .and_then(|d| d.max(0))
        .and_then(|d| d.to_scalar::<f32>())
        .expect("max")
}

fn prompt(case: &Value, io: &HashMap<String, Tensor>, name: &str) -> Prompt {
    let f = |v: &Value| v.as_f64().expect("number") as f32;
    let points = case["points"]
        .as_array()
        .expect("points")
        .iter()
        .zip(case["labels"].as_array().expect("labels"))
        .map(|(p, l)| (f(&p[0]), f(&p[1]), f(l)))
        .collect();
    let bbox = case["box"]
        .as_array()
        .map(|b| [f(&b[0]), f(&b[1]), f(&b[2]), f(&b[3])]);
    Prompt {
        points,
        bbox,
        mask: io.get(&format!("{name}_mask_input")).cloned(),
    }
}

#[test]
fn small_sam_matches_reference_embedding_and_masks() {
    let (model, io, cases) = small();
    let emb = model.embed_image(&io["image"]).expect("encoder");
    let d = max_diff(&emb, &io["embedding"]);
    println!(
        "image embedding: max abs diff {d:e} (values up to {})",
        max_abs(&io["embedding"])
    );
    assert!(d < 1e-4, "embedding differs by {d}");
    assert_eq!(model.encoder_runs(), 1);

    let d = max_diff(model.dense_pe(), &io["dense_pe"]);
    assert!(d < 1e-4, "dense positional encoding differs by {d}");

    let cases = cases.as_object().expect("cases");
    assert_eq!(cases.len(), 4);
    for (name, case) in cases {
        let p = prompt(case, &io, name);
        let (sparse, dense) = model.encode_prompt(&p).expect("prompt encoder");
        let ds = max_diff(&sparse, &io[&format!("{name}_sparse")]);
        let dd = max_diff(&dense, &io[&format!("{name}_dense")]);
        // Decode from the reference embedding so each stage is judged on its own.
        let (masks, iou) = model.decode(&io["embedding"], &p).expect("mask decoder");
        let dm = max_diff(&masks, &io[&format!("{name}_masks")]);
        let di = max_diff(&iou, &io[&format!("{name}_iou")]);
        println!(
            "{name}: sparse {ds:e}, dense {dd:e}, masks {dm:e} (logits up to {}), iou {di:e}",
            max_abs(&io[&format!("{name}_masks")])
        );
        for (what, v) in [("sparse", ds), ("dense", dd), ("masks", dm), ("iou", di)] {
            assert!(v < 1e-4, "{name}: {what} differs by {v}");
        }
        // MedSAM's single-mask output is token 0.
        let (low, score) = model
            .predict_low_res(&io["embedding"], &p)
            .expect("single mask");
        let low_res = model.config().low_res();
        assert_eq!(low.len(), low_res * low_res);
        let ref0: Vec<f32> = io[&format!("{name}_masks")]
            .get(0)
            .and_then(|m| m.get(0))
            .and_then(|m| m.flatten_all())
            .and_then(|m| m.to_vec1())
            .expect("reference token 0");
        let worst = low
            .iter()
            .zip(&ref0)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{name}: single mask differs by {worst}");
        let ref_iou: f32 = io[&format!("{name}_iou")]
            .get(0)
            .and_then(|t| t.get(0))
            .and_then(|t| t.to_scalar())
            .expect("iou");
        assert!((score - ref_iou).abs() < 1e-4);
    }
}

#[test]
fn full_size_parameters_match_sam_vit_b() {
    let published: BTreeMap<String, Vec<usize>> = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sam_vit_b_params.json")).expect("list"),
    )
    .expect("list parses");
    let ours = sam::expected_params(&Config::vit_b()).expect("names");
    hilum_models::weights::compare(&published, &ours).unwrap_or_else(|e| panic!("{e}"));
    println!("{} parameters match", published.len());
    assert_eq!(published.len(), 314);
    assert!(published.contains_key("image_encoder.blocks.0.attn.qkv.weight"));
}

#[test]
fn registry_checks_medsam_weights_against_vit_b() {
    let reg = hilum_models::ModelRegistry::new("/nonexistent").expect("registry");
    let m = reg.manifest("medsam-vit-b").expect("manifest");
    assert_eq!(m.architecture, "sam");
    assert_eq!(Config::from_manifest(m).expect("config"), Config::vit_b());
    // The small fixture has the right names but the wrong shapes for ViT-B: refused.
    let err = hilum_models::import(
        &reg,
        "medsam-vit-b",
        &fixtures().join("sam_small.safetensors"),
        &hilum_models::ImportOptions::default(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(
        err.contains("does not fit architecture `sam`") && err.contains("expected [768"),
        "{err}"
    );
}

fn data() -> PathBuf {
    let d = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        d.is_dir(),
        "{} missing (the shared data folder beside the repository)",
        d.display()
    );
    d
}

/// `sam::preprocess` as it was written before it became a recipe: 8-bit scale, skimage's
/// order-3 resize in f64, truncated to bytes, min-max over the resized plane, three planes.
fn medsam_input_as_written_before(
    gray: &[f32],
    w: usize,
    h: usize,
    max: f32,
    size: usize,
) -> Vec<f32> {
    let scale = 255.0 / max.max(1.0);
    let eight: Vec<f32> = gray.iter().map(|&v| v * scale).collect();
    let resized = hilum_imaging::skresize::resize_cubic_mirror(&eight, w, h, size, size);
    let quant: Vec<f32> = resized
        .iter()
        .map(|v| v.clamp(0.0, 255.0).trunc() as f32)
        .collect();
    let (lo, hi) = quant
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    let range = (hi - lo).max(1e-8);
    let one: Vec<f32> = quant.iter().map(|&v| (v - lo) / range).collect();
    [&one[..], &one[..], &one[..]].concat()
}

/// The image store's MedSAM input (`sam::recipe`, what `segment_region` asks for) is the
/// 1024 px input MedSAM was checked against, value for value, on 8-bit PNG, JPEG and 16-bit
/// radiographs; and the small model's runner takes it and refuses another recipe's input.
#[test]
fn the_store_recipe_is_the_medsam_input_exactly() {
    let store = hilum_imaging::ImageStore::default();
    for name in [
        "nih_00000100_000_effusion_multi.png",
        "covid_0a7faa2a.jpg",
        "derived_RG1_chest_pa_16bit.png",
    ] {
        let path = data().join("cxr/images").join(name);
        let id = store.ingest_file(&path).expect("ingest");
        let img = store.get(&id).expect("image");
        let (w, h) = (img.width as usize, img.height as usize);
        let before = medsam_input_as_written_before(&img.pixels, w, h, img.max_value(), 1024);
        let prepared = store.prepared(&id, &sam::recipe(1024)).expect("prepared");
        assert_eq!(prepared.shape(), [3, 1024, 1024], "{name}");
        assert!(
            prepared.data == before,
            "{name}: the recipe differs from MedSAM's input"
        );
        assert!(
            sam::preprocess(&img.pixels, w, h, img.max_value(), 1024) == before,
            "{name}"
        );
    }

    use hilum_models::runner::Runner;
    let (model, _, _) = small();
    let id = store.ids()[0].clone();
    let x = store.prepared(&id, &model.recipe()).expect("prepared");
    let emb = model.run(&x).expect("encoder");
    let direct = model.embed_prepared(&x.data).expect("encoder");
    assert_eq!(max_diff(&emb, &direct), 0.0);
    let other = store
        .prepared(&id, &hilum_imaging::Preprocess::imagenet(64))
        .expect("prepared");
    assert!(
        model.run(&other).is_err(),
        "another recipe's input is refused"
    );
}

/// Full-size ViT-B encoder at 1024 px with seeded random weights: the time of one forward.
/// Slow: `cargo test -p hilum-models --release --test it medsam_fixture:: -- --ignored --nocapture`
#[test]
#[ignore]
fn full_size_encoder_time() {
    let cfg = Config::vit_b();
    let model = sam::random(&cfg, 7, hilum_models::Device::Cpu).expect("random ViT-B");
    let x = vec![0.5f32; 3 * cfg.image_size * cfg.image_size];
    let t = std::time::Instant::now();
    let emb = model.embed_prepared(&x).expect("encoder");
    let enc = t.elapsed().as_secs_f64();
    let t = std::time::Instant::now();
    let p = Prompt {
        bbox: Some([100.0, 200.0, 600.0, 800.0]),
        ..Default::default()
    };
    let (low, _) = model.predict_low_res(&emb, &p).expect("decoder");
    println!(
        "MedSAM ViT-B 1024 px on candle CPU: encoder {enc:.2} s, prompt+decoder {:.3} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(emb.dims(), &[1, 256, 64, 64]);
    assert_eq!(low.len(), 256 * 256);
}
