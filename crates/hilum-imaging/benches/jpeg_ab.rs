//! Old and new JPEG decoders timed in alternation (new, old, new, old, ...), so that a busy
//! machine slows both alike; criterion's groups run one case after another instead.
//! New: `decode` (libjpeg-turbo, then f32). Old: the `image` crate's zune-jpeg, luminance and
//! f32, as `decode` did before. Prints median and minimum milliseconds per file, and how many
//! pixels the two decoders disagree on.
//! Run: `cargo bench -p hilum-imaging --bench jpeg_ab [-- ROUNDS]`.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;

use hilum_imaging::decode;

fn zune_decode(bytes: &[u8]) -> Vec<f32> {
    let img = image::load_from_memory_with_format(bytes, image::ImageFormat::Jpeg).expect("zune");
    img.into_luma8()
        .into_raw()
        .into_iter()
        .map(f32::from)
        .collect()
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn summary(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!("median {:6.1} ms, min {:6.1} ms", v[v.len() / 2], v[0])
}

fn main() {
    // `cargo bench` passes `--bench`; the first number given is the round count.
    let rounds = std::env::args()
        .skip(1)
        .find_map(|a| a.parse::<usize>().ok())
        .unwrap_or(15);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/cxr/images");
    for file in ["medrax_normal3.jpg", "kermany_IM-0025-0001_normal.jpeg"] {
        let path = root.join(file);
        let bytes = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("real data missing: {} ({e})", path.display()));
        // One untimed call each (first allocations, caches), kept to compare the pixels.
        let new_pixels = decode(&bytes, file, u64::MAX).expect("decode").pixels;
        let old_pixels = zune_decode(&bytes);
        let differ = new_pixels
            .iter()
            .zip(&old_pixels)
            .filter(|(a, b)| a != b)
            .count();
        let worst = new_pixels
            .iter()
            .zip(&old_pixels)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!(
            "{file:34} pixels differing: {differ} of {} ({:.2}%), max {worst} levels",
            new_pixels.len(),
            100.0 * differ as f64 / new_pixels.len() as f64
        );
        let (mut new, mut old) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            black_box(decode(black_box(&bytes), file, u64::MAX).expect("decode"));
            new.push(ms(t));
            let t = Instant::now();
            black_box(zune_decode(black_box(&bytes)));
            old.push(ms(t));
        }
        println!("{file:34} libjpeg-turbo {}", summary(new));
        println!("{file:34} zune (before)  {}", summary(old));
    }
}
