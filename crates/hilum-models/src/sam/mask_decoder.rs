//! SAM's `MaskDecoder`: the two-way transformer, the upscaling to 256 x 256 and the
//! hypernetwork heads that give the mask logits and their IoU predictions.

use super::*;

/// (b, cin, h, w) -> (b, cout, 2h, 2w): a kernel-2 stride-2 transposed convolution has no
/// overlapping outputs, so it is one matrix product.
#[derive(Clone, Debug)]
pub(super) struct Up2 {
    pub(super) weight: Tensor, // (cin, cout * 4)
    pub(super) bias: Tensor,
    pub(super) cout: usize,
}

impl Up2 {
    pub(super) fn load(vb: VarBuilder, cin: usize, cout: usize) -> candle_core::Result<Self> {
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
pub(super) struct MaskDecoder {
    pub(super) layers: Vec<TwoWayBlock>,
    pub(super) final_attn: TokenAttention,
    pub(super) norm_final: LayerNorm,
    pub(super) iou_token: Tensor,
    pub(super) mask_tokens: Tensor,
    pub(super) up0: Up2,
    pub(super) up1: LayerNorm,
    pub(super) up3: Up2,
    pub(super) hyper: Vec<HeadMlp>,
    pub(super) iou_head: HeadMlp,
}

impl MaskDecoder {
    pub(super) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
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
    pub(super) fn forward(
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
