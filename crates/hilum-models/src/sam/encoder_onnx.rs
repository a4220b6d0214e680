//! The image encoder as an ONNX graph (ONNX Runtime, Triton), op for op as the candle code of
//! [`super::image_encoder`]: two-pass LayerNorms, the erf GELU, the decomposed relative
//! positions added before the softmax.

use super::*;

/// Name of the encoder graph's output: (batch, prompt_embed_dim, grid, grid).
pub const ONNX_EMBEDDINGS: &str = "embeddings";

impl Lin {
    /// `x @ weight.T + bias` over the last axis of any rank; the runtime folds the transpose
    /// of the initializer once, and the initializer keeps the checkpoint's name and layout.
    pub(super) fn to_onnx(
        &self,
        g: &mut GraphBuilder,
        name: &str,
        x: &str,
    ) -> candle_core::Result<String> {
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
    pub(super) fn to_onnx(
        &self,
        g: &mut GraphBuilder,
        name: &str,
        x: &str,
    ) -> candle_core::Result<String> {
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
    pub(super) fn to_onnx(
        &self,
        g: &mut GraphBuilder,
        name: &str,
        x: &str,
    ) -> candle_core::Result<String> {
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
    pub(super) fn to_onnx(
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
    pub(super) fn to_onnx(
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
    pub(super) fn to_onnx(
        &self,
        g: &mut GraphBuilder,
        image_size: usize,
    ) -> candle_core::Result<String> {
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
