//! Preprocessing for the models: resize (with aspect-preserving pad or centre crop),
//! normalisation (fixed scales, ImageNet statistics or min-max), channel replication, and the inverse mapping of coordinates and masks.
//!
//! Usage from model code (through the store, so the work is shared and cached):
//!
//! ```no_run
//! # use hilum_imaging::{ImageStore, Preprocess, Layout, Norm};
//! # let store = ImageStore::default();
//! # let id = "img_000000000000";
//! // torchxrayvision: centre crop, 224 px, [-1024, 1024], (1, 224, 224)
//! let x = store.prepared(id, &Preprocess::xrv(224))?;
//! // lung U-Net: 256 px stretched, RGB 0..255, interleaved (256, 256, 3)
//! let u = store.prepared(id, &Preprocess::stretch(256, 256).norm(Norm::Byte).channels(3).layout(Layout::Hwc))?;
//! // a probability map predicted at 256x256 goes back onto the original pixels:
//! # let prob = vec![0.0f32; 256 * 256];
//! let full = u.geometry.map_to_original(&prob);
//! # Ok::<(), hilum_imaging::ImagingError>(())
//! ```

use serde::{Deserialize, Serialize};

use crate::skresize::Region;
use crate::{CxrImage, ImagingError};

/// Resampling filter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Filter {
    /// Nearest neighbour (label masks).
    Nearest,
    /// Triangle filter whose support widens when downscaling, so it antialiases like
    /// PIL's `BILINEAR` resize (not like a 4-tap `cv2.INTER_LINEAR`).
    #[default]
    Bilinear,
    /// Exact pixel-area averaging when downscaling (like `cv2.INTER_AREA`); bilinear when
    /// upscaling.
    Area,
    /// `skimage.transform.resize(order=1, mode="constant", anti_aliasing=True)` on the
    /// normalised values, as torchxrayvision's `XRayResizer` does (Gaussian anti-aliasing, then
    /// linear interpolation; skimage's `cval=0` is the value the recipe's `norm` maps to 0, e.g.
    /// mid-grey for [`Norm::Xrv`]; clipped to the input's range). See [`crate::skresize`].
    SkimageLinear,
    /// `skimage.transform.resize(order=3, mode="reflect", anti_aliasing=True,
    /// preserve_range=True)` on an 8-bit image, then `astype(np.uint8)`, as MedSAM's inference
    /// script feeds SAM: the values are scaled to 0..=255 (the norms then see a maximum of 255),
    /// resized in f64 (see [`crate::skresize::resize_cubic_mirror`]) and truncated to whole
    /// values. At the same size the values pass unchanged, as scipy's `zoom` returns them.
    SkimageCubicU8,
    /// Pillow's `BICUBIC` on an 8-bit image (`a = -0.5`, support widened when shrinking,
    /// 22-bit fixed-point weights, each pass rounded and clipped to a byte), as the slow
    /// `CLIPImageProcessor` resizes for LLaVA: the values are first scaled and rounded to whole
    /// bytes (the norms then see a maximum of 255).
    PilBicubicU8,
    /// Pillow's `BILINEAR` exactly: [`Filter::PilBicubicU8`]'s fixed-point arithmetic with the
    /// triangle kernel, as ViTImageProcessor resizes for the report models and the lung U-Net's
    /// Keras reference was fed.
    PilBilinearFixedU8,
}

/// How the image's aspect ratio meets the target size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fit {
    /// Resize to exactly the target size, distorting the aspect ratio.
    #[default]
    Stretch,
    /// Keep the aspect ratio, fit inside, pad the rest with black (0 before normalisation),
    /// the image centred.
    Pad,
    /// Keep the aspect ratio, crop the centre to the target's aspect, then resize
    /// (torchxrayvision's `XRayCenterCrop` for a square target).
    CenterCrop,
    /// transformers' `CLIPImageProcessor`: the shortest side resized to the target's (the other
    /// to `int(target * long / short)`), then the centre cropped (`top = (h - target) // 2`).
    /// Square targets only.
    ShortSideCrop,
    /// LLaVA's `expand2square` before CLIP: the image centred (`(side - w) // 2`) on a square of
    /// its longer side, filled per channel with the colour the norm maps to zero rounded down
    /// to a byte (`int(mean * 255)`), then resized to the target. Square targets only.
    PadSquare,
}

/// Value scaling applied after resizing. `max` is the image's `2^bit_depth - 1`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    /// The canonical values, unchanged.
    None,
    /// `v / max`, in 0..=1.
    #[default]
    Unit,
    /// `v / max * 255`, in 0..=255 (models trained on 8-bit files).
    Byte,
    /// torchxrayvision: `(2 v / max - 1) * 1024`, in -1024..=1024.
    Xrv,
    /// `(v / max - mean[c]) / std[c]` with ImageNet's RGB mean and std; implies 3 channels.
    ImageNet,
    /// torchxrayvision's PSPNet input: [`Norm::ImageNet`]'s values (its xrv range mapped back,
    /// `(x + 1024) / 2048`, is `v / max`), but the resize pads with mid-grey as for
    /// [`Norm::Xrv`], the range the image went through first; implies 3 channels.
    XrvImageNet,
    /// `(v - min) / max(max - min, 1e-8)` over the resized plane (padding included), in 0..=1
    /// (MedSAM); a flat plane is all 0.
    MinMax,
    /// `(v / max - mean[c]) / std[c]` with OpenAI CLIP's mean and std; implies 3 channels.
    Clip,
}

/// Memory order of a multi-channel result.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Planar `(c, h, w)`, as PyTorch/candle models take it.
    #[default]
    Chw,
    /// Interleaved `(h, w, c)`, as Keras/TF models take it.
    Hwc,
}

/// One preprocessing recipe; also the cache key of the variant it produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Preprocess {
    /// Output width.
    pub width: u32,
    /// Output height.
    pub height: u32,
    /// How values are resampled.
    pub filter: Filter,
    /// How the aspect ratio meets the output size.
    pub fit: Fit,
    /// How values are normalised.
    pub norm: Norm,
    /// 1 or 3 (the luminance replicated).
    pub channels: u8,
    /// Planar or interleaved channels.
    pub layout: Layout,
}

const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];
/// OpenAI CLIP's normalisation (the `CLIPImageProcessor` of LLaVA checkpoints).
pub const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
/// OpenAI CLIP's per-channel standard deviation.
pub const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

impl Preprocess {
    /// `width` x `height`, stretched, bilinear, 0..1, one channel, planar.
    pub fn stretch(width: u32, height: u32) -> Self {
        Preprocess {
            width,
            height,
            filter: Filter::Bilinear,
            fit: Fit::Stretch,
            norm: Norm::Unit,
            channels: 1,
            layout: Layout::Chw,
        }
    }

    /// torchxrayvision's pipeline: centre crop to a square, `size` px with its skimage resize,
    /// [-1024, 1024], 1 channel.
    pub fn xrv(size: u32) -> Self {
        Self::stretch(size, size)
            .fit(Fit::CenterCrop)
            .norm(Norm::Xrv)
            .filter(Filter::SkimageLinear)
    }

    /// ImageNet-pretrained CNNs: `size` px stretched, 3 channels, ImageNet mean/std, planar.
    pub fn imagenet(size: u32) -> Self {
        Self::stretch(size, size).norm(Norm::ImageNet).channels(3)
    }

    /// With this resampling filter.
    pub fn filter(mut self, filter: Filter) -> Self {
        self.filter = filter;
        self
    }
    /// With this fit.
    pub fn fit(mut self, fit: Fit) -> Self {
        self.fit = fit;
        self
    }
    /// With this normalisation.
    pub fn norm(mut self, norm: Norm) -> Self {
        self.norm = norm;
        self
    }
    /// With this many channels (1 or 3).
    pub fn channels(mut self, channels: u8) -> Self {
        self.channels = channels;
        self
    }
    /// With this layout.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    fn validate(&self) -> Result<(), ImagingError> {
        if self.width == 0 || self.height == 0 || self.width > 16384 || self.height > 16384 {
            return Err(ImagingError::InvalidTransform(format!(
                "target size {}x{} must be between 1 and 16384 per side",
                self.width, self.height
            )));
        }
        if !(self.channels == 1 || self.channels == 3) {
            return Err(ImagingError::InvalidTransform(format!(
                "{} channels: use 1 or 3",
                self.channels
            )));
        }
        if matches!(self.norm, Norm::ImageNet | Norm::XrvImageNet | Norm::Clip)
            && self.channels != 3
        {
            return Err(ImagingError::InvalidTransform(format!(
                "{:?} normalisation needs 3 channels",
                self.norm
            )));
        }
        if matches!(self.fit, Fit::ShortSideCrop | Fit::PadSquare) && self.width != self.height {
            return Err(ImagingError::InvalidTransform(format!(
                "{:?} makes square inputs; {}x{} is not square",
                self.fit, self.width, self.height
            )));
        }
        Ok(())
    }
}

/// Where the original image lies in the model input: `input = original * scale + offset`,
/// in continuous pixel coordinates (pixel `i` covers `[i, i + 1)`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Geometry {
    /// Original width.
    pub src_width: u32,
    /// Original height.
    pub src_height: u32,
    /// Model input width.
    pub dst_width: u32,
    /// Model input height.
    pub dst_height: u32,
    /// Input pixels per original pixel, across.
    pub scale_x: f64,
    /// Input pixels per original pixel, down.
    pub scale_y: f64,
    /// Where the original's left edge lies in the input.
    pub offset_x: f64,
    /// Where the original's top edge lies in the input.
    pub offset_y: f64,
}

impl Geometry {
    /// A point of the original image in model-input coordinates.
    pub fn to_input(&self, x: f64, y: f64) -> (f64, f64) {
        (
            x * self.scale_x + self.offset_x,
            y * self.scale_y + self.offset_y,
        )
    }

    /// A point of the model input in original-image coordinates.
    pub fn to_original(&self, x: f64, y: f64) -> (f64, f64) {
        (
            (x - self.offset_x) / self.scale_x,
            (y - self.offset_y) / self.scale_y,
        )
    }

    /// A box `[x0, y0, x1, y1]` of the model input in original coordinates, clipped to the
    /// original image (a box drawn on padding shrinks to the image edge).
    pub fn box_to_original(&self, b: [f64; 4]) -> [f64; 4] {
        let (x0, y0) = self.to_original(b[0], b[1]);
        let (x1, y1) = self.to_original(b[2], b[3]);
        let (w, h) = (self.src_width as f64, self.src_height as f64);
        [
            x0.clamp(0.0, w),
            y0.clamp(0.0, h),
            x1.clamp(0.0, w),
            y1.clamp(0.0, h),
        ]
    }

    /// A single-channel map at model-input size (`dst_width * dst_height`, row-major:
    /// probabilities, logits, a heatmap) sampled bilinearly at every original pixel centre.
    /// Original pixels the input did not cover (cropped away) get 0. Threshold the result
    /// for a binary mask at full resolution.
    pub fn map_to_original(&self, map: &[f32]) -> Vec<f32> {
        let (dw, dh) = (self.dst_width as usize, self.dst_height as usize);
        let (sw, sh) = (self.src_width as usize, self.src_height as usize);
        if map.len() < dw * dh || dw == 0 || dh == 0 {
            return vec![0.0; sw * sh];
        }
        // Per-axis sample positions, computed once: (index0, index1, weight1) or None outside.
        let axis = |n_src: usize,
                    n_dst: usize,
                    scale: f64,
                    offset: f64|
         -> Vec<Option<(usize, usize, f32)>> {
            (0..n_src)
                .map(|i| {
                    let p = (i as f64 + 0.5) * scale + offset;
                    if p < 0.0 || p >= n_dst as f64 {
                        return None;
                    }
                    let c = (p - 0.5).clamp(0.0, (n_dst - 1) as f64);
                    let i0 = c.floor() as usize;
                    let i1 = (i0 + 1).min(n_dst - 1);
                    Some((i0, i1, (c - i0 as f64) as f32))
                })
                .collect()
        };
        let xs = axis(sw, dw, self.scale_x, self.offset_x);
        let ys = axis(sh, dh, self.scale_y, self.offset_y);
        let mut out = vec![0.0f32; sw * sh];
        for (y, yy) in ys.iter().enumerate() {
            let Some((y0, y1, fy)) = *yy else { continue };
            let (r0, r1) = (&map[y0 * dw..(y0 + 1) * dw], &map[y1 * dw..(y1 + 1) * dw]);
            let row = &mut out[y * sw..(y + 1) * sw];
            for (o, xx) in row.iter_mut().zip(xs.iter()) {
                if let Some((x0, x1, fx)) = *xx {
                    let top = r0[x0] + (r0[x1] - r0[x0]) * fx;
                    let bottom = r1[x0] + (r1[x1] - r1[x0]) * fx;
                    *o = top + (bottom - top) * fy;
                }
            }
        }
        out
    }
}

/// A preprocessed variant of an image, ready to wrap in a tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    /// Width.
    pub width: u32,
    /// Height.
    pub height: u32,
    /// Channels.
    pub channels: u8,
    /// Planar or interleaved.
    pub layout: Layout,
    /// `channels * height * width` values in `layout` order.
    pub data: Vec<f32>,
    /// Where the original lies in it.
    pub geometry: Geometry,
}

impl Prepared {
    /// Bytes held by the values (for cache accounting).
    pub fn size_bytes(&self) -> usize {
        self.data.len() * std::mem::size_of::<f32>()
    }

    /// Shape in the layout's order: `[c, h, w]` or `[h, w, c]`.
    pub fn shape(&self) -> [usize; 3] {
        let (c, h, w) = (
            self.channels as usize,
            self.height as usize,
            self.width as usize,
        );
        match self.layout {
            Layout::Chw => [c, h, w],
            Layout::Hwc => [h, w, c],
        }
    }
}

/// Runs a recipe on an image (the store caches the result; call this directly only for
/// one-off work).
pub fn prepare(img: &CxrImage, p: &Preprocess) -> Result<Prepared, ImagingError> {
    prepare_values(&img.pixels, img.width, img.height, img.max_value(), p)
}

/// [`prepare`] on a bare row-major luminance plane whose full scale is `max_value` (for code
/// that holds values, not a [`CxrImage`]: fixtures, batch tools). The one implementation of
/// every recipe.
pub fn prepare_values(
    values: &[f32],
    width: u32,
    height: u32,
    max_value: f32,
    p: &Preprocess,
) -> Result<Prepared, ImagingError> {
    p.validate()?;
    let (sw, sh) = (width as usize, height as usize);
    if sw == 0 || sh == 0 || values.len() < sw * sh {
        return Err(ImagingError::InvalidTransform(format!(
            "the image has {} pixels for {sw}x{sh}",
            values.len()
        )));
    }
    let (dw, dh) = (p.width as usize, p.height as usize);
    let max = max_value.max(1.0);
    let byte_scaled: Vec<f32>;
    let (pixels, max) = if matches!(p.filter, Filter::PilBicubicU8 | Filter::PilBilinearFixedU8) {
        // Whole bytes, as the 8-bit picture Pillow is handed.
        let s = 255.0 / max;
        byte_scaled = values
            .iter()
            .map(|v| (v * s).round().clamp(0.0, 255.0))
            .collect();
        (&byte_scaled[..], 255.0)
    } else if p.filter == Filter::SkimageCubicU8 {
        let s = 255.0 / max;
        byte_scaled = values.iter().map(|v| v * s).collect();
        (&byte_scaled[..], 255.0)
    } else {
        (values, max)
    };
    // The raw value the norm maps to 0: what skimage's cval=0 pads with.
    let pad = if matches!(p.norm, Norm::Xrv | Norm::XrvImageNet) {
        max / 2.0
    } else {
        0.0
    };
    let resize_region = |region: Region, w: usize, h: usize| -> Vec<f32> {
        if p.filter == Filter::SkimageLinear {
            return crate::skresize::resize_linear_constant(pixels, sw, region, w, h, pad);
        }
        if region.x0 == 0 && region.y0 == 0 && region.width == sw && region.height == sh {
            return resize(pixels, sw, sh, w, h, p.filter);
        }
        let mut crop = Vec::with_capacity(region.width * region.height);
        for y in region.y0..region.y0 + region.height {
            crop.extend_from_slice(&pixels[y * sw + region.x0..y * sw + region.x0 + region.width]);
        }
        resize(&crop, region.width, region.height, w, h, p.filter)
    };
    let whole = Region::whole(sw, sh);
    let geometry_of = |scale_x: f64, scale_y: f64, offset_x: f64, offset_y: f64| Geometry {
        src_width: width,
        src_height: height,
        dst_width: p.width,
        dst_height: p.height,
        scale_x,
        scale_y,
        offset_x,
        offset_y,
    };
    // One plane, or one per channel where the fill colour differs by channel (`PadSquare`).
    let (planes, geometry): (Vec<Vec<f32>>, Geometry) = match p.fit {
        Fit::ShortSideCrop => {
            let (nw, nh) = if sw <= sh {
                (dw, ((dw * sh) as f64 / sw as f64) as usize)
            } else {
                (((dw * sw) as f64 / sh as f64) as usize, dw)
            };
            let (nw, nh) = (nw.max(dw), nh.max(dh));
            let resized = resize_region(whole, nw, nh);
            let (top, left) = ((nh - dh) / 2, (nw - dw) / 2);
            let mut plane = Vec::with_capacity(dw * dh);
            for y in top..top + dh {
                plane.extend_from_slice(&resized[y * nw + left..y * nw + left + dw]);
            }
            let (sx, sy) = (nw as f64 / sw as f64, nh as f64 / sh as f64);
            (
                vec![plane],
                geometry_of(sx, sy, -(left as f64), -(top as f64)),
            )
        }
        Fit::PadSquare => {
            let side = sw.max(sh);
            let (ox, oy) = ((side - sw) / 2, (side - sh) / 2);
            let fills = pad_fills(p.norm, max, p.channels);
            let planes = fills
                .iter()
                .map(|&fill| {
                    let mut square = vec![fill; side * side];
                    for y in 0..sh {
                        square[(oy + y) * side + ox..(oy + y) * side + ox + sw]
                            .copy_from_slice(&pixels[y * sw..(y + 1) * sw]);
                    }
                    resize(&square, side, side, dw, dh, p.filter)
                })
                .collect();
            let s = dw as f64 / side as f64;
            (planes, geometry_of(s, s, ox as f64 * s, oy as f64 * s))
        }
        Fit::Stretch => (
            vec![resize_region(whole, dw, dh)],
            geometry_of(dw as f64 / sw as f64, dh as f64 / sh as f64, 0.0, 0.0),
        ),
        Fit::Pad => {
            let s = (dw as f64 / sw as f64).min(dh as f64 / sh as f64);
            let rw = ((sw as f64 * s).round() as usize).clamp(1, dw);
            let rh = ((sh as f64 * s).round() as usize).clamp(1, dh);
            let (ox, oy) = ((dw - rw) / 2, (dh - rh) / 2);
            let small = resize_region(whole, rw, rh);
            let mut plane = vec![0.0f32; dw * dh];
            for y in 0..rh {
                plane[(y + oy) * dw + ox..(y + oy) * dw + ox + rw]
                    .copy_from_slice(&small[y * rw..(y + 1) * rw]);
            }
            (
                vec![plane],
                geometry_of(
                    rw as f64 / sw as f64,
                    rh as f64 / sh as f64,
                    ox as f64,
                    oy as f64,
                ),
            )
        }
        Fit::CenterCrop => {
            let target = dw as f64 / dh as f64;
            let (cw, ch) = if sw as f64 / sh as f64 > target {
                (((sh as f64 * target).round() as usize).clamp(1, sw), sh)
            } else {
                (sw, ((sw as f64 / target).round() as usize).clamp(1, sh))
            };
            // Same origin as torchxrayvision's XRayCenterCrop (differs from (sw - cw) / 2 by one
            // pixel for some odd sizes).
            let (x0, y0) = (sw / 2 - cw / 2, sh / 2 - ch / 2);
            let (sx, sy) = (dw as f64 / cw as f64, dh as f64 / ch as f64);
            let region = Region {
                x0,
                y0,
                width: cw,
                height: ch,
            };
            (
                vec![resize_region(region, dw, dh)],
                geometry_of(sx, sy, -(x0 as f64) * sx, -(y0 as f64) * sy),
            )
        }
    };
    let data = normalise(&planes, p, max, dw * dh);
    Ok(Prepared {
        width: p.width,
        height: p.height,
        channels: p.channels,
        layout: p.layout,
        data,
        geometry,
    })
}

/// The planes under the recipe's norm, one per output channel (a single plane serves every
/// channel), laid out as it asks; `n` values per plane.
fn normalise(planes: &[Vec<f32>], p: &Preprocess, max: f32, n: usize) -> Vec<f32> {
    let (lo, range) = if p.norm == Norm::MinMax {
        let (lo, hi) = planes
            .iter()
            .flatten()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                (a.min(v), b.max(v))
            });
        (lo, (hi - lo).max(1e-8))
    } else {
        (0.0, 1.0)
    };
    let channels = p.channels as usize;
    let scaled: Vec<Vec<f32>> = (0..channels)
        .map(|c| {
            let f: Box<dyn Fn(f32) -> f32> = match p.norm {
                Norm::None => Box::new(|v| v),
                Norm::Unit => Box::new(move |v| v / max),
                Norm::Byte => Box::new(move |v| v * (255.0 / max)),
                Norm::Xrv => Box::new(move |v| (2.0 * (v / max) - 1.0) * 1024.0),
                Norm::ImageNet | Norm::XrvImageNet => {
                    Box::new(move |v| (v / max - IMAGENET_MEAN[c]) / IMAGENET_STD[c])
                }
                Norm::MinMax => Box::new(move |v| (v - lo) / range),
                Norm::Clip => {
                    Box::new(move |v| ((v as f64 / max as f64 - CLIP_MEAN[c]) / CLIP_STD[c]) as f32)
                }
            };
            planes[c.min(planes.len() - 1)]
                .iter()
                .map(|&v| f(v))
                .collect()
        })
        .collect();
    match (p.layout, channels) {
        (_, 1) | (Layout::Chw, _) => scaled.concat(),
        (Layout::Hwc, _) => {
            let mut out = Vec::with_capacity(n * channels);
            for i in 0..n {
                for ch in &scaled {
                    out.push(ch[i]);
                }
            }
            out
        }
    }
}

/// The fill of [`Fit::PadSquare`] per output channel: the raw value the norm maps to zero,
/// rounded down to a byte of the `max` scale (LLaVA's `tuple(int(x * 255) for x in mean)`).
fn pad_fills(norm: Norm, max: f32, channels: u8) -> Vec<f32> {
    let byte = |mean: f64| ((mean * 255.0).floor() / 255.0 * max as f64) as f32;
    match norm {
        Norm::Clip => CLIP_MEAN[..channels as usize]
            .iter()
            .map(|&m| byte(m))
            .collect(),
        Norm::ImageNet => IMAGENET_MEAN[..channels as usize]
            .iter()
            .map(|&m| byte(m as f64))
            .collect(),
        Norm::Xrv | Norm::XrvImageNet => vec![byte(0.5)],
        Norm::None | Norm::Unit | Norm::Byte | Norm::MinMax => vec![0.0],
    }
}

/// Pillow's resampling kernels ([`resize_pil_u8`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PilKernel {
    /// Triangle, support 1.
    Bilinear,
    /// `a = -0.5`, support 2.
    Bicubic,
}

/// Pillow's 8-bit resampling (`ImagingResample`: support widened by the scale when shrinking,
/// 22-bit fixed-point weights, horizontal pass then vertical, each rounded and clipped to 8
/// bits), so the bytes equal Pillow's exactly.
pub fn resize_pil_u8(
    src: &[u8],
    w: usize,
    h: usize,
    nw: usize,
    nh: usize,
    kernel: PilKernel,
) -> Vec<u8> {
    const PRECISION_BITS: u32 = 32 - 8 - 2;
    let (support_1, filter): (f64, fn(f64) -> f64) = match kernel {
        PilKernel::Bilinear => (1.0, |x: f64| (1.0 - x.abs()).max(0.0)),
        PilKernel::Bicubic => (2.0, |x: f64| {
            let a = -0.5;
            let x = x.abs();
            if x < 1.0 {
                ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
            } else if x < 2.0 {
                (((x - 5.0) * x + 8.0) * x - 4.0) * a
            } else {
                0.0
            }
        }),
    };
    // Per output pixel: first input index and fixed-point weights.
    let coeffs = |in_size: usize, out_size: usize| -> Vec<(usize, Vec<i32>)> {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = support_1 * filterscale;
        (0..out_size)
            .map(|xx| {
                let center = (xx as f64 + 0.5) * scale;
                let ss = 1.0 / filterscale;
                let xmin = ((center - support + 0.5).floor() as i64).max(0) as usize;
                let xmax = ((center + support + 0.5).floor() as i64).min(in_size as i64) as usize;
                let mut k: Vec<f64> = (xmin..xmax)
                    .map(|x| filter((x as f64 - center + 0.5) * ss))
                    .collect();
                let ww: f64 = k.iter().sum();
                if ww != 0.0 {
                    k.iter_mut().for_each(|v| *v /= ww);
                }
                let fixed = k
                    .iter()
                    .map(|v| {
                        let s = v * (1u32 << PRECISION_BITS) as f64;
                        (if s < 0.0 { s - 0.5 } else { s + 0.5 }) as i32
                    })
                    .collect();
                (xmin, fixed)
            })
            .collect()
    };
    fn clip8(v: i64) -> u8 {
        (v >> PRECISION_BITS).clamp(0, 255) as u8
    }
    if w == 0 || h == 0 || nw == 0 || nh == 0 || src.len() < w * h {
        return vec![0; nw * nh];
    }
    let half = 1i64 << (PRECISION_BITS - 1);
    let mut tmp = vec![0u8; nw * h];
    let hc = coeffs(w, nw);
    for y in 0..h {
        for (x, (x0, k)) in hc.iter().enumerate() {
            let mut s = half;
            for (j, &kk) in k.iter().enumerate() {
                s += src[y * w + x0 + j] as i64 * kk as i64;
            }
            tmp[y * nw + x] = clip8(s);
        }
    }
    let vc = coeffs(h, nh);
    let mut out = vec![0u8; nw * nh];
    for (y, (y0, k)) in vc.iter().enumerate() {
        for x in 0..nw {
            let mut s = half;
            for (j, &kk) in k.iter().enumerate() {
                s += tmp[(y0 + j) * nw + x] as i64 * kk as i64;
            }
            out[y * nw + x] = clip8(s);
        }
    }
    out
}

/// Taps of one output sample along one axis.
struct Taps {
    start: usize,
    weights: Vec<f32>,
}

fn taps(n_in: usize, n_out: usize, filter: Filter) -> Vec<Taps> {
    let scale = n_in as f64 / n_out as f64;
    (0..n_out)
        .map(|i| {
            let center = (i as f64 + 0.5) * scale;
            match filter {
                Filter::Nearest => Taps {
                    start: (center.floor() as usize).min(n_in - 1),
                    weights: vec![1.0],
                },
                Filter::Area if scale > 1.0 => {
                    // Overlap of [i*scale, (i+1)*scale) with each source pixel.
                    let (lo, hi) = (i as f64 * scale, (i as f64 + 1.0) * scale);
                    let start = lo.floor() as usize;
                    let end = (hi.ceil() as usize).min(n_in);
                    let weights: Vec<f64> = (start..end)
                        .map(|j| (hi.min(j as f64 + 1.0) - lo.max(j as f64)).max(0.0))
                        .collect();
                    normalised(start, weights)
                }
                // The skimage and Pillow-exact filters never get here: `resize` hands them to
                // `skresize` and `resize_pil_u8`.
                Filter::Bilinear
                | Filter::Area
                | Filter::SkimageLinear
                | Filter::SkimageCubicU8
                | Filter::PilBicubicU8
                | Filter::PilBilinearFixedU8 => {
                    let stretch = scale.max(1.0);
                    let support = stretch;
                    let start = ((center - support + 0.5).floor().max(0.0)) as usize;
                    let end = ((center + support + 0.5).floor() as usize).min(n_in);
                    let weights: Vec<f64> = (start..end)
                        .map(|j| (1.0 - ((j as f64 + 0.5 - center) / stretch).abs()).max(0.0))
                        .collect();
                    normalised(start.min(n_in - 1), weights)
                }
            }
        })
        .collect()
}

fn normalised(start: usize, weights: Vec<f64>) -> Taps {
    let sum: f64 = weights.iter().sum();
    let weights = if sum > 0.0 {
        weights.iter().map(|w| (w / sum) as f32).collect()
    } else {
        vec![1.0]
    };
    Taps { start, weights }
}

/// Resizes one row-major channel of `sw` x `sh` values to `dw` x `dh` (separable: rows
/// first, then columns).
pub fn resize(src: &[f32], sw: usize, sh: usize, dw: usize, dh: usize, filter: Filter) -> Vec<f32> {
    if matches!(filter, Filter::PilBicubicU8 | Filter::PilBilinearFixedU8) {
        // Pillow copies an image resized to its own size.
        if sw == dw && sh == dh {
            return src[..sw * sh].to_vec();
        }
        let bytes: Vec<u8> = src[..sw * sh]
            .iter()
            .map(|v| v.round().clamp(0.0, 255.0) as u8)
            .collect();
        let kernel = if filter == Filter::PilBicubicU8 {
            PilKernel::Bicubic
        } else {
            PilKernel::Bilinear
        };
        return resize_pil_u8(&bytes, sw, sh, dw, dh, kernel)
            .into_iter()
            .map(f32::from)
            .collect();
    }
    if filter == Filter::SkimageCubicU8 {
        return crate::skresize::resize_cubic_mirror(src, sw, sh, dw, dh)
            .iter()
            .map(|v| v.clamp(0.0, 255.0).trunc() as f32)
            .collect();
    }
    if sw == dw && sh == dh {
        return src[..sw * sh].to_vec();
    }
    if filter == Filter::SkimageLinear {
        let whole = Region::whole(sw, sh);
        return crate::skresize::resize_linear_constant(src, sw, whole, dw, dh, 0.0);
    }
    let hx = taps(sw, dw, filter);
    let mut tmp = vec![0.0f32; sh * dw];
    for (row_in, row_out) in src.chunks_exact(sw).take(sh).zip(tmp.chunks_exact_mut(dw)) {
        for (o, t) in row_out.iter_mut().zip(hx.iter()) {
            let window = &row_in[t.start..t.start + t.weights.len()];
            *o = window
                .iter()
                .zip(t.weights.iter())
                .map(|(a, b)| a * b)
                .sum();
        }
    }
    let vy = taps(sh, dh, filter);
    let mut out = vec![0.0f32; dh * dw];
    for (row_out, t) in out.chunks_exact_mut(dw).zip(vy.iter()) {
        for (k, &w) in t.weights.iter().enumerate() {
            let row_in = &tmp[(t.start + k) * dw..(t.start + k + 1) * dw];
            for (o, &v) in row_out.iter_mut().zip(row_in.iter()) {
                *o += w * v;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ImageMeta;

    fn ramp(w: u32, h: u32) -> CxrImage {
        CxrImage {
            width: w,
            height: h,
            pixels: (0..w * h).map(|i| (i % w) as f32).collect(),
            meta: ImageMeta {
                bit_depth: 8,
                width: w,
                height: h,
                ..Default::default()
            },
        }
    }

    #[test]
    fn resize_keeps_constants_and_averages_blocks() {
        let flat = vec![7.0f32; 60];
        for f in [Filter::Bilinear, Filter::Area, Filter::Nearest] {
            assert!(resize(&flat, 10, 6, 4, 3, f)
                .iter()
                .all(|v| (v - 7.0).abs() < 1e-5));
        }
        // 2x2 area averaging of a 4x2 image: exact block means.
        let src = [0.0, 2.0, 4.0, 6.0, 2.0, 4.0, 6.0, 8.0];
        assert_eq!(resize(&src, 4, 2, 2, 1, Filter::Area), vec![2.0, 6.0]);
    }

    #[test]
    fn pad_keeps_aspect_and_maps_back() {
        let img = ramp(200, 100);
        let p = prepare(
            &img,
            &Preprocess::stretch(64, 64).fit(Fit::Pad).norm(Norm::None),
        )
        .unwrap();
        let g = p.geometry;
        assert_eq!((g.scale_x, g.scale_y), (0.32, 0.32));
        assert_eq!(g.offset_y, 16.0);
        // Padding rows are black, the content row is the ramp.
        assert_eq!(p.data[0], 0.0);
        assert!(p.data[32 * 64 + 63] > 190.0);
        let (x, y) = g.to_original(g.to_input(150.0, 40.0).0, g.to_input(150.0, 40.0).1);
        assert!((x - 150.0).abs() < 1e-9 && (y - 40.0).abs() < 1e-9);
    }

    #[test]
    fn center_crop_matches_xrv_square_crop() {
        let img = ramp(300, 100);
        let p = prepare(&img, &Preprocess::xrv(50)).unwrap();
        // The crop is columns 100..200; its left edge maps to input x = 0.
        let (x, _) = p.geometry.to_input(100.0, 0.0);
        assert!(x.abs() < 1e-9);
        let min = p.data.iter().cloned().fold(f32::MAX, f32::min);
        let max = p.data.iter().cloned().fold(f32::MIN, f32::max);
        // Ramp 100..199 of 255 in xrv units.
        assert!(
            min > (2.0 * 99.0 / 255.0 - 1.0) * 1024.0 && max < (2.0 * 200.0 / 255.0 - 1.0) * 1024.0
        );
        // Cropped-away pixels map to nothing.
        let back = p.geometry.map_to_original(&vec![1.0; 2500]);
        assert_eq!(back[10], 0.0);
        assert_eq!(back[150], 1.0);
    }

    #[test]
    fn imagenet_is_three_planes_with_channel_stats() {
        let img = ramp(10, 10);
        let p = prepare(&img, &Preprocess::imagenet(4)).unwrap();
        assert_eq!(p.shape(), [3, 4, 4]);
        // Same pixel, different channel constants.
        assert!((p.data[0] - p.data[16]).abs() > 1e-3);
        let hwc = prepare(&img, &Preprocess::imagenet(4).layout(Layout::Hwc)).unwrap();
        assert_eq!(hwc.data[1], p.data[16]);
        assert!(prepare(&img, &Preprocess::stretch(4, 4).norm(Norm::ImageNet)).is_err());
    }

    #[test]
    fn skimage_cubic_u8_gives_whole_bytes_and_min_max_spans_0_to_1() {
        // A 16-bit ramp: the resize sees it on an 8-bit scale and truncates to whole values.
        let mut img = ramp(40, 30);
        img.pixels.iter_mut().for_each(|v| *v *= 1000.0);
        img.meta.bit_depth = 16;
        let cubic = Preprocess::stretch(16, 16).filter(Filter::SkimageCubicU8);
        let bytes = prepare(&img, &cubic.norm(Norm::Byte)).unwrap();
        assert!(bytes
            .data
            .iter()
            .all(|v| v.fract() == 0.0 && (0.0..=255.0).contains(v)));
        let unit = prepare(&img, &cubic.norm(Norm::MinMax).channels(3)).unwrap();
        let (lo, hi) = unit
            .data
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        assert_eq!((lo, hi), (0.0, 1.0));
        assert_eq!(unit.data[..256], unit.data[256..512]);
        // A flat image does not divide by zero.
        let flat = prepare_values(&[9.0; 100], 10, 10, 255.0, &cubic.norm(Norm::MinMax)).unwrap();
        assert!(flat.data.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn clip_short_side_crop_keeps_the_centre_and_maps_back() {
        // 40x20 -> shortest side 10 (20x10), then the centre 10x10: columns 5..15 of the half.
        let img = ramp(40, 20);
        let clip = Preprocess::stretch(10, 10)
            .filter(Filter::PilBicubicU8)
            .fit(Fit::ShortSideCrop)
            .norm(Norm::Clip)
            .channels(3);
        let p = prepare(&img, &clip).unwrap();
        assert_eq!(p.shape(), [3, 10, 10]);
        let g = p.geometry;
        assert_eq!(
            (g.scale_x, g.scale_y, g.offset_x, g.offset_y),
            (0.5, 0.5, -5.0, 0.0)
        );
        // The input's left edge is original column 10, its right edge column 30.
        assert_eq!(g.to_original(0.0, 0.0), (10.0, 0.0));
        assert_eq!(g.to_original(10.0, 10.0), (30.0, 20.0));
        // Grey in, grey out: the channels differ only by CLIP's per-channel statistics.
        let byte = |c: usize, v: f32| ((v as f64 * CLIP_STD[c] + CLIP_MEAN[c]) * 255.0) as f32;
        for i in 0..100 {
            let (r, b) = (byte(0, p.data[i]), byte(2, p.data[200 + i]));
            assert!(
                (r - b).abs() < 1e-3 && (r - r.round()).abs() < 1e-3,
                "{r} {b}"
            );
        }
        assert!(Preprocess::stretch(10, 12)
            .fit(Fit::ShortSideCrop)
            .validate()
            .is_err());
    }

    #[test]
    fn pad_square_fills_each_channel_with_its_mean_byte() {
        // A white 8x4 image on an 8x8 square: rows 0, 1, 6 and 7 are the fill.
        let img = prepare_values(
            &[255.0; 32],
            8,
            4,
            255.0,
            &Preprocess::stretch(8, 8)
                .filter(Filter::PilBicubicU8)
                .fit(Fit::PadSquare)
                .norm(Norm::Clip)
                .channels(3),
        )
        .unwrap();
        for c in 0..3 {
            let plane = &img.data[c * 64..(c + 1) * 64];
            let fill =
                (((CLIP_MEAN[c] * 255.0).floor() / 255.0 - CLIP_MEAN[c]) / CLIP_STD[c]) as f32;
            let white = ((1.0 - CLIP_MEAN[c]) / CLIP_STD[c]) as f32;
            assert!((plane[0] - fill).abs() < 1e-6 && (plane[63] - fill).abs() < 1e-6);
            assert!((plane[2 * 8] - white).abs() < 1e-6 && (plane[5 * 8 + 7] - white).abs() < 1e-6);
        }
        assert_eq!(img.geometry.to_original(0.0, 2.0), (0.0, 0.0));
        assert_eq!(img.geometry.to_original(8.0, 6.0), (8.0, 4.0));
    }
}
