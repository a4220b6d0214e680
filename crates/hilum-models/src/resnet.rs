//! ResNet with bottleneck blocks (He et al., "Deep Residual Learning for Image Recognition",
//! CVPR 2016; torchvision's v1.5 layout with the stride on the 3x3 conv), as torchxrayvision
//! 1.5.7 uses it for `resnet50-res512-all`: torchvision's resnet50 with a one-channel `conv1`.
//! Parameter names match the published state dict (`conv1.weight`, `layer1.0.conv2.weight`,
//! `layer2.0.downsample.0.weight`, `fc.bias`).
//!
//! This is the candle path; on the CPU `hilum-kernels` runs the same weights (read by
//! [`native_weights`]). Every batch norm directly follows a convolution and is folded into it
//! at load (weight and bias); the public `BatchNorm` fields keep the checkpoint's values for
//! the ONNX export and for [`ResNet::forward_unfolded`], the reference. [`ResNet::to_dtype`]
//! runs the folded convolutions in f16 (opt-in; logits stay f32).

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{
    batch_norm, conv2d_no_bias, linear, BatchNorm, Conv2d, Conv2dConfig, Linear, VarBuilder,
};
use serde::{Deserialize, Serialize};

use crate::bn_fold::{check_compute_dtype, conv_to_dtype, fold_conv_bn};
use crate::densenet::BN_EPS;
use crate::onnx_graph::{self, GraphBuilder};
use hilum_kernels::resnet as kw;

use crate::native;

/// The shape of a torchvision-style bottleneck ResNet (ResNet-50 for torchxrayvision).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Bottleneck blocks per stage.
    pub layers: Vec<usize>,
    /// Channels of the stem convolution.
    pub stem_channels: usize,
    /// Inner (3x3) width of each stage's blocks; a stage outputs `planes * expansion` channels.
    pub planes: Vec<usize>,
    /// Width multiplier of a block's last 1x1 convolution (4 for ResNet-50).
    pub expansion: usize,
    /// Outputs of the classifier (one logit per label).
    pub num_classes: usize,
    /// Channels of the input image (1 for radiographs).
    pub in_channels: usize,
}

impl Config {
    /// torchxrayvision `resnet50-res512-all`: ResNet-50, 1 channel, 18 pathologies.
    pub fn resnet50_res512_all() -> Self {
        Config {
            layers: vec![3, 4, 6, 3],
            stem_channels: 64,
            planes: vec![64, 128, 256, 512],
            expansion: 4,
            num_classes: 18,
            in_channels: 1,
        }
    }

    /// The stride of block `block` of stage `stage`: the first block of every stage but the
    /// first halves the resolution.
    pub fn block_stride(&self, stage: usize, block: usize) -> usize {
        if stage > 0 && block == 0 {
            2
        } else {
            1
        }
    }

    /// Channels of the last stage: what the classifier sees after pooling.
    pub fn out_channels(&self) -> usize {
        self.planes.last().copied().unwrap_or(self.stem_channels) * self.expansion
    }
}

/// 1x1 → 3x3 (stride) → 1x1, each followed by BN; ReLU after the first two and after the sum.
/// The forward runs the convolutions with their BN folded in at load; changing the public
/// fields afterwards changes only the ONNX export and [`ResNet::forward_unfolded`].
#[derive(Clone, Debug)]
pub struct Bottleneck {
    /// The 1x1 convolution that narrows to `planes`.
    pub conv1: Conv2d,
    /// BatchNorm after `conv1`.
    pub bn1: BatchNorm,
    /// The 3x3 convolution (with the block's stride).
    pub conv2: Conv2d,
    /// BatchNorm after `conv2`.
    pub bn2: BatchNorm,
    /// The 1x1 convolution that widens to `planes * expansion`.
    pub conv3: Conv2d,
    /// BatchNorm after `conv3`.
    pub bn3: BatchNorm,
    /// 1x1 conv (with the block's stride) + BN, when the shortcut changes shape.
    pub downsample: Option<(Conv2d, BatchNorm)>,
    /// Stride of the 3x3 convolution (2 in the first block of every stage but the first).
    pub stride: usize,
    /// conv1..conv3 with bn1..bn3 folded in, then the shortcut's conv + BN, if any.
    folded: ([Conv2d; 3], Option<Conv2d>),
}

impl Bottleneck {
    fn load(
        vb: VarBuilder,
        c_in: usize,
        planes: usize,
        stride: usize,
        cfg: &Config,
    ) -> Result<Self> {
        let c_out = planes * cfg.expansion;
        let c3 = Conv2dConfig {
            padding: 1,
            stride,
            ..Default::default()
        };
        let downsample = if stride != 1 || c_in != c_out {
            let ds = Conv2dConfig {
                stride,
                ..Default::default()
            };
            Some((
                conv2d_no_bias(c_in, c_out, 1, ds, vb.pp("downsample.0"))?,
                batch_norm(c_out, BN_EPS, vb.pp("downsample.1"))?,
            ))
        } else {
            None
        };
        let conv1 = conv2d_no_bias(c_in, planes, 1, Default::default(), vb.pp("conv1"))?;
        let bn1 = batch_norm(planes, BN_EPS, vb.pp("bn1"))?;
        let conv2 = conv2d_no_bias(planes, planes, 3, c3, vb.pp("conv2"))?;
        let bn2 = batch_norm(planes, BN_EPS, vb.pp("bn2"))?;
        let conv3 = conv2d_no_bias(planes, c_out, 1, Default::default(), vb.pp("conv3"))?;
        let bn3 = batch_norm(c_out, BN_EPS, vb.pp("bn3"))?;
        let folded = (
            [
                fold_conv_bn(&conv1, &bn1)?,
                fold_conv_bn(&conv2, &bn2)?,
                fold_conv_bn(&conv3, &bn3)?,
            ],
            match &downsample {
                Some((conv, bn)) => Some(fold_conv_bn(conv, bn)?),
                None => None,
            },
        );
        Ok(Bottleneck {
            conv1,
            bn1,
            conv2,
            bn2,
            conv3,
            bn3,
            downsample,
            stride,
            folded,
        })
    }

    /// The folded convolutions in `dtype`.
    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let ([c1, c2, c3], downsample) = &self.folded;
        let folded = (
            [
                conv_to_dtype(c1, dtype)?,
                conv_to_dtype(c2, dtype)?,
                conv_to_dtype(c3, dtype)?,
            ],
            downsample
                .as_ref()
                .map(|c| conv_to_dtype(c, dtype))
                .transpose()?,
        );
        Ok(Bottleneck {
            folded,
            ..self.clone()
        })
    }

    /// The block through candle_nn's BatchNorm (the reference).
    fn forward_unfolded(&self, xs: &Tensor) -> Result<Tensor> {
        let shortcut = match &self.downsample {
            Some((conv, bn)) => xs.apply(conv)?.apply_t(bn, false)?,
            None => xs.clone(),
        };
        let ys = xs
            .apply(&self.conv1)?
            .apply_t(&self.bn1, false)?
            .relu()?
            .apply(&self.conv2)?
            .apply_t(&self.bn2, false)?
            .relu()?
            .apply(&self.conv3)?
            .apply_t(&self.bn3, false)?;
        (ys + shortcut)?.relu()
    }
}

impl Module for Bottleneck {
    /// (b, c_in, h, w) → (b, planes * expansion, h / stride, w / stride), BN folded.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let ([c1, c2, c3], downsample) = &self.folded;
        let shortcut = match downsample {
            Some(conv) => xs.apply(conv)?,
            None => xs.clone(),
        };
        let ys = xs.apply(c1)?.relu()?.apply(c2)?.relu()?.apply(c3)?;
        (ys + shortcut)?.relu()
    }
}

/// The ResNet on candle: the reference path, and the GPU one. Its forward runs the batch
/// norms folded at load (see the module's documentation).
#[derive(Clone, Debug)]
pub struct ResNet {
    /// The architecture it was built for.
    pub cfg: Config,
    /// The 7x7 stride-2 stem convolution.
    pub conv1: Conv2d,
    /// BatchNorm after the stem.
    pub bn1: BatchNorm,
    /// One Vec of blocks per stage (`layer1` ..).
    pub stages: Vec<Vec<Bottleneck>>,
    /// The linear classifier over the pooled features.
    pub fc: Linear,
    /// `conv1` with `bn1` folded in.
    conv1_bn1: Conv2d,
    /// The dtype of the folded convolutions (f32 unless [`ResNet::to_dtype`] changed it).
    dtype: DType,
}

impl ResNet {
    /// `vb` is the state dict's root (`conv1.weight`, `layer1.0...`, `fc.weight`).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let stem = Conv2dConfig {
            padding: 3,
            stride: 2,
            ..Default::default()
        };
        let conv1 = conv2d_no_bias(cfg.in_channels, cfg.stem_channels, 7, stem, vb.pp("conv1"))?;
        let bn1 = batch_norm(cfg.stem_channels, BN_EPS, vb.pp("bn1"))?;
        let mut c_in = cfg.stem_channels;
        let mut stages = Vec::new();
        for (i, (&n, &planes)) in cfg.layers.iter().zip(&cfg.planes).enumerate() {
            let svb = vb.pp(format!("layer{}", i + 1));
            let mut blocks = Vec::with_capacity(n);
            for j in 0..n {
                let stride = cfg.block_stride(i, j);
                blocks.push(Bottleneck::load(svb.pp(j), c_in, planes, stride, cfg)?);
                c_in = planes * cfg.expansion;
            }
            stages.push(blocks);
        }
        Ok(ResNet {
            cfg: cfg.clone(),
            conv1_bn1: fold_conv_bn(&conv1, &bn1)?,
            dtype: conv1.weight().dtype(),
            conv1,
            bn1,
            stages,
            fc: linear(c_in, cfg.num_classes, vb.pp("fc"))?,
        })
    }

    /// Pooled features: (b, in_channels, h, w) → (b, planes.last * expansion).
    pub fn features(&self, xs: &Tensor) -> Result<Tensor> {
        self.features_with(xs, true)
    }

    /// The same network with its folded forward in `dtype` (f32 or f16, see
    /// [`check_compute_dtype`]): weights and activations in `dtype` on the device, the input
    /// converted on entry and the last feature map back to the input's dtype before the pool
    /// and `fc` (which stay f32). The public fields, the ONNX export and
    /// [`ResNet::forward_unfolded`] keep the checkpoint's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        check_compute_dtype(dtype)?;
        Ok(ResNet {
            conv1_bn1: conv_to_dtype(&self.conv1_bn1, dtype)?,
            stages: self
                .stages
                .iter()
                .map(|s| s.iter().map(|b| b.to_dtype(dtype)).collect())
                .collect::<Result<_>>()?,
            dtype,
            ..self.clone()
        })
    }

    /// The dtype the folded forward runs in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The logits through candle_nn's `BatchNorm` ops, nothing folded: the reference the
    /// folded forward ([`Module::forward`]) is tested against.
    pub fn forward_unfolded(&self, xs: &Tensor) -> Result<Tensor> {
        self.features_with(xs, false)?.apply(&self.fc)
    }

    fn features_with(&self, input: &Tensor, folded: bool) -> Result<Tensor> {
        let xs = &input.to_dtype(if folded { self.dtype } else { input.dtype() })?;
        let stem = if folded {
            xs.apply(&self.conv1_bn1)?
        } else {
            xs.apply(&self.conv1)?.apply_t(&self.bn1, false)?
        };
        // Zero padding equals -inf padding here: the max pool follows a ReLU.
        let mut xs = stem
            .relu()?
            .pad_with_zeros(2, 1, 1)?
            .pad_with_zeros(3, 1, 1)?
            .max_pool2d_with_stride(3, 2)?;
        for block in self.stages.iter().flatten() {
            xs = if folded {
                xs.apply(block)?
            } else {
                block.forward_unfolded(&xs)?
            };
        }
        xs.to_dtype(input.dtype())?.mean((2, 3))
    }
}

impl Module for ResNet {
    /// Raw logits (b, num_classes).
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.features(xs)?.apply(&self.fc)
    }
}

impl ResNet {
    /// The same forward pass as an ONNX graph with these weights: input `x`
    /// (batch, in_channels, size, size), output `logits` (batch, num_classes).
    pub fn to_onnx(&self, size: usize) -> Result<Vec<u8>> {
        let mut g = GraphBuilder::new("resnet");
        let x = g.conv2d("conv1", &self.conv1, onnx_graph::INPUT)?;
        let x = g.batch_norm("bn1", &self.bn1, &x)?;
        let x = g.relu(&x);
        let mut xs = g.max_pool(&x, 3, 2, 1);
        for (i, blocks) in self.stages.iter().enumerate() {
            for (j, b) in blocks.iter().enumerate() {
                let p = format!("layer{}.{j}", i + 1);
                let shortcut = match &b.downsample {
                    Some((conv, bn)) => {
                        let s = g.conv2d(&format!("{p}.downsample.0"), conv, &xs)?;
                        g.batch_norm(&format!("{p}.downsample.1"), bn, &s)?
                    }
                    None => xs.clone(),
                };
                let y = g.conv2d(&format!("{p}.conv1"), &b.conv1, &xs)?;
                let y = g.batch_norm(&format!("{p}.bn1"), &b.bn1, &y)?;
                let y = g.relu(&y);
                let y = g.conv2d(&format!("{p}.conv2"), &b.conv2, &y)?;
                let y = g.batch_norm(&format!("{p}.bn2"), &b.bn2, &y)?;
                let y = g.relu(&y);
                let y = g.conv2d(&format!("{p}.conv3"), &b.conv3, &y)?;
                let y = g.batch_norm(&format!("{p}.bn3"), &b.bn3, &y)?;
                let y = g.add(&y, &shortcut);
                xs = g.relu(&y);
            }
        }
        let y = g.global_avg_pool(&xs);
        let logits = g.linear("fc", &self.fc, &y)?;
        Ok(g.finish_classifier(
            &logits,
            self.cfg.in_channels,
            size,
            self.cfg.num_classes,
            "torchxrayvision ResNet (resnet50-res512-all layout): logits before sigmoid and op_norm",
        ))
    }
}

/// [`ResNet`]'s weights for the native engine (`conv1.*`, `layer1.0.*`, ..., `fc.*` at the root of `vb`).
pub fn native_weights(vb: VarBuilder, cfg: &Config) -> Result<kw::ResNetWeights> {
    let eps = BN_EPS;
    let mut c_in = cfg.stem_channels;
    let mut blocks = Vec::new();
    for (i, (&n, &planes)) in cfg.layers.iter().zip(&cfg.planes).enumerate() {
        let svb = vb.pp(format!("layer{}", i + 1));
        for j in 0..n {
            let b = svb.pp(j);
            let stride = cfg.block_stride(i, j);
            let c_out = planes * cfg.expansion;
            let downsample = if stride != 1 || c_in != c_out {
                Some((
                    native::conv(&b.pp("downsample.0"), c_in, c_out, 1, false)?,
                    native::batch_norm(&b.pp("downsample.1"), c_out, eps)?,
                ))
            } else {
                None
            };
            blocks.push(kw::Bottleneck {
                conv1: native::conv(&b.pp("conv1"), c_in, planes, 1, false)?,
                bn1: native::batch_norm(&b.pp("bn1"), planes, eps)?,
                conv2: native::conv(&b.pp("conv2"), planes, planes, 3, false)?,
                bn2: native::batch_norm(&b.pp("bn2"), planes, eps)?,
                conv3: native::conv(&b.pp("conv3"), planes, c_out, 1, false)?,
                bn3: native::batch_norm(&b.pp("bn3"), c_out, eps)?,
                downsample,
                stride,
            });
            c_in = c_out;
        }
    }
    Ok(kw::ResNetWeights {
        conv1: native::conv(
            &vb.pp("conv1"),
            cfg.in_channels,
            cfg.stem_channels,
            7,
            false,
        )?,
        bn1: native::batch_norm(&vb.pp("bn1"), cfg.stem_channels, eps)?,
        blocks,
        fc: native::linear(&vb.pp("fc"), c_in, cfg.num_classes)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::recorded_params;

    /// The native reader asks for exactly the parameters (names and shapes) the candle model does.
    #[test]
    fn native_reader_asks_for_the_candle_models_parameters() {
        let cfg = Config::resnet50_res512_all();
        assert_eq!(
            recorded_params(|vb| native_weights(vb, &cfg)).expect("native"),
            recorded_params(|vb| ResNet::load(vb, &cfg)).expect("candle"),
        );
    }
}
