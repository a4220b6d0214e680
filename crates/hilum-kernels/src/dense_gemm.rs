//! Convolutions as a gemm against weights packed once at load, with an AVX-512 register-tiled
//! kernel (`MR` pixels x `NR` output channels per call). Compared with calling the `gemm` crate
//! per tile, nothing is repacked per call (the weights were a large share of the small layers'
//! time at batch 1), a kxk conv without pre-activation reads its input through per-pixel row
//! pointers (no im2col copy, padding points at zeros), and bias, ReLU and a residual add are
//! applied to the accumulators before the last store.

#[cfg(target_arch = "x86_64")]
use super::{gather, share, Scratch, Shared};
use super::{Act, ConvOp};

/// Output channels per packed panel (two 16-float registers).
pub(crate) const NR: usize = 32;
/// Pixels per kernel call.
const MR: usize = 12;
/// Largest input channel count read through row pointers (the zero row covers it).
const MAX_DIRECT_C: usize = 2048;
static ZEROS: [f32; MAX_DIRECT_C] = [0.0; MAX_DIRECT_C];

/// Weights (kdim, n) regrouped as panels of `NR` columns, each (kdim, NR) row-major and
/// zero-padded, plus the bias padded the same way.
#[derive(Clone, Debug)]
pub(crate) struct Packed {
    data: Vec<f32>,
    /// First float of panel 0 (chosen so panels start 64-byte aligned when packed).
    off: usize,
    bias: Vec<f32>,
    kdim: usize,
    panels: usize,
}

impl Packed {
    pub fn new(weight: &[f32], bias: Option<&[f32]>, kdim: usize, n: usize) -> Self {
        let panels = n.div_ceil(NR);
        let mut data = vec![0f32; panels * kdim * NR + 16];
        let off = data.as_ptr().align_offset(64).min(15);
        for p in 0..panels {
            for r in 0..kdim {
                let row = &mut data[off + (p * kdim + r) * NR..][..NR];
                for (j, d) in row.iter_mut().enumerate() {
                    let col = p * NR + j;
                    if col < n {
                        *d = weight[r * n + col];
                    }
                }
            }
        }
        let mut b = vec![0f32; panels * NR];
        if let Some(bias) = bias {
            b[..n].copy_from_slice(&bias[..n]);
        }
        Packed {
            data,
            off,
            bias: b,
            kdim,
            panels,
        }
    }

    fn panel(&self, p: usize) -> *const f32 {
        self.data[self.off + p * self.kdim * NR..].as_ptr()
    }
}

/// Whether `c` can take the packed path: its epilogue is at most bias, ReLU, a residual add
/// and ReLU.
pub(crate) fn packable(c: &ConvOp) -> bool {
    c.gate.is_none()
        && c.post.is_none()
        && !c.se_sums
        && matches!(c.act, Act::None | Act::Relu)
        && matches!(c.post_act, Act::None | Act::Relu)
        // Passes before the last store partial sums into dst.
        && c.residual.is_none_or(|r| r.buf != c.dst.buf)
}

/// Whether the input is read in place through row pointers (else gathered into a tile).
fn indirect(c: &ConvOp) -> bool {
    c.k <= 3 && c.pre.is_none() && !c.pool2 && c.src.c >= 8 && c.src.c <= MAX_DIRECT_C
}

/// Pixels per gathered tile: about 256 KiB of floats, a multiple of `MR`, at most `CHUNK * 9`
/// row blocks (the row pointer array).
fn tile_rows(c: &ConvOp) -> usize {
    ((super::tile_floats() / c.kdim()) / MR).clamp(1, CHUNK * 9) * MR
}

/// Floats from one gathered row to the next: an odd multiple of 16 (64 bytes), so the
/// kernel's rows do not all map to the same L1 sets (rows 4 KiB apart would thrash them).
fn tile_ld(c: &ConvOp) -> usize {
    let ld = c.kdim().div_ceil(16) * 16;
    if (ld / 16).is_multiple_of(2) {
        ld + 16
    } else {
        ld
    }
}

/// Floats of per-thread tile the packed path needs for `c`.
pub(crate) fn tile_len(c: &ConvOp) -> usize {
    if indirect(c) {
        0
    } else {
        tile_rows(c) * tile_ld(c)
    }
}

/// `[lo, hi)` of `n` rows for thread `t` of `nt`, cut at multiples of `MR`.
fn share_rows(n: usize, t: usize, nt: usize) -> (usize, usize) {
    let cut = |i: usize| {
        if i == nt {
            n
        } else {
            ((n * i / nt + MR / 2) / MR * MR).min(n)
        }
    };
    (cut(t), cut(t + 1))
}

/// Floats of the reduction per kernel pass: a (KC, NR) block of weights (32 KiB) stays in L1
/// while it meets every row of a chunk.
const KC: usize = 256;
/// Row blocks per chunk of pixels read through row pointers.
const CHUNK: usize = 16;

/// One pass over part of the reduction: taps `tap0..tap0 + taps`, floats `koff..koff + kc` of
/// each.
#[derive(Clone, Copy)]
struct KBlock {
    tap0: usize,
    taps: usize,
    koff: usize,
    kc: usize,
}

/// The reduction over `taps` taps of `kt` floats each, cut into passes of about `KC` floats.
fn k_blocks(taps: usize, kt: usize) -> Vec<KBlock> {
    let mut v = Vec::new();
    if kt <= KC {
        let per = (KC / kt).max(1);
        let mut t = 0;
        while t < taps {
            let n = per.min(taps - t);
            v.push(KBlock {
                tap0: t,
                taps: n,
                koff: 0,
                kc: kt,
            });
            t += n;
        }
    } else {
        let pieces = kt.div_ceil(KC);
        for t in 0..taps {
            for i in 0..pieces {
                let (k0, k1) = (kt * i / pieces, kt * (i + 1) / pieces);
                v.push(KBlock {
                    tap0: t,
                    taps: 1,
                    koff: k0,
                    kc: k1 - k0,
                });
            }
        }
    }
    v
}

#[cfg(target_arch = "x86_64")]
pub(crate) fn conv_part(
    c: &ConvOp,
    pk: &Packed,
    batch: usize,
    t: usize,
    nt: usize,
    sh: &Shared,
    scratch: &mut Scratch,
) {
    let rows = batch * c.dst.h * c.dst.w;
    // Rows per thread when there are enough of them, else output panels.
    let ((r0, r1), (p0, p1)) = if rows >= nt * 4 * MR || pk.panels < nt {
        (share_rows(rows, t, nt), (0, pk.panels))
    } else {
        ((0, rows), share(pk.panels, t, nt))
    };
    if r0 >= r1 || p0 >= p1 {
        return;
    }
    let relu = c.act == Act::Relu;
    let post_relu = c.residual.is_some() && c.post_act == Act::Relu;
    let n = c.c_out();
    let ind = indirect(c);
    let (taps, kt) = if ind {
        (c.k * c.k, c.src.c)
    } else {
        (1, c.kdim())
    };
    let blocks = k_blocks(taps, kt);
    let chunk = if ind { CHUNK * MR } else { tile_rows(c) };
    let mut ptrs = [ZEROS.as_ptr(); CHUNK * 9 * MR];
    // SAFETY: views were checked against their buffers when the plan was built; this thread
    // writes rows r0..r1, panels p0..p1 of dst only; the src was completed before the barrier.
    unsafe {
        let src = sh.bufs[c.src.buf] as *const f32;
        let dst = sh.bufs[c.dst.buf];
        let res_at = |r: usize, p: usize| match &c.residual {
            Some(v) => (sh.bufs[v.buf] as *const f32).add(r * v.pitch + v.ch_off + p * NR),
            None => std::ptr::null(),
        };
        let mut g0 = r0;
        while g0 < r1 {
            let g1 = (g0 + chunk).min(r1);
            // Row pointers of every row block of the chunk: [block][tap][row].
            if ind {
                row_pointers(c, g0, g1, src, &mut ptrs);
            } else {
                let ld = tile_ld(c);
                let tile = &mut scratch.tile[..(g1 - g0) * ld];
                if c.src.c == 1 && c.pre.is_none() && !c.pool2 && !c.up2 {
                    gather_c1(c, g0, g1, src, tile, ld);
                } else {
                    gather(c, g0, g1, src, sh.lens[c.src.buf], tile, ld);
                }
                let tile = scratch.tile.as_ptr();
                for (i, q) in ptrs.iter_mut().take(g1 - g0).enumerate() {
                    *q = tile.add(i * ld);
                }
            }
            let stride = if ind { taps * MR } else { MR };
            let b_at = |p: usize, kb: &KBlock| pk.panel(p).add((kb.tap0 * kt + kb.koff) * NR);
            for (bi, kb) in blocks.iter().enumerate() {
                let (first, last) = (bi == 0, bi + 1 == blocks.len());
                for p in p0..p1 {
                    let cols = (n - p * NR).min(NR);
                    let b = b_at(p, kb);
                    // The next weight block is fetched into L2 while this one runs, a slice
                    // per row block (small layers meet each block a few times only, and it
                    // comes from memory).
                    let (next, next_rows) = if p + 1 < p1 {
                        (b_at(p + 1, kb), kb.taps * kb.kc)
                    } else if let Some(nb) = blocks.get(bi + 1) {
                        (b_at(p0, nb), nb.taps * nb.kc)
                    } else if g1 < r1 {
                        (b_at(p0, &blocks[0]), blocks[0].taps * blocks[0].kc)
                    } else {
                        (std::ptr::null(), 0)
                    };
                    let row_blocks = (g1 - g0).div_ceil(MR);
                    let mut m0 = g0;
                    while m0 < g1 {
                        let m = (g1 - m0).min(MR);
                        let blk = (m0 - g0) / MR;
                        let (pf0, pf1) = share(next_rows, blk, row_blocks);
                        let a = &ptrs[blk * stride + kb.tap0 * MR..];
                        let call = Call {
                            a,
                            taps: kb.taps,
                            koff: kb.koff,
                            kc: kb.kc,
                            b,
                            bias: pk.bias[p * NR..].as_ptr(),
                            c: dst.add(m0 * c.dst.pitch + c.dst.ch_off + p * NR),
                            ldc: c.dst.pitch,
                            cols,
                            first,
                            last,
                            relu,
                            res: if last {
                                res_at(m0, p)
                            } else {
                                std::ptr::null()
                            },
                            res_ld: c.residual.map_or(0, |v| v.pitch),
                            post_relu,
                            prefetch: if pf1 > pf0 {
                                next.wrapping_add(pf0 * NR)
                            } else {
                                std::ptr::null()
                            },
                            prefetch_rows: pf1 - pf0,
                        };
                        kernel(m, &call);
                        m0 += m;
                    }
                }
            }
            g0 = g1;
        }
    }
}

/// im2col of a one-channel input without pre-activation (the classifiers' stems): rows of
/// k*k floats, zero in the padding.
#[cfg(target_arch = "x86_64")]
unsafe fn gather_c1(
    c: &ConvOp,
    g0: usize,
    g1: usize,
    src: *const f32,
    tile: &mut [f32],
    ld: usize,
) {
    let s = c.src;
    let (ho, wo, k) = (c.dst.h, c.dst.w, c.k);
    let (d, pad) = (c.dilation, c.pad as isize);
    let (h, w) = (s.h as isize, s.w as isize);
    for r in g0..g1 {
        let (b, oy, ox) = (r / (ho * wo), (r / wo) % ho, r % wo);
        let out = &mut tile[(r - g0) * ld..][..k * k];
        let x0 = (ox * c.stride) as isize - pad;
        let inside = x0 >= 0 && x0 + (((k - 1) * d) as isize) < w && s.pitch == 1;
        for (ky, o) in out.chunks_exact_mut(k).enumerate() {
            let iy = (oy * c.stride + ky * d) as isize - pad;
            if iy < 0 || iy >= h {
                o.fill(0.0);
                continue;
            }
            let row = src.add((b * s.h + iy as usize) * s.w * s.pitch + s.ch_off);
            if inside && d == 1 {
                // Contiguous pixels: plain loads, no per-tap bounds checks.
                let p = std::slice::from_raw_parts(row.add(x0 as usize), k);
                for (v, &x) in o.iter_mut().zip(p) {
                    *v = x;
                }
                continue;
            }
            for (kx, v) in o.iter_mut().enumerate() {
                let ix = x0 + (kx * d) as isize;
                *v = if ix >= 0 && ix < w {
                    *row.add(ix as usize * s.pitch)
                } else {
                    0.0
                };
            }
        }
    }
}

/// Fills `ptrs` ([block][tap][row], `MR` rows a block) with each output pixel's input pixel
/// per tap, the zero row where the tap falls in the padding.
#[cfg(target_arch = "x86_64")]
unsafe fn row_pointers(c: &ConvOp, g0: usize, g1: usize, src: *const f32, ptrs: &mut [*const f32]) {
    let s = c.src;
    let (ho, wo) = (c.dst.h, c.dst.w);
    let (ih, iw) = c.in_hw();
    let up = usize::from(c.up2);
    let taps = c.k * c.k;
    for r in g0..g1 {
        let (blk, i) = ((r - g0) / MR, (r - g0) % MR);
        let (b, oy, ox) = (r / (ho * wo), (r / wo) % ho, r % wo);
        for ky in 0..c.k {
            let iy = (oy * c.stride + ky * c.dilation) as isize - c.pad as isize;
            for kx in 0..c.k {
                let ix = (ox * c.stride + kx * c.dilation) as isize - c.pad as isize;
                let tap = ky * c.k + kx;
                ptrs[(blk * taps + tap) * MR + i] =
                    if iy < 0 || ix < 0 || iy >= ih as isize || ix >= iw as isize {
                        ZEROS.as_ptr()
                    } else {
                        let (y, x) = (iy as usize >> up, ix as usize >> up);
                        src.add(((b * s.h + y) * s.w + x) * s.pitch + s.ch_off)
                    };
            }
        }
    }
}

/// One kernel call: `M` rows of output, one panel, one pass of the reduction.
struct Call<'a> {
    /// Row pointers [tap][row], `MR` per tap, from this pass's first tap.
    a: &'a [*const f32],
    taps: usize,
    koff: usize,
    kc: usize,
    /// The panel's rows for this pass.
    b: *const f32,
    bias: *const f32,
    c: *mut f32,
    ldc: usize,
    cols: usize,
    /// First pass: start from zero (else from `c`); last: add bias, ReLU.
    first: bool,
    last: bool,
    relu: bool,
    /// Rows to add after the ReLU on the last pass (null: none), `res_ld` apart; then ReLU
    /// again when `post_relu`.
    res: *const f32,
    res_ld: usize,
    post_relu: bool,
    /// Weights to prefetch into L2 (null: none), `prefetch_rows` rows of `NR`.
    prefetch: *const f32,
    prefetch_rows: usize,
}

/// Dispatches `m` (1..=MR) rows to the kernel compiled for that many.
#[cfg(target_arch = "x86_64")]
unsafe fn kernel(m: usize, call: &Call) {
    macro_rules! go {
        ($($m:literal)*) => {
            match m {
                $($m => if call.prefetch.is_null() {
                    micro::<$m, false>(call)
                } else {
                    micro::<$m, true>(call)
                },)*
                _ => unreachable!("kernel rows {m}"),
            }
        };
    }
    go!(1 2 3 4 5 6 7 8 9 10 11 12)
}

/// `M` pixels x `NR` channels: for each tap, rows `a[tap * MR + i] + koff` (`kc` floats each)
/// times the panel's next `kc` rows, added to zero or to `c`; on the last pass bias and ReLU;
/// stores the first `cols` channels.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,fma")]
unsafe fn micro<const M: usize, const PF: bool>(k: &Call) {
    use std::arch::x86_64::*;
    let m0: __mmask16 = if k.cols >= 16 {
        0xffff
    } else {
        (1u32 << k.cols) as u16 - 1
    };
    let m1: __mmask16 = if k.cols >= 32 {
        0xffff
    } else if k.cols > 16 {
        (1u32 << (k.cols - 16)) as u16 - 1
    } else {
        0
    };
    let mut acc = [[_mm512_setzero_ps(); 2]; M];
    if !k.first {
        for (i, acc) in acc.iter_mut().enumerate() {
            let row = k.c.add(i * k.ldc);
            acc[0] = _mm512_maskz_loadu_ps(m0, row);
            acc[1] = _mm512_maskz_loadu_ps(m1, row.add(16));
        }
    }
    let mut bp = k.b;
    let mut pf = k.prefetch;
    let mut pf_left = k.prefetch_rows;
    for tap in 0..k.taps {
        let mut ap = [std::ptr::null::<f32>(); M];
        for (i, p) in ap.iter_mut().enumerate() {
            *p = k.a[tap * MR + i].add(k.koff);
        }
        for kk in 0..k.kc {
            let b0 = _mm512_loadu_ps(bp);
            let b1 = _mm512_loadu_ps(bp.add(16));
            bp = bp.add(NR);
            if PF && pf_left > 0 {
                _mm_prefetch::<_MM_HINT_T1>(pf as *const i8);
                _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(16) as *const i8);
                pf = pf.wrapping_add(NR);
                pf_left -= 1;
            }
            for i in 0..M {
                let av = _mm512_set1_ps(*ap[i].add(kk));
                acc[i][0] = _mm512_fmadd_ps(av, b0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(av, b1, acc[i][1]);
            }
        }
    }
    let zero = _mm512_setzero_ps();
    let (bias0, bias1) = (_mm512_loadu_ps(k.bias), _mm512_loadu_ps(k.bias.add(16)));
    for (i, acc) in acc.iter().enumerate() {
        let (mut v0, mut v1) = (acc[0], acc[1]);
        if k.last {
            v0 = _mm512_add_ps(v0, bias0);
            v1 = _mm512_add_ps(v1, bias1);
            if k.relu {
                v0 = _mm512_max_ps(v0, zero);
                v1 = _mm512_max_ps(v1, zero);
            }
            if !k.res.is_null() {
                let r = k.res.add(i * k.res_ld);
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, r));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, r.add(16)));
                if k.post_relu {
                    v0 = _mm512_max_ps(v0, zero);
                    v1 = _mm512_max_ps(v1, zero);
                }
            }
        }
        let row = k.c.add(i * k.ldc);
        _mm512_mask_storeu_ps(row, m0, v0);
        _mm512_mask_storeu_ps(row.add(16), m1, v1);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{validate, Act, Affine, ConvOp, Executor, Op, Output, Plan, View};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Runs `op` (reading buffer 0, an NHWC input of `size`^2 x `c` per image, and writing
    /// buffer 1) with and without packed weights; returns the largest difference.
    fn packed_vs_plain(op: ConvOp, size: usize, c: usize, batch: usize) -> f32 {
        let dst = op.dst;
        let input = values(batch * size * size * c, 3);
        let run = |op: ConvOp, threads: usize| {
            let plan = Plan {
                in_channels: c,
                size,
                input_nhwc: true,
                buf_sizes: vec![size * size * c, dst.h * dst.w * dst.pitch],
                ops: vec![Op::Conv(op)],
                output: Output::Map(dst),
            };
            validate(&plan).expect("valid plan");
            let exec = Executor::new(plan, threads).expect("executor");
            exec.forward(&input, batch).expect("forward")
        };
        let plain = run(op.clone(), 1);
        let packed = op.packed();
        assert!(packed.packed.is_some(), "op should take the packed path");
        let mut worst = 0f32;
        for threads in [1, 2, 3] {
            let out = run(packed.clone(), threads);
            assert_eq!(out.len(), plain.len());
            for (a, b) in out.iter().zip(&plain) {
                worst = worst.max((a - b).abs());
            }
        }
        worst
    }

    fn conv(src: View, dst: View, k: usize, stride: usize, pad: usize, seed: u64) -> ConvOp {
        let kdim = k * k * src.c;
        let w = values(kdim * dst.c, seed)
            .into_iter()
            .map(|v| v / (kdim as f32).sqrt())
            .collect();
        ConvOp::new(src, dst, k, stride, pad, (w, Some(values(dst.c, seed + 1))))
    }

    fn affine(c: usize) -> Affine {
        Affine {
            scale: values(c, 11).iter().map(|v| 1.0 + v).collect(),
            shift: values(c, 12),
        }
    }

    #[test]
    fn pre_activated_1x1_on_a_channel_slice() {
        // 40 of 48 channels in, 40 out (a masked panel), 81 pixels (row-block tails).
        let src = View::whole(0, 9, 9, 48).slice(0, 40);
        let op = ConvOp {
            pre: Some(affine(40)),
            act: Act::Relu,
            ..conv(src, View::whole(1, 9, 9, 40), 1, 1, 0, 1)
        };
        assert!(packed_vs_plain(op, 9, 48, 2) < 1e-5);
    }

    #[test]
    fn long_reduction_takes_several_passes() {
        let src = View::whole(0, 5, 5, 600);
        let op = ConvOp {
            pre: Some(affine(600)),
            ..conv(src, View::whole(1, 5, 5, 70), 1, 1, 0, 2)
        };
        assert!(packed_vs_plain(op, 5, 600, 3) < 1e-5);
    }

    #[test]
    fn kxk_through_row_pointers_with_padding_and_stride() {
        let op = conv(
            View::whole(0, 7, 7, 16),
            View::whole(1, 7, 7, 32),
            3,
            1,
            1,
            3,
        );
        assert!(packed_vs_plain(op, 7, 16, 2) < 1e-5);
        let op = ConvOp {
            act: Act::Relu,
            ..conv(
                View::whole(0, 13, 13, 24),
                View::whole(1, 7, 7, 64),
                3,
                2,
                1,
                4,
            )
        };
        assert!(packed_vs_plain(op, 13, 24, 3) < 1e-5);
    }

    #[test]
    fn one_channel_stem_and_pooled_transition() {
        let op = ConvOp {
            act: Act::Relu,
            ..conv(
                View::whole(0, 20, 20, 1),
                View::whole(1, 10, 10, 64),
                7,
                2,
                3,
                5,
            )
        };
        assert!(packed_vs_plain(op, 20, 1, 2) < 1e-5);
        let op = ConvOp {
            pre: Some(affine(32)),
            pool2: true,
            ..conv(
                View::whole(0, 8, 8, 32),
                View::whole(1, 4, 4, 16),
                1,
                1,
                0,
                6,
            )
        };
        assert!(packed_vs_plain(op, 8, 32, 2) < 1e-5);
    }

    #[test]
    fn residual_add_then_relu() {
        let x = View::whole(0, 6, 6, 32);
        for (k, pad) in [(1, 0), (3, 1)] {
            let op = ConvOp {
                residual: Some(x),
                post_act: Act::Relu,
                ..conv(x, View::whole(1, 6, 6, 32), k, 1, pad, 7)
            };
            assert!(packed_vs_plain(op, 6, 32, 2) < 1e-5);
        }
    }
}
