//! One-token decode products `y = W x` on GGUF blocks, with Hilum's own kernels for the two
//! 32-element block types a small model is mostly made of.
//!
//! Why not candle's `QMatMul` alone: candle has no SIMD dot product for Q5_0 (its scalar one is
//! ~10x slower), so Q5_0 matrices used to be re-quantized to Q8_0 at load — 8.5 instead of 5.5
//! bits per weight, i.e. ~25% more bytes read per token on Qwen2.5-0.5B, where decode is bound
//! by memory bandwidth. Here Q5_0 and Q8_0 rows are dotted with 8-bit activations (AVX2 + FMA,
//! runtime-detected, scalar fallback) and several matrices sharing one input (q/k/v, gate/up)
//! run in one parallel region on candle's own thread pool (so no second pool spins beside it).
//! K-quant matrices keep candle's SIMD kernels (`GgmlType::vec_dot`) inside the same region.
//! `matmat` serves a few rows at once (a grammar-forced batch, a checked draft): there an
//! AVX-512 Q5_0/Q8_0 row is unpacked once for up to eight inputs.

use candle_core::quantized::k_quants::{BlockQ4K, BlockQ6K, BlockQ8K, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};

/// Elements per Q5_0 / Q8_0 block.
const QK: usize = 32;
/// Bytes of a GGUF Q5_0 block: f16 scale, 32 high bits, 16 bytes of low nibbles.
const Q5_0_BYTES: usize = 22;
/// Bytes of a GGUF Q8_0 block: f16 scale, 32 signed bytes.
const Q8_0_BYTES: usize = 34;
/// Rows per work item (one activation load serves four rows).
const ROWS_PER_ITEM: usize = 4;
/// Activations one unpacked weight row serves at once in `matmat` (accumulators in registers).
const BATCH: usize = 8;

enum Blocks {
    Q5_0(Vec<u8>),
    Q8_0(Vec<u8>),
    Q4K(Vec<BlockQ4K>),
    Q6K(Vec<BlockQ6K>),
}

/// A (rows, cols) weight matrix kept in its GGUF block form.
pub(crate) struct QMat {
    rows: usize,
    cols: usize,
    blocks: Blocks,
}

/// The activation `x` quantized once per block family.
struct Activation {
    /// 32-element blocks: one f32 scale and 32 signed bytes each.
    q8_d: Vec<f32>,
    q8_qs: Vec<i8>,
    /// Per pair of blocks, what the AVX-512 kernels load instead of building it per row.
    pairs: Vec<PairConsts>,
    /// 256-element blocks for candle's K-quant dot products.
    q8k: Vec<BlockQ8K>,
}

/// Blocks 2p and 2p+1 of the activation spread over the 16 lanes of a 512-bit register (lanes
/// 0-7: the first block, 8-15: the second).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct PairConsts {
    /// `-16 * sum(x)` (Q5_0's stored offset) in lanes 0 and 8, zero elsewhere.
    off5: [i32; 16],
    /// `-128 * sum(x)` (Q8_0 flipped to unsigned) in lanes 0 and 8.
    off8: [i32; 16],
    /// The activation's scales.
    dx: [f32; 16],
}

impl PairConsts {
    fn build(d: &[f32], qs: &[i8]) -> Vec<Self> {
        // The weights' offset times the block's sum of quantized activations.
        let sums: Vec<i32> = qs
            .chunks(QK)
            .map(|b| b.iter().map(|&v| v as i32).sum())
            .collect();
        (0..d.len() / 2)
            .map(|p| {
                let (b0, b1) = (2 * p, 2 * p + 1);
                let mut c = PairConsts {
                    off5: [0; 16],
                    off8: [0; 16],
                    dx: [0.0; 16],
                };
                c.off5[0] = -16 * sums[b0];
                c.off5[8] = -16 * sums[b1];
                c.off8[0] = -128 * sums[b0];
                c.off8[8] = -128 * sums[b1];
                c.dx[..8].fill(d[b0]);
                c.dx[8..].fill(d[b1]);
                c
            })
            .collect()
    }
}

fn copy_blocks<T: GgmlType>(bytes: &[u8]) -> Option<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if size == 0 || !bytes.len().is_multiple_of(size) {
        return None;
    }
    let n = bytes.len() / size;
    let mut v: Vec<T> = vec![T::zeros(); n];
    // SAFETY: `v` owns exactly `bytes.len()` bytes of plain-old-data blocks (repr(C) structs of
    // integers and f16 in the GGUF layout), and the two buffers do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len());
    }
    Some(v)
}

impl QMat {
    /// The matrix in a form these kernels handle, or `None` (the caller keeps candle's path).
    pub(crate) fn from_qtensor(q: &QTensor) -> candle_core::Result<Option<Self>> {
        let (rows, cols) = match q.shape().dims() {
            [r, c] => (*r, *c),
            _ => return Ok(None),
        };
        let data = q.data()?;
        let blocks = match q.dtype() {
            GgmlDType::Q5_0 if cols.is_multiple_of(QK) => Blocks::Q5_0(data.into_owned()),
            GgmlDType::Q8_0 if cols.is_multiple_of(QK) => Blocks::Q8_0(data.into_owned()),
            GgmlDType::Q4K if cols.is_multiple_of(BlockQ4K::BLCK_SIZE) => {
                match copy_blocks(&data) {
                    Some(b) => Blocks::Q4K(b),
                    None => return Ok(None),
                }
            }
            GgmlDType::Q6K if cols.is_multiple_of(BlockQ6K::BLCK_SIZE) => {
                match copy_blocks(&data) {
                    Some(b) => Blocks::Q6K(b),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        let m = QMat { rows, cols, blocks };
        let expected = match &m.blocks {
            Blocks::Q5_0(b) => b.len() == rows * cols / QK * Q5_0_BYTES,
            Blocks::Q8_0(b) => b.len() == rows * cols / QK * Q8_0_BYTES,
            Blocks::Q4K(b) => b.len() == rows * cols / BlockQ4K::BLCK_SIZE,
            Blocks::Q6K(b) => b.len() == rows * cols / BlockQ6K::BLCK_SIZE,
        };
        if !expected {
            candle_core::bail!("a {rows}x{cols} {:?} tensor has the wrong size", q.dtype());
        }
        Ok(Some(m))
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Whether `row_times` serves this matrix on this CPU (Q5_0 / Q8_0 with AVX-512 VNNI).
    fn batch_kernel(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            matches!(self.blocks, Blocks::Q5_0(_) | Blocks::Q8_0(_)) && simd_level() == Simd::Avx512
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// Row `r` of `W` times each activation of `acts` (at most `BATCH`) into `out`, the row's
    /// blocks unpacked once for all of them. Only where `batch_kernel` says so.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn row_times(&self, r: usize, acts: &[Activation], out: &mut [f32; BATCH]) {
        #[cfg(target_arch = "x86_64")]
        {
            let (q5, b) = match &self.blocks {
                Blocks::Q5_0(b) => (true, b),
                Blocks::Q8_0(b) => (false, b),
                _ => return,
            };
            let row_bytes = self.cols / QK * if q5 { Q5_0_BYTES } else { Q8_0_BYTES };
            let row = &b[r * row_bytes..(r + 1) * row_bytes];
            fn chunk<const N: usize>(q5: bool, row: &[u8], acts: &[Activation], out: &mut [f32]) {
                let refs: [&Activation; N] = std::array::from_fn(|k| &acts[k]);
                // SAFETY: called only when `simd_level()` is AVX-512 (see `batch_kernel`).
                let y = unsafe {
                    if q5 {
                        avx512::dot_rows::<N, true>(row, &refs)
                    } else {
                        avx512::dot_rows::<N, false>(row, &refs)
                    }
                };
                out[..N].copy_from_slice(&y);
            }
            match acts.len() {
                1 => chunk::<1>(q5, row, acts, out),
                2 => chunk::<2>(q5, row, acts, out),
                3 => chunk::<3>(q5, row, acts, out),
                4 => chunk::<4>(q5, row, acts, out),
                5 => chunk::<5>(q5, row, acts, out),
                6 => chunk::<6>(q5, row, acts, out),
                7 => chunk::<7>(q5, row, acts, out),
                n => {
                    debug_assert_eq!(n, BATCH, "row_times takes 1..=BATCH inputs");
                    chunk::<BATCH>(q5, row, acts, out)
                }
            }
        }
    }

    fn needs_q8k(&self) -> bool {
        matches!(self.blocks, Blocks::Q4K(_) | Blocks::Q6K(_))
    }

    /// Rows `r..r + n` (n ≤ 4) of `W x` into `out`.
    fn rows_dot(&self, r: usize, n: usize, act: &Activation, out: &mut [f32]) {
        match &self.blocks {
            Blocks::Q5_0(b) | Blocks::Q8_0(b) => {
                let q5 = matches!(self.blocks, Blocks::Q5_0(_));
                let bytes = if q5 { Q5_0_BYTES } else { Q8_0_BYTES };
                let row_bytes = self.cols / QK * bytes;
                for (i, o) in out[..n].iter_mut().enumerate() {
                    let row = &b[(r + i) * row_bytes..(r + i + 1) * row_bytes];
                    *o = dot(q5, row, act);
                }
            }
            Blocks::Q4K(b) => k_rows(b, self.cols, r, n, &act.q8k, out),
            Blocks::Q6K(b) => k_rows(b, self.cols, r, n, &act.q8k, out),
        }
    }
}

fn k_rows<T: GgmlType<VecDotType = BlockQ8K>>(
    b: &[T],
    cols: usize,
    r: usize,
    n: usize,
    x: &[BlockQ8K],
    out: &mut [f32],
) {
    let per_row = cols / T::BLCK_SIZE;
    let row = |i: usize| &b[(r + i) * per_row..(r + i + 1) * per_row];
    if n == 4 {
        let (a, bb, c, d) = T::vec_dot_4(cols, row(0), row(1), row(2), row(3), x);
        out[..4].copy_from_slice(&[a, bb, c, d]);
    } else {
        for (i, o) in out[..n].iter_mut().enumerate() {
            *o = T::vec_dot(cols, row(i), x);
        }
    }
}

/// `x` as 32-element blocks of signed bytes with one scale each (round to nearest even, as
/// ggml's AVX2 quantizer).
fn quantize_q8(x: &[f32], d: &mut Vec<f32>, qs: &mut Vec<i8>) {
    d.clear();
    qs.clear();
    for block in x.chunks(QK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        d.push(scale);
        qs.extend(block.iter().map(|v| (v * inv).round_ties_even() as i8));
    }
}

/// One row of Q5_0 (`q5`) or Q8_0 blocks times the quantized activation. Rows are read one
/// at a time: one sequential stream per thread is what the hardware prefetcher follows best
/// (four interleaved rows ran at half the bandwidth).
fn dot(q5: bool, row: &[u8], a: &Activation) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        match simd_level() {
            // SAFETY: the CPU has the features of the level (detected once at run time).
            Simd::Avx512 => unsafe {
                return if q5 {
                    avx512::dot_rows::<1, true>(row, &[a])[0]
                } else {
                    avx512::dot_rows::<1, false>(row, &[a])[0]
                };
            },
            Simd::Avx2 => unsafe {
                return if q5 {
                    avx2::dot_q5_0(row, &a.q8_d, &a.q8_qs)
                } else {
                    avx2::dot_q8_0(row, &a.q8_d, &a.q8_qs)
                };
            },
            Simd::None => {}
        }
    }
    if q5 {
        scalar::dot_q5_0(row, &a.q8_d, &a.q8_qs)
    } else {
        scalar::dot_q8_0(row, &a.q8_d, &a.q8_qs)
    }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Simd {
    /// AVX-512 F/BW/VL + VNNI: two blocks per 512-bit register, `vpdpbusd`.
    Avx512,
    /// AVX2 + FMA + F16C.
    Avx2,
    None,
}

/// The widest SIMD the block kernels may use; they take the best the CPU has up to it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SimdCap {
    /// The best the CPU has.
    #[default]
    Auto,
    /// AVX2 at most (to compare with builds without AVX-512).
    Avx2,
    /// No SIMD (the reference kernels).
    Scalar,
}

impl std::str::FromStr for SimdCap {
    type Err = String;

    /// `auto` (or empty), `avx2` or `scalar`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "" | "auto" => Ok(SimdCap::Auto),
            "avx2" => Ok(SimdCap::Avx2),
            "scalar" => Ok(SimdCap::Scalar),
            other => Err(format!(
                "SIMD cap `{other}` is not one of auto, avx2, scalar"
            )),
        }
    }
}

/// The process-wide cap (0 auto, 1 avx2, 2 scalar), set by every model load.
static SIMD_CAP: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

pub(crate) fn cap_simd(cap: SimdCap) {
    let v = match cap {
        SimdCap::Auto => 0,
        SimdCap::Avx2 => 1,
        SimdCap::Scalar => 2,
    };
    SIMD_CAP.store(v, std::sync::atomic::Ordering::Relaxed);
}

#[cfg(target_arch = "x86_64")]
fn simd_level() -> Simd {
    static DETECTED: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    let detected = *DETECTED.get_or_init(|| {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let avx512 = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        match (avx2, avx512) {
            (true, true) => Simd::Avx512,
            (true, false) => Simd::Avx2,
            _ => Simd::None,
        }
    });
    match (
        SIMD_CAP.load(std::sync::atomic::Ordering::Relaxed),
        detected,
    ) {
        (2, _) => Simd::None,
        (1, Simd::Avx512) => Simd::Avx2,
        (_, level) => level,
    }
}

/// The little-endian IEEE half at byte `at` (a block's scale) as f32.
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

mod scalar {
    use super::{f16_at, Q5_0_BYTES, Q8_0_BYTES, QK};

    pub(super) fn dot_q5_0(row: &[u8], d: &[f32], qs: &[i8]) -> f32 {
        let mut sum = 0f32;
        for (bi, blk) in row.chunks_exact(Q5_0_BYTES).enumerate() {
            let scale = f16_at(blk, 0);
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let x = &qs[bi * QK..(bi + 1) * QK];
            let mut s = 0i32;
            for j in 0..16 {
                let lo = (blk[6 + j] & 0x0f) as i32 | ((((qh >> j) & 1) << 4) as i32);
                let hi = (blk[6 + j] >> 4) as i32 | ((((qh >> (j + 16)) & 1) << 4) as i32);
                s += (lo - 16) * x[j] as i32 + (hi - 16) * x[j + 16] as i32;
            }
            sum += scale * d[bi] * s as f32;
        }
        sum
    }

    pub(super) fn dot_q8_0(row: &[u8], d: &[f32], qs: &[i8]) -> f32 {
        let mut sum = 0f32;
        for (bi, blk) in row.chunks_exact(Q8_0_BYTES).enumerate() {
            let scale = f16_at(blk, 0);
            let x = &qs[bi * QK..(bi + 1) * QK];
            let s: i32 = blk[2..]
                .iter()
                .zip(x)
                .map(|(&w, &v)| w as i8 as i32 * v as i32)
                .sum();
            sum += scale * d[bi] * s as f32;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Q5_0_BYTES, Q8_0_BYTES, QK};

    /// Sum of the eight f32 lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Signed-byte dot product of 32 pairs as eight i32 partial sums, then f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_i8(w: __m256i, x: __m256i) -> __m256 {
        // maddubs wants unsigned x signed: move w's sign onto x.
        let aw = _mm256_sign_epi8(w, w);
        let sx = _mm256_sign_epi8(x, w);
        let p16 = _mm256_maddubs_epi16(aw, sx);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
    }

    /// The 32 weights of a Q5_0 block as signed bytes in -16..=15.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_0_bytes(blk: *const u8) -> __m256i {
        let raw = _mm_loadu_si128(blk.add(6) as *const __m128i);
        let m4 = _mm_set1_epi8(0x0f);
        let lo = _mm_and_si128(raw, m4);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
        let nib = _mm256_set_m128i(hi, lo);
        let qh = (blk.add(2) as *const u32).read_unaligned();
        // Byte i takes byte i/8 of qh, then tests bit i%8.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits);
        let q = _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        _mm256_sub_epi8(q, _mm256_set1_epi8(16))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let x = _mm256_loadu_ps(a.as_ptr().add(i));
            let y = _mm256_loadu_ps(b.as_ptr().add(i));
            acc = _mm256_fmadd_ps(x, y, acc);
            i += 8;
        }
        let mut s = hsum(acc);
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let a = _mm256_set1_ps(alpha);
        let mut i = 0;
        while i + 8 <= n {
            let xv = _mm256_loadu_ps(x.as_ptr().add(i));
            let yv = _mm256_loadu_ps(y.as_ptr().add(i));
            _mm256_storeu_ps(y.as_mut_ptr().add(i), _mm256_fmadd_ps(a, xv, yv));
            i += 8;
        }
        while i < n {
            y[i] += alpha * x[i];
            i += 1;
        }
    }

    /// One row, two blocks per step (two accumulators): the row is read as one sequential
    /// stream, which the hardware prefetcher follows better than four interleaved rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q5_0(row: &[u8], d: &[f32], qs: &[i8]) -> f32 {
        let nb = d.len().min(row.len() / Q5_0_BYTES);
        let p = row.as_ptr();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut b = 0;
        while b + 1 < nb {
            let s0 = scale1(p.add(b * Q5_0_BYTES)) * d[b];
            let s1 = scale1(p.add((b + 1) * Q5_0_BYTES)) * d[b + 1];
            let x0 = _mm256_loadu_si256(qs.as_ptr().add(b * QK) as *const __m256i);
            let x1 = _mm256_loadu_si256(qs.as_ptr().add((b + 1) * QK) as *const __m256i);
            let w0 = q5_0_bytes(p.add(b * Q5_0_BYTES));
            let w1 = q5_0_bytes(p.add((b + 1) * Q5_0_BYTES));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0), dot_i8(w0, x0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s1), dot_i8(w1, x1), acc1);
            b += 2;
        }
        if b < nb {
            let s0 = scale1(p.add(b * Q5_0_BYTES)) * d[b];
            let x0 = _mm256_loadu_si256(qs.as_ptr().add(b * QK) as *const __m256i);
            let w0 = q5_0_bytes(p.add(b * Q5_0_BYTES));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0), dot_i8(w0, x0), acc0);
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0(row: &[u8], d: &[f32], qs: &[i8]) -> f32 {
        let nb = d.len().min(row.len() / Q8_0_BYTES);
        let p = row.as_ptr();
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut b = 0;
        while b + 1 < nb {
            let s0 = scale1(p.add(b * Q8_0_BYTES)) * d[b];
            let s1 = scale1(p.add((b + 1) * Q8_0_BYTES)) * d[b + 1];
            let x0 = _mm256_loadu_si256(qs.as_ptr().add(b * QK) as *const __m256i);
            let x1 = _mm256_loadu_si256(qs.as_ptr().add((b + 1) * QK) as *const __m256i);
            let w0 = _mm256_loadu_si256(p.add(b * Q8_0_BYTES + 2) as *const __m256i);
            let w1 = _mm256_loadu_si256(p.add((b + 1) * Q8_0_BYTES + 2) as *const __m256i);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0), dot_i8(w0, x0), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(s1), dot_i8(w1, x1), acc1);
            b += 2;
        }
        if b < nb {
            let s0 = scale1(p.add(b * Q8_0_BYTES)) * d[b];
            let x0 = _mm256_loadu_si256(qs.as_ptr().add(b * QK) as *const __m256i);
            let w0 = _mm256_loadu_si256(p.add(b * Q8_0_BYTES + 2) as *const __m256i);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(s0), dot_i8(w0, x0), acc0);
        }
        hsum(_mm256_add_ps(acc0, acc1))
    }

    /// The f16 scale at the start of a block (F16C).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale1(blk: *const u8) -> f32 {
        let h = (blk as *const i16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as u16 as i32)))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{scalar, Activation, Q5_0_BYTES, Q8_0_BYTES, QK};

    /// The weight scales of two consecutive blocks (f16 at `p` and `p + stride`), each spread
    /// over the eight lanes of its half.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    unsafe fn scales2(p: *const u8, stride: usize) -> __m512 {
        let h0 = (p as *const u16).read_unaligned() as i32;
        let h1 = (p.add(stride) as *const u16).read_unaligned() as i32;
        let w = _mm_cvtph_ps(_mm_cvtsi32_si128(h0 | (h1 << 16)));
        let lanes = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(w))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    unsafe fn hsum(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    /// Q5_0 blocks b, b+1 as 64 unsigned bytes 0..=31 (the stored value + 16).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    unsafe fn q5_0_pair(p: *const u8) -> __m512i {
        let q0 = _mm_loadu_si128(p.add(6) as *const __m128i);
        let q1 = _mm_loadu_si128(p.add(Q5_0_BYTES + 6) as *const __m128i);
        let both = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
        let z = _mm512_inserti64x4(_mm512_castsi256_si512(both), _mm256_srli_epi16(both, 4), 1);
        // [q0, q1, q0>>4, q1>>4] -> [lo0, hi0, lo1, hi1]
        let z = _mm512_shuffle_i64x2(z, z, 0b11_01_10_00);
        let nib = _mm512_and_si512(z, _mm512_set1_epi8(0x0f));
        let h0 = (p.add(2) as *const u32).read_unaligned() as u64;
        let h1 = (p.add(Q5_0_BYTES + 2) as *const u32).read_unaligned() as u64;
        // Bit i of the 64 high bits belongs to byte i: one masked add.
        _mm512_mask_add_epi8(nib, h0 | (h1 << 32), nib, _mm512_set1_epi8(0x10))
    }

    /// One row of Q5_0 (`Q5`) or Q8_0 blocks times each of `N` activations, the row's blocks
    /// unpacked once for all of them; `N = 1` is the one-token product. Per activation the
    /// arithmetic and its order do not depend on `N`, so a batch's products equal one-row ones
    /// bit for bit.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    pub(super) unsafe fn dot_rows<const N: usize, const Q5: bool>(
        row: &[u8],
        acts: &[&Activation; N],
    ) -> [f32; N] {
        let bytes = if Q5 { Q5_0_BYTES } else { Q8_0_BYTES };
        let nb = acts
            .iter()
            .fold(row.len() / bytes, |n, a| n.min(a.q8_d.len()));
        let p = row.as_ptr();
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); N];
        let mut b = 0;
        while b + 1 < nb {
            let blk = p.add(b * bytes);
            let w = if Q5 {
                q5_0_pair(blk)
            } else {
                let w0 = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let w1 = _mm256_loadu_si256(blk.add(Q8_0_BYTES + 2) as *const __m256i);
                _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), flip)
            };
            let sw = scales2(blk, bytes);
            for (acc, a) in acc.iter_mut().zip(acts) {
                let c = &a.pairs[b / 2];
                let x = _mm512_loadu_si512(a.q8_qs.as_ptr().add(b * QK) as *const __m512i);
                let off = if Q5 { &c.off5 } else { &c.off8 };
                let off = _mm512_load_si512(off.as_ptr() as *const __m512i);
                let i = _mm512_dpbusd_epi32(off, w, x);
                let s = _mm512_mul_ps(sw, _mm512_load_ps(c.dx.as_ptr()));
                *acc = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(i), *acc);
            }
            b += 2;
        }
        let mut out = [0f32; N];
        for ((o, acc), a) in out.iter_mut().zip(acc).zip(acts) {
            *o = hsum(acc);
            if b < nb {
                let (d, qs) = (&a.q8_d[b..], &a.q8_qs[b * QK..]);
                *o += if Q5 {
                    scalar::dot_q5_0(&row[b * bytes..], d, qs)
                } else {
                    scalar::dot_q8_0(&row[b * bytes..], d, qs)
                };
            }
        }
        out
    }
}

/// `Σ a_i b_i` (attention scores).
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd_level() != Simd::None {
            // SAFETY: AVX2 and FMA are present at both SIMD levels.
            return unsafe { avx2::dot_f32(a, b) };
        }
    }
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += alpha x` (attention-weighted values).
pub(crate) fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd_level() != Simd::None {
            // SAFETY: AVX2 and FMA are present at both SIMD levels.
            return unsafe { avx2::axpy(y, alpha, x) };
        }
    }
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

impl Activation {
    /// `x` quantized for every block family `mats` hold.
    fn of(x: &[f32], mats: &[&QMat]) -> Self {
        let mut act = Activation {
            q8_d: Vec::new(),
            q8_qs: Vec::new(),
            pairs: Vec::new(),
            q8k: Vec::new(),
        };
        if mats.iter().any(|m| !m.needs_q8k()) {
            quantize_q8(x, &mut act.q8_d, &mut act.q8_qs);
            act.pairs = PairConsts::build(&act.q8_d, &act.q8_qs);
        }
        if mats.iter().any(|m| m.needs_q8k()) {
            act.q8k = vec![BlockQ8K::zeros(); x.len() / BlockQ8K::BLCK_SIZE];
            BlockQ8K::from_float(x, &mut act.q8k);
        }
        act
    }
}

/// `W_i x` for every matrix of `mats` (all with `x.len()` columns), written one after another
/// into `out` (length: the sum of their rows). One parallel region for all of them.
pub(crate) fn matvec(x: &[f32], mats: &[&QMat], out: &mut [f32]) -> candle_core::Result<()> {
    let total: usize = mats.iter().map(|m| m.rows).sum();
    if out.len() != total {
        candle_core::bail!("matvec: output of {} for {total} rows", out.len());
    }
    if let Some(m) = mats.iter().find(|m| m.cols != x.len()) {
        candle_core::bail!("matvec: {} columns for an input of {}", m.cols, x.len());
    }
    let act = Activation::of(x, mats);
    // Work items: groups of four rows, numbered across the matrices in order.
    let mut starts = Vec::with_capacity(mats.len() + 1);
    let mut items = 0usize;
    for m in mats {
        starts.push(items);
        items += m.rows.div_ceil(ROWS_PER_ITEM);
    }
    starts.push(items);
    let out_ptr = out.as_mut_ptr() as usize;
    let act = &act;
    let run = |range: std::ops::Range<usize>| {
        for item in range {
            let mi = starts.partition_point(|&s| s <= item) - 1;
            let m = mats[mi];
            let r = (item - starts[mi]) * ROWS_PER_ITEM;
            let n = ROWS_PER_ITEM.min(m.rows - r);
            let row0: usize = mats[..mi].iter().map(|m| m.rows).sum::<usize>() + r;
            // SAFETY: each work item writes the disjoint rows row0..row0+n of `out`, which
            // outlives the parallel region (execute_chunked returns after every item ran).
            let dst = unsafe { std::slice::from_raw_parts_mut((out_ptr as *mut f32).add(row0), n) };
            m.rows_dot(r, n, act, dst);
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(items, run);
    Ok(())
}

/// `Y = X W^T` for a few rows of `x` (row-major, `m.cols` wide): `out` gets one row of
/// `m.rows` per input row. Each group of four weight rows is read from memory once and dotted
/// with every input row while it is in cache, where one `matvec` per row streams all the
/// weights again for each row. Every product is the one `matvec` computes, bit for bit.
pub(crate) fn matmat(x: &[f32], m: &QMat, out: &mut [f32]) -> candle_core::Result<()> {
    if m.cols == 0 || !x.len().is_multiple_of(m.cols) {
        candle_core::bail!("matmat: an input of {} for {} columns", x.len(), m.cols);
    }
    let n_x = x.len() / m.cols;
    if out.len() != n_x * m.rows {
        candle_core::bail!(
            "matmat: output of {} for {n_x} x {} rows",
            out.len(),
            m.rows
        );
    }
    let acts: Vec<Activation> = x
        .chunks_exact(m.cols)
        .map(|r| Activation::of(r, &[m]))
        .collect();
    let items = m.rows.div_ceil(ROWS_PER_ITEM);
    let out_ptr = out.as_mut_ptr() as usize;
    let (acts, rows) = (&acts, m.rows);
    let batched = m.batch_kernel();
    let run = |range: std::ops::Range<usize>| {
        let mut col = [0f32; BATCH];
        for item in range {
            let r = item * ROWS_PER_ITEM;
            let n = ROWS_PER_ITEM.min(rows - r);
            if batched {
                for i in 0..n {
                    for (c, chunk) in acts.chunks(BATCH).enumerate() {
                        m.row_times(r + i, chunk, &mut col);
                        for (k, &v) in col[..chunk.len()].iter().enumerate() {
                            let j = c * BATCH + k;
                            // SAFETY: item `item` writes rows r..r+n of each output row j,
                            // disjoint across items; `out` outlives the parallel region.
                            unsafe { *(out_ptr as *mut f32).add(j * rows + r + i) = v };
                        }
                    }
                }
                continue;
            }
            for (j, act) in acts.iter().enumerate() {
                // SAFETY: item `item` writes rows r..r+n of each output row j, disjoint across
                // items; `out` outlives the parallel region.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut((out_ptr as *mut f32).add(j * rows + r), n)
                };
                m.rows_dot(r, n, act, dst);
            }
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(items, run);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn weights(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2
            })
            .collect()
    }

    /// Each block type against the dequantized matrix times the same 8-bit activation, and
    /// the fused call against single calls.
    #[test]
    fn kernels_match_dequantized_weights() -> candle_core::Result<()> {
        let cols = 512;
        let x = weights(1, cols, 7);
        let mut d = Vec::new();
        let mut qs = Vec::new();
        quantize_q8(&x, &mut d, &mut qs);
        let xq: Vec<f32> = qs
            .iter()
            .enumerate()
            .map(|(i, &q)| q as f32 * d[i / QK])
            .collect();
        let mut mats = Vec::new();
        for (i, (dtype, rows)) in [
            (GgmlDType::Q5_0, 13usize),
            (GgmlDType::Q8_0, 8),
            (GgmlDType::Q4K, 12),
            (GgmlDType::Q6K, 7),
        ]
        .into_iter()
        .enumerate()
        {
            let w = Tensor::from_vec(
                weights(rows, cols, 11 + i as u64),
                (rows, cols),
                &Device::Cpu,
            )?;
            let q = QTensor::quantize(&w, dtype)?;
            let deq: Vec<Vec<f32>> = q.dequantize(&Device::Cpu)?.to_vec2()?;
            let m = QMat::from_qtensor(&q)?.expect("supported type");
            let mut y = vec![0f32; rows];
            matvec(&x, &[&m], &mut y)?;
            // K-quants quantize x in 256-blocks; the reference uses the exact x for those.
            let xr = if m.needs_q8k() { &x } else { &xq };
            for (r, row) in deq.iter().enumerate() {
                let want: f32 = row.iter().zip(xr).map(|(a, b)| a * b).sum();
                let tol = if m.needs_q8k() { 2e-2 } else { 1e-4 };
                assert!(
                    (y[r] - want).abs() <= tol * (1.0 + want.abs()),
                    "{dtype:?} row {r}: {} vs {want}",
                    y[r]
                );
            }
            mats.push((m, y));
        }
        // Fused: all four matrices in one call give the same numbers.
        let refs: Vec<&QMat> = mats.iter().map(|(m, _)| m).collect();
        let mut fused = vec![0f32; refs.iter().map(|m| m.rows()).sum()];
        matvec(&x, &refs, &mut fused)?;
        let single: Vec<f32> = mats.iter().flat_map(|(_, y)| y.clone()).collect();
        assert_eq!(fused, single);
        Ok(())
    }

    /// A batch of rows through `matmat` equals one `matvec` per row, bit for bit, for every
    /// block type; bad shapes are errors.
    #[test]
    fn a_batch_of_rows_equals_one_product_per_row() -> candle_core::Result<()> {
        // 11 inputs: a full group of `BATCH` and a partial one; Q5_0/Q8_0 rows of an odd
        // block count (the AVX-512 kernels take blocks in pairs, the last one alone).
        for (i, (dtype, rows, cols)) in [
            (GgmlDType::Q5_0, 13usize, 17 * QK),
            (GgmlDType::Q8_0, 9, 17 * QK),
            (GgmlDType::Q5_0, 6, 512),
            (GgmlDType::Q4K, 12, 512),
            (GgmlDType::Q6K, 7, 512),
        ]
        .into_iter()
        .enumerate()
        {
            let xs = weights(11, cols, 21);
            let w = Tensor::from_vec(
                weights(rows, cols, 31 + i as u64),
                (rows, cols),
                &Device::Cpu,
            )?;
            let m = QMat::from_qtensor(&QTensor::quantize(&w, dtype)?)?.expect("supported");
            let mut batch = vec![0f32; 11 * rows];
            matmat(&xs, &m, &mut batch)?;
            for (j, x) in xs.chunks_exact(cols).enumerate() {
                let mut one = vec![0f32; rows];
                matvec(x, &[&m], &mut one)?;
                assert_eq!(
                    &batch[j * rows..(j + 1) * rows],
                    &one[..],
                    "{dtype:?} row {j}"
                );
            }
            assert!(matmat(&xs[..cols + 1], &m, &mut batch).is_err());
            assert!(matmat(&xs, &m, &mut batch[1..]).is_err());
        }
        Ok(())
    }

    /// Every SIMD level this CPU has against the scalar kernels, on rows with an odd block
    /// count (the AVX-512 kernels take blocks in pairs).
    #[test]
    fn scalar_and_simd_agree() {
        let cols = 7 * QK;
        let x = weights(1, cols, 3);
        let mut a = Activation {
            q8_d: Vec::new(),
            q8_qs: Vec::new(),
            pairs: Vec::new(),
            q8k: Vec::new(),
        };
        quantize_q8(&x, &mut a.q8_d, &mut a.q8_qs);
        a.pairs = PairConsts::build(&a.q8_d, &a.q8_qs);
        for dtype in [GgmlDType::Q5_0, GgmlDType::Q8_0] {
            let w = Tensor::from_vec(weights(1, cols, 5), (1, cols), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, dtype).unwrap();
            let m = QMat::from_qtensor(&q).unwrap().unwrap();
            let (Blocks::Q5_0(row) | Blocks::Q8_0(row)) = &m.blocks else {
                unreachable!()
            };
            let q5 = dtype == GgmlDType::Q5_0;
            let want = if q5 {
                scalar::dot_q5_0(row, &a.q8_d, &a.q8_qs)
            } else {
                scalar::dot_q8_0(row, &a.q8_d, &a.q8_qs)
            };
            let mut got = vec![("dispatched", dot(q5, row, &a))];
            #[cfg(target_arch = "x86_64")]
            {
                let level = simd_level();
                if level != Simd::None {
                    // SAFETY: AVX2/FMA/F16C are present at both SIMD levels.
                    let v = unsafe {
                        if q5 {
                            avx2::dot_q5_0(row, &a.q8_d, &a.q8_qs)
                        } else {
                            avx2::dot_q8_0(row, &a.q8_d, &a.q8_qs)
                        }
                    };
                    got.push(("avx2", v));
                }
                if level == Simd::Avx512 {
                    // SAFETY: detected above.
                    let v = unsafe {
                        if q5 {
                            avx512::dot_rows::<1, true>(row, &[&a])[0]
                        } else {
                            avx512::dot_rows::<1, false>(row, &[&a])[0]
                        }
                    };
                    got.push(("avx512", v));
                }
            }
            for (name, v) in got {
                assert!(
                    (v - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{dtype:?} {name}: {v} vs scalar {want}"
                );
            }
        }
    }

    #[test]
    fn half_conversion() {
        for (h, v) in [
            (0x0000u16, 0.0f32),
            (0x3c00, 1.0),
            (0xc100, -2.5),
            (0x0400, 6.1035156e-5),
            (0x0001, 5.9604645e-8),
            (0x0200, 3.0517578e-5),
            (0x7bff, 65504.0),
        ] {
            assert_eq!(f16_at(&h.to_le_bytes(), 0), v, "{h:#06x}");
        }
        assert!(f16_at(&0x7c00u16.to_le_bytes(), 0).is_infinite());
    }
}
