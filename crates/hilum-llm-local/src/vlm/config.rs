//! `config.json` of a `Gemma3ForConditionalGeneration` checkpoint, with transformers' defaults
//! (`Gemma3Config`, `Gemma3TextConfig`, `SiglipVisionConfig`) for the keys a file leaves out.

use serde_json::Value;

use crate::gemma3::Gemma3Config;

/// The SigLIP vision tower's hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    /// Width of the tower's tokens.
    pub hidden: usize,
    /// Width of its feed-forward layers.
    pub intermediate: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Input channels (3: RGB).
    pub channels: usize,
    /// Side of the square input in pixels.
    pub image_size: usize,
    /// Side of one patch in pixels.
    pub patch_size: usize,
    /// Epsilon of the layer norms.
    pub eps: f64,
}

impl VisionConfig {
    /// Patches along one side of the (square) input.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }
}

/// The language model's hyper-parameters (Hugging Face names, before they become a
/// [`Gemma3Config`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TextConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the feed-forward layers.
    pub intermediate: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Queries are scaled by its inverse square root.
    pub query_pre_attn_scalar: f64,
    /// Epsilon of the RMS norms.
    pub eps: f64,
    /// Rotary base frequency of the global layers.
    pub rope_theta: f32,
    /// Rotary base frequency of the local (sliding-window) layers.
    pub rope_local_base: f32,
    /// Linear rotary scaling factor of the global layers (1 = none).
    pub rope_linear_factor: f32,
    /// Positions a local layer attends to.
    pub sliding_window: usize,
    /// Per layer: attends only to its sliding window.
    pub local: Vec<bool>,
    /// Longest context (`max_position_embeddings`).
    pub max_positions: usize,
    /// `tanh` cap of the final logits, if any.
    pub final_softcap: Option<f32>,
}

/// The whole model's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct VlmConfig {
    /// The language model's.
    pub text: TextConfig,
    /// The vision tower's.
    pub vision: VisionConfig,
    /// Soft tokens each picture becomes in the prompt.
    pub mm_tokens_per_image: usize,
    /// Token that opens a picture (`<start_of_image>`).
    pub boi_token: u32,
    /// Token that closes a picture (`<end_of_image>`).
    pub eoi_token: u32,
    /// Placeholder for each of a picture's soft tokens (`<image_soft_token>`).
    pub image_token: u32,
}

fn get_u(v: &Value, key: &str, default: usize) -> Result<usize, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| format!("`{key}` is not a whole number: {x}")),
    }
}

fn get_f(v: &Value, key: &str, default: f64) -> Result<f64, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(x) => x
            .as_f64()
            .ok_or_else(|| format!("`{key}` is not a number: {x}")),
    }
}

impl VlmConfig {
    /// Parses a checkpoint's `config.json` text.
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        if model_type != "gemma3" {
            return Err(format!(
                "model_type `{model_type}` is not gemma3 (Gemma3ForConditionalGeneration)"
            ));
        }
        let empty = Value::Object(Default::default());
        let t = v.get("text_config").unwrap_or(&empty);
        let vis = v.get("vision_config").unwrap_or(&empty);
        let layers = get_u(t, "num_hidden_layers", 26)?;
        let pattern = get_u(t, "sliding_window_pattern", 6)?.max(1);
        // transformers >= 4.53 writes `layer_types`; older files only the pattern.
        let local = match t.get("layer_types").and_then(Value::as_array) {
            Some(types) => types
                .iter()
                .map(|ty| match ty.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(format!("unknown layer type {ty}")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => (0..layers).map(|i| (i + 1) % pattern != 0).collect(),
        };
        if local.len() != layers {
            return Err(format!("{} layer types for {layers} layers", local.len()));
        }
        let rope_linear_factor = match t.get("rope_scaling") {
            None | Some(Value::Null) => 1.0,
            Some(rs) => {
                let kind = rs
                    .get("rope_type")
                    .or_else(|| rs.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match kind {
                    "default" => 1.0,
                    "linear" => get_f(rs, "factor", 1.0)? as f32,
                    other => return Err(format!("rope scaling `{other}` is not supported")),
                }
            }
        };
        let text = TextConfig {
            vocab: get_u(t, "vocab_size", 262_208)?,
            hidden: get_u(t, "hidden_size", 2304)?,
            intermediate: get_u(t, "intermediate_size", 9216)?,
            layers,
            heads: get_u(t, "num_attention_heads", 8)?,
            kv_heads: get_u(t, "num_key_value_heads", 4)?,
            head_dim: get_u(t, "head_dim", 256)?,
            query_pre_attn_scalar: get_f(t, "query_pre_attn_scalar", 256.0)?,
            eps: get_f(t, "rms_norm_eps", 1e-6)?,
            rope_theta: get_f(t, "rope_theta", 1_000_000.0)? as f32,
            rope_local_base: get_f(t, "rope_local_base_freq", 10_000.0)? as f32,
            rope_linear_factor,
            sliding_window: get_u(t, "sliding_window", 4096)?.max(1),
            local,
            max_positions: get_u(t, "max_position_embeddings", 131_072)?,
            final_softcap: match t.get("final_logit_softcapping") {
                None | Some(Value::Null) => None,
                Some(_) => Some(get_f(t, "final_logit_softcapping", 0.0)? as f32),
            },
        };
        for act in [t.get("hidden_activation"), vis.get("hidden_act")]
            .into_iter()
            .flatten()
        {
            if act.as_str() != Some("gelu_pytorch_tanh") {
                return Err(format!(
                    "activation {act} is not supported (gelu_pytorch_tanh)"
                ));
            }
        }
        if t.get("use_bidirectional_attention")
            .and_then(Value::as_bool)
            == Some(true)
        {
            return Err(
                "a text model with bidirectional attention is not Gemma 3's decoder".into(),
            );
        }
        if vis.get("vision_use_head").and_then(Value::as_bool) == Some(true) {
            return Err("a vision tower with a pooling head is not Gemma 3's".into());
        }
        let vision = VisionConfig {
            hidden: get_u(vis, "hidden_size", 768)?,
            intermediate: get_u(vis, "intermediate_size", 3072)?,
            layers: get_u(vis, "num_hidden_layers", 12)?,
            heads: get_u(vis, "num_attention_heads", 12)?,
            channels: get_u(vis, "num_channels", 3)?,
            image_size: get_u(vis, "image_size", 224)?,
            patch_size: get_u(vis, "patch_size", 16)?,
            eps: get_f(vis, "layer_norm_eps", 1e-6)?,
        };
        let cfg = VlmConfig {
            text,
            vision,
            mm_tokens_per_image: get_u(&v, "mm_tokens_per_image", 256)?,
            boi_token: get_u(&v, "boi_token_index", 255_999)? as u32,
            eoi_token: get_u(&v, "eoi_token_index", 256_000)? as u32,
            image_token: get_u(&v, "image_token_index", 262_144)? as u32,
        };
        cfg.check()?;
        Ok(cfg)
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        let (t, v) = (&self.text, &self.vision);
        if t.heads == 0
            || t.kv_heads == 0
            || !t.heads.is_multiple_of(t.kv_heads)
            || t.head_dim % 2 != 0
        {
            return Err(format!(
                "inconsistent attention shapes ({} heads, {} kv heads, head size {})",
                t.heads, t.kv_heads, t.head_dim
            ));
        }
        if v.heads == 0 || !v.hidden.is_multiple_of(v.heads) {
            return Err(format!(
                "vision width {} is not a multiple of its {} heads",
                v.hidden, v.heads
            ));
        }
        if v.patch_size == 0 || !v.image_size.is_multiple_of(v.patch_size) {
            return Err(format!(
                "vision image size {} is not a multiple of the patch size {}",
                v.image_size, v.patch_size
            ));
        }
        // The projector pools the patch grid to a square of soft tokens.
        let side = self.tokens_per_side();
        let patches = v.patches_per_side();
        if side == 0 || side * side != self.mm_tokens_per_image || !patches.is_multiple_of(side) {
            return Err(format!(
                "{} image tokens do not pool a {patches}x{patches} patch grid",
                self.mm_tokens_per_image
            ));
        }
        Ok(())
    }

    /// Soft tokens along one side of an image's pooled grid.
    pub fn tokens_per_side(&self) -> usize {
        (self.mm_tokens_per_image as f64).sqrt().round() as usize
    }

    /// The decoder's configuration.
    pub fn decoder(&self) -> Gemma3Config {
        let t = &self.text;
        Gemma3Config {
            n_layer: t.layers,
            n_embd: t.hidden,
            n_head: t.heads,
            n_kv_head: t.kv_heads,
            head_dim: t.head_dim,
            context_length: t.max_positions,
            rms_eps: t.eps,
            rope_base_global: t.rope_theta,
            rope_base_local: t.rope_local_base,
            sliding_window: t.sliding_window,
            local: t.local.clone(),
            attn_scale: 1.0 / t.query_pre_attn_scalar.sqrt(),
            rope_scale_global: t.rope_linear_factor,
            final_softcap: t.final_softcap,
        }
    }

    /// Every parameter a checkpoint holds, as the published files name them
    /// (`language_model.model.*`, `vision_tower.vision_model.*`, `multi_modal_projector.*`; the
    /// output layer is tied to the embeddings and not stored), with its shape.
    pub fn parameters(&self) -> Vec<(String, Vec<usize>)> {
        let (t, v) = (&self.text, &self.vision);
        let mut out: Vec<(String, Vec<usize>)> = Vec::new();
        let mut add = |name: String, shape: &[usize]| out.push((name, shape.to_vec()));
        let lm = "language_model.model";
        let (d, hd, q, kv) = (
            t.hidden,
            t.head_dim,
            t.heads * t.head_dim,
            t.kv_heads * t.head_dim,
        );
        add(format!("{lm}.embed_tokens.weight"), &[t.vocab, d]);
        add(format!("{lm}.norm.weight"), &[d]);
        for i in 0..t.layers {
            let p = format!("{lm}.layers.{i}");
            add(format!("{p}.self_attn.q_proj.weight"), &[q, d]);
            add(format!("{p}.self_attn.k_proj.weight"), &[kv, d]);
            add(format!("{p}.self_attn.v_proj.weight"), &[kv, d]);
            add(format!("{p}.self_attn.o_proj.weight"), &[d, q]);
            add(format!("{p}.self_attn.q_norm.weight"), &[hd]);
            add(format!("{p}.self_attn.k_norm.weight"), &[hd]);
            add(format!("{p}.mlp.gate_proj.weight"), &[t.intermediate, d]);
            add(format!("{p}.mlp.up_proj.weight"), &[t.intermediate, d]);
            add(format!("{p}.mlp.down_proj.weight"), &[d, t.intermediate]);
            for n in [
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            ] {
                add(format!("{p}.{n}.weight"), &[d]);
            }
        }
        let vm = "vision_tower.vision_model";
        let (w, ps) = (v.hidden, v.patch_size);
        let n_patches = v.patches_per_side() * v.patches_per_side();
        add(
            format!("{vm}.embeddings.patch_embedding.weight"),
            &[w, v.channels, ps, ps],
        );
        add(format!("{vm}.embeddings.patch_embedding.bias"), &[w]);
        add(
            format!("{vm}.embeddings.position_embedding.weight"),
            &[n_patches, w],
        );
        for i in 0..v.layers {
            let p = format!("{vm}.encoder.layers.{i}");
            for proj in ["q_proj", "k_proj", "v_proj", "out_proj"] {
                add(format!("{p}.self_attn.{proj}.weight"), &[w, w]);
                add(format!("{p}.self_attn.{proj}.bias"), &[w]);
            }
            for ln in ["layer_norm1", "layer_norm2"] {
                add(format!("{p}.{ln}.weight"), &[w]);
                add(format!("{p}.{ln}.bias"), &[w]);
            }
            add(format!("{p}.mlp.fc1.weight"), &[v.intermediate, w]);
            add(format!("{p}.mlp.fc1.bias"), &[v.intermediate]);
            add(format!("{p}.mlp.fc2.weight"), &[w, v.intermediate]);
            add(format!("{p}.mlp.fc2.bias"), &[w]);
        }
        add(format!("{vm}.post_layernorm.weight"), &[w]);
        add(format!("{vm}.post_layernorm.bias"), &[w]);
        add(
            "multi_modal_projector.mm_input_projection_weight".into(),
            &[w, d],
        );
        add("multi_modal_projector.mm_soft_emb_norm.weight".into(), &[w]);
        out
    }
}
