//! BERT as a decoder with cross-attention, matching Hugging Face transformers'
//! `BertLMHeadModel` with `is_decoder = true, add_cross_attention = true` (`modeling_bert.py`):
//! embeddings (word + position + token type 0, LayerNorm), per layer causal self-attention,
//! cross-attention over the image tokens and a GELU MLP, each with a residual post-norm, and
//! the masked-LM prediction head. Parameter names are those of the checkpoint under
//! `decoder.` (`bert.encoder.layer.N.crossattention.self.key.weight`, `cls.predictions.bias`).
//!
//! Generation state lives outside the weights: a [`KvCache`] holds each layer's self-attention
//! keys and values per beam (reordered when beams are), and [`CrossKv`] the image's
//! cross-attention keys and values, computed once per image.

use candle_core::{Device, Module, Result, Tensor, D};
use candle_nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear, VarBuilder};
use serde::{Deserialize, Serialize};

use super::FlatLinear;

/// `BertConfig` fields that change the computation (names as in `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BertDecoderConfig {
    /// Size of the token vocabulary.
    pub vocab_size: usize,
    /// Width of the decoder's tokens.
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    /// Number of decoder layers.
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    /// Attention heads per layer (self- and cross-attention).
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    /// Width of the MLP.
    #[serde(default = "d_intermediate")]
    pub intermediate_size: usize,
    /// Longest sequence the position embeddings cover.
    #[serde(default = "d_max_pos")]
    pub max_position_embeddings: usize,
    /// Number of token types (only type 0 is used).
    #[serde(default = "d_type_vocab")]
    pub type_vocab_size: usize,
    /// Epsilon of the layer norms.
    #[serde(default = "d_eps")]
    pub layer_norm_eps: f64,
    /// The MLP's activation; only `gelu` is supported.
    #[serde(default = "d_act")]
    pub hidden_act: String,
}

fn d_hidden() -> usize {
    768
}
fn d_layers() -> usize {
    12
}
fn d_heads() -> usize {
    12
}
fn d_intermediate() -> usize {
    3072
}
fn d_max_pos() -> usize {
    512
}
fn d_type_vocab() -> usize {
    2
}
fn d_eps() -> f64 {
    1e-12
}
fn d_act() -> String {
    "gelu".into()
}

impl BertDecoderConfig {
    /// Checks the sizes fit together before any tensor is built; the error says which does not.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.num_attention_heads == 0
            || !self.hidden_size.is_multiple_of(self.num_attention_heads)
        {
            return Err(format!(
                "hidden_size {} is not divisible by {} heads",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.hidden_act != "gelu" {
            return Err(format!(
                "hidden_act `{}` is not supported (only `gelu`)",
                self.hidden_act
            ));
        }
        Ok(())
    }
}

struct Attention {
    query: FlatLinear,
    key: FlatLinear,
    value: FlatLinear,
    out: FlatLinear,
    norm: LayerNorm,
    heads: usize,
}

impl Attention {
    fn new(cfg: &BertDecoderConfig, vb: VarBuilder) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(Attention {
            query: FlatLinear(linear(h, h, vb.pp("self.query"))?),
            key: FlatLinear(linear(h, h, vb.pp("self.key"))?),
            value: FlatLinear(linear(h, h, vb.pp("self.value"))?),
            out: FlatLinear(linear(h, h, vb.pp("output.dense"))?),
            norm: layer_norm(h, cfg.layer_norm_eps, vb.pp("output.LayerNorm"))?,
            heads: cfg.num_attention_heads,
        })
    }

    /// (b, t, h) → (b, heads, t, hd).
    fn split(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        x.reshape((b, t, self.heads, h / self.heads))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// Scaled dot-product attention of `x`'s queries over (k, v), then the output projection
    /// and the residual post-norm.
    fn attend(&self, x: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (b, t, h) = x.dims3()?;
        let q = self.split(&x.apply(&self.query)?)?;
        let scale = 1.0 / ((h / self.heads) as f64).sqrt();
        let mut scores = (q.matmul(&k.t()?)? * scale)?;
        if let Some(m) = mask {
            scores = scores.broadcast_add(m)?;
        }
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        let ctx = p.matmul(v)?.transpose(1, 2)?.reshape((b, t, h))?;
        (ctx.apply(&self.out)? + x)?.apply(&self.norm)
    }
}

struct Layer {
    self_attn: Attention,
    cross_attn: Attention,
    fc1: FlatLinear,
    fc2: FlatLinear,
    norm: LayerNorm,
}

/// Self-attention keys and values of every layer, (beams, heads, t, hd) each.
#[derive(Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// Tokens already cached.
    pub fn len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .and_then(|(k, _)| k.dim(2).ok())
            .unwrap_or(0)
    }

    /// Whether no token is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps, for each new beam, the cache of the beam it continues (`beam_idx` on dim 0).
    pub fn reorder(&mut self, beam_idx: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut().flatten() {
            *k = k.index_select(beam_idx, 0)?;
            *v = v.index_select(beam_idx, 0)?;
        }
        Ok(())
    }
}

/// Cross-attention keys and values of every layer for one image, (1, heads, tokens, hd).
pub struct CrossKv {
    layers: Vec<(Tensor, Tensor)>,
    device: Device,
}

impl CrossKv {
    /// The device the keys and values live on.
    pub fn device(&self) -> Result<Device> {
        Ok(self.device.clone())
    }

    /// The same keys and values repeated for `n` beams.
    pub fn repeat(&self, n: usize) -> Result<CrossKv> {
        let rep = |t: &Tensor| -> Result<Tensor> {
            if t.dim(0)? == n {
                Ok(t.clone())
            } else {
                t.repeat((n, 1, 1, 1))
            }
        };
        Ok(CrossKv {
            layers: self
                .layers
                .iter()
                .map(|(k, v)| Ok((rep(k)?, rep(v)?)))
                .collect::<Result<_>>()?,
            device: self.device.clone(),
        })
    }
}

/// `BertLMHeadModel` (decoder with cross-attention and LM head).
pub struct BertDecoder {
    word: Embedding,
    position: Embedding,
    token_type0: Tensor, // (hidden,)
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
    head_dense: FlatLinear,
    head_norm: LayerNorm,
    /// `cls.predictions.decoder` (weight tied to the word embeddings) and `cls.predictions.bias`.
    head: FlatLinear,
    cfg: BertDecoderConfig,
}

impl BertDecoder {
    /// `vb` is scoped at the decoder (`decoder.` in a VisionEncoderDecoder checkpoint).
    pub fn new(cfg: &BertDecoderConfig, vb: VarBuilder) -> Result<Self> {
        cfg.validate().map_err(candle_core::Error::msg)?;
        let h = cfg.hidden_size;
        let e = vb.pp("bert.embeddings");
        let word = embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?;
        let position = embedding(cfg.max_position_embeddings, h, e.pp("position_embeddings"))?;
        let token_type0 = e
            .pp("token_type_embeddings")
            .get((cfg.type_vocab_size, h), "weight")?
            .get(0)?;
        let emb_norm = layer_norm(h, cfg.layer_norm_eps, e.pp("LayerNorm"))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = vb.pp(format!("bert.encoder.layer.{i}"));
            layers.push(Layer {
                self_attn: Attention::new(cfg, l.pp("attention"))?,
                cross_attn: Attention::new(cfg, l.pp("crossattention"))?,
                fc1: FlatLinear(linear(
                    h,
                    cfg.intermediate_size,
                    l.pp("intermediate.dense"),
                )?),
                fc2: FlatLinear(linear(cfg.intermediate_size, h, l.pp("output.dense"))?),
                norm: layer_norm(h, cfg.layer_norm_eps, l.pp("output.LayerNorm"))?,
            });
        }
        let p = vb.pp("cls.predictions");
        let head_dense = FlatLinear(linear(h, h, p.pp("transform.dense"))?);
        let head_norm = layer_norm(h, cfg.layer_norm_eps, p.pp("transform.LayerNorm"))?;
        // Checkpoints saved by transformers drop the tied copy of the word embeddings.
        let head_weight = if p.contains_tensor("decoder.weight") {
            p.get((cfg.vocab_size, h), "decoder.weight")?
        } else {
            word.embeddings().clone()
        };
        let head_bias = p.get(cfg.vocab_size, "bias")?;
        Ok(BertDecoder {
            word,
            position,
            token_type0,
            emb_norm,
            layers,
            head_dense,
            head_norm,
            head: FlatLinear(Linear::new(head_weight, Some(head_bias))),
            cfg: cfg.clone(),
        })
    }

    /// The configuration the decoder was built from.
    pub fn config(&self) -> &BertDecoderConfig {
        &self.cfg
    }

    /// The device its weights live on.
    pub fn device(&self) -> Result<Device> {
        Ok(self.token_type0.device().clone())
    }

    /// Cross-attention keys and values of `encoder_states` (b, tokens, hidden), once per image.
    pub fn cross_kv(&self, encoder_states: &Tensor) -> Result<CrossKv> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let a = &l.cross_attn;
                Ok((
                    a.split(&encoder_states.apply(&a.key)?)?,
                    a.split(&encoder_states.apply(&a.value)?)?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(CrossKv {
            layers,
            device: encoder_states.device().clone(),
        })
    }

    /// Logits (b, t, vocab) of `ids` (b, t) following the `cache` (updated in place).
    pub fn forward(&self, ids: &Tensor, cache: &mut KvCache, cross: &CrossKv) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        let past = cache.len();
        if past + t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {} tokens exceeds max_position_embeddings {}",
                past + t,
                self.cfg.max_position_embeddings
            );
        }
        let dev = ids.device();
        let pos = Tensor::arange(past as u32, (past + t) as u32, dev)?;
        let x = self
            .word
            .forward(ids)?
            .broadcast_add(&self.position.forward(&pos)?)?
            .broadcast_add(&self.token_type0)?;
        let mut x = x.apply(&self.emb_norm)?;
        // Causal mask over [past + new] keys for the new queries.
        let mask = if t > 1 {
            let mut m = vec![0f32; t * (past + t)];
            for i in 0..t {
                for j in (past + i + 1)..(past + t) {
                    m[i * (past + t) + j] = f32::NEG_INFINITY;
                }
            }
            Some(Tensor::from_vec(m, (t, past + t), dev)?)
        } else {
            None
        };
        if cache.layers.len() != self.layers.len() {
            cache.layers = vec![None; self.layers.len()];
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let k = a.split(&x.apply(&a.key)?)?;
            let v = a.split(&x.apply(&a.value)?)?;
            let (k, v) = match &cache.layers[i] {
                Some((pk, pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
                None => (k, v),
            };
            x = a.attend(&x, &k, &v, mask.as_ref())?;
            cache.layers[i] = Some((k, v));
            let (ck, cv) = &cross.layers[i];
            x = layer.cross_attn.attend(&x, ck, cv, None)?;
            let mlp = x.apply(&layer.fc1)?.gelu_erf()?.apply(&layer.fc2)?;
            x = (mlp + &x)?.apply(&layer.norm)?;
        }
        let hdn = x
            .apply(&self.head_dense)?
            .gelu_erf()?
            .apply(&self.head_norm)?;
        hdn.apply(&self.head)
    }

    /// Logits of the last position only, (b, vocab).
    pub fn next_logits(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        cross: &CrossKv,
    ) -> Result<Tensor> {
        let logits = self.forward(ids, cache, cross)?;
        let t = logits.dim(1)?;
        logits.narrow(1, t - 1, 1)?.squeeze(1)
    }
}

/// Log-softmax over the last dimension.
pub(crate) fn log_softmax(x: &Tensor) -> Result<Tensor> {
    candle_nn::ops::log_softmax(x, D::Minus1)
}
