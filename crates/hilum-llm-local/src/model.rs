//! Qwen2 / Llama-style decoder run from a GGUF file, written for an agent loop rather than a demo,
//! or from a Hugging Face Llama/Mistral checkpoint's f32 tensors ([`Model::from_dense`], LLaVA's
//! text decoder in hilum-models), where input embeddings can stand in for token ids.
//!
//! Matches llama.cpp's `qwen2` and `llama` graphs (RMSNorm, GQA attention with NeoX rotary
//! embeddings — `rope` on halves for qwen2, interleaved `rope_i` for llama — SwiGLU MLP). It differs
//! from candle-transformers' `quantized_qwen2` in three ways that matter for latency:
//! - the KV cache can be truncated to any prefix, so a new round only processes the tokens after
//!   the longest prefix it shares with what is already cached;
//! - each weight matrix can be kept twice: dequantized to f32 for multi-token prompt chunks
//!   (candle's f32 `gemm`, compute-bound work where dense kernels win) and as its GGUF blocks
//!   for one-token decode (memory-bound: reading ~0.4 GB of blocks per token instead of ~2 GB
//!   of f32);
//! - a one-token step (`forward_one`) runs on slices with Hilum's block kernels (`qmatvec`:
//!   Q5_0 — most of Qwen2.5-0.5B, for which candle has no SIMD dot product — Q8_0, and candle's
//!   K-quant dot products), q/k/v and gate/up each in one parallel product, and the new key and
//!   value appended in place, instead of ~30 tensor operations per layer and a copy of the cache.
//!   Elsewhere (a GPU, `MatmulMode::Quantized` prompt chunks) candle's `QMatMul` runs, and
//!   types without a SIMD dot product there (Q5_0, Q4_1, Q5_1) are re-quantized to Q8_0 at load.

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, IndexOp, Module, Tensor, D};

use crate::prefix::KvSnapshot;
use crate::qmatvec::{self, QMat};

/// How a checkpoint's f32 matrices are stored once loaded (LLaVA's and a multimodal snapshot's
/// decoder): `none|q8_0|q4k`, see [`std::str::FromStr`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// As loaded (f32 on CPU).
    #[default]
    Dense,
    /// 8-bit blocks (GGML Q8_0), quantized at load.
    Q8_0,
    /// 4-bit k-quants (GGML Q4_K), quantized at load; rows must split into 256-element blocks
    /// (a matrix whose rows do not stays f32).
    Q4K,
}

impl std::str::FromStr for Precision {
    type Err = String;

    /// `none` (also `dense`, `f32`, empty), `q8_0` (`q8`) or `q4k` (`q4_k`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "f32" | "dense" | "none" => Ok(Precision::Dense),
            "q8_0" | "q8" => Ok(Precision::Q8_0),
            "q4k" | "q4_k" => Ok(Precision::Q4K),
            other => Err(format!("quantize = `{other}`: use none, q8_0 or q4k")),
        }
    }
}

impl Precision {
    /// The block type, `None` for f32.
    pub fn ggml(self) -> Option<GgmlDType> {
        match self {
            Precision::Dense => None,
            Precision::Q8_0 => Some(GgmlDType::Q8_0),
            Precision::Q4K => Some(GgmlDType::Q4K),
        }
    }
}

/// How the weight matrices are multiplied (`dense|quantized|hybrid`, see [`std::str::FromStr`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulMode {
    /// f32 weights and `gemm` everywhere (≈ 4 bytes per weight in memory).
    Dense,
    /// Quantized dot products everywhere (≈ 1 byte per weight).
    Quantized,
    /// f32 `gemm` for prompt chunks, quantized dot products for one-token decode (both copies).
    Hybrid,
}

impl std::str::FromStr for MatmulMode {
    type Err = String;

    /// `dense`, `quantized` or `hybrid` (empty: hybrid).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "hybrid" => Ok(MatmulMode::Hybrid),
            "dense" => Ok(MatmulMode::Dense),
            "quantized" => Ok(MatmulMode::Quantized),
            other => Err(format!(
                "local matmul mode `{other}` is not one of dense, quantized, hybrid"
            )),
        }
    }
}

/// Model hyper-parameters read from the GGUF metadata.
#[derive(Clone, Debug)]
pub struct Config {
    /// Which decoder family the weights are for.
    pub arch: Arch,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_kv_head: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Epsilon of the RMS norms.
    pub rms_eps: f64,
    /// Rotary embedding base frequency.
    pub rope_base: f32,
    /// How the rotary embedding pairs a head's elements.
    pub rope: Rope,
}

/// Which elements of a head the rotary embedding turns together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rope {
    /// NeoX: element `i` with `i + head_dim / 2` (qwen2 GGUFs, Hugging Face checkpoints).
    Halves,
    /// Pairs `(2i, 2i + 1)`: llama GGUFs, whose converter permutes the q/k rows to this order.
    Pairs,
}

/// The GGUF architectures this decoder runs (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `qwen2` (Qwen2, Qwen2.5), whose rotary embedding turns halves.
    Qwen2,
    /// `llama` (Llama, Mistral), whose rotary embedding turns pairs.
    Llama,
}

impl Arch {
    fn key(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Llama => "llama",
        }
    }
}

/// Opens a GGUF file and reads its header (metadata and tensor index, not the weights); the
/// file stays open for the weights.
pub(crate) fn open_gguf(
    path: &std::path::Path,
) -> Result<(gguf_file::Content, std::fs::File), crate::LocalError> {
    let mut f = std::fs::File::open(path).map_err(|e| crate::LocalError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let ct = gguf_file::Content::read(&mut f).map_err(|e| crate::LocalError::BadGguf {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok((ct, f))
}

pub(crate) fn md<'a>(
    ct: &'a gguf_file::Content,
    key: &str,
) -> candle_core::Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| candle_core::Error::Msg(format!("GGUF metadata has no `{key}`")))
}

impl Config {
    /// Reads the hyper-parameters from a GGUF's metadata.
    pub fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Self> {
        let arch_name = md(ct, "general.architecture")?.to_string()?.clone();
        let arch = match arch_name.as_str() {
            "qwen2" => Arch::Qwen2,
            "llama" => Arch::Llama,
            other => candle_core::bail!(
                "GGUF architecture `{other}` is not supported by the local backend (qwen2 and llama are)"
            ),
        };
        let k = |s: &str| format!("{}.{s}", arch.key());
        let n_embd = md(ct, &k("embedding_length"))?.to_u32()? as usize;
        let n_head = md(ct, &k("attention.head_count"))?.to_u32()? as usize;
        let n_kv_head = md(ct, &k("attention.head_count_kv"))
            .and_then(|v| v.to_u32())
            .map(|v| v as usize)
            .unwrap_or(n_head);
        let head_dim = md(ct, &k("attention.key_length"))
            .and_then(|v| v.to_u32())
            .map(|v| v as usize)
            .unwrap_or(n_embd / n_head.max(1));
        if n_head == 0 || n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
            candle_core::bail!(
                "GGUF has inconsistent head counts ({n_head} heads, {n_kv_head} kv heads)"
            );
        }
        Ok(Config {
            arch,
            n_layer: md(ct, &k("block_count"))?.to_u32()? as usize,
            n_embd,
            n_head,
            n_kv_head,
            head_dim,
            context_length: md(ct, &k("context_length"))?.to_u32()? as usize,
            rms_eps: md(ct, &k("attention.layer_norm_rms_epsilon"))?.to_f32()? as f64,
            rope_base: md(ct, &k("rope.freq_base"))
                .and_then(|v| v.to_f32())
                .unwrap_or(10_000.0),
            rope: match arch {
                Arch::Qwen2 => Rope::Halves,
                Arch::Llama => Rope::Pairs,
            },
        })
    }
}

/// Rows up to which a layer with GGUF blocks multiplies row by row on them.
const FEW_ROWS: usize = 12;

/// A layer `y = x W^T (+ b)`, W of shape (out, in), as f32 and/or quantized blocks.
pub(crate) struct Linear {
    dense: Option<Tensor>,
    quant: Option<QMatMul>,
    /// The GGUF blocks for Hilum's one-row kernels (Q5_0, Q8_0, Q4_K, Q6_K), used before `quant`.
    blocks: Option<QMat>,
    b: Option<Tensor>,
    /// `b` as a slice, for the one-token step.
    b_v: Option<Vec<f32>>,
}

impl Linear {
    /// A layer on an f32 matrix (out, in) alone, e.g. from a safetensors checkpoint.
    pub(crate) fn from_dense(w: Tensor) -> Self {
        Linear {
            dense: Some(w),
            quant: None,
            blocks: None,
            b: None,
            b_v: None,
        }
    }

    /// A layer on an f32 matrix (out, in), quantized to `quantize` blocks for candle's
    /// `QMatMul` alone (no f32 copy: the point is the memory); `None`, or a matrix whose rows
    /// do not split into whole blocks, stays f32.
    pub(crate) fn stored(w: Tensor, quantize: Option<GgmlDType>) -> candle_core::Result<Self> {
        match quantize {
            Some(dt) if w.dim(D::Minus1)?.is_multiple_of(dt.block_size()) => {
                Self::from_qtensor(QTensor::quantize(&w, dt)?)
            }
            _ => Ok(Self::from_dense(w)),
        }
    }

    /// A layer on quantized blocks for candle's `QMatMul` alone.
    pub(crate) fn from_qtensor(q: QTensor) -> candle_core::Result<Self> {
        Ok(Linear {
            dense: None,
            quant: Some(QMatMul::from_qtensor(q)?),
            blocks: None,
            b: None,
            b_v: None,
        })
    }

    /// The layer with a bias `b` (out) added to its products.
    pub(crate) fn with_bias(mut self, b: Option<Tensor>) -> candle_core::Result<Self> {
        self.b_v = b.as_ref().map(|b| b.to_vec1()).transpose()?;
        self.b = b;
        Ok(self)
    }

    /// Whether the GGUF blocks are kept for the one-row kernels.
    pub(crate) fn has_blocks(&self) -> bool {
        self.blocks.is_some()
    }

    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let rows = x.dim(0)?;
        let y = match (&self.dense, &self.quant, &self.blocks) {
            // A few rows (a grammar-forced batch, a short prompt chunk) cost less as block
            // products than as a dense gemm, which reads four times the bytes of weights: on a
            // 2-core AVX2 machine 8 rows took 0.48 s one by one vs 0.88 s dense. `matmat`
            // streams the blocks once for all the rows.
            (_, _, Some(m)) if rows <= FEW_ROWS => {
                let xv = x.flatten_all()?.to_vec1::<f32>()?;
                let mut y = vec![0f32; rows * m.rows()];
                qmatvec::matmat(&xv, m, &mut y)?;
                Tensor::from_vec(y, (rows, m.rows()), x.device())?
            }
            (Some(_), Some(q), _) if rows == 1 => q.forward(x)?,
            // (t, in) x (in, out): gemm reads W^T through strides, no copy.
            (Some(w), _, _) => x.matmul(&w.t()?)?,
            (None, Some(q), _) => q.forward(x)?,
            // `load` keeps a dense or a candle copy beside the blocks for several rows.
            (None, None, _) => {
                candle_core::bail!("a linear layer has no weights for {rows} rows")
            }
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

pub(crate) struct RmsNorm {
    alpha: Tensor,
    /// `alpha` as a slice, for the one-token step.
    w: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    pub(crate) fn load(
        ct: &gguf_file::Content,
        r: &mut std::fs::File,
        name: &str,
        eps: f32,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let alpha = dense(ct, r, name, dev)?;
        Ok(RmsNorm {
            w: alpha.to_vec1()?,
            alpha,
            eps,
        })
    }

    /// A norm whose weight multiplies as given (a GGUF's Gemma norms already hold "1 + w").
    pub(crate) fn from_weight(alpha: Tensor, eps: f32) -> candle_core::Result<Self> {
        Ok(RmsNorm {
            w: alpha.to_vec1()?,
            alpha,
            eps,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::rms_norm(x, &self.alpha, self.eps)
    }

    /// Normalises `x` in place, in pieces of the weight's length (one head each for q/k norms).
    pub(crate) fn forward_inplace(&self, x: &mut [f32]) {
        for piece in x.chunks_exact_mut(self.w.len().max(1)) {
            let ms = piece.iter().map(|v| v * v).sum::<f32>() / piece.len() as f32;
            let inv = 1.0 / (ms + self.eps).sqrt();
            for (v, w) in piece.iter_mut().zip(&self.w) {
                *v = *v * inv * w;
            }
        }
    }

    /// `x` normalised into `out` (both of the weight's length).
    pub(crate) fn forward_slice(&self, x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
        self.forward_inplace(out);
    }
}

/// Whether every matrix keeps its GGUF blocks on the CPU, so one-token steps can run on slices.
pub(crate) fn one_token_ready<'a>(
    dev: &Device,
    output: &Linear,
    matrices: impl IntoIterator<Item = &'a Linear>,
) -> bool {
    dev.is_cpu() && output.has_blocks() && matrices.into_iter().all(Linear::has_blocks)
}

/// The one-token gated FFN: `down(act(gate(h)) * up(h))` into `out`, gate and up in one
/// parallel product (`gu` is scratch space).
pub(crate) fn gated_ffn(
    h: &[f32],
    (gate, up, down): (&Linear, &Linear, &Linear),
    act: impl Fn(f32) -> f32,
    gu: &mut Vec<f32>,
    out: &mut [f32],
) -> candle_core::Result<()> {
    let (gate, up) = (blocks(gate)?, blocks(up)?);
    gu.resize(gate.rows() + up.rows(), 0.0);
    qmatvec::matvec(h, &[gate, up], gu)?;
    let (g, u) = gu.split_at_mut(gate.rows());
    for (g, u) in g.iter_mut().zip(u.iter()) {
        *g = act(*g) * u;
    }
    qmatvec::matvec(g, &[blocks(down)?], out)
}

/// The logits of one normalised hidden state through the output layer's blocks.
pub(crate) fn logits_one(h: &[f32], output: &Linear, dev: &Device) -> candle_core::Result<Tensor> {
    let out = blocks(output)?;
    let mut logits = vec![0f32; out.rows()];
    qmatvec::matvec(h, &[out], &mut logits)?;
    let n = logits.len();
    Tensor::from_vec(logits, n, dev)
}

struct Layer {
    attn_norm: RmsNorm,
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    ffn_norm: RmsNorm,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// Keys and values of the processed positions, per layer, position-major: (len, n_kv_head *
/// head_dim). A new position is appended in place (no copy of the cache per token), and a
/// truncation is a `Vec::truncate`. Shared by the qwen2/llama and the Gemma 3 decoders.
pub struct KvCache {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    /// On a GPU, each layer's keys and values as device tensors (n_kv_head, len, head_dim),
    /// grown on the device: uploading the cache, or reading each new row back, for every token
    /// would cost more than the token's arithmetic (each read is a device sync). There a
    /// layer's mirror, when present, is the truth and `k`/`v` hold only what `restore` put
    /// there (uploaded on the next append); a snapshot reads the mirror back.
    mirror: Vec<Option<(Tensor, Tensor)>>,
    /// Appends go to the device copies (a model off the CPU).
    mirrored: bool,
    /// n_kv_head * head_dim: one position's row.
    kvd: usize,
    len: usize,
}

impl KvCache {
    /// An empty cache for a model on `dev`.
    pub(crate) fn new(n_layer: usize, kvd: usize, dev: &Device) -> Self {
        KvCache {
            k: vec![Vec::new(); n_layer],
            v: vec![Vec::new(); n_layer],
            mirror: vec![None; n_layer],
            mirrored: !dev.is_cpu(),
            kvd,
            len: 0,
        }
    }

    /// Positions every layer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on.
    pub(crate) fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        for slot in self.k.iter_mut().chain(self.v.iter_mut()) {
            slot.truncate(len * self.kvd);
        }
        for m in self.mirror.iter_mut() {
            *m = m
                .take()
                .and_then(|(k, v)| Some((k.narrow(1, 0, len).ok()?, v.narrow(1, 0, len).ok()?)));
        }
        self.len = len;
    }

    /// Appends layer `li`'s keys and values of `t` new positions, (n_kv_head, t, head_dim)
    /// each, and returns the layer's keys and values of all `len + t` positions in that layout.
    /// [`KvCache::advance`] counts the positions once every layer has appended them.
    pub(crate) fn append(
        &mut self,
        li: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (pos, kvd) = (self.len, self.kvd);
        let (nkv, t, hd) = k.dims3()?;
        let upload = |slot: &[f32], dev: &Device| -> candle_core::Result<Tensor> {
            Tensor::from_slice(slot, (slot.len() / kvd, nkv, hd), dev)?
                .transpose(0, 1)?
                .contiguous()
        };
        let whole = |new: &Tensor, slot: &mut Vec<f32>| -> candle_core::Result<Tensor> {
            slot.extend(new.transpose(0, 1)?.flatten_all()?.to_vec1::<f32>()?);
            if pos == 0 {
                return Ok(new.clone());
            }
            upload(&slot[..(pos + t) * kvd], new.device())
        };
        if !self.mirrored {
            return Ok((whole(k, &mut self.k[li])?, whole(v, &mut self.v[li])?));
        }
        let dev = k.device().clone();
        let old = match self.mirror[li].take() {
            Some((mk, mv)) if mk.dim(1)? == pos => Some((mk, mv)),
            Some(_) => candle_core::bail!("the KV cache's device copy lost its length"),
            None if pos == 0 => None,
            None if self.k[li].len() >= pos * kvd => Some((
                upload(&self.k[li][..pos * kvd], &dev)?,
                upload(&self.v[li][..pos * kvd], &dev)?,
            )),
            None => candle_core::bail!("the KV cache has no rows for {pos} positions"),
        };
        let (ak, av) = match old {
            Some((mk, mv)) => (Tensor::cat(&[&mk, k], 1)?, Tensor::cat(&[&mv, v], 1)?),
            None => (k.contiguous()?, v.contiguous()?),
        };
        self.mirror[li] = Some((ak.clone(), av.clone()));
        Ok((ak, av))
    }

    /// Appends layer `li`'s key and value rows of one new position; returns all of the layer's
    /// key and value rows.
    pub(crate) fn push(&mut self, li: usize, k: &[f32], v: &[f32]) -> (&[f32], &[f32]) {
        self.k[li].extend_from_slice(k);
        self.v[li].extend_from_slice(v);
        (&self.k[li], &self.v[li])
    }

    /// Counts `t` appended positions (after every layer appended them).
    pub(crate) fn advance(&mut self, t: usize) {
        self.len += t;
    }

    /// A copy of the first `len` positions of every layer (for the prefix cache).
    pub(crate) fn snapshot(&self, tokens: &[u32]) -> Option<KvSnapshot> {
        let n = tokens.len() * self.kvd;
        if tokens.len() > self.len {
            return None;
        }
        // A device copy (n_kv_head, len, head_dim) read back as position-major rows.
        let rows = |t: &Tensor| -> Option<Vec<f32>> {
            t.narrow(1, 0, tokens.len())
                .and_then(|t| t.transpose(0, 1)?.flatten_all()?.to_vec1::<f32>())
                .ok()
        };
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (li, m) in self.mirror.iter().enumerate() {
            match m {
                Some((mk, mv)) => {
                    k.push(rows(mk)?);
                    v.push(rows(mv)?);
                }
                None => {
                    k.push(self.k[li].get(..n)?.to_vec());
                    v.push(self.v[li].get(..n)?.to_vec());
                }
            }
        }
        Some(KvSnapshot {
            tokens: tokens.to_vec(),
            kvd: self.kvd,
            k,
            v,
        })
    }

    /// Replaces the whole cache by `snap`'s positions; refuses one of another shape.
    pub(crate) fn restore(&mut self, snap: &KvSnapshot) -> candle_core::Result<()> {
        let n = snap.tokens.len() * self.kvd;
        if snap.kvd != self.kvd
            || snap.k.len() != self.k.len()
            || snap.v.len() != self.v.len()
            || snap.k.iter().chain(&snap.v).any(|l| l.len() != n)
        {
            candle_core::bail!("a saved prompt prefix does not fit this model's KV cache");
        }
        for (dst, src) in self
            .k
            .iter_mut()
            .zip(&snap.k)
            .chain(self.v.iter_mut().zip(&snap.v))
        {
            dst.clear();
            dst.extend_from_slice(src);
        }
        self.mirror.iter_mut().for_each(|m| *m = None);
        self.len = snap.tokens.len();
        Ok(())
    }

    pub(crate) fn n_layer(&self) -> usize {
        self.k.len()
    }

    pub(crate) fn kvd(&self) -> usize {
        self.kvd
    }
}

/// Refuses an empty run of tokens and one past the positions a decoder was loaded with.
pub(crate) fn check_span(pos: usize, t: usize, max: usize) -> candle_core::Result<()> {
    if t == 0 {
        candle_core::bail!("forward called with no tokens");
    }
    if pos + t > max {
        candle_core::bail!(
            "{} positions exceed the context of {max} this model was loaded with",
            pos + t
        );
    }
    Ok(())
}

/// A Qwen2/Llama decoder with its KV cache, on the CPU block kernels or a candle device.
pub struct Model {
    /// Its hyper-parameters.
    pub cfg: Config,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: RmsNorm,
    output: Linear,
    cos: Tensor,
    sin: Tensor,
    cache: KvCache,
    /// Rotary tables as slices (positions x head_dim/2), for the one-token step.
    cos_v: Vec<f32>,
    sin_v: Vec<f32>,
    /// Every matrix has its GGUF blocks on the CPU: one-token steps run `forward_one`.
    one_token_path: bool,
    device: Device,
}

pub(crate) fn dense(
    ct: &gguf_file::Content,
    r: &mut std::fs::File,
    name: &str,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let q: QTensor = ct.tensor(r, name, dev)?;
    q.dequantize(dev)?.to_dtype(DType::F32)
}

/// Loads a weight matrix in the form(s) `mode` needs.
pub(crate) fn linear_weights(
    ct: &gguf_file::Content,
    r: &mut std::fs::File,
    name: &str,
    mode: MatmulMode,
    dev: &Device,
) -> candle_core::Result<Linear> {
    let q: QTensor = ct.tensor(r, name, dev)?;
    let w = q.dequantize(dev)?.to_dtype(DType::F32)?;
    let blocks = match (mode, dev) {
        (MatmulMode::Dense, _) => None,
        (_, Device::Cpu) => QMat::from_qtensor(&q)?,
        _ => None,
    };
    // Hybrid runs prompt chunks on the dense copy, so the blocks alone serve one-row decode;
    // Quantized keeps candle's batched kernels for prompt chunks.
    let quant = match (mode, &blocks) {
        (MatmulMode::Dense, _) | (MatmulMode::Hybrid, Some(_)) => None,
        _ => Some(quantized_for_dot(q, &w)?),
    };
    let dense = match mode {
        MatmulMode::Quantized => None,
        _ => Some(w),
    };
    Ok(Linear {
        dense,
        quant,
        blocks,
        b: None,
        b_v: None,
    })
}

/// The block type candle has a SIMD dot product for: kept as is, else re-quantized to Q8_0.
fn quantized_for_dot(q: QTensor, w: &Tensor) -> candle_core::Result<QMatMul> {
    let fast = matches!(
        q.dtype(),
        GgmlDType::Q4_0
            | GgmlDType::Q8_0
            | GgmlDType::Q2K
            | GgmlDType::Q3K
            | GgmlDType::Q4K
            | GgmlDType::Q5K
            | GgmlDType::Q6K
    );
    let in_dim = w.dim(D::Minus1)?;
    if fast {
        QMatMul::from_qtensor(q)
    } else if in_dim.is_multiple_of(GgmlDType::Q8_0.block_size()) {
        QMatMul::from_qtensor(QTensor::quantize(w, GgmlDType::Q8_0)?)
    } else {
        // F32/F16 weights (or odd shapes) stay dense inside QMatMul.
        QMatMul::from_qtensor(q)
    }
}

/// What a Hugging Face Llama/Mistral checkpoint adds to [`Config`] for [`Model::from_dense`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DenseLayout {
    /// Vocabulary size.
    pub vocab: usize,
    /// Width of the feed-forward layer.
    pub intermediate: usize,
    /// q/k/v/o carry biases (`attention_bias`).
    pub attention_bias: bool,
    /// gate/up/down carry biases (`mlp_bias`).
    pub mlp_bias: bool,
    /// The output layer is the embedding matrix (`tie_word_embeddings`).
    pub tied_embeddings: bool,
    /// Blocks the matrices are quantized to at load (Q8_0, Q4_K), for candle's `QMatMul`; `None`
    /// keeps them f32. A tied output layer stays f32, as the embedding lookup needs it.
    pub quantize: Option<GgmlDType>,
}

/// A layer `name` (`name.weight`, optionally `name.bias`) of a dense checkpoint.
fn dense_linear(
    get: &mut dyn FnMut(&str, &[usize]) -> candle_core::Result<Tensor>,
    name: &str,
    (out, inp): (usize, usize),
    bias: bool,
    quantize: Option<GgmlDType>,
) -> candle_core::Result<Linear> {
    let w = get(&format!("{name}.weight"), &[out, inp])?;
    let l = Linear::stored(w, quantize)?;
    let b = if bias {
        Some(get(&format!("{name}.bias"), &[out])?)
    } else {
        None
    };
    l.with_bias(b)
}

impl Model {
    /// Loads every tensor in the form `mode` multiplies with; rotary tables are sized for
    /// `max_positions`.
    pub fn load(
        ct: &gguf_file::Content,
        r: &mut std::fs::File,
        max_positions: usize,
        mode: MatmulMode,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let cfg = Config::from_gguf(ct)?;
        let eps = cfg.rms_eps as f32;
        let norm = |r: &mut std::fs::File, n: &str| RmsNorm::load(ct, r, n, eps, dev);
        let lin = |r: &mut std::fs::File, n: &str, bias: bool| -> candle_core::Result<Linear> {
            let b = if bias && ct.tensor_infos.contains_key(&format!("{n}.bias")) {
                Some(dense(ct, r, &format!("{n}.bias"), dev)?)
            } else {
                None
            };
            linear_weights(ct, r, &format!("{n}.weight"), mode, dev)?.with_bias(b)
        };
        let embed = dense(ct, r, "token_embd.weight", dev)?; // (vocab, n_embd)
                                                             // Only the last position goes through the output layer, even in a prompt chunk, so it
                                                             // is always a one-row product: the quantized form alone is enough unless `Dense`.
        let out_mode = match mode {
            MatmulMode::Dense => MatmulMode::Dense,
            _ => MatmulMode::Quantized,
        };
        let output_name = if ct.tensor_infos.contains_key("output.weight") {
            "output.weight"
        } else {
            // Tied embeddings (small Qwen/Llama variants).
            "token_embd.weight"
        };
        let output = linear_weights(ct, r, output_name, out_mode, dev)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            layers.push(Layer {
                attn_norm: norm(r, &format!("{p}.attn_norm.weight"))?,
                wq: lin(r, &format!("{p}.attn_q"), true)?,
                wk: lin(r, &format!("{p}.attn_k"), true)?,
                wv: lin(r, &format!("{p}.attn_v"), true)?,
                wo: lin(r, &format!("{p}.attn_output"), false)?,
                ffn_norm: norm(r, &format!("{p}.ffn_norm.weight"))?,
                gate: lin(r, &format!("{p}.ffn_gate"), false)?,
                up: lin(r, &format!("{p}.ffn_up"), false)?,
                down: lin(r, &format!("{p}.ffn_down"), false)?,
            });
        }
        let norm_out = norm(r, "output_norm.weight")?;
        Self::assemble(cfg, embed, layers, norm_out, output, max_positions, dev)
    }

    /// A decoder on f32 weights in Hugging Face's `LlamaForCausalLM` / `MistralForCausalLM`
    /// layout (`model.layers.N.self_attn.q_proj.weight`, `model.norm.weight`, `lm_head.weight`):
    /// `get(name)` returns the tensor `name` under the decoder's prefix, shapes are checked
    /// here. `cfg.rope` should be [`Rope::Halves`] (transformers' `rotate_half`). The matrices
    /// are quantized as `layout.quantize` says; such a model runs candle's kernels throughout
    /// (the one-token block path needs GGUF blocks).
    pub fn from_dense(
        cfg: Config,
        layout: &DenseLayout,
        get: &mut dyn FnMut(&str) -> candle_core::Result<Tensor>,
        max_positions: usize,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let (d, inter, vocab) = (cfg.n_embd, layout.intermediate, layout.vocab);
        let (qd, kvd) = (cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim);
        if cfg.n_head == 0 || cfg.n_kv_head == 0 || !cfg.n_head.is_multiple_of(cfg.n_kv_head) {
            candle_core::bail!(
                "inconsistent head counts ({} heads, {} kv heads)",
                cfg.n_head,
                cfg.n_kv_head
            );
        }
        let mut get = |name: &str, shape: &[usize]| -> candle_core::Result<Tensor> {
            let w = get(name)?.to_dtype(DType::F32)?;
            if w.dims() != shape {
                candle_core::bail!("{name} has shape {:?}, expected {shape:?}", w.dims());
            }
            Ok(w)
        };
        let eps = cfg.rms_eps as f32;
        let (ab, mb, q) = (layout.attention_bias, layout.mlp_bias, layout.quantize);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("model.layers.{i}");
            let mut lin = |s: &str, shape: (usize, usize), bias: bool| {
                dense_linear(&mut get, &format!("{p}.{s}"), shape, bias, q)
            };
            let wq = lin("self_attn.q_proj", (qd, d), ab)?;
            let wk = lin("self_attn.k_proj", (kvd, d), ab)?;
            let wv = lin("self_attn.v_proj", (kvd, d), ab)?;
            let wo = lin("self_attn.o_proj", (d, qd), ab)?;
            let gate = lin("mlp.gate_proj", (inter, d), mb)?;
            let up = lin("mlp.up_proj", (inter, d), mb)?;
            let down = lin("mlp.down_proj", (d, inter), mb)?;
            let mut norm =
                |s: &str| RmsNorm::from_weight(get(&format!("{p}.{s}.weight"), &[d])?, eps);
            layers.push(Layer {
                attn_norm: norm("input_layernorm")?,
                ffn_norm: norm("post_attention_layernorm")?,
                wq,
                wk,
                wv,
                wo,
                gate,
                up,
                down,
            });
        }
        let norm_out = RmsNorm::from_weight(get("model.norm.weight", &[d])?, eps)?;
        let embed = get("model.embed_tokens.weight", &[vocab, d])?;
        let output = if layout.tied_embeddings {
            Linear::from_dense(embed.clone())
        } else {
            dense_linear(&mut get, "lm_head", (vocab, d), false, q)?
        };
        Self::assemble(cfg, embed, layers, norm_out, output, max_positions, dev)
    }

    fn assemble(
        cfg: Config,
        embed: Tensor,
        layers: Vec<Layer>,
        norm: RmsNorm,
        output: Linear,
        max_positions: usize,
        dev: &Device,
    ) -> candle_core::Result<Self> {
        let max_positions = max_positions.min(cfg.context_length).max(1);
        let (cos, sin) = rotary_tables(cfg.head_dim, cfg.rope_base, max_positions, dev)?;
        let (n_layer, kvd) = (cfg.n_layer, cfg.n_kv_head * cfg.head_dim);
        // `forward_one` adds the biases of q/k/v only (qwen2's), so a model with others (a
        // checkpoint's `mlp_bias`) stays on the tensor path.
        let one_token_path = one_token_ready(
            dev,
            &output,
            layers
                .iter()
                .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]),
        ) && layers.iter().all(|l| {
            [&l.wo, &l.gate, &l.up, &l.down]
                .iter()
                .all(|m| m.b.is_none())
        });
        let cos_v = cos.flatten_all()?.to_vec1()?;
        let sin_v = sin.flatten_all()?.to_vec1()?;
        Ok(Model {
            cfg,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            cache: KvCache::new(n_layer, kvd, dev),
            cos_v,
            sin_v,
            one_token_path,
            device: dev.clone(),
        })
    }

    /// Positions the rotary tables cover: the longest conversation this model instance accepts.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// Rows of the embedding matrix.
    pub fn vocab(&self) -> usize {
        self.embed.dims()[0]
    }

    /// Number of positions in the KV cache.
    pub fn cached_len(&self) -> usize {
        self.cache.len()
    }

    pub(crate) fn kv(&mut self) -> &mut KvCache {
        &mut self.cache
    }

    /// An empty KV cache of this model's shape, for [`Model::forward_embeds`] (the model's own
    /// cache serves [`Model::forward`]; a separate one lets a shared model serve requests).
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.cfg.n_layer,
            self.cfg.n_kv_head * self.cfg.head_dim,
            &self.device,
        )
    }

    /// Forgets every cached position from `len` on.
    pub fn truncate_cache(&mut self, len: usize) -> candle_core::Result<()> {
        self.cache.truncate(len);
        Ok(())
    }

    /// The input embeddings of `tokens`: (tokens, n_embd).
    pub fn embed_tokens(&self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let n = self.vocab();
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= n) {
            candle_core::bail!("token id {t} is outside the vocabulary of {n}");
        }
        self.embed
            .index_select(&Tensor::new(tokens, &self.device)?, 0)
    }

    /// Runs `tokens` (appended after the cached positions) and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let t = tokens.len();
        check_span(self.cache.len(), t, self.max_positions())?;
        // The cache is lent to the steps, which take it apart from `&self`.
        let mut cache = std::mem::replace(&mut self.cache, KvCache::new(0, 0, &self.device));
        let out = if t == 1 && self.one_token_path {
            self.embed
                .get(tokens[0] as usize)
                .and_then(|x| x.to_vec1())
                .and_then(|x| self.forward_one(x, &mut cache))
        } else {
            self.embed_tokens(tokens)
                .and_then(|x| self.hidden(x, &mut cache))
                .and_then(|h| self.logits(&h.i(t - 1..t)?)?.squeeze(0))
        };
        self.cache = cache;
        out
    }

    /// Runs `tokens` after the cached positions and returns the logits of every one of them
    /// (tokens, vocab): a draft checked in one pass.
    pub fn forward_all(&mut self, tokens: &[u32]) -> candle_core::Result<Tensor> {
        let x = self.embed_tokens(tokens)?;
        // The cache is lent to the pass, which takes it apart from `&self`.
        let mut cache = std::mem::replace(&mut self.cache, KvCache::new(0, 0, &self.device));
        let out = self.forward_embeds(&x, &mut cache, true);
        self.cache = cache;
        out
    }

    /// Runs input embeddings `x` (t, n_embd) appended after the positions in `cache` (from
    /// [`Model::new_cache`]) and returns the logits of every position (t, vocab), or of the
    /// last one (vocab) when `all` is false. Embeddings rather than ids let a multimodal model
    /// put image features where its image tokens are.
    pub fn forward_embeds(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        all: bool,
    ) -> candle_core::Result<Tensor> {
        let (t, n) = x.dims2()?;
        let kvd = self.cfg.n_kv_head * self.cfg.head_dim;
        if n != self.cfg.n_embd {
            candle_core::bail!(
                "embeddings of width {n}, the model's is {}",
                self.cfg.n_embd
            );
        }
        if cache.n_layer() != self.cfg.n_layer || cache.kvd() != kvd {
            candle_core::bail!("the KV cache belongs to a model of another shape");
        }
        check_span(cache.len(), t, self.max_positions())?;
        if t == 1 && self.one_token_path {
            let l = self.forward_one(x.flatten_all()?.to_vec1()?, cache)?;
            return if all { l.unsqueeze(0) } else { Ok(l) };
        }
        let h = self.hidden(x.clone(), cache)?;
        if all {
            self.logits(&h)
        } else {
            self.logits(&h.i(t - 1..t)?)?.squeeze(0)
        }
    }

    /// Final norm and output layer of hidden states (rows, n_embd).
    fn logits(&self, h: &Tensor) -> candle_core::Result<Tensor> {
        self.output.forward(&self.norm.forward(h)?)
    }

    /// The decoder layers over `x` (t, n_embd) after the positions in `cache`; returns the
    /// hidden states before the final norm and counts the positions in the cache.
    fn hidden(&self, mut x: Tensor, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let t = x.dim(0)?;
        let pos = cache.len();
        let mask = if t > 1 {
            Some(attention_mask(t, pos, 0, None, &self.device)?)
        } else {
            None
        };
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let (nh, nkv, hd) = (self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim);
        let scale = 1.0 / (hd as f64).sqrt();
        for (li, layer) in self.layers.iter().enumerate() {
            let h = layer.attn_norm.forward(&x)?;
            // (t, heads*hd) -> (heads, t, hd)
            let q = layer
                .wq
                .forward(&h)?
                .reshape((t, nh, hd))?
                .transpose(0, 1)?;
            let k = layer
                .wk
                .forward(&h)?
                .reshape((t, nkv, hd))?
                .transpose(0, 1)?;
            let v = layer
                .wv
                .forward(&h)?
                .reshape((t, nkv, hd))?
                .transpose(0, 1)?;
            let q = self.rotate(&q.contiguous()?, &cos, &sin)?;
            let k = self.rotate(&k.contiguous()?, &cos, &sin)?;
            let v = v.contiguous()?;
            let (k, v) = cache.append(li, &k, &v)?;
            // Grouped-query attention: the query heads of one group share a kv head, so fold
            // the group into the rows: (nkv, group*t, hd) x (nkv, hd, kv_len).
            let group = nh / nkv;
            let qg = q.reshape((nkv, group * t, hd))?;
            let att = (qg.matmul(&k.t()?)? * scale)?; // (nkv, group*t, kv_len)
            let att = match &mask {
                Some(m) => {
                    let kv_len = pos + t;
                    att.reshape((nkv, group, t, kv_len))?
                        .broadcast_add(m)?
                        .reshape((nkv, group * t, kv_len))?
                }
                None => att,
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(&v)?; // (nkv, group*t, hd)
            let y = y
                .reshape((nh, t, hd))?
                .transpose(0, 1)?
                .reshape((t, nh * hd))?;
            x = (layer.wo.forward(&y)? + &x)?;
            let h = layer.ffn_norm.forward(&x)?;
            let g = candle_nn::ops::silu(&layer.gate.forward(&h)?)?;
            let u = layer.up.forward(&h)?;
            x = (layer.down.forward(&(g * u)?)? + &x)?;
        }
        cache.advance(t);
        Ok(x)
    }

    /// One position (its input embedding `x`) after those in `cache`, on slices: the same
    /// arithmetic as `hidden` without a tensor allocation per operation, with q/k/v and gate/up
    /// each in one parallel product (decode is bound by reading the weights once per token).
    fn forward_one(&self, mut x: Vec<f32>, cache: &mut KvCache) -> candle_core::Result<Tensor> {
        let pos = cache.len();
        let (nh, nkv, hd) = (self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim);
        let (kvd, qd, half, group) = (nkv * hd, nh * hd, hd / 2, nh / nkv);
        let n_embd = self.cfg.n_embd;
        let scale = 1.0 / (hd as f32).sqrt();
        let cos = &self.cos_v[pos * half..(pos + 1) * half];
        let sin = &self.sin_v[pos * half..(pos + 1) * half];
        let mut h = vec![0f32; n_embd];
        let mut qkv = vec![0f32; qd + 2 * kvd];
        let mut att = vec![0f32; qd];
        let mut proj = vec![0f32; n_embd];
        let mut gu = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            layer.attn_norm.forward_slice(&x, &mut h);
            qmatvec::matvec(
                &h,
                &[blocks(&layer.wq)?, blocks(&layer.wk)?, blocks(&layer.wv)?],
                &mut qkv,
            )?;
            let (q, kv) = qkv.split_at_mut(qd);
            let (k, v) = kv.split_at_mut(kvd);
            for (part, lin) in [
                (&mut *q, &layer.wq),
                (&mut *k, &layer.wk),
                (&mut *v, &layer.wv),
            ] {
                if let Some(b) = &lin.b_v {
                    for (a, b) in part.iter_mut().zip(b) {
                        *a += b;
                    }
                }
            }
            for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
                rope_slice(self.cfg.rope, head, cos, sin);
            }
            let (kc, vc) = cache.push(li, k, v);
            attend(q, kc, vc, pos + 1, (group, hd, kvd), scale, &mut att);
            qmatvec::matvec(&att, &[blocks(&layer.wo)?], &mut proj)?;
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
            layer.ffn_norm.forward_slice(&x, &mut h);
            gated_ffn(
                &h,
                (&layer.gate, &layer.up, &layer.down),
                |g| g / (1.0 + (-g).exp()),
                &mut gu,
                &mut proj,
            )?;
            for (a, b) in x.iter_mut().zip(&proj) {
                *a += b;
            }
        }
        cache.advance(1);
        self.norm.forward_slice(&x, &mut h);
        logits_one(&h, &self.output, &self.device)
    }

    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        let x = x.unsqueeze(0)?;
        let y = match self.cfg.rope {
            Rope::Halves => candle_nn::rotary_emb::rope(&x, cos, sin)?,
            Rope::Pairs => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        };
        y.squeeze(0)
    }
}

/// One token's attention over `len` cached positions (`k`, `v`: (len, kvd) rows), heads split
/// over candle's thread pool. `shape` = (query heads per kv head, head_dim, kv row width).
pub(crate) fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    len: usize,
    shape: (usize, usize, usize),
    scale: f32,
    out: &mut [f32],
) {
    let (group, hd, kvd) = shape;
    let heads = q.len() / hd;
    let out_ptr = out.as_mut_ptr() as usize;
    let head = |hq: usize| {
        let qh = &q[hq * hd..(hq + 1) * hd];
        let g = (hq / group) * hd;
        let mut scores: Vec<f32> = (0..len)
            .map(|p| qmatvec::dot_f32(qh, &k[p * kvd + g..p * kvd + g + hd]) * scale)
            .collect();
        let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        // SAFETY: head `hq` writes only out[hq*hd..(hq+1)*hd]; `out` outlives the pool call.
        let o = unsafe { std::slice::from_raw_parts_mut((out_ptr as *mut f32).add(hq * hd), hd) };
        o.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            qmatvec::axpy(o, w / sum, &v[p * kvd + g..p * kvd + g + hd]);
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(heads, |range| range.for_each(head));
}

/// The GGUF blocks of a layer (`forward_one` runs only when every layer has them).
pub(crate) fn blocks(l: &Linear) -> candle_core::Result<&QMat> {
    l.blocks
        .as_ref()
        .ok_or_else(|| candle_core::Error::Msg("a layer has no quantized blocks".into()))
}

/// Rotary embedding of one head at one position, halves (NeoX) or pairs.
fn rope_slice(rope: Rope, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    match rope {
        Rope::Halves => rope_halves(x, cos, sin),
        Rope::Pairs => {
            for i in 0..half {
                let (a, b) = (x[2 * i], x[2 * i + 1]);
                x[2 * i] = a * cos[i] - b * sin[i];
                x[2 * i + 1] = a * sin[i] + b * cos[i];
            }
        }
    }
}

/// NeoX rotary embedding of one head: element `i` pairs with `i + head_dim / 2`.
pub(crate) fn rope_halves(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = a * sin[i] + b * cos[i];
    }
}

pub(crate) fn rotary_tables(
    head_dim: usize,
    base: f32,
    positions: usize,
    dev: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    rotary_tables_scaled(head_dim, base, 1.0, positions, dev)
}

/// Rotary tables with linear position scaling: position `p` turns as `p / factor` (Gemma 3 4B and
/// larger scale their global layers by 8).
pub(crate) fn rotary_tables_scaled(
    head_dim: usize,
    base: f32,
    factor: f32,
    positions: usize,
    dev: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let inv: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / base.powf(2.0 * i as f32 / head_dim as f32) / factor)
        .collect();
    let inv = Tensor::new(inv.as_slice(), dev)?.unsqueeze(0)?;
    let p = Tensor::arange(0u32, positions as u32, dev)?
        .to_dtype(DType::F32)?
        .unsqueeze(1)?;
    let ang = p.broadcast_mul(&inv)?; // (positions, head_dim/2)
    Ok((ang.cos()?, ang.sin()?))
}

/// Additive mask (t, pos + t - kv_start) for queries at `pos..pos + t` over keys at
/// `kv_start..pos + t`: a key is hidden when it comes after the query or, with a `window`, when
/// it is `window` or more positions before it (llama.cpp's standard sliding window).
pub fn attention_mask(
    t: usize,
    pos: usize,
    kv_start: usize,
    window: Option<usize>,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let kv = pos + t - kv_start;
    let mut v = Vec::with_capacity(t * kv);
    for i in 0..t {
        let qp = pos + i;
        for j in 0..kv {
            let kp = kv_start + j;
            let hidden = kp > qp || window.is_some_and(|w| qp - kp >= w);
            v.push(if hidden { f32::NEG_INFINITY } else { 0.0 });
        }
    }
    Tensor::from_vec(v, (t, kv), dev)
}

/// Greedy helper used by tests: index of the largest logit.
pub fn argmax(logits: &Tensor) -> candle_core::Result<u32> {
    logits.argmax(D::Minus1)?.to_scalar::<u32>()
}

/// xorshift64: a value in [-0.5, 0.5) per call, for seeded test weights.
#[cfg(test)]
pub(crate) fn xorshift_unit(seed: &mut u64) -> f32 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    (*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny Hugging Face-layout decoder (2 layers, GQA 4/2, head 8, attention biases) on
    /// seeded weights, optionally quantized.
    fn tiny_dense(quantize: Option<GgmlDType>) -> Model {
        let cfg = Config {
            arch: Arch::Llama,
            n_layer: 2,
            n_embd: 32,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 8,
            context_length: 64,
            rms_eps: 1e-5,
            rope_base: 10_000.0,
            rope: Rope::Halves,
        };
        let layout = DenseLayout {
            vocab: 50,
            intermediate: 64,
            attention_bias: true,
            mlp_bias: false,
            tied_embeddings: false,
            quantize,
        };
        let mut seed = 0x9E37_79B9u64;
        let mut get = |name: &str| -> candle_core::Result<Tensor> {
            let shape: Vec<usize> = match name.rsplit_once('.').map(|(n, _)| n) {
                Some(n) if n.ends_with("norm") || n.ends_with("layernorm") => vec![32],
                Some(n)
                    if name.ends_with(".bias")
                        && !n.ends_with("k_proj")
                        && !n.ends_with("v_proj") =>
                {
                    vec![32]
                }
                Some(_) if name.ends_with(".bias") => vec![16],
                Some(n) if n.ends_with("q_proj") || n.ends_with("o_proj") => vec![32, 32],
                Some(n) if n.ends_with("k_proj") || n.ends_with("v_proj") => vec![16, 32],
                Some(n) if n.ends_with("gate_proj") || n.ends_with("up_proj") => vec![64, 32],
                Some(n) if n.ends_with("down_proj") => vec![32, 64],
                _ => vec![50, 32],
            };
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let u = xorshift_unit(&mut seed);
                    if shape.len() == 1 && !name.ends_with(".bias") {
                        1.0 + 0.2 * u
                    } else {
                        u * 0.6
                    }
                })
                .collect();
            Tensor::from_vec(v, shape, &Device::Cpu)
        };
        Model::from_dense(cfg, &layout, &mut get, 64, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .and_then(|d| d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>())
            .unwrap()
    }

    /// Embeddings in, a separate cache, one position at a time: the logits of one pass over
    /// the ids, row for row; and `forward` over the ids (the model's own cache) agrees.
    #[test]
    fn forward_embeds_steps_agree_with_one_pass() {
        for quantize in [None, Some(GgmlDType::Q8_0)] {
            let mut m = tiny_dense(quantize);
            let ids = [3u32, 17, 42, 8, 0, 49];
            let x = m.embed_tokens(&ids).unwrap();
            let all = m.forward_embeds(&x, &mut m.new_cache(), true).unwrap();
            assert_eq!(all.dims(), [6, 50]);
            let mut cache = m.new_cache();
            m.forward_embeds(&x.narrow(0, 0, 3).unwrap(), &mut cache, false)
                .unwrap();
            for p in 3..6 {
                let l = m
                    .forward_embeds(&x.narrow(0, p, 1).unwrap(), &mut cache, false)
                    .unwrap();
                let d = max_diff(&l, &all.get(p).unwrap());
                assert!(d < 1e-4, "{quantize:?} position {p}: {d}");
            }
            assert_eq!(cache.len(), 6);
            let last = m.forward(&ids).unwrap();
            assert!(max_diff(&last, &all.get(5).unwrap()) < 1e-4);
            assert!(m.embed_tokens(&[50]).is_err());
            assert!(m
                .forward_embeds(&x, &mut KvCache::new(1, 16, &Device::Cpu), true)
                .is_err());
        }
    }

    #[test]
    fn precision_names() {
        for (s, p) in [
            ("", Precision::Dense),
            ("None", Precision::Dense),
            ("f32", Precision::Dense),
            ("Q8_0", Precision::Q8_0),
            (" q8 ", Precision::Q8_0),
            ("q4_k", Precision::Q4K),
        ] {
            assert_eq!(s.parse::<Precision>(), Ok(p), "{s:?}");
        }
        let e = "q5_0".parse::<Precision>().unwrap_err();
        assert!(
            e.contains("`q5_0`") && e.contains("none, q8_0 or q4k"),
            "{e}"
        );
        assert_eq!(Precision::Q4K.ggml(), Some(GgmlDType::Q4K));
        assert_eq!(Precision::Dense.ggml(), None);
    }

    /// (n_kv_head 2, t, head_dim 3) keys and values numbered from `start`.
    fn kv(t: usize, start: f32) -> (Tensor, Tensor) {
        let n = 2 * t * 3;
        let k: Vec<f32> = (0..n).map(|i| start + i as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        (
            Tensor::from_vec(k, (2, t, 3), &Device::Cpu).unwrap(),
            Tensor::from_vec(v, (2, t, 3), &Device::Cpu).unwrap(),
        )
    }

    /// The device-copy cache (forced on the CPU here) returns what the host-row cache returns
    /// through appends, a truncation, a snapshot and its restore.
    #[test]
    fn the_device_copy_cache_agrees_with_the_host_rows() {
        let mut host = KvCache::new(1, 6, &Device::Cpu);
        let mut dev = KvCache::new(1, 6, &Device::Cpu);
        dev.mirrored = true;
        let same = |a: (Tensor, Tensor), b: (Tensor, Tensor)| {
            assert_eq!(a.0.to_vec3::<f32>().unwrap(), b.0.to_vec3::<f32>().unwrap());
            assert_eq!(a.1.to_vec3::<f32>().unwrap(), b.1.to_vec3::<f32>().unwrap());
        };
        let step = |t: usize, start: f32, host: &mut KvCache, dev: &mut KvCache| {
            let (k, v) = kv(t, start);
            let a = host.append(0, &k, &v).unwrap();
            let b = dev.append(0, &k, &v).unwrap();
            host.advance(t);
            dev.advance(t);
            same(a, b);
        };
        step(4, 0.0, &mut host, &mut dev);
        step(1, 100.0, &mut host, &mut dev);
        host.truncate(3);
        dev.truncate(3);
        step(2, 200.0, &mut host, &mut dev);
        let tokens = [1u32, 2, 3, 4];
        let (sa, sb) = (
            host.snapshot(&tokens).unwrap(),
            dev.snapshot(&tokens).unwrap(),
        );
        assert_eq!((&sa.k, &sa.v), (&sb.k, &sb.v));
        step(1, 300.0, &mut host, &mut dev);
        host.restore(&sa).unwrap();
        dev.restore(&sb).unwrap();
        // After a restore the device copy is rebuilt from the restored rows.
        step(2, 400.0, &mut host, &mut dev);
        assert_eq!(dev.len(), 6);
        assert!(dev.snapshot(&[0; 7]).is_none());
    }
}
