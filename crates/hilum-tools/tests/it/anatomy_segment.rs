//! `segment_anatomy` on a real radiograph with the seeded small-configuration PSPNet from
//! tests/fixtures/anatomy (the real checkpoint is not on this machine), and its refusals.

use std::path::PathBuf;
use std::sync::Arc;

use hilum_agent::{Tool, ToolContext, ToolError};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_models::pspnet::{self, Config};
use hilum_models::{ModelPool, ModelRegistry};
use hilum_tools::segment_anatomy::{assemble, run, structure_index};
use hilum_tools::SegmentAnatomy;
use serde_json::json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn real_image(name: &str) -> PathBuf {
    let p = root().join("../shared/data/cxr/images").join(name);
    assert!(
        p.is_file(),
        "real test image missing: {} (the shared data folder beside the repository)",
        p.display()
    );
    p
}

fn small_model() -> pspnet::AnatomySegmenter {
    let dir = root().join("tests/fixtures/anatomy");
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("pspnet_small_config.json"))
            .expect("run scripts/fixtures/make_anatomy_fixtures.py"),
    )
    .expect("config");
    pspnet::load_file(
        &dir.join("pspnet_small.safetensors"),
        &cfg,
        hilum_models::Device::Cpu,
        hilum_models::Backend::Native,
        2,
    )
    .expect("small weights")
}

#[test]
fn structures_come_back_at_original_resolution_with_measurements() {
    let store = ImageStore::new(StoreLimits::default());
    let id = store
        .ingest_file(&real_image("nih_00000001_000_cardiomegaly.png"))
        .expect("ingest");
    let img = store.get(&id).expect("image");
    let model = small_model();
    let which: Vec<usize> = (0..14).collect();
    let input =
        hilum_imaging::prepare(&img, &pspnet::recipe(model.config().input_size)).expect("prepare");
    let maps = run(&model, &input, &which).expect("run");
    assert_eq!(maps.len(), 14);
    for m in &maps {
        assert_eq!(
            m.prob.len(),
            (img.width * img.height) as usize,
            "{}",
            m.name
        );
        assert!(m.prob.iter().all(|p| (0.0..=1.0).contains(p)));
    }
    let out = assemble(&id, &img, &maps, 1.0).expect("assemble");
    let structures = out.data["structures"].as_array().expect("structures");
    assert_eq!(structures.len(), 14);
    // Seeded weights segment something somewhere; every found structure must be consistent.
    let mut found = 0;
    for (s, m) in structures.iter().zip(&maps) {
        if s["found"] != json!(true) {
            continue;
        }
        found += 1;
        let area = s["area_px"].as_u64().expect("area") as usize;
        assert_eq!(area, m.prob.iter().filter(|p| **p > 0.5).count());
        let c = s["confidence"].as_f64().expect("confidence");
        assert!((0.5..=1.0).contains(&c), "{c}");
        let b = s["bbox"].as_array().expect("bbox");
        let (bw, bh) = (b[2].as_u64().unwrap_or(0), b[3].as_u64().unwrap_or(0));
        assert!(area as u64 <= bw * bh);
        assert!(s.get("area_cm2").is_none(), "PNG has no pixel spacing");
    }
    println!("{}", out.summary);
    assert!(out.data["areas"].as_str().unwrap_or("").contains("px only"));
    // One overlay plus one mask per structure, masks at the original size.
    assert_eq!(out.artifacts.len(), 15);
    let mask = image::load_from_memory(&out.artifacts[1].bytes).expect("mask PNG");
    assert_eq!((mask.width(), mask.height()), (img.width, img.height));
    assert!(found <= 14);
    assert_eq!(structure_index("Heart"), Some(8));
}

#[tokio::test]
async fn unknown_structures_and_missing_model_are_clear_errors() {
    let store = Arc::new(ImageStore::new(StoreLimits::default()));
    let id = store
        .ingest_file(&real_image("nih_00000001_000_cardiomegaly.png"))
        .expect("ingest");
    let dir = std::env::temp_dir().join(format!("hilum-anatomy-{}", std::process::id()));
    let models = Arc::new(ModelPool::new(Arc::new(
        ModelRegistry::new(&dir).expect("registry"),
    )));
    let tool = SegmentAnatomy::new(store, models);
    let ctx = ToolContext::default();
    let e = tool
        .call(&ctx, json!({"image": id, "structures": ["Heart", "Liver"]}))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, ToolError::InvalidArguments(m) if m.contains("Liver") && m.contains("Weasand")),
        "{e}"
    );
    let e = tool.call(&ctx, json!({"image": id})).await.unwrap_err();
    assert!(
        matches!(&e, ToolError::ModelMissing { model, fix } if model == "chestx-det-pspnet" && fix.contains("hilum models fetch chestx-det-pspnet")),
        "{e}"
    );
}
