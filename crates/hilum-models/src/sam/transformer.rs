//! SAM's `TwoWayTransformer`: prompt tokens and image embedding attend to each other.

use super::*;

/// The two-way transformer's attention, with a downsampled internal dimension.
#[derive(Clone, Debug)]
pub(super) struct TokenAttention {
    pub(super) q: Lin,
    pub(super) k: Lin,
    pub(super) v: Lin,
    pub(super) out: Lin,
    pub(super) heads: usize,
}

impl TokenAttention {
    pub(super) fn load(
        vb: VarBuilder,
        dim: usize,
        heads: usize,
        down: usize,
    ) -> candle_core::Result<Self> {
        let inner = dim / down;
        Ok(TokenAttention {
            q: Lin::load(vb.pp("q_proj"), dim, inner, true)?,
            k: Lin::load(vb.pp("k_proj"), dim, inner, true)?,
            v: Lin::load(vb.pp("v_proj"), dim, inner, true)?,
            out: Lin::load(vb.pp("out_proj"), inner, dim, true)?,
            heads,
        })
    }

    pub(super) fn heads_of(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, n, c) = x.dims3()?;
        x.reshape((b, n, self.heads, c / self.heads))?
            .transpose(1, 2)?
            .contiguous()
    }

    pub(super) fn forward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<Tensor> {
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
pub(super) struct TwoWayBlock {
    pub(super) self_attn: TokenAttention,
    pub(super) norm1: LayerNorm,
    pub(super) cross_token_to_image: TokenAttention,
    pub(super) norm2: LayerNorm,
    pub(super) mlp: Mlp,
    pub(super) norm3: LayerNorm,
    pub(super) norm4: LayerNorm,
    pub(super) cross_image_to_token: TokenAttention,
    pub(super) skip_first_layer_pe: bool,
}

impl TwoWayBlock {
    pub(super) fn load(vb: VarBuilder, cfg: &Config, first: bool) -> candle_core::Result<Self> {
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

    pub(super) fn forward(
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
