// What the browser tests share: their environment from crates/hilum-server/tests/it/ui_browser.rs,
// one headless Chromium, pages that record their errors, and connecting with a token.
import { chromium } from "playwright-core";
import fs from "node:fs";

/** A variable the Rust side sets; missing means the test was not started through cargo. */
export const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set: run this through cargo test -p hilum-server --test it ui_browser::`);
  return v;
};

/** Headless Chromium with its own profile in HILUM_PROFILE. */
export const launch = (viewport, extra = {}) => {
  const profile = env("HILUM_PROFILE");
  fs.mkdirSync(profile, { recursive: true });
  return chromium.launchPersistentContext(profile, {
    executablePath: process.env.HILUM_CHROMIUM || "/usr/bin/chromium",
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    viewport,
    // The page's CSP forbids eval; Playwright's waitForFunction needs it (test only).
    bypassCSP: true,
    ...extra,
  });
};

/** Page errors, and console errors except those `expected` matches, go into `errors`. */
export const recordErrors = (page, errors, expected = null) => {
  page.on("pageerror", (e) => errors.push(`page error: ${e.message}`));
  page.on("console", (m) => {
    if (m.type() === "error" && !(expected && expected.test(m.text()))) errors.push(`console: ${m.text()}`);
  });
};

/** Opens `url` and connects with `token`, waiting until the page says so. */
export const connect = async (page, url, token) => {
  await page.goto(url);
  await page.fill("#token", token);
  await page.press("#token", "Enter");
  await page.waitForFunction(() => document.getElementById("token-state").textContent === "Connected.");
};
