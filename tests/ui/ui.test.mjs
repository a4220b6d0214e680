// Browser test of the Hilum web UI: headless Debian chromium via playwright-core against a
// server started by crates/hilum-server/tests/it/ui_browser.rs (which passes the environment).
// Run through `cargo test -p hilum-server --test it ui_browser::`; set up with
// scripts/setup_ui_tests.sh.
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { connect, env, launch, recordErrors } from "./browser.mjs";

const URL_ = env("HILUM_URL");
const TOKEN = env("HILUM_TOKEN");
const IMAGE = env("HILUM_IMAGE");
const DICOM = env("HILUM_DICOM");
const NOLLM_URL = env("HILUM_NOLLM_URL");
const NOLLM_TOKEN = env("HILUM_NOLLM_TOKEN");
const ANSWER = env("HILUM_ANSWER");
const LUNGS = process.env.HILUM_EXPECT_LUNGS === "1";
const SHOTS = env("HILUM_SCREENSHOTS");

const shot = (page, name) => page.screenshot({ path: path.join(SHOTS, name), fullPage: true });

/** A fingerprint of the canvas pixels, to see that drawing changed. */
const canvasHash = (page) => page.evaluate(() => {
  const d = document.getElementById("canvas").getContext("2d").getImageData(0, 0, 800, 800).data;
  let h = 0;
  for (let i = 0; i < d.length; i += 7) h = (h * 31 + d[i]) >>> 0;
  return h;
});

const context = await launch({ width: 1500, height: 1000 }, { acceptDownloads: true });
const errors = [];
try {
  const page = context.pages()[0] || await context.newPage();
  // The wrong-token step makes the browser log its 401s; anything else is a fault.
  recordErrors(page, errors, /status of 401/);
  page.setDefaultTimeout(30_000);

  await page.goto(URL_);
  assert.match(await page.title(), /Hilum/);

  // Every form control has a label (keyboard and screen-reader users need them).
  const unlabelled = await page.evaluate(() => [...document.querySelectorAll("input, textarea, select")]
    .filter((e) => e.labels.length === 0 && !e.getAttribute("aria-label")).map((e) => e.id));
  assert.deepEqual(unlabelled, [], "controls without a label");

  // A wrong token: a readable message naming the fix.
  await page.fill("#token", "hlm_wrong");
  await page.press("#token", "Enter");
  await page.waitForSelector("#alert:not([hidden])");
  const alertText = await page.textContent("#alert-text");
  assert.match(alertText, /check your token/);
  assert.match(alertText, /hilum serve token create/);
  await shot(page, "01-bad-token.png");

  // The right token, entered with the keyboard only.
  await page.click("#alert-close");
  await page.fill("#token", TOKEN);
  await page.focus("#token");
  await page.keyboard.press("Tab");
  assert.equal(await page.evaluate(() => document.activeElement.textContent), "Use token");
  await page.keyboard.press("Enter");
  await page.waitForFunction(() => document.getElementById("token-state").textContent === "Connected.");
  assert.equal(await page.evaluate(() => sessionStorage.getItem("hilum.token")), TOKEN);

  // Upload a real radiograph through the file picker.
  const blank = await canvasHash(page);
  await page.setInputFiles("#file", IMAGE);
  await page.waitForSelector("#canvas[data-image]");
  const imageId = await page.getAttribute("#canvas", "data-image");
  assert.match(imageId, /\S{8,}/);
  assert.equal(await page.locator("#images button").count(), 1);
  const shown = await canvasHash(page);
  assert.notEqual(shown, blank, "the image was not drawn");
  await shot(page, "02-uploaded.png");

  // Window/level changes the displayed pixels.
  const setRange = (sel, v) => page.$eval(sel, (e, v) => {
    e.value = v;
    e.dispatchEvent(new Event("input", { bubbles: true }));
  }, v);
  await setRange("#ww", "60");
  assert.notEqual(await canvasHash(page), shown, "window/level did not change the display");
  await setRange("#ww", "255");
  assert.equal(await canvasHash(page), shown, "the full window shows the original pixels");

  // Ask (Ctrl+Enter from the question box) and follow the streamed run.
  await page.fill("#question", "Describe this image and show the lungs.");
  await page.press("#question", "Control+Enter");
  await page.waitForSelector("#run-state[data-done=true]", { timeout: 90_000 });
  const answer = await page.textContent("[data-role=answer]");
  assert.equal(answer.trim(), ANSWER);
  const tools = await page.$$eval(".call", (rows) => rows.map((r) => [r.dataset.tool, r.dataset.status]));
  const expected = [["image_info", "ok"], ["visualize", "ok"], ["image_info", "failed"],
    ["segment_lungs", LUNGS ? "ok" : "failed"]];
  assert.deepEqual(tools.sort(), expected.sort(), "timeline rows");
  const note = await page.textContent(".round .muted");
  assert.match(note, /4 tool calls, up to [2-4] in parallel/);
  assert.match(note, new RegExp(`${LUNGS ? 1 : 2} failed`));
  assert.match(await page.textContent(".call[data-tool=image_info][data-status=failed] .err"), /img_does_not_exist/);
  if (!LUNGS) {
    // The missing model is named with the command that installs it.
    assert.match(await page.textContent(".call[data-tool=segment_lungs] .err"), /hilum models (import|fetch)/);
  }
  const overlayNames = await page.$$eval("#overlay-list input", (cs) => cs.map((c) => c.dataset.overlay));
  assert.ok(overlayNames.includes("visualization.png"), `overlays: ${overlayNames}`);
  if (LUNGS) assert.ok(overlayNames.includes("lung_mask.png"), `overlays: ${overlayNames}`);
  await shot(page, "03-answered.png");

  // Contrast: every visible text against its nearest opaque background, WCAG AA (4.5:1).
  const lowContrast = await page.evaluate(() => {
    const rgb = (c) => (c.match(/[\d.]+/g) || []).map(Number);
    const lum = ([r, g, b]) => {
      const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
      return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
    };
    const bad = [];
    for (const e of document.querySelectorAll("body *")) {
      const own = [...e.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
      if (!own || !e.getClientRects().length || e.closest("[hidden]")) continue;
      let b = e;
      let bg = null;
      while (b) {
        const c = rgb(getComputedStyle(b).backgroundColor);
        if (c.length === 3 || (c.length === 4 && c[3] === 1)) { bg = c; break; }
        b = b.parentElement;
      }
      const fg = rgb(getComputedStyle(e).color);
      const [l1, l2] = [lum(fg), lum(bg || [17, 20, 24])].sort((x, y) => y - x);
      const ratio = (l1 + 0.05) / (l2 + 0.05);
      if (ratio < 4.5) bad.push(`${e.tagName}.${e.className} "${e.textContent.trim().slice(0, 30)}" ${ratio.toFixed(2)}`);
    }
    return bad;
  });
  assert.deepEqual(lowContrast, [], "text below 4.5:1 contrast");

  // Toggle each overlay with the keyboard: the canvas changes; with all off it shows the plain
  // image. Structures of the first segmentation start on, tool PNGs off (issue 36).
  const withOverlays = await canvasHash(page);
  for (const cb of await page.$$("#overlay-list input")) {
    await cb.focus();
    await page.keyboard.press("Space");
  }
  assert.notEqual(await canvasHash(page), withOverlays, "toggling overlays did not change the canvas");
  for (const cb of await page.$$("#overlay-list input:checked")) {
    await cb.focus();
    await page.keyboard.press("Space");
  }
  const without = await canvasHash(page);
  assert.equal(without, shown, "with overlays off the canvas shows the plain image");
  await shot(page, "04-overlay-off.png");
  const first = page.locator("#overlay-list input").first();
  await first.check();
  assert.notEqual(await canvasHash(page), without);

  // Exports carry the answer and its evidence.
  const md = await page.evaluate(() => window.hilum.markdown());
  assert.ok(md.includes(ANSWER) && md.includes("| image_info | ok |"), md);
  const fhir = await page.evaluate(() => window.hilum.fhir());
  assert.equal(fhir.resourceType, "DiagnosticReport");
  assert.equal(fhir.status, "preliminary");
  assert.equal(fhir.conclusion, ANSWER);
  assert.ok(Buffer.from(fhir.presentedForm[0].data, "base64").toString("utf8").includes(ANSWER));
  const [download] = await Promise.all([page.waitForEvent("download"), page.click("#export-fhir")]);
  const saved = path.join(SHOTS, "report.fhir.json");
  await download.saveAs(saved);
  assert.equal(JSON.parse(fs.readFileSync(saved, "utf8")).conclusion, ANSWER);

  // A fresh page: the session list brings the run back (replayed from stored events).
  await page.reload();
  await page.waitForFunction(() => document.getElementById("token-state").textContent === "Connected.");
  assert.equal(await page.locator("#sessions button").count(), 1);
  await page.click("#sessions button");
  await page.waitForSelector("#chat[data-session]");
  assert.equal(await page.locator(".call").count(), expected.length);
  assert.equal((await page.textContent("[data-role=answer]")).trim(), ANSWER);
  await shot(page, "05-session-reopened.png");

  // A DICOM file dropped on the drop zone: the server renders it to 8 bits (visualize) and
  // the viewer says where window/level acts.
  const dcm = fs.readFileSync(DICOM).toString("base64");
  const transfer = await page.evaluateHandle((b64) => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const dt = new DataTransfer();
    dt.items.add(new File([bytes], "chest.dcm", { type: "application/dicom" }));
    return dt;
  }, dcm);
  const before = await canvasHash(page);
  await page.dispatchEvent("#drop", "dragover", { dataTransfer: transfer });
  await page.dispatchEvent("#drop", "drop", { dataTransfer: transfer });
  await page.waitForFunction((id) => {
    const c = document.getElementById("canvas");
    return c.dataset.image && c.dataset.image !== id;
  }, imageId);
  assert.equal(await page.locator("#images button").count(), 2);
  assert.notEqual(await canvasHash(page), before, "the DICOM image was not drawn");
  // Window/level acts on the DICOM's own 10-bit values fetched from the server, not on an
  // 8-bit rendering: the sliders span 0..1023 and narrowing the window changes the canvas.
  assert.match(await page.textContent("#wl-note"), /the 10-bit values \(0–1023\)/);
  assert.equal(await page.getAttribute("#wl", "max"), "1023");
  assert.equal(await page.getAttribute("#ww", "max"), "1024");
  const deepShown = await canvasHash(page);
  const [ww0, wl0] = [await page.inputValue("#ww"), await page.inputValue("#wl")];
  assert.ok(Number(ww0) > 255, `default window ${ww0} should span the 10-bit values`);
  await setRange("#ww", "100");
  const narrow = await canvasHash(page);
  assert.notEqual(narrow, deepShown, "the window width did not change the 10-bit display");
  assert.match(await page.textContent("#wl-note"), /window 100,/);
  await setRange("#wl", String(Number(wl0) + 200));
  assert.notEqual(await canvasHash(page), narrow, "the level did not change the 10-bit display");
  await shot(page, "06-dicom-dropped-windowed.png");
  // Keyboard only: focus the width slider and step it with the arrow keys.
  await page.focus("#ww");
  await page.keyboard.press("ArrowRight");
  assert.equal(await page.inputValue("#ww"), "101");
  await setRange("#ww", ww0);
  await setRange("#wl", wl0);
  assert.equal(await canvasHash(page), deepShown, "the default window did not come back");
  await shot(page, "06-dicom-dropped.png");

  // A server without a reasoning model: asking shows what is missing and how to fix it.
  const bare = await context.newPage();
  bare.on("pageerror", (e) => errors.push(`page error: ${e.message}`));
  await connect(bare, NOLLM_URL, NOLLM_TOKEN);
  await bare.setInputFiles("#file", IMAGE);
  await bare.waitForSelector("#canvas[data-image]");
  await bare.fill("#question", "Is there cardiomegaly?");
  await bare.click("#ask");
  await bare.waitForSelector("#alert:not([hidden])");
  const noLlm = await bare.textContent("#alert-text");
  assert.match(noLlm, /reasoning model is unavailable/);
  assert.match(noLlm, /--llm/);
  assert.ok(await bare.isDisabled("#export-fhir"), "nothing to export after a refused question");
  await shot(bare, "07-no-llm.png");
  await bare.close();

  assert.deepEqual(errors, [], "browser errors");
  console.log(`UI TEST PASSED (lungs: ${LUNGS}; screenshots in ${SHOTS})`);
} catch (e) {
  console.error(e);
  console.error(errors.join("\n"));
  try { await shot(context.pages()[0], "99-failure.png"); } catch { /* no page */ }
  process.exitCode = 1;
} finally {
  await context.close();
}
