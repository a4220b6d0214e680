// Browser test: the workstation shows what Hilum cannot assess once, with the install command,
// and no failed tool rows for tools that were never offered (issue 34). Started by
// crates/hilum-server/tests/it/ui_browser.rs (`ui_answers_in_headless_chromium`), which runs a
// server with only the lung U-Net installed and a script LLM.
import assert from "node:assert/strict";
import path from "node:path";
import { connect, env, launch, recordErrors } from "./browser.mjs";

const URL_ = env("HILUM_URL");
const TOKEN = env("HILUM_TOKEN");
const IMAGE = env("HILUM_IMAGE");
const SHOTS = env("HILUM_SCREENSHOTS");

const context = await launch({ width: 1440, height: 900 });
const errors = [];
const count = (text, part) => text.split(part).length - 1;
try {
  const page = context.pages()[0] || await context.newPage();
  recordErrors(page, errors);
  page.setDefaultTimeout(30_000);
  await connect(page, URL_, TOKEN);
  await page.setInputFiles("#file", IMAGE);
  await page.waitForSelector("#canvas[data-image]");

  // No installed model covers nodules: Hilum answers itself, the model is never asked.
  await page.fill("#question", "Are there any nodules?");
  await page.press("#question", "Control+Enter");
  await page.waitForSelector("#run-state[data-done=true]", { timeout: 60_000 });
  let answer = await page.textContent("[data-role=answer]");
  assert.match(answer, /I cannot assess nodules: no installed model covers it\./);
  assert.match(answer, /hilum models (fetch|import) densenet121-res224-all/);
  assert.equal(count(answer, "I cannot assess nodules"), 1, answer);
  assert.equal(await page.locator(".call").count(), 0, "no tool rows for a question no tool covers");
  await page.screenshot({ path: path.join(SHOTS, "11-cannot-assess.png"), fullPage: true });

  // Two parts: the lungs are measured; nodules get the line once; nothing fails.
  await page.fill("#question", "How large are the lungs, and are there any nodules?");
  await page.press("#question", "Control+Enter");
  // The second answer streams in first; the final event replaces it with the completed answer.
  await page.waitForFunction(() => {
    const all = document.querySelectorAll("[data-role=answer]");
    return all.length >= 2 && /I cannot assess nodules/.test(all[all.length - 1].textContent)
      && document.getElementById("run-state").dataset.done === "true";
  }, null, { timeout: 60_000 }).catch(async (e) => {
    const texts = await page.$$eval("[data-role=answer]", (els) => els.map((x) => x.textContent));
    throw new Error(`${e.message}; answers: ${JSON.stringify(texts)}; state: ${await page.textContent("#run-state")}`);
  });
  const answers = await page.$$eval("[data-role=answer]", (els) => els.map((e) => e.textContent));
  answer = answers[answers.length - 1];
  assert.equal(count(answer, "I cannot assess nodules"), 1, answer);
  assert.match(answer, /the lungs cover [0-9.]+% of the image/);
  const rows = await page.$$eval(".call", (rs) => rs.map((r) => [r.dataset.tool, r.dataset.status]));
  assert.ok(rows.length > 0 && rows.every(([, s]) => s === "ok"), `tool rows: ${JSON.stringify(rows)}`);
  assert.ok(!rows.some(([t]) => t === "classify_chest_xray"), "a tool never offered has no row");
  assert.equal(await page.locator("[data-role=unanswered]").count(), 1, "the relevance flag is shown");
  await page.screenshot({ path: path.join(SHOTS, "12-two-parts.png"), fullPage: true });

  assert.deepEqual(errors, [], "browser errors");
  console.log("UI ANSWERS TEST PASSED");
} finally {
  await context.close();
}
