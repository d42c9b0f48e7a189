// Cyrene's web chat (docs/web.md): a static page whose only link to Cyrene is a NATS connection
// over WebSocket, as the person who logged in. Everything it does is a request or a subscription
// that person could make with `nats req`/`nats sub`: no server keeps state for the page.
//
// Untrusted text (names, messages, tool arguments and results, errors) is only ever put in the
// page with `textContent`; the one HTML path is an answer's Markdown, rendered by `marked` and
// sanitised by DOMPurify before it is inserted.

import { wsconnect, createInbox, errors } from "@nats-io/nats-core";
import type { NatsConnection, Subscription } from "@nats-io/nats-core";
import { marked } from "marked";
import DOMPurify from "dompurify";

// ---- wire shapes (docs/orchestrator.md, docs/architecture.md §9) ----

interface Part {
  type: string;
  text?: string;
  id?: string;
  name?: string;
  args?: unknown;
  tool_call_id?: string;
  is_error?: boolean;
  mime?: string;
  size?: number;
}
interface Message {
  role: string;
  content: Part[] | string;
  sender_name?: string;
}
interface HistoryEntry {
  id: string;
  seq: number;
  message: Message;
  turn_id?: string;
}
interface SessionEvent {
  type: string;
  session_id: string;
  turn_id?: string;
  leg_id?: string;
  at_step?: number;
  message_ids?: string[];
  message?: Message;
  error?: { code: string; message: string };
  delta?: string;
  seq?: number;
  attempt?: number;
  retry?: number;
  sender_name?: string;
  /** `approval_requested` / `approval_decided` / `tool_outcome_unknown`: the call. */
  call_id?: string;
  tool?: string;
  arguments?: Record<string, unknown>;
  /** `approval_requested`: unix ms when the call is denied by itself. */
  deadline_ms?: number;
  /** `approval_decided`: the decision that holds, its reason, and who made it. */
  decision?: Decision;
  reason?: string;
  decided_by?: string;
}
type Decision = "approve" | "deny";
/** One entry of `session.approvals` (docs/web.md, "Approvals"). */
interface Approval {
  turn_id?: string;
  call_id: string;
  tool: string;
  arguments?: Record<string, unknown>;
  requested_at_ms?: number;
  deadline_ms?: number;
  decision?: Decision;
  reason?: string;
  decided_by?: string;
}
/** The reply to `session.approve`: the decision that holds, and whether this request made it. */
interface ApproveResponse {
  session_id: string;
  call_id: string;
  decision: Decision;
  already_decided: boolean;
  decided_by: string;
}
interface SendAck {
  message_id: string;
  seq: number;
  disposition: "turn_started" | "pending" | "parallel_leg";
  turn_id?: string;
}
interface SessionSummary {
  session_id: string;
  persona?: string;
  created_at_ms?: number;
}
interface WebConfig {
  nats_ws_url: string;
  personas?: string[];
}

/** The reply of a Cyrene endpoint that failed (docs/errors.md). */
class ServiceError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

// ---- small DOM helpers ----

function $(id: string): HTMLElement {
  const el = document.getElementById(id);
  if (!el) throw new Error(`the page lacks #${id}`);
  return el;
}

/** An element with classes and text: text is always text, never markup. */
function el(tag: string, cls = "", text?: string): HTMLElement {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

/** Markdown → sanitised DOM: the only place HTML built from a message enters the page. */
function markdown(target: HTMLElement, text: string): void {
  const html = marked.parse(text, { async: false, gfm: true, breaks: true });
  const clean = DOMPurify.sanitize(html, {
    FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "iframe", "img"],
    FORBID_ATTR: ["style"],
    RETURN_DOM_FRAGMENT: true,
  });
  target.replaceChildren(clean);
  for (const a of target.querySelectorAll("a")) {
    a.setAttribute("rel", "noopener noreferrer");
    a.setAttribute("target", "_blank");
  }
}

function textOf(m: Message | undefined): string {
  if (!m) return "";
  if (typeof m.content === "string") return m.content;
  return m.content
    .filter((p) => p.type === "text")
    .map((p) => p.text ?? "")
    .join("");
}

function parts(m: Message | undefined): Part[] {
  if (!m) return [];
  return typeof m.content === "string" ? [{ type: "text", text: m.content }] : m.content;
}

function randomToken(n: number): string {
  const bytes = new Uint8Array(n);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => (b % 36).toString(36)).join("");
}

// ---- state ----

const enc = new TextEncoder();
const dec = new TextDecoder();
const REMEMBER_KEY = "cyrene.login";

let config: WebConfig = { nats_ws_url: "" };
let nc: NatsConnection | null = null;
let person = "";
let operator = false;
let online = false;
/** This tab: a client of its own, so the double-texting policy can tell it from others. */
const clientId = `web-${randomToken(12)}`;
let eventsSub: Subscription | null = null;
let openSession = "";
/** Sessions created on this page that the server has not seen yet (no message sent). */
const localSessions = new Set<string>();
/** Sessions created on this page that the session list has not named yet (shown first). */
const unlisted = new Set<string>();

/** A message typed but not yet acknowledged: re-sent with the same key until it is. */
interface Outgoing {
  key: string;
  session: string;
  text: string;
  /** Documents uploaded for this message (server-issued `document` parts). */
  documents: Part[];
  node: HTMLElement;
  persona: string;
  /** The double-texting policy picked for it ("" = the session's, which steers by default). */
  whenBusy: string;
}
const outbox: Outgoing[] = [];
let flushing = false;

/** What the open session's transcript shows, so a catch-up adds only what is missing. */
const shownMessages = new Map<string, HTMLElement>(); // message id → bubble
const turnNodes = new Map<string, HTMLElement>(); // turn id → its live container
const stepCount = new Map<string, string>(); // turn id → "attempt/step" of the streamed text
/** What the events said of a message before its ack arrived (the ack and the events travel on
 *  different subjects, so either may come first). */
const fateOf = new Map<string, string>(); // message id → status text

// ---- NATS ----

function subjectFor(what: string): string {
  return `cyrene.person.${person}.${what}`;
}

async function request<T>(subject: string, body: unknown, timeout = 5000): Promise<T> {
  if (!nc) throw new ServiceError("offline", "not connected");
  const reply = await nc.request(subject, enc.encode(JSON.stringify(body)), { timeout });
  const doc = JSON.parse(dec.decode(reply.data)) as T & { error?: { code: string; message: string } };
  const err = (doc as { error?: { code: string; message: string } }).error;
  if (err && typeof err === "object" && "code" in err) {
    throw new ServiceError(err.code, err.message);
  }
  return doc;
}

/** The full session id of `name` in the URL: a bare name is the person's own. */
function sessionId(name: string): string {
  return name.includes(".") ? name : `${person}.${name}`;
}

function shortName(id: string): string {
  return id.startsWith(`${person}.`) ? id.slice(person.length + 1) : id;
}

async function login(who: string, password: string, remember: boolean): Promise<void> {
  const errorLine = $("login-error");
  const button = $("login-button") as HTMLButtonElement;
  errorLine.textContent = "";
  button.disabled = true;
  operator = who === "operator";
  const user = operator ? "cyrene-operator" : `person-${who}`;
  try {
    // One connection attempt per click: no retry on the first connect (waitOnFirstConnect off);
    // once connected, the client reconnects by itself for as long as the page is open.
    nc = await wsconnect({
      servers: config.nats_ws_url,
      name: user,
      user,
      pass: password,
      inboxPrefix: `_INBOX_${user}`,
      maxReconnectAttempts: -1,
      reconnectTimeWait: 500,
      reconnectJitter: 200,
      waitOnFirstConnect: false,
    });
  } catch (e) {
    button.disabled = false;
    operator = false;
    if (e instanceof errors.AuthorizationError || /authoriz/i.test(String(e))) {
      errorLine.textContent = "wrong person or password";
    } else {
      errorLine.textContent = `cannot reach Cyrene: ${e instanceof Error ? e.message : String(e)}`;
    }
    return;
  }
  button.disabled = false;
  person = who;
  if (remember) localStorage.setItem(REMEMBER_KEY, JSON.stringify({ who, password }));
  online = true;
  watchStatus(nc);
  $("login-view").hidden = true;
  $("app-view").hidden = false;
  $("who").textContent = operator ? "operator" : who;
  setConn();
  if (operator) {
    $("operator-view").hidden = false;
    void startOperator();
  } else {
    $("chat-view").hidden = false;
    subscribeEvents();
    await refreshSessions();
    await route();
  }
}

function setConn(): void {
  const c = $("conn");
  c.textContent = online ? "connected" : "offline — reconnecting…";
  c.classList.toggle("offline", !online);
  document.body.dataset.online = String(online);
}

function watchStatus(conn: NatsConnection): void {
  void (async () => {
    for await (const s of conn.status()) {
      if (s.type === "disconnect" || s.type === "reconnecting") {
        if (online) {
          online = false;
          setConn();
        }
      } else if (s.type === "reconnect") {
        online = true;
        setConn();
        void catchUp();
      } else if (s.type === "error" && "error" in s) {
        const err = (s as { error: Error }).error;
        if (err instanceof errors.PermissionViolationError) showSessionError(`permission error: ${err.message}`);
      }
    }
  })();
  void conn.closed().then(() => {
    online = false;
    setConn();
  });
}

function subscribeEvents(): void {
  if (!nc) return;
  // Every session of this person: the open one is shown, the others mark the list.
  eventsSub = nc.subscribe(`cyrene.session.${person}.*.events`);
  void (async () => {
    for await (const m of eventsSub!) {
      let ev: SessionEvent;
      try {
        ev = JSON.parse(dec.decode(m.data)) as SessionEvent;
      } catch {
        continue;
      }
      if (ev.session_id === openSession) onEvent(ev);
    }
  })();
}

// ---- sessions ----

/** The person's sessions as the orchestrator last listed them. */
let listed: SessionSummary[] = [];

async function refreshSessions(): Promise<void> {
  try {
    const reply = await request<{ sessions: SessionSummary[] }>(subjectFor("session.list"), {});
    listed = reply.sessions ?? [];
  } catch (e) {
    showSessionError(`cannot list the sessions: ${describe(e)}`);
  }
  renderSessions();
}

/** The sessions opened on this page and not yet on the server first, then the listed ones. */
function renderSessions(): void {
  const ids = new Set(listed.map((s) => s.session_id));
  for (const id of unlisted) {
    if (ids.has(id)) unlisted.delete(id);
  }
  const all: SessionSummary[] = [...[...unlisted].reverse().map((session_id) => ({ session_id })), ...listed];
  const list = $("session-list");
  list.replaceChildren();
  for (const s of all) {
    const li = el("li");
    const a = el("a", s.session_id === openSession ? "open" : "", shortName(s.session_id)) as HTMLAnchorElement;
    a.href = `#/s/${encodeURIComponent(shortName(s.session_id))}`;
    if (s.persona) a.title = `persona ${s.persona}`;
    li.append(a);
    list.append(li);
  }
}

function newSession(): void {
  const name = `w${Date.now().toString(36)}${randomToken(4)}`;
  const id = `${person}.${name}`;
  localSessions.add(id);
  unlisted.add(id);
  // Opened here, not by the `hashchange` that follows a task later: the session left behind
  // never shows under the new one's address (a new session reads no history, so this clears
  // the page before it returns).
  void open(id);
  location.hash = `#/s/${name}`;
  renderSessions();
}

/** Opens the session the URL names (`#/s/<name>`), or a new one. */
async function route(): Promise<void> {
  const m = /^#\/s\/(.+)$/.exec(location.hash);
  if (!m) {
    newSession();
    return;
  }
  const id = sessionId(decodeURIComponent(m[1]));
  // Open already: New session opens its session before it sets the address.
  if (id === openSession) return;
  await open(id);
}

/** The message box, Send and Attach take input only once a session is open. */
function enableComposer(): void {
  for (const id of ["message", "send", "attach"]) ($(id) as HTMLInputElement).disabled = false;
}

async function open(id: string): Promise<void> {
  openSession = id;
  enableComposer();
  shownMessages.clear();
  turnNodes.clear();
  stepCount.clear();
  $("transcript").replaceChildren();
  $("timeline-steps").replaceChildren();
  attached.length = 0; // an attachment belongs to the session it was uploaded in
  $("attachments").replaceChildren();
  $("session-title").textContent = shortName(id);
  hideSessionError();
  for (const a of $("session-list").querySelectorAll("a")) {
    a.classList.toggle("open", a.textContent === shortName(id));
  }
  if (!localSessions.has(id)) {
    await loadHistory();
    await loadApprovals();
    void loadTimeline();
  }
  for (const o of outbox) if (o.session === id) $("transcript").append(o.node);
}

async function loadHistory(): Promise<void> {
  const id = openSession;
  let entries: HistoryEntry[];
  try {
    const reply = await request<{ messages: HistoryEntry[] }>(subjectFor("session.history"), {
      session_id: id,
      limit: 200,
    });
    entries = reply.messages ?? [];
  } catch (e) {
    if (id === openSession) showSessionError(describe(e));
    return;
  }
  if (id !== openSession) return;
  for (const entry of entries) showEntry(entry);
}

/** One transcript entry, unless it is shown already (a catch-up after a reconnect). */
function showEntry(entry: HistoryEntry): void {
  if (shownMessages.has(entry.id)) return;
  const t = $("transcript");
  if (entry.message.role === "user") {
    const node = userBubble(textOf(entry.message), parts(entry.message));
    node.dataset.id = entry.id;
    shownMessages.set(entry.id, node);
    t.append(node);
    return;
  }
  // An answer that streamed live on this page is the same answer: fill it in, don't repeat it.
  const live = entry.turn_id ? turnNodes.get(entry.turn_id) : undefined;
  if (live) {
    shownMessages.set(entry.id, live);
    finishAnswer(live, entry.message);
    return;
  }
  const turn = turnNode(entry.turn_id ?? `h-${entry.id}`);
  shownMessages.set(entry.id, turn);
  finishAnswer(turn, entry.message);
}

function userBubble(text: string, ps: Part[]): HTMLElement {
  const node = el("div", "msg user");
  for (const p of ps) {
    if (p.type === "document") {
      node.append(el("span", "chip", `${titles.get(p.name ?? "") ?? p.name ?? "document"} · ${p.mime ?? "?"}`));
    }
  }
  node.append(el("span", "text", text));
  node.append(el("span", "status"));
  return node;
}

function setStatus(node: HTMLElement, text: string): void {
  const s = node.querySelector(".status");
  if (s) s.textContent = text;
  node.dataset.status = text;
}

/** The answer of a turn (`.turn`, holding `.answer`). Live, what the turn does — tool calls,
 *  results, notices — goes into the transcript in arrival order, between the messages sent
 *  meanwhile (a steered message shows where it came in), and the answer moves below them when
 *  its text starts and when it is final. */
function turnNode(turnId: string): HTMLElement {
  let node = turnNodes.get(turnId);
  if (!node) {
    node = el("div", "turn");
    node.dataset.turn = turnId;
    const answer = el("div", "msg assistant answer");
    answer.hidden = true;
    node.append(answer);
    turnNodes.set(turnId, node);
    $("transcript").append(node);
  }
  return node;
}

function answerOf(turn: HTMLElement): HTMLElement {
  return turn.querySelector(".answer") as HTMLElement;
}

/** Moves a turn's answer below everything shown so far. */
function bringForward(turn: HTMLElement): void {
  if (turn.nextSibling) $("transcript").append(turn);
}

function finishAnswer(turn: HTMLElement, message: Message): void {
  const answer = answerOf(turn);
  answer.hidden = false;
  const body = el("div", "body");
  markdown(body, textOf(message));
  answer.replaceChildren(el("span", "who", message.sender_name || "assistant"), body);
  answer.dataset.final = "true";
  // tool calls the answer carries (history of a turn not seen live)
  for (const p of parts(message)) if (p.type === "tool_call") turn.insertBefore(toolDetails(p), answer);
}

function findCall(id: string | undefined): HTMLElement | null {
  return id ? $("transcript").querySelector(`details[data-call="${CSS.escape(id)}"]`) : null;
}

/** A tool call, collapsed: its name, then its arguments (and later its result) as text. */
function toolDetails(p: Part): HTMLElement {
  const d = el("details", "tool") as HTMLDetailsElement;
  if (p.id) d.dataset.call = p.id;
  d.append(el("summary", "", `⚙ ${p.name ?? "tool"}`), el("pre", "args", JSON.stringify(p.args ?? {}, null, 1)));
  return d;
}

function toolCall(turnId: string, p: Part): void {
  if (findCall(p.id)) return;
  const d = toolDetails(p);
  d.dataset.turn = turnId;
  $("transcript").append(d);
}

function toolResult(turnId: string, p: Part): void {
  const d = findCall(p.tool_call_id);
  const pre = el("pre", p.is_error ? "result failed" : "result", p.text ?? "");
  if (d) {
    d.append(pre);
    const summary = d.querySelector("summary");
    if (summary) summary.textContent = `${p.is_error ? "✗" : "✓"} ${summary.textContent?.slice(2) ?? ""}`;
  } else {
    const orphan = el("details", "tool");
    orphan.dataset.turn = turnId;
    orphan.append(el("summary", "", p.is_error ? "✗ tool result" : "✓ tool result"), pre);
    $("transcript").append(orphan);
  }
}

function notice(turnId: string, text: string, failed = false): void {
  const n = el("div", failed ? "notice failed" : "notice", text);
  n.dataset.turn = turnId;
  $("transcript").append(n);
}

// ---- approvals ----

/** The longest denial reason the orchestrator takes (bytes of UTF-8). */
const MAX_REASON_BYTES = 1024;

function findApproval(callId: string): HTMLElement | null {
  return $("transcript").querySelector(`.approval[data-call="${CSS.escape(callId)}"]`);
}

/** Who made a decision, as the person reads it (`decided_by` of the contract). */
function decider(by: string | undefined): string {
  if (!by) return "";
  if (by === `person:${person}`) return "by you";
  if (by.startsWith("person:")) return `by ${by.slice("person:".length)}`;
  if (by === "operator") return "by the operator";
  if (by === "bridge") return "from the chat bridge";
  if (by === "deadline") return "by itself: nobody decided in time";
  return `by ${by}`;
}

/** A card asking the person to approve or deny one tool call: the tool's name and its
 *  arguments as text (never HTML), Approve, Deny with an optional reason. Shown once per call. */
function approvalCard(a: Approval, turnId: string): HTMLElement {
  const existing = findApproval(a.call_id);
  if (existing) return existing;
  const card = el("section", "approval");
  card.dataset.call = a.call_id;
  card.dataset.turn = turnId;
  card.dataset.session = openSession;
  card.dataset.state = "pending";
  card.setAttribute("aria-label", `approval of ${a.tool}`);
  const title = el("p", "approval-title");
  title.append("Run ", el("code", "approval-tool", a.tool), "?");
  const args = el("pre", "args", JSON.stringify(a.arguments ?? {}, null, 1));
  const meta = el("p", "approval-meta", `call ${a.call_id}`);
  if (a.deadline_ms) meta.textContent += ` · denied by itself at ${new Date(a.deadline_ms).toLocaleString()}`;
  const reasonId = `reason-${randomToken(8)}`;
  const reasonLabel = el("label", "visually-hidden", "Reason for a denial (optional)");
  reasonLabel.setAttribute("for", reasonId);
  const reason = el("input", "approval-reason") as HTMLInputElement;
  reason.id = reasonId;
  reason.placeholder = "reason (optional)";
  reason.maxLength = MAX_REASON_BYTES;
  const approve = el("button", "approve", "Approve") as HTMLButtonElement;
  approve.type = "button";
  const deny = el("button", "deny", "Deny") as HTMLButtonElement;
  deny.type = "button";
  const actions = el("div", "approval-actions");
  actions.append(reasonLabel, reason, approve, deny);
  const outcome = el("p", "approval-outcome");
  outcome.setAttribute("role", "status");
  card.append(title, args, meta, actions, outcome);
  approve.addEventListener("click", () => void decide(card, "approve", ""));
  deny.addEventListener("click", () => void decide(card, "deny", reason.value.trim()));
  $("transcript").append(card);
  if (a.decision) showDecision(card, a.decision, a.decided_by, a.reason, false);
  return card;
}

/** The card shows the decision that holds; its buttons go. */
function showDecision(card: HTMLElement, decision: Decision, by: string | undefined, reason: string | undefined, already: boolean): void {
  card.dataset.state = decision;
  card.querySelector(".approval-actions")?.remove();
  const meta = card.querySelector(".approval-meta");
  if (meta) meta.textContent = `call ${card.dataset.call ?? ""}`; // the deadline no longer matters
  const word = decision === "approve" ? "Approved" : "Denied";
  let text = `${already ? "Already decided: " : ""}${word}`;
  const who = decider(by);
  if (who) text += ` ${who}`;
  if (reason) text += ` — ${reason}`;
  const outcome = card.querySelector(".approval-outcome");
  if (outcome) {
    outcome.textContent = text;
    outcome.classList.remove("failed");
  }
}

/** Sends the person's decision (`session.approve`); the card then shows the one that holds —
 *  maybe an earlier one (`already_decided`), from another tab, the CLI or the deadline. */
async function decide(card: HTMLElement, decision: Decision, reason: string): Promise<void> {
  const callId = card.dataset.call ?? "";
  const outcome = card.querySelector(".approval-outcome") as HTMLElement;
  const buttons = [...card.querySelectorAll("button")] as HTMLButtonElement[];
  if (enc.encode(reason).length > MAX_REASON_BYTES) {
    outcome.textContent = `the reason is too long (at most ${MAX_REASON_BYTES} bytes)`;
    outcome.classList.add("failed");
    return;
  }
  for (const b of buttons) b.disabled = true;
  outcome.classList.remove("failed");
  outcome.textContent = "sending…";
  try {
    const reply = await request<ApproveResponse>(subjectFor("session.approve"), {
      session_id: card.dataset.session ?? openSession,
      call_id: callId,
      decision,
      ...(decision === "deny" && reason ? { reason } : {}),
    });
    // the reason of a decision that holds comes with its `approval_decided` event
    const mine = !reply.already_decided && reply.decision === decision;
    showDecision(card, reply.decision, reply.decided_by, mine ? reason : undefined, reply.already_decided);
  } catch (e) {
    for (const b of buttons) b.disabled = false;
    outcome.textContent = `not decided: ${describe(e)}`;
    outcome.classList.add("failed");
  }
}

/** The open session's approvals (`session.approvals`): a pending one shows its card (a reload
 *  or a catch-up), a decided one updates the card shown. */
async function loadApprovals(): Promise<void> {
  const id = openSession;
  if (!id || localSessions.has(id)) return;
  let approvals: Approval[];
  try {
    const reply = await request<{ approvals: Approval[] }>(subjectFor("session.approvals"), { session_id: id });
    approvals = reply.approvals ?? [];
  } catch {
    return; // the session's approvals are shown as they are asked for, from the events
  }
  if (id !== openSession) return;
  for (const a of approvals) {
    const card = findApproval(a.call_id);
    if (card) {
      if (a.decision && card.dataset.state === "pending") showDecision(card, a.decision, a.decided_by, a.reason, false);
    } else if (!a.decision) {
      approvalCard(a, a.turn_id ?? "");
    }
  }
}

function onEvent(ev: SessionEvent): void {
  const turnId = ev.turn_id ?? "";
  const leg = ev.leg_id ? ` (leg ${ev.leg_id})` : "";
  switch (ev.type) {
    case "turn_started": {
      const turn = turnNode(turnId);
      // a message that started a parallel leg keeps saying so; one that started a turn, nothing
      const status = ev.leg_id ? "its own parallel leg" : "";
      for (const id of ev.message_ids ?? []) {
        const node = shownMessages.get(id);
        if (node) setStatus(node, status);
        else fateOf.set(id, status);
      }
      turn.dataset.running = "true";
      if (ev.leg_id) notice(turnId, `parallel leg ${ev.leg_id} started`);
      break;
    }
    case "steer_ack":
      for (const id of ev.message_ids ?? []) {
        const status = `steered into step ${ev.at_step ?? "?"}`;
        const node = shownMessages.get(id);
        if (node) setStatus(node, status);
        else fateOf.set(id, status);
      }
      break;
    case "delta": {
      const turn = turnNode(turnId);
      const answer = answerOf(turn);
      // a redelivered attempt, or a model call sent again after its gateway replica died
      // (`retry`), streams the step's text again from the start
      const key = `${ev.attempt ?? 1}/${ev.retry ?? 0}/${ev.at_step ?? 0}`;
      if (stepCount.get(turnId) !== key || answer.dataset.final === "true") {
        // a new step (or a redelivered attempt) streams its text anew, below what came before
        stepCount.set(turnId, key);
        answer.dataset.final = "";
        answer.replaceChildren(el("span", "who", ev.sender_name || "assistant"), el("div", "body streaming"));
        bringForward(turn);
      }
      answer.hidden = false;
      answer.querySelector(".body")?.append(document.createTextNode(ev.delta ?? ""));
      // how many pieces this answer was shown in as it streamed (kept after the final)
      turn.dataset.deltas = String(Number(turn.dataset.deltas ?? "0") + 1);
      break;
    }
    case "tool_call":
      for (const p of parts(ev.message)) if (p.type === "tool_call") toolCall(turnId, p);
      break;
    case "tool_result":
      for (const p of parts(ev.message)) if (p.type === "tool_result") toolResult(turnId, p);
      break;
    case "final":
      if (ev.message) {
        const turn = turnNode(turnId);
        finishAnswer(turn, ev.message);
        bringForward(turn);
      }
      break;
    case "error": {
      const e = ev.error;
      notice(turnId, `turn failed${leg}: ${e ? `${e.code}: ${e.message}` : "unknown error"}`, true);
      break;
    }
    case "approval_requested":
      if (ev.call_id) {
        approvalCard({ call_id: ev.call_id, tool: ev.tool ?? "tool", arguments: ev.arguments, deadline_ms: ev.deadline_ms }, turnId);
      }
      break;
    case "approval_decided":
      if (ev.call_id && ev.decision) {
        const card = findApproval(ev.call_id) ?? approvalCard({ call_id: ev.call_id, tool: ev.tool ?? "tool" }, turnId);
        showDecision(card, ev.decision, ev.decided_by, ev.reason, false);
      }
      break;
    case "tool_outcome_unknown": {
      const n = el("div", "notice failed unknown", `⚠ the outcome of ${ev.tool ?? "a tool"} (call ${ev.call_id ?? "?"}) is unknown: Cyrene stopped while it ran, and it was not run again`);
      n.dataset.turn = turnId;
      if (ev.call_id) n.dataset.call = ev.call_id;
      n.append(el("pre", "args", JSON.stringify(ev.arguments ?? {}, null, 1)));
      $("transcript").append(n);
      break;
    }
    case "turn_ended": {
      const turn = turnNodes.get(turnId);
      if (turn) turn.dataset.running = "false";
      void loadTimeline();
      void refreshSessions();
      break;
    }
  }
  const t = $("transcript");
  t.scrollTop = t.scrollHeight;
}

// ---- sending ----

/** Queues `text` (and the session's uploaded documents) for the open session; false when
 *  nothing was taken, so the caller keeps what was typed. The composer is disabled until a
 *  session is open (enableComposer), so a message typed right after the login is never
 *  dropped for want of a session. */
function send(text: string): boolean {
  const documents = attached.filter((a) => a.session === openSession && a.part).map((a) => a.part as Part);
  if ((!text.trim() && !documents.length) || !openSession) return false;
  if (attached.some((a) => a.session === openSession && !a.part && !a.failed)) {
    setAttachNote("wait for the upload to finish");
    return false;
  }
  clearAttachments();
  const node = userBubble(text, documents);
  setStatus(node, online ? "sending…" : "waiting for the connection…");
  $("transcript").append(node);
  const o: Outgoing = {
    key: `web-${Date.now().toString(36)}-${randomToken(10)}`,
    session: openSession,
    text,
    documents,
    node,
    persona: ($("persona") as HTMLSelectElement).value,
    whenBusy: ($("when-busy") as HTMLSelectElement).value,
  };
  node.dataset.key = o.key;
  outbox.push(o);
  void flush();
  return true;
}

/** Sends what the outbox holds, in order. A send whose fate is unknown (timeout, lost
 *  connection) stays and is sent again with the same idempotency key: the orchestrator answers
 *  a repeat with the first ack, so each message is stored once. */
async function flush(): Promise<void> {
  if (flushing) return;
  flushing = true;
  try {
    while (outbox.length && online) {
      const o = outbox[0];
      let ack: SendAck;
      try {
        ack = await request<SendAck>(subjectFor("session.send"), {
          session_id: o.session,
          message: {
            role: "user",
            content: [...o.documents, ...(o.text.trim() ? [{ type: "text", text: o.text }] : [])],
          },
          client_id: clientId,
          idempotency_key: o.key,
          // The persona picked addresses this message, in a new session or an existing one:
          // the session's turns run as it from here on (docs/orchestrator.md, "Several personas").
          ...(o.persona ? { persona: o.persona } : {}),
          ...(o.whenBusy ? { when_busy: o.whenBusy } : {}),
        });
      } catch (e) {
        if (e instanceof ServiceError && e.code !== "offline" && e.code !== "unavailable") {
          outbox.shift();
          setStatus(o.node, `not sent: ${e.code}: ${e.message}`);
          o.node.classList.add("failed");
          continue;
        }
        setStatus(o.node, "waiting for the connection…");
        if (online) await new Promise((r) => setTimeout(r, 1000));
        continue;
      }
      outbox.shift();
      localSessions.delete(o.session);
      o.node.dataset.id = ack.message_id;
      if (shownMessages.has(ack.message_id)) {
        o.node.remove(); // a catch-up already showed it
      } else {
        shownMessages.set(ack.message_id, o.node);
      }
      switch (ack.disposition) {
        case "turn_started":
          setStatus(o.node, "");
          break;
        case "pending":
          if (o.node.dataset.status === "sending…" || o.node.dataset.status?.startsWith("waiting")) setStatus(o.node, "pending");
          break;
        case "parallel_leg":
          setStatus(o.node, "its own parallel leg");
          break;
      }
      const fate = fateOf.get(ack.message_id);
      if (fate !== undefined) {
        fateOf.delete(ack.message_id);
        setStatus(o.node, fate);
      }
      if (o.session === openSession && !$("session-list").textContent?.includes(shortName(o.session))) {
        void refreshSessions();
      }
    }
  } finally {
    flushing = false;
  }
}

/** After a reconnect: what happened while offline comes from the history; unsent messages go. */
async function catchUp(): Promise<void> {
  if (operator) return;
  await flush();
  if (openSession && !localSessions.has(openSession)) {
    await loadHistory();
    await loadApprovals();
  }
  void refreshSessions();
  void loadTimeline();
}

// ---- documents ----

/** A file being uploaded (or uploaded) for the next message of `session`. */
interface Attachment {
  session: string;
  chip: HTMLElement;
  part?: Part;
  failed?: boolean;
}
const attached: Attachment[] = [];
/** Server document name (`d-…`) → the file's title, for the chips of this page's messages. */
const titles = new Map<string, string>();
/** The largest chunk of one upload request (docs/documents.md): 512 KiB before base64. */
const CHUNK = 512 * 1024;

interface UploadAck {
  upload_id: string;
  seq: number;
  received: number;
  document?: { part: Part; title?: string };
}

function base64(bytes: Uint8Array): string {
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(text);
}

function setAttachNote(text: string): void {
  const note = el("span", "chip failed", text);
  $("attachments").append(note);
  setTimeout(() => note.remove(), 4000);
}

function clearAttachments(): void {
  for (let i = attached.length - 1; i >= 0; i--) {
    if (attached[i].session === openSession) {
      attached[i].chip.remove();
      attached.splice(i, 1);
    }
  }
}

/** Uploads `file` through the person's document subject, a chunk per request; the chip then
 *  shows the type the server sniffed from the bytes (never the browser's claim). */
async function attach(file: File): Promise<void> {
  const a: Attachment = { session: openSession, chip: el("span", "chip", `${file.name} · uploading…`) };
  attached.push(a);
  $("attachments").append(a.chip);
  try {
    const bytes = new Uint8Array(await file.arrayBuffer());
    let uploadId = "";
    for (let seq = 0, off = 0; ; seq += 1, off += CHUNK) {
      const last = off + CHUNK >= bytes.length;
      const ack = await request<UploadAck>(
        subjectFor("document.upload"),
        {
          session_id: a.session,
          ...(seq === 0 ? { name: file.name, mime: file.type } : { upload_id: uploadId }),
          seq,
          data: base64(bytes.subarray(off, off + CHUNK)),
          last,
        },
        15000,
      );
      uploadId = ack.upload_id;
      if (last) {
        if (!ack.document) throw new ServiceError("internal", "the last chunk's reply names no document");
        a.part = ack.document.part;
        const title = ack.document.title || file.name;
        titles.set(a.part.name ?? "", title);
        a.chip.textContent = `${title} · ${a.part.mime ?? "?"}`;
        a.chip.dataset.mime = a.part.mime ?? "";
        return;
      }
    }
  } catch (e) {
    a.failed = true;
    a.chip.classList.add("failed");
    a.chip.textContent = `${file.name}: not attached: ${describe(e)}`;
  }
}

// ---- checkpoints ----

interface Checkpoint {
  step?: number;
  created_at?: string;
  /** What the loop worker saved (docs/checkpoint-store.md): the stop reason of the step. */
  state?: { stop_reason?: string; turn_id?: string };
}

async function loadTimeline(): Promise<void> {
  const id = openSession;
  if (!id || localSessions.has(id)) return;
  let cps: Checkpoint[] = [];
  try {
    const reply = await request<{ checkpoints: Checkpoint[] }>(subjectFor("checkpoint.list"), {
      agent_id: id,
      limit: 50,
    });
    cps = reply.checkpoints ?? [];
  } catch {
    return;
  }
  if (id !== openSession) return;
  const ol = $("timeline-steps");
  ol.replaceChildren(
    ...cps.map((c) =>
      el("li", "", `step ${c.step ?? "?"} · ${c.state?.stop_reason || "—"} · ${c.created_at ?? ""}`),
    ),
  );
}

// ---- errors ----

function describe(e: unknown): string {
  if (e instanceof ServiceError) {
    return e.code === "forbidden" ? `permission error: ${e.message}` : `${e.code}: ${e.message}`;
  }
  if (e instanceof errors.PermissionViolationError) return `permission error: ${e.message}`;
  return e instanceof Error ? e.message : String(e);
}

function showSessionError(text: string): void {
  const p = $("session-error");
  p.textContent = text;
  p.hidden = false;
}

function hideSessionError(): void {
  $("session-error").hidden = true;
}

// ---- operators ----

interface EndpointStats {
  name: string;
  subject: string;
  num_requests: number;
  num_errors: number;
  average_processing_time: number;
}
interface ServiceStats {
  name: string;
  id: string;
  endpoints?: EndpointStats[];
}
interface CallRecord {
  model: string;
  purpose?: string;
  tokens: number;
  took_ms: number;
  provider?: string;
  cache_hit_tokens?: number;
}

/** Every reply to one `$SRV.<verb>` request that arrives within `wait` ms. */
async function gather<T>(verb: string, wait = 600): Promise<T[]> {
  if (!nc) return [];
  const inbox = createInbox(`_INBOX_cyrene-operator`);
  const sub = nc.subscribe(inbox);
  const out: T[] = [];
  setTimeout(() => sub.unsubscribe(), wait);
  nc.publish(`$SRV.${verb}`, new Uint8Array(), { reply: inbox });
  for await (const m of sub) {
    try {
      out.push(JSON.parse(dec.decode(m.data)) as T);
    } catch {
      /* not JSON: skipped */
    }
  }
  return out;
}

async function refreshServices(): Promise<void> {
  const stats = await gather<ServiceStats>("STATS");
  stats.sort((a, b) => a.name.localeCompare(b.name) || a.id.localeCompare(b.id));
  const rows: HTMLElement[] = [];
  let workers = 0;
  for (const s of stats) {
    // a service without request endpoints (the loop worker takes its turns from JetStream)
    // still shows, with one empty row
    const endpoints = s.endpoints?.length ? s.endpoints : [null];
    for (const [i, e] of endpoints.entries()) {
      const tr = el("tr", i === 0 ? "first" : "");
      tr.append(
        // the service's name on its first row only (one instance after another)
        el("td", "service", i === 0 ? `${s.name} ${s.id.slice(-4)}` : ""),
        el("td", "", e ? e.name : "—"),
        el("td", "", e ? String(e.num_requests) : ""),
        el("td", "", e ? String(e.num_errors) : ""),
        el("td", "", e ? `${(e.average_processing_time / 1e6).toFixed(1)} ms` : ""),
      );
      rows.push(tr);
    }
    if (s.name === "cyrene-loop-worker") workers += 1;
  }
  $("services-table").querySelector("tbody")?.replaceChildren(...rows);
  loopWorkers = workers;
}

/** One turn of `cyrene.turns.running` (docs/orchestrator.md, "Turns in flight"). */
interface RunningTurn {
  turn_id: string;
  session_id: string;
  leg_id?: string;
  persona?: string;
  attempt: number;
  step: number;
  started_at_ms: number;
}
let loopWorkers = 0;

/** The turns running now, from the orchestrator (operators only). */
async function refreshTurns(): Promise<void> {
  let reply: { turns?: RunningTurn[]; more?: boolean };
  try {
    reply = await request<{ turns?: RunningTurn[]; more?: boolean }>("cyrene.turns.running", { limit: 50 });
  } catch (e) {
    $("turns-in-flight").textContent = `cannot list the turns in flight: ${describe(e)}`;
    return;
  }
  const turns = reply.turns ?? [];
  const rows = turns.map((t) => {
    const tr = el("tr");
    tr.dataset.turn = t.turn_id;
    tr.append(
      el("td", "session", t.leg_id ? `${t.session_id} (leg)` : t.session_id),
      el("td", "", t.persona || "default"),
      el("td", "", t.turn_id.slice(-8)),
      el("td", "step", String(t.step)),
      el("td", "", String(t.attempt)),
      el("td", "", new Date(t.started_at_ms).toLocaleTimeString()),
    );
    return tr;
  });
  $("turns-table").querySelector("tbody")?.replaceChildren(...rows);
  const more = reply.more ? "+" : "";
  $("turns-in-flight").textContent = `${turns.length}${more} turn(s) in flight · ${loopWorkers} loop worker(s) on the bus`;
}

const calls: CallRecord[] = [];

function drawCalls(): void {
  const svg = $("calls-chart");
  const ns = "http://www.w3.org/2000/svg";
  // tokens per call, the latest 30 (an offline scripted call takes 0 ms: tokens always show)
  const recent = calls.slice(-30);
  const max = Math.max(1, ...recent.map((c) => c.tokens));
  const bars = recent.map((c, i) => {
    const h = Math.max(1, Math.round((c.tokens / max) * 76));
    const r = document.createElementNS(ns, "rect");
    r.setAttribute("x", String(i * 12));
    r.setAttribute("y", String(80 - h));
    r.setAttribute("width", "10");
    r.setAttribute("height", String(h));
    const title = document.createElementNS(ns, "title");
    title.textContent = `${c.provider ?? ""} ${c.model}: ${c.tokens} tokens (${c.cache_hit_tokens ?? 0} from the cache), ${c.took_ms} ms`;
    r.append(title);
    return r;
  });
  svg.replaceChildren(...bars);
  const rows = calls
    .slice(-20)
    .reverse()
    .map((c) => {
      const tr = el("tr");
      tr.append(
        el("td", "", c.provider ?? ""),
        el("td", "", c.model),
        el("td", "", c.purpose ?? ""),
        el("td", "", String(c.tokens)),
        el("td", "cache", String(c.cache_hit_tokens ?? 0)),
        el("td", "", `${c.took_ms} ms`),
      );
      return tr;
    });
  $("calls-table").querySelector("tbody")?.replaceChildren(...rows);
}

async function startOperator(): Promise<void> {
  if (!nc) return;
  const sub = nc.subscribe("cyrene.model.calls");
  void (async () => {
    for await (const m of sub) {
      try {
        calls.push(JSON.parse(dec.decode(m.data)) as CallRecord);
      } catch {
        continue;
      }
      if (calls.length > 200) calls.shift();
      drawCalls();
    }
  })();
  // the services every 3 s, the turns in flight every second (a turn often lasts a few)
  for (let tick = 0; ; tick += 1) {
    if (online && tick % 3 === 0) await refreshServices();
    if (online) await refreshTurns();
    await new Promise((r) => setTimeout(r, 1000));
    if (!nc || nc.isClosed()) return;
  }
}

// ---- start ----

async function logout(): Promise<void> {
  localStorage.removeItem(REMEMBER_KEY);
  const conn = nc;
  nc = null;
  await conn?.close();
  location.reload();
}

async function main(): Promise<void> {
  try {
    config = (await (await fetch("/config.json")).json()) as WebConfig;
  } catch (e) {
    $("login-error").textContent = `cannot load the page's settings: ${describe(e)}`;
    return;
  }
  const picker = $("persona") as HTMLSelectElement;
  for (const p of config.personas ?? []) {
    const o = el("option", "", p) as HTMLOptionElement;
    o.value = p;
    picker.append(o);
  }
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const who = ($("login-person") as HTMLInputElement).value.trim();
    const password = ($("login-password") as HTMLInputElement).value;
    const remember = ($("login-remember") as HTMLInputElement).checked;
    void login(who, password, remember);
  });
  // The button is disabled in the HTML until the script handles the form: a click before that
  // would be the browser's own form submission (refused by the CSP's form-action 'none', and a
  // navigation that never ends), and the login would be lost.
  ($("login-button") as HTMLButtonElement).disabled = false;
  $("logout").addEventListener("click", () => void logout());
  $("new-session").addEventListener("click", () => newSession());
  window.addEventListener("hashchange", () => {
    if (nc && !operator) void route();
  });
  const picker2 = $("attach") as HTMLInputElement;
  picker2.addEventListener("change", () => {
    for (const file of picker2.files ?? []) void attach(file);
    picker2.value = "";
  });
  const box = $("message") as HTMLTextAreaElement;
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    if (send(box.value)) box.value = "";
  });
  box.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      if (send(box.value)) box.value = "";
    }
  });
  const saved = localStorage.getItem(REMEMBER_KEY);
  if (saved) {
    try {
      const { who, password } = JSON.parse(saved) as { who: string; password: string };
      ($("login-person") as HTMLInputElement).value = who;
      await login(who, password, true);
    } catch {
      localStorage.removeItem(REMEMBER_KEY);
    }
  }
  document.body.dataset.ready = "true";
}

void main();
