// The canvas viewer: zoom (wheel, +/-), pan (drag, arrow keys), window/level (on the image's
// own values at full depth when the server sent them, else on the 8-bit rendering), and
// overlays drawn over the image in image coordinates.

const COLORS = ["#00e5ff", "#ff4081", "#ffea00", "#76ff03", "#ff9100", "#d500f9", "#ffffff"];

export class Viewer {
  constructor(canvas) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.base = null; // ImageData of the source rendering, or {width, height} for deep images
    this.deep = null; // {values: Uint16Array, bits} when showing canonical values at full depth
    this.windowed = document.createElement("canvas");
    this.overlays = [];
    this.ww = 255;
    this.wl = 128;
    this.invert = false;
    this.opacity = 0.6;
    this.reset();
    this.bindInput();
  }

  reset() {
    this.scale = 1;
    this.tx = 0;
    this.ty = 0;
    if (this.base) {
      const s = Math.min(this.canvas.width / this.base.width, this.canvas.height / this.base.height);
      this.scale = s;
      this.tx = (this.canvas.width - this.base.width * s) / 2;
      this.ty = (this.canvas.height - this.base.height * s) / 2;
    }
    this.draw();
  }

  /** Shows a decoded image (ImageBitmap or canvas); clears the overlays of the last one. */
  setImage(source) {
    const c = document.createElement("canvas");
    c.width = source.width;
    c.height = source.height;
    const cx = c.getContext("2d");
    cx.drawImage(source, 0, 0);
    this.base = cx.getImageData(0, 0, c.width, c.height);
    this.deep = null;
    this.ww = 255;
    this.wl = 128;
    this.windowed.width = c.width;
    this.windowed.height = c.height;
    this.overlays = [];
    this.applyWindow();
    this.reset();
  }

  /** Shows canonical values (0..2^bits-1) with a window from their min to their max. */
  setDeepImage({ width, height, values, bits }) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const v of values) {
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    if (!(hi >= lo)) [lo, hi] = [0, 2 ** bits - 1];
    this.base = { width, height };
    this.deep = { values, bits };
    this.ww = Math.max(1, hi - lo + 1);
    this.wl = Math.round((lo + hi) / 2);
    this.windowed.width = width;
    this.windowed.height = height;
    this.overlays = [];
    this.applyWindow();
    this.reset();
  }

  /** Largest value of the shown image's own units (255 for the 8-bit rendering). */
  get maxValue() {
    return this.deep ? 2 ** this.deep.bits - 1 : 255;
  }

  setWindow(ww, wl, invert) {
    this.ww = Math.max(1, ww);
    this.wl = wl;
    this.invert = invert;
    this.applyWindow();
    this.draw();
  }

  /** Window/level as a lookup table over every value the image can take. */
  applyWindow() {
    if (!this.base) return;
    const n = this.maxValue + 1;
    const lut = new Uint8ClampedArray(n);
    const lo = this.wl - this.ww / 2;
    for (let v = 0; v < n; v++) {
      let o = ((v - lo) / this.ww) * 255;
      o = Math.min(255, Math.max(0, o));
      lut[v] = this.invert ? 255 - o : o;
    }
    if (this.deep) {
      const { values } = this.deep;
      const out = new ImageData(this.base.width, this.base.height);
      const d = out.data;
      for (let i = 0, j = 0; i < values.length; i++, j += 4) {
        const o = lut[Math.min(n - 1, values[i])];
        d[j] = o;
        d[j + 1] = o;
        d[j + 2] = o;
        d[j + 3] = 255;
      }
      this.windowed.getContext("2d").putImageData(out, 0, 0);
      return;
    }
    const src = this.base.data;
    const out = new ImageData(this.base.width, this.base.height);
    const d = out.data;
    for (let i = 0; i < src.length; i += 4) {
      d[i] = lut[src[i]];
      d[i + 1] = lut[src[i + 1]];
      d[i + 2] = lut[src[i + 2]];
      d[i + 3] = 255;
    }
    this.windowed.getContext("2d").putImageData(out, 0, 0);
  }

  /** Adds an overlay from a PNG bitmap; masks are tinted so that only their inside shows. */
  addOverlay({ id, name, kind, tool, bitmap }) {
    const color = COLORS[this.overlays.length % COLORS.length];
    let layer = bitmap;
    if (kind === "mask") {
      const c = document.createElement("canvas");
      c.width = bitmap.width;
      c.height = bitmap.height;
      const cx = c.getContext("2d");
      cx.drawImage(bitmap, 0, 0);
      const img = cx.getImageData(0, 0, c.width, c.height);
      const [r, g, b] = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
      for (let i = 0; i < img.data.length; i += 4) {
        const inside = img.data[i] > 127 || img.data[i + 1] > 127 || img.data[i + 2] > 127;
        img.data[i] = r;
        img.data[i + 1] = g;
        img.data[i + 2] = b;
        img.data[i + 3] = inside ? 255 : 0;
      }
      cx.putImageData(img, 0, 0);
      layer = c;
    }
    const ov = { id, name, kind, tool, color, layer, visible: true };
    this.overlays.push(ov);
    this.draw();
    return ov;
  }

  setOverlayVisible(id, visible) {
    const ov = this.overlays.find((o) => o.id === id);
    if (ov) ov.visible = visible;
    this.draw();
  }

  setOpacity(a) {
    this.opacity = a;
    this.draw();
  }

  zoom(factor, cx = this.canvas.width / 2, cy = this.canvas.height / 2) {
    const s = Math.min(40, Math.max(0.05, this.scale * factor));
    const f = s / this.scale;
    this.tx = cx - (cx - this.tx) * f;
    this.ty = cy - (cy - this.ty) * f;
    this.scale = s;
    this.draw();
  }

  pan(dx, dy) {
    this.tx += dx;
    this.ty += dy;
    this.draw();
  }

  draw() {
    const { ctx, canvas } = this;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#000";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (!this.base) return;
    ctx.setTransform(this.scale, 0, 0, this.scale, this.tx, this.ty);
    ctx.imageSmoothingEnabled = this.scale < 1;
    ctx.drawImage(this.windowed, 0, 0);
    ctx.globalAlpha = this.opacity;
    for (const ov of this.overlays) {
      // Tool outputs may be at another resolution than the rendering: stretch to the image.
      if (ov.visible) ctx.drawImage(ov.layer, 0, 0, this.base.width, this.base.height);
    }
    ctx.globalAlpha = 1;
  }

  bindInput() {
    const c = this.canvas;
    const toCanvas = (e) => {
      const r = c.getBoundingClientRect();
      return [((e.clientX - r.left) * c.width) / r.width, ((e.clientY - r.top) * c.height) / r.height];
    };
    c.addEventListener("wheel", (e) => {
      e.preventDefault();
      const [x, y] = toCanvas(e);
      this.zoom(e.deltaY < 0 ? 1.15 : 1 / 1.15, x, y);
    }, { passive: false });
    let drag = null;
    c.addEventListener("pointerdown", (e) => {
      drag = toCanvas(e);
      c.setPointerCapture(e.pointerId);
    });
    c.addEventListener("pointermove", (e) => {
      if (!drag) return;
      const p = toCanvas(e);
      this.pan(p[0] - drag[0], p[1] - drag[1]);
      drag = p;
    });
    c.addEventListener("pointerup", () => { drag = null; });
    c.addEventListener("keydown", (e) => {
      const step = 40;
      const keys = {
        ArrowLeft: () => this.pan(step, 0),
        ArrowRight: () => this.pan(-step, 0),
        ArrowUp: () => this.pan(0, step),
        ArrowDown: () => this.pan(0, -step),
        "+": () => this.zoom(1.25),
        "=": () => this.zoom(1.25),
        "-": () => this.zoom(0.8),
        0: () => this.reset(),
      };
      const f = keys[e.key];
      if (f) {
        e.preventDefault();
        f();
      }
    });
  }
}

/** Decodes a grayscale, non-interlaced PNG of 8 or 16 bits into its sample values. The
 * browser's own decoders give 8 bits only, so the server's 16-bit pixels are read here. */
export async function decodeGrayPng(buffer) {
  const bytes = new Uint8Array(buffer);
  const view = new DataView(buffer);
  const sig = [137, 80, 78, 71, 13, 10, 26, 10];
  if (bytes.length < 8 || sig.some((b, i) => bytes[i] !== b)) throw new Error("the pixels are not a PNG");
  let width = 0;
  let height = 0;
  let depth = 0;
  const idat = [];
  for (let p = 8; p + 8 <= bytes.length;) {
    const len = view.getUint32(p);
    const type = String.fromCharCode(...bytes.subarray(p + 4, p + 8));
    const body = bytes.subarray(p + 8, p + 8 + len);
    if (type === "IHDR") {
      width = view.getUint32(p + 8);
      height = view.getUint32(p + 12);
      depth = body[8];
      if (body[9] !== 0 || body[12] !== 0 || (depth !== 8 && depth !== 16)) {
        throw new Error("the pixels are not a plain 8- or 16-bit grayscale PNG");
      }
    } else if (type === "IDAT") {
      idat.push(body);
    } else if (type === "IEND") {
      break;
    }
    p += 12 + len;
  }
  // IDAT is a zlib stream, which is what DecompressionStream calls "deflate".
  const stream = new Blob(idat).stream().pipeThrough(new DecompressionStream("deflate"));
  const raw = new Uint8Array(await new Response(stream).arrayBuffer());
  const bpp = depth / 8;
  const stride = width * bpp;
  if (raw.length < height * (stride + 1)) throw new Error("the pixel PNG is truncated");
  const out = new Uint8Array(height * stride);
  for (let y = 0; y < height; y++) {
    const filter = raw[y * (stride + 1)];
    const src = raw.subarray(y * (stride + 1) + 1, (y + 1) * (stride + 1));
    const row = out.subarray(y * stride, (y + 1) * stride);
    const prev = y > 0 ? out.subarray((y - 1) * stride, y * stride) : null;
    for (let x = 0; x < stride; x++) {
      const a = x >= bpp ? row[x - bpp] : 0;
      const b = prev ? prev[x] : 0;
      const c = prev && x >= bpp ? prev[x - bpp] : 0;
      let pred = 0;
      if (filter === 1) pred = a;
      else if (filter === 2) pred = b;
      else if (filter === 3) pred = (a + b) >> 1;
      else if (filter === 4) {
        const pa = Math.abs(b - c);
        const pb = Math.abs(a - c);
        const pc = Math.abs(a + b - 2 * c);
        pred = pa <= pb && pa <= pc ? a : pb <= pc ? b : c;
      } else if (filter !== 0) throw new Error(`unknown PNG filter ${filter}`);
      row[x] = (src[x] + pred) & 255;
    }
  }
  const values = new Uint16Array(width * height);
  for (let i = 0; i < values.length; i++) {
    values[i] = depth === 16 ? (out[2 * i] << 8) | out[2 * i + 1] : out[i];
  }
  return { width, height, values };
}
