//! `complete`: a turn's end recorded (fenced, idempotent), its answer appended to the
//! transcript, and the session moved on (docs/orchestrator.md, "`complete`").
//!
//! # Invariants
//! - One transaction under the session lock: the turn's status, its answer, the messages handed
//!   back, and the next turn (or the claims for the one leg left) commit together.
//! - A second completion of a turn changes nothing and reports `first = false`.
//! - A completion with a final answer in a session that is not restricted, answering no ask,
//!   not stopped by a guard, names a memory extraction job (`Completed::memory_job`), on a repeated completion too.
//! - The common completion checks the fence and completes the turn in one conditional UPDATE;
//!   only when it matches nothing does the fence's read say why (`not_found`, `bad_request`,
//!   `conflict`) or that the turn was already completed.

use super::start::Earlier;
use super::steer::TurnRef;
use super::{Completed, Store, StoreError, encode, now_ms};
use cyrene_protocol::ids::new_id;
use cyrene_protocol::memory::MemoryExtractJob;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::SessionEnv;
use cyrene_protocol::turn::{TurnComplete, TurnOutcome};

/// The stop reason of a turn its persona's guard ended (docs/loop-worker.md, "Guardrails").
const GUARDRAIL_STOP: &str = "guardrail";
use sqlx::Row;

impl Store {
    /// Records a turn's completion (idempotent, fenced), appends its answer to the transcript,
    /// releases the fence and starts the next turn from pending messages.
    pub async fn complete(&self, req: &TurnComplete) -> Result<Completed, StoreError> {
        let answer = match &req.message {
            Some(m) if m.role != Role::Assistant => {
                return Err(StoreError::BadRequest(format!(
                    "the final message must have role assistant, not {:?}",
                    m.role
                )));
            }
            Some(m) => Some(encode(m)?),
            None => None,
        };
        let outcome = encode(&req.outcome)?;
        let outcome = outcome.trim_matches('"').to_owned();
        let mut tx = self.begin().await?;
        let (env, seq) = self
            .lock_session(&mut tx, &req.session_id, answer.is_some())
            .await?;
        let now = now_ms();
        // The common case in one statement: the turn is this session's, still running, and this
        // attempt is not older than the recorded one (which it raises). Under the session lock
        // no other call changes the turn's status or attempt (steer and complete both take it
        // first), so this is the fence's check and the completion together.
        let completed = sqlx::query(
            "UPDATE orch_turns SET status = 'completed', outcome = $1, updated_at = $2, \
             attempt = $4 WHERE turn_id = $3 AND session_id = $5 AND status = 'running' \
             AND attempt <= $4 RETURNING leg_id, persona",
        )
        .bind(&outcome)
        .bind(now)
        .bind(&req.turn_id)
        .bind(i64::from(req.attempt))
        .bind(&req.session_id)
        .fetch_optional(&mut *tx)
        .await?;
        let (leg_id, turn_persona): (String, String) = match completed {
            Some(row) => (row.try_get(0)?, row.try_get(1)?),
            None => {
                // Why not: the fence's refusal (no such turn, another session's, an older
                // attempt) or a second completion, which changes nothing (rolled back).
                let fence = TurnRef {
                    session_id: &req.session_id,
                    turn_id: &req.turn_id,
                    attempt: req.attempt,
                };
                let turn = self.fence(&mut tx, fence).await?;
                let memory_job = match self.extraction_wanted(req, &env) {
                    true => {
                        let persona: String =
                            sqlx::query_scalar("SELECT persona FROM orch_turns WHERE turn_id = $1")
                                .bind(&req.turn_id)
                                .fetch_one(&mut *tx)
                                .await?;
                        let asks: i64 = sqlx::query_scalar(
                            "SELECT COUNT(*) FROM orch_messages WHERE claimed_by_turn = $1 \
                             AND reply_to IS NOT NULL",
                        )
                        .bind(&req.turn_id)
                        .fetch_one(&mut *tx)
                        .await?;
                        (asks == 0).then(|| self.memory_job(req, &env, persona))
                    }
                    false => None,
                };
                tx.rollback().await?;
                if !turn.completed {
                    return Err(StoreError::Internal(format!(
                        "turn {} passed its fence but could not be completed",
                        req.turn_id
                    )));
                }
                return Ok(Completed {
                    first: false,
                    session_id: req.session_id.clone(),
                    leg_id: turn.leg_id,
                    reply_to: Vec::new(),
                    next: None,
                    pushed: None,
                    persona: env.persona,
                    waited_ms: None,
                    memory_job,
                });
            }
        };
        if let (Some(answer), Some(seq)) = (answer, seq) {
            sqlx::query(
                "INSERT INTO orch_messages (id, session_id, seq, client_id, idempotency_key, \
                 role, message, claimed_by_turn, steered, solo, reply_to, ack, created_at) \
                 VALUES ($1, $2, $3, '', NULL, 'assistant', $4, $5, 0, 0, NULL, NULL, $6)",
            )
            .bind(new_id())
            .bind(&req.session_id)
            .bind(seq)
            .bind(&answer)
            .bind(&req.turn_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        // One read of what the turn claimed — the messages claimed at a boundary that the turn
        // never took in go back to pending; the others' `reply_to` are the asks answered — and,
        // in the same statement, whether another leg runs or a message waits: the common end
        // (neither) is told without a read of its own. A row always comes back; its message
        // columns are NULL when the turn claimed nothing.
        let claimed = sqlx::query(
            "SELECT CAST(CASE WHEN EXISTS (SELECT 1 FROM orch_turns \
               WHERE session_id = $2 AND status = 'running') \
               OR EXISTS (SELECT 1 FROM orch_messages \
               WHERE session_id = $2 AND claimed_by_turn IS NULL AND context = 0) \
             THEN 1 ELSE 0 END AS BIGINT) AS busy, m.id, m.steered, m.reply_to, m.created_at \
             FROM (SELECT 1 AS one) AS b LEFT JOIN orch_messages m ON m.claimed_by_turn = $1 \
             ORDER BY m.seq",
        )
        .bind(&req.turn_id)
        .bind(&req.session_id)
        .fetch_all(&mut *tx)
        .await?;
        let mut reply_to = Vec::new();
        // The oldest message this turn answers (the answer itself is the newest row).
        let mut oldest_ms = None;
        // The same on every row (the statement's one read of the session).
        let mut busy = match claimed.first() {
            Some(row) => row.try_get::<i64, _>(0)? == 1,
            None => false,
        };
        for row in &claimed {
            let Some(id) = row.try_get::<Option<String>, _>(1)? else {
                continue;
            };
            let steered: i64 = row.try_get(2)?;
            if steered == 1 && !req.steered_ids.contains(&id) {
                // Pending again: a message now waits.
                Self::release_unsteered(&mut tx, &req.turn_id, &id).await?;
                busy = true;
                continue;
            }
            oldest_ms = oldest_ms.or(Some(row.try_get::<i64, _>(4)?));
            if let Some(to) = row.try_get::<Option<String>, _>(3)? {
                reply_to.push(to);
            }
        }
        let (next, pushed) = match busy {
            false => (None, None),
            true => {
                let running = Self::running_turns(&mut tx, &req.session_id).await?;
                match running.as_slice() {
                    [] => {
                        let batch = self
                            .pending_batch(&mut tx, &req.session_id, None, Earlier::Maybe)
                            .await?;
                        if batch.is_empty() {
                            (None, None)
                        } else {
                            let next = self
                                .start_turn(
                                    &mut tx,
                                    &req.session_id,
                                    &env,
                                    batch,
                                    String::new(),
                                    None,
                                    Earlier::Maybe,
                                )
                                .await?;
                            (Some(next), None)
                        }
                    }
                    // One leg left: it is now alone in its session and takes every pending
                    // message, as its next boundary would have claimed them.
                    [only] => (
                        None,
                        Self::claim_pending(&mut tx, &req.session_id, only).await?,
                    ),
                    _ => (None, None),
                }
            }
        };
        tx.commit().await?;
        let memory_job = (self.extraction_wanted(req, &env) && reply_to.is_empty())
            .then(|| self.memory_job(req, &env, turn_persona));
        Ok(Completed {
            first: true,
            session_id: req.session_id.clone(),
            leg_id,
            reply_to,
            next,
            pushed,
            persona: env.persona,
            waited_ms: oldest_ms.map(|at| (now_ms() - at).max(0)),
            memory_job,
        })
    }

    /// Whether a completion may ask for memory extraction (before the persona's own setting and
    /// whether it answers an ask): a final answer in a session that is not restricted — a
    /// person's restricted sessions (groups, strangers) never write into the owner's memory —
    /// that the persona's guard did not stop (what a guard refused is not remembered either).
    fn extraction_wanted(&self, req: &TurnComplete, env: &SessionEnv) -> bool {
        req.outcome == TurnOutcome::Final
            && req.message.is_some()
            && !env.restricted
            && req.stop_reason != GUARDRAIL_STOP
    }

    /// The job for `req`'s turn, run as `turn_persona` (else the session's, else the default).
    fn memory_job(
        &self,
        req: &TurnComplete,
        env: &SessionEnv,
        turn_persona: String,
    ) -> MemoryExtractJob {
        let persona = [turn_persona, env.persona.clone()]
            .into_iter()
            .find(|p| !p.is_empty())
            .unwrap_or_else(|| self.settings.personas.default.clone());
        MemoryExtractJob {
            session_id: req.session_id.clone(),
            turn_id: req.turn_id.clone(),
            persona,
        }
    }
}
