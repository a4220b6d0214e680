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
//! logits. The blocks below are written on candle-nn's layers instead.
//!
//! Preprocessing ([`preprocess`]) reproduces the slow `CLIPImageProcessor` (PIL bicubic resize of
//! the shortest side, centre crop, CLIP mean/std), optionally after LLaVA-1.5's
//! `expand2square` padding with the mean colour (`image_aspect_ratio = "pad"`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, IndexOp, Module, Tensor, D};
use candle_nn::{Conv2d, Conv2dConfig, Embedding, LayerNorm, RmsNorm, VarBuilder};
use serde::Deserialize;

use crate::ModelError;

/// CLIP's normalisation (OpenAI CLIP, also in `CLIPImageProcessor` of LLaVA checkpoints).
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

fn bad_config(why: impl Into<String>) -> ModelError {
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
    #[serde(default = "d_clip_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_clip_inter")]
    pub intermediate_size: usize,
    #[serde(default = "d_clip_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_clip_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_three")]
    pub num_channels: usize,
    #[serde(default = "d_clip_image")]
    pub image_size: usize,
    #[serde(default = "d_clip_patch")]
    pub patch_size: usize,
    #[serde(default = "d_quick_gelu")]
    pub hidden_act: String,
    #[serde(default = "d_ln_eps")]
    pub layer_norm_eps: f64,
}

/// `LlamaConfig` / `MistralConfig` (the decoder is the same; defaults differ by `model_type`).
#[derive(Clone, Debug, Deserialize)]
pub struct TextConfig {
    #[serde(default = "d_llama")]
    pub model_type: String,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub max_position_embeddings: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mistral only; `None` (null) means full attention.
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<serde_json::Value>,
}

/// `LlavaConfig`.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    #[serde(default = "d_clip_l336")]
    pub vision_config: VisionConfig,
    #[serde(default = "d_text")]
    pub text_config: TextConfig,
    #[serde(default = "d_image_token", alias = "image_token_id")]
    pub image_token_index: u32,
    #[serde(default = "d_gelu")]
    pub projector_hidden_act: String,
    #[serde(default = "d_feature_layer")]
    pub vision_feature_layer: serde_json::Value,
    #[serde(default = "d_default")]
    pub vision_feature_select_strategy: String,
    #[serde(default = "d_true")]
    pub multimodal_projector_bias: bool,
}

fn d_clip_hidden() -> usize {
    768
}
fn d_clip_inter() -> usize {
    3072
}
fn d_clip_layers() -> usize {
    12
}
fn d_clip_heads() -> usize {
    12
}
fn d_three() -> usize {
    3
}
fn d_clip_image() -> usize {
    224
}
fn d_clip_patch() -> usize {
    32
}
fn d_quick_gelu() -> String {
    "quick_gelu".into()
}
fn d_ln_eps() -> f64 {
    1e-5
}
fn d_llama() -> String {
    "llama".into()
}
fn d_image_token() -> u32 {
    32000
}
fn d_gelu() -> String {
    "gelu".into()
}
fn d_feature_layer() -> serde_json::Value {
    serde_json::json!(-2)
}
fn d_default() -> String {
    "default".into()
}
fn d_true() -> bool {
    true
}
/// `LlavaConfig` without a vision config: CLIP ViT-L/14 at 336 px.
fn d_clip_l336() -> VisionConfig {
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
fn d_text() -> TextConfig {
    serde_json::from_value(serde_json::json!({"model_type": "llama"}))
        .unwrap_or_else(|_| unreachable!("a literal config parses"))
}

/// The text decoder's configuration with the defaults of its `model_type` filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Decoder {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub tie_word_embeddings: bool,
    pub sliding_window: Option<usize>,
}

impl TextConfig {
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

    pub fn from_json(text: &str) -> Result<Config, ModelError> {
        let cfg: Config = serde_json::from_str(text)
            .map_err(|e| bad_config(format!("not a LlavaConfig: {e}")))?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), ModelError> {
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

// ---------------------------------------------------------------------------------------------
// Layers
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    QuickGelu,
    /// Exact (erf) GELU: transformers' "gelu".
    Gelu,
    /// tanh approximation: "gelu_new", "gelu_pytorch_tanh".
    GeluTanh,
}

fn activation(name: &str) -> Result<Act, ModelError> {
    match name {
        "quick_gelu" => Ok(Act::QuickGelu),
        "gelu" => Ok(Act::Gelu),
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Act::GeluTanh),
        other => Err(bad_config(format!("activation `{other}` is not supported"))),
    }
}

impl Act {
    fn apply(self, xs: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Act::QuickGelu => xs * candle_nn::ops::sigmoid(&(xs * 1.702)?)?,
            Act::Gelu => xs.gelu_erf(),
            Act::GeluTanh => xs.gelu(),
        }
    }
}

/// How the decoder's linear layers are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// As loaded (f32 on CPU).
    #[default]
    Dense,
    /// 8-bit blocks (GGML Q8_0) for the text decoder's linear layers, quantized at load.
    Q8_0,
    /// 4-bit k-quants (GGML Q4_K), quantized at load; needs dimensions divisible by 256.
    Q4K,
}

impl Precision {
    pub fn parse(s: &str) -> Result<Precision, ModelError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "f32" | "dense" | "none" => Ok(Precision::Dense),
            "q8_0" | "q8" => Ok(Precision::Q8_0),
            "q4k" | "q4_k" => Ok(Precision::Q4K),
            other => Err(ModelError::Manifest {
                id: "llava".into(),
                reason: format!("quantize = `{other}`: use none, q8_0 or q4k"),
            }),
        }
    }

    fn ggml(self) -> Option<GgmlDType> {
        match self {
            Precision::Dense => None,
            Precision::Q8_0 => Some(GgmlDType::Q8_0),
            Precision::Q4K => Some(GgmlDType::Q4K),
        }
    }
}

/// A linear layer, dense or quantized (`x @ W^T + b`).
#[derive(Debug)]
struct Lin {
    w: QMatMul,
    b: Option<Tensor>,
}

impl Lin {
    fn load(
        vb: VarBuilder,
        inp: usize,
        out: usize,
        bias: bool,
        p: Precision,
    ) -> candle_core::Result<Lin> {
        let w = vb.get((out, inp), "weight")?;
        let w = match p.ggml() {
            Some(dt) if inp.is_multiple_of(dt.block_size()) => {
                QMatMul::from_qtensor(QTensor::quantize(&w, dt)?)?
            }
            _ => QMatMul::Tensor(w),
        };
        let b = if bias {
            Some(vb.get(out, "bias")?)
        } else {
            None
        };
        Ok(Lin { w, b })
    }
}

impl Module for Lin {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.w {
            // Dense weights: a broadcast matmul against W^T, as candle_nn::Linear does.
            QMatMul::Tensor(w) => {
                let wt = match xs.dims() {
                    [b, _, _] => w.broadcast_left(*b)?.t()?,
                    _ => w.t()?,
                };
                xs.matmul(&wt)?
            }
            q => q.forward(xs)?,
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// Softmax attention of (b, h, tq, d) queries over (b, h, tk, d) keys/values.
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let mut w = (q.matmul(&k.t()?)? * scale)?;
    if let Some(m) = mask {
        w = w.broadcast_add(m)?;
    }
    candle_nn::ops::softmax_last_dim(&w)?.matmul(v)
}

// --- CLIP vision tower ------------------------------------------------------------------------

#[derive(Debug)]
struct ClipLayer {
    q_proj: Lin,
    k_proj: Lin,
    v_proj: Lin,
    out_proj: Lin,
    layer_norm1: LayerNorm,
    layer_norm2: LayerNorm,
    fc1: Lin,
    fc2: Lin,
    heads: usize,
    act: Act,
}

impl ClipLayer {
    fn load(vb: VarBuilder, c: &VisionConfig) -> Result<ClipLayer, ModelError> {
        let d = c.hidden_size;
        let lin = |n: &str, i, o| Lin::load(vb.pp(n), i, o, true, Precision::Dense);
        Ok(ClipLayer {
            q_proj: lin("self_attn.q_proj", d, d)?,
            k_proj: lin("self_attn.k_proj", d, d)?,
            v_proj: lin("self_attn.v_proj", d, d)?,
            out_proj: lin("self_attn.out_proj", d, d)?,
            layer_norm1: candle_nn::layer_norm(d, c.layer_norm_eps, vb.pp("layer_norm1"))?,
            layer_norm2: candle_nn::layer_norm(d, c.layer_norm_eps, vb.pp("layer_norm2"))?,
            fc1: lin("mlp.fc1", d, c.intermediate_size)?,
            fc2: lin("mlp.fc2", c.intermediate_size, d)?,
            heads: c.num_attention_heads,
            act: activation(&c.hidden_act)?,
        })
    }

    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = xs.dims3()?;
        let hd = d / self.heads;
        let h = xs.apply(&self.layer_norm1)?;
        let split = |x: Tensor| {
            x.reshape((b, t, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(self.q_proj.forward(&h)?)?;
        let k = split(self.k_proj.forward(&h)?)?;
        let v = split(self.v_proj.forward(&h)?)?;
        let a = attention(&q, &k, &v, (hd as f64).powf(-0.5), None)?
            .transpose(1, 2)?
            .reshape((b, t, d))?;
        let xs = (xs + self.out_proj.forward(&a)?)?;
        let h = xs.apply(&self.layer_norm2)?.apply(&self.fc1)?;
        let h = self.act.apply(&h)?.apply(&self.fc2)?;
        xs + h
    }
}

/// CLIP's vision transformer up to the layer LLaVA reads its features from.
#[derive(Debug)]
struct ClipVision {
    patch_embedding: Conv2d,
    class_embedding: Tensor,
    position_embedding: Tensor,
    pre_layrnorm: LayerNorm,
    layers: Vec<ClipLayer>,
}

impl ClipVision {
    /// Loads the first `n_layers` encoder layers (the later ones do not change the features).
    fn load(vb: VarBuilder, c: &VisionConfig, n_layers: usize) -> Result<ClipVision, ModelError> {
        let d = c.hidden_size;
        let n_pos = (c.image_size / c.patch_size).pow(2) + 1;
        let e = vb.pp("embeddings");
        let conv = Conv2dConfig {
            stride: c.patch_size,
            ..Default::default()
        };
        Ok(ClipVision {
            patch_embedding: candle_nn::conv2d_no_bias(
                c.num_channels,
                d,
                c.patch_size,
                conv,
                e.pp("patch_embedding"),
            )?,
            class_embedding: e.get(d, "class_embedding")?,
            position_embedding: e.get((n_pos, d), "position_embedding.weight")?,
            pre_layrnorm: candle_nn::layer_norm(d, c.layer_norm_eps, vb.pp("pre_layrnorm"))?,
            layers: (0..n_layers)
                .map(|i| ClipLayer::load(vb.pp(format!("encoder.layers.{i}")), c))
                .collect::<Result<_, _>>()?,
        })
    }

    /// (b, 3, S, S) → hidden state after the loaded layers, (b, 1 + patches, d).
    fn forward(&self, pixels: &Tensor) -> candle_core::Result<Tensor> {
        let b = pixels.dim(0)?;
        // (b, d, S/p, S/p) → (b, patches, d)
        let patches = pixels
            .apply(&self.patch_embedding)?
            .flatten_from(2)?
            .transpose(1, 2)?;
        let d = self.class_embedding.dim(0)?;
        let cls = self.class_embedding.reshape((1, 1, d))?.repeat((b, 1, 1))?;
        let mut xs = Tensor::cat(&[&cls, &patches], 1)?
            .broadcast_add(&self.position_embedding)?
            .apply(&self.pre_layrnorm)?;
        for l in &self.layers {
            xs = l.forward(&xs)?;
        }
        Ok(xs)
    }
}

// --- Llama / Mistral decoder ------------------------------------------------------------------

#[derive(Debug)]
struct DecoderLayer {
    q_proj: Lin,
    k_proj: Lin,
    v_proj: Lin,
    o_proj: Lin,
    gate_proj: Lin,
    up_proj: Lin,
    down_proj: Lin,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn load(vb: VarBuilder, t: &Decoder, p: Precision) -> candle_core::Result<DecoderLayer> {
        let (h, hd, i) = (t.hidden_size, t.head_dim, t.intermediate_size);
        let (q, kv) = (t.num_attention_heads * hd, t.num_key_value_heads * hd);
        let a = vb.pp("self_attn");
        let m = vb.pp("mlp");
        Ok(DecoderLayer {
            q_proj: Lin::load(a.pp("q_proj"), h, q, t.attention_bias, p)?,
            k_proj: Lin::load(a.pp("k_proj"), h, kv, t.attention_bias, p)?,
            v_proj: Lin::load(a.pp("v_proj"), h, kv, t.attention_bias, p)?,
            o_proj: Lin::load(a.pp("o_proj"), q, h, t.attention_bias, p)?,
            gate_proj: Lin::load(m.pp("gate_proj"), h, i, t.mlp_bias, p)?,
            up_proj: Lin::load(m.pp("up_proj"), h, i, t.mlp_bias, p)?,
            down_proj: Lin::load(m.pp("down_proj"), i, h, t.mlp_bias, p)?,
            input_layernorm: candle_nn::rms_norm(h, t.rms_norm_eps, vb.pp("input_layernorm"))?,
            post_attention_layernorm: candle_nn::rms_norm(
                h,
                t.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
        })
    }
}

/// Keys and values of every decoder layer for the positions seen so far.
#[derive(Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    len: usize,
}

impl KvCache {
    /// Positions already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Debug)]
struct TextModel {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Lin,
    cfg: Decoder,
    /// RoPE inverse frequencies, (head_dim / 2).
    inv_freq: Tensor,
}

impl TextModel {
    fn load(vb: VarBuilder, t: &Decoder, p: Precision) -> candle_core::Result<TextModel> {
        let m = vb.pp("model");
        let embed_tokens = candle_nn::embedding(t.vocab_size, t.hidden_size, m.pp("embed_tokens"))?;
        let lm_head = if t.tie_word_embeddings {
            Lin {
                w: QMatMul::Tensor(embed_tokens.embeddings().clone()),
                b: None,
            }
        } else {
            Lin::load(vb.pp("lm_head"), t.hidden_size, t.vocab_size, false, p)?
        };
        let half = t.head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| (1.0 / t.rope_theta.powf(2.0 * i as f64 / t.head_dim as f64)) as f32)
            .collect();
        Ok(TextModel {
            layers: (0..t.num_hidden_layers)
                .map(|i| DecoderLayer::load(m.pp(format!("layers.{i}")), t, p))
                .collect::<candle_core::Result<_>>()?,
            norm: candle_nn::rms_norm(t.hidden_size, t.rms_norm_eps, m.pp("norm"))?,
            embed_tokens,
            lm_head,
            cfg: t.clone(),
            inv_freq: Tensor::new(inv, vb.device())?,
        })
    }

    /// Logits (b, t, vocab) of `embeds` (b, t, hidden), which follow the cached positions.
    fn forward(&self, embeds: &Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let (b, t, _) = embeds.dims3()?;
        let c = &self.cfg;
        let start = cache.len;
        if cache.layers.len() != self.layers.len() {
            cache.layers = (0..self.layers.len()).map(|_| None).collect();
        }
        // RoPE tables for positions start..start+t, computed in f32 as transformers does.
        let pos = Tensor::arange(start as u32, (start + t) as u32, embeds.device())?
            .to_dtype(DType::F32)?
            .reshape((t, 1))?;
        let freqs = pos.broadcast_mul(&self.inv_freq.reshape((1, ()))?)?;
        let (cos, sin) = (freqs.cos()?, freqs.sin()?);
        // Causal mask for a multi-token chunk (one new token sees every cached one).
        let mask = if t > 1 {
            let total = start + t;
            let m: Vec<f32> = (0..t)
                .flat_map(|i| {
                    (0..total).map(move |j| {
                        if j > start + i {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        }
                    })
                })
                .collect();
            Some(Tensor::from_vec(m, (1, 1, t, total), embeds.device())?)
        } else {
            None
        };
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let mut xs = embeds.clone();
        for (li, l) in self.layers.iter().enumerate() {
            let h = xs.apply(&l.input_layernorm)?;
            let split =
                |x: Tensor, n: usize| x.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
            let q = split(l.q_proj.forward(&h)?, nh)?;
            let k = split(l.k_proj.forward(&h)?, nkv)?;
            let v = split(l.v_proj.forward(&h)?, nkv)?;
            let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
            let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?;
            let (k, v) = match cache.layers[li].take() {
                Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                None => (k, v),
            };
            cache.layers[li] = Some((k.clone(), v.clone()));
            // Grouped-query attention: each key/value head serves nh / nkv query heads.
            let rep = |x: &Tensor| -> candle_core::Result<Tensor> {
                if nh == nkv {
                    return Ok(x.clone());
                }
                let (b, _, tk, _) = x.dims4()?;
                x.unsqueeze(2)?
                    .expand((b, nkv, nh / nkv, tk, hd))?
                    .reshape((b, nh, tk, hd))
            };
            let a = attention(
                &q,
                &rep(&k)?.contiguous()?,
                &rep(&v)?.contiguous()?,
                (hd as f64).powf(-0.5),
                mask.as_ref(),
            )?
            .transpose(1, 2)?
            .reshape((b, t, nh * hd))?;
            xs = (xs + l.o_proj.forward(&a)?)?;
            let h = xs.apply(&l.post_attention_layernorm)?;
            let g = l.gate_proj.forward(&h)?.silu()?;
            let u = l.up_proj.forward(&h)?;
            xs = (&xs + l.down_proj.forward(&(g * u)?)?)?;
        }
        cache.len = start + t;
        xs.apply(&self.norm)?.apply(&self.lm_head)
    }
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

/// `LlavaForConditionalGeneration`.
#[derive(Debug)]
pub struct Llava {
    vision: ClipVision,
    linear_1: Lin,
    linear_2: Lin,
    projector_act: Act,
    text: TextModel,
    cfg: Config,
    device: Device,
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
    /// Image encoding + prompt forward, and the per-token decode loop, in seconds.
    pub prefill_secs: f64,
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
            linear_1: Lin::load(mp.pp("linear_1"), vd, t.hidden_size, bias, Precision::Dense)?,
            linear_2: Lin::load(
                mp.pp("linear_2"),
                t.hidden_size,
                t.hidden_size,
                bias,
                Precision::Dense,
            )?,
            projector_act: activation(&cfg.projector_hidden_act)?,
            text: TextModel::load(vb.pp("language_model"), &t, precision)?,
            cfg: cfg.clone(),
            device: vb.device().clone(),
        })
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

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
        let vocab = self.text.cfg.vocab_size;
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
        let t = Tensor::new(ids, &self.device)?;
        let text = self.text.embed_tokens.forward(&t)?;
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

    /// Logits (1, t, vocab) for embeddings that follow the cached positions.
    pub fn forward_embeds(
        &self,
        embeds: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor, ModelError> {
        let t = embeds.dim(1)?;
        let c = &self.text.cfg;
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
        Ok(self.text.forward(embeds, cache)?)
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
        let c = &self.text.cfg;
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
        let mut logits = self.forward_embeds(&e, &mut cache)?;
        // GPU kernels run asynchronously: wait for them, or the prefill time is only the launch.
        self.device.synchronize()?;
        let prefill_secs = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut out = Vec::new();
        let mut stopped = false;
        while out.len() < max_new_tokens {
            let last = logits.i((0, logits.dim(1)? - 1))?;
            let next = last.argmax(D::Minus1)?.to_scalar::<u32>()?;
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
            logits = self.forward_embeds(&e, &mut cache)?;
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
// Preprocessing
// ---------------------------------------------------------------------------------------------

/// How a non-square radiograph becomes the model's square input.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AspectMode {
    /// `CLIPImageProcessor`: shortest side to S, centre crop S x S (drops the long side's ends).
    #[default]
    Crop,
    /// LLaVA-1.5 `image_aspect_ratio = "pad"`: centred on a square of the mean colour first,
    /// so the whole radiograph is seen.
    Pad,
}

/// An 8-bit grey radiograph → pixel values (1, 3, size, size), normalised with CLIP mean/std.
/// Grey is replicated to RGB (PIL's `convert("RGB")`).
pub fn preprocess(
    gray: &[u8],
    width: usize,
    height: usize,
    size: usize,
    mode: AspectMode,
    device: &Device,
) -> Result<Tensor, ModelError> {
    if width == 0 || height == 0 || gray.len() != width * height || size == 0 {
        return Err(ModelError::Compute(format!(
            "image buffer of {} bytes does not match {width}x{height}",
            gray.len()
        )));
    }
    // Crop mode keeps R = G = B: one plane is resized and used three times.
    let n_planes = if mode == AspectMode::Crop { 1 } else { 3 };
    let mut planes: Vec<(Vec<u8>, usize, usize)> = (0..n_planes)
        .map(|c| match mode {
            AspectMode::Crop => (gray.to_vec(), width, height),
            AspectMode::Pad => {
                // expand2square: background = int(mean * 255) per channel, image centred.
                let side = width.max(height);
                let bg = (CLIP_MEAN[c] * 255.0) as u8;
                let mut p = vec![bg; side * side];
                let (ox, oy) = ((side - width) / 2, (side - height) / 2);
                for y in 0..height {
                    p[(oy + y) * side + ox..(oy + y) * side + ox + width]
                        .copy_from_slice(&gray[y * width..(y + 1) * width]);
                }
                (p, side, side)
            }
        })
        .collect();
    // Shortest side to `size` (transformers' get_resize_output_image_size), bicubic as PIL.
    let (w, h) = (planes[0].1, planes[0].2);
    let (nw, nh) = if w <= h {
        (size, ((size * h) as f64 / w as f64) as usize)
    } else {
        (((size * w) as f64 / h as f64) as usize, size)
    };
    for p in &mut planes {
        if (nw, nh) != (p.1, p.2) {
            p.0 = resize_bicubic_pil(&p.0, p.1, p.2, nw, nh);
            p.1 = nw;
            p.2 = nh;
        }
    }
    // Centre crop (transformers' center_crop: top = (h - size) // 2).
    let (top, left) = ((nh - size.min(nh)) / 2, (nw - size.min(nw)) / 2);
    let mut out = vec![0f32; 3 * size * size];
    for c in 0..3 {
        let (p, pw, _) = &planes[c.min(n_planes - 1)];
        for y in 0..size {
            for x in 0..size {
                let v = p[(top + y) * pw + left + x] as f64 / 255.0;
                out[(c * size + y) * size + x] = ((v - CLIP_MEAN[c]) / CLIP_STD[c]) as f32;
            }
        }
    }
    Ok(Tensor::from_vec(out, (1, 3, size, size), device)?)
}

/// Pillow's 8-bit bicubic resampling (`ImagingResample`, a = -0.5, support widened by the
/// scale when shrinking, 22-bit fixed-point weights, horizontal pass then vertical, each
/// rounded and clipped to 8 bits), so pixel values match the Python processor exactly.
pub fn resize_bicubic_pil(src: &[u8], w: usize, h: usize, nw: usize, nh: usize) -> Vec<u8> {
    const PRECISION_BITS: u32 = 32 - 8 - 2;
    fn cubic(x: f64) -> f64 {
        let a = -0.5;
        let x = x.abs();
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * a
        } else {
            0.0
        }
    }
    // Per output pixel: first input index and fixed-point weights.
    fn coeffs(in_size: usize, out_size: usize) -> Vec<(usize, Vec<i32>)> {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = 2.0 * filterscale;
        (0..out_size)
            .map(|xx| {
                let center = (xx as f64 + 0.5) * scale;
                let ss = 1.0 / filterscale;
                let xmin = ((center - support + 0.5).floor() as i64).max(0) as usize;
                let xmax = ((center + support + 0.5).floor() as i64).min(in_size as i64) as usize;
                let mut k: Vec<f64> = (xmin..xmax)
                    .map(|x| cubic((x as f64 - center + 0.5) * ss))
                    .collect();
                let ww: f64 = k.iter().sum();
                if ww != 0.0 {
                    k.iter_mut().for_each(|v| *v /= ww);
                }
                let fixed = k
                    .iter()
                    .map(|v| {
                        let s = v * (1u32 << PRECISION_BITS) as f64;
                        (if s < 0.0 { s - 0.5 } else { s + 0.5 }) as i32
                    })
                    .collect();
                (xmin, fixed)
            })
            .collect()
    }
    fn clip8(v: i64) -> u8 {
        (v >> PRECISION_BITS).clamp(0, 255) as u8
    }
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut tmp = vec![0u8; nw * h];
    let hc = coeffs(w, nw);
    for y in 0..h {
        for (x, (x0, k)) in hc.iter().enumerate() {
            let mut s = half;
            for (j, &kk) in k.iter().enumerate() {
                s += src[y * w + x0 + j] as i64 * kk as i64;
            }
            tmp[y * nw + x] = clip8(s);
        }
    }
    let vc = coeffs(h, nh);
    let mut out = vec![0u8; nw * nh];
    for (y, (y0, k)) in vc.iter().enumerate() {
        for x in 0..nw {
            let mut s = half;
            for (j, &kk) in k.iter().enumerate() {
                s += tmp[(y0 + j) * nw + x] as i64 * kk as i64;
            }
            out[y * nw + x] = clip8(s);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// An installed LLaVA: network, tokenizer, prompt
// ---------------------------------------------------------------------------------------------

/// Files an installed LLaVA keeps beside `model.safetensors`.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const CONFIG_FILE: &str = "config.json";

/// A LLaVA ready to answer questions about a radiograph: the network, its Hugging Face
/// tokenizer, and the manifest's prompt and preprocessing.
pub struct NativeVlm {
    pub model: Llava,
    pub tokenizer: tokenizers::Tokenizer,
    pub aspect: AspectMode,
    /// Prompt template with `<image>` and `{question}`.
    pub prompt: String,
    pub max_new_tokens: usize,
    /// Ids that end an answer: the config's `eos_token_id` and the tokenizer's `</s>`.
    pub stop: Vec<u32>,
    pub precision: Precision,
}

/// One answer of [`NativeVlm::answer`].
#[derive(Clone, Debug)]
pub struct NativeAnswer {
    pub text: String,
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
    if let Some(v) = quantize.filter(|v| !v.is_empty()) {
        return Precision::parse(v);
    }
    Precision::parse(
        manifest
            .postprocessing
            .get("quantize")
            .and_then(|v| v.as_str())
            .unwrap_or("none"),
    )
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

    /// Answers `question` about an 8-bit grey radiograph with greedy decoding.
    pub fn answer(
        &self,
        gray: &[u8],
        width: usize,
        height: usize,
        question: &str,
        max_new_tokens: Option<usize>,
    ) -> Result<NativeAnswer, ModelError> {
        let size = self.model.config().vision_config.image_size;
        let px = preprocess(gray, width, height, size, self.aspect, self.model.device())?;
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
        assert!(resize_bicubic_pil(&flat, 40, 30, 13, 9)
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
