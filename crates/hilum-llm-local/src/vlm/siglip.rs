//! SigLIP vision tower (transformers' `SiglipVisionModel` without its pooling head, as Gemma 3
//! uses it) and Gemma 3's multimodal projector.
//!
//! Tower: non-overlapping patches (a strided convolution, run here as one matrix product) plus
//! learned position embeddings, no class token; pre-norm encoder layers (LayerNorm -> multi-head
//! attention with biases -> residual, LayerNorm -> fc1 -> GELU(tanh) -> fc2 -> residual); a
//! final LayerNorm. Projector: the patch grid averaged in k x k squares to `mm_tokens_per_image`
//! soft tokens, Gemma's RMSNorm (weights stored as `w`, multiplying as `1 + w`), then a matrix
//! (vision width, text width).

use candle_core::{Module, Tensor, D};
use candle_nn::{LayerNorm, Linear};

use super::config::VlmConfig;

struct EncoderLayer {
    ln1: LayerNorm,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    ln2: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

pub(crate) struct VisionTower {
    /// Patch embedding as (width, channels * patch * patch).
    patch_w: Tensor,
    patch_b: Tensor,
    pos: Tensor,
    layers: Vec<EncoderLayer>,
    post_ln: LayerNorm,
    heads: usize,
    channels: usize,
    patch: usize,
    side: usize,
}

type Get<'a> = dyn FnMut(&str) -> candle_core::Result<Tensor> + 'a;

fn layer_norm(get: &mut Get, p: &str, eps: f64) -> candle_core::Result<LayerNorm> {
    Ok(LayerNorm::new(
        get(&format!("{p}.weight"))?,
        get(&format!("{p}.bias"))?,
        eps,
    ))
}

fn linear(get: &mut Get, p: &str) -> candle_core::Result<Linear> {
    Ok(Linear::new(
        get(&format!("{p}.weight"))?,
        Some(get(&format!("{p}.bias"))?),
    ))
}

impl VisionTower {
    /// `get` returns the tensors under `vision_tower.vision_model.`.
    pub(crate) fn load(cfg: &VlmConfig, get: &mut Get) -> candle_core::Result<Self> {
        let v = &cfg.vision;
        let w = get("embeddings.patch_embedding.weight")?;
        let patch_w = w.reshape((v.hidden, v.channels * v.patch_size * v.patch_size))?;
        let mut layers = Vec::with_capacity(v.layers);
        for i in 0..v.layers {
            let p = format!("encoder.layers.{i}");
            layers.push(EncoderLayer {
                ln1: layer_norm(get, &format!("{p}.layer_norm1"), v.eps)?,
                q: linear(get, &format!("{p}.self_attn.q_proj"))?,
                k: linear(get, &format!("{p}.self_attn.k_proj"))?,
                v: linear(get, &format!("{p}.self_attn.v_proj"))?,
                out: linear(get, &format!("{p}.self_attn.out_proj"))?,
                ln2: layer_norm(get, &format!("{p}.layer_norm2"), v.eps)?,
                fc1: linear(get, &format!("{p}.mlp.fc1"))?,
                fc2: linear(get, &format!("{p}.mlp.fc2"))?,
            });
        }
        Ok(VisionTower {
            patch_w,
            patch_b: get("embeddings.patch_embedding.bias")?,
            pos: get("embeddings.position_embedding.weight")?,
            layers,
            post_ln: layer_norm(get, "post_layernorm", v.eps)?,
            heads: v.heads,
            channels: v.channels,
            patch: v.patch_size,
            side: v.patches_per_side(),
        })
    }

    /// The last hidden state (patches, width) of one image's pixel values (channels, size, size).
    pub(crate) fn forward(&self, pixels: &Tensor) -> candle_core::Result<Tensor> {
        let (c, p, n) = (self.channels, self.patch, self.side);
        let dims = pixels.dims();
        if dims != [c, n * p, n * p] {
            candle_core::bail!(
                "pixel values of shape {dims:?}, expected [{c}, {0}, {0}]",
                n * p
            );
        }
        // (c, row, py, col, px) -> (row, col, c, py, px): one patch per row, in the weight's order.
        let patches = pixels
            .reshape((c, n, p, n, p))?
            .permute((1, 3, 0, 2, 4))?
            .contiguous()?
            .reshape((n * n, c * p * p))?;
        let mut x = patches
            .matmul(&self.patch_w.t()?)?
            .broadcast_add(&self.patch_b)?
            .add(&self.pos)?;
        for layer in &self.layers {
            let h = layer.ln1.forward(&x)?;
            let a = self.attention(layer, &h)?;
            x = (x + layer.out.forward(&a)?)?;
            let h = layer.ln2.forward(&x)?;
            let f = layer.fc2.forward(&layer.fc1.forward(&h)?.gelu()?)?;
            x = (x + f)?;
        }
        self.post_ln.forward(&x)
    }

    /// Full (bidirectional) multi-head attention over the patches, one head at a time so the
    /// score matrix of 4096 patches stays at 64 MB.
    fn attention(&self, layer: &EncoderLayer, h: &Tensor) -> candle_core::Result<Tensor> {
        let (t, width) = h.dims2()?;
        let hd = width / self.heads;
        let scale = 1.0 / (hd as f64).sqrt();
        // (t, heads * hd) -> (heads, t, hd), contiguous: each head's rows in one block, as
        // cuBLAS needs (the CPU's gemm would take the strided columns as they are).
        let heads = |x: Tensor| -> candle_core::Result<Tensor> {
            x.reshape((t, self.heads, hd))?
                .transpose(0, 1)?
                .contiguous()
        };
        let q = heads((layer.q.forward(h)? * scale)?)?;
        let k = heads(layer.k.forward(h)?)?;
        let v = heads(layer.v.forward(h)?)?;
        let mut outs = Vec::with_capacity(self.heads);
        for head in 0..self.heads {
            let (qh, kh, vh) = (q.get(head)?, k.get(head)?, v.get(head)?);
            let att = candle_nn::ops::softmax_last_dim(&qh.matmul(&kh.t()?)?)?;
            outs.push(att.matmul(&vh)?);
        }
        let y = Tensor::cat(&outs, D::Minus1)?;
        debug_assert_eq!(y.dims(), [t, width]);
        Ok(y)
    }
}

/// Gemma 3's multimodal projector.
pub(crate) struct Projector {
    norm_w: Tensor,
    eps: f32,
    proj: Tensor,
    side: usize,
    kernel: usize,
}

impl Projector {
    /// `get` returns the tensors under `multi_modal_projector.`.
    pub(crate) fn load(cfg: &VlmConfig, get: &mut Get) -> candle_core::Result<Self> {
        let side = cfg.vision.patches_per_side();
        Ok(Projector {
            norm_w: (get("mm_soft_emb_norm.weight")? + 1.0)?,
            eps: cfg.vision.eps as f32,
            proj: get("mm_input_projection_weight")?,
            side,
            kernel: side / cfg.tokens_per_side(),
        })
    }

    /// Soft tokens (mm_tokens_per_image, text width) of the tower's output (patches, width).
    pub(crate) fn forward(&self, vision: &Tensor) -> candle_core::Result<Tensor> {
        let (_, width) = vision.dims2()?;
        // (patches, width) -> (1, width, side, side), pooled, -> (tokens, width)
        let grid = vision
            .t()?
            .contiguous()?
            .reshape((1, width, self.side, self.side))?;
        let pooled = grid.avg_pool2d(self.kernel)?.flatten_from(2)?.squeeze(0)?;
        let tokens = pooled.t()?.contiguous()?;
        let normed = candle_nn::ops::rms_norm(&tokens, &self.norm_w, self.eps)?;
        normed.matmul(&self.proj)
    }
}
