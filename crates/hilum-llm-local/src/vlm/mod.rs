//! Gemma 3's multimodal model (`Gemma3ForConditionalGeneration`, the architecture of MedGemma
//! 4B: Gemma 3 4B with a SigLIP image encoder), loaded from a Hugging Face safetensors snapshot
//! (`config.json` + `model.safetensors` or its shards) in f32.
//!
//! An image becomes `mm_tokens_per_image` soft tokens: [`preprocess::pixel_values`] (the
//! processor's resize and normalisation), the SigLIP tower and the projector
//! ([`Gemma3Vlm::image_features`]). In the prompt, Gemma3Processor turns each
//! `<start_of_image>` into `\n\n<start_of_image>` + N x `<image_soft_token>` +
//! `<end_of_image>\n\n` ([`Gemma3Vlm::expand_image_placeholders`]); [`Gemma3Vlm::prefill`] puts
//! the features in place of the soft tokens (unscaled, unlike text embeddings) and runs the
//! decoder ([`crate::gemma3::Gemma3`], shared with the GGUF path) with each image's soft tokens
//! attending to each other in both directions, causal attention elsewhere.

pub mod config;
mod gguf;
pub mod preprocess;
pub mod reasoner;
mod siglip;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::gemma3::Gemma3;
use crate::model::Precision;
use crate::LocalError;
pub use config::VlmConfig;
use siglip::{Projector, VisionTower};

/// The text Gemma3Processor puts in place of each `<start_of_image>`.
pub const BOI_TEXT: &str = "<start_of_image>";
pub(crate) const EOI_TEXT: &str = "<end_of_image>";
pub(crate) const IMAGE_TOKEN_TEXT: &str = "<image_soft_token>";

/// A Gemma 3 multimodal model: the SigLIP vision tower, its projector and the decoder.
pub struct Gemma3Vlm {
    /// Its configuration.
    pub cfg: VlmConfig,
    vision: VisionTower,
    projector: Projector,
    decoder: Gemma3,
    device: Device,
}

/// A checkpoint's tensor name in the published form: transformers >= 4.52 saves
/// `model.language_model.*` etc. when asked to, older files and the published weights
/// `language_model.model.*`.
fn published_name(name: &str) -> String {
    for (new, old) in [
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ] {
        if let Some(rest) = name.strip_prefix(new) {
            return format!("{old}{rest}");
        }
    }
    name.to_string()
}

/// The weight files of a snapshot directory: `model.safetensors` or its shards
/// (`model-00001-of-00002.safetensors`, ...), in name order.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, LocalError> {
    let io = |reason: String| LocalError::Io {
        path: dir.display().to_string(),
        reason,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(io("no model*.safetensors files in this directory".into()));
    }
    Ok(files)
}

impl Gemma3Vlm {
    /// Loads a snapshot directory. Every parameter [`VlmConfig::parameters`] lists must be
    /// there with its shape, and nothing else; weights are converted to f32 on `dev`, and the
    /// decoder's matrices then stored as `precision` says. The decoder's rotary tables and
    /// cache are sized for `max_positions`.
    pub fn load(
        dir: &Path,
        max_positions: usize,
        precision: Precision,
        dev: &Device,
    ) -> Result<Self, LocalError> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| LocalError::Io {
            path: cfg_path.display().to_string(),
            reason: e.to_string(),
        })?;
        let cfg = VlmConfig::from_json(&text)
            .map_err(|e| LocalError::Unsupported(format!("{}: {e}", cfg_path.display())))?;
        let files = weight_files(dir)?;
        // SAFETY: the files are mapped read-only for the duration of the load; every tensor is
        // copied out (converted to f32) before the mapping is dropped.
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| LocalError::Io {
            path: dir.display().to_string(),
            reason: e.to_string(),
        })?;
        // Published name -> stored name.
        let stored: BTreeMap<String, String> = st
            .tensors()
            .into_iter()
            .map(|(n, _)| (published_name(&n), n))
            .collect();
        let shapes: BTreeMap<String, Vec<usize>> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (published_name(&n), v.shape().to_vec()))
            .collect();
        check_parameters(&cfg.parameters(), &shapes)
            .map_err(|e| LocalError::Unsupported(format!("{}: {e}", dir.display())))?;
        let mut get = |name: &str| -> candle_core::Result<Tensor> {
            let key = stored
                .get(name)
                .ok_or_else(|| candle_core::Error::Msg(format!("missing tensor {name}")))?;
            st.load(key, dev)?.to_dtype(DType::F32)
        };
        Self::from_weights(cfg, &mut get, max_positions, precision, dev)
    }

    /// The model from `get(published name)`, which returns each tensor of
    /// [`VlmConfig::parameters`] in f32; the decoder's matrices are stored as `precision` says
    /// (the vision tower and projector stay f32).
    pub fn from_weights(
        cfg: VlmConfig,
        get: &mut dyn FnMut(&str) -> candle_core::Result<Tensor>,
        max_positions: usize,
        precision: Precision,
        dev: &Device,
    ) -> Result<Self, LocalError> {
        let decoder = Gemma3::from_dense(
            cfg.decoder(),
            &mut |n| get(&format!("language_model.model.{n}")),
            max_positions,
            precision,
            dev,
        )?;
        Self::assemble(cfg, get, decoder, dev)
    }

    /// The vision tower and projector from `get(published name)` around a loaded decoder.
    fn assemble(
        cfg: VlmConfig,
        get: &mut dyn FnMut(&str) -> candle_core::Result<Tensor>,
        decoder: Gemma3,
        dev: &Device,
    ) -> Result<Self, LocalError> {
        let vision = VisionTower::load(&cfg, &mut |n| {
            get(&format!("vision_tower.vision_model.{n}"))
        })?;
        let projector = Projector::load(&cfg, &mut |n| get(&format!("multi_modal_projector.{n}")))?;
        Ok(Gemma3Vlm {
            cfg,
            vision,
            projector,
            decoder,
            device: dev.clone(),
        })
    }

    /// The model's input (channels, size, size) from an 8-bit grey (`channels` 1) or RGB (3)
    /// image, interleaved and row-major, as Gemma3ImageProcessor makes it.
    pub fn pixel_values(
        &self,
        image: &[u8],
        width: usize,
        height: usize,
        channels: usize,
    ) -> Result<Tensor, LocalError> {
        let size = self.cfg.vision.image_size;
        let v = preprocess::pixel_values(image, width, height, channels, size)
            .map_err(LocalError::Inference)?;
        Ok(Tensor::from_vec(v, (3, size, size), &self.device)?)
    }

    /// The soft tokens (mm_tokens_per_image, text width) of one image's pixel values.
    pub fn image_features(&self, pixels: &Tensor) -> Result<Tensor, LocalError> {
        Ok(self.projector.forward(&self.vision.forward(pixels)?)?)
    }

    /// `text` with each `<start_of_image>` expanded as Gemma3Processor expands it.
    pub fn expand_image_placeholders(&self, text: &str) -> String {
        let span = format!(
            "\n\n{BOI_TEXT}{}{EOI_TEXT}\n\n",
            IMAGE_TOKEN_TEXT.repeat(self.cfg.mm_tokens_per_image)
        );
        text.replace(BOI_TEXT, &span)
    }

    /// Runs a prompt (appended after the cached positions) whose image soft tokens are filled,
    /// in order, with `images` (each from [`Gemma3Vlm::image_features`]); returns the logits
    /// of every position (tokens, vocab).
    pub fn prefill(&mut self, ids: &[u32], images: &[Tensor]) -> Result<Tensor, LocalError> {
        self.prefill_logits(ids, images, true)
    }

    /// [`Gemma3Vlm::prefill`] returning the last position's logits only (vocab): what a reply
    /// needs, without the output layer's product for every prompt position.
    pub fn prefill_last(&mut self, ids: &[u32], images: &[Tensor]) -> Result<Tensor, LocalError> {
        self.prefill_logits(ids, images, false)
    }

    fn prefill_logits(
        &mut self,
        ids: &[u32],
        images: &[Tensor],
        all: bool,
    ) -> Result<Tensor, LocalError> {
        let n = self.cfg.mm_tokens_per_image;
        let pos = self.decoder.cached_len();
        // Runs of soft tokens: transformers' image groups (each attends to itself in full).
        let mut blocks: Vec<(usize, usize)> = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            if id != self.cfg.image_token {
                continue;
            }
            match blocks.last_mut() {
                Some((_, e)) if *e == pos + i => *e += 1,
                _ => blocks.push((pos + i, pos + i + 1)),
            }
        }
        let soft: usize = blocks.iter().map(|(s, e)| e - s).sum();
        if soft != images.len() * n {
            return Err(LocalError::Inference(format!(
                "the prompt has {soft} image tokens but {} image(s) of {n} tokens were given",
                images.len()
            )));
        }
        let x = self.decoder.embed_tokens(ids)?;
        let x = if images.is_empty() {
            x
        } else {
            let d = self.cfg.text.hidden;
            let mut rows = x.flatten_all()?.to_vec1::<f32>()?;
            let mut feats = Vec::with_capacity(soft * d);
            for f in images {
                if f.dims() != [n, d] {
                    return Err(LocalError::Inference(format!(
                        "image features of shape {:?}, expected [{n}, {d}]",
                        f.dims()
                    )));
                }
                feats.extend(f.flatten_all()?.to_vec1::<f32>()?);
            }
            let mut next = feats.chunks_exact(d);
            for (i, _) in ids
                .iter()
                .enumerate()
                .filter(|(_, &id)| id == self.cfg.image_token)
            {
                if let Some(f) = next.next() {
                    rows[i * d..(i + 1) * d].copy_from_slice(f);
                }
            }
            Tensor::from_vec(rows, (ids.len(), d), &self.device)?
        };
        Ok(self.decoder.forward_embeds(&x, &blocks, all)?)
    }

    /// The decoder, for text-only steps after a prefill (`forward` of the next token).
    pub fn decoder_mut(&mut self) -> &mut Gemma3 {
        &mut self.decoder
    }

    /// The decoder, for reading its state (cached positions, configuration).
    pub fn decoder(&self) -> &Gemma3 {
        &self.decoder
    }
}

/// Compares a checkpoint's published names and shapes with the expected list: every expected
/// tensor present with its shape, and no other.
pub fn check_parameters(
    expected: &[(String, Vec<usize>)],
    found: &BTreeMap<String, Vec<usize>>,
) -> Result<(), String> {
    let mut problems = Vec::new();
    for (name, shape) in expected {
        match found.get(name) {
            None => problems.push(format!("missing {name}")),
            Some(s) if s != shape => problems.push(format!("{name} is {s:?}, expected {shape:?}")),
            _ => {}
        }
    }
    let known: std::collections::BTreeSet<&str> =
        expected.iter().map(|(n, _)| n.as_str()).collect();
    for name in found.keys().filter(|n| !known.contains(n.as_str())) {
        problems.push(format!("unexpected {name}"));
    }
    if problems.is_empty() {
        return Ok(());
    }
    let n = problems.len();
    problems.truncate(6);
    let more = if n > 6 {
        format!(" (and {} more)", n - 6)
    } else {
        String::new()
    };
    Err(format!(
        "not a Gemma 3 multimodal checkpoint of this config: {}{more}",
        problems.join("; ")
    ))
}
