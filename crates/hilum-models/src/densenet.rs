//! DenseNet (Huang et al., "Densely Connected Convolutional Networks", CVPR 2017) exactly as
//! torchxrayvision 1.5.7 defines it (`xrv.models.DenseNet`, a copy of torchvision's with one
//! input channel). Parameter names match the published checkpoints (`features.conv0.weight`,
//! `features.denseblock1.denselayer1.norm1.running_mean`, ..., `classifier.bias`), so converted
//! weights load unchanged.
//!
//! This is the candle path (GPUs, reference); on the CPU `hilum-kernels` runs the same weights
//! (read by [`native_weights`]).
//!
//! Batch norms are folded at load: a BN that directly follows a convolution (`norm0`, each
//! layer's `norm2`) goes into that convolution's weight and bias, and a pre-activation BN
//! (`norm1`, the transitions' `norm`, `norm5`) becomes one per-channel scale and shift, so the
//! forward runs one broadcast mul + add instead of candle_nn's six-op `BatchNorm` (which also
//! recomputes `sqrt(var + eps)` every call). The public `BatchNorm` fields keep the checkpoint's
//! values for the ONNX export and for [`DenseNet::forward_unfolded`], the reference.
//! [`DenseNet::to_dtype`] runs those folded layers in f16 (opt-in; logits stay f32).

use candle_core::{DType, Module, Result, Tensor};

pub use crate::bn_fold::check_compute_dtype;
use crate::bn_fold::{conv_to_dtype, fold_conv_bn, ChannelAffine};
use candle_nn::{
    batch_norm, conv2d_no_bias, linear, BatchNorm, Conv2d, Conv2dConfig, Linear, VarBuilder,
};
use serde::{Deserialize, Serialize};

use crate::onnx_graph::{self, GraphBuilder};
use hilum_kernels::densenet as kw;

use crate::native;

/// torchvision/torchxrayvision use BatchNorm2d's default epsilon.
pub const BN_EPS: f64 = 1e-5;

/// Shape of a DenseNet. `Config::densenet121_res224_all()` is the published model; small
/// configurations are used for reference fixtures.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Channels each dense layer adds to the concatenation.
    pub growth_rate: usize,
    /// Dense layers per block.
    pub block_config: Vec<usize>,
    /// Channels of the stem convolution.
    pub num_init_features: usize,
    /// Bottleneck width multiplier: the 1x1 conv of a dense layer outputs `bn_size * growth_rate`.
    pub bn_size: usize,
    /// Outputs of the classifier (one logit per label).
    pub num_classes: usize,
    /// Channels of the input image (1 for radiographs).
    pub in_channels: usize,
}

impl Config {
    /// torchxrayvision `densenet121-res224-all`: DenseNet-121, 1 channel, 18 pathologies.
    pub fn densenet121_res224_all() -> Self {
        Config {
            growth_rate: 32,
            block_config: vec![6, 12, 24, 16],
            num_init_features: 64,
            bn_size: 4,
            num_classes: 18,
            in_channels: 1,
        }
    }

    /// Channels entering each dense block, and the channels leaving the last one.
    pub fn block_channels(&self) -> (Vec<usize>, usize) {
        let mut c = self.num_init_features;
        let mut ins = Vec::with_capacity(self.block_config.len());
        for (i, &n) in self.block_config.iter().enumerate() {
            ins.push(c);
            c += n * self.growth_rate;
            if i + 1 != self.block_config.len() {
                c /= 2;
            }
        }
        (ins, c)
    }
}

/// norm1 → relu → conv1 (1x1) → norm2 → relu → conv2 (3x3); the output is concatenated.
/// The forward runs the folded copies made at load; changing the public fields afterwards
/// changes only the ONNX export and [`DenseNet::forward_unfolded`].
#[derive(Clone, Debug)]
pub struct DenseLayer {
    /// BatchNorm before the bottleneck convolution.
    pub norm1: BatchNorm,
    /// The 1x1 bottleneck convolution.
    pub conv1: Conv2d,
    /// BatchNorm before the 3x3 convolution.
    pub norm2: BatchNorm,
    /// The 3x3 convolution that adds `growth_rate` channels.
    pub conv2: Conv2d,
    /// `norm1` as a scale and shift.
    pre: ChannelAffine,
    /// `conv1` with `norm2` folded in.
    conv1_norm2: Conv2d,
    /// `conv2` in the forward's dtype.
    conv2_fwd: Conv2d,
}

impl DenseLayer {
    fn load(vb: VarBuilder, c_in: usize, cfg: &Config) -> Result<Self> {
        let mid = cfg.bn_size * cfg.growth_rate;
        let pad1 = Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let norm1 = batch_norm(c_in, BN_EPS, vb.pp("norm1"))?;
        let conv1 = conv2d_no_bias(c_in, mid, 1, Default::default(), vb.pp("conv1"))?;
        let norm2 = batch_norm(mid, BN_EPS, vb.pp("norm2"))?;
        let conv2 = conv2d_no_bias(mid, cfg.growth_rate, 3, pad1, vb.pp("conv2"))?;
        Ok(DenseLayer {
            pre: ChannelAffine::from_batch_norm(&norm1)?,
            conv1_norm2: fold_conv_bn(&conv1, &norm2)?,
            conv2_fwd: conv2.clone(),
            norm1,
            conv1,
            norm2,
            conv2,
        })
    }

    /// The folded layer's tensors in `dtype`.
    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(DenseLayer {
            pre: self.pre.to_dtype(dtype)?,
            conv1_norm2: conv_to_dtype(&self.conv1_norm2, dtype)?,
            conv2_fwd: conv_to_dtype(&self.conv2_fwd, dtype)?,
            ..self.clone()
        })
    }

    /// (b, c_in, h, w) → (b, growth_rate, h, w), batch norms folded.
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.pre
            .forward_relu(xs)?
            .apply(&self.conv1_norm2)?
            .relu()?
            .apply(&self.conv2_fwd)
    }

    /// The same through candle_nn's BatchNorm (the reference).
    fn forward_unfolded(&self, xs: &Tensor) -> Result<Tensor> {
        xs.apply_t(&self.norm1, false)?
            .relu()?
            .apply(&self.conv1)?
            .apply_t(&self.norm2, false)?
            .relu()?
            .apply(&self.conv2)
    }
}

/// norm → relu → conv (1x1, halves channels) → 2x2 average pool.
#[derive(Clone, Debug)]
pub struct Transition {
    /// BatchNorm before the convolution.
    pub norm: BatchNorm,
    /// The 1x1 convolution that halves the channels.
    pub conv: Conv2d,
    /// `norm` as a scale and shift.
    pre: ChannelAffine,
    /// `conv` in the forward's dtype.
    conv_fwd: Conv2d,
}

impl Transition {
    fn load(vb: VarBuilder, c_in: usize, c_out: usize) -> Result<Self> {
        let norm = batch_norm(c_in, BN_EPS, vb.pp("norm"))?;
        let conv = conv2d_no_bias(c_in, c_out, 1, Default::default(), vb.pp("conv"))?;
        Ok(Transition {
            pre: ChannelAffine::from_batch_norm(&norm)?,
            conv_fwd: conv.clone(),
            norm,
            conv,
        })
    }

    fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(Transition {
            pre: self.pre.to_dtype(dtype)?,
            conv_fwd: conv_to_dtype(&self.conv_fwd, dtype)?,
            ..self.clone()
        })
    }

    fn forward(&self, xs: &Tensor, folded: bool) -> Result<Tensor> {
        let ys = if folded {
            self.pre.forward_relu(xs)?.apply(&self.conv_fwd)?
        } else {
            xs.apply_t(&self.norm, false)?.relu()?.apply(&self.conv)?
        };
        ys.avg_pool2d(2)
    }
}

/// The DenseNet on candle: the reference path, and the GPU one. Its forward runs the batch
/// norms folded at load (see the module's documentation).
#[derive(Clone, Debug)]
pub struct DenseNet {
    /// The architecture it was built for.
    pub cfg: Config,
    /// The 7x7 stride-2 stem convolution.
    pub conv0: Conv2d,
    /// BatchNorm after the stem.
    pub norm0: BatchNorm,
    /// One Vec of layers per dense block.
    pub blocks: Vec<Vec<DenseLayer>>,
    /// One transition after every block but the last.
    pub transitions: Vec<Transition>,
    /// BatchNorm after the last block.
    pub norm5: BatchNorm,
    /// The linear classifier over the pooled features.
    pub classifier: Linear,
    /// `conv0` with `norm0` folded in.
    conv0_norm0: Conv2d,
    /// `norm5` as a scale and shift.
    post: ChannelAffine,
    /// The dtype of the folded layers (f32 unless [`DenseNet::to_dtype`] changed it).
    dtype: DType,
}

impl DenseNet {
    /// `vb` is the checkpoint root (holding `features.*` and `classifier.*`).
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let f = vb.pp("features");
        let stem = Conv2dConfig {
            padding: 3,
            stride: 2,
            ..Default::default()
        };
        let conv0 = conv2d_no_bias(
            cfg.in_channels,
            cfg.num_init_features,
            7,
            stem,
            f.pp("conv0"),
        )?;
        let norm0 = batch_norm(cfg.num_init_features, BN_EPS, f.pp("norm0"))?;
        let (block_in, c_final) = cfg.block_channels();
        let mut blocks = Vec::new();
        let mut transitions = Vec::new();
        for (i, &n_layers) in cfg.block_config.iter().enumerate() {
            let bvb = f.pp(format!("denseblock{}", i + 1));
            let layers = (0..n_layers)
                .map(|j| {
                    let c_in = block_in[i] + j * cfg.growth_rate;
                    DenseLayer::load(bvb.pp(format!("denselayer{}", j + 1)), c_in, cfg)
                })
                .collect::<Result<Vec<_>>>()?;
            blocks.push(layers);
            if i + 1 != cfg.block_config.len() {
                let c = block_in[i] + n_layers * cfg.growth_rate;
                transitions.push(Transition::load(
                    f.pp(format!("transition{}", i + 1)),
                    c,
                    c / 2,
                )?);
            }
        }
        let norm5 = batch_norm(c_final, BN_EPS, f.pp("norm5"))?;
        Ok(DenseNet {
            cfg: cfg.clone(),
            conv0_norm0: fold_conv_bn(&conv0, &norm0)?,
            post: ChannelAffine::from_batch_norm(&norm5)?,
            dtype: conv0.weight().dtype(),
            conv0,
            norm0,
            blocks,
            transitions,
            norm5,
            classifier: linear(c_final, cfg.num_classes, vb.pp("classifier"))?,
        })
    }

    /// Pooled features: (b, in_channels, h, w) → (b, c_final), after norm5 and ReLU.
    pub fn features(&self, xs: &Tensor) -> Result<Tensor> {
        // (b, c_final, h/32, w/32) → (b, c_final)
        self.feature_map(xs)?.mean((2, 3))
    }

    /// The last feature map before the pool: (b, in_channels, h, w) → (b, c_final, h/32,
    /// w/32), after norm5 and ReLU (what a class activation map weighs).
    pub fn feature_map(&self, xs: &Tensor) -> Result<Tensor> {
        let dtype = xs.dtype();
        self.feature_map_with(&xs.to_dtype(self.dtype)?, true)?
            .to_dtype(dtype)
    }

    /// The same network with its folded forward in `dtype` (f32 or f16, see
    /// [`check_compute_dtype`]): weights and activations in `dtype` on the device, the input
    /// converted on entry and the feature map back to the input's dtype before the pool and
    /// the classifier (which stay f32). The public fields, the ONNX export and
    /// [`DenseNet::forward_unfolded`] keep the checkpoint's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        check_compute_dtype(dtype)?;
        Ok(DenseNet {
            conv0_norm0: conv_to_dtype(&self.conv0_norm0, dtype)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| b.iter().map(|l| l.to_dtype(dtype)).collect())
                .collect::<Result<_>>()?,
            transitions: self
                .transitions
                .iter()
                .map(|t| t.to_dtype(dtype))
                .collect::<Result<_>>()?,
            post: self.post.to_dtype(dtype)?,
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
        self.feature_map_with(xs, false)?
            .mean((2, 3))?
            .apply(&self.classifier)
    }

    fn feature_map_with(&self, xs: &Tensor, folded: bool) -> Result<Tensor> {
        let stem = if folded {
            xs.apply(&self.conv0_norm0)?
        } else {
            xs.apply(&self.conv0)?.apply_t(&self.norm0, false)?
        };
        // Zero padding equals -inf padding here: the max pool follows a ReLU.
        let mut xs = stem
            .relu()?
            .pad_with_zeros(2, 1, 1)?
            .pad_with_zeros(3, 1, 1)?
            .max_pool2d_with_stride(3, 2)?;
        for (i, layers) in self.blocks.iter().enumerate() {
            for layer in layers {
                let new = if folded {
                    layer.forward(&xs)?
                } else {
                    layer.forward_unfolded(&xs)?
                };
                xs = Tensor::cat(&[&xs, &new], 1)?;
            }
            if let Some(t) = self.transitions.get(i) {
                xs = t.forward(&xs, folded)?;
            }
        }
        if folded {
            self.post.forward_relu(&xs)
        } else {
            xs.apply_t(&self.norm5, false)?.relu()
        }
    }
}

impl Module for DenseNet {
    /// Raw logits (b, num_classes); sigmoid and op_norm are in [`crate::xrv`].
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.features(xs)?.apply(&self.classifier)
    }
}

impl DenseNet {
    /// The same forward pass as an ONNX graph with these weights: input `x`
    /// (batch, in_channels, size, size), output `logits` (batch, num_classes).
    pub fn to_onnx(&self, size: usize) -> Result<Vec<u8>> {
        let mut g = GraphBuilder::new("densenet");
        let x = g.conv2d("features.conv0", &self.conv0, onnx_graph::INPUT)?;
        let x = g.batch_norm("features.norm0", &self.norm0, &x)?;
        let x = g.relu(&x);
        let mut xs = g.max_pool(&x, 3, 2, 1);
        for (i, layers) in self.blocks.iter().enumerate() {
            let block = format!("features.denseblock{}", i + 1);
            for (j, l) in layers.iter().enumerate() {
                let p = format!("{block}.denselayer{}", j + 1);
                let y = g.batch_norm(&format!("{p}.norm1"), &l.norm1, &xs)?;
                let y = g.relu(&y);
                let y = g.conv2d(&format!("{p}.conv1"), &l.conv1, &y)?;
                let y = g.batch_norm(&format!("{p}.norm2"), &l.norm2, &y)?;
                let y = g.relu(&y);
                let new = g.conv2d(&format!("{p}.conv2"), &l.conv2, &y)?;
                xs = g.concat(&[&xs, &new], 1);
            }
            if let Some(t) = self.transitions.get(i) {
                let p = format!("features.transition{}", i + 1);
                let y = g.batch_norm(&format!("{p}.norm"), &t.norm, &xs)?;
                let y = g.relu(&y);
                let y = g.conv2d(&format!("{p}.conv"), &t.conv, &y)?;
                xs = g.avg_pool(&y, 2);
            }
        }
        let y = g.batch_norm("features.norm5", &self.norm5, &xs)?;
        let y = g.relu(&y);
        // (b, c_final, size/32, size/32) → (b, c_final)
        let y = g.global_avg_pool(&y);
        let logits = g.linear("classifier", &self.classifier, &y)?;
        Ok(g.finish_classifier(
            &logits,
            self.cfg.in_channels,
            size,
            self.cfg.num_classes,
            "torchxrayvision DenseNet (densenet121-res224-all layout): logits before sigmoid and op_norm",
        ))
    }
}

/// [`DenseNet`]'s weights for the native engine (`features.*`, `classifier.*` at the root of `vb`).
pub fn native_weights(vb: VarBuilder, cfg: &Config) -> Result<kw::DenseNetWeights> {
    let eps = BN_EPS;
    let f = vb.pp("features");
    let (block_in, c_final) = cfg.block_channels();
    let mid = cfg.bn_size * cfg.growth_rate;
    let mut blocks = Vec::new();
    let mut transitions = Vec::new();
    for (i, &n) in cfg.block_config.iter().enumerate() {
        let bvb = f.pp(format!("denseblock{}", i + 1));
        let layers = (0..n)
            .map(|j| {
                let c_in = block_in[i] + j * cfg.growth_rate;
                let l = bvb.pp(format!("denselayer{}", j + 1));
                Ok(kw::DenseLayer {
                    norm1: native::batch_norm(&l.pp("norm1"), c_in, eps)?,
                    conv1: native::conv(&l.pp("conv1"), c_in, mid, 1, false)?,
                    norm2: native::batch_norm(&l.pp("norm2"), mid, eps)?,
                    conv2: native::conv(&l.pp("conv2"), mid, cfg.growth_rate, 3, false)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        blocks.push(layers);
        if i + 1 != cfg.block_config.len() {
            let c = block_in[i] + n * cfg.growth_rate;
            let t = f.pp(format!("transition{}", i + 1));
            transitions.push(kw::Transition {
                norm: native::batch_norm(&t.pp("norm"), c, eps)?,
                conv: native::conv(&t.pp("conv"), c, c / 2, 1, false)?,
            });
        }
    }
    Ok(kw::DenseNetWeights {
        conv0: native::conv(
            &f.pp("conv0"),
            cfg.in_channels,
            cfg.num_init_features,
            7,
            false,
        )?,
        norm0: native::batch_norm(&f.pp("norm0"), cfg.num_init_features, eps)?,
        blocks,
        transitions,
        norm5: native::batch_norm(&f.pp("norm5"), c_final, eps)?,
        classifier: native::linear(&vb.pp("classifier"), c_final, cfg.num_classes)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::recorded_params;

    /// The native reader asks for exactly the parameters (names and shapes) the candle model does.
    #[test]
    fn native_reader_asks_for_the_candle_models_parameters() {
        let small = Config {
            growth_rate: 4,
            block_config: vec![2, 3],
            num_init_features: 8,
            bn_size: 2,
            num_classes: 3,
            in_channels: 1,
        };
        for cfg in [&small, &Config::densenet121_res224_all()] {
            assert_eq!(
                recorded_params(|vb| native_weights(vb, cfg)).expect("native"),
                recorded_params(|vb| DenseNet::load(vb, cfg)).expect("candle"),
            );
        }
    }
}
