// The canvas viewer: zoom (wheel, +/-), pan (drag, arrow keys), window/level on the displayed
// 8-bit pixels, and overlays drawn over the image in image coordinates.

const COLORS = ["#00e5ff", "#ff4081", "#ffea00", "#76ff03", "#ff9100", "#d500f9", "#ffffff"];

export class Viewer {
  constructor(canvas) {
    this.canvas = canvas;
    this.ctx = canvas.getContext("2d");
    this.base = null; // ImageData of the source rendering
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
    this.windowed.width = c.width;
    this.windowed.height = c.height;
    this.overlays = [];
    this.applyWindow();
    this.reset();
  }

  setWindow(ww, wl, invert) {
    this.ww = Math.max(1, ww);
    this.wl = wl;
    this.invert = invert;
    this.applyWindow();
    this.draw();
  }

  /** Window/level as a lookup table over the 0..255 displayed values. */
  applyWindow() {
    if (!this.base) return;
    const lut = new Uint8ClampedArray(256);
    const lo = this.wl - this.ww / 2;
    for (let v = 0; v < 256; v++) {
      let o = ((v - lo) / this.ww) * 255;
      o = Math.min(255, Math.max(0, o));
      lut[v] = this.invert ? 255 - o : o;
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
