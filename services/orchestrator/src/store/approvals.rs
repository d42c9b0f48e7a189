//! Approvals (docs/orchestrator.md, "Approvals"): the calls a turn stopped at, their decisions,
//! and the turn dispatched again once every one is decided.
//!
//! # Invariants
//! - **A waiting turn stays running.** A turn whose worker reported `awaiting_approval` keeps
//!   `status = 'running'` with `awaiting_since` set: the session's busy policy treats it as in
//!   flight (a steered message is claimed for it and taken in when it continues), no sweeper
//!   republishes it, and no completion of it is published.
//! - **Recorded once.** The awaiting completion is fenced like any completion and records its
//!   calls in the same transaction that marks the turn waiting; a repeat (same attempt, or a
//!   redelivery that stopped at the same calls) changes nothing.
//! - **The first decision holds.** `decision` goes from NULL to a value once, under the session
//!   lock; every later request gets that decision back with `already_decided`.
//! - **Continued in the decision's transaction.** The decision that leaves no call of its turn
//!   undecided also rewrites the turn's job (the decisions, the deadline moved on by the wait,
//!   and `attempt_base` past every attempt the earlier job made or can still make: the highest
//!   seen, or the earlier base plus [`MAX_JOB_DELIVERIES`] if that is more), clears
//!   `awaiting_since`, records the attempt past that base and marks the job undispatched. So the
//!   dispatch sweeper publishes it should this process die before it does, and every attempt of
//!   the earlier job is fenced off — a redelivery of it still queued too (its ack lost while the
//!   turn waited): a stale attempt can neither save, steer nor complete, and so never applies a
//!   decision, nor sets the turn waiting again.
//! - A decision binds to `(turn_id, call_id, step)`: a model that repeats a call id in a later
//!   step of the same turn is asked again (its row is requested anew).
//!
//! # Pitfalls
//! - A person names a call by session and call id only: when two waiting turns of one session
//!   (parallel legs) hold the same call id, the older waiting one is decided.

use super::steer::TurnRef;
use super::{NewTurn, Store, StoreError, encode, now_ms};
use cyrene_protocol::approval::{
    APPROVALS_DECIDED_LIMIT, Approval, CallDecision, DEFAULT_APPROVAL_TIMEOUT_MS, Decision,
};
use cyrene_protocol::turn::{MAX_JOB_DELIVERIES, TurnComplete, TurnJob};
use cyrene_sql::WarmTx;
use sqlx::{Any, Row};

/// One row of `orch_approvals`.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ApprovalRow {
    pub turn_id: String,
    pub call_id: String,
    pub session_id: String,
    pub step: i64,
    pub tool: String,
    /// The call's JSON object, as text.
    pub arguments: String,
    pub persona: String,
    pub requested_at: i64,
    pub deadline: i64,
    pub decision: Option<String>,
    pub reason: Option<String>,
    pub decided_by: Option<String>,
    pub decided_at: Option<i64>,
}

const COLUMNS: &str = "turn_id, call_id, session_id, step, tool, arguments, persona, \
    requested_at, deadline, decision, reason, decided_by, decided_at";

impl ApprovalRow {
    /// The decision that holds, if any.
    pub fn decision(&self) -> Option<Decision> {
        match self.decision.as_deref() {
            Some("approve") => Some(Decision::Approve),
            Some("deny") => Some(Decision::Deny),
            _ => None,
        }
    }

    /// The call's arguments (an object; `{}` should the text be corrupt).
    pub fn arguments(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::from_str(&self.arguments).unwrap_or_default()
    }

    /// As `session.approvals` lists it.
    pub fn to_wire(&self) -> Approval {
        Approval {
            turn_id: self.turn_id.clone(),
            call_id: self.call_id.clone(),
            tool: self.tool.clone(),
            arguments: self.arguments(),
            requested_at_ms: self.requested_at,
            deadline_ms: self.deadline,
            decision: self.decision(),
            reason: self.reason.clone(),
            decided_by: self.decided_by.clone(),
        }
    }

    fn to_call_decision(&self) -> Option<CallDecision> {
        Some(CallDecision {
            step: u32::try_from(self.step).unwrap_or(0),
            call_id: self.call_id.clone(),
            decision: self.decision()?,
            reason: self.reason.clone(),
            decided_by: self.decided_by.clone().unwrap_or_default(),
        })
    }
}

/// What an `awaiting_approval` completion did.
#[derive(Debug, Clone)]
pub struct Awaited {
    /// False when the turn was already waiting (a repeat): nothing changed.
    pub first: bool,
    pub session_id: String,
    pub leg_id: String,
    /// The calls that wait for a decision now (on a repeat too, to announce them again).
    pub pending: Vec<ApprovalRow>,
}

/// What a decision did.
#[derive(Debug, Clone)]
pub struct Decided {
    /// The row as it holds now (with the decision that holds).
    pub row: ApprovalRow,
    /// True when this request did not make the decision.
    pub already: bool,
    /// The turn, dispatched again: this decision was the last its calls waited for.
    pub resumed: Option<NewTurn>,
}

/// Which call a decision names.
#[derive(Debug, Clone, Copy)]
pub enum CallRef<'a> {
    /// A person's, an operator's or a bridge's request: the session and the call id.
    Session {
        session_id: &'a str,
        call_id: &'a str,
    },
    /// The deadline sweeper's: exactly one row.
    Exact {
        session_id: &'a str,
        turn_id: &'a str,
        call_id: &'a str,
    },
}

impl CallRef<'_> {
    fn session_id(&self) -> &str {
        match self {
            CallRef::Session { session_id, .. } | CallRef::Exact { session_id, .. } => session_id,
        }
    }
}

/// A decision to record.
#[derive(Debug, Clone, Copy)]
pub struct NewDecision<'a> {
    pub decision: Decision,
    pub reason: Option<&'a str>,
    /// `person:<p>`, `operator`, `bridge` or `deadline`.
    pub decided_by: &'a str,
}

impl Store {
    /// Records an `awaiting_approval` completion: fenced like any completion, the turn marked
    /// waiting and its calls recorded with their deadline (the persona's
    /// `approval_timeout_ms`), in one transaction. A repeat changes nothing.
    pub async fn await_approval(&self, req: &TurnComplete) -> Result<Awaited, StoreError> {
        self.await_approval_at(req, now_ms()).await
    }

    pub(crate) async fn await_approval_at(
        &self,
        req: &TurnComplete,
        now: i64,
    ) -> Result<Awaited, StoreError> {
        if req.approvals.is_empty() {
            return Err(StoreError::BadRequest(
                "an awaiting_approval completion names the calls that wait".to_owned(),
            ));
        }
        let mut tx = self.begin().await?;
        self.lock_session(&mut tx, &req.session_id, false).await?;
        // The fence and the waiting mark in one statement (as `complete` does). The job's
        // dispatch is confirmed too: a worker ran it.
        let marked = sqlx::query(
            "UPDATE orch_turns SET awaiting_since = $1, dispatched = 1, updated_at = $1, \
             attempt = $2 WHERE turn_id = $3 AND session_id = $4 AND status = 'running' \
             AND awaiting_since IS NULL AND attempt <= $2 RETURNING leg_id, persona",
        )
        .bind(now)
        .bind(i64::from(req.attempt))
        .bind(&req.turn_id)
        .bind(&req.session_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(marked) = marked else {
            // The fence's refusal, a completed turn, or a repeat: nothing changes.
            let fence = TurnRef {
                session_id: &req.session_id,
                turn_id: &req.turn_id,
                attempt: req.attempt,
            };
            let turn = self.fence(&mut tx, fence).await?;
            let pending = match turn.completed {
                true => Vec::new(),
                false => Self::pending_of_turn(&mut tx, &req.turn_id).await?,
            };
            tx.rollback().await?;
            return Ok(Awaited {
                first: false,
                session_id: req.session_id.clone(),
                leg_id: turn.leg_id,
                pending,
            });
        };
        let leg_id: String = marked.try_get(0)?;
        let persona: String = marked.try_get(1)?;
        let timeout = self
            .settings
            .personas
            .resolve(&persona)
            .map_or(DEFAULT_APPROVAL_TIMEOUT_MS, |p| p.approval_timeout());
        let deadline = now.saturating_add(i64::try_from(timeout).unwrap_or(i64::MAX));
        for call in &req.approvals {
            // A call id already decided in an earlier step of this turn is a new call: asked
            // anew (a decision binds to its step).
            sqlx::query(
                "INSERT INTO orch_approvals (turn_id, call_id, session_id, step, tool, arguments, \
                 persona, requested_at, deadline) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (turn_id, call_id) DO UPDATE SET step = excluded.step, \
                 tool = excluded.tool, arguments = excluded.arguments, \
                 requested_at = excluded.requested_at, deadline = excluded.deadline, \
                 decision = NULL, reason = NULL, decided_by = NULL, decided_at = NULL \
                 WHERE orch_approvals.step <> excluded.step",
            )
            .bind(&req.turn_id)
            .bind(&call.call_id)
            .bind(&req.session_id)
            .bind(i64::from(call.step))
            .bind(&call.tool)
            .bind(encode(&call.arguments)?)
            .bind(&persona)
            .bind(now)
            .bind(deadline)
            .execute(&mut *tx)
            .await?;
        }
        let pending = Self::pending_of_turn(&mut tx, &req.turn_id).await?;
        tx.commit().await?;
        Ok(Awaited {
            first: true,
            session_id: req.session_id.clone(),
            leg_id,
            pending,
        })
    }

    /// Records a decision (the first holds) and, when it is the last one its turn waited for,
    /// continues the turn (see the module invariants). `not_found` for an unknown session or
    /// call.
    pub async fn decide(
        &self,
        call: CallRef<'_>,
        decision: NewDecision<'_>,
    ) -> Result<Decided, StoreError> {
        self.decide_at(call, decision, now_ms()).await
    }

    pub(crate) async fn decide_at(
        &self,
        call: CallRef<'_>,
        decision: NewDecision<'_>,
        now: i64,
    ) -> Result<Decided, StoreError> {
        let mut tx = self.begin().await?;
        self.lock_session(&mut tx, call.session_id(), false).await?;
        let found =
            match call {
                CallRef::Session {
                    session_id,
                    call_id,
                } => sqlx::query_as::<_, ApprovalRow>(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM orch_approvals WHERE session_id = $1 AND call_id = $2 \
                     ORDER BY CASE WHEN decision IS NULL THEN 0 ELSE 1 END, \
                     CASE WHEN decision IS NULL THEN requested_at ELSE -requested_at END \
                     LIMIT 1"
                )))
                .bind(session_id)
                .bind(call_id)
                .fetch_optional(&mut *tx)
                .await?,
                CallRef::Exact {
                    session_id,
                    turn_id,
                    call_id,
                } => sqlx::query_as::<_, ApprovalRow>(sqlx::AssertSqlSafe(format!(
                    "SELECT {COLUMNS} FROM orch_approvals WHERE session_id = $1 AND turn_id = $2 \
                     AND call_id = $3"
                )))
                .bind(session_id)
                .bind(turn_id)
                .bind(call_id)
                .fetch_optional(&mut *tx)
                .await?,
            };
        let Some(mut row) = found else {
            return Err(StoreError::NotFound(format!(
                "no call of session {:?} waits for approval under that id",
                call.session_id()
            )));
        };
        if row.decision.is_some() {
            tx.rollback().await?;
            return Ok(Decided {
                row,
                already: true,
                resumed: None,
            });
        }
        sqlx::query(
            "UPDATE orch_approvals SET decision = $1, reason = $2, decided_by = $3, \
             decided_at = $4 WHERE turn_id = $5 AND call_id = $6 AND decision IS NULL",
        )
        .bind(decision.decision.as_str())
        .bind(decision.reason)
        .bind(decision.decided_by)
        .bind(now)
        .bind(&row.turn_id)
        .bind(&row.call_id)
        .execute(&mut *tx)
        .await?;
        row.decision = Some(decision.decision.as_str().to_owned());
        row.reason = decision.reason.map(str::to_owned);
        row.decided_by = Some(decision.decided_by.to_owned());
        row.decided_at = Some(now);
        let resumed = self.continue_if_decided(&mut tx, &row.turn_id, now).await?;
        tx.commit().await?;
        Ok(Decided {
            row,
            already: false,
            resumed,
        })
    }

    /// The turn's job again, with its decisions, when none of its calls waits any more and it
    /// is waiting (see the module invariants).
    async fn continue_if_decided(
        &self,
        tx: &mut WarmTx<Any>,
        turn_id: &str,
        now: i64,
    ) -> Result<Option<NewTurn>, StoreError> {
        let rows: Vec<ApprovalRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM orch_approvals WHERE turn_id = $1 ORDER BY step, call_id"
        )))
        .bind(turn_id)
        .fetch_all(&mut **tx)
        .await?;
        if rows.iter().any(|r| r.decision.is_none()) {
            return Ok(None);
        }
        let turn = sqlx::query(
            "SELECT session_id, leg_id, job, attempt, awaiting_since, resumes FROM orch_turns \
             WHERE turn_id = $1 AND status = 'running' AND awaiting_since IS NOT NULL",
        )
        .bind(turn_id)
        .fetch_optional(&mut **tx)
        .await?;
        let Some(turn) = turn else {
            return Ok(None);
        };
        let session_id: String = turn.try_get(0)?;
        let leg_id: String = turn.try_get(1)?;
        let job_text: String = turn.try_get(2)?;
        let attempt: i64 = turn.try_get(3)?;
        let since: i64 = turn.try_get(4)?;
        let resumes: i64 = turn.try_get::<i64, _>(5)? + 1;
        let mut job: TurnJob = serde_json::from_str(&job_text)
            .map_err(|e| StoreError::Internal(format!("corrupt job of turn {turn_id}: {e}")))?;
        job.decisions = rows
            .iter()
            .filter_map(ApprovalRow::to_call_decision)
            .collect();
        // The earlier job's deliveries take the attempts past its own base, at most
        // MAX_JOB_DELIVERIES of them, and one of them may still be queued (its ack lost while
        // the turn waited): the new job starts past all of them, and past every attempt seen.
        let base =
            attempt.max(i64::from(job.attempt_base).saturating_add(i64::from(MAX_JOB_DELIVERIES)));
        job.attempt_base = u32::try_from(base).unwrap_or(u32::MAX);
        // The wait does not count against the persona's turn timeout.
        let waited = u64::try_from(now.saturating_sub(since)).unwrap_or(0);
        job.deadline_unix_ms = job.deadline_unix_ms.map(|d| d.saturating_add(waited));
        let job_json = encode(&job)?;
        sqlx::query(
            "UPDATE orch_turns SET awaiting_since = NULL, dispatched = 0, job = $1, \
             attempt = $2, resumes = $3, updated_at = $4 WHERE turn_id = $5",
        )
        .bind(&job_json)
        .bind(base.saturating_add(1))
        .bind(resumes)
        .bind(now)
        .bind(turn_id)
        .execute(&mut **tx)
        .await?;
        Ok(Some(NewTurn {
            turn_id: turn_id.to_owned(),
            session_id,
            leg_id,
            message_ids: job.message_ids,
            job: job_json,
            resumes,
        }))
    }

    /// A session's approvals: the pending ones first, then the last
    /// [`APPROVALS_DECIDED_LIMIT`] decided, oldest→newest within each group. `not_found` for
    /// an unknown session.
    pub async fn approvals(&self, session_id: &str) -> Result<Vec<ApprovalRow>, StoreError> {
        let known: Option<String> =
            sqlx::query_scalar("SELECT id FROM orch_sessions WHERE id = $1")
                .bind(session_id)
                .fetch_optional(&self.pool)
                .await?;
        if known.is_none() {
            return Err(StoreError::NotFound(format!("no session {session_id:?}")));
        }
        let mut rows: Vec<ApprovalRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM orch_approvals WHERE session_id = $1 AND decision IS NULL \
             ORDER BY requested_at, step, call_id"
        )))
        .bind(session_id)
        .fetch_all(&self.pool)
        .await?;
        let mut decided: Vec<ApprovalRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM orch_approvals WHERE session_id = $1 \
             AND decision IS NOT NULL ORDER BY decided_at DESC, call_id DESC LIMIT $2"
        )))
        .bind(session_id)
        .bind(i64::try_from(APPROVALS_DECIDED_LIMIT).unwrap_or(i64::MAX))
        .fetch_all(&self.pool)
        .await?;
        decided.reverse();
        rows.extend(decided);
        Ok(rows)
    }

    /// Calls still undecided whose deadline is at or before `now` (the oldest first, at most
    /// `limit`): the sweeper denies them.
    pub async fn expired_approvals(
        &self,
        now: i64,
        limit: i64,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM orch_approvals WHERE decision IS NULL AND deadline <= $1 \
             ORDER BY deadline, call_id LIMIT $2"
        )))
        .bind(now)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?)
    }

    /// The calls of `turn_id` still waiting.
    async fn pending_of_turn(
        tx: &mut WarmTx<Any>,
        turn_id: &str,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM orch_approvals WHERE turn_id = $1 AND decision IS NULL \
             ORDER BY step, call_id"
        )))
        .bind(turn_id)
        .fetch_all(&mut **tx)
        .await?)
    }

    /// The number of calls waiting for a decision (the `cyrene_approvals_pending` gauge).
    pub async fn approvals_pending(&self) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT COUNT(*) FROM orch_approvals WHERE decision IS NULL")
                .fetch_one(&self.pool)
                .await?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::NewMessage;
    use cyrene_protocol::ErrorCode;
    use cyrene_protocol::approval::Decision::{Approve, Deny};
    use cyrene_protocol::approval::PendingCall;
    use cyrene_protocol::message::{Message, Role};
    use cyrene_protocol::session::{BusyPolicy, SessionEnv};
    use cyrene_protocol::turn::TurnOutcome;
    use std::time::Duration;

    /// When the turn stops in these tests, unix ms.
    const AT: i64 = 1_700_000_000_000;
    /// The persona's approval timeout.
    const TIMEOUT: i64 = 60_000;

    async fn store_on(url: &str) -> Store {
        let personas = crate::Personas::from_json(
            r#"{"default":"cyrene","personas":[{"id":"cyrene","name":"昔涟",
                "approval":["send_email"],"approval_timeout_ms":60000}]}"#,
        )
        .unwrap();
        crate::store::testing::store_on(url, personas).await
    }

    /// A session `session` with one running turn (dispatched), whose id is returned.
    async fn running_turn(store: &Store, session: &str) -> NewTurn {
        let sent = store
            .send(
                NewMessage {
                    session_id: session.into(),
                    message: Message::text(Role::User, "mail bob"),
                    client_id: "cli".into(),
                    idempotency_key: None,
                    env: SessionEnv::default(),
                    policy: BusyPolicy::Steer,
                    solo: false,
                    reply_to: None,
                    ask_chain: Vec::new(),
                    persona: None,
                    context_only: false,
                },
                &|_| (0, Vec::new()),
            )
            .await
            .unwrap();
        let turn = sent.started.unwrap();
        store.mark_dispatched(&turn.msg_id()).await.unwrap();
        turn
    }

    fn awaiting(turn: &NewTurn, attempt: u32, calls: &[&str]) -> TurnComplete {
        TurnComplete {
            turn_id: turn.turn_id.clone(),
            session_id: turn.session_id.clone(),
            leg_id: String::new(),
            attempt,
            outcome: TurnOutcome::AwaitingApproval,
            message: None,
            stop_reason: "awaiting_approval".into(),
            steps: 1,
            steered_ids: Vec::new(),
            error: None,
            approvals: calls
                .iter()
                .map(|id| PendingCall {
                    step: 1,
                    call_id: (*id).into(),
                    tool: "send_email".into(),
                    arguments: serde_json::json!({"to": "bob"})
                        .as_object()
                        .cloned()
                        .unwrap(),
                })
                .collect(),
        }
    }

    fn by<'a>(decision: Decision, who: &'a str, reason: Option<&'a str>) -> NewDecision<'a> {
        NewDecision {
            decision,
            reason,
            decided_by: who,
        }
    }

    /// `decision` on call `call_id` of session `s1` at `at`.
    async fn decide(store: &Store, call_id: &str, decision: NewDecision<'_>, at: i64) -> Decided {
        store
            .decide_at(call("s1", call_id), decision, at)
            .await
            .unwrap()
    }

    fn call<'a>(session_id: &'a str, call_id: &'a str) -> CallRef<'a> {
        CallRef::Session {
            session_id,
            call_id,
        }
    }

    /// The awaiting completion is recorded once; the first decision of each call holds; the
    /// last decision continues the turn with every decision on its job, fencing the earlier
    /// attempts off; the sweeper republishes it should nobody publish it.
    async fn a_waiting_turn_is_recorded_once_and_each_call_decided_once(store: &Store) {
        let turn = running_turn(store, "s1").await;
        let first = store
            .await_approval_at(&awaiting(&turn, 1, &["c1", "c2"]), AT)
            .await
            .unwrap();
        assert!(first.first);
        assert_eq!(first.pending.len(), 2);
        assert!(first.pending.iter().all(|r| r.deadline == AT + TIMEOUT));
        let again = store
            .await_approval_at(&awaiting(&turn, 1, &["c1", "c2"]), AT + 5)
            .await
            .unwrap();
        assert!(!again.first, "a repeated completion changes nothing");
        assert!(again.pending.iter().all(|r| r.requested_at == AT));
        assert!(
            store
                .undispatched_at(AT + 3_600_000, Duration::ZERO)
                .await
                .unwrap()
                .is_empty(),
            "a waiting turn is never republished"
        );

        let one = decide(store, "c1", by(Approve, "person:alice", None), AT + 10).await;
        assert!(!one.already);
        assert!(one.resumed.is_none(), "c2 still waits");
        let twice = decide(store, "c1", by(Deny, "operator", Some("no")), AT + 11).await;
        assert!(twice.already, "the first decision holds");
        assert_eq!(twice.row.decision(), Some(Decision::Approve));
        assert_eq!(twice.row.decided_by.as_deref(), Some("person:alice"));
        for (session, call_id) in [("s1", "c9"), ("s2", "c2"), ("nobody", "c2")] {
            let err = store
                .decide_at(call(session, call_id), by(Approve, "operator", None), AT)
                .await
                .unwrap_err();
            assert_eq!(err.code(), ErrorCode::NotFound, "{session} {call_id}");
        }

        let last = decide(store, "c2", by(Deny, "bridge", Some("not bob")), AT + 20).await;
        let resumed = last
            .resumed
            .expect("every call decided: the turn continues");
        assert_eq!(resumed.turn_id, turn.turn_id);
        assert_eq!(resumed.resumes, 1);
        assert_eq!(resumed.msg_id(), format!("{}.1", turn.turn_id));
        let job: TurnJob = serde_json::from_str(&resumed.job).unwrap();
        assert_eq!(job.attempt_base, MAX_JOB_DELIVERIES);
        assert_eq!(
            job.decisions,
            [
                CallDecision {
                    step: 1,
                    call_id: "c1".into(),
                    decision: Decision::Approve,
                    reason: None,
                    decided_by: "person:alice".into(),
                },
                CallDecision {
                    step: 1,
                    call_id: "c2".into(),
                    decision: Decision::Deny,
                    reason: Some("not bob".into()),
                    decided_by: "bridge".into(),
                }
            ]
        );
        // Not published yet: the sweeper's, once its grace has passed since the decision.
        let grace = Duration::from_secs(2);
        assert!(
            store
                .undispatched_at(AT + 20 + 1_999, grace)
                .await
                .unwrap()
                .is_empty()
        );
        let swept = store.undispatched_at(AT + 20 + 2_000, grace).await.unwrap();
        assert_eq!(swept.len(), 1);
        assert_eq!((swept[0].resumes, &swept[0].job), (1, &resumed.job));
        // A late mark of the first job does not confirm this one; its own mark does.
        store.mark_dispatched(&turn.turn_id).await.unwrap();
        assert_eq!(
            store
                .undispatched_at(AT + 9_999, grace)
                .await
                .unwrap()
                .len(),
            1
        );
        store.mark_dispatched(&resumed.msg_id()).await.unwrap();
        assert!(
            store
                .undispatched_at(AT + 9_999, grace)
                .await
                .unwrap()
                .is_empty()
        );

        // The earlier job's attempts are fenced off — a redelivery of it too (its ack lost while
        // the turn waited: chaos, 2026-12-06), which would set the turn waiting again on calls
        // already decided; the new job's first attempt is not.
        for earlier in [1, 2, MAX_JOB_DELIVERIES] {
            let stale = store
                .await_approval_at(&awaiting(&turn, earlier, &["c1"]), AT + 30)
                .await
                .unwrap_err();
            assert_eq!(stale.code(), ErrorCode::Conflict, "attempt {earlier}");
        }
        let listed = store.approvals("s1").await.unwrap();
        let order: Vec<(&str, Option<Decision>)> = listed
            .iter()
            .map(|r| (r.call_id.as_str(), r.decision()))
            .collect();
        assert_eq!(
            order,
            [
                ("c1", Some(Decision::Approve)),
                ("c2", Some(Decision::Deny))
            ]
        );
        let second = store
            .await_approval_at(&awaiting(&turn, MAX_JOB_DELIVERIES + 1, &["c3"]), AT + 40)
            .await
            .unwrap();
        assert!(second.first, "the continued turn may stop again");
        let listed = store.approvals("s1").await.unwrap();
        assert_eq!(listed[0].call_id, "c3", "pending first");
        assert_eq!(listed[0].decision, None);
        assert_eq!(listed.len(), 3);
        let err = store.approvals("s9").await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::NotFound);
    }

    /// A call waits until its deadline, not a millisecond less: the sweeper finds it from that
    /// millisecond on, and a denial by the deadline loses to a decision made before it.
    async fn the_deadline_denies_exactly_when_it_passes(store: &Store) {
        let turn = running_turn(store, "s1").await;
        store
            .await_approval_at(&awaiting(&turn, 1, &["c1", "c2"]), AT)
            .await
            .unwrap();
        assert!(
            store
                .expired_approvals(AT + TIMEOUT - 1, 10)
                .await
                .unwrap()
                .is_empty()
        );
        decide(store, "c1", by(Approve, "operator", None), AT + 1).await;
        let expired = store.expired_approvals(AT + TIMEOUT, 10).await.unwrap();
        let ids: Vec<&str> = expired.iter().map(|r| r.call_id.as_str()).collect();
        assert_eq!(ids, ["c2"], "only the undecided call");
        let denied = store
            .decide_at(
                CallRef::Exact {
                    session_id: "s1",
                    turn_id: &turn.turn_id,
                    call_id: "c2",
                },
                by(Deny, "deadline", Some("late")),
                AT + TIMEOUT,
            )
            .await
            .unwrap();
        assert_eq!(denied.row.decided_by.as_deref(), Some("deadline"));
        assert!(denied.resumed.is_some());
        assert!(
            store
                .expired_approvals(AT + TIMEOUT * 9, 10)
                .await
                .unwrap()
                .is_empty()
        );
        assert_eq!(store.approvals_pending().await.unwrap(), 0);
    }

    /// A model that repeats a call id in a later step is asked again: the earlier decision
    /// does not carry over.
    async fn a_repeated_call_id_in_a_later_step_is_asked_again(store: &Store) {
        let turn = running_turn(store, "s1").await;
        store
            .await_approval_at(&awaiting(&turn, 1, &["c1"]), AT)
            .await
            .unwrap();
        let decided = decide(store, "c1", by(Approve, "operator", None), AT + 1).await;
        assert!(decided.resumed.is_some());
        let mut later = awaiting(&turn, MAX_JOB_DELIVERIES + 1, &["c1"]);
        later.approvals[0].step = 3;
        let asked = store.await_approval_at(&later, AT + 2).await.unwrap();
        assert_eq!(asked.pending.len(), 1, "asked anew");
        assert_eq!(asked.pending[0].step, 3);
        let again = decide(store, "c1", by(Deny, "operator", None), AT + 3).await;
        assert!(!again.already);
        let job: TurnJob = serde_json::from_str(&again.resumed.unwrap().job).unwrap();
        assert_eq!(job.decisions.len(), 1);
        assert_eq!(
            (job.decisions[0].step, job.decisions[0].decision),
            (3, Decision::Deny)
        );
        assert_eq!(job.attempt_base, 2 * MAX_JOB_DELIVERIES);
    }

    crate::store::testing::on_both_backends!(
        store_on, "orch_approvals";
        a_waiting_turn_is_recorded_once_and_each_call_decided_once,
        the_deadline_denies_exactly_when_it_passes,
        a_repeated_call_id_in_a_later_step_is_asked_again,
    );
}
