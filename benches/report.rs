//! Report generation speed (candle CPU):
//! - the tiny fixture model (`tests/fixtures/report/tiny_pad`) on a real radiograph at 224 px,
//!   greedy, 24 tokens at most: the whole `generate` (encoder + decoding);
//! - the full-size architecture of the CheXpert-Plus baselines (SwinV2-Tiny + 2-layer BERT,
//!   vocabulary 30522) with placeholder weights: the encoder at 224 px, and 32 greedy decoding
//!   steps with EOS disabled (so every run decodes the same number of tokens).
//!
//! `cargo bench --bench report`; tokens/s = tokens / the reported time.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, Criterion};
use hilum_imaging::ImageStore;
use hilum_models::report::{self, Config, GenerationConfig, ReportModel, ReportNet};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn bench(c: &mut Criterion) {
    let store = ImageStore::default();
    let id = store
        .ingest_file(&root().join("../shared/data/cxr/images/nih_00000001_000_cardiomegaly.png"))
        .expect("real radiograph (../shared/data)");
    let px = store
        .prepared(&id, &hilum_models::report::recipe(224))
        .expect("prepared");

    let tiny = ReportModel::load_files(
        &root().join("tests/fixtures/report/tiny_pad/model.safetensors"),
        None,
        224,
        hilum_models::Device::Cpu,
    )
    .expect("tiny fixture");
    let gen = tiny.generation(1, 24);
    let mut g = c.benchmark_group("report_tiny");
    g.sample_size(20);
    g.bench_function("generate_greedy_24", |b| {
        b.iter(|| tiny.generate_from(&px, &gen).expect("generate"))
    });
    g.finish();

    let cfg = Config::chexpert_plus_baseline(30522);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let net = ReportNet::new(&cfg, vb).expect("full-size architecture");
    let x = Tensor::from_slice(&px.data, (1, 3, 224, 224), &Device::Cpu).expect("pixels");
    let states = net.encode(&x).expect("encode");
    let cross = net.cross_kv(&states).expect("cross");
    let steps = GenerationConfig {
        num_beams: 1,
        max_length: 33,
        length_penalty: 1.0,
        early_stopping: false,
        decoder_start_token_id: 2,
        eos_token_id: None,
    };
    let mut g = c.benchmark_group("report_full_size");
    g.sample_size(10);
    g.bench_function("encoder_224", |b| {
        b.iter(|| net.encode(&x).expect("encode"))
    });
    g.bench_function("decode_greedy_32_tokens", |b| {
        b.iter(|| report::generate::generate(&net.decoder, &cross, &steps).expect("decode"))
    });
    let beams = GenerationConfig {
        num_beams: 2,
        ..steps.clone()
    };
    g.bench_function("decode_beam2_32_tokens", |b| {
        b.iter(|| report::generate::generate(&net.decoder, &cross, &beams).expect("decode"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
