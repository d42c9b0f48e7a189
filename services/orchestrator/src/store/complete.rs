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
//! - On PostgreSQL that UPDATE, the answer's insert and the read of what the turn claimed are
//!   one statement (`end_turn`): a completion is `BEGIN`, the session lock, that statement and
//!   `COMMIT` when nothing waits. The lock is taken by the statement before, never inside it:
//!   a statement's snapshot is taken as it starts, so a lock it waited for inside would not
//!   make a message sent meanwhile visible to its read, and that message would wait unanswered.

use super::start::Earlier;
use super::steer::TurnRef;
use super::{Backend, Completed, Store, StoreError, encode, now_ms};
use cyrene_protocol::ids::new_id;
use cyrene_protocol::memory::MemoryExtractJob;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::SessionEnv;
use cyrene_protocol::turn::{TurnComplete, TurnOutcome};
use cyrene_sql::WarmTx;
use sqlx::any::AnyArguments;
use sqlx::query::Query;
use sqlx::{Any, Row};

/// The stop reason of a turn its persona's guard ended (docs/loop-worker.md, "Guardrails").
const GUARDRAIL_STOP: &str = "guardrail";

/// The conditional completion ([`Store::end_turn`]): `$1` outcome, `$2` now, `$3` turn id,
/// `$4` attempt, `$5` session id.
macro_rules! end_turn_update {
    () => {
        "UPDATE orch_turns SET status = 'completed', outcome = $1, updated_at = $2, \
         attempt = $4 WHERE turn_id = $3 AND session_id = $5 AND status = 'running' \
         AND attempt <= $4 RETURNING leg_id, persona"
    };
}

/// What a completion reads after `ended` (the completed turn's row, none when it was not
/// completed): whether another leg runs or a message waits, beside every message the turn
/// claimed (NULL columns when it claimed none), in seq order. The same parameters.
macro_rules! end_turn_read {
    () => {
        "SELECT e.leg_id, e.persona, CAST(CASE WHEN EXISTS (SELECT 1 FROM orch_turns \
           WHERE session_id = $5 AND status = 'running' AND turn_id <> $3) \
           OR EXISTS (SELECT 1 FROM orch_messages \
           WHERE session_id = $5 AND claimed_by_turn IS NULL AND context = 0) \
         THEN 1 ELSE 0 END AS BIGINT), m.id, m.steered, m.reply_to, m.created_at \
         FROM ended e LEFT JOIN orch_messages m ON m.claimed_by_turn = $3 ORDER BY m.seq"
    };
}

/// Binds `$1`–`$5` of [`end_turn_update!`] and [`end_turn_read!`].
trait BindEnd<'q> {
    fn bind_end(self, outcome: &'q str, now: i64, req: &'q TurnComplete) -> Self;
}

impl<'q> BindEnd<'q> for Query<'q, Any, AnyArguments> {
    fn bind_end(self, outcome: &'q str, now: i64, req: &'q TurnComplete) -> Self {
        self.bind(outcome)
            .bind(now)
            .bind(&req.turn_id)
            .bind(i64::from(req.attempt))
            .bind(&req.session_id)
    }
}

/// A completed turn's row, and what its completion reads next under the session lock.
struct Ended {
    leg_id: String,
    persona: String,
    /// Whether another leg of the session runs or a message of it waits.
    busy: bool,
    /// The messages the turn claimed, in seq order.
    claimed: Vec<Claim>,
}

/// A message a turn claimed, as its completion reads it.
struct Claim {
    id: String,
    /// Claimed at a steer boundary (else by the job that started the turn).
    steered: bool,
    reply_to: Option<String>,
    created_at: i64,
}

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
        let answer_row = match (&answer, seq) {
            (Some(text), Some(seq)) => Some((text.as_str(), seq)),
            _ => None,
        };
        let Some(ended) = self
            .end_turn(&mut tx, req, &outcome, answer_row, now)
            .await?
        else {
            // Why not: the fence's refusal (no such turn, another session's, an older attempt)
            // or a second completion, which changes nothing (rolled back).
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
        };
        let Ended {
            leg_id,
            persona: turn_persona,
            mut busy,
            claimed,
        } = ended;
        let mut reply_to = Vec::new();
        // The oldest message this turn answers.
        let mut oldest_ms = None;
        for claim in claimed {
            if claim.steered && !req.steered_ids.contains(&claim.id) {
                // Pending again: a message now waits.
                Self::release_unsteered(&mut tx, &req.turn_id, &claim.id).await?;
                busy = true;
                continue;
            }
            oldest_ms = oldest_ms.or(Some(claim.created_at));
            reply_to.extend(claim.reply_to);
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
                            let (next, row) = self
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
                            self.record_turn(&mut tx, &row).await?;
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

    /// Completes the turn if this is its first completion and `req` passes its fence; then
    /// appends `answer` (its text and seq) and reads what the rest of the completion decides
    /// on. `None`: the turn was not completed (the caller asks the fence why).
    ///
    /// Under the session lock no other call changes the turn's status or attempt (steer and
    /// complete both take it first), so the conditional UPDATE is the fence's check and the
    /// completion together; and the reads see every message and turn of the session, whose
    /// writers take the lock too. On PostgreSQL all three are one statement (one round trip
    /// instead of three). Its parts share one snapshot, taken after the lock: the read leaves
    /// out this turn by id, where it would otherwise see it still running, and never sees the
    /// answer row; on SQLite the read runs before the insert, so it sees the same.
    async fn end_turn(
        &self,
        tx: &mut WarmTx<Any>,
        req: &TurnComplete,
        outcome: &str,
        answer: Option<(&str, i64)>,
        now: i64,
    ) -> Result<Option<Ended>, StoreError> {
        let rows = match (self.backend, answer) {
            (Backend::Postgres, Some((text, seq))) => {
                sqlx::query(concat!(
                    "WITH ended AS (",
                    end_turn_update!(),
                    "), answer AS (INSERT INTO orch_messages (id, session_id, seq, role, \
                     message, claimed_by_turn, created_at) \
                     SELECT $6, $5, $7, 'assistant', $8, $3, $2 FROM ended) ",
                    end_turn_read!(),
                ))
                .bind_end(outcome, now, req)
                .bind(new_id())
                .bind(seq)
                .bind(text)
                .fetch_all(&mut **tx)
                .await?
            }
            (Backend::Postgres, None) => {
                sqlx::query(concat!(
                    "WITH ended AS (",
                    end_turn_update!(),
                    ") ",
                    end_turn_read!()
                ))
                .bind_end(outcome, now, req)
                .fetch_all(&mut **tx)
                .await?
            }
            (Backend::Sqlite, _) => {
                let updated = sqlx::query(end_turn_update!())
                    .bind_end(outcome, now, req)
                    .fetch_optional(&mut **tx)
                    .await?;
                if updated.is_none() {
                    return Ok(None);
                }
                let rows = sqlx::query(concat!(
                    // The parameters `end_turn_update!` takes, of which it reads two.
                    "WITH ended AS (SELECT leg_id, persona FROM orch_turns WHERE turn_id = $3 \
                     AND session_id = $5) ",
                    end_turn_read!()
                ))
                .bind_end(outcome, now, req)
                .fetch_all(&mut **tx)
                .await?;
                if let Some((text, seq)) = answer {
                    sqlx::query(
                        "INSERT INTO orch_messages (id, session_id, seq, role, message, \
                         claimed_by_turn, created_at) \
                         VALUES ($1, $2, $3, 'assistant', $4, $5, $6)",
                    )
                    .bind(new_id())
                    .bind(&req.session_id)
                    .bind(seq)
                    .bind(text)
                    .bind(&req.turn_id)
                    .bind(now)
                    .execute(&mut **tx)
                    .await?;
                }
                rows
            }
        };
        let Some(first) = rows.first() else {
            return Ok(None);
        };
        let mut ended = Ended {
            leg_id: first.try_get(0)?,
            persona: first.try_get(1)?,
            // The same on every row (the statement's one read of the session).
            busy: first.try_get::<i64, _>(2)? == 1,
            claimed: Vec::with_capacity(rows.len()),
        };
        for row in &rows {
            // NULL when the turn claimed nothing (the read's one row comes from the turn).
            let Some(id) = row.try_get::<Option<String>, _>(3)? else {
                continue;
            };
            ended.claimed.push(Claim {
                id,
                steered: row.try_get::<i64, _>(4)? == 1,
                reply_to: row.try_get(5)?,
                created_at: row.try_get(6)?,
            });
        }
        Ok(Some(ended))
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
