//! Where the native CPU path spends its time, per kind of layer, and how it compares with the
//! other backends, interleaved in one run:
//! `cargo run --release -p hilum-models --example xrv_profile -- MODE [batch] [iters]`
//! (`pspnet [iters]`)
//! - `densenet` | `resnet`: the classifiers (synthetic weights): native vs ONNX Runtime (when
//!   `ORT_DYLIB_PATH` is set) on a graph built from the same weights, same threads;
//! - `unet`: the real lung U-Net (imported from ../shared/data/models/lung_seg_unet): native
//!   vs candle vs ONNX Runtime (when `ORT_DYLIB_PATH` is set), same threads, with a pause before each run
//!   (`HILUM_PROFILE_PAUSE_MS`, default 20; `HILUM_PROFILE_CANDLE=0` leaves candle out);
//! - `pspnet`: the full-size ChestX-Det PSPNet at 512 px (random weights): native vs candle
//!   (`HILUM_PROFILE_CANDLE=0` skips candle's ~1 min forward).
//!
//! Threads: `HILUM_CPU_THREADS` (default all cores), used by the native kernels and ONNX
//! Runtime; candle uses its global pool of all cores.

use std::time::Instant;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use hilum_kernels::Profile;
use hilum_models::xrv::{self, Classifier, XrvSpec};
use hilum_models::{Backend, ModelSettings};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms<T>(f: impl FnOnce() -> Res<T>) -> Res<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("densenet");
    let batch: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1);
    let iters: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(20);
    // The same variables as `hilum` (HILUM_CPU_*, HILUM_UNET_*, ORT_DYLIB_PATH). The timed
    // runs are not profiled; one last run is (HILUM_CPU_PROFILE=2: per output size too).
    let mut settings = ModelSettings::from_vars(|k| std::env::var(k).ok());
    let last = match settings.cpu.profile {
        Profile::Off => Profile::Ops,
        p => p,
    };
    settings.cpu.profile = Profile::Off;
    settings.apply_process_wide();
    match mode {
        "unet" => unet(&settings, batch, iters),
        // pspnet [iters]: no batch argument.
        "pspnet" => pspnet(
            &settings,
            args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3),
        ),
        "resnet" => classifier(
            &settings,
            last,
            XrvSpec::resnet50_res512_all(),
            batch,
            iters,
        ),
        _ => classifier(
            &settings,
            last,
            XrvSpec::densenet121_res224_all(),
            batch,
            iters,
        ),
    }
}

fn classifier(
    settings: &ModelSettings,
    last: Profile,
    spec: XrvSpec,
    batch: usize,
    iters: usize,
) -> Res<()> {
    let w = xrv::synthetic_weights(&spec.arch, 7)?;
    let vb = VarBuilder::from_tensors(w, DType::F32, &Device::Cpu);
    let threads = settings.cpu.threads();
    let m = Classifier::new(vb.clone(), spec.clone(), Backend::Native, threads)?;
    // ONNX Runtime on a graph built from the same weights, when its library is available.
    let ort = if cfg!(feature = "onnx") && settings.ort_dylib.is_some() {
        Some(Classifier::new(vb, spec.clone(), Backend::Onnx, threads)?)
    } else {
        println!("ONNX Runtime skipped: ORT_DYLIB_PATH is not set");
        None
    };
    let x: Vec<f32> = (0..batch * spec.resolution * spec.resolution)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    // Warm-up (workspace, ORT's arena).
    let a = m.logits(&x, batch)?;
    if let Some(o) = &ort {
        let b = o.logits(&x, batch)?;
        let diff = a
            .iter()
            .zip(&b)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        println!("max |native - ORT| logit difference: {diff:.2e}");
    }
    // Alternating blocks of runs, each after a pause and a discarded run: ONNX Runtime's
    // workers keep spinning after a run (stealing the cores from a native run right after it),
    // and both backends' pools need a run to become hot again after the other one ran.
    let rounds = (iters / 5).clamp(1, 6);
    let per = iters.div_ceil(rounds);
    let block = |f: &dyn Fn() -> Res<()>, out: &mut Vec<f64>| -> Res<()> {
        std::thread::sleep(std::time::Duration::from_millis(200));
        f()?;
        for _ in 0..per {
            out.push(ms(f)?);
        }
        Ok(())
    };
    let (mut nat, mut onx) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        block(&|| Ok(m.logits(&x, batch).map(drop)?), &mut nat)?;
        if let Some(o) = &ort {
            block(&|| Ok(o.logits(&x, batch).map(drop)?), &mut onx)?;
        }
    }
    let n_min = nat.iter().copied().fold(f64::INFINITY, f64::min);
    let n = median(nat);
    println!(
        "{} batch {batch}, {threads} threads, medians of {} runs ({rounds} alternating blocks):",
        spec.id,
        rounds * per
    );
    println!("  native       {n:>8.2} ms  (min {n_min:.2})");
    if !onx.is_empty() {
        let o_min = onx.iter().copied().fold(f64::INFINITY, f64::min);
        let o = median(onx);
        println!(
            "  ONNX Runtime {o:>8.2} ms  (min {o_min:.2})  native / ORT = {:.3} (mins {:.3})",
            n / o,
            n_min / o_min
        );
    }
    hilum_kernels::set_profile(last);
    m.logits(&x, batch)?;
    Ok(())
}

fn shared_data() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data")
}

fn unet(settings: &ModelSettings, batch: usize, iters: usize) -> Res<()> {
    use hilum_models::unet::{self, LungSegmenter};
    use hilum_models::{ImportOptions, ModelPool, ModelRegistry};
    let dir = tempfile::tempdir()?;
    let reg = ModelRegistry::new(dir.path())?;
    let h5 = shared_data().join("models/lung_seg_unet/lung_seg_valiou_088.h5");
    hilum_models::import(&reg, "lung-unet", &h5, &ImportOptions::default())?;
    let pool = ModelPool::with_settings(std::sync::Arc::new(reg), settings.clone());
    let on = |backend| {
        pool.get_or_load::<LungSegmenter>("lung-unet", hilum_models::Device::Cpu, backend)
    };
    let m = on(Backend::Native)?;
    let threads = settings.cpu.threads();
    let s = m.config().input_size;
    // A real radiograph through the model's own preprocessing.
    let img =
        image::open(shared_data().join("cxr/images/nih_00000001_000_cardiomegaly.png"))?.to_luma8();
    let gray: Vec<f32> = img.as_raw().iter().map(|&v| v as f32).collect();
    let x = unet::preprocess_gray(&gray, img.width() as usize, img.height() as usize, s);
    let xs = vec![x; batch];
    #[cfg(feature = "onnx")]
    let ort = match hilum_models::onnx::dylib_path() {
        Some(_) => Some(hilum_models::onnx::OnnxModel::load(
            &shared_data().join("models/lung_seg_unet/lung_seg_valiou_088.onnx"),
            threads,
        )?),
        None => {
            println!("ONNX Runtime skipped: ORT_DYLIB_PATH is not set");
            None
        }
    };
    let flat: Vec<f32> = xs.concat();
    // `HILUM_PROFILE_CANDLE=0` leaves candle out (as for pspnet).
    let with_candle = std::env::var("HILUM_PROFILE_CANDLE").as_deref() != Ok("0");
    let candle = if with_candle {
        Some(on(Backend::Candle)?)
    } else {
        None
    };
    // Warm-up (ORT's arena, the native workspace).
    m.predict(&xs)?;
    if let Some(c) = &candle {
        c.predict(&xs)?;
    }
    #[cfg(feature = "onnx")]
    if let Some(o) = &ort {
        o.run(&[batch, s, s, 3], &flat)?;
    }
    let (mut nat, mut can, mut onx) = (Vec::new(), Vec::new(), Vec::new());
    // ORT's and rayon's workers keep spinning for a while after a run; a pause before each run
    // keeps them from taking the next backend's cores (`HILUM_PROFILE_PAUSE_MS`, default 20;
    // 0 runs back to back).
    let pause_ms: u64 = std::env::var("HILUM_PROFILE_PAUSE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let pause = || std::thread::sleep(std::time::Duration::from_millis(pause_ms));
    for i in 0..iters {
        pause();
        nat.push(ms(|| Ok(m.predict(&xs)?))?);
        #[cfg(feature = "onnx")]
        if let Some(o) = &ort {
            pause();
            onx.push(ms(|| Ok(o.run(&[batch, s, s, 3], &flat)?))?);
        }
        // candle is ~10x slower: one run in four.
        if let (0, Some(c)) = (i % 4, &candle) {
            pause();
            can.push(ms(|| Ok(c.predict(&xs)?))?);
        }
    }
    let _ = &flat;
    let n = median(nat);
    println!(
        "lung U-Net {s}x{s}, batch {batch}, {threads} threads, medians of interleaved runs \
         ({iters} native/ORT, {} candle, {pause_ms} ms pause before each):",
        iters.div_ceil(4)
    );
    println!("  native       {n:>8.2} ms");
    if with_candle {
        let c = median(can);
        println!("  candle       {c:>8.2} ms  ({:.1}x native)", c / n);
    }
    if !onx.is_empty() {
        let o = median(onx);
        println!("  ONNX Runtime {o:>8.2} ms  (native / ORT = {:.2})", n / o);
    }
    hilum_kernels::set_profile(Profile::Ops);
    m.predict(&xs)?;
    Ok(())
}

fn pspnet(settings: &ModelSettings, iters: usize) -> Res<()> {
    use hilum_models::pspnet::{AnatomySegmenter, Config};
    let cfg = Config::chestx_det();
    let map = candle_nn::VarMap::new();
    let vb = VarBuilder::from_varmap(&map, DType::F32, &Device::Cpu);
    let threads = settings.cpu.threads();
    let t0 = std::time::Instant::now();
    let model = AnatomySegmenter::new(vb.clone(), &cfg, Backend::Native, threads)?;
    let t = t0.elapsed().as_secs_f64() * 1e3;
    println!("PSPNet native plan built (BN folded) in {t:.0} ms");
    let x = x_of(&cfg);
    model.probabilities(&x)?;
    let mut nat = Vec::new();
    for _ in 0..iters.max(1) {
        nat.push(ms(|| Ok(model.probabilities(&x)?))?);
    }
    let n = median(nat);
    println!(
        "PSPNet {0}x{0}, batch 1, {threads} threads: native {n:.0} ms (median of {1})",
        cfg.input_size,
        iters.max(1)
    );
    if std::env::var("HILUM_PROFILE_CANDLE").as_deref() != Ok("0") {
        let candle = AnatomySegmenter::new(vb, &cfg, Backend::Candle, threads)?;
        let c = ms(|| Ok(candle.probabilities(&x)?))?;
        println!("  candle {c:.0} ms ({:.1}x native)", c / n);
    }
    hilum_kernels::set_profile(Profile::Ops);
    model.probabilities(&x)?;
    Ok(())
}

/// A constant PSPNet input (only the time matters).
fn x_of(cfg: &hilum_models::pspnet::Config) -> Vec<f32> {
    vec![0.1f32; 3 * cfg.input_size * cfg.input_size]
}
