// The workstation page: token, sessions, images with their study context, viewer and its
// tools, question with live progress, timeline, overlays, findings and export. State lives
// here; the API is in api.js, the viewer in viewer.js, the run's events in the section below.
import { ApiError, getToken, setToken, getJson, postJson, request, upload, artifactBlob, ask, resume, follow, cancelRun, explainRunError } from "./api.js";
import { Viewer, decodeGrayPng } from "./viewer.js";
import { structuresOf } from "./overlays.js";
import { toMarkdown, toFhir, download } from "./export.js";

const $ = (id) => document.getElementById(id);

const SESSION_KEY = "hilum.session";
const NAMES_KEY = "hilum.names";

/** File names by image id, kept in this browser only (names may identify a patient). */
function loadNames() {
  try {
    return JSON.parse(localStorage.getItem(NAMES_KEY) || "{}") || {};
  } catch {
    return {};
  }
}

const state = {
  sessionId: null,
  sessions: [],
  images: [],
  imageId: null,
  names: loadNames(),
  info: new Map(), // image id -> GET /v1/images/{id}/info (metadata, study, tags)
  layers: new Map(), // image id -> [{art, tool, data}] the tools' outputs drawn on it
  bitmaps: new Map(), // artifact url -> ImageBitmap
  localFiles: new Map(), // image id -> File, to show PNG/JPEG without a round trip
  active: null, // the run this page is showing live
  lastRun: null,
  wlUnits: "the 8-bit pixels (0–255)",
  busy: false,
};

const viewer = new Viewer($("canvas"), $("vector"));
viewer.onchange = () => updateReadouts();
// ---------- messages ----------

function showError(err) {
  const text = err instanceof ApiError || err instanceof Error ? err.message : String(err);
  $("alert-text").textContent = text;
  $("alert").hidden = false;
}

function clearError() {
  $("alert").hidden = true;
  $("alert-text").textContent = "";
}

$("alert-close").addEventListener("click", clearError);

async function guarded(f) {
  try {
    await f();
  } catch (e) {
    showError(e);
  }
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v; // CSSOM: allowed by the page's CSP
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) if (c != null) e.append(c);
  return e;
}

// ---------- token ----------

$("token").value = getToken();
$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  setToken($("token").value);
  clearError();
  $("token-state").textContent = "Checking…";
  guarded(async () => {
    try {
      await loadAll();
    } catch (err) {
      $("token-state").textContent = "Not connected.";
      throw err;
    }
  });
});

async function loadAll() {
  if (!getToken()) {
    $("token-state").textContent = "Enter a token to start.";
    return;
  }
  await Promise.all([loadSessions(), loadImages()]);
  $("token-state").textContent = "Connected.";
  loadPacsJobs();
  // A reloaded page comes back to its session, and to its run if that is still going.
  const stored = sessionStorage.getItem(SESSION_KEY);
  if (stored && !state.sessionId && state.sessions.some((s) => s.id === stored)) await openSession(stored);
}

// ---------- PACS jobs (issue 35): the DICOM node's studies, their states and runs ----------

async function loadPacsJobs() {
  let jobs = [];
  try {
    ({ jobs } = await getJson("/v1/pacs/jobs"));
  } catch {
    return; // an older server: no panel content
  }
  const ul = $("pacs-jobs");
  ul.replaceChildren();
  $("pacs-empty").hidden = jobs.length > 0;
  for (const j of jobs.slice(0, 20)) {
    const when = new Date(j.updated_ms).toLocaleTimeString();
    const what = `${j.state} · ${j.protocol || "no protocol"} · ${j.instances} image(s) · ${when}`;
    ul.append(el("li", { "data-job": j.id, "data-state": j.state, title: j.detail || "" },
      el("strong", { text: j.state === "failed" ? "Failed" : j.state === "done" ? "Done" : "Working" }),
      el("span", { text: ` ${what}` }),
      el("div", { class: "muted", text: j.detail || "" }),
      j.run_id ? el("button", { type: "button", "data-job-run": j.id, text: "Show run",
        onclick: (e) => guarded(() => showJobRun(j.id, e.target)) }) : el("span", {})));
  }
}

/** The job's run as its tools and answer, under its row. */
async function showJobRun(id, button) {
  const { events } = await getJson(`/v1/pacs/jobs/${encodeURIComponent(id)}/events`);
  const lines = [];
  for (const ev of events) {
    if (ev.type === "tool_finished") lines.push(`✓ ${ev.name}: ${ev.summary}`);
    else if (ev.type === "tool_failed") lines.push(`✗ ${ev.name}: ${ev.error}`);
    else if (ev.type === "final") lines.push(`Answer: ${ev.answer}`);
  }
  button.replaceWith(el("ul", { class: "job-run", "data-job-events": id },
    ...lines.map((t) => el("li", { text: t }))));
}

// ---------- sessions ----------

async function loadSessions() {
  ({ sessions: state.sessions } = await getJson("/v1/sessions"));
  renderSessions();
}

function renderSessions() {
  const ul = $("sessions");
  ul.replaceChildren();
  for (const s of state.sessions) {
    const label = s.title || `Session ${localStamp(new Date(s.created_ms))}`;
    ul.append(el("li", {}, el("button", {
      type: "button",
      "data-session": s.id,
      "aria-current": s.id === state.sessionId ? "true" : "false",
      title: `${label} (started ${new Date(s.created_ms).toLocaleString()})`,
      text: label,
      onclick: () => guarded(() => openSession(s.id)),
    })));
  }
}

/** `2026-12-07 14:05`, local time. */
function localStamp(d) {
  const p = (n) => String(n).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}`;
}

/** A dated title from the first question, unique among this token's sessions. */
function sessionTitle(question) {
  const words = question.replace(/\s+/g, " ").trim();
  const base = `${localStamp(new Date())} · ${words.length > 40 ? `${words.slice(0, 40)}…` : words}`;
  const taken = new Set(state.sessions.map((s) => s.title));
  let title = base;
  for (let n = 2; taken.has(title); n++) title = `${base} (${n})`;
  return title;
}

async function newSession(title) {
  const s = await postJson("/v1/sessions", { title });
  state.sessionId = s.id;
  sessionStorage.setItem(SESSION_KEY, s.id);
  resetWork();
  await loadSessions();
  return s.id;
}

$("new-session").addEventListener("click", () => guarded(() => newSession(sessionTitle("new session"))));

function resetWork() {
  $("chat").replaceChildren();
  delete $("chat").dataset.session;
  $("timeline").replaceChildren();
  $("findings").replaceChildren();
  $("findings-empty").hidden = false;
  state.layers.clear();
  $("overlay-list").replaceChildren();
  $("overlays-empty").hidden = false;
  viewer.overlays = [];
  viewer.draw();
  state.lastRun = null;
  setExport(false);
}

/** Opens a stored session: finished runs are replayed from their stored events; a run still
 * going is followed live from its first event. A newer open stops an older one's replay. */
async function openSession(id) {
  const gen = (state.openGen = (state.openGen || 0) + 1);
  state.sessionId = id;
  sessionStorage.setItem(SESSION_KEY, id);
  resetWork();
  renderSessions();
  const { runs } = await getJson(`/v1/sessions/${encodeURIComponent(id)}/runs`);
  for (const r of runs) {
    if (gen !== state.openGen) return;
    if (r.images[0] && r.images[0] !== state.imageId) await selectImage(r.images[0]);
    if (gen !== state.openGen) return;
    const run = newRun(r.question, r.images);
    run.runId = r.id;
    if (r.status === "running") {
      guarded(() => live(run, () => follow(id, r.id, (ev) => onEvent(run, ev)), Date.now() - r.started_ms));
      continue;
    }
    const { events } = await getJson(`/v1/sessions/${encodeURIComponent(id)}/runs/${encodeURIComponent(r.id)}/events`);
    for (const ev of events) {
      if (gen !== state.openGen) return;
      await onEvent(run, ev);
    }
    if (!run.answer && r.answer) setAnswer(run, r.answer);
    finishRun(run);
    if (r.status === "interrupted") offerResume(run, r.id);
  }
  if (gen === state.openGen) $("chat").dataset.session = id;
}

// ---------- images ----------

async function loadImages() {
  const { images } = await getJson("/v1/images");
  state.images = images;
  renderImages();
  // DICOM rows show their study; the details come from the server, for this screen only.
  await Promise.all(images.filter((i) => i.format === "dicom").slice(0, 30).map((i) => imageInfo(i.id).catch(() => null)));
  renderImages();
}

/** The image's metadata, study context and tags (cached). */
async function imageInfo(id) {
  if (!state.info.has(id)) {
    try {
      state.info.set(id, await getJson(`/v1/images/${encodeURIComponent(id)}/info`));
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) throw e;
      state.info.set(id, null); // an older server: the list shows what it has
    }
  }
  return state.info.get(id);
}

function imageName(id) {
  return state.names[id] || `image ${id.slice(0, 12)}`;
}

/** One line under the name: DICOM study (date, modality, view, patient) or the raster's size. */
function imageLine(img) {
  const st = state.info.get(img.id)?.study;
  if (st) {
    const who = st.patient_initials || st.patient_id;
    return [st.study_date, [st.modality, st.view_position].filter(Boolean).join(" "), who && `pt ${who}`]
      .filter(Boolean).join(" · ");
  }
  return `${img.format.toUpperCase()} ${img.width}×${img.height}, ${img.bit_depth}-bit`;
}

function renderImages() {
  const ul = $("images");
  ul.replaceChildren();
  for (const img of state.images) {
    ul.append(el("li", {}, el("button", {
      type: "button",
      "data-image": img.id,
      "aria-current": img.id === state.imageId ? "true" : "false",
      title: `${imageName(img.id)} (${img.id})`,
      onclick: () => guarded(() => selectImage(img.id)),
    }, el("span", { class: "name", text: imageName(img.id) }), el("span", { class: "meta", text: imageLine(img) }))));
  }
}

async function handleFile(file) {
  clearError();
  if (!getToken()) throw new ApiError("Enter your API token first (create one with `hilum serve token create`).", 401, "unauthorized");
  $("drop-help").setAttribute("aria-busy", "true");
  try {
    const row = await upload(file);
    state.localFiles.set(row.id, file);
    state.names[row.id] = file.name;
    try { localStorage.setItem(NAMES_KEY, JSON.stringify(state.names)); } catch { /* private mode: this visit only */ }
    if (!state.images.some((i) => i.id === row.id)) state.images.unshift(row);
    await selectImage(row.id);
  } finally {
    $("drop-help").removeAttribute("aria-busy");
  }
}

/** Pixel spacing in mm as [row, col] when the file gives a usable one. */
function spacingOf(info) {
  const s = info?.meta?.pixel_spacing_mm;
  return Array.isArray(s) && s[0] > 0 && s[1] > 0 ? s : null;
}

/** Shows an image. Deeper than 8 bits (DICOM, 16-bit PNG): the server's canonical values at
 * full depth, windowed here. Otherwise the browser decodes PNG/JPEG itself; DICOM (and images
 * uploaded in an earlier visit) are rendered to 8 bits by the server's `visualize` tool. */
async function selectImage(id) {
  state.imageId = id;
  renderImages();
  const row = state.images.find((i) => i.id === id);
  const info = await imageInfo(id);
  renderImages(); // with the study now known
  const spacing = spacingOf(info);
  const deep = row && row.bit_depth > 8;
  let shownDeep = false;
  if (deep) {
    try {
      const resp = await request(`/v1/images/${encodeURIComponent(id)}/pixels`);
      const bits = Number(resp.headers.get("x-hilum-bit-depth")) || row.bit_depth;
      const px = await decodeGrayPng(await resp.arrayBuffer());
      viewer.setDeepImage({ ...px, bits }, spacing);
      shownDeep = true;
    } catch (e) {
      if (e instanceof ApiError && e.status === 401) throw e;
      // An older server without the pixels route: fall back to the 8-bit rendering.
    }
  }
  if (!shownDeep) {
    const file = state.localFiles.get(id);
    let bitmap = null;
    if (file && /png|jpe?g/i.test(file.type + file.name) && !/dicom/i.test(row?.format || "")) {
      try {
        bitmap = await createImageBitmap(file);
      } catch {
        bitmap = null; // Fall back to the server's rendering.
      }
    }
    if (!bitmap) {
      const res = await postJson("/v1/tools/visualize:call", { image: id, legend: false });
      const png = (res.artifacts || []).find((a) => a.media_type === "image/png");
      if (!png) throw new Error(`The server could not render image ${id}: ${res.error?.message || "no PNG returned"}`);
      bitmap = await createImageBitmap(await artifactBlob(png.url));
    }
    viewer.setImage(bitmap, spacing);
  }
  $("viewer-empty").hidden = true;
  $("preset").value = "default";
  state.wlUnits = shownDeep
    ? `the ${viewer.deep.bits}-bit values (0–${viewer.maxValue})`
    : deep
      ? `the 8-bit rendering shown; this server did not send the ${row.bit_depth}-bit values`
      : "the 8-bit pixels (0–255)";
  syncWindowControls();
  $("show-tags").disabled = !(info?.tags?.length);
  setCorners(row, info, spacing);
  $("canvas").setAttribute("data-image", id);
  $("overlay-list").replaceChildren();
  $("overlays-empty").hidden = false;
  await showLayers(id);
  markExchanges();
}

/** Corner text, as on a PACS viewer: patient (top left), study (top right), display (bottom
 * left, live), image (bottom right). Shown on this screen only. */
function setCorners(row, info, spacing) {
  const st = info?.study;
  const name = imageName(row?.id || "");
  $("corner-tl").textContent = st
    ? [st.patient_initials ? `Patient ${st.patient_initials}` : null, st.patient_id ? `ID ${st.patient_id}` : null,
      st.patient_sex ? `Sex ${st.patient_sex}` : null].filter(Boolean).join("\n") || "Patient not named"
    : name;
  $("corner-tr").textContent = st
    ? [[st.study_date, st.study_time].filter(Boolean).join(" ") || "No study date",
      [st.modality, st.body_part, st.view_position].filter(Boolean).join(" "),
      st.study_description || null, st.institution || null].filter(Boolean).join("\n")
    : "";
  const size = row ? `${row.width}×${row.height}, ${row.bit_depth}-bit` : "";
  $("corner-br").textContent = [st ? name : null, size,
    spacing ? `${spacing[1]} × ${spacing[0]} mm/px` : "No pixel spacing: lengths in px"].filter(Boolean).join("\n");
  updateReadouts();
}

/** Puts the sliders in the shown image's own units and says what they act on. */
function syncWindowControls() {
  const max = viewer.maxValue;
  const ww = $("ww");
  const wl = $("wl");
  ww.min = "1";
  ww.max = String(max + 1);
  wl.min = "0";
  wl.max = String(max);
  // Step 1 keeps every value reachable; Page Up/Down move by a tenth of the range.
  ww.step = wl.step = "1";
  ww.value = String(viewer.ww);
  wl.value = String(viewer.wl);
  updateWindowNote();
}

function updateWindowNote() {
  $("wl-note").textContent = `Window/level acts on ${state.wlUnits}: window ${viewer.ww}, level ${viewer.wl}.`;
}

/** Zoom, window/level and the ruler's length wherever they are shown. */
function updateReadouts() {
  $("zoom-pct").textContent = `${viewer.zoomPercent}%`;
  const wl = `W ${viewer.ww} / L ${viewer.wl}${viewer.invert ? ", inverted" : ""}`;
  $("wl-readout").textContent = wl;
  $("measure").textContent = viewer.ruler ? `Ruler: ${viewer.rulerText()}` : "";
  $("corner-bl").textContent = viewer.base ? `${wl}\nZoom ${viewer.zoomPercent}%` : "";
  if (state.imageId && ($("ww").value !== String(viewer.ww) || $("wl").value !== String(viewer.wl))) {
    $("ww").value = String(viewer.ww);
    $("wl").value = String(viewer.wl);
    updateWindowNote();
  }
}

const drop = $("drop");
drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", (e) => {
  e.preventDefault();
  drop.classList.remove("over");
  const f = e.dataTransfer?.files?.[0];
  if (f) guarded(() => handleFile(f));
});
drop.addEventListener("keydown", (e) => {
  if (e.key === "Enter" || e.key === " ") { e.preventDefault(); $("file").click(); }
});
$("file").addEventListener("change", (e) => {
  const f = e.target.files?.[0];
  if (f) guarded(() => handleFile(f));
  e.target.value = "";
});

// ---------- viewer tools ----------

function setMode(mode) {
  viewer.mode = mode;
  $("canvas").dataset.mode = mode;
  for (const b of document.querySelectorAll(".mode")) b.setAttribute("aria-pressed", String(b.dataset.mode === mode));
}

for (const b of document.querySelectorAll(".mode")) b.addEventListener("click", () => setMode(b.dataset.mode));
$("zoom-in").addEventListener("click", () => viewer.zoom(1.25));
$("zoom-out").addEventListener("click", () => viewer.zoom(0.8));
$("fit").addEventListener("click", () => viewer.reset());
$("one-to-one").addEventListener("click", () => viewer.actualSize());
$("preset").addEventListener("change", () => viewer.preset($("preset").value));
const wl = () => {
  viewer.setWindow(Number($("ww").value), Number($("wl").value), $("invert").checked);
  if (state.imageId) updateWindowNote();
};
for (const id of ["ww", "wl", "invert"]) $(id).addEventListener("input", wl);
$("opacity").addEventListener("input", () => viewer.setOpacity(Number($("opacity").value) / 100));
$("show-help").addEventListener("click", () => $("help").showModal());
$("show-tags").addEventListener("click", () => showTags());
$("tags-filter").addEventListener("input", () => renderTags());

function showTags() {
  if (!state.info.get(state.imageId)?.tags?.length) return;
  $("tags-filter").value = "";
  renderTags();
  $("tags").showModal();
}

function renderTags() {
  const q = $("tags-filter").value.trim().toLowerCase();
  const rows = (state.info.get(state.imageId)?.tags || [])
    .filter((t) => !q || `${t.tag} ${t.name} ${t.value}`.toLowerCase().includes(q));
  $("tags-table").tBodies[0].replaceChildren(...rows.map((t) => el("tr", { "data-tag": t.tag },
    el("td", { text: t.tag }), el("td", { text: t.vr }), el("td", { text: t.name }), el("td", { text: t.value }))));
}

/** Shortcuts (listed in the help window, `?`), unless typing in a field. */
document.addEventListener("keydown", (e) => {
  if (e.target.closest("input, textarea, select, dialog") || e.ctrlKey || e.metaKey || e.altKey) return;
  const presetKey = (name) => () => { $("preset").value = name; viewer.preset(name); };
  const keys = {
    "?": () => $("help").showModal(),
    p: () => setMode("pan"),
    w: () => setMode("wl"),
    r: () => setMode("ruler"),
    f: () => viewer.reset(),
    0: () => viewer.reset(),
    1: () => viewer.actualSize(),
    "+": () => viewer.zoom(1.25),
    "=": () => viewer.zoom(1.25),
    "-": () => viewer.zoom(0.8),
    5: presetKey("default"),
    6: presetKey("lung"),
    7: presetKey("mediastinum"),
    8: presetKey("bone"),
    i: () => { $("invert").checked = !$("invert").checked; wl(); },
    t: () => showTags(),
    ArrowLeft: () => viewer.pan(40, 0),
    ArrowRight: () => viewer.pan(-40, 0),
    ArrowUp: () => viewer.pan(0, 40),
    ArrowDown: () => viewer.pan(0, -40),
  };
  const f = keys[e.key.length === 1 ? e.key.toLowerCase() : e.key];
  // Arrow keys pan only with the viewer focused (elsewhere they scroll and move focus).
  if (!f || (e.key.startsWith("Arrow") && e.target !== $("canvas"))) return;
  e.preventDefault();
  f();
});

// ---------- overlays ----------

/** Records a tool's outputs against the image they are about, and draws them if it is shown. */
async function addArtifacts(imageId, tool, data, artifacts) {
  const list = state.layers.get(imageId) || [];
  for (const art of artifacts) {
    if (art.media_type !== "image/png" || list.some((l) => l.art.id === art.id)) continue;
    list.push({ art, tool, data });
  }
  state.layers.set(imageId, list);
  if (imageId === state.imageId) await showLayers(imageId);
}

async function bitmapOf(url) {
  if (!state.bitmaps.has(url)) state.bitmaps.set(url, await createImageBitmap(await artifactBlob(url)));
  return state.bitmaps.get(url);
}

/** Draws the image's layers: one per structure from the masks, in fixed colours, and the
 * tools' PNGs. One set of structures (the first segmentation) is on; the rest start off. */
async function showLayers(imageId) {
  const list = state.layers.get(imageId) || [];
  const shown = new Set(viewer.overlays.map((o) => o.id));
  let anyOn = viewer.overlays.some((o) => o.visible);
  for (const { art, tool, data } of list) {
    if (imageId !== state.imageId) return;
    const bitmap = await bitmapOf(art.url);
    if (imageId !== state.imageId) return;
    if (art.kind === "mask") {
      const c = document.createElement("canvas");
      c.width = bitmap.width;
      c.height = bitmap.height;
      const cx = c.getContext("2d");
      cx.drawImage(bitmap, 0, 0);
      const mask = cx.getImageData(0, 0, c.width, c.height);
      const parts = structuresOf(art, tool, data, mask);
      const on = !anyOn;
      for (const { key, inside } of parts) {
        const id = `${art.id}:${key}`;
        if (shown.has(id)) continue;
        const ov = viewer.addStructure({ id, key, tool, mw: mask.width, mh: mask.height, inside, visible: on });
        if (ov) legendRow(ov, art, `${ov.label} (${tool})`);
      }
      anyOn = anyOn || on;
    } else if (!shown.has(art.id)) {
      const ov = viewer.addRaster({ id: art.id, name: art.name, tool, bitmap, visible: false });
      legendRow(ov, art, `${art.name} (tool image, ${tool})`);
    }
  }
}

function legendRow(ov, art, text) {
  $("overlays-empty").hidden = true;
  const safe = ov.id.replace(/[^A-Za-z0-9_-]/g, "_");
  const cb = el("input", {
    type: "checkbox", id: `ov-${safe}`, checked: ov.visible, "data-overlay": art.name,
    "data-structure": ov.kind === "structure" ? ov.key : null,
    onchange: (e) => viewer.setOverlayVisible(ov.id, e.target.checked),
  });
  $("overlay-list").append(el("li", {},
    cb,
    ov.color
      ? el("span", { class: "swatch", style: `background:${ov.color}`, "data-color": ov.color, "aria-hidden": "true" })
      : el("span", { class: "swatch raster", "aria-hidden": "true" }),
    el("label", { for: `ov-${safe}`, text })));
}

// ---------- findings ----------

/** Says what happened to the classifier when there are no scores to show. */
function findingsNote(text) {
  if ($("findings").children.length) return;
  $("findings-empty").textContent = text;
  $("findings-empty").hidden = false;
}

function showFindings(data) {
  const scores = Array.isArray(data?.scores) ? data.scores : [];
  const ul = $("findings");
  ul.replaceChildren();
  $("findings-empty").hidden = scores.length > 0;
  const sorted = [...scores].sort((a, b) => (b.score ?? b.probability ?? 0) - (a.score ?? a.probability ?? 0));
  for (const s of sorted) {
    // Calibrated scores put the operating point at 0.5; raw probabilities at `threshold`.
    const value = s.score ?? s.probability ?? 0;
    const thr = s.score != null ? 0.5 : (s.threshold ?? 0.5);
    const pct = (v) => `${Math.round(Math.min(1, Math.max(0, v)) * 100)}%`;
    ul.append(el("li", { class: `finding${s.positive ? " positive" : ""}` },
      el("span", { class: "label", text: s.label }),
      el("span", {
        class: "scorebar", role: "meter", "aria-valuemin": "0", "aria-valuemax": "1",
        "aria-valuenow": String(value), "aria-label": `${s.label} score, threshold ${thr}`,
      },
      el("span", { class: "fill", style: `width:${pct(value)}` }),
      el("span", { class: "thr", style: `left:${pct(thr)}`, title: `threshold ${thr}` })),
      el("span", { text: `${value.toFixed(2)}${s.positive ? " ▲" : ""}` })));
  }
  return scores;
}

// ---------- runs, timeline ----------

/** A question shown at its length, up to a screenful. */
function shortQuestion(q) {
  return q.length > 600 ? `${q.slice(0, 600)}… (${q.length.toLocaleString()} characters)` : q;
}

function newRun(question, images) {
  const run = {
    sessionId: state.sessionId, question, images, runId: null, model: null,
    answer: "", calls: [], callById: new Map(), rounds: new Map(), scores: [], running: new Map(),
    startedAt: new Date().toISOString(), finishedAt: null, lastT: 0, answerEl: null,
  };
  // The answer is bound to its image(s): named here, and marked when another image is shown.
  const chips = images.map((id) => el("button", {
    type: "button", class: "chip", "data-image": id, title: `Show ${imageName(id)}`,
    text: imageName(id), onclick: () => guarded(() => selectImage(id)),
  }));
  const about = el("p", { class: "about muted" }, el("span", { text: "About " }), ...chips);
  run.answerEl = el("p", { class: "msg assistant", "data-role": "answer", "aria-busy": "true" });
  run.exchange = el("div", { class: "exchange", "data-images": images.join(" ") },
    about, el("p", { class: "msg user", text: shortQuestion(question) }), run.answerEl);
  $("chat").append(run.exchange);
  markExchanges();
  return run;
}

/** Which answers are about the image on screen. */
function markExchanges() {
  for (const ex of document.querySelectorAll(".exchange")) {
    const mine = (ex.dataset.images || "").split(" ").includes(state.imageId);
    ex.classList.toggle("current-image", mine);
    ex.classList.toggle("other-image", !mine);
    ex.title = mine ? "" : "This answer is about another image: click its name to show it.";
  }
}

// ---------- progress ----------

function startProgress(run, elapsedMs = 0) {
  run.t0 = performance.now() - Math.max(0, elapsedMs);
  $("run-timer").hidden = false;
  $("cancel").hidden = false;
  $("cancel").disabled = false;
  const tick = () => { $("run-timer").textContent = `${((performance.now() - run.t0) / 1000).toFixed(1)} s`; };
  tick();
  run.timer = setInterval(tick, 100);
}

function setStep(text) {
  $("run-step").textContent = text;
}

function stopProgress(run) {
  clearInterval(run.timer);
  $("cancel").hidden = true;
  setStep("");
}

function elapsed(run) {
  return `${((performance.now() - (run.t0 ?? performance.now())) / 1000).toFixed(1)} s`;
}

function setAnswer(run, text) {
  run.answer = text;
  run.answerEl.textContent = text;
  $("chat").scrollTop = $("chat").scrollHeight;
}

function roundEl(run, round, phase) {
  let r = run.rounds.get(round);
  if (!r) {
    const title = el("h3", { text: `Round ${round}${phase ? ` · ${phase}` : ""}` });
    const note = el("p", { class: "muted" });
    const calls = el("div", { class: "calls" });
    const li = el("li", { class: "round", "data-round": String(round) }, title, note, calls);
    $("timeline").append(li);
    r = { li, title, note, calls, items: [] };
    run.rounds.set(round, r);
  }
  return r;
}

/** Lays out the round's bars on a shared time axis and says how many ran at once. */
function layoutRound(run, r) {
  if (!r.items.length) return;
  const start = Math.min(...r.items.map((c) => c.start));
  const end = Math.max(...r.items.map((c) => (c.ms != null ? c.start + c.ms : run.lastT)), start + 1);
  const span = end - start;
  const edges = [];
  for (const c of r.items) {
    const cEnd = c.ms != null ? c.start + c.ms : run.lastT;
    c.bar.style.left = `${((c.start - start) / span) * 100}%`;
    c.bar.style.width = `${Math.max(0.5, ((cEnd - c.start) / span) * 100)}%`;
    edges.push([c.start, 1], [cEnd, -1]);
  }
  edges.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  let now = 0;
  let peak = 0;
  for (const [, d] of edges) { now += d; peak = Math.max(peak, now); }
  const n = r.items.length;
  const failed = r.items.filter((c) => c.ok === false).length;
  r.note.textContent = `${n} tool call${n === 1 ? "" : "s"}` +
    (n > 1 ? (peak > 1 ? `, up to ${peak} in parallel` : ", one after another") : "") +
    `, ${span.toFixed(0)} ms` + (failed ? `, ${failed} failed` : "");
}

async function onEvent(run, ev) {
  if (typeof ev.t_ms === "number") run.lastT = Math.max(run.lastT, ev.t_ms);
  switch (ev.type) {
    case "run_started":
      run.runId = ev.run_id;
      run.model = ev.model;
      run.exchange.dataset.run = ev.run_id;
      $("run-state").textContent = `Running (${ev.model})…`;
      setStep("model choosing tools");
      if (run.cancelAsked) cancelRun(run.sessionId, run.runId).catch(showError);
      break;
    case "decision": {
      const r = roundEl(run, ev.round, ev.phase);
      const asked = (ev.tool_calls || []).map((c) => c.name).join(", ");
      r.title.textContent = `Round ${ev.round} · ${ev.phase} · model ${Math.round(ev.llm_ms)} ms` +
        (asked ? ` → ${asked}` : " → answer");
      if (ev.text) r.li.append(el("p", { class: "muted", text: ev.text }));
      setStep(asked ? `running ${asked}` : "writing the answer");
      break;
    }
    case "tool_started": {
      const r = roundEl(run, ev.round);
      const bar = el("span", { class: "bar" });
      const status = el("span", { text: "running" });
      const row = el("div", { class: "call running", "data-tool": ev.name, "data-status": "running" },
        el("code", { text: ev.name }), el("span", { class: "track" }, bar), status);
      r.calls.append(row);
      const c = { name: ev.name, round: ev.round, start: ev.t_ms, ms: null, ok: undefined, row, bar, status, artifacts: [] };
      r.items.push(c);
      run.calls.push(c);
      run.callById.set(ev.call_id, c);
      run.running.set(ev.call_id, ev.name);
      setStep(`running ${[...new Set(run.running.values())].join(", ")}`);
      layoutRound(run, r);
      break;
    }
    case "tool_finished":
    case "tool_failed": {
      let c = run.callById.get(ev.call_id);
      const r = roundEl(run, ev.round);
      if (!c) {
        // Calls refused before they start (invalid arguments) have no tool_started.
        const bar = el("span", { class: "bar" });
        const status = el("span");
        const row = el("div", { class: "call", "data-tool": ev.name },
          el("code", { text: ev.name }), el("span", { class: "track" }, bar), status);
        r.calls.append(row);
        c = { name: ev.name, round: ev.round, start: ev.t_ms - ev.ms, row, bar, status, artifacts: [] };
        r.items.push(c);
        run.calls.push(c);
      }
      c.ms = ev.ms;
      c.ok = ev.type === "tool_finished";
      run.running.delete(ev.call_id);
      setStep(run.running.size ? `running ${[...new Set(run.running.values())].join(", ")}` : "model reading the tool results");
      c.row.classList.remove("running");
      c.row.classList.add(c.ok ? "ok" : "failed");
      c.row.dataset.status = c.ok ? "ok" : "failed";
      c.status.textContent = `${Math.round(ev.ms)} ms`;
      if (c.ok) {
        c.summary = ev.summary;
        c.row.title = ev.summary || "";
        c.artifacts = ev.artifacts || [];
        if (ev.name === "classify_chest_xray") run.scores = showFindings(ev.data);
        try {
          await addArtifacts(run.images[0], ev.name, ev.data, c.artifacts);
        } catch (e) {
          showError(e);
        }
      } else {
        if (ev.name === "classify_chest_xray") findingsNote(`classify_chest_xray failed: ${ev.error}`);
        c.error = `${ev.kind}: ${ev.error}`;
        c.row.append(el("p", { class: "err", text: explainRunError(`${ev.name} failed (${ev.kind}): ${ev.error}`) }));
      }
      layoutRound(run, r);
      break;
    }
    case "token":
      setStep("writing the answer");
      if (!run.streamed) { run.streamed = true; run.answer = ""; }
      setAnswer(run, run.answer + ev.text);
      break;
    case "final":
      setAnswer(run, ev.answer);
      if (ev.grounded === false) {
        // The grounding check (issue 20): the answer quotes what no tool result supports.
        run.answerEl.after(el("div", { class: "msg ungrounded", role: "alert", "data-role": "ungrounded" },
          el("strong", { text: "Not grounded: this answer states what no tool result supports. Check it against the tool results." }),
          el("ul", {}, ...(ev.unsupported || []).map((u) => el("li", { text: u })))));
      }
      if (ev.answers_question === false) {
        // The relevance check (issue 34): the model left out a part; Hilum stated it.
        run.answerEl.after(el("div", { class: "msg ungrounded", role: "note", "data-role": "unanswered" },
          el("strong", { text: `The model's answer left out ${(ev.unanswered || []).join(", ")}: Hilum added what the tool results say.` })));
      }
      break;
    case "error":
      // A failed run (a model error such as a context overflow) is not "Done"; the session
      // stays usable: the next question starts from the runs that completed.
      run.failed = explainRunError(ev.message);
      showError(run.failed);
      $("run-state").textContent = `Failed after ${elapsed(run)}: ${run.failed}`;
      $("run-state").dataset.outcome = "failed";
      $("run-state").dataset.done = "true";
      break;
    case "cancelled":
      run.cancelled = true;
      for (const c of run.calls.filter((c) => c.ok === undefined)) {
        c.row.classList.remove("running");
        c.row.dataset.status = "stopped";
        c.status.textContent = "stopped";
      }
      if (!run.answer) run.answerEl.textContent = "(cancelled)";
      $("run-state").textContent = `Cancelled after ${elapsed(run)}.`;
      $("run-state").dataset.outcome = "cancelled";
      $("run-state").dataset.done = "true";
      break;
    case "interrupted":
      run.interrupted = true;
      $("run-state").textContent = "Interrupted: the server stopped before the run finished. Resume continues it.";
      break;
    case "complete": {
      if (!run.scores.length && !run.calls.some((c) => c.name === "classify_chest_xray")) {
        findingsNote("classify_chest_xray did not run for this question: no classifier scores.");
      }
      if (run.failed) break; // the error said what happened
      // The counts are the timeline's own rows, so the two always agree.
      const rounds = run.rounds.size;
      $("run-state").textContent = `Done in ${(ev.total_ms / 1000).toFixed(1)} s: ${rounds} round${rounds === 1 ? "" : "s"}, ` +
        `${run.calls.length} tool call${run.calls.length === 1 ? "" : "s"} (model ${Math.round(ev.llm_ms)} ms, tools ${Math.round(ev.tool_ms)} ms).`;
      $("run-state").dataset.outcome = "completed";
      $("run-state").dataset.done = "true";
      break;
    }
    default:
      break; // heartbeat and future event types
  }
}

function finishRun(run) {
  run.finishedAt = new Date().toISOString();
  run.answerEl.removeAttribute("aria-busy");
  if (!run.answer) run.answerEl.textContent = run.cancelled ? "(cancelled)" : run.failed ? "(failed: see the status)" : "(no answer)";
  state.lastRun = run;
  setExport(true);
}

/** Shows a run live (asked here, resumed, or followed after a reload) until its stream ends:
 * the timer, the step, Cancel. */
async function live(run, stream, elapsedMs = 0) {
  state.busy = true;
  state.active = run;
  $("ask").disabled = true;
  delete $("run-state").dataset.done;
  delete $("run-state").dataset.outcome;
  startProgress(run, elapsedMs);
  setStep(run.runId ? "following the run" : "reading the question");
  try {
    await stream();
  } finally {
    stopProgress(run);
    if (state.active === run) state.active = null;
    state.busy = false;
    $("ask").disabled = false;
  }
  finishRun(run);
  if (run.interrupted && run.runId) offerResume(run, run.runId);
}

$("cancel").addEventListener("click", () => guarded(async () => {
  const run = state.active;
  if (!run) return;
  $("cancel").disabled = true;
  setStep("cancelling");
  if (run.runId) await cancelRun(run.sessionId, run.runId);
  else run.cancelAsked = true; // sent as soon as the run has an id
}));

/** A stopped run (its server shut down or died) gets a Resume button: the run continues from
 * its last stored step, and tool calls that finished are not run again. */
function offerResume(run, runId) {
  run.answerEl.textContent = "(interrupted)";
  const button = el("button", { type: "button", class: "resume", "data-run": runId, text: "Resume" });
  run.answerEl.after(button);
  button.addEventListener("click", () => guarded(async () => {
    if (state.busy) return;
    button.disabled = true;
    run.answerEl.setAttribute("aria-busy", "true");
    run.answerEl.textContent = "";
    run.interrupted = false;
    try {
      await live(run, () => resume(run.sessionId, runId, (ev) => onEvent(run, ev)));
      if (!run.interrupted) button.remove();
    } finally {
      button.disabled = false;
    }
  }));
}

$("ask-form").addEventListener("submit", (e) => {
  e.preventDefault();
  if (state.busy) return;
  guarded(async () => {
    const question = $("question").value.trim();
    if (!question) return;
    if (!getToken()) throw new ApiError("Enter your API token first (create one with `hilum serve token create`).", 401, "unauthorized");
    if (!state.imageId) throw new Error("Upload or select an image first: the question is about the selected image.");
    clearError();
    if (!state.sessionId) await newSession(sessionTitle(question));
    const run = newRun(question, [state.imageId]);
    $("question").value = "";
    let refused = false;
    try {
      await live(run, async () => {
        try {
          await ask(state.sessionId, question, [state.imageId], (ev) => onEvent(run, ev));
        } catch (err) {
          refused = !run.runId; // The server said no before a run started.
          throw err;
        }
      });
    } finally {
      if (refused) {
        // Nothing happened: no exchange to show, and the question is back in the box to edit.
        run.exchange.remove();
        $("question").value = question;
        $("run-state").textContent = "";
        setExport(Boolean(state.lastRun));
      }
    }
  });
});
$("question").addEventListener("keydown", (e) => {
  // Ctrl/Cmd+Enter asks; Enter alone makes a new line.
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    $("ask-form").requestSubmit();
  }
});

// ---------- export ----------

function setExport(on) {
  $("export-md").disabled = !on;
  $("export-fhir").disabled = !on;
}

$("export-md").addEventListener("click", () => {
  if (state.lastRun) download(`hilum-${state.lastRun.runId || "report"}.md`, "text/markdown", toMarkdown(state.lastRun));
});
$("export-fhir").addEventListener("click", () => {
  if (state.lastRun) {
    download(`hilum-${state.lastRun.runId || "report"}.fhir.json`, "application/fhir+json",
      JSON.stringify(toFhir(state.lastRun), null, 2));
  }
});

// For the browser tests and the console: the last run's exports without a download.
window.hilum = {
  markdown: () => (state.lastRun ? toMarkdown(state.lastRun) : null),
  fhir: () => (state.lastRun ? toFhir(state.lastRun) : null),
  /** The view and its layers in screen pixels (for tests and the console). */
  view: () => ({
    scale: viewer.scale,
    spacing: viewer.spacing,
    overlays: viewer.overlays.map((o) => ({
      id: o.id, key: o.key, kind: o.kind, color: o.color, visible: o.visible,
      box: o.box && [...viewer.toScreen([o.box[0], o.box[1]]), ...viewer.toScreen([o.box[2], o.box[3]])],
    })),
  }),
};

guarded(loadAll);
// Keep `request` referenced for console debugging of raw calls.
window.hilum.request = request;
