//! The local decoders (`hilum_llm_local`) on f32 weights in Hugging Face's layout: Qwen2.5-0.5B's
//! shape (the default local model's architecture) through `Model::from_dense`, and MedGemma 4B's
//! decoder shape (Gemma 3: q/k norms, sandwich norms, GELU-tanh FFN, local sliding-window layers
//! with their own rotary base) through `Gemma3::from_dense`, as a slice of its first layers at
//! full width and vocabulary. Greedy decode with the KV cache, timed per token.

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{Device as CDevice, Tensor};
use hilum_llm_local::gemma3::{Gemma3, Gemma3Config};
use hilum_llm_local::model::{argmax, Arch, Config, DenseLayout, Model, Precision, Rope};
use serde_json::{json, Value};

use crate::Res;

/// The decoder's shape, shared with the PyTorch side as JSON.
struct Spec {
    family: &'static str,
    vocab: usize,
    hidden: usize,
    layers: usize,
    /// Layers of the whole model (the slice's times scale to it).
    full_layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    eps: f64,
    rope_base: f32,
    /// Gemma 3: the local layers' base, the global layers' linear factor, the window, which
    /// layers are local, the query scale.
    rope_local_base: f32,
    rope_scale: f32,
    window: usize,
    local: Vec<bool>,
    attn_scale: f64,
}

pub fn is_decoder(arch: &str) -> bool {
    arch.starts_with("qwen2-") || arch.starts_with("gemma3-")
}

fn spec(arch: &str) -> Res<Spec> {
    let qwen = |vocab, hidden, layers, heads, kv_heads, ffn| Spec {
        family: "qwen2",
        vocab,
        hidden,
        layers,
        full_layers: layers,
        heads,
        kv_heads,
        head_dim: hidden / heads,
        ffn,
        eps: 1e-6,
        rope_base: 1_000_000.0,
        rope_local_base: 0.0,
        rope_scale: 1.0,
        window: 0,
        local: Vec::new(),
        attn_scale: 1.0 / ((hidden / heads) as f64).sqrt(),
    };
    let gemma = |vocab, hidden, (layers, full), (heads, kv_heads, head_dim), ffn, window, every| {
        Spec {
            family: "gemma3",
            vocab,
            hidden,
            layers,
            full_layers: full,
            heads,
            kv_heads,
            head_dim,
            ffn,
            eps: 1e-6,
            rope_base: 1_000_000.0,
            rope_local_base: 10_000.0,
            rope_scale: 8.0,
            window,
            // Every `every`-th layer is global, the others local.
            local: (0..layers).map(|i| (i + 1) % every != 0).collect(),
            attn_scale: 1.0 / (head_dim as f64).sqrt(),
        }
    };
    Ok(match arch {
        // Qwen2.5-0.5B: 24 layers of 896, 14 query / 2 kv heads, FFN 4864, tied embeddings.
        "qwen2-0.5b" => qwen(151_936, 896, 24, 14, 2, 4864),
        "qwen2-tiny" => qwen(512, 64, 2, 4, 2, 128),
        // MedGemma 4B's decoder (34 layers of 2560, 8 / 4 heads of 256, FFN 10240, window 1024,
        // one global layer in 6): its first 6 layers, so one of them is global.
        "gemma3-4b-slice" => gemma(262_208, 2560, (6, 34), (8, 4, 256), 10_240, 1024, 6),
        // Window 10 under a 16-token prompt: the sliding window is exercised.
        "gemma3-tiny" => gemma(300, 48, (3, 3), (3, 1, 20), 88, 10, 2),
        other => return Err(format!("unknown decoder `{other}`").into()),
    })
}

impl Spec {
    fn json(&self) -> Value {
        json!({
            "family": self.family, "vocab": self.vocab, "hidden": self.hidden,
            "layers": self.layers, "full_layers": self.full_layers, "heads": self.heads,
            "kv_heads": self.kv_heads, "head_dim": self.head_dim, "ffn": self.ffn,
            "eps": self.eps, "rope_base": self.rope_base, "rope_local_base": self.rope_local_base,
            "rope_scale": self.rope_scale, "window": self.window, "local": self.local,
            "attn_scale": self.attn_scale,
        })
    }

    /// Every parameter in Hugging Face's names with its shape, seeded amplitude and centre.
    fn params(&self) -> Vec<(String, Vec<usize>, f32, f32)> {
        let (d, f, hd) = (self.hidden, self.ffn, self.head_dim);
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let fan = |n: usize| (3.0 / n as f32).sqrt();
        let mut out = Vec::new();
        let gemma = self.family == "gemma3";
        let pre = if gemma { "" } else { "model." };
        // Gemma's norm weights multiply as 1 + w: near 0; Qwen's as w: near 1.
        let (norm, centre) = (0.2, if gemma { 0.0 } else { 1.0 });
        out.push((
            format!("{pre}embed_tokens.weight"),
            vec![self.vocab, d],
            1.0,
            0.0,
        ));
        out.push((format!("{pre}norm.weight"), vec![d], norm, centre));
        for i in 0..self.layers {
            let p = format!("{pre}layers.{i}");
            let mut add = |s: &str, shape: Vec<usize>, amp| {
                let c = if s.contains("norm") { centre } else { 0.0 };
                out.push((format!("{p}.{s}"), shape, amp, c))
            };
            add("input_layernorm.weight", vec![d], norm);
            add("post_attention_layernorm.weight", vec![d], norm);
            add("self_attn.q_proj.weight", vec![q, d], fan(d));
            add("self_attn.k_proj.weight", vec![kv, d], fan(d));
            add("self_attn.v_proj.weight", vec![kv, d], fan(d));
            add("self_attn.o_proj.weight", vec![d, q], fan(q));
            add("mlp.gate_proj.weight", vec![f, d], fan(d));
            add("mlp.up_proj.weight", vec![f, d], fan(d));
            add("mlp.down_proj.weight", vec![d, f], fan(f));
            if gemma {
                add("self_attn.q_norm.weight", vec![hd], norm);
                add("self_attn.k_norm.weight", vec![hd], norm);
                add("pre_feedforward_layernorm.weight", vec![d], norm);
                add("post_feedforward_layernorm.weight", vec![d], norm);
            } else {
                // `DenseLayout::attention_bias` gives all four projections a bias.
                for (s, n) in [("q", q), ("k", kv), ("v", kv), ("o", d)] {
                    add(&format!("self_attn.{s}_proj.bias"), vec![n], 0.1);
                }
            }
        }
        out
    }
}

/// Seeded weights (uniform: matrices with unit-variance outputs, biases 0.1, norms about 1);
/// prints the shape.
pub fn weights(arch: &str, out: &std::path::Path) -> Res<String> {
    let s = spec(arch)?;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut ts = HashMap::new();
    for (name, shape, amp, centre) in s.params() {
        let n: usize = shape.iter().product();
        let mut v = crate::uniform(&mut state, n, amp);
        v.iter_mut().for_each(|x| *x += centre);
        ts.insert(name, Tensor::from_vec(v, shape, &CDevice::Cpu)?);
    }
    candle_core::safetensors::save(&ts, out)?;
    Ok(s.json().to_string())
}

enum Decoder {
    Qwen(Box<Model>),
    Gemma(Box<Gemma3>),
}

impl Decoder {
    fn load(s: &Spec, path: &str, dev: &CDevice, positions: usize) -> Res<Decoder> {
        let mut ts = candle_core::safetensors::load(path, dev)?;
        let mut get = |name: &str| {
            ts.remove(name)
                .ok_or_else(|| candle_core::Error::Msg(format!("no tensor {name}")))
        };
        if s.family == "qwen2" {
            let cfg = Config {
                arch: Arch::Qwen2,
                n_layer: s.layers,
                n_embd: s.hidden,
                n_head: s.heads,
                n_kv_head: s.kv_heads,
                head_dim: s.head_dim,
                context_length: 32_768,
                rms_eps: s.eps,
                rope_base: s.rope_base,
                rope: Rope::Halves,
            };
            let layout = DenseLayout {
                vocab: s.vocab,
                intermediate: s.ffn,
                attention_bias: true,
                mlp_bias: false,
                tied_embeddings: true,
                quantize: None,
            };
            let m = Model::from_dense(cfg, &layout, &mut get, positions, dev)?;
            return Ok(Decoder::Qwen(Box::new(m)));
        }
        let cfg = Gemma3Config {
            n_layer: s.layers,
            n_embd: s.hidden,
            n_head: s.heads,
            n_kv_head: s.kv_heads,
            head_dim: s.head_dim,
            context_length: 131_072,
            rms_eps: s.eps,
            rope_base_global: s.rope_base,
            rope_base_local: s.rope_local_base,
            sliding_window: s.window,
            local: s.local.clone(),
            attn_scale: s.attn_scale,
            rope_scale_global: s.rope_scale,
            final_softcap: None,
        };
        let m = Gemma3::from_dense(cfg, &mut get, positions, Precision::Dense, dev)?;
        Ok(Decoder::Gemma(Box::new(m)))
    }

    /// The logits of the last of `tokens`, after the cached positions.
    fn forward(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        match self {
            Decoder::Qwen(m) => m.forward(tokens),
            Decoder::Gemma(m) => m.forward(tokens),
        }
    }

    fn reset(&mut self) -> candle_core::Result<()> {
        match self {
            Decoder::Qwen(m) => m.truncate_cache(0),
            Decoder::Gemma(m) => m.truncate_cache(0),
        }
    }
}

/// One greedy generation from an empty cache: the prompt's last logits, the tokens, prefill ms
/// and decode ms per token (each step reads its token back: a device sync, as a sampler does).
fn generate(m: &mut Decoder, prompt: &[u32], new: usize) -> Res<(Tensor, Vec<u32>, f64, f64)> {
    m.reset()?;
    let t = Instant::now();
    let logits = m.forward(prompt)?;
    let mut next = argmax(&logits)?;
    let prefill = t.elapsed().as_secs_f64() * 1e3;
    let mut tokens = vec![next];
    let t = Instant::now();
    for _ in 1..new {
        next = argmax(&m.forward(&[next])?)?;
        tokens.push(next);
    }
    let per_token = t.elapsed().as_secs_f64() * 1e3 / (new - 1).max(1) as f64;
    Ok((logits, tokens, prefill, per_token))
}

/// `decode ARCH WEIGHTS DEVICE PROMPT NEW ITERS OUT`.
pub fn decode(a: &[String]) -> Res<()> {
    let s = spec(&a[0])?;
    let device: hilum_models::Device = a[2].parse()?;
    let (prompt_len, new): (usize, usize) = (a[3].parse()?, a[4].parse::<usize>()?.max(2));
    let iters: usize = a[5].parse::<usize>()?.max(1);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| ((i * 7919 + 13) % s.vocab) as u32)
        .collect();
    let mut m = Decoder::load(&s, &a[1], &device.candle()?, prompt_len + new + 8)?;
    let (logits, tokens, _, _) = generate(&mut m, &prompt, new)?; // warm-up
    let (mut prefill, mut per_token) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let (_, again, p, d) = generate(&mut m, &prompt, new)?;
        if again != tokens {
            return Err("greedy decode is not deterministic across runs".into());
        }
        prefill.push(p);
        per_token.push(d);
    }
    let (prefill_ms, _) = crate::median_min(&mut prefill);
    let (ms_per_token, min_per_token) = crate::median_min(&mut per_token);
    let v: Vec<f32> = logits.to_vec1()?;
    let n = v.len();
    crate::save_output(&a[6], v, &[n], HashMap::new())?;
    let line = json!({
        "prefill_ms": prefill_ms, "median_ms": ms_per_token, "min_ms": min_per_token,
        "iters": iters, "prompt": prompt, "tokens": tokens, "device": device.to_string(),
        "backend": "candle f32",
    });
    println!("{line}");
    Ok(())
}
