//! SAM's `PromptEncoder`: points and boxes as random-Fourier positional encodings plus learned
//! type embeddings, and the dense embedding (no mask prompt).

use super::*;

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
pub(super) struct PromptEncoder {
    pub(super) gaussian: Tensor, // (2, e/2)
    pub(super) point_embeddings: Vec<Tensor>,
    pub(super) not_a_point: Tensor,
    pub(super) no_mask: Tensor,
    pub(super) mask_conv0: candle_nn::Conv2d,
    pub(super) mask_ln1: LayerNorm,
    pub(super) mask_conv3: candle_nn::Conv2d,
    pub(super) mask_ln4: LayerNorm,
    pub(super) mask_conv6: Lin,
    pub(super) input_size: usize,
    pub(super) grid: usize,
}

impl PromptEncoder {
    pub(super) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
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
    pub(super) fn pe_encoding(&self, coords: &Tensor) -> candle_core::Result<Tensor> {
        let c = coords.affine(2.0, -1.0)?;
        let c = (c.broadcast_matmul(&self.gaussian)? * (2.0 * std::f64::consts::PI))?;
        Tensor::cat(&[c.sin()?, c.cos()?], D::Minus1)
    }

    /// `get_dense_pe`: (1, e, g, g).
    pub(super) fn dense_pe(&self) -> candle_core::Result<Tensor> {
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
    pub(super) fn embed_coords(&self, xy: &[(f32, f32)]) -> candle_core::Result<Tensor> {
        let s = self.input_size as f32;
        let v: Vec<f32> = xy
            .iter()
            .flat_map(|&(x, y)| [(x + 0.5) / s, (y + 0.5) / s])
            .collect();
        let t = Tensor::from_vec(v, (1, xy.len(), 2), self.gaussian.device())?;
        self.pe_encoding(&t)
    }

    /// (sparse (1, n, e), dense (1, e, g, g)).
    pub(super) fn forward(&self, prompt: &Prompt) -> candle_core::Result<(Tensor, Tensor)> {
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
