//! Tool calls with a durable intent (docs/loop-worker.md, "Tool calls with a durable intent";
//! the guarantee per tool kind: docs/reliability.md, "Tool calls in flight"): a step's tool-call
//! message is durable before any of its calls goes out, so a redelivered turn continues *those*
//! calls under *those* ids instead of asking the model again, and a call to a tool that must not
//! run twice never runs twice. Owns a step's tool batch ([`Batch`]): who its calls run as, how
//! each is sent or answered without being sent, and its result messages.
//!
//! # Invariants
//! - **Intent before request.** Before the first request of a batch goes out, the step is saved
//!   as `tool_calls_started` with its tool-call message: the `started` intent of every call in
//!   it. A `conflict` stops the attempt before any call; a save that keeps failing (a few tries)
//!   hands the job back (`Retry`) before any call. No call goes out without its intent.
//! - **Results as they return.** A not-idempotent call that returns while others of its batch
//!   still run is recorded at once: the same row, saved again with every result so far. The
//!   batch's last result is recorded by the step's own save, which follows at once. A batch's
//!   records are saved one at a time, each holding all earlier ones, and the step's save comes
//!   after the last of them, so a later write never loses an earlier result.
//! - **Continue, never re-ask.** A delivery that finds a started batch runs that step's batch
//!   again: recorded results are kept; a read-only or idempotent call without a result runs again
//!   under its own id; any other call without a result is never run again: its result is
//!   [`OUTCOME_UNKNOWN`] and the session gets a `tool_outcome_unknown` event.
//! - **A lost reply is the same.** A call whose reply never came within the tool's timeout (a
//!   slow tool, or a reply published while the worker was reconnecting) is called once more under
//!   its id if it may be, or reported outcome-unknown, by the attempt that is still alive.
//! - **Fenced.** A `conflict` on any of these saves stops the attempt: nothing more is recorded or
//!   called. The one call this module makes again in a live attempt (after a lost reply) is
//!   preceded by a fenced save.
//!
//! - **Approval before a gated call** (docs/reliability.md, "Approval"). A call that needs a
//!   person's approval (the job's `approval` list, or the tool's `cyrene.tool.approval` =
//!   `required`) and has no decision on the job for its step holds the *whole* batch: the row
//!   is saved as `awaiting_approval` with the calls never sent (`unsent`: all of a fresh
//!   batch), nothing is sent, and the turn ends its job with an `awaiting_approval` completion.
//!   The job that continues it carries the decisions: a denied call gets [`denial`] as its
//!   result without being sent; before an approved call (or any other call of the batch) goes
//!   out, the row is saved again as `tool_calls_started` with no `unsent` call, so from then
//!   on the rule above holds (a crash after it never runs a not-idempotent call twice).
//! - **Decisions bind to their batch.** A decision applies only to the call of that id in the
//!   batch of its step; a call that may already have run is never held again.
//!
//! # Pitfalls
//! - A batch of only read-only calls (`current_time`) and calls answered without being sent
//!   (undecodable arguments) records no intent: running it again changes nothing, so such a step
//!   costs what it always did. Every other batch adds one store round trip before its tools start.
//! - An intent save that timed out may still have landed: a redelivery then finds calls that were
//!   never sent, and reports a not-idempotent one's outcome as unknown (never the reverse).
//! - A read does not say where the started row began, so a resumed batch saves its row again
//!   from the end of the turn's base (the job's seeded messages), a point every earlier row of
//!   the turn covers: that one save carries the turn's steps so far, not only the batch.

use super::{Exit, Turn};
use crate::ports::{Idempotence, ToolContext, ToolOutput, TurnPorts};
use crate::resume::stop_reason;
use cyrene_protocol::ErrorCode;
use cyrene_protocol::approval::{CallDecision, Decision, PendingCall};
use cyrene_protocol::message::{Message, Part, Role, ToolCall};
use cyrene_protocol::session::SessionEventType;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The result a call gets when it was started, may not run twice, and its outcome was lost.
pub const OUTCOME_UNKNOWN: &str = "The outcome of this tool call is unknown: the runtime stopped \
(or lost the tool's reply) while the tool was running, so it may or may not have taken effect. \
It was not run again; check whether it took effect before calling it again.";

/// The result a call gets when a person denied it (then `Reason: …` when one was given).
pub const DENIED: &str = "This tool call was not approved, so it did not run.";
/// The result a call gets when nobody decided before its deadline.
pub const DENIED_BY_DEADLINE: &str =
    "Nobody approved this tool call before its deadline, so it did not run.";

/// How many times an intent save is tried before the job is handed back.
const INTENT_SAVE_TRIES: usize = 3;

/// A step's tool batch: the model's calls and what is already known of their results.
pub(super) struct Batch {
    /// The step's tool-call message, as the window holds it.
    pub assistant: Message,
    pub calls: Vec<ToolCall>,
    /// Results recorded before this delivery (a resumed batch), in any order.
    pub recorded: Vec<Message>,
    /// Found started in the store: its intent is already durable, and a call without a
    /// recorded result may have run (unless `unsent` names it).
    pub resumed: bool,
    /// The calls of a resumed batch known never to have been sent (they waited for approval).
    pub unsent: Vec<String>,
}

impl Batch {
    /// The batch of a step's model answer.
    pub fn new(assistant: Message, calls: Vec<ToolCall>) -> Batch {
        Batch {
            assistant,
            calls,
            recorded: Vec::new(),
            resumed: false,
            unsent: Vec::new(),
        }
    }

    /// Whether `call` may have been sent before this delivery: a resumed batch's call that
    /// no row says was never sent.
    fn may_have_run(&self, call: &ToolCall) -> bool {
        self.resumed && !self.unsent.contains(&call.id)
    }

    fn recorded(&self, call: &ToolCall) -> Option<&Message> {
        self.recorded.iter().find(|m| m.tool_call_id == call.id)
    }
}

/// Splits a window resumed from a started row into the window before the batch and the batch
/// (its last tool-call message, the results after it). `None` for the batch when the window holds
/// no tool-call message. `unsent`: the row's calls known never to have been sent.
pub(super) fn split_started(
    mut window: Vec<Message>,
    unsent: Vec<String>,
) -> (Vec<Message>, Option<Batch>) {
    let at = window.iter().rposition(|m| {
        m.role == Role::Assistant && m.content.iter().any(|p| matches!(p, Part::ToolCall { .. }))
    });
    let Some(at) = at else {
        return (window, None);
    };
    let after = window.split_off(at + 1);
    let Some(assistant) = window.pop() else {
        return (window, None);
    };
    let calls: Vec<ToolCall> = assistant
        .content
        .iter()
        .filter_map(|p| match p {
            Part::ToolCall {
                id,
                name,
                args,
                args_error,
            } => Some(ToolCall {
                id: id.clone(),
                name: name.clone(),
                args: args.clone(),
                args_error: args_error.clone(),
            }),
            _ => None,
        })
        .collect();
    let recorded = after
        .into_iter()
        .filter(|m| m.role == Role::Tool && calls.iter().any(|c| c.id == m.tool_call_id))
        .collect();
    let batch = Batch {
        assistant,
        calls,
        recorded,
        resumed: true,
        unsent,
    };
    (window, Some(batch))
}

/// What becomes of one call of a batch.
enum Plan {
    /// Its result is already recorded.
    Recorded(Message),
    /// Started before, no result, may not run twice.
    Unknown,
    /// Sent now (again, under its id, for a resumed read-only or idempotent call).
    Run,
}

impl<P: TurnPorts> Turn<'_, P> {
    /// Runs a step's tool batch with its intent recorded (see the module invariants): pushes the
    /// tool-call message and the results, in call order, to the window, and returns the results.
    pub(super) async fn tool_batch(
        &mut self,
        step: u32,
        batch: Batch,
    ) -> Result<Vec<Message>, Exit> {
        // Approval: a gated call without a decision holds the whole batch; a denied one gets
        // its denial without being sent.
        let mut waiting = Vec::new();
        let mut denied = Vec::new();
        for call in &batch.calls {
            if call.args_error.is_some()
                || batch.recorded(call).is_some()
                || batch.may_have_run(call)
                || !self.needs_approval(&call.name)
            {
                continue;
            }
            match self.decision(step, &call.id) {
                Some(d) if d.decision == Decision::Approve => {}
                Some(d) => denied.push(denial(call, d)),
                None => waiting.push(PendingCall {
                    step,
                    call_id: call.id.clone(),
                    tool: call.name.clone(),
                    arguments: call.args.clone(),
                }),
            }
        }
        let never_sent: Vec<String> = batch
            .calls
            .iter()
            .filter(|c| batch.recorded(c).is_none() && !batch.may_have_run(c))
            .map(|c| c.id.clone())
            .collect();
        self.window.push(batch.assistant.clone());
        if !waiting.is_empty() {
            self.saves.unsent = never_sent;
            self.save_before_calls(step, stop_reason::AWAITING_APPROVAL, &batch.recorded)
                .await?;
            tracing::info!(turn = %self.job.turn_id, step, calls = waiting.len(),
                "tool calls wait for approval; the job ends");
            return Err(Exit::AwaitingApproval(waiting));
        }
        let kinds: Vec<Idempotence> = batch
            .calls
            .iter()
            .map(|call| match call.args_error {
                // Answered without being sent.
                Some(_) => Idempotence::ReadOnly,
                None => self.ports.tool_idempotence(&call.name),
            })
            .collect();
        let plans: Vec<Plan> = batch
            .calls
            .iter()
            .zip(&kinds)
            .map(|(call, kind)| {
                let done = batch
                    .recorded(call)
                    .or_else(|| denied.iter().find(|m| m.tool_call_id == call.id));
                match done {
                    Some(result) => Plan::Recorded(result.clone()),
                    None if batch.may_have_run(call) && *kind == Idempotence::NotIdempotent => {
                        Plan::Unknown
                    }
                    None => Plan::Run,
                }
            })
            .collect();
        // The results known before any call goes out: recorded, or denied.
        let known: Vec<Message> = batch.recorded.iter().chain(&denied).cloned().collect();
        let sends = plans
            .iter()
            .zip(&kinds)
            .any(|(plan, kind)| matches!(plan, Plan::Run) && *kind != Idempotence::ReadOnly);
        // The intent: a fresh batch's, or a resumed one's whose calls were held for approval
        // (the row says they were never sent; from now on they may be).
        self.saves.unsent.clear();
        if sends && (!batch.resumed || !batch.unsent.is_empty()) {
            self.save_before_calls(step, stop_reason::TOOL_CALLS_STARTED, &known)
                .await?;
        }
        let running = AtomicUsize::new(plans.iter().filter(|p| matches!(p, Plan::Run)).count());
        // The results so far (recorded first, then in the order they return); held while a
        // record is saved, so records go one at a time.
        let results = tokio::sync::Mutex::new(known);
        let stale = AtomicBool::new(false);
        let context = self.tool_context();
        let this = &*self;
        let (running, results, stale, context) = (&running, &results, &stale, &context);
        let messages = futures::future::join_all(batch.calls.iter().zip(kinds).zip(plans).map(
            |((call, kind), plan)| async move {
                let message = match plan {
                    Plan::Recorded(message) => return message,
                    Plan::Unknown => {
                        this.outcome_unknown(step, call).await;
                        return unknown_result(call);
                    }
                    Plan::Run => this.run_call(context, call).await,
                };
                let message = match (message.unanswered, kind) {
                    (false, _) => tool_message(call, message),
                    (true, Idempotence::NotIdempotent) => {
                        this.outcome_unknown(step, call).await;
                        unknown_result(call)
                    }
                    (true, _) => {
                        // Called once more under its id, if this attempt still owns the turn.
                        let again = match this.record(step, results, stale, None).await {
                            true => this.run_call(context, call).await,
                            false => message,
                        };
                        tool_message(call, again)
                    }
                };
                let others = running.fetch_sub(1, Ordering::SeqCst) > 1;
                let record = (kind == Idempotence::NotIdempotent && others).then_some(&message);
                if record.is_some() {
                    this.record(step, results, stale, record).await;
                } else {
                    results.lock().await.push(message.clone());
                }
                message
            },
        ))
        .await;
        if stale.load(Ordering::SeqCst) {
            return Err(Exit::Stale);
        }
        self.window.extend(messages.iter().cloned());
        Ok(messages)
    }

    /// Who this turn's tool calls run as.
    fn tool_context(&self) -> ToolContext {
        ToolContext {
            agent_id: self.job.env.persona.clone(),
            session_id: self.job.session_id.clone(),
            turn_id: self.job.turn_id.clone(),
            allowed: self.job.tools.clone(),
            ask_chain: self.job.ask_chain.clone(),
        }
    }

    /// Runs one call of a step's batch (the batch runs its calls concurrently, intents).
    async fn run_call(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        match &call.args_error {
            Some(err) => ToolOutput::error(format!(
                "the arguments of this call are not valid JSON ({err}); the tool did not run"
            )),
            None => self.ports.call_tool(context, call).await,
        }
    }

    /// Whether a call of `name` waits for a person's approval: the persona's list or the
    /// tool's own metadata says so.
    fn needs_approval(&self, name: &str) -> bool {
        self.job.approval.iter().any(|t| t == name) || self.ports.tool_approval(name)
    }

    /// The job's decision on call `call_id` of the batch of `step`.
    fn decision(&self, step: u32, call_id: &str) -> Option<&CallDecision> {
        self.job
            .decisions
            .iter()
            .find(|d| d.step == step && d.call_id == call_id)
    }

    /// Saves the step as `stop` (`tool_calls_started`: the intent; `awaiting_approval`) with
    /// its tool-call message (the last of the window) and the results `known` so far. A failure
    /// other than `conflict` is tried again a few times, then the job is handed back: no call
    /// goes out without its intent, and no turn waits for approval without its row.
    async fn save_before_calls(
        &mut self,
        step: u32,
        stop: &str,
        known: &[Message],
    ) -> Result<(), Exit> {
        let from = self.delta_from();
        let mut pauses = cyrene_bus::retry::REPORT.delays();
        let mut tries = 0;
        loop {
            let checkpoint = self.checkpoint_with(step, stop, "", known);
            tries += 1;
            match self.ports.save_checkpoint(checkpoint).await {
                // The step's later saves rewrite this row from the same point.
                Ok(()) => {
                    self.saves.stored = Some(from);
                    return Ok(());
                }
                Err(err) if err.code == ErrorCode::Conflict => {
                    tracing::warn!(turn = %self.job.turn_id, attempt = self.attempt, error = %err,
                        "intent refused: a newer attempt owns this turn; stopping");
                    return Err(Exit::Stale);
                }
                Err(err) if tries >= INTENT_SAVE_TRIES => {
                    tracing::warn!(turn = %self.job.turn_id, step, error = %err,
                        "the tool calls' intent could not be saved; no call was made");
                    return Err(Exit::Retry(err));
                }
                Err(err) => {
                    tracing::warn!(turn = %self.job.turn_id, step, error = %err,
                        "intent save failed; trying again");
                    let pause = pauses.next().unwrap_or(cyrene_bus::retry::REPORT.max);
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Saves the started row again with every result so far (and `add`, taken into them);
    /// `false` once this attempt is fenced off (`stale` is set). Any other failure only costs an
    /// outcome reported unknown after a crash, and is not retried.
    async fn record(
        &self,
        step: u32,
        results: &tokio::sync::Mutex<Vec<Message>>,
        stale: &AtomicBool,
        add: Option<&Message>,
    ) -> bool {
        let mut held = results.lock().await;
        if let Some(message) = add {
            held.push(message.clone());
        }
        if stale.load(Ordering::SeqCst) {
            return false;
        }
        let checkpoint = self.checkpoint_with(step, stop_reason::TOOL_CALLS_STARTED, "", &held);
        match self.ports.save_checkpoint(checkpoint).await {
            Ok(()) => true,
            Err(err) if err.code == ErrorCode::Conflict => {
                tracing::warn!(turn = %self.job.turn_id, attempt = self.attempt, error = %err,
                    "tool result refused: a newer attempt owns this turn; stopping");
                stale.store(true, Ordering::SeqCst);
                false
            }
            Err(err) => {
                tracing::warn!(turn = %self.job.turn_id, step, error = %err,
                    "a tool result could not be recorded");
                true
            }
        }
    }

    /// Tells the session that `call`'s outcome is unknown.
    async fn outcome_unknown(&self, step: u32, call: &ToolCall) {
        tracing::warn!(turn = %self.job.turn_id, step, call = %call.id, tool = %call.name,
            "tool call outcome unknown; it is not run again");
        metrics::counter!("cyrene_tool_outcome_unknown_total").increment(1);
        self.event(SessionEventType::ToolOutcomeUnknown, |e| {
            e.at_step = Some(step);
            e.call_id = Some(call.id.clone());
            e.tool = Some(call.name.clone());
            e.arguments = Some(call.args.clone());
        })
        .await;
    }
}

/// The deterministic result of a denied call: [`DENIED`] (with the reason, when one was given)
/// or [`DENIED_BY_DEADLINE`].
pub(super) fn denial(call: &ToolCall, decision: &CallDecision) -> Message {
    let text = match (&decision.reason, decision.decided_by.as_str()) {
        (_, cyrene_protocol::approval::DECIDED_BY_DEADLINE) => DENIED_BY_DEADLINE.to_owned(),
        (Some(reason), _) => format!("{DENIED} Reason: {reason}"),
        (None, _) => DENIED.to_owned(),
    };
    tool_message(call, ToolOutput::error(text))
}

/// The deterministic result of a call whose outcome is unknown.
pub(super) fn unknown_result(call: &ToolCall) -> Message {
    tool_message(call, ToolOutput::error(OUTCOME_UNKNOWN))
}

/// A call's result message: its text, and its images as image parts.
fn tool_message(call: &ToolCall, out: ToolOutput) -> Message {
    let mut message = Message::tool_result(&call.id, &call.name, out.text, out.is_error);
    message.content.extend(
        out.images
            .into_iter()
            .map(|image_url| Part::ImageUrl { image_url }),
    );
    message
}
