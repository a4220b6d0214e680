//! The local decoder on a device against the CPU, for `hilum gpu-check`'s `local-llm` row: a GGUF
//! of Qwen2.5-0.5B's shape (the default local model's architecture) with seeded Q8_0 weights is
//! written to a temporary file, loaded on both, and compared and timed. No download: a GPU
//! machine needs nothing but the binary.
//!
//! Compared: the prompt's last logits, f32 on both devices (`dense`), and greedy tokens after it.
//! Timed: the prompt (prefill) and one-token decode on the target in `dense` and `quantized`
//! modes, against candle's f32 path on the CPU (the reference) and the CPU default (`hybrid`:
//! Hilum's block kernels for decode), which is what a GPU replaces in practice.
//!
//! [`run_vlm`] does the same for Gemma 3 multimodal at MedGemma 4B's size (the `medgemma` row):
//! the whole SigLIP tower at 896 px and a slice of the decoder at full width and vocabulary, on
//! seeded f32 weights.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::model::{argmax, MatmulMode, Model, Precision};
use crate::vlm::{Gemma3Vlm, VlmConfig};
use crate::{LocalDevice, LocalError};

/// One timed measurement: mean milliseconds on the target, candle's CPU f32 path and the CPU
/// default.
#[derive(Clone, Debug)]
pub struct CheckTiming {
    /// The step timed, e.g. `decode ms/token (dense)`.
    pub what: String,
    /// Mean milliseconds on the device under test.
    pub target_ms: f64,
    /// Mean milliseconds on candle's CPU f32 path, when measured.
    pub reference_ms: Option<f64>,
    /// Mean milliseconds on the CPU default (Hilum's block kernels), when measured.
    pub native_ms: Option<f64>,
}

/// The row: agreement of the two devices and the timings.
#[derive(Clone, Debug)]
pub struct DeviceCheck {
    /// What was compared, e.g. the last logits after the prompt.
    pub compared: String,
    /// max |target - cpu| / max(1, max |cpu|) of the prompt's last logits (f32 on both).
    pub max_rel_diff: f32,
    /// Largest `max_rel_diff` that passes.
    pub tolerance: f32,
    /// Greedy tokens equal (the f32 decode must agree token for token; quantized is reported).
    pub greedy_equal: usize,
    /// Greedy tokens decoded on each device.
    pub new_tokens: usize,
    /// Remarks for the report (what was skipped, what differs).
    pub notes: Vec<String>,
    /// Timings of each step.
    pub timings: Vec<CheckTiming>,
}

impl DeviceCheck {
    /// Whether the logits agree within `tolerance` and every greedy token is equal.
    pub fn passed(&self) -> bool {
        self.max_rel_diff <= self.tolerance && self.greedy_equal == self.new_tokens
    }
}

/// Qwen2-family hyper-parameters of the seeded file.
struct Shape {
    vocab: usize,
    embd: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    ffn: usize,
}

impl Shape {
    /// Qwen2.5-0.5B (`quick`: a toy of the same layout, for CPU dry runs).
    fn qwen25_05b(quick: bool) -> Shape {
        if quick {
            Shape {
                vocab: 512,
                embd: 64,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                ffn: 128,
            }
        } else {
            Shape {
                vocab: 151_936,
                embd: 896,
                layers: 24,
                heads: 14,
                kv_heads: 2,
                ffn: 4864,
            }
        }
    }
}

/// Removes the seeded file however the check ends.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs the check on `target` (`quick`: toy sizes and few tokens); `iterations` timed calls of
/// the prompt on the target after a warm-up (the CPU gets at most 2).
pub fn run(target: LocalDevice, quick: bool, iterations: usize) -> Result<DeviceCheck, LocalError> {
    let shape = Shape::qwen25_05b(quick);
    let file = TempFile(std::env::temp_dir().join(format!(
        "hilum-devcheck-{}-{}.gguf",
        std::process::id(),
        if quick { "toy" } else { "qwen2.5-0.5b" }
    )));
    write_seeded(&file.0, &shape)?;
    let (prompt_len, new_tokens) = if quick { (16, 4) } else { (128, 32) };
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| ((i * 7919 + 13) % shape.vocab) as u32)
        .collect();
    let dev = target.open()?;
    let load = |mode: MatmulMode, dev: &Device| -> Result<Model, LocalError> {
        let (ct, mut f) = crate::model::open_gguf(&file.0)?;
        Ok(Model::load(&ct, &mut f, 4096, mode, dev)?)
    };

    let mut cpu_dense = load(MatmulMode::Dense, &Device::Cpu)?;
    let mut cpu_default = load(MatmulMode::Hybrid, &Device::Cpu)?;
    let mut gpu_dense = load(MatmulMode::Dense, &dev)?;
    let mut gpu_quant = load(MatmulMode::Quantized, &dev)?;

    let a = logits(&mut cpu_dense, &prompt)?;
    let b = logits(&mut gpu_dense, &prompt)?;
    let max_rel_diff = rel_diff(&a, &b);

    let ref_iters = iterations.clamp(1, 2);
    let prefill = |m: &mut Model, n: usize| mean_ms(n, &mut || logits(m, &prompt).map(|_| ()));
    let mut timings = vec![CheckTiming {
        what: format!("prefill {prompt_len} tokens (dense)"),
        target_ms: prefill(&mut gpu_dense, iterations.max(1))?,
        reference_ms: Some(prefill(&mut cpu_dense, ref_iters)?),
        native_ms: Some(prefill(&mut cpu_default, ref_iters)?),
    }];

    let (ga, cpu_ms) = greedy(&mut cpu_dense, &prompt, new_tokens)?;
    let (gb, dense_ms) = greedy(&mut gpu_dense, &prompt, new_tokens)?;
    let (gq, quant_ms) = greedy(&mut gpu_quant, &prompt, new_tokens)?;
    let (gh, native_ms) = greedy(&mut cpu_default, &prompt, new_tokens)?;
    let greedy_equal = common_prefix(&ga, &gb);
    timings.push(CheckTiming {
        what: "decode ms/token (dense)".into(),
        target_ms: dense_ms,
        reference_ms: Some(cpu_ms),
        native_ms: Some(native_ms),
    });
    timings.push(CheckTiming {
        what: "decode ms/token (Q8_0)".into(),
        target_ms: quant_ms,
        reference_ms: Some(cpu_ms),
        native_ms: Some(native_ms),
    });
    let notes = vec![
        format!("greedy tokens equal (f32 on both): first {greedy_equal} of {new_tokens}"),
        format!(
            "greedy tokens equal (target Q8_0 vs cpu default): first {} of {new_tokens} (seeded weights)",
            common_prefix(&gq, &gh)
        ),
        format!(
            "decode tokens/s: target {:.0} (f32) / {:.0} (Q8_0), cpu default {:.0}",
            1000.0 / dense_ms.max(1e-9),
            1000.0 / quant_ms.max(1e-9),
            1000.0 / native_ms.max(1e-9)
        ),
    ];
    Ok(DeviceCheck {
        compared: format!("last logits after {prompt_len} prompt tokens (f32)"),
        max_rel_diff,
        tolerance: 1e-3,
        greedy_equal,
        new_tokens,
        notes,
        timings,
    })
}

/// MedGemma 4B's configuration (Gemma3ForConditionalGeneration as published).
const MEDGEMMA_4B: &str = include_str!("../tests/fixtures/gemma3_vlm/medgemma_4b_config.json");
/// The tiny configuration the fidelity tests use (dry runs).
const TINY_VLM: &str = include_str!("../tests/fixtures/gemma3_vlm/tiny/config.json");
/// Decoder layers of the slice: MedGemma's 34 in f32 would be ~17 GB per device.
const VLM_SLICE_LAYERS: usize = 4;

/// Gemma 3 multimodal at MedGemma 4B's size on `target` against the CPU: the image features of
/// one 896 px picture, the prompt's last logits (picture + 32 text tokens) and greedy tokens;
/// the encoder, prefill and decode timed. `quick`: the tiny test configuration.
pub fn run_vlm(
    target: LocalDevice,
    quick: bool,
    iterations: usize,
) -> Result<DeviceCheck, LocalError> {
    let bad = |e: String| LocalError::Unsupported(format!("the check's configuration: {e}"));
    let full = VlmConfig::from_json(if quick { TINY_VLM } else { MEDGEMMA_4B }).map_err(bad)?;
    let mut cfg = full.clone();
    cfg.text.layers = cfg.text.layers.min(VLM_SLICE_LAYERS);
    cfg.text.local.truncate(cfg.text.layers);
    let params = cfg.parameters();
    let dev = target.open()?;
    let build = |d: &Device| -> Result<Gemma3Vlm, LocalError> {
        let mut get = |name: &str| -> candle_core::Result<Tensor> {
            let shape = params
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, s)| s.clone())
                .ok_or_else(|| candle_core::Error::Msg(format!("no parameter {name}")))?;
            // Seeded by name, so both devices get the same values in any loading order.
            let n: usize = shape.iter().product();
            let seed = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
            });
            Tensor::from_vec(uniform(n, seed, 0.035), shape, d)
        };
        Gemma3Vlm::from_weights(cfg.clone(), &mut get, 1024, Precision::Dense, d)
    };
    let mut cpu = build(&Device::Cpu)?;
    let mut gpu = build(&dev)?;

    // A grey gradient picture, preprocessed as MedGemma's processor does.
    let side = 1024;
    let grey: Vec<u8> = (0..side * side)
        .map(|i| ((i % side + i / side) % 256) as u8)
        .collect();
    let px_cpu = cpu.pixel_values(&grey, side, side, 1)?;
    let px_gpu = gpu.pixel_values(&grey, side, side, 1)?;
    let feats = |m: &Gemma3Vlm, px: &Tensor| -> Result<Tensor, LocalError> {
        let f = m.image_features(px)?;
        f.flatten_all()?.to_vec1::<f32>()?; // wait for the device
        Ok(f)
    };
    let fa = feats(&cpu, &px_cpu)?;
    let fb = feats(&gpu, &px_gpu)?;
    let feat_diff = rel_diff(&fa.flatten_all()?.to_vec1()?, &fb.flatten_all()?.to_vec1()?);

    let mut ids: Vec<u32> = vec![2, 105, 10];
    ids.extend(std::iter::repeat_n(
        cfg.image_token,
        cfg.mm_tokens_per_image,
    ));
    let text_tokens = if quick { 4 } else { 32 };
    ids.extend((0..text_tokens as u32).map(|i| (1000 + i) % cfg.image_token));
    let last = |m: &mut Gemma3Vlm, f: &Tensor| -> Result<(Vec<f32>, u32), LocalError> {
        m.decoder_mut().truncate_cache(0)?;
        let l = m.prefill_last(&ids, std::slice::from_ref(f))?;
        Ok((l.to_vec1::<f32>()?, argmax(&l)?))
    };
    let (la, first_a) = last(&mut cpu, &fa)?;
    let (lb, first_b) = last(&mut gpu, &fb)?;
    let max_rel_diff = rel_diff(&la, &lb).max(feat_diff);

    let new_tokens = if quick { 4 } else { 16 };
    let decode = |m: &mut Gemma3Vlm, mut next: u32| -> Result<(Vec<u32>, f64), LocalError> {
        let mut out = vec![next];
        let t = Instant::now();
        for _ in 1..new_tokens {
            next = argmax(&m.decoder_mut().forward(&[next])?)?;
            out.push(next);
        }
        Ok((
            out,
            t.elapsed().as_secs_f64() * 1000.0 / (new_tokens - 1).max(1) as f64,
        ))
    };
    let (ga, cpu_decode) = decode(&mut cpu, first_a)?;
    let (gb, gpu_decode) = decode(&mut gpu, first_b)?;
    let greedy_equal = common_prefix(&ga, &gb);

    let n = iterations.max(1);
    let encode_gpu = mean_ms(n, &mut || feats(&gpu, &px_gpu).map(|_| ()))?;
    // One timed CPU pass each (after the warm-up): the full tower takes seconds there.
    let encode_cpu = mean_ms(1, &mut || feats(&cpu, &px_cpu).map(|_| ()))?;
    let prefill_gpu = mean_ms(n, &mut || last(&mut gpu, &fb).map(|_| ()))?;
    let prefill_cpu = mean_ms(1, &mut || last(&mut cpu, &fa).map(|_| ()))?;
    let timings = vec![
        CheckTiming {
            what: format!("SigLIP {} px + projector", cfg.vision.image_size),
            target_ms: encode_gpu,
            reference_ms: Some(encode_cpu),
            native_ms: None,
        },
        CheckTiming {
            what: format!("prefill {} tokens", ids.len()),
            target_ms: prefill_gpu,
            reference_ms: Some(prefill_cpu),
            native_ms: None,
        },
        CheckTiming {
            what: format!("decode ms/token ({} layers)", cfg.text.layers),
            target_ms: gpu_decode,
            reference_ms: Some(cpu_decode),
            native_ms: None,
        },
    ];
    let notes = vec![
        format!("image features rel diff {feat_diff:.2e}"),
        format!("greedy tokens equal: first {greedy_equal} of {new_tokens} (seeded f32 weights)"),
        format!(
            "decoder: {} of {} layers at full width, vocabulary {}; the {}-layer decode at most \
             {:.1} ms/token on the target (the whole step scaled by layer count)",
            cfg.text.layers,
            full.text.layers,
            cfg.text.vocab,
            full.text.layers,
            gpu_decode * full.text.layers as f64 / cfg.text.layers as f64
        ),
    ];
    Ok(DeviceCheck {
        compared: "image features; last logits (f32)".into(),
        max_rel_diff,
        tolerance: 1e-3,
        greedy_equal,
        new_tokens,
        notes,
        timings,
    })
}

/// Mean milliseconds of `n` calls of `f` after one untimed warm-up (kernels loaded, buffers
/// sized).
fn mean_ms(n: usize, f: &mut dyn FnMut() -> Result<(), LocalError>) -> Result<f64, LocalError> {
    f()?;
    let t = Instant::now();
    for _ in 0..n {
        f()?;
    }
    Ok(t.elapsed().as_secs_f64() * 1000.0 / n as f64)
}

/// `n` values uniform in [-scale, scale) from `seed` (xorshift).
fn uniform(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// The last logits of `prompt` from an empty cache, copied to the host (a device sync).
fn logits(m: &mut Model, prompt: &[u32]) -> Result<Vec<f32>, LocalError> {
    m.truncate_cache(0)?;
    Ok(m.forward(prompt)?.to_vec1::<f32>()?)
}

/// `n` greedy tokens after `prompt`; the mean milliseconds of one decode step.
fn greedy(m: &mut Model, prompt: &[u32], n: usize) -> Result<(Vec<u32>, f64), LocalError> {
    m.truncate_cache(0)?;
    let mut next = argmax(&m.forward(prompt)?)?;
    let mut out = vec![next];
    let t = Instant::now();
    for _ in 1..n {
        next = argmax(&m.forward(&[next])?)?;
        out.push(next);
    }
    let steps = n.saturating_sub(1).max(1);
    Ok((out, t.elapsed().as_secs_f64() * 1000.0 / steps as f64))
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// max |a - b| / max(1, max |a|); a NaN or a length mismatch is infinite.
fn rel_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let scale = a.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    let mut d = 0.0f32;
    for (x, y) in a.iter().zip(b) {
        let e = (x - y).abs();
        if e.is_nan() {
            return f32::INFINITY;
        }
        d = d.max(e);
    }
    d / scale
}

/// Writes a qwen2 GGUF of `s`'s shape: matrices Q8_0 with fan-in scaled uniform noise (so
/// activations stay of order one), norms 1, small biases, tied embeddings.
fn write_seeded(path: &std::path::Path, s: &Shape) -> Result<(), LocalError> {
    let io = |e: &dyn std::fmt::Display| LocalError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    };
    let hd = s.embd / s.heads;
    let kvd = s.kv_heads * hd;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut noise = |rows: usize, cols: usize, scale: f32| -> Result<Tensor, LocalError> {
        seed = seed.wrapping_add(0x9e37_79b9);
        let v = uniform(rows * cols, seed, scale);
        Ok(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
    };
    let q8 = |t: Tensor| QTensor::quantize(&t, GgmlDType::Q8_0);
    let f32_1d = |t: Tensor| -> candle_core::Result<QTensor> {
        let n = t.elem_count();
        QTensor::quantize(&t.reshape(n)?, GgmlDType::F32)
    };
    let ones = |n: usize| Tensor::ones(n, candle_core::DType::F32, &Device::Cpu);
    let fan = |n: usize| (3.0 / n as f32).sqrt();

    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    tensors.push((
        "token_embd.weight".into(),
        q8(noise(s.vocab, s.embd, 1.0)?)?,
    ));
    tensors.push(("output_norm.weight".into(), f32_1d(ones(s.embd)?)?));
    for i in 0..s.layers {
        let p = format!("blk.{i}");
        let mut add = |name: &str, t: QTensor| tensors.push((format!("{p}.{name}"), t));
        add("attn_norm.weight", f32_1d(ones(s.embd)?)?);
        add("ffn_norm.weight", f32_1d(ones(s.embd)?)?);
        add("attn_q.weight", q8(noise(s.embd, s.embd, fan(s.embd))?)?);
        add("attn_k.weight", q8(noise(kvd, s.embd, fan(s.embd))?)?);
        add("attn_v.weight", q8(noise(kvd, s.embd, fan(s.embd))?)?);
        add("attn_q.bias", f32_1d(noise(1, s.embd, 0.1)?)?);
        add("attn_k.bias", f32_1d(noise(1, kvd, 0.1)?)?);
        add("attn_v.bias", f32_1d(noise(1, kvd, 0.1)?)?);
        add(
            "attn_output.weight",
            q8(noise(s.embd, s.embd, fan(s.embd))?)?,
        );
        add("ffn_gate.weight", q8(noise(s.ffn, s.embd, fan(s.embd))?)?);
        add("ffn_up.weight", q8(noise(s.ffn, s.embd, fan(s.embd))?)?);
        add("ffn_down.weight", q8(noise(s.embd, s.ffn, fan(s.ffn))?)?);
    }
    use gguf_file::Value;
    let meta: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("qwen2".into())),
        ("qwen2.block_count", Value::U32(s.layers as u32)),
        ("qwen2.embedding_length", Value::U32(s.embd as u32)),
        ("qwen2.feed_forward_length", Value::U32(s.ffn as u32)),
        ("qwen2.attention.head_count", Value::U32(s.heads as u32)),
        (
            "qwen2.attention.head_count_kv",
            Value::U32(s.kv_heads as u32),
        ),
        ("qwen2.context_length", Value::U32(32_768)),
        ("qwen2.attention.layer_norm_rms_epsilon", Value::F32(1e-6)),
        ("qwen2.rope.freq_base", Value::F32(1_000_000.0)),
    ];
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let f = std::fs::File::create(path).map_err(|e| io(&e))?;
    let mut w = std::io::BufWriter::new(f);
    gguf_file::write(&mut w, &meta_refs, &tensor_refs)?;
    use std::io::Write;
    w.flush().map_err(|e| io(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dry run: the CPU against itself on the toy shape agrees exactly and times every row.
    #[test]
    fn the_cpu_against_itself_passes() {
        let c = run(LocalDevice::Cpu, true, 1).unwrap();
        assert!(c.passed(), "{c:?}");
        assert_eq!(c.max_rel_diff, 0.0);
        assert_eq!(c.timings.len(), 3);
        assert!(c.timings.iter().all(|t| t.target_ms > 0.0), "{c:?}");
    }

    #[test]
    fn the_vlm_on_the_cpu_against_itself_passes() {
        let c = run_vlm(LocalDevice::Cpu, true, 1).unwrap();
        assert!(c.passed(), "{c:?}");
        assert_eq!(c.max_rel_diff, 0.0);
        assert_eq!(c.timings.len(), 3);
    }
}
