//! Direct NHWC convolution kernels for the lung U-Net, whose layers have 1-64 channels: too few
//! for a packed gemm to pay off. Every convolution is a list of taps (float offsets from a
//! window origin) over a zero-bordered input, so padding costs nothing. Output channels sit in
//! vector lanes (16 per AVX-512 register), several output pixels share each weight load, and
//! the epilogue (bias, activation, residual, affine, squeeze-excitation sums) runs on the
//! accumulators before they are stored. A portable scalar version serves other CPUs.

use crate::exp_approx;
use crate::settings::unet_isa;
use crate::IsaCap;

/// Activation applied in an epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Act {
    None,
    /// `x * sigmoid(x)`.
    Swish,
    Sigmoid,
}

impl Act {
    #[inline(always)]
    pub(super) fn scalar(self, x: f32) -> f32 {
        match self {
            Act::None => x,
            Act::Swish => x / (1.0 + exp_approx(-x)),
            Act::Sigmoid => 1.0 / (1.0 + exp_approx(-x)),
        }
    }
}

/// Output channels rounded up to whole 16-lane vectors (weights and epilogue vectors are
/// zero-padded to this width).
pub(super) fn cpad(c: usize) -> usize {
    c.div_ceil(16) * 16
}

/// Element `(y, x)` of a pixel grid inside a buffer: `org + y * ys + x * xs` floats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Grid {
    pub org: usize,
    pub ys: usize,
    pub xs: usize,
}

impl Grid {
    pub(super) fn at(self, y: usize, x: usize) -> usize {
        self.org + y * self.ys + x * self.xs
    }
}

/// Per-channel epilogue, vectors `cpad(cout)` long: `act(acc + bias)`, then `+ residual`,
/// `* scale + shift`, `post_act`.
#[derive(Clone, Debug)]
pub(super) struct Epi {
    pub bias: Vec<f32>,
    pub act: Act,
    pub post: Option<(Vec<f32>, Vec<f32>)>,
    pub post_act: Act,
}

/// One output row of a direct convolution.
pub(super) struct Row<'a> {
    /// Window origin of the row's first output pixel.
    pub src: *const f32,
    /// Floats between the window origins of neighbouring output pixels.
    pub in_xs: usize,
    /// Float offsets of the taps from the window origin; tap `t` uses weights `t`.
    pub taps: &'a [usize],
    pub cin: usize,
    /// `[tap][cin][cpad(cout)]`.
    pub w: *const f32,
    pub cout: usize,
    pub dst: *mut f32,
    pub out_xs: usize,
    /// Residual pixel of the first output (null: none), `res_xs` apart.
    pub res: *const f32,
    pub res_xs: usize,
    pub epi: &'a Epi,
    /// Channel sums of the stored outputs are added here (null: none), `cpad(cout)` floats.
    pub sums: *mut f32,
    pub width: usize,
}

/// Whether this CPU runs the AVX-512 kernels (the shared kernels' detection, under the
/// configured [`IsaCap`]).
pub(super) fn has_avx512() -> bool {
    unet_isa() >= IsaCap::Best && crate::has_avx512()
}

/// Whether this CPU runs the AVX2 kernels (under the configured [`IsaCap`]).
pub(super) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // The CPU's answer is cached; the cap is read each time, as it may be configured
        // after the first call.
        static V3: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        unet_isa() >= IsaCap::Avx2
            && *V3
                .get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Computes one output row.
///
/// # Safety
/// Every pointer must cover what the row reads or writes: the plan checks this when built.
pub(super) unsafe fn conv_row(r: &Row) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        match cpad(r.cout) / 16 {
            1 => return v4::row::<8, 1>(r),
            2 => return v4::row::<8, 2>(r),
            3 => return v4::row::<6, 3>(r),
            4 => return v4::row::<4, 4>(r),
            _ => {}
        }
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && row_v3(r) {
        return;
    }
    row_portable(r)
}

/// The AVX2 row kernel, when it covers `r.cout` (a multiple of 8, at most 64).
///
/// # Safety
/// As for [`conv_row`], on a CPU with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
unsafe fn row_v3(r: &Row) -> bool {
    if !r.cout.is_multiple_of(8) {
        return false;
    }
    match r.cout / 8 {
        1 => v3::row::<8, 1>(r),
        2 => v3::row::<6, 2>(r),
        3 => v3::row::<4, 3>(r),
        4 => v3::row::<3, 4>(r),
        5 => v3::row::<2, 5>(r),
        6 => v3::row::<2, 6>(r),
        7 => v3::row::<1, 7>(r),
        8 => v3::row::<1, 8>(r),
        _ => return false,
    }
    true
}

unsafe fn row_portable(r: &Row) {
    let cp = cpad(r.cout);
    let mut acc = vec![0f32; cp];
    let mut sums = vec![0f32; cp];
    for x in 0..r.width {
        acc.fill(0.0);
        for (t, &off) in r.taps.iter().enumerate() {
            let ip = r.src.add(x * r.in_xs + off);
            let wt = r.w.add(t * r.cin * cp);
            for ci in 0..r.cin {
                let v = *ip.add(ci);
                let w = std::slice::from_raw_parts(wt.add(ci * cp), r.cout);
                acc.iter_mut().zip(w).for_each(|(a, &w)| *a += v * w);
            }
        }
        for co in 0..r.cout {
            let mut y = r.epi.act.scalar(acc[co] + r.epi.bias[co]);
            if !r.res.is_null() {
                y += *r.res.add(x * r.res_xs + co);
            }
            if let Some((s, t)) = &r.epi.post {
                y = y * s[co] + t[co];
            }
            y = r.epi.post_act.scalar(y);
            *r.dst.add(x * r.out_xs + co) = y;
            sums[co] += y;
        }
    }
    if !r.sums.is_null() {
        for (co, s) in sums.iter().enumerate().take(r.cout) {
            *r.sums.add(co) += s;
        }
    }
}

/// One output row of a 3x3 (or any-tap) convolution to a single channel + sigmoid, written
/// contiguously (the U-Net head).
pub(super) struct HeadRow<'a> {
    pub src: *const f32,
    pub in_xs: usize,
    pub taps: &'a [usize],
    pub cin: usize,
    /// `[tap][cin]`.
    pub w: &'a [f32],
    pub bias: f32,
    pub dst: *mut f32,
    pub width: usize,
}

/// # Safety
/// As for [`conv_row`].
pub(super) unsafe fn head_row(h: &HeadRow) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() && h.cin.is_multiple_of(8) {
        let full = h.width / 16 * 16;
        v4::head16(h, full);
        return head_portable(h, full);
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && h.cin.is_multiple_of(8) {
        let full = h.width / 8 * 8;
        v3::head8(h, full);
        return head_portable(h, full);
    }
    head_portable(h, 0)
}

unsafe fn head_portable(h: &HeadRow, from: usize) {
    for x in from..h.width {
        let mut acc = h.bias;
        for (t, &off) in h.taps.iter().enumerate() {
            let ip = h.src.add(x * h.in_xs + off);
            for ci in 0..h.cin {
                acc += *ip.add(ci) * h.w[t * h.cin + ci];
            }
        }
        *h.dst.add(x) = Act::Sigmoid.scalar(acc);
    }
}

/// 2x2 stride-2 max pool of one output row: `a`, `b` are the two input rows (pixels `c` apart).
///
/// # Safety
/// `a`, `b` hold `2 * width` pixels and `dst` `width` pixels of `c` floats.
pub(super) unsafe fn maxpool_row(
    a: *const f32,
    b: *const f32,
    dst: *mut f32,
    c: usize,
    width: usize,
) {
    let a = std::slice::from_raw_parts(a, 2 * width * c);
    let b = std::slice::from_raw_parts(b, 2 * width * c);
    let d = std::slice::from_raw_parts_mut(dst, width * c);
    for x in 0..width {
        let (a0, a1) = (&a[2 * x * c..][..c], &a[(2 * x + 1) * c..][..c]);
        let (b0, b1) = (&b[2 * x * c..][..c], &b[(2 * x + 1) * c..][..c]);
        for (i, o) in d[x * c..(x + 1) * c].iter_mut().enumerate() {
            *o = a0[i].max(a1[i]).max(b0[i].max(b1[i]));
        }
    }
}

/// Squeeze-excitation gate from channel means: 1x1 conv + swish, 1x1 conv + sigmoid. Weights
/// `(c, c_se)` and `(c_se, c)` row-major.
pub(super) fn se_gate(
    mean: &[f32],
    reduce: &(Vec<f32>, Option<Vec<f32>>),
    expand: &(Vec<f32>, Option<Vec<f32>>),
    gate: &mut [f32],
) {
    let c = mean.len();
    let c_se = reduce.0.len() / c.max(1);
    let hidden: Vec<f32> = (0..c_se)
        .map(|j| {
            let z = reduce.1.as_ref().map_or(0.0, |b| b[j])
                + mean
                    .iter()
                    .enumerate()
                    .map(|(i, m)| m * reduce.0[i * c_se + j])
                    .sum::<f32>();
            Act::Swish.scalar(z)
        })
        .collect();
    for (o, g) in gate.iter_mut().enumerate().take(c) {
        let z = expand.1.as_ref().map_or(0.0, |b| b[o])
            + hidden
                .iter()
                .enumerate()
                .map(|(j, h)| h * expand.0[j * c + o])
                .sum::<f32>();
        *g = Act::Sigmoid.scalar(z);
    }
}

#[cfg(target_arch = "x86_64")]
mod v4 {
    use super::{cpad, Act, HeadRow, Row};
    use std::arch::x86_64::*;

    /// `exp` as [`crate::exp_approx`]: the same range reduction and polynomial, with
    /// `scalef` for the power of two.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
    fn exp(x: __m512) -> __m512 {
        let x = _mm512_max_ps(
            _mm512_min_ps(x, _mm512_set1_ps(88.0)),
            _mm512_set1_ps(-87.0),
        );
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
    fn act(a: Act, v: __m512) -> __m512 {
        let one = _mm512_set1_ps(1.0);
        match a {
            Act::None => v,
            Act::Swish => _mm512_div_ps(
                v,
                _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), v))),
            ),
            Act::Sigmoid => _mm512_div_ps(
                one,
                _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), v))),
            ),
        }
    }

    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
    pub(super) unsafe fn row<const N: usize, const CV: usize>(r: &Row) {
        let mut sums = [_mm512_setzero_ps(); CV];
        let mut x = 0;
        while x + N <= r.width {
            block::<N, CV>(r, x, &mut sums);
            x += N;
        }
        while x < r.width {
            block::<1, CV>(r, x, &mut sums);
            x += 1;
        }
        if !r.sums.is_null() {
            for (v, s) in sums.iter().enumerate() {
                let p = r.sums.add(v * 16);
                _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), *s));
            }
        }
    }

    /// `N` output pixels from `x`: `N * CV` accumulators, `CV` weight vectors per input value.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
    unsafe fn block<const N: usize, const CV: usize>(r: &Row, x: usize, sums: &mut [__m512; CV]) {
        let cp = cpad(r.cout);
        let mut acc = [[_mm512_setzero_ps(); CV]; N];
        for (t, &off) in r.taps.iter().enumerate() {
            let wt = r.w.add(t * r.cin * cp);
            let ip = r.src.add(x * r.in_xs + off);
            for ci in 0..r.cin {
                let mut wv = [_mm512_setzero_ps(); CV];
                for (v, w) in wv.iter_mut().enumerate() {
                    *w = _mm512_loadu_ps(wt.add(ci * cp + v * 16));
                }
                for (n, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(*ip.add(n * r.in_xs + ci));
                    for v in 0..CV {
                        a[v] = _mm512_fmadd_ps(b, wv[v], a[v]);
                    }
                }
            }
        }
        let e = r.epi;
        for (n, a) in acc.iter().enumerate() {
            for v in 0..CV {
                let lanes = (r.cout - v * 16).min(16);
                let m: __mmask16 = if lanes == 16 {
                    0xffff
                } else {
                    (1u16 << lanes) - 1
                };
                let mut y = act(
                    e.act,
                    _mm512_add_ps(a[v], _mm512_loadu_ps(e.bias.as_ptr().add(v * 16))),
                );
                if !r.res.is_null() {
                    y = _mm512_add_ps(
                        y,
                        _mm512_maskz_loadu_ps(m, r.res.add((x + n) * r.res_xs + v * 16)),
                    );
                }
                if let Some((s, t)) = &e.post {
                    y = _mm512_fmadd_ps(
                        y,
                        _mm512_loadu_ps(s.as_ptr().add(v * 16)),
                        _mm512_loadu_ps(t.as_ptr().add(v * 16)),
                    );
                }
                y = act(e.post_act, y);
                _mm512_mask_storeu_ps(r.dst.add((x + n) * r.out_xs + v * 16), m, y);
                sums[v] = _mm512_add_ps(sums[v], y);
            }
        }
    }

    /// Head pixels `0..full` (a multiple of 16), input channels a multiple of 8.
    #[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
    pub(super) unsafe fn head16(h: &HeadRow, full: usize) {
        let bias = _mm512_set1_ps(h.bias);
        let mut x = 0;
        while x < full {
            let mut halves = [_mm256_setzero_ps(); 2];
            if h.cin == 8 && h.in_xs == 8 {
                // Two neighbouring pixels' 8 channels fill one 16-lane load.
                for (half, out) in halves.iter_mut().enumerate() {
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for (t, &off) in h.taps.iter().enumerate() {
                        let w8 = _mm256_loadu_ps(h.w.as_ptr().add(t * 8));
                        let w = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(w8), w8);
                        let ip = h.src.add((x + half * 8) * 8 + off);
                        for (n, a) in acc.iter_mut().enumerate() {
                            *a = _mm512_fmadd_ps(_mm512_loadu_ps(ip.add(n * 16)), w, *a);
                        }
                    }
                    let mut px = [_mm256_setzero_ps(); 8];
                    for (n, a) in acc.iter().enumerate() {
                        px[2 * n] = _mm512_castps512_ps256(*a);
                        px[2 * n + 1] = _mm512_extractf32x8_ps::<1>(*a);
                    }
                    *out = super::v3::hsum8(&px);
                }
                let v = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(halves[0]), halves[1]);
                _mm512_storeu_ps(h.dst.add(x), act(Act::Sigmoid, _mm512_add_ps(v, bias)));
                x += 16;
                continue;
            }
            for (half, out) in halves.iter_mut().enumerate() {
                let mut acc = [_mm256_setzero_ps(); 8];
                for (t, &off) in h.taps.iter().enumerate() {
                    for c8 in (0..h.cin).step_by(8) {
                        let w = _mm256_loadu_ps(h.w.as_ptr().add(t * h.cin + c8));
                        let ip = h.src.add((x + half * 8) * h.in_xs + off + c8);
                        for (n, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(_mm256_loadu_ps(ip.add(n * h.in_xs)), w, *a);
                        }
                    }
                }
                *out = super::v3::hsum8(&acc);
            }
            let v = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(halves[0]), halves[1]);
            _mm512_storeu_ps(h.dst.add(x), act(Act::Sigmoid, _mm512_add_ps(v, bias)));
            x += 16;
        }
    }
}

/// The same kernels on 8-lane AVX2 vectors, for CPUs without AVX-512: output channels a
/// multiple of 8, so no masking.
#[cfg(target_arch = "x86_64")]
mod v3 {
    use super::{cpad, Act, HeadRow, Row};
    use std::arch::x86_64::*;

    /// `exp` as [`crate::exp_approx`], the power of two built in the exponent bits.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(
            _mm256_min_ps(x, _mm256_set1_ps(88.0)),
            _mm256_set1_ps(-87.0),
        );
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        // n is in [-126, 127] after the clamp: a normal power of two.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn act(a: Act, v: __m256) -> __m256 {
        let one = _mm256_set1_ps(1.0);
        let e = || exp(_mm256_sub_ps(_mm256_setzero_ps(), v));
        match a {
            Act::None => v,
            Act::Swish => _mm256_div_ps(v, _mm256_add_ps(one, e())),
            Act::Sigmoid => _mm256_div_ps(one, _mm256_add_ps(one, e())),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn row<const N: usize, const CV: usize>(r: &Row) {
        let mut sums = [_mm256_setzero_ps(); CV];
        let mut x = 0;
        while x + N <= r.width {
            block::<N, CV>(r, x, &mut sums);
            x += N;
        }
        while x < r.width {
            block::<1, CV>(r, x, &mut sums);
            x += 1;
        }
        if !r.sums.is_null() {
            for (v, s) in sums.iter().enumerate() {
                let p = r.sums.add(v * 8);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), *s));
            }
        }
    }

    /// Eight 8-lane dot-product accumulators to their eight sums.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn hsum8(a: &[__m256; 8]) -> __m256 {
        let h01 = _mm256_hadd_ps(a[0], a[1]);
        let h23 = _mm256_hadd_ps(a[2], a[3]);
        let h45 = _mm256_hadd_ps(a[4], a[5]);
        let h67 = _mm256_hadd_ps(a[6], a[7]);
        let lo = _mm256_hadd_ps(h01, h23);
        let hi = _mm256_hadd_ps(h45, h67);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(lo, hi),
            _mm256_permute2f128_ps::<0x31>(lo, hi),
        )
    }

    /// Head pixels `0..full` (a multiple of 8), input channels a multiple of 8.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn head8(h: &HeadRow, full: usize) {
        let bias = _mm256_set1_ps(h.bias);
        let mut x = 0;
        while x < full {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (t, &off) in h.taps.iter().enumerate() {
                for c8 in (0..h.cin).step_by(8) {
                    let w = _mm256_loadu_ps(h.w.as_ptr().add(t * h.cin + c8));
                    let ip = h.src.add(x * h.in_xs + off + c8);
                    for (n, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(ip.add(n * h.in_xs)), w, *a);
                    }
                }
            }
            let v = _mm256_add_ps(hsum8(&acc), bias);
            _mm256_storeu_ps(h.dst.add(x), act(Act::Sigmoid, v));
            x += 8;
        }
    }

    /// `N` output pixels from `x`, `CV = cout / 8` vectors each.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<const N: usize, const CV: usize>(r: &Row, x: usize, sums: &mut [__m256; CV]) {
        let cp = cpad(r.cout);
        let mut acc = [[_mm256_setzero_ps(); CV]; N];
        for (t, &off) in r.taps.iter().enumerate() {
            let wt = r.w.add(t * r.cin * cp);
            let ip = r.src.add(x * r.in_xs + off);
            for ci in 0..r.cin {
                let mut wv = [_mm256_setzero_ps(); CV];
                for (v, w) in wv.iter_mut().enumerate() {
                    *w = _mm256_loadu_ps(wt.add(ci * cp + v * 8));
                }
                for (n, a) in acc.iter_mut().enumerate() {
                    let b = _mm256_broadcast_ss(&*ip.add(n * r.in_xs + ci));
                    for v in 0..CV {
                        a[v] = _mm256_fmadd_ps(b, wv[v], a[v]);
                    }
                }
            }
        }
        let e = r.epi;
        for (n, a) in acc.iter().enumerate() {
            for v in 0..CV {
                let mut y = act(
                    e.act,
                    _mm256_add_ps(a[v], _mm256_loadu_ps(e.bias.as_ptr().add(v * 8))),
                );
                if !r.res.is_null() {
                    y = _mm256_add_ps(y, _mm256_loadu_ps(r.res.add((x + n) * r.res_xs + v * 8)));
                }
                if let Some((s, t)) = &e.post {
                    y = _mm256_fmadd_ps(
                        y,
                        _mm256_loadu_ps(s.as_ptr().add(v * 8)),
                        _mm256_loadu_ps(t.as_ptr().add(v * 8)),
                    );
                }
                y = act(e.post_act, y);
                _mm256_storeu_ps(r.dst.add((x + n) * r.out_xs + v * 8), y);
                sums[v] = _mm256_add_ps(sums[v], y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    #[derive(Clone, Copy)]
    enum Path {
        Best,
        Portable,
        Avx2,
    }

    /// The vector row kernels this CPU has against the scalar one, for every vector count,
    /// with all epilogue parts on and a width that leaves a remainder.
    #[test]
    fn vector_rows_match_scalar_rows() {
        let mut seed = 7;
        for cout in [1, 8, 16, 24, 32, 40, 48, 64] {
            let (cin, width, xs) = (5, 11, 7);
            let taps = [0, 3, 40];
            let cp = cpad(cout);
            let src: Vec<f32> = (0..width * xs + 60).map(|_| lcg(&mut seed)).collect();
            let mut w: Vec<f32> = (0..taps.len() * cin * cp).map(|_| lcg(&mut seed)).collect();
            let res: Vec<f32> = (0..width * cp).map(|_| lcg(&mut seed)).collect();
            let mut epi = Epi {
                bias: (0..cp).map(|_| lcg(&mut seed)).collect(),
                act: Act::Swish,
                post: Some((
                    (0..cp).map(|_| lcg(&mut seed)).collect(),
                    (0..cp).map(|_| lcg(&mut seed)).collect(),
                )),
                post_act: Act::Sigmoid,
            };
            // Padded weight and epilogue lanes are zero, as the plan builds them.
            for t in 0..taps.len() * cin {
                w[t * cp + cout..(t + 1) * cp].fill(0.0);
            }
            epi.bias[cout..].fill(0.0);
            let run = |path: Path| {
                let mut out = vec![0f32; width * cp + 3];
                let mut sums = vec![0f32; cp];
                let r = Row {
                    src: src.as_ptr(),
                    in_xs: xs,
                    taps: &taps,
                    cin,
                    w: w.as_ptr(),
                    cout,
                    dst: out.as_mut_ptr(),
                    out_xs: cp,
                    res: res.as_ptr(),
                    res_xs: cp,
                    epi: &epi,
                    sums: sums.as_mut_ptr(),
                    width,
                };
                // SAFETY: the buffers above cover the row.
                unsafe {
                    match path {
                        Path::Best => conv_row(&r),
                        Path::Portable => row_portable(&r),
                        #[cfg(target_arch = "x86_64")]
                        Path::Avx2 => assert!(row_v3(&r)),
                        #[cfg(not(target_arch = "x86_64"))]
                        Path::Avx2 => unreachable!(),
                    }
                }
                (out, sums)
            };
            let (a, sa) = run(Path::Best);
            let (b, sb) = run(Path::Portable);
            let avx2 = (has_avx2() && cout % 8 == 0).then(|| run(Path::Avx2));
            for x in 0..width {
                for c in 0..cp {
                    let (va, vb) = (a[x * cp + c], b[x * cp + c]);
                    if c < cout {
                        assert!(
                            (va - vb).abs() < 1e-5,
                            "cout {cout} x {x} c {c}: {va} vs {vb}"
                        );
                    } else {
                        assert_eq!(va, 0.0, "cout {cout}: lane {c} written");
                    }
                }
            }
            for c in 0..cout {
                assert!((sa[c] - sb[c]).abs() < 1e-4, "cout {cout} sum {c}");
            }
            if let Some((v3, s3)) = avx2 {
                for x in 0..width {
                    for c in 0..cp {
                        let (va, vb) = (v3[x * cp + c], b[x * cp + c]);
                        assert!((va - vb).abs() < 1e-5, "avx2 cout {cout} x {x} c {c}");
                    }
                }
                for c in 0..cout {
                    assert!((s3[c] - sb[c]).abs() < 1e-4, "avx2 cout {cout} sum {c}");
                }
            }
        }
    }

    #[test]
    fn vector_head_matches_scalar_head() {
        for cin in [8, 16] {
            head_case(cin);
        }
    }

    /// Input channels 8 take the paired-pixel path of the AVX-512 head.
    fn head_case(cin: usize) {
        let mut seed = 3;
        let width = 37;
        let taps = [0, 16, 640];
        let src: Vec<f32> = (0..width * cin + 700).map(|_| lcg(&mut seed)).collect();
        let w: Vec<f32> = (0..taps.len() * cin).map(|_| lcg(&mut seed)).collect();
        let run = |vector: bool| {
            let mut out = vec![0f32; width];
            let h = HeadRow {
                src: src.as_ptr(),
                in_xs: cin,
                taps: &taps,
                cin,
                w: &w,
                bias: 0.3,
                dst: out.as_mut_ptr(),
                width,
            };
            // SAFETY: the buffers above cover the row.
            unsafe {
                if vector {
                    head_row(&h)
                } else {
                    head_portable(&h, 0)
                }
            }
            out
        };
        let (a, b) = (run(true), run(false));
        for x in 0..width {
            assert!((a[x] - b[x]).abs() < 1e-6, "x {x}: {} vs {}", a[x], b[x]);
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            let mut c = vec![0f32; width];
            let h = HeadRow {
                src: src.as_ptr(),
                in_xs: cin,
                taps: &taps,
                cin,
                w: &w,
                bias: 0.3,
                dst: c.as_mut_ptr(),
                width,
            };
            // SAFETY: as above.
            unsafe {
                v3::head8(&h, width / 8 * 8);
                head_portable(&h, width / 8 * 8);
            }
            for x in 0..width {
                assert!(
                    (c[x] - b[x]).abs() < 1e-6,
                    "avx2 x {x}: {} vs {}",
                    c[x],
                    b[x]
                );
            }
        }
    }
}
