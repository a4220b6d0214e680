//! Segment Anything (Kirillov et al., 2023) with a ViT image encoder, as MedSAM uses it
//! (Ma et al., "Segment anything in medical images", Nat. Commun. 2024; bowang-lab/MedSAM):
//! facebookresearch/segment-anything's `ImageEncoderViT`, `PromptEncoder`, `MaskDecoder` and
//! `TwoWayTransformer`, with the parameter names of `sam_vit_b` / `medsam_vit_b.pth`
//! (`image_encoder.blocks.0.attn.qkv.weight`, ...).
//!
//! Written here instead of using candle-transformers' `segment_anything` because that one
//! differs numerically (tanh-approximated GELU in the mask decoder and mask downscaling, where
//! SAM uses the exact erf GELU), hard-codes the decoder's size, and panics (`todo!`) when a
//! relative position table would need resizing.
//!
//! Preprocessing and postprocessing follow MedSAM's `MedSAM_Inference.py`, not SAM's
//! predictor: the image is stretched to 1024 x 1024 (no aspect-preserving pad), min-max scaled
//! to 0..1 (no ImageNet mean/std), the box is given in 1024-px coordinates, and the 256 x 256
//! low-resolution logits go through a sigmoid, bilinear resize to the original size
//! (`align_corners=False`) and a 0.5 threshold.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Module, Shape, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use hilum_imaging::{Filter, Norm, Prepared, Preprocess};

use crate::manifest::{InstalledModel, Manifest};
use crate::onnx_graph::{self, Attr, Dim, GraphBuilder};
use crate::runner::{check_input, recipe_values, Runner};
use crate::{Device, ModelError};

/// Architecture of one SAM variant. The published ViT variants all use a qkv bias, relative
/// and absolute position embeddings, MLP ratio 4 and LayerNorm eps 1e-6 in the encoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Side of the square encoder input (1024).
    pub image_size: usize,
    pub patch_size: usize,
    pub encoder_embed_dim: usize,
    pub encoder_depth: usize,
    pub encoder_num_heads: usize,
    /// Window side of the windowed-attention blocks.
    pub window_size: usize,
    /// Blocks with global attention; the others attend within windows.
    pub global_attn_indexes: Vec<usize>,
    /// Channels of the image embedding and of every prompt token (256).
    pub prompt_embed_dim: usize,
    pub mask_in_chans: usize,
    pub decoder_depth: usize,
    pub decoder_num_heads: usize,
    pub decoder_mlp_dim: usize,
    pub num_multimask_outputs: usize,
    pub iou_head_depth: usize,
    pub iou_head_hidden_dim: usize,
}

impl Config {
    /// SAM ViT-B (`sam_model_registry["vit_b"]`), the architecture of `medsam_vit_b.pth`.
    pub fn vit_b() -> Self {
        Config {
            image_size: 1024,
            patch_size: 16,
            encoder_embed_dim: 768,
            encoder_depth: 12,
            encoder_num_heads: 12,
            window_size: 14,
            global_attn_indexes: vec![2, 5, 8, 11],
            prompt_embed_dim: 256,
            mask_in_chans: 16,
            decoder_depth: 2,
            decoder_num_heads: 8,
            decoder_mlp_dim: 2048,
            num_multimask_outputs: 3,
            iou_head_depth: 3,
            iou_head_hidden_dim: 256,
        }
    }

    /// Side of the image embedding grid (64 for ViT-B).
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Side of the decoder's low-resolution masks (256 for ViT-B).
    pub fn low_res(&self) -> usize {
        4 * self.grid()
    }

    /// From a manifest's `[config]`: `variant = "vit_b"`, or every field spelled out.
    pub fn from_manifest(manifest: &Manifest) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::Manifest {
            id: manifest.id.clone(),
            reason,
        };
        match manifest.config.get("variant").and_then(|v| v.as_str()) {
            Some("vit_b") => Ok(Config::vit_b()),
            Some(other) => Err(bad(format!("unknown SAM variant `{other}` (known: vit_b)"))),
            None => toml::Value::Table(manifest.config.clone())
                .try_into()
                .map_err(|e| bad(format!("[config]: {e}"))),
        }
    }

    fn check(&self) -> candle_core::Result<()> {
        let ok = self.patch_size > 0
            && self.image_size.is_multiple_of(self.patch_size)
            && self.encoder_num_heads > 0
            && self
                .encoder_embed_dim
                .is_multiple_of(self.encoder_num_heads)
            && self.decoder_num_heads > 0
            && (self.prompt_embed_dim / 2).is_multiple_of(self.decoder_num_heads)
            && self.prompt_embed_dim.is_multiple_of(8)
            && self.mask_in_chans.is_multiple_of(4)
            && self.iou_head_depth > 0;
        if ok {
            Ok(())
        } else {
            candle_core::bail!("inconsistent SAM configuration {self:?}")
        }
    }
}

/// A linear layer applied to the last dimension of any tensor as one matrix product.
#[derive(Clone, Debug)]
struct Lin {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Lin {
    fn load(vb: VarBuilder, cin: usize, cout: usize, bias: bool) -> candle_core::Result<Self> {
        let weight = vb.get((cout, cin), "weight")?;
        let bias = if bias {
            Some(vb.get(cout, "bias")?)
        } else {
            None
        };
        Ok(Lin { weight, bias })
    }
}

impl Module for Lin {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut dims = xs.dims().to_vec();
        let k = dims.pop().unwrap_or(1);
        let n = xs.elem_count() / k.max(1);
        let y = xs.reshape((n, k))?.matmul(&self.weight.t()?)?;
        let y = match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        };
        dims.push(self.weight.dim(0)?);
        y.reshape(dims)
    }
}

/// `nn.LayerNorm` over the last dimension, computed in two passes like PyTorch (mean, then
/// the mean of squared deviations). candle's fused layer norm takes `E[x²] - E[x]²` in one
/// pass, which loses precision when the mean is large against the spread (it was off by
/// 4e-4 on the two-channel LayerNorm2d of the mask downscaling).
#[derive(Clone, Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl Module for LayerNorm {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let d = xs.broadcast_sub(&xs.mean_keepdim(D::Minus1)?)?;
        let var = d.sqr()?.mean_keepdim(D::Minus1)?;
        d.broadcast_div(&(var + self.eps)?.sqrt()?)?
            .broadcast_mul(&self.weight)?
            .broadcast_add(&self.bias)
    }
}

fn layer_norm(vb: VarBuilder, dim: usize, eps: f64) -> candle_core::Result<LayerNorm> {
    Ok(LayerNorm {
        weight: vb.get(dim, "weight")?,
        bias: vb.get(dim, "bias")?,
        eps,
    })
}

/// SAM's `LayerNorm2d` (over channels of NCHW), eps 1e-6: the same numbers as a LayerNorm
/// over the last dimension of the NHWC tensor, which is how it is computed here.
fn layer_norm_nchw(ln: &LayerNorm, xs: &Tensor) -> candle_core::Result<Tensor> {
    xs.permute((0, 2, 3, 1))?
        .contiguous()?
        .apply(ln)?
        .permute((0, 3, 1, 2))
}

/// SAM's `MLPBlock` (`lin1`, activation, `lin2`); GELU is the exact (erf) one.
#[derive(Clone, Debug)]
struct Mlp {
    lin1: Lin,
    lin2: Lin,
    gelu: bool,
}

impl Mlp {
    fn load(vb: VarBuilder, dim: usize, hidden: usize, gelu: bool) -> candle_core::Result<Self> {
        Ok(Mlp {
            lin1: Lin::load(vb.pp("lin1"), dim, hidden, true)?,
            lin2: Lin::load(vb.pp("lin2"), hidden, dim, true)?,
            gelu,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let h = xs.apply(&self.lin1)?;
        let h = if self.gelu { h.gelu_erf()? } else { h.relu()? };
        h.apply(&self.lin2)
    }
}

/// The mask decoder's `MLP`: `layers.{i}` with ReLU between them.
#[derive(Clone, Debug)]
struct HeadMlp {
    layers: Vec<Lin>,
}

impl HeadMlp {
    fn load(
        vb: VarBuilder,
        cin: usize,
        hidden: usize,
        cout: usize,
        depth: usize,
    ) -> candle_core::Result<Self> {
        let vb = vb.pp("layers");
        let layers = (0..depth)
            .map(|i| {
                let a = if i == 0 { cin } else { hidden };
                let b = if i + 1 == depth { cout } else { hidden };
                Lin::load(vb.pp(i), a, b, true)
            })
            .collect::<candle_core::Result<_>>()?;
        Ok(HeadMlp { layers })
    }
}

impl Module for HeadMlp {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mut x = xs.clone();
        for (i, l) in self.layers.iter().enumerate() {
            x = x.apply(l)?;
            if i + 1 < self.layers.len() {
                x = x.relu()?;
            }
        }
        Ok(x)
    }
}

// ---------------------------------------------------------------------------------------------
// Image encoder

/// Adds the decomposed relative position terms to the attention logits and takes the softmax
/// in one pass over the (large) logits, on the CPU: logits (n, qh*qw, kh*kw), rel_h
/// (n, qh, qw, kh), rel_w (n, qh, qw, kw).
struct RelPosSoftmax {
    n: usize,
    q: (usize, usize),
    k: (usize, usize),
}

fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    let s = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("rel-pos softmax needs contiguous inputs"),
    }
}

impl CustomOp3 for RelPosSoftmax {
    fn name(&self) -> &'static str {
        "sam-rel-pos-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        use rayon::prelude::*;
        let (attn, rel_h, rel_w) = (
            contiguous_f32(s1, l1)?,
            contiguous_f32(s2, l2)?,
            contiguous_f32(s3, l3)?,
        );
        let ((qh, qw), (kh, kw)) = (self.q, self.k);
        let (rows, row) = (self.n * qh * qw, kh * kw);
        if attn.len() != rows * row || rel_h.len() != rows * kh || rel_w.len() != rows * kw {
            candle_core::bail!("rel-pos softmax: inconsistent sizes");
        }
        let mut out = vec![0f32; rows * row];
        out.par_chunks_exact_mut(row)
            .enumerate()
            .for_each(|(r, dst)| {
                let a = &attn[r * row..(r + 1) * row];
                let rh = &rel_h[r * kh..(r + 1) * kh];
                let rw = &rel_w[r * kw..(r + 1) * kw];
                let mut max = f32::NEG_INFINITY;
                for (i, &h) in rh.iter().enumerate() {
                    let (src, d) = (&a[i * kw..(i + 1) * kw], &mut dst[i * kw..(i + 1) * kw]);
                    for ((o, &x), &w) in d.iter_mut().zip(src).zip(rw) {
                        *o = x + h + w;
                        max = max.max(*o);
                    }
                }
                let mut sum = 0f32;
                for o in dst.iter_mut() {
                    *o = (*o - max).exp();
                    sum += *o;
                }
                let inv = 1.0 / sum;
                dst.iter_mut().for_each(|o| *o *= inv);
            });
        Ok((
            CpuStorage::F32(out),
            Shape::from((self.n, qh * qw, kh * kw)),
        ))
    }
}

/// Rows of a relative position table for every (query, key) pair: (q_size, k_size, head_dim).
/// Published checkpoints always have tables of exactly `2 * size - 1` rows for their sizes.
fn get_rel_pos(q_size: usize, k_size: usize, rel_pos: &Tensor) -> candle_core::Result<Tensor> {
    let max_rel_dist = 2 * q_size.max(k_size) - 1;
    if rel_pos.dim(0)? != max_rel_dist {
        candle_core::bail!(
            "relative position table has {} rows, {max_rel_dist} needed (resizing is not supported)",
            rel_pos.dim(0)?
        );
    }
    let (qs, ks) = (
        (k_size as f64 / q_size as f64).max(1.0),
        (q_size as f64 / k_size as f64).max(1.0),
    );
    let mut idx = Vec::with_capacity(q_size * k_size);
    for q in 0..q_size {
        for k in 0..k_size {
            let r = q as f64 * qs - k as f64 * ks + (k_size as f64 - 1.0) * ks;
            idx.push(r as u32);
        }
    }
    let idx = Tensor::from_vec(idx, q_size * k_size, rel_pos.device())?;
    rel_pos.index_select(&idx, 0)?.reshape((q_size, k_size, ()))
}

#[derive(Clone, Debug)]
struct EncoderAttention {
    qkv: Lin,
    proj: Lin,
    num_heads: usize,
    scale: f64,
    rel_pos_h: Tensor,
    rel_pos_w: Tensor,
}

impl EncoderAttention {
    fn load(
        vb: VarBuilder,
        dim: usize,
        num_heads: usize,
        input: usize,
    ) -> candle_core::Result<Self> {
        let head_dim = dim / num_heads;
        Ok(EncoderAttention {
            qkv: Lin::load(vb.pp("qkv"), dim, 3 * dim, true)?,
            proj: Lin::load(vb.pp("proj"), dim, dim, true)?,
            num_heads,
            scale: 1.0 / (head_dim as f64).sqrt(),
            rel_pos_h: vb.get((2 * input - 1, head_dim), "rel_pos_h")?,
            rel_pos_w: vb.get((2 * input - 1, head_dim), "rel_pos_w")?,
        })
    }
}

impl Module for EncoderAttention {
    /// (b, h, w, c) -> (b, h, w, c)
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (b, h, w, c) = xs.dims4()?;
        let (nh, hd) = (self.num_heads, c / self.num_heads);
        let n = b * nh;
        let qkv = xs
            .apply(&self.qkv)?
            .reshape((b, h * w, 3, nh, hd))?
            .permute((2, 0, 3, 1, 4))?
            .contiguous()?
            .reshape((3, n, h * w, hd))?;
        let (q, k, v) = (qkv.get(0)?, qkv.get(1)?, qkv.get(2)?);
        let attn = (&q * self.scale)?.matmul(&k.t()?)?; // (n, hw, hw)

        // Decomposed relative positions: einsum("bhwc,hkc->bhwk") and ("bhwc,wkc->bhwk").
        let r_h = get_rel_pos(h, h, &self.rel_pos_h)?; // (h, h, hd)
        let r_w = get_rel_pos(w, w, &self.rel_pos_w)?; // (w, w, hd)
        let r_q = q.reshape((n, h, w, hd))?;
        let rel_h = r_q
            .permute((1, 0, 2, 3))?
            .contiguous()?
            .reshape((h, n * w, hd))?
            .matmul(&r_h.transpose(1, 2)?)? // (h, n*w, kh)
            .reshape((h, n, w, h))?
            .permute((1, 0, 2, 3))?
            .contiguous()?; // (n, h, w, kh)
        let rel_w = r_q
            .permute((2, 0, 1, 3))?
            .contiguous()?
            .reshape((w, n * h, hd))?
            .matmul(&r_w.transpose(1, 2)?)? // (w, n*h, kw)
            .reshape((w, n, h, w))?
            .permute((1, 2, 0, 3))?
            .contiguous()?; // (n, h, w, kw)
        let attn = if attn.device().is_cpu() {
            let op = RelPosSoftmax {
                n,
                q: (h, w),
                k: (h, w),
            };
            attn.contiguous()?.apply_op3_no_bwd(&rel_h, &rel_w, &op)?
        } else {
            let a = attn
                .reshape((n, h, w, h, w))?
                .broadcast_add(&rel_h.unsqueeze(4)?)?
                .broadcast_add(&rel_w.unsqueeze(3)?)?
                .reshape((n, h * w, h * w))?;
            candle_nn::ops::softmax_last_dim(&a)?
        };
        attn.matmul(&v)? // (n, hw, hd)
            .reshape((b, nh, h, w, hd))?
            .permute((0, 2, 3, 1, 4))?
            .contiguous()?
            .reshape((b, h, w, c))?
            .apply(&self.proj)
    }
}

#[derive(Clone, Debug)]
struct EncoderBlock {
    norm1: LayerNorm,
    attn: EncoderAttention,
    norm2: LayerNorm,
    mlp: Mlp,
    /// 0 for global attention.
    window: usize,
}

/// (b, h, w, c) -> (b * windows, ws, ws, c), zero-padding h and w to multiples of `ws`.
fn window_partition(xs: &Tensor, ws: usize) -> candle_core::Result<(Tensor, (usize, usize))> {
    let (b, h, w, c) = xs.dims4()?;
    let (ph, pw) = ((ws - h % ws) % ws, (ws - w % ws) % ws);
    let xs = xs.pad_with_zeros(1, 0, ph)?.pad_with_zeros(2, 0, pw)?;
    let (hp, wp) = (h + ph, w + pw);
    let win = xs
        .reshape((b, hp / ws, ws, wp / ws, ws, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .contiguous()?
        .reshape((b * (hp / ws) * (wp / ws), ws, ws, c))?;
    Ok((win, (hp, wp)))
}

fn window_unpartition(
    win: &Tensor,
    ws: usize,
    (hp, wp): (usize, usize),
    (h, w): (usize, usize),
) -> candle_core::Result<Tensor> {
    let c = win.dim(3)?;
    let b = win.dim(0)? / ((hp / ws) * (wp / ws));
    win.reshape((b, hp / ws, wp / ws, ws, ws, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .contiguous()?
        .reshape((b, hp, wp, c))?
        .narrow(1, 0, h)?
        .narrow(2, 0, w)
}

impl Module for EncoderBlock {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let x = xs.apply(&self.norm1)?;
        let x = if self.window > 0 {
            let (h, w) = (x.dim(1)?, x.dim(2)?);
            let (win, pad) = window_partition(&x, self.window)?;
            window_unpartition(&win.apply(&self.attn)?, self.window, pad, (h, w))?
        } else {
            x.apply(&self.attn)?
        };
        let x = (xs + x)?;
        &x + x.apply(&self.norm2)?.apply(&self.mlp)?
    }
}

#[derive(Clone, Debug)]
struct ImageEncoder {
    /// `patch_embed.proj` as a (embed, 3 * p * p) matrix: a stride-p p x p convolution is one
    /// matrix product over non-overlapping patches.
    patch_w: Tensor,
    patch_b: Tensor,
    pos_embed: Tensor,
    blocks: Vec<EncoderBlock>,
    neck0: Tensor,
    neck1: LayerNorm,
    /// `neck.2` (3x3, padding 1, no bias) as a (out, 9 * in) matrix over (ky, kx, in) patches.
    neck2: Tensor,
    neck3: LayerNorm,
    patch: usize,
}

impl ImageEncoder {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let (d, p, g) = (cfg.encoder_embed_dim, cfg.patch_size, cfg.grid());
        let patch_w = vb
            .pp("patch_embed.proj")
            .get((d, 3, p, p), "weight")?
            .reshape((d, 3 * p * p))?;
        let patch_b = vb.pp("patch_embed.proj").get(d, "bias")?;
        let pos_embed = vb.get((1, g, g, d), "pos_embed")?;
        let blocks = (0..cfg.encoder_depth)
            .map(|i| {
                let vb = vb.pp("blocks").pp(i);
                let global = cfg.global_attn_indexes.contains(&i);
                let window = if global { 0 } else { cfg.window_size };
                let input = if global { g } else { cfg.window_size };
                Ok(EncoderBlock {
                    norm1: layer_norm(vb.pp("norm1"), d, 1e-6)?,
                    attn: EncoderAttention::load(vb.pp("attn"), d, cfg.encoder_num_heads, input)?,
                    norm2: layer_norm(vb.pp("norm2"), d, 1e-6)?,
                    mlp: Mlp::load(vb.pp("mlp"), d, 4 * d, true)?,
                    window,
                })
            })
            .collect::<candle_core::Result<_>>()?;
        let e = cfg.prompt_embed_dim;
        let neck0 = vb
            .pp("neck.0")
            .get((e, d, 1, 1), "weight")?
            .reshape((e, d))?;
        let neck2 = vb
            .pp("neck.2")
            .get((e, e, 3, 3), "weight")?
            .permute((0, 2, 3, 1))?
            .contiguous()?
            .reshape((e, 9 * e))?;
        Ok(ImageEncoder {
            patch_w,
            patch_b,
            pos_embed,
            blocks,
            neck0,
            neck1: layer_norm(vb.pp("neck.1"), e, 1e-6)?,
            neck2,
            neck3: layer_norm(vb.pp("neck.3"), e, 1e-6)?,
            patch: p,
        })
    }
}

impl Module for ImageEncoder {
    /// (b, 3, S, S) -> (b, prompt_embed_dim, S/p, S/p)
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (b, c, s, _) = xs.dims4()?;
        let (p, g) = (self.patch, s / self.patch);
        let patches = xs
            .reshape((b, c, g, p, g, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .contiguous()?
            .reshape((b * g * g, c * p * p))?;
        let mut x = patches
            .matmul(&self.patch_w.t()?)?
            .broadcast_add(&self.patch_b)?
            .reshape((b, g, g, ()))? // (b, g, g, d), NHWC as in SAM
            .broadcast_add(&self.pos_embed)?;
        for blk in &self.blocks {
            x = x.apply(blk)?;
        }
        // Neck in NHWC: the 1x1 conv is a matrix product, the 3x3 conv one matrix product
        // over its nine shifted copies (im2col), LayerNorm2d a LayerNorm over channels.
        let e = self.neck0.dim(0)?;
        let x = x
            .reshape((b * g * g, ()))?
            .matmul(&self.neck0.t()?)?
            .reshape((b, g, g, e))?
            .apply(&self.neck1)?;
        let padded = x.pad_with_zeros(1, 1, 1)?.pad_with_zeros(2, 1, 1)?;
        let mut shifted = Vec::with_capacity(9);
        for ky in 0..3 {
            for kx in 0..3 {
                shifted.push(padded.narrow(1, ky, g)?.narrow(2, kx, g)?);
            }
        }
        Tensor::stack(&shifted, 3)? // (b, g, g, 9, e)
            .reshape((b * g * g, 9 * e))?
            .matmul(&self.neck2.t()?)?
            .reshape((b, g, g, e))?
            .apply(&self.neck3)?
            .permute((0, 3, 1, 2))?
            .contiguous() // (b, e, g, g)
    }
}

// ---------------------------------------------------------------------------------------------
// The image encoder as an ONNX graph (ONNX Runtime, Triton), op for op as the candle code above:
// two-pass LayerNorms, the erf GELU, the decomposed relative positions added before the softmax.

/// Name of the encoder graph's output: (batch, prompt_embed_dim, grid, grid).
pub const ONNX_EMBEDDINGS: &str = "embeddings";

impl Lin {
    /// `x @ weight.T + bias` over the last axis of any rank; the runtime folds the transpose
    /// of the initializer once, and the initializer keeps the checkpoint's name and layout.
    fn to_onnx(&self, g: &mut GraphBuilder, name: &str, x: &str) -> candle_core::Result<String> {
        let w = g.weight(&format!("{name}.weight"), &self.weight)?;
        let wt = g.transpose(&w, &[1, 0]);
        let y = g.matmul(x, &wt);
        Ok(match &self.bias {
            Some(b) => {
                let b = g.weight(&format!("{name}.bias"), b)?;
                g.add(&y, &b)
            }
            None => y,
        })
    }
}

impl LayerNorm {
    /// Over the last axis, two passes as [`LayerNorm::forward`] (not ONNX's fused
    /// `LayerNormalization`, which ONNX Runtime computes in one pass).
    fn to_onnx(&self, g: &mut GraphBuilder, name: &str, x: &str) -> candle_core::Result<String> {
        let mean_of = |g: &mut GraphBuilder, x: &str| {
            g.node(
                "ReduceMean",
                &[x],
                &[Attr::Ints("axes", vec![-1]), Attr::Int("keepdims", 1)],
            )
        };
        let mean = mean_of(g, x);
        let d = g.node("Sub", &[x, &mean], &[]);
        let sq = g.mul(&d, &d);
        let var = mean_of(g, &sq);
        let eps = g.scalar(self.eps as f32);
        let var = g.add(&var, &eps);
        let sd = g.node("Sqrt", &[&var], &[]);
        let n = g.node("Div", &[&d, &sd], &[]);
        let w = g.weight(&format!("{name}.weight"), &self.weight)?;
        let b = g.weight(&format!("{name}.bias"), &self.bias)?;
        let y = g.mul(&n, &w);
        Ok(g.add(&y, &b))
    }
}

impl Mlp {
    fn to_onnx(&self, g: &mut GraphBuilder, name: &str, x: &str) -> candle_core::Result<String> {
        let h = self.lin1.to_onnx(g, &format!("{name}.lin1"), x)?;
        let h = if self.gelu {
            // 0.5 * x * (1 + erf(x / sqrt(2))): opset 17 has no Gelu.
            let r = g.scalar(std::f32::consts::FRAC_1_SQRT_2);
            let e = g.mul(&h, &r);
            let e = g.node("Erf", &[&e], &[]);
            let one = g.scalar(1.0);
            let e = g.add(&e, &one);
            let half = g.scalar(0.5);
            let y = g.mul(&h, &e);
            g.mul(&y, &half)
        } else {
            g.relu(&h)
        };
        self.lin2.to_onnx(g, &format!("{name}.lin2"), &h)
    }
}

impl EncoderAttention {
    /// `x`: (n, h, w, c) -> (n, h, w, c). The gathered relative position tables are constants
    /// of the graph (`{name}.rel_pos_h.gathered`: (h, head_dim, h)), as `get_rel_pos` is.
    fn to_onnx(
        &self,
        g: &mut GraphBuilder,
        name: &str,
        x: &str,
        (h, w): (usize, usize),
    ) -> candle_core::Result<String> {
        let c = self.qkv.weight.dim(1)?;
        let (nh, hd) = (self.num_heads, c / self.num_heads);
        let (h_, w_, nh_, hd_, hw) = (h as i64, w as i64, nh as i64, hd as i64, (h * w) as i64);
        let qkv = self.qkv.to_onnx(g, &format!("{name}.qkv"), x)?;
        let qkv = g.reshape(&qkv, &[-1, hw, 3, nh_, hd_]);
        let qkv = g.transpose(&qkv, &[2, 0, 3, 1, 4]); // (3, n, nh, hw, hd)
        let mut part = |i| {
            let idx = g.index(i);
            g.node("Gather", &[&qkv, &idx], &[Attr::Int("axis", 0)])
        };
        let (q, k, v) = (part(0), part(1), part(2));
        let scale = g.scalar(self.scale as f32);
        let qs = g.mul(&q, &scale);
        let kt = g.transpose(&k, &[0, 1, 3, 2]);
        let attn = g.matmul(&qs, &kt); // (n, nh, hw, hw)

        let r_h = get_rel_pos(h, h, &self.rel_pos_h)?.transpose(1, 2)?; // (h, hd, kh)
        let r_w = get_rel_pos(w, w, &self.rel_pos_w)?.transpose(1, 2)?; // (w, hd, kw)
        let r_h = g.weight(&format!("{name}.rel_pos_h.gathered"), &r_h.contiguous()?)?;
        let r_w = g.weight(&format!("{name}.rel_pos_w.gathered"), &r_w.contiguous()?)?;
        let r_q = g.reshape(&q, &[-1, nh_, h_, w_, hd_]);
        let rel_h = g.matmul(&r_q, &r_h); // (n, nh, h, w, kh)
        let r_qt = g.transpose(&r_q, &[0, 1, 3, 2, 4]);
        let rel_w = g.matmul(&r_qt, &r_w); // (n, nh, w, h, kw)
        let rel_w = g.transpose(&rel_w, &[0, 1, 3, 2, 4]);
        let a = g.reshape(&attn, &[-1, nh_, h_, w_, h_, w_]);
        let rel_h = g.reshape(&rel_h, &[-1, nh_, h_, w_, h_, 1]);
        let rel_w = g.reshape(&rel_w, &[-1, nh_, h_, w_, 1, w_]);
        let a = g.add(&a, &rel_h);
        let a = g.add(&a, &rel_w);
        let a = g.reshape(&a, &[-1, nh_, hw, hw]);
        let a = g.node("Softmax", &[&a], &[Attr::Int("axis", -1)]);
        let o = g.matmul(&a, &v); // (n, nh, hw, hd)
        let o = g.transpose(&o, &[0, 2, 1, 3]);
        let o = g.reshape(&o, &[-1, h_, w_, c as i64]);
        self.proj.to_onnx(g, &format!("{name}.proj"), &o)
    }
}

impl EncoderBlock {
    /// `x`: (b, grid, grid, c) -> the same.
    fn to_onnx(
        &self,
        g: &mut GraphBuilder,
        name: &str,
        x: &str,
        grid: usize,
    ) -> candle_core::Result<String> {
        let c = self.norm1.weight.dim(0)? as i64;
        let y = self.norm1.to_onnx(g, &format!("{name}.norm1"), x)?;
        let attn = format!("{name}.attn");
        let y = if self.window > 0 {
            let ws = self.window;
            let pad = (ws - grid % ws) % ws;
            let (hp, nw, ws_) = ((grid + pad) as i64, ((grid + pad) / ws) as i64, ws as i64);
            let y = if pad > 0 {
                let pads = g.ints(&[0, 0, 0, 0, 0, pad as i64, pad as i64, 0]);
                g.node("Pad", &[&y, &pads], &[])
            } else {
                y
            };
            let y = g.reshape(&y, &[-1, nw, ws_, nw, ws_, c]);
            let y = g.transpose(&y, &[0, 1, 3, 2, 4, 5]);
            let y = g.reshape(&y, &[-1, ws_, ws_, c]);
            let y = self.attn.to_onnx(g, &attn, &y, (ws, ws))?;
            let y = g.reshape(&y, &[-1, nw, nw, ws_, ws_, c]);
            let y = g.transpose(&y, &[0, 1, 3, 2, 4, 5]);
            let y = g.reshape(&y, &[-1, hp, hp, c]);
            if pad > 0 {
                let (starts, ends, axes) =
                    (g.ints(&[0, 0]), g.ints(&[grid as i64; 2]), g.ints(&[1, 2]));
                g.node("Slice", &[&y, &starts, &ends, &axes], &[])
            } else {
                y
            }
        } else {
            self.attn.to_onnx(g, &attn, &y, (grid, grid))?
        };
        let x = g.add(x, &y);
        let z = self.norm2.to_onnx(g, &format!("{name}.norm2"), &x)?;
        let z = self.mlp.to_onnx(g, &format!("{name}.mlp"), &z)?;
        Ok(g.add(&x, &z))
    }
}

impl ImageEncoder {
    /// The whole encoder from [`onnx_graph::INPUT`] (b, 3, S, S) to its NCHW output; the
    /// checkpoint's names under `image_encoder.`, its convolutions as `Conv`s again.
    fn to_onnx(&self, g: &mut GraphBuilder, image_size: usize) -> candle_core::Result<String> {
        let (d, p) = (self.patch_w.dim(0)?, self.patch);
        let grid = image_size / p;
        let e = self.neck0.dim(0)?;
        // The convolutions as candle layers again, so the builder's `Conv` writes them.
        let conv = |w: Tensor, b: Option<Tensor>, stride: usize, padding: usize| {
            let cfg = candle_nn::Conv2dConfig {
                stride,
                padding,
                ..Default::default()
            };
            candle_nn::Conv2d::new(w, b, cfg)
        };
        let pre = "image_encoder";
        let patch = conv(
            self.patch_w.reshape((d, 3, p, p))?,
            Some(self.patch_b.clone()),
            p,
            0,
        );
        let x = g.conv2d(
            &format!("{pre}.patch_embed.proj"),
            &patch,
            onnx_graph::INPUT,
        )?;
        let x = g.transpose(&x, &[0, 2, 3, 1]); // NHWC, as SAM's blocks run
        let pos = g.weight(&format!("{pre}.pos_embed"), &self.pos_embed)?;
        let mut x = g.add(&x, &pos);
        for (i, blk) in self.blocks.iter().enumerate() {
            x = blk.to_onnx(g, &format!("{pre}.blocks.{i}"), &x, grid)?;
        }
        let nchw = |g: &mut GraphBuilder, x: &str| g.transpose(x, &[0, 3, 1, 2]);
        let nhwc = |g: &mut GraphBuilder, x: &str| g.transpose(x, &[0, 2, 3, 1]);
        let neck0 = conv(self.neck0.reshape((e, d, 1, 1))?, None, 1, 0);
        let x = nchw(g, &x);
        let x = g.conv2d(&format!("{pre}.neck.0"), &neck0, &x)?;
        let x = nhwc(g, &x);
        let x = self.neck1.to_onnx(g, &format!("{pre}.neck.1"), &x)?;
        let w2 = self
            .neck2
            .reshape((e, 3, 3, e))?
            .permute((0, 3, 1, 2))?
            .contiguous()?;
        let x = nchw(g, &x);
        let x = g.conv2d(&format!("{pre}.neck.2"), &conv(w2, None, 1, 1), &x)?;
        let x = nhwc(g, &x);
        let x = self.neck3.to_onnx(g, &format!("{pre}.neck.3"), &x)?;
        Ok(nchw(g, &x))
    }
}

// ---------------------------------------------------------------------------------------------
// Prompt encoder

/// A prompt in encoder-input pixel coordinates (0..image_size, e.g. 1024-px frame).
#[derive(Clone, Debug, Default)]
pub struct Prompt {
    /// (x, y, label): 1 foreground, 0 background.
    pub points: Vec<(f32, f32, f32)>,
    /// [x0, y0, x1, y1].
    pub bbox: Option<[f32; 4]>,
    /// Previous low-resolution mask logits (1, 1, 4g, 4g), optional.
    pub mask: Option<Tensor>,
}

#[derive(Clone, Debug)]
struct PromptEncoder {
    gaussian: Tensor, // (2, e/2)
    point_embeddings: Vec<Tensor>,
    not_a_point: Tensor,
    no_mask: Tensor,
    mask_conv0: candle_nn::Conv2d,
    mask_ln1: LayerNorm,
    mask_conv3: candle_nn::Conv2d,
    mask_ln4: LayerNorm,
    mask_conv6: Lin,
    input_size: usize,
    grid: usize,
}

impl PromptEncoder {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let e = cfg.prompt_embed_dim;
        let m = cfg.mask_in_chans;
        let point_embeddings = (0..4)
            .map(|i| vb.pp("point_embeddings").pp(i).get((1, e), "weight"))
            .collect::<candle_core::Result<_>>()?;
        let k2 = candle_nn::Conv2dConfig {
            stride: 2,
            ..Default::default()
        };
        let conv = |vb: VarBuilder, cin: usize, cout: usize| -> candle_core::Result<_> {
            Ok(candle_nn::Conv2d::new(
                vb.get((cout, cin, 2, 2), "weight")?,
                Some(vb.get(cout, "bias")?),
                k2,
            ))
        };
        let md = vb.pp("mask_downscaling");
        let w6 = md.pp("6").get((e, m, 1, 1), "weight")?.reshape((e, m))?;
        Ok(PromptEncoder {
            gaussian: vb
                .pp("pe_layer")
                .get((2, e / 2), "positional_encoding_gaussian_matrix")?,
            point_embeddings,
            not_a_point: vb.pp("not_a_point_embed").get((1, e), "weight")?,
            no_mask: vb.pp("no_mask_embed").get((1, e), "weight")?,
            mask_conv0: conv(md.pp("0"), 1, m / 4)?,
            mask_ln1: layer_norm(md.pp("1"), m / 4, 1e-6)?,
            mask_conv3: conv(md.pp("3"), m / 4, m)?,
            mask_ln4: layer_norm(md.pp("4"), m, 1e-6)?,
            mask_conv6: Lin {
                weight: w6,
                bias: Some(md.pp("6").get(e, "bias")?),
            },
            input_size: cfg.image_size,
            grid: cfg.grid(),
        })
    }

    /// Coordinates normalised to 0..1 (..., 2) -> (..., e).
    fn pe_encoding(&self, coords: &Tensor) -> candle_core::Result<Tensor> {
        let c = coords.affine(2.0, -1.0)?;
        let c = (c.broadcast_matmul(&self.gaussian)? * (2.0 * std::f64::consts::PI))?;
        Tensor::cat(&[c.sin()?, c.cos()?], D::Minus1)
    }

    /// `get_dense_pe`: (1, e, g, g).
    fn dense_pe(&self) -> candle_core::Result<Tensor> {
        let g = self.grid;
        let mut xy = Vec::with_capacity(g * g * 2);
        for y in 0..g {
            for x in 0..g {
                xy.push((x as f32 + 0.5) / g as f32);
                xy.push((y as f32 + 0.5) / g as f32);
            }
        }
        let coords = Tensor::from_vec(xy, (g, g, 2), self.gaussian.device())?;
        self.pe_encoding(&coords)?.permute((2, 0, 1))?.unsqueeze(0)
    }

    /// Embedding of points in input pixels (shifted to pixel centres), (1, n, e).
    fn embed_coords(&self, xy: &[(f32, f32)]) -> candle_core::Result<Tensor> {
        let s = self.input_size as f32;
        let v: Vec<f32> = xy
            .iter()
            .flat_map(|&(x, y)| [(x + 0.5) / s, (y + 0.5) / s])
            .collect();
        let t = Tensor::from_vec(v, (1, xy.len(), 2), self.gaussian.device())?;
        self.pe_encoding(&t)
    }

    /// (sparse (1, n, e), dense (1, e, g, g)).
    fn forward(&self, prompt: &Prompt) -> candle_core::Result<(Tensor, Tensor)> {
        let mut tokens: Vec<Tensor> = Vec::new();
        if !prompt.points.is_empty() {
            let mut pts: Vec<(f32, f32, f32)> = prompt.points.clone();
            if prompt.bbox.is_none() {
                pts.push((0.0, 0.0, -1.0)); // SAM pads point-only prompts with a non-point
            }
            let xy: Vec<(f32, f32)> = pts.iter().map(|p| (p.0, p.1)).collect();
            let pe = self.embed_coords(&xy)?;
            for (i, &(_, _, label)) in pts.iter().enumerate() {
                let t = pe.narrow(1, i, 1)?;
                let t = if label < 0.0 {
                    self.not_a_point.unsqueeze(0)?
                } else if label == 0.0 {
                    t.broadcast_add(&self.point_embeddings[0])?
                } else if label == 1.0 {
                    t.broadcast_add(&self.point_embeddings[1])?
                } else {
                    t
                };
                tokens.push(t);
            }
        }
        if let Some([x0, y0, x1, y1]) = prompt.bbox {
            let pe = self.embed_coords(&[(x0, y0), (x1, y1)])?;
            tokens.push(
                pe.narrow(1, 0, 1)?
                    .broadcast_add(&self.point_embeddings[2])?,
            );
            tokens.push(
                pe.narrow(1, 1, 1)?
                    .broadcast_add(&self.point_embeddings[3])?,
            );
        }
        let e = self.no_mask.dim(1)?;
        let sparse = if tokens.is_empty() {
            Tensor::zeros((1, 0, e), DType::F32, self.gaussian.device())?
        } else {
            Tensor::cat(&tokens, 1)?
        };
        let dense = match &prompt.mask {
            Some(m) => {
                let x = m.apply(&self.mask_conv0)?;
                let x = layer_norm_nchw(&self.mask_ln1, &x)?.gelu_erf()?;
                let x = x.apply(&self.mask_conv3)?;
                let x = layer_norm_nchw(&self.mask_ln4, &x)?.gelu_erf()?;
                // 1x1 conv in NHWC.
                x.permute((0, 2, 3, 1))?
                    .apply(&self.mask_conv6)?
                    .permute((0, 3, 1, 2))?
                    .contiguous()?
            }
            None => self
                .no_mask
                .reshape((1, e, 1, 1))?
                .broadcast_as((1, e, self.grid, self.grid))?
                .contiguous()?,
        };
        Ok((sparse, dense))
    }
}

// ---------------------------------------------------------------------------------------------
// Mask decoder

/// The two-way transformer's attention, with a downsampled internal dimension.
#[derive(Clone, Debug)]
struct TokenAttention {
    q: Lin,
    k: Lin,
    v: Lin,
    out: Lin,
    heads: usize,
}

impl TokenAttention {
    fn load(vb: VarBuilder, dim: usize, heads: usize, down: usize) -> candle_core::Result<Self> {
        let inner = dim / down;
        Ok(TokenAttention {
            q: Lin::load(vb.pp("q_proj"), dim, inner, true)?,
            k: Lin::load(vb.pp("k_proj"), dim, inner, true)?,
            v: Lin::load(vb.pp("v_proj"), dim, inner, true)?,
            out: Lin::load(vb.pp("out_proj"), inner, dim, true)?,
            heads,
        })
    }

    fn heads_of(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, c) = x.dims3()?;
        x.reshape((b, n, self.heads, c / self.heads))?
            .transpose(1, 2)?
            .contiguous()
    }

    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        let q = self.heads_of(&q.apply(&self.q)?)?;
        let k = self.heads_of(&k.apply(&self.k)?)?;
        let v = self.heads_of(&v.apply(&self.v)?)?;
        let (b, h, n, c) = q.dims4()?;
        let attn = (q.matmul(&k.t()?)? / (c as f64).sqrt())?;
        let attn = candle_nn::ops::softmax_last_dim(&attn)?;
        attn.matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, n, h * c))?
            .apply(&self.out)
    }
}

#[derive(Clone, Debug)]
struct TwoWayBlock {
    self_attn: TokenAttention,
    norm1: LayerNorm,
    cross_token_to_image: TokenAttention,
    norm2: LayerNorm,
    mlp: Mlp,
    norm3: LayerNorm,
    norm4: LayerNorm,
    cross_image_to_token: TokenAttention,
    skip_first_layer_pe: bool,
}

impl TwoWayBlock {
    fn load(vb: VarBuilder, cfg: &Config, first: bool) -> candle_core::Result<Self> {
        let (e, h) = (cfg.prompt_embed_dim, cfg.decoder_num_heads);
        Ok(TwoWayBlock {
            self_attn: TokenAttention::load(vb.pp("self_attn"), e, h, 1)?,
            norm1: layer_norm(vb.pp("norm1"), e, 1e-5)?,
            cross_token_to_image: TokenAttention::load(
                vb.pp("cross_attn_token_to_image"),
                e,
                h,
                2,
            )?,
            norm2: layer_norm(vb.pp("norm2"), e, 1e-5)?,
            mlp: Mlp::load(vb.pp("mlp"), e, cfg.decoder_mlp_dim, false)?,
            norm3: layer_norm(vb.pp("norm3"), e, 1e-5)?,
            norm4: layer_norm(vb.pp("norm4"), e, 1e-5)?,
            cross_image_to_token: TokenAttention::load(
                vb.pp("cross_attn_image_to_token"),
                e,
                h,
                2,
            )?,
            skip_first_layer_pe: first,
        })
    }

    fn forward(
        &self,
        queries: &Tensor,
        keys: &Tensor,
        query_pe: &Tensor,
        key_pe: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let queries = if self.skip_first_layer_pe {
            self.self_attn.forward(queries, queries, queries)?
        } else {
            let q = (queries + query_pe)?;
            (queries + self.self_attn.forward(&q, &q, queries)?)?
        };
        let queries = queries.apply(&self.norm1)?;
        let q = (&queries + query_pe)?;
        let k = (keys + key_pe)?;
        let queries = (&queries + self.cross_token_to_image.forward(&q, &k, keys)?)?;
        let queries = queries.apply(&self.norm2)?;
        let queries = (&queries + queries.apply(&self.mlp)?)?.apply(&self.norm3)?;
        let q = (&queries + query_pe)?;
        let k = (keys + key_pe)?;
        let keys = (keys + self.cross_image_to_token.forward(&k, &q, &queries)?)?;
        Ok((queries, keys.apply(&self.norm4)?))
    }
}

/// (b, cin, h, w) -> (b, cout, 2h, 2w): a kernel-2 stride-2 transposed convolution has no
/// overlapping outputs, so it is one matrix product.
#[derive(Clone, Debug)]
struct Up2 {
    weight: Tensor, // (cin, cout * 4)
    bias: Tensor,
    cout: usize,
}

impl Up2 {
    fn load(vb: VarBuilder, cin: usize, cout: usize) -> candle_core::Result<Self> {
        Ok(Up2 {
            weight: vb
                .get((cin, cout, 2, 2), "weight")?
                .reshape((cin, cout * 4))?,
            bias: vb.get(cout, "bias")?,
            cout,
        })
    }
}

impl Module for Up2 {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (b, c, h, w) = xs.dims4()?;
        let co = self.cout;
        xs.permute((0, 2, 3, 1))?
            .contiguous()?
            .reshape((b * h * w, c))?
            .matmul(&self.weight)?
            .reshape((b, h, w, co, 2, 2))?
            .permute((0, 3, 1, 4, 2, 5))?
            .contiguous()?
            .reshape((b, co, 2 * h, 2 * w))?
            .broadcast_add(&self.bias.reshape((1, co, 1, 1))?)
    }
}

#[derive(Clone, Debug)]
struct MaskDecoder {
    layers: Vec<TwoWayBlock>,
    final_attn: TokenAttention,
    norm_final: LayerNorm,
    iou_token: Tensor,
    mask_tokens: Tensor,
    up0: Up2,
    up1: LayerNorm,
    up3: Up2,
    hyper: Vec<HeadMlp>,
    iou_head: HeadMlp,
}

impl MaskDecoder {
    fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let e = cfg.prompt_embed_dim;
        let t = cfg.num_multimask_outputs + 1;
        let tv = vb.pp("transformer");
        let layers = (0..cfg.decoder_depth)
            .map(|i| TwoWayBlock::load(tv.pp("layers").pp(i), cfg, i == 0))
            .collect::<candle_core::Result<_>>()?;
        let hyper = (0..t)
            .map(|i| HeadMlp::load(vb.pp("output_hypernetworks_mlps").pp(i), e, e, e / 8, 3))
            .collect::<candle_core::Result<_>>()?;
        Ok(MaskDecoder {
            layers,
            final_attn: TokenAttention::load(
                tv.pp("final_attn_token_to_image"),
                e,
                cfg.decoder_num_heads,
                2,
            )?,
            norm_final: layer_norm(tv.pp("norm_final_attn"), e, 1e-5)?,
            iou_token: vb.pp("iou_token").get((1, e), "weight")?,
            mask_tokens: vb.pp("mask_tokens").get((t, e), "weight")?,
            up0: Up2::load(vb.pp("output_upscaling.0"), e, e / 4)?,
            up1: layer_norm(vb.pp("output_upscaling.1"), e / 4, 1e-6)?,
            up3: Up2::load(vb.pp("output_upscaling.3"), e / 4, e / 8)?,
            hyper,
            iou_head: HeadMlp::load(
                vb.pp("iou_prediction_head"),
                e,
                cfg.iou_head_hidden_dim,
                t,
                cfg.iou_head_depth,
            )?,
        })
    }

    /// `predict_masks` for one image and one prompt: (masks (1, t, 4g, 4g), iou (1, t)).
    fn forward(
        &self,
        image: &Tensor,
        image_pe: &Tensor,
        sparse: &Tensor,
        dense: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let t = self.mask_tokens.dim(0)?;
        let output_tokens = Tensor::cat(&[&self.iou_token, &self.mask_tokens], 0)?.unsqueeze(0)?;
        let tokens = Tensor::cat(&[&output_tokens, sparse], 1)?; // (1, 1 + t + n, e)
        let src = image.broadcast_add(dense)?;
        let (b, c, h, w) = src.dims4()?;
        let keys0 = src.flatten_from(2)?.transpose(1, 2)?.contiguous()?; // (1, hw, e)
        let key_pe = image_pe.flatten_from(2)?.transpose(1, 2)?.contiguous()?;
        let (mut queries, mut keys) = (tokens.clone(), keys0);
        for l in &self.layers {
            (queries, keys) = l.forward(&queries, &keys, &tokens, &key_pe)?;
        }
        let q = (&queries + &tokens)?;
        let k = (&keys + &key_pe)?;
        let queries =
            (&queries + self.final_attn.forward(&q, &k, &keys)?)?.apply(&self.norm_final)?;
        let iou_out = queries.narrow(1, 0, 1)?.squeeze(1)?;
        let mask_out = queries.narrow(1, 1, t)?;

        let src = keys.transpose(1, 2)?.reshape((b, c, h, w))?;
        let up = src.apply(&self.up0)?;
        let up = layer_norm_nchw(&self.up1, &up)?.gelu_erf()?;
        let up = up.apply(&self.up3)?.gelu_erf()?; // (1, e/8, 4h, 4w)
        let hyper = self
            .hyper
            .iter()
            .enumerate()
            .map(|(i, mlp)| mask_out.narrow(1, i, 1)?.apply(mlp))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let hyper = Tensor::cat(&hyper, 1)?; // (1, t, e/8)
        let (_, cu, hu, wu) = up.dims4()?;
        let masks = hyper
            .matmul(&up.reshape((b, cu, hu * wu))?)?
            .reshape((b, t, hu, wu))?;
        let iou = iou_out.apply(&self.iou_head)?;
        Ok((masks, iou))
    }
}

// ---------------------------------------------------------------------------------------------
// The model

static INSTANCES: AtomicU64 = AtomicU64::new(1);

/// Where the image encoder runs: candle on the model's device, or its ONNX graph
/// ([`Sam::encoder_onnx`]) on ONNX Runtime or on a KServe v2 server (Triton). The prompt encoder
/// and mask decoder always run in candle, in process.
enum EncoderRun {
    Candle,
    #[cfg(feature = "onnx")]
    Onnx(crate::onnx::OnnxModel),
    Remote(crate::kserve::KserveModel),
}

impl std::fmt::Debug for EncoderRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EncoderRun::Candle => "candle",
            #[cfg(feature = "onnx")]
            EncoderRun::Onnx(_) => "onnx",
            EncoderRun::Remote(_) => "kserve",
        })
    }
}

/// SAM / MedSAM: encode an image once, then decode any number of prompts against it.
#[derive(Debug)]
pub struct Sam {
    image_encoder: ImageEncoder,
    encoder_run: EncoderRun,
    prompt_encoder: PromptEncoder,
    mask_decoder: MaskDecoder,
    image_pe: Tensor,
    config: Config,
    device: candle_core::Device,
    encoder_runs: AtomicUsize,
    instance: u64,
}

impl Sam {
    /// `vb` at the root of the checkpoint (`image_encoder.`, `prompt_encoder.`, `mask_decoder.`).
    pub fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        cfg.check()?;
        let prompt_encoder = PromptEncoder::load(vb.pp("prompt_encoder"), cfg)?;
        let image_pe = prompt_encoder.dense_pe()?;
        Ok(Sam {
            image_encoder: ImageEncoder::load(vb.pp("image_encoder"), cfg)?,
            encoder_run: EncoderRun::Candle,
            prompt_encoder,
            mask_decoder: MaskDecoder::load(vb.pp("mask_decoder"), cfg)?,
            image_pe,
            config: cfg.clone(),
            device: vb.device().clone(),
            encoder_runs: AtomicUsize::new(0),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn device(&self) -> &candle_core::Device {
        &self.device
    }

    /// How many times the image encoder has run (the expensive part; callers cache its output).
    pub fn encoder_runs(&self) -> usize {
        self.encoder_runs.load(Ordering::Relaxed)
    }

    /// Distinguishes loaded copies (a cache keyed by it never mixes weights).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// The image encoder: (1, 3, S, S) -> (1, prompt_embed_dim, S/p, S/p).
    pub fn embed_image(&self, input: &Tensor) -> candle_core::Result<Tensor> {
        self.encoder_runs.fetch_add(1, Ordering::Relaxed);
        self.image_encoder.forward(input)
    }

    /// Where the image encoder runs (the rest is candle's).
    pub fn backend(&self) -> crate::Backend {
        match self.encoder_run {
            EncoderRun::Candle => crate::Backend::Candle,
            #[cfg(feature = "onnx")]
            EncoderRun::Onnx(_) => crate::Backend::Onnx,
            EncoderRun::Remote(_) => crate::Backend::Kserve,
        }
    }

    /// The image encoder on `backend`: `Candle` (and `Native`) in process on the model's device,
    /// `Onnx` runs [`Sam::encoder_onnx`] of these weights on
    /// ONNX Runtime (CPU, `threads`), `Kserve` sends it to the server of `remote`, which serves
    /// that graph as model `id` (`hilum models export-triton`), checked at connection.
    pub fn with_encoder_on(
        mut self,
        backend: crate::Backend,
        id: &str,
        threads: usize,
        remote: Option<&crate::KserveSettings>,
    ) -> Result<Self, ModelError> {
        let (s, e, g) = (
            self.config.image_size as i64,
            self.config.prompt_embed_dim as i64,
            self.config.grid() as i64,
        );
        self.encoder_run = match backend {
            // SAM has no kernels of Hilum's own: in process, `native` (a `[remote] fallback`
            // written for the CNNs) is candle.
            crate::Backend::Candle | crate::Backend::Native => EncoderRun::Candle,
            crate::Backend::Kserve => {
                use crate::kserve::{KserveModel, TensorSpec};
                let remote = remote.ok_or(ModelError::NoRemote)?;
                let input = TensorSpec::new(onnx_graph::INPUT, &[-1, 3, s, s]);
                let output = TensorSpec::new(ONNX_EMBEDDINGS, &[-1, e, g, g]);
                EncoderRun::Remote(KserveModel::connect(remote, id, input, output)?)
            }
            #[cfg(feature = "onnx")]
            crate::Backend::Onnx => {
                let graph = self.encoder_onnx()?;
                EncoderRun::Onnx(crate::onnx::OnnxModel::from_memory(
                    &graph,
                    &format!("{id}'s image encoder"),
                    threads,
                    Device::Cpu,
                )?)
            }
            #[cfg(not(feature = "onnx"))]
            crate::Backend::Onnx => {
                let _ = threads;
                return Err(ModelError::Onnx(
                    "this hilum was built without the `onnx` feature; use the candle backend"
                        .into(),
                ));
            }
        };
        Ok(self)
    }

    /// [`Sam::embed_image`] on the output of [`preprocess`] / [`recipe`] (`3 * S * S` values),
    /// on the encoder's backend.
    pub fn embed_prepared(&self, input: &[f32]) -> Result<Tensor, ModelError> {
        crate::fault::check()?;
        let c = &self.config;
        let s = c.image_size;
        let (e, g) = (c.prompt_embed_dim, c.grid());
        let served = match &self.encoder_run {
            EncoderRun::Candle => {
                let x = Tensor::from_slice(input, (1, 3, s, s), &self.device)?;
                return Ok(self.embed_image(&x)?);
            }
            #[cfg(feature = "onnx")]
            EncoderRun::Onnx(m) => m.run(&[1, 3, s, s], input)?,
            EncoderRun::Remote(m) => m.infer(&[1, 3, s, s], input)?,
        };
        self.encoder_runs.fetch_add(1, Ordering::Relaxed);
        let (shape, values) = served;
        if shape != [1, e, g, g] || values.len() != e * g * g {
            return Err(ModelError::Compute(format!(
                "the {} backend's image embedding has shape {shape:?} ({} values), expected [1, {e}, {g}, {g}]",
                self.backend(),
                values.len()
            )));
        }
        Ok(Tensor::from_vec(values, (1, e, g, g), &self.device)?)
    }

    /// The image encoder as an ONNX graph (IR 8, opset 17): input [`onnx_graph::INPUT`]
    /// (batch, 3, S, S) as [`recipe`] prepares it, output [`ONNX_EMBEDDINGS`]
    /// (batch, prompt_embed_dim, S/p, S/p), what [`Sam::embed_image`] returns. The prompt
    /// encoder and mask decoder stay in process: they are small and run once per prompt.
    pub fn encoder_onnx(&self) -> candle_core::Result<Vec<u8>> {
        let (s, e, grid) = (
            self.config.image_size,
            self.config.prompt_embed_dim,
            self.config.grid(),
        );
        let mut g = GraphBuilder::new("sam_image_encoder");
        let y = self.image_encoder.to_onnx(&mut g, s)?;
        let batch = Dim::Named("batch");
        let (s, e, grid) = (Dim::Fixed(s), Dim::Fixed(e), Dim::Fixed(grid));
        Ok(g.finish(
            (onnx_graph::INPUT, &[batch, Dim::Fixed(3), s, s]),
            &y,
            (ONNX_EMBEDDINGS, &[batch, e, grid, grid]),
            "Segment Anything image encoder (MedSAM ViT-B), written by Hilum from the installed weights",
        ))
    }

    /// The prompt encoder: (sparse (1, n, e), dense (1, e, g, g)).
    pub fn encode_prompt(&self, prompt: &Prompt) -> candle_core::Result<(Tensor, Tensor)> {
        self.prompt_encoder.forward(prompt)
    }

    /// `get_dense_pe()`: (1, e, g, g).
    pub fn dense_pe(&self) -> &Tensor {
        &self.image_pe
    }

    /// Every mask token's low-resolution logits (1, 1 + multimask, 4g, 4g) and predicted IoU
    /// (1, 1 + multimask); MedSAM uses index 0 (`multimask_output=False`).
    pub fn decode(
        &self,
        embedding: &Tensor,
        prompt: &Prompt,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (sparse, dense) = self.prompt_encoder.forward(prompt)?;
        self.mask_decoder
            .forward(embedding, &self.image_pe, &sparse, &dense)
    }

    /// MedSAM's single-mask output: low-resolution logits (4g * 4g values, row-major) and the
    /// predicted IoU.
    pub fn predict_low_res(
        &self,
        embedding: &Tensor,
        prompt: &Prompt,
    ) -> Result<(Vec<f32>, f32), ModelError> {
        crate::fault::check()?;
        let (masks, iou) = self.decode(embedding, prompt)?;
        let logits = masks.get(0)?.get(0)?.flatten_all()?.to_vec1::<f32>()?;
        let iou = iou.get(0)?.get(0)?.to_scalar::<f32>()?;
        Ok((logits, iou))
    }
}

/// MedSAM's input for a whole grayscale image (`MedSAM_Inference.py`): the image on an 8-bit
/// scale, stretched to `size` x `size` by skimage's resize as MedSAM calls it (order 3,
/// `mode="reflect"`, anti-aliasing), truncated to integers (`astype(np.uint8)`), min-max scaled
/// to 0..1 over the resized image, repeated to 3 channels (CHW).
pub fn recipe(size: usize) -> Preprocess {
    Preprocess::stretch(size as u32, size as u32)
        .filter(Filter::SkimageCubicU8)
        .norm(Norm::MinMax)
        .channels(3)
}

/// [`recipe`] on a bare plane of full scale `max_value` (fixtures, device checks); nothing when
/// the plane does not hold `width * height` values.
pub fn preprocess(
    gray: &[f32],
    width: usize,
    height: usize,
    max_value: f32,
    size: usize,
) -> Vec<f32> {
    recipe_values(&recipe(size), gray, width, height, max_value)
}

/// The runner is the image encoder, the expensive pass whose output callers cache: prompts are
/// decoded on its embedding afterwards ([`Sam::predict_low_res`]), several per image, so they
/// are not part of `run`.
impl Runner for Sam {
    /// The image embedding (1, prompt_embed_dim, S/p, S/p).
    type Output = Tensor;

    fn recipe(&self) -> Preprocess {
        recipe(self.config.image_size)
    }

    fn run(&self, input: &Prepared) -> Result<Tensor, ModelError> {
        check_input(&Runner::recipe(self), input)?;
        self.embed_prepared(&input.data)
    }
}

/// `F.interpolate(mode="bilinear", align_corners=False)` of one map, without antialiasing
/// (what MedSAM does to bring the 256 x 256 probabilities to the original size).
pub fn interpolate_bilinear(src: &[f32], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<f32> {
    let taps = |s: usize, d: usize| -> Vec<(usize, usize, f32)> {
        let scale = s as f32 / d as f32;
        (0..d)
            .map(|i| {
                let x = ((i as f32 + 0.5) * scale - 0.5).max(0.0);
                let x0 = (x.floor() as usize).min(s - 1);
                let x1 = (x0 + 1).min(s - 1);
                (x0, x1, x - x0 as f32)
            })
            .collect()
    };
    if sw == 0 || sh == 0 || src.len() < sw * sh {
        return vec![0.0; dw * dh];
    }
    let (tx, ty) = (taps(sw, dw), taps(sh, dh));
    let mut out = Vec::with_capacity(dw * dh);
    for &(y0, y1, fy) in &ty {
        let (r0, r1) = (&src[y0 * sw..(y0 + 1) * sw], &src[y1 * sw..(y1 + 1) * sw]);
        for &(x0, x1, fx) in &tx {
            let top = r0[x0] * (1.0 - fx) + r0[x1] * fx;
            let bottom = r1[x0] * (1.0 - fx) + r1[x1] * fx;
            out.push(top * (1.0 - fy) + bottom * fy);
        }
    }
    out
}

/// Every parameter of a SAM checkpoint for `cfg`, as the loader asks for them.
pub fn expected_params(cfg: &Config) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    crate::weights::recorded_params(|vb| Sam::load(vb, cfg))
}

/// A model of `cfg` with seeded random weights (benchmarks; never used for answers).
pub fn random(cfg: &Config, seed: u64, device: Device) -> Result<Sam, ModelError> {
    let dev = device.candle()?;
    let names = expected_params(cfg)?;
    let mut state = seed | 1;
    let mut tensors = std::collections::HashMap::new();
    for (name, shape) in names {
        let n: usize = shape.iter().product();
        let fan_in = shape.iter().skip(1).product::<usize>().max(1) as f32;
        let amp = 1.0 / fan_in.sqrt();
        let v: Vec<f32> = (0..n)
            .map(|_| (2.0 * crate::weights::xorshift_unit(&mut state) - 1.0) * amp)
            .collect();
        tensors.insert(name, Tensor::from_vec(v, shape, &dev)?);
    }
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &dev);
    Ok(Sam::load(vb, cfg)?)
}

/// Where the image encoder runs by default: on the CPU, its ONNX graph on ONNX Runtime when the
/// runtime loads — ViT-B at 1024 px took 11.3-12.0 s there against candle's 22.1-24.1 s,
/// alternated on 2 cores (`cargo test --release -p hilum-models --test it medsam_onnx::full --
/// --ignored --nocapture`), the embeddings within 1.0e-6; candle otherwise and on GPUs.
pub fn auto_backend(device: Device) -> crate::Backend {
    #[cfg(feature = "onnx")]
    if !device.is_gpu() && crate::onnx::available() {
        return crate::Backend::Onnx;
    }
    let _ = device;
    crate::Backend::Candle
}

/// Loads a safetensors checkpoint with configuration `cfg`.
pub fn load_file(path: &Path, cfg: &Config, device: Device) -> Result<Sam, ModelError> {
    let vb = crate::weights::var_builder(path, device)?;
    Sam::load(vb, cfg).map_err(|e| ModelError::Corrupt {
        id: "medsam-vit-b".into(),
        reason: e.to_string(),
    })
}

impl crate::Model for Sam {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: crate::Backend,
        settings: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        let cfg = Config::from_manifest(manifest)?;
        let vb = crate::weights::var_builder(&installed.weights, device)?;
        let sam = Sam::load(vb, &cfg).map_err(|e| ModelError::Corrupt {
            id: manifest.id.clone(),
            reason: e.to_string(),
        })?;
        sam.with_encoder_on(
            backend,
            &manifest.id,
            settings.cpu.threads(),
            settings.remote.as_ref(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bilinear_matches_align_corners_false() {
        // 2 -> 4 upsampling of [0, 1]: torch gives [0, 0.25, 0.75, 1].
        let out = interpolate_bilinear(&[0.0, 1.0], 2, 1, 4, 1);
        for (a, b) in out.iter().zip([0.0, 0.25, 0.75, 1.0]) {
            assert!((a - b).abs() < 1e-6, "{out:?}");
        }
        // Same size is the identity.
        let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(interpolate_bilinear(&src, 4, 3, 4, 3), src);
    }

    #[test]
    fn preprocess_is_min_max_scaled_and_three_channel() {
        let gray: Vec<f32> = (0..64 * 48).map(|i| (i % 64) as f32 * 4.0 + 20.0).collect();
        let x = preprocess(&gray, 64, 48, 65535.0, 32);
        assert_eq!(x.len(), 3 * 32 * 32);
        let (lo, hi) = x
            .iter()
            .fold((1f32, 0f32), |(a, b), &v| (a.min(v), b.max(v)));
        assert_eq!((lo, hi), (0.0, 1.0));
        assert_eq!(&x[..1024], &x[1024..2048]);
        // A flat image does not divide by zero.
        let flat = preprocess(&[7.0; 100], 10, 10, 255.0, 16);
        assert!(flat.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn vit_b_config_is_consistent() {
        let c = Config::vit_b();
        assert!(c.check().is_ok());
        assert_eq!((c.grid(), c.low_res()), (64, 256));
    }
}
