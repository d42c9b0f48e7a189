//! `complete`: a turn's end recorded (fenced, idempotent), its answer appended to the
//! transcript, and the session moved on (docs/orchestrator.md, "`complete`").
//!
//! # Invariants
//! - One transaction under the session lock: the turn's status, its answer, the messages handed
//!   back, and the next turn (or the claims for the one leg left) commit together.
//! - A second completion of a turn changes nothing and reports `first = false`.

use super::{Completed, Store, StoreError, encode, now_ms};
use cyrene_protocol::ids::new_id;
use cyrene_protocol::message::Role;
use cyrene_protocol::turn::TurnComplete;
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
        let (env, turn) = self
            .lock_turn(&mut tx, &req.session_id, &req.turn_id, req.attempt)
            .await?;
        if turn.completed {
            tx.rollback().await?;
            return Ok(Completed {
                first: false,
                session_id: req.session_id.clone(),
                leg_id: turn.leg_id,
                reply_to: Vec::new(),
                next: None,
                pushed: None,
            });
        }
        let now = now_ms();
        sqlx::query(
            "UPDATE orch_turns SET status = 'completed', outcome = $1, updated_at = $2 \
             WHERE turn_id = $3",
        )
        .bind(&outcome)
        .bind(now)
        .bind(&req.turn_id)
        .execute(&mut *tx)
        .await?;
        if let Some(answer) = answer {
            let seq = Self::next_seq(&mut tx, &req.session_id).await?;
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
        Self::release_unsteered(&mut tx, req).await?;
        let rows = sqlx::query(
            "SELECT reply_to FROM orch_messages \
             WHERE claimed_by_turn = $1 AND reply_to IS NOT NULL ORDER BY seq",
        )
        .bind(&req.turn_id)
        .fetch_all(&mut *tx)
        .await?;
        let reply_to = rows
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<Vec<_>, _>>()?;
        let running = Self::running_turns(&mut tx, &req.session_id).await?;
        let (next, pushed) = match running.as_slice() {
            [] => {
                let batch = self.pending_batch(&mut tx, &req.session_id).await?;
                if batch.is_empty() {
                    (None, None)
                } else {
                    let next = self
                        .start_turn(&mut tx, &req.session_id, &env, batch, String::new(), None)
                        .await?;
                    (Some(next), None)
                }
            }
            // One leg left: it is now alone in its session and takes every pending message,
            // as its next boundary would have claimed them.
            [only] => (
                None,
                Self::claim_pending(&mut tx, &req.session_id, only).await?,
            ),
            _ => (None, None),
        };
        tx.commit().await?;
        Ok(Completed {
            first: true,
            session_id: req.session_id.clone(),
            leg_id: turn.leg_id,
            reply_to,
            next,
            pushed,
        })
    }
}
