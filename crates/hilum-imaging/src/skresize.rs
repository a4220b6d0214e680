//! `skimage.transform.resize` as the Python reference pipelines call it, reproduced to float
//! rounding: torchxrayvision's `XRayResizer` (order 1, `mode="constant"`, `cval=0`, anti-aliasing
//! when shrinking, `clip=True`) and MedSAM's (order 3, `mode="reflect"`, anti-aliasing).
//!
//! What skimage 0.26 does, and what is reproduced here:
//! - anti-aliasing: when any axis shrinks, `scipy.ndimage.gaussian_filter` with
//!   `sigma = max(0, (in / out - 1) / 2)` per axis, truncated at `int(4 sigma + 0.5)` taps each
//!   side, the kernel normalised to sum 1, the image extended by the mode (`grid-constant`: cval;
//!   `mirror`: reflected about the edge pixels);
//! - then `scipy.ndimage.zoom(..., grid_mode=True)`: output pixel `o` samples the input at
//!   `(o + 0.5) * in / out - 0.5`, by linear interpolation (cval outside the image) or by a cubic
//!   B-spline whose coefficients come from the exact mirror-boundary prefilter;
//! - `clip=True`: the result is clipped to the input's [min, max] (for `constant`, widened to
//!   cval when cval lies outside that range and inside the output's).
//!
//! Everything before the clip is linear and separable, so the order-1 path folds the Gaussian and
//! the interpolation into one set of taps per axis and reads only the source pixels it needs,
//! accumulating in f64 (the reference works in f64 between f32 roundings).

/// A rectangle of a row-major plane of `stride` values per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// First column.
    pub x0: usize,
    /// First row.
    pub y0: usize,
    /// Columns.
    pub width: usize,
    /// Rows.
    pub height: usize,
}

impl Region {
    /// The whole `width` x `height` image.
    pub fn whole(width: usize, height: usize) -> Self {
        Region {
            x0: 0,
            y0: 0,
            width,
            height,
        }
    }
}

/// `scipy.ndimage._filters._gaussian_kernel1d(sigma, 0, radius)` with skimage's radius rule; an
/// identity kernel when sigma is 0 (scipy skips axes with sigma <= 1e-15).
fn gaussian_kernel(n_in: usize, n_out: usize) -> Vec<f64> {
    let factor = n_in as f64 / n_out as f64;
    let sigma = ((factor - 1.0) / 2.0).max(0.0);
    if sigma <= 1e-15 {
        return vec![1.0];
    }
    let radius = (4.0 * sigma + 0.5) as i64;
    let c = -0.5 / (sigma * sigma);
    let k: Vec<f64> = (-radius..=radius)
        .map(|x| (c * (x * x) as f64).exp())
        .collect();
    let sum: f64 = k.iter().sum();
    k.into_iter().map(|v| v / sum).collect()
}

/// `(o + 0.5) * in / out - 0.5`, scipy's grid-mode sample position of output pixel `o`.
fn sample_position(o: usize, n_in: usize, n_out: usize) -> f64 {
    (o as f64 + 0.5) * (n_in as f64 / n_out as f64) - 0.5
}

/// Taps of one output sample of the order-1 path: input `start..start + weights.len()`.
struct Taps {
    start: usize,
    weights: Vec<f64>,
    /// Sum of the weights: below 1 where the kernel reaches past the edge (the rest is cval).
    sum: f64,
}

/// Gaussian (grid-constant) followed by linear interpolation (grid-constant), as one FIR per
/// output sample. Input samples outside `0..n_in` carry cval, which the caller adds back as
/// `cval * (1 - sum)`.
fn linear_taps(n_in: usize, n_out: usize) -> Vec<Taps> {
    let kernel = gaussian_kernel(n_in, n_out);
    let r = (kernel.len() / 2) as i64;
    let n = n_in as i64;
    (0..n_out)
        .map(|o| {
            let c = sample_position(o, n_in, n_out);
            let i0 = c.floor() as i64;
            let t = c - i0 as f64;
            let lo = (i0 - r).clamp(0, n);
            let hi = (i0 + 1 + r + 1).clamp(lo, n);
            let mut weights = vec![0.0f64; (hi - lo) as usize];
            for (j, wj) in [(i0, 1.0 - t), (i0 + 1, t)] {
                // A blurred sample outside the image is cval itself (not a blur of cval).
                if j < 0 || j >= n || wj == 0.0 {
                    continue;
                }
                for (d, &kd) in kernel.iter().enumerate() {
                    let i = j - r + d as i64;
                    if (0..n).contains(&i) {
                        weights[(i - lo) as usize] += wj * kd;
                    }
                }
            }
            let sum = weights.iter().sum();
            Taps {
                start: lo as usize,
                weights,
                sum,
            }
        })
        .collect()
}

/// `skimage.transform.resize(crop, (dh, dw), order=1, mode="constant", cval=pad,
/// anti_aliasing=None, preserve_range=True)` of `region` of `src` (`stride` values per row), on
/// the values as given: `pad` is the value that skimage's `cval=0` stands for on this scale
/// (torchxrayvision resizes values already in [-1024, 1024], so for raw pixels of maximum `m`
/// the padding is `m / 2`). Returns `dw * dh` values, row-major.
pub fn resize_linear_constant(
    src: &[f32],
    stride: usize,
    region: Region,
    dw: usize,
    dh: usize,
    pad: f32,
) -> Vec<f32> {
    let Region {
        x0,
        y0,
        width: sw,
        height: sh,
    } = region;
    if sw == 0 || sh == 0 || dw == 0 || dh == 0 {
        return vec![pad; dw * dh];
    }
    let row = |y: usize| &src[(y0 + y) * stride + x0..(y0 + y) * stride + x0 + sw];
    let vy = linear_taps(sh, dh);
    let hx = linear_taps(sw, dw);

    // Vertical pass first: each output row is a weighted sum of whole input rows (contiguous,
    // vectorises), f64 accumulators. The input's min/max (for the clip) is taken on each row the
    // first time a tap reads it, while it is in cache.
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut scanned = 0usize;
    let scan = |y: usize, lo: &mut f32, hi: &mut f32| {
        let (a, b) = min_max(row(y));
        *lo = lo.min(a);
        *hi = hi.max(b);
    };
    let mut acc = vec![0.0f64; sw];
    let mut tmp = vec![0.0f64; dh * sw];
    for (t, out_row) in vy.iter().zip(tmp.chunks_exact_mut(sw)) {
        acc.iter_mut().for_each(|a| *a = 0.0);
        for (k, &w) in t.weights.iter().enumerate() {
            let y = t.start + k;
            while scanned <= y {
                scan(scanned, &mut lo, &mut hi);
                scanned += 1;
            }
            if w == 0.0 {
                continue;
            }
            for (a, &v) in acc.iter_mut().zip(row(y)) {
                *a += w * v as f64;
            }
        }
        out_row.copy_from_slice(&acc);
    }
    while scanned < sh {
        scan(scanned, &mut lo, &mut hi);
        scanned += 1;
    }

    // Horizontal pass on the dh short rows, then cval where the kernels left the image.
    let mut out = vec![0.0f32; dh * dw];
    for ((in_row, out_row), ty) in tmp.chunks_exact(sw).zip(out.chunks_exact_mut(dw)).zip(&vy) {
        for (o, tx) in out_row.iter_mut().zip(&hx) {
            let window = &in_row[tx.start..tx.start + tx.weights.len()];
            let s = dot(window, &tx.weights);
            let missing = 1.0 - ty.sum * tx.sum;
            *o = (s + pad as f64 * missing) as f32;
        }
    }
    clip(&mut out, lo, hi, Some(pad));
    out
}

/// Four independent accumulators, so the sum is not one long dependency chain.
fn dot(a: &[f64], b: &[f64]) -> f64 {
    let mut s = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f64 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            s[i] += x[i] * y[i];
        }
    }
    (s[0] + s[1]) + (s[2] + s[3]) + tail
}

/// Min and max of a row, in eight lanes (a single running min does not vectorise).
fn min_max(v: &[f32]) -> (f32, f32) {
    let mut lo = [f32::INFINITY; 8];
    let mut hi = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..8 {
            lo[i] = if c[i] < lo[i] { c[i] } else { lo[i] };
            hi[i] = if c[i] > hi[i] { c[i] } else { hi[i] };
        }
    }
    let mut l = lo.iter().copied().fold(f32::INFINITY, f32::min);
    let mut h = hi.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &x in rest {
        l = l.min(x);
        h = h.max(x);
    }
    (l, h)
}

/// skimage's `_clip_warp_output`: clip to the input's range, widened to include cval when the
/// mode is constant, cval is outside the input's range and inside the output's.
fn clip(out: &mut [f32], lo: f32, hi: f32, cval: Option<f32>) {
    let (mut lo, mut hi) = (lo, hi);
    if let Some(c) = cval {
        if !(lo <= c && c <= hi) {
            let (olo, ohi) = min_max(out);
            if olo <= c && c <= ohi {
                lo = lo.min(c);
                hi = hi.max(c);
            }
        }
    }
    for v in out.iter_mut() {
        *v = v.clamp(lo, hi);
    }
}

/// `i` reflected into `0..n` about the edge pixels (scipy's `mirror`: d c b | a b c d | c b a).
fn mirror_index(i: i64, n: usize) -> usize {
    if n == 1 {
        return 0;
    }
    let period = 2 * n as i64 - 2;
    let i = i.abs() % period;
    (if i >= n as i64 { period - i } else { i }) as usize
}

/// A coordinate reflected into `[0, n - 1]` the same way.
fn mirror_coordinate(x: f64, n: usize) -> f64 {
    if n == 1 {
        return 0.0;
    }
    let period = (2 * n - 2) as f64;
    let x = x.abs() % period;
    if x > (n - 1) as f64 {
        period - x
    } else {
        x
    }
}

/// Cubic B-spline basis at distance `t`.
fn bspline3(t: f64) -> f64 {
    let t = t.abs();
    if t < 1.0 {
        2.0 / 3.0 - t * t + t * t * t / 2.0
    } else if t < 2.0 {
        (2.0 - t).powi(3) / 6.0
    } else {
        0.0
    }
}

/// scipy's cubic `spline_filter1d` with the mirror boundary (exact causal initialisation, as
/// `ni_splines.c` does), in place.
fn spline_prefilter_mirror(c: &mut [f64]) {
    let n = c.len();
    if n < 2 {
        return;
    }
    let z = 3f64.sqrt() - 2.0;
    let gain = (1.0 - z) * (1.0 - 1.0 / z);
    c.iter_mut().for_each(|v| *v *= gain);
    let z_n1 = z.powi(n as i32 - 1);
    let mut c0 = c[0] + z_n1 * c[n - 1];
    let mut zi = z;
    for i in 1..n - 1 {
        c0 += zi * (c[i] + z_n1 * c[n - 1 - i]);
        zi *= z;
    }
    c[0] = c0 / (1.0 - z_n1 * z_n1);
    for i in 1..n {
        c[i] += z * c[i - 1];
    }
    c[n - 1] = (z * c[n - 2] + c[n - 1]) * z / (z * z - 1.0);
    for i in (0..n - 1).rev() {
        c[i] = z * (c[i + 1] - c[i]);
    }
}

/// One axis of the order-3 mirror path: Gaussian (mirror), spline prefilter, cubic sampling.
fn cubic_mirror_axis(x: &[f64], m: usize, kernel: &[f64], blurred: &mut Vec<f64>, out: &mut [f64]) {
    let n = x.len();
    let r = (kernel.len() / 2) as i64;
    blurred.clear();
    if r == 0 {
        blurred.extend_from_slice(x);
    } else {
        blurred.extend((0..n as i64).map(|j| {
            kernel
                .iter()
                .enumerate()
                .map(|(d, &k)| k * x[mirror_index(j - r + d as i64, n)])
                .sum::<f64>()
        }));
    }
    spline_prefilter_mirror(blurred);
    for (o, v) in out.iter_mut().enumerate().take(m) {
        let mut pos = sample_position(o, n, m);
        if pos < 0.0 || pos > (n - 1) as f64 {
            pos = mirror_coordinate(pos, n);
        }
        let i0 = pos.floor() as i64;
        *v = (i0 - 1..i0 + 3)
            .map(|j| bspline3(pos - j as f64) * blurred[mirror_index(j, n)])
            .sum();
    }
}

/// `skimage.transform.resize(image, (dh, dw), order=3, mode="reflect", anti_aliasing=True,
/// preserve_range=True)` of a `sw` x `sh` plane, in f64 as skimage computes it for 8-bit input
/// (MedSAM_Inference.py's resize), clipped to the input's range. Returns `dw * dh` values.
pub fn resize_cubic_mirror(src: &[f32], sw: usize, sh: usize, dw: usize, dh: usize) -> Vec<f64> {
    if sw == 0 || sh == 0 || dw == 0 || dh == 0 || src.len() < sw * sh {
        return vec![0.0; dw * dh];
    }
    // Every zoom factor 1: scipy's `zoom` returns its input unchanged (its gh-20999 early exit,
    // in the pinned 1.17.1), and sigma 0 leaves the Gaussian out. A spline round trip here would
    // land just below whole values and truncate one level down.
    if (sw, sh) == (dw, dh) {
        return src[..sw * sh].iter().map(|&v| f64::from(v)).collect();
    }
    let (lo, hi) = min_max(&src[..sw * sh]);
    // Rows to dw, then (transposed) columns to dh.
    let kx = gaussian_kernel(sw, dw);
    let mut blurred = Vec::with_capacity(sw.max(sh));
    let mut row = vec![0.0f64; sw];
    let mut tmp_t = vec![0.0f64; dw * sh];
    let mut out_row = vec![0.0f64; dw];
    for y in 0..sh {
        for (r, &v) in row.iter_mut().zip(&src[y * sw..(y + 1) * sw]) {
            *r = v as f64;
        }
        cubic_mirror_axis(&row, dw, &kx, &mut blurred, &mut out_row);
        for (x, &v) in out_row.iter().enumerate() {
            tmp_t[x * sh + y] = v;
        }
    }
    let ky = gaussian_kernel(sh, dh);
    let mut out = vec![0.0f64; dw * dh];
    let mut col = vec![0.0f64; dh];
    for x in 0..dw {
        cubic_mirror_axis(
            &tmp_t[x * sh..(x + 1) * sh],
            dh,
            &ky,
            &mut blurred,
            &mut col,
        );
        for (y, &v) in col.iter().enumerate() {
            out[y * dw + x] = v.clamp(lo as f64, hi as f64);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taps_sum_to_one_inside_and_less_at_the_edges() {
        let t = linear_taps(2544, 224);
        let mid = &t[112];
        assert!((mid.sum - 1.0).abs() < 1e-12);
        // sigma = (2544/224 - 1)/2 = 5.18, radius 21: the first sample's kernel leaves the image.
        assert!(t[0].sum < 0.99 && t[0].start == 0);
        // Upsampling: no blur, two taps, and the first sample lies left of pixel 0's centre.
        let up = linear_taps(440, 512);
        assert!(up[0].weights.len() <= 3 && up[0].sum < 1.0);
    }

    #[test]
    fn border_fades_to_pad_unless_the_clip_restores_it() {
        let region = Region::whole(300, 200);
        // A constant image: the border is pulled toward the pad (0), which lies outside both the
        // input's range [10, 10] and the output's, so skimage's clip puts it back to 10.
        let src = vec![10.0f32; 300 * 200];
        let out = resize_linear_constant(&src, 300, region, 64, 32, 0.0);
        assert!(out.iter().all(|v| (v - 10.0).abs() < 1e-5));
        // One dark pixel puts the pad inside the input's range: the corner keeps the fade.
        let mut src = src;
        src[100 * 300 + 150] = -5.0;
        let out = resize_linear_constant(&src, 300, region, 64, 32, 0.0);
        assert!(out[0] < 9.0 && out[0] > 0.0, "{}", out[0]);
        assert!((out[2 * 64 + 2] - 10.0).abs() < 1e-4);
    }

    #[test]
    fn cubic_spline_interpolates_its_samples_and_keeps_constants() {
        // Same size: the prefilter and the spline reproduce the samples exactly.
        let src: Vec<f32> = (0..40).map(|i| ((i * 37) % 11) as f32).collect();
        let same = resize_cubic_mirror(&src, 8, 5, 8, 5);
        assert!(same
            .iter()
            .zip(&src)
            .all(|(a, &b)| (a - b as f64).abs() < 1e-9));
        let flat = vec![3.0f32; 30 * 20];
        let out = resize_cubic_mirror(&flat, 30, 20, 7, 50);
        assert!(out.iter().all(|v| (v - 3.0).abs() < 1e-9));
    }
}
