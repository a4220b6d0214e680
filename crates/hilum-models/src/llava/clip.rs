//! CLIP's vision transformer (`models/clip/modeling_clip.py`) up to the layer LLaVA reads, and
//! the slow `CLIPImageProcessor` that prepares its input.

use candle_core::{Device, Module, Tensor};
use candle_nn::{Conv2d, Conv2dConfig, LayerNorm, VarBuilder};
use hilum_imaging::{prepare_values, Filter, Fit, Norm, Preprocess};

use crate::ModelError;
use serde::Deserialize;

use super::config::*;
use super::layers::*;

pub use hilum_imaging::{CLIP_MEAN, CLIP_STD};

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
        let lin = |n: &str, i, o| Lin::load(vb.pp(n), i, o, true);
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

/// CLIP's input as an image-store recipe: Pillow's 8-bit bicubic, CLIP mean/std, grey
/// replicated to RGB (PIL's `convert("RGB")`); `Crop` is `CLIPImageProcessor`'s shortest side
/// to `size` then centre crop, `Pad` LLaVA's `expand2square` on the mean colour first.
pub fn recipe(size: usize, mode: AspectMode) -> Preprocess {
    let side = u32::try_from(size).unwrap_or(u32::MAX);
    Preprocess::stretch(side, side)
        .filter(Filter::PilBicubicU8)
        .fit(match mode {
            AspectMode::Crop => Fit::ShortSideCrop,
            AspectMode::Pad => Fit::PadSquare,
        })
        .norm(Norm::Clip)
        .channels(3)
}

/// An 8-bit grey radiograph → pixel values (1, 3, size, size) by [`recipe`], for callers that
/// hold bytes rather than an image store (fixtures).
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
    let values: Vec<f32> = gray.iter().map(|&v| f32::from(v)).collect();
    let (w, h) = (
        u32::try_from(width).map_err(|_| ModelError::Compute("image too wide".into()))?,
        u32::try_from(height).map_err(|_| ModelError::Compute("image too tall".into()))?,
    );
    let input = prepare_values(&values, w, h, 255.0, &recipe(size, mode))
        .map_err(|e| ModelError::Compute(e.to_string()))?;
    Ok(Tensor::from_vec(input.data, (1, 3, size, size), device)?)
}
