/*
 * A small C layer between Hilum (src/jpeg.rs) and libjpeg-turbo's decoder.
 *
 * libjpeg reports a fatal error by calling error_exit, which by default prints and calls
 * exit(). Here error_exit formats the message and longjmps back to the entry point that set
 * the jump, which returns -1; Rust then reads the message and frees the decoder. Doing this in
 * C keeps every libjpeg frame and the setjmp/longjmp pair on one side of the FFI boundary,
 * so it works whatever Rust's panic strategy is.
 */
#include <setjmp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jpeglib.h"
#include "jerror.h"

/* Progressive files can carry thousands of tiny scans, each a full pass over the coefficients:
 * a cheap way to make a small file cost minutes. Real encoders write about ten. */
#define HILUM_MAX_SCANS 1000

struct hilum_error {
  struct jpeg_error_mgr pub; /* first: libjpeg hands back a pointer to it */
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

struct hilum_jpeg {
  struct jpeg_decompress_struct cinfo;
  struct hilum_error err;
  struct jpeg_progress_mgr progress;
  int created; /* jpeg_create_decompress succeeded: destroy must run */
};

static void hilum_error_exit(j_common_ptr cinfo) {
  struct hilum_error *err = (struct hilum_error *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

/* Warnings are level -1. A cut-off file is one (libjpeg pads it with grey and goes on); Pillow
 * refuses such a file, and so does Hilum. Other warnings (stray bytes between markers) are let
 * through as Pillow lets them. Nothing is ever printed. */
static void hilum_emit_message(j_common_ptr cinfo, int msg_level) {
  if (msg_level == -1) {
    cinfo->err->num_warnings++;
    if (cinfo->err->msg_code == JWRN_JPEG_EOF) {
      hilum_error_exit(cinfo);
    }
  }
}

static void hilum_output_message(j_common_ptr cinfo) { (void)cinfo; }

static void hilum_progress(j_common_ptr cinfo) {
  if (cinfo->is_decompressor) {
    j_decompress_ptr d = (j_decompress_ptr)cinfo;
    if (d->input_scan_number > HILUM_MAX_SCANS) {
      struct hilum_error *err = (struct hilum_error *)cinfo->err;
      snprintf(err->message, sizeof err->message,
               "more than %d progressive scans (refused: decoding them could take minutes)",
               HILUM_MAX_SCANS);
      longjmp(err->jump, 1);
    }
  }
}

struct hilum_jpeg *hilum_jpeg_new(void) {
  return (struct hilum_jpeg *)calloc(1, sizeof(struct hilum_jpeg));
}

void hilum_jpeg_free(struct hilum_jpeg *h) {
  if (h == NULL) {
    return;
  }
  if (h->created) {
    jpeg_destroy_decompress(&h->cinfo);
  }
  free(h);
}

const char *hilum_jpeg_message(const struct hilum_jpeg *h) { return h->err.message; }

/*
 * Reads the header of `len` bytes at `data` (which must outlive the decoder) and chooses the
 * output: gray stays gray, YCbCr and RGB become RGB (what Pillow asks libjpeg for), with the
 * accurate integer IDCT and fancy upsampling (Pillow's defaults). `components` is 1 or 3, or 0
 * for CMYK/YCCK and other colour spaces, which this decoder leaves to the caller.
 * Returns 0, or -1 with the reason in hilum_jpeg_message.
 */
int hilum_jpeg_read_header(struct hilum_jpeg *h, const unsigned char *data, unsigned long len,
                           unsigned int *width, unsigned int *height, int *components) {
  h->cinfo.err = jpeg_std_error(&h->err.pub);
  h->err.pub.error_exit = hilum_error_exit;
  h->err.pub.emit_message = hilum_emit_message;
  h->err.pub.output_message = hilum_output_message;
  h->err.message[0] = '\0';
  if (setjmp(h->err.jump)) {
    return -1;
  }
  jpeg_create_decompress(&h->cinfo);
  h->created = 1;
  h->progress.progress_monitor = hilum_progress;
  h->cinfo.progress = &h->progress;
  jpeg_mem_src(&h->cinfo, data, len);
  jpeg_read_header(&h->cinfo, TRUE);

  switch (h->cinfo.jpeg_color_space) {
  case JCS_GRAYSCALE:
    h->cinfo.out_color_space = JCS_GRAYSCALE;
    *components = 1;
    break;
  case JCS_YCbCr:
  case JCS_RGB:
    h->cinfo.out_color_space = JCS_RGB;
    *components = 3;
    break;
  default:
    *components = 0;
    break;
  }
  h->cinfo.dct_method = JDCT_ISLOW;
  h->cinfo.do_fancy_upsampling = TRUE;
  h->cinfo.scale_num = 1;
  h->cinfo.scale_denom = 1;
  *width = h->cinfo.image_width;
  *height = h->cinfo.image_height;
  return 0;
}

/*
 * Decodes the whole image into `out`, rows of width * components bytes, after
 * hilum_jpeg_read_header returned 0 with a non-zero `components`. `out_len` must be exactly
 * width * height * components. Returns 0, or -1 with the reason in hilum_jpeg_message.
 */
int hilum_jpeg_read_pixels(struct hilum_jpeg *h, unsigned char *out, size_t out_len) {
  if (setjmp(h->err.jump)) {
    return -1;
  }
  jpeg_start_decompress(&h->cinfo);
  size_t stride = (size_t)h->cinfo.output_width * (size_t)h->cinfo.output_components;
  if (stride == 0 || out_len / stride != h->cinfo.output_height || out_len % stride != 0) {
    snprintf(h->err.message, sizeof h->err.message,
             "decoder output %ux%ux%d does not fit the %zu-byte buffer", h->cinfo.output_width,
             h->cinfo.output_height, h->cinfo.output_components, out_len);
    return -1;
  }
  while (h->cinfo.output_scanline < h->cinfo.output_height) {
    JSAMPROW row = out + (size_t)h->cinfo.output_scanline * stride;
    /* A memory source never suspends, so no row means something is wrong: stop, not spin. */
    if (jpeg_read_scanlines(&h->cinfo, &row, 1) != 1) {
      snprintf(h->err.message, sizeof h->err.message, "decoder stopped at row %u of %u",
               h->cinfo.output_scanline, h->cinfo.output_height);
      return -1;
    }
  }
  jpeg_finish_decompress(&h->cinfo);
  return 0;
}
