//! The ChestX-Det PSPNet (ptsemseg's `pspnet`) on the native CPU kernels: the dilated ResNet
//! encoder as folded conv ops (dilation read while gathering), the pyramid pooling as
//! average pools + 1x1 convs + bilinear resizes written straight into the concatenation buffer,
//! whose first channels the last bottleneck also writes in place.

use super::{validate, Act, BatchNorm, Conv, ConvOp, CpuError, Executor, Op, Output, Plan, View};

/// conv (no bias) + BatchNorm, optionally ReLU: ptsemseg's `conv2DBatchNorm[Relu]`.
#[derive(Clone, Debug)]
pub struct ConvBn {
    /// The convolution, without bias.
    pub conv: Conv,
    /// BatchNorm folded into the conv at load.
    pub bn: BatchNorm,
    /// Conv stride.
    pub stride: usize,
    /// Zero padding on each side.
    pub padding: usize,
    /// Conv dilation (1: none).
    pub dilation: usize,
    /// Whether a ReLU follows the BatchNorm.
    pub relu: bool,
}

/// `bottleNeckPSP` (with the projection `cb4`) or `bottleNeckIdentifyPSP` (without):
/// cbr1 → cbr2 → cb3, plus the shortcut, ReLU.
#[derive(Clone, Debug)]
pub struct Bottleneck {
    /// 1x1 unit that narrows the channels.
    pub cbr1: ConvBn,
    /// 3x3 unit (strided or dilated as the stage asks).
    pub cbr2: ConvBn,
    /// 1x1 unit that widens the channels, without ReLU.
    pub cb3: ConvBn,
    /// Projection shortcut; `None`: the input is added as is.
    pub cb4: Option<ConvBn>,
}

/// A PSPNet's weights: the stem units then a 3x3 max pool (stride 2, padding 1), the
/// bottlenecks in order, one pyramid path (average pool to `pool_sizes[i]`, 1x1 unit, bilinear
/// resize) per pool size concatenated after the features, `cbr_final` and the 1x1
/// `classification` conv; logits are resized to the input.
#[derive(Clone, Debug)]
pub struct PspNetWeights {
    /// Stem units, applied before the max pool.
    pub stem: Vec<ConvBn>,
    /// Bottlenecks of the dilated encoder, in order.
    pub blocks: Vec<Bottleneck>,
    /// Output side of each pyramid path's average pool.
    pub pool_sizes: Vec<usize>,
    /// One 1x1 unit per pyramid path, in the order of `pool_sizes`.
    pub pyramid: Vec<ConvBn>,
    /// 3x3 unit over the features and the pyramid paths.
    pub cbr_final: ConvBn,
    /// 1x1 conv to one logit per class.
    pub classification: Conv,
}

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
    let (c_out, k) = (u.conv.c_out, u.conv.k);
    let (s, p, d) = (u.stride, u.padding, u.dilation);
    if s == 0 || d == 0 || src.h + 2 * p < d * (k - 1) + 1 || src.w + 2 * p < d * (k - 1) + 1 {
        return Err(CpuError::Weights(format!(
            "a {k}x{k} conv (stride {s}, padding {p}, dilation {d}) on a {}x{} map",
            src.h, src.w
        )));
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
    /// `size`: the square input side (512 for ChestX-Det).
    pub fn new(net: &PspNetWeights, size: usize, threads: usize) -> Result<Self, CpuError> {
        if net.pyramid.len() != net.pool_sizes.len() || net.pool_sizes.contains(&0) {
            return Err(CpuError::Weights(format!(
                "{} pyramid paths for pool sizes {:?}",
                net.pyramid.len(),
                net.pool_sizes
            )));
        }
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
        let feat_c = net.blocks.last().map_or(x.c, |b| b.cb3.conv.c_out);
        let paths = net.pool_sizes.len();
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
        for (i, (path, &p)) in net.pyramid.iter().zip(&net.pool_sizes).enumerate() {
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
        let classes = net.classification.c_out;
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

    /// Side of the square input the network was built for.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Number of classes (output channels).
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// Worker threads this network runs on.
    pub fn threads(&self) -> usize {
        self.exec.threads()
    }
}
