// Approval cards (docs/web.md, "Approvals") in a real headless Chromium against the page's side
// of the wire contract alone: tests/web.rs runs nats-server with the shipped users, `cyrene web`,
// and a stub in place of the orchestrator that answers alice's `session.list`, `.history`,
// `.approvals` and `.approve` and publishes the session's events when this script asks:
//   @@ask <json>       an `approval_requested` event (and a pending approval) of alice.approvals
//   @@deadline <call>  the call is denied by the deadline, its event lost (a click then learns it)
//   @@unknown <json>   a `tool_outcome_unknown` event
// The stub checks every `session.approve` body against the contract; tests/web.rs then checks
// the decisions it was sent.
import assert from "node:assert/strict";
import { join } from "node:path";
import { SHOTS, WAIT, driver, newPage, loggedIn, scenario, inert, fitsThePhone } from "./browser.mjs";

const SESSION = "#/s/approvals";
const HOSTILE_TOOL = `<img src=x onerror="window.__pwned='tool'">`;
const HOSTILE_ARGS = {
  to: "<script>window.__pwned='args'</script>",
  note: "[x](javascript:window.__pwned='md') <svg onload=\"window.__pwned='svg'\">",
};

const card = (page, call) => page.locator(`.approval[data-call="${call}"]`);

async function ask(call_id, tool, args) {
  await driver(`ask ${JSON.stringify({ call_id, tool, arguments: args })}`);
}

/** The card's outcome line once it says `text`. */
async function outcome(page, call, text) {
  const line = card(page, call).getByRole("status");
  await line.filter({ hasText: text }).waitFor({ timeout: WAIT });
  return line.innerText();
}

let watcher = null;

scenario("a card shows a hostile tool name and arguments as text; Approve decides it on every open page", async () => {
  const page = await newPage({ viewport: { width: 1000, height: 760 } });
  await loggedIn(page, "alice", SESSION);
  watcher = await newPage();
  await loggedIn(watcher, "alice", SESSION);
  await ask("c1", HOSTILE_TOOL, HOSTILE_ARGS);
  for (const p of [page, watcher]) await card(p, "c1").waitFor({ timeout: WAIT });
  // the card is named by its tool, and its tool and arguments are text
  const region = page.getByRole("region", { name: `approval of ${HOSTILE_TOOL}` });
  assert.equal(await region.count(), 1);
  assert.equal(await region.locator(".approval-tool").innerText(), HOSTILE_TOOL);
  assert.equal(JSON.parse(await region.locator("pre.args").innerText()).to, HOSTILE_ARGS.to);
  assert.match(await region.locator(".approval-meta").innerText(), /^call c1 · denied by itself at /);
  await inert(page);
  await inert(watcher);

  await region.getByRole("button", { name: "Approve" }).click();
  assert.equal(await outcome(page, "c1", "Approved"), "Approved by you");
  assert.equal(await region.getByRole("button").count(), 0, "a decided card has no buttons");
  // the other page learns it from the `approval_decided` event
  assert.equal(await outcome(watcher, "c1", "Approved"), "Approved by you");
  assert.equal(await card(watcher, "c1").getAttribute("data-state"), "approve");
  await inert(page);
  await page.context().close();
});

scenario("Deny takes a reason; a call decided before the click shows the decision that holds", async () => {
  const page = await newPage({ viewport: { width: 1000, height: 760 } });
  await loggedIn(page, "alice", SESSION);
  await ask("c2", "send_email", { to: "boss@example.org", subject: "my raise" });
  await ask("c3", "send_email", { to: "all@example.org", subject: "party" });
  await card(page, "c3").waitFor({ timeout: WAIT });

  const c2 = card(page, "c2");
  await c2.getByLabel("Reason for a denial (optional)").fill("not to my boss");
  await c2.getByRole("button", { name: "Deny" }).click();
  assert.equal(await outcome(page, "c2", "Denied"), "Denied by you — not to my boss");
  assert.equal(await outcome(watcher, "c2", "Denied"), "Denied by you — not to my boss");
  assert.equal(await c2.locator(".approval-meta").innerText(), "call c2", "a decided card drops its deadline");
  await page.screenshot({ path: join(SHOTS, "approval.png") });

  // the deadline denied c3 and its event was lost: Approve learns the decision that holds
  await driver("deadline c3");
  await card(page, "c3").getByRole("button", { name: "Approve" }).click();
  assert.equal(await outcome(page, "c3", "Already decided"), "Already decided: Denied by itself: nobody decided in time");
  assert.equal(await card(page, "c3").getAttribute("data-state"), "deny");
  assert.deepEqual(page.problems, []);
  await page.context().close();
});

scenario("a reload lists what still waits; an unknown outcome shows as an inert notice; a phone fits the card", async () => {
  await ask("c4", HOSTILE_TOOL, HOSTILE_ARGS);
  await card(watcher, "c4").waitFor({ timeout: WAIT });
  await watcher.reload();
  await loggedIn(watcher, "alice", SESSION);
  // from `session.approvals`: the one still pending, with its buttons (decided ones are not
  // repeated below the transcript)
  await card(watcher, "c4").getByRole("button", { name: "Approve" }).waitFor({ timeout: WAIT });
  assert.equal(await watcher.locator(".approval").count(), 1);
  assert.equal(await card(watcher, "c4").locator(".approval-tool").innerText(), HOSTILE_TOOL);

  await driver(`unknown ${JSON.stringify({ call_id: "c5", tool: HOSTILE_TOOL, arguments: HOSTILE_ARGS })}`);
  const notice = watcher.locator('.notice.unknown[data-call="c5"]');
  await notice.waitFor({ timeout: WAIT });
  assert.match(await notice.innerText(), /^⚠ the outcome of <img src=x onerror=.* \(call c5\) is unknown/);
  await inert(watcher);
  await watcher.context().close();

  const phone = await newPage({ viewport: { width: 375, height: 667 }, isMobile: true, hasTouch: true });
  await loggedIn(phone, "alice", SESSION);
  await card(phone, "c4").getByRole("button", { name: "Deny" }).waitFor({ timeout: WAIT });
  await fitsThePhone(phone);
  const box = await card(phone, "c4").boundingBox();
  assert.ok(box && box.x >= 0 && box.x + box.width <= 375, `the card fits: ${JSON.stringify(box)}`);
  await phone.screenshot({ path: join(SHOTS, "approval-phone.png") });
  await card(phone, "c4").getByRole("button", { name: "Deny" }).click();
  assert.equal(await outcome(phone, "c4", "Denied"), "Denied by you");
  await inert(phone);
  await phone.context().close();
});
