//! Checkpoints read into `hilum-kernels`' plain weight structs, so the CPU engines are built from
//! the weights themselves and never from the candle modules. Each reader walks the same
//! `vb.pp(..)` tree as its candle model (names and shapes are checked equal by the tests below);
//! BatchNorms are handed over as parameters and folded by the engine.

use candle_core::{DType, Result};
use candle_nn::VarBuilder;
use hilum_kernels::densenet::{DenseLayer, DenseNetWeights, Transition};
use hilum_kernels::pspnet::{Bottleneck as PspBottleneck, ConvBn, PspNetWeights};
use hilum_kernels::resnet::{Bottleneck, ResNetWeights};
use hilum_kernels::unet::{UnetBlock, UnetWeights};
use hilum_kernels::{BatchNorm, Conv, Linear};

use crate::{densenet, pspnet, resnet, unet};

fn floats(vb: &VarBuilder, shape: &[usize], name: &str) -> Result<Vec<f32>> {
    vb.get(shape, name)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()
}

/// A PyTorch conv (`weight` (c_out, c_in, k, k), optional `bias`).
fn conv(vb: &VarBuilder, c_in: usize, c_out: usize, k: usize, bias: bool) -> Result<Conv> {
    Ok(Conv {
        c_out,
        c_in,
        k,
        weight: floats(vb, &[c_out, c_in, k, k], "weight")?,
        bias: if bias {
            Some(floats(vb, &[c_out], "bias")?)
        } else {
            None
        },
    })
}

/// A PyTorch BatchNorm2d (`weight`, `bias`, `running_mean`, `running_var`).
fn batch_norm(vb: &VarBuilder, c: usize, eps: f64) -> Result<BatchNorm> {
    Ok(BatchNorm {
        gamma: floats(vb, &[c], "weight")?,
        beta: floats(vb, &[c], "bias")?,
        mean: floats(vb, &[c], "running_mean")?,
        var: floats(vb, &[c], "running_var")?,
        eps: eps as f32,
    })
}

fn linear(vb: &VarBuilder, in_features: usize, out_features: usize) -> Result<Linear> {
    Ok(Linear {
        in_features,
        out_features,
        weight: floats(vb, &[out_features, in_features], "weight")?,
        bias: Some(floats(vb, &[out_features], "bias")?),
    })
}

/// [`densenet::DenseNet`]'s weights (`features.*`, `classifier.*` at the root of `vb`).
pub fn densenet(vb: VarBuilder, cfg: &densenet::Config) -> Result<DenseNetWeights> {
    let eps = densenet::BN_EPS;
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
                Ok(DenseLayer {
                    norm1: batch_norm(&l.pp("norm1"), c_in, eps)?,
                    conv1: conv(&l.pp("conv1"), c_in, mid, 1, false)?,
                    norm2: batch_norm(&l.pp("norm2"), mid, eps)?,
                    conv2: conv(&l.pp("conv2"), mid, cfg.growth_rate, 3, false)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        blocks.push(layers);
        if i + 1 != cfg.block_config.len() {
            let c = block_in[i] + n * cfg.growth_rate;
            let t = f.pp(format!("transition{}", i + 1));
            transitions.push(Transition {
                norm: batch_norm(&t.pp("norm"), c, eps)?,
                conv: conv(&t.pp("conv"), c, c / 2, 1, false)?,
            });
        }
    }
    Ok(DenseNetWeights {
        conv0: conv(
            &f.pp("conv0"),
            cfg.in_channels,
            cfg.num_init_features,
            7,
            false,
        )?,
        norm0: batch_norm(&f.pp("norm0"), cfg.num_init_features, eps)?,
        blocks,
        transitions,
        norm5: batch_norm(&f.pp("norm5"), c_final, eps)?,
        classifier: linear(&vb.pp("classifier"), c_final, cfg.num_classes)?,
    })
}

/// [`resnet::ResNet`]'s weights (`conv1.*`, `layer1.0.*`, ..., `fc.*` at the root of `vb`).
pub fn resnet(vb: VarBuilder, cfg: &resnet::Config) -> Result<ResNetWeights> {
    let eps = densenet::BN_EPS;
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
                    conv(&b.pp("downsample.0"), c_in, c_out, 1, false)?,
                    batch_norm(&b.pp("downsample.1"), c_out, eps)?,
                ))
            } else {
                None
            };
            blocks.push(Bottleneck {
                conv1: conv(&b.pp("conv1"), c_in, planes, 1, false)?,
                bn1: batch_norm(&b.pp("bn1"), planes, eps)?,
                conv2: conv(&b.pp("conv2"), planes, planes, 3, false)?,
                bn2: batch_norm(&b.pp("bn2"), planes, eps)?,
                conv3: conv(&b.pp("conv3"), planes, c_out, 1, false)?,
                bn3: batch_norm(&b.pp("bn3"), c_out, eps)?,
                downsample,
                stride,
            });
            c_in = c_out;
        }
    }
    Ok(ResNetWeights {
        conv1: conv(
            &vb.pp("conv1"),
            cfg.in_channels,
            cfg.stem_channels,
            7,
            false,
        )?,
        bn1: batch_norm(&vb.pp("bn1"), cfg.stem_channels, eps)?,
        blocks,
        fc: linear(&vb.pp("fc"), c_in, cfg.num_classes)?,
    })
}

/// A ptsemseg unit `{unit}.0` (conv, no bias) + `{unit}.1` (BatchNorm).
#[allow(clippy::too_many_arguments)]
fn conv_bn(
    vb: &VarBuilder,
    unit: &str,
    cin: usize,
    cout: usize,
    k: usize,
    (stride, padding, dilation): (usize, usize, usize),
    relu: bool,
) -> Result<ConvBn> {
    let vb = vb.pp(unit);
    Ok(ConvBn {
        conv: conv(&vb.pp("0"), cin, cout, k, false)?,
        bn: batch_norm(&vb.pp("1"), cout, pspnet::BN_EPS)?,
        stride,
        padding,
        dilation,
        relu,
    })
}

/// `conv2DBatchNormRelu` with (stride, padding, dilation).
fn cbr(
    vb: &VarBuilder,
    cin: usize,
    cout: usize,
    k: usize,
    spd: (usize, usize, usize),
) -> Result<ConvBn> {
    conv_bn(vb, "cbr_unit", cin, cout, k, spd, true)
}

/// `conv2DBatchNorm`, 1x1.
fn cb(vb: &VarBuilder, cin: usize, cout: usize, stride: usize) -> Result<ConvBn> {
    conv_bn(vb, "cb_unit", cin, cout, 1, (stride, 0, 1), false)
}

/// [`pspnet::PspNet`]'s weights (the state dict without `module.`).
pub fn pspnet(vb: VarBuilder, cfg: &pspnet::Config) -> Result<PspNetWeights> {
    let [s1, s2, s3] = cfg.stem;
    let stem = vec![
        cbr(&vb.pp("convbnrelu1_1"), 3, s1, 3, (2, 1, 1))?,
        cbr(&vb.pp("convbnrelu1_2"), s1, s2, 3, (1, 1, 1))?,
        cbr(&vb.pp("convbnrelu1_3"), s2, s3, 3, (1, 1, 1))?,
    ];
    let mut blocks = Vec::new();
    let mut cin = s3;
    for (i, ((&[mid, cout], &n), (stride, dil))) in cfg
        .stages
        .iter()
        .zip(&cfg.block_config)
        .zip(pspnet::STAGE_STRIDE_DILATION)
        .enumerate()
    {
        let svb = vb.pp(format!("res_block{}", i + 2)).pp("layers");
        // ptsemseg drops the stride when the stage is dilated; only the projecting first block
        // strides.
        let stride = if dil > 1 { 1 } else { stride };
        for j in 0..n {
            let b = svb.pp(j);
            let project = j == 0;
            let c = if project { cin } else { cout };
            let s2 = if project { stride } else { 1 };
            blocks.push(PspBottleneck {
                cbr1: cbr(&b.pp("cbr1"), c, mid, 1, (1, 0, 1))?,
                cbr2: cbr(&b.pp("cbr2"), mid, mid, 3, (s2, dil, dil))?,
                cb3: cb(&b.pp("cb3"), mid, cout, 1)?,
                cb4: if project {
                    Some(cb(&b.pp("cb4"), c, cout, stride)?)
                } else {
                    None
                },
            });
        }
        cin = cout;
    }
    let paths = cfg.pool_sizes.len().max(1);
    let pyramid = (0..cfg.pool_sizes.len())
        .map(|i| {
            let p = vb.pp("pyramid_pooling").pp("path_module_list").pp(i);
            cbr(&p, cin, cin / paths, 1, (1, 0, 1))
        })
        .collect::<Result<Vec<_>>>()?;
    let cat = cin + (cin / paths) * cfg.pool_sizes.len();
    Ok(PspNetWeights {
        stem,
        blocks,
        pool_sizes: cfg.pool_sizes.clone(),
        pyramid,
        cbr_final: cbr(&vb.pp("cbr_final"), cat, cfg.final_channels, 3, (1, 1, 1))?,
        classification: conv(
            &vb.pp("classification"),
            cfg.final_channels,
            cfg.n_classes,
            1,
            true,
        )?,
    })
}

/// A Keras conv `{name}.kernel` (HWIO) + `{name}.bias`, as a PyTorch-layout [`Conv`].
fn keras_conv(vb: &VarBuilder, name: &str, k: usize, c_in: usize, c_out: usize) -> Result<Conv> {
    let v = vb.pp(name);
    let weight = v
        .get((k, k, c_in, c_out), "kernel")?
        .to_dtype(DType::F32)?
        .permute((3, 2, 0, 1))? // (o, i, kh, kw)
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(Conv {
        c_out,
        c_in,
        k,
        weight,
        bias: Some(floats(&v, &[c_out], "bias")?),
    })
}

/// A Keras BatchNormalization (`gamma`, `beta`, `moving_mean`, `moving_variance`).
fn keras_bn(vb: &VarBuilder, name: &str, c: usize) -> Result<BatchNorm> {
    let v = vb.pp(name);
    Ok(BatchNorm {
        gamma: floats(&v, &[c], "gamma")?,
        beta: floats(&v, &[c], "beta")?,
        mean: floats(&v, &[c], "moving_mean")?,
        var: floats(&v, &[c], "moving_variance")?,
        eps: unet::BN_EPS as f32,
    })
}

/// [`unet::LungUnet`]'s weights (Keras layer names at the root of `vb`).
pub fn lung_unet(vb: VarBuilder, cfg: &unet::Config) -> Result<UnetWeights> {
    let mut se = 0;
    let mut c_in = cfg.in_channels;
    let mut block = |conv_name: String,
                     bn_name: String,
                     residual: Option<String>,
                     c_in: usize,
                     c: usize,
                     stride: usize|
     -> Result<UnetBlock> {
        let c_se = c / cfg.se_reduction;
        let b = UnetBlock {
            conv: keras_conv(&vb, &conv_name, 3, c_in, c)?,
            bn: keras_bn(&vb, &bn_name, c)?,
            stride,
            residual_bn: residual.map(|n| keras_bn(&vb, &n, c)).transpose()?,
            se_reduce: keras_conv(&vb, &unet::conv2d_name(se), 1, c, c_se)?,
            se_expand: keras_conv(&vb, &unet::conv2d_name(se + 1), 1, c_se, c)?,
            project: keras_conv(&vb, &unet::conv2d_name(se + 2), 1, c, c)?,
        };
        se += 3;
        Ok(b)
    };
    let mut encoder = Vec::new();
    for (i, (&c, &n)) in cfg
        .encoder_channels
        .iter()
        .zip(&cfg.encoder_ids)
        .enumerate()
    {
        let stride = if i == 0 { 2 } else { 1 };
        let residual = (i > 0 && c == c_in).then(|| format!("bn{n}_a"));
        encoder.push(block(
            format!("conv{n}"),
            format!("bn{n}"),
            residual,
            c_in,
            c,
            stride,
        )?);
        c_in = c;
    }
    let mut decoder = Vec::new();
    for (&c, &n) in cfg.decoder_channels.iter().zip(&cfg.decoder_ids) {
        decoder.push(block(
            format!("resize_conv{n}"),
            format!("resize_bn{n}"),
            None,
            c_in,
            c,
            1,
        )?);
        c_in = c;
    }
    Ok(UnetWeights {
        encoder,
        decoder,
        head: keras_conv(&vb, &format!("resize_conv{}", cfg.head_id), 3, c_in, 1)?,
        head_bn: keras_bn(&vb, &format!("resize_bn{}", cfg.head_id), 1)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::recorded_params;

    /// Each reader asks for exactly the parameters (names and shapes) its candle model does.
    #[test]
    fn readers_ask_for_the_candle_models_parameters() {
        let small_dense = densenet::Config {
            growth_rate: 4,
            block_config: vec![2, 3],
            num_init_features: 8,
            bn_size: 2,
            num_classes: 3,
            in_channels: 1,
        };
        let dense = densenet::Config::densenet121_res224_all();
        for cfg in [&small_dense, &dense] {
            assert_eq!(
                recorded_params(|vb| densenet(vb, cfg)).expect("native"),
                recorded_params(|vb| densenet::DenseNet::load(vb, cfg)).expect("candle"),
            );
        }
        let res = resnet::Config::resnet50_res512_all();
        assert_eq!(
            recorded_params(|vb| resnet(vb, &res)).expect("native"),
            recorded_params(|vb| resnet::ResNet::load(vb, &res)).expect("candle"),
        );
        let psp = pspnet::Config::chestx_det();
        assert_eq!(
            recorded_params(|vb| pspnet(vb, &psp)).expect("native"),
            pspnet::expected_params(&psp).expect("candle"),
        );
        let lung = unet::Config::lung_seg_valiou_088();
        let names = recorded_params(|vb| lung_unet(vb, &lung)).expect("native");
        assert_eq!(names, unet::expected_params());
        assert_eq!(
            names,
            recorded_params(|vb| unet::LungUnet::load(vb, &lung)).expect("candle"),
        );
    }

    /// The lung U-Net at 64 px with seeded weights (fan-in scaled so activations stay in
    /// range) on the native engine and on candle: the same probabilities.
    #[test]
    fn native_lung_unet_matches_candle() {
        use candle_core::{Device, Tensor};
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut unit = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut ts = std::collections::HashMap::new();
        for (name, shape) in unet::expected_params() {
            let n: usize = shape.iter().product();
            let fan_in = if shape.len() == 4 {
                shape[0] * shape[1] * shape[2]
            } else {
                1
            };
            let vals: Vec<f32> = (0..n)
                .map(|_| {
                    let u = unit();
                    if name.ends_with("moving_variance") {
                        0.5 + u.abs()
                    } else {
                        3.0 * u / (fan_in as f32).sqrt()
                    }
                })
                .collect();
            ts.insert(
                name,
                Tensor::from_vec(vals, shape, &Device::Cpu).expect("tensor"),
            );
        }
        let vb = VarBuilder::from_tensors(ts, DType::F32, &Device::Cpu);
        let cfg = unet::Config {
            input_size: 64,
            ..unet::Config::lung_seg_valiou_088()
        };
        let mut px = 99u32;
        let inputs: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                (0..64 * 64 * 3)
                    .map(|_| {
                        px = px.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        (px >> 24) as f32
                    })
                    .collect()
            })
            .collect();
        let run = |backend| {
            unet::LungSegmenter::new(vb.clone(), &cfg, backend, 2)
                .expect("load")
                .predict(&inputs)
                .expect("predict")
                .concat()
        };
        let (native, candle) = (run(crate::Backend::Native), run(crate::Backend::Candle));
        let max = native
            .iter()
            .zip(&candle)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(max < 1e-4, "native vs candle: max abs diff {max}");
        let (lo, hi) = candle
            .iter()
            .fold((1f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        assert!(hi - lo > 0.1, "degenerate test output {lo}..{hi}");
    }
}
