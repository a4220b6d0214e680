//! The Hugging Face configurations of a LLaVA (`LlavaConfig`, `CLIPVisionConfig`, the text
//! model's `LlamaConfig` / `MistralConfig`) with the defaults `save_pretrained` leaves out.

use std::collections::BTreeMap;
use std::path::Path;

use super::layers::activation;
use crate::ModelError;
use serde::Deserialize;

pub(crate) fn bad_config(why: impl Into<String>) -> ModelError {
    ModelError::Convert {
        what: "LLaVA config.json".into(),
        reason: why.into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Configuration (HF config.json). Fields absent from the file take the defaults of the
// corresponding transformers config class, because `save_pretrained` omits default values.
// ---------------------------------------------------------------------------------------------

/// `CLIPVisionConfig`.
#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    /// Width of the vision encoder's tokens.
    #[serde(default = "d_clip_hidden")]
    pub hidden_size: usize,
    /// Width of the vision encoder's MLP.
    #[serde(default = "d_clip_inter")]
    pub intermediate_size: usize,
    /// Number of vision encoder layers.
    #[serde(default = "d_clip_layers")]
    pub num_hidden_layers: usize,
    /// Attention heads per vision layer.
    #[serde(default = "d_clip_heads")]
    pub num_attention_heads: usize,
    /// Channels of the input image.
    #[serde(default = "d_three")]
    pub num_channels: usize,
    /// Side of the square input image, in pixels.
    #[serde(default = "d_clip_image")]
    pub image_size: usize,
    /// Side of one square patch, in pixels.
    #[serde(default = "d_clip_patch")]
    pub patch_size: usize,
    /// The vision MLP's activation (`quick_gelu` or `gelu`).
    #[serde(default = "d_quick_gelu")]
    pub hidden_act: String,
    /// Epsilon of the vision encoder's layer norms.
    #[serde(default = "d_ln_eps")]
    pub layer_norm_eps: f64,
}

/// `LlamaConfig` / `MistralConfig` (the decoder is the same; defaults differ by `model_type`).
#[derive(Clone, Debug, Deserialize)]
pub struct TextConfig {
    /// `llama` or `mistral`: picks the defaults of the fields left out.
    #[serde(default = "d_llama")]
    pub model_type: String,
    /// Size of the token vocabulary.
    pub vocab_size: Option<usize>,
    /// Width of the decoder's tokens.
    pub hidden_size: Option<usize>,
    /// Width of the decoder's MLP.
    pub intermediate_size: Option<usize>,
    /// Number of decoder layers.
    pub num_hidden_layers: Option<usize>,
    /// Query heads per decoder layer.
    pub num_attention_heads: Option<usize>,
    /// Key/value heads per decoder layer (fewer than query heads with grouped attention).
    pub num_key_value_heads: Option<usize>,
    /// Width of one attention head, when not `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    /// Longest sequence the rotary embeddings were trained for.
    pub max_position_embeddings: Option<usize>,
    /// Epsilon of the RMS norms.
    pub rms_norm_eps: Option<f64>,
    /// Base of the rotary position embeddings.
    pub rope_theta: Option<f64>,
    /// Rotary scaling settings; only none (or the `default` type) is supported.
    pub rope_scaling: Option<serde_json::Value>,
    /// The MLP's activation; only `silu` is supported.
    pub hidden_act: Option<String>,
    /// Whether the attention projections carry biases.
    #[serde(default)]
    pub attention_bias: bool,
    /// Whether the MLP projections carry biases.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Whether the output head shares the token embedding's weights.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mistral only; `None` (null) means full attention.
    pub sliding_window: Option<usize>,
    /// Beginning-of-sequence token id.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id: one id or a list.
    pub eos_token_id: Option<serde_json::Value>,
}

/// `LlavaConfig`.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    /// The CLIP vision tower's configuration.
    #[serde(default = "d_clip_l336")]
    pub vision_config: VisionConfig,
    /// The text decoder's configuration.
    #[serde(default = "d_text")]
    pub text_config: TextConfig,
    /// Token id that marks where the image's tokens go in the prompt.
    #[serde(default = "d_image_token", alias = "image_token_id")]
    pub image_token_index: u32,
    /// Activation between the projector's two linear layers.
    #[serde(default = "d_gelu")]
    pub projector_hidden_act: String,
    /// Which CLIP hidden state feeds the projector (negative counts from the last).
    #[serde(default = "d_feature_layer")]
    pub vision_feature_layer: serde_json::Value,
    /// `default` drops CLIP's CLS token, `full` keeps it.
    #[serde(default = "d_default")]
    pub vision_feature_select_strategy: String,
    /// Whether the projector's linear layers carry biases.
    #[serde(default = "d_true")]
    pub multimodal_projector_bias: bool,
}

pub(crate) fn d_clip_hidden() -> usize {
    768
}
pub(crate) fn d_clip_inter() -> usize {
    3072
}
pub(crate) fn d_clip_layers() -> usize {
    12
}
pub(crate) fn d_clip_heads() -> usize {
    12
}
pub(crate) fn d_three() -> usize {
    3
}
pub(crate) fn d_clip_image() -> usize {
    224
}
pub(crate) fn d_clip_patch() -> usize {
    32
}
pub(crate) fn d_quick_gelu() -> String {
    "quick_gelu".into()
}
pub(crate) fn d_ln_eps() -> f64 {
    1e-5
}
pub(crate) fn d_llama() -> String {
    "llama".into()
}
pub(crate) fn d_image_token() -> u32 {
    32000
}
pub(crate) fn d_gelu() -> String {
    "gelu".into()
}
pub(crate) fn d_feature_layer() -> serde_json::Value {
    serde_json::json!(-2)
}
pub(crate) fn d_default() -> String {
    "default".into()
}
pub(crate) fn d_true() -> bool {
    true
}
/// `LlavaConfig` without a vision config: CLIP ViT-L/14 at 336 px.
pub(crate) fn d_clip_l336() -> VisionConfig {
    VisionConfig {
        hidden_size: 1024,
        intermediate_size: 4096,
        num_hidden_layers: 24,
        num_attention_heads: 16,
        num_channels: 3,
        image_size: 336,
        patch_size: 14,
        hidden_act: "quick_gelu".into(),
        layer_norm_eps: 1e-5,
    }
}
pub(crate) fn d_text() -> TextConfig {
    serde_json::from_value(serde_json::json!({"model_type": "llama"}))
        .unwrap_or_else(|_| unreachable!("a literal config parses"))
}

/// The text decoder's configuration with the defaults of its `model_type` filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoder {
    /// Size of the token vocabulary.
    pub vocab_size: usize,
    /// Width of the decoder's tokens.
    pub hidden_size: usize,
    /// Width of the decoder's MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads per layer.
    pub num_attention_heads: usize,
    /// Key/value heads per layer.
    pub num_key_value_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Longest sequence the rotary embeddings were trained for.
    pub max_position_embeddings: usize,
    /// Epsilon of the RMS norms.
    pub rms_norm_eps: f64,
    /// Base of the rotary position embeddings.
    pub rope_theta: f64,
    /// Whether the attention projections carry biases.
    pub attention_bias: bool,
    /// Whether the MLP projections carry biases.
    pub mlp_bias: bool,
    /// Whether the output head shares the token embedding's weights.
    pub tie_word_embeddings: bool,
    /// Mistral's attention window; `None` means full attention.
    pub sliding_window: Option<usize>,
}

impl TextConfig {
    /// Fills in the `model_type`'s defaults and rejects settings Hilum's decoder cannot run.
    pub fn resolve(&self) -> Result<Decoder, ModelError> {
        // LlamaConfig and MistralConfig defaults (transformers 4.57).
        let mistral = match self.model_type.as_str() {
            "llama" => false,
            "mistral" => true,
            other => {
                return Err(bad_config(format!(
                    "text model `{other}` is not supported: Hilum's LLaVA runs llama and mistral \
                     text models"
                )))
            }
        };
        if let Some(act) = &self.hidden_act {
            if act != "silu" {
                return Err(bad_config(format!("text hidden_act `{act}`: only silu")));
            }
        }
        match &self.rope_scaling {
            None | Some(serde_json::Value::Null) => {}
            Some(v) => {
                let kind = v
                    .get("rope_type")
                    .or_else(|| v.get("type"))
                    .and_then(|t| t.as_str());
                if kind != Some("default") {
                    return Err(bad_config(format!("rope_scaling {v} is not supported")));
                }
            }
        }
        let hidden = self.hidden_size.unwrap_or(4096);
        let heads = self.num_attention_heads.unwrap_or(32);
        if heads == 0 || (!hidden.is_multiple_of(heads) && self.head_dim.is_none()) {
            return Err(bad_config(format!(
                "hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )));
        }
        let kv = self
            .num_key_value_heads
            .unwrap_or(if mistral { 8 } else { heads });
        if kv == 0 || !heads.is_multiple_of(kv) {
            return Err(bad_config(format!(
                "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
            )));
        }
        Ok(Decoder {
            vocab_size: self.vocab_size.unwrap_or(32000),
            hidden_size: hidden,
            intermediate_size: self.intermediate_size.unwrap_or(if mistral {
                14336
            } else {
                11008
            }),
            num_hidden_layers: self.num_hidden_layers.unwrap_or(32),
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: self.head_dim.unwrap_or(hidden / heads),
            max_position_embeddings: self.max_position_embeddings.unwrap_or(if mistral {
                4096 * 32
            } else {
                2048
            }),
            rms_norm_eps: self.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: self.rope_theta.unwrap_or(10000.0),
            attention_bias: self.attention_bias,
            mlp_bias: self.mlp_bias,
            tie_word_embeddings: self.tie_word_embeddings,
            sliding_window: if mistral { self.sliding_window } else { None },
        })
    }

    /// End-of-sequence ids named by the config (one id or a list).
    pub fn eos_ids(&self) -> Vec<u32> {
        match &self.eos_token_id {
            Some(serde_json::Value::Number(n)) => {
                n.as_u64().map(|v| v as u32).into_iter().collect()
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|v| v as u32))
                .collect(),
            _ => vec![2],
        }
    }
}

impl Config {
    /// Reads an HF `config.json`.
    pub fn from_json_file(path: &Path) -> Result<Config, ModelError> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::Convert { reason, .. } => ModelError::Convert {
                what: path.display().to_string(),
                reason,
            },
            other => other,
        })
    }

    /// Parses the text of an HF `config.json` and checks Hilum can run it.
    pub fn from_json(text: &str) -> Result<Config, ModelError> {
        let cfg: Config = serde_json::from_str(text)
            .map_err(|e| bad_config(format!("not a LlavaConfig: {e}")))?;
        cfg.check()?;
        Ok(cfg)
    }

    pub(crate) fn check(&self) -> Result<(), ModelError> {
        self.text_config.resolve()?;
        self.feature_layer_index()?;
        match self.vision_feature_select_strategy.as_str() {
            "default" | "full" => {}
            s => return Err(bad_config(format!("vision_feature_select_strategy `{s}`"))),
        }
        activation(&self.projector_hidden_act)?;
        activation(&self.vision_config.hidden_act)?;
        let v = &self.vision_config;
        if v.patch_size == 0 || !v.image_size.is_multiple_of(v.patch_size) {
            return Err(bad_config(format!(
                "image_size {} is not a multiple of patch_size {}",
                v.image_size, v.patch_size
            )));
        }
        if v.num_attention_heads == 0 || !v.hidden_size.is_multiple_of(v.num_attention_heads) {
            return Err(bad_config("vision hidden_size not a multiple of its heads"));
        }
        Ok(())
    }

    /// Number of encoder layers to run: the index into CLIP's `hidden_states` tuple
    /// (embeddings, layer 1, ..., layer N) that `vision_feature_layer` selects.
    pub fn feature_layer_index(&self) -> Result<usize, ModelError> {
        let n = self.vision_config.num_hidden_layers as i64;
        let l = self.vision_feature_layer.as_i64().ok_or_else(|| {
            bad_config(format!(
                "vision_feature_layer {} (a list of layers is not supported)",
                self.vision_feature_layer
            ))
        })?;
        let idx = if l < 0 { n + 1 + l } else { l };
        if !(0..=n).contains(&idx) {
            return Err(bad_config(format!(
                "vision_feature_layer {l} out of range for {n} layers"
            )));
        }
        Ok(idx as usize)
    }

    /// Image tokens per image: one per patch (plus CLS with the "full" strategy).
    pub fn image_seq_length(&self) -> usize {
        let side = self.vision_config.image_size / self.vision_config.patch_size.max(1);
        side * side + usize::from(self.vision_feature_select_strategy == "full")
    }

    /// Every parameter of the checkpoint, name → shape, as `save_pretrained` writes it.
    pub fn expected_params(&self) -> Result<BTreeMap<String, Vec<usize>>, ModelError> {
        let mut p = BTreeMap::new();
        let v = &self.vision_config;
        let t = self.text_config.resolve()?;
        let vm = "vision_tower.vision_model";
        let (vd, vi) = (v.hidden_size, v.intermediate_size);
        let n_pos = (v.image_size / v.patch_size).pow(2) + 1;
        let mut put = |k: String, s: &[usize]| {
            p.insert(k, s.to_vec());
        };
        put(format!("{vm}.embeddings.class_embedding"), &[vd]);
        put(
            format!("{vm}.embeddings.patch_embedding.weight"),
            &[vd, v.num_channels, v.patch_size, v.patch_size],
        );
        put(
            format!("{vm}.embeddings.position_embedding.weight"),
            &[n_pos, vd],
        );
        for ln in ["pre_layrnorm", "post_layernorm"] {
            put(format!("{vm}.{ln}.weight"), &[vd]);
            put(format!("{vm}.{ln}.bias"), &[vd]);
        }
        for i in 0..v.num_hidden_layers {
            let l = format!("{vm}.encoder.layers.{i}");
            for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
                put(format!("{l}.self_attn.{proj}.weight"), &[vd, vd]);
                put(format!("{l}.self_attn.{proj}.bias"), &[vd]);
            }
            for ln in ["layer_norm1", "layer_norm2"] {
                put(format!("{l}.{ln}.weight"), &[vd]);
                put(format!("{l}.{ln}.bias"), &[vd]);
            }
            put(format!("{l}.mlp.fc1.weight"), &[vi, vd]);
            put(format!("{l}.mlp.fc1.bias"), &[vi]);
            put(format!("{l}.mlp.fc2.weight"), &[vd, vi]);
            put(format!("{l}.mlp.fc2.bias"), &[vd]);
        }
        let mp = "multi_modal_projector";
        put(format!("{mp}.linear_1.weight"), &[t.hidden_size, vd]);
        put(
            format!("{mp}.linear_2.weight"),
            &[t.hidden_size, t.hidden_size],
        );
        if self.multimodal_projector_bias {
            put(format!("{mp}.linear_1.bias"), &[t.hidden_size]);
            put(format!("{mp}.linear_2.bias"), &[t.hidden_size]);
        }
        let lm = "language_model.model";
        let (h, hd) = (t.hidden_size, t.head_dim);
        let (q, kv) = (t.num_attention_heads * hd, t.num_key_value_heads * hd);
        put(format!("{lm}.embed_tokens.weight"), &[t.vocab_size, h]);
        put(format!("{lm}.norm.weight"), &[h]);
        if !t.tie_word_embeddings {
            put("language_model.lm_head.weight".into(), &[t.vocab_size, h]);
        }
        for i in 0..t.num_hidden_layers {
            let l = format!("{lm}.layers.{i}");
            for (proj, out, inp) in [
                ("q_proj", q, h),
                ("k_proj", kv, h),
                ("v_proj", kv, h),
                ("o_proj", h, q),
            ] {
                put(format!("{l}.self_attn.{proj}.weight"), &[out, inp]);
                if t.attention_bias {
                    put(format!("{l}.self_attn.{proj}.bias"), &[out]);
                }
            }
            for (proj, out, inp) in [
                ("gate_proj", t.intermediate_size, h),
                ("up_proj", t.intermediate_size, h),
                ("down_proj", h, t.intermediate_size),
            ] {
                put(format!("{l}.mlp.{proj}.weight"), &[out, inp]);
                if t.mlp_bias {
                    put(format!("{l}.mlp.{proj}.bias"), &[out]);
                }
            }
            put(format!("{l}.input_layernorm.weight"), &[h]);
            put(format!("{l}.post_attention_layernorm.weight"), &[h]);
        }
        Ok(p)
    }
}
