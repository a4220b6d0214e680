//! The lung U-Net ([`crate::unet::LungUnet`]) on the native CPU kernels, built from the candle
//! model's (already BN-folded) weights. NHWC input as Keras takes it; the decoder's nearest
//! upsampling is read on the fly by each decoder conv, the squeeze-excitation gate is folded
//! into the 1x1 projection's weights per image, and the skip add is fused into that projection.

use super::{validate, Act, Affine, ConvOp, CpuError, Executor, Op, Output, Plan, SeOp, View};
use crate::unet::{same_padding, Block, LungUnet};

/// A lung U-Net compiled for its input size.
pub struct NativeUnet {
    exec: Executor,
    size: usize,
}

impl std::fmt::Debug for NativeUnet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeUnet")
            .field("size", &self.size)
            .field("threads", &self.exec.threads())
            .finish()
    }
}

const INPUT: usize = 0;

/// Buffer numbers after the encoder outputs (1..=n).
struct Bufs {
    pool: usize,
    tmp: usize,
    gate: usize,
    ping: usize,
    pong: usize,
    out: usize,
}

/// conv 3x3 (+ folded BN, swish [, + input, BN, swish]) → squeeze-excitation → gated 1x1 conv
/// + swish [+ skip], written to `out`.
fn block_ops(
    blk: &Block,
    src: View,
    up2: bool,
    out_buf: usize,
    skip: Option<View>,
    b: &Bufs,
    ops: &mut Vec<Op>,
) -> Result<View, CpuError> {
    let c = blk.conv.weight().dim(0)?;
    let (ih, iw) = if up2 {
        (src.h * 2, src.w * 2)
    } else {
        (src.h, src.w)
    };
    let s = blk.stride;
    let (pad, _) = same_padding(ih, 3, s);
    let (pad_w, _) = same_padding(iw, 3, s);
    if pad != pad_w {
        return Err(CpuError::Weights(format!(
            "non-square input {ih}x{iw} with different `same` paddings"
        )));
    }
    let t = View::whole(b.tmp, ih.div_ceil(s), iw.div_ceil(s), c);
    let post = blk
        .residual_bn
        .as_ref()
        .map(|a| a.to_vecs().map(|(scale, shift)| Affine { scale, shift }))
        .transpose()?;
    ops.push(Op::Conv(ConvOp {
        up2,
        act: Act::Swish,
        residual: post.as_ref().map(|_| src),
        post_act: if post.is_some() {
            Act::Swish
        } else {
            Act::None
        },
        post,
        se_sums: true,
        ..ConvOp::new(src, t, 3, s, pad, ConvOp::fold(&blk.conv, None)?)
    }));
    let gate = View::whole(b.gate, 1, 1, c);
    ops.push(Op::Se(SeOp {
        src: t,
        dst: gate,
        reduce: ConvOp::fold(&blk.se_reduce, None)?,
        expand: ConvOp::fold(&blk.se_expand, None)?,
    }));
    let out = View::whole(out_buf, t.h, t.w, c);
    ops.push(Op::Conv(ConvOp {
        gate: Some(gate),
        act: Act::Swish,
        residual: skip,
        ..ConvOp::new(t, out, 1, 1, 0, ConvOp::fold(&blk.project, None)?)
    }));
    Ok(out)
}

impl NativeUnet {
    pub fn new(net: &LungUnet, threads: usize) -> Result<Self, CpuError> {
        let cfg = net.config();
        let size = cfg.input_size;
        let n_enc = net.encoder.len();
        let b = Bufs {
            pool: n_enc + 1,
            tmp: n_enc + 2,
            gate: n_enc + 3,
            ping: n_enc + 4,
            pong: n_enc + 5,
            out: n_enc + 6,
        };
        let mut ops = Vec::new();
        let mut x = View::whole(INPUT, size, size, cfg.in_channels);
        let mut skips = Vec::new();
        for (i, blk) in net.encoder.iter().enumerate() {
            if i > 0 {
                // Keras MaxPooling2D(2): 2x2, stride 2, no padding.
                let p = View::whole(b.pool, x.h / 2, x.w / 2, x.c);
                ops.push(Op::MaxPool {
                    src: x,
                    dst: p,
                    k: 2,
                    stride: 2,
                    pad: 0,
                });
                x = p;
            }
            x = block_ops(blk, x, false, 1 + i, None, &b, &mut ops)?;
            skips.push(x);
        }
        skips.pop(); // the bottleneck is `x` itself
        for blk in &net.decoder {
            let out_buf = if x.buf == b.ping { b.pong } else { b.ping };
            let skip = skips.pop();
            x = block_ops(blk, x, true, out_buf, skip, &b, &mut ops)?;
        }
        let out = View::whole(b.out, x.h, x.w, 1);
        ops.push(Op::Conv(ConvOp {
            act: Act::Sigmoid,
            ..ConvOp::new(x, out, 3, 1, 1, ConvOp::fold(&net.head, None)?)
        }));
        let mut buf_sizes = vec![0usize; b.out + 1];
        buf_sizes[INPUT] = size * size * cfg.in_channels;
        for op in &ops {
            let views: Vec<View> = match op {
                Op::Conv(c) => vec![c.src, c.dst],
                Op::MaxPool { src, dst, .. } => vec![*src, *dst],
                Op::Se(se) => vec![se.src, se.dst],
                Op::AvgPool { src, dst, .. } | Op::Resize { src, dst } => vec![*src, *dst],
            };
            for v in views {
                buf_sizes[v.buf] = buf_sizes[v.buf].max(v.h * v.w * v.pitch);
            }
        }
        let plan = Plan {
            in_channels: cfg.in_channels,
            size,
            input_nhwc: true,
            buf_sizes,
            ops,
            output: Output::Map(out),
        };
        validate(&plan)?;
        Ok(NativeUnet {
            exec: Executor::new(plan, threads)?,
            size,
        })
    }

    /// Input (batch, size, size, 3) NHWC 0..255 → lung probabilities (batch, size, size).
    pub fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        self.exec.forward(input, batch)
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn threads(&self) -> usize {
        self.exec.threads()
    }
}
