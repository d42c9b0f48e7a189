//! One turn, step by step (docs/architecture.md §5, "The step loop"; docs/loop-worker.md, "What
//! a worker does with it"): resume or start fresh, assemble the view, call the model, run the
//! tool batch, checkpoint, steer, repeat; settle every exit. This file owns the step loop and
//! its exits; each part of a turn's state lives with the file that changes it:
//! - [`checkpoint`]: the rows as deltas, and how much of the window the store holds;
//! - [`steering`]: what was steered in and taken in, pushed input and the steer request;
//! - [`request`]: the view's other parts (blocks, documents, images) and the held view;
//! - [`intents`]: a step's tool batch, its intent and approvals;
//! - [`guardrails`]: asking the persona's guard about calls and answers;
//! - [`settle`]: every exit as a non-resumable checkpoint and a completion.
//!
//! # Invariants
//! - **Window vs view.** Steered messages and the parallel notice live only in the view rebuilt
//!   at every step; the window (what checkpoints hold) gets only the seeded messages, the
//!   assistant's messages and tool results.
//! - **Checkpoint after every step** under the turn's owner key (`session` or `session#leg`) with
//!   `{turn_id, attempt}`. A step that ends in tool calls is saved as `tool_calls` (the only
//!   resumable stop reason, and only the loop writes it: a final answer is saved as `stop`
//!   whatever the provider's finish reason, which goes beside it as `finish_reason`; a row
//!   that holds a final answer is never resumed); every other exit — final answer, `safety_net`
//!   answer, budget exhausted, deadline at a boundary (`canceled`) or during a model call
//!   (`aborted`), error — is settled by a non-resumable checkpoint before it is reported
//!   ([`settle`]). A checkpoint is a delta ([`checkpoint`]; docs/checkpoint-store.md,
//!   "Incremental checkpoints"): the turn's base once, then only what each step added, from the
//!   last point the store is known to hold.
//! - **The step budget has a safety net.** When step `max_steps` ends in tool calls, one more
//!   model call with tool use off asks for an answer from what the window holds; it shares the
//!   last step's number and checkpoint. Only when it gives no text does the turn end as
//!   `budget_exhausted`.
//! - **Steering never cancels, and taken in means answered** ([`steering`]; I1–I3, D16): input
//!   is taken only at boundaries, after the whole tool batch finished, and counts as taken in
//!   only once a model call whose view held it has answered; a turn past its deadline steers no
//!   more.
//! - **Fencing.** A `conflict` from a checkpoint read or save or a steer means a newer attempt of
//!   this turn owns it: the runner stops at once ([`TurnEnd::Stale`]) and reports nothing.
//! - **Overlap, never reorder.** After a tool batch, the step's checkpoint save, the next
//!   boundary's input and the next model call run together; the next tool batch starts only when
//!   the save is back. So a step is durable before any later side effect, and a fenced-off
//!   attempt runs no tool after its refused save (at most one model call overlapped it).
//! - **Intent before a tool runs** ([`intents`]): a batch that calls anything but read-only tools
//!   is first saved as `tool_calls_started` with the step's tool-call message; a redelivery
//!   continues that batch with the same calls and ids, never asking the model again, and a call
//!   that may not run twice and has no recorded result gets [`OUTCOME_UNKNOWN`] instead of
//!   running again.
//! - **Resume never redoes work.** A delivery reads only its own turn's latest checkpoint, fenced
//!   (no older attempt can save after the read). A resumed turn continues after its last
//!   completed step, or within its started batch; a job whose turn already reached a settled
//!   checkpoint is reported again (the orchestrator's completion is idempotent) instead of being
//!   run again; a failed read hands the job back for redelivery and never means "start fresh".
//! - **Guarded** ([`guardrails`]; docs/loop-worker.md, "Guardrails"): a turn whose job names a
//!   guard runs no call of a batch and settles no answer the guard did not allow.
//!
//! # Pitfalls
//! - A checkpoint save failure other than `conflict` never fails the turn (WARN): losing a
//!   snapshot only costs re-running a step after a crash.
//! - The deadline abandons a model call, never a tool batch already started (tools are bounded
//!   by their own timeout); it is checked again at the next boundary.
//! - A tool call whose arguments could not be decoded (`args_error`) is answered with an
//!   `is_error` result without running the tool.

use crate::ports::TurnPorts;
use crate::resume::{self, ResumeDecision, stop_reason};
use cyrene_protocol::checkpoint::owner_key;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::turn::{TurnComplete, TurnJob};
use cyrene_protocol::{ErrorBody, ErrorCode};

mod checkpoint;
mod guardrails;
mod intents;
mod request;
mod settle;
mod steering;
pub use intents::OUTCOME_UNKNOWN;

/// What the worker does with the job after the runner returns.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnEnd {
    /// Report this completion (retrying until acknowledged), then ack the job.
    Complete(Box<TurnComplete>),
    /// A retryable failure with attempts left: let JetStream redeliver the job; the crash-left
    /// checkpoint makes the next attempt resume where this one stopped.
    Retry(ErrorBody),
    /// A newer attempt owns the turn: stop without acking or reporting anything.
    Stale,
}

/// Per-worker knobs of the runner.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Accounting tag on model requests.
    pub purpose: String,
    /// The job's delivery limit: on the last attempt a retryable failure settles as an error.
    pub max_attempts: u32,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig {
            purpose: "chat".to_owned(),
            max_attempts: 5,
        }
    }
}

/// How the step loop ended, before settling.
enum Exit {
    /// An answer, settled under a loop-owned stop reason (`stop` or `safety_net`); the
    /// provider's raw finish reason goes beside it, never in its place.
    Final {
        message: Box<Message>,
        stop_reason: &'static str,
        finish_reason: String,
    },
    Budget,
    /// The deadline had passed at a boundary: no further step started.
    Deadline,
    /// The deadline passed during a model call: the call was abandoned.
    Aborted,
    Failed(ErrorBody),
    Retry(ErrorBody),
    Stale,
    /// The guard denied a tool call or the answer (or failed closed); `reason` is for the log
    /// and the checkpoint only.
    Guardrail {
        reason: String,
    },
    /// The step's tool batch holds calls that wait for a person's decision; its row is saved
    /// (`awaiting_approval`) and nothing of the batch was sent (intents).
    AwaitingApproval(Vec<cyrene_protocol::approval::PendingCall>),
}

/// The mutable state of one turn: what every part reads (the ports, the job, the window), and
/// the state each part owns.
struct Turn<'a, P> {
    ports: &'a P,
    job: &'a TurnJob,
    attempt: u32,
    /// The seeded messages, the assistant's messages and the tool results: what checkpoints
    /// hold (never a steered message or the notice, which only the view holds).
    window: Vec<Message>,
    /// Where the rows go and how much of the window the store holds (checkpoint).
    saves: checkpoint::Saves,
    /// What was steered in and taken in, and how the next boundary gets input (steering).
    steering: steering::Steering,
    /// What the view is built from besides the window, and the view a replica holds (request).
    view: request::ViewState,
}

/// The system note closing the view of the safety-net call at the step budget (ours: the
/// reference names the `safety_net` stop but not its wording).
pub const SAFETY_NET_NOTE: &str =
    "[步数上限] 本回合可用的步数已经用完：不要再调用工具，请根据以上已有的信息直接回答。";

/// Runs `job` as delivery `attempt` (1-based).
pub async fn run_turn<P: TurnPorts>(
    ports: &P,
    job: &TurnJob,
    attempt: u32,
    config: &RunnerConfig,
) -> TurnEnd {
    let owner = owner_key(&job.session_id, Some(job.leg_id.as_str()));
    // This turn's own checkpoints only: another turn of the owner is never resumed or reported.
    let latest = match ports.turn_checkpoint(&owner, &job.turn_id, attempt).await {
        Ok(latest) => latest,
        Err(err) if err.code == ErrorCode::Conflict => {
            tracing::warn!(turn = %job.turn_id, attempt, error = %err, "a newer attempt owns this turn");
            return TurnEnd::Stale;
        }
        Err(err) => {
            // Starting fresh could run a completed step's tools again: hand the job back. On the
            // last delivery JetStream gives up on it and the turn is reported as failed.
            tracing::warn!(turn = %job.turn_id, error = %err, "checkpoint load failed; the job will be redelivered");
            return TurnEnd::Retry(err);
        }
    };
    if let Some(done) = settle::already_settled(job, attempt, latest.as_ref()) {
        tracing::info!(turn = %job.turn_id, "turn already settled; reporting it again");
        return TurnEnd::Complete(Box::new(done));
    }
    let decision = resume::decide(latest, &job.messages);
    let next_step = decision.next_step();
    let (window, stored, taken_in, started) = match decision {
        ResumeDecision::Resume {
            messages,
            steered_ids,
            started: true,
            unsent,
            ..
        } => {
            // A step whose tool batch had started: it continues with the same calls
            // (intents), and its row is saved again from the end of the turn's base, a point
            // every earlier row of the turn covers (a read does not say where the row began).
            tracing::info!(turn = %job.turn_id, next_step, "resuming a started tool batch");
            let (before, batch) = intents::split_started(messages, unsent);
            let from = before.len().min(job.messages.len());
            (before, Some(from), steered_ids, batch)
        }
        ResumeDecision::Resume {
            messages,
            steered_ids,
            ..
        } => {
            tracing::info!(turn = %job.turn_id, next_step, "resuming from checkpoint");
            let held = messages.len();
            (messages, Some(held), steered_ids, None)
        }
        ResumeDecision::Fresh { reason } => {
            tracing::debug!(turn = %job.turn_id, ?reason, "starting fresh");
            (job.messages.clone(), None, Vec::new(), None)
        }
    };
    let seed = window.len();
    // Subscribed before the first steer: whatever is claimed for this turn after that steer's
    // read is pushed to a subscription that already exists.
    let input = ports.turn_input(&job.turn_id).await;
    let mut turn = Turn {
        ports,
        job,
        attempt,
        window,
        saves: checkpoint::Saves::new(owner, stored, seed),
        steering: steering::Steering::new(taken_in, job.base_seq, input),
        view: request::ViewState::new(job),
    };
    turn.load_memory().await;
    let (exit, step) = turn.steps(next_step, started, config).await;
    let exit = turn.guard_answer(exit).await;
    turn.settle(exit, step, config).await
}

impl<'a, P: TurnPorts> Turn<'a, P> {
    /// The step loop from step `first`; `started` is a resumed step whose tool batch had
    /// started, which continues before any model call (intents).
    async fn steps(
        &mut self,
        first: u32,
        started: Option<intents::Batch>,
        config: &RunnerConfig,
    ) -> (Exit, u32) {
        let max = self.job.max_steps.max(1);
        if first > max {
            return (Exit::Budget, max);
        }
        let mut step = first;
        let mut next = match started {
            Some(batch) => Next::Started(batch),
            // A boundary before the first step: messages that arrived since dispatch, and — for
            // a resumed turn — every message this turn had already claimed.
            None => match self.boundary_then_model(step, config).await {
                Ok(response) => Next::Answered(response),
                Err(exit) => return (exit, step),
            },
        };
        loop {
            self.event(SessionEventType::Step, |e| e.at_step = Some(step))
                .await;
            let batch = match next {
                Next::Started(batch) => batch,
                Next::Answered(response) if response.tool_calls.is_empty() => {
                    // The loop's own stop, whatever the provider said: a provider may finish
                    // with `tool_calls` and no calls, which must not leave a resumable row (D18).
                    let message = Box::new(self.assistant_message(&response));
                    return (
                        Exit::Final {
                            message,
                            stop_reason: stop_reason::STOP,
                            finish_reason: response.stop_reason,
                        },
                        step,
                    );
                }
                Next::Answered(response) => {
                    // A resumed batch's calls were allowed before their intent was saved.
                    if let Some(reason) = self.guard_calls(&response.tool_calls).await {
                        return (Exit::Guardrail { reason }, step);
                    }
                    intents::Batch::new(self.assistant_message(&response), response.tool_calls)
                }
            };
            self.event(SessionEventType::ToolCall, |e| {
                e.message = Some(batch.assistant.clone())
            })
            .await;
            // The step's calls and results go to the window (intents).
            let results = match self.tool_batch(step, batch).await {
                Ok(results) => results,
                Err(exit) => return (exit, step),
            };
            for result in &results {
                self.event(SessionEventType::ToolResult, |e| {
                    e.message = Some(result.clone())
                })
                .await;
            }
            if step == max {
                // Out of steps mid tool loop: the safety net asks once more for an answer.
                return (self.safety_net(config).await, step);
            }
            // The step's checkpoint, the next boundary's steer and the next model call all
            // follow the tool batch: the save runs while the steer and the model call do. The
            // next tool batch starts only once both are back, so no new side effect happens
            // before this step is durable (or this attempt learns it was fenced off).
            let ports = self.ports;
            let checkpoint = self.checkpoint(step, stop_reason::TOOL_CALLS, "");
            let covered = self.window.len();
            let (saved, next_response) = tokio::join!(
                ports.save_checkpoint(checkpoint),
                self.boundary_then_model(step + 1, config)
            );
            if let Err(exit) = self.saved(saved, covered) {
                return (exit, step);
            }
            step += 1;
            next = match next_response {
                Ok(response) => Next::Answered(response),
                Err(exit) => return (exit, step),
            };
        }
    }

    /// The boundary before `step` (steer), then its model call. A turn past its deadline steers
    /// no more (docs/semantics.md#steering); what a steer merged counts as taken in only once the
    /// model call that saw it has answered.
    async fn boundary_then_model(
        &mut self,
        step: u32,
        config: &RunnerConfig,
    ) -> Result<ModelResponse, Exit> {
        if self.past_deadline() {
            return Err(Exit::Deadline);
        }
        self.steer(step).await?;
        if self.past_deadline() {
            return Err(Exit::Deadline);
        }
        self.resolve_documents().await?;
        let request = self.step_request(config);
        let request = self.resolve_images(request).await;
        let seen = self.steering.steered.len();
        // The held view is lent to the call (taken out of the turn, put back after it).
        let mut sent = std::mem::take(&mut self.view.sent);
        let result = self.model_call(request, Some((step, &mut sent))).await;
        self.view.sent = sent;
        match result? {
            Ok(response) => {
                self.steering.took_in(seen);
                Ok(response)
            }
            Err(err) if err.code.is_retryable() => Err(Exit::Retry(err)),
            Err(err) => Err(Exit::Failed(err)),
        }
    }

    /// One model call, abandoned (`Exit::Aborted`) when the turn's deadline passes first.
    /// A step's call (`step` given) streams its answer text as `delta` events and continues
    /// the turn's held view (crate::deltas).
    async fn model_call(
        &self,
        request: ModelRequest,
        step: Option<(u32, &mut crate::deltas::SentView)>,
    ) -> Result<Result<ModelResponse, ErrorBody>, Exit> {
        let step = step.map(|(s, view)| {
            (
                crate::deltas::DeltaTag::new(self.job, self.attempt, s),
                view,
            )
        });
        let call = crate::ports::complete(self.ports, request, step);
        let Some(deadline) = self.job.deadline_unix_ms else {
            return Ok(call.await);
        };
        let left = std::time::Duration::from_millis(deadline.saturating_sub(now_unix_ms()));
        match tokio::time::timeout(left, call).await {
            Ok(result) => Ok(result),
            Err(_) => {
                tracing::warn!(turn = %self.job.turn_id, "deadline passed during a model call; abandoned");
                Err(Exit::Aborted)
            }
        }
    }

    /// The safety net at the step budget: the last step ended in tool calls whose results are in
    /// the window, so one more model call, with tool use switched off and [`SAFETY_NET_NOTE`]
    /// last in its view, asks for an answer from what is there. A text answer settles the turn
    /// as final with stop reason `safety_net`; anything else (an error, more tool calls, no
    /// text) as `budget_exhausted`.
    async fn safety_net(&mut self, config: &RunnerConfig) -> Exit {
        if self.past_deadline() {
            return Exit::Deadline;
        }
        if let Err(exit) = self.resolve_documents().await {
            return exit;
        }
        let mut request = self.resolve_images(self.request(config)).await;
        request
            .messages
            .push(Message::text(Role::System, SAFETY_NET_NOTE));
        // The neutral form (docs/model-gateway.md): Anthropic's own, mapped to `"none"` for the
        // OpenAI dialect. OpenAI's bare string would be sent verbatim to Anthropic and refused.
        request.tool_choice = Some(serde_json::json!({"type": "none"}));
        match self.model_call(request, None).await {
            Err(exit) => exit,
            Ok(Ok(response))
                if response.tool_calls.is_empty() && !response.content.trim().is_empty() =>
            {
                let steering = &mut self.steering;
                steering.took_in(steering.steered.len());
                Exit::Final {
                    message: Box::new(self.assistant_message(&response)),
                    stop_reason: stop_reason::SAFETY_NET,
                    finish_reason: response.stop_reason,
                }
            }
            Ok(Ok(_)) => Exit::Budget,
            Ok(Err(err)) => {
                tracing::warn!(turn = %self.job.turn_id, error = %err, "safety-net answer failed");
                Exit::Budget
            }
        }
    }

    fn past_deadline(&self) -> bool {
        self.job
            .deadline_unix_ms
            .is_some_and(|deadline| now_unix_ms() >= deadline)
    }

    async fn event(&self, kind: SessionEventType, fill: impl FnOnce(&mut SessionEvent)) {
        let mut event = SessionEvent::new(kind, self.job.session_id.clone());
        event.turn_id = self.job.turn_id.clone();
        event.leg_id = self.job.leg_id.clone();
        fill(&mut event);
        self.ports.publish(event).await;
    }
}

/// What the step loop takes next.
enum Next {
    /// A step's model answer.
    Answered(ModelResponse),
    /// A resumed step whose tool batch had started.
    Started(intents::Batch),
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::notice::PARALLEL_NOTICE_HEADER;
    use crate::ports::{ToolContext, ToolOutput, TurnInput};
    use cyrene_protocol::JsonObject;
    use cyrene_protocol::checkpoint::{Checkpoint, CheckpointState, checkpoint_id};
    use cyrene_protocol::guard::{GuardFail, GuardKind, GuardRequest, GuardSpec};
    use cyrene_protocol::message::{Part, ToolCall};
    use cyrene_protocol::turn::{ParallelNotice, SteerResponse, SteeredMessage};
    use cyrene_protocol::turn::{SteerRequest, TurnComplete, TurnOutcome};
    use serde_json::Map;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// An in-memory bus: scripted model replies and steer answers, recorded everything else.
    #[derive(Default)]
    struct Fake {
        replies: Mutex<VecDeque<Result<ModelResponse, ErrorBody>>>,
        steers: Mutex<VecDeque<Result<SteerResponse, ErrorBody>>>,
        latest: Mutex<Option<Checkpoint>>,
        load_error: Mutex<Option<ErrorBody>>,
        save_error: Mutex<Option<ErrorBody>>,
        requests: Mutex<Vec<ModelRequest>>,
        saved: Mutex<Vec<Checkpoint>>,
        tool_runs: Mutex<Vec<String>>,
        events: Mutex<Vec<SessionEvent>>,
        steer_requests: Mutex<Vec<SteerRequest>>,
        vision: Mutex<Option<bool>>,
        vision_asks: Mutex<usize>,
        /// How long each model call takes.
        model_delay: Mutex<Option<std::time::Duration>>,
        /// The contexts tools were called with.
        tool_contexts: Mutex<Vec<ToolContext>>,
        /// Every tool runs until this unix millisecond (the turn's deadline passes during it).
        tool_until: Mutex<Option<u64>>,
        /// How many of the next saves fail (without landing).
        failing_saves: Mutex<usize>,
        /// Saves as sent (deltas) and the window they rebuild.
        deltas: Mutex<Vec<Checkpoint>>,
        window: Mutex<Vec<Message>>,
        /// Pushed input: `None` = no subscription (every boundary asks).
        pushes: Mutex<Option<futures::channel::mpsc::UnboundedReceiver<SteeredMessage>>>,
        /// The document service's next answers (then `not_found`), and how often it was asked.
        documents: Mutex<VecDeque<Result<crate::ports::FetchedDocument, ErrorBody>>>,
        document_reads: Mutex<usize>,
        /// What tools declare (by name); otherwise as the built-ins, or not idempotent.
        idempotence: Mutex<std::collections::HashMap<String, crate::ports::Idempotence>>,
        /// Saves (`save:<stop>:<step>`) and tool runs (`run:<id>`), in order.
        log: Mutex<Vec<String>>,
        /// Call ids whose next run gets no reply (its request went out).
        unanswered: Mutex<std::collections::HashSet<String>>,
        /// How long each run of a tool (by name) takes.
        tool_delay: Mutex<std::collections::HashMap<String, std::time::Duration>>,
        /// From this save on (0-based), every save is refused as `conflict`.
        conflict_from: Mutex<Option<usize>>,
        save_count: Mutex<usize>,
        /// The guard's reply to each request (none: nobody listens), after `guard_delay`; every
        /// request asked, with its subject.
        guard_rule: Mutex<Option<GuardRule>>,
        guard_delay: Mutex<Option<std::time::Duration>>,
        guard_asks: Mutex<Vec<(String, GuardRequest)>>,
        /// The delta tags of the streamed step calls.
        tags: Mutex<Vec<crate::deltas::DeltaTag>>,
        /// Tools whose metadata asks for approval of every call.
        approval: Mutex<std::collections::HashSet<String>>,
    }

    type GuardRule = fn(&GuardRequest) -> Result<Vec<u8>, ErrorBody>;

    impl TurnPorts for Fake {
        async fn document(
            &self,
            _session_id: &str,
            _url: &str,
        ) -> Result<crate::ports::FetchedDocument, ErrorBody> {
            *self.document_reads.lock().unwrap() += 1;
            self.documents
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| Err(ErrorBody::new(ErrorCode::NotFound, "no such document")))
        }

        /// Like the store: the turn's own latest row, fenced by the attempts that wrote it.
        async fn turn_checkpoint(
            &self,
            _owner: &str,
            turn_id: &str,
            attempt: u32,
        ) -> Result<Option<Checkpoint>, ErrorBody> {
            if let Some(err) = self.load_error.lock().unwrap().clone() {
                return Err(err);
            }
            let latest = self.latest.lock().unwrap().clone();
            let latest = latest.filter(|c| c.turn_id.as_deref() == Some(turn_id));
            if latest.as_ref().and_then(|c| c.attempt) > Some(attempt) {
                return Err(ErrorBody::new(ErrorCode::Conflict, "a newer attempt read"));
            }
            // The rows a resumed turn's next delta builds on.
            if let Some(cp) = &latest {
                *self.window.lock().unwrap() = state(cp).messages;
            }
            Ok(latest)
        }
        /// Like the store: keeps the delta as sent (`deltas`) and the full snapshot a read
        /// would rebuild from it (`saved`).
        async fn save_checkpoint(&self, checkpoint: Checkpoint) -> Result<(), ErrorBody> {
            let nth = {
                let mut count = self.save_count.lock().unwrap();
                *count += 1;
                *count - 1
            };
            if self
                .conflict_from
                .lock()
                .unwrap()
                .is_some_and(|from| nth >= from)
            {
                return Err(ErrorBody::new(ErrorCode::Conflict, "a newer attempt wrote"));
            }
            if let Some(err) = self.save_error.lock().unwrap().clone() {
                return Err(err);
            }
            {
                let mut failing = self.failing_saves.lock().unwrap();
                if *failing > 0 {
                    *failing -= 1;
                    return Err(ErrorBody::new(ErrorCode::Timeout, "no answer"));
                }
            }
            #[derive(serde::Deserialize)]
            struct Delta {
                from: Option<usize>,
                messages: Vec<Message>,
            }
            #[derive(serde::Deserialize)]
            struct Base {
                messages: Vec<Message>,
            }
            let mut window = self.window.lock().unwrap();
            if let Some(base) = &checkpoint.base {
                *window = base.parse::<Base>().unwrap().messages;
            }
            let delta: Delta = checkpoint.state.parse().unwrap();
            let from = delta.from.expect("a turn saves deltas");
            assert!(from <= window.len(), "a delta past the stored window");
            window.truncate(from);
            window.extend(delta.messages);
            let mut full: CheckpointState = checkpoint.state.parse().unwrap();
            self.log
                .lock()
                .unwrap()
                .push(format!("save:{}:{}", full.stop_reason, checkpoint.step));
            full.messages = window.clone();
            let mut assembled = checkpoint.clone();
            assembled.state = JsonObject::encode(&full).unwrap();
            assembled.base = None;
            self.deltas.lock().unwrap().push(checkpoint);
            self.saved.lock().unwrap().push(assembled);
            Ok(())
        }
        async fn turn_input(&self, _turn_id: &str) -> TurnInput {
            match self.pushes.lock().unwrap().take() {
                Some(receiver) => TurnInput::new(receiver),
                None => TurnInput::none(),
            }
        }
        async fn steer(&self, request: SteerRequest) -> Result<SteerResponse, ErrorBody> {
            self.steer_requests.lock().unwrap().push(request);
            self.steers
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or(Ok(SteerResponse::default()))
        }
        async fn main_model_vision(&self, _persona: &str) -> Result<bool, ErrorBody> {
            *self.vision_asks.lock().unwrap() += 1;
            self.vision
                .lock()
                .unwrap()
                .ok_or_else(|| ErrorBody::new(ErrorCode::Unavailable, "no gateway"))
        }
        async fn complete(&self, request: ModelRequest) -> Result<ModelResponse, ErrorBody> {
            if request.purpose == "vision" {
                return reply_text("a red kite over the sea");
            }
            self.requests.lock().unwrap().push(request);
            let delay = *self.model_delay.lock().unwrap();
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            self.replies
                .lock()
                .unwrap()
                .pop_front()
                .unwrap_or_else(|| Err(ErrorBody::new(ErrorCode::Internal, "script ran out")))
        }
        fn tool_specs(&self, _allowed: Option<&[String]>) -> Vec<cyrene_protocol::model::ToolSpec> {
            crate::tools::builtin_specs()
        }
        async fn call_tool(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
            self.tool_contexts.lock().unwrap().push(context.clone());
            self.tool_runs.lock().unwrap().push(call.id.clone());
            self.log.lock().unwrap().push(format!("run:{}", call.id));
            let until = *self.tool_until.lock().unwrap();
            while until.is_some_and(|until| now_unix_ms() <= until) {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            let delay = self.tool_delay.lock().unwrap().get(&call.name).copied();
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            if self.unanswered.lock().unwrap().remove(&call.id) {
                return ToolOutput {
                    unanswered: true,
                    ..ToolOutput::error("request timed out")
                };
            }
            ToolOutput::ok(format!("result of {}", call.id))
        }
        fn tool_idempotence(&self, name: &str) -> crate::ports::Idempotence {
            let declared = self.idempotence.lock().unwrap().get(name).copied();
            declared
                .or_else(|| crate::tools::builtin_idempotence(name))
                .unwrap_or(crate::ports::Idempotence::NotIdempotent)
        }
        fn tool_approval(&self, name: &str) -> bool {
            self.approval.lock().unwrap().contains(name)
        }
        async fn publish(&self, event: SessionEvent) {
            self.events.lock().unwrap().push(event);
        }
        async fn complete_streamed(
            &self,
            mut request: ModelRequest,
            tag: crate::deltas::DeltaTag,
            view: &mut crate::deltas::SentView,
        ) -> Result<ModelResponse, ErrorBody> {
            self.tags.lock().unwrap().push(tag);
            view.whole(&mut request);
            self.complete(request).await
        }
        async fn guard(
            &self,
            subject: &str,
            payload: Vec<u8>,
            _timeout: std::time::Duration,
        ) -> Result<Vec<u8>, ErrorBody> {
            let request: GuardRequest = serde_json::from_slice(&payload).unwrap();
            self.guard_asks
                .lock()
                .unwrap()
                .push((subject.to_owned(), request.clone()));
            let delay = *self.guard_delay.lock().unwrap();
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            let rule = *self.guard_rule.lock().unwrap();
            match rule {
                Some(rule) => rule(&request),
                None => Err(ErrorBody::new(
                    ErrorCode::Unavailable,
                    "no responders on cyrene.guard.policy",
                )),
            }
        }
    }

    impl Fake {
        /// A bus whose model gives `replies`, in order.
        fn scripted(replies: impl IntoIterator<Item = Result<ModelResponse, ErrorBody>>) -> Self {
            let fake = Self::default();
            fake.replies.lock().unwrap().extend(replies);
            fake
        }

        /// A bus whose store already holds `latest` as the turn's newest row (a redelivery).
        fn resuming(latest: Option<Checkpoint>) -> Self {
            let fake = Self::default();
            *fake.latest.lock().unwrap() = latest;
            fake
        }

        /// The state of the `index`th full snapshot saved.
        fn saved_state(&self, index: usize) -> CheckpointState {
            state(&self.saved.lock().unwrap()[index])
        }
    }

    /// The full snapshots attempt `attempt` of `job()` saves when the model gives `replies`:
    /// what a later attempt finds in the store.
    async fn rows_left_by(
        replies: impl IntoIterator<Item = Result<ModelResponse, ErrorBody>>,
        attempt: u32,
    ) -> Vec<Checkpoint> {
        let fake = Fake::scripted(replies);
        let _ = run_turn(&fake, &job(), attempt, &CFG).await;
        fake.saved.lock().unwrap().clone()
    }

    /// The row of step 1 that attempt `attempt` of `job()` saves when that step calls tool `c1`:
    /// what a crash after the step leaves in the store.
    async fn tool_step_left_by(attempt: u32) -> Checkpoint {
        rows_left_by([reply_tools(&["c1"]), reply_text("x")], attempt)
            .await
            .swap_remove(0)
    }

    /// A plain text answer of the scripted model (also used by `crate::images`' tests).
    pub(crate) fn reply_text(text: &str) -> Result<ModelResponse, ErrorBody> {
        Ok(ModelResponse::offline_text("scripted", "offline", text))
    }

    fn reply_tools(ids: &[&str]) -> Result<ModelResponse, ErrorBody> {
        let calls: Vec<ToolCall> = ids
            .iter()
            .map(|id| ToolCall {
                id: (*id).into(),
                name: "current_time".into(),
                args: Map::new(),
                args_error: None,
            })
            .collect();
        let mut r = reply_text("")?;
        r.message = Message::assistant_tool_calls(&calls);
        r.tool_calls = calls;
        r.stop_reason = "tool_calls".into();
        Ok(r)
    }

    fn job() -> TurnJob {
        TurnJob {
            message_ids: vec!["m1".into()],
            max_steps: 4,
            ..cyrene_test_support::fixtures::turn_job("t1", "s1", "what time is it?")
        }
    }

    fn state(cp: &Checkpoint) -> CheckpointState {
        cp.state.parse().unwrap()
    }

    fn completed(end: TurnEnd) -> TurnComplete {
        match end {
            TurnEnd::Complete(done) => *done,
            other => panic!("expected a completion, got {other:?}"),
        }
    }

    const CFG: RunnerConfig = RunnerConfig {
        purpose: String::new(),
        max_attempts: 3,
    };

    #[tokio::test]
    async fn a_tool_turn_checkpoints_every_step_and_ends_with_the_answer() {
        let fake = Fake::scripted([reply_tools(&["c1", "c2"]), reply_text("It is noon.")]);
        let done = completed(run_turn(&fake, &job(), 1, &CFG).await);

        assert_eq!(done.outcome, TurnOutcome::Final);
        assert_eq!(done.steps, 2);
        let answer = done.message.unwrap();
        assert_eq!(answer.text_content(), "It is noon.");
        assert_eq!(answer.sender_name, "cyrene");
        assert_eq!(*fake.tool_runs.lock().unwrap(), ["c1", "c2"]);

        let saved = fake.saved.lock().unwrap();
        assert_eq!(saved.len(), 2);
        assert_eq!(
            (saved[0].id.as_str(), saved[0].attempt),
            ("s1:t1:1", Some(1))
        );
        assert_eq!(state(&saved[0]).stop_reason, "tool_calls");
        // user, assistant tool calls, two results in call order
        let window = state(&saved[0]).messages;
        assert_eq!(window.len(), 4);
        assert_eq!(window[2].tool_call_id, "c1");
        assert_eq!(window[3].tool_call_id, "c2");
        assert_eq!(state(&saved[1]).stop_reason, "stop");
        assert_eq!(state(&saved[1]).messages.len(), 5);

        // The second model call saw the tool results; both started with the instructions.
        let requests = fake.requests.lock().unwrap();
        assert_eq!(
            requests[0].messages[0],
            Message::text(Role::System, "You are Cyrene.")
        );
        // instructions, time block, user, assistant calls, two results: the assistant message is
        // labelled with its persona, but only one persona spoke, so attribution renders nothing
        // (docs/semantics.md#attribution).
        assert_eq!(requests[1].messages.len(), 6);
        assert!(
            requests[1]
                .messages
                .iter()
                .all(|m| !m.text_content().starts_with("[会话角色]")
                    && !m.text_content().starts_with("[发言归属]"))
        );
        assert_eq!(requests[0].persona_id, "cyrene");

        let kinds: Vec<_> = fake.events.lock().unwrap().iter().map(|e| e.kind).collect();
        use SessionEventType::*;
        assert_eq!(kinds, [Step, ToolCall, ToolResult, ToolResult, Step, Final]);
    }

    #[tokio::test]
    async fn a_steered_message_reaches_the_next_step_but_never_a_checkpoint() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("done")]);
        let steered = SteeredMessage {
            id: "m2".into(),
            seq: 2,
            message: Message::text(Role::User, "and the date too"),
        };
        fake.steers.lock().unwrap().extend([
            Ok(SteerResponse::default()),
            Ok(SteerResponse {
                messages: vec![steered.clone()],
            }),
        ]);
        let done = completed(run_turn(&fake, &job(), 1, &CFG).await);

        assert_eq!(done.steered_ids, ["m2"]);
        let requests = fake.requests.lock().unwrap();
        assert!(!requests[0].messages.contains(&steered.message));
        assert_eq!(requests[1].messages.last(), Some(&steered.message));
        for cp in fake.saved.lock().unwrap().iter() {
            assert!(
                !state(cp).messages.contains(&steered.message),
                "steered text in {}",
                cp.id
            );
        }
        let steers = fake.steer_requests.lock().unwrap();
        assert_eq!((steers[0].step, steers[0].after_seq), (1, 1));
        assert_eq!((steers[1].step, steers[1].after_seq), (2, 1));
        let ack = fake
            .events
            .lock()
            .unwrap()
            .iter()
            .find(|e| e.kind == SessionEventType::SteerAck)
            .cloned();
        let ack = ack.expect("a steer_ack event");
        assert_eq!(
            (ack.at_step, ack.message_ids),
            (Some(2), vec!["m2".to_owned()])
        );
    }

    #[tokio::test]
    async fn each_save_sends_only_what_its_step_added_and_the_base_once() {
        let fake = Fake::scripted([
            reply_tools(&["c1"]),
            reply_tools(&["c2", "c3"]),
            reply_text("done"),
        ]);
        let mut j = job();
        j.messages = (0..50)
            .map(|i| Message::text(Role::User, format!("old {i}")))
            .collect();
        completed(run_turn(&fake, &j, 1, &CFG).await);

        let deltas = fake.deltas.lock().unwrap();
        let shape = |cp: &Checkpoint| {
            let map = cp.state.to_map();
            let added = map["messages"].as_array().unwrap().len();
            (map["from"].as_u64().unwrap(), added, cp.base.is_some())
        };
        // The base (50 seeded messages) goes once, with the first save; then each step's call
        // and results, then the answer.
        assert_eq!(
            deltas.iter().map(shape).collect::<Vec<_>>(),
            [(50, 2, true), (52, 3, false), (55, 1, false)]
        );
        let base = deltas[0].base.as_ref().unwrap().to_map();
        assert_eq!(base["messages"].as_array().unwrap().len(), 50);
        // What a read rebuilds is the whole window.
        let last = state(fake.saved.lock().unwrap().last().unwrap());
        assert_eq!(last.messages.len(), 56);
        assert_eq!(last.messages[..50], j.messages[..]);
    }

    #[tokio::test]
    async fn after_a_failed_save_the_next_one_resends_from_the_last_stored_point() {
        let fake = Fake::scripted([
            reply_tools(&["c1"]),
            reply_tools(&["c2"]),
            reply_text("done"),
        ]);
        // The first save (with the base) fails: the second carries the base and both steps.
        *fake.failing_saves.lock().unwrap() = 1;
        completed(run_turn(&fake, &job(), 1, &CFG).await);
        let deltas = fake.deltas.lock().unwrap();
        let first = deltas[0].state.to_map();
        assert_eq!(deltas[0].step, 2);
        assert!(deltas[0].base.is_some(), "the base was never stored");
        assert_eq!(first["from"], 1);
        assert_eq!(first["messages"].as_array().unwrap().len(), 4);
        let last = state(fake.saved.lock().unwrap().last().unwrap());
        assert_eq!(last.messages.len(), 6);
    }

    #[tokio::test]
    async fn pushed_input_reaches_the_next_boundary_without_a_steer_request() {
        let (push, receiver) = futures::channel::mpsc::unbounded();
        let fake = Fake::scripted([
            reply_tools(&["c1"]),
            reply_tools(&["c2"]),
            reply_text("done"),
        ]);
        *fake.pushes.lock().unwrap() = Some(receiver);
        let pushed = |id: &str, seq: u64| SteeredMessage {
            id: id.into(),
            seq,
            message: Message::text(Role::User, format!("pushed {id}")),
        };
        // Two pushes before the second boundary, out of order, one of them also returned by the
        // first steer: taken in once each, in seq order.
        fake.steers.lock().unwrap().push_back(Ok(SteerResponse {
            messages: vec![pushed("m2", 2)],
        }));
        push.unbounded_send(pushed("m3", 3)).unwrap();
        push.unbounded_send(pushed("m2", 2)).unwrap();
        push.unbounded_send(pushed("m4", 4)).unwrap();
        let done = completed(run_turn(&fake, &job(), 1, &CFG).await);

        assert_eq!(done.steered_ids, ["m2", "m3", "m4"]);
        let steers = fake.steer_requests.lock().unwrap();
        assert_eq!(steers.len(), 1, "only the first boundary asks");
        assert_eq!(steers[0].step, 1);
        let requests = fake.requests.lock().unwrap();
        let texts = |i: usize| -> Vec<String> {
            requests[i]
                .messages
                .iter()
                .map(Message::text_content)
                .filter(|t| t.starts_with("pushed"))
                .collect()
        };
        assert_eq!(texts(0), ["pushed m2"]);
        assert_eq!(texts(1), ["pushed m2", "pushed m3", "pushed m4"]);
        assert_eq!(texts(2), texts(1));
    }

    #[tokio::test]
    async fn a_crash_left_checkpoint_resumes_without_rerunning_tools() {
        let crash_left = tool_step_left_by(1).await;

        let second = Fake::scripted([reply_text("It is noon.")]);
        *second.latest.lock().unwrap() = Some(crash_left);
        let done = completed(run_turn(&second, &job(), 2, &CFG).await);

        assert_eq!(done.steps, 2);
        assert!(
            second.tool_runs.lock().unwrap().is_empty(),
            "step 1's tool ran again"
        );
        assert_eq!(second.requests.lock().unwrap().len(), 1);
        assert_eq!(second.saved.lock().unwrap()[0].id, "s1:t1:2");
        assert_eq!(second.saved.lock().unwrap()[0].attempt, Some(2));
    }

    #[tokio::test]
    async fn a_settled_turn_is_reported_again_not_rerun() {
        let settled = rows_left_by([reply_text("It is noon.")], 1).await.pop();

        let again = Fake::resuming(settled);
        let done = completed(run_turn(&again, &job(), 2, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Final);
        assert_eq!(done.message.unwrap().text_content(), "It is noon.");
        assert!(again.requests.lock().unwrap().is_empty());
        assert!(again.saved.lock().unwrap().is_empty());
    }

    /// D18: a provider that finishes with `tool_calls` but sends no calls. The answer is
    /// settled as the loop's `stop` (the raw reason beside it), and a redelivery after the save
    /// reports it again instead of calling the model for a second answer.
    #[tokio::test]
    async fn an_answer_the_provider_calls_tool_calls_is_settled_and_never_answered_twice() {
        let mut odd = reply_text("It is noon.").unwrap();
        odd.stop_reason = "tool_calls".into();
        let first = Fake::scripted([Ok(odd)]);
        let done = completed(run_turn(&first, &job(), 1, &CFG).await);
        assert_eq!(
            (done.outcome, done.stop_reason.as_str()),
            (TurnOutcome::Final, "stop")
        );
        let settled = first.saved.lock().unwrap().last().cloned().unwrap();
        let saved = state(&settled);
        assert_eq!(
            (saved.stop_reason.as_str(), saved.finish_reason.as_str()),
            ("stop", "tool_calls")
        );

        let again = Fake::scripted([reply_text("a second answer")]);
        *again.latest.lock().unwrap() = Some(settled.clone());
        let redone = completed(run_turn(&again, &job(), 2, &CFG).await);
        assert_eq!(redone.message.unwrap().text_content(), "It is noon.");
        assert!(again.requests.lock().unwrap().is_empty(), "asked again");
        assert!(
            again.events.lock().unwrap().is_empty(),
            "a second final event"
        );

        // A row an older worker saved under the provider's `tool_calls`: the same.
        let mut legacy = settled;
        let mut map = legacy.state.to_map();
        map.insert("stop_reason".into(), serde_json::json!("tool_calls"));
        map.remove("finish_reason");
        legacy.state = map.into();
        let old = Fake::scripted([reply_text("a second answer")]);
        *old.latest.lock().unwrap() = Some(legacy);
        let redone = completed(run_turn(&old, &job(), 2, &CFG).await);
        assert_eq!(
            (redone.outcome, redone.stop_reason.as_str()),
            (TurnOutcome::Final, "stop")
        );
        assert_eq!(redone.message.unwrap().text_content(), "It is noon.");
        assert!(old.requests.lock().unwrap().is_empty(), "asked again");
    }

    #[tokio::test]
    async fn a_settled_turn_is_reported_again_with_its_steered_messages() {
        let first = Fake::scripted([reply_text("Noon, and sunny.")]);
        first.steers.lock().unwrap().push_back(Ok(SteerResponse {
            messages: vec![SteeredMessage {
                id: "m2".into(),
                seq: 2,
                message: Message::text(Role::User, "and the weather?"),
            }],
        }));
        let reported = completed(run_turn(&first, &job(), 1, &CFG).await);
        assert_eq!(reported.steered_ids, ["m2"]);
        let settled = first.saved.lock().unwrap().last().cloned();

        // The report never arrived; the worker died; the redelivery must say the same.
        let again = Fake::resuming(settled);
        let done = completed(run_turn(&again, &job(), 2, &CFG).await);
        assert_eq!(
            done.steered_ids,
            ["m2"],
            "its steered message would be answered twice"
        );
        assert!(again.requests.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn another_turns_checkpoint_is_never_resumed_or_reported() {
        let other_turn = tool_step_left_by(1).await;

        let fake = Fake::scripted([reply_text("fresh")]);
        *fake.latest.lock().unwrap() = Some(other_turn);
        let mut next = job();
        next.turn_id = "t2".into();
        let done = completed(run_turn(&fake, &next, 1, &CFG).await);
        assert_eq!((done.steps, done.turn_id.as_str()), (1, "t2"));
        assert_eq!(fake.saved.lock().unwrap()[0].id, "s1:t2:1");
    }

    /// A job whose message carries a text document.
    fn job_with_a_document() -> TurnJob {
        let mut job = job();
        let message = job.messages.last_mut().unwrap();
        message.content.push(Part::Document {
            name: "d-1".into(),
            mime: "text/plain".into(),
            url: "cyrene-doc://d-1".into(),
            size: 5,
        });
        job
    }

    fn stored_document() -> crate::ports::FetchedDocument {
        crate::ports::FetchedDocument {
            name: "d-1".into(),
            mime: "text/plain".into(),
            size: 5,
            title: String::new(),
            bytes: b"hello".to_vec(),
        }
    }

    /// D23 (issue 34): a document service that fails for a passing reason is asked again; the
    /// model sees the document's text, never "could not extract".
    #[tokio::test(start_paused = true)]
    async fn a_passing_document_service_failure_is_tried_again() {
        let fake = Fake::scripted([reply_text("read it")]);
        fake.documents.lock().unwrap().extend([
            Err(ErrorBody::new(ErrorCode::Unavailable, "no responders")),
            Err(ErrorBody::new(ErrorCode::Timeout, "slow")),
            Ok(stored_document()),
        ]);
        let done = completed(run_turn(&fake, &job_with_a_document(), 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Final);
        assert_eq!(*fake.document_reads.lock().unwrap(), 3);
        let requests = fake.requests.lock().unwrap();
        let user = requests[0]
            .messages
            .iter()
            .rev()
            .find(|m| m.role == Role::User)
            .unwrap()
            .text_content();
        assert!(
            user.contains("[文档] d-1（text/plain，5 字节）：\nhello"),
            "{user}"
        );
        assert!(!user.contains("未能提取文字内容"), "{user}");
    }

    /// D23: still failing after every try, the attempt hands its job back (the model is not
    /// asked); a lasting answer (`not_found`) is the manifest line.
    #[tokio::test(start_paused = true)]
    async fn a_document_service_that_stays_down_hands_the_job_back() {
        let fake = Fake::scripted([reply_text("never")]);
        fake.documents.lock().unwrap().extend(
            (0..crate::documents::READ_TRIES)
                .map(|_| Err(ErrorBody::new(ErrorCode::Unavailable, "no responders"))),
        );
        let end = run_turn(&fake, &job_with_a_document(), 1, &CFG).await;
        assert!(
            matches!(end, TurnEnd::Retry(ref e) if e.code == ErrorCode::Unavailable),
            "{end:?}"
        );
        assert!(
            fake.requests.lock().unwrap().is_empty(),
            "the model was asked"
        );

        let gone = Fake::scripted([reply_text("answered")]);
        let done = completed(run_turn(&gone, &job_with_a_document(), 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Final);
        let requests = gone.requests.lock().unwrap();
        assert!(
            requests[0]
                .messages
                .iter()
                .any(|m| m.text_content().contains("未能提取文字内容")),
            "the manifest line"
        );
    }

    #[tokio::test]
    async fn a_failed_checkpoint_read_hands_the_job_back_instead_of_starting_fresh() {
        let fake = Fake::scripted([reply_tools(&["c1"])]);
        *fake.load_error.lock().unwrap() =
            Some(ErrorBody::new(ErrorCode::Unavailable, "store down"));
        let end = run_turn(&fake, &job(), 2, &CFG).await;
        assert!(
            matches!(end, TurnEnd::Retry(ref e) if e.code == ErrorCode::Unavailable),
            "{end:?}"
        );
        assert!(
            fake.requests.lock().unwrap().is_empty(),
            "the model was asked"
        );
        assert!(fake.tool_runs.lock().unwrap().is_empty(), "a tool ran");
        assert!(fake.steer_requests.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_fenced_off_attempt_stops_without_reporting() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("x")]);
        *fake.save_error.lock().unwrap() =
            Some(ErrorBody::new(ErrorCode::Conflict, "attempt 1 < 2"));
        assert_eq!(run_turn(&fake, &job(), 1, &CFG).await, TurnEnd::Stale);
        // The next model call overlaps the refused save, but no tool runs after the refusal.
        assert_eq!(
            *fake.tool_runs.lock().unwrap(),
            ["c1"],
            "no tool after the refusal"
        );
        assert!(fake.saved.lock().unwrap().is_empty());

        let fenced = Fake::default();
        fenced
            .steers
            .lock()
            .unwrap()
            .push_back(Err(ErrorBody::new(ErrorCode::Conflict, "old")));
        assert_eq!(run_turn(&fenced, &job(), 1, &CFG).await, TurnEnd::Stale);
        assert!(fenced.requests.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn an_attempt_older_than_the_latest_writer_stops_at_once() {
        let written_by_3 = tool_step_left_by(3).await;

        let zombie = Fake::resuming(Some(written_by_3));
        assert_eq!(run_turn(&zombie, &job(), 2, &CFG).await, TurnEnd::Stale);
        assert!(zombie.requests.lock().unwrap().is_empty());
        assert!(zombie.steer_requests.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn images_become_descriptions_for_a_main_model_without_vision() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("a kite!")]);
        *fake.vision.lock().unwrap() = Some(false);
        let mut j = job();
        let photo = Message::image(Role::User, "look", "https://example.invalid/kite.png");
        j.messages = vec![photo.clone()];
        let _ = run_turn(&fake, &j, 1, &CFG).await;

        let requests = fake.requests.lock().unwrap();
        for request in requests.iter() {
            assert!(
                !request.messages.iter().any(Message::has_image),
                "an image reached the model"
            );
            let user = request
                .messages
                .iter()
                .find(|m| m.role == Role::User)
                .unwrap();
            assert_eq!(
                user.content[1],
                Part::text("[图片描述] a red kite over the sea")
            );
        }
        assert_eq!(*fake.vision_asks.lock().unwrap(), 1, "asked once per turn");
        // The window (checkpoints) keeps the image itself.
        assert_eq!(fake.saved_state(0).messages[0], photo);
    }

    #[tokio::test]
    async fn images_pass_through_to_a_main_model_with_vision_or_when_unsure() {
        for vision in [Some(true), None] {
            let fake = Fake::scripted([reply_text("nice")]);
            *fake.vision.lock().unwrap() = vision;
            let mut j = job();
            j.messages = vec![Message::image(
                Role::User,
                "look",
                "https://example.invalid/k.png",
            )];
            let _ = run_turn(&fake, &j, 1, &CFG).await;
            assert!(
                fake.requests.lock().unwrap()[0]
                    .messages
                    .iter()
                    .any(Message::has_image)
            );
        }
    }

    #[tokio::test]
    async fn a_failed_steer_yields_nothing_and_the_turn_goes_on() {
        let fake = Fake::scripted([reply_text("fine")]);
        fake.steers
            .lock()
            .unwrap()
            .push_back(Err(ErrorBody::new(ErrorCode::Timeout, "slow")));
        let done = completed(run_turn(&fake, &job(), 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Final);
        assert!(done.steered_ids.is_empty());
    }

    #[tokio::test]
    async fn other_non_conflict_save_failures_do_not_fail_the_turn() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("ok")]);
        *fake.save_error.lock().unwrap() = Some(ErrorBody::new(ErrorCode::Unavailable, "db down"));
        let done = completed(run_turn(&fake, &job(), 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Final);
    }

    #[tokio::test]
    async fn retryable_model_failures_retry_until_the_last_attempt_then_settle() {
        let fake = Fake::scripted([Err(ErrorBody::new(ErrorCode::Unavailable, "no gateway"))]);
        assert!(matches!(
            run_turn(&fake, &job(), 1, &CFG).await,
            TurnEnd::Retry(_)
        ));
        assert!(
            fake.saved.lock().unwrap().is_empty(),
            "nothing settled: the next attempt runs"
        );

        fake.replies
            .lock()
            .unwrap()
            .push_back(Err(ErrorBody::new(ErrorCode::Unavailable, "no gateway")));
        let done = completed(run_turn(&fake, &job(), 3, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Error);
        assert_eq!(done.error.unwrap().code, ErrorCode::Unavailable);
        assert_eq!(fake.saved_state(0).stop_reason, "error");
        assert!(
            fake.events
                .lock()
                .unwrap()
                .iter()
                .any(|e| e.kind == SessionEventType::Error)
        );

        let bad = Fake::scripted([Err(ErrorBody::new(
            ErrorCode::Upstream,
            "400 from provider",
        ))]);
        assert_eq!(
            completed(run_turn(&bad, &job(), 1, &CFG).await).outcome,
            TurnOutcome::Error
        );
    }

    #[tokio::test]
    async fn running_out_of_steps_settles_as_budget_exhausted() {
        let fake = Fake::scripted([reply_tools(&["a"]), reply_tools(&["b"])]);
        let mut j = job();
        j.max_steps = 2;
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::BudgetExhausted);
        let last = fake.saved.lock().unwrap().last().cloned().unwrap();
        assert_eq!(
            (last.step, state(&last).stop_reason.as_str()),
            (2, "budget_exhausted")
        );
    }

    #[tokio::test]
    async fn a_call_with_undecodable_args_gets_an_error_result_without_running() {
        let mut r = reply_tools(&["bad"]).unwrap();
        r.tool_calls[0].args_error = Some("expected value at line 1".into());
        let fake = Fake::scripted([Ok(r), reply_text("sorry")]);
        let _ = run_turn(&fake, &job(), 1, &CFG).await;
        assert!(fake.tool_runs.lock().unwrap().is_empty());
        let window = fake.saved_state(0).messages;
        assert!(
            matches!(&window[2].content[0], Part::ToolResult { is_error: true, text, .. }
            if text.contains("not valid JSON"))
        );
    }

    #[tokio::test]
    async fn the_parallel_notice_is_the_last_view_message_and_never_checkpointed() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("x")]);
        let mut j = job();
        j.leg_id = "leg2".into();
        j.notice = Some(ParallelNotice {
            step: 3,
            ..Default::default()
        });
        let _ = run_turn(&fake, &j, 1, &CFG).await;
        for request in fake.requests.lock().unwrap().iter() {
            let last = request.messages.last().unwrap();
            assert_eq!(last.role, Role::System);
            assert!(last.text_content().starts_with(PARALLEL_NOTICE_HEADER));
        }
        for cp in fake.saved.lock().unwrap().iter() {
            assert_eq!(cp.agent_id, "s1#leg2");
            assert!(state(cp).messages.iter().all(|m| m.role != Role::System));
        }
    }

    fn steered(id: &str, seq: u64, text: &str) -> SteeredMessage {
        SteeredMessage {
            id: id.into(),
            seq,
            message: Message::text(Role::User, text),
        }
    }

    /// D16: the deadline passes while step 1's tool runs and a message waits to be steered in at
    /// step 2. The turn ends without taking it (no steer, not in `steered_ids` or a checkpoint),
    /// so the orchestrator hands it back to pending and it gets a turn of its own.
    #[tokio::test]
    async fn a_message_waiting_when_the_deadline_passes_is_not_taken_in() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("too late")]);
        fake.steers.lock().unwrap().extend([
            Ok(SteerResponse::default()),
            Ok(SteerResponse {
                messages: vec![steered("m2", 2, "and the weather?")],
            }),
        ]);
        let mut j = job();
        let deadline = now_unix_ms() + 2_000;
        j.deadline_unix_ms = Some(deadline);
        *fake.tool_until.lock().unwrap() = Some(deadline);
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);

        assert_eq!(done.outcome, TurnOutcome::Cancelled);
        assert_eq!(fake.requests.lock().unwrap().len(), 1, "step 1 ran");
        assert!(done.steered_ids.is_empty(), "{:?}", done.steered_ids);
        assert_eq!(
            fake.steer_requests.lock().unwrap().len(),
            1,
            "a turn past its deadline steers no more"
        );
        for cp in fake.saved.lock().unwrap().iter() {
            assert!(state(cp).steered_ids.is_empty(), "{}", cp.id);
        }
    }

    /// D16: a message counts as taken in only once a model call that saw it answered. Attempt 1
    /// steers `m2` in and dies before its model call answers; attempt 2 (a redelivery past the
    /// deadline, or one whose model call fails) must not report `m2` as taken in.
    #[tokio::test]
    async fn a_message_steered_in_before_a_crash_is_taken_in_only_by_a_model_call() {
        let first = Fake::scripted([reply_text("never sent")]);
        *first.model_delay.lock().unwrap() = Some(std::time::Duration::from_secs(3600));
        first.steers.lock().unwrap().push_back(Ok(SteerResponse {
            messages: vec![steered("m2", 2, "and the weather?")],
        }));
        let crashed = tokio::time::timeout(
            std::time::Duration::from_millis(300),
            run_turn(&first, &job(), 1, &CFG),
        )
        .await;
        assert!(crashed.is_err(), "attempt 1 died in its model call");
        assert_eq!(first.steer_requests.lock().unwrap().len(), 1);

        // The orchestrator answers attempt 2's first steer with everything claimed for the turn.
        let again = || {
            let fake = Fake::default();
            fake.steers.lock().unwrap().push_back(Ok(SteerResponse {
                messages: vec![steered("m2", 2, "and the weather?")],
            }));
            fake
        };
        // Redelivered after the deadline: cancelled, and m2 goes back to pending.
        let late = again();
        let mut j = job();
        j.deadline_unix_ms = Some(1);
        let done = completed(run_turn(&late, &j, 2, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Cancelled);
        assert!(done.steered_ids.is_empty(), "{:?}", done.steered_ids);

        // Redelivered on its last attempt and the model call fails: an error, m2 not taken in.
        let failing = again();
        failing
            .replies
            .lock()
            .unwrap()
            .push_back(Err(ErrorBody::new(ErrorCode::Upstream, "400")));
        let done = completed(run_turn(&failing, &job(), 3, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Error);
        assert!(done.steered_ids.is_empty(), "{:?}", done.steered_ids);
        assert!(failing.saved_state(0).steered_ids.is_empty());

        // Redelivered and answered: m2 was in the answering call's view, so it is taken in.
        let answered = again();
        answered
            .replies
            .lock()
            .unwrap()
            .push_back(reply_text("sunny"));
        let done = completed(run_turn(&answered, &job(), 2, &CFG).await);
        assert_eq!(done.steered_ids, ["m2"]);
        assert_eq!(answered.saved_state(0).steered_ids, ["m2"]);
    }

    /// A resumed turn keeps what its checkpoint says was taken in, even when it ends before a
    /// model call of its own.
    #[tokio::test]
    async fn a_resumed_turn_keeps_the_messages_its_checkpoint_took_in() {
        let first = Fake::scripted([reply_tools(&["c1"]), reply_tools(&["c2"])]);
        first.steers.lock().unwrap().extend([
            Ok(SteerResponse::default()),
            Ok(SteerResponse {
                messages: vec![steered("m2", 2, "and the date")],
            }),
        ]);
        let mut j = job();
        j.max_steps = 4;
        // Step 2 saw m2 and asked for tools; its row is what a crash after its save leaves.
        let _ = run_turn(&first, &j, 1, &CFG).await;
        let step2 = first
            .saved
            .lock()
            .unwrap()
            .iter()
            .find(|c| c.step == 2)
            .cloned()
            .unwrap();
        assert_eq!(state(&step2).steered_ids, ["m2"]);

        let late = Fake::resuming(Some(step2));
        j.deadline_unix_ms = Some(1);
        let done = completed(run_turn(&late, &j, 2, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Cancelled);
        assert_eq!(done.steered_ids, ["m2"]);
    }

    #[tokio::test]
    async fn a_passed_deadline_settles_as_cancelled() {
        let fake = Fake::default();
        let mut j = job();
        j.deadline_unix_ms = Some(1);
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Cancelled);
        assert!(fake.requests.lock().unwrap().is_empty());
        assert_eq!(fake.saved_state(0).stop_reason, "canceled");
    }

    #[tokio::test]
    async fn every_view_opens_with_the_instructions_then_the_time_block() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("noon")]);
        let _ = run_turn(&fake, &job(), 1, &CFG).await;
        let requests = fake.requests.lock().unwrap();
        assert_eq!(requests.len(), 2);
        let first_block = requests[0].messages[1].clone();
        for request in requests.iter() {
            assert_eq!(request.messages[0].text_content(), "You are Cyrene.");
            assert_eq!(request.messages[1].role, Role::System);
            assert!(
                request.messages[1]
                    .text_content()
                    .starts_with(crate::assemble::TIME_BLOCK_MARKER),
                "{:?}",
                request.messages[1]
            );
            // One stamp per attempt: the prefix stays the same from step to step.
            assert_eq!(request.messages[1], first_block);
        }
        // A view block, never in the window.
        for cp in fake.saved.lock().unwrap().iter() {
            assert!(state(cp).messages.iter().all(|m| m.role != Role::System));
        }
    }

    #[tokio::test]
    async fn the_step_budget_ends_with_a_safety_net_answer_without_tools() {
        let fake = Fake::scripted([
            reply_tools(&["a"]),
            reply_tools(&["b"]),
            reply_text("From what I found: noon."),
        ]);
        let mut j = job();
        j.max_steps = 2;
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);
        assert_eq!(done.outcome, TurnOutcome::Final);
        assert_eq!(done.stop_reason, "safety_net");
        assert_eq!(done.steps, 2);
        assert_eq!(
            done.message.unwrap().text_content(),
            "From what I found: noon."
        );
        assert_eq!(*fake.tool_runs.lock().unwrap(), ["a", "b"]);
        let last = fake.requests.lock().unwrap().last().cloned().unwrap();
        assert_eq!(last.tool_choice, Some(serde_json::json!({"type": "none"})));
        assert_eq!(
            last.messages.last().unwrap().text_content(),
            SAFETY_NET_NOTE
        );
        let settled = fake.saved.lock().unwrap().last().cloned().unwrap();
        let settled_state = state(&settled);
        assert_eq!(
            (settled.step, settled_state.stop_reason.as_str()),
            (2, "safety_net")
        );
        assert!(
            settled_state
                .messages
                .iter()
                .all(|m| m.text_content() != SAFETY_NET_NOTE),
            "the note is view only"
        );

        // Redelivered after the report was lost: reported again, not rerun.
        let again = Fake::resuming(Some(settled));
        let done = completed(run_turn(&again, &j, 2, &CFG).await);
        assert_eq!(
            (done.outcome, done.stop_reason.as_str()),
            (TurnOutcome::Final, "safety_net")
        );
        assert!(again.requests.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_model_call_still_running_at_the_deadline_is_abandoned_as_aborted() {
        let fake = Fake::scripted([reply_text("too late")]);
        *fake.model_delay.lock().unwrap() = Some(std::time::Duration::from_secs(30));
        let mut j = job();
        j.deadline_unix_ms = Some(now_unix_ms() + 150);
        let started = std::time::Instant::now();
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        assert_eq!(done.outcome, TurnOutcome::Cancelled);
        assert_eq!(done.stop_reason, "aborted");
        assert_eq!(fake.saved_state(0).stop_reason, "aborted");
    }

    #[tokio::test]
    async fn tool_calls_carry_the_turns_allow_list() {
        let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("ok")]);
        let mut j = job();
        j.tools = Some(vec!["current_time".into()]);
        let _ = run_turn(&fake, &j, 1, &CFG).await;
        let contexts = fake.tool_contexts.lock().unwrap();
        assert_eq!(contexts[0].allowed, Some(vec!["current_time".to_owned()]));
    }

    // ---- guardrails ----

    const GUARD_MESSAGE: &str = "I can't help with that here.";

    fn guarded(fail: GuardFail) -> TurnJob {
        TurnJob {
            guard: Some(GuardSpec {
                subject: "cyrene.guard.policy".into(),
                timeout_ms: 1_000,
                fail,
                message: GUARD_MESSAGE.into(),
            }),
            ..job()
        }
    }

    fn allow(_: &GuardRequest) -> Result<Vec<u8>, ErrorBody> {
        Ok(br#"{"allow":true}"#.to_vec())
    }

    /// Denies every call of `count` and any answer that mentions a secret.
    fn policy(request: &GuardRequest) -> Result<Vec<u8>, ErrorBody> {
        let denied = match request.kind {
            GuardKind::ToolCall => request.tool.as_deref() == Some("count"),
            GuardKind::Answer => request.text.as_deref().unwrap_or("").contains("secret"),
        };
        Ok(serde_json::to_vec(&serde_json::json!({
            "allow": !denied,
            "reason": if denied { "policy 7: internal rule text" } else { "" },
        }))
        .unwrap())
    }

    fn named_calls(names: &[(&str, &str)]) -> Result<ModelResponse, ErrorBody> {
        let mut r = reply_tools(&names.iter().map(|(id, _)| *id).collect::<Vec<_>>())?;
        for (call, (_, name)) in r.tool_calls.iter_mut().zip(names) {
            call.name = (*name).into();
        }
        r.message = Message::assistant_tool_calls(&r.tool_calls);
        Ok(r)
    }

    /// Asserts a turn ended by its guard: the configured message as its answer, none of the
    /// guard's reason for the person, a settled `guardrail` checkpoint holding the reason.
    fn assert_guardrail(fake: &Fake, done: &TurnComplete, reason_has: &str) -> Checkpoint {
        assert_eq!(
            (done.outcome, done.stop_reason.as_str()),
            (TurnOutcome::Final, "guardrail")
        );
        let answer = done.message.clone().unwrap();
        assert_eq!(answer.text_content(), GUARD_MESSAGE);
        assert_eq!(answer.sender_name, "cyrene");
        let settled = fake.saved.lock().unwrap().last().cloned().unwrap();
        let st = state(&settled);
        assert_eq!(st.stop_reason, "guardrail");
        assert!(st.guard_reason.contains(reason_has), "{}", st.guard_reason);
        assert_eq!(st.messages.last(), Some(&answer));
        let events = fake.events.lock().unwrap();
        let last = events.last().unwrap();
        assert_eq!(last.kind, SessionEventType::Final);
        assert_eq!(last.message.as_ref().unwrap().text_content(), GUARD_MESSAGE);
        for event in events.iter() {
            let shown = serde_json::to_string(event).unwrap();
            assert!(
                !shown.contains("internal rule"),
                "the reason reached the session: {shown}"
            );
        }
        settled
    }

    #[tokio::test]
    async fn a_denied_tool_call_never_runs_and_neither_does_its_batch() {
        let fake = Fake::scripted([
            named_calls(&[("c1", "current_time"), ("c2", "count")]),
            reply_text("never asked"),
        ]);
        *fake.guard_rule.lock().unwrap() = Some(policy);
        let j = guarded(GuardFail::Closed);
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);

        assert!(
            fake.tool_runs.lock().unwrap().is_empty(),
            "no call of the batch ran"
        );
        assert_eq!(fake.requests.lock().unwrap().len(), 1, "no further step");
        let settled = assert_guardrail(&fake, &done, "tool_call count: policy 7");
        assert_eq!(done.steps, 1);
        // Both calls were asked about, each with its name and arguments.
        let asks = fake.guard_asks.lock().unwrap().clone();
        assert_eq!(asks.len(), 2);
        for (subject, request) in &asks {
            assert_eq!(subject, "cyrene.guard.policy");
            assert_eq!(request.kind, GuardKind::ToolCall);
            assert_eq!(
                (request.session_id.as_str(), request.turn_id.as_str()),
                ("s1", "t1")
            );
            assert_eq!(request.persona, "cyrene");
            assert!(request.arguments.is_some() && request.text.is_none());
        }
        assert!(
            fake.events
                .lock()
                .unwrap()
                .iter()
                .all(|e| e.kind != SessionEventType::ToolCall),
            "a stopped call is not announced"
        );

        // Redelivered after the report was lost: reported again, nothing asked or run.
        let again = Fake::resuming(Some(settled));
        let redone = completed(run_turn(&again, &j, 2, &CFG).await);
        assert_eq!(
            (
                redone.stop_reason.as_str(),
                redone.message.unwrap().text_content()
            ),
            ("guardrail", GUARD_MESSAGE.to_owned())
        );
        assert!(again.requests.lock().unwrap().is_empty());
        assert!(again.guard_asks.lock().unwrap().is_empty());
        assert!(again.tool_runs.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn allowed_calls_run_and_calls_with_undecodable_args_are_not_asked_about() {
        let mut bad = named_calls(&[("c1", "current_time"), ("c2", "count")]).unwrap();
        bad.tool_calls[1].args_error = Some("expected value".into());
        let fake = Fake::scripted([Ok(bad), reply_text("It is noon.")]);
        *fake.guard_rule.lock().unwrap() = Some(policy);
        let done = completed(run_turn(&fake, &guarded(GuardFail::Closed), 1, &CFG).await);
        assert_eq!(
            (done.outcome, done.stop_reason.as_str()),
            (TurnOutcome::Final, "stop")
        );
        assert_eq!(done.message.unwrap().text_content(), "It is noon.");
        assert_eq!(*fake.tool_runs.lock().unwrap(), ["c1"]);
        let kinds: Vec<(GuardKind, Option<String>)> = fake
            .guard_asks
            .lock()
            .unwrap()
            .iter()
            .map(|(_, r)| (r.kind, r.tool.clone()))
            .collect();
        assert_eq!(
            kinds,
            [
                (GuardKind::ToolCall, Some("current_time".into())),
                (GuardKind::Answer, None)
            ]
        );
    }

    #[tokio::test]
    async fn a_denied_answer_never_reaches_the_session_or_the_checkpoint() {
        let fake = Fake::scripted([reply_text("the secret is 42")]);
        *fake.guard_rule.lock().unwrap() = Some(policy);
        let done = completed(run_turn(&fake, &guarded(GuardFail::Closed), 1, &CFG).await);
        let settled = assert_guardrail(&fake, &done, "answer: policy 7");
        let asks = fake.guard_asks.lock().unwrap().clone();
        assert_eq!(asks.len(), 1);
        assert_eq!(asks[0].1.kind, GuardKind::Answer);
        assert_eq!(asks[0].1.text.as_deref(), Some("the secret is 42"));
        assert!(asks[0].1.tool.is_none() && asks[0].1.arguments.is_none());
        for shown in [
            serde_json::to_string(&*fake.events.lock().unwrap()).unwrap(),
            settled.state.as_str().to_owned(),
        ] {
            assert!(!shown.contains("secret is 42"), "{shown}");
        }
        // No step of a guarded turn is previewed as deltas; an unguarded one is.
        let tags = fake.tags.lock().unwrap().clone();
        assert!(
            !tags.is_empty() && tags.iter().all(|t| !t.preview),
            "{tags:?}"
        );
        let open = Fake::scripted([reply_text("hello")]);
        let _ = run_turn(&open, &job(), 1, &CFG).await;
        assert!(open.tags.lock().unwrap().iter().all(|t| t.preview));
    }

    #[tokio::test]
    async fn the_safety_net_answer_is_asked_about_too() {
        let fake = Fake::scripted([
            reply_tools(&["a"]),
            reply_tools(&["b"]),
            reply_text("the secret, from what I found"),
        ]);
        *fake.guard_rule.lock().unwrap() = Some(policy);
        let mut j = guarded(GuardFail::Closed);
        j.max_steps = 2;
        let done = completed(run_turn(&fake, &j, 1, &CFG).await);
        assert_eq!(*fake.tool_runs.lock().unwrap(), ["a", "b"]);
        assert_guardrail(&fake, &done, "answer: policy 7");
    }

    #[tokio::test]
    async fn a_guard_that_is_down_fails_closed_or_open_as_configured() {
        // Nobody listens (the fake's guard has no rule).
        let closed = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
        let done = completed(run_turn(&closed, &guarded(GuardFail::Closed), 1, &CFG).await);
        assert!(closed.tool_runs.lock().unwrap().is_empty());
        assert_guardrail(
            &closed,
            &done,
            "the guard failed: unavailable: no responders",
        );

        let open = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
        let done = completed(run_turn(&open, &guarded(GuardFail::Open), 1, &CFG).await);
        assert_eq!(*open.tool_runs.lock().unwrap(), ["c1"]);
        assert_eq!(
            (done.outcome, done.stop_reason.as_str()),
            (TurnOutcome::Final, "stop")
        );
        assert_eq!(done.message.unwrap().text_content(), "It is noon.");
        assert_eq!(
            open.guard_asks.lock().unwrap().len(),
            2,
            "asked, failed, let through"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_guard_slower_than_its_timeout_fails_closed_or_open_as_configured() {
        for fail in [GuardFail::Closed, GuardFail::Open] {
            let fake = Fake::scripted([reply_text("It is noon.")]);
            *fake.guard_rule.lock().unwrap() = Some(allow);
            // Longer than the spec's 1 s: the reply would allow, but it comes too late.
            *fake.guard_delay.lock().unwrap() = Some(std::time::Duration::from_secs(60));
            let done = completed(run_turn(&fake, &guarded(fail), 1, &CFG).await);
            match fail {
                GuardFail::Closed => {
                    assert_guardrail(&fake, &done, "no reply within 1s");
                }
                GuardFail::Open => {
                    assert_eq!(done.stop_reason, "stop");
                    assert_eq!(done.message.unwrap().text_content(), "It is noon.");
                }
            }
        }
        // Within the timeout the reply counts.
        let fake = Fake::scripted([reply_text("It is noon.")]);
        *fake.guard_rule.lock().unwrap() = Some(allow);
        *fake.guard_delay.lock().unwrap() = Some(std::time::Duration::from_millis(900));
        let done = completed(run_turn(&fake, &guarded(GuardFail::Closed), 1, &CFG).await);
        assert_eq!(done.stop_reason, "stop");
    }

    #[tokio::test]
    async fn a_malformed_guard_reply_is_a_failure_never_a_panic() {
        let rules: [GuardRule; 6] = [
            |_| Ok(b"yes".to_vec()),
            |_| Ok(br#"{"reason":"allow missing"}"#.to_vec()),
            |_| Ok(br#"{"allow":"true"}"#.to_vec()),
            |_| Ok(br#"{"allow":true,"reason":["x"]}"#.to_vec()),
            |_| {
                let mut huge = br#"{"allow":true,"reason":""#.to_vec();
                huge.extend(std::iter::repeat_n(b'x', 70 * 1024));
                huge.extend(br#""}"#);
                Ok(huge)
            },
            |_| Err(ErrorBody::new(ErrorCode::Internal, "the guard crashed")),
        ];
        for (i, rule) in rules.into_iter().enumerate() {
            let closed = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
            *closed.guard_rule.lock().unwrap() = Some(rule);
            let done = completed(run_turn(&closed, &guarded(GuardFail::Closed), 1, &CFG).await);
            assert!(closed.tool_runs.lock().unwrap().is_empty(), "rule {i}");
            assert_guardrail(&closed, &done, "the guard failed");

            let open = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
            *open.guard_rule.lock().unwrap() = Some(rule);
            let done = completed(run_turn(&open, &guarded(GuardFail::Open), 1, &CFG).await);
            assert_eq!(*open.tool_runs.lock().unwrap(), ["c1"], "rule {i}");
            assert_eq!(done.stop_reason, "stop", "rule {i}");
        }
    }

    #[tokio::test]
    async fn a_deny_beats_failing_open() {
        let fake = Fake::scripted([named_calls(&[("c1", "count")]), reply_text("x")]);
        *fake.guard_rule.lock().unwrap() = Some(policy);
        let done = completed(run_turn(&fake, &guarded(GuardFail::Open), 1, &CFG).await);
        assert!(fake.tool_runs.lock().unwrap().is_empty());
        assert_guardrail(&fake, &done, "policy 7");
    }

    /// Human approval of tool calls (`super::intents`).
    mod approvals;
    /// Tool calls with a durable intent (`super::intents`).
    mod intents;
}
