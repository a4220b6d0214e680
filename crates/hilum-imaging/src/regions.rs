//! Connected regions of a binary mask (4-connectivity), shared by the segmentation and
//! localisation tools.

/// The connected regions of the pixels where `inside(index)` holds on a `width` x `height`
/// row-major grid, in scan order of their first pixel; each region lists its pixel indices.
pub fn components(width: usize, height: usize, inside: impl Fn(usize) -> bool) -> Vec<Vec<usize>> {
    let n = width * height;
    let mut seen = vec![false; n];
    let mut out = Vec::new();
    let mut stack = Vec::new();
    for start in 0..n {
        if seen[start] || !inside(start) {
            continue;
        }
        seen[start] = true;
        stack.push(start);
        let mut pixels = Vec::new();
        while let Some(p) = stack.pop() {
            pixels.push(p);
            let (x, y) = (p % width, p / width);
            let mut visit = |q: usize| {
                if !seen[q] && inside(q) {
                    seen[q] = true;
                    stack.push(q);
                }
            };
            if x > 0 {
                visit(p - 1);
            }
            if x + 1 < width {
                visit(p + 1);
            }
            if y > 0 {
                visit(p - width);
            }
            if y + 1 < height {
                visit(p + width);
            }
        }
        out.push(pixels);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::components;

    #[test]
    fn separates_regions_by_four_connectivity() {
        // Two blobs touching only diagonally are two regions.
        #[rustfmt::skip]
        let mask = [
            true,  true,  false, false,
            true,  false, false, false,
            false, false, true,  true,
            false, false, false, true,
        ];
        let regions = components(4, 4, |i| mask[i]);
        assert_eq!(regions.len(), 2);
        let mut first = regions[0].clone();
        first.sort();
        assert_eq!(first, vec![0, 1, 4]);
        assert_eq!(regions[1].len(), 3);
        assert!(components(4, 4, |_| false).is_empty());
    }
}
