//! Hilum's own CPU convolution kernels. candle's CPU `conv2d` spends most of its time outside
//! the matrix product (FACTS.md: ~10x slower than ONNX Runtime on DenseNet-121), so on CPU the
//! classifiers run here instead:
//! - activations are NHWC `f32`, a layer's output is a channel slice of a (possibly wider) buffer,
//!   so DenseNet's concatenation is written in place;
//! - a 1x1 convolution is one strided gemm over pixels; a kxk one gathers tiles of pixels
//!   (im2col) into a per-thread buffer and runs one single-threaded gemm per tile;
//! - BatchNorm after a conv is folded into its weights at load; bias, residual and ReLU are
//!   applied to each tile while it is hot; a BatchNorm + ReLU *before* a conv (DenseNet) is
//!   applied while the tile is gathered;
//! - the whole forward runs inside one scope of a dedicated rayon pool: every thread walks the
//!   same list of layers, takes its share of each, and meets the others at a spin barrier
//!   (waking sleeping workers per layer costs more than small layers take).

mod densenet;
mod resnet;

pub use densenet::NativeDenseNet;
pub use resnet::NativeResNet;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_nn::{BatchNorm, Conv2d, Linear};

/// Errors of the native path; they only arise from malformed weights or inputs.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("cannot read weights for the CPU kernels: {0}")]
    Weights(String),
    #[error("input has {got} values, expected {expected} (batch x {channels} x {size} x {size})")]
    Input {
        got: usize,
        expected: usize,
        channels: usize,
        size: usize,
    },
    #[error("cannot start CPU worker threads: {0}")]
    Threads(String),
}

impl From<candle_core::Error> for CpuError {
    fn from(e: candle_core::Error) -> Self {
        CpuError::Weights(e.to_string())
    }
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
    let (w, b) = bn
        .weight_and_bias()
        .ok_or_else(|| CpuError::Weights("BatchNorm without affine parameters".into()))?;
    let mean = bn.running_mean().to_vec1::<f32>()?;
    let var = bn.running_var().to_vec1::<f32>()?;
    let w = w.to_vec1::<f32>()?;
    let b = b.to_vec1::<f32>()?;
    let eps = bn.eps() as f32;
    let scale: Vec<f32> = w
        .iter()
        .zip(&var)
        .map(|(w, v)| w / (v + eps).sqrt())
        .collect();
    let shift = b
        .iter()
        .zip(&mean)
        .zip(&scale)
        .map(|((b, m), s)| b - m * s)
        .collect();
    Ok(Affine { scale, shift })
}

/// Gemm weights (k * k * c_in, c_out) and the bias of a conv with its BatchNorm folded in.
pub(crate) type Folded = (Vec<f32>, Option<Vec<f32>>);

/// Floats per gathered tile: `HILUM_CPU_TILE_FLOATS` (a tuning knob), default 2^16 (256 KiB).
fn tile_floats() -> usize {
    static TILE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *TILE.get_or_init(|| {
        std::env::var("HILUM_CPU_TILE_FLOATS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &usize| n >= 1024)
            .unwrap_or(1 << 16)
    })
}

/// One convolution with everything fused around it.
#[derive(Clone, Debug)]
pub(crate) struct ConvOp {
    pub src: View,
    pub dst: View,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
    /// BatchNorm + ReLU applied to the input before the conv (pre-activation).
    pub pre: Option<Affine>,
    /// 2x2 average pool of the (pre-activated) input before a 1x1 conv: a DenseNet
    /// transition's conv and pool are both linear, so pooling first is 4x cheaper.
    pub pool2: bool,
    /// (k * k * c_in, c_out) row-major, BatchNorm folded in.
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    /// Added before the ReLU (ResNet shortcut); same pixels and channels as `dst`.
    pub residual: Option<View>,
    pub relu: bool,
}

impl ConvOp {
    /// Conv (c_out, c_in, k, k) followed by an optional BatchNorm, as gemm weights and a bias.
    pub fn fold(conv: &Conv2d, bn: Option<&BatchNorm>) -> Result<Folded, CpuError> {
        let w = conv.weight();
        let (c_out, c_in, kh, kw) = w.dims4()?;
        if kh != kw {
            return Err(CpuError::Weights(format!("non-square kernel {kh}x{kw}")));
        }
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let aff = bn.map(bn_affine).transpose()?;
        let mut out = vec![0f32; wv.len()];
        for co in 0..c_out {
            let s = aff.as_ref().map_or(1.0, |a| a.scale[co]);
            for ci in 0..c_in {
                for ky in 0..kh {
                    for kx in 0..kw {
                        let src = ((co * c_in + ci) * kh + ky) * kw + kx;
                        let dst = ((ky * kw + kx) * c_in + ci) * c_out + co;
                        out[dst] = wv[src] * s;
                    }
                }
            }
        }
        Ok((out, aff.map(|a| a.shift)))
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
    /// Whether the gemm can read the input buffer directly (no gathering).
    fn direct(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0 && self.pre.is_none() && !self.pool2
    }
    /// Pixels per gathered tile: big enough to amortise packing the weights, small enough
    /// to stay in L2.
    fn tile_rows(&self, rows: usize) -> usize {
        if self.direct() {
            return rows.max(1);
        }
        (tile_floats() / self.kdim())
            .clamp(48, 512)
            .min(rows.max(1))
    }
}

#[derive(Clone, Debug)]
pub(crate) enum Op {
    Conv(ConvOp),
    /// 3x3, stride 2, padding 1 max pool (padding never wins: the inputs follow a ReLU).
    MaxPool {
        src: View,
        dst: View,
    },
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
        let w = fc.weight();
        let classes = w.dim(0)?;
        let bias = match fc.bias() {
            Some(b) => b.to_vec1::<f32>()?,
            None => vec![0.0; classes],
        };
        Ok(Head {
            src,
            pre,
            weight: w.flatten_all()?.to_vec1::<f32>()?,
            bias,
            classes,
        })
    }
}

/// A network as a list of ops over numbered NHWC buffers (sizes per image).
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    pub in_channels: usize,
    pub size: usize,
    /// Floats per image of each buffer; buffer 0 is the input.
    pub buf_sizes: Vec<usize>,
    pub ops: Vec<Op>,
    pub head: Head,
}

/// Per-thread scratch and buffers, reused across calls with the same batch size.
struct Workspace {
    batch: usize,
    bufs: Vec<Vec<f32>>,
    scratch: Vec<Vec<f32>>,
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

    /// Input (batch, in_channels, size, size) as NCHW `f32` (NHWC when in_channels == 1).
    /// Returns logits (batch, classes) row-major.
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
        if guard.as_ref().map(|w| w.batch) != Some(batch) {
            let scratch_len = p
                .ops
                .iter()
                .map(|op| match op {
                    Op::Conv(c) if !c.direct() => {
                        let rows = batch * c.dst.h * c.dst.w;
                        c.tile_rows(rows) * c.kdim()
                    }
                    _ => 0,
                })
                .max()
                .unwrap_or(0);
            *guard = Some(Workspace {
                batch,
                bufs: p.buf_sizes.iter().map(|&s| vec![0f32; s * batch]).collect(),
                scratch: (0..self.threads).map(|_| vec![0f32; scratch_len]).collect(),
            });
        }
        let ws = guard
            .as_mut()
            .ok_or_else(|| CpuError::Threads("no workspace".into()))?;
        // NCHW → NHWC for the input buffer.
        let hw = p.size * p.size;
        let c = p.in_channels;
        for b in 0..batch {
            for ch in 0..c {
                for i in 0..hw {
                    ws.bufs[0][(b * hw + i) * c + ch] = input[(b * c + ch) * hw + i];
                }
            }
        }
        let shared = Shared {
            lens: ws.bufs.iter().map(|b| b.len()).collect(),
            bufs: ws.bufs.iter_mut().map(|b| b.as_mut_ptr()).collect(),
        };
        let barrier = SpinBarrier::new(self.threads);
        let nt = self.threads;
        let scratch = &mut ws.scratch;
        // HILUM_CPU_PROFILE=1: time of every op (thread 0, barrier to barrier) on stderr.
        let mut profile = std::env::var_os("HILUM_CPU_PROFILE").map(|_| vec![0f64; p.ops.len()]);
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
        Ok(head(&p.head, &ws.bufs[p.head.src.buf], batch))
    }
}

#[allow(clippy::too_many_arguments)]
fn run_ops(
    plan: &Plan,
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
    barrier: &SpinBarrier,
    scratch: &mut [f32],
    mut profile: Option<&mut Vec<f64>>,
) {
    let mut t0 = std::time::Instant::now();
    for (i, op) in plan.ops.iter().enumerate() {
        match op {
            Op::Conv(c) => conv_part(c, batch, t, nt, sh, scratch),
            Op::MaxPool { src, dst } => maxpool_part(*src, *dst, batch, t, nt, sh),
        }
        barrier.wait();
        if let Some(p) = profile.as_deref_mut() {
            let now = std::time::Instant::now();
            p[i] += (now - t0).as_secs_f64() * 1e3;
            t0 = now;
        }
    }
}

/// Per kind of op: count, milliseconds, GFLOP/s.
fn print_profile(plan: &Plan, batch: usize, nt: usize, times: &[f64]) {
    let mut rows: std::collections::BTreeMap<String, (usize, f64, f64)> = Default::default();
    for (op, &ms) in plan.ops.iter().zip(times) {
        let (kind, flops) = match op {
            Op::Conv(c) => {
                let kind = match (c.k, c.pre.is_some(), c.pool2, c.direct()) {
                    (_, _, true, _) => "1x1 pre-act + pool2 (transition)".to_string(),
                    (1, true, _, _) => "1x1 pre-act (gathered)".to_string(),
                    (1, _, _, true) => "1x1 direct".to_string(),
                    (k, _, _, _) => format!("{k}x{k} s{} im2col", c.stride),
                };
                let f = 2.0 * (batch * c.dst.h * c.dst.w * c.kdim() * c.c_out()) as f64;
                (kind, f)
            }
            Op::MaxPool { .. } => ("maxpool".to_string(), 0.0),
        };
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
            "  {kind:<36} {n:>4} ops {ms:>8.2} ms {:>5.1}% {:>7.1} GFLOP/s",
            100.0 * ms / total.max(1e-9),
            f / (ms.max(1e-9) * 1e6)
        );
    }
}

/// `[lo, hi)` of `n` items for thread `t` of `nt`.
fn share(n: usize, t: usize, nt: usize) -> (usize, usize) {
    (n * t / nt, n * (t + 1) / nt)
}

fn conv_part(c: &ConvOp, batch: usize, t: usize, nt: usize, sh: &Shared, scratch: &mut [f32]) {
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
        let m = r1 - r0;
        // SAFETY: views were checked to fit their buffers when the plan was built; rows r0..r1
        // and columns n0..n1 of dst belong to this thread only; the src was completed before the
        // last barrier.
        unsafe {
            let src = sh.bufs[c.src.buf] as *const f32;
            let (lhs, lhs_rs) = if c.direct() {
                (src.add(r0 * c.src.pitch + c.src.ch_off), c.src.pitch)
            } else {
                if gathered != Some(r0) {
                    gather(
                        c,
                        batch,
                        r0,
                        r1,
                        src,
                        sh.lens[c.src.buf],
                        &mut scratch[..m * kdim],
                    );
                    gathered = Some(r0);
                }
                (scratch.as_ptr(), kdim)
            };
            let dst = sh.bufs[c.dst.buf].add(r0 * c.dst.pitch + c.dst.ch_off + n0);
            gemm::gemm(
                m,
                n1 - n0,
                kdim,
                dst,
                1,
                c.dst.pitch as isize,
                false,
                lhs,
                1,
                lhs_rs as isize,
                c.weight.as_ptr().add(n0),
                1,
                c_out as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
            epilogue(c, sh, r0, r1, n0, n1);
        }
    }
}

/// Bias, shortcut and ReLU on the rows r0..r1, columns n0..n1 just written.
unsafe fn epilogue(c: &ConvOp, sh: &Shared, r0: usize, r1: usize, n0: usize, n1: usize) {
    if c.bias.is_none() && c.residual.is_none() && !c.relu {
        return;
    }
    let dst = sh.bufs[c.dst.buf];
    for r in r0..r1 {
        let row = std::slice::from_raw_parts_mut(dst.add(r * c.dst.pitch + c.dst.ch_off), c.dst.c);
        let row = &mut row[n0..n1];
        if let Some(b) = &c.bias {
            row.iter_mut().zip(&b[n0..n1]).for_each(|(v, b)| *v += b);
        }
        if let Some(res) = &c.residual {
            let rp = sh.bufs[res.buf] as *const f32;
            let rrow = std::slice::from_raw_parts(rp.add(r * res.pitch + res.ch_off), res.c);
            row.iter_mut().zip(&rrow[n0..n1]).for_each(|(v, s)| *v += s);
        }
        if c.relu {
            row.iter_mut().for_each(|v| *v = v.max(0.0));
        }
    }
}

/// im2col of output pixels r0..r1 into `tile` ((r1 - r0) x k*k*c_in), applying the
/// pre-activation and the 2x2 pre-pool. Padding stays zero (PyTorch pads the activated input).
unsafe fn gather(
    c: &ConvOp,
    _batch: usize,
    r0: usize,
    r1: usize,
    src: *const f32,
    src_len: usize,
    tile: &mut [f32],
) {
    let s = c.src;
    let (ho, wo) = (c.dst.h, c.dst.w);
    let kdim = c.kdim();
    let src = std::slice::from_raw_parts(src, src_len);
    let pix = |b: usize, y: usize, x: usize| {
        &src[((b * s.h + y) * s.w + x) * s.pitch + s.ch_off..][..s.c]
    };
    for r in r0..r1 {
        let (b, oy, ox) = (r / (ho * wo), (r / wo) % ho, r % wo);
        let out = &mut tile[(r - r0) * kdim..(r - r0 + 1) * kdim];
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
            let iy = (oy * c.stride + ky) as isize - c.pad as isize;
            for kx in 0..c.k {
                let ix = (ox * c.stride + kx) as isize - c.pad as isize;
                let o = &mut out[(ky * c.k + kx) * s.c..(ky * c.k + kx + 1) * s.c];
                if iy < 0 || ix < 0 || iy >= s.h as isize || ix >= s.w as isize {
                    o.fill(0.0);
                    continue;
                }
                let p = pix(b, iy as usize, ix as usize);
                match &c.pre {
                    Some(a) => {
                        for (((o, &v), &sc), &sh) in o.iter_mut().zip(p).zip(&a.scale).zip(&a.shift)
                        {
                            *o = (v * sc + sh).max(0.0);
                        }
                    }
                    None => o.copy_from_slice(p),
                }
            }
        }
    }
}

fn maxpool_part(src: View, dst: View, batch: usize, t: usize, nt: usize, sh: &Shared) {
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
            for ky in 0..3 {
                let iy = (2 * oy + ky) as isize - 1;
                if iy < 0 || iy >= src.h as isize {
                    continue;
                }
                for kx in 0..3 {
                    let ix = (2 * ox + kx) as isize - 1;
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
    for op in &plan.ops {
        let ok = match op {
            Op::Conv(c) => {
                fits(&c.src)
                    && fits(&c.dst)
                    && c.residual.as_ref().is_none_or(|r| {
                        fits(r) && r.c == c.dst.c && r.h == c.dst.h && r.w == c.dst.w
                    })
                    && c.weight.len() == c.kdim() * c.c_out()
                    && c.pre.as_ref().is_none_or(|a| a.scale.len() == c.src.c)
                    && (!c.pool2 || (c.k == 1 && c.src.h >= 2 * c.dst.h && c.src.w >= 2 * c.dst.w))
            }
            Op::MaxPool { src, dst } => fits(src) && fits(dst) && src.c == dst.c,
        };
        if !ok {
            return Err(CpuError::Weights(
                format!("inconsistent layer in the CPU plan: {op:?}")
                    .chars()
                    .take(300)
                    .collect(),
            ));
        }
    }
    if !fits(&plan.head.src) || plan.head.weight.len() != plan.head.classes * plan.head.src.c {
        return Err(CpuError::Weights("inconsistent classification head".into()));
    }
    Ok(())
}

/// Output size of a conv/pool along one axis.
pub(crate) fn out_dim(i: usize, k: usize, stride: usize, pad: usize) -> usize {
    (i + 2 * pad - k) / stride + 1
}
