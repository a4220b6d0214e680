//! Gemma 3 decoder run from a GGUF file (`general.architecture = "gemma3"`), written after
//! llama.cpp's `gemma3` graph (interleaved sliding-window variant):
//! - token embeddings scaled by sqrt(n_embd) (the embedding matrix doubles as the output layer);
//! - per layer: RMSNorm -> q/k/v -> RMSNorm of each q and k head -> NeoX rotary embedding ->
//!   queries scaled by 1/sqrt(head_dim) -> attention -> output projection -> RMSNorm -> residual,
//!   then RMSNorm -> GELU(tanh)-gated FFN -> RMSNorm -> residual (the GGUF's norm weights already
//!   include Gemma's "+1", so they multiply as stored);
//! - layers are local (each query sees the last `sliding_window` positions, itself included;
//!   rotary base 10 000) except every `sliding_window_pattern`-th one, which is global (the GGUF's
//!   `rope.freq_base`).
//!
//! The KV cache keeps every position of every layer, so it can be truncated to any prefix like
//! the Qwen/Llama model's; local layers only read their window of it.
//!
//! The same decoder runs on f32 weights from a Hugging Face checkpoint ([`Gemma3::from_dense`],
//! used by the multimodal model in [`crate::vlm`]), where it also takes input embeddings and
//! runs the image blocks of a prompt bidirectionally ([`Gemma3::forward_embeds`]).

use std::borrow::Cow;

use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, IndexOp, Tensor};

use crate::model::{
    attend, attention_mask, blocks, check_span, gated_ffn, linear_weights, logits_one, md,
    one_token_ready, rope_halves, rotary_tables, rotary_tables_scaled, KvCache, Linear, MatmulMode,
    Precision, RmsNorm,
};
use crate::qmatvec;

/// Layers per local/global cycle when the GGUF does not say (llama.cpp's value for Gemma 3).
const DEFAULT_SWA_PATTERN: u32 = 6;
/// Rotary base of the local layers (Gemma 3's, not stored in its GGUFs).
const DEFAULT_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Gemma 3 hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug)]
pub struct Gemma3Config {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_kv_head: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Epsilon of the RMS norms.
    pub rms_eps: f64,
    /// Rotary base frequency of the global layers.
    pub rope_base_global: f32,
    /// Rotary base frequency of the local (sliding-window) layers.
    pub rope_base_local: f32,
    /// Positions a local layer attends to.
    pub sliding_window: usize,
    /// Per layer: attends only to its sliding window (from a GGUF: every layer but each
    /// `sliding_window_pattern`-th).
    pub local: Vec<bool>,
    /// Factor applied to the queries before attention.
    pub attn_scale: f64,
    /// Linear rotary scaling of the global layers (positions divided by it; 1 = none).
    pub rope_scale_global: f32,
    /// `tanh` cap of the final logits (Gemma 2's; Gemma 3 checkpoints leave it unset).
    pub final_softcap: Option<f32>,
}

impl Gemma3Config {
    /// Reads the hyper-parameters from a GGUF's metadata.
    pub fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Self> {
        let arch = md(ct, "general.architecture")?.to_string()?;
        if arch != "gemma3" {
            candle_core::bail!("GGUF architecture `{arch}` is not gemma3");
        }
        let u = |k: &str| -> candle_core::Result<usize> {
            Ok(md(ct, &format!("gemma3.{k}"))?.to_u32()? as usize)
        };
        let opt_u = |k: &str| u(k).ok();
        let opt_f = |k: &str| md(ct, &format!("gemma3.{k}")).and_then(|v| v.to_f32()).ok();
        let n_embd = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_kv_head = opt_u("attention.head_count_kv").unwrap_or(n_head);
        let head_dim = opt_u("attention.key_length").unwrap_or(n_embd / n_head.max(1));
        if let Some(v) = opt_u("attention.value_length") {
            if v != head_dim {
                candle_core::bail!("gemma3 GGUF with value length {v} != key length {head_dim}");
            }
        }
        if n_head == 0 || n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) || head_dim % 2 != 0 {
            candle_core::bail!(
                "GGUF has inconsistent attention shapes ({n_head} heads, {n_kv_head} kv heads, head size {head_dim})"
            );
        }
        let n_layer = u("block_count")?;
        let sliding_window = u("attention.sliding_window")?;
        let swa_pattern = opt_u("attention.sliding_window_pattern")
            .unwrap_or(DEFAULT_SWA_PATTERN as usize)
            .max(1);
        // llama.cpp (after gemma_pytorch's config): the 62-layer 27B scales queries by
        // 1/sqrt(n_embd / n_head); every other size by 1/sqrt(head_dim).
        let scale_dim = if n_layer == 62 {
            n_embd / n_head
        } else {
            head_dim
        };
        Ok(Gemma3Config {
            n_layer,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            context_length: u("context_length")?,
            rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6) as f64,
            rope_base_global: opt_f("rope.freq_base").unwrap_or(1_000_000.0),
            rope_base_local: opt_f("rope.freq_base_swa").unwrap_or(DEFAULT_LOCAL_ROPE_BASE),
            sliding_window: sliding_window.max(1),
            local: (0..n_layer)
                .map(|i| i % swa_pattern < swa_pattern - 1)
                .collect(),
            attn_scale: 1.0 / (scale_dim as f64).sqrt(),
            // llama.cpp's converter writes Gemma 3 4B+'s linear factor 8 here.
            rope_scale_global: match md(ct, "gemma3.rope.scaling.type")
                .and_then(|v| v.to_string().cloned())
            {
                Ok(t) if t == "linear" => opt_f("rope.scaling.factor").unwrap_or(1.0),
                _ => 1.0,
            },
            final_softcap: None,
        })
    }

    /// Whether layer `i` attends only to its sliding window.
    pub fn is_local(&self, i: usize) -> bool {
        self.local.get(i).copied().unwrap_or(false)
    }
}

struct Layer {
    attn_norm: RmsNorm,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    wo: Linear,
    post_attn_norm: RmsNorm,
    ffn_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
    post_ffn_norm: RmsNorm,
    local: bool,
}

impl Layer {
    fn matrices(&self) -> [&Linear; 7] {
        [
            &self.wq, &self.wk, &self.wv, &self.wo, &self.gate, &self.up, &self.down,
        ]
    }
}

/// The embedding matrix: kept in its GGUF blocks (262k x 640 would be 671 MB as f32), the rows
/// of a batch dequantized on lookup; or an f32 matrix from a safetensors checkpoint.
enum Embedding {
    Blocks(BlockEmbedding),
    Dense(Tensor),
}

impl Embedding {
    /// The f32 rows of `tokens`: (tokens, n_embd).
    fn rows(&self, tokens: &[u32], dev: &Device) -> candle_core::Result<Tensor> {
        match self {
            Embedding::Blocks(b) => b.rows(tokens, dev),
            Embedding::Dense(w) => {
                let n = w.dim(0)?;
                if let Some(t) = tokens.iter().find(|&&t| t as usize >= n) {
                    candle_core::bail!("token id {t} is outside the vocabulary of {n}");
                }
                w.index_select(&Tensor::new(tokens, w.device())?, 0)
            }
        }
    }
}

struct BlockEmbedding {
    blocks: Vec<u8>,
    dtype: GgmlDType,
    row_bytes: usize,
    rows: usize,
    n_embd: usize,
}

impl BlockEmbedding {
    fn load(
        ct: &gguf_file::Content,
        r: &mut std::fs::File,
        n_embd: usize,
    ) -> candle_core::Result<Self> {
        // The blocks stay in host memory (read row by row); only looked-up rows go to `dev`.
        let q: QTensor = ct.tensor(r, "token_embd.weight", &Device::Cpu)?;
        Self::from_qtensor(&q, n_embd)
    }

    /// The embedding from a host `QTensor` (rows, n_embd).
    fn from_qtensor(q: &QTensor, n_embd: usize) -> candle_core::Result<Self> {
        let dtype = q.dtype();
        let (rows, cols) = q.shape().dims2()?;
        if cols != n_embd || !n_embd.is_multiple_of(dtype.block_size()) {
            candle_core::bail!(
                "token_embd.weight has shape ({rows}, {cols}), expected n_embd {n_embd}"
            );
        }
        let row_bytes = n_embd / dtype.block_size() * dtype.type_size();
        let blocks = q.data()?.into_owned();
        if blocks.len() != rows * row_bytes {
            candle_core::bail!(
                "token_embd.weight holds {} bytes, expected {}",
                blocks.len(),
                rows * row_bytes
            );
        }
        Ok(BlockEmbedding {
            blocks,
            dtype,
            row_bytes,
            rows,
            n_embd,
        })
    }

    /// The f32 rows of `tokens`: (tokens, n_embd).
    fn rows(&self, tokens: &[u32], dev: &Device) -> candle_core::Result<Tensor> {
        let mut buf = Vec::with_capacity(tokens.len() * self.row_bytes);
        for &t in tokens {
            let t = t as usize;
            if t >= self.rows {
                candle_core::bail!("token id {t} is outside the vocabulary of {}", self.rows);
            }
            buf.extend_from_slice(&self.blocks[t * self.row_bytes..(t + 1) * self.row_bytes]);
        }
        let storage = QStorage::from_data(Cow::Owned(buf), dev, self.dtype)?;
        QTensor::new(storage, (tokens.len(), self.n_embd))?
            .dequantize(dev)?
            .to_dtype(DType::F32)
    }
}

/// A Gemma 3 decoder with its KV cache.
pub struct Gemma3 {
    /// Its hyper-parameters.
    pub cfg: Gemma3Config,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: Linear,
    /// Rotary tables (positions, head_dim / 2) of the global and the local layers.
    rope_global: (Tensor, Tensor),
    rope_local: (Tensor, Tensor),
    /// The same tables as slices (cos, sin), for the one-token step.
    rope_global_v: (Vec<f32>, Vec<f32>),
    rope_local_v: (Vec<f32>, Vec<f32>),
    /// Every matrix has its GGUF blocks on the CPU: one-token steps run `forward_one`.
    one_token_path: bool,
    cache: KvCache,
    device: Device,
}

impl Gemma3 {
    /// Loads every tensor in the form `mode` multiplies with; rotary tables and the cache are
    /// sized for `max_positions` (at most the model's context).
    pub fn load(
        ct: &gguf_file::Content,
        r: &mut std::fs::File,
        max_positions: usize,
        mode: MatmulMode,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let cfg = Gemma3Config::from_gguf(ct)?;
        let eps = cfg.rms_eps as f32;
        let norm = |r: &mut std::fs::File, n: &str| RmsNorm::load(ct, r, n, eps, dev);
        let lin = |r: &mut std::fs::File, n: &str| linear_weights(ct, r, n, mode, dev);
        let embed = Embedding::Blocks(BlockEmbedding::load(ct, r, cfg.n_embd)?);
        // Only the last position reaches the output layer: one row, so quantized unless Dense.
        let out_mode = match mode {
            MatmulMode::Dense => MatmulMode::Dense,
            _ => MatmulMode::Quantized,
        };
        let output_name = if ct.tensor_infos.contains_key("output.weight") {
            "output.weight"
        } else {
            "token_embd.weight"
        };
        let output = linear_weights(ct, r, output_name, out_mode, dev)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: norm(r, &p("attn_norm"))?,
                wq: lin(r, &p("attn_q"))?,
                wk: lin(r, &p("attn_k"))?,
                wv: lin(r, &p("attn_v"))?,
                q_norm: norm(r, &p("attn_q_norm"))?,
                k_norm: norm(r, &p("attn_k_norm"))?,
                wo: lin(r, &p("attn_output"))?,
                post_attn_norm: norm(r, &p("post_attention_norm"))?,
                ffn_norm: norm(r, &p("ffn_norm"))?,
                gate: lin(r, &p("ffn_gate"))?,
                up: lin(r, &p("ffn_up"))?,
                down: lin(r, &p("ffn_down"))?,
                post_ffn_norm: norm(r, &p("post_ffw_norm"))?,
                local: cfg.is_local(i),
            });
        }
        let norm_out = norm(r, "output_norm.weight")?;
        Self::assemble(cfg, embed, layers, norm_out, output, max_positions, dev)
    }

    /// A decoder on f32 weights in Hugging Face's layout (the `language_model.model.*` tensors
    /// of a `Gemma3ForConditionalGeneration` checkpoint): `get(name)` returns the tensor `name`
    /// under the decoder's prefix (the caller checks names and shapes). Gemma's RMSNorm weights
    /// are stored as `w` and multiply as `1 + w`; the output layer is the embedding matrix (tied).
    ///
    /// `precision` quantizes the matrices at load (a 4B decoder: ~17 GB in f32, ~4.6 GB in
    /// Q8_0), the tied embedding and output layer included (on the CPU; elsewhere they stay f32).
    pub fn from_dense(
        cfg: Gemma3Config,
        get: &mut dyn FnMut(&str) -> candle_core::Result<Tensor>,
        max_positions: usize,
        precision: Precision,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let eps = cfg.rms_eps as f32;
        let quantize = precision.ggml();
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let mut w = |s: &str| get(&format!("layers.{i}.{s}.weight"));
            let mut norm = |s: &str| RmsNorm::from_weight((w(s)? + 1.0)?, eps);
            let attn_norm = norm("input_layernorm")?;
            let q_norm = norm("self_attn.q_norm")?;
            let k_norm = norm("self_attn.k_norm")?;
            let post_attn_norm = norm("post_attention_layernorm")?;
            let ffn_norm = norm("pre_feedforward_layernorm")?;
            let post_ffn_norm = norm("post_feedforward_layernorm")?;
            let mut lin = |s: &str| Linear::stored(w(s)?, quantize);
            layers.push(Layer {
                attn_norm,
                wq: lin("self_attn.q_proj")?,
                wk: lin("self_attn.k_proj")?,
                wv: lin("self_attn.v_proj")?,
                q_norm,
                k_norm,
                wo: lin("self_attn.o_proj")?,
                post_attn_norm,
                ffn_norm,
                gate: lin("mlp.gate_proj")?,
                up: lin("mlp.up_proj")?,
                down: lin("mlp.down_proj")?,
                post_ffn_norm,
                local: cfg.is_local(i),
            });
        }
        let norm_out = RmsNorm::from_weight((get("norm.weight")? + 1.0)?, eps)?;
        let embed = get("embed_tokens.weight")?;
        let (embed, output) = match quantize {
            // One quantization serves the lookup (its blocks) and the tied output layer.
            Some(dt) if dev.is_cpu() && cfg.n_embd.is_multiple_of(dt.block_size()) => {
                let q = QTensor::quantize(&embed, dt)?;
                drop(embed);
                let blocks = BlockEmbedding::from_qtensor(&q, cfg.n_embd)?;
                (Embedding::Blocks(blocks), Linear::from_qtensor(q)?)
            }
            _ => (Embedding::Dense(embed.clone()), Linear::from_dense(embed)),
        };
        Self::assemble(cfg, embed, layers, norm_out, output, max_positions, dev)
    }

    fn assemble(
        cfg: Gemma3Config,
        embed: Embedding,
        layers: Vec<Layer>,
        norm_out: RmsNorm,
        output: Linear,
        max_positions: usize,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let positions = max_positions.min(cfg.context_length).max(1);
        let rope_global = rotary_tables_scaled(
            cfg.head_dim,
            cfg.rope_base_global,
            cfg.rope_scale_global,
            positions,
            dev,
        )?;
        let rope_local = rotary_tables(cfg.head_dim, cfg.rope_base_local, positions, dev)?;
        let (n_layer, kvd) = (cfg.n_layer, cfg.n_kv_head * cfg.head_dim);
        let slices = |(c, s): &(Tensor, Tensor)| -> candle_core::Result<(Vec<f32>, Vec<f32>)> {
            Ok((c.flatten_all()?.to_vec1()?, s.flatten_all()?.to_vec1()?))
        };
        let mut model = Gemma3 {
            cfg,
            embed,
            layers,
            norm: norm_out,
            output,
            rope_global_v: slices(&rope_global)?,
            rope_local_v: slices(&rope_local)?,
            rope_global,
            rope_local,
            one_token_path: false,
            cache: KvCache::new(n_layer, kvd, dev),
            device: dev.clone(),
        };
        model.set_one_token_path(true);
        Ok(model)
    }

    /// The device the decoder's weights and KV mirror live on.
    pub(crate) fn device(&self) -> &Device {
        &self.device
    }

    /// Positions the rotary tables cover: the longest conversation this instance accepts.
    pub fn max_positions(&self) -> usize {
        self.rope_global.0.dims()[0]
    }

    /// Whether one-token steps run on the GGUF blocks (`Hybrid`/`Quantized` on the CPU when every
    /// matrix has a supported block type) rather than the tensor path.
    pub fn uses_one_token_path(&self) -> bool {
        self.one_token_path
    }

    /// Turns the one-token path off (or back on, where the blocks allow it), to compare it with
    /// the tensor path on the same weights.
    pub fn set_one_token_path(&mut self, on: bool) {
        self.one_token_path = on
            && one_token_ready(
                &self.device,
                &self.output,
                self.layers.iter().flat_map(Layer::matrices),
            );
    }

    /// Number of positions in the KV cache.
    pub fn cached_len(&self) -> usize {
        self.cache.len()
    }

    pub(crate) fn kv(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// Forgets every cached position from `len` on.
    pub fn truncate_cache(&mut self, len: usize) -> candle_core::Result<()> {
        self.cache.truncate(len);
        Ok(())
    }

    /// Runs `tokens` (appended after the cached positions) and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        let pos = self.cache.len();
        check_span(pos, t, self.max_positions())?;
        if t == 1 && self.one_token_path {
            return self.forward_one(tokens[0]);
        }
        let x = self.embed_tokens(tokens)?;
        let last = self.hidden(x, &[])?.i(t - 1..t)?;
        self.logits(&last)?.squeeze(0)
    }

    /// The input embeddings of `tokens` (scaled by sqrt(n_embd)): (tokens, n_embd).
    pub fn embed_tokens(&self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        self.embed.rows(tokens, &self.device)? * (self.cfg.n_embd as f64).sqrt()
    }

    /// Runs input embeddings `x` (t, n_embd) appended after the cached positions and returns
    /// the logits of every position (t, vocab), or of the last one (vocab) when `all` is false.
    /// `image_blocks` are absolute position ranges `start..end` of image soft tokens: each
    /// attends to the whole of its own block, in both directions and past the sliding window
    /// (transformers' `token_type_ids` mask); a block must lie within this call's positions.
    pub fn forward_embeds(
        &mut self,
        x: &Tensor,
        image_blocks: &[(usize, usize)],
        all: bool,
    ) -> candle_core::Result<Tensor> {
        let (t, _) = x.dims2()?;
        let pos = self.cache.len();
        check_span(pos, t, self.max_positions())?;
        if let Some(&(s, e)) = image_blocks
            .iter()
            .find(|&&(s, e)| s < pos || e > pos + t || s >= e)
        {
            candle_core::bail!(
                "image block {s}..{e} is not inside the positions {pos}..{} of this call",
                pos + t
            );
        }
        let h = self.hidden(x.clone(), image_blocks)?;
        if all {
            self.logits(&h)
        } else {
            self.logits(&h.i(t - 1..t)?)?.squeeze(0)
        }
    }

    /// Final norm, output layer and (if set) the logit cap of hidden states (rows, n_embd).
    fn logits(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.output.forward(&self.norm.forward(h)?)?;
        match self.cfg.final_softcap {
            Some(c) => (logits / c as f64)?.tanh()? * c as f64,
            None => Ok(logits),
        }
    }

    /// The decoder layers over `x` (t, n_embd) after the cached positions; returns the hidden
    /// states before the final norm and counts the positions in the cache.
    fn hidden(
        &mut self,
        mut x: Tensor,
        image_blocks: &[(usize, usize)],
    ) -> candle_core::Result<Tensor> {
        let t = x.dim(0)?;
        let pos = self.cache.len();
        let (nh, nkv, hd) = (self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim);
        let group = nh / nkv;
        let window = self.cfg.sliding_window;
        // Keys a layer reads start at `kv_start`: 0 for global layers, the window start of the
        // first query for local ones (image blocks lie after it: they are inside this call).
        let local_start = (pos + 1).saturating_sub(window);
        let mask = |start: usize, window: Option<usize>| -> candle_core::Result<Option<Tensor>> {
            if t == 1 {
                return Ok(None);
            }
            let m = attention_mask(t, pos, start, window, &self.device)?;
            if image_blocks.is_empty() {
                return Ok(Some(m));
            }
            Ok(Some(open_image_blocks(m, pos, start, image_blocks)?))
        };
        let global_mask = mask(0, None)?;
        let local_mask = mask(local_start, Some(window))?;
        let rope = |local: bool| {
            let (c, s) = if local {
                &self.rope_local
            } else {
                &self.rope_global
            };
            Ok::<_, candle_core::Error>((c.narrow(0, pos, t)?, s.narrow(0, pos, t)?))
        };
        let (cos_g, sin_g) = rope(false)?;
        let (cos_l, sin_l) = rope(true)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (cos, sin, kv_start, mask) = if layer.local {
                (&cos_l, &sin_l, local_start, &local_mask)
            } else {
                (&cos_g, &sin_g, 0, &global_mask)
            };
            let h = layer.attn_norm.forward(&x)?;
            // (t, heads*hd) -> (t, heads, hd), normalised per head, -> (heads, t, hd)
            let q = layer
                .q_norm
                .forward(&layer.wq.forward(&h)?.reshape((t, nh, hd))?)?;
            let k = layer
                .k_norm
                .forward(&layer.wk.forward(&h)?.reshape((t, nkv, hd))?)?;
            let v = layer.wv.forward(&h)?.reshape((t, nkv, hd))?;
            let q = rope_neox(&q.transpose(0, 1)?.contiguous()?, cos, sin)?;
            let k = rope_neox(&k.transpose(0, 1)?.contiguous()?, cos, sin)?;
            let v = v.transpose(0, 1)?.contiguous()?;
            let q = (q * self.cfg.attn_scale)?;
            let (k, v) = self.cache.append(li, &k, &v)?;
            let kv_len = pos + t - kv_start;
            let k = k.narrow(1, kv_start, kv_len)?;
            let v = v.narrow(1, kv_start, kv_len)?;
            // Grouped-query attention: the query heads of a group share one kv head.
            let qg = q.reshape((nkv, group * t, hd))?;
            let att = qg.matmul(&k.t()?)?; // (nkv, group*t, kv_len)
            let att = match mask {
                Some(m) => att
                    .reshape((nkv, group, t, kv_len))?
                    .broadcast_add(m)?
                    .reshape((nkv, group * t, kv_len))?,
                None => att,
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att
                .matmul(&v.contiguous()?)?
                .reshape((nh, t, hd))?
                .transpose(0, 1)?
                .reshape((t, nh * hd))?;
            let y = layer.post_attn_norm.forward(&layer.wo.forward(&y)?)?;
            x = (x + y)?;
            let h = layer.ffn_norm.forward(&x)?;
            let g = layer.gate.forward(&h)?.gelu()?;
            let u = layer.up.forward(&h)?;
            let f = layer
                .post_ffn_norm
                .forward(&layer.down.forward(&(g * u)?)?)?;
            x = (x + f)?;
        }
        self.cache.advance(t);
        Ok(x)
    }

    /// One token after the cached positions, on slices: `forward`'s arithmetic without a tensor
    /// per operation, q/k/v and gate/up each in one parallel product of the GGUF blocks.
    fn forward_one(&mut self, token: u32) -> candle_core::Result<Tensor> {
        let pos = self.cache.len();
        let (nh, nkv, hd) = (self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim);
        let (kvd, qd, half) = (nkv * hd, nh * hd, hd / 2);
        let n_embd = self.cfg.n_embd;
        let scale = self.cfg.attn_scale as f32;
        let window = self.cfg.sliding_window;
        let mut x: Vec<f32> = self
            .embed
            .rows(&[token], &self.device)?
            .flatten_all()?
            .to_vec1()?;
        let embed_scale = (n_embd as f32).sqrt();
        x.iter_mut().for_each(|v| *v *= embed_scale);
        let at = |(c, s): &(Vec<f32>, Vec<f32>)| {
            (
                c[pos * half..(pos + 1) * half].to_vec(),
                s[pos * half..(pos + 1) * half].to_vec(),
            )
        };
        let (rope_g, rope_l) = (at(&self.rope_global_v), at(&self.rope_local_v));
        let mut h = vec![0f32; n_embd];
        let mut qkv = vec![0f32; qd + 2 * kvd];
        let mut att = vec![0f32; qd];
        let mut proj = vec![0f32; n_embd];
        let mut gu = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            let ((cos, sin), kv_start) = if layer.local {
                (&rope_l, (pos + 1).saturating_sub(window))
            } else {
                (&rope_g, 0)
            };
            layer.attn_norm.forward_slice(&x, &mut h);
            qmatvec::matvec(
                &h,
                &[blocks(&layer.wq)?, blocks(&layer.wk)?, blocks(&layer.wv)?],
                &mut qkv,
            )?;
            let (q, kv) = qkv.split_at_mut(qd);
            let (k, v) = kv.split_at_mut(kvd);
            layer.q_norm.forward_inplace(q);
            layer.k_norm.forward_inplace(k);
            for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                rope_halves(head, cos, sin);
            }
            let (kc, vc) = self.cache.push(li, k, v);
            let len = pos + 1 - kv_start;
            attend(
                q,
                &kc[kv_start * kvd..],
                &vc[kv_start * kvd..],
                len,
                (nh / nkv, hd, kvd),
                scale,
                &mut att,
            );
            qmatvec::matvec(&att, &[blocks(&layer.wo)?], &mut proj)?;
            layer.post_attn_norm.forward_inplace(&mut proj);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
            layer.ffn_norm.forward_slice(&x, &mut h);
            gated_ffn(
                &h,
                (&layer.gate, &layer.up, &layer.down),
                gelu_tanh,
                &mut gu,
                &mut proj,
            )?;
            layer.post_ffn_norm.forward_inplace(&mut proj);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
        }
        self.cache.advance(1);
        self.norm.forward_slice(&x, &mut h);
        logits_one(&h, &self.output, &self.device)
    }
}

/// `mask` (t, keys from `kv_start`) for queries from `pos`, with every image block made visible
/// to its own queries (transformers' `or` of the causal/sliding mask and the image-block mask).
fn open_image_blocks(
    mask: Tensor,
    pos: usize,
    kv_start: usize,
    blocks: &[(usize, usize)],
) -> candle_core::Result<Tensor> {
    let (t, kv) = mask.dims2()?;
    let dev = mask.device().clone();
    let mut m = mask.flatten_all()?.to_vec1::<f32>()?;
    for &(s, e) in blocks {
        for q in s.max(pos)..e.min(pos + t) {
            for k in s.max(kv_start)..e.min(kv_start + kv) {
                m[(q - pos) * kv + (k - kv_start)] = 0.0;
            }
        }
    }
    Tensor::from_vec(m, (t, kv), &dev)
}

/// GELU, tanh approximation (as candle's `gelu` and llama.cpp's Gemma graph).
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// NeoX rotary embedding (pairs `i` and `i + head_dim/2`) of (heads, t, head_dim).
fn rope_neox(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    candle_nn::rotary_emb::rope(&x.unsqueeze(0)?, cos, sin)?.squeeze(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded Hugging Face-layout decoder (2 layers, one local; widths that split into 32-
    /// element blocks), stored as `precision` says.
    fn tiny(precision: Precision) -> Gemma3 {
        let (embd, hd, heads, kv, inter, vocab) = (64, 32, 2, 1, 128, 40);
        let cfg = Gemma3Config {
            n_layer: 2,
            n_embd: embd,
            n_head: heads,
            n_kv_head: kv,
            head_dim: hd,
            context_length: 64,
            rms_eps: 1e-6,
            rope_base_global: 10_000.0,
            rope_base_local: 1_000.0,
            sliding_window: 4,
            local: vec![true, false],
            attn_scale: 1.0 / (hd as f64).sqrt(),
            rope_scale_global: 1.0,
            final_softcap: None,
        };
        let mut seed = 0x2545_F491u64;
        let mut get = |name: &str| -> candle_core::Result<Tensor> {
            let part = name.trim_end_matches(".weight");
            let shape = match part.rsplit('.').next().unwrap_or("") {
                "q_proj" => vec![heads * hd, embd],
                "k_proj" | "v_proj" => vec![kv * hd, embd],
                "o_proj" => vec![embd, heads * hd],
                "gate_proj" | "up_proj" => vec![inter, embd],
                "down_proj" => vec![embd, inter],
                "q_norm" | "k_norm" => vec![hd],
                "embed_tokens" => vec![vocab, embd],
                _ => vec![embd],
            };
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    // Norm weights are stored as `w` and multiply as `1 + w`.
                    let u = crate::model::xorshift_unit(&mut seed);
                    if shape.len() == 1 {
                        0.2 * u
                    } else {
                        0.5 * u
                    }
                })
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu)
        };
        Gemma3::from_dense(cfg, &mut get, 64, precision, &Device::Cpu).unwrap()
    }

    /// Quantized at load, the decoder keeps the f32 one's answers within Q8_0's error, one
    /// step at a time as in one pass, and the tied embedding is looked up from its blocks.
    #[test]
    fn a_snapshot_decoder_quantized_at_load_follows_the_f32_one() {
        let ids = [1u32, 7, 39, 12, 5, 22, 30, 3];
        let mut f = tiny(Precision::Dense);
        let mut q = tiny(Precision::Q8_0);
        assert!(matches!(f.embed, Embedding::Dense(_)));
        assert!(matches!(q.embed, Embedding::Blocks(_)));
        let lf = f.forward(&ids).unwrap().flatten_all().unwrap();
        let lq = q.forward(&ids).unwrap().flatten_all().unwrap();
        let (lf, lq) = (lf.to_vec1::<f32>().unwrap(), lq.to_vec1::<f32>().unwrap());
        let spread = lf.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = lf
            .iter()
            .zip(&lq)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // Really quantized (not the f32 path under another name), and close.
        assert!(err > 0.0, "Q8_0 logits equal the f32 ones bit for bit");
        assert!(
            err < 0.03 * spread,
            "max |diff| {err} of logits up to {spread}"
        );
        // The quantized decoder's cached steps agree with a fresh pass over the same ids.
        let mut steps = tiny(Precision::Q8_0);
        steps.forward(&ids[..5]).unwrap();
        let mut last = None;
        for &t in &ids[5..] {
            last = Some(steps.forward(&[t]).unwrap());
        }
        let last = last
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let d = last
            .iter()
            .zip(&lq)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(d < 1e-3 * spread.max(1.0), "steps vs one pass: {d}");
    }

    fn visible(t: usize, pos: usize, start: usize, w: Option<usize>) -> Vec<Vec<u8>> {
        let m = attention_mask(t, pos, start, w, &Device::Cpu).unwrap();
        m.to_vec2::<f32>()
            .unwrap()
            .into_iter()
            .map(|r| r.into_iter().map(|x| u8::from(x == 0.0)).collect())
            .collect()
    }

    #[test]
    fn causal_mask_without_window() {
        assert_eq!(
            visible(3, 1, 0, None),
            [vec![1, 1, 0, 0], vec![1, 1, 1, 0], vec![1, 1, 1, 1]]
        );
    }

    #[test]
    fn sliding_window_keeps_the_last_w_positions_including_the_query() {
        // Window 2, queries at 3 and 4, keys 2..=4 (the window start of the first query).
        assert_eq!(visible(2, 3, 2, Some(2)), [vec![1, 1, 0], vec![0, 1, 1]]);
        // From the start: query 2 with window 3 sees 0, 1, 2.
        assert_eq!(
            visible(4, 0, 0, Some(3)),
            [
                vec![1, 0, 0, 0],
                vec![1, 1, 0, 0],
                vec![1, 1, 1, 0],
                vec![0, 1, 1, 1]
            ]
        );
    }
}
