//! The lung-field U-Net of vk1996/Lung-Segmentation-TF on the native CPU, NHWC input as Keras
//! takes it.
//!
//! The network has 1-64 channels per layer, too few for packed gemms to pay off, so by default
//! it runs on its own direct kernels ([`kernels`]) and executor:
//! - every map lives in its own buffer with a one-pixel zero border (never written), so 3x3
//!   windows need no bounds checks or gathering;
//! - each decoder stage's nearest 2x upsampling + 3x3 conv is computed as four 2x2 convs on
//!   the low-resolution input, one per output parity (sub-pixel decomposition: the taps that
//!   read the same source pixel are summed at load), 2.25x fewer FLOPs and no upsampled map;
//! - bias, swish, the encoder's residual + BatchNorm + swish and the squeeze-excitation sums
//!   are applied to the accumulators before they are stored; each thread then computes the
//!   gate itself and folds it into its copy of the 1x1 projection's weights (no extra pass);
//! - on AVX-512, layers with 8 channels pair neighbouring output pixels in one 16-lane vector;
//! - every layer is handed out in row chunks of ~10 µs: the caller starts at once, persistent
//!   workers ([`pool`]) join when they wake, and a thread moves to the next layer when all of
//!   this layer's chunks are done; so a late or descheduled worker delays a chunk, not every
//!   layer (the squeeze-excitation sums are kept per chunk, so results do not depend on which
//!   thread ran what).
//!
//! Without AVX2 (or with `HILUM_UNET_ENGINE=gemm`) the network runs as a plan for the shared
//! im2col + gemm [`super::Executor`] instead; `HILUM_UNET_ENGINE=direct` forces the direct
//! kernels, and `HILUM_UNET_ISA=avx2|portable` caps their instruction set (for comparisons).

#[path = "unet_kernels.rs"]
mod kernels;
#[path = "unet_pool.rs"]
mod pool;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use self::kernels::{cpad, Act, Epi, Grid, HeadRow, Row};
use self::pool::Pool;
use super::{
    bn_affine, validate, Act as GemmAct, BatchNorm, ConvOp, CpuError, Executor, Folded, Op, Output,
    Plan, SeOp, View,
};
use crate::{Profile, UnetEngine};

/// One stage of the U-Net: a 3x3 conv (Keras `same` padding, `stride`) + `bn` + swish, for
/// encoder stages that keep their width `+ input`, `residual_bn` and swish, then
/// squeeze-excitation (channel means → `se_reduce` 1x1 + swish → `se_expand` 1x1 + sigmoid,
/// scaling the channels) and the 1x1 `project` + swish. Decoder stages upsample 2x (nearest)
/// first.
#[derive(Clone, Debug)]
pub struct UnetBlock {
    /// 3x3 conv of the stage.
    pub conv: crate::Conv,
    /// BatchNorm after `conv`.
    pub bn: BatchNorm,
    /// Stride of `conv`.
    pub stride: usize,
    /// BatchNorm after the residual sum, for encoder stages that keep their width.
    pub residual_bn: Option<BatchNorm>,
    /// Squeeze-excitation 1x1 conv that narrows the channel means.
    pub se_reduce: crate::Conv,
    /// Squeeze-excitation 1x1 conv back to one gate per channel.
    pub se_expand: crate::Conv,
    /// 1x1 projection after the squeeze-excitation.
    pub project: crate::Conv,
}

/// The U-Net's weights: encoder stages (every stage after the first max-pools 2x first), decoder
/// stages (each adds the matching encoder output after its projection) and the head, a 3x3
/// conv + `head_bn` + sigmoid to one channel.
#[derive(Clone, Debug)]
pub struct UnetWeights {
    /// Encoder stages, input side first.
    pub encoder: Vec<UnetBlock>,
    /// Decoder stages, deepest first.
    pub decoder: Vec<UnetBlock>,
    /// 3x3 conv to the single output channel.
    pub head: crate::Conv,
    /// BatchNorm after the head conv.
    pub head_bn: BatchNorm,
}

impl UnetWeights {
    fn in_channels(&self) -> Result<usize, CpuError> {
        self.encoder
            .first()
            .map(|b| b.conv.c_in)
            .ok_or_else(|| CpuError::Weights("a U-Net without encoder stages".into()))
    }
}

/// TensorFlow `same` padding along one axis: (before, after).
pub fn same_padding(size: usize, k: usize, stride: usize) -> (usize, usize) {
    let out = size.div_ceil(stride.max(1));
    let total = (out.saturating_sub(1) * stride + k).saturating_sub(size);
    (total / 2, total - total / 2)
}

/// A lung U-Net compiled for its input size.
pub struct NativeUnet {
    engine: Engine,
    size: usize,
    threads: usize,
}

enum Engine {
    Direct(Box<Direct>),
    Gemm(Box<Executor>),
}

impl std::fmt::Debug for NativeUnet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeUnet")
            .field("size", &self.size)
            .field("threads", &self.threads)
            .field(
                "engine",
                &match self.engine {
                    Engine::Direct(_) => "direct",
                    Engine::Gemm(_) => "gemm",
                },
            )
            .finish()
    }
}

/// Whether [`NativeUnet`] runs the direct kernels here (x86-64 with AVX2 or AVX-512, unless
/// [`CpuSettings::unet_engine`](crate::CpuSettings::unet_engine) says otherwise) rather than
/// the im2col + gemm plan.
pub fn direct_engine() -> bool {
    match crate::settings::unet_engine() {
        UnetEngine::Gemm => false,
        UnetEngine::Direct => true,
        UnetEngine::Auto => kernels::has_avx512() || kernels::has_avx2(),
    }
}

impl NativeUnet {
    /// `size`: the square input side (256 for `lung_seg_valiou_088.h5`).
    pub fn new(net: &UnetWeights, size: usize, threads: usize) -> Result<Self, CpuError> {
        let threads = threads.max(1);
        // The direct kernels are vectorised for x86-64 (AVX-512, AVX2); elsewhere the gemm
        // crate's kernels are faster than their scalar fallback.
        let direct = direct_engine();
        let engine = if direct {
            Engine::Direct(Box::new(Direct::new(net, size, threads)?))
        } else {
            Engine::Gemm(Box::new(gemm_plan(net, size, threads)?))
        };
        Ok(NativeUnet {
            engine,
            size,
            threads,
        })
    }

    /// Input (batch, size, size, 3) NHWC 0..255 → lung probabilities (batch, size, size).
    pub fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        match &self.engine {
            Engine::Direct(d) => d.forward(input, batch),
            Engine::Gemm(e) => e.forward(input, batch),
        }
    }

    /// Side of the square input the network was built for.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Worker threads this network runs on.
    pub fn threads(&self) -> usize {
        self.threads
    }
}

/// A zero-bordered NHWC map in its own buffer: `(h + 2) x (w + 2)` pixels of `c` floats.
#[derive(Clone, Copy, Debug)]
struct Map {
    buf: usize,
    h: usize,
    w: usize,
    c: usize,
}

impl Map {
    fn floats(&self) -> usize {
        (self.h + 2) * (self.w + 2) * self.c
    }
    /// Floats per bordered row.
    fn row(&self) -> usize {
        (self.w + 2) * self.c
    }
    /// Pixel (y, x) of the interior.
    fn interior(&self) -> Grid {
        Grid {
            org: self.row() + self.c,
            ys: self.row(),
            xs: self.c,
        }
    }
}

/// One direct convolution over the op's (rows x cols) grid.
#[derive(Debug)]
struct Pass {
    /// Window origin of each output pixel.
    input: Grid,
    output: Grid,
    /// (buffer, grid) added after the activation.
    residual: Option<(usize, Grid)>,
    taps: Vec<usize>,
    /// `[tap][cin][cpad(cout)]`.
    weight: Vec<f32>,
}

/// Squeeze-excitation gate folded into a 1x1 conv's weights, from the sums of `slot`.
#[derive(Debug)]
struct Gate {
    slot: usize,
    /// Output pixels per vector of the summing conv: its sums of channel `c` sit at
    /// `c + j * channels` for `j < fold`.
    fold: usize,
    pixels: usize,
    reduce: Folded,
    expand: Folded,
}

#[derive(Debug)]
struct Conv {
    /// For the profile: what the op computes (output size, channels) and its FLOPs (after the
    /// sub-pixel decomposition, without paired pixels' zero weights).
    name: String,
    flops: f64,
    src: usize,
    dst: usize,
    rows: usize,
    cols: usize,
    cin: usize,
    cout: usize,
    passes: Vec<Pass>,
    epi: Epi,
    /// Squeeze-excitation slot whose channel sums this conv accumulates.
    sums: Option<usize>,
    gate: Option<Gate>,
}

#[derive(Debug)]
struct HeadOp {
    src: Map,
    taps: Vec<usize>,
    /// `[tap][cin]`.
    weight: Vec<f32>,
    bias: f32,
}

#[derive(Debug)]
enum UOp {
    /// The image (NHWC) into the interior of a map.
    Input(Map),
    Conv(Box<Conv>),
    /// Keras MaxPooling2D(2).
    Pool {
        src: Map,
        dst: Map,
    },
    /// 3x3 conv to one channel + sigmoid, written to the output.
    Head(HeadOp),
}

/// `v` zero-padded to whole vectors.
fn padded(v: &[f32], c: usize) -> Vec<f32> {
    let mut out = vec![0f32; cpad(c)];
    out[..v.len().min(c)].copy_from_slice(&v[..v.len().min(c)]);
    out
}

/// Per-tap (cin x cout) matrices → `[tap][cin][cpad(cout)]`.
fn pack(mats: &[Vec<f32>], cin: usize, cout: usize) -> Vec<f32> {
    let cp = cpad(cout);
    let mut out = vec![0f32; mats.len() * cin * cp];
    for (t, m) in mats.iter().enumerate() {
        for ci in 0..cin {
            out[(t * cin + ci) * cp..][..cout].copy_from_slice(&m[ci * cout..][..cout]);
        }
    }
    out
}

/// Kernel rows (or columns) of a 3x3 conv that read low-resolution offset `d` (0: the earlier
/// one) for an output of parity `p`, when the conv runs on a nearest 2x upsampling.
const SPAN: [[&[usize]; 2]; 2] = [[&[0], &[1, 2]], [&[0, 1], &[2]]];

struct Builder {
    bufs: Vec<usize>,
    ops: Vec<UOp>,
    slots: usize,
    /// Pixels per vector of the last conv's sums (see [`Gate::fold`]).
    last_fold: usize,
    /// Pair neighbouring output pixels of layers with at most 8 channels in one 16-lane vector
    /// (AVX-512 only: AVX2 vectors are already full at 8).
    pair: bool,
}

impl Builder {
    fn map(&mut self, h: usize, w: usize, c: usize) -> Map {
        let m = Map {
            buf: self.bufs.len(),
            h,
            w,
            c,
        };
        self.bufs.push(m.floats());
        m
    }

    /// 3x3 weights of `conv` with `bn` folded in, for `cin` inputs: (weights, bias padded,
    /// cout).
    fn fold3(
        conv: &crate::Conv,
        bn: &BatchNorm,
        cin: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, usize), CpuError> {
        let cout = conv.c_out;
        let (w, b) = ConvOp::fold(conv, Some(bn))?;
        if w.len() != 9 * cin * cout {
            return Err(CpuError::Weights(format!(
                "expected a 3x3 conv from {cin} channels, got {} weights for {cout} outputs",
                w.len()
            )));
        }
        let bias = padded(b.as_deref().unwrap_or(&[]), cout);
        Ok((w, bias, cout))
    }

    /// A block's 3x3 conv (+ folded BN, swish [, + input, BN, swish]), accumulating the
    /// squeeze-excitation sums; on a 2x upsampling of `src` when `up2`.
    fn conv3(
        &mut self,
        src: Map,
        blk: &UnetBlock,
        up2: bool,
        name: String,
    ) -> Result<Map, CpuError> {
        let cin = src.c;
        let (w, bias, cout) = Self::fold3(&blk.conv, &blk.bn, cin)?;
        let tap = |ky: usize, kx: usize| &w[(ky * 3 + kx) * cin * cout..][..cin * cout];
        let slot = self.slots;
        self.slots += 1;
        let epi = |post: Option<(Vec<f32>, Vec<f32>)>| Epi {
            bias: bias.clone(),
            act: Act::Swish,
            post_act: if post.is_some() {
                Act::Swish
            } else {
                Act::None
            },
            post,
        };
        let (dst, rows, cols, passes, epi) = if up2 {
            if blk.stride != 1 || blk.residual_bn.is_some() {
                return Err(CpuError::Weights(
                    "upsampling block with a stride or residual".into(),
                ));
            }
            let dst = self.map(2 * src.h, 2 * src.w, cout);
            // Effective 2x2 kernel of output parity (py, px), tap (dy, dx): (cin x cout).
            let eff = |py: usize, px: usize, dy: usize, dx: usize| {
                let mut m = vec![0f32; cin * cout];
                for &ky in SPAN[py][dy] {
                    for &kx in SPAN[px][dx] {
                        m.iter_mut().zip(tap(ky, kx)).for_each(|(a, b)| *a += b);
                    }
                }
                m
            };
            let mut passes = Vec::new();
            if self.pair && 2 * cout <= 16 {
                // Both column parities in one vector: lanes [0, cout) are output column 2x
                // (low-resolution columns x-1, x), lanes [cout, 2 cout) column 2x + 1 (x, x+1),
                // so each row parity is a 2x3 conv to 2 * cout channels, stored contiguously.
                let vc = 2 * cout;
                for py in 0..2 {
                    let mut mats = Vec::new();
                    let mut taps = Vec::new();
                    for dy in 0..2 {
                        for cx in 0..3usize {
                            let mut m = vec![0f32; cin * vc];
                            for (px, dx) in [(0, cx), (1, cx.wrapping_sub(1))] {
                                if dx < 2 {
                                    let e = eff(py, px, dy, dx);
                                    for ci in 0..cin {
                                        m[ci * vc + px * cout..][..cout]
                                            .copy_from_slice(&e[ci * cout..][..cout]);
                                    }
                                }
                            }
                            mats.push(m);
                            taps.push(dy * src.row() + cx * src.c);
                        }
                    }
                    passes.push(Pass {
                        input: Grid {
                            org: py * src.row(),
                            ys: src.row(),
                            xs: src.c,
                        },
                        output: Grid {
                            org: dst.interior().at(py, 0),
                            ys: 2 * dst.row(),
                            xs: vc,
                        },
                        residual: None,
                        taps,
                        weight: pack(&mats, cin, vc),
                    });
                }
            } else {
                for py in 0..2 {
                    for px in 0..2 {
                        let mut mats = Vec::new();
                        let mut taps = Vec::new();
                        for dy in 0..2 {
                            for dx in 0..2 {
                                mats.push(eff(py, px, dy, dx));
                                taps.push(dy * src.row() + dx * src.c);
                            }
                        }
                        passes.push(Pass {
                            input: Grid {
                                org: py * src.row() + px * src.c,
                                ys: src.row(),
                                xs: src.c,
                            },
                            output: Grid {
                                org: dst.interior().at(py, px),
                                ys: 2 * dst.row(),
                                xs: 2 * dst.c,
                            },
                            residual: None,
                            taps,
                            weight: pack(&mats, cin, cout),
                        });
                    }
                }
            }
            (dst, src.h, src.w, passes, epi(None))
        } else {
            let s = blk.stride;
            let (ph, _) = same_padding(src.h, 3, s);
            let (pw, _) = same_padding(src.w, 3, s);
            if ph > 1 || pw > 1 {
                return Err(CpuError::Weights(format!(
                    "3x3 stride {s} conv needs padding {ph}x{pw} > 1"
                )));
            }
            let dst = self.map(src.h.div_ceil(s), src.w.div_ceil(s), cout);
            let (residual, post) = match &blk.residual_bn {
                Some(bn) => {
                    if s != 1 || cin != cout {
                        return Err(CpuError::Weights(
                            "residual block changes its size or width".into(),
                        ));
                    }
                    let a = bn_affine(bn)?;
                    let (scale, shift) = (a.scale, a.shift);
                    (
                        Some((src.buf, src.interior())),
                        Some((padded(&scale, cout), padded(&shift, cout))),
                    )
                }
                None => (None, None),
            };
            let mats: Vec<Vec<f32>> = (0..9).map(|t| tap(t / 3, t % 3).to_vec()).collect();
            let pass = Pass {
                input: Grid {
                    org: (1 - ph) * src.row() + (1 - pw) * src.c,
                    ys: s * src.row(),
                    xs: s * src.c,
                },
                output: dst.interior(),
                residual,
                taps: (0..9).map(|t| t / 3 * src.row() + t % 3 * src.c).collect(),
                weight: pack(&mats, cin, cout),
            };
            (dst, dst.h, dst.w, vec![pass], epi(post))
        };
        // Paired passes write two pixels' channels per output: 2 * cout lanes.
        let fold = if up2 && passes.len() == 2 { 2 } else { 1 };
        let vc = fold * cout;
        let epi = Epi {
            bias: padded(&epi.bias[..cout].repeat(fold), vc),
            ..epi
        };
        self.last_fold = fold;
        let taps = if up2 { 4 } else { 9 };
        let how = match (up2, fold) {
            (false, _) => String::new(),
            (true, 1) => " as 4 2x2 convs".into(),
            (true, _) => " as 2 paired 2x3 convs".into(),
        };
        self.ops.push(UOp::Conv(Box::new(Conv {
            name: format!("{name}{how} to {}x{}x{cout}", dst.h, dst.w),
            flops: 2.0 * (dst.h * dst.w * taps * cin * cout) as f64,
            src: src.buf,
            dst: dst.buf,
            rows,
            cols,
            cin,
            cout: vc,
            passes,
            epi,
            sums: Some(slot),
            gate: None,
        })));
        Ok(dst)
    }

    /// The block's squeeze-excitation-gated 1x1 projection + swish [+ skip].
    fn project(
        &mut self,
        t: Map,
        blk: &UnetBlock,
        skip: Option<Map>,
        name: String,
    ) -> Result<Map, CpuError> {
        let cin = t.c;
        let cout = blk.project.c_out;
        let (w, b) = ConvOp::fold(&blk.project, None)?;
        if w.len() != cin * cout {
            return Err(CpuError::Weights(format!(
                "expected a 1x1 conv from {cin} channels, got {} weights",
                w.len()
            )));
        }
        let dst = self.map(t.h, t.w, cout);
        let residual = match skip {
            Some(s) if (s.h, s.w, s.c) == (dst.h, dst.w, dst.c) => Some((s.buf, s.interior())),
            Some(s) => {
                return Err(CpuError::Weights(format!(
                    "skip {}x{}x{} does not match the decoder's {}x{}x{}",
                    s.h, s.w, s.c, dst.h, dst.w, dst.c
                )))
            }
            None => None,
        };
        let bias = b.unwrap_or_else(|| vec![0.0; cout]);
        // With at most 8 channels, two neighbouring pixels form one 16-lane output: taps at
        // the two pixels with block-diagonal weights.
        let pass = if self.pair && 2 * cout <= 16 && t.w.is_multiple_of(2) {
            let vc = 2 * cout;
            let mats: Vec<Vec<f32>> = (0..2)
                .map(|px| {
                    let mut m = vec![0f32; cin * vc];
                    for ci in 0..cin {
                        m[ci * vc + px * cout..][..cout].copy_from_slice(&w[ci * cout..][..cout]);
                    }
                    m
                })
                .collect();
            let pairs = |g: Grid| Grid { xs: 2 * g.xs, ..g };
            Pass {
                input: pairs(t.interior()),
                output: pairs(dst.interior()),
                residual: residual.map(|(buf, g)| (buf, pairs(g))),
                taps: vec![0, cin],
                weight: pack(&mats, cin, vc),
            }
        } else {
            Pass {
                input: t.interior(),
                output: dst.interior(),
                residual,
                taps: vec![0],
                weight: pack(&[w], cin, cout),
            }
        };
        let fold = pass.taps.len();
        self.ops.push(UOp::Conv(Box::new(Conv {
            name: format!(
                "{name}{} to {}x{}x{cout}",
                if fold > 1 { " paired" } else { "" },
                dst.h,
                dst.w
            ),
            flops: 2.0 * (dst.h * dst.w * cin * cout) as f64,
            src: t.buf,
            dst: dst.buf,
            rows: t.h,
            cols: t.w / fold,
            cin,
            cout: fold * cout,
            passes: vec![pass],
            epi: Epi {
                bias: padded(&padded(&bias, cout)[..cout].repeat(fold), fold * cout),
                act: Act::Swish,
                post: None,
                post_act: Act::None,
            },
            sums: None,
            gate: Some(Gate {
                fold: self.last_fold,
                slot: self.slots - 1,
                pixels: t.h * t.w,
                reduce: ConvOp::fold(&blk.se_reduce, None)?,
                expand: ConvOp::fold(&blk.se_expand, None)?,
            }),
        })));
        Ok(dst)
    }
}

/// The direct-kernel network.
struct Direct {
    ops: Vec<UOp>,
    /// Row chunks each op is handed out in.
    chunks: Vec<usize>,
    buf_sizes: Vec<usize>,
    slots: usize,
    /// Per slot: its first chunk's sums among an image's (`per_image` of them). Sums are kept
    /// per chunk, not per thread, so their order, and the output, does not depend on which
    /// thread ran what.
    slot_base: Vec<usize>,
    per_image: usize,
    /// Floats per squeeze-excitation sum (the widest padded width).
    cmax: usize,
    size: usize,
    in_channels: usize,
    pool: Pool,
    threads: usize,
    ws: Mutex<Option<Workspace>>,
}

struct Workspace {
    bufs: Vec<Vec<f32>>,
    /// Per thread: gate-scaled weights.
    scratch: Vec<Vec<f32>>,
}

/// What the threads of one forward share. Every chunk writes its own rows; an op's chunks
/// all complete (`done`) before any thread starts the next op, so reads see finished maps.
struct Shared {
    bufs: Vec<*mut f32>,
    /// Per image, slot and chunk: channel sums.
    sums_ptr: *mut f32,
    scratch: Vec<*mut f32>,
    input: *const f32,
    out: *mut f32,
    batch: usize,
    /// Per (image, op): next chunk to claim, chunks completed.
    claim: Vec<AtomicUsize>,
    done: Vec<AtomicUsize>,
    /// Set when a thread panicked: the others stop waiting.
    failed: AtomicBool,
}

// SAFETY: the raw pointers are only dereferenced under the chunk protocol above.
unsafe impl Sync for Shared {}

/// An op's rows and rough work per row (in 16-lane FMAs, the epilogue counted as ~16).
fn op_work(op: &UOp) -> (usize, usize) {
    match op {
        UOp::Input(m) => (m.h, m.w * m.c / 16),
        UOp::Pool { dst, .. } => (dst.h, dst.w * dst.c / 4),
        UOp::Head(h) => (h.src.h, h.src.w * h.taps.len() * h.src.c / 8),
        UOp::Conv(c) => {
            let per_px: usize = c.passes.iter().map(|p| p.taps.len() * c.cin + 16).sum();
            (c.rows, c.cols * per_px * cpad(c.cout) / 16)
        }
    }
}

/// Zmm-FMA-sized work units per chunk: ~10 µs, so claiming (one atomic) stays cheap and a
/// descheduled thread holds up little.
const CHUNK_WORK: usize = 1 << 14;

impl Direct {
    fn new(net: &UnetWeights, size: usize, threads: usize) -> Result<Self, CpuError> {
        let in_channels = net.in_channels()?;
        let mut b = Builder {
            bufs: Vec::new(),
            ops: Vec::new(),
            slots: 0,
            last_fold: 1,
            pair: kernels::has_avx512(),
        };
        let input = b.map(size, size, in_channels);
        b.ops.push(UOp::Input(input));
        let mut x = input;
        let mut skips = Vec::new();
        for (i, blk) in net.encoder.iter().enumerate() {
            if i > 0 {
                let p = b.map(x.h / 2, x.w / 2, x.c);
                b.ops.push(UOp::Pool { src: x, dst: p });
                x = p;
            }
            let t = b.conv3(
                x,
                blk,
                false,
                format!("enc{i} 3x3 s{} {}ch", blk.stride, x.c),
            )?;
            x = b.project(t, blk, None, format!("enc{i} 1x1 gated"))?;
            skips.push(x);
        }
        skips.pop(); // the bottleneck is `x` itself
        for (i, blk) in net.decoder.iter().enumerate() {
            let t = b.conv3(x, blk, true, format!("dec{i} up2+3x3 {}ch", x.c))?;
            let skip = skips.pop();
            let name = format!(
                "dec{i} 1x1 gated{}",
                if skip.is_some() { " +skip" } else { "" }
            );
            x = b.project(t, blk, skip, name)?;
        }
        let cin = x.c;
        let (w, bias, cout) = Builder::fold3(&net.head, &net.head_bn, cin)?;
        if cout != 1 || x.h != size || x.w != size {
            return Err(CpuError::Weights(format!(
                "head gives {cout} channels at {}x{}, expected 1 at {size}x{size}",
                x.h, x.w
            )));
        }
        b.ops.push(UOp::Head(HeadOp {
            src: x,
            taps: (0..9).map(|t| t / 3 * x.row() + t % 3 * x.c).collect(),
            weight: w,
            bias: bias[0],
        }));
        let cmax = b
            .ops
            .iter()
            .map(|op| match op {
                UOp::Conv(c) => cpad(c.cout.max(c.cin)),
                _ => 0,
            })
            .max()
            .unwrap_or(0);
        let chunks = b
            .ops
            .iter()
            .map(|op| {
                let (rows, work) = op_work(op);
                (rows * work).div_ceil(CHUNK_WORK).clamp(1, rows.max(1))
            })
            .collect();
        let mut slot_base = vec![0; b.slots];
        let mut per_image = 0;
        for (op, &n) in b.ops.iter().zip(&chunks) {
            if let UOp::Conv(c) = op {
                if let Some(slot) = c.sums {
                    slot_base[slot] = per_image;
                    per_image += n;
                }
            }
        }
        let d = Direct {
            ops: b.ops,
            slot_base,
            per_image,
            chunks,
            buf_sizes: b.bufs,
            slots: b.slots,
            cmax,
            size,
            in_channels,
            pool: Pool::new(threads)?,
            threads,
            ws: Mutex::new(None),
        };
        d.check()?;
        Ok(d)
    }

    /// Every read and write of every op stays inside its buffer (the kernels rely on it).
    fn check(&self) -> Result<(), CpuError> {
        let len = |buf: usize| self.buf_sizes.get(buf).copied().unwrap_or(0);
        let fits = |buf: usize, g: Grid, rows: usize, cols: usize, extra: usize| {
            rows == 0 || cols == 0 || g.at(rows - 1, cols - 1) + extra <= len(buf)
        };
        for op in &self.ops {
            let ok = match op {
                UOp::Input(m) => m.h == self.size && m.w == self.size && m.c == self.in_channels,
                UOp::Pool { src, dst } => {
                    src.c == dst.c
                        && 2 * dst.h <= src.h
                        && 2 * dst.w <= src.w
                        && src.floats() <= len(src.buf)
                        && dst.floats() <= len(dst.buf)
                }
                UOp::Head(h) => {
                    let g = Grid {
                        org: 0,
                        ys: h.src.row(),
                        xs: h.src.c,
                    };
                    let reach = h.taps.iter().max().copied().unwrap_or(0) + h.src.c;
                    fits(h.src.buf, g, h.src.h, h.src.w, reach)
                        && h.weight.len() == h.taps.len() * h.src.c
                        && h.src.h == self.size
                        && h.src.w == self.size
                }
                UOp::Conv(c) => {
                    let cp = cpad(c.cout);
                    c.passes.iter().all(|p| {
                        let reach = p.taps.iter().max().copied().unwrap_or(0) + c.cin;
                        fits(c.src, p.input, c.rows, c.cols, reach)
                            && fits(c.dst, p.output, c.rows, c.cols, c.cout)
                            && p.residual
                                .is_none_or(|(buf, g)| fits(buf, g, c.rows, c.cols, c.cout))
                            && p.weight.len() == p.taps.len() * c.cin * cp
                    }) && c.epi.bias.len() == cp
                        && c.epi
                            .post
                            .as_ref()
                            .is_none_or(|(s, t)| s.len() == cp && t.len() == cp)
                        && c.sums.is_none_or(|s| s < self.slots && cp <= self.cmax)
                        && c.gate.as_ref().is_none_or(|g| {
                            let c_se = g.reduce.0.len() / c.cin.max(1);
                            c.passes.len() == 1
                                && g.slot < self.slots
                                && g.fold * c.cin <= self.cmax
                                && g.reduce.0.len() == c.cin * c_se
                                && g.expand.0.len() == c_se * c.cin
                                && g.reduce.1.as_ref().is_none_or(|b| b.len() == c_se)
                                && g.expand.1.as_ref().is_none_or(|b| b.len() == c.cin)
                        })
                }
            };
            if !ok {
                return Err(CpuError::Weights(
                    format!("inconsistent layer in the U-Net plan: {op:?}")
                        .chars()
                        .take(300)
                        .collect(),
                ));
            }
        }
        Ok(())
    }

    fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        let (s, c) = (self.size, self.in_channels);
        let expected = batch * s * s * c;
        if input.len() != expected || batch == 0 {
            return Err(CpuError::Input {
                got: input.len(),
                expected,
                channels: c,
                size: s,
            });
        }
        let mut out = vec![0f32; batch * s * s];
        let mut guard = self.ws.lock().unwrap_or_else(|e| e.into_inner());
        let ws = guard.get_or_insert_with(|| {
            let wmax = self
                .ops
                .iter()
                .map(|op| match op {
                    UOp::Conv(c) if c.gate.is_some() => c.passes[0].weight.len(),
                    _ => 0,
                })
                .max()
                .unwrap_or(0);
            Workspace {
                bufs: self.buf_sizes.iter().map(|&n| vec![0f32; n]).collect(),
                scratch: (0..self.threads).map(|_| vec![0f32; wmax]).collect(),
            }
        });
        let n_ops = self.ops.len();
        let mut sums = vec![0f32; batch * self.per_image * self.cmax];
        let sh = Shared {
            bufs: ws.bufs.iter_mut().map(|b| b.as_mut_ptr()).collect(),
            sums_ptr: sums.as_mut_ptr(),
            scratch: ws.scratch.iter_mut().map(|b| b.as_mut_ptr()).collect(),
            input: input.as_ptr(),
            out: out.as_mut_ptr(),
            batch,
            claim: (0..batch * n_ops).map(|_| AtomicUsize::new(0)).collect(),
            done: (0..batch * n_ops).map(|_| AtomicUsize::new(0)).collect(),
            failed: AtomicBool::new(false),
        };
        let wmax = ws.scratch.first().map_or(0, Vec::len);
        // Profiling: time of every op on thread 0 (its chunks and the wait for the others' to
        // complete) on stderr.
        let profile =
            (crate::settings::profile() != Profile::Off).then(|| Mutex::new(vec![0f64; n_ops]));
        let job = |t: usize| {
            let run = || {
                let mut prof = profile
                    .as_ref()
                    .filter(|_| t == 0)
                    .map(|p| p.lock().unwrap_or_else(|e| e.into_inner()));
                // SAFETY: each thread has its own scratch (index t).
                let scratch = unsafe { std::slice::from_raw_parts_mut(sh.scratch[t], wmax) };
                self.run(&sh, scratch, prof.as_deref_mut());
            };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).is_err() {
                sh.failed.store(true, Ordering::Release);
            }
        };
        self.pool.run(&job);
        drop(sums);
        if sh.failed.load(Ordering::Acquire) {
            return Err(CpuError::Threads("a U-Net worker thread panicked".into()));
        }
        if let Some(times) = profile {
            self.print_profile(
                batch,
                &times.into_inner().unwrap_or_else(|e| e.into_inner()),
            );
        }
        Ok(out)
    }

    /// Chunk `k`'s channel sums of `slot` for image `b`.
    unsafe fn sums(&self, sh: &Shared, b: usize, slot: usize, k: usize) -> *mut f32 {
        sh.sums_ptr
            .add((b * self.per_image + self.slot_base[slot] + k) * self.cmax)
    }

    /// Chunks of the conv that sums `slot`.
    fn chunk_count(&self, slot: usize) -> usize {
        let next = self
            .slot_base
            .iter()
            .copied()
            .filter(|&b| b > self.slot_base[slot])
            .min()
            .unwrap_or(self.per_image);
        next - self.slot_base[slot]
    }

    /// One thread's part of a forward: for every image and op, claim row chunks until none is
    /// left, then wait for the op's other chunks.
    fn run(&self, sh: &Shared, scratch: &mut [f32], mut profile: Option<&mut Vec<f64>>) {
        let mut t0 = std::time::Instant::now();
        let n_ops = self.ops.len();
        for b in 0..sh.batch {
            for (i, op) in self.ops.iter().enumerate() {
                let k = b * n_ops + i;
                let n = self.chunks[i];
                let rows = op_work(op).0;
                let mut gate_ready = false;
                loop {
                    let c = sh.claim[k].fetch_add(1, Ordering::AcqRel);
                    if c >= n {
                        break;
                    }
                    let (y0, y1) = (rows * c / n, rows * (c + 1) / n);
                    // SAFETY: `check` bounded every access when the plan was built; chunk c's
                    // rows are this thread's alone; earlier ops are complete.
                    unsafe { self.exec(op, b, (c, y0, y1), sh, scratch, &mut gate_ready) };
                    sh.done[k].fetch_add(1, Ordering::AcqRel);
                }
                let mut spins = 0u32;
                while sh.done[k].load(Ordering::Acquire) < n {
                    if sh.failed.load(Ordering::Relaxed) {
                        return;
                    }
                    if spins < 1 << 12 {
                        std::hint::spin_loop();
                        spins += 1;
                    } else {
                        std::thread::yield_now();
                    }
                }
                if let Some(p) = profile.as_deref_mut() {
                    let now = std::time::Instant::now();
                    p[i] += (now - t0).as_secs_f64() * 1e3;
                    t0 = now;
                }
            }
        }
    }

    /// Rows `y0..y1` (chunk `chunk`) of `op` for image `b`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn exec(
        &self,
        op: &UOp,
        b: usize,
        (chunk, y0, y1): (usize, usize, usize),
        sh: &Shared,
        scratch: &mut [f32],
        gate_ready: &mut bool,
    ) {
        match op {
            UOp::Input(m) => {
                let row = m.w * m.c;
                for y in y0..y1 {
                    let src = sh.input.add((b * m.h + y) * row);
                    let dst = sh.bufs[m.buf].add(m.interior().at(y, 0));
                    std::ptr::copy_nonoverlapping(src, dst, row);
                }
            }
            UOp::Pool { src, dst } => {
                let (s, d) = (sh.bufs[src.buf] as *const f32, sh.bufs[dst.buf]);
                for y in y0..y1 {
                    kernels::maxpool_row(
                        s.add(src.interior().at(2 * y, 0)),
                        s.add(src.interior().at(2 * y + 1, 0)),
                        d.add(dst.interior().at(y, 0)),
                        dst.c,
                        dst.w,
                    );
                }
            }
            UOp::Head(h) => {
                let m = h.src;
                let src = sh.bufs[m.buf] as *const f32;
                for y in y0..y1 {
                    kernels::head_row(&HeadRow {
                        src: src.add(y * m.row()),
                        in_xs: m.c,
                        taps: &h.taps,
                        cin: m.c,
                        w: &h.weight,
                        bias: h.bias,
                        dst: sh.out.add((b * m.h + y) * m.w),
                        width: m.w,
                    });
                }
            }
            UOp::Conv(c) => {
                let cp = cpad(c.cout);
                match &c.gate {
                    Some(g) if !*gate_ready => {
                        *gate_ready = true;
                        let mut mean = vec![0f32; c.cin];
                        for k in 0..self.chunk_count(g.slot) {
                            let part = std::slice::from_raw_parts(
                                self.sums(sh, b, g.slot, k),
                                g.fold * c.cin,
                            );
                            for lanes in part.chunks_exact(c.cin) {
                                mean.iter_mut().zip(lanes).for_each(|(m, p)| *m += p);
                            }
                        }
                        mean.iter_mut().for_each(|m| *m /= g.pixels as f32);
                        let mut gate = vec![0f32; c.cin];
                        kernels::se_gate(&mean, &g.reduce, &g.expand, &mut gate);
                        // Weight rows are (tap, input channel): every tap reads the same
                        // channels (the pixels paired by a 1x1).
                        let w = &c.passes[0].weight;
                        for (r, (d, s)) in scratch[..w.len()]
                            .chunks_exact_mut(cp)
                            .zip(w.chunks_exact(cp))
                            .enumerate()
                        {
                            let gv = gate[r % c.cin];
                            d.iter_mut().zip(s).for_each(|(d, &v)| *d = v * gv);
                        }
                    }
                    _ => {}
                }
                let src = sh.bufs[c.src] as *const f32;
                let dst = sh.bufs[c.dst];
                let sums = c
                    .sums
                    .map_or(std::ptr::null_mut(), |slot| self.sums(sh, b, slot, chunk));
                for y in y0..y1 {
                    for p in &c.passes {
                        let (res, res_xs) = match p.residual {
                            Some((buf, g)) => (sh.bufs[buf].add(g.at(y, 0)) as *const f32, g.xs),
                            None => (std::ptr::null(), 0),
                        };
                        kernels::conv_row(&Row {
                            src: src.add(p.input.at(y, 0)),
                            in_xs: p.input.xs,
                            taps: &p.taps,
                            cin: c.cin,
                            w: if c.gate.is_some() {
                                scratch.as_ptr()
                            } else {
                                p.weight.as_ptr()
                            },
                            cout: c.cout,
                            dst: dst.add(p.output.at(y, 0)),
                            out_xs: p.output.xs,
                            res,
                            res_xs,
                            epi: &c.epi,
                            sums,
                            width: c.cols,
                        });
                    }
                }
            }
        }
    }

    fn print_profile(&self, batch: usize, times: &[f64]) {
        let total: f64 = times.iter().sum();
        eprintln!(
            "hilum cpu profile (U-Net direct): batch {batch}, {} threads, {total:.2} ms in {} ops",
            self.threads,
            times.len()
        );
        for (op, &ms) in self.ops.iter().zip(times) {
            let (name, flops) = match op {
                UOp::Input(_) => ("input".to_string(), 0.0),
                UOp::Pool { dst, .. } => (format!("maxpool to {}x{}", dst.h, dst.w), 0.0),
                UOp::Head(h) => (
                    "head 3x3 sigmoid".to_string(),
                    2.0 * (h.src.h * h.src.w * h.weight.len()) as f64,
                ),
                UOp::Conv(c) => (c.name.clone(), c.flops),
            };
            eprintln!(
                "  {name:<54} {ms:>7.3} ms {:>5.1}% {:>6.1} GFLOP/s",
                100.0 * ms / total.max(1e-9),
                batch as f64 * flops / (ms.max(1e-9) * 1e6)
            );
        }
    }
}

const INPUT: usize = 0;

/// Buffer numbers after the encoder outputs (1..=n).
struct Bufs {
    pool: usize,
    tmp: usize,
    gate: usize,
    ping: usize,
    pong: usize,
    out: usize,
}

/// conv 3x3 (+ folded BN, swish [, + input, BN, swish]) → squeeze-excitation → gated 1x1 conv
/// + swish [+ skip], written to `out`.
fn block_ops(
    blk: &UnetBlock,
    src: View,
    up2: bool,
    out_buf: usize,
    skip: Option<View>,
    b: &Bufs,
    ops: &mut Vec<Op>,
) -> Result<View, CpuError> {
    let c = blk.conv.c_out;
    let (ih, iw) = if up2 {
        (src.h * 2, src.w * 2)
    } else {
        (src.h, src.w)
    };
    let s = blk.stride;
    let (pad, _) = same_padding(ih, 3, s);
    let (pad_w, _) = same_padding(iw, 3, s);
    if pad != pad_w {
        return Err(CpuError::Weights(format!(
            "non-square input {ih}x{iw} with different `same` paddings"
        )));
    }
    let t = View::whole(b.tmp, ih.div_ceil(s), iw.div_ceil(s), c);
    let post = blk.residual_bn.as_ref().map(bn_affine).transpose()?;
    ops.push(Op::Conv(ConvOp {
        up2,
        act: GemmAct::Swish,
        residual: post.as_ref().map(|_| src),
        post_act: if post.is_some() {
            GemmAct::Swish
        } else {
            GemmAct::None
        },
        post,
        se_sums: true,
        ..ConvOp::new(src, t, 3, s, pad, ConvOp::fold(&blk.conv, Some(&blk.bn))?)
    }));
    let gate = View::whole(b.gate, 1, 1, c);
    ops.push(Op::Se(SeOp {
        src: t,
        dst: gate,
        reduce: ConvOp::fold(&blk.se_reduce, None)?,
        expand: ConvOp::fold(&blk.se_expand, None)?,
    }));
    let out = View::whole(out_buf, t.h, t.w, c);
    ops.push(Op::Conv(ConvOp {
        gate: Some(gate),
        act: GemmAct::Swish,
        residual: skip,
        ..ConvOp::new(t, out, 1, 1, 0, ConvOp::fold(&blk.project, None)?)
    }));
    Ok(out)
}

/// The same network as a plan for the shared im2col + gemm executor: the decoder's upsampling
/// is read on the fly by each decoder conv, the squeeze-excitation gate folded into the 1x1
/// projection's weights per image, the skip add fused into that projection.
fn gemm_plan(net: &UnetWeights, size: usize, threads: usize) -> Result<Executor, CpuError> {
    let in_channels = net.in_channels()?;
    let n_enc = net.encoder.len();
    let b = Bufs {
        pool: n_enc + 1,
        tmp: n_enc + 2,
        gate: n_enc + 3,
        ping: n_enc + 4,
        pong: n_enc + 5,
        out: n_enc + 6,
    };
    let mut ops = Vec::new();
    let mut x = View::whole(INPUT, size, size, in_channels);
    let mut skips = Vec::new();
    for (i, blk) in net.encoder.iter().enumerate() {
        if i > 0 {
            // Keras MaxPooling2D(2): 2x2, stride 2, no padding.
            let p = View::whole(b.pool, x.h / 2, x.w / 2, x.c);
            ops.push(Op::MaxPool {
                src: x,
                dst: p,
                k: 2,
                stride: 2,
                pad: 0,
            });
            x = p;
        }
        x = block_ops(blk, x, false, 1 + i, None, &b, &mut ops)?;
        skips.push(x);
    }
    skips.pop(); // the bottleneck is `x` itself
    for blk in &net.decoder {
        let out_buf = if x.buf == b.ping { b.pong } else { b.ping };
        let skip = skips.pop();
        x = block_ops(blk, x, true, out_buf, skip, &b, &mut ops)?;
    }
    let out = View::whole(b.out, x.h, x.w, 1);
    ops.push(Op::Conv(ConvOp {
        act: GemmAct::Sigmoid,
        ..ConvOp::new(
            x,
            out,
            3,
            1,
            1,
            ConvOp::fold(&net.head, Some(&net.head_bn))?,
        )
    }));
    let mut buf_sizes = vec![0usize; b.out + 1];
    buf_sizes[INPUT] = size * size * in_channels;
    super::grow_buffers(&ops, &mut buf_sizes);
    let plan = Plan {
        in_channels,
        size,
        input_nhwc: true,
        buf_sizes,
        ops,
        output: Output::Map(out),
    };
    validate(&plan)?;
    Executor::new(plan, threads)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max)
    }

    /// The lung U-Net's shape (`lung_seg_valiou_088.h5`) with seeded weights, fan-in scaled so
    /// activations stay in range.
    fn small_weights() -> UnetWeights {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut unit = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut conv = |c_in: usize, c_out: usize, k: usize| {
            let scale = 3.0 / ((k * k * c_in) as f32).sqrt();
            crate::Conv {
                c_out,
                c_in,
                k,
                weight: (0..c_out * c_in * k * k).map(|_| scale * unit()).collect(),
                bias: Some((0..c_out).map(|_| 0.3 * unit()).collect()),
            }
        };
        let bn = |c: usize, v: f32| BatchNorm {
            gamma: (0..c).map(|i| 1.0 + 0.1 * ((i % 5) as f32 - 2.0)).collect(),
            beta: (0..c).map(|i| 0.05 * ((i % 3) as f32 - 1.0)).collect(),
            mean: (0..c).map(|i| 0.1 * ((i % 4) as f32 - 1.5)).collect(),
            var: vec![v; c],
            eps: 1e-3,
        };
        let mut block = |c_in: usize, c_out: usize, stride: usize, residual: bool| UnetBlock {
            conv: conv(c_in, c_out, 3),
            bn: bn(c_out, 0.8),
            stride,
            residual_bn: residual.then(|| bn(c_out, 1.2)),
            se_reduce: conv(c_out, c_out / 4, 1),
            se_expand: conv(c_out / 4, c_out, 1),
            project: conv(c_out, c_out, 1),
        };
        let (mut encoder, mut decoder, mut c_in) = (Vec::new(), Vec::new(), 3);
        for (i, c) in [16, 16, 32, 32, 64, 64].into_iter().enumerate() {
            let stride = if i == 0 { 2 } else { 1 };
            encoder.push(block(c_in, c, stride, i > 0 && c == c_in));
            c_in = c;
        }
        for c in [64, 32, 32, 16, 16, 8] {
            decoder.push(block(c_in, c, 1, false));
            c_in = c;
        }
        let head = conv(c_in, 1, 3);
        UnetWeights {
            encoder,
            decoder,
            head,
            head_bn: bn(1, 1.0),
        }
    }

    #[test]
    fn same_padding_matches_tensorflow() {
        assert_eq!(same_padding(256, 3, 2), (0, 1));
        assert_eq!(same_padding(255, 3, 2), (1, 1));
        assert_eq!(same_padding(64, 3, 1), (1, 1));
        assert_eq!(same_padding(8, 1, 1), (0, 0));
    }

    /// The direct kernels against the im2col + gemm plan (two independent implementations; the
    /// candle reference is checked in hilum-models), and bit for bit the same whatever the
    /// thread count (the squeeze-excitation sums are kept per chunk, not per thread).
    #[test]
    fn direct_engine_matches_gemm_plan_for_any_thread_count() {
        let net = small_weights();
        let mut state = 99u32;
        let flat: Vec<f32> = (0..2 * 64 * 64 * 3)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 24) as f32
            })
            .collect();
        let expected = gemm_plan(&net, 64, 2)
            .expect("plan")
            .forward(&flat, 2)
            .expect("gemm");
        let one = Direct::new(&net, 64, 1)
            .expect("plan")
            .forward(&flat, 2)
            .expect("forward");
        let max = max_diff(&one, &expected);
        assert!(max < 1e-4, "direct vs gemm plan: max abs diff {max}");
        let spread = expected
            .iter()
            .fold((1f32, 0f32), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        assert!(
            spread.1 - spread.0 > 0.1,
            "degenerate test output {spread:?}"
        );
        for threads in [2, 3] {
            let d = Direct::new(&net, 64, threads).expect("plan");
            for _ in 0..3 {
                assert!(
                    d.forward(&flat, 2).expect("forward") == one,
                    "{threads} threads"
                );
            }
        }
    }

    #[test]
    fn mismatched_weights_are_an_error_not_a_panic() {
        let mut net = small_weights();
        net.decoder[2].project.weight.pop();
        assert!(Direct::new(&net, 64, 1).is_err());
        assert!(gemm_plan(&net, 64, 1).is_err());
        let mut net = small_weights();
        net.encoder[1].bn.var.pop();
        assert!(NativeUnet::new(&net, 64, 1).is_err());
    }
}
