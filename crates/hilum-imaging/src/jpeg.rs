//! JPEG through libjpeg-turbo's decoder (the C source bundled in `mozjpeg-sys`, whose decoder
//! is libjpeg-turbo's), with the accurate integer IDCT and fancy upsampling: the settings and
//! the code Pillow (and so skimage and torchxrayvision) decode with, hence the same pixels.
//! The libjpeg calls themselves are in `jpeg_shim.c`, which turns libjpeg's fatal errors into
//! return codes instead of its default `exit()`.

use std::ffi::{c_char, c_int, c_uint, c_ulong, CStr};
use std::ptr::NonNull;

use crate::canonical::check_size;
use crate::ImagingError;

// Links libjpeg-turbo's static library; no Rust item of the crate is used.
extern crate mozjpeg_sys;

/// The opaque decoder state of `jpeg_shim.c`.
#[repr(C)]
struct ShimJpeg {
    _private: [u8; 0],
}

extern "C" {
    fn hilum_jpeg_new() -> *mut ShimJpeg;
    fn hilum_jpeg_free(h: *mut ShimJpeg);
    fn hilum_jpeg_message(h: *const ShimJpeg) -> *const c_char;
    fn hilum_jpeg_read_header(
        h: *mut ShimJpeg,
        data: *const u8,
        len: c_ulong,
        width: *mut c_uint,
        height: *mut c_uint,
        components: *mut c_int,
    ) -> c_int;
    fn hilum_jpeg_read_pixels(h: *mut ShimJpeg, out: *mut u8, out_len: usize) -> c_int;
}

/// Owns one decoder; freeing it also releases libjpeg's memory after an error.
struct Shim(NonNull<ShimJpeg>);

impl Shim {
    fn new() -> Option<Self> {
        // SAFETY: allocates a zeroed state or returns null; no other precondition.
        NonNull::new(unsafe { hilum_jpeg_new() }).map(Shim)
    }

    fn message(&self) -> String {
        // SAFETY: the state lives as long as self; its message buffer is always NUL-terminated
        // (zeroed at allocation, then written by libjpeg's formatter or snprintf).
        let text = unsafe { CStr::from_ptr(hilum_jpeg_message(self.0.as_ptr())) };
        let text = text.to_string_lossy();
        if text.is_empty() {
            "libjpeg failed without a message".into()
        } else {
            text.into_owned()
        }
    }
}

impl Drop for Shim {
    fn drop(&mut self) {
        // SAFETY: the pointer came from hilum_jpeg_new and is freed only here.
        unsafe { hilum_jpeg_free(self.0.as_ptr()) }
    }
}

/// The decoder's own 8-bit samples: gray, or RGB interleaved, rows top to bottom.
#[derive(Debug, Clone, PartialEq)]
pub struct JpegSamples {
    /// Columns.
    pub width: u32,
    /// Rows.
    pub height: u32,
    /// 1 (gray) or 3 (RGB, from YCbCr or RGB files).
    pub channels: u8,
    /// `width * height * channels` samples.
    pub samples: Vec<u8>,
}

/// Decodes JPEG bytes with libjpeg-turbo as Pillow does (`Image.open(f)` then `np.asarray`
/// gives these samples exactly). `Ok(None)`: the file is CMYK/YCCK or another colour space
/// this path does not convert (the caller decodes it another way). The image's size is
/// checked against `max_pixels` from the header, before any pixel buffer exists.
pub fn decode_jpeg_samples(
    bytes: &[u8],
    what: &str,
    max_pixels: u64,
) -> Result<Option<JpegSamples>, ImagingError> {
    let err = |reason: String| ImagingError::Decode {
        what: what.to_string(),
        reason,
    };
    let len = c_ulong::try_from(bytes.len())
        .map_err(|_| err(format!("{} bytes is too long for libjpeg", bytes.len())))?;
    let shim = Shim::new().ok_or_else(|| err("out of memory for the JPEG decoder".into()))?;
    let (mut width, mut height, mut components): (c_uint, c_uint, c_int) = (0, 0, 0);
    // SAFETY: `bytes` outlives `shim` (dropped at the end of this function), and the out
    // pointers are valid locals.
    let rc = unsafe {
        hilum_jpeg_read_header(
            shim.0.as_ptr(),
            bytes.as_ptr(),
            len,
            &mut width,
            &mut height,
            &mut components,
        )
    };
    if rc != 0 {
        return Err(err(shim.message()));
    }
    check_size(what, u64::from(width), u64::from(height), 1, max_pixels)?;
    let channels: u8 = match components {
        1 => 1,
        3 => 3,
        _ => return Ok(None),
    };
    // Within max_pixels (checked above), so this cannot overflow on a 64-bit usize; on 32-bit
    // the checked product refuses what would.
    let len = (width as usize)
        .checked_mul(height as usize)
        .and_then(|n| n.checked_mul(channels as usize))
        .ok_or_else(|| err(format!("{width}x{height} does not fit in memory here")))?;
    let mut samples = vec![0u8; len];
    // SAFETY: `samples` is a writable buffer of exactly `len` bytes; the C side checks that
    // the decoder's output is exactly that size before writing.
    let rc = unsafe { hilum_jpeg_read_pixels(shim.0.as_ptr(), samples.as_mut_ptr(), len) };
    if rc != 0 {
        return Err(err(shim.message()));
    }
    Ok(Some(JpegSamples {
        width,
        height,
        channels,
        samples,
    }))
}
