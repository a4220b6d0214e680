//! LLaVA-1.5 (Liu et al., "Improved Baselines with Visual Instruction Tuning", CVPR 2024) and
//! LLaVA-Med v1.5 (Li et al., "LLaVA-Med", NeurIPS 2023) in the Hugging Face
//! `LlavaForConditionalGeneration` layout (transformers `models/llava/modeling_llava.py`), with
//! the published parameter names, so converted checkpoints (`llava-hf/llava-1.5-7b-hf`, the
//! HF-format LLaVA-Med conversions) load unchanged:
//!
//! - `vision_tower.vision_model.*`: a CLIP ViT (`models/clip/modeling_clip.py`); the features are
//!   the hidden state of `vision_feature_layer` (-2: the second-to-last encoder layer), CLS token
//!   dropped (`vision_feature_select_strategy = "default"`);
//! - `multi_modal_projector.linear_1` → GELU → `linear_2`;
//! - `language_model.model.*` + `language_model.lm_head`: a Llama or Mistral decoder
//!   (`models/llama/modeling_llama.py`); every `<image>` token of the prompt stands for one
//!   image patch, its embedding replaced by that patch's projected feature.
//!
//! Mistral's sliding window is not implemented: a sequence longer than the window is refused
//! (LLaVA-Med v1.5's Mistral-7B-Instruct-v0.2 sets no window; prompts here are < 1k tokens).
//!
//! candle-transformers 0.11.1 has a `llava` module, but it does not load these checkpoints:
//! in HF mode it requires an `image_newline` tensor (a LLaVA-NeXT parameter that
//! `LlavaForConditionalGeneration` checkpoints lack), reads the original LLaVA repository's
//! config rather than the HF `LlavaConfig`, and its Llama returns only the last position's
//! logits. The vision tower and projector are written on candle-nn's layers instead; the text
//! decoder is the local GGUF engine's Llama-family decoder
//! ([`hilum_llm_local::model::Model::from_dense`]), so one implementation serves both.
//!
//! Its input is an image-store recipe ([`recipe`]): the slow `CLIPImageProcessor` (PIL bicubic
//! resize of the shortest side, centre crop, CLIP mean/std), optionally after LLaVA-1.5's
//! `expand2square` padding with the mean colour (`image_aspect_ratio = "pad"`).
//!
//! Its parts: [`config`] (the HF configurations and their defaults), [`clip`] (the CLIP vision
//! tower and the `CLIPImageProcessor` preprocessing), [`layers`] (the tower's and the
//! projector's linear layers, activations and attention); this
//! file is the LLaVA glue (projector, text decoder, image-token merge, greedy decoding) and the
//! installed model.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::{Device, IndexOp, Module, Tensor, D};
use candle_nn::VarBuilder;
use hilum_imaging::{Prepared, Preprocess};
use hilum_llm_local::model::{self as lm, Model as TextModel};

use crate::ModelError;

pub mod clip;
pub mod config;
pub mod layers;

pub use clip::{preprocess, recipe, AspectMode, CLIP_MEAN, CLIP_STD};
pub use config::{Config, Decoder, TextConfig, VisionConfig};
/// How the text decoder's matrices are stored: the local engine's, as the decoder is.
pub use hilum_llm_local::model::Precision;

use clip::ClipVision;
use config::bad_config;
use layers::{activation, Act, Lin};

/// Keys and values of every decoder layer for the positions seen so far (empty until the
/// first [`Llava::forward_embeds`]: the model it belongs to gives it its shape).
#[derive(Default)]
pub struct KvCache(Option<lm::KvCache>);

impl KvCache {
    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.0.as_ref().map_or(0, lm::KvCache::len)
    }

    /// Whether no position is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache").field("len", &self.len()).finish()
    }
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

/// `LlavaForConditionalGeneration`.
pub struct Llava {
    vision: ClipVision,
    linear_1: Lin,
    linear_2: Lin,
    projector_act: Act,
    text: TextModel,
    /// The resolved text configuration (vocabulary, positions, Mistral's window).
    dec: Decoder,
    cfg: Config,
    device: Device,
}

impl std::fmt::Debug for Llava {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Llava")
            .field("cfg", &self.cfg)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// The text decoder of a `LlavaForConditionalGeneration` checkpoint (`language_model.*`).
fn text_model(vb: VarBuilder, t: &Decoder, precision: Precision) -> candle_core::Result<TextModel> {
    let cfg = lm::Config {
        arch: lm::Arch::Llama,
        n_layer: t.num_hidden_layers,
        n_embd: t.hidden_size,
        n_head: t.num_attention_heads,
        n_kv_head: t.num_key_value_heads,
        head_dim: t.head_dim,
        context_length: t.max_position_embeddings,
        rms_eps: t.rms_norm_eps,
        rope_base: t.rope_theta as f32,
        // transformers' rotate_half on the checkpoint's unpermuted q/k rows.
        rope: lm::Rope::Halves,
    };
    let layout = lm::DenseLayout {
        vocab: t.vocab_size,
        intermediate: t.intermediate_size,
        attention_bias: t.attention_bias,
        mlp_bias: t.mlp_bias,
        tied_embeddings: t.tie_word_embeddings,
        quantize: precision.ggml(),
    };
    let dev = vb.device().clone();
    TextModel::from_dense(
        cfg,
        &layout,
        &mut |n| vb.get_unchecked(n),
        t.max_position_embeddings,
        &dev,
    )
}

/// What greedy decoding produced.
#[derive(Clone, Debug)]
pub struct Generation {
    /// New tokens, the stop token included when one ended the generation.
    pub ids: Vec<u32>,
    /// Length of the prompt (image tokens included).
    pub prompt_tokens: usize,
    /// Whether a stop token ended it (else the length limit did).
    pub stopped: bool,
    /// Image encoding + prompt forward, in seconds.
    pub prefill_secs: f64,
    /// The per-token decode loop, in seconds.
    pub decode_secs: f64,
}

impl Llava {
    /// Builds the model from a `VarBuilder` at the checkpoint's root.
    pub fn load(vb: VarBuilder, cfg: &Config, precision: Precision) -> Result<Llava, ModelError> {
        cfg.check()?;
        let t = cfg.text_config.resolve()?;
        let vd = cfg.vision_config.hidden_size;
        let mp = vb.pp("multi_modal_projector");
        let bias = cfg.multimodal_projector_bias;
        Ok(Llava {
            vision: ClipVision::load(
                vb.pp("vision_tower.vision_model"),
                &cfg.vision_config,
                cfg.feature_layer_index()?,
            )?,
            linear_1: Lin::load(mp.pp("linear_1"), vd, t.hidden_size, bias)?,
            linear_2: Lin::load(mp.pp("linear_2"), t.hidden_size, t.hidden_size, bias)?,
            projector_act: activation(&cfg.projector_hidden_act)?,
            text: text_model(vb.pp("language_model"), &t, precision)?,
            dec: t,
            cfg: cfg.clone(),
            device: vb.device().clone(),
        })
    }

    /// The configuration the model was built from.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// The device its weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Projected image features, (b, image_seq_length, text hidden), from pixel values
    /// (b, 3, S, S) as [`preprocess`] makes them.
    pub fn encode_images(&self, pixel_values: &Tensor) -> Result<Tensor, ModelError> {
        let hs = self.vision.forward(pixel_values)?;
        let feats = if self.cfg.vision_feature_select_strategy == "default" {
            hs.i((.., 1..))?
        } else {
            hs
        };
        let x = self.linear_1.forward(&feats)?;
        let x = self.projector_act.apply(&x)?;
        Ok(self.linear_2.forward(&x)?)
    }

    /// Replaces the image-token runs of `ids` by the rows of `features` (n_images * seq, d),
    /// in order, as transformers' `masked_scatter` does. Returns (1, len(ids), d).
    pub fn embed(&self, ids: &[u32], features: Option<&Tensor>) -> Result<Tensor, ModelError> {
        let vocab = self.dec.vocab_size;
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(ModelError::Compute(format!(
                "token id {bad} is outside the vocabulary ({vocab}): the tokenizer does not \
                 belong to these weights"
            )));
        }
        let img = self.cfg.image_token_index;
        let n_img = ids.iter().filter(|&&i| i == img).count();
        let n_feat = features.map_or(Ok(0), |f| f.dim(0))?;
        if n_img != n_feat {
            return Err(ModelError::Compute(format!(
                "the prompt has {n_img} image tokens but the images give {n_feat} features"
            )));
        }
        let text = self.text.embed_tokens(ids)?;
        let Some(features) = features.filter(|_| n_img > 0) else {
            return Ok(text.unsqueeze(0)?);
        };
        let features = features.to_dtype(text.dtype())?;
        // Contiguous runs of text or image positions, concatenated in order.
        let mut parts = Vec::new();
        let (mut i, mut f) = (0, 0);
        while i < ids.len() {
            let is_img = ids[i] == img;
            let j = (i..ids.len())
                .find(|&j| (ids[j] == img) != is_img)
                .unwrap_or(ids.len());
            if is_img {
                parts.push(features.narrow(0, f, j - i)?);
                f += j - i;
            } else {
                parts.push(text.narrow(0, i, j - i)?);
            }
            i = j;
        }
        Ok(Tensor::cat(&parts, 0)?.unsqueeze(0)?)
    }

    /// Logits (1, t, vocab) for embeddings (1, t, hidden) that follow the cached positions.
    pub fn forward_embeds(
        &self,
        embeds: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        Ok(self.run(embeds, cache, true)?.unsqueeze(0)?)
    }

    /// The decoder over `embeds` (1, t, hidden): logits of every position (t, vocab), or of the
    /// last (vocab) when `all` is false.
    fn run(&self, embeds: &Tensor, cache: &mut KvCache, all: bool) -> Result<Tensor, ModelError> {
        let (b, t, _) = embeds.dims3()?;
        if b != 1 {
            return Err(ModelError::Compute(format!(
                "the decoder runs one sequence at a time, not {b}"
            )));
        }
        let c = &self.dec;
        let total = cache.len() + t;
        if let Some(w) = c.sliding_window.filter(|&w| total > w) {
            return Err(ModelError::Compute(format!(
                "{total} tokens exceed Mistral's sliding window ({w}), which Hilum does not implement"
            )));
        }
        if total > c.max_position_embeddings {
            return Err(ModelError::Compute(format!(
                "{total} tokens exceed the model's {} positions",
                c.max_position_embeddings
            )));
        }
        let kv = cache.0.get_or_insert_with(|| self.text.new_cache());
        Ok(self.text.forward_embeds(&embeds.squeeze(0)?, kv, all)?)
    }

    /// Logits of the whole prompt, (1, t, vocab), from a fresh cache.
    pub fn forward(
        &self,
        ids: &[u32],
        pixel_values: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let feats = match pixel_values {
            Some(p) => Some(self.encode_images(p)?.flatten_to(1)?),
            None => None,
        };
        let e = self.embed(ids, feats.as_ref())?;
        self.forward_embeds(&e, &mut KvCache::default())
    }

    /// Greedy decoding with a KV cache: the prompt (image tokens already expanded, see
    /// [`expand_image_tokens`]) in one forward, then one token per step until a stop token,
    /// `max_new_tokens` or the model's last position. `on_token` sees each new id as it is
    /// chosen.
    pub fn generate(
        &self,
        ids: &[u32],
        pixel_values: Option<&Tensor>,
        max_new_tokens: usize,
        stop: &[u32],
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, ModelError> {
        // The answer ends where the model's positions (or Mistral's window) run out.
        let c = &self.dec;
        let limit = c.sliding_window.map_or(c.max_position_embeddings, |w| {
            w.min(c.max_position_embeddings)
        });
        let max_new_tokens = max_new_tokens.min(limit.saturating_sub(ids.len()));
        let t0 = Instant::now();
        let mut cache = KvCache::default();
        let feats = match pixel_values {
            Some(p) => Some(self.encode_images(p)?.flatten_to(1)?),
            None => None,
        };
        let e = self.embed(ids, feats.as_ref())?;
        // Only the last position's logits choose the next token.
        let mut logits = self.run(&e, &mut cache, false)?;
        // GPU kernels run asynchronously: wait for them, or the prefill time is only the launch.
        self.device.synchronize()?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut out = Vec::new();
        let mut stopped = false;
        while out.len() < max_new_tokens {
            let next = logits.argmax(D::Minus1)?.to_scalar::<u32>()?;
            out.push(next);
            on_token(next);
            if stop.contains(&next) {
                stopped = true;
                break;
            }
            if out.len() == max_new_tokens {
                break;
            }
            let e = self.embed(&[next], None)?;
            logits = self.run(&e, &mut cache, false)?;
        }
        Ok(Generation {
            ids: out,
            prompt_tokens: ids.len(),
            stopped,
            prefill_secs,
            decode_secs: t1.elapsed().as_secs_f64(),
        })
    }
}

/// Replaces each `<image>` token of a tokenised prompt by `seq_len` copies (one per patch), as
/// transformers' `LlavaProcessor` does before the model sees the ids.
pub fn expand_image_tokens(ids: &[u32], image_token: u32, seq_len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(ids.len() + seq_len);
    for &i in ids {
        if i == image_token {
            out.extend(std::iter::repeat_n(image_token, seq_len));
        } else {
            out.push(i);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// An installed LLaVA: network, tokenizer, prompt
// ---------------------------------------------------------------------------------------------

/// The tokenizer file an installed LLaVA keeps beside `model.safetensors`.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// The `config.json` an installed LLaVA may keep beside `model.safetensors`.
pub const CONFIG_FILE: &str = "config.json";

/// A LLaVA ready to answer questions about a radiograph: the network, its Hugging Face
/// tokenizer, and the manifest's prompt and preprocessing.
pub struct NativeVlm {
    /// The network.
    pub model: Llava,
    /// The Hugging Face tokenizer of the text decoder.
    pub tokenizer: tokenizers::Tokenizer,
    /// How a radiograph is fitted to the vision tower's square input.
    pub aspect: AspectMode,
    /// Prompt template with `<image>` and `{question}`.
    pub prompt: String,
    /// Longest answer, in new tokens.
    pub max_new_tokens: usize,
    /// Ids that end an answer: the config's `eos_token_id` and the tokenizer's `</s>`.
    pub stop: Vec<u32>,
    /// How the text decoder's matrices are stored.
    pub precision: Precision,
}

/// One answer of [`NativeVlm::answer`].
#[derive(Clone, Debug)]
pub struct NativeAnswer {
    /// The decoded answer.
    pub text: String,
    /// The tokens and timings behind it.
    pub generation: Generation,
}

impl NativeAnswer {
    /// Decode speed (new tokens after the first, per second of the decode loop).
    pub fn tokens_per_second(&self) -> Option<f64> {
        let g = &self.generation;
        (g.ids.len() > 1 && g.decode_secs > 0.0).then(|| (g.ids.len() - 1) as f64 / g.decode_secs)
    }
}

/// The LLaVA configuration for installed weights: `config.json` beside them, else the
/// manifest's `[config]` table.
pub fn config_for(manifest: &crate::Manifest, weights: &Path) -> Result<Config, ModelError> {
    let beside = weights.with_file_name(CONFIG_FILE);
    if beside.is_file() {
        return Config::from_json_file(&beside);
    }
    manifest_config(manifest)
}

/// The manifest's `[config]` table as a LLaVA configuration.
pub fn manifest_config(manifest: &crate::Manifest) -> Result<Config, ModelError> {
    let v = serde_json::to_value(&manifest.config).map_err(|e| bad_config(e.to_string()))?;
    Config::from_json(&v.to_string())
}

/// How to run the model: the manifest's `[postprocessing] quantize`, overridden by `quantize`
/// ([`ModelSettings::llava_quantize`](crate::ModelSettings::llava_quantize): none, q8_0, q4k;
/// empty counts as unset).
pub fn precision_for(
    manifest: &crate::Manifest,
    quantize: Option<&str>,
) -> Result<Precision, ModelError> {
    let v = match quantize.filter(|v| !v.is_empty()) {
        Some(v) => v,
        None => manifest
            .postprocessing
            .get("quantize")
            .and_then(|v| v.as_str())
            .unwrap_or("none"),
    };
    v.parse().map_err(|reason| ModelError::Manifest {
        id: "llava".into(),
        reason,
    })
}

impl NativeVlm {
    /// Loads installed weights (`model.safetensors` with `tokenizer.json` and optionally
    /// `config.json` in the same folder), quantized as [`precision_for`] says.
    pub fn load_installed(
        manifest: &crate::Manifest,
        weights: &Path,
        device: crate::Device,
        quantize: Option<&str>,
    ) -> Result<NativeVlm, ModelError> {
        let id = &manifest.id;
        let tok_path = weights.with_file_name(TOKENIZER_FILE);
        if !tok_path.is_file() {
            return Err(ModelError::Corrupt {
                id: id.clone(),
                reason: format!(
                    "{} is missing: run `python3 scripts/convert_llava.py SNAPSHOT_DIR OUT_DIR` on \
                     the Hugging Face snapshot, which puts tokenizer.json beside model.safetensors",
                    tok_path.display()
                ),
            });
        }
        let tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| ModelError::Corrupt {
                id: id.clone(),
                reason: format!("{}: {e}", tok_path.display()),
            })?;
        let cfg = config_for(manifest, weights)?;
        match tokenizer.token_to_id("<image>") {
            Some(t) if t == cfg.image_token_index => {}
            other => {
                return Err(ModelError::Corrupt {
                    id: id.clone(),
                    reason: format!(
                        "{} maps <image> to {other:?}, the config's image_token_index is {}: the \
                         tokenizer does not belong to these weights",
                        tok_path.display(),
                        cfg.image_token_index
                    ),
                })
            }
        }
        let precision = precision_for(manifest, quantize)?;
        let vb = crate::weights::var_builder(weights, device)?;
        let model = Llava::load(vb, &cfg, precision).map_err(|e| match e {
            ModelError::Compute(m) => ModelError::WeightsMismatch {
                what: weights.display().to_string(),
                architecture: "llava".into(),
                details: m,
            },
            other => other,
        })?;
        let text = |k: &str, d: &str| {
            manifest
                .preprocessing
                .get(k)
                .and_then(|v| v.as_str())
                .unwrap_or(d)
                .to_string()
        };
        let aspect = match text("image_aspect_ratio", "crop").as_str() {
            "pad" => AspectMode::Pad,
            "crop" => AspectMode::Crop,
            other => {
                return Err(ModelError::Manifest {
                    id: id.clone(),
                    reason: format!("image_aspect_ratio `{other}`: use pad or crop"),
                })
            }
        };
        let prompt = text("prompt", "USER: <image>\n{question} ASSISTANT:");
        if !prompt.contains("<image>") || !prompt.contains("{question}") {
            return Err(ModelError::Manifest {
                id: id.clone(),
                reason: "the prompt must contain <image> and {question}".into(),
            });
        }
        let mut stop = cfg.text_config.eos_ids();
        stop.extend(tokenizer.token_to_id("</s>"));
        stop.sort_unstable();
        stop.dedup();
        let max_new_tokens = manifest
            .postprocessing
            .get("max_new_tokens")
            .and_then(|v| v.as_integer())
            .map_or(256, |v| v.max(1) as usize);
        Ok(NativeVlm {
            model,
            tokenizer,
            aspect,
            prompt,
            max_new_tokens,
            stop,
            precision,
        })
    }

    /// The token ids of the prompt for `question`, `<image>` expanded to one id per patch.
    pub fn prompt_ids(&self, question: &str) -> Result<Vec<u32>, ModelError> {
        // The question must not smuggle in image tokens of its own.
        let q = question.replace("<image>", "image");
        let text = self.prompt.replace("{question}", &q);
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| ModelError::Compute(format!("tokenizer: {e}")))?;
        let cfg = self.model.config();
        Ok(expand_image_tokens(
            enc.get_ids(),
            cfg.image_token_index,
            cfg.image_seq_length(),
        ))
    }

    /// The vision tower's input: the image store computes it ([`recipe`]) once per image.
    pub fn recipe(&self) -> Preprocess {
        recipe(self.model.config().vision_config.image_size, self.aspect)
    }

    /// Answers `question` about a radiograph prepared by [`NativeVlm::recipe`], greedily.
    pub fn answer(
        &self,
        input: &Prepared,
        question: &str,
        max_new_tokens: Option<usize>,
    ) -> Result<NativeAnswer, ModelError> {
        let recipe = self.recipe();
        crate::runner::check_input(&recipe, input)?;
        let size = recipe.width as usize;
        let px = Tensor::from_slice(&input.data, (1, 3, size, size), self.model.device())?;
        let ids = self.prompt_ids(question)?;
        let generation = self.model.generate(
            &ids,
            Some(&px),
            max_new_tokens.unwrap_or(self.max_new_tokens),
            &self.stop,
            |_| {},
        )?;
        let text = self
            .tokenizer
            .decode(&generation.ids, true)
            .map_err(|e| ModelError::Compute(format!("tokenizer: {e}")))?;
        Ok(NativeAnswer {
            text: text.trim().to_string(),
            generation,
        })
    }
}

impl crate::Model for NativeVlm {
    fn load(
        manifest: &crate::Manifest,
        installed: &crate::InstalledModel,
        device: crate::Device,
        backend: crate::Backend,
        settings: &crate::ModelSettings,
    ) -> Result<Self, ModelError> {
        backend.expect(&[crate::Backend::Candle], &manifest.id)?;
        let quantize = settings.llava_quantize.as_deref();
        NativeVlm::load_installed(manifest, &installed.weights, device, quantize)
    }
}

/// LLaVA in the table of architectures: candle only, its layout given by the `config.json`
/// that travels with the weights (else the manifest's).
pub struct LlavaArch;

impl crate::Architecture for LlavaArch {
    fn name(&self) -> &'static str {
        "llava"
    }

    fn expected_params(
        &self,
        m: &crate::Manifest,
        weights: Option<&Path>,
    ) -> Result<Option<crate::architecture::Params>, ModelError> {
        match weights {
            Some(w) => expected_params_for(m, w).map(Some),
            None => manifest_config(m)?.expected_params().map(Some),
        }
    }

    fn device_checks(&self) -> Vec<crate::architecture::DeviceCheck> {
        vec![crate::architecture::DeviceCheck {
            name: "llava-slice",
            run: crate::devcheck::llava_slice,
        }]
    }
}

/// Parameter names and shapes for weights at `weights` (their `config.json`, else the
/// manifest's), for the registry's architecture check.
pub fn expected_params_for(
    manifest: &crate::Manifest,
    weights: &Path,
) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
    config_for(manifest, weights)?.expected_params()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_transformers_for_a_minimal_llava_hf_config() {
        // The text_config of llava-hf/llava-1.5-7b-hf lists only what differs from LlamaConfig.
        let cfg = Config::from_json(
            r#"{"model_type": "llava", "image_token_index": 32000,
                "text_config": {"model_type": "llama", "max_position_embeddings": 4096,
                                "rms_norm_eps": 1e-05, "vocab_size": 32064},
                "vision_config": {"hidden_size": 1024, "image_size": 336,
                  "intermediate_size": 4096, "num_attention_heads": 16,
                  "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768}}"#,
        )
        .expect("valid");
        let t = cfg.text_config.resolve().expect("llama");
        assert_eq!(
            (t.hidden_size, t.intermediate_size, t.num_key_value_heads),
            (4096, 11008, 32)
        );
        assert_eq!(cfg.feature_layer_index().expect("layer"), 23);
        assert_eq!(cfg.image_seq_length(), 576);
        let m: Config =
            serde_json::from_str(r#"{"text_config": {"model_type": "mistral"}}"#).expect("valid");
        let t = m.text_config.resolve().expect("mistral");
        assert_eq!((t.intermediate_size, t.num_key_value_heads), (14336, 8));
        assert!(Config::from_json(r#"{"text_config": {"model_type": "gemma"}}"#).is_err());
    }

    #[test]
    fn image_tokens_expand_in_place() {
        assert_eq!(expand_image_tokens(&[1, 9, 5], 9, 3), vec![1, 9, 9, 9, 5]);
        assert_eq!(expand_image_tokens(&[1, 5], 9, 3), vec![1, 5]);
    }

    #[test]
    fn bicubic_keeps_a_flat_image_flat_and_pad_centres_the_image() {
        let flat = vec![77u8; 40 * 30];
        assert!(hilum_imaging::resize_pil_u8(
            &flat,
            40,
            30,
            13,
            9,
            hilum_imaging::PilKernel::Bicubic
        )
        .iter()
        .all(|&v| v == 77));
        // A white 20x10 image padded to 20x20: rows 0..5 and 15..20 take the mean colour.
        let px = preprocess(&[255u8; 200], 20, 10, 20, AspectMode::Pad, &Device::Cpu)
            .expect("preprocess");
        let r = px
            .i((0, 0))
            .and_then(|t| t.to_vec2::<f32>())
            .expect("plane");
        let bg = (((CLIP_MEAN[0] * 255.0).floor() / 255.0 - CLIP_MEAN[0]) / CLIP_STD[0]) as f32;
        let white = ((1.0 - CLIP_MEAN[0]) / CLIP_STD[0]) as f32;
        assert!((r[0][0] - bg).abs() < 1e-6 && (r[19][19] - bg).abs() < 1e-6);
        assert!((r[10][10] - white).abs() < 1e-6);
    }
}
