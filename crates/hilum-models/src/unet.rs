//! The lung-field U-Net of vk1996/Lung-Segmentation-TF (`lung_seg_valiou_088.h5`, Keras 2.2.4):
//! an encoder of six conv stages (swish activations, batch norm, residual adds where the width
//! is kept, squeeze-excitation), a nearest-upsampling decoder with additive skips, and a
//! sigmoid head giving one lung probability per pixel.
//!
//! Parameter names are the Keras layer and weight names (`conv1.kernel`, `bn1.moving_mean`,
//! `conv2d_17.bias`) with Keras shapes (kernels HWIO), so the converted checkpoint is a plain
//! renaming of the published one. Preprocessing and postprocessing (resize, threshold,
//! upsampling to the original size) live here, beside the network, and so does
//! [`LungSegmenter`], which runs it on one backend: `hilum-kernels`' native engine (from
//! weights read by [`native_weights`]), candle, or ONNX Runtime.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Module, Tensor, D};
use candle_nn::{Conv2d, Conv2dConfig, VarBuilder};
use serde::{Deserialize, Serialize};

use hilum_kernels::unet::same_padding;
use hilum_kernels::NativeUnet;

use crate::native::{keras_bn, keras_conv};

use hilum_imaging::{Filter, Layout, Norm, Prepared, Preprocess};

use crate::bn_fold::ChannelAffine;
use crate::runner::{check_input, recipe_values, Runner};
use crate::{Backend, Device, InstalledModel, Manifest, ModelError};

/// Input name of the published ONNX export (`lung_seg_valiou_088.onnx`), used by the kserve
/// backend when no `model.onnx` is installed to read the names from.
pub const ONNX_INPUT: &str = "input";
/// Output name of the published ONNX export.
pub const ONNX_OUTPUT: &str = "activation_51";

/// Keras' default batch-norm epsilon, used by every BN layer of the checkpoint.
pub(crate) const BN_EPS: f64 = 1e-3;

/// The shape of the lung U-Net.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Square input side in pixels.
    pub input_size: usize,
    /// Channels of the input image.
    pub in_channels: usize,
    /// Output width of each encoder stage; stage 0 convolves with stride 2, later stages
    /// max-pool first.
    pub encoder_channels: Vec<usize>,
    /// Keras numbering of the encoder's 3x3 convs (`conv{n}`, `bn{n}`, `bn{n}_a`).
    pub encoder_ids: Vec<usize>,
    /// Output width of each decoder stage (each upsamples 2x first).
    pub decoder_channels: Vec<usize>,
    /// Keras numbering of the decoder's 3x3 convs (`resize_conv{n}`, `resize_bn{n}`).
    pub decoder_ids: Vec<usize>,
    /// Keras numbering of the head (`resize_conv{n}`, `resize_bn{n}`), one output channel.
    pub head_id: usize,
    /// Squeeze-excitation bottleneck = width / this.
    pub se_reduction: usize,
}

impl Config {
    /// `lung_seg_valiou_088.h5`.
    pub fn lung_seg_valiou_088() -> Self {
        Config {
            input_size: 256,
            in_channels: 3,
            encoder_channels: vec![16, 16, 32, 32, 64, 64],
            encoder_ids: vec![1, 3, 4, 5, 6, 7],
            decoder_channels: vec![64, 32, 32, 16, 16, 8],
            decoder_ids: vec![7, 6, 5, 4, 3, 2],
            head_id: 1,
            se_reduction: 4,
        }
    }
}

/// Keras names its unnamed 1x1 convs `conv2d`, `conv2d_1`, ... in creation order.
pub(crate) fn conv2d_name(n: usize) -> String {
    if n == 0 {
        "conv2d".to_string()
    } else {
        format!("conv2d_{n}")
    }
}

/// One stage: a 3x3 conv + BN + swish, an optional residual add + BN + swish (encoder stages
/// that keep their width), squeeze-excitation, and a 1x1 conv + swish.
struct Block {
    conv: Conv2d,
    stride: usize,
    residual_bn: Option<ChannelAffine>,
    se_reduce: Conv2d,
    se_expand: Conv2d,
    project: Conv2d,
}

/// A Keras batch norm's per-channel (scale, shift), shapes (c,): gamma / sqrt(var + eps) and
/// beta - mean * scale.
fn keras_scale_shift(vb: VarBuilder, c: usize) -> candle_core::Result<(Tensor, Tensor)> {
    let gamma = vb.get(c, "gamma")?;
    let beta = vb.get(c, "beta")?;
    let mean = vb.get(c, "moving_mean")?;
    let var = vb.get(c, "moving_variance")?;
    let scale = gamma.broadcast_div(&(var + BN_EPS)?.sqrt()?)?;
    let shift = (beta - mean.mul(&scale)?)?;
    Ok((scale, shift))
}

/// A Keras conv (kernel HWIO) as a candle conv (OIHW), with an optional following batch norm
/// folded into its weights. Padding is applied by the caller (Keras `same` may be asymmetric).
fn conv(
    vb: &VarBuilder,
    name: &str,
    k: usize,
    c_in: usize,
    c_out: usize,
    stride: usize,
    bn: Option<&str>,
) -> candle_core::Result<Conv2d> {
    let v = vb.pp(name);
    let kernel = v
        .get((k, k, c_in, c_out), "kernel")?
        .permute((3, 2, 0, 1))?; // (o, i, kh, kw)
    let bias = v.get(c_out, "bias")?;
    let (w, b) = match bn {
        None => (kernel, bias),
        Some(bn) => {
            let (s, shift) = keras_scale_shift(vb.pp(bn), c_out)?;
            let w = kernel.broadcast_mul(&s.reshape((c_out, 1, 1, 1))?)?;
            let b = bias.mul(&s)?.add(&shift)?;
            (w, b)
        }
    };
    let cfg = Conv2dConfig {
        stride,
        ..Default::default()
    };
    Ok(Conv2d::new(w.contiguous()?, Some(b), cfg))
}

impl Block {
    #[allow(clippy::too_many_arguments)]
    fn load(
        vb: &VarBuilder,
        conv_name: &str,
        bn_name: &str,
        residual_bn: Option<&str>,
        se_first: usize,
        c_in: usize,
        c_out: usize,
        stride: usize,
        se_reduction: usize,
    ) -> candle_core::Result<Self> {
        let c_se = c_out / se_reduction;
        Ok(Block {
            conv: conv(vb, conv_name, 3, c_in, c_out, stride, Some(bn_name))?,
            stride,
            residual_bn: match residual_bn {
                Some(n) => {
                    let (scale, shift) = keras_scale_shift(vb.pp(n), c_out)?;
                    Some(ChannelAffine::new(&scale, &shift)?)
                }
                None => None,
            },
            se_reduce: conv(vb, &conv2d_name(se_first), 1, c_out, c_se, 1, None)?,
            se_expand: conv(vb, &conv2d_name(se_first + 1), 1, c_se, c_out, 1, None)?,
            project: conv(vb, &conv2d_name(se_first + 2), 1, c_out, c_out, 1, None)?,
        })
    }
}

impl Module for Block {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (_, _, h, w) = xs.dims4()?;
        let (pt, pb) = same_padding(h, 3, self.stride);
        let (pl, pr) = same_padding(w, 3, self.stride);
        let padded = xs.pad_with_zeros(2, pt, pb)?.pad_with_zeros(3, pl, pr)?;
        let mut ys = padded.apply(&self.conv)?.silu()?; // conv + folded BN + swish
        if let Some(bn) = &self.residual_bn {
            ys = bn.forward(&(xs + ys)?)?.silu()?;
        }
        let gate = ys
            .mean_keepdim(D::Minus1)?
            .mean_keepdim(D::Minus2)? // (b, c, 1, 1)
            .apply(&self.se_reduce)?
            .silu()?
            .apply(&self.se_expand)?;
        let gate = candle_nn::ops::sigmoid(&gate)?;
        ys.broadcast_mul(&gate)?.apply(&self.project)?.silu()
    }
}

/// The lung U-Net. Input (b, 256, 256, 3) NHWC raw 0..255 RGB; output (b, 256, 256, 1) lung
/// probability, as in Keras.
pub struct LungUnet {
    config: Config,
    encoder: Vec<Block>,
    decoder: Vec<Block>,
    head: Conv2d,
}

impl LungUnet {
    /// Builds the network from a `VarBuilder` at the checkpoint's root.
    pub fn load(vb: VarBuilder, config: &Config) -> candle_core::Result<Self> {
        let mut se = 0;
        let mut encoder = Vec::new();
        let mut c_in = config.in_channels;
        for (i, (&c, &n)) in config
            .encoder_channels
            .iter()
            .zip(&config.encoder_ids)
            .enumerate()
        {
            let stride = if i == 0 { 2 } else { 1 };
            let residual = (i > 0 && c == c_in).then(|| format!("bn{n}_a"));
            encoder.push(Block::load(
                &vb,
                &format!("conv{n}"),
                &format!("bn{n}"),
                residual.as_deref(),
                se,
                c_in,
                c,
                stride,
                config.se_reduction,
            )?);
            se += 3;
            c_in = c;
        }
        let mut decoder = Vec::new();
        for (&c, &n) in config.decoder_channels.iter().zip(&config.decoder_ids) {
            decoder.push(Block::load(
                &vb,
                &format!("resize_conv{n}"),
                &format!("resize_bn{n}"),
                None,
                se,
                c_in,
                c,
                1,
                config.se_reduction,
            )?);
            se += 3;
            c_in = c;
        }
        let head = conv(
            &vb,
            &format!("resize_conv{}", config.head_id),
            3,
            c_in,
            1,
            1,
            Some(&format!("resize_bn{}", config.head_id)),
        )?;
        Ok(LungUnet {
            config: config.clone(),
            encoder,
            decoder,
            head,
        })
    }

    /// The shape it was built for.
    pub fn config(&self) -> &Config {
        &self.config
    }
}

impl Module for LungUnet {
    /// (b, s, s, 3) NHWC → (b, s, s, 1) probabilities.
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let xs = xs.permute((0, 3, 1, 2))?.contiguous()?; // (b, 3, 256, 256)
        let mut skips = Vec::with_capacity(self.encoder.len());
        let mut h = xs;
        for (i, block) in self.encoder.iter().enumerate() {
            if i > 0 {
                h = h.max_pool2d(2)?;
            }
            h = h.apply(block)?;
            skips.push(h.clone());
        }
        skips.pop(); // the bottleneck (b, 64, 4, 4) is `h` itself
        for block in &self.decoder {
            let (_, _, hh, ww) = h.dims4()?;
            h = h.upsample_nearest2d(hh * 2, ww * 2)?.apply(block)?;
            if let Some(skip) = skips.pop() {
                h = (h + skip)?;
            }
        }
        let padded = h.pad_with_zeros(2, 1, 1)?.pad_with_zeros(3, 1, 1)?;
        let out = candle_nn::ops::sigmoid(&padded.apply(&self.head)?)?; // (b, 1, 256, 256)
        out.permute((0, 2, 3, 1))?.contiguous()
    }
}

/// The backend the lung U-Net runs on by default. On the CPU: the native kernels where their
/// direct (AVX2/AVX-512) engine runs — 0.4x ONNX Runtime's time on this small-channel network
/// (`examples/xrv_profile.rs unet`); elsewhere ONNX Runtime when its graph is installed and the runtime loads (the native
/// im2col + gemm plan measured 2-3x slower than it), else the native kernels (still 4-8x
/// faster than candle's CPU convolutions). candle on GPUs.
pub fn auto_backend(installed: &InstalledModel, device: Device) -> Backend {
    if device.is_gpu() {
        return Backend::Candle;
    }
    if hilum_kernels::unet_direct_engine() {
        return Backend::Native;
    }
    #[cfg(feature = "onnx")]
    if installed.onnx.is_some() && crate::onnx::available() {
        return Backend::Onnx;
    }
    let _ = installed;
    Backend::Native
}

/// The lung U-Net in the table of architectures ([`crate::Architectures`]).
pub struct LungUnetArch;

impl crate::Architecture for LungUnetArch {
    fn name(&self) -> &'static str {
        "lung-unet"
    }

    fn backends(&self) -> &'static [Backend] {
        &Backend::ALL
    }

    /// ONNX Runtime needs the imported graph.
    fn supports(&self, backend: Backend, installed: &InstalledModel) -> bool {
        backend != Backend::Onnx || installed.onnx.is_some()
    }

    fn default_backend(&self, installed: &InstalledModel, device: Device) -> Backend {
        auto_backend(installed, device)
    }

    fn expected_params(
        &self,
        _: &Manifest,
        _: Option<&Path>,
    ) -> Result<Option<crate::architecture::Params>, ModelError> {
        Ok(Some(expected_params()))
    }

    /// Served from the published ONNX export, imported beside the weights.
    fn graph(&self) -> crate::architecture::Graph {
        crate::architecture::Graph::Imported
    }

    fn device_checks(&self) -> Vec<crate::architecture::DeviceCheck> {
        vec![crate::architecture::DeviceCheck {
            name: "lung-unet",
            run: crate::devcheck::lung_unet,
        }]
    }
}

/// The lung U-Net ready to run on one backend; the same input and output whichever runs it.
pub struct LungSegmenter {
    config: Config,
    net: LungNet,
}

type LungNet = crate::Engine<NativeUnet, LungUnet>;

impl LungSegmenter {
    /// The network from the weights in `vb` on `backend`: `Native` (CPU, `threads` workers)
    /// or `Candle` (the device of `vb`). ONNX Runtime needs the graph: [`LungSegmenter::onnx`].
    pub fn new(
        vb: VarBuilder,
        config: &Config,
        backend: Backend,
        threads: usize,
    ) -> Result<Self, ModelError> {
        let net = match backend {
            Backend::Native => {
                if !vb.device().is_cpu() {
                    return Err(ModelError::Device {
                        device: format!("{:?}", vb.device()),
                        reason: "the native backend runs on the CPU only: load the model on the \
                                 CPU or use the candle backend"
                            .into(),
                    });
                }
                let weights = native_weights(vb, config)?;
                LungNet::Native(
                    NativeUnet::new(&weights, config.input_size, threads)
                        .map_err(|e| ModelError::Compute(e.to_string()))?,
                )
            }
            Backend::Candle => {
                let device = vb.device().clone();
                LungNet::Candle(LungUnet::load(vb, config)?, device)
            }
            Backend::Onnx | Backend::Kserve => {
                return Err(ModelError::Backend {
                    what: "a lung U-Net built from safetensors".into(),
                    backend,
                    supported: "native, candle (ONNX Runtime loads the imported model.onnx; \
                                LungSegmenter::kserve connects to a server)"
                        .into(),
                })
            }
        };
        Ok(LungSegmenter {
            config: config.clone(),
            net,
        })
    }

    /// The imported ONNX graph `path` on ONNX Runtime's CPU provider, `threads` intra-op
    /// threads.
    #[cfg_attr(not(feature = "onnx"), allow(unused_variables))]
    pub fn onnx(path: &Path, config: &Config, threads: usize) -> Result<Self, ModelError> {
        #[cfg(feature = "onnx")]
        {
            Ok(LungSegmenter {
                config: config.clone(),
                net: LungNet::Onnx(crate::onnx::OnnxModel::load(path, threads)?),
            })
        }
        #[cfg(not(feature = "onnx"))]
        Err(ModelError::Onnx(
            "this hilum was built without the `onnx` feature; use the native backend".into(),
        ))
    }

    /// The network served as model `id` by the KServe v2 server of `settings`, with the graph's
    /// input and output names (NHWC (batch, s, s, 3) in, (batch, s, s, 1) out), checked at
    /// connection.
    pub fn kserve(
        id: &str,
        config: &Config,
        names: (&str, &str),
        settings: &crate::KserveSettings,
    ) -> Result<Self, ModelError> {
        use crate::kserve::{KserveModel, TensorSpec};
        let s = config.input_size as i64;
        let input = TensorSpec::new(names.0, &[-1, s, s, 3]);
        let output = TensorSpec::new(names.1, &[-1, s, s, 1]);
        Ok(LungSegmenter {
            config: config.clone(),
            net: LungNet::Kserve(KserveModel::connect(settings, id, input, output)?),
        })
    }

    /// The shape of the loaded network.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The backend it runs on.
    pub fn backend(&self) -> Backend {
        self.net.backend()
    }

    /// Lung probability maps at the model's resolution for a batch of preprocessed inputs
    /// (each `s*s*3` values, NHWC, from [`preprocess_rgb`] / [`preprocess_gray`]).
    pub fn predict(&self, inputs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, ModelError> {
        crate::fault::check()?;
        let s = self.config.input_size;
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let mut flat = Vec::with_capacity(inputs.len() * s * s * 3);
        for x in inputs {
            if x.len() != s * s * 3 {
                return Err(ModelError::Compute(format!(
                    "input has {} values, expected {s}x{s}x3",
                    x.len()
                )));
            }
            flat.extend_from_slice(x);
        }
        let ys = match &self.net {
            LungNet::Native(n) => n
                .forward(&flat, inputs.len())
                .map_err(|e| ModelError::Compute(e.to_string()))?,
            LungNet::Candle(m, device) => {
                let xs = Tensor::from_vec(flat, (inputs.len(), s, s, 3), device)?;
                m.forward(&xs)?
                    .to_dtype(DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?
            }
            graph => graph.run_graph(&[inputs.len(), s, s, 3], &flat)?.1,
        };
        if ys.len() != inputs.len() * s * s {
            return Err(ModelError::Compute(format!(
                "the {} backend returned {} values for {} images of {s}x{s}",
                self.backend(),
                ys.len(),
                inputs.len()
            )));
        }
        Ok(ys.chunks(s * s).map(<[f32]>::to_vec).collect())
    }
}

impl crate::Model for LungSegmenter {
    /// Native and candle from the installed safetensors, ONNX Runtime from the imported
    /// `model.onnx`.
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: Backend,
        settings: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        let mut config = Config::lung_seg_valiou_088();
        if let Some(s) = manifest
            .config
            .get("input_size")
            .and_then(|v| v.as_integer())
        {
            config.input_size = s.max(1) as usize;
        }
        let threads = settings.cpu.threads();
        if backend == Backend::Kserve {
            // The served graph is the installed model.onnx: its tensor names, when it is here.
            let io = match &installed.onnx {
                Some(path) => {
                    let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
                    let io = crate::onnx_graph::graph_io(&bytes).map_err(|reason| {
                        ModelError::Corrupt {
                            id: manifest.id.clone(),
                            reason: format!("{}: {reason}", path.display()),
                        }
                    })?;
                    io.inputs
                        .first()
                        .zip(io.outputs.first())
                        .map(|(i, o)| (i.name.clone(), o.name.clone()))
                }
                None => None,
            };
            let (input, output) =
                io.unwrap_or_else(|| (ONNX_INPUT.to_string(), ONNX_OUTPUT.to_string()));
            let remote = crate::kserve::configured(settings)?;
            return Self::kserve(&manifest.id, &config, (&input, &output), remote);
        }
        if backend == Backend::Onnx {
            let path = installed.onnx.as_ref().ok_or_else(|| {
                ModelError::Onnx(format!(
                    "no ONNX graph installed for `{}`: run `hilum models import {} {}`",
                    manifest.id,
                    manifest.id,
                    manifest.source.onnx_file.as_deref().unwrap_or("MODEL.onnx")
                ))
            })?;
            return Self::onnx(path, &config, threads);
        }
        let vb = crate::weights::var_builder(&installed.weights, device)?;
        Self::new(vb, &config, backend, threads).map_err(|e| match e {
            ModelError::Compute(reason) => ModelError::Corrupt {
                id: manifest.id.clone(),
                reason,
            },
            other => other,
        })
    }
}

/// Every parameter of [`Config::lung_seg_valiou_088`] with its Keras shape.
pub fn expected_params() -> BTreeMap<String, Vec<usize>> {
    let cfg = Config::lung_seg_valiou_088();
    let mut out = BTreeMap::new();
    let add_conv = |out: &mut BTreeMap<String, Vec<usize>>, name: &str, k, i, o| {
        out.insert(format!("{name}.kernel"), vec![k, k, i, o]);
        out.insert(format!("{name}.bias"), vec![o]);
    };
    let add_bn = |out: &mut BTreeMap<String, Vec<usize>>, name: &str, c| {
        for p in ["gamma", "beta", "moving_mean", "moving_variance"] {
            out.insert(format!("{name}.{p}"), vec![c]);
        }
    };
    let mut se = 0;
    let mut c_in = cfg.in_channels;
    let mut stages: Vec<(String, String, Option<String>, usize)> = Vec::new();
    for (i, (&c, &n)) in cfg
        .encoder_channels
        .iter()
        .zip(&cfg.encoder_ids)
        .enumerate()
    {
        let res = (i > 0 && c == c_in).then(|| format!("bn{n}_a"));
        stages.push((format!("conv{n}"), format!("bn{n}"), res, c));
        c_in = c;
    }
    for (&c, &n) in cfg.decoder_channels.iter().zip(&cfg.decoder_ids) {
        stages.push((format!("resize_conv{n}"), format!("resize_bn{n}"), None, c));
    }
    let mut c_in = cfg.in_channels;
    for (conv_name, bn_name, res, c) in stages {
        add_conv(&mut out, &conv_name, 3, c_in, c);
        add_bn(&mut out, &bn_name, c);
        if let Some(r) = res {
            add_bn(&mut out, &r, c);
        }
        let c_se = c / cfg.se_reduction;
        add_conv(&mut out, &conv2d_name(se), 1, c, c_se);
        add_conv(&mut out, &conv2d_name(se + 1), 1, c_se, c);
        add_conv(&mut out, &conv2d_name(se + 2), 1, c, c);
        se += 3;
        c_in = c;
    }
    add_conv(&mut out, &format!("resize_conv{}", cfg.head_id), 3, c_in, 1);
    add_bn(&mut out, &format!("resize_bn{}", cfg.head_id), 1);
    out
}

/// PIL-style separable resize with a triangle (bilinear) filter whose support grows with the
/// downscale factor (antialiasing), on interleaved `channels`-channel f32 pixels.
pub fn resize_bilinear(
    src: &[f32],
    width: usize,
    height: usize,
    channels: usize,
    new_width: usize,
    new_height: usize,
) -> Vec<f32> {
    let horizontal = resample_axis(src, width, height, channels, new_width, true);
    resample_axis(&horizontal, new_width, height, channels, new_height, false)
}

/// Weights of each output sample along one axis: (first input index, weights).
fn axis_weights(in_size: usize, out_size: usize) -> Vec<(usize, Vec<f32>)> {
    let scale = in_size as f64 / out_size as f64;
    let support = scale.max(1.0); // triangle radius in input pixels
    (0..out_size)
        .map(|o| {
            let center = (o as f64 + 0.5) * scale;
            let lo = ((center - support).floor().max(0.0)) as usize;
            let hi = ((center + support).ceil() as usize).min(in_size);
            let mut w: Vec<f64> = (lo..hi)
                .map(|i| {
                    let d = ((i as f64 + 0.5 - center) / support).abs();
                    (1.0 - d).max(0.0)
                })
                .collect();
            let sum: f64 = w.iter().sum();
            if sum > 0.0 {
                w.iter_mut().for_each(|v| *v /= sum);
            }
            (lo, w.into_iter().map(|v| v as f32).collect())
        })
        .collect()
}

fn resample_axis(
    src: &[f32],
    width: usize,
    height: usize,
    channels: usize,
    new_len: usize,
    horizontal: bool,
) -> Vec<f32> {
    let (in_len, other) = if horizontal {
        (width, height)
    } else {
        (height, width)
    };
    let weights = axis_weights(in_len, new_len);
    let (out_w, out_h) = if horizontal {
        (new_len, height)
    } else {
        (width, new_len)
    };
    let mut out = vec![0f32; out_w * out_h * channels];
    for o in 0..other {
        for (n, (lo, ws)) in weights.iter().enumerate() {
            for c in 0..channels {
                let mut acc = 0f32;
                for (k, w) in ws.iter().enumerate() {
                    let i = lo + k;
                    let idx = if horizontal {
                        (o * width + i) * channels + c
                    } else {
                        (i * width + o) * channels + c
                    };
                    acc += w * src[idx];
                }
                let oidx = if horizontal {
                    (o * out_w + n) * channels + c
                } else {
                    (n * out_w + o) * channels + c
                };
                out[oidx] = acc;
            }
        }
    }
    out
}

/// Model input from an interleaved 8-bit-range RGB image: each channel resized to `size`² as
/// Pillow resizes an 8-bit picture (the reference feeds Keras from PIL); nothing when the image
/// does not hold `width * height` pixels.
pub fn preprocess_rgb(rgb: &[f32], width: usize, height: usize, size: usize) -> Vec<f32> {
    let n = width * height;
    if rgb.len() < n * 3 {
        return Vec::new();
    }
    let planes: Vec<Vec<f32>> = (0..3)
        .map(|c| {
            let plane: Vec<f32> = rgb.chunks_exact(3).take(n).map(|p| p[c]).collect();
            hilum_imaging::resize(
                &plane,
                width,
                height,
                size,
                size,
                Filter::PilBilinearFixedU8,
            )
        })
        .collect();
    (0..size * size)
        .flat_map(|i| planes.iter().map(move |p| p[i]))
        .collect()
}

/// Model input from one luminance channel scaled to 0..255 (grey replicated to RGB): the
/// [`recipe`] on values outside an image store; nothing when the plane is not
/// `width * height` values.
pub fn preprocess_gray(gray: &[f32], width: usize, height: usize, size: usize) -> Vec<f32> {
    recipe_values(&recipe(size), gray, width, height, 255.0)
}

/// The U-Net's input: stretched to `size`², resized exactly as Pillow resizes an 8-bit image
/// (fixed-point bilinear), 0..=255, grey in all three channels, interleaved (NHWC, as Keras
/// takes it).
pub fn recipe(size: usize) -> Preprocess {
    Preprocess::stretch(size as u32, size as u32)
        .filter(Filter::PilBilinearFixedU8)
        .norm(Norm::Byte)
        .channels(3)
        .layout(Layout::Hwc)
}

impl Runner for LungSegmenter {
    /// The lung probability at the input's size (`size * size`, row-major).
    type Output = Vec<f32>;

    fn recipe(&self) -> Preprocess {
        recipe(self.config.input_size)
    }

    fn run(&self, input: &Prepared) -> Result<Vec<f32>, ModelError> {
        check_input(&Runner::recipe(self), input)?;
        let mut out = self.predict(std::slice::from_ref(&input.data))?;
        out.pop()
            .ok_or_else(|| ModelError::Compute("no output".into()))
    }
}

/// The probability map upsampled (bilinear) to the original size and thresholded.
pub fn mask_at(
    prob: &[f32],
    size: usize,
    width: usize,
    height: usize,
    threshold: f32,
) -> Vec<bool> {
    resize_bilinear(prob, size, size, 1, width, height)
        .into_iter()
        .map(|p| p > threshold)
        .collect()
}

/// [`LungUnet`]'s weights for the native engine (Keras layer names at the root of `vb`).
pub fn native_weights(
    vb: VarBuilder,
    cfg: &Config,
) -> candle_core::Result<hilum_kernels::unet::UnetWeights> {
    let mut se = 0;
    let mut c_in = cfg.in_channels;
    let mut block = |conv_name: String,
                     bn_name: String,
                     residual: Option<String>,
                     c_in: usize,
                     c: usize,
                     stride: usize|
     -> candle_core::Result<hilum_kernels::unet::UnetBlock> {
        let c_se = c / cfg.se_reduction;
        let b = hilum_kernels::unet::UnetBlock {
            conv: keras_conv(&vb, &conv_name, 3, c_in, c)?,
            bn: keras_bn(&vb, &bn_name, c, BN_EPS)?,
            stride,
            residual_bn: residual.map(|n| keras_bn(&vb, &n, c, BN_EPS)).transpose()?,
            se_reduce: keras_conv(&vb, &conv2d_name(se), 1, c, c_se)?,
            se_expand: keras_conv(&vb, &conv2d_name(se + 1), 1, c_se, c)?,
            project: keras_conv(&vb, &conv2d_name(se + 2), 1, c, c)?,
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
    Ok(hilum_kernels::unet::UnetWeights {
        encoder,
        decoder,
        head: keras_conv(&vb, &format!("resize_conv{}", cfg.head_id), 3, c_in, 1)?,
        head_bn: keras_bn(&vb, &format!("resize_bn{}", cfg.head_id), 1, BN_EPS)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::weights::recorded_params;

    /// The native reader asks for exactly the parameters (names and shapes) the candle model does.
    #[test]
    fn native_reader_asks_for_the_candle_models_parameters() {
        let cfg = Config::lung_seg_valiou_088();
        let names = recorded_params(|vb| native_weights(vb, &cfg)).expect("native");
        assert_eq!(names, expected_params());
        assert_eq!(
            names,
            recorded_params(|vb| LungUnet::load(vb, &cfg)).expect("candle"),
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
        for (name, shape) in expected_params() {
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
        let cfg = Config {
            input_size: 64,
            ..Config::lung_seg_valiou_088()
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
            LungSegmenter::new(vb.clone(), &cfg, backend, 2)
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

    #[test]
    fn expected_params_count_matches_published_174k() {
        let p = expected_params();
        let n: usize = p.values().map(|s| s.iter().product::<usize>()).sum();
        // The checkpoint has 174k parameters (including BN statistics).
        assert!((170_000..180_000).contains(&n), "{n}");
        assert_eq!(p["conv1.kernel"], vec![3, 3, 3, 16]);
        assert_eq!(p["conv2d_35.kernel"], vec![1, 1, 8, 8]);
        assert!(p.contains_key("bn7_a.moving_variance"));
        assert!(!p.contains_key("bn4_a.gamma"));
    }

    #[test]
    fn resize_keeps_constants_and_averages_on_downscale() {
        let flat = vec![7.0f32; 10 * 6];
        assert!(resize_bilinear(&flat, 10, 6, 1, 4, 3)
            .iter()
            .all(|v| (v - 7.0).abs() < 1e-5));
        // 2x downscale of a 0/1 column stripe pattern averages to 0.5 everywhere inside.
        let stripes: Vec<f32> = (0..8 * 8).map(|i| (i % 2) as f32).collect();
        let half = resize_bilinear(&stripes, 8, 8, 1, 4, 4);
        let inner = half.chunks(4).flat_map(|row| row[1..3].to_vec());
        assert!(inner.clone().all(|v| (v - 0.5).abs() < 1e-5), "{half:?}");
    }
}
