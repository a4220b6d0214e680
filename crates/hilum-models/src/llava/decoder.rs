//! The Llama / Mistral text decoder (`models/llama/modeling_llama.py`) with its KV cache.

use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Tensor};
use candle_nn::{Embedding, RmsNorm, VarBuilder};

use super::config::*;
use super::layers::*;

// --- Llama / Mistral decoder ------------------------------------------------------------------

#[derive(Debug)]
pub(crate) struct DecoderLayer {
    pub(crate) q_proj: Lin,
    pub(crate) k_proj: Lin,
    pub(crate) v_proj: Lin,
    pub(crate) o_proj: Lin,
    pub(crate) gate_proj: Lin,
    pub(crate) up_proj: Lin,
    pub(crate) down_proj: Lin,
    pub(crate) input_layernorm: RmsNorm,
    pub(crate) post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    pub(crate) fn load(
        vb: VarBuilder,
        t: &Decoder,
        p: Precision,
    ) -> candle_core::Result<DecoderLayer> {
        let (h, hd, i) = (t.hidden_size, t.head_dim, t.intermediate_size);
        let (q, kv) = (t.num_attention_heads * hd, t.num_key_value_heads * hd);
        let a = vb.pp("self_attn");
        let m = vb.pp("mlp");
        Ok(DecoderLayer {
            q_proj: Lin::load(a.pp("q_proj"), h, q, t.attention_bias, p)?,
            k_proj: Lin::load(a.pp("k_proj"), h, kv, t.attention_bias, p)?,
            v_proj: Lin::load(a.pp("v_proj"), h, kv, t.attention_bias, p)?,
            o_proj: Lin::load(a.pp("o_proj"), q, h, t.attention_bias, p)?,
            gate_proj: Lin::load(m.pp("gate_proj"), h, i, t.mlp_bias, p)?,
            up_proj: Lin::load(m.pp("up_proj"), h, i, t.mlp_bias, p)?,
            down_proj: Lin::load(m.pp("down_proj"), i, h, t.mlp_bias, p)?,
            input_layernorm: candle_nn::rms_norm(h, t.rms_norm_eps, vb.pp("input_layernorm"))?,
            post_attention_layernorm: candle_nn::rms_norm(
                h,
                t.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
        })
    }
}

/// Keys and values of every decoder layer for the positions seen so far.
#[derive(Debug, Default)]
pub struct KvCache {
    pub(crate) layers: Vec<Option<(Tensor, Tensor)>>,
    pub(crate) len: usize,
}

impl KvCache {
    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Debug)]
pub(crate) struct TextModel {
    pub(crate) embed_tokens: Embedding,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: RmsNorm,
    pub(crate) lm_head: Lin,
    pub(crate) cfg: Decoder,
    /// RoPE inverse frequencies, (head_dim / 2).
    pub(crate) inv_freq: Tensor,
}

impl TextModel {
    pub(crate) fn load(
        vb: VarBuilder,
        t: &Decoder,
        p: Precision,
    ) -> candle_core::Result<TextModel> {
        let m = vb.pp("model");
        let embed_tokens = candle_nn::embedding(t.vocab_size, t.hidden_size, m.pp("embed_tokens"))?;
        let lm_head = if t.tie_word_embeddings {
            Lin {
                w: QMatMul::Tensor(embed_tokens.embeddings().clone()),
                b: None,
            }
        } else {
            Lin::load(vb.pp("lm_head"), t.hidden_size, t.vocab_size, false, p)?
        };
        let half = t.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| (1.0 / t.rope_theta.powf(2.0 * i as f64 / t.head_dim as f64)) as f32)
            .collect();
        Ok(TextModel {
            layers: (0..t.num_hidden_layers)
                .map(|i| DecoderLayer::load(m.pp(format!("layers.{i}")), t, p))
                .collect::<candle_core::Result<_>>()?,
            norm: candle_nn::rms_norm(t.hidden_size, t.rms_norm_eps, m.pp("norm"))?,
            embed_tokens,
            lm_head,
            cfg: t.clone(),
            inv_freq: Tensor::new(inv, vb.device())?,
        })
    }

    /// Logits (b, t, vocab) of `embeds` (b, t, hidden), which follow the cached positions.
    pub(crate) fn forward(
        &self,
        embeds: &Tensor,
        cache: &mut KvCache,
    ) -> candle_core::Result<Tensor> {
        let (b, t, _) = embeds.dims3()?;
        let c = &self.cfg;
        let start = cache.len;
        if cache.layers.len() != self.layers.len() {
            cache.layers = (0..self.layers.len()).map(|_| None).collect();
        }
        // RoPE tables for positions start..start+t, computed in f32 as transformers does.
        let pos = Tensor::arange(start as u32, (start + t) as u32, embeds.device())?
            .to_dtype(DType::F32)?
            .reshape((t, 1))?;
        let freqs = pos.broadcast_mul(&self.inv_freq.reshape((1, ()))?)?;
        let (cos, sin) = (freqs.cos()?, freqs.sin()?);
        // Causal mask for a multi-token chunk (one new token sees every cached one).
        let mask = if t > 1 {
            let total = start + t;
            let m: Vec<f32> = (0..t)
                .flat_map(|i| {
                    (0..total).map(move |j| {
                        if j > start + i {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            Some(Tensor::from_vec(m, (1, 1, t, total), embeds.device())?)
        } else {
            None
        };
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let mut xs = embeds.clone();
        for (li, l) in self.layers.iter().enumerate() {
            let h = xs.apply(&l.input_layernorm)?;
            let split =
                |x: Tensor, n: usize| x.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
            let q = split(l.q_proj.forward(&h)?, nh)?;
            let k = split(l.k_proj.forward(&h)?, nkv)?;
            let v = split(l.v_proj.forward(&h)?, nkv)?;
            let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?;
            let (k, v) = match cache.layers[li].take() {
                Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                None => (k, v),
            };
            cache.layers[li] = Some((k.clone(), v.clone()));
            // Grouped-query attention: each key/value head serves nh / nkv query heads.
            let rep = |x: &Tensor| -> candle_core::Result<Tensor> {
                if nh == nkv {
                    return Ok(x.clone());
                }
                let (b, _, tk, _) = x.dims4()?;
                x.unsqueeze(2)?
                    .expand((b, nkv, nh / nkv, tk, hd))?
                    .reshape((b, nh, tk, hd))
            };
            let a = attention(
                &q,
                &rep(&k)?.contiguous()?,
                &rep(&v)?.contiguous()?,
                (hd as f64).powf(-0.5),
                mask.as_ref(),
            )?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?;
            xs = (xs + l.o_proj.forward(&a)?)?;
            let h = xs.apply(&l.post_attention_layernorm)?;
            let g = l.gate_proj.forward(&h)?.silu()?;
            let u = l.up_proj.forward(&h)?;
            xs = (&xs + l.down_proj.forward(&(g * u)?)?)?;
        }
        cache.len = start + t;
        xs.apply(&self.norm)?.apply(&self.lm_head)
    }
}
