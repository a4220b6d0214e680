//! Device parity and timing: every candle model run on a target device (a GPU) against a
//! reference device (the CPU) with the same weights and inputs, each with its own tolerance,
//! and the forward passes timed on both. `hilum gpu-check` prints the rows;
//! `scripts/gpu_check.sh` runs it on a GPU machine. Weights are seeded (the architecture at full
//! size, fan-in scaled so activations stay of order one) except the lung U-Net, whose real
//! weights are used when a path is given: a GPU machine needs no model downloads.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Module, Tensor};
use candle_nn::VarBuilder;

use crate::{llava, pspnet, report, sam, unet, xrv, Backend, Device, ModelError};

/// What to run.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The device whose output is taken as right (normally the CPU).
    pub reference: Device,
    /// The device checked against it.
    pub target: Device,
    /// Small batches and one timed call: checks the plumbing in seconds (CPU dry runs).
    pub quick: bool,
    /// Timed calls per measurement (after one untimed warm-up).
    pub iterations: usize,
    /// A radiograph (luminance, 0..=max) for the image models; seeded noise when absent.
    pub image: Option<Gray>,
    /// The real lung U-Net's `model.safetensors`; seeded weights when absent.
    pub unet_weights: Option<PathBuf>,
    /// Only these checks (names as in [`CHECKS`]); all when empty.
    pub only: Vec<String>,
}

/// A grayscale image for the checks.
#[derive(Clone, Debug)]
pub struct Gray {
    /// Luminance values, row by row.
    pub pixels: Vec<f32>,
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// The value of full white.
    pub max_value: f32,
}

/// One model's result: agreement between the devices and its timings.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CheckRow {
    /// The check's name.
    pub model: String,
    /// What was compared (e.g. "logits", "probabilities").
    pub compared: String,
    /// max |target - reference| / max(1, max |reference|).
    pub max_rel_diff: Option<f32>,
    /// Largest `max_rel_diff` that passes.
    pub tolerance: f32,
    /// Whether the devices agreed within the tolerance (false when the check failed to run).
    pub passed: bool,
    /// Extra agreement figures (e.g. mask pixels equal, greedy tokens equal).
    pub notes: Vec<String>,
    /// The measured calls.
    pub timings: Vec<Timing>,
    /// Why the check could not run, if it could not.
    pub error: Option<String>,
}

impl CheckRow {
    /// The row of a check that could not run.
    pub fn failed(model: &str, error: String) -> CheckRow {
        CheckRow {
            model: model.into(),
            compared: String::new(),
            max_rel_diff: None,
            tolerance: 0.0,
            passed: false,
            notes: Vec::new(),
            timings: Vec::new(),
            error: Some(error),
        }
    }
}

/// Mean milliseconds of one measured call on each device.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Timing {
    /// The call measured.
    pub what: String,
    /// Mean milliseconds on the target device.
    pub target_ms: f64,
    /// Mean milliseconds on the reference device, when it was timed.
    pub reference_ms: Option<f64>,
    /// Hilum's own CPU kernels (the CPU default) where the model has them: what a GPU replaces
    /// in practice, where `reference_ms` is candle's CPU path.
    pub native_ms: Option<f64>,
}

/// The checks of Hilum's architectures ([`crate::Architectures::builtin`]), in the order
/// they run.
pub fn check_names() -> Vec<&'static str> {
    names_of(&crate::Architectures::builtin())
}

fn names_of(archs: &crate::Architectures) -> Vec<&'static str> {
    archs
        .iter()
        .flat_map(|a| a.device_checks())
        .map(|c| c.name)
        .collect()
}

/// Runs the checks of Hilum's architectures, handing each row to `on_row` as it finishes (a
/// failure is a row with its error, and the next check still runs).
pub fn run(opts: &CheckOptions, on_row: impl FnMut(&CheckRow)) -> Vec<CheckRow> {
    run_with(opts, &crate::Architectures::builtin(), on_row)
}

/// [`run`] over the device checks of the architectures in `archs`.
pub fn run_with(
    opts: &CheckOptions,
    archs: &crate::Architectures,
    mut on_row: impl FnMut(&CheckRow),
) -> Vec<CheckRow> {
    let mut rows = Vec::new();
    for check in archs.iter().flat_map(|a| a.device_checks()) {
        if !opts.only.is_empty() && !opts.only.iter().any(|o| o == check.name) {
            continue;
        }
        let row = match (check.run)(opts) {
            Ok(row) => row,
            Err(e) => CheckRow::failed(check.name, e.to_string()),
        };
        on_row(&row);
        rows.push(row);
    }
    rows
}

/// Relative max difference: |a - b| over max(1, max |a|).
pub fn rel_diff(reference: &[f32], target: &[f32]) -> f32 {
    if reference.len() != target.len() {
        return f32::INFINITY;
    }
    let scale = reference.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let mut d = 0.0f32;
    for (a, b) in reference.iter().zip(target) {
        let e = (a - b).abs();
        // f32::max would drop a NaN: a device that produced one has failed.
        if e.is_nan() {
            return f32::INFINITY;
        }
        d = d.max(e);
    }
    d / scale
}

/// Mean milliseconds of `iterations` calls of `f` after one warm-up.
pub fn mean_ms(
    iterations: usize,
    mut f: impl FnMut() -> Result<(), ModelError>,
) -> Result<f64, ModelError> {
    f()?; // warm-up: kernels compiled/loaded, caches filled
    let n = iterations.max(1);
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1000.0 / n as f64)
}

/// How many leading tokens two decodes share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn cpu_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPU reference is timed with fewer calls: its full-size passes take seconds.
fn ref_iters(o: &CheckOptions) -> usize {
    o.iterations.clamp(1, 2)
}

/// Seeded noise in [lo, hi).
fn noise(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| lo + (hi - lo) * crate::weights::xorshift_unit(&mut s))
        .collect()
}

/// The image, or a seeded one.
fn gray(o: &CheckOptions) -> Gray {
    o.image.clone().unwrap_or_else(|| Gray {
        pixels: noise(512 * 512, 7, 0.0, 255.0),
        width: 512,
        height: 512,
        max_value: 255.0,
    })
}

/// A row comparing `diff` with `tolerance`, without timings yet.
pub fn row(model: &str, compared: &str, diff: f32, tolerance: f32) -> CheckRow {
    CheckRow {
        model: model.into(),
        compared: compared.into(),
        max_rel_diff: Some(diff),
        tolerance,
        passed: diff <= tolerance,
        notes: Vec::new(),
        timings: Vec::new(),
        error: None,
    }
}

/// A VarBuilder over `tensors` on `device` (the weights of a check).
pub fn vb_on(
    tensors: &HashMap<String, Tensor>,
    device: Device,
) -> Result<VarBuilder<'static>, ModelError> {
    Ok(VarBuilder::from_tensors(
        tensors.clone(),
        DType::F32,
        &device.candle()?,
    ))
}

/// torchxrayvision's DenseNet-121 on both devices.
pub fn densenet121(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    classifier(o, xrv::XrvSpec::densenet121_res224_all(), "densenet121")
}

/// torchxrayvision's ResNet-50 on both devices.
pub fn resnet50(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    classifier(o, xrv::XrvSpec::resnet50_res512_all(), "resnet50")
}

fn classifier(
    o: &CheckOptions,
    mut spec: xrv::XrvSpec,
    name: &str,
) -> Result<CheckRow, ModelError> {
    if o.quick {
        spec.resolution = spec.resolution.min(128);
    }
    let weights = xrv::synthetic_weights(&spec.arch, 11)?;
    let make = |d: Device| -> Result<xrv::Classifier, ModelError> {
        xrv::Classifier::new(vb_on(&weights, d)?, spec.clone(), Backend::Candle, 0)
    };
    let (r, t) = (make(o.reference)?, make(o.target)?);
    let native = xrv::Classifier::new(
        vb_on(&weights, Device::Cpu)?,
        spec.clone(),
        Backend::Native,
        cpu_threads(),
    )?;
    let g = gray(o);
    let one = xrv::preprocess(&g.pixels, g.width, g.height, g.max_value, spec.resolution);
    let a = r.logits(&one, 1)?;
    let b = t.logits(&one, 1)?;
    let mut out = row(name, "logits", rel_diff(&a, &b), 1e-3);
    let batches: &[usize] = match (o.quick, name) {
        (true, _) => &[1],
        (false, "densenet121") => &[1, 16, 64],
        (false, _) => &[1, 16],
    };
    for &n in batches {
        let x: Vec<f32> = one.iter().copied().cycle().take(one.len() * n).collect();
        let target_ms = mean_ms(o.iterations, || t.logits(&x, n).map(|_| ()))?;
        // The reference is timed at batch 1 only: large CPU batches would dominate the run.
        let reference_ms = if n == 1 {
            Some(mean_ms(ref_iters(o), || r.logits(&x, n).map(|_| ()))?)
        } else {
            None
        };
        out.timings.push(Timing {
            what: format!("batch {n}"),
            target_ms,
            reference_ms,
            native_ms: Some(mean_ms(ref_iters(o), || native.logits(&x, n).map(|_| ()))?),
        });
    }
    Ok(out)
}

/// The device check of its architecture (see the module doc).
pub fn lung_unet(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    let cfg = unet::Config::lung_seg_valiou_088();
    let (weights, what) = match &o.unet_weights {
        Some(p) => {
            let vb = crate::weights::var_builder(p, Device::Cpu)?;
            let mut m = HashMap::new();
            for name in unet::expected_params().keys() {
                m.insert(name.clone(), vb.get_unchecked(name)?);
            }
            (m, "probabilities (real weights)")
        }
        None => (
            crate::weights::seeded(&unet::expected_params(), 13),
            "probabilities (seeded weights)",
        ),
    };
    let s = cfg.input_size;
    let g = gray(o);
    let input = unet::preprocess_gray(&g.pixels, g.width, g.height, s);
    let run = |net: &unet::LungUnet,
               d: &candle_core::Device,
               x: &[f32],
               n: usize|
     -> Result<Vec<f32>, ModelError> {
        let x = Tensor::from_slice(x, (n, s, s, 3), d)?;
        Ok(net.forward(&x)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (rd, td) = (o.reference.candle()?, o.target.candle()?);
    let r = unet::LungUnet::load(vb_on(&weights, o.reference)?, &cfg)?;
    let t = unet::LungUnet::load(vb_on(&weights, o.target)?, &cfg)?;
    let native = unet::LungSegmenter::new(
        vb_on(&weights, Device::Cpu)?,
        &cfg,
        Backend::Native,
        cpu_threads(),
    )?;
    let a = run(&r, &rd, &input, 1)?;
    let b = run(&t, &td, &input, 1)?;
    let mut out = row("lung-unet", what, rel_diff(&a, &b), 1e-4);
    let same = a
        .iter()
        .zip(&b)
        .filter(|(x, y)| (**x >= 0.5) == (**y >= 0.5))
        .count();
    out.notes.push(format!(
        "mask pixels equal: {same} of {} ({:.4}%)",
        a.len(),
        100.0 * same as f64 / a.len().max(1) as f64
    ));
    for n in if o.quick { vec![1] } else { vec![1, 8] } {
        // The batch is built before the clock starts: the timings are of the forward passes.
        let x: Vec<f32> = input
            .iter()
            .copied()
            .cycle()
            .take(input.len() * n)
            .collect();
        let images = vec![input.clone(); n];
        out.timings.push(Timing {
            what: format!("batch {n}"),
            target_ms: mean_ms(o.iterations, || run(&t, &td, &x, n).map(|_| ()))?,
            reference_ms: if n == 1 {
                Some(mean_ms(ref_iters(o), || run(&r, &rd, &x, n).map(|_| ()))?)
            } else {
                None
            },
            native_ms: Some(mean_ms(ref_iters(o), || {
                native.predict(&images).map(|_| ())
            })?),
        });
    }
    Ok(out)
}

/// The device check of its architecture (see the module doc).
pub fn psp(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    let mut cfg = pspnet::Config::chestx_det();
    if o.quick {
        cfg.input_size = 64;
    }
    let weights = crate::weights::seeded(&pspnet::expected_params(&cfg)?, 17);
    let g = gray(o);
    let s = cfg.input_size;
    let input = pspnet::preprocess(&g.pixels, g.width, g.height, g.max_value, s);
    let run = |net: &pspnet::PspNet, d: &candle_core::Device| -> Result<Vec<f32>, ModelError> {
        let x = Tensor::from_slice(&input, (1, 3, s, s), d)?;
        Ok(net.forward(&x)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let (rd, td) = (o.reference.candle()?, o.target.candle()?);
    let r = pspnet::PspNet::load(vb_on(&weights, o.reference)?, &cfg)?;
    let t = pspnet::PspNet::load(vb_on(&weights, o.target)?, &cfg)?;
    let a = run(&r, &rd)?;
    let b = run(&t, &td)?;
    let mut out = row("pspnet", "logits", rel_diff(&a, &b), 1e-3);
    out.timings.push(Timing {
        what: format!("batch 1 ({s} px)"),
        target_ms: mean_ms(o.iterations, || run(&t, &td).map(|_| ()))?,
        reference_ms: Some(mean_ms(ref_iters(o), || run(&r, &rd).map(|_| ()))?),
        native_ms: None,
    });
    Ok(out)
}

/// The device check of its architecture (see the module doc).
pub fn medsam(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    let mut cfg = sam::Config::vit_b();
    if o.quick {
        cfg.image_size = 128;
        cfg.encoder_depth = 2;
        cfg.window_size = 4;
    }
    let r = sam::random(&cfg, 19, o.reference)?;
    let t = sam::random(&cfg, 19, o.target)?;
    let g = gray(o);
    let s = cfg.image_size;
    let input = sam::preprocess(&g.pixels, g.width, g.height, g.max_value, s);
    let ea = r.embed_prepared(&input)?;
    let eb = t.embed_prepared(&input)?;
    let va = ea.flatten_all()?.to_vec1::<f32>()?;
    let vb = eb.flatten_all()?.to_vec1::<f32>()?;
    let enc = rel_diff(&va, &vb);
    let q = s as f32;
    let prompt = sam::Prompt {
        bbox: Some([0.2 * q, 0.25 * q, 0.7 * q, 0.8 * q]),
        ..Default::default()
    };
    // The decoder on each device from the same (reference) embedding, so its own error shows.
    let eb_ref = ea.to_device(t.device())?;
    let (la, _) = r.predict_low_res(&ea, &prompt)?;
    let (lb, _) = t.predict_low_res(&eb_ref, &prompt)?;
    let dec = rel_diff(&la, &lb);
    let mut out = row(
        "medsam",
        "encoder embedding; decoder logits",
        enc.max(dec),
        1e-3,
    );
    out.notes
        .push(format!("encoder {enc:.2e}, decoder {dec:.2e}"));
    out.timings.push(Timing {
        what: format!("encoder ({s} px)"),
        target_ms: mean_ms(o.iterations, || {
            t.embed_prepared(&input)?.flatten_all()?.to_vec1::<f32>()?;
            Ok(())
        })?,
        reference_ms: Some(mean_ms(ref_iters(o), || {
            r.embed_prepared(&input)?.flatten_all()?.to_vec1::<f32>()?;
            Ok(())
        })?),
        native_ms: None,
    });
    out.timings.push(Timing {
        what: "decoder (box)".into(),
        target_ms: mean_ms(o.iterations, || {
            t.predict_low_res(&eb_ref, &prompt).map(|_| ())
        })?,
        reference_ms: Some(mean_ms(ref_iters(o), || {
            r.predict_low_res(&ea, &prompt).map(|_| ())
        })?),
        native_ms: None,
    });
    Ok(out)
}

/// The device check of its architecture (see the module doc).
pub fn report_model(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    let cfg = report::Config::chexpert_plus_baseline(30522);
    let weights = crate::weights::seeded(&report::expected_params(&cfg), 23);
    let size = 256;
    let pixels = noise(3 * size * size, 29, -2.0, 2.0);
    let gen = report::GenerationConfig {
        num_beams: 1,
        max_length: if o.quick { 8 } else { 64 },
        length_penalty: 1.0,
        early_stopping: true,
        decoder_start_token_id: 101,
        eos_token_id: None,
    };
    let make = |d: Device| -> Result<(report::ReportNet, Tensor), ModelError> {
        let net = report::ReportNet::new(&cfg, vb_on(&weights, d)?)?;
        let x = Tensor::from_slice(&pixels, (1, 3, size, size), &d.candle()?)?;
        Ok((net, x))
    };
    let (rn, rx) = make(o.reference)?;
    let (tn, tx) = make(o.target)?;
    let sa = rn.encode(&rx)?;
    let sb = tn.encode(&tx)?;
    let ids_a = Tensor::new(&[[101u32, 1996, 4958]], sa.device())?;
    let ids_b = Tensor::new(&[[101u32, 1996, 4958]], sb.device())?;
    let la = rn.logits(&sa, &ids_a)?.flatten_all()?.to_vec1::<f32>()?;
    let lb = tn.logits(&sb, &ids_b)?.flatten_all()?.to_vec1::<f32>()?;
    let mut out = row(
        "report",
        "decoder logits (3 tokens)",
        rel_diff(&la, &lb),
        1e-3,
    );
    let ga = rn.generate(&rx, &gen)?;
    let gb = tn.generate(&tx, &gen)?;
    let same = common_prefix(&ga.ids, &gb.ids);
    out.notes.push(format!(
        "greedy tokens equal: first {same} of {} (seeded weights: near-ties may differ)",
        ga.ids.len().max(gb.ids.len())
    ));
    let per_token = |net: &report::ReportNet, x: &Tensor, n: usize| -> Result<f64, ModelError> {
        let mut tokens = 0;
        let ms = mean_ms(n, || {
            tokens = net.generate(x, &gen)?.new_tokens();
            Ok(())
        })?;
        Ok(ms / tokens.max(1) as f64)
    };
    out.timings.push(Timing {
        what: format!("decode, ms/token ({} tokens)", gen.max_length - 1),
        target_ms: per_token(&tn, &tx, o.iterations)?,
        reference_ms: Some(per_token(&rn, &rx, ref_iters(o))?),
        native_ms: None,
    });
    Ok(out)
}

/// LLaVA-Med v1.5's shapes (CLIP ViT-L/14-336 and Mistral-7B) with fewer layers: the vision
/// tower's 3 and the decoder's 2 layers at full width exercise every kernel the full model runs.
fn llava_config(quick: bool) -> Result<llava::Config, ModelError> {
    let (hidden, inter, heads, kv, vocab, image, patch, vh, vi, vheads) = if quick {
        (64, 128, 4, 2, 256, 56, 14, 32, 64, 4)
    } else {
        (4096, 14336, 32, 8, 32064, 336, 14, 1024, 4096, 16)
    };
    let seq = (image / patch) * (image / patch);
    let text = serde_json::json!({
        "image_seq_length": seq,
        "image_token_index": vocab - 64,
        "model_type": "llava",
        "multimodal_projector_bias": true,
        "projector_hidden_act": "gelu",
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "text_config": {
            "hidden_act": "silu", "hidden_size": hidden, "intermediate_size": inter,
            "max_position_embeddings": 4096, "model_type": "mistral",
            "num_attention_heads": heads, "num_hidden_layers": 2, "num_key_value_heads": kv,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": null,
            "vocab_size": vocab
        },
        "vision_config": {
            "hidden_act": "quick_gelu", "hidden_size": vh, "image_size": image,
            "intermediate_size": vi, "layer_norm_eps": 1e-5, "model_type": "clip_vision_model",
            "num_attention_heads": vheads, "num_channels": 3, "num_hidden_layers": 3,
            "patch_size": patch, "projection_dim": 768
        }
    });
    llava::Config::from_json(&text.to_string())
}

/// The device check of its architecture (see the module doc).
pub fn llava_slice(o: &CheckOptions) -> Result<CheckRow, ModelError> {
    let cfg = llava_config(o.quick)?;
    let weights = crate::weights::seeded(&cfg.expected_params()?, 31);
    let image = cfg.vision_config.image_size;
    let pixels = noise(3 * image * image, 37, -1.8, 2.1);
    let seq = cfg.image_seq_length();
    let img = cfg.image_token_index;
    // Mistral's "[INST] <image> What is shown? [/INST]", folded into a small vocabulary.
    let mut prompt: Vec<u32> = [1u32, 733, 16289, 28793].iter().map(|t| t % img).collect();
    prompt.push(img);
    prompt.extend(
        [1824u32, 349, 4894, 28804, 733, 28748, 16289, 28793]
            .iter()
            .map(|t| t % img),
    );
    let ids = llava::expand_image_tokens(&prompt, img, seq);
    let make = |d: Device| -> Result<(llava::Llava, Tensor), ModelError> {
        let m = llava::Llava::load(vb_on(&weights, d)?, &cfg, llava::Precision::Dense)?;
        let x = Tensor::from_slice(&pixels, (1, 3, image, image), &d.candle()?)?;
        Ok((m, x))
    };
    let (rm, rx) = make(o.reference)?;
    let (tm, tx) = make(o.target)?;
    let last = |m: &llava::Llava, x: &Tensor| -> Result<Vec<f32>, ModelError> {
        let l = m.forward(&ids, Some(x))?;
        let n = l.dim(1)?;
        Ok(l.narrow(1, n - 1, 1)?.flatten_all()?.to_vec1::<f32>()?)
    };
    let a = last(&rm, &rx)?;
    let b = last(&tm, &tx)?;
    let mut out = row(
        "llava-slice",
        &format!("last-position logits ({} prompt tokens)", ids.len()),
        rel_diff(&a, &b),
        1e-3,
    );
    let new_tokens = if o.quick { 4 } else { 32 };
    let ga = rm.generate(&ids, Some(&rx), new_tokens, &[], |_| {})?;
    let gb = tm.generate(&ids, Some(&tx), new_tokens, &[], |_| {})?;
    let same = common_prefix(&ga.ids, &gb.ids);
    out.notes.push(format!(
        "greedy tokens equal: first {same} of {new_tokens} (seeded weights)"
    ));
    out.timings.push(Timing {
        what: "prefill (image + prompt)".into(),
        target_ms: gb.prefill_secs * 1000.0,
        reference_ms: Some(ga.prefill_secs * 1000.0),
        native_ms: None,
    });
    let per = |g: &llava::Generation| g.decode_secs * 1000.0 / g.ids.len().max(1) as f64;
    out.timings.push(Timing {
        what: "decode, ms/token".into(),
        target_ms: per(&gb),
        reference_ms: Some(per(&ga)),
        native_ms: None,
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_diff_scales_by_the_reference() {
        assert_eq!(rel_diff(&[10.0, -20.0], &[10.0, -19.0]), 1.0 / 20.0);
        assert!((rel_diff(&[0.1], &[0.3]) - 0.2).abs() < 1e-6);
        assert!(rel_diff(&[1.0], &[f32::NAN]).is_infinite());
        assert!(rel_diff(&[1.0, 2.0], &[1.0]).is_infinite());
    }

    /// The dry run on the CPU: every check runs end to end and the CPU agrees with itself.
    #[test]
    fn dry_run_on_the_cpu_passes_every_check() {
        let o = CheckOptions {
            reference: Device::Cpu,
            target: Device::Cpu,
            quick: true,
            iterations: 1,
            image: None,
            unet_weights: None,
            only: Vec::new(),
        };
        let rows = run(&o, |_| {});
        assert_eq!(rows.len(), check_names().len());
        for r in &rows {
            assert!(r.passed, "{r:?}");
            assert!(!r.timings.is_empty(), "{r:?}");
        }
    }
}
