//! torchxrayvision (Cohen et al., "TorchXRayVision: A library of chest X-ray datasets and
//! models", MIDL 2022; version 1.5.7) around the DenseNet and ResNet networks: its 18 labels,
//! its preprocessing (values scaled to [-1024, 1024], centre crop, resize), and its operating
//! point calibration `op_norm`, which rescales each sigmoid output so that the published
//! threshold maps to 0.5.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use crate::{densenet, resnet, Backend, Device, InstalledModel, Manifest, ModelError};
use hilum_imaging::{prepare_values, Prepared, Preprocess};

use crate::runner::{check_input, recipe_values, Runner};
use hilum_kernels::{CpuError, NativeDenseNet, NativeResNet};

/// `xrv.datasets.default_pathologies`: the 18 outputs of the `-all` models, in order.
pub const LABELS: [&str; 18] = [
    "Atelectasis",
    "Consolidation",
    "Infiltration",
    "Pneumothorax",
    "Edema",
    "Emphysema",
    "Fibrosis",
    "Effusion",
    "Pneumonia",
    "Pleural_Thickening",
    "Cardiomegaly",
    "Nodule",
    "Mass",
    "Hernia",
    "Lung Lesion",
    "Fracture",
    "Lung Opacity",
    "Enlarged Cardiomediastinum",
];

/// torchxrayvision 1.5.7 `model_urls["all"]["op_threshs"]`.
const DENSENET121_ALL_THRESHS: [f32; 18] = [
    0.07422872,
    0.038290843,
    0.09814756,
    0.0098118475,
    0.023601074,
    0.0022490358,
    0.010060724,
    0.103246614,
    0.056810737,
    0.026791653,
    0.050318155,
    0.023985857,
    0.01939503,
    0.042889766,
    0.053369623,
    0.035975814,
    0.20204692,
    0.05015312,
];

/// torchxrayvision 1.5.7 `model_urls["resnet50-res512-all"]["op_threshs"]` (NaN: no
/// operating point; torchxrayvision then outputs a constant 0.5).
const RESNET50_ALL_THRESHS: [f32; 18] = [
    0.51570356,
    0.50444704,
    0.53787947,
    0.50723547,
    0.5025118,
    0.5035252,
    0.5038076,
    0.51862943,
    0.5078151,
    0.50724894,
    0.5056339,
    0.510706,
    0.5053923,
    0.5020846,
    f32::NAN,
    0.5080557,
    0.5138526,
    f32::NAN,
];

/// Which network, with its shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "architecture", rename_all = "lowercase")]
pub enum Arch {
    /// A torchxrayvision DenseNet.
    DenseNet(densenet::Config),
    /// A torchxrayvision ResNet.
    ResNet(resnet::Config),
}

/// Everything about a published torchxrayvision model besides its weights.
#[derive(Clone, Debug, PartialEq)]
pub struct XrvSpec {
    /// Model id (`densenet121-res224-all`, ...).
    pub id: String,
    /// The network and its shape.
    pub arch: Arch,
    /// Output labels, in the network's order.
    pub labels: Vec<String>,
    /// Per-label operating point; `None` where the model has none.
    pub op_threshs: Vec<Option<f32>>,
    /// Square input size the model was trained at.
    pub resolution: usize,
}

fn threshs(t: &[f32]) -> Vec<Option<f32>> {
    t.iter().map(|&v| (!v.is_nan()).then_some(v)).collect()
}

impl XrvSpec {
    /// torchxrayvision `densenet121-res224-all`: 224 px, 18 pathologies, published thresholds.
    pub fn densenet121_res224_all() -> Self {
        XrvSpec {
            id: "densenet121-res224-all".into(),
            arch: Arch::DenseNet(densenet::Config::densenet121_res224_all()),
            labels: LABELS.iter().map(|s| s.to_string()).collect(),
            op_threshs: threshs(&DENSENET121_ALL_THRESHS),
            resolution: 224,
        }
    }

    /// torchxrayvision `resnet50-res512-all`: 512 px, 18 pathologies, published thresholds.
    pub fn resnet50_res512_all() -> Self {
        XrvSpec {
            id: "resnet50-res512-all".into(),
            arch: Arch::ResNet(resnet::Config::resnet50_res512_all()),
            labels: LABELS.iter().map(|s| s.to_string()).collect(),
            op_threshs: threshs(&RESNET50_ALL_THRESHS),
            resolution: 512,
        }
    }

    /// The spec of a registry manifest: the built-in spec of its architecture, with the
    /// manifest's id, labels and thresholds when it gives them.
    pub fn from_manifest(m: &Manifest) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::Manifest {
            id: m.id.clone(),
            reason,
        };
        let Some(family) = XrvArch::FAMILY.iter().find(|a| a.name == m.architecture) else {
            return Err(bad(format!(
                "`{}` is not a torchxrayvision classifier",
                m.architecture
            )));
        };
        let mut spec = (family.base)();
        spec.id = m.id.clone();
        if !m.labels.is_empty() {
            spec.labels = m.labels.clone();
        }
        if let Some(t) = m
            .postprocessing
            .get("op_threshs")
            .and_then(|v| v.as_array())
        {
            spec.op_threshs = t
                .iter()
                .map(|v| v.as_float().map(|f| f as f32).filter(|f| !f.is_nan()))
                .collect();
        }
        if let Some(r) = m
            .config
            .get("input_resolution")
            .and_then(|v| v.as_integer())
        {
            spec.resolution =
                usize::try_from(r).map_err(|_| bad(format!("bad input_resolution {r}")))?;
        }
        let classes = match &spec.arch {
            Arch::DenseNet(c) => c.num_classes,
            Arch::ResNet(c) => c.num_classes,
        };
        if spec.labels.len() != classes || spec.op_threshs.len() != classes {
            return Err(bad(format!(
                "{} labels and {} thresholds for {classes} outputs",
                spec.labels.len(),
                spec.op_threshs.len()
            )));
        }
        Ok(spec)
    }
}

/// A torchxrayvision classifier architecture in the table ([`crate::Architectures`]): its
/// published spec, checkpoint reading, backends, graph and device check.
pub struct XrvArch {
    name: &'static str,
    base: fn() -> XrvSpec,
    check: fn(&crate::devcheck::CheckOptions) -> Result<crate::devcheck::CheckRow, ModelError>,
}

impl XrvArch {
    /// The DenseNet-121 family (`densenet121-res224-all` and custom checkpoints of it).
    pub const DENSENET121: XrvArch = XrvArch {
        name: "densenet121",
        base: XrvSpec::densenet121_res224_all,
        check: crate::devcheck::densenet121,
    };
    /// The ResNet-50 family (`resnet50-res512-all` and custom checkpoints of it).
    pub const RESNET50: XrvArch = XrvArch {
        name: "resnet50",
        base: XrvSpec::resnet50_res512_all,
        check: crate::devcheck::resnet50,
    };
    const FAMILY: [XrvArch; 2] = [XrvArch::DENSENET121, XrvArch::RESNET50];
}

impl crate::Architecture for XrvArch {
    fn name(&self) -> &'static str {
        self.name
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
        _: Option<&std::path::Path>,
    ) -> Result<Option<crate::architecture::Params>, ModelError> {
        expected_params(&XrvSpec::from_manifest(m)?.arch).map(Some)
    }

    /// scripts/convert_xrv.py: names unchanged, BN counters dropped, `{"state_dict": ..}`
    /// unwrapped; the source file named in the metadata.
    fn pytorch_renames(&self) -> Option<crate::architecture::Renames> {
        Some(crate::architecture::Renames {
            unwrap: &["state_dict"],
            rename: |k| (!k.ends_with("num_batches_tracked")).then(|| k.to_string()),
            record_source: true,
        })
    }

    fn graph(&self) -> crate::architecture::Graph {
        crate::architecture::Graph::Built
    }

    fn onnx_graph(&self, m: &Manifest, vb: VarBuilder) -> Result<Vec<u8>, ModelError> {
        Classifier::onnx_graph(vb, &XrvSpec::from_manifest(m)?)
    }

    fn device_checks(&self) -> Vec<crate::architecture::DeviceCheck> {
        vec![crate::architecture::DeviceCheck {
            name: self.name,
            run: self.check,
        }]
    }
}

impl XrvSpec {
    /// The input this network takes (see [`Runner::recipe`]).
    pub fn recipe(&self) -> Preprocess {
        Preprocess::xrv(self.resolution as u32)
    }
}

/// The logistic function: a logit's probability.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torchxrayvision's `op_norm` for one probability: below the threshold `t` scales to [0, 0.5),
/// above it to [0.5, 1]; without a threshold the output is 0.5.
pub fn op_norm(p: f32, t: Option<f32>) -> f32 {
    match t {
        None => 0.5,
        Some(t) if p < t => p / (t * 2.0),
        Some(t) => 1.0 - (1.0 - p) / ((1.0 - t) * 2.0),
    }
}

/// torchxrayvision's input ([`Preprocess::xrv`]: the centred square crop of the shorter side,
/// `(2 * v / max_value - 1) * 1024`, resized to `size` x `size` the way its `XRayResizer` does)
/// for values outside an image store. Returns `size * size` values, row-major; nothing when the
/// plane is not `width * height` values.
pub fn preprocess(
    pixels: &[f32],
    width: usize,
    height: usize,
    max_value: f32,
    size: usize,
) -> Vec<f32> {
    recipe_values(
        &Preprocess::xrv(size as u32),
        pixels,
        width,
        height,
        max_value,
    )
}

/// Where the ONNX Runtime backend's graph came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnnxSource {
    /// Written by [`crate::onnx_graph`] from the installed safetensors.
    Built,
    /// The installed `model.onnx` (e.g. from `scripts/export_xrv_onnx.py`).
    Imported,
}

/// The network of either family on its backend (on a KServe v2 server: model `spec.id`, the
/// graph of [`Classifier::onnx_graph`]).
type Net = crate::Engine<NativeNet, CandleNet>;

/// The native plan of either family.
enum NativeNet {
    Dense(NativeDenseNet),
    Res(NativeResNet),
}

/// The candle network of either family.
enum CandleNet {
    Dense(densenet::DenseNet),
    Res(resnet::ResNet),
}

/// One label's result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LabelScore {
    /// The pathology.
    pub label: String,
    /// Calibrated score: 0.5 is the published operating point. `None` where the model has
    /// no operating point for this label.
    pub score: Option<f32>,
    /// The network's sigmoid output, uncalibrated.
    pub probability: f32,
    /// The operating point the score is calibrated against; `None` where there is none.
    pub threshold: Option<f32>,
}

impl LabelScore {
    /// Whether the calibrated score reaches the operating point (0.5); false without one.
    pub fn positive(&self) -> bool {
        self.score.is_some_and(|s| s >= 0.5)
    }
}

/// A torchxrayvision classifier ready to run.
pub struct Classifier {
    /// The model this classifier runs.
    pub spec: XrvSpec,
    backend: Backend,
    device: candle_core::Device,
    net: Net,
    /// Whether the weights are a site's own checkpoint rather than the published ones.
    pub custom: bool,
    /// With the ONNX Runtime backend: where its graph came from.
    pub onnx_source: Option<OnnxSource>,
    /// The candle path is not re-entrant on every device; one forward at a time.
    candle_lock: Mutex<()>,
}

fn cpu_err(e: CpuError) -> ModelError {
    ModelError::Compute(e.to_string())
}

impl Classifier {
    /// Builds the network from `vb` (checkpoint names at its root). `threads` is used by the
    /// native and ONNX Runtime backends; ONNX Runtime runs on the CPU here (see
    /// [`Classifier::onnx`] for GPUs).
    pub fn new(
        vb: VarBuilder,
        spec: XrvSpec,
        backend: Backend,
        threads: usize,
    ) -> Result<Self, ModelError> {
        let device = vb.device().clone();
        if backend == Backend::Onnx {
            return Self::onnx(vb, spec, threads, Device::Cpu);
        }
        if backend == Backend::Kserve {
            return Err(ModelError::Backend {
                what: "a classifier built from weights".into(),
                backend,
                supported: "native, candle or onnx (Classifier::kserve connects to a server)"
                    .into(),
            });
        }
        if backend == Backend::Native && !device.is_cpu() {
            return Err(ModelError::Device {
                device: format!("{device:?}"),
                reason: "the native backend runs on the CPU only; use the candle backend on GPUs"
                    .into(),
            });
        }
        let size = spec.resolution;
        let net = match (&spec.arch, backend) {
            (Arch::DenseNet(c), Backend::Candle) => Net::Candle(
                CandleNet::Dense(densenet::DenseNet::load(vb, c)?),
                device.clone(),
            ),
            (Arch::ResNet(c), Backend::Candle) => {
                Net::Candle(CandleNet::Res(resnet::ResNet::load(vb, c)?), device.clone())
            }
            // The native plans are built from the checkpoint's weights, not from candle modules.
            (Arch::DenseNet(c), _) => {
                let w = densenet::native_weights(vb, c)?;
                Net::Native(NativeNet::Dense(
                    NativeDenseNet::new(&w, size, threads).map_err(cpu_err)?,
                ))
            }
            (Arch::ResNet(c), _) => {
                let w = resnet::native_weights(vb, c)?;
                Net::Native(NativeNet::Res(
                    NativeResNet::new(&w, size, threads).map_err(cpu_err)?,
                ))
            }
        };
        Ok(Self::with_net(spec, backend, device, net))
    }

    fn with_net(spec: XrvSpec, backend: Backend, device: candle_core::Device, net: Net) -> Self {
        Classifier {
            spec,
            backend,
            device,
            net,
            custom: false,
            onnx_source: None,
            candle_lock: Mutex::new(()),
        }
    }

    /// The candle backend with its folded forward in `dtype` on `vb`'s device: `F16` runs the
    /// weights and activations in f16 (opt-in, for GPUs; the logits and the CAM's feature map
    /// come back in f32; tolerance in docs/gpu.md), `F32` is [`Classifier::new`] on candle.
    /// bf16 is refused.
    pub fn candle_with_dtype(
        vb: VarBuilder,
        spec: XrvSpec,
        dtype: candle_core::DType,
    ) -> Result<Self, ModelError> {
        let device = vb.device().clone();
        let net = match &spec.arch {
            Arch::DenseNet(c) => {
                CandleNet::Dense(densenet::DenseNet::load(vb, c)?.to_dtype(dtype)?)
            }
            Arch::ResNet(c) => CandleNet::Res(resnet::ResNet::load(vb, c)?.to_dtype(dtype)?),
        };
        let net = Net::Candle(net, device.clone());
        Ok(Self::with_net(spec, Backend::Candle, device, net))
    }

    /// The ONNX graph of this network with the weights in `vb` (see [`crate::onnx_graph`]):
    /// input `x` (batch, 1, res, res), output `logits` (batch, classes).
    pub fn onnx_graph(vb: VarBuilder, spec: &XrvSpec) -> Result<Vec<u8>, ModelError> {
        Ok(match &spec.arch {
            Arch::DenseNet(c) => densenet::DenseNet::load(vb, c)?.to_onnx(spec.resolution)?,
            Arch::ResNet(c) => resnet::ResNet::load(vb, c)?.to_onnx(spec.resolution)?,
        })
    }

    /// The network on ONNX Runtime, its graph built from the weights in `vb`, with `threads`
    /// intra-op threads on `device` (CPU, or TensorRT/CUDA with the `onnx-gpu` feature).
    pub fn onnx(
        vb: VarBuilder,
        spec: XrvSpec,
        threads: usize,
        device: Device,
    ) -> Result<Self, ModelError> {
        let graph = Self::onnx_graph(vb, &spec)?;
        let mut c = Self::onnx_from_bytes(
            &graph,
            &format!("{} (built graph)", spec.id),
            spec,
            threads,
            device,
        )?;
        c.onnx_source = Some(OnnxSource::Built);
        Ok(c)
    }

    /// The network on ONNX Runtime from a serialised graph with the same input and output.
    pub fn onnx_from_bytes(
        graph: &[u8],
        what: &str,
        spec: XrvSpec,
        threads: usize,
        device: Device,
    ) -> Result<Self, ModelError> {
        let net = Net::onnx(graph, what, threads, device)?;
        let mut c = Self::with_net(spec, Backend::Onnx, candle_core::Device::Cpu, net);
        c.onnx_source = Some(OnnxSource::Imported);
        Ok(c)
    }

    /// The network served as model `spec.id` by the KServe v2 server of `settings` (the graph
    /// `hilum models export-triton` writes: input [`crate::onnx_graph::INPUT`] (batch, 1, res,
    /// res), output [`crate::onnx_graph::OUTPUT`] (batch, classes)), checked at connection.
    pub fn kserve(spec: XrvSpec, settings: &crate::KserveSettings) -> Result<Self, ModelError> {
        use crate::kserve::{KserveModel, TensorSpec};
        let res = spec.resolution as i64;
        let input = TensorSpec::new(crate::onnx_graph::INPUT, &[-1, 1, res, res]);
        let output = TensorSpec::new(crate::onnx_graph::OUTPUT, &[-1, spec.labels.len() as i64]);
        let model = KserveModel::connect(settings, &spec.id, input, output)?;
        Ok(Self::with_net(
            spec,
            Backend::Kserve,
            candle_core::Device::Cpu,
            Net::Kserve(model),
        ))
    }

    /// The backend it runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Number of labels (the network's outputs).
    pub fn classes(&self) -> usize {
        self.spec.labels.len()
    }

    /// Raw logits (batch, classes) for preprocessed images (batch, 1, res, res) row-major.
    pub fn logits(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, ModelError> {
        let size = self.spec.resolution;
        if batch == 0 || input.len() != batch * size * size {
            return Err(ModelError::Compute(format!(
                "classifier input has {} values, expected {batch} x {size} x {size}",
                input.len()
            )));
        }
        match &self.net {
            Net::Native(NativeNet::Dense(n)) => n.forward(input, batch).map_err(cpu_err),
            Net::Native(NativeNet::Res(n)) => n.forward(input, batch).map_err(cpu_err),
            Net::Candle(CandleNet::Dense(n), _) => self.candle_logits(n, input, batch),
            Net::Candle(CandleNet::Res(n), _) => self.candle_logits(n, input, batch),
            graph => {
                let (_, out) = graph.run_graph(&[batch, 1, size, size], input)?;
                let (source, error): (&str, fn(String) -> ModelError) =
                    if self.backend == Backend::Kserve {
                        ("the server", ModelError::Compute)
                    } else {
                        ("the graph", ModelError::Onnx)
                    };
                self.checked_logits(out, batch, source, error)
            }
        }
    }

    /// Logits computed outside candle and the native kernels, checked to be `batch` rows of
    /// this classifier's classes before anything reads them as such.
    fn checked_logits(
        &self,
        out: Vec<f32>,
        batch: usize,
        source: &str,
        error: fn(String) -> ModelError,
    ) -> Result<Vec<f32>, ModelError> {
        if out.len() != batch * self.classes() {
            return Err(error(format!(
                "{source} returned {} values for {batch} images of {} classes",
                out.len(),
                self.classes()
            )));
        }
        Ok(out)
    }

    fn candle_logits(
        &self,
        m: &impl Module,
        input: &[f32],
        batch: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let _one = self.candle_lock.lock().unwrap_or_else(|e| e.into_inner());
        let size = self.spec.resolution;
        let x = Tensor::from_slice(input, (batch, 1, size, size), &self.device)?;
        Ok(m.forward(&x)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Calibrated scores for preprocessed images, one Vec of 18 (label order) per image.
    pub fn predict(&self, input: &[f32], batch: usize) -> Result<Vec<Vec<LabelScore>>, ModelError> {
        let logits = self.logits(input, batch)?;
        let k = self.classes();
        Ok(logits
            .chunks(k)
            .map(|row| {
                row.iter()
                    .zip(&self.spec.labels)
                    .zip(&self.spec.op_threshs)
                    .map(|((&z, label), &t)| {
                        let p = sigmoid(z);
                        LabelScore {
                            label: label.clone(),
                            score: t.map(|t| op_norm(p, Some(t))),
                            probability: p,
                            threshold: t,
                        }
                    })
                    .collect()
            })
            .collect())
    }

    /// Preprocesses one image (luminance, values 0..=max_value) and classifies it.
    pub fn classify(
        &self,
        pixels: &[f32],
        width: usize,
        height: usize,
        max_value: f32,
    ) -> Result<Vec<LabelScore>, ModelError> {
        if width == 0 || height == 0 || pixels.len() != width * height {
            return Err(ModelError::Compute(format!(
                "image has {} pixels, expected {width} x {height}",
                pixels.len()
            )));
        }
        let x = prepare_values(
            pixels,
            width as u32,
            height as u32,
            max_value,
            &self.recipe(),
        )
        .map_err(|e| ModelError::Compute(e.to_string()))?;
        self.run(&x)
    }
}

/// A class activation map (Zhou et al., "Learning Deep Features for Discriminative
/// Localization", CVPR 2016) at feature-map resolution: one class's head weights over the
/// classifier's last feature map.
#[derive(Clone, Debug, PartialEq)]
pub struct Cam {
    /// Index of the class in the model's labels.
    pub class: usize,
    /// Height of the feature map.
    pub h: usize,
    /// Width of the feature map.
    pub w: usize,
    /// `sum_k W[class, k] * F[k, y, x]`, row-major, without the bias.
    pub values: Vec<f32>,
    /// The class logit: mean of `values` plus the bias, as the head computes it.
    pub logit: f32,
}

impl Classifier {
    /// Whether [`Classifier::class_activation`] runs on this classifier: a DenseNet on the
    /// candle backend (the native plan and the graphs end at the logits).
    pub fn has_feature_map(&self) -> bool {
        matches!(self.net, Net::Candle(CandleNet::Dense(_), _))
    }

    /// The class activation map of `class` for one preprocessed input (res x res,
    /// xrv-normalised): this network's own last feature map ([`densenet::DenseNet::feature_map`],
    /// after `norm5` and ReLU) weighed by its own head, so the map's mean plus the bias is the
    /// logit [`Classifier::logits`] gives.
    pub fn class_activation(&self, input: &[f32], class: usize) -> Result<Cam, ModelError> {
        let res = self.spec.resolution;
        if input.len() != res * res {
            return Err(ModelError::Compute(format!(
                "CAM input has {} values, expected {res} x {res}",
                input.len()
            )));
        }
        let k = self.classes();
        if class >= k {
            return Err(ModelError::Compute(format!(
                "class {class} out of range (the model has {k})"
            )));
        }
        let Net::Candle(CandleNet::Dense(net), device) = &self.net else {
            return Err(ModelError::Backend {
                what: format!("the class activation map of {}", self.spec.id),
                backend: self.backend,
                supported: "candle, for a DenseNet (the native plan and the graphs end at the \
                            logits)"
                    .into(),
            });
        };
        let _one = self.candle_lock.lock().unwrap_or_else(|e| e.into_inner());
        let x = Tensor::from_slice(input, (1, 1, res, res), device)?;
        let f = net.feature_map(&x)?; // (1, C, h, w)
        let (_, c, h, w) = f.dims4()?;
        let wc = net.classifier.weight().narrow(0, class, 1)?; // (1, C)
        let values = wc
            .matmul(&f.reshape((c, h * w))?)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let bias = match net.classifier.bias() {
            Some(b) => b.narrow(0, class, 1)?.to_vec1::<f32>()?[0],
            None => 0.0,
        };
        let logit = values.iter().sum::<f32>() / values.len().max(1) as f32 + bias;
        Ok(Cam {
            class,
            h,
            w,
            values,
            logit,
        })
    }
}

impl Runner for Classifier {
    type Output = Vec<LabelScore>;

    fn recipe(&self) -> Preprocess {
        self.spec.recipe()
    }

    fn run(&self, input: &Prepared) -> Result<Vec<LabelScore>, ModelError> {
        check_input(&self.recipe(), input)?;
        self.predict(&input.data, 1)?
            .pop()
            .ok_or_else(|| ModelError::Compute("no output".into()))
    }
}

impl Classifier {
    /// An installed model on `backend`: its manifest's spec, its weights (and for ONNX
    /// Runtime its imported `model.onnx` when there is one, else a graph built from the
    /// weights), with `threads` for the native and ONNX Runtime backends.
    pub fn load_installed(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: Backend,
        threads: usize,
    ) -> Result<Self, ModelError> {
        let spec = XrvSpec::from_manifest(manifest)?;
        let corrupt = |e| match e {
            ModelError::Compute(reason) => ModelError::Corrupt {
                id: manifest.id.clone(),
                reason,
            },
            other => other,
        };
        let mut c = match (backend, &installed.onnx) {
            (Backend::Onnx, Some(path)) => {
                let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
                let what = path.display().to_string();
                Self::onnx_from_bytes(&bytes, &what, spec, threads, device)?
            }
            (Backend::Onnx, None) => {
                // The graph is built from CPU copies of the weights, whatever the device.
                let vb = crate::weights::var_builder(&installed.weights, Device::Cpu)?;
                Self::onnx(vb, spec, threads, device).map_err(corrupt)?
            }
            _ => {
                let vb = crate::weights::var_builder(&installed.weights, device)?;
                Self::new(vb, spec, backend, threads).map_err(corrupt)?
            }
        };
        c.custom = installed.record.custom;
        Ok(c)
    }
}

impl crate::Model for Classifier {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: Backend,
        settings: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        if backend == Backend::Kserve {
            let remote = crate::kserve::configured(settings)?;
            let mut c = Self::kserve(XrvSpec::from_manifest(manifest)?, remote)?;
            c.custom = installed.record.custom;
            return Ok(c);
        }
        Self::load_installed(manifest, installed, device, backend, settings.cpu.threads())
    }
}

/// The warm classifier `id` on `device` and `backend` (default: [`Backend::default_for`]),
/// loading it first if needed. Blocking: call it from `spawn_blocking`.
pub fn pooled(
    pool: &crate::ModelPool,
    id: &str,
    device: Device,
    backend: Option<Backend>,
) -> Result<Arc<Classifier>, ModelError> {
    pool.get_or_load::<Classifier>(id, device, backend.unwrap_or(Backend::default_for(device)))
}

/// Parameter names and shapes the network reads, in checkpoint naming. Checkpoints from
/// PyTorch also hold `*.num_batches_tracked` (training bookkeeping, unused at inference);
/// `scripts/convert_xrv.py` leaves them out.
pub fn expected_params(arch: &Arch) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    let rec = Recorder::default();
    let names = rec.seen.clone();
    let vb = VarBuilder::from_backend(
        Box::new(rec),
        candle_core::DType::F32,
        candle_core::Device::Cpu,
    );
    match arch {
        Arch::DenseNet(c) => {
            densenet::DenseNet::load(vb, c)?;
        }
        Arch::ResNet(c) => {
            resnet::ResNet::load(vb, c)?;
        }
    }
    let seen = names.lock().unwrap_or_else(|e| e.into_inner()).clone();
    Ok(seen)
}

/// A VarBuilder backend that hands out zeros and writes down what was asked for.
#[derive(Default)]
struct Recorder {
    seen: std::sync::Arc<Mutex<BTreeMap<String, Vec<usize>>>>,
}

impl candle_nn::var_builder::SimpleBackend for Recorder {
    fn get(
        &self,
        s: candle_core::Shape,
        name: &str,
        _h: candle_nn::Init,
        dtype: candle_core::DType,
        dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), s.dims().to_vec());
        Tensor::zeros(s, dtype, dev)
    }

    fn get_unchecked(
        &self,
        name: &str,
        _dtype: candle_core::DType,
        _dev: &candle_core::Device,
    ) -> candle_core::Result<Tensor> {
        candle_core::bail!("the shape of `{name}` is not known when recording")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        true
    }
}

/// Seeded weights for `arch` with activations of order one (He-scaled convolutions, BatchNorm
/// near identity): for benchmarks and backend parity tests only. Tools never use them — a
/// missing model is an error.
pub fn synthetic_weights(arch: &Arch, seed: u64) -> Result<HashMap<String, Tensor>, ModelError> {
    Ok(crate::weights::seeded(&expected_params(arch)?, seed))
}
