// Overlay structures: the fixed colour and name of each anatomical structure (documented in
// docs/ui.md; the legend shows the same colour the viewer fills with), and how a tool's mask
// becomes one layer per structure.

/** One colour per structure, the same in every session and export. Patient's right/left. */
export const STRUCTURE_COLORS = {
  right_lung: "#29b6f6",
  left_lung: "#ffa726",
  lungs: "#26c6da",
  heart: "#ef5350",
  mediastinum: "#ab47bc",
  cardiomediastinum: "#ab47bc",
  trachea: "#66bb6a",
  airways: "#66bb6a",
  spine: "#8d6e63",
  clavicles: "#d4e157",
  aorta: "#ec407a",
  diaphragm: "#5c6bc0",
  region: "#ffee58",
  opacities: "#ffee58",
  tubes: "#bdbdbd",
};

/** For structures not in the table: fixed by name, so a structure keeps its colour. */
const SPARE = ["#7e57c2", "#9ccc65", "#ff7043", "#26a69a", "#78909c"];

export function structureColor(key) {
  if (STRUCTURE_COLORS[key]) return STRUCTURE_COLORS[key];
  let h = 0;
  for (const ch of key) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return SPARE[h % SPARE.length];
}

export function structureLabel(key) {
  const s = key.replace(/_/g, " ");
  return s.charAt(0).toUpperCase() + s.slice(1);
}

/** `heart_mask.png` → `heart`; segment_lungs' `lung_mask.png` holds both lungs. */
export function maskKey(name) {
  return name.replace(/\.png$/i, "").replace(/_mask$/i, "").toLowerCase().replace(/[^a-z0-9]+/g, "_");
}

/** The structures in one mask artifact: [{key, inside(x, y)}] over the mask's own grid.
 * segment_lungs' one mask is split by the tool's own right/left lung boxes (image pixels). */
export function structuresOf(art, tool, data, mask) {
  const { width: mw, height: mh, data: px } = mask;
  const on = (x, y) => px[(y * mw + x) * 4] > 127;
  const key = maskKey(art.name);
  if (tool === "segment_lungs" && key === "lung" && data) {
    const sx = mw / (data.width || mw);
    const sy = mh / (data.height || mh);
    const boxes = [["right_lung", data.right_lung], ["left_lung", data.left_lung]]
      .filter(([, l]) => l && Array.isArray(l.bbox))
      .map(([k, l]) => {
        const [x, y, w, h] = l.bbox;
        return { k, x0: x * sx, y0: y * sy, x1: (x + w) * sx, y1: (y + h) * sy, cx: (x + w / 2) * sx };
      });
    if (boxes.length) {
      const owner = (x, y) => {
        const hit = boxes.filter((b) => x >= b.x0 && x < b.x1 && y >= b.y0 && y < b.y1);
        if (!hit.length) return null;
        return hit.reduce((a, b) => (Math.abs(a.cx - x) <= Math.abs(b.cx - x) ? a : b)).k;
      };
      return boxes.map(({ k }) => ({ key: k, inside: (x, y) => on(x, y) && owner(x, y) === k }));
    }
    return [{ key: "lungs", inside: on }];
  }
  return [{ key, inside: on }];
}
