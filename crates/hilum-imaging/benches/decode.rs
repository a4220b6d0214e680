//! Decode + torchxrayvision normalisation + centre crop + resize to 224 of real radiographs:
//! the largest JPEG (2544x3056, 8-bit) and the 1841x1955 JPEG 2000 DICOM (15-bit MONOCHROME1).
//! Python counterpart: scripts/bench/bench_decode.py (same files, same steps); compare the medians as
//! a ratio on one machine. Run: `cargo bench -p hilum-imaging --bench decode`.
//!
//! The `jpeg_decoders` group times Hilum's JPEG path (libjpeg-turbo, C without SIMD) beside
//! the one it replaced (zune-jpeg through the `image` crate, then luminance and f32 as
//! `decode` did), on a baseline and a progressive radiograph, in one run:
//! `cargo bench -p hilum-imaging --bench decode -- jpeg_decoders`.

use std::path::PathBuf;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use hilum_imaging::{decode_jpeg_samples, decode_with, prepare, DecodeOptions, Preprocess, Voi};

fn data(rel: &str) -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/cxr")
        .join(rel);
    std::fs::read(&p).unwrap_or_else(|e| panic!("real data missing: {} ({e})", p.display()))
}

fn bench(c: &mut Criterion) {
    // Raw stored values, MONOCHROME1 inverted, no window: what xrv.utils.read_xray_dcm does.
    let opts = DecodeOptions {
        voi: Voi::None,
        ..Default::default()
    };
    let recipe = Preprocess::xrv(224);
    let mut g = c.benchmark_group("decode_xrv224");
    g.sample_size(20);
    for (name, rel) in [
        ("jpeg_2544x3056", "images/medrax_normal3.jpg"),
        (
            "dicom_j2k_1841x1955",
            "dicom/RG1_chest_cr_pa_jpeg2000_lossy.dcm",
        ),
    ] {
        let bytes = data(rel);
        g.bench_function(name, |b| {
            b.iter(|| {
                let img = decode_with(black_box(&bytes), name, &opts).expect("decode");
                prepare(&img, &recipe).expect("prepare")
            })
        });
        g.bench_function(format!("{name}_decode_only"), |b| {
            b.iter(|| decode_with(black_box(&bytes), name, &opts).expect("decode"))
        });
    }
    g.finish();
}

/// What `decode` did for JPEG before libjpeg-turbo: the `image` crate's zune-jpeg, then
/// luminance and f32.
fn zune_decode(bytes: &[u8]) -> Vec<f32> {
    let img = image::load_from_memory_with_format(bytes, image::ImageFormat::Jpeg).expect("zune");
    img.into_luma8()
        .into_raw()
        .into_iter()
        .map(f32::from)
        .collect()
}

fn bench_jpeg(c: &mut Criterion) {
    let mut g = c.benchmark_group("jpeg_decoders");
    g.sample_size(20);
    for (name, rel) in [
        ("baseline_2544x3056", "images/medrax_normal3.jpg"),
        (
            "progressive_2720x2458",
            "images/kermany_IM-0025-0001_normal.jpeg",
        ),
    ] {
        let bytes = data(rel);
        let opts = DecodeOptions::default();
        g.bench_function(format!("{name}/libjpeg_turbo_decode"), |b| {
            b.iter(|| decode_with(black_box(&bytes), name, &opts).expect("decode"))
        });
        g.bench_function(format!("{name}/zune_decode_before"), |b| {
            b.iter(|| zune_decode(black_box(&bytes)))
        });
        g.bench_function(format!("{name}/libjpeg_turbo_samples"), |b| {
            b.iter(|| decode_jpeg_samples(black_box(&bytes), name, u64::MAX).expect("decode"))
        });
        g.bench_function(format!("{name}/zune_samples"), |b| {
            b.iter(|| {
                image::load_from_memory_with_format(black_box(&bytes), image::ImageFormat::Jpeg)
                    .expect("zune")
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench, bench_jpeg);
criterion_main!(benches);
