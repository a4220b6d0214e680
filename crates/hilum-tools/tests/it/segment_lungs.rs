//! `segment_lungs` on real radiographs with the real lung U-Net (imported from
//! ../shared/data/models/lung_seg_unet).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use hilum_agent::{Tool, ToolContext, ToolError, ToolOutput, Typed};
use hilum_imaging::ImageStore;
use hilum_models::{ImportOptions, ModelPool, ModelRegistry};
use hilum_tools::{MeasureChest, SegmentLungs};
use serde_json::json;

fn data() -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    assert!(
        d.join("models/lung_seg_unet").is_dir(),
        "real test data missing: expected {}",
        d.display()
    );
    d
}

fn pool() -> Arc<ModelPool> {
    static POOL: OnceLock<(tempfile::TempDir, Arc<ModelPool>)> = OnceLock::new();
    POOL.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let reg = ModelRegistry::new(dir.path()).expect("registry");
        let h5 = data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
        let opts = ImportOptions::default();
        hilum_models::import(&reg, "lung-unet", &h5, &opts).expect("import lung-unet");
        (dir, Arc::new(ModelPool::new(Arc::new(reg))))
    })
    .1
    .clone()
}

async fn segment(file: &Path) -> ToolOutput {
    let store = Arc::new(ImageStore::default());
    let id = store.ingest_file(file).expect("ingest");
    let tool = SegmentLungs::new(store, pool());
    tool.call(&ToolContext::default(), json!({ "image": id }))
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

fn mask_of(out: &ToolOutput) -> image::GrayImage {
    let art = out
        .artifacts
        .iter()
        .find(|a| a.kind == "mask")
        .expect("mask artifact");
    image::load_from_memory(&art.bytes)
        .expect("mask png")
        .to_luma8()
}

#[tokio::test]
async fn mask_matches_ground_truth_at_original_resolution() {
    let img = data().join("cxr/images/covid_2c35005f.jpg");
    let out = segment(&img).await;
    let mask = mask_of(&out);
    let gt = image::open(data().join("cxr/ground_truth/lung_masks/covid_2c35005f.lungs.png"))
        .expect("gt")
        .to_luma8();
    assert_eq!(mask.dimensions(), gt.dimensions());
    let (mut inter, mut sum) = (0usize, 0usize);
    for (a, b) in mask.as_raw().iter().zip(gt.as_raw()) {
        let (a, b) = (*a > 127, *b > 127);
        inter += (a && b) as usize;
        sum += a as usize + b as usize;
    }
    let dice = 2.0 * inter as f64 / sum as f64;
    eprintln!("segment_lungs covid_2c35005f Dice {dice:.4}");
    assert!(dice >= 0.82, "{dice}");
    assert_eq!(out.data["lungs_found"], 2);
    assert!(
        out.data["right_lung"]["area_cm2"].is_null(),
        "no spacing in a JPEG"
    );
    // Patient's right lung is on the image's left.
    let rx = out.data["right_lung"]["bbox"][0].as_u64().expect("bbox");
    let lx = out.data["left_lung"]["bbox"][0].as_u64().expect("bbox");
    assert!(rx < lx);
    assert!(out.artifacts.iter().any(|a| a.kind == "overlay"));
    // The summary states the comparison from the data, in the patient's terms, each area once
    // (a small model copies the summary into its answer).
    let area = |side: &str| out.data[side]["area_px"].as_u64().expect("area");
    let (r, l) = (area("right_lung"), area("left_lung"));
    let larger = if l > r { "left" } else { "right" };
    assert!(
        out.summary
            .contains(&format!("the patient's {larger} lung is larger:")),
        "{}",
        out.summary
    );
    for a in [r, l] {
        let digits = a.to_string();
        let printed: String = digits
            .chars()
            .enumerate()
            .flat_map(|(i, c)| {
                let comma = i > 0 && (digits.len() - i).is_multiple_of(3);
                comma.then_some(',').into_iter().chain([c])
            })
            .collect();
        assert_eq!(out.summary.matches(&printed).count(), 1, "{}", out.summary);
    }
    assert!(out.summary.contains("lungs cover"), "{}", out.summary);
}

#[tokio::test]
async fn dicom_spacing_gives_areas_in_cm2() {
    let out = segment(&data().join("cxr/dicom/siim_pneumothorax_neg_cr_pa_jpegbaseline.dcm")).await;
    eprintln!("{}", out.summary);
    assert_eq!(out.data["lungs_found"], 2);
    for side in ["right_lung", "left_lung"] {
        let l = &out.data[side];
        let px = l["area_px"].as_f64().expect("px");
        let cm2 = l["area_cm2"].as_f64().expect("cm2 with spacing");
        assert!((cm2 - px * 0.168 * 0.168 / 100.0).abs() < 0.01, "{l}");
        // SIIM's spacing tag (0.168 mm) predates its resampling to 1024 px, so only the
        // conversion is checked here, not anatomical plausibility.
        let hpx = l["height_px"].as_f64().expect("height px");
        let h = l["height_cm"].as_f64().expect("height cm");
        assert!((h - hpx * 0.0168).abs() < 0.01, "{l}");
    }
    let ratio = out.data["left_right_area_ratio"].as_f64().expect("ratio");
    assert!((0.6..1.5).contains(&ratio), "{ratio}");
}

#[tokio::test]
async fn high_bit_depth_dicom_is_scaled_before_the_model() {
    // 15-bit MONOCHROME1 JPEG 2000: values must be brought to 0..255 or the model sees white.
    let out = segment(&data().join("cxr/dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm")).await;
    eprintln!("{}", out.summary);
    assert_eq!(out.data["lungs_found"], 2);
    let f = out.data["lung_fraction"].as_f64().expect("fraction");
    assert!((0.1..0.6).contains(&f), "{f}");
}

#[tokio::test]
async fn missing_model_names_the_import_command() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = Arc::new(ModelPool::new(Arc::new(
        ModelRegistry::new(dir.path()).expect("registry"),
    )));
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&data().join("cxr/images/nih_00000001_000_cardiomegaly.png"))
        .expect("ingest");
    let err = SegmentLungs::new(store, empty)
        .call(&ToolContext::default(), json!({ "image": id }))
        .await
        .err();
    match err {
        Some(ToolError::ModelMissing { model, fix }) => {
            assert_eq!(model, "lung-unet");
            assert_eq!(fix, "hilum models import lung-unet PATH");
        }
        other => panic!("expected ModelMissing, got {other:?}"),
    }
}

#[tokio::test]
async fn onnx_runtime_backend_gives_the_same_mask() {
    // The program's part: hand the models crate the library ORT_DYLIB_PATH names.
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        hilum_models::onnx::use_runtime(p.into());
    }
    if hilum_models::onnx::dylib_path().is_none() {
        eprintln!("SKIPPED: ORT_DYLIB_PATH is not set (eval \"$(scripts/setup_onnxruntime.sh)\")");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let reg = ModelRegistry::new(dir.path()).expect("registry");
    let opts = ImportOptions::default();
    let models = data().join("models/lung_seg_unet");
    hilum_models::import(
        &reg,
        "lung-unet",
        &models.join("lung_seg_valiou_088.h5"),
        &opts,
    )
    .expect("h5");
    hilum_models::import(
        &reg,
        "lung-unet",
        &models.join("lung_seg_valiou_088.onnx"),
        &opts,
    )
    .expect("onnx");
    let pool = Arc::new(ModelPool::new(Arc::new(reg)));
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&data().join("cxr/images/covid_00870a9c.jpg"))
        .expect("ingest");
    let run = |tool: Typed<SegmentLungs>| {
        let id = id.clone();
        async move {
            tool.call(&ToolContext::default(), json!({ "image": id }))
                .await
                .expect("segment")
        }
    };
    let auto = run(SegmentLungs::new(store.clone(), pool.clone())).await;
    let ort = run(SegmentLungs::with_backend(
        store.clone(),
        pool.clone(),
        hilum_models::Backend::Onnx,
    ))
    .await;
    let candle = run(SegmentLungs::with_backend(
        store.clone(),
        pool.clone(),
        hilum_models::Backend::Candle,
    ))
    .await;
    // With the graph installed, the CPU default is still the native kernels where their direct
    // engine runs (faster than ONNX Runtime), ONNX Runtime elsewhere.
    let want = if hilum_models::kernels::unet_direct_engine() {
        "native"
    } else {
        "onnx"
    };
    assert_eq!(auto.data["backend"], want, "automatic backend on CPU");
    assert_eq!(ort.data["backend"], "onnx");
    assert_eq!(candle.data["backend"], "candle");
    let (a, b) = (mask_of(&ort), mask_of(&candle));
    let differ = a
        .as_raw()
        .iter()
        .zip(b.as_raw())
        .filter(|(x, y)| x != y)
        .count();
    eprintln!(
        "onnx vs candle masks: {differ} of {} pixels differ; inference {} ms vs {} ms",
        a.as_raw().len(),
        ort.data["inference_ms"],
        candle.data["inference_ms"]
    );
    assert!(differ * 10_000 < a.as_raw().len(), "{differ} pixels differ");
}

/// `segment_lungs` and `measure_chest` run the same U-Net on the same radiograph: the store
/// prepares its input once (the runner's recipe) and both tools read it; the two masks agree.
#[tokio::test]
async fn tools_running_one_model_share_its_prepared_input() {
    let store = Arc::new(ImageStore::default());
    let id = store
        .ingest_file(&data().join("cxr/images/covid_2c35005f.jpg"))
        .expect("ingest");
    let (seg, measure) = (
        SegmentLungs::new(store.clone(), pool()),
        MeasureChest::new(store.clone(), pool()),
    );
    let ctx = ToolContext::default();
    let (a, b) = tokio::join!(
        seg.call(&ctx, json!({ "image": id })),
        measure.call(&ctx, json!({ "image": id })),
    );
    let (a, b) = (a.expect("segment_lungs"), b.expect("measure_chest"));
    assert_eq!(store.stats().variants_computed, 1, "{:?}", store.stats());
    assert!(store.stats().hits >= 1, "{:?}", store.stats());
    // The same mask: both tools count the same lung areas (threshold 0.5 in both).
    for side in ["right", "left"] {
        let seg_px = a.data[format!("{side}_lung")]["area_px"].as_u64();
        let measure_px = b.data[format!("{side}_lung_px")].as_u64();
        assert!(seg_px.is_some_and(|v| v > 50_000), "{side}: {seg_px:?}");
        assert_eq!(seg_px, measure_px, "{side} lung");
    }
}
