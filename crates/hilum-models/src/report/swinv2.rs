//! SwinV2 image encoder, matching Hugging Face transformers' `Swinv2Model`
//! (`modeling_swinv2.py`; Liu et al., "Swin Transformer V2", CVPR 2022): patch embedding,
//! shifted-window attention with scaled cosine attention and a log-spaced continuous relative
//! position bias (`continuous_position_bias_mlp`), residual post-norm, patch merging, and the
//! final layer norm. Parameter names are those of the checkpoint under `encoder.`.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{layer_norm, linear, linear_no_bias, LayerNorm, VarBuilder};

use super::FlatLinear;
use serde::{Deserialize, Serialize};

/// `Swinv2Config` fields that change the computation (names as in `config.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwinV2Config {
    /// Side of the square input image, in pixels.
    #[serde(default = "d_image_size")]
    pub image_size: usize,
    /// Side of one square patch, in pixels.
    #[serde(default = "d_patch_size")]
    pub patch_size: usize,
    /// Channels of the input image.
    #[serde(default = "d_num_channels")]
    pub num_channels: usize,
    /// Width of the first stage's tokens (doubled at each later stage).
    #[serde(default = "d_embed_dim")]
    pub embed_dim: usize,
    /// Number of blocks in each stage.
    #[serde(default = "d_depths")]
    pub depths: Vec<usize>,
    /// Attention heads in each stage.
    #[serde(default = "d_num_heads")]
    pub num_heads: Vec<usize>,
    /// Side of the square attention window, in patches.
    #[serde(default = "d_window_size")]
    pub window_size: usize,
    /// Window sizes at pre-training per stage (the continuous position bias scales to them).
    #[serde(default)]
    pub pretrained_window_sizes: Vec<usize>,
    /// Width of the MLP relative to the tokens.
    #[serde(default = "d_mlp_ratio")]
    pub mlp_ratio: f64,
    /// Whether the query and value projections carry biases.
    #[serde(default = "d_true")]
    pub qkv_bias: bool,
    /// Epsilon of the layer norms.
    #[serde(default = "d_ln_eps")]
    pub layer_norm_eps: f64,
    /// Whether absolute position embeddings are added to the patches.
    #[serde(default)]
    pub use_absolute_embeddings: bool,
}

fn d_image_size() -> usize {
    224
}
fn d_patch_size() -> usize {
    4
}
fn d_num_channels() -> usize {
    3
}
fn d_embed_dim() -> usize {
    96
}
fn d_depths() -> Vec<usize> {
    vec![2, 2, 6, 2]
}
fn d_num_heads() -> Vec<usize> {
    vec![3, 6, 12, 24]
}
fn d_window_size() -> usize {
    7
}
fn d_mlp_ratio() -> f64 {
    4.0
}
fn d_true() -> bool {
    true
}
fn d_ln_eps() -> f64 {
    1e-5
}

impl SwinV2Config {
    /// SwinV2-Tiny, patch 4, window 8, 256 px (`microsoft/swinv2-tiny-patch4-window8-256`).
    pub fn tiny_patch4_window8_256() -> Self {
        SwinV2Config {
            image_size: 256,
            patch_size: 4,
            num_channels: 3,
            embed_dim: 96,
            depths: vec![2, 2, 6, 2],
            num_heads: vec![3, 6, 12, 24],
            window_size: 8,
            pretrained_window_sizes: vec![0, 0, 0, 0],
            mlp_ratio: 4.0,
            qkv_bias: true,
            layer_norm_eps: 1e-5,
            use_absolute_embeddings: false,
        }
    }

    /// Width of the last stage (the encoder's hidden size).
    pub fn hidden_size(&self) -> usize {
        self.embed_dim << self.depths.len().saturating_sub(1)
    }

    /// Checks the sizes fit together before any tensor is built; the error says which does not.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.depths.is_empty() || self.depths.len() != self.num_heads.len() {
            return Err(format!(
                "depths {:?} and num_heads {:?} must be non-empty and of equal length",
                self.depths, self.num_heads
            ));
        }
        // HF's default is four zeros whatever the number of stages; it reads one per stage.
        if !self.pretrained_window_sizes.is_empty()
            && self.pretrained_window_sizes.len() < self.depths.len()
        {
            return Err("pretrained_window_sizes must have an entry for every stage".into());
        }
        for (i, &h) in self.num_heads.iter().enumerate() {
            let dim = self.embed_dim << i;
            if h == 0 || !dim.is_multiple_of(h) {
                return Err(format!(
                    "stage {i}: width {dim} is not divisible by {h} heads"
                ));
            }
        }
        if self.patch_size == 0 || self.window_size == 0 || self.image_size == 0 {
            return Err("image_size, patch_size and window_size must be positive".into());
        }
        if self.use_absolute_embeddings {
            return Err("use_absolute_embeddings = true is not supported".into());
        }
        Ok(())
    }
}

/// Window size and shift of one block: a stage whose (configured) resolution fits in one
/// window uses that resolution as window and does not shift (`_compute_window_shift`).
fn window_and_shift(resolution: usize, window: usize, shift: usize) -> (usize, usize) {
    let w = resolution.min(window);
    let s = if resolution <= w { 0 } else { shift };
    (w, s)
}

struct PatchEmbed {
    weight: Tensor, // (embed, channels * p * p)
    bias: Tensor,
    patch: usize,
    norm: LayerNorm,
}

impl PatchEmbed {
    fn new(cfg: &SwinV2Config, vb: VarBuilder) -> Result<Self> {
        let p = cfg.patch_size;
        let w = vb
            .pp("patch_embeddings.projection")
            .get((cfg.embed_dim, cfg.num_channels, p, p), "weight")?;
        let bias = vb
            .pp("patch_embeddings.projection")
            .get(cfg.embed_dim, "bias")?;
        let weight = w.flatten_from(1)?.t()?.contiguous()?;
        let norm = layer_norm(cfg.embed_dim, cfg.layer_norm_eps, vb.pp("norm"))?;
        Ok(PatchEmbed {
            weight,
            bias,
            patch: p,
            norm,
        })
    }

    /// (b, c, H, W) → (b, h*w, embed) and (h, w). A stride-p convolution with a p×p kernel
    /// is one matmul over the unfolded patches.
    fn forward(&self, x: &Tensor) -> Result<(Tensor, usize, usize)> {
        let p = self.patch;
        let (b, c, hh, ww) = x.dims4()?;
        let x = x.pad_with_zeros(3, 0, (p - ww % p) % p)?;
        let x = x.pad_with_zeros(2, 0, (p - hh % p) % p)?;
        let (h, w) = (x.dim(2)? / p, x.dim(3)? / p);
        let patches = x
            .reshape((b, c, h, p, w, p))?
            .permute((0, 2, 4, 1, 3, 5))?
            .reshape((b * h * w, c * p * p))?;
        let y = patches
            .matmul(&self.weight)?
            .broadcast_add(&self.bias)?
            .reshape((b, h * w, ()))?;
        Ok((y.apply(&self.norm)?, h, w))
    }
}

struct WindowAttention {
    query: FlatLinear,
    key: FlatLinear,
    value: FlatLinear,
    out: FlatLinear,
    heads: usize,
    /// exp(clamp(logit_scale, max = ln 100)), (heads, 1, 1).
    scale: Tensor,
    /// 16 · sigmoid(cpb_mlp(table))[index], (heads, n, n); constant once loaded.
    bias: Tensor,
}

/// Relative coordinates of a (2w-1)² grid, log-spaced (SwinV2 §3.3), (2w-1)², 2 rows.
fn relative_coords_table(window: usize, pretrained: usize, dev: &Device) -> Result<Tensor> {
    let n = 2 * window - 1;
    let norm = if pretrained > 0 {
        (pretrained - 1) as f32
    } else if window > 1 {
        (window - 1) as f32
    } else {
        1.0
    };
    let mut v = Vec::with_capacity(n * n * 2);
    for i in 0..n {
        for j in 0..n {
            for c in [
                i as f32 - (window - 1) as f32,
                j as f32 - (window - 1) as f32,
            ] {
                let c = c / norm * 8.0;
                v.push(c.signum() * (c.abs() + 1.0).log2() / 8f32.log2());
            }
        }
    }
    Tensor::from_vec(v, (n * n, 2), dev)
}

/// For each pair of positions in a window, the row of the relative coordinates table.
fn relative_position_index(window: usize) -> Vec<u32> {
    let n = window * window;
    let mut idx = Vec::with_capacity(n * n);
    for a in 0..n {
        for b in 0..n {
            let dh = (a / window) as i64 - (b / window) as i64 + window as i64 - 1;
            let dw = (a % window) as i64 - (b % window) as i64 + window as i64 - 1;
            idx.push((dh * (2 * window as i64 - 1) + dw) as u32);
        }
    }
    idx
}

impl WindowAttention {
    fn new(
        cfg: &SwinV2Config,
        dim: usize,
        heads: usize,
        window: usize,
        pretrained: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let s = vb.pp("self");
        let lin = |name: &str, bias: bool| {
            if bias {
                linear(dim, dim, s.pp(name)).map(FlatLinear)
            } else {
                linear_no_bias(dim, dim, s.pp(name)).map(FlatLinear)
            }
        };
        let query = lin("query", cfg.qkv_bias)?;
        let key = lin("key", false)?;
        let value = lin("value", cfg.qkv_bias)?;
        let out = FlatLinear(linear(dim, dim, vb.pp("output.dense"))?);
        let logit_scale = s.get((heads, 1, 1), "logit_scale")?;
        let scale = logit_scale.clamp(f32::MIN, 100f32.ln())?.exp()?;

        let mlp = s.pp("continuous_position_bias_mlp");
        let fc1 = FlatLinear(linear(2, 512, mlp.pp("0"))?);
        let fc2 = FlatLinear(linear_no_bias(512, heads, mlp.pp("2"))?);
        let dev = vb.device();
        let table = relative_coords_table(window, pretrained, dev)?;
        let table = table.apply(&fc1)?.relu()?.apply(&fc2)?; // ((2w-1)², heads)
        let n = window * window;
        let index = Tensor::from_vec(relative_position_index(window), n * n, dev)?;
        let bias = table
            .index_select(&index, 0)?
            .reshape((n, n, heads))?
            .permute((2, 0, 1))?;
        let bias = (candle_nn::ops::sigmoid(&bias)? * 16.0)?.contiguous()?;
        Ok(WindowAttention {
            query,
            key,
            value,
            out,
            heads,
            scale,
            bias,
        })
    }

    /// `x`: (b·nW, n, c); `mask`: (nW, n, n) of 0 / -100.
    fn forward(&self, x: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (bw, n, c) = x.dims3()?;
        let hd = c / self.heads;
        let split = |t: Tensor| -> Result<Tensor> {
            t.reshape((bw, n, self.heads, hd))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = split(x.apply(&self.query)?)?;
        let k = split(x.apply(&self.key)?)?;
        let v = split(x.apply(&self.value)?)?;
        let q = l2_normalize(&q)?;
        let k = l2_normalize(&k)?;
        let attn = q.matmul(&k.t()?)?.broadcast_mul(&self.scale)?;
        let mut attn = attn.broadcast_add(&self.bias)?; // (bw, heads, n, n)
        if let Some(mask) = mask {
            // HF adds the shift mask twice (-200 across regions); do the same.
            let nw = mask.dim(0)?;
            let mask = (mask * 2.0)?.unsqueeze(1)?.unsqueeze(0)?;
            attn = attn
                .reshape((bw / nw, nw, self.heads, n, n))?
                .broadcast_add(&mask)?
                .reshape((bw, self.heads, n, n))?;
        }
        let p = candle_nn::ops::softmax_last_dim(&attn)?;
        p.matmul(&v)?
            .transpose(1, 2)?
            .reshape((bw, n, c))?
            .apply(&self.out)
    }
}

/// `F.normalize(x, dim=-1)`: x / max(‖x‖, 1e-12).
fn l2_normalize(x: &Tensor) -> Result<Tensor> {
    let norm = x
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f32::MAX)?;
    x.broadcast_div(&norm)
}

/// (b, H, W, c) → (b·nW, w·w, c), windows in row-major order.
fn window_partition(x: &Tensor, w: usize) -> Result<Tensor> {
    let (b, h, ww, c) = x.dims4()?;
    x.reshape((b, h / w, w, ww / w, w, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b * (h / w) * (ww / w), w * w, c))
}

/// Inverse of [`window_partition`].
fn window_reverse(x: &Tensor, w: usize, h: usize, ww: usize) -> Result<Tensor> {
    let c = x.dim(D::Minus1)?;
    let b = x.dim(0)? / ((h / w) * (ww / w));
    x.reshape((b, h / w, ww / w, w, w, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .reshape((b, h, ww, c))
}

/// The shifted-window mask for a padded (h, w) map: pairs from different regions get -100.
fn shift_mask(h: usize, w: usize, window: usize, shift: usize, dev: &Device) -> Result<Tensor> {
    let region = |i: usize, size: usize| -> usize {
        if i < size - window {
            0
        } else if i < size - shift {
            1
        } else {
            2
        }
    };
    let mut img = vec![0f32; h * w];
    for i in 0..h {
        for j in 0..w {
            img[i * w + j] = (region(i, h) * 3 + region(j, w)) as f32;
        }
    }
    let img = Tensor::from_vec(img, (1, h, w, 1), dev)?;
    let win = window_partition(&img, window)?.squeeze(D::Minus1)?; // (nW, n)
    let diff = win.unsqueeze(1)?.broadcast_sub(&win.unsqueeze(2)?)?;
    let zero = diff.zeros_like()?;
    let neg = (diff.ones_like()? * -100.0)?;
    diff.ne(&zero)?.where_cond(&neg, &zero)
}

struct Block {
    attention: WindowAttention,
    norm_before: LayerNorm,
    norm_after: LayerNorm,
    fc1: FlatLinear,
    fc2: FlatLinear,
    window: usize,
    shift: usize,
}

impl Block {
    fn forward(&self, x: &Tensor, h: usize, w: usize) -> Result<Tensor> {
        let (b, _, c) = x.dims3()?;
        let ws = self.window;
        let shortcut = x;
        let pad_h = (ws - h % ws) % ws;
        let pad_w = (ws - w % ws) % ws;
        let mut y = x
            .reshape((b, h, w, c))?
            .pad_with_zeros(2, 0, pad_w)?
            .pad_with_zeros(1, 0, pad_h)?;
        let (hp, wp) = (h + pad_h, w + pad_w);
        let s = self.shift;
        if s > 0 {
            y = y.roll(-(s as i32), 1)?.roll(-(s as i32), 2)?;
        }
        let mask = if s > 0 {
            Some(shift_mask(hp, wp, ws, s, x.device())?)
        } else {
            None
        };
        let windows = window_partition(&y, ws)?;
        let attended = self.attention.forward(&windows, mask.as_ref())?;
        let mut y = window_reverse(&attended, ws, hp, wp)?;
        if s > 0 {
            y = y.roll(s as i32, 1)?.roll(s as i32, 2)?;
        }
        let y = y.narrow(1, 0, h)?.narrow(2, 0, w)?.reshape((b, h * w, c))?;
        // Residual post-norm (SwinV2): x + LN(attn(x)), then h + LN(mlp(h)).
        let hidden = (shortcut + y.apply(&self.norm_before)?)?;
        let mlp = hidden.apply(&self.fc1)?.gelu_erf()?.apply(&self.fc2)?;
        hidden + mlp.apply(&self.norm_after)?
    }
}

struct PatchMerging {
    reduction: FlatLinear,
    norm: LayerNorm,
}

impl PatchMerging {
    /// (b, h·w, c) → (b, ⌈h/2⌉·⌈w/2⌉, 2c).
    fn forward(&self, x: &Tensor, h: usize, w: usize) -> Result<Tensor> {
        let (b, _, c) = x.dims3()?;
        let x = x
            .reshape((b, h, w, c))?
            .pad_with_zeros(2, 0, w % 2)?
            .pad_with_zeros(1, 0, h % 2)?;
        let (h2, w2) = (h.div_ceil(2), w.div_ceil(2));
        // HF concatenates x[0::2,0::2], x[1::2,0::2], x[0::2,1::2], x[1::2,1::2]:
        // the column offset varies slowest, then the row offset.
        x.reshape((b, h2, 2, w2, 2, c))?
            .permute((0, 1, 3, 4, 2, 5))?
            .reshape((b, h2 * w2, 4 * c))?
            .apply(&self.reduction)?
            .apply(&self.norm)
    }
}

struct Stage {
    blocks: Vec<Block>,
    downsample: Option<PatchMerging>,
}

/// `Swinv2Model` without the pooler: `forward` returns `last_hidden_state`.
pub struct SwinV2 {
    embed: PatchEmbed,
    stages: Vec<Stage>,
    norm: LayerNorm,
    cfg: SwinV2Config,
}

impl SwinV2 {
    /// `vb` is scoped at the encoder (`encoder.` in a VisionEncoderDecoder checkpoint).
    pub fn new(cfg: &SwinV2Config, vb: VarBuilder) -> Result<Self> {
        cfg.validate().map_err(candle_core::Error::msg)?;
        let embed = PatchEmbed::new(cfg, vb.pp("embeddings"))?;
        // Block windows follow the configured resolution, not the input's (as in HF).
        let grid = cfg.image_size / cfg.patch_size;
        let mut stages = Vec::with_capacity(cfg.depths.len());
        for (si, (&depth, &heads)) in cfg.depths.iter().zip(&cfg.num_heads).enumerate() {
            let dim = cfg.embed_dim << si;
            let resolution = grid >> si;
            let pretrained = cfg.pretrained_window_sizes.get(si).copied().unwrap_or(0);
            let svb = vb.pp(format!("encoder.layers.{si}"));
            let mut blocks = Vec::with_capacity(depth);
            for bi in 0..depth {
                let shift = if bi % 2 == 0 { 0 } else { cfg.window_size / 2 };
                let (window, shift) = window_and_shift(resolution, cfg.window_size, shift);
                let bvb = svb.pp(format!("blocks.{bi}"));
                let hidden = (dim as f64 * cfg.mlp_ratio) as usize;
                blocks.push(Block {
                    attention: WindowAttention::new(
                        cfg,
                        dim,
                        heads,
                        window,
                        pretrained,
                        bvb.pp("attention"),
                    )?,
                    norm_before: layer_norm(dim, cfg.layer_norm_eps, bvb.pp("layernorm_before"))?,
                    norm_after: layer_norm(dim, cfg.layer_norm_eps, bvb.pp("layernorm_after"))?,
                    fc1: FlatLinear(linear(dim, hidden, bvb.pp("intermediate.dense"))?),
                    fc2: FlatLinear(linear(hidden, dim, bvb.pp("output.dense"))?),
                    window,
                    shift,
                });
            }
            let downsample = if si + 1 < cfg.depths.len() {
                let d = svb.pp("downsample");
                Some(PatchMerging {
                    reduction: FlatLinear(linear_no_bias(4 * dim, 2 * dim, d.pp("reduction"))?),
                    norm: layer_norm(2 * dim, cfg.layer_norm_eps, d.pp("norm"))?,
                })
            } else {
                None
            };
            stages.push(Stage { blocks, downsample });
        }
        let norm = layer_norm(cfg.hidden_size(), cfg.layer_norm_eps, vb.pp("layernorm"))?;
        Ok(SwinV2 {
            embed,
            stages,
            norm,
            cfg: cfg.clone(),
        })
    }

    /// The configuration the encoder was built from.
    pub fn config(&self) -> &SwinV2Config {
        &self.cfg
    }

    /// `pixel_values` (b, channels, H, W), normalised → (b, tokens, hidden).
    pub fn forward(&self, pixel_values: &Tensor) -> Result<Tensor> {
        let pixel_values = pixel_values.to_dtype(DType::F32)?;
        let (mut x, mut h, mut w) = self.embed.forward(&pixel_values)?;
        for stage in &self.stages {
            for block in &stage.blocks {
                x = block.forward(&x, h, w)?;
            }
            if let Some(down) = &stage.downsample {
                x = down.forward(&x, h, w)?;
                h = h.div_ceil(2);
                w = w.div_ceil(2);
            }
        }
        self.norm.forward(&x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_shrinks_and_stops_shifting_when_the_map_fits() {
        assert_eq!(window_and_shift(64, 8, 4), (8, 4));
        assert_eq!(window_and_shift(8, 8, 4), (8, 0));
        assert_eq!(window_and_shift(7, 8, 4), (7, 0));
    }

    #[test]
    fn relative_index_is_symmetric_around_the_centre() {
        let idx = relative_position_index(2);
        // Same position → centre of the 3x3 table.
        assert_eq!(idx[0], 4);
        assert_eq!(idx.len(), 16);
        assert_eq!(*idx.iter().max().unwrap_or(&0), 8);
    }

    #[test]
    fn window_partition_round_trips() -> Result<()> {
        let x = Tensor::arange(0f32, 2.0 * 4.0 * 6.0 * 3.0, &Device::Cpu)?.reshape((2, 4, 6, 3))?;
        let w = window_partition(&x, 2)?;
        assert_eq!(w.dims(), &[12, 4, 3]);
        let back = window_reverse(&w, 2, 4, 6)?;
        let diff = (back - &x)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert_eq!(diff, 0.0);
        Ok(())
    }
}
