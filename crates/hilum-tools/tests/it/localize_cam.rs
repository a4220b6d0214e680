//! `localize_finding`: the CAM of the torchxrayvision DenseNet against direct computations on
//! the seeded small DenseNet whose logits were matched to PyTorch (tests/fixtures/classifier),
//! boxes against the thresholded map, and — informative, with real weights only — IoU against
//! the NIH expert boxes.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use hilum_agent::{Tool, ToolContext, ToolError};
use hilum_imaging::ImageStore;
use hilum_models::densenet::{self, DenseNet};
use hilum_models::xrv::{Arch, Classifier, XrvSpec};
use hilum_models::{Backend, ModelPool, ModelRegistry, ModelSettings};
use hilum_tools::localize::{self, LocalizeFinding, MODEL_ID};
use serde_json::json;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixtures() -> PathBuf {
    let p = repo().join("tests/fixtures/classifier");
    assert!(
        p.join("densenet_small.safetensors").exists(),
        "classifier fixtures missing in {}: run scripts/fixtures/make_fixtures.py",
        p.display()
    );
    p
}

fn shared() -> PathBuf {
    let p = repo().join("../shared/data/cxr");
    assert!(
        p.is_dir(),
        "real test data missing: expected {} (the shared data folder beside the repository)",
        p.display()
    );
    p
}

fn small_weights() -> (densenet::Config, VarBuilder<'static>) {
    let text = std::fs::read_to_string(fixtures().join("small_configs.json")).expect("configs");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    let cfg: densenet::Config = serde_json::from_value(v["densenet"].clone()).expect("config");
    // SAFETY: the fixture is not modified while the test runs.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(
            &[fixtures().join("densenet_small.safetensors")],
            DType::F32,
            &Device::Cpu,
        )
    }
    .expect("weights");
    (cfg, vb)
}

/// The small DenseNet as the classifier the tool asks for: candle backend.
fn small_net() -> Classifier {
    let (cfg, vb) = small_weights();
    let spec = XrvSpec {
        resolution: 64,
        arch: Arch::DenseNet(cfg),
        ..XrvSpec::densenet121_res224_all()
    };
    Classifier::new(vb, spec, Backend::Candle, 1).expect("small classifier")
}

/// The same weights as a bare candle DenseNet, for direct computations.
fn small_densenet() -> DenseNet {
    let (cfg, vb) = small_weights();
    DenseNet::load(vb, &cfg).expect("small densenet")
}

/// Inputs (b, 64*64) and PyTorch logits (b, 18) of the small DenseNet.
fn torch_io() -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let t = candle_core::safetensors::load(
        fixtures().join("densenet_small_io.safetensors"),
        &Device::Cpu,
    )
    .expect("io fixture");
    let rows = |name: &str| -> Vec<Vec<f32>> {
        let x = &t[name];
        let b = x.dim(0).expect("batch");
        (0..b)
            .map(|i| {
                x.get(i)
                    .and_then(|r| r.flatten_all())
                    .and_then(|r| r.to_vec1::<f32>())
                    .expect("row")
            })
            .collect()
    };
    (rows("input"), rows("logits"))
}

#[test]
fn cam_mean_plus_bias_is_the_pytorch_logit() {
    let net = small_net();
    let (inputs, logits) = torch_io();
    for (x, want) in inputs.iter().zip(&logits) {
        for (class, &w) in want.iter().enumerate() {
            let cam = net.class_activation(x, class).expect("cam");
            assert_eq!((cam.h, cam.w), (4, 4), "64 px / 16 for three dense blocks");
            assert!(
                (cam.logit - w).abs() <= 1e-4 * w.abs().max(1.0),
                "class {class}: CAM logit {} vs PyTorch {w}",
                cam.logit
            );
        }
    }
}

#[test]
fn cam_equals_weights_times_feature_map() {
    let net = small_net();
    let dense = small_densenet();
    let (inputs, _) = torch_io();
    let x = Tensor::from_slice(&inputs[0], (1, 1, 64, 64), &Device::Cpu).expect("x");
    let f = dense.feature_map(&x).expect("feature map");
    let (_, c, h, w) = f.dims4().expect("4-d");
    // Pooling the map gives exactly DenseNet::features (norm5 + ReLU + mean).
    let pooled = f.mean((2, 3)).and_then(|t| t.flatten_all());
    let reference = dense.features(&x).and_then(|t| t.flatten_all());
    let (pooled, reference) = (
        pooled.and_then(|t| t.to_vec1::<f32>()).expect("pooled"),
        reference
            .and_then(|t| t.to_vec1::<f32>())
            .expect("features"),
    );
    let d = pooled
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        d < 1e-5,
        "feature map pooled differs from DenseNet::features by {d}"
    );
    let fm = f
        .flatten_all()
        .and_then(|t| t.to_vec1::<f32>())
        .expect("fm");
    let wts = dense.classifier.weight().to_vec2::<f32>().expect("weights");
    for class in [0, 7, 17] {
        let cam = net.class_activation(&inputs[0], class).expect("cam");
        for p in 0..h * w {
            let direct: f64 = (0..c)
                .map(|k| wts[class][k] as f64 * fm[k * h * w + p] as f64)
                .sum();
            assert!(
                (cam.values[p] as f64 - direct).abs() < 1e-4,
                "class {class} cell {p}: {} vs {direct}",
                cam.values[p]
            );
        }
    }
    // And the whole head: the logits of the classifier's own forward.
    let logits = net.logits(&inputs[0], 1).expect("logits");
    let cam = net.class_activation(&inputs[0], 3).expect("cam");
    assert!((cam.logit - logits[3]).abs() < 1e-4);
}

#[test]
fn boxes_are_the_regions_of_the_thresholded_map_on_a_real_image() {
    let net = small_net();
    let store = ImageStore::default();
    // 920 x 977, 16-bit: a non-square image, so the centre square is offset in y.
    let id = store
        .ingest_file(&shared().join("images/derived_RG1_chest_pa_16bit.png"))
        .expect("ingest");
    let img = store.get(&id).expect("image");
    let threshold = 0.5;
    // Seeded weights: take the class whose map has the most positive cells (a real model's
    // map for a present finding is positive where the evidence is).
    let x = hilum_models::xrv::preprocess(&img.pixels, 920, 977, img.max_value(), 64);
    let class = (0..18)
        .max_by_key(|&c| {
            let cam = net.class_activation(&x, c).expect("cam");
            cam.values.iter().filter(|&&v| v > 0.0).count()
        })
        .expect("18 classes");
    let loc = localize::localize(&net, &img, class, threshold).expect("localize");
    assert_eq!((loc.crop, loc.crop_x, loc.crop_y), (920, 0, 28));
    assert_eq!((loc.heat.len(), loc.heat_side), (920 * 920, 920));
    assert!(
        !loc.boxes.is_empty(),
        "the map's peak region must give a box"
    );
    // The normalised map peaks near 1 (bilinear between cells) and the first box holds it.
    let (peak_at, peak) = loc
        .heat
        .iter()
        .enumerate()
        .fold((0, f32::MIN), |m, (i, &v)| if v > m.1 { (i, v) } else { m });
    let (hb, _) = &loc.boxes[0];
    assert!(peak > 0.9 && hb.peak == peak, "{} vs {peak}", hb.peak);
    let (px, py) = (peak_at % loc.heat_side, peak_at / loc.heat_side);
    assert!((hb.x1..hb.x2).contains(&px) && (hb.y1..hb.y2).contains(&py));
    for (hb, pb) in &loc.boxes {
        // Boxes are tight around above-threshold pixels: every edge holds one.
        let above = |x: usize, y: usize| loc.heat[y * loc.heat_side + x] >= threshold;
        assert!((hb.x1..hb.x2).any(|x| above(x, hb.y1)));
        assert!((hb.x1..hb.x2).any(|x| above(x, hb.y2 - 1)));
        assert!((hb.y1..hb.y2).any(|y| above(hb.x1, y)));
        assert!((hb.y1..hb.y2).any(|y| above(hb.x2 - 1, y)));
        let inside = (hb.y1..hb.y2)
            .flat_map(|y| (hb.x1..hb.x2).map(move |x| (x, y)))
            .filter(|&(x, y)| above(x, y))
            .count();
        assert!(inside >= hb.area);
        // Original-image pixels: shifted by the centre square's offset.
        assert_eq!((pb.x1, pb.y1), (hb.x1 as f64, (hb.y1 + 28) as f64));
        assert_eq!(pb.label, net.spec.labels[class]);
    }
    // Every above-threshold pixel of the map is in a box, or in a dropped speck.
    let covered: usize = loc.boxes.iter().map(|(h, _)| h.area).sum();
    let total = loc.heat.iter().filter(|&&v| v >= threshold).count();
    assert!(covered <= total);
    let speck = (0.002 * (920.0 * 920.0)) as usize;
    assert!(
        total - covered < speck * 8,
        "{total} above threshold, {covered} in boxes"
    );
    // A higher threshold can only shrink the boxed area.
    let strict = localize::localize(&net, &img, class, 0.9).expect("localize");
    let strict_area: usize = strict.boxes.iter().map(|(h, _)| h.area).sum();
    assert!(strict_area <= covered);
    // The overlay is a PNG of the image (<= 1024 px) with the heat blended in.
    let png = localize::overlay_png(&img, &loc).expect("overlay");
    let rgb = image::load_from_memory(&png).expect("png").to_rgb8();
    assert_eq!(rgb.dimensions(), (920, 977));
    let coloured = rgb.pixels().filter(|p| p.0[0] != p.0[2]).count();
    assert!(coloured > 0, "heat must tint the image");
}

#[tokio::test]
async fn missing_weights_name_the_fetch_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = Arc::new(ModelPool::new(Arc::new(
        ModelRegistry::new(dir.path()).expect("registry"),
    )));
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&shared().join("images/nih_00004387_000_effusion.png"))
        .expect("ingest");
    let tool = LocalizeFinding::new(store, pool);
    let err = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "finding": "Effusion"}),
        )
        .await
        .expect_err("no weights installed");
    assert_eq!(
        err,
        ToolError::ModelMissing {
            model: MODEL_ID.into(),
            fix: format!("hilum models fetch {MODEL_ID}")
        }
    );
}

fn iou(a: [f64; 4], b: [f64; 4]) -> f64 {
    let ix = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let iy = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = ix * iy;
    let union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter;
    if union > 0.0 {
        inter / union
    } else {
        0.0
    }
}

/// Informative: IoU of CAM boxes with the NIH expert boxes, with the installed real weights.
/// Skips (passing) when `densenet121-res224-all` is not installed (`hilum models fetch
/// densenet121-res224-all`, or `HILUM_MODELS_DIR` pointing at a models folder).
#[tokio::test]
async fn cam_boxes_vs_nih_expert_boxes_iou_report() {
    let csv = shared().join("ground_truth/nih_bbox_subset.csv");
    let text = std::fs::read_to_string(&csv).expect("nih_bbox_subset.csv");
    // The program's part: the models dir HILUM_MODELS_DIR names, else the default one.
    let models_dir = std::env::var_os("HILUM_MODELS_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(ModelRegistry::default_dir);
    let pool = Arc::new(ModelPool::from_settings(ModelSettings {
        models_dir,
        ..Default::default()
    }));
    if let Err(e) = pool.registry().installed(MODEL_ID) {
        eprintln!("SKIPPED cam IoU report: {e}");
        return;
    }
    let store = Arc::new(ImageStore::default());
    let tool = LocalizeFinding::new(store.clone(), pool);
    let mut ious = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 7, "bad row {line}");
        let num = |i: usize| f[i].parse::<f64>().expect("number");
        let gt = [num(3), num(4), num(3) + num(5), num(4) + num(6)];
        // NIH's box label "Infiltrate" is the classifier's "Infiltration".
        let finding = if f[2] == "Infiltrate" {
            "Infiltration"
        } else {
            f[2]
        };
        let id = store
            .ingest_file(&shared().join("images").join(f[0]))
            .expect("ingest");
        let out = tool
            .call(
                &ToolContext::default(),
                json!({"image": id, "finding": finding}),
            )
            .await
            .expect("localize");
        let best = out.data["boxes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| {
                let g = |k: &str| b[k].as_f64().unwrap_or(0.0);
                iou([g("x1"), g("y1"), g("x2"), g("y2")], gt)
            })
            .fold(0.0, f64::max);
        eprintln!(
            "{:<40} {:<13} p={:.2} boxes={} best IoU={best:.3}",
            f[0],
            finding,
            out.data["probability"].as_f64().unwrap_or(f64::NAN),
            out.data["boxes"].as_array().map_or(0, Vec::len)
        );
        ious.push(best);
    }
    assert!(!ious.is_empty());
    let mean = ious.iter().sum::<f64>() / ious.len() as f64;
    let hit = ious.iter().filter(|&&v| v >= 0.1).count();
    eprintln!(
        "CAM vs NIH expert boxes: {} images, mean best IoU {mean:.3}, IoU>=0.1 on {hit}",
        ious.len()
    );
}

/// Full-size DenseNet-121 (seeded weights, the real architecture): the CAM grid is 7x7 at
/// 224 px, its mean plus bias is the reference forward's logit, and the latency is printed
/// (`cargo test -p hilum-tools --test it localize_cam::full_size -- --nocapture`).
#[test]
fn full_size_densenet121_cam_matches_its_forward_and_reports_latency() {
    let spec = XrvSpec::densenet121_res224_all();
    let weights = hilum_models::xrv::synthetic_weights(&spec.arch, 7).expect("weights");
    let vb = VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
    let net = Classifier::new(vb, spec, Backend::Candle, 1).expect("densenet121");
    let store = ImageStore::default();
    let id = store
        .ingest_file(&shared().join("images/nih_00004387_000_effusion.png"))
        .expect("ingest");
    let img = store.get(&id).expect("image");
    let x = hilum_models::xrv::preprocess(&img.pixels, 1024, 1024, img.max_value(), 224);
    let cam = net.class_activation(&x, 7).expect("cam");
    assert_eq!((cam.h, cam.w), (7, 7));
    let logits = net.logits(&x, 1).expect("logits");
    assert!(
        (cam.logit - logits[7]).abs() <= 1e-4 * logits[7].abs().max(1.0),
        "{} vs {}",
        cam.logit,
        logits[7]
    );
    let mut ms = Vec::new();
    for _ in 0..2 {
        let t = std::time::Instant::now();
        let loc = localize::localize(&net, &img, 7, 0.5).expect("localize");
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(loc.heat.len(), 1024 * 1024);
    }
    eprintln!(
        "localize (DenseNet-121 candle CPU, 1024² image, CAM + upsample + boxes): {ms:.1?} ms"
    );
}

#[test]
fn large_images_keep_a_1024_map_and_scale_boxes_to_original_pixels() {
    let net = small_net();
    let store = ImageStore::default();
    let id = store
        .ingest_file(&shared().join("images/medrax_normal3.jpg"))
        .expect("ingest");
    let img = store.get(&id).expect("image");
    let (w, h) = (img.width as usize, img.height as usize);
    let crop = w.min(h);
    assert!(crop > 1024, "this test needs an image larger than 1024 px");
    let x = hilum_models::xrv::preprocess(&img.pixels, w, h, img.max_value(), 64);
    let class = (0..18)
        .max_by_key(|&c| {
            let cam = net.class_activation(&x, c).expect("cam");
            cam.values.iter().filter(|&&v| v > 0.0).count()
        })
        .expect("18 classes");
    let loc = localize::localize(&net, &img, class, 0.5).expect("localize");
    assert_eq!((loc.heat_side, loc.crop), (1024, crop));
    assert!(!loc.boxes.is_empty());
    let s = crop as f64 / 1024.0;
    for (hb, pb) in &loc.boxes {
        assert!((pb.x1 - (loc.crop_x as f64 + hb.x1 as f64 * s)).abs() < 1e-9);
        assert!((pb.y2 - (loc.crop_y as f64 + hb.y2 as f64 * s)).abs() < 1e-9);
        assert!(pb.x1 >= loc.crop_x as f64 && pb.x2 <= (loc.crop_x + crop) as f64);
        assert!(pb.y1 >= loc.crop_y as f64 && pb.y2 <= (loc.crop_y + crop) as f64);
    }
    let png = localize::overlay_png(&img, &loc).expect("overlay");
    let rgb = image::load_from_memory(&png).expect("png").to_rgb8();
    assert_eq!(rgb.width().max(rgb.height()), 1024);
}

#[test]
fn the_map_needs_the_candle_densenet_and_says_so() {
    let (cfg, vb) = small_weights();
    let spec = XrvSpec {
        resolution: 64,
        arch: Arch::DenseNet(cfg),
        ..XrvSpec::densenet121_res224_all()
    };
    let native = Classifier::new(vb, spec, Backend::Native, 1).expect("native classifier");
    assert!(!native.has_feature_map());
    let e = native
        .class_activation(&[0.0; 64 * 64], 0)
        .expect_err("the native plan ends at the logits");
    assert!(e.to_string().contains("candle"), "{e}");
    let candle = small_net();
    assert!(candle.has_feature_map());
    let e = candle
        .class_activation(&[0.0; 64 * 64], 18)
        .expect_err("18 classes: 0..17");
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = candle
        .class_activation(&[0.0; 100], 0)
        .expect_err("wrong input size");
    assert!(e.to_string().contains("64 x 64"), "{e}");
}

/// The tool asks the pool for the classifier itself (on candle): with the classifier already
/// warm on candle, running the tool loads nothing, and its logit is the classifier's.
#[tokio::test]
async fn the_tool_uses_the_classifiers_own_copy() {
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = ModelRegistry::new(dir.path().join("models")).expect("registry");
    let spec = XrvSpec::densenet121_res224_all();
    let weights = hilum_models::xrv::synthetic_weights(&spec.arch, 11).expect("weights");
    let file = dir.path().join("site.safetensors");
    candle_core::safetensors::save(&weights, &file).expect("save");
    let opts = hilum_models::ImportOptions {
        custom: true,
        origin: None,
    };
    hilum_models::import(&registry, MODEL_ID, &file, &opts).expect("import");
    let pool = Arc::new(ModelPool::new(Arc::new(registry)));
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&shared().join("images/nih_00004387_000_effusion.png"))
        .expect("ingest");
    let (classifier, input) = {
        let (pool, store, id) = (pool.clone(), store.clone(), id.clone());
        tokio::task::spawn_blocking(move || {
            let c = hilum_models::xrv::pooled(
                &pool,
                MODEL_ID,
                hilum_models::Device::Cpu,
                Some(Backend::Candle),
            )
            .expect("classifier on candle");
            let img = store.get(&id).expect("image");
            let x = hilum_imaging::prepare(&img, &c.spec.recipe()).expect("prepare");
            (c, x)
        })
        .await
        .expect("join")
    };
    assert_eq!(pool.load_count(MODEL_ID), 1);
    let effusion = 7;
    let want = classifier.logits(&input.data, 1).expect("logits")[effusion];
    let tool = LocalizeFinding::on_device(store, pool.clone(), Some(hilum_models::Device::Cpu));
    let out = tool
        .call(
            &ToolContext::default(),
            json!({"image": id, "finding": "Effusion"}),
        )
        .await
        .expect("localize");
    assert_eq!(
        pool.load_count(MODEL_ID),
        1,
        "the tool loaded a network of its own"
    );
    let got = out.data["logit"].as_f64().expect("logit") as f32;
    assert!(
        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
        "tool logit {got} vs classifier {want}"
    );
    assert_eq!(out.data["finding"], "Effusion");
    assert_eq!(out.data["model_custom"], true);
}
