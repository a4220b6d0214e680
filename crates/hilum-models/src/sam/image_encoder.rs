//! SAM's `ImageEncoderViT`: patch embedding, windowed and global attention blocks with
//! decomposed relative positions, and the neck that gives the (256, 64, 64) embedding.

use super::*;

/// Adds the decomposed relative position terms to the attention logits and takes the softmax
/// in one pass over the (large) logits, on the CPU: logits (n, qh*qw, kh*kw), rel_h
/// (n, qh, qw, kh), rel_w (n, qh, qw, kw).
pub(super) struct RelPosSoftmax {
    pub(super) n: usize,
    pub(super) q: (usize, usize),
    pub(super) k: (usize, usize),
}

pub(super) fn contiguous_f32<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
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
pub(super) fn get_rel_pos(
    q_size: usize,
    k_size: usize,
    rel_pos: &Tensor,
) -> candle_core::Result<Tensor> {
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
pub(super) struct EncoderAttention {
    pub(super) qkv: Lin,
    pub(super) proj: Lin,
    pub(super) num_heads: usize,
    pub(super) scale: f64,
    pub(super) rel_pos_h: Tensor,
    pub(super) rel_pos_w: Tensor,
}

impl EncoderAttention {
    pub(super) fn load(
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
pub(super) struct EncoderBlock {
    pub(super) norm1: LayerNorm,
    pub(super) attn: EncoderAttention,
    pub(super) norm2: LayerNorm,
    pub(super) mlp: Mlp,
    /// 0 for global attention.
    pub(super) window: usize,
}

/// (b, h, w, c) -> (b * windows, ws, ws, c), zero-padding h and w to multiples of `ws`.
pub(super) fn window_partition(
    xs: &Tensor,
    ws: usize,
) -> candle_core::Result<(Tensor, (usize, usize))> {
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

pub(super) fn window_unpartition(
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
pub(super) struct ImageEncoder {
    /// `patch_embed.proj` as a (embed, 3 * p * p) matrix: a stride-p p x p convolution is one
    /// matrix product over non-overlapping patches.
    pub(super) patch_w: Tensor,
    pub(super) patch_b: Tensor,
    pub(super) pos_embed: Tensor,
    pub(super) blocks: Vec<EncoderBlock>,
    pub(super) neck0: Tensor,
    pub(super) neck1: LayerNorm,
    /// `neck.2` (3x3, padding 1, no bias) as a (out, 9 * in) matrix over (ky, kx, in) patches.
    pub(super) neck2: Tensor,
    pub(super) neck3: LayerNorm,
    pub(super) patch: usize,
}

impl ImageEncoder {
    pub(super) fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
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
