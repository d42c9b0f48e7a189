//! Settling a turn (docs/loop-worker.md, "What a worker does with it" and "Crashes, redelivery,
//! fencing"): every exit of the step loop becomes a non-resumable checkpoint, an event and the
//! completion the worker reports; a redelivered job whose turn already settled is reported again
//! from its row instead of being run again.
//!
//! # Invariants
//! - **Settled before reported.** Every exit but `Stale`, `AwaitingApproval` and a `Retry` with
//!   deliveries left is saved as a non-resumable checkpoint before its completion is returned: a
//!   final answer as `stop` (or `safety_net`, `guardrail`) whatever the provider's finish reason,
//!   which goes beside it as `finish_reason`; budget exhausted, deadline at a boundary
//!   (`canceled`) or during a model call (`aborted`), error. A refused (`conflict`) settling save
//!   reports nothing ([`TurnEnd::Stale`]).
//! - **Reported again exactly.** A settled row (any stop reason but `tool_calls`, or a row whose
//!   window ends in a final answer, D18) rebuilds the completion the first report gave, steered
//!   messages included; the orchestrator's completion is idempotent.
//! - **Only what was taken in is reported** in `steered_ids` (runner::steering).

use super::{Exit, RunnerConfig, Turn, TurnEnd};
use crate::ports::TurnPorts;
use crate::resume::{self, stop_reason};
use cyrene_protocol::checkpoint::{Checkpoint, CheckpointState};
use cyrene_protocol::message::Role;
use cyrene_protocol::session::SessionEventType;
use cyrene_protocol::turn::{TurnComplete, TurnJob, TurnOutcome};
use cyrene_protocol::{ErrorBody, ErrorCode};

impl<P: TurnPorts> Turn<'_, P> {
    /// Settles every exit: a non-resumable checkpoint, an event, the completion to report.
    pub(super) async fn settle(mut self, exit: Exit, step: u32, config: &RunnerConfig) -> TurnEnd {
        let mut finish = String::new();
        let (outcome, stop, message, error) = match exit {
            Exit::Stale => return TurnEnd::Stale,
            // The row is saved; the turn is not over, so no event ends it.
            Exit::AwaitingApproval(approvals) => {
                return TurnEnd::Complete(Box::new(TurnComplete {
                    approvals,
                    ..completion(
                        self.job,
                        self.attempt,
                        TurnOutcome::AwaitingApproval,
                        stop_reason::AWAITING_APPROVAL.to_owned(),
                        step,
                        self.steering.taken_in.clone(),
                    )
                }));
            }
            // The deliveries of this job (its attempts count on from `attempt_base`).
            Exit::Retry(err)
                if self.attempt.saturating_sub(self.job.attempt_base) < config.max_attempts =>
            {
                tracing::warn!(turn = %self.job.turn_id, attempt = self.attempt, error = %err,
                    "retryable failure; the job will be redelivered");
                return TurnEnd::Retry(err);
            }
            Exit::Retry(err) | Exit::Failed(err) => (
                TurnOutcome::Error,
                stop_reason::ERROR.to_owned(),
                None,
                Some(err),
            ),
            Exit::Final {
                message,
                stop_reason,
                finish_reason,
            } => {
                self.window.push((*message).clone());
                finish = finish_reason;
                (
                    TurnOutcome::Final,
                    stop_reason.to_owned(),
                    Some(*message),
                    None,
                )
            }
            Exit::Guardrail { reason } => {
                // The denied call or answer is in no message: the window ends with what the
                // person is told, so a redelivery reports it again.
                self.saves.guard_reason = reason;
                let message = self.guard_message();
                self.window.push(message.clone());
                (
                    TurnOutcome::Final,
                    stop_reason::GUARDRAIL.to_owned(),
                    Some(message),
                    None,
                )
            }
            Exit::Budget => (
                TurnOutcome::BudgetExhausted,
                stop_reason::BUDGET_EXHAUSTED.to_owned(),
                None,
                None,
            ),
            Exit::Deadline => (
                TurnOutcome::Cancelled,
                stop_reason::CANCELED.to_owned(),
                None,
                None,
            ),
            Exit::Aborted => (
                TurnOutcome::Cancelled,
                stop_reason::ABORTED.to_owned(),
                None,
                None,
            ),
        };
        let saved = self
            .ports
            .save_checkpoint(self.checkpoint(step, &stop, &finish))
            .await;
        if self.saved(saved, self.window.len()).is_err() {
            return TurnEnd::Stale;
        }
        match (&message, &error) {
            (Some(m), _) => {
                self.event(SessionEventType::Final, |e| e.message = Some(m.clone()))
                    .await
            }
            (None, Some(err)) => {
                self.event(SessionEventType::Error, |e| e.error = Some(err.clone()))
                    .await
            }
            (None, None) => {}
        }
        TurnEnd::Complete(Box::new(TurnComplete {
            message,
            error,
            ..completion(
                self.job,
                self.attempt,
                outcome,
                stop,
                step,
                self.steering.taken_in.clone(),
            )
        }))
    }
}

/// A redelivered job whose turn already reached a settled checkpoint — any stop reason but
/// `tool_calls`, or a row whose window ends in a final answer whatever it says (D18) —: rebuild
/// its completion, steered messages included, exactly as the first report said it.
pub(super) fn already_settled(
    job: &TurnJob,
    attempt: u32,
    latest: Option<&Checkpoint>,
) -> Option<TurnComplete> {
    let checkpoint = latest?;
    let mut state: CheckpointState = checkpoint.state.parse().ok()?;
    let answered = resume::holds_final_answer(&state.messages);
    if state.turn_id != job.turn_id
        || (resume::resumable_stop_reason(&state.stop_reason) && !answered)
    {
        return None;
    }
    if resume::resumable_stop_reason(&state.stop_reason) {
        // A row saved under the provider's `tool_calls` though it holds the answer (D18).
        state.stop_reason = stop_reason::STOP.to_owned();
    }
    let (outcome, message) = match state.stop_reason.as_str() {
        stop_reason::BUDGET_EXHAUSTED => (TurnOutcome::BudgetExhausted, None),
        stop_reason::CANCELED | stop_reason::ABORTED => (TurnOutcome::Cancelled, None),
        stop_reason::ERROR => (TurnOutcome::Error, None),
        _ => (
            TurnOutcome::Final,
            state
                .messages
                .last()
                .filter(|m| m.role == Role::Assistant)
                .cloned(),
        ),
    };
    let error = (outcome == TurnOutcome::Error)
        .then(|| ErrorBody::new(ErrorCode::Internal, "the turn had already failed"));
    Some(TurnComplete {
        message,
        error,
        ..completion(
            job,
            attempt,
            outcome,
            state.stop_reason,
            checkpoint.step,
            state.steered_ids,
        )
    })
}

/// The completion of `job`'s delivery `attempt`, without an answer, an error or calls waiting
/// for approval (each caller sets the ones it has).
fn completion(
    job: &TurnJob,
    attempt: u32,
    outcome: TurnOutcome,
    stop_reason: String,
    steps: u32,
    steered_ids: Vec<String>,
) -> TurnComplete {
    TurnComplete {
        turn_id: job.turn_id.clone(),
        session_id: job.session_id.clone(),
        leg_id: job.leg_id.clone(),
        attempt,
        outcome,
        message: None,
        stop_reason,
        steps,
        steered_ids,
        error: None,
        approvals: Vec::new(),
    }
}
