// What the browser tests share (chat.test.mjs, approval.test.mjs): Debian's chromium through
// playwright-core, fresh pages with their problems collected, logging in, the driver protocol
// (a line `@@<what>` on stdout, answered by a line `done` on stdin once tests/web.rs did it), and
// the check that nothing hostile ran.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { createInterface } from "node:readline";
import { join } from "node:path";
import { chromium } from "playwright-core";

export const URL = process.env.CYRENE_WEB_URL ?? "http://127.0.0.1:8090/";
export const SHOTS = process.env.CYRENE_WEB_SHOTS ?? ".";
export const PASSWORDS = { alice: "pw-alice", bob: "pw-bob", operator: "pw-operator" };
export const WAIT = 45_000; // a condition awaited (make test runs the other tests beside this one)

let browser;
const stdinLines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();

/** Asks the driver (tests/web.rs) to do something and waits until it has. */
export async function driver(what) {
  console.log(`@@${what}`);
  const answer = await stdinLines.next();
  assert.equal(answer.value, "done", `the driver did ${what}`);
}

before(async () => {
  browser = await chromium.launch({
    executablePath: process.env.CYRENE_CHROMIUM ?? "/usr/bin/chromium",
    headless: true,
    // Playwright gives every launch a fresh temporary profile (--user-data-dir) of its own.
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
});

after(async () => {
  await browser?.close();
  process.stdin.destroy();
});

/** The pages open now (a failed scenario shows them). */
const open = new Set();

/** A fresh browser context (no storage shared with other tests) and its page, with the page's
 *  console errors and uncaught exceptions collected. */
export async function newPage(options = {}) {
  const context = await browser.newContext(options);
  const page = await context.newPage();
  open.add(page);
  page.on("close", () => open.delete(page));
  // actions (a click and the navigation it schedules) get as long as awaited conditions
  page.setDefaultTimeout(WAIT);
  page.problems = [];
  page.on("pageerror", (e) => page.problems.push(`pageerror: ${e.message}`));
  page.sockets = 0;
  page.on("websocket", () => (page.sockets += 1));
  return page;
}

export async function logIn(page, who, password = PASSWORDS[who], hash = "") {
  await page.goto(URL + hash);
  await page.getByLabel("Person", { exact: true }).fill(who);
  await page.getByLabel("Password", { exact: true }).fill(password);
  await page.getByRole("button", { name: "Log in" }).click();
}

export async function loggedIn(page, who, hash = "") {
  await logIn(page, who, PASSWORDS[who], hash);
  await page.locator("#app-view").waitFor({ state: "visible", timeout: WAIT });
  if (who !== "operator") {
    await page.waitForFunction(() => /^#\/s\/.+/.test(location.hash), null, { timeout: WAIT });
  }
}

/** A test whose failure leaves a screenshot and the text of every page it had open. */
export function scenario(name, body) {
  test(name, async () => {
    try {
      await body();
    } catch (e) {
      let i = 0;
      for (const page of open) {
        i += 1;
        const shot = join(SHOTS, `failed-${name.slice(0, 30).replace(/\W+/g, "-")}-${i}.png`);
        await page.screenshot({ path: shot }).catch(() => {});
        const text = await page.evaluate(() => document.body.innerText).catch(() => "");
        console.log(`# page ${i} at ${page.url()} (${shot}):\n${text.replace(/^/gm, "#   ")}`);
        await page.context().close().catch(() => {});
      }
      throw e;
    }
  });
}

/** No payload ran, and no element carries an event handler or a javascript: URL. */
export async function inert(page) {
  const found = await page.evaluate(() => {
    const handlers = [];
    for (const e of document.querySelectorAll("*")) {
      for (const a of e.attributes) {
        if (a.name.toLowerCase().startsWith("on")) handlers.push(`${e.tagName} ${a.name}`);
        if (/^\s*javascript:/i.test(a.value)) handlers.push(`${e.tagName} ${a.name}=${a.value}`);
      }
    }
    return {
      pwned: window.__pwned,
      handlers,
      scripts: [...document.scripts].map((s) => s.src || "inline"),
      frames: document.querySelectorAll("iframe, object, embed").length,
    };
  });
  assert.equal(found.pwned, undefined, "no payload ran");
  assert.deepEqual(found.handlers, [], "no event handler or javascript: URL in the page");
  assert.equal(found.frames, 0);
  assert.ok(found.scripts.every((s) => s.endsWith("/app.js") || s === "inline"), String(found.scripts));
  assert.deepEqual(page.problems, []);
}

/** Nothing scrolls sideways at the page's width, and the message box and Send are on screen. */
export async function fitsThePhone(page, width = 375, height = 667) {
  const layout = await page.evaluate(() => {
    const box = document.getElementById("message").getBoundingClientRect();
    const send = document.getElementById("send").getBoundingClientRect();
    return {
      scrollWidth: document.documentElement.scrollWidth,
      bodyWidth: document.body.scrollWidth,
      box: { top: box.top, bottom: box.bottom, left: box.left, right: box.right },
      send: { right: send.right, bottom: send.bottom },
    };
  });
  assert.ok(layout.scrollWidth <= width && layout.bodyWidth <= width, JSON.stringify(layout));
  assert.ok(layout.box.top >= 0 && layout.box.bottom <= height, `message box on screen: ${JSON.stringify(layout)}`);
  assert.ok(layout.send.right <= width && layout.send.bottom <= height, JSON.stringify(layout));
}
