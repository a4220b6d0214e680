//! The ChestX-Det PSPNet ([`crate::pspnet::PspNet`]) on the native CPU kernels: the dilated
//! ResNet encoder as folded conv ops (dilation read while gathering), the pyramid pooling as
//! average pools + 1x1 convs + bilinear resizes written straight into the concatenation buffer,
//! whose first channels the last bottleneck also writes in place.

use super::{validate, Act, ConvOp, CpuError, Executor, Op, Output, Plan, View};
use crate::pspnet::{ConvBn, PspNet};

/// A PSPNet compiled for its input size. Returns logits NHWC at the input resolution.
pub struct NativePspNet {
    exec: Executor,
    size: usize,
    classes: usize,
}

impl std::fmt::Debug for NativePspNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativePspNet")
            .field("size", &self.size)
            .field("classes", &self.classes)
            .field("threads", &self.exec.threads())
            .finish()
    }
}

const INPUT: usize = 0;
const STEM_A: usize = 1;
const STEM_B: usize = 2;
const PING: usize = 3;
const PONG: usize = 4;
const T1: usize = 5;
const T2: usize = 6;
const SHORTCUT: usize = 7;
const CAT: usize = 8;
const POOLED: usize = 9;
const PATH: usize = 10;
const FINAL: usize = 11;
const LOGITS: usize = 12;
const OUT: usize = 13;

/// Output size along one axis of a conv with dilation.
fn conv_out(i: usize, k: usize, stride: usize, pad: usize, dil: usize) -> usize {
    (i + 2 * pad - dil * (k - 1) - 1) / stride + 1
}

/// The conv + folded BN (+ ReLU) of a ptsemseg unit, from `src` into buffer `buf` (or `dst`).
fn unit(
    u: &ConvBn,
    src: View,
    dst: impl FnOnce(usize, usize, usize) -> View,
) -> Result<ConvOp, CpuError> {
    let w = u.conv.weight();
    let (c_out, _, k, _) = w.dims4()?;
    let cfg = u.conv.config();
    let (s, p, d) = (cfg.stride, cfg.padding, cfg.dilation);
    if cfg.groups != 1 {
        return Err(CpuError::Weights(
            "grouped convolutions are not supported".into(),
        ));
    }
    let dst = dst(
        conv_out(src.h, k, s, p, d),
        conv_out(src.w, k, s, p, d),
        c_out,
    );
    Ok(ConvOp {
        dilation: d,
        act: if u.relu { Act::Relu } else { Act::None },
        ..ConvOp::new(src, dst, k, s, p, ConvOp::fold(&u.conv, Some(&u.bn))?)
    })
}

impl NativePspNet {
    pub fn new(net: &PspNet, threads: usize) -> Result<Self, CpuError> {
        let cfg = net.config();
        let size = cfg.input_size;
        let mut ops = Vec::new();
        let mut x = View::whole(INPUT, size, size, 3);
        for (i, u) in net.stem.iter().enumerate() {
            let buf = if i % 2 == 0 { STEM_A } else { STEM_B };
            let op = unit(u, x, |h, w, c| View::whole(buf, h, w, c))?;
            x = op.dst;
            ops.push(Op::Conv(op));
        }
        let pooled = View::whole(
            PING,
            conv_out(x.h, 3, 2, 1, 1),
            conv_out(x.w, 3, 2, 1, 1),
            x.c,
        );
        ops.push(Op::MaxPool {
            src: x,
            dst: pooled,
            k: 3,
            stride: 2,
            pad: 1,
        });
        x = pooled;
        let feat_c = net
            .blocks
            .last()
            .map(|b| b.cb3.conv.weight().dim(0))
            .transpose()?
            .unwrap_or(x.c);
        let paths = cfg.pool_sizes.len();
        let path_c = feat_c / paths.max(1);
        let cat_c = feat_c + path_c * paths;
        let n_blocks = net.blocks.len();
        for (i, blk) in net.blocks.iter().enumerate() {
            let a = unit(&blk.cbr1, x, |h, w, c| View::whole(T1, h, w, c))?;
            let b = unit(&blk.cbr2, a.dst, |h, w, c| View::whole(T2, h, w, c))?;
            let (t2, shortcut) = (b.dst, x);
            ops.push(Op::Conv(a));
            ops.push(Op::Conv(b));
            let shortcut = match &blk.cb4 {
                Some(cb4) => {
                    let op = unit(cb4, shortcut, |h, w, c| View::whole(SHORTCUT, h, w, c))?;
                    let d = op.dst;
                    ops.push(Op::Conv(op));
                    d
                }
                None => shortcut,
            };
            // The last bottleneck writes the first channels of the pyramid's concatenation.
            let last = i + 1 == n_blocks;
            let next = if x.buf == PING { PONG } else { PING };
            let mut y = unit(&blk.cb3, t2, |h, w, c| {
                if last {
                    View::whole(CAT, h, w, cat_c).slice(0, c)
                } else {
                    View::whole(next, h, w, c)
                }
            })?;
            y.residual = Some(shortcut);
            y.act = Act::None;
            y.post_act = Act::Relu;
            x = y.dst;
            ops.push(Op::Conv(y));
        }
        if x.buf != CAT {
            return Err(CpuError::Weights("PSPNet without bottlenecks".into()));
        }
        let (fh, fw) = (x.h, x.w);
        for (i, (path, &p)) in net.pyramid.iter().zip(&cfg.pool_sizes).enumerate() {
            // ptsemseg: kernel = stride = floor(size / pool_size), no padding.
            let k = ((fh / p.max(1)).max(1), (fw / p.max(1)).max(1));
            let pooled = View::whole(POOLED, fh / k.0, fw / k.1, feat_c);
            ops.push(Op::AvgPool {
                src: x,
                dst: pooled,
                k,
            });
            let conv = unit(path, pooled, |h, w, c| View::whole(PATH, h, w, c))?;
            let small = conv.dst;
            ops.push(Op::Conv(conv));
            ops.push(Op::Resize {
                src: small,
                dst: View::whole(CAT, fh, fw, cat_c).slice(feat_c + i * path_c, small.c),
            });
        }
        let cat = View::whole(CAT, fh, fw, cat_c);
        let fin = unit(&net.cbr_final, cat, |h, w, c| View::whole(FINAL, h, w, c))?;
        let fin_v = fin.dst;
        ops.push(Op::Conv(fin));
        let classes = net.classification.weight().dim(0)?;
        let logits = View::whole(LOGITS, fin_v.h, fin_v.w, classes);
        ops.push(Op::Conv(ConvOp::new(
            fin_v,
            logits,
            1,
            1,
            0,
            ConvOp::fold(&net.classification, None)?,
        )));
        let out = View::whole(OUT, size, size, classes);
        ops.push(Op::Resize {
            src: logits,
            dst: out,
        });

        let mut buf_sizes = vec![0usize; OUT + 1];
        super::grow_buffers(&ops, &mut buf_sizes);
        let plan = Plan {
            in_channels: 3,
            size,
            input_nhwc: false,
            buf_sizes,
            ops,
            output: Output::Map(out),
        };
        validate(&plan)?;
        Ok(NativePspNet {
            exec: Executor::new(plan, threads)?,
            size,
            classes,
        })
    }

    /// Input (batch, 3, size, size) NCHW → logits (batch, size, size, classes) NHWC.
    pub fn forward_nhwc(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        self.exec.forward(input, batch)
    }

    /// Input (batch, 3, size, size) NCHW → logits (batch, classes, size, size) NCHW.
    pub fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        let nhwc = self.forward_nhwc(input, batch)?;
        let (hw, c) = (self.size * self.size, self.classes);
        let mut out = vec![0f32; nhwc.len()];
        for b in 0..batch {
            for i in 0..hw {
                for ch in 0..c {
                    out[(b * c + ch) * hw + i] = nhwc[(b * hw + i) * c + ch];
                }
            }
        }
        Ok(out)
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn classes(&self) -> usize {
        self.classes
    }

    pub fn threads(&self) -> usize {
        self.exec.threads()
    }
}
