// The canvas viewer: zoom (wheel, +/-, fit, 1:1), pan, window/level (slider, mouse drag,
// presets) on the image's own values at full depth when the server sent them, a distance
// ruler calibrated by pixel spacing, and overlays: structures drawn from their masks in fixed
// colours, with labels and measurements in an SVG layer above the canvas (crisp at any zoom,
// never under a mask). Tool PNGs can be shown too, off by default.

import { structureColor, structureLabel } from "./overlays.js";

const SVG = "http://www.w3.org/2000/svg";
const MIN_SCALE = 0.05;
const MAX_SCALE = 40;

/** Presets as fractions of the image's value range [lo, hi] (a radiograph has no Hounsfield
 * scale): where the level sits and how wide the window is. `default` is the DICOM VOI (the
 * canonical values are already windowed by the file's VOI), i.e. the full range. */
export const PRESETS = {
  default: { label: "Default (VOI)", level: 0.5, width: 1 },
  lung: { label: "Lung", level: 0.3, width: 0.6 },
  mediastinum: { label: "Mediastinum", level: 0.65, width: 0.45 },
  bone: { label: "Bone", level: 0.8, width: 0.35 },
};

function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, String(v));
  return e;
}

export class Viewer {
  constructor(canvas, vector) {
    this.canvas = canvas;
    this.vector = vector; // <svg> over the canvas: labels, ruler
    this.ctx = canvas.getContext("2d");
    this.base = null; // ImageData of the source rendering, or {width, height} for deep images
    this.deep = null; // {values: Uint16Array, bits} when showing canonical values at full depth
    this.range = [0, 255]; // the shown image's lowest and highest value
    this.windowed = document.createElement("canvas");
    this.overlays = [];
    this.ww = 255;
    this.wl = 128;
    this.invert = false;
    this.opacity = 0.6;
    this.mode = "pan"; // pan | wl | ruler
    this.spacing = null; // [row mm, col mm]
    this.ruler = null; // {a: [x, y], b: [x, y]} in image pixels
    this.onchange = () => {};
    this.fitToCanvas();
    this.reset();
    this.bindInput();
    new ResizeObserver(() => this.fitToCanvas(true)).observe(canvas);
  }

  /** Keeps the canvas's pixels equal to its size on screen, so that 1:1 is one image pixel
   * per screen pixel and text in the SVG sits where it is drawn. */
  fitToCanvas(redraw = false) {
    const w = Math.max(1, Math.round(this.canvas.clientWidth));
    const h = Math.max(1, Math.round(this.canvas.clientHeight));
    if (w === this.canvas.width && h === this.canvas.height) return;
    this.canvas.width = w;
    this.canvas.height = h;
    this.vector.setAttribute("viewBox", `0 0 ${w} ${h}`);
    if (redraw) this.reset();
  }

  /** Fit: the whole image, centred. */
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

  /** 1:1: one image pixel per screen pixel, about the centre of the view. */
  actualSize() {
    this.zoom(1 / this.scale);
  }

  get zoomPercent() {
    return Math.round(this.scale * 100);
  }

  clearImage() {
    this.overlays = [];
    this.ruler = null;
  }

  /** Shows a decoded image (ImageBitmap or canvas); clears the overlays of the last one. */
  setImage(source, spacing = null) {
    const c = document.createElement("canvas");
    c.width = source.width;
    c.height = source.height;
    const cx = c.getContext("2d");
    cx.drawImage(source, 0, 0);
    this.base = cx.getImageData(0, 0, c.width, c.height);
    this.deep = null;
    this.range = [0, 255];
    this.ww = 255;
    this.wl = 128;
    this.windowed.width = c.width;
    this.windowed.height = c.height;
    this.spacing = spacing;
    this.clearImage();
    this.applyWindow();
    this.reset();
  }

  /** Shows canonical values (0..2^bits-1) with a window from their min to their max. */
  setDeepImage({ width, height, values, bits }, spacing = null) {
    let lo = Infinity;
    let hi = -Infinity;
    for (const v of values) {
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    if (!(hi >= lo)) [lo, hi] = [0, 2 ** bits - 1];
    this.base = { width, height };
    this.deep = { values, bits };
    this.range = [lo, hi];
    this.ww = Math.max(1, hi - lo + 1);
    this.wl = Math.round((lo + hi) / 2);
    this.windowed.width = width;
    this.windowed.height = height;
    this.spacing = spacing;
    this.clearImage();
    this.applyWindow();
    this.reset();
  }

  /** Largest value of the shown image's own units (255 for the 8-bit rendering). */
  get maxValue() {
    return this.deep ? 2 ** this.deep.bits - 1 : 255;
  }

  setWindow(ww, wl, invert = this.invert) {
    this.ww = Math.max(1, Math.round(ww));
    this.wl = Math.round(Math.min(this.maxValue, Math.max(0, wl)));
    this.invert = invert;
    this.applyWindow();
    this.draw();
  }

  preset(name) {
    const p = PRESETS[name];
    if (!p || !this.base) return;
    const [lo, hi] = this.range;
    const span = Math.max(1, hi - lo + 1);
    this.setWindow(span * p.width, lo + span * p.level);
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
    const out = new ImageData(this.base.width, this.base.height);
    const d = out.data;
    if (this.deep) {
      const { values } = this.deep;
      for (let i = 0, j = 0; i < values.length; i++, j += 4) {
        const o = lut[Math.min(n - 1, values[i])];
        d[j] = o;
        d[j + 1] = o;
        d[j + 2] = o;
        d[j + 3] = 255;
      }
    } else {
      const src = this.base.data;
      for (let i = 0; i < src.length; i += 4) {
        d[i] = lut[src[i]];
        d[i + 1] = lut[src[i + 1]];
        d[i + 2] = lut[src[i + 2]];
        d[i + 3] = 255;
      }
    }
    this.windowed.getContext("2d").putImageData(out, 0, 0);
  }

  /** A tool's PNG as it was written (a raster layer). */
  addRaster({ id, name, tool, bitmap, visible }) {
    const ov = { id, name, tool, kind: "raster", color: null, layer: bitmap, visible };
    this.overlays.push(ov);
    this.draw();
    return ov;
  }

  /** A structure from a mask (`inside(x, y)` over a mw×mh grid): filled in its fixed colour,
   * its label drawn by the SVG layer beside its box (image pixels). */
  addStructure({ id, key, tool, mw, mh, inside, visible }) {
    const color = structureColor(key);
    const c = document.createElement("canvas");
    c.width = mw;
    c.height = mh;
    const cx = c.getContext("2d");
    const img = cx.createImageData(mw, mh);
    const [r, g, b] = [1, 3, 5].map((i) => parseInt(color.slice(i, i + 2), 16));
    let [x0, y0, x1, y1] = [Infinity, Infinity, -1, -1];
    for (let y = 0; y < mh; y++) {
      for (let x = 0; x < mw; x++) {
        if (!inside(x, y)) continue;
        const i = (y * mw + x) * 4;
        img.data[i] = r;
        img.data[i + 1] = g;
        img.data[i + 2] = b;
        img.data[i + 3] = 255;
        if (x < x0) x0 = x;
        if (y < y0) y0 = y;
        if (x > x1) x1 = x;
        if (y > y1) y1 = y;
      }
    }
    if (x1 < 0) return null;
    cx.putImageData(img, 0, 0);
    const sx = this.base ? this.base.width / mw : 1;
    const sy = this.base ? this.base.height / mh : 1;
    const ov = {
      id, key, tool, kind: "structure", color, label: structureLabel(key), layer: c, visible,
      box: [x0 * sx, y0 * sy, (x1 + 1) * sx, (y1 + 1) * sy],
    };
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
    const s = Math.min(MAX_SCALE, Math.max(MIN_SCALE, this.scale * factor));
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

  toScreen([x, y]) {
    return [x * this.scale + this.tx, y * this.scale + this.ty];
  }

  toImage([x, y]) {
    return [(x - this.tx) / this.scale, (y - this.ty) / this.scale];
  }

  /** The ruler's length: mm when the pixel spacing is known, else pixels (and says so). */
  rulerText() {
    if (!this.ruler) return "";
    const dx = this.ruler.b[0] - this.ruler.a[0];
    const dy = this.ruler.b[1] - this.ruler.a[1];
    if (this.spacing) {
      const [row, col] = this.spacing;
      return `${Math.hypot(dx * col, dy * row).toFixed(1)} mm`;
    }
    return `${Math.hypot(dx, dy).toFixed(1)} px (no pixel spacing)`;
  }

  draw() {
    const { ctx, canvas } = this;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.fillStyle = "#000";
    ctx.fillRect(0, 0, canvas.width, canvas.height);
    if (this.base) {
      ctx.setTransform(this.scale, 0, 0, this.scale, this.tx, this.ty);
      ctx.imageSmoothingEnabled = this.scale < 1;
      ctx.drawImage(this.windowed, 0, 0);
      ctx.globalAlpha = this.opacity;
      for (const ov of this.overlays) {
        // Masks may be at another resolution than the image: stretch to the image.
        if (ov.visible) ctx.drawImage(ov.layer, 0, 0, this.base.width, this.base.height);
      }
      ctx.globalAlpha = 1;
    }
    this.drawVector();
    this.onchange();
  }

  /** Labels and the ruler in screen pixels: the same crisp text at any zoom. */
  drawVector() {
    const v = this.vector;
    v.replaceChildren();
    if (!this.base) return;
    const placed = [];
    for (const ov of this.overlays) {
      if (ov.kind !== "structure" || !ov.visible) continue;
      const [x0, y0] = this.toScreen([ov.box[0], ov.box[1]]);
      const [x1, y1] = this.toScreen([ov.box[2], ov.box[3]]);
      const w = ov.label.length * 8 + 12;
      // Above the structure's box, else below it: outside the mask, clear of other labels.
      let x = Math.max(2, Math.min(this.canvas.width - w - 2, (x0 + x1) / 2 - w / 2));
      // Clear of the corner text (about 40 px at the top and bottom).
      let y = y0 - 26;
      if (y < 44) y = Math.min(this.canvas.height - 66, y1 + 4);
      while (placed.some((p) => Math.abs(p[1] - y) < 22 && x < p[0] + p[2] && p[0] < x + w)) y += 22;
      placed.push([x, y, w]);
      const g = svg("g", { class: "label", "data-structure": ov.key });
      g.append(svg("rect", { x, y, width: w, height: 20, rx: 3, fill: "#000000cc", stroke: ov.color }));
      const t = svg("text", { x: x + 6, y: y + 14, fill: ov.color, "font-size": 13, "font-family": "system-ui, sans-serif" });
      t.textContent = ov.label;
      g.append(t);
      v.append(g);
    }
    if (this.ruler) {
      const [ax, ay] = this.toScreen(this.ruler.a);
      const [bx, by] = this.toScreen(this.ruler.b);
      const g = svg("g", { class: "ruler" });
      g.append(svg("line", { x1: ax, y1: ay, x2: bx, y2: by, stroke: "#ffee58", "stroke-width": 2 }));
      for (const [x, y] of [[ax, ay], [bx, by]]) g.append(svg("circle", { cx: x, cy: y, r: 3, fill: "#ffee58" }));
      const t = svg("text", { x: bx + 8, y: by - 8, fill: "#ffee58", "font-size": 14, "font-family": "system-ui, sans-serif", stroke: "#000", "stroke-width": 3, "paint-order": "stroke" });
      t.textContent = this.rulerText();
      g.append(t);
      v.append(g);
    }
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
      const p = toCanvas(e);
      // The right button always windows, as on a PACS workstation.
      const mode = e.button === 2 ? "wl" : this.mode;
      drag = { p, mode, ww: this.ww, wl: this.wl, start: p };
      if (mode === "ruler" && this.base) this.ruler = { a: this.toImage(p), b: this.toImage(p) };
      c.setPointerCapture(e.pointerId);
    });
    c.addEventListener("contextmenu", (e) => e.preventDefault());
    c.addEventListener("pointermove", (e) => {
      if (!drag) return;
      const p = toCanvas(e);
      if (drag.mode === "pan") {
        this.pan(p[0] - drag.p[0], p[1] - drag.p[1]);
      } else if (drag.mode === "wl") {
        // Across the view: the whole value range in width (right = wider) and level (down = higher).
        const span = this.range[1] - this.range[0] + 1;
        const dx = (p[0] - drag.start[0]) / c.width;
        const dy = (p[1] - drag.start[1]) / c.height;
        this.setWindow(drag.ww + dx * span, drag.wl + dy * span);
      } else if (drag.mode === "ruler" && this.ruler) {
        this.ruler.b = this.toImage(p);
        this.draw();
      }
      drag.p = p;
    });
    c.addEventListener("pointerup", () => { drag = null; });
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
