//! Hilum's own CPU convolution engines. candle's CPU `conv2d` spends most of its time outside
//! the matrix product (FACTS.md: ~10x slower than ONNX Runtime on DenseNet-121), so on the CPU
//! Hilum's CNNs run here instead. This crate knows nothing of checkpoints or tensors: a network
//! is built from plain weights ([`Conv`], [`BatchNorm`], [`Linear`] and the per-network structs
//! such as [`densenet::DenseNetWeights`]) that the caller reads from wherever they live.
//!
//! - activations are NHWC `f32`, a layer's output is a channel slice of a (possibly wider) buffer,
//!   so DenseNet's concatenation is written in place;
//! - a 1x1 convolution is one strided gemm over pixels; a kxk one gathers tiles of pixels
//!   (im2col) into a per-thread buffer and runs one single-threaded gemm per tile;
//! - on AVX-512 CPUs the classifiers' convs instead run a register-tiled kernel against
//!   weights packed at load (`dense_gemm`): kxk inputs read in place through row pointers,
//!   bias/ReLU/residual applied before the last store;
//! - BatchNorm after a conv is folded into its weights at load; bias, residual and ReLU are
//!   applied to each tile while it is hot; a BatchNorm + ReLU *before* a conv (DenseNet) is
//!   applied while the tile is gathered;
//! - the whole forward runs inside one scope of a dedicated rayon pool: every thread walks the
//!   same list of layers, takes its share of each, and meets the others at a spin barrier
//!   (waking sleeping workers per layer costs more than small layers take);
//! - for the segmentation networks: dilation, nearest 2x upsampling read while gathering (never
//!   materialised), squeeze-excitation gates folded into the next 1x1 conv's weights per image,
//!   swish/sigmoid with a vectorisable `exp`, pooling and bilinear resizing between NHWC views.
//!
//! The engines read no environment variables: threads are given to each network, and the
//! process-wide tuning knobs are set by [`configure`] (see [`CpuSettings`]).

#![warn(missing_docs)]

mod dense_gemm;
pub mod densenet;
pub mod pspnet;
pub mod resnet;
mod settings;
pub mod unet;

pub use densenet::NativeDenseNet;
pub use pspnet::NativePspNet;
pub use resnet::NativeResNet;
pub use settings::{all_cores, configure, set_profile, CpuSettings, IsaCap, Profile, UnetEngine};
pub use unet::{direct_engine as unet_direct_engine, NativeUnet};

use settings::{profile, tile_floats};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// Errors of the native path; they only arise from malformed weights or inputs.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    /// The weights do not fit the network: wrong lengths, or layers that do not connect.
    #[error("cannot read weights for the CPU kernels: {0}")]
    Weights(String),
    /// The input buffer's length does not match the batch and the network's input shape.
    #[error("input has {got} values, expected {expected} (batch x {channels} x {size} x {size})")]
    Input {
        /// Values the caller passed.
        got: usize,
        /// Values the batch and input shape call for.
        expected: usize,
        /// Input channels the network takes.
        channels: usize,
        /// Side of the square input the network was built for.
        size: usize,
    },
    /// The worker pool could not be started.
    #[error("cannot start CPU worker threads: {0}")]
    Threads(String),
}

/// A convolution's weights as PyTorch lays them out: `weight` is (c_out, c_in, k, k)
/// row-major, square kernels only. Stride, padding and dilation belong to the network.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv {
    /// Output channels.
    pub c_out: usize,
    /// Input channels.
    pub c_in: usize,
    /// Side of the square kernel.
    pub k: usize,
    /// (c_out, c_in, k, k) row-major.
    pub weight: Vec<f32>,
    /// One bias per output channel, if the layer has them.
    pub bias: Option<Vec<f32>>,
}

impl Conv {
    fn check(&self) -> Result<(), CpuError> {
        let n = self.c_out * self.c_in * self.k * self.k;
        if self.weight.len() != n || self.bias.as_ref().is_some_and(|b| b.len() != self.c_out) {
            return Err(CpuError::Weights(format!(
                "a {k}x{k} conv {} -> {} needs {n} weights and {} biases, got {} and {}",
                self.c_in,
                self.c_out,
                self.c_out,
                self.weight.len(),
                self.bias.as_ref().map_or(0, Vec::len),
                k = self.k,
            )));
        }
        Ok(())
    }
}

/// An inference BatchNorm, per channel: `(x - mean) / sqrt(var + eps) * gamma + beta`.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchNorm {
    /// Per-channel scale.
    pub gamma: Vec<f32>,
    /// Per-channel shift.
    pub beta: Vec<f32>,
    /// Running mean, subtracted first.
    pub mean: Vec<f32>,
    /// Running variance.
    pub var: Vec<f32>,
    /// Added to the variance before its square root.
    pub eps: f32,
}

/// A fully connected layer: `weight` is (out_features, in_features) row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    /// Length of the input vector.
    pub in_features: usize,
    /// Length of the output vector (the number of classes for a classifier head).
    pub out_features: usize,
    /// (out_features, in_features) row-major.
    pub weight: Vec<f32>,
    /// One bias per output feature, if the layer has them.
    pub bias: Option<Vec<f32>>,
}

/// A channel slice `[ch_off, ch_off + c)` of an NHWC buffer whose pixels are `pitch` apart.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct View {
    pub buf: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub ch_off: usize,
    pub pitch: usize,
}

impl View {
    pub fn whole(buf: usize, h: usize, w: usize, c: usize) -> Self {
        View {
            buf,
            h,
            w,
            c,
            ch_off: 0,
            pitch: c,
        }
    }
    pub fn slice(self, ch_off: usize, c: usize) -> Self {
        View {
            ch_off: self.ch_off + ch_off,
            c,
            ..self
        }
    }
}

/// Per-channel `y = x * scale + shift` (an inference BatchNorm).
#[derive(Clone, Debug)]
pub(crate) struct Affine {
    pub scale: Vec<f32>,
    pub shift: Vec<f32>,
}

pub(crate) fn bn_affine(bn: &BatchNorm) -> Result<Affine, CpuError> {
    let c = bn.gamma.len();
    if [bn.beta.len(), bn.mean.len(), bn.var.len()] != [c; 3] {
        return Err(CpuError::Weights(format!(
            "BatchNorm parameters of unequal lengths: {c}, {}, {}, {}",
            bn.beta.len(),
            bn.mean.len(),
            bn.var.len()
        )));
    }
    let scale: Vec<f32> = bn
        .gamma
        .iter()
        .zip(&bn.var)
        .map(|(w, v)| w / (v + bn.eps).sqrt())
        .collect();
    let shift = bn
        .beta
        .iter()
        .zip(&bn.mean)
        .zip(&scale)
        .map(|((b, m), s)| b - m * s)
        .collect();
    Ok(Affine { scale, shift })
}

/// Gemm weights (k * k * c_in, c_out) and the bias of a conv with its BatchNorm folded in.
pub(crate) type Folded = (Vec<f32>, Option<Vec<f32>>);

/// An element-wise activation fused into a conv's epilogue.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Act {
    #[default]
    None,
    Relu,
    /// `x * sigmoid(x)` (Keras swish, PyTorch SiLU).
    Swish,
    Sigmoid,
}

/// `exp(x)` from a degree-6 polynomial after range reduction: branch-free so loops over it
/// vectorise (the libm call does not); relative error ~2e-7, like `f32::exp`.
#[inline(always)]
pub(crate) fn exp_approx(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to the nearest integer, which then sits in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.0, 88.0);
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let e = (t.to_bits() as i32 - MAGIC.to_bits() as i32 + 127) << 23;
    p * f32::from_bits(e as u32)
}

/// The logistic function, with the same `exp` as the fused activations.
pub fn sigmoid(x: f32) -> f32 {
    Act::Sigmoid.scalar(x)
}

impl Act {
    #[inline(always)]
    fn apply(self, v: &mut [f32]) {
        match self {
            Act::None => {}
            Act::Relu => v.iter_mut().for_each(|x| *x = x.max(0.0)),
            Act::Swish => v.iter_mut().for_each(|x| *x /= 1.0 + exp_approx(-*x)),
            Act::Sigmoid => v
                .iter_mut()
                .for_each(|x| *x = 1.0 / (1.0 + exp_approx(-*x))),
        }
    }
    pub fn scalar(self, x: f32) -> f32 {
        let mut v = [x];
        self.apply(&mut v);
        v[0]
    }
}

/// One convolution with everything fused around it. Epilogue order, per output value:
/// `+ bias`, `act`, then with a residual `+ residual`, `post` affine, `post_act`.
#[derive(Clone, Debug)]
pub(crate) struct ConvOp {
    pub src: View,
    pub dst: View,
    pub k: usize,
    pub stride: usize,
    /// Zero padding before the first row/column (after is implied by `dst`'s size, so Keras'
    /// asymmetric `same` padding needs nothing more).
    pub pad: usize,
    pub dilation: usize,
    /// The conv reads a nearest-neighbour 2x upsampling of `src` (never materialised).
    pub up2: bool,
    /// BatchNorm + ReLU applied to the input before the conv (pre-activation).
    pub pre: Option<Affine>,
    /// 2x2 average pool of the (pre-activated) input before a 1x1 conv: a DenseNet
    /// transition's conv and pool are both linear, so pooling first is 4x cheaper.
    pub pool2: bool,
    /// Per-image, per-input-channel scale (a squeeze-excitation gate, a 1x1 view per image),
    /// folded into the weights of each image's gemm.
    pub gate: Option<View>,
    /// (k * k * c_in, c_out) row-major, BatchNorm folded in.
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub act: Act,
    /// Same pixels and channels as `dst` (ResNet shortcut, U-Net skip).
    pub residual: Option<View>,
    /// A BatchNorm after the residual add (the lung U-Net's `bn{n}_a`).
    pub post: Option<Affine>,
    pub post_act: Act,
    /// Accumulate each image's channel sums of the output for the next squeeze-excitation.
    pub se_sums: bool,
    /// The weights packed for the AVX-512 kernel ([`ConvOp::packed`]), used when the CPU has it.
    pub packed: Option<Box<dense_gemm::Packed>>,
}

impl ConvOp {
    /// A plain conv: no pre-activation, pooling, gate, residual or activation.
    pub fn new(src: View, dst: View, k: usize, stride: usize, pad: usize, folded: Folded) -> Self {
        let (weight, bias) = folded;
        ConvOp {
            src,
            dst,
            k,
            stride,
            pad,
            dilation: 1,
            up2: false,
            pre: None,
            pool2: false,
            gate: None,
            weight,
            bias,
            act: Act::None,
            residual: None,
            post: None,
            post_act: Act::None,
            se_sums: false,
            packed: None,
        }
    }

    /// This conv with its weights also packed for the AVX-512 kernel (when its epilogue allows:
    /// bias and ReLU only). Set the other fields first.
    pub fn packed(mut self) -> Self {
        if dense_gemm::packable(&self) {
            let p = dense_gemm::Packed::new(
                &self.weight,
                self.bias.as_deref(),
                self.kdim(),
                self.c_out(),
            );
            self.packed = Some(Box::new(p));
        }
        self
    }

    /// Conv (c_out, c_in, k, k) followed by an optional BatchNorm, as gemm weights and a bias.
    pub fn fold(conv: &Conv, bn: Option<&BatchNorm>) -> Result<Folded, CpuError> {
        conv.check()?;
        let (c_out, c_in, k) = (conv.c_out, conv.c_in, conv.k);
        let aff = bn.map(bn_affine).transpose()?;
        if aff.as_ref().is_some_and(|a| a.scale.len() != c_out) {
            return Err(CpuError::Weights(format!(
                "a BatchNorm of {} channels after a conv with {c_out} outputs",
                aff.as_ref().map_or(0, |a| a.scale.len())
            )));
        }
        let wv = &conv.weight;
        let mut out = vec![0f32; wv.len()];
        for co in 0..c_out {
            let s = aff.as_ref().map_or(1.0, |a| a.scale[co]);
            for ci in 0..c_in {
                for ky in 0..k {
                    for kx in 0..k {
                        let src = ((co * c_in + ci) * k + ky) * k + kx;
                        let dst = ((ky * k + kx) * c_in + ci) * c_out + co;
                        out[dst] = wv[src] * s;
                    }
                }
            }
        }
        let bias = match (aff, conv.bias.clone()) {
            (None, b) => b,
            (Some(a), None) => Some(a.shift),
            (Some(a), Some(b)) => Some(
                b.iter()
                    .zip(&a.scale)
                    .zip(&a.shift)
                    .map(|((b, s), t)| b * s + t)
                    .collect(),
            ),
        };
        Ok((out, bias))
    }

    fn c_in(&self) -> usize {
        self.src.c
    }
    fn c_out(&self) -> usize {
        self.dst.c
    }
    fn kdim(&self) -> usize {
        self.k * self.k * self.c_in()
    }
    /// Input size the kernel slides over (twice `src` when upsampling on the fly).
    fn in_hw(&self) -> (usize, usize) {
        let u = if self.up2 { 2 } else { 1 };
        (self.src.h * u, self.src.w * u)
    }
    /// Whether the gemm can read the input buffer directly (no gathering).
    fn direct(&self) -> bool {
        self.k == 1
            && self.stride == 1
            && self.pad == 0
            && self.pre.is_none()
            && !self.pool2
            && !self.up2
    }
    /// Pixels per gathered tile: big enough to amortise packing the weights (at least 256 rows
    /// when they exceed 1 MiB), small enough to stay in L2 otherwise.
    fn tile_rows(&self, rows: usize) -> usize {
        if self.direct() {
            return rows.max(1);
        }
        let min = if self.kdim() * self.c_out() > 1 << 18 {
            256
        } else {
            48
        };
        (tile_floats() / self.kdim())
            .clamp(min, 512)
            .min(rows.max(1))
    }
}

/// Squeeze-excitation: per image, the channel means of `src` through a 1x1 conv + swish and a
/// 1x1 conv + sigmoid, written as a gate (a 1x1 view) for the next conv. The conv writing
/// `src` must have `se_sums` set: the sums are taken while its output is hot.
#[derive(Clone, Debug)]
pub(crate) struct SeOp {
    pub src: View,
    pub dst: View,
    /// (c, c_se) row-major and (c_se, c).
    pub reduce: Folded,
    pub expand: Folded,
}

// Plans are built once and walked per forward: conv ops inline, not boxed.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum Op {
    Conv(ConvOp),
    /// Max pool; padding never wins (the inputs follow a ReLU or are pooled without padding).
    MaxPool {
        src: View,
        dst: View,
        k: usize,
        stride: usize,
        pad: usize,
    },
    /// Average pool without padding (PSPNet's pyramid: kernel = stride).
    AvgPool {
        src: View,
        dst: View,
        k: (usize, usize),
    },
    /// Bilinear resize, PyTorch `align_corners=False`.
    Resize {
        src: View,
        dst: View,
    },
    Se(SeOp),
}

impl Op {
    /// The two maps an op reads and writes.
    fn views(&self) -> [View; 2] {
        match self {
            Op::Conv(c) => [c.src, c.dst],
            Op::MaxPool { src, dst, .. } => [*src, *dst],
            Op::Se(se) => [se.src, se.dst],
            Op::AvgPool { src, dst, .. } | Op::Resize { src, dst } => [*src, *dst],
        }
    }
}

/// Grows `sizes` (floats per buffer) so every map of `ops` fits its buffer.
pub(crate) fn grow_buffers(ops: &[Op], sizes: &mut [usize]) {
    for v in ops.iter().flat_map(Op::views) {
        sizes[v.buf] = sizes[v.buf].max(v.h * v.w * v.pitch);
    }
}

/// The classification head: optional BN + ReLU, global average pool, linear layer.
#[derive(Clone, Debug)]
pub(crate) struct Head {
    pub src: View,
    pub pre: Option<Affine>,
    /// (classes, channels) row-major, as in the checkpoint.
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub classes: usize,
}

impl Head {
    pub fn new(src: View, pre: Option<Affine>, fc: &Linear) -> Result<Self, CpuError> {
        let classes = fc.out_features;
        if fc.weight.len() != classes * fc.in_features
            || fc.in_features != src.c
            || fc.bias.as_ref().is_some_and(|b| b.len() != classes)
        {
            return Err(CpuError::Weights(format!(
                "a linear layer {} -> {classes} with {} weights after {} channels",
                fc.in_features,
                fc.weight.len(),
                src.c
            )));
        }
        Ok(Head {
            src,
            pre,
            weight: fc.weight.clone(),
            bias: fc.bias.clone().unwrap_or_else(|| vec![0.0; classes]),
            classes,
        })
    }
}

/// What a forward returns.
#[derive(Clone, Debug)]
pub(crate) enum Output {
    /// Logits (batch, classes).
    Head(Head),
    /// A feature map, returned NHWC (batch, h, w, c).
    Map(View),
}

/// A network as a list of ops over numbered NHWC buffers (sizes per image).
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub in_channels: usize,
    pub size: usize,
    /// The input comes NHWC (Keras) instead of NCHW (PyTorch).
    pub input_nhwc: bool,
    /// Floats per image of each buffer; buffer 0 is the input.
    pub buf_sizes: Vec<usize>,
    pub ops: Vec<Op>,
    pub output: Output,
}

/// Per-thread scratch and buffers, reused across calls with at most its batch size.
struct Workspace {
    batch: usize,
    bufs: Vec<Vec<f32>>,
    scratch: Vec<Scratch>,
    /// Per thread, per image: channel sums for squeeze-excitation (`se_width` floats each).
    sums: Vec<f32>,
}

/// One thread's gathered tile and gate-scaled weights.
#[derive(Default)]
struct Scratch {
    tile: Vec<f32>,
    weights: Vec<f32>,
}

/// Runs a [`Plan`] on a dedicated thread pool, one forward at a time.
pub(crate) struct Executor {
    plan: Plan,
    pool: rayon::ThreadPool,
    threads: usize,
    ws: Mutex<Option<Workspace>>,
}

/// Raw buffer pointers shared by the workers. Each op writes disjoint rows/columns per thread,
/// and the barrier orders one op's writes before the next op's reads.
struct Shared {
    bufs: Vec<*mut f32>,
    lens: Vec<usize>,
    sums: *mut f32,
    batch: usize,
    se_width: usize,
}

impl Shared {
    /// Thread `t`'s channel sums of image `b`.
    unsafe fn sums(&self, t: usize, b: usize) -> *mut f32 {
        self.sums.add((t * self.batch + b) * self.se_width)
    }
}
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

struct SpinBarrier {
    n: usize,
    count: AtomicUsize,
    generation: AtomicUsize,
}

impl SpinBarrier {
    fn new(n: usize) -> Self {
        SpinBarrier {
            n,
            count: AtomicUsize::new(0),
            generation: AtomicUsize::new(0),
        }
    }
    fn wait(&self) {
        if self.n == 1 {
            return;
        }
        let gen = self.generation.load(Ordering::Acquire);
        if self.count.fetch_add(1, Ordering::AcqRel) + 1 == self.n {
            self.count.store(0, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::Release);
            return;
        }
        let mut spins = 0u32;
        while self.generation.load(Ordering::Acquire) == gen {
            // Spin briefly (layers take tens of µs), then yield so an oversubscribed machine
            // still makes progress.
            if spins < 4096 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl Executor {
    pub fn new(plan: Plan, threads: usize) -> Result<Self, CpuError> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("hilum-cpu-{i}"))
            .build()
            .map_err(|e| CpuError::Threads(e.to_string()))?;
        Ok(Executor {
            plan,
            pool,
            threads,
            ws: Mutex::new(None),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Input (batch, in_channels, size, size) as NCHW `f32` (NHWC when the plan says so or
    /// in_channels == 1). Returns logits (batch, classes) row-major for a head, else the
    /// output map NHWC.
    pub fn forward(&self, input: &[f32], batch: usize) -> Result<Vec<f32>, CpuError> {
        let p = &self.plan;
        let expected = batch * p.in_channels * p.size * p.size;
        if input.len() != expected || batch == 0 {
            return Err(CpuError::Input {
                got: input.len(),
                expected,
                channels: p.in_channels,
                size: p.size,
            });
        }
        let mut guard = self.ws.lock().unwrap_or_else(|e| e.into_inner());
        if guard.as_ref().is_none_or(|w| w.batch < batch) {
            let (mut tile_len, mut w_len) = (0, 0);
            for op in &p.ops {
                if let Op::Conv(c) = op {
                    if !c.direct() {
                        let rows = batch * c.dst.h * c.dst.w;
                        tile_len = tile_len.max(c.tile_rows(rows) * c.kdim());
                    }
                    if c.packed.is_some() {
                        tile_len = tile_len.max(dense_gemm::tile_len(c));
                    }
                    if c.gate.is_some() {
                        w_len = w_len.max(c.weight.len());
                    }
                }
            }
            *guard = Some(Workspace {
                batch,
                sums: vec![0f32; self.threads * batch * se_width(p)],
                bufs: p.buf_sizes.iter().map(|&s| vec![0f32; s * batch]).collect(),
                scratch: (0..self.threads)
                    .map(|_| Scratch {
                        tile: vec![0f32; tile_len],
                        weights: vec![0f32; w_len],
                    })
                    .collect(),
            });
        }
        let ws = guard
            .as_mut()
            .ok_or_else(|| CpuError::Threads("no workspace".into()))?;
        let hw = p.size * p.size;
        let c = p.in_channels;
        if p.input_nhwc || c == 1 {
            ws.bufs[0][..input.len()].copy_from_slice(input);
        } else {
            // NCHW → NHWC for the input buffer.
            for b in 0..batch {
                for ch in 0..c {
                    for i in 0..hw {
                        ws.bufs[0][(b * hw + i) * c + ch] = input[(b * c + ch) * hw + i];
                    }
                }
            }
        }
        ws.sums.fill(0.0);
        let shared = Shared {
            lens: ws.bufs.iter().map(|b| b.len()).collect(),
            bufs: ws.bufs.iter_mut().map(|b| b.as_mut_ptr()).collect(),
            sums: ws.sums.as_mut_ptr(),
            batch,
            se_width: se_width(p),
        };
        let barrier = SpinBarrier::new(self.threads);
        let nt = self.threads;
        let scratch = &mut ws.scratch;
        // Profiling: time of every op (thread 0, barrier to barrier) on stderr.
        let mut profile = (profile() != Profile::Off).then(|| vec![0f64; p.ops.len()]);
        self.pool.scope(|s| {
            let (first, rest) = scratch.split_at_mut(1);
            for (i, sc) in rest.iter_mut().enumerate() {
                let (shared, barrier) = (&shared, &barrier);
                s.spawn(move |_| run_ops(p, batch, i + 1, nt, shared, barrier, sc, None));
            }
            let prof = profile.as_mut();
            run_ops(p, batch, 0, nt, &shared, &barrier, &mut first[0], prof);
        });
        if let Some(times) = profile {
            print_profile(p, batch, nt, &times);
        }
        Ok(match &p.output {
            Output::Head(h) => head(h, &ws.bufs[h.src.buf], batch),
            Output::Map(v) => {
                let buf = &ws.bufs[v.buf];
                let mut out = Vec::with_capacity(batch * v.h * v.w * v.c);
                for px in 0..batch * v.h * v.w {
                    out.extend_from_slice(&buf[px * v.pitch + v.ch_off..][..v.c]);
                }
                out
            }
        })
    }
}

/// Widest squeeze-excitation of a plan (0 without any).
fn se_width(p: &Plan) -> usize {
    p.ops
        .iter()
        .map(|op| match op {
            Op::Se(se) => se.src.c,
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}

#[allow(clippy::too_many_arguments)]
fn run_ops(
    plan: &Plan,
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
    barrier: &SpinBarrier,
    scratch: &mut Scratch,
    mut profile: Option<&mut Vec<f64>>,
) {
    let mut t0 = std::time::Instant::now();
    for (i, op) in plan.ops.iter().enumerate() {
        match op {
            Op::Conv(c) => conv_part(c, batch, t, nt, sh, scratch),
            Op::MaxPool {
                src,
                dst,
                k,
                stride,
                pad,
            } => maxpool_part(*src, *dst, (*k, *stride, *pad), batch, t, nt, sh),
            Op::AvgPool { src, dst, k } => avgpool_part(*src, *dst, *k, batch, t, nt, sh),
            Op::Resize { src, dst } => resize_part(*src, *dst, batch, t, nt, sh),
            Op::Se(se) => se_part(se, batch, t, nt, sh),
        }
        barrier.wait();
        if let Some(p) = profile.as_deref_mut() {
            let now = std::time::Instant::now();
            p[i] += (now - t0).as_secs_f64() * 1e3;
            t0 = now;
        }
    }
}

/// Name of an op's kind in the profile.
fn op_kind(op: &Op) -> String {
    match op {
        Op::Conv(c) => {
            let mut kind = match (c.k, c.pre.is_some(), c.pool2, c.direct()) {
                (_, _, true, _) => "1x1 pre-act + pool2 (transition)".to_string(),
                (1, true, _, _) => "1x1 pre-act (gathered)".to_string(),
                (1, _, _, true) => "1x1 direct".to_string(),
                (k, _, _, _) => format!("{k}x{k} s{} im2col", c.stride),
            };
            if c.dilation > 1 {
                kind += &format!(" d{}", c.dilation);
            }
            if c.up2 {
                kind += " up2";
            }
            if c.gate.is_some() {
                kind += " gated";
            }
            if c.act == Act::Swish || c.post_act == Act::Swish {
                kind += " swish";
            }
            if c.residual.is_some() {
                kind += " +res";
            }
            kind
        }
        Op::MaxPool { k, stride, .. } => format!("maxpool {k}x{k} s{stride}"),
        Op::AvgPool { .. } => "avgpool".to_string(),
        Op::Resize { .. } => "bilinear resize".to_string(),
        Op::Se(_) => "squeeze-excitation".to_string(),
    }
}

/// Per kind of op: count, milliseconds, GFLOP/s.
fn print_profile(plan: &Plan, batch: usize, nt: usize, times: &[f64]) {
    let mut rows: std::collections::BTreeMap<String, (usize, f64, f64)> = Default::default();
    for (op, &ms) in plan.ops.iter().zip(times) {
        let flops = match op {
            Op::Conv(c) => 2.0 * (batch * c.dst.h * c.dst.w * c.kdim() * c.c_out()) as f64,
            _ => 0.0,
        };
        let mut kind = op_kind(op);
        if let (Op::Conv(c), Profile::OpsBySize) = (op, profile()) {
            kind += &format!(" -> {}x{}", c.dst.h, c.dst.w);
        }
        let e = rows.entry(kind).or_default();
        e.0 += 1;
        e.1 += ms;
        e.2 += flops;
    }
    let total: f64 = times.iter().sum();
    eprintln!(
        "hilum cpu profile: batch {batch}, {nt} threads, {total:.2} ms in {} ops",
        times.len()
    );
    for (kind, (n, ms, f)) in rows {
        eprintln!(
            "  {kind:<40} {n:>4} ops {ms:>8.2} ms {:>5.1}% {:>7.1} GFLOP/s",
            100.0 * ms / total.max(1e-9),
            f / (ms.max(1e-9) * 1e6)
        );
    }
}

/// `[lo, hi)` of `n` items for thread `t` of `nt`.
fn share(n: usize, t: usize, nt: usize) -> (usize, usize) {
    (n * t / nt, n * (t + 1) / nt)
}

fn conv_part(c: &ConvOp, batch: usize, t: usize, nt: usize, sh: &Shared, scratch: &mut Scratch) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(pk), true) = (&c.packed, has_avx512()) {
        return dense_gemm::conv_part(c, pk, batch, t, nt, sh, scratch);
    }
    let rows = batch * c.dst.h * c.dst.w;
    let tm = c.tile_rows(rows);
    let (kdim, c_out) = (c.kdim(), c.c_out());
    // Split rows into tiles; when there are fewer tiles than threads, split columns too.
    let (row_items, col_splits) = if c.direct() {
        // Direct gemms: one row range per thread, columns split when rows are few.
        let splits = if rows >= 64 * nt { 1 } else { nt };
        ((if splits == 1 { nt } else { 1 }), splits)
    } else {
        let tiles = rows.div_ceil(tm);
        (tiles, if tiles >= nt { 1 } else { nt.div_ceil(tiles) })
    };
    let col_splits = col_splits.min(c_out.div_ceil(16)).max(1);
    let items = row_items * col_splits;
    let (lo, hi) = share(items, t, nt);
    let mut gathered: Option<usize> = None;
    let hw = c.dst.h * c.dst.w;
    for item in lo..hi {
        let (ri, ci) = (item / col_splits, item % col_splits);
        let (r0, r1) = if c.direct() {
            share(rows, ri, row_items)
        } else {
            (ri * tm, ((ri + 1) * tm).min(rows))
        };
        // Column chunks on multiples of 16 (the gemm's register width).
        let chunk = c_out.div_ceil(col_splits).div_ceil(16) * 16;
        let (n0, n1) = ((ci * chunk).min(c_out), ((ci + 1) * chunk).min(c_out));
        if r0 >= r1 || n0 >= n1 {
            continue;
        }
        // SAFETY: views were checked to fit their buffers when the plan was built; rows r0..r1
        // and columns n0..n1 of dst belong to this thread only; the src was completed before the
        // last barrier.
        unsafe {
            let src = sh.bufs[c.src.buf] as *const f32;
            if !c.direct() && gathered != Some(r0) {
                let m = r1 - r0;
                gather(
                    c,
                    r0,
                    r1,
                    src,
                    sh.lens[c.src.buf],
                    &mut scratch.tile[..m * kdim],
                    kdim,
                );
                gathered = Some(r0);
            }
            // A gate differs per image: one gemm per image within the rows.
            let mut a = r0;
            while a < r1 {
                let b = if c.gate.is_some() {
                    ((a / hw + 1) * hw).min(r1)
                } else {
                    r1
                };
                let (lhs, lhs_rs) = if c.direct() {
                    (src.add(a * c.src.pitch + c.src.ch_off), c.src.pitch)
                } else {
                    (scratch.tile.as_ptr().add((a - r0) * kdim), kdim)
                };
                let rhs = match &c.gate {
                    Some(g) => {
                        let gp = sh.bufs[g.buf] as *const f32;
                        let gate =
                            std::slice::from_raw_parts(gp.add((a / hw) * g.pitch + g.ch_off), g.c);
                        let w = &mut scratch.weights[..c.weight.len()];
                        for (row, (wr, or)) in w
                            .chunks_exact_mut(c_out)
                            .zip(c.weight.chunks_exact(c_out))
                            .enumerate()
                        {
                            let s = gate[row % c.src.c];
                            wr.iter_mut().zip(or).for_each(|(d, &v)| *d = v * s);
                        }
                        w.as_ptr()
                    }
                    None => c.weight.as_ptr(),
                };
                let dst = sh.bufs[c.dst.buf].add(a * c.dst.pitch + c.dst.ch_off + n0);
                gemm::gemm(
                    b - a,
                    n1 - n0,
                    kdim,
                    dst,
                    1,
                    c.dst.pitch as isize,
                    false,
                    lhs,
                    1,
                    lhs_rs as isize,
                    rhs.add(n0),
                    1,
                    c_out as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
                a = b;
            }
            epilogue(c, sh, t, r0, r1, n0, n1);
        }
    }
}

/// Whether this CPU runs the AVX-512 builds of the element-wise loops.
fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static V4: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *V4.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("fma")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Bias, activation, residual, post-affine and post-activation on rows r0..r1, columns n0..n1;
/// then thread `t`'s squeeze-excitation sums.
unsafe fn epilogue(c: &ConvOp, sh: &Shared, t: usize, r0: usize, r1: usize, n0: usize, n1: usize) {
    if c.bias.is_none() && c.residual.is_none() && c.act == Act::None && !c.se_sums {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        return epilogue_v4(c, sh, t, r0, r1, n0, n1);
    }
    epilogue_body(c, sh, t, r0, r1, n0, n1)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
unsafe fn epilogue_v4(
    c: &ConvOp,
    sh: &Shared,
    t: usize,
    r0: usize,
    r1: usize,
    n0: usize,
    n1: usize,
) {
    epilogue_body(c, sh, t, r0, r1, n0, n1)
}

#[inline(always)]
unsafe fn epilogue_body(
    c: &ConvOp,
    sh: &Shared,
    t: usize,
    r0: usize,
    r1: usize,
    n0: usize,
    n1: usize,
) {
    let dst = sh.bufs[c.dst.buf];
    let hw = c.dst.h * c.dst.w;
    for r in r0..r1 {
        let row = std::slice::from_raw_parts_mut(dst.add(r * c.dst.pitch + c.dst.ch_off), c.dst.c);
        let row = &mut row[n0..n1];
        if let Some(b) = &c.bias {
            row.iter_mut().zip(&b[n0..n1]).for_each(|(v, b)| *v += b);
        }
        c.act.apply(row);
        if let Some(res) = &c.residual {
            let rp = sh.bufs[res.buf] as *const f32;
            let rrow = std::slice::from_raw_parts(rp.add(r * res.pitch + res.ch_off), res.c);
            row.iter_mut().zip(&rrow[n0..n1]).for_each(|(v, s)| *v += s);
            if let Some(a) = &c.post {
                row.iter_mut()
                    .zip(&a.scale[n0..n1])
                    .zip(&a.shift[n0..n1])
                    .for_each(|((v, s), t)| *v = *v * s + t);
            }
            c.post_act.apply(row);
        }
        if c.se_sums {
            let sums = std::slice::from_raw_parts_mut(sh.sums(t, r / hw), sh.se_width);
            sums[n0..n1]
                .iter_mut()
                .zip(&*row)
                .for_each(|(s, v)| *s += v);
        }
    }
}

/// im2col of output pixels r0..r1 into `tile` ((r1 - r0) rows of k*k*c_in, `ld` apart),
/// applying the pre-activation, the 2x2 pre-pool, dilation and on-the-fly 2x upsampling.
/// Padding stays zero (PyTorch and Keras pad the activated input).
unsafe fn gather(
    c: &ConvOp,
    r0: usize,
    r1: usize,
    src: *const f32,
    src_len: usize,
    tile: &mut [f32],
    ld: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        return gather_v4(c, r0, r1, src, src_len, tile, ld);
    }
    gather_body(c, r0, r1, src, src_len, tile, ld)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
unsafe fn gather_v4(
    c: &ConvOp,
    r0: usize,
    r1: usize,
    src: *const f32,
    src_len: usize,
    tile: &mut [f32],
    ld: usize,
) {
    gather_body(c, r0, r1, src, src_len, tile, ld)
}

#[inline(always)]
unsafe fn gather_body(
    c: &ConvOp,
    r0: usize,
    r1: usize,
    src: *const f32,
    src_len: usize,
    tile: &mut [f32],
    ld: usize,
) {
    let s = c.src;
    let (ho, wo) = (c.dst.h, c.dst.w);
    let (ih, iw) = c.in_hw();
    let up = if c.up2 { 1 } else { 0 };
    let kdim = c.kdim();
    let src = std::slice::from_raw_parts(src, src_len);
    let pix = |b: usize, y: usize, x: usize| {
        &src[((b * s.h + y) * s.w + x) * s.pitch + s.ch_off..][..s.c]
    };
    for r in r0..r1 {
        let (b, oy, ox) = (r / (ho * wo), (r / wo) % ho, r % wo);
        let out = &mut tile[(r - r0) * ld..][..kdim];
        if c.pool2 {
            out.fill(0.0);
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let p = pix(b, 2 * oy + dy, 2 * ox + dx);
                match &c.pre {
                    Some(a) => {
                        for (((o, &v), &sc), &sh) in
                            out.iter_mut().zip(p).zip(&a.scale).zip(&a.shift)
                        {
                            *o += (v * sc + sh).max(0.0);
                        }
                    }
                    None => out.iter_mut().zip(p).for_each(|(o, &v)| *o += v),
                }
            }
            out.iter_mut().for_each(|o| *o *= 0.25);
            continue;
        }
        for ky in 0..c.k {
            let iy = (oy * c.stride + ky * c.dilation) as isize - c.pad as isize;
            for kx in 0..c.k {
                let ix = (ox * c.stride + kx * c.dilation) as isize - c.pad as isize;
                let o = &mut out[(ky * c.k + kx) * s.c..(ky * c.k + kx + 1) * s.c];
                if iy < 0 || ix < 0 || iy >= ih as isize || ix >= iw as isize {
                    o.fill(0.0);
                    continue;
                }
                let p = pix(b, iy as usize >> up, ix as usize >> up);
                match &c.pre {
                    Some(a) => {
                        for (((o, &v), &sc), &sh) in o.iter_mut().zip(p).zip(&a.scale).zip(&a.shift)
                        {
                            *o = (v * sc + sh).max(0.0);
                        }
                    }
                    // One channel (the classifiers' stems): a store, not a memcpy call.
                    None if s.c == 1 => o[0] = p[0],
                    None => o.copy_from_slice(p),
                }
            }
        }
    }
}

fn maxpool_part(
    src: View,
    dst: View,
    geom: (usize, usize, usize),
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU has the features (checked at run time).
        return unsafe { maxpool_v4(src, dst, geom, batch, t, nt, sh) };
    }
    maxpool_body(src, dst, geom, batch, t, nt, sh)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
unsafe fn maxpool_v4(
    src: View,
    dst: View,
    geom: (usize, usize, usize),
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
) {
    maxpool_body(src, dst, geom, batch, t, nt, sh)
}

#[inline(always)]
fn maxpool_body(
    src: View,
    dst: View,
    (k, stride, pad): (usize, usize, usize),
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
) {
    let rows = batch * dst.h * dst.w;
    let (r0, r1) = share(rows, t, nt);
    // SAFETY: as in conv_part; this thread writes pixels r0..r1 of dst only.
    unsafe {
        let s = std::slice::from_raw_parts(sh.bufs[src.buf] as *const f32, sh.lens[src.buf]);
        let d = sh.bufs[dst.buf];
        for r in r0..r1 {
            let (b, oy, ox) = (r / (dst.h * dst.w), (r / dst.w) % dst.h, r % dst.w);
            let out = std::slice::from_raw_parts_mut(d.add(r * dst.pitch + dst.ch_off), dst.c);
            out.fill(f32::NEG_INFINITY);
            for ky in 0..k {
                let iy = (stride * oy + ky) as isize - pad as isize;
                if iy < 0 || iy >= src.h as isize {
                    continue;
                }
                for kx in 0..k {
                    let ix = (stride * ox + kx) as isize - pad as isize;
                    if ix < 0 || ix >= src.w as isize {
                        continue;
                    }
                    let at =
                        ((b * src.h + iy as usize) * src.w + ix as usize) * src.pitch + src.ch_off;
                    out.iter_mut()
                        .zip(&s[at..at + src.c])
                        .for_each(|(o, &v)| *o = o.max(v));
                }
            }
        }
    }
}

/// Channel chunks per pixel when pooling: few output pixels with many channels still split.
const POOL_CHUNK: usize = 256;

fn avgpool_part(
    src: View,
    dst: View,
    (kh, kw): (usize, usize),
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
) {
    let chunks = dst.c.div_ceil(POOL_CHUNK);
    let items = batch * dst.h * dst.w * chunks;
    let (lo, hi) = share(items, t, nt);
    let norm = 1.0 / (kh * kw) as f32;
    // SAFETY: as in conv_part; this thread writes its (pixel, channel chunk) items only.
    unsafe {
        let s = std::slice::from_raw_parts(sh.bufs[src.buf] as *const f32, sh.lens[src.buf]);
        let d = sh.bufs[dst.buf];
        for item in lo..hi {
            let (r, ch) = (item / chunks, item % chunks);
            let (c0, c1) = (ch * POOL_CHUNK, ((ch + 1) * POOL_CHUNK).min(dst.c));
            let (b, oy, ox) = (r / (dst.h * dst.w), (r / dst.w) % dst.h, r % dst.w);
            let out =
                std::slice::from_raw_parts_mut(d.add(r * dst.pitch + dst.ch_off + c0), c1 - c0);
            out.fill(0.0);
            for iy in oy * kh..(oy + 1) * kh {
                for ix in ox * kw..(ox + 1) * kw {
                    let at = ((b * src.h + iy) * src.w + ix) * src.pitch + src.ch_off;
                    out.iter_mut()
                        .zip(&s[at + c0..at + c1])
                        .for_each(|(o, &v)| *o += v);
                }
            }
            out.iter_mut().for_each(|o| *o *= norm);
        }
    }
}

/// PyTorch's source coordinate for `align_corners=False`: (first index, second, weight of second).
fn linear_taps(out: usize, in_size: usize, out_size: usize) -> (usize, usize, f32) {
    let scale = in_size as f32 / out_size as f32;
    let x = ((out as f32 + 0.5) * scale - 0.5).max(0.0);
    let i0 = (x as usize).min(in_size - 1);
    let i1 = (i0 + 1).min(in_size - 1);
    (i0, i1, x - i0 as f32)
}

fn resize_part(src: View, dst: View, batch: usize, t: usize, nt: usize, sh: &Shared) {
    let rows = batch * dst.h;
    let (r0, r1) = share(rows, t, nt);
    let xs: Vec<(usize, usize, f32)> = (0..dst.w).map(|x| linear_taps(x, src.w, dst.w)).collect();
    // SAFETY: as in conv_part; this thread writes output rows r0..r1 only.
    unsafe {
        let s = std::slice::from_raw_parts(sh.bufs[src.buf] as *const f32, sh.lens[src.buf]);
        let d = sh.bufs[dst.buf];
        let pix = |b: usize, y: usize, x: usize| {
            &s[((b * src.h + y) * src.w + x) * src.pitch + src.ch_off..][..src.c]
        };
        for r in r0..r1 {
            let (b, oy) = (r / dst.h, r % dst.h);
            let (y0, y1, ly) = linear_taps(oy, src.h, dst.h);
            for (ox, &(x0, x1, lx)) in xs.iter().enumerate() {
                let at = ((b * dst.h + oy) * dst.w + ox) * dst.pitch + dst.ch_off;
                let out = std::slice::from_raw_parts_mut(d.add(at), dst.c);
                let (a, bb, cc, dd) = (
                    pix(b, y0, x0),
                    pix(b, y0, x1),
                    pix(b, y1, x0),
                    pix(b, y1, x1),
                );
                let (w00, w01) = ((1.0 - ly) * (1.0 - lx), (1.0 - ly) * lx);
                let (w10, w11) = (ly * (1.0 - lx), ly * lx);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = w00 * a[i] + w01 * bb[i] + w10 * cc[i] + w11 * dd[i];
                }
            }
        }
    }
}

fn se_part(se: &SeOp, batch: usize, t: usize, nt: usize, sh: &Shared) {
    let (b0, b1) = share(batch, t, nt);
    let (src, dst) = (se.src, se.dst);
    let (rw, rb) = &se.reduce;
    let (ew, eb) = &se.expand;
    let c = src.c;
    let c_se = rw.len() / c.max(1);
    let hw = src.h * src.w;
    // SAFETY: as in conv_part; this thread writes the gates (and clears the sums) of images
    // b0..b1 only; every thread's sums were completed before the barrier.
    unsafe {
        let mut mean = vec![0f32; c];
        let mut hidden = vec![0f32; c_se];
        for b in b0..b1 {
            mean.fill(0.0);
            for th in 0..nt {
                let part = std::slice::from_raw_parts_mut(sh.sums(th, b), c);
                mean.iter_mut().zip(part.iter_mut()).for_each(|(m, p)| {
                    *m += *p;
                    *p = 0.0;
                });
            }
            mean.iter_mut().for_each(|m| *m /= hw as f32);
            for (j, h) in hidden.iter_mut().enumerate() {
                let z = rb.as_ref().map_or(0.0, |b| b[j])
                    + mean
                        .iter()
                        .enumerate()
                        .map(|(i, m)| m * rw[i * c_se + j])
                        .sum::<f32>();
                *h = Act::Swish.scalar(z);
            }
            let g =
                std::slice::from_raw_parts_mut(sh.bufs[dst.buf].add(b * dst.pitch + dst.ch_off), c);
            for (o, gv) in g.iter_mut().enumerate() {
                let z = eb.as_ref().map_or(0.0, |b| b[o])
                    + hidden
                        .iter()
                        .enumerate()
                        .map(|(j, h)| h * ew[j * c + o])
                        .sum::<f32>();
                *gv = Act::Sigmoid.scalar(z);
            }
        }
    }
}

fn head(h: &Head, buf: &[f32], batch: usize) -> Vec<f32> {
    let s = h.src;
    let hw = s.h * s.w;
    let mut logits = vec![0f32; batch * h.classes];
    let mut feat = vec![0f32; s.c];
    for b in 0..batch {
        feat.fill(0.0);
        for i in 0..hw {
            let p = &buf[(b * hw + i) * s.pitch + s.ch_off..][..s.c];
            match &h.pre {
                Some(a) => {
                    for (((f, &v), &sc), &sh) in feat.iter_mut().zip(p).zip(&a.scale).zip(&a.shift)
                    {
                        *f += (v * sc + sh).max(0.0);
                    }
                }
                None => feat.iter_mut().zip(p).for_each(|(f, &v)| *f += v),
            }
        }
        feat.iter_mut().for_each(|f| *f /= hw as f32);
        for k in 0..h.classes {
            let w = &h.weight[k * s.c..(k + 1) * s.c];
            logits[b * h.classes + k] =
                h.bias[k] + w.iter().zip(&feat).map(|(w, f)| w * f).sum::<f32>();
        }
    }
    logits
}

/// Checks that every view of the plan fits its buffer (called once when a plan is built).
pub(crate) fn validate(plan: &Plan) -> Result<(), CpuError> {
    let fits = |v: &View| {
        v.buf < plan.buf_sizes.len()
            && v.ch_off + v.c <= v.pitch
            && v.h * v.w * v.pitch <= plan.buf_sizes[v.buf]
    };
    let one_px = |v: &View| fits(v) && v.h == 1 && v.w == 1;
    let input = View::whole(0, plan.size, plan.size, plan.in_channels);
    let mut ok_all = fits(&input);
    let mut prev: Option<&Op> = None;
    for op in &plan.ops {
        let summed = |v: &View| matches!(prev, Some(Op::Conv(c)) if c.se_sums && c.dst == *v);
        let ok = match op {
            Op::Conv(c) => {
                fits(&c.src)
                    && fits(&c.dst)
                    && c.k >= 1
                    && c.stride >= 1
                    && c.dilation >= 1
                    && c.dst.h >= 1
                    && c.dst.w >= 1
                    && (!c.direct() || (c.src.h == c.dst.h && c.src.w == c.dst.w))
                    && c.residual.as_ref().is_none_or(|r| {
                        fits(r) && r.c == c.dst.c && r.h == c.dst.h && r.w == c.dst.w
                    })
                    && c.post
                        .as_ref()
                        .is_none_or(|a| a.scale.len() == c.dst.c && c.residual.is_some())
                    && c.gate.as_ref().is_none_or(|g| one_px(g) && g.c == c.src.c)
                    && c.weight.len() == c.kdim() * c.c_out()
                    && c.bias.as_ref().is_none_or(|b| b.len() == c.c_out())
                    && c.pre.as_ref().is_none_or(|a| a.scale.len() == c.src.c)
                    && (!c.pool2 || (c.k == 1 && c.src.h >= 2 * c.dst.h && c.src.w >= 2 * c.dst.w))
            }
            Op::MaxPool {
                src,
                dst,
                k,
                stride,
                pad,
            } => {
                fits(src)
                    && fits(dst)
                    && src.c == dst.c
                    && *stride >= 1
                    && *k > *pad
                    && (dst.h - 1) * stride + k <= src.h + 2 * pad
                    && (dst.w - 1) * stride + k <= src.w + 2 * pad
            }
            Op::AvgPool { src, dst, k } => {
                fits(src)
                    && fits(dst)
                    && src.c == dst.c
                    && k.0 >= 1
                    && k.1 >= 1
                    && dst.h * k.0 <= src.h
                    && dst.w * k.1 <= src.w
            }
            Op::Resize { src, dst } => {
                fits(src) && fits(dst) && src.c == dst.c && src.h >= 1 && src.w >= 1
            }
            Op::Se(se) => {
                let c_se = se.reduce.0.len() / se.src.c.max(1);
                fits(&se.src)
                    && summed(&se.src)
                    && one_px(&se.dst)
                    && se.dst.c == se.src.c
                    && se.reduce.0.len() == se.src.c * c_se
                    && se.expand.0.len() == c_se * se.src.c
                    && se.reduce.1.as_ref().is_none_or(|b| b.len() == c_se)
                    && se.expand.1.as_ref().is_none_or(|b| b.len() == se.src.c)
            }
        };
        ok_all &= ok;
        prev = Some(op);
        if !ok {
            return Err(CpuError::Weights(
                format!("inconsistent layer in the CPU plan: {op:?}")
                    .chars()
                    .take(300)
                    .collect(),
            ));
        }
    }
    let out_ok = match &plan.output {
        Output::Head(h) => fits(&h.src) && h.weight.len() == h.classes * h.src.c,
        Output::Map(v) => fits(v),
    };
    if !out_ok || !ok_all {
        return Err(CpuError::Weights(
            "inconsistent network output in the CPU plan".into(),
        ));
    }
    Ok(())
}

/// Output size of a conv/pool along one axis.
pub(crate) fn out_dim(i: usize, k: usize, stride: usize, pad: usize) -> usize {
    (i + 2 * pad - k) / stride + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_approx_matches_std_exp() {
        let mut worst = 0f32;
        for i in -8000..8000 {
            let x = i as f32 * 0.01;
            let rel = (exp_approx(x) - x.exp()).abs() / x.exp();
            worst = worst.max(rel);
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert!(exp_approx(-200.0) < 1e-37);
        assert!(exp_approx(200.0).is_finite());
    }

    #[test]
    fn linear_taps_follow_pytorch_half_pixel_rule() {
        // 2 → 4: sources -0.25 (clamped to 0), 0.25, 0.75, 1.25 (second tap clamped).
        assert_eq!(linear_taps(0, 2, 4), (0, 1, 0.0));
        assert_eq!(linear_taps(1, 2, 4), (0, 1, 0.25));
        assert_eq!(linear_taps(3, 2, 4), (1, 1, 0.25));
        // From one pixel everything is that pixel.
        assert_eq!(linear_taps(5, 1, 8).0, 0);
    }
}
