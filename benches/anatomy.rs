//! Latency of the anatomy tools' work: `measure_chest` geometry on real ground-truth masks
//! (1600x1600) and the `segment_anatomy` pipeline (preprocess, PSPNet, resize back, stats,
//! overlay and mask PNGs) with the small seeded PSPNet of tests/fixtures/anatomy on a real
//! radiograph (native CPU kernels, the default on the CPU). The full-size 512 px forward, native
//! vs candle, with a per-layer profile:
//! `cargo run --release -p hilum-models --example xrv_profile -- pspnet`.
//!
//! `cargo bench --bench anatomy`

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_models::pspnet::{self, Config};
use hilum_tools::measure::{measure, ChestMasks};
use hilum_tools::segment_anatomy::{assemble, run};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn mask(store: &ImageStore, path: PathBuf) -> (usize, usize, Vec<bool>) {
    let id = store
        .ingest_file(&path)
        .expect("real mask (../shared/data)");
    let img = store.get(&id).expect("mask");
    let half = img.max_value() / 2.0;
    let m = img.pixels.iter().map(|&v| v > half).collect();
    (img.width as usize, img.height as usize, m)
}

fn bench(c: &mut Criterion) {
    let store = ImageStore::new(StoreLimits::default());
    let gt =
        root().join("../shared/data/cxr/ground_truth/multiclass/covid_pneumocystis-pneumonia-1");
    let (w, h, left) = mask(&store, gt.join("left_lung.png"));
    let (_, _, right) = mask(&store, gt.join("right_lung.png"));
    let (_, _, heart) = mask(&store, gt.join("cardiomediastinum.png"));
    let masks = ChestMasks {
        width: w,
        height: h,
        lungs: left.iter().zip(&right).map(|(a, b)| *a || *b).collect(),
        heart: Some(heart),
        mediastinum: None,
    };
    c.bench_function(&format!("measure_chest geometry {w}x{h}"), |b| {
        b.iter(|| measure(&masks))
    });

    let dir = root().join("tests/fixtures/anatomy");
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("pspnet_small_config.json")).expect("fixture"),
    )
    .expect("config");
    let model = pspnet::load_file(
        &dir.join("pspnet_small.safetensors"),
        &cfg,
        hilum_models::Device::Cpu,
        hilum_models::Backend::Native,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    )
    .expect("weights");
    let id = store
        .ingest_file(&root().join("../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png"))
        .expect("real image");
    let img = store.get(&id).expect("image");
    let all: Vec<usize> = (0..14).collect();
    c.bench_function("segment_anatomy pipeline, small PSPNet, 1024x1024", |b| {
        b.iter(|| {
            // Preprocessing counts: the pipeline as one call without a shared variant runs it.
            let input = hilum_imaging::prepare(&img, &pspnet::recipe(model.config().input_size))
                .expect("prepare");
            let maps = run(&model, &input, &all).expect("run");
            assemble(&id, &img, &maps, 0.0).expect("assemble")
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = bench
}
criterion_main!(benches);
