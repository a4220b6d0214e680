//! Segment Anything (Kirillov et al., 2023) with a ViT image encoder, as MedSAM uses it
//! (Ma et al., "Segment anything in medical images", Nat. Commun. 2024; bowang-lab/MedSAM):
//! facebookresearch/segment-anything's `ImageEncoderViT`, `PromptEncoder`, `MaskDecoder` and
//! `TwoWayTransformer`, with the parameter names of `sam_vit_b` / `medsam_vit_b.pth`
//! (`image_encoder.blocks.0.attn.qkv.weight`, ...).
//!
//! Written here instead of using candle-transformers' `segment_anything` because that one
//! differs numerically (tanh-approximated GELU in the mask decoder and mask downscaling, where
//! SAM uses the exact erf GELU), hard-codes the decoder's size, and panics (`todo!`) when a
//! relative position table would need resizing.
//!
//! Preprocessing and postprocessing follow MedSAM's `MedSAM_Inference.py`, not SAM's
//! predictor: the image is stretched to 1024 x 1024 (no aspect-preserving pad), min-max scaled
//! to 0..1 (no ImageNet mean/std), the box is given in 1024-px coordinates, and the 256 x 256
//! low-resolution logits go through a sigmoid, bilinear resize to the original size
//! (`align_corners=False`) and a 0.5 threshold.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Module, Shape, Tensor, D};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

use hilum_imaging::{Filter, Norm, Prepared, Preprocess};

use crate::manifest::{InstalledModel, Manifest};
use crate::onnx_graph::{self, Attr, Dim, GraphBuilder};
use crate::runner::{check_input, recipe_values, Runner};
use crate::{Device, ModelError};

mod arch;
mod encoder_onnx;
mod image_encoder;
mod layers;
mod mask_decoder;
mod prompt_encoder;
mod transformer;

pub use arch::SamArch;
pub use encoder_onnx::ONNX_EMBEDDINGS;
use image_encoder::*;
use layers::*;
use mask_decoder::*;
pub use prompt_encoder::Prompt;
use prompt_encoder::*;
use transformer::*;

/// Architecture of one SAM variant. The published ViT variants all use a qkv bias, relative
/// and absolute position embeddings, MLP ratio 4 and LayerNorm eps 1e-6 in the encoder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    /// Side of the square encoder input (1024).
    pub image_size: usize,
    /// Side of one square patch, in pixels (16).
    pub patch_size: usize,
    /// Width of the image encoder's tokens.
    pub encoder_embed_dim: usize,
    /// Number of image encoder blocks.
    pub encoder_depth: usize,
    /// Attention heads per image encoder block.
    pub encoder_num_heads: usize,
    /// Window side of the windowed-attention blocks.
    pub window_size: usize,
    /// Blocks with global attention; the others attend within windows.
    pub global_attn_indexes: Vec<usize>,
    /// Channels of the image embedding and of every prompt token (256).
    pub prompt_embed_dim: usize,
    /// Hidden channels of the convolutions that embed a mask prompt.
    pub mask_in_chans: usize,
    /// Number of two-way transformer blocks in the mask decoder.
    pub decoder_depth: usize,
    /// Attention heads per mask decoder block.
    pub decoder_num_heads: usize,
    /// Width of the mask decoder's MLP.
    pub decoder_mlp_dim: usize,
    /// Masks predicted besides the single-mask output (3).
    pub num_multimask_outputs: usize,
    /// Layers of the MLP that predicts each mask's IoU.
    pub iou_head_depth: usize,
    /// Width of that IoU MLP.
    pub iou_head_hidden_dim: usize,
}

impl Config {
    /// SAM ViT-B (`sam_model_registry["vit_b"]`), the architecture of `medsam_vit_b.pth`.
    pub fn vit_b() -> Self {
        Config {
            image_size: 1024,
            patch_size: 16,
            encoder_embed_dim: 768,
            encoder_depth: 12,
            encoder_num_heads: 12,
            window_size: 14,
            global_attn_indexes: vec![2, 5, 8, 11],
            prompt_embed_dim: 256,
            mask_in_chans: 16,
            decoder_depth: 2,
            decoder_num_heads: 8,
            decoder_mlp_dim: 2048,
            num_multimask_outputs: 3,
            iou_head_depth: 3,
            iou_head_hidden_dim: 256,
        }
    }

    /// Side of the image embedding grid (64 for ViT-B).
    pub fn grid(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Side of the decoder's low-resolution masks (256 for ViT-B).
    pub fn low_res(&self) -> usize {
        4 * self.grid()
    }

    /// From a manifest's `[config]`: `variant = "vit_b"`, or every field spelled out.
    pub fn from_manifest(manifest: &Manifest) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::Manifest {
            id: manifest.id.clone(),
            reason,
        };
        match manifest.config.get("variant").and_then(|v| v.as_str()) {
            Some("vit_b") => Ok(Config::vit_b()),
            Some(other) => Err(bad(format!("unknown SAM variant `{other}` (known: vit_b)"))),
            None => toml::Value::Table(manifest.config.clone())
                .try_into()
                .map_err(|e| bad(format!("[config]: {e}"))),
        }
    }

    fn check(&self) -> candle_core::Result<()> {
        let ok = self.patch_size > 0
            && self.image_size.is_multiple_of(self.patch_size)
            && self.encoder_num_heads > 0
            && self
                .encoder_embed_dim
                .is_multiple_of(self.encoder_num_heads)
            && self.decoder_num_heads > 0
            && (self.prompt_embed_dim / 2).is_multiple_of(self.decoder_num_heads)
            && self.prompt_embed_dim.is_multiple_of(8)
            && self.mask_in_chans.is_multiple_of(4)
            && self.iou_head_depth > 0;
        if ok {
            Ok(())
        } else {
            candle_core::bail!("inconsistent SAM configuration {self:?}")
        }
    }
}

static INSTANCES: AtomicU64 = AtomicU64::new(1);

/// Where the image encoder runs, in the holder every model keeps its network in: the candle
/// encoder on the model's device, or its ONNX graph ([`Sam::encoder_onnx`]) on ONNX Runtime or
/// on a KServe v2 server (Triton). SAM has no native plan. The prompt encoder and mask decoder
/// always run in candle, in process.
type EncoderEngine = crate::Engine<std::convert::Infallible, ImageEncoder>;

/// SAM / MedSAM: encode an image once, then decode any number of prompts against it.
#[derive(Debug)]
pub struct Sam {
    encoder: EncoderEngine,
    prompt_encoder: PromptEncoder,
    mask_decoder: MaskDecoder,
    image_pe: Tensor,
    config: Config,
    device: candle_core::Device,
    encoder_runs: AtomicUsize,
    instance: u64,
}

impl Sam {
    /// `vb` at the root of the checkpoint (`image_encoder.`, `prompt_encoder.`, `mask_decoder.`).
    pub fn load(vb: VarBuilder, cfg: &Config) -> candle_core::Result<Self> {
        cfg.check()?;
        let prompt_encoder = PromptEncoder::load(vb.pp("prompt_encoder"), cfg)?;
        let image_pe = prompt_encoder.dense_pe()?;
        Ok(Sam {
            encoder: crate::Engine::Candle(
                ImageEncoder::load(vb.pp("image_encoder"), cfg)?,
                vb.device().clone(),
            ),
            prompt_encoder,
            mask_decoder: MaskDecoder::load(vb.pp("mask_decoder"), cfg)?,
            image_pe,
            config: cfg.clone(),
            device: vb.device().clone(),
            encoder_runs: AtomicUsize::new(0),
            instance: INSTANCES.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// The architecture the model was built from.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The device its weights live on.
    pub fn device(&self) -> &candle_core::Device {
        &self.device
    }

    /// How many times the image encoder has run (the expensive part; callers cache its output).
    pub fn encoder_runs(&self) -> usize {
        self.encoder_runs.load(Ordering::Relaxed)
    }

    /// Distinguishes loaded copies (a cache keyed by it never mixes weights).
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// The candle image encoder, or an error saying where the encoder runs instead.
    fn candle_encoder(&self) -> candle_core::Result<&ImageEncoder> {
        match &self.encoder {
            crate::Engine::Candle(e, _) => Ok(e),
            other => candle_core::bail!(
                "the image encoder runs on {}, not candle: send it the prepared image \
                 (embed_prepared), or load the model on candle",
                other.backend()
            ),
        }
    }

    /// The candle image encoder: (1, 3, S, S) -> (1, prompt_embed_dim, S/p, S/p).
    pub fn embed_image(&self, input: &Tensor) -> candle_core::Result<Tensor> {
        let encoder = self.candle_encoder()?;
        self.encoder_runs.fetch_add(1, Ordering::Relaxed);
        encoder.forward(input)
    }

    /// Where the image encoder runs (the rest is candle's).
    pub fn backend(&self) -> crate::Backend {
        self.encoder.backend()
    }

    /// The image encoder on `backend`: `Candle` (and `Native`) in process on the model's device,
    /// `Onnx` runs [`Sam::encoder_onnx`] of these weights on
    /// ONNX Runtime (CPU, `threads`), `Kserve` sends it to the server of `remote`, which serves
    /// that graph as model `id` (`hilum models export-triton`), checked at connection.
    pub fn with_encoder_on(
        mut self,
        backend: crate::Backend,
        id: &str,
        threads: usize,
        remote: Option<&crate::KserveSettings>,
    ) -> Result<Self, ModelError> {
        let (s, e, g) = (
            self.config.image_size as i64,
            self.config.prompt_embed_dim as i64,
            self.config.grid() as i64,
        );
        self.encoder = match backend {
            // SAM has no kernels of Hilum's own: in process, `native` (a `[remote] fallback`
            // written for the CNNs) is candle.
            crate::Backend::Candle | crate::Backend::Native => {
                self.candle_encoder()?;
                return Ok(self);
            }
            crate::Backend::Kserve => {
                use crate::kserve::{KserveModel, TensorSpec};
                let remote = remote.ok_or(ModelError::NoRemote)?;
                let input = TensorSpec::new(onnx_graph::INPUT, &[-1, 3, s, s]);
                let output = TensorSpec::new(ONNX_EMBEDDINGS, &[-1, e, g, g]);
                crate::Engine::Kserve(KserveModel::connect(remote, id, input, output)?)
            }
            crate::Backend::Onnx => {
                let graph = self.encoder_onnx()?;
                let what = format!("{id}'s image encoder");
                crate::Engine::onnx(&graph, &what, threads, Device::Cpu)?
            }
        };
        Ok(self)
    }

    /// [`Sam::embed_image`] on the output of [`preprocess`] / [`recipe`] (`3 * S * S` values),
    /// on the encoder's backend.
    pub fn embed_prepared(&self, input: &[f32]) -> Result<Tensor, ModelError> {
        crate::fault::check()?;
        let c = &self.config;
        let s = c.image_size;
        let (e, g) = (c.prompt_embed_dim, c.grid());
        let served = match &self.encoder {
            crate::Engine::Candle(_, device) => {
                let x = Tensor::from_slice(input, (1, 3, s, s), device)?;
                return Ok(self.embed_image(&x)?);
            }
            crate::Engine::Native(never) => match *never {},
            graph => graph.run_graph(&[1, 3, s, s], input)?,
        };
        self.encoder_runs.fetch_add(1, Ordering::Relaxed);
        let (shape, values) = served;
        if shape != [1, e, g, g] || values.len() != e * g * g {
            return Err(ModelError::Compute(format!(
                "the {} backend's image embedding has shape {shape:?} ({} values), expected [1, {e}, {g}, {g}]",
                self.backend(),
                values.len()
            )));
        }
        Ok(Tensor::from_vec(values, (1, e, g, g), &self.device)?)
    }

    /// The image encoder as an ONNX graph (IR 8, opset 17): input [`onnx_graph::INPUT`]
    /// (batch, 3, S, S) as [`recipe`] prepares it, output [`ONNX_EMBEDDINGS`]
    /// (batch, prompt_embed_dim, S/p, S/p), what [`Sam::embed_image`] returns. The prompt
    /// encoder and mask decoder stay in process: they are small and run once per prompt.
    pub fn encoder_onnx(&self) -> candle_core::Result<Vec<u8>> {
        let (s, e, grid) = (
            self.config.image_size,
            self.config.prompt_embed_dim,
            self.config.grid(),
        );
        let mut g = GraphBuilder::new("sam_image_encoder");
        let y = self.candle_encoder()?.to_onnx(&mut g, s)?;
        let batch = Dim::Named("batch");
        let (s, e, grid) = (Dim::Fixed(s), Dim::Fixed(e), Dim::Fixed(grid));
        Ok(g.finish(
            (onnx_graph::INPUT, &[batch, Dim::Fixed(3), s, s]),
            &y,
            (ONNX_EMBEDDINGS, &[batch, e, grid, grid]),
            "Segment Anything image encoder (MedSAM ViT-B), written by Hilum from the installed weights",
        ))
    }

    /// The prompt encoder: (sparse (1, n, e), dense (1, e, g, g)).
    pub fn encode_prompt(&self, prompt: &Prompt) -> candle_core::Result<(Tensor, Tensor)> {
        self.prompt_encoder.forward(prompt)
    }

    /// `get_dense_pe()`: (1, e, g, g).
    pub fn dense_pe(&self) -> &Tensor {
        &self.image_pe
    }

    /// Every mask token's low-resolution logits (1, 1 + multimask, 4g, 4g) and predicted IoU
    /// (1, 1 + multimask); MedSAM uses index 0 (`multimask_output=False`).
    pub fn decode(
        &self,
        embedding: &Tensor,
        prompt: &Prompt,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (sparse, dense) = self.prompt_encoder.forward(prompt)?;
        self.mask_decoder
            .forward(embedding, &self.image_pe, &sparse, &dense)
    }

    /// MedSAM's single-mask output: low-resolution logits (4g * 4g values, row-major) and the
    /// predicted IoU.
    pub fn predict_low_res(
        &self,
        embedding: &Tensor,
        prompt: &Prompt,
    ) -> Result<(Vec<f32>, f32), ModelError> {
        crate::fault::check()?;
        let (masks, iou) = self.decode(embedding, prompt)?;
        let logits = masks.get(0)?.get(0)?.flatten_all()?.to_vec1::<f32>()?;
        let iou = iou.get(0)?.get(0)?.to_scalar::<f32>()?;
        Ok((logits, iou))
    }
}

/// MedSAM's input for a whole grayscale image (`MedSAM_Inference.py`): the image on an 8-bit
/// scale, stretched to `size` x `size` by skimage's resize as MedSAM calls it (order 3,
/// `mode="reflect"`, anti-aliasing), truncated to integers (`astype(np.uint8)`), min-max scaled
/// to 0..1 over the resized image, repeated to 3 channels (CHW).
pub fn recipe(size: usize) -> Preprocess {
    Preprocess::stretch(size as u32, size as u32)
        .filter(Filter::SkimageCubicU8)
        .norm(Norm::MinMax)
        .channels(3)
}

/// [`recipe`] on a bare plane of full scale `max_value` (fixtures, device checks); nothing when
/// the plane does not hold `width * height` values.
pub fn preprocess(
    gray: &[f32],
    width: usize,
    height: usize,
    max_value: f32,
    size: usize,
) -> Vec<f32> {
    recipe_values(&recipe(size), gray, width, height, max_value)
}

/// The runner is the image encoder, the expensive pass whose output callers cache: prompts are
/// decoded on its embedding afterwards ([`Sam::predict_low_res`]), several per image, so they
/// are not part of `run`.
impl Runner for Sam {
    /// The image embedding (1, prompt_embed_dim, S/p, S/p).
    type Output = Tensor;

    fn recipe(&self) -> Preprocess {
        recipe(self.config.image_size)
    }

    fn run(&self, input: &Prepared) -> Result<Tensor, ModelError> {
        check_input(&Runner::recipe(self), input)?;
        self.embed_prepared(&input.data)
    }
}

/// `F.interpolate(mode="bilinear", align_corners=False)` of one map, without antialiasing
/// (what MedSAM does to bring the 256 x 256 probabilities to the original size).
pub fn interpolate_bilinear(src: &[f32], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<f32> {
    let taps = |s: usize, d: usize| -> Vec<(usize, usize, f32)> {
        let scale = s as f32 / d as f32;
        (0..d)
            .map(|i| {
                let x = ((i as f32 + 0.5) * scale - 0.5).max(0.0);
                let x0 = (x.floor() as usize).min(s - 1);
                let x1 = (x0 + 1).min(s - 1);
                (x0, x1, x - x0 as f32)
            })
            .collect()
    };
    if sw == 0 || sh == 0 || src.len() < sw * sh {
        return vec![0.0; dw * dh];
    }
    let (tx, ty) = (taps(sw, dw), taps(sh, dh));
    let mut out = Vec::with_capacity(dw * dh);
    for &(y0, y1, fy) in &ty {
        let (r0, r1) = (&src[y0 * sw..(y0 + 1) * sw], &src[y1 * sw..(y1 + 1) * sw]);
        for &(x0, x1, fx) in &tx {
            let top = r0[x0] * (1.0 - fx) + r0[x1] * fx;
            let bottom = r1[x0] * (1.0 - fx) + r1[x1] * fx;
            out.push(top * (1.0 - fy) + bottom * fy);
        }
    }
    out
}

/// Every parameter of a SAM checkpoint for `cfg`, as the loader asks for them.
pub fn expected_params(cfg: &Config) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    crate::weights::recorded_params(|vb| Sam::load(vb, cfg))
}

/// A model of `cfg` with seeded random weights (benchmarks; never used for answers).
pub fn random(cfg: &Config, seed: u64, device: Device) -> Result<Sam, ModelError> {
    let dev = device.candle()?;
    let names = expected_params(cfg)?;
    let mut state = seed | 1;
    let mut tensors = std::collections::HashMap::new();
    for (name, shape) in names {
        let n: usize = shape.iter().product();
        let fan_in = shape.iter().skip(1).product::<usize>().max(1) as f32;
        let amp = 1.0 / fan_in.sqrt();
        let v: Vec<f32> = (0..n)
            .map(|_| (2.0 * crate::weights::xorshift_unit(&mut state) - 1.0) * amp)
            .collect();
        tensors.insert(name, Tensor::from_vec(v, shape, &dev)?);
    }
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &dev);
    Ok(Sam::load(vb, cfg)?)
}

/// Where the image encoder runs by default: on the CPU, its ONNX graph on ONNX Runtime when the
/// runtime loads — ViT-B at 1024 px took 11.3-12.0 s there against candle's 22.1-24.1 s,
/// alternated on 2 cores (`cargo test --release -p hilum-models --test it medsam_onnx::full --
/// --ignored --nocapture`), the embeddings within 1.0e-6; candle otherwise and on GPUs.
pub fn auto_backend(device: Device) -> crate::Backend {
    #[cfg(feature = "onnx")]
    if !device.is_gpu() && crate::onnx::available() {
        return crate::Backend::Onnx;
    }
    let _ = device;
    crate::Backend::Candle
}

/// Loads a safetensors checkpoint with configuration `cfg`.
pub fn load_file(path: &Path, cfg: &Config, device: Device) -> Result<Sam, ModelError> {
    let vb = crate::weights::var_builder(path, device)?;
    Sam::load(vb, cfg).map_err(|e| ModelError::Corrupt {
        id: "medsam-vit-b".into(),
        reason: e.to_string(),
    })
}

impl crate::Model for Sam {
    fn load(
        manifest: &Manifest,
        installed: &InstalledModel,
        device: Device,
        backend: crate::Backend,
        settings: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        let cfg = Config::from_manifest(manifest)?;
        let vb = crate::weights::var_builder(&installed.weights, device)?;
        let sam = Sam::load(vb, &cfg).map_err(|e| ModelError::Corrupt {
            id: manifest.id.clone(),
            reason: e.to_string(),
        })?;
        sam.with_encoder_on(
            backend,
            &manifest.id,
            settings.cpu.threads(),
            settings.remote.as_ref(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bilinear_matches_align_corners_false() {
        // 2 -> 4 upsampling of [0, 1]: torch gives [0, 0.25, 0.75, 1].
        let out = interpolate_bilinear(&[0.0, 1.0], 2, 1, 4, 1);
        for (a, b) in out.iter().zip([0.0, 0.25, 0.75, 1.0]) {
            assert!((a - b).abs() < 1e-6, "{out:?}");
        }
        // Same size is the identity.
        let src: Vec<f32> = (0..12).map(|v| v as f32).collect();
        assert_eq!(interpolate_bilinear(&src, 4, 3, 4, 3), src);
    }

    #[test]
    fn preprocess_is_min_max_scaled_and_three_channel() {
        let gray: Vec<f32> = (0..64 * 48).map(|i| (i % 64) as f32 * 4.0 + 20.0).collect();
        let x = preprocess(&gray, 64, 48, 65535.0, 32);
        assert_eq!(x.len(), 3 * 32 * 32);
        let (lo, hi) = x
            .iter()
            .fold((1f32, 0f32), |(a, b), &v| (a.min(v), b.max(v)));
        assert_eq!((lo, hi), (0.0, 1.0));
        assert_eq!(&x[..1024], &x[1024..2048]);
        // A flat image does not divide by zero.
        let flat = preprocess(&[7.0; 100], 10, 10, 255.0, 16);
        assert!(flat.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn vit_b_config_is_consistent() {
        let c = Config::vit_b();
        assert!(c.check().is_ok());
        assert_eq!((c.grid(), c.low_res()), (64, 256));
    }
}
