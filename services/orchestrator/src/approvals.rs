//! Approvals on the bus (docs/orchestrator.md, "Approvals"): the `awaiting_approval` completion
//! of a turn that stopped at calls needing a person's decision, the decisions
//! (`cyrene.session.approve`, the person's and the bridge's), the list
//! (`cyrene.session.approvals`, …) and the deadline that denies by itself.
//!
//! # Invariants
//! - The SQL owns the truth (`store/approvals.rs`): a decision is committed, and the turn it
//!   completes is rewritten for dispatch, before anything is published. `approval_decided` and
//!   the job follow the commit; should this process die in between, the dispatch sweeper
//!   publishes the job (the event is lost: `session.approvals` shows the decision).
//! - `approval_requested` is published after the awaiting completion commits, and again on a
//!   repeat of that completion for the calls still waiting (clients key cards by call id).
//! - A caller who may not touch the session hears `not_found`, as for an unknown call: a call
//!   id of somebody else's session is never confirmed to exist.

use crate::engine::Engine;
use crate::identity::Caller;
use crate::store::{ApprovalRow, CallRef, Decided, NewDecision};
use cyrene_bus::service::{page_within, reply_budget};
use cyrene_protocol::approval::{
    self, ApprovalsRequest, ApprovalsResponse, ApproveRequest, ApproveResponse, Decision,
};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::turn::{TurnComplete, TurnCompleteAck};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_sql::bounded;

/// The longest call id taken (providers' are far shorter).
pub const MAX_CALL_ID_BYTES: usize = 512;
/// The most expired calls one sweep denies.
const DENY_PER_SWEEP: i64 = 100;
/// The reason the deadline's denials carry (the model sees it).
pub const DEADLINE_REASON: &str = "nobody decided before the deadline";

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::BadRequest, message)
}

fn check_call_id(call_id: &str) -> Result<(), ErrorBody> {
    if call_id.is_empty() || call_id.len() > MAX_CALL_ID_BYTES || call_id.contains(char::is_control)
    {
        return Err(bad(format!(
            "call_id must be 1 to {MAX_CALL_ID_BYTES} bytes of printable text"
        )));
    }
    Ok(())
}

/// A refusal to touch a session is answered as an unknown call would be.
pub fn hide_forbidden(err: ErrorBody) -> ErrorBody {
    match err.code {
        ErrorCode::Forbidden => ErrorBody::new(
            ErrorCode::NotFound,
            "no call of that session waits for approval under that id",
        ),
        _ => err,
    }
}

/// `decided_by` of a decision sent by `caller`, and its metric label.
fn decider(caller: Caller<'_>) -> (String, &'static str) {
    match caller {
        Caller::Shared => (approval::DECIDED_BY_OPERATOR.to_owned(), "operator"),
        Caller::Person(person) => (approval::decided_by_person(person), "person"),
        Caller::Bridge => (approval::DECIDED_BY_BRIDGE.to_owned(), "bridge"),
    }
}

impl Engine {
    /// An `awaiting_approval` completion: the turn waits, its calls are recorded and announced.
    pub(crate) async fn await_approval(
        &self,
        req: TurnComplete,
    ) -> Result<TurnCompleteAck, ErrorBody> {
        for call in &req.approvals {
            check_call_id(&call.call_id)?;
            ids::validate(IdKind::Tool, &call.tool).map_err(|e| bad(format!("tool: {e}")))?;
        }
        let awaited = bounded(self.config().db_timeout, self.store.await_approval(&req)).await?;
        if awaited.first {
            metrics::counter!("cyrene_approvals_requested_total")
                .increment(awaited.pending.len() as u64);
            tracing::info!(turn = %req.turn_id, calls = awaited.pending.len(),
                "turn waits for approval");
        }
        for row in &awaited.pending {
            let mut event = SessionEvent::new(SessionEventType::ApprovalRequested, &row.session_id);
            event.turn_id = row.turn_id.clone();
            event.leg_id = awaited.leg_id.clone();
            event.at_step = u32::try_from(row.step).ok();
            event.call_id = Some(row.call_id.clone());
            event.tool = Some(row.tool.clone());
            event.arguments = Some(row.arguments());
            event.deadline_ms = Some(row.deadline);
            self.publish_event(&event).await;
        }
        Ok(TurnCompleteAck {
            first: awaited.first,
        })
    }

    /// `cyrene.session.approve` (and the person's and bridge's): the decision that holds.
    pub async fn approve(
        &self,
        req: ApproveRequest,
        caller: Caller<'_>,
    ) -> Result<ApproveResponse, ErrorBody> {
        ids::validate(IdKind::Session, &req.session_id)
            .map_err(|e| bad(format!("session_id: {e}")))?;
        check_call_id(&req.call_id)?;
        if let Some(reason) = &req.reason
            && reason.len() > approval::MAX_REASON_BYTES
        {
            return Err(ErrorBody::new(
                ErrorCode::TooLarge,
                format!(
                    "reason is {} bytes; at most {}",
                    reason.len(),
                    approval::MAX_REASON_BYTES
                ),
            ));
        }
        let (decided_by, kind) = decider(caller);
        let call = CallRef::Session {
            session_id: &req.session_id,
            call_id: &req.call_id,
        };
        let decision = NewDecision {
            decision: req.decision,
            reason: req.reason.as_deref().filter(|r| !r.trim().is_empty()),
            decided_by: &decided_by,
        };
        let decided = bounded(self.config().db_timeout, self.store.decide(call, decision))
            .await
            .map_err(|err| match err.code {
                ErrorCode::NotFound => ErrorBody::new(
                    ErrorCode::NotFound,
                    "no call of that session waits for approval under that id",
                ),
                _ => err,
            })?;
        self.after_decision(&decided, kind).await;
        Ok(ApproveResponse {
            session_id: req.session_id,
            call_id: req.call_id,
            decision: decided.row.decision().unwrap_or(req.decision),
            already_decided: decided.already,
            decided_by: decided.row.decided_by.clone().unwrap_or_default(),
        })
    }

    /// Announces a decision just made and dispatches the turn it completed.
    async fn after_decision(&self, decided: &Decided, kind: &'static str) {
        if decided.already {
            return;
        }
        let row = &decided.row;
        let decision = row.decision().map_or("deny", Decision::as_str);
        metrics::counter!("cyrene_approvals_decided_total", "decision" => decision, "by" => kind)
            .increment(1);
        tracing::info!(turn = %row.turn_id, call = %row.call_id, decision,
            by = row.decided_by.as_deref().unwrap_or_default(), "approval decided");
        let mut event = SessionEvent::new(SessionEventType::ApprovalDecided, &row.session_id);
        event.turn_id = row.turn_id.clone();
        event.at_step = u32::try_from(row.step).ok();
        event.call_id = Some(row.call_id.clone());
        event.tool = Some(row.tool.clone());
        event.decision = row.decision();
        event.reason = row.reason.clone();
        event.decided_by = row.decided_by.clone();
        self.publish_event(&event).await;
        if let Some(turn) = &decided.resumed {
            tracing::info!(turn = %turn.turn_id, resumes = turn.resumes,
                "every call decided; the turn continues");
            self.publish_job(&turn.turn_id, &turn.msg_id(), &turn.job)
                .await;
        }
    }

    /// `cyrene.session.approvals` (and the person's and bridge's).
    pub async fn approvals(&self, req: ApprovalsRequest) -> Result<ApprovalsResponse, ErrorBody> {
        ids::validate(IdKind::Session, &req.session_id)
            .map_err(|e| bad(format!("session_id: {e}")))?;
        let rows = bounded(
            self.config().db_timeout,
            self.store.approvals(&req.session_id),
        )
        .await?;
        let approvals = rows.iter().map(ApprovalRow::to_wire).collect();
        // The pending calls come first, so a cut keeps them.
        let (approvals, _) = page_within(approvals, reply_budget(self.client()));
        Ok(ApprovalsResponse { approvals })
    }

    /// Denies every call whose deadline has passed (`decided_by` `deadline`); returns how many
    /// this sweep denied.
    pub async fn sweep_approvals(&self) -> usize {
        self.deny_expired(crate::store::now_ms()).await
    }

    /// [`Engine::sweep_approvals`] as seen at `now` (unix milliseconds).
    pub(crate) async fn deny_expired(&self, now: i64) -> usize {
        let expired = match bounded(
            self.config().db_timeout,
            self.store.expired_approvals(now, DENY_PER_SWEEP),
        )
        .await
        {
            Ok(expired) => expired,
            Err(err) => {
                tracing::debug!(error = %err.message, "approval sweep skipped");
                return 0;
            }
        };
        let mut denied = 0;
        for row in expired {
            let call = CallRef::Exact {
                session_id: &row.session_id,
                turn_id: &row.turn_id,
                call_id: &row.call_id,
            };
            let decision = NewDecision {
                decision: Decision::Deny,
                reason: Some(DEADLINE_REASON),
                decided_by: approval::DECIDED_BY_DEADLINE,
            };
            match bounded(
                self.config().db_timeout,
                self.store.decide_at(call, decision, now),
            )
            .await
            {
                Ok(decided) => {
                    denied += usize::from(!decided.already);
                    self.after_decision(&decided, "deadline").await;
                }
                Err(err) => {
                    tracing::warn!(turn = %row.turn_id, call = %row.call_id, error = %err.message,
                        "could not deny an expired approval; the next sweep tries again");
                }
            }
        }
        denied
    }
}
