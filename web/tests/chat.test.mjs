// The web chat in a real headless Chromium (docs/web.md, "Tests"). Run by tests/web.rs, which
// starts the stack (nats-server with the shipped users and websocket block, `cyrene up` serving
// the page) and passes:
//   CYRENE_WEB_URL     the page, as `cyrene up` printed it
//   CYRENE_CHROMIUM    Debian's chromium (Playwright's own browser download is not used)
//   CYRENE_WEB_SHOTS   where the screenshots go
// The script asks its driver to stop and start nats-server by printing `@@kill-nats` /
// `@@start-nats` and waits for a line on stdin. Tests run in order and share the stack.
import assert from "node:assert/strict";
import { join } from "node:path";
import { URL, SHOTS, PASSWORDS, WAIT, driver, newPage, logIn, loggedIn, scenario, inert, fitsThePhone } from "./browser.mjs";

async function sendMessage(page, text) {
  const box = page.getByLabel("Message", { exact: true });
  await box.fill(text);
  await box.press("Enter");
}

/** The turn container whose answer contains `text`, once its answer is final. */
async function answered(page, text) {
  const turn = page.locator(".turn", { has: page.locator('.answer[data-final="true"]', { hasText: text }) });
  await turn.first().waitFor({ timeout: WAIT });
  return turn.first();
}

/** How many elements match `selector` in the page now. */
const countOf = (page, selector) => page.locator(selector).count();

/** Waits until more than `before` elements match `selector`. */
async function moreThan(page, selector, before) {
  await page.waitForFunction(([sel, n]) => document.querySelectorAll(sel).length > n, [selector, before], { timeout: WAIT });
}

const FINAL = '.answer[data-final="true"]';

let aliceSession = "";

scenario("alice logs in (a wrong password is refused once), sends, and sees the answer stream in", async () => {
  const page = await newPage();
  await logIn(page, "alice", "not-her-password");
  await page.getByText("wrong person or password").waitFor({ timeout: WAIT });
  // one connection attempt for one click: no retry storm
  await page.waitForTimeout(1500);
  assert.equal(page.sockets, 1, "one WebSocket for one click");
  assert.equal(await page.locator("#app-view").isVisible(), false);

  await page.getByLabel("Password", { exact: true }).fill(PASSWORDS.alice);
  await page.getByRole("button", { name: "Log in" }).click();
  await page.waitForFunction(() => /^#\/s\/.+/.test(location.hash), null, { timeout: WAIT });
  aliceSession = new globalThis.URL(page.url()).hash;
  assert.match(aliceSession, /^#\/s\/w[0-9a-z]+$/, "a new session, named by the page, is open");
  assert.equal(await page.getByRole("log").count(), 1, "the transcript is role=log");

  await sendMessage(page, "hello **there**");
  await page.locator(".msg.user", { hasText: "hello **there**" }).waitFor({ timeout: WAIT });
  const turn = await answered(page, "You said: hello");
  // the answer's Markdown is rendered (by marked, sanitised by DOMPurify)
  assert.equal(await turn.locator(".answer strong").innerText(), "there");
  const pieces = Number(await turn.getAttribute("data-deltas"));
  assert.ok(pieces > 1, `the answer streamed in word by word (${pieces} pieces)`);
  // the session is listed by the person-scoped endpoint
  const name = aliceSession.slice("#/s/".length);
  await page.locator("#session-list a", { hasText: name }).waitFor({ timeout: WAIT });
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

scenario("a message sent while the demo tool runs is steered into the running turn", async () => {
  const page = await newPage({ viewport: { width: 1100, height: 760 } });
  await loggedIn(page, "alice", aliceSession);
  await sendMessage(page, "Could you search my notes about the picnic?");
  // the tool call shows live (collapsed), and while it runs the person keeps typing
  await page.locator("details.tool", { hasText: "search_notes" }).waitFor({ timeout: WAIT });
  await sendMessage(page, "Oh, and what time is it?");
  const steered = page.locator(".msg.user", { hasText: "what time is it?" });
  await steered.locator(".status", { hasText: /steered into step \d+/ }).waitFor({ timeout: WAIT });
  await page.locator("details.tool", { hasText: "current_time" }).waitFor({ timeout: WAIT });
  await answered(page, "It is");
  await page.locator('.turn[data-running="false"]', { hasText: "It is" }).waitFor({ timeout: WAIT });
  // live, the transcript is in the order things happened: the steered message between the
  // search and what it led to, the answer last
  const order = await page.evaluate(() =>
    [...document.querySelectorAll("#transcript > *")].map((e) =>
      e.matches(".msg.user") ? `you: ${e.querySelector(".text")?.textContent}` : e.matches("details.tool") ? `tool: ${e.querySelector("summary")?.textContent}` : e.matches(".turn") ? `answer: ${e.textContent?.slice(0, 12)}` : e.className,
    ),
  );
  const at = (what) => order.findIndex((line) => line.includes(what));
  assert.ok(at("you: Could you search") < at("search_notes"), order.join(" | "));
  assert.ok(at("search_notes") < at("you: Oh, and what time"), order.join(" | "));
  assert.ok(at("you: Oh, and what time") < at("current_time"), order.join(" | "));
  assert.ok(at("current_time") < at("answer: cyreneIt is"), order.join(" | "));
  assert.equal(await page.locator("details.tool[open]").count(), 0, "tool calls are collapsed");
  await page.locator("details.tool", { hasText: "search_notes" }).first().click();
  await page.locator("details.tool pre.result", { hasText: "3 notes mention" }).waitFor({ timeout: WAIT });
  // the session's checkpoints: one per step, with its stop reason
  await page.getByText("Checkpoints").click();
  await page.locator("#timeline-steps li", { hasText: /^step 1 · tool_calls · \d{4}-/ }).first().waitFor({ timeout: WAIT });
  await page.locator("#timeline-steps li", { hasText: /^step \d+ · stop · / }).first().waitFor({ timeout: WAIT });
  await page.screenshot({ path: join(SHOTS, "chat.png") });
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

scenario("a reload asks for the login again and shows the session's history once", async () => {
  const page = await newPage();
  await loggedIn(page, "alice", aliceSession);
  await page.locator(".msg.user", { hasText: "what time is it?" }).waitFor({ timeout: WAIT });
  await page.reload();
  // credentials were kept in memory only: the reload asks again, and the URL never held them
  await page.getByLabel("Person", { exact: true }).waitFor({ timeout: WAIT });
  assert.equal(await page.evaluate(() => localStorage.length), 0);
  assert.ok(!page.url().includes(PASSWORDS.alice));
  await page.getByLabel("Person", { exact: true }).fill("alice");
  await page.getByLabel("Password", { exact: true }).fill(PASSWORDS.alice);
  await page.getByRole("button", { name: "Log in" }).click();
  await answered(page, "It is");
  assert.equal(new globalThis.URL(page.url()).hash, aliceSession, "the URL reopened the session");
  for (const text of ["hello **there**", "search my notes", "what time is it?"]) {
    assert.equal(await page.locator(".msg.user", { hasText: text }).count(), 1, text);
  }
  assert.equal(await page.locator(".answer", { hasText: "You said: hello" }).count(), 1);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

scenario("bob cannot open alice's session: a permission error, no data", async () => {
  const page = await newPage();
  const name = aliceSession.slice("#/s/".length);
  await logIn(page, "bob", PASSWORDS.bob, `#/s/alice.${name}`);
  await page.locator("#session-error", { hasText: "permission error" }).waitFor({ timeout: WAIT });
  assert.match(await page.locator("#session-error").innerText(), /not one of "bob"'s/);
  assert.equal(await page.locator("#transcript .msg").count(), 0, "nothing of alice's is shown");
  assert.equal(await page.locator("#session-list a", { hasText: name }).count(), 0);
  await page.context().close();
});

const XSS = [
  "<script>window.__pwned = 'script'</script>",
  '<img src=x onerror="window.__pwned = \'img\'">',
  "[click me](javascript:window.__pwned='link')",
  '<a href="javascript:window.__pwned=\'a\'">a link</a>',
  "<svg><script>window.__pwned='svg'</script></svg><svg onload=\"window.__pwned='onload'\"></svg>",
  "![x](x\" onerror=\"window.__pwned='md-img')",
  '<iframe srcdoc="<script>parent.__pwned=1</script>"></iframe><details open ontoggle="window.__pwned=\'toggle\'">',
  "[a](&#106;avascript:window.__pwned='entity')",
];

scenario("hostile names and messages render inert, under a strict CSP", async () => {
  const page = await newPage();
  const response = await page.goto(URL);
  const csp = response.headers()["content-security-policy"] ?? "";
  assert.match(csp, /script-src 'self';/);
  assert.match(csp, /connect-src 'self' ws:\/\/127\.0\.0\.1:\d+;/);
  assert.ok(!csp.includes("unsafe-inline") && !csp.includes("unsafe-eval"), csp);
  // the policy is enforced: an inline script added to the page does not run
  await page.evaluate(() => {
    const s = document.createElement("script");
    s.textContent = "window.__inline = true";
    document.body.append(s);
  });
  assert.equal(await page.evaluate(() => window.__inline), undefined, "inline script blocked");

  await loggedIn(page, "alice");
  for (const [i, payload] of XSS.entries()) {
    await sendMessage(page, payload);
    // one answer per message (each waits for the last, so none is steered into another)
    await page.waitForFunction((n) => document.querySelectorAll('.answer[data-final="true"]').length >= n, i + 1, {
      timeout: WAIT,
    });
  }
  await inert(page);
  await page.context().close();

  // a hostile session name in the URL is shown as text too
  const named = await newPage();
  await logIn(named, "alice", PASSWORDS.alice, `#/s/${encodeURIComponent('<img src=x onerror="window.__pwned=\'name\'">')}`);
  await named.locator("#session-error").waitFor({ state: "visible", timeout: WAIT });
  assert.match(await named.locator("#session-title").innerText(), /<img src=x onerror=/);
  await inert(named);
  await named.context().close();
});

scenario("alice attaches a document: a chip with the type the server sniffed, in the message", async () => {
  const page = await newPage();
  await loggedIn(page, "alice", aliceSession);
  await answered(page, "It is");
  // the browser claims image/png and a name with markup; the server sniffs the bytes
  await page.getByLabel("Attach", { exact: true }).setInputFiles({
    name: "picnic <img src=x onerror=alert(1)>.txt",
    mimeType: "image/png",
    buffer: Buffer.from("picnic list: tea, cake, a blanket\n"),
  });
  const chip = page.locator("#attachments .chip", { hasText: "text/plain" });
  await chip.waitFor({ timeout: WAIT });
  assert.ok(!(await chip.innerText()).includes("image/png"));
  await sendMessage(page, "what is in the file?");
  const sent = page.locator(".msg.user", { hasText: "what is in the file?" });
  await sent.locator(".chip", { hasText: "text/plain" }).waitFor({ timeout: WAIT });
  assert.equal(await page.locator("#attachments .chip").count(), 0, "the attachment went with the message");
  await answered(page, "what is in the file?");
  // the stored message holds the server's document reference: the history shows it too
  await page.reload();
  await page.getByLabel("Person", { exact: true }).fill("alice");
  await page.getByLabel("Password", { exact: true }).fill(PASSWORDS.alice);
  await page.getByRole("button", { name: "Log in" }).click();
  const stored = page.locator(".msg.user", { hasText: "what is in the file?" });
  await stored.locator(".chip", { hasText: /^d-.* · text\/plain/ }).waitFor({ timeout: WAIT });
  assert.equal(await page.locator("img, [onerror]").count(), 0);
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

scenario("on a phone (375×667) nothing scrolls sideways and the message box stays visible", async () => {
  const page = await newPage({ viewport: { width: 375, height: 667 }, isMobile: true, hasTouch: true });
  await loggedIn(page, "alice", aliceSession);
  await answered(page, "It is");
  await fitsThePhone(page);
  await sendMessage(page, "typed on a phone");
  await answered(page, "You said: typed on a phone");
  // acknowledged and answered: no status left on the message
  await page.locator('.msg.user[data-status=""]', { hasText: "typed on a phone" }).waitFor({ timeout: WAIT });
  await page.screenshot({ path: join(SHOTS, "phone.png") });
  await page.context().close();
});

scenario("nats-server restarted under the page: it reconnects, sends what was typed offline once", async () => {
  const page = await newPage();
  await loggedIn(page, "alice", aliceSession);
  await answered(page, "You said: typed on a phone");
  await driver("kill-nats");
  await page.waitForFunction(() => document.body.dataset.online === "false", null, { timeout: WAIT });
  await sendMessage(page, "typed while offline");
  const offline = page.locator(".msg.user", { hasText: "typed while offline" });
  await offline.locator(".status", { hasText: "waiting for the connection" }).waitFor({ timeout: WAIT });
  await driver("start-nats");
  await page.waitForFunction(() => document.body.dataset.online === "true", null, { timeout: WAIT });
  await answered(page, "You said: typed while offline");
  // caught up from the history without showing anything twice
  await page.waitForTimeout(500);
  assert.equal(await offline.count(), 1, "the offline message is shown (and was stored) once");
  assert.equal(await page.locator(".answer", { hasText: "You said: typed while offline" }).count(), 1);
  assert.equal(await page.locator(".msg.user", { hasText: "hello **there**" }).count(), 1);
  // the server stored it once: a fresh page's history agrees
  const fresh = await newPage();
  await loggedIn(fresh, "alice", aliceSession);
  await answered(fresh, "You said: typed while offline");
  assert.equal(await fresh.locator(".msg.user", { hasText: "typed while offline" }).count(), 1);
  await fresh.context().close();
  await page.context().close();
});

scenario("the operator sees the services on the bus and the model calls", async () => {
  const page = await newPage({ viewport: { width: 1000, height: 700 } });
  await loggedIn(page, "operator");
  for (const service of ["cyrene-model-gateway", "cyrene-checkpoint-store", "cyrene-orchestrator", "cyrene-loop-worker"]) {
    await page.locator("#services-table td.service", { hasText: service }).first().waitFor({ timeout: WAIT });
  }
  // a model call made while the operator watches shows in the calls table and chart
  const alice = await newPage();
  await loggedIn(alice, "alice", aliceSession);
  for (const n of [1, 2, 3]) {
    await sendMessage(alice, `message ${n} for the operator${" and more".repeat(n * 3)}`);
    await answered(alice, `You said: message ${n} for the operator`);
  }
  await page.waitForFunction(() => document.querySelectorAll("#calls-chart rect").length >= 3, null, { timeout: WAIT });
  assert.ok((await page.locator("#calls-table td", { hasText: "scripted" }).count()) >= 3);
  // each call's cache hits (the scripted provider reports none)
  await page.locator("#calls-table th", { hasText: "cache hits" }).waitFor({ timeout: WAIT });
  assert.ok((await page.locator("#calls-table td.cache", { hasText: /^0$/ }).count()) >= 3);

  // the turns in flight (cyrene.turns.running, read every second): alice's turn while the demo
  // tool runs shows with her session. What the table ever held is recorded as it changes, so
  // a turn that ends between two looks at the page is still seen; a turn that ends between
  // two reads of the page is asked again, up to five times.
  await page.evaluate(() => {
    window.__turnsSeen = [];
    new MutationObserver(() => {
      for (const td of document.querySelectorAll("#turns-table td.session")) window.__turnsSeen.push(td.textContent);
    }).observe(document.getElementById("turns-table"), { childList: true, subtree: true });
  });
  const sessionId = `alice.${aliceSession.slice("#/s/".length)}`;
  for (let attempt = 1; attempt <= 5; attempt += 1) {
    const before = await countOf(alice, FINAL);
    await sendMessage(alice, `search my notes for the operator (${attempt})`);
    await moreThan(alice, FINAL, before);
    if (await page.evaluate((id) => window.__turnsSeen.includes(id), sessionId)) break;
  }
  assert.ok(await page.evaluate((id) => window.__turnsSeen.includes(id), sessionId), "alice's turn was listed in flight");
  await page.locator("#turns-in-flight", { hasText: /turn\(s\) in flight · 1 loop worker\(s\) on the bus/ }).waitFor({ timeout: WAIT });
  await page.screenshot({ path: join(SHOTS, "operator.png"), fullPage: true });
  assert.deepEqual(page.problems, []);
  await alice.context().close();
  await page.context().close();
});

scenario('"remember me" keeps the login in this browser until Log out', async () => {
  const page = await newPage();
  await page.goto(URL);
  await page.getByLabel("Person", { exact: true }).fill("alice");
  await page.getByLabel("Password", { exact: true }).fill(PASSWORDS.alice);
  await page.getByLabel("remember me").check();
  await page.getByRole("button", { name: "Log in" }).click();
  await page.waitForFunction(() => /^#\/s\/.+/.test(location.hash), null, { timeout: WAIT });
  await page.reload();
  // logged in again by itself: no login form
  await page.locator("#app-view").waitFor({ state: "visible", timeout: WAIT });
  assert.equal(await page.locator("#login-view").isVisible(), false);
  await page.getByRole("button", { name: "Log out" }).click();
  await page.getByLabel("Person", { exact: true }).waitFor({ timeout: WAIT });
  assert.equal(await page.evaluate(() => localStorage.length), 0, "Log out forgets the login");
  await page.context().close();
});

scenario("New session opens a fresh session at once; the persona picked answers, and picking another switches the session", async () => {
  const page = await newPage();
  await loggedIn(page, "alice", aliceSession);
  await page.getByRole("button", { name: "New session" }).click();
  await page.waitForFunction((old) => location.hash !== old, aliceSession, { timeout: WAIT });
  const fresh = new globalThis.URL(page.url()).hash;
  assert.match(fresh, /^#\/s\/w[0-9a-z]+$/);
  assert.equal(await page.locator("#transcript .msg").count(), 0, "a new session is empty");
  await page.getByLabel("Persona", { exact: true }).selectOption("hoshi");
  await sendMessage(page, "hello hoshi");
  const turn = await answered(page, "You said: hello hoshi");
  assert.equal(await turn.locator(".answer .who").innerText(), "hoshi");
  // the picker addresses another persona in the same session: she answers the next message
  await page.getByLabel("Persona", { exact: true }).selectOption("cyrene");
  await sendMessage(page, "hello cyrene");
  const next = await answered(page, "You said: hello cyrene");
  assert.equal(await next.locator(".answer .who").innerText(), "cyrene");
  // both sessions are listed, the new one first (newest first), once the list is read again
  await page.waitForFunction(
    ([a, b]) => {
      const names = [...document.querySelectorAll("#session-list a")].map((x) => x.textContent);
      return names[0] === a && names.includes(b) && names.filter((n) => n === a).length === 1;
    },
    [fresh.slice("#/s/".length), aliceSession.slice("#/s/".length)],
    { timeout: WAIT },
  );
  assert.equal(await page.locator("#session-list a", { hasText: fresh.slice("#/s/".length) }).count(), 1);
  await page.context().close();
});

scenario("a message from another tab under \"a parallel leg\" runs beside the turn; a failed turn shows its reason", async () => {
  // two tabs of alice in one session: each is a client of its own (client_id)
  const tab = await newPage();
  await loggedIn(tab, "alice", aliceSession);
  await answered(tab, "It is");
  const other = await newPage();
  await loggedIn(other, "alice", aliceSession);
  await answered(other, "It is");
  await other.getByLabel("When busy", { exact: true }).selectOption("parallel");
  let leg = null;
  // the other tab sends while the first tab's turn waits on the demo tool (1.5 s); should that
  // turn end first, the message starts a turn of its own instead, and the pair is sent again
  for (let attempt = 1; attempt <= 3 && !leg; attempt += 1) {
    const [tools, finals] = [await countOf(tab, "details.tool"), await countOf(tab, FINAL)];
    await sendMessage(tab, `search my notes, tab one (${attempt})`);
    await moreThan(tab, "details.tool", tools);
    await sendMessage(other, `hello from the other tab (${attempt})`);
    const sent = other.locator(".msg.user", { hasText: `hello from the other tab (${attempt})` });
    await other.waitForFunction(
      (text) => [...document.querySelectorAll(".msg.user")].some((m) => m.textContent.includes(text) && m.dataset.id),
      `hello from the other tab (${attempt})`,
      { timeout: WAIT },
    );
    if ((await sent.getAttribute("data-status")) === "its own parallel leg") leg = attempt;
    await moreThan(tab, FINAL, finals);
    await answered(other, `You said: hello from the other tab (${attempt})`);
  }
  assert.ok(leg, "a message was sent while the other tab's turn ran");
  // the leg is announced in the transcript, and its answer comes beside the running turn's
  await other.locator(".notice", { hasText: /^parallel leg \S+ started$/ }).first().waitFor({ timeout: WAIT });
  await answered(other, `You said: hello from the other tab (${leg})`);

  // a failed turn (the offline demo fails a message that says "please fail") shows its reason
  // (sent once no turn runs: else it would be steered into the turn still finishing)
  await other.waitForFunction(() => !document.querySelector('.turn[data-running="true"]'), null, { timeout: WAIT });
  await other.getByLabel("When busy", { exact: true }).selectOption("");
  await sendMessage(other, "please fail");
  const failed = other.locator(".notice.failed", { hasText: "turn failed" });
  await failed.first().waitFor({ timeout: WAIT });
  assert.match(await failed.first().innerText(), /^turn failed: [a-z_]+: .*the offline demo fails on purpose when asked to/);
  await other.waitForFunction(() => !document.querySelector('.turn[data-running="true"]'), null, { timeout: WAIT });
  assert.equal(await failed.count(), 1, "one failed turn for one message");
  assert.deepEqual(other.problems, []);
  assert.deepEqual(tab.problems, []);
  await other.context().close();
  await tab.context().close();
});

scenario("a tool call that needs approval waits for it: Approve runs it, Deny tells the model why", async () => {
  const page = await newPage({ viewport: { width: 1000, height: 760 } });
  await loggedIn(page, "alice"); // a new session
  // the offline demo's send_postcard declares cyrene.tool.approval = required
  await sendMessage(page, "Send a postcard to Grandma, please");
  const pending = page.locator('.approval[data-state="pending"]');
  await pending.waitFor({ timeout: WAIT });
  const card = page.getByRole("region", { name: "approval of send_postcard" });
  assert.equal(await card.locator(".approval-tool").innerText(), "send_postcard");
  // its arguments (the demo puts markup in them) are text
  assert.equal(JSON.parse(await card.locator("pre.args").innerText()).to, "Grandma <img src=x onerror=alert(1)>");
  assert.equal(await page.locator(FINAL).count(), 0, "the turn waits: no answer yet");
  await card.getByRole("button", { name: "Approve" }).click();
  await card.getByRole("status").filter({ hasText: "Approved by you" }).waitFor({ timeout: WAIT });
  await answered(page, "a postcard is on its way to Grandma");
  await page.locator("details.tool pre.result", { hasText: "a postcard is on its way" }).first().waitFor({ state: "attached", timeout: WAIT });

  // Deny, with a reason: the tool does not run, the model is told why
  await sendMessage(page, "One more postcard, please");
  await pending.waitFor({ timeout: WAIT });
  await pending.getByLabel("Reason for a denial (optional)").fill("one is enough");
  await pending.getByRole("button", { name: "Deny" }).click();
  const denied = page.locator('.approval[data-state="deny"]');
  await denied.getByRole("status").filter({ hasText: "Denied by you — one is enough" }).waitFor({ timeout: WAIT });
  const turn = await answered(page, "was not approved");
  assert.match(await turn.locator(".answer").innerText(), /This tool call was not approved, so it did not run\. Reason: one is enough/);
  assert.equal(await page.locator(".approval").count(), 2);

  // a reload shows no card waiting any more: both were decided
  await page.reload();
  await loggedIn(page, "alice", new globalThis.URL(page.url()).hash);
  await answered(page, "was not approved");
  assert.equal(await page.locator('.approval[data-state="pending"]').count(), 0);
  await inert(page);
  await page.context().close();
});
