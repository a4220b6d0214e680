//! `measure_chest` geometry on real ground-truth masks (../shared/data/cxr/ground_truth) and
//! the tool's refusals on bad input.

use std::path::PathBuf;
use std::sync::Arc;

use hilum_agent::{Tool, ToolContext, ToolError};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_models::{ModelPool, ModelRegistry};
use hilum_tools::measure::{measure, ChestMasks};
use hilum_tools::MeasureChest;
use serde_json::json;

fn ground_truth() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/ground_truth");
    assert!(
        p.is_dir(),
        "real test data missing: expected {} (the shared data folder beside the repository)",
        p.display()
    );
    p
}

fn read_mask(path: &PathBuf) -> (usize, usize, Vec<bool>) {
    let img = image::open(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
        .to_luma8();
    let (w, h) = img.dimensions();
    (
        w as usize,
        h as usize,
        img.pixels().map(|p| p.0[0] > 127).collect(),
    )
}

#[test]
fn real_multiclass_masks_give_plausible_measurements() {
    let dir = ground_truth().join("multiclass");
    for case in [
        "covid_ARDSSevere",
        "covid_X-ray_of_cyst_in_pneumocystis_pneumonia_1",
        "covid_pneumocystis-pneumonia-1",
    ] {
        let (w, h, left) = read_mask(&dir.join(case).join("left_lung.png"));
        let (w2, h2, right) = read_mask(&dir.join(case).join("right_lung.png"));
        // The cardiomediastinal silhouette: its widest row is the cardiac silhouette.
        let (w3, h3, heart) = read_mask(&dir.join(case).join("cardiomediastinum.png"));
        assert_eq!((w, h), (w2, h2));
        assert_eq!((w, h), (w3, h3));
        let lungs: Vec<bool> = left.iter().zip(&right).map(|(a, b)| *a || *b).collect();
        let r = measure(&ChestMasks {
            width: w,
            height: h,
            lungs,
            heart: Some(heart),
            mediastinum: None,
        });
        println!(
            "{case} {w}x{h}: CTR {:?}, heart {:?}, thorax {:?}, mediastinum {:?}, L/R area {:?}",
            r.ctr, r.heart, r.thorax, r.mediastinum, r.left_right_area_ratio
        );
        let ctr = r.ctr.expect("CTR measured");
        assert!((0.3..0.8).contains(&ctr), "{case}: implausible CTR {ctr}");
        let t = r.thorax.expect("thorax");
        let frac = t.width() as f64 / w as f64;
        assert!(
            (0.5..0.98).contains(&frac),
            "{case}: thorax {frac} of the width"
        );
        let heart = r.heart.expect("heart");
        assert!(
            heart.y > t.y.saturating_sub(h / 3),
            "{case}: heart line far above thorax line"
        );
        let ratio = r.left_right_area_ratio.expect("area ratio");
        assert!((0.5..1.5).contains(&ratio), "{case}: L/R ratio {ratio}");
        let md = r.mediastinum.expect("mediastinum").width() as f64 / t.width() as f64;
        assert!((0.05..0.5).contains(&md), "{case}: mediastinum/thorax {md}");
    }
}

#[test]
fn real_lung_masks_without_heart_measure_lungs_only() {
    let dir = ground_truth().join("lung_masks");
    for name in [
        "covid_00870a9c",
        "covid_0a7faa2a",
        "covid_2c35005f",
        "covid_12941_2020_358_Fig1_HTML",
    ] {
        let (w, h, lungs) = read_mask(&dir.join(format!("{name}.lungs.png")));
        let r = measure(&ChestMasks {
            width: w,
            height: h,
            lungs,
            heart: None,
            mediastinum: None,
        });
        println!(
            "{name} {w}x{h}: thorax {:?}, mediastinum {:?}, L/R area {:?}, missing {:?}",
            r.thorax, r.mediastinum, r.left_right_area_ratio, r.missing
        );
        assert_eq!(r.ctr, None, "{name}: no heart mask, so no CTR");
        assert!(r.missing.iter().any(|m| m.contains("heart")));
        let frac = r.thorax.expect("thorax").width() as f64 / w as f64;
        assert!(
            (0.4..0.98).contains(&frac),
            "{name}: thorax {frac} of the width"
        );
        let ratio = r.left_right_area_ratio.expect("area ratio");
        assert!((0.4..1.6).contains(&ratio), "{name}: L/R ratio {ratio}");
    }
}

fn store_with(w: u32, h: u32) -> (Arc<ImageStore>, String) {
    let store = Arc::new(ImageStore::new(StoreLimits::default()));
    let img = image::GrayImage::from_fn(w, h, |x, y| image::Luma([((x + y) % 256) as u8]));
    let mut buf = std::io::Cursor::new(Vec::new());
    img.write_to(&mut buf, image::ImageFormat::Png)
        .expect("encode");
    let id = store
        .ingest_bytes(buf.into_inner().into(), "test.png")
        .expect("ingest");
    (store, id)
}

fn empty_models() -> Arc<ModelPool> {
    let dir = std::env::temp_dir().join(format!("hilum-measure-empty-{}", std::process::id()));
    Arc::new(ModelPool::new(Arc::new(ModelRegistry::empty(dir))))
}

fn ctx() -> ToolContext {
    ToolContext::default()
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_error() {
    let (store, tiny) = store_with(40, 300);
    let tool = MeasureChest::new(store, empty_models());
    let e = tool.call(&ctx(), json!({"image": tiny})).await.unwrap_err();
    assert!(
        matches!(&e, ToolError::Unprocessable(m) if m.contains("64 px")),
        "{e}"
    );

    let (store, id) = store_with(128, 128);
    let tool = MeasureChest::new(store, empty_models());
    let e = tool
        .call(&ctx(), json!({"image": id, "view": "lateral"}))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, ToolError::Unprocessable(m) if m.contains("lateral")),
        "{e}"
    );
    // A frontal view with no models installed names the install commands.
    let e = tool.call(&ctx(), json!({"image": id})).await.unwrap_err();
    assert!(
        matches!(&e, ToolError::ModelMissing { fix, .. } if fix.contains("hilum models")),
        "{e}"
    );
}

/// A models directory with the real lung U-Net imported.
fn lung_unet_pool() -> Arc<ModelPool> {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let h5 = repo.join("../shared/data/models/lung_seg_unet/lung_seg_valiou_088.h5");
    let dir = std::env::temp_dir().join(format!("hilum-measure-unet-{}", std::process::id()));
    let reg = ModelRegistry::new(&dir).expect("registry");
    let opts = hilum_models::ImportOptions {
        custom: false,
        origin: None,
    };
    hilum_models::import(&reg, "lung-unet", &h5, &opts)
        .unwrap_or_else(|e| panic!("importing {}: {e}", h5.display()));
    Arc::new(ModelPool::new(Arc::new(reg)))
}

#[tokio::test]
async fn measure_chest_with_the_real_lung_unet_says_what_it_could_not_measure() {
    let store = Arc::new(ImageStore::new(StoreLimits::default()));
    let images = ground_truth().join("../images");
    let pa = store
        .ingest_file(&images.join("covid_00870a9c.jpg"))
        .expect("ingest");
    let ap = store
        .ingest_file(&images.join("nih_00000797_000_nofinding_ap.png"))
        .expect("ingest");
    let tool = MeasureChest::new(store, lung_unet_pool());
    let out = tool
        .call(&ctx(), json!({"image": pa, "view": "PA"}))
        .await
        .expect("measure");
    println!("{}\n{:#}", out.summary, out.data);
    let d = &out.data;
    assert!(d["masks_source"]
        .as_str()
        .unwrap_or("")
        .contains("lung-unet"));
    assert_eq!(d["cardiothoracic_ratio"], json!(null));
    assert!(d["not_measured"].to_string().contains("heart"));
    let thorax = d["thoracic_width_px"].as_f64().expect("thorax measured");
    let width = d["width"].as_f64().expect("width");
    assert!(
        (0.4..0.98).contains(&(thorax / width)),
        "{thorax} of {width}"
    );
    let ratio = d["left_right_lung_area_ratio"].as_f64().expect("ratio");
    assert!((0.5..1.6).contains(&ratio), "{ratio}");
    let overlay = image::load_from_memory(&out.artifacts[0].bytes).expect("overlay PNG");
    assert!(overlay.width() <= 1024 && overlay.width() > 0);
    // Without a CTR the summary says why and what to install, once, and leaves out the view's
    // note on the CTR threshold (still in `notes`).
    let s = &out.summary;
    assert!(
        s.contains("CTR not measured (no heart mask: `hilum models fetch chestx-det-pspnet`)"),
        "{s}"
    );
    assert_eq!(s.matches("chestx-det-pspnet").count(), 1, "{s}");
    assert!(
        s.contains("lung is larger:") && !s.contains("threshold"),
        "{s}"
    );

    let out = tool
        .call(
            &ctx(),
            json!({"image": ap, "view": "AP", "pediatric": true}),
        )
        .await
        .expect("measure AP");
    let notes = out.data["notes"].to_string();
    assert!(
        notes.contains("AP projection") && notes.contains("pediatric"),
        "{notes}"
    );
}
