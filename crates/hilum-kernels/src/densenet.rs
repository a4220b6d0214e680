//! DenseNet (torchvision's layout, as torchxrayvision uses it) on the native CPU kernels.

use super::{
    bn_affine, out_dim, validate, Act, BatchNorm, Conv, ConvOp, CpuError, Executor, Head, Linear,
    Op, Output, Plan, View,
};

/// norm1 → relu → conv1 (1x1) → norm2 → relu → conv2 (3x3, padding 1), concatenated.
#[derive(Clone, Debug)]
pub struct DenseLayer {
    /// BatchNorm before the bottleneck conv.
    pub norm1: BatchNorm,
    /// 1x1 bottleneck conv.
    pub conv1: Conv,
    /// BatchNorm before the 3x3 conv.
    pub norm2: BatchNorm,
    /// 3x3 conv whose output channels are appended to the block's features.
    pub conv2: Conv,
}

/// norm → relu → conv (1x1) → 2x2 average pool.
#[derive(Clone, Debug)]
pub struct Transition {
    /// BatchNorm before the conv.
    pub norm: BatchNorm,
    /// 1x1 conv that narrows the features before pooling.
    pub conv: Conv,
}

/// A DenseNet's weights: the stem conv0 (7x7, stride 2, padding 3) + norm0 + relu + 3x3 max
/// pool (stride 2, padding 1), the dense blocks with a transition after each but the last,
/// norm5 + relu, global average pool and the classifier. Widths are read from the weights.
#[derive(Clone, Debug)]
pub struct DenseNetWeights {
    /// 7x7 stem conv.
    pub conv0: Conv,
    /// BatchNorm after the stem conv.
    pub norm0: BatchNorm,
    /// Dense blocks, each a list of layers in order.
    pub blocks: Vec<Vec<DenseLayer>>,
    /// Transitions between blocks, one fewer than the blocks.
    pub transitions: Vec<Transition>,
    /// BatchNorm after the last block.
    pub norm5: BatchNorm,
    /// Classifier over the pooled features.
    pub classifier: Linear,
}

/// Channels entering each block and leaving the last one, checked against the weights.
fn block_channels(net: &DenseNetWeights) -> Result<(Vec<usize>, usize), CpuError> {
    let bad = |what: String| CpuError::Weights(format!("inconsistent DenseNet weights: {what}"));
    if net.transitions.len() + 1 != net.blocks.len() {
        return Err(bad(format!(
            "{} transitions for {} blocks",
            net.transitions.len(),
            net.blocks.len()
        )));
    }
    let mut c = net.conv0.c_out;
    let mut ins = Vec::with_capacity(net.blocks.len());
    for (i, layers) in net.blocks.iter().enumerate() {
        ins.push(c);
        for l in layers {
            if l.conv1.c_in != c
                || l.conv2.c_in != l.conv1.c_out
                || l.conv1.k != 1
                || l.conv2.k != 3
            {
                return Err(bad(format!(
                    "a dense layer of block {} after {c} channels",
                    i + 1
                )));
            }
            c += l.conv2.c_out;
        }
        if let Some(t) = net.transitions.get(i) {
            if t.conv.c_in != c || t.conv.k != 1 {
                return Err(bad(format!("transition {} after {c} channels", i + 1)));
            }
            c = t.conv.c_out;
        }
    }
    Ok((ins, c))
}

/// A DenseNet compiled for one input size into NHWC ops with BatchNorm folded.
pub struct NativeDenseNet {
    exec: Executor,
    classes: usize,
}

impl NativeDenseNet {
    /// `size`: the square input size (224 for `densenet121-res224-all`).
    pub fn new(net: &DenseNetWeights, size: usize, threads: usize) -> Result<Self, CpuError> {
        let (block_in, c_final) = block_channels(net)?;
        let in_channels = net.conv0.c_in;
        let num_init_features = net.conv0.c_out;
        // The widest bottleneck of any layer (all equal in torchvision's DenseNets).
        let mid = net
            .blocks
            .iter()
            .flatten()
            .map(|l| l.conv1.c_out)
            .max()
            .unwrap_or(0);
        let mut buf_sizes = vec![size * size * in_channels];
        let mut ops = Vec::new();

        // Stem: conv0 + norm0 (folded) + ReLU, then the max pool into block 1's buffer.
        let h1 = out_dim(size, 7, 2, 3);
        let stem = View::whole(1, h1, h1, num_init_features);
        buf_sizes.push(h1 * h1 * num_init_features);
        let (weight, bias) = ConvOp::fold(&net.conv0, Some(&net.norm0))?;
        ops.push(Op::Conv(
            ConvOp {
                act: Act::Relu,
                ..ConvOp::new(
                    View::whole(0, size, size, in_channels),
                    stem,
                    7,
                    2,
                    3,
                    (weight, bias),
                )
            }
            .packed(),
        ));

        // One concatenation buffer per block; the bottleneck buffer is shared by all layers.
        let bottleneck_buf = 2;
        buf_sizes.push(0);
        let mut hw = out_dim(h1, 3, 2, 1);
        let mut blocks = Vec::new();
        for (i, layers) in net.blocks.iter().enumerate() {
            let total = block_in[i] + layers.iter().map(|l| l.conv2.c_out).sum::<usize>();
            blocks.push(View::whole(buf_sizes.len(), hw, hw, total));
            buf_sizes.push(hw * hw * total);
            buf_sizes[bottleneck_buf] = buf_sizes[bottleneck_buf].max(hw * hw * mid);
            hw /= 2;
        }
        let first = blocks
            .first()
            .ok_or_else(|| CpuError::Weights("DenseNet without blocks".into()))?;
        ops.push(Op::MaxPool {
            src: stem,
            dst: first.slice(0, num_init_features),
            k: 3,
            stride: 2,
            pad: 1,
        });

        for (i, layers) in net.blocks.iter().enumerate() {
            let block = blocks[i];
            let mut c_in = block_in[i];
            for layer in layers {
                let tmp = View::whole(bottleneck_buf, block.h, block.w, layer.conv1.c_out);
                // norm1 + ReLU on the way in; norm2 folded into conv1, its ReLU fused.
                let (weight, bias) = ConvOp::fold(&layer.conv1, Some(&layer.norm2))?;
                ops.push(Op::Conv(
                    ConvOp {
                        pre: Some(bn_affine(&layer.norm1)?),
                        act: Act::Relu,
                        ..ConvOp::new(block.slice(0, c_in), tmp, 1, 1, 0, (weight, bias))
                    }
                    .packed(),
                ));
                // conv2 writes its growth_rate channels straight into the concatenation.
                let growth = layer.conv2.c_out;
                let (weight, bias) = ConvOp::fold(&layer.conv2, None)?;
                ops.push(Op::Conv(
                    ConvOp::new(tmp, block.slice(c_in, growth), 3, 1, 1, (weight, bias)).packed(),
                ));
                c_in += growth;
            }
            if let (Some(t), Some(next)) = (net.transitions.get(i), blocks.get(i + 1)) {
                let (weight, bias) = ConvOp::fold(&t.conv, None)?;
                ops.push(Op::Conv(
                    ConvOp {
                        pre: Some(bn_affine(&t.norm)?),
                        pool2: true,
                        ..ConvOp::new(block, next.slice(0, t.conv.c_out), 1, 1, 0, (weight, bias))
                    }
                    .packed(),
                ));
            }
        }
        let last = *blocks
            .last()
            .ok_or_else(|| CpuError::Weights("DenseNet without blocks".into()))?;
        if last.c != c_final {
            return Err(CpuError::Weights(format!(
                "final channels {} differ from the configuration's {c_final}",
                last.c
            )));
        }
        let head = Head::new(last, Some(bn_affine(&net.norm5)?), &net.classifier)?;
        let plan = Plan {
            in_channels,
            size,
            input_nhwc: false,
            buf_sizes,
            ops,
            output: Output::Head(head),
        };
        validate(&plan)?;
        Ok(NativeDenseNet {
            exec: Executor::new(plan, threads)?,
            classes: net.classifier.out_features,
        })
    }

    /// Logits (batch, classes) for input (batch, in_channels, size, size).
    pub fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        let chunk = crate::settings::images_per_pass();
        if batch <= chunk || !input.len().is_multiple_of(batch) {
            return self.exec.forward(input, batch);
        }
        // A few images at a time: a dense block's buffers for the whole batch outgrow the L3
        // cache, and each layer would then stream its input from memory.
        let per = input.len() / batch;
        let mut out = Vec::with_capacity(batch * self.classes);
        for x in input.chunks(per * chunk) {
            out.extend(self.exec.forward(x, x.len() / per)?);
        }
        Ok(out)
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
