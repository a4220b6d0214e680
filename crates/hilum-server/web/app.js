// The workstation page: token, sessions, images, viewer, question with streamed events,
// timeline, overlays, findings and export. State lives here; the API is in api.js.
import { ApiError, getToken, setToken, getJson, postJson, request, upload, artifactBlob, ask, resume, explainRunError } from "./api.js";
import { Viewer, decodeGrayPng } from "./viewer.js";
import { toMarkdown, toFhir, download } from "./export.js";

const $ = (id) => document.getElementById(id);

const state = {
  sessionId: null,
  images: [],
  imageId: null,
  localFiles: new Map(), // image id -> File, to show PNG/JPEG without a round trip
  run: null,
  lastRun: null,
  wlUnits: "the 8-bit pixels (0–255)",
  busy: false,
};

const viewer = new Viewer($("canvas"));

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
  const { sessions } = await getJson("/v1/sessions");
  const ul = $("sessions");
  ul.replaceChildren();
  for (const s of sessions) {
    const label = s.title || `Session ${new Date(s.created_ms).toLocaleString()}`;
    ul.append(el("li", {}, el("button", {
      type: "button",
      "data-session": s.id,
      "aria-current": s.id === state.sessionId ? "true" : "false",
      text: label,
      onclick: () => guarded(() => openSession(s.id)),
    })));
  }
}

async function newSession(title) {
  const s = await postJson("/v1/sessions", { title });
  state.sessionId = s.id;
  resetWork();
  await loadSessions();
  return s.id;
}

$("new-session").addEventListener("click", () => guarded(() => newSession("")));

function resetWork() {
  $("chat").replaceChildren();
  delete $("chat").dataset.session;
  $("timeline").replaceChildren();
  $("findings").replaceChildren();
  $("findings-empty").hidden = false;
  $("overlay-list").replaceChildren();
  $("overlays-empty").hidden = false;
  viewer.overlays = [];
  viewer.draw();
  state.lastRun = null;
  setExport(false);
}

/** Opens a stored session: its runs are replayed from their stored events. */
async function openSession(id) {
  state.sessionId = id;
  resetWork();
  await loadSessions();
  const { runs } = await getJson(`/v1/sessions/${encodeURIComponent(id)}/runs`);
  for (const r of runs) {
    if (r.images[0] && r.images[0] !== state.imageId) await selectImage(r.images[0]);
    const run = newRun(r.question, r.images);
    const { events } = await getJson(`/v1/sessions/${encodeURIComponent(id)}/runs/${encodeURIComponent(r.id)}/events`);
    for (const ev of events) await onEvent(run, ev);
    if (!run.answer && r.answer) setAnswer(run, r.answer);
    finishRun(run);
    if (r.status === "interrupted") offerResume(run, r.id);
  }
  $("chat").dataset.session = id;
}

// ---------- images ----------

async function loadImages() {
  const { images } = await getJson("/v1/images");
  state.images = images;
  renderImages();
}

function renderImages() {
  const ul = $("images");
  ul.replaceChildren();
  for (const img of state.images) {
    ul.append(el("li", {}, el("button", {
      type: "button",
      "data-image": img.id,
      "aria-current": img.id === state.imageId ? "true" : "false",
      title: img.id,
      text: `${img.format} ${img.width}×${img.height}, ${img.bit_depth}-bit`,
      onclick: () => guarded(() => selectImage(img.id)),
    })));
  }
}

async function handleFile(file) {
  clearError();
  if (!getToken()) throw new ApiError("Enter your API token first (create one with `hilum serve token create`).", 401, "unauthorized");
  $("drop-help").setAttribute("aria-busy", "true");
  try {
    const row = await upload(file);
    state.localFiles.set(row.id, file);
    if (!state.images.some((i) => i.id === row.id)) state.images.unshift(row);
    await selectImage(row.id);
  } finally {
    $("drop-help").removeAttribute("aria-busy");
  }
}

/** Shows an image. Deeper than 8 bits (DICOM, 16-bit PNG): the server's canonical values at
 * full depth, windowed here. Otherwise the browser decodes PNG/JPEG itself; DICOM (and images
 * uploaded in an earlier visit) are rendered to 8 bits by the server's `visualize` tool. */
async function selectImage(id) {
  state.imageId = id;
  renderImages();
  const row = state.images.find((i) => i.id === id);
  const deep = row && row.bit_depth > 8;
  let shownDeep = false;
  if (deep) {
    try {
      const resp = await request(`/v1/images/${encodeURIComponent(id)}/pixels`);
      const bits = Number(resp.headers.get("x-hilum-bit-depth")) || row.bit_depth;
      const px = await decodeGrayPng(await resp.arrayBuffer());
      viewer.setDeepImage({ ...px, bits });
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
    viewer.setImage(bitmap);
  }
  $("viewer-empty").hidden = true;
  $("overlay-list").replaceChildren();
  $("overlays-empty").hidden = false;
  state.wlUnits = shownDeep
    ? `the ${viewer.deep.bits}-bit values (0–${viewer.maxValue})`
    : deep
      ? `the 8-bit rendering shown; this server did not send the ${row.bit_depth}-bit values`
      : "the 8-bit pixels (0–255)";
  syncWindowControls();
  $("canvas").setAttribute("data-image", id);
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

// ---------- viewer controls ----------

$("zoom-in").addEventListener("click", () => viewer.zoom(1.25));
$("zoom-out").addEventListener("click", () => viewer.zoom(0.8));
$("reset-view").addEventListener("click", () => viewer.reset());
const wl = () => {
  viewer.setWindow(Number($("ww").value), Number($("wl").value), $("invert").checked);
  if (state.imageId) updateWindowNote();
};
for (const id of ["ww", "wl", "invert"]) $(id).addEventListener("input", wl);
$("opacity").addEventListener("input", () => viewer.setOpacity(Number($("opacity").value) / 100));

async function addOverlay(art, tool) {
  if (art.media_type !== "image/png") return;
  const bitmap = await createImageBitmap(await artifactBlob(art.url));
  const ov = viewer.addOverlay({ id: art.id, name: art.name, kind: art.kind, tool, bitmap });
  $("overlays-empty").hidden = true;
  const cb = el("input", {
    type: "checkbox", id: `ov-${art.id}`, checked: true, "data-overlay": art.name,
    onchange: (e) => viewer.setOverlayVisible(art.id, e.target.checked),
  });
  $("overlay-list").append(el("li", {},
    cb,
    el("span", { class: "swatch", style: `background:${ov.color}`, "aria-hidden": "true" }),
    el("label", { for: `ov-${art.id}`, text: `${art.name} (${art.kind}, ${tool})` })));
}

// ---------- findings ----------

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

function newRun(question, images) {
  const run = {
    sessionId: state.sessionId, question, images, runId: null, model: null,
    answer: "", calls: [], callById: new Map(), rounds: new Map(), scores: [],
    startedAt: new Date().toISOString(), finishedAt: null, lastT: 0, answerEl: null,
  };
  $("chat").append(el("p", { class: "msg user", text: question }));
  run.answerEl = el("p", { class: "msg assistant", "data-role": "answer", "aria-busy": "true" });
  $("chat").append(run.answerEl);
  return run;
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
      $("run-state").textContent = `Running (${ev.model})…`;
      break;
    case "decision": {
      const r = roundEl(run, ev.round, ev.phase);
      const asked = (ev.tool_calls || []).map((c) => c.name).join(", ");
      r.title.textContent = `Round ${ev.round} · ${ev.phase} · model ${Math.round(ev.llm_ms)} ms` +
        (asked ? ` → ${asked}` : " → answer");
      if (ev.text) r.li.append(el("p", { class: "muted", text: ev.text }));
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
      c.row.classList.remove("running");
      c.row.classList.add(c.ok ? "ok" : "failed");
      c.row.dataset.status = c.ok ? "ok" : "failed";
      c.status.textContent = `${Math.round(ev.ms)} ms`;
      if (c.ok) {
        c.summary = ev.summary;
        c.row.title = ev.summary || "";
        c.artifacts = ev.artifacts || [];
        if (ev.name === "classify_chest_xray") run.scores = showFindings(ev.data);
        for (const a of c.artifacts) {
          try { await addOverlay(a, ev.name); } catch (e) { showError(e); }
        }
      } else {
        c.error = `${ev.kind}: ${ev.error}`;
        c.row.append(el("p", { class: "err", text: explainRunError(`${ev.name} failed (${ev.kind}): ${ev.error}`) }));
      }
      layoutRound(run, r);
      break;
    }
    case "token":
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
      showError(explainRunError(ev.message));
      break;
    case "cancelled":
      $("run-state").textContent = "Cancelled.";
      break;
    case "interrupted":
      run.interrupted = true;
      $("run-state").textContent = "Interrupted: the server stopped before the run finished. Resume continues it.";
      break;
    case "complete":
      $("run-state").textContent = `Done: ${ev.rounds} rounds, ${ev.tool_calls} tool calls, ${Math.round(ev.total_ms)} ms ` +
        `(model ${Math.round(ev.llm_ms)} ms, tools ${Math.round(ev.tool_ms)} ms).`;
      $("run-state").dataset.done = "true";
      break;
    default:
      break; // heartbeat and future event types
  }
}

function finishRun(run) {
  run.finishedAt = new Date().toISOString();
  run.answerEl.removeAttribute("aria-busy");
  if (!run.answer) run.answerEl.textContent = "(no answer)";
  state.lastRun = run;
  setExport(true);
}

/** A stopped run (its server shut down or died) gets a Resume button: the run continues from
 * its last stored step, and tool calls that finished are not run again. */
function offerResume(run, runId) {
  run.answerEl.textContent = "(interrupted)";
  const button = el("button", { type: "button", class: "resume", "data-run": runId, text: "Resume" });
  run.answerEl.after(button);
  button.addEventListener("click", () => guarded(async () => {
    if (state.busy) return;
    state.busy = true;
    button.disabled = true;
    $("ask").disabled = true;
    delete $("run-state").dataset.done;
    run.answerEl.setAttribute("aria-busy", "true");
    run.answerEl.textContent = "";
    run.interrupted = false;
    try {
      await resume(run.sessionId, runId, (ev) => onEvent(run, ev));
      if (!run.interrupted) button.remove();
    } finally {
      button.disabled = false;
      finishRun(run);
      state.busy = false;
      $("ask").disabled = false;
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
    if (!state.sessionId) await newSession(question.slice(0, 60));
    state.busy = true;
    $("ask").disabled = true;
    delete $("run-state").dataset.done;
    const run = newRun(question, [state.imageId]);
    $("question").value = "";
    let refused = false;
    try {
      await ask(state.sessionId, question, [state.imageId], (ev) => onEvent(run, ev));
    } catch (err) {
      refused = !run.runId; // The server said no before a run started: nothing to export.
      throw err;
    } finally {
      if (refused) {
        run.answerEl.removeAttribute("aria-busy");
        run.answerEl.textContent = "(not answered: see the message above)";
        $("run-state").textContent = "";
      } else {
        finishRun(run);
        if (run.interrupted && run.runId) offerResume(run, run.runId);
      }
      state.busy = false;
      $("ask").disabled = false;
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
};

guarded(loadAll);
// Keep `request` referenced for console debugging of raw calls.
window.hilum.request = request;
