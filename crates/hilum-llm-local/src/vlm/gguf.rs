//! The same model from llama.cpp's files: the text GGUF (`gemma3`, run by the GGUF decoder with
//! its quantized kernels) and the `mmproj` GGUF of the vision tower and projector
//! (`clip.projector_type = gemma3`, written by convert_hf_to_gguf.py with `--mmproj`).
//!
//! llama.cpp's names for the checkpoint's tensors: `v.patch_embd`, `v.position_embd`,
//! `v.blk.N.{attn_q,attn_k,attn_v,attn_out,ln1,ln2,ffn_up (fc1),ffn_down (fc2)}`, `v.post_ln`,
//! `mm.input_projection`, `mm.soft_emb_norm` (stored as 1 + w, the only norm the converter
//! shifts in the mmproj file).

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};

use super::config::{TextConfig, VisionConfig, VlmConfig};
use super::Gemma3Vlm;
use crate::gemma3::Gemma3;
use crate::model::MatmulMode;
use crate::LocalError;

/// llama.cpp pools Gemma 3's patch grid 4 x 4 unless the file says otherwise.
const DEFAULT_POOL: usize = 4;

fn meta_u(ct: &gguf_file::Content, key: &str) -> candle_core::Result<usize> {
    Ok(crate::model::md(ct, key)?.to_u32()? as usize)
}

/// The mmproj name of a tensor under `vision_tower.vision_model.` or `multi_modal_projector.`.
fn mmproj_name(published: &str) -> Option<String> {
    if let Some(rest) = published.strip_prefix("vision_tower.vision_model.") {
        let fixed = [
            ("embeddings.patch_embedding.", "v.patch_embd."),
            ("embeddings.position_embedding.", "v.position_embd."),
            ("post_layernorm.", "v.post_ln."),
        ];
        for (hf, gg) in fixed {
            if let Some(kind) = rest.strip_prefix(hf) {
                return Some(format!("{gg}{kind}"));
            }
        }
        let rest = rest.strip_prefix("encoder.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let parts = [
            ("self_attn.q_proj.", "attn_q."),
            ("self_attn.k_proj.", "attn_k."),
            ("self_attn.v_proj.", "attn_v."),
            ("self_attn.out_proj.", "attn_out."),
            ("layer_norm1.", "ln1."),
            ("layer_norm2.", "ln2."),
            ("mlp.fc1.", "ffn_up."),
            ("mlp.fc2.", "ffn_down."),
        ];
        for (hf, gg) in parts {
            if let Some(kind) = rest.strip_prefix(hf) {
                return Some(format!("v.blk.{layer}.{gg}{kind}"));
            }
        }
        return None;
    }
    match published {
        "multi_modal_projector.mm_input_projection_weight" => {
            Some("mm.input_projection.weight".into())
        }
        "multi_modal_projector.mm_soft_emb_norm.weight" => Some("mm.soft_emb_norm.weight".into()),
        _ => None,
    }
}

/// Id of a special token in the text GGUF's vocabulary.
fn token_id(ct: &gguf_file::Content, text: &str) -> Result<u32, String> {
    let tokens = ct
        .metadata
        .get("tokenizer.ggml.tokens")
        .and_then(|v| v.to_vec().ok())
        .ok_or("the text GGUF has no vocabulary (tokenizer.ggml.tokens)")?;
    tokens
        .iter()
        .position(|t| t.to_string().is_ok_and(|s| s == text))
        .map(|i| i as u32)
        .ok_or_else(|| format!("the vocabulary has no {text}"))
}

impl Gemma3Vlm {
    /// Loads llama.cpp's pair of files: the text GGUF (matrices multiplied as `mode` says) and
    /// the mmproj GGUF (vision tower and projector, dequantized to f32).
    pub fn load_gguf(
        text: &Path,
        mmproj: &Path,
        max_positions: usize,
        mode: MatmulMode,
        dev: &Device,
    ) -> Result<Self, LocalError> {
        let (tct, mut tf) = crate::model::open_gguf(text)?;
        let (vct, mut vf) = crate::model::open_gguf(mmproj)?;
        let bad_v = |reason: String| LocalError::BadGguf {
            path: mmproj.display().to_string(),
            reason,
        };
        let projector = crate::model::md(&vct, "clip.projector_type")
            .and_then(|v| v.to_string().cloned())
            .map_err(|e| bad_v(e.to_string()))?;
        if projector != "gemma3" {
            return Err(bad_v(format!("projector type `{projector}` is not gemma3")));
        }
        let decoder = Gemma3::load(&tct, &mut tf, max_positions, mode, dev)?;
        let dc = decoder.cfg.clone();
        let vocab = tct
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0])
            .unwrap_or(0);
        let u =
            |k: &str| meta_u(&vct, &format!("clip.vision.{k}")).map_err(|e| bad_v(e.to_string()));
        let vision = VisionConfig {
            hidden: u("embedding_length")?,
            intermediate: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads: u("attention.head_count")?,
            channels: 3,
            image_size: u("image_size")?,
            patch_size: u("patch_size")?,
            eps: crate::model::md(&vct, "clip.vision.attention.layer_norm_epsilon")
                .and_then(|v| v.to_f32())
                .unwrap_or(1e-6) as f64,
        };
        let pool = u("projector.scale_factor").unwrap_or(DEFAULT_POOL).max(1);
        let side = vision.patches_per_side() / pool;
        let tok = |s: &str| {
            token_id(&tct, s).map_err(|reason| LocalError::BadGguf {
                path: text.display().to_string(),
                reason,
            })
        };
        let cfg = VlmConfig {
            text: TextConfig {
                vocab,
                hidden: dc.n_embd,
                intermediate: meta_u(&tct, "gemma3.feed_forward_length").unwrap_or(0),
                layers: dc.n_layer,
                heads: dc.n_head,
                kv_heads: dc.n_kv_head,
                head_dim: dc.head_dim,
                query_pre_attn_scalar: 1.0 / (dc.attn_scale * dc.attn_scale),
                eps: dc.rms_eps,
                rope_theta: dc.rope_base_global,
                rope_local_base: dc.rope_base_local,
                rope_linear_factor: dc.rope_scale_global,
                sliding_window: dc.sliding_window,
                local: dc.local.clone(),
                max_positions: dc.context_length,
                final_softcap: dc.final_softcap,
            },
            vision,
            mm_tokens_per_image: side * side,
            boi_token: tok(super::BOI_TEXT)?,
            eoi_token: tok(super::EOI_TEXT)?,
            image_token: tok(super::IMAGE_TOKEN_TEXT)?,
        };
        cfg.check().map_err(bad_v)?;
        let mut get = |published: &str| -> candle_core::Result<Tensor> {
            let name = mmproj_name(published).ok_or_else(|| {
                candle_core::Error::Msg(format!("no mmproj name for {published}"))
            })?;
            let t = vct
                .tensor(&mut vf, &name, dev)?
                .dequantize(dev)?
                .to_dtype(DType::F32)?;
            // Back to the checkpoint's `w` (the projector multiplies by 1 + w).
            if name == "mm.soft_emb_norm.weight" {
                t - 1.0
            } else {
                Ok(t)
            }
        };
        // Shapes as the checkpoint's (candle's GGUF reader gives them in that order).
        for (name, shape) in cfg.parameters() {
            if name.starts_with("language_model.") {
                continue;
            }
            let gg = mmproj_name(&name).unwrap_or_default();
            match vct.tensor_infos.get(&gg) {
                None => return Err(bad_v(format!("missing {gg} ({name})"))),
                Some(info) if info.shape.dims() != shape.as_slice() => {
                    return Err(bad_v(format!(
                        "{gg} is {:?}, expected {shape:?}",
                        info.shape.dims()
                    )))
                }
                Some(_) => {}
            }
        }
        Self::assemble(cfg, &mut get, decoder, dev)
    }
}
