//! CLIP's vision transformer (`models/clip/modeling_clip.py`) up to the layer LLaVA reads, and
//! the slow `CLIPImageProcessor` that prepares its input.

use candle_core::{Device, Module, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, LayerNorm, VarBuilder};

use crate::ModelError;
use serde::Deserialize;

use super::config::*;
use super::layers::*;

/// CLIP's normalisation (OpenAI CLIP, also in `CLIPImageProcessor` of LLaVA checkpoints).
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

// --- CLIP vision tower ------------------------------------------------------------------------

#[derive(Debug)]
pub(crate) struct ClipLayer {
    pub(crate) q_proj: Lin,
    pub(crate) k_proj: Lin,
    pub(crate) v_proj: Lin,
    pub(crate) out_proj: Lin,
    pub(crate) layer_norm1: LayerNorm,
    pub(crate) layer_norm2: LayerNorm,
    pub(crate) fc1: Lin,
    pub(crate) fc2: Lin,
    pub(crate) heads: usize,
    pub(crate) act: Act,
}

impl ClipLayer {
    pub(crate) fn load(vb: VarBuilder, c: &VisionConfig) -> Result<ClipLayer, ModelError> {
        let d = c.hidden_size;
        let lin = |n: &str, i, o| Lin::load(vb.pp(n), i, o, true, Precision::Dense);
        Ok(ClipLayer {
            q_proj: lin("self_attn.q_proj", d, d)?,
            k_proj: lin("self_attn.k_proj", d, d)?,
            v_proj: lin("self_attn.v_proj", d, d)?,
            out_proj: lin("self_attn.out_proj", d, d)?,
            layer_norm1: candle_nn::layer_norm(d, c.layer_norm_eps, vb.pp("layer_norm1"))?,
            layer_norm2: candle_nn::layer_norm(d, c.layer_norm_eps, vb.pp("layer_norm2"))?,
            fc1: lin("mlp.fc1", d, c.intermediate_size)?,
            fc2: lin("mlp.fc2", c.intermediate_size, d)?,
            heads: c.num_attention_heads,
            act: activation(&c.hidden_act)?,
        })
    }

    pub(crate) fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = xs.dims3()?;
        let hd = d / self.heads;
        let h = xs.apply(&self.layer_norm1)?;
        let split = |x: Tensor| {
            x.reshape((b, t, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(self.q_proj.forward(&h)?)?;
        let k = split(self.k_proj.forward(&h)?)?;
        let v = split(self.v_proj.forward(&h)?)?;
        let a = attention(&q, &k, &v, (hd as f64).powf(-0.5), None)?
            .transpose(1, 2)?
            .reshape((b, t, d))?;
        let xs = (xs + self.out_proj.forward(&a)?)?;
        let h = xs.apply(&self.layer_norm2)?.apply(&self.fc1)?;
        let h = self.act.apply(&h)?.apply(&self.fc2)?;
        xs + h
    }
}

/// CLIP's vision transformer up to the layer LLaVA reads its features from.
#[derive(Debug)]
pub(crate) struct ClipVision {
    pub(crate) patch_embedding: Conv2d,
    pub(crate) class_embedding: Tensor,
    pub(crate) position_embedding: Tensor,
    pub(crate) pre_layrnorm: LayerNorm,
    pub(crate) layers: Vec<ClipLayer>,
}

impl ClipVision {
    /// Loads the first `n_layers` encoder layers (the later ones do not change the features).
    pub(crate) fn load(
        vb: VarBuilder,
        c: &VisionConfig,
        n_layers: usize,
    ) -> Result<ClipVision, ModelError> {
        let d = c.hidden_size;
        let n_pos = (c.image_size / c.patch_size).pow(2) + 1;
        let e = vb.pp("embeddings");
        let conv = Conv2dConfig {
            stride: c.patch_size,
            ..Default::default()
        };
        Ok(ClipVision {
            patch_embedding: candle_nn::conv2d_no_bias(
                c.num_channels,
                d,
                c.patch_size,
                conv,
                e.pp("patch_embedding"),
            )?,
            class_embedding: e.get(d, "class_embedding")?,
            position_embedding: e.get((n_pos, d), "position_embedding.weight")?,
            pre_layrnorm: candle_nn::layer_norm(d, c.layer_norm_eps, vb.pp("pre_layrnorm"))?,
            layers: (0..n_layers)
                .map(|i| ClipLayer::load(vb.pp(format!("encoder.layers.{i}")), c))
                .collect::<Result<_, _>>()?,
        })
    }

    /// (b, 3, S, S) → hidden state after the loaded layers, (b, 1 + patches, d).
    pub(crate) fn forward(&self, pixels: &Tensor) -> candle_core::Result<Tensor> {
        let b = pixels.dim(0)?;
        // (b, d, S/p, S/p) → (b, patches, d)
        let patches = pixels
            .apply(&self.patch_embedding)?
            .flatten_from(2)?
            .transpose(1, 2)?;
        let d = self.class_embedding.dim(0)?;
        let cls = self.class_embedding.reshape((1, 1, d))?.repeat((b, 1, 1))?;
        let mut xs = Tensor::cat(&[&cls, &patches], 1)?
            .broadcast_add(&self.position_embedding)?
            .apply(&self.pre_layrnorm)?;
        for l in &self.layers {
            xs = l.forward(&xs)?;
        }
        Ok(xs)
    }
}

// ---------------------------------------------------------------------------------------------
// Preprocessing
// ---------------------------------------------------------------------------------------------

/// How a non-square radiograph becomes the model's square input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AspectMode {
    /// `CLIPImageProcessor`: shortest side to S, centre crop S x S (drops the long side's ends).
    #[default]
    Crop,
    /// LLaVA-1.5 `image_aspect_ratio = "pad"`: centred on a square of the mean colour first,
    /// so the whole radiograph is seen.
    Pad,
}

/// An 8-bit grey radiograph → pixel values (1, 3, size, size), normalised with CLIP mean/std.
/// Grey is replicated to RGB (PIL's `convert("RGB")`).
pub fn preprocess(
    gray: &[u8],
    width: usize,
    height: usize,
    size: usize,
    mode: AspectMode,
    device: &Device,
) -> Result<Tensor, ModelError> {
    if width == 0 || height == 0 || gray.len() != width * height || size == 0 {
        return Err(ModelError::Compute(format!(
            "image buffer of {} bytes does not match {width}x{height}",
            gray.len()
        )));
    }
    // Crop mode keeps R = G = B: one plane is resized and used three times.
    let n_planes = if mode == AspectMode::Crop { 1 } else { 3 };
    let mut planes: Vec<(Vec<u8>, usize, usize)> = (0..n_planes)
        .map(|c| match mode {
            AspectMode::Crop => (gray.to_vec(), width, height),
            AspectMode::Pad => {
                // expand2square: background = int(mean * 255) per channel, image centred.
                let side = width.max(height);
                let bg = (CLIP_MEAN[c] * 255.0) as u8;
                let mut p = vec![bg; side * side];
                let (ox, oy) = ((side - width) / 2, (side - height) / 2);
                for y in 0..height {
                    p[(oy + y) * side + ox..(oy + y) * side + ox + width]
                        .copy_from_slice(&gray[y * width..(y + 1) * width]);
                }
                (p, side, side)
            }
        })
        .collect();
    // Shortest side to `size` (transformers' get_resize_output_image_size), bicubic as PIL.
    let (w, h) = (planes[0].1, planes[0].2);
    let (nw, nh) = if w <= h {
        (size, ((size * h) as f64 / w as f64) as usize)
    } else {
        (((size * w) as f64 / h as f64) as usize, size)
    };
    for p in &mut planes {
        if (nw, nh) != (p.1, p.2) {
            p.0 = resize_bicubic_pil(&p.0, p.1, p.2, nw, nh);
            p.1 = nw;
            p.2 = nh;
        }
    }
    // Centre crop (transformers' center_crop: top = (h - size) // 2).
    let (top, left) = ((nh - size.min(nh)) / 2, (nw - size.min(nw)) / 2);
    let mut out = vec![0f32; 3 * size * size];
    for c in 0..3 {
        let (p, pw, _) = &planes[c.min(n_planes - 1)];
        for y in 0..size {
            for x in 0..size {
                let v = p[(top + y) * pw + left + x] as f64 / 255.0;
                out[(c * size + y) * size + x] = ((v - CLIP_MEAN[c]) / CLIP_STD[c]) as f32;
            }
        }
    }
    Ok(Tensor::from_vec(out, (1, 3, size, size), device)?)
}

/// Pillow's 8-bit bicubic resampling (`ImagingResample`, a = -0.5, support widened by the
/// scale when shrinking, 22-bit fixed-point weights, horizontal pass then vertical, each
/// rounded and clipped to 8 bits), so pixel values match the Python processor exactly.
pub fn resize_bicubic_pil(src: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    const PRECISION_BITS: u32 = 32 - 8 - 2;
    pub(crate) fn cubic(x: f64) -> f64 {
        let a = -0.5;
        let x = x.abs();
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * a
        } else {
            0.0
        }
    }
    // Per output pixel: first input index and fixed-point weights.
    pub(crate) fn coeffs(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = 2.0 * filterscale;
        (0..out_size)
            .map(|xx| {
                let center = (xx as f64 + 0.5) * scale;
                let ss = 1.0 / filterscale;
                let xmin = ((center - support + 0.5).floor() as i64).max(0) as usize;
                let xmax = ((center + support + 0.5).floor() as i64).min(in_size as i64) as usize;
                let mut k: Vec<f64> = (xmin..xmax)
                    .map(|x| cubic((x as f64 - center + 0.5) * ss))
                    .collect();
                let ww: f64 = k.iter().sum();
                if ww != 0.0 {
                    k.iter_mut().for_each(|v| *v /= ww);
                }
                let fixed = k
                    .iter()
                    .map(|v| {
                        let s = v * (1u32 << PRECISION_BITS) as f64;
                        (if s < 0.0 { s - 0.5 } else { s + 0.5 }) as i32
                    })
                    .collect();
                (xmin, fixed)
            })
            .collect()
    }
    pub(crate) fn clip8(v: i64) -> u8 {
        (v >> PRECISION_BITS).clamp(0, 255) as u8
    }
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut tmp = vec![0u8; nw * h];
    let hc = coeffs(w, nw);
    for y in 0..h {
        for (x, (x0, k)) in hc.iter().enumerate() {
            let mut s = half;
            for (j, &kk) in k.iter().enumerate() {
                s += src[y * w + x0 + j] as i64 * kk as i64;
            }
            tmp[y * nw + x] = clip8(s);
        }
    }
    let vc = coeffs(h, nh);
    let mut out = vec![0u8; nw * nh];
    for (y, (y0, k)) in vc.iter().enumerate() {
        for x in 0..nw {
            let mut s = half;
            for (j, &kk) in k.iter().enumerate() {
                s += tmp[(y0 + j) * nw + x] as i64 * kk as i64;
            }
            out[y * nw + x] = clip8(s);
        }
    }
    out
}
