//! ChestX-Det anatomy PSPNet, as torchxrayvision ships it
//! (`baseline_models.chestx_det.PSPNet`, ptsemseg's `pspnet` with 14 classes): a dilated
//! ResNet-101 style encoder, pyramid pooling (6, 3, 2, 1) and a 1x1 classifier, upsampled to
//! the input. Parameter names match `pspnet_chestxray_best_model_4.pth` once `module.` is
//! stripped. The auxiliary head (`convbnrelu4_aux`, `aux_cls`) is training-only and not loaded.
//! [`AnatomySegmenter`] runs it on `hilum-kernels`' native engine (from weights read by
//! [`native_weights`]) or on candle. On candle every batch norm (each follows a convolution)
//! is folded into that convolution at load; the `BatchNorm`s keep the checkpoint's values for
//! the ONNX export and for [`PspNet::forward_unfolded`], the reference.

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{Module, Tensor};
use candle_nn::{BatchNorm, Conv2d, Conv2dConfig, VarBuilder};
use serde::{Deserialize, Serialize};

use hilum_imaging::{Filter, Norm, Prepared, Preprocess};
use hilum_kernels::pspnet as kw;
use hilum_kernels::NativePspNet;

use crate::bn_fold::fold_conv_bn;
use crate::native;
use crate::onnx_graph::{self, Dim, GraphBuilder};

/// Name of the ONNX graph's output: (batch, n_classes, size, size) probabilities.
pub const ONNX_OUTPUT: &str = "probabilities";

use crate::manifest::{InstalledModel, Manifest};
use crate::runner::{check_input, recipe_values, Runner};
use crate::{Backend, Device, ModelError};

/// ptsemseg's BatchNorm2d epsilon (PyTorch's default).
pub(crate) const BN_EPS: f64 = 1e-5;

/// (stride, dilation) of `res_block2..5`: output stride 8, then dilation 2 and 4.
pub(crate) const STAGE_STRIDE_DILATION: [(usize, usize); 4] = [(1, 1), (2, 1), (1, 2), (1, 4)];

/// The 14 ChestX-Det structures, in output-channel order.
pub const TARGETS: [&str; 14] = [
    "Left Clavicle",
    "Right Clavicle",
    "Left Scapula",
    "Right Scapula",
    "Left Lung",
    "Right Lung",
    "Left Hilus Pulmonis",
    "Right Hilus Pulmonis",
    "Heart",
    "Aorta",
    "Facies Diaphragmatica",
    "Mediastinum",
    "Weasand",
    "Spine",
];

/// The shape of the anatomy PSPNet.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Output classes (anatomical structures), one mask each.
    pub n_classes: usize,
    /// Output channels of `convbnrelu1_1`, `_2`, `_3`.
    pub stem: [usize; 3],
    /// (mid, out) channels of `res_block2..5`.
    pub stages: [[usize; 2]; 4],
    /// Bottlenecks per stage.
    pub block_config: [usize; 4],
    /// Grid sides of the pyramid pooling paths (6, 3, 2, 1).
    pub pool_sizes: Vec<usize>,
    /// Output channels of `cbr_final`, the 3x3 conv before the classifier.
    pub final_channels: usize,
    /// Side of the square network input.
    pub input_size: usize,
}

impl Config {
    /// The published ChestX-Det model (`pspnet(14)`, input 512 px).
    pub fn chestx_det() -> Self {
        Config {
            n_classes: TARGETS.len(),
            stem: [64, 64, 128],
            stages: [[64, 256], [128, 512], [256, 1024], [512, 2048]],
            block_config: [3, 4, 23, 3],
            pool_sizes: vec![6, 3, 2, 1],
            final_channels: 512,
            input_size: 512,
        }
    }

    /// The manifest's `[config]`: a whole configuration (every field, as in a small test
    /// network's), or [`Config::chestx_det`] with at most its `input_size` changed.
    pub fn from_manifest(manifest: &Manifest) -> Result<Self, ModelError> {
        let table = &manifest.config;
        if table.contains_key("stages") {
            return toml::Value::Table(table.clone()).try_into().map_err(|e| {
                ModelError::Manifest {
                    id: manifest.id.clone(),
                    reason: format!("[config]: {e}"),
                }
            });
        }
        let mut cfg = Config::chestx_det();
        if let Some(s) = table.get("input_size").and_then(|v| v.as_integer()) {
            cfg.input_size = s.max(64) as usize;
        }
        Ok(cfg)
    }
}

/// conv (no bias) + batch norm, optionally ReLU: ptsemseg's `conv2DBatchNorm[Relu]`.
#[derive(Clone, Debug)]
struct ConvBn {
    /// Checkpoint prefix (`cbr_final.cbr_unit`), for the ONNX graph's initializer names.
    name: String,
    conv: Conv2d,
    bn: BatchNorm,
    relu: bool,
    /// `conv` with `bn` folded in: what the forward runs.
    folded: Conv2d,
}

impl ConvBn {
    #[allow(clippy::too_many_arguments)]
    fn load(
        vb: VarBuilder,
        unit: &str,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        padding: usize,
        dilation: usize,
        relu: bool,
    ) -> candle_core::Result<Self> {
        let cfg = Conv2dConfig {
            padding,
            stride,
            dilation,
            ..Default::default()
        };
        let vb = vb.pp(unit);
        let conv = candle_nn::conv2d_no_bias(cin, cout, k, cfg, vb.pp("0"))?;
        let bn = candle_nn::batch_norm(cout, BN_EPS, vb.pp("1"))?;
        Ok(ConvBn {
            name: vb.prefix(),
            folded: fold_conv_bn(&conv, &bn)?,
            conv,
            bn,
            relu,
        })
    }

    fn cbr(
        vb: VarBuilder,
        cin: usize,
        cout: usize,
        k: usize,
        s: usize,
        p: usize,
        d: usize,
    ) -> candle_core::Result<Self> {
        Self::load(vb, "cbr_unit", cin, cout, k, s, p, d, true)
    }

    fn cb(vb: VarBuilder, cin: usize, cout: usize, s: usize) -> candle_core::Result<Self> {
        Self::load(vb, "cb_unit", cin, cout, 1, s, 0, 1, false)
    }
}

impl ConvBn {
    fn to_onnx(&self, g: &mut GraphBuilder, x: &str) -> candle_core::Result<String> {
        let y = g.conv2d(&format!("{}.0", self.name), &self.conv, x)?;
        let y = g.batch_norm(&format!("{}.1", self.name), &self.bn, &y)?;
        Ok(if self.relu { g.relu(&y) } else { y })
    }
}

impl ConvBn {
    /// Folded (the forward) or through candle_nn's BatchNorm (the reference).
    fn forward_with(&self, xs: &Tensor, folded: bool) -> candle_core::Result<Tensor> {
        let ys = if folded {
            xs.apply(&self.folded)?
        } else {
            xs.apply(&self.conv)?.apply_t(&self.bn, false)?
        };
        if self.relu {
            ys.relu()
        } else {
            Ok(ys)
        }
    }
}

/// `bottleNeckPSP` (with the projection `cb4`) or `bottleNeckIdentifyPSP` (without).
#[derive(Clone, Debug)]
struct Bottleneck {
    cbr1: ConvBn,
    cbr2: ConvBn,
    cb3: ConvBn,
    cb4: Option<ConvBn>,
}

impl Bottleneck {
    fn load(
        vb: VarBuilder,
        cin: usize,
        mid: usize,
        cout: usize,
        stride: usize,
        dilation: usize,
        project: bool,
    ) -> candle_core::Result<Self> {
        // ptsemseg drops the stride when the stage is dilated.
        let stride = if dilation > 1 { 1 } else { stride };
        let s2 = if project { stride } else { 1 };
        Ok(Bottleneck {
            cbr1: ConvBn::cbr(vb.pp("cbr1"), cin, mid, 1, 1, 0, 1)?,
            cbr2: ConvBn::cbr(vb.pp("cbr2"), mid, mid, 3, s2, dilation, dilation)?,
            cb3: ConvBn::cb(vb.pp("cb3"), mid, cout, 1)?,
            cb4: if project {
                Some(ConvBn::cb(vb.pp("cb4"), cin, cout, stride)?)
            } else {
                None
            },
        })
    }
}

impl Bottleneck {
    fn forward_with(&self, xs: &Tensor, folded: bool) -> candle_core::Result<Tensor> {
        let conv = self.cbr1.forward_with(xs, folded)?;
        let conv = self.cbr2.forward_with(&conv, folded)?;
        let conv = self.cb3.forward_with(&conv, folded)?;
        let residual = match &self.cb4 {
            Some(cb4) => cb4.forward_with(xs, folded)?,
            None => xs.clone(),
        };
        (conv + residual)?.relu()
    }
}

/// The PSPNet: logits `(b, n_classes, h, w)` for a normalised input `(b, 3, h, w)`.
#[derive(Clone, Debug)]
pub struct PspNet {
    config: Config,
    stem: [ConvBn; 3],
    blocks: Vec<Bottleneck>,
    pyramid: Vec<ConvBn>,
    cbr_final: ConvBn,
    classification: Conv2d,
}

impl PspNet {
    /// Builds the network from a `VarBuilder` at the checkpoint's root (`module.` stripped).
    pub fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        let [s1, s2, s3] = cfg.stem;
        let stem = [
            ConvBn::cbr(vb.pp("convbnrelu1_1"), 3, s1, 3, 2, 1, 1)?,
            ConvBn::cbr(vb.pp("convbnrelu1_2"), s1, s2, 3, 1, 1, 1)?,
            ConvBn::cbr(vb.pp("convbnrelu1_3"), s2, s3, 3, 1, 1, 1)?,
        ];
        let mut blocks = Vec::new();
        let mut cin = s3;
        for (i, ((&[mid, cout], &n), (stride, dil))) in cfg
            .stages
            .iter()
            .zip(&cfg.block_config)
            .zip(STAGE_STRIDE_DILATION)
            .enumerate()
        {
            let vb = vb.pp(format!("res_block{}", i + 2)).pp("layers");
            for j in 0..n {
                let (c, project) = if j == 0 { (cin, true) } else { (cout, false) };
                blocks.push(Bottleneck::load(
                    vb.pp(j),
                    c,
                    mid,
                    cout,
                    stride,
                    dil,
                    project,
                )?);
            }
            cin = cout;
        }
        let paths = cfg.pool_sizes.len().max(1);
        let pyramid = (0..cfg.pool_sizes.len())
            .map(|i| {
                let vb = vb.pp("pyramid_pooling").pp("path_module_list").pp(i);
                ConvBn::cbr(vb, cin, cin / paths, 1, 1, 0, 1)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let cat = cin + (cin / paths) * cfg.pool_sizes.len();
        let cbr_final = ConvBn::cbr(vb.pp("cbr_final"), cat, cfg.final_channels, 3, 1, 1, 1)?;
        let classification = candle_nn::conv2d(
            cfg.final_channels,
            cfg.n_classes,
            1,
            Default::default(),
            vb.pp("classification"),
        )?;
        Ok(PspNet {
            config: cfg.clone(),
            stem,
            blocks,
            pyramid,
            cbr_final,
            classification,
        })
    }

    /// The shape it was built for.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The same forward pass, then the sigmoid, as an ONNX graph with these weights: input
    /// [`onnx_graph::INPUT`] (batch, 3, size, size) as [`recipe`] prepares it, output
    /// [`ONNX_OUTPUT`] (batch, n_classes, size, size), the probabilities of
    /// [`AnatomySegmenter::probabilities`]. `size` is fixed: the pyramid's pooling kernels and
    /// resize targets are computed from it, as ptsemseg does from the feature map at run time.
    pub fn to_onnx(&self, size: usize) -> candle_core::Result<Vec<u8>> {
        let mut g = GraphBuilder::new("pspnet");
        let mut x = onnx_graph::INPUT.to_string();
        for s in &self.stem {
            x = s.to_onnx(&mut g, &x)?;
        }
        x = g.max_pool(&x, 3, 2, 1);
        for b in &self.blocks {
            let y = b.cbr1.to_onnx(&mut g, &x)?;
            let y = b.cbr2.to_onnx(&mut g, &y)?;
            let y = b.cb3.to_onnx(&mut g, &y)?;
            let residual = match &b.cb4 {
                Some(cb4) => cb4.to_onnx(&mut g, &x)?,
                None => x.clone(),
            };
            let sum = g.add(&y, &residual);
            x = g.relu(&sum);
        }
        // The feature map's side, as the convolutions and the max pool shape it.
        let mut f = size;
        for s in &self.stem {
            f = conv_out(f, &s.conv);
        }
        f = (f + 2 - 3) / 2 + 1;
        for b in &self.blocks {
            f = conv_out(
                conv_out(conv_out(f, &b.cbr1.conv), &b.cbr2.conv),
                &b.cb3.conv,
            );
        }
        let mut slices = vec![x.clone()];
        for (path, &p) in self.pyramid.iter().zip(&self.config.pool_sizes) {
            // ptsemseg: kernel = stride = floor(size / pool_size), no padding.
            let pooled = g.avg_pool(&x, (f / p.max(1)).max(1));
            let y = path.to_onnx(&mut g, &pooled)?;
            // ptsemseg's F.upsample(mode="bilinear"): align_corners False.
            slices.push(g.resize_bilinear(&y, f, f, false));
        }
        let refs: Vec<&str> = slices.iter().map(String::as_str).collect();
        let cat = g.concat(&refs, 1);
        let y = self.cbr_final.to_onnx(&mut g, &cat)?;
        let y = g.conv2d("classification", &self.classification, &y)?;
        let y = g.resize_bilinear(&y, size, size, false);
        let probs = g.sigmoid(&y);
        let batch = Dim::Named("batch");
        let side = Dim::Fixed(size);
        Ok(g.finish(
            (onnx_graph::INPUT, &[batch, Dim::Fixed(3), side, side]),
            &probs,
            (
                ONNX_OUTPUT,
                &[batch, Dim::Fixed(self.config.n_classes), side, side],
            ),
            "ChestX-Det PSPNet (ptsemseg), per-structure probabilities; written by hilum",
        ))
    }
}

/// Output side of `conv` on a side of `i` pixels.
fn conv_out(i: usize, conv: &Conv2d) -> usize {
    let c = conv.config();
    let k = conv.weight().dims().last().copied().unwrap_or(1);
    (i + 2 * c.padding).saturating_sub(c.dilation * k.saturating_sub(1) + 1) / c.stride + 1
}

impl Module for PspNet {
    /// Logits `(b, n_classes, h, w)` for a normalised input `(b, 3, h, w)`, batch norms folded.
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(xs, true)
    }
}

impl PspNet {
    /// The logits through candle_nn's `BatchNorm` ops, nothing folded: the reference the
    /// folded forward ([`Module::forward`]) is tested against.
    pub fn forward_unfolded(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        self.forward_with(xs, false)
    }

    fn forward_with(&self, xs: &Tensor, folded: bool) -> candle_core::Result<Tensor> {
        let (_, _, h, w) = xs.dims4()?;
        let mut x = xs.clone();
        for s in &self.stem {
            x = s.forward_with(&x, folded)?;
        }
        // max_pool2d(3, 2, padding 1): zero padding is exact here because x >= 0 after ReLU.
        x = x.pad_with_zeros(2, 1, 1)?.pad_with_zeros(3, 1, 1)?;
        x = x.max_pool2d_with_stride(3, 2)?;
        for b in &self.blocks {
            x = b.forward_with(&x, folded)?;
        } // (b, 2048, h/8, w/8)
        let (_, _, fh, fw) = x.dims4()?;
        let mut slices = vec![x.clone()];
        for (path, &p) in self.pyramid.iter().zip(&self.config.pool_sizes) {
            // ptsemseg: kernel = stride = floor(size / pool_size), no padding.
            let k = ((fh / p).max(1), (fw / p).max(1));
            let pooled = path.forward_with(&x.avg_pool2d_with_stride(k, k)?, folded)?;
            slices.push(pooled.upsample_bilinear2d(fh, fw, false)?);
        }
        let cat = Tensor::cat(&slices, 1)?; // (b, 4096, h/8, w/8)
        self.cbr_final
            .forward_with(&cat, folded)?
            .apply(&self.classification)?
            .upsample_bilinear2d(h, w, false)
    }
}

/// The PSPNet in the table of architectures ([`crate::Architectures`]).
pub struct PspNetArch;

impl crate::Architecture for PspNetArch {
    fn name(&self) -> &'static str {
        "pspnet"
    }

    fn backends(&self) -> &'static [Backend] {
        &Backend::ALL
    }

    /// Native on the CPU, candle on GPUs.
    fn default_backend(&self, _: &InstalledModel, device: Device) -> Backend {
        Backend::default_for(device)
    }

    fn expected_params(
        &self,
        m: &Manifest,
        _: Option<&Path>,
    ) -> Result<Option<crate::architecture::Params>, ModelError> {
        expected_params(&Config::from_manifest(m)?).map(Some)
    }

    /// scripts/convert_pspnet.py: DataParallel's `module.` stripped, BN counters and the
    /// training-only auxiliary head dropped.
    fn pytorch_renames(&self) -> Option<crate::architecture::Renames> {
        Some(crate::architecture::Renames {
            unwrap: &[],
            rename: |k| {
                let name = crate::architecture::strip_module(k);
                let drop = name.ends_with("num_batches_tracked")
                    || name.starts_with("convbnrelu4_aux.")
                    || name.starts_with("aux_cls.");
                (!drop).then(|| name.to_string())
            },
            record_source: false,
        })
    }

    fn graph(&self) -> crate::architecture::Graph {
        crate::architecture::Graph::Built
    }

    fn onnx_graph(&self, m: &Manifest, vb: VarBuilder) -> Result<Vec<u8>, ModelError> {
        let cfg = Config::from_manifest(m)?;
        Ok(PspNet::load(vb, &cfg)?.to_onnx(cfg.input_size)?)
    }

    fn device_checks(&self) -> Vec<crate::architecture::DeviceCheck> {
        vec![crate::architecture::DeviceCheck {
            name: "pspnet",
            run: crate::devcheck::psp,
        }]
    }
}

/// The PSPNet ready to run on one backend: native kernels (the default on the CPU), candle,
/// ONNX Runtime (the graph of [`PspNet::to_onnx`]) or a KServe v2 server serving that graph.
pub struct AnatomySegmenter {
    config: Config,
    net: AnatomyNet,
}

type AnatomyNet = crate::Engine<Box<NativePspNet>, Box<PspNet>>;

impl AnatomySegmenter {
    /// The network from the weights in `vb` on `backend`: `Native` (CPU, `threads` workers),
    /// `Candle` (the device of `vb`) or `Onnx` (ONNX Runtime on the CPU, `threads` intra-op
    /// threads, the graph built from these weights). `Kserve`: [`AnatomySegmenter::kserve`].
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
                        reason: "the native backend runs on the CPU only: use the candle backend"
                            .into(),
                    });
                }
                let weights = native_weights(vb, config)?;
                AnatomyNet::Native(Box::new(
                    NativePspNet::new(&weights, config.input_size, threads)
                        .map_err(|e| ModelError::Compute(e.to_string()))?,
                ))
            }
            Backend::Candle => {
                let device = vb.device().clone();
                AnatomyNet::Candle(Box::new(PspNet::load(vb, config)?), device)
            }
            Backend::Onnx => {
                let graph = PspNet::load(vb, config)?.to_onnx(config.input_size)?;
                return Self::onnx_from_bytes(
                    &graph,
                    "chestx-det PSPNet (built graph)",
                    config,
                    threads,
                );
            }
            Backend::Kserve => {
                return Err(ModelError::Backend {
                    what: "the anatomy PSPNet built from weights".into(),
                    backend,
                    supported: "native, candle or onnx (AnatomySegmenter::kserve connects to a \
                                server)"
                        .into(),
                })
            }
        };
        Ok(AnatomySegmenter {
            config: config.clone(),
            net,
        })
    }

    /// The network on ONNX Runtime (CPU) from a serialised graph with [`PspNet::to_onnx`]'s
    /// input and output; `what` names it in errors.
    pub fn onnx_from_bytes(
        graph: &[u8],
        what: &str,
        config: &Config,
        threads: usize,
    ) -> Result<Self, ModelError> {
        Ok(AnatomySegmenter {
            config: config.clone(),
            net: AnatomyNet::onnx(graph, what, threads, Device::Cpu)?,
        })
    }

    /// The network served as model `id` by a KServe v2 server (the graph `hilum models
    /// export-triton` writes), checked at connection.
    pub fn kserve(
        id: &str,
        config: &Config,
        settings: &crate::KserveSettings,
    ) -> Result<Self, ModelError> {
        use crate::kserve::{KserveModel, TensorSpec};
        let s = config.input_size as i64;
        let input = TensorSpec::new(onnx_graph::INPUT, &[-1, 3, s, s]);
        let output = TensorSpec::new(ONNX_OUTPUT, &[-1, config.n_classes as i64, s, s]);
        Ok(AnatomySegmenter {
            config: config.clone(),
            net: AnatomyNet::Kserve(KserveModel::connect(settings, id, input, output)?),
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

    /// The native engine, when this runs on it (for benchmarks and batch use).
    pub fn native(&self) -> Option<&NativePspNet> {
        match &self.net {
            AnatomyNet::Native(n) => Some(n),
            _ => None,
        }
    }

    /// Per-structure probabilities (sigmoid of the logits) for one prepared image
    /// (`3 * input_size²` values from [`preprocess`]); returns `n_classes` maps of `input_size²`.
    pub fn probabilities(&self, input: &[f32]) -> Result<Vec<Vec<f32>>, ModelError> {
        crate::fault::check()?;
        let s = self.config.input_size;
        if input.len() != 3 * s * s {
            return Err(ModelError::Compute(format!(
                "input has {} values, expected 3x{s}x{s}",
                input.len()
            )));
        }
        match &self.net {
            AnatomyNet::Native(n) => {
                let nhwc = n
                    .forward_nhwc(input, 1)
                    .map_err(|e| ModelError::Compute(e.to_string()))?;
                let c = self.config.n_classes;
                let mut maps = vec![Vec::with_capacity(s * s); c];
                for px in nhwc.chunks_exact(c) {
                    for (m, &v) in maps.iter_mut().zip(px) {
                        m.push(hilum_kernels::sigmoid(v));
                    }
                }
                Ok(maps)
            }
            AnatomyNet::Candle(m, device) => {
                let x = Tensor::from_slice(input, (1, 3, s, s), device)?;
                let y = candle_nn::ops::sigmoid(&m.forward(&x)?)?.squeeze(0)?;
                Ok(y.to_vec3::<f32>()?
                    .into_iter()
                    .map(|m| m.concat())
                    .collect())
            }
            graph => split_maps(graph.run_graph(&[1, 3, s, s], input)?.1, &self.config),
        }
    }
}

/// One image's (n_classes, s, s) probabilities from a graph, checked, as per-class maps.
fn split_maps(values: Vec<f32>, cfg: &Config) -> Result<Vec<Vec<f32>>, ModelError> {
    let hw = cfg.input_size * cfg.input_size;
    if values.len() != cfg.n_classes * hw {
        return Err(ModelError::Compute(format!(
            "the graph returned {} values, expected {}x{s}x{s}",
            values.len(),
            cfg.n_classes,
            s = cfg.input_size
        )));
    }
    Ok(values.chunks(hw).map(<[f32]>::to_vec).collect())
}

/// torchxrayvision's PSPNet input for a whole image ([`recipe`]: values to the xrv range,
/// resized to `size` x `size` by its `XRayResizer` (skimage's resize: Gaussian anti-aliasing,
/// linear interpolation, mid-grey padding; the image is stretched, not cropped, so masks map back
/// onto the whole image), `(x + 1024) / 2048`, repeated to 3 channels with ImageNet
/// normalisation), for values outside an image store; nothing when the plane is not
/// `width * height` values.
pub fn preprocess(
    gray: &[f32],
    width: usize,
    height: usize,
    max_value: f32,
    size: usize,
) -> Vec<f32> {
    recipe_values(&recipe(size), gray, width, height, max_value)
}

/// The PSPNet's input recipe at `size` px (see [`preprocess`]).
pub fn recipe(size: usize) -> Preprocess {
    Preprocess::stretch(size as u32, size as u32)
        .filter(Filter::SkimageLinear)
        .norm(Norm::XrvImageNet)
        .channels(3)
}

impl Runner for AnatomySegmenter {
    /// `n_classes` probability maps at the input's size.
    type Output = Vec<Vec<f32>>;

    fn recipe(&self) -> Preprocess {
        recipe(self.config().input_size)
    }

    fn run(&self, input: &Prepared) -> Result<Vec<Vec<f32>>, ModelError> {
        check_input(&Runner::recipe(self), input)?;
        self.probabilities(&input.data)
    }
}

/// Every parameter the published checkpoint holds for `cfg` (minus the training-only head and
/// `num_batches_tracked`), as the loader asks for them.
pub fn expected_params(cfg: &Config) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    crate::weights::recorded_params(|vb| PspNet::load(vb, cfg))
}

/// Loads a safetensors file with [`Config::chestx_det`] (or `cfg`) on `backend`.
pub fn load_file(
    path: &Path,
    cfg: &Config,
    device: Device,
    backend: Backend,
    threads: usize,
) -> Result<AnatomySegmenter, ModelError> {
    let vb = crate::weights::var_builder(path, device)?;
    AnatomySegmenter::new(vb, cfg, backend, threads).map_err(|e| corrupt("chestx-det-pspnet", e))
}

/// A computation error while reading weights means the weights are unusable.
fn corrupt(id: &str, e: ModelError) -> ModelError {
    match e {
        ModelError::Compute(reason) => ModelError::Corrupt {
            id: id.to_string(),
            reason,
        },
        other => other,
    }
}

impl crate::Model for AnatomySegmenter {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: Backend,
        settings: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        let cfg = Config::from_manifest(manifest)?;
        if backend == Backend::Kserve {
            let remote = crate::kserve::configured(settings)?;
            return AnatomySegmenter::kserve(&manifest.id, &cfg, remote);
        }
        let vb = crate::weights::var_builder(&installed.weights, device)?;
        AnatomySegmenter::new(vb, &cfg, backend, settings.cpu.threads())
            .map_err(|e| corrupt(&manifest.id, e))
    }
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
) -> candle_core::Result<kw::ConvBn> {
    let vb = vb.pp(unit);
    Ok(kw::ConvBn {
        conv: native::conv(&vb.pp("0"), cin, cout, k, false)?,
        bn: native::batch_norm(&vb.pp("1"), cout, BN_EPS)?,
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
) -> candle_core::Result<kw::ConvBn> {
    conv_bn(vb, "cbr_unit", cin, cout, k, spd, true)
}

/// `conv2DBatchNorm`, 1x1.
fn cb(vb: &VarBuilder, cin: usize, cout: usize, stride: usize) -> candle_core::Result<kw::ConvBn> {
    conv_bn(vb, "cb_unit", cin, cout, 1, (stride, 0, 1), false)
}

/// [`PspNet`]'s weights for the native engine (the state dict without `module.`).
pub fn native_weights(vb: VarBuilder, cfg: &Config) -> candle_core::Result<kw::PspNetWeights> {
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
        .zip(STAGE_STRIDE_DILATION)
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
            blocks.push(kw::Bottleneck {
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
        .collect::<candle_core::Result<Vec<_>>>()?;
    let cat = cin + (cin / paths) * cfg.pool_sizes.len();
    Ok(kw::PspNetWeights {
        stem,
        blocks,
        pool_sizes: cfg.pool_sizes.clone(),
        pyramid,
        cbr_final: cbr(&vb.pp("cbr_final"), cat, cfg.final_channels, 3, (1, 1, 1))?,
        classification: native::conv(
            &vb.pp("classification"),
            cfg.final_channels,
            cfg.n_classes,
            1,
            true,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::recorded_params;

    /// The native reader asks for exactly the parameters (names and shapes) the candle model does.
    #[test]
    fn native_reader_asks_for_the_candle_models_parameters() {
        let cfg = Config::chestx_det();
        assert_eq!(
            recorded_params(|vb| native_weights(vb, &cfg)).expect("native"),
            expected_params(&cfg).expect("candle"),
        );
    }
}
