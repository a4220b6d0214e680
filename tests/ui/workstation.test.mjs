// Browser test of the reading workstation (issue 36) at 1440x900: live progress, a run that
// survives a reload, Cancel, the question-length limit, answers bound to their image, DICOM
// corner text and tags, overlay structures in their legend colours with vector labels, mouse
// window/level, presets, zoom readout, a ruler in mm and the shortcut help. Started by
// crates/hilum-server/tests/it/ui_browser.rs (`ui_workstation_in_headless_chromium`), with a
// script LLM whose every run waits 3 s in a `sleep` tool, segments the lungs and answers.
import assert from "node:assert/strict";
import path from "node:path";
import { connect, env, launch, recordErrors } from "./browser.mjs";

const URL_ = env("HILUM_URL");
const TOKEN = env("HILUM_TOKEN");
const IMAGE = env("HILUM_IMAGE");
const DICOM = env("HILUM_DICOM");
const ANSWER = env("HILUM_ANSWER");
const SHOTS = env("HILUM_SCREENSHOTS");

const shot = (page, name) => page.screenshot({ path: path.join(SHOTS, name) });
const text = (page, sel) => page.textContent(sel);

const context = await launch({ width: 1440, height: 900 });
const errors = [];
try {
  const page = context.pages()[0] || await context.newPage();
  // A reload aborts the page's own stream; the browser may log that. Anything else is a fault.
  recordErrors(page, errors, /status of 413|aborted|network error/i);
  page.setDefaultTimeout(30_000);
  await connect(page, URL_, TOKEN);
  await page.setInputFiles("#file", IMAGE);
  await page.waitForSelector("#canvas[data-image]");
  const pngId = await page.getAttribute("#canvas", "data-image");
  const pngName = path.basename(IMAGE);
  assert.match(await text(page, `#images button[data-image="${pngId}"]`), new RegExp(pngName.replace(".", "\\.")));

  // ---- progress from the first second: the timer moves within 1 s of Ask ----
  await page.fill("#question", "Describe this image and show the lungs.");
  await page.click("#ask");
  const asked = Date.now();
  await page.waitForSelector("#run-timer:not([hidden])", { timeout: 1000 });
  const t0 = await text(page, "#run-timer");
  await page.waitForFunction((t) => document.getElementById("run-timer").textContent !== t, t0, { timeout: 1000 });
  assert.ok(Date.now() - asked < 1500, "the timer did not move within 1 s of Ask");
  assert.ok(await page.isVisible("#cancel"), "Cancel is offered while the run goes on");
  await page.waitForFunction(() => /running .*sleep/.test(document.getElementById("run-step").textContent));
  await shot(page, "21-progress.png");
  const sessionId = await page.evaluate(() => sessionStorage.getItem("hilum.session"));
  const runId = await page.getAttribute(".exchange[data-run]", "data-run");
  assert.ok(sessionId && runId, "the page knows its session and run");

  // ---- the page never owns a run: reload mid-run, reattach, the same final answer ----
  await page.reload();
  await page.waitForFunction(() => document.getElementById("token-state").textContent === "Connected.");
  await page.waitForSelector(`.exchange[data-run="${runId}"]`);
  await page.waitForSelector("#run-state[data-done=true]", { timeout: 60_000 });
  assert.equal(await page.getAttribute("#run-state", "data-outcome"), "completed", await text(page, "#run-state"));
  assert.equal((await text(page, `.exchange[data-run="${runId}"] [data-role=answer]`)).trim(), ANSWER);
  const rows = await page.$$eval(".call", (rs) => rs.map((r) => [r.dataset.tool, r.dataset.status]));
  assert.deepEqual(rows.sort(), [["segment_lungs", "ok"], ["sleep", "ok"]], "each tool once, both ok");
  const events = await page.evaluate(async ([s, r, tok]) => {
    const resp = await fetch(`/v1/sessions/${s}/runs/${r}/events`, { headers: { Authorization: `Bearer ${tok}` } });
    return (await resp.json()).events;
  }, [sessionId, runId, TOKEN]);
  const started = events.filter((e) => e.type === "tool_started").map((e) => e.name).sort();
  assert.deepEqual(started, ["segment_lungs", "sleep"], "the server started each tool once");
  // Sessions are titled with their date and first question.
  assert.match(await text(page, `#sessions button[data-session="${sessionId}"]`),
    /^\d{4}-\d{2}-\d{2} \d{2}:\d{2} · Describe this image/);
  // Status and timeline agree: the rounds the status counts are the timeline's.
  const roundsShown = await page.locator(".round").count();
  assert.match(await text(page, "#run-state"), new RegExp(`${roundsShown} rounds?, 2 tool calls`));
  await shot(page, "22-reattached.png");

  // ---- overlays: one layer per structure, legend colour = screen colour, controls in view ----
  const view = await page.evaluate(() => window.hilum.view());
  const structures = view.overlays.filter((o) => o.kind === "structure");
  assert.deepEqual(structures.map((o) => o.key).sort(), ["left_lung", "right_lung"]);
  assert.ok(structures.every((o) => o.visible), "the lung layer is on by default");
  assert.ok(view.overlays.filter((o) => o.kind === "raster").every((o) => !o.visible), "tool PNGs start off");
  for (const cb of await page.$$("#overlay-list input")) {
    const box = await cb.boundingBox();
    assert.ok(box && box.y + box.height <= 900, `overlay control below the fold at 1440x900 (y ${box?.y})`);
  }
  await page.$eval("#opacity", (e) => { e.value = "100"; e.dispatchEvent(new Event("input", { bubbles: true })); });
  for (const o of structures) {
    const legend = await page.$eval(`#overlay-list input[data-structure="${o.key}"] + .swatch`,
      (s) => getComputedStyle(s).backgroundColor);
    const rgb = [1, 3, 5].map((i) => parseInt(o.color.slice(i, i + 2), 16));
    assert.equal(legend, `rgb(${rgb.join(", ")})`, `${o.key}: legend swatch`);
    // Share of the structure's box that shows exactly the legend's colour on the canvas.
    const share = await page.evaluate(([b, c]) => {
      const cv = document.getElementById("canvas");
      const [x0, y0, x1, y1] = b.map(Math.round);
      const d = cv.getContext("2d").getImageData(x0, y0, x1 - x0, y1 - y0).data;
      let hit = 0;
      for (let i = 0; i < d.length; i += 4) if (d[i] === c[0] && d[i + 1] === c[1] && d[i + 2] === c[2]) hit++;
      return hit / (d.length / 4);
    }, [o.box, rgb]);
    assert.ok(share > 0.3, `${o.key}: only ${(share * 100).toFixed(1)}% of its box shows the legend colour`);
  }
  await shot(page, "26-overlay-colours.png");
  await page.$eval("#opacity", (e) => { e.value = "45"; e.dispatchEvent(new Event("input", { bubbles: true })); });
  await page.screenshot({ path: path.join(SHOTS, "ui-answer-overlays.png") });

  // ---- labels are SVG text: the same size and sharpness at 400% ----
  const labelAt = () => page.$$eval("#vector g.label text", (ts) => ts.map((t) => ({
    text: t.textContent, size: t.getAttribute("font-size"), h: t.getBBox().height })));
  const before = await labelAt();
  assert.deepEqual(before.map((l) => l.text).sort(), ["Left lung", "Right lung"]);
  await page.click("#one-to-one");
  assert.equal(await text(page, "#zoom-pct"), "100%");
  while (Number((await text(page, "#zoom-pct")).replace("%", "")) < 400) await page.click("#zoom-in");
  const zoomed = await labelAt();
  assert.equal(zoomed.length, before.length);
  for (let i = 0; i < zoomed.length; i++) {
    assert.equal(zoomed[i].size, before[i].size, "label font size changed with zoom");
    assert.ok(Math.abs(zoomed[i].h - before[i].h) < 1, "label height changed with zoom");
  }
  await shot(page, "27-label-400.png");
  await page.click("#fit");

  // ---- Cancel stops a run ----
  await page.fill("#question", "Describe this image again.");
  await page.click("#ask");
  await page.waitForFunction(() => /running .*sleep/.test(document.getElementById("run-step").textContent));
  await page.click("#cancel");
  await page.waitForSelector("#run-state[data-outcome=cancelled]", { timeout: 10_000 });
  const status = await page.evaluate(async ([s, tok]) => {
    const resp = await fetch(`/v1/sessions/${s}/runs`, { headers: { Authorization: `Bearer ${tok}` } });
    const { runs } = await resp.json();
    return runs[runs.length - 1].status;
  }, [sessionId, TOKEN]);
  assert.equal(status, "cancelled");
  assert.ok(!(await page.isVisible("#cancel")), "Cancel goes away with the run");
  await shot(page, "23-cancelled.png");

  // ---- a 60,000-character question: the limit message, checked before the model ----
  const exchanges = await page.locator(".exchange").count();
  await page.fill("#question", "Is the heart enlarged? ".repeat(2609).slice(0, 60_000));
  await page.click("#ask");
  await page.waitForSelector("#alert:not([hidden])");
  assert.match(await text(page, "#alert-text"), /60,000 characters; the limit is 8,000 characters/);
  assert.equal(await page.locator(".exchange").count(), exchanges, "a refused question is not shown as asked");
  assert.equal((await page.inputValue("#question")).length, 60_000, "the question stays in the box to shorten");
  const refused = await page.evaluate(async ([s, tok]) => {
    const resp = await fetch(`/v1/sessions/${s}/messages`, {
      method: "POST",
      headers: { Authorization: `Bearer ${tok}`, "Content-Type": "application/json" },
      body: JSON.stringify({ question: "x".repeat(60_000), images: [] }),
    });
    return [resp.status, (await resp.json()).error?.message];
  }, [sessionId, TOKEN]);
  assert.equal(refused[0], 413);
  assert.match(refused[1], /limit is 8,000 characters/);
  await shot(page, "24-too-long.png");
  // The session still answers.
  await page.click("#alert-close");
  await page.fill("#question", "Describe the image once more.");
  await page.click("#ask");
  await page.waitForSelector("#run-state[data-outcome=completed]", { timeout: 60_000 });
  const answers = await page.$$eval("[data-role=answer]", (a) => a.map((e) => e.textContent.trim()));
  assert.equal(answers[answers.length - 1], ANSWER);
  await shot(page, "25-follow-up.png");

  // ---- answers stay with their image after another upload; DICOM context ----
  await page.setInputFiles("#file", DICOM);
  await page.waitForFunction((id) => document.getElementById("canvas").dataset.image !== id, pngId);
  const dcmId = await page.getAttribute("#canvas", "data-image");
  const bound = await page.$$eval(".exchange", (xs) => xs.map((x) => [x.dataset.images, x.className,
    x.querySelector(".chip").textContent]));
  for (const [imgs, cls, chip] of bound) {
    assert.equal(imgs, pngId, "an answer moved to another image");
    assert.match(cls, /other-image/);
    assert.equal(chip, pngName);
  }
  await shot(page, "28-answer-bound.png");
  const listed = await text(page, `#images button[data-image="${dcmId}"]`);
  assert.match(listed, /siim_pneumothorax_neg_cr_pa_jpegbaseline\.dcm/);
  assert.match(listed, /1901-01-01 · CR PA/);
  assert.match(await text(page, "#corner-tr"), /1901-01-01/);
  assert.match(await text(page, "#corner-tr"), /\bPA\b/);
  assert.match(await text(page, "#corner-tl"), /ID 16d7f894/);
  assert.match(await text(page, "#corner-br"), /0\.168 × 0\.168 mm\/px/);
  await shot(page, "29-dicom-corners.png");
  await page.screenshot({ path: path.join(SHOTS, "ui-dicom-corners.png") });
  await page.focus("#canvas");
  await page.keyboard.press("t");
  await page.waitForSelector("#tags[open]");
  const studyDate = await page.$$eval('#tags-table tr[data-tag="(0008,0020)"] td', (tds) => tds.map((t) => t.textContent));
  assert.deepEqual(studyDate.slice(2), ["StudyDate", "19010101"]);
  await shot(page, "30-dicom-tags.png");
  await page.keyboard.press("Escape");

  // ---- mouse window/level: the drag changes the display and the readout ----
  const hash = () => page.evaluate(() => {
    const c = document.getElementById("canvas");
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let h = 0;
    for (let i = 0; i < d.length; i += 7) h = (h * 31 + d[i]) >>> 0;
    return h;
  });
  await page.click('.mode[data-mode="wl"]');
  const readout0 = await text(page, "#wl-readout");
  const hash0 = await hash();
  const cbox = await page.locator("#canvas").boundingBox();
  const [cx, cy] = [cbox.x + cbox.width / 2, cbox.y + cbox.height / 2];
  await page.mouse.move(cx, cy);
  await page.mouse.down();
  await page.mouse.move(cx - 120, cy + 60, { steps: 5 });
  await page.mouse.up();
  assert.notEqual(await text(page, "#wl-readout"), readout0, "the drag did not change the W/L readout");
  assert.notEqual(await hash(), hash0, "the drag did not change the display");
  assert.match(await text(page, "#corner-bl"), new RegExp(`${(await text(page, "#wl-readout")).split(",")[0]}`));
  await shot(page, "31-wl-drag.png");
  // Presets: lung differs from the VOI default, which comes back.
  await page.selectOption("#preset", "lung");
  const lung = await text(page, "#wl-readout");
  await page.selectOption("#preset", "default");
  assert.notEqual(lung, await text(page, "#wl-readout"));

  // ---- a ruler on a DICOM with pixel spacing reads mm ----
  await page.click('.mode[data-mode="ruler"]');
  const { scale, spacing } = await page.evaluate(() => window.hilum.view());
  assert.deepEqual(spacing, [0.168, 0.168]);
  await page.mouse.move(cx - 150, cy);
  await page.mouse.down();
  await page.mouse.move(cx + 150, cy + 80, { steps: 5 });
  await page.mouse.up();
  const mm = (Math.hypot(300, 80) / scale) * 0.168;
  const said = await text(page, "#measure");
  const m = said.match(/([\d.]+) mm/);
  assert.ok(m, `the ruler does not read mm: ${said}`);
  assert.ok(Math.abs(Number(m[1]) - mm) < mm * 0.01 + 0.2, `ruler ${m[1]} mm, expected ${mm.toFixed(1)} mm`);
  assert.match(await page.textContent("#vector g.ruler text"), / mm$/);
  await shot(page, "32-ruler-mm.png");
  // Without pixel spacing the ruler says px, and says why.
  await page.click(`#images button[data-image="${pngId}"]`);
  await page.waitForFunction((id) => document.getElementById("canvas").dataset.image === id, pngId);
  await page.mouse.move(cx - 100, cy);
  await page.mouse.down();
  await page.mouse.move(cx + 100, cy, { steps: 3 });
  await page.mouse.up();
  assert.match(await text(page, "#measure"), /px \(no pixel spacing\)/);

  // ---- the shortcuts, listed in a help window ----
  await page.focus("#canvas");
  await page.keyboard.press("?");
  await page.waitForSelector("#help[open]");
  assert.match(await text(page, "#help"), /Window\/level with the mouse/);
  await shot(page, "33-help.png");
  await page.keyboard.press("Escape");

  // ---- a context overflow is a failure, not "Done", and the session still answers ----
  const other = await context.newPage();
  other.on("pageerror", (e) => errors.push(`page error: ${e.message}`));
  await connect(other, env("HILUM_OVERFLOW_URL"), env("HILUM_OVERFLOW_TOKEN"));
  await other.setInputFiles("#file", IMAGE);
  await other.waitForSelector("#canvas[data-image]");
  await other.fill("#question", "Describe this image.");
  await other.click("#ask");
  await other.waitForSelector("#run-state[data-done=true]", { timeout: 30_000 });
  assert.equal(await other.getAttribute("#run-state", "data-outcome"), "failed");
  assert.match(await other.textContent("#run-state"), /^Failed after [\d.]+ s: .*over the model's context/);
  assert.match(await other.textContent("#alert-text"), /over the model's context/);
  await shot(other, "34-context-overflow.png");
  await other.click("#alert-close");
  await other.fill("#question", "Describe this image, briefly.");
  await other.click("#ask");
  await other.waitForSelector("#run-state[data-done=true]", { timeout: 30_000 });
  assert.equal(await other.getAttribute("#run-state", "data-outcome"), "completed", await other.textContent("#run-state"));
  const last = await other.$$eval("[data-role=answer]", (a) => a.map((e) => e.textContent.trim()));
  assert.equal(last[last.length - 1], ANSWER);
  await shot(other, "35-after-overflow.png");
  await other.close();

  assert.deepEqual(errors, [], "browser errors");
  console.log("UI WORKSTATION TEST PASSED");
} catch (e) {
  console.error(e);
  console.error(errors.join("\n"));
  try { await shot(context.pages()[0], "99-workstation-failure.png"); } catch { /* no page */ }
  process.exitCode = 1;
} finally {
  await context.close();
}
