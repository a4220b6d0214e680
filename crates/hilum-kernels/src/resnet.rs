//! Bottleneck ResNet (torchvision's layout, as torchxrayvision uses it) on the native CPU
//! kernels.

use super::{
    out_dim, validate, Act, BatchNorm, Conv, ConvOp, CpuError, Executor, Folded, Head, Linear, Op,
    Output, Plan, View,
};

/// conv1 (1x1) + bn1 + relu → conv2 (3x3, `stride`, padding 1) + bn2 + relu → conv3 (1x1) +
/// bn3, plus the shortcut (`downsample`: a strided 1x1 conv + BN, else the input), relu.
#[derive(Clone, Debug)]
pub struct Bottleneck {
    /// 1x1 conv that narrows the channels.
    pub conv1: Conv,
    /// BatchNorm after `conv1`.
    pub bn1: BatchNorm,
    /// 3x3 conv, strided by `stride`.
    pub conv2: Conv,
    /// BatchNorm after `conv2`.
    pub bn2: BatchNorm,
    /// 1x1 conv that widens the channels.
    pub conv3: Conv,
    /// BatchNorm after `conv3`.
    pub bn3: BatchNorm,
    /// Projection shortcut (strided 1x1 conv + BatchNorm); `None`: the input is added as is.
    pub downsample: Option<(Conv, BatchNorm)>,
    /// Stride of `conv2` and of the shortcut.
    pub stride: usize,
}

/// A ResNet's weights: conv1 (7x7, stride 2, padding 3) + bn1 + relu + 3x3 max pool (stride 2,
/// padding 1), the bottlenecks in order, global average pool and fc.
#[derive(Clone, Debug)]
pub struct ResNetWeights {
    /// 7x7 stem conv.
    pub conv1: Conv,
    /// BatchNorm after the stem conv.
    pub bn1: BatchNorm,
    /// Bottlenecks in order.
    pub blocks: Vec<Bottleneck>,
    /// Classifier over the pooled features.
    pub fc: Linear,
}

/// A ResNet compiled for one input size into NHWC ops with BatchNorm folded.
pub struct NativeResNet {
    exec: Executor,
    classes: usize,
}

const INPUT: usize = 0;
const STEM: usize = 1;
const PING: usize = 2;
const PONG: usize = 3;
const T1: usize = 4;
const T2: usize = 5;
const SHORTCUT: usize = 6;

#[allow(clippy::too_many_arguments)]
fn conv(
    src: View,
    dst: View,
    k: usize,
    stride: usize,
    pad: usize,
    folded: Folded,
    residual: Option<View>,
    relu: bool,
) -> Op {
    // ReLU after the shortcut is added.
    let act = if relu { Act::Relu } else { Act::None };
    Op::Conv(
        ConvOp {
            residual,
            act: if residual.is_some() { Act::None } else { act },
            post_act: act,
            ..ConvOp::new(src, dst, k, stride, pad, folded)
        }
        .packed(),
    )
}

impl NativeResNet {
    /// `size`: the square input size (512 for `resnet50-res512-all`).
    pub fn new(net: &ResNetWeights, size: usize, threads: usize) -> Result<Self, CpuError> {
        let (in_channels, stem_channels) = (net.conv1.c_in, net.conv1.c_out);
        let mut buf_sizes = vec![0usize; 7];
        let mut need =
            |buf: usize, v: &View| buf_sizes[buf] = buf_sizes[buf].max(v.h * v.w * v.pitch);
        let input = View::whole(INPUT, size, size, in_channels);
        need(INPUT, &input);
        let h1 = out_dim(size, 7, 2, 3);
        let stem = View::whole(STEM, h1, h1, stem_channels);
        need(STEM, &stem);
        let h2 = out_dim(h1, 3, 2, 1);
        let mut x = View::whole(PING, h2, h2, stem_channels);
        need(PING, &x);
        let mut ops = vec![
            conv(
                input,
                stem,
                7,
                2,
                3,
                ConvOp::fold(&net.conv1, Some(&net.bn1))?,
                None,
                true,
            ),
            Op::MaxPool {
                src: stem,
                dst: x,
                k: 3,
                stride: 2,
                pad: 1,
            },
        ];
        for block in &net.blocks {
            let s = block.stride;
            let planes = block.conv1.c_out;
            let c_out = block.conv3.c_out;
            let h = out_dim(x.h, 3, s, 1);
            let t1 = View::whole(T1, x.h, x.w, planes);
            let t2 = View::whole(T2, h, h, planes);
            let y = View::whole(if x.buf == PING { PONG } else { PING }, h, h, c_out);
            for (b, v) in [(T1, &t1), (T2, &t2), (y.buf, &y)] {
                need(b, v);
            }
            ops.push(conv(
                x,
                t1,
                1,
                1,
                0,
                ConvOp::fold(&block.conv1, Some(&block.bn1))?,
                None,
                true,
            ));
            ops.push(conv(
                t1,
                t2,
                3,
                s,
                1,
                ConvOp::fold(&block.conv2, Some(&block.bn2))?,
                None,
                true,
            ));
            let shortcut = match &block.downsample {
                Some((dconv, dbn)) => {
                    let d = View::whole(SHORTCUT, h, h, c_out);
                    need(SHORTCUT, &d);
                    ops.push(conv(
                        x,
                        d,
                        1,
                        s,
                        0,
                        ConvOp::fold(dconv, Some(dbn))?,
                        None,
                        false,
                    ));
                    d
                }
                None => x,
            };
            ops.push(conv(
                t2,
                y,
                1,
                1,
                0,
                ConvOp::fold(&block.conv3, Some(&block.bn3))?,
                Some(shortcut),
                true,
            ));
            x = y;
        }
        let head = Head::new(x, None, &net.fc)?;
        let plan = Plan {
            in_channels,
            size,
            input_nhwc: false,
            buf_sizes,
            ops,
            output: Output::Head(head),
        };
        validate(&plan)?;
        Ok(NativeResNet {
            exec: Executor::new(plan, threads)?,
            classes: net.fc.out_features,
        })
    }

    /// Logits (batch, classes) for input (batch, in_channels, size, size).
    pub fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        self.exec.forward(input, batch)
    }

    /// Number of logits per image.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// Worker threads this network runs on.
    pub fn threads(&self) -> usize {
        self.exec.threads()
    }
}
