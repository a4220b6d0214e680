//! `segment_region`: a first call on an image (preprocess, image encoder, prompt encoder, mask
//! decoder, resize to the original size, PNGs) against a call whose image embedding is cached,
//! through the tool itself on a real radiograph.
//!
//! - small seeded SAM of tests/fixtures/medsam (128 px, embed 32, depth 2), always;
//! - full-size ViT-B at 1024 px on seeded random weights (the MedSAM architecture; the real
//!   checkpoint is not on this machine) when `HILUM_BENCH_VIT_B=1` — one encoder pass takes
//!   seconds to tens of seconds on 2 cores, so this takes a few minutes.
//!
//! `cargo bench --bench segment_region` (`HILUM_BENCH_VIT_B=1 cargo bench --bench segment_region`)

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use hilum_agent::{Tool, ToolContext};
use hilum_imaging::{ImageStore, StoreLimits};
use hilum_models::sam::{self, Config, Sam};
use hilum_tools::SegmentRegion;
use serde_json::json;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn small() -> Sam {
    let dir = root().join("tests/fixtures/medsam");
    let cfg: Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("sam_small_config.json")).expect("fixture"),
    )
    .expect("config");
    sam::load_file(
        &dir.join("sam_small.safetensors"),
        &cfg,
        hilum_models::Device::Cpu,
    )
    .expect("weights")
}

fn bench_model(c: &mut Criterion, name: &str, model: Arc<Sam>, samples: usize) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let store = Arc::new(ImageStore::new(StoreLimits::default()));
    let id = store
        .ingest_file(&root().join("../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png"))
        .expect("real image");
    let args = json!({"image": id, "box": [250, 300, 700, 800]});
    let mut g = c.benchmark_group(format!("segment_region {name}"));
    g.sample_size(samples);
    g.warm_up_time(Duration::from_millis(100));
    // A fresh tool per iteration has an empty embedding cache: every call encodes.
    g.bench_function("first call (encoder + decoder)", |b| {
        b.to_async(&rt).iter_batched(
            || SegmentRegion::with_model(store.clone(), model.clone()),
            |tool| {
                let args = args.clone();
                async move {
                    let out = tool
                        .call(&ToolContext::default(), args)
                        .await
                        .expect("call");
                    assert_eq!(out.data["embedding_cached"], json!(false));
                }
            },
            BatchSize::PerIteration,
        )
    });
    let warm = SegmentRegion::with_model(store.clone(), model.clone());
    rt.block_on(warm.call(&ToolContext::default(), args.clone()))
        .expect("warm-up call");
    g.bench_function("cached call (decoder only)", |b| {
        b.to_async(&rt).iter(|| async {
            let out = warm
                .call(&ToolContext::default(), args.clone())
                .await
                .expect("call");
            assert_eq!(out.data["embedding_cached"], json!(true));
        })
    });
    g.finish();
}

fn bench(c: &mut Criterion) {
    bench_model(c, "small SAM 128 px", Arc::new(small()), 20);
    if std::env::var("HILUM_BENCH_VIT_B").is_ok_and(|v| v == "1") {
        let vit_b = sam::random(&Config::vit_b(), 7, hilum_models::Device::Cpu).expect("ViT-B");
        bench_model(c, "ViT-B 1024 px (random weights)", Arc::new(vit_b), 10);
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
