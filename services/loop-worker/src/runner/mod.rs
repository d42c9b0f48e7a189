//! One turn, step by step (docs/architecture.md, "§5 A turn on a loop worker"; docs/loop-worker.md,
//! "What a worker does with it"): resume or start fresh, assemble the view, call the model, run
//! the tool batch, checkpoint, steer, repeat; settle every exit. This file owns the step loop and
//! its exits; each part of a turn's state lives with the file that changes it:
//! - `checkpoint`: the rows as deltas, and how much of the window the store holds;
//! - `steering`: what was steered in and taken in, pushed input and the steer request;
//! - `request`: the view's other parts (blocks, documents, images) and the held view;
//! - `intents`: a step's tool batch, its intent and approvals;
//! - `guardrails`: asking the persona's guard about calls and answers;
//! - `settle`: every exit as a non-resumable checkpoint and a completion.
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
//!   (`settle`). A checkpoint is a delta (`checkpoint`; docs/checkpoint-store.md,
//!   "Incremental checkpoints"): the turn's base once, then only what each step added, from the
//!   last point the store is known to hold.
//! - **The step budget has a safety net.** When step `max_steps` ends in tool calls, one more
//!   model call with tool use off asks for an answer from what the window holds; it shares the
//!   last step's number and checkpoint. Only when it gives no text does the turn end as
//!   `budget_exhausted`.
//! - **Steering never cancels, and taken in means answered** (`steering`; I1–I3, D16): input
//!   is taken only at boundaries, after the whole tool batch finished, and counts as taken in
//!   only once a model call whose view held it has answered; a turn past its deadline steers no
//!   more.
//! - **Fencing.** A `conflict` from a checkpoint read or save or a steer means a newer attempt of
//!   this turn owns it: the runner stops at once ([`TurnEnd::Stale`]) and reports nothing.
//! - **Overlap, never reorder.** After a tool batch, the step's checkpoint save, the next
//!   boundary's input and the next model call run together; the next tool batch starts only when
//!   the save is back. So a step is durable before any later side effect, and a fenced-off
//!   attempt runs no tool after its refused save (at most one model call overlapped it).
//! - **Intent before a tool runs** (`intents`): a batch that calls anything but read-only tools
//!   is first saved as `tool_calls_started` with the step's tool-call message; a redelivery
//!   continues that batch with the same calls and ids, never asking the model again, and a call
//!   that may not run twice and has no recorded result gets [`OUTCOME_UNKNOWN`] instead of
//!   running again.
//! - **Resume never redoes work.** A delivery reads only its own turn's latest checkpoint, fenced
//!   (no older attempt can save after the read). A resumed turn continues after its last
//!   completed step, or within its started batch; a job whose turn already reached a settled
//!   checkpoint is reported again (the orchestrator's completion is idempotent) instead of being
//!   run again; a failed read hands the job back for redelivery and never means "start fresh".
//! - **Guarded** (`guardrails`; docs/loop-worker.md, "Guardrails"): a turn whose job names a
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
        match self.model_call(request, Some(step)).await? {
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
        &mut self,
        request: ModelRequest,
        step: Option<u32>,
    ) -> Result<Result<ModelResponse, ErrorBody>, Exit> {
        // The ports and the job are shared references of the turn: copied out, they leave the
        // held view (`self.view.sent`) free to lend to the call.
        let (ports, job, attempt) = (self.ports, self.job, self.attempt);
        let streamed = step.map(|s| {
            (
                crate::deltas::DeltaTag::new(job, attempt, s),
                &mut self.view.sent,
            )
        });
        let call = crate::ports::complete(ports, request, streamed);
        let Some(deadline) = job.deadline_unix_ms else {
            return Ok(call.await);
        };
        let left = std::time::Duration::from_millis(deadline.saturating_sub(now_unix_ms()));
        match tokio::time::timeout(left, call).await {
            Ok(result) => Ok(result),
            Err(_) => {
                tracing::warn!(turn = %job.turn_id, "deadline passed during a model call; abandoned");
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
mod tests;
