//! Steering and the fence: what a running turn takes in at a boundary, the `{turn_id, attempt}`
//! check every worker call passes, and the claims made for a running turn outside a steer
//! (docs/orchestrator.md, "Steering").
//!
//! # Invariants
//! - A claim only takes steerable messages (`solo = 0`, `queued = 0`) with a seq above the
//!   turn's claim floor (`claim_floor`): what a worker has seen is always a prefix.
//! - Alone in its session a turn takes every steerable pending message; beside other legs only
//!   its own client's.
//! - A steer answers with everything the turn claimed at boundaries past `after_seq`, so a retried
//!   steer gets the same messages back (I2).
//! - A claimed message the turn never took in goes back to pending at its completion
//!   (`release_unsteered`): never lost, answered as a turn of its own.
//!
//! # Pitfalls
//! - The unlocked fast path (`nothing_to_steer`) may only ever answer "nothing": any
//!   doubt takes the locked path, which also produces the errors.

use super::{Pushed, RunningTurn, Store, StoreError, decode_message, now_ms, to_i64, to_u64};
use cyrene_protocol::turn::{SteerRequest, SteeredMessage};
use cyrene_sql::WarmTx;
use sqlx::any::AnyRow;
use sqlx::{Any, Row};

impl Store {
    /// Claims the session's unclaimed messages for the asking turn and returns every message
    /// claimed by it at a boundary with `seq > after_seq`, in seq order.
    pub async fn steer(&self, req: &SteerRequest) -> Result<Vec<SteeredMessage>, StoreError> {
        let after = to_i64(req.after_seq)?;
        if self.nothing_to_steer(req, after).await? {
            return Ok(Vec::new());
        }
        let mut tx = self.begin().await?;
        let turn = self.lock_turn(&mut tx, TurnRef::of(req)).await?;
        if turn.completed {
            return Err(StoreError::Conflict(format!(
                "turn {} has already completed",
                req.turn_id
            )));
        }
        let running = Self::running_turns(&mut tx, &req.session_id).await?;
        let floor = Self::claim_floor(&mut tx, &req.turn_id, turn.base_seq).await?;
        // Alone in its session, a turn takes every pending message; beside other legs only its
        // own client's (the other legs take theirs).
        let claim = if running.len() <= 1 {
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 1 \
                 WHERE session_id = $2 AND claimed_by_turn IS NULL AND solo = 0 AND queued = 0 \
                 AND seq > $3",
            )
            .bind(&req.turn_id)
            .bind(&req.session_id)
            .bind(floor)
        } else {
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 1 \
                 WHERE session_id = $2 AND claimed_by_turn IS NULL AND solo = 0 AND queued = 0 \
                 AND seq > $3 \
                 AND client_id = $4",
            )
            .bind(&req.turn_id)
            .bind(&req.session_id)
            .bind(floor)
            .bind(turn.client_id.clone())
        };
        claim.execute(&mut *tx).await?;
        let rows = sqlx::query(
            "SELECT id, seq, message FROM orch_messages \
             WHERE claimed_by_turn = $1 AND steered = 1 AND seq > $2 ORDER BY seq",
        )
        .bind(&req.turn_id)
        .bind(after)
        .fetch_all(&mut *tx)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let text: String = r.try_get(2)?;
            out.push(SteeredMessage {
                id: r.try_get(0)?,
                seq: to_u64(r.try_get(1)?),
                message: decode_message(&text)?,
            });
        }
        tx.commit().await?;
        Ok(out)
    }

    /// The common boundary, read in one statement without a lock or a commit to flush: the turn
    /// is in its session, running, at exactly this attempt, no steerable message waits in its
    /// session and it holds none beyond `after`. Anything else (something to claim or hand
    /// back, a newer or stale attempt, an unknown or completed turn) takes the locked path,
    /// which also produces the errors. A message that arrives just after this read stays
    /// pending for the next boundary or the next turn, as it would after the locked path.
    async fn nothing_to_steer(&self, req: &SteerRequest, after: i64) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT t.session_id, t.status, t.attempt, \
             CAST(CASE WHEN EXISTS (SELECT 1 FROM orch_messages m \
               WHERE m.session_id = t.session_id AND m.claimed_by_turn IS NULL \
               AND m.solo = 0 AND m.queued = 0 AND m.seq > t.base_seq) \
               THEN 1 ELSE 0 END AS BIGINT), \
             CAST(CASE WHEN EXISTS (SELECT 1 FROM orch_messages m \
               WHERE m.claimed_by_turn = t.turn_id AND m.steered = 1 AND m.seq > $2) \
               THEN 1 ELSE 0 END AS BIGINT) \
             FROM orch_turns t WHERE t.turn_id = $1",
        )
        .bind(&req.turn_id)
        .bind(after)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(false);
        };
        let session: String = row.try_get(0)?;
        let status: String = row.try_get(1)?;
        let attempt: i64 = row.try_get(2)?;
        let pending: i64 = row.try_get(3)?;
        let held_beyond_after: i64 = row.try_get(4)?;
        Ok(session == req.session_id
            && status == "running"
            && attempt == i64::from(req.attempt)
            && pending == 0
            && held_beyond_after == 0)
    }

    /// Locks the session of a worker's call (`not_found` when there is none), then checks its
    /// turn's fence ([`Store::fence`]): what a locked `steer` starts with.
    async fn lock_turn(
        &self,
        tx: &mut WarmTx<Any>,
        req: TurnRef<'_>,
    ) -> Result<TurnRow, StoreError> {
        self.lock_session(tx, req.session_id, false).await?;
        self.fence(tx, req).await
    }

    /// Checks the `{turn_id, attempt}` fence and raises the recorded attempt to a newer one.
    pub(super) async fn fence(
        &self,
        tx: &mut WarmTx<Any>,
        req: TurnRef<'_>,
    ) -> Result<TurnRow, StoreError> {
        let TurnRef {
            session_id,
            turn_id,
            attempt,
        } = req;
        let row = sqlx::query(
            "SELECT session_id, client_id, status, attempt, base_seq, leg_id FROM orch_turns \
             WHERE turn_id = $1",
        )
        .bind(turn_id)
        .fetch_optional(&mut **tx)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("no turn {turn_id:?}")))?;
        let turn = TurnRow::from_row(&row)?;
        if turn.session_id != session_id {
            return Err(StoreError::BadRequest(format!(
                "turn {turn_id} belongs to another session"
            )));
        }
        let attempt = i64::from(attempt);
        if attempt < turn.attempt {
            return Err(StoreError::Conflict(format!(
                "attempt {attempt} of turn {turn_id} is stale: attempt {} has taken over",
                turn.attempt
            )));
        }
        if attempt > turn.attempt {
            sqlx::query("UPDATE orch_turns SET attempt = $1, updated_at = $2 WHERE turn_id = $3")
                .bind(attempt)
                .bind(now_ms())
                .bind(turn_id)
                .execute(&mut **tx)
                .await?;
        }
        Ok(turn)
    }

    /// The seq a turn's next claim starts after: past everything it holds and its own base, so
    /// an `after_seq` cursor never skips a claimed message.
    async fn claim_floor(
        tx: &mut WarmTx<Any>,
        turn_id: &str,
        base_seq: i64,
    ) -> Result<i64, StoreError> {
        let row = sqlx::query("SELECT MAX(seq) FROM orch_messages WHERE claimed_by_turn = $1")
            .bind(turn_id)
            .fetch_one(&mut **tx)
            .await?;
        let held: Option<i64> = row.try_get(0)?;
        Ok(held.unwrap_or(0).max(base_seq))
    }

    /// Claims for `turn`, the only running turn of its session, every steerable pending message
    /// past what it holds (as the locked steer path would), to push to it.
    pub(super) async fn claim_pending(
        tx: &mut WarmTx<Any>,
        session_id: &str,
        turn: &RunningTurn,
    ) -> Result<Option<Pushed>, StoreError> {
        let floor = Self::claim_floor(tx, &turn.turn_id, turn.base_seq).await?;
        let rows = sqlx::query(
            "SELECT id, seq, message FROM orch_messages \
             WHERE session_id = $1 AND claimed_by_turn IS NULL AND solo = 0 AND queued = 0 \
             AND seq > $2 ORDER BY seq",
        )
        .bind(session_id)
        .bind(floor)
        .fetch_all(&mut **tx)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut messages = Vec::with_capacity(rows.len());
        for r in &rows {
            let message = SteeredMessage {
                id: r.try_get(0)?,
                seq: to_u64(r.try_get(1)?),
                message: decode_message(&r.try_get::<String, _>(2)?)?,
            };
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 1 \
                 WHERE id = $2 AND claimed_by_turn IS NULL",
            )
            .bind(&turn.turn_id)
            .bind(&message.id)
            .execute(&mut **tx)
            .await?;
            messages.push(message);
        }
        Ok(Some(Pushed {
            turn_id: turn.turn_id.clone(),
            messages,
        }))
    }

    /// Gives back to pending every message this turn claimed at a boundary but never took in
    /// (absent from `steered_ids`): a steer whose reply was lost, or that the worker gave up on,
    /// after the claim committed, with no later boundary to hand it back. Pending again, it is
    /// answered as its own turn (I2: never lost).
    /// Hands message `id`, claimed by `turn_id` at a boundary the turn never took it in at,
    /// back to pending (at the turn's completion).
    pub(super) async fn release_unsteered(
        tx: &mut WarmTx<Any>,
        turn_id: &str,
        id: &str,
    ) -> Result<(), StoreError> {
        // Routine when a message was pushed after the turn's last boundary.
        tracing::info!(turn = %turn_id, message = %id,
            "a message claimed for the turn never reached it; it is pending again");
        sqlx::query(
            "UPDATE orch_messages SET claimed_by_turn = NULL, steered = 0 \
             WHERE id = $1 AND claimed_by_turn = $2",
        )
        .bind(id)
        .bind(turn_id)
        .execute(&mut **tx)
        .await?;
        Ok(())
    }
}

/// Which turn attempt a worker's call speaks for: what the fence checks.
#[derive(Debug, Clone, Copy)]
pub(super) struct TurnRef<'a> {
    pub session_id: &'a str,
    pub turn_id: &'a str,
    pub attempt: u32,
}

impl<'a> TurnRef<'a> {
    pub fn of(req: &'a SteerRequest) -> TurnRef<'a> {
        TurnRef {
            session_id: &req.session_id,
            turn_id: &req.turn_id,
            attempt: req.attempt,
        }
    }
}

/// A turn as the fence reads it.
pub(super) struct TurnRow {
    session_id: String,
    client_id: String,
    pub(super) completed: bool,
    attempt: i64,
    base_seq: i64,
    pub(super) leg_id: String,
}

impl TurnRow {
    fn from_row(row: &AnyRow) -> Result<TurnRow, StoreError> {
        let status: String = row.try_get(2)?;
        Ok(TurnRow {
            session_id: row.try_get(0)?,
            client_id: row.try_get(1)?,
            completed: status == "completed",
            attempt: row.try_get(3)?,
            base_seq: row.try_get(4)?,
            leg_id: row.try_get(5)?,
        })
    }
}
