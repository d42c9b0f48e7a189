//! `send`: a user message stored durably with its seq and ack, and its disposition decided
//! under the session lock (docs/orchestrator.md, "`send`").
//!
//! # Invariants
//! - Everything is one transaction: the message, its claim for a running turn (when it steers
//!   one), the turn it starts and its ack commit together or not at all; a refused `reject`
//!   send writes nothing, not even its seq. The message's row and the row of the turn it starts
//!   are written last, after everything was decided: on PostgreSQL in one statement.
//! - An idempotent resend returns the stored ack and changes nothing.
//! - A message labelled with a third party (`sender_name`, person lane) is stored only in a
//!   restricted session; otherwise nothing is written and the caller gets `forbidden`.
//! - A message claimed here for a running turn is pushed after the commit; a lost push is
//!   handed back at that turn's completion (see `steer.rs`).
//! - A context-only message is stored with its seq and ack and nothing else: whatever runs, it
//!   starts no turn, is claimed by none and pushed to none (see `mod.rs`, "Context only").

use super::start::{Earlier, insert_turn, turn_values};
use super::{
    Backend, NewMessage, Pending, ProgressOf, Pushed, RunningTurn, Sent, Store, StoreError, encode,
    now_ms, to_u64,
};
use cyrene_protocol::ids::new_id;
use cyrene_protocol::message::SenderKind;
use cyrene_protocol::session::{BusyPolicy, Disposition, SendAck};
use cyrene_protocol::turn::{ParallelNotice, SteeredMessage};
use sqlx::Row;

/// A sent message's row: `$1`–`$14` as `send` binds them.
macro_rules! insert_message {
    () => {
        "INSERT INTO orch_messages (id, session_id, seq, client_id, idempotency_key, role, \
         message, claimed_by_turn, steered, solo, reply_to, ack, created_at, queued, \
         ask_chain) \
         VALUES ($1, $2, $3, $4, $5, 'user', $6, $12, $13, $7, $8, $14, $9, $10, $11)"
    };
}

impl Store {
    /// Stores a user message durably with a server id and the next seq, and decides its
    /// disposition (one transaction). Idempotent by `idempotency_key`.
    pub async fn send(
        &self,
        input: NewMessage,
        progress: ProgressOf<'_>,
    ) -> Result<Sent, StoreError> {
        let message_json = encode(&input.message)?;
        let env_json = encode(&input.env)?;
        let now = now_ms();
        let mut tx = self.begin().await?;
        // Created if new, locked, and this message's seq taken: one round trip.
        let (mut env, seq) = Self::open_session(&mut tx, &input.session_id, &env_json, now).await?;
        // A message addressing another persona switches the session to it (docs/orchestrator.md,
        // "Several personas"): recorded in the session's env under its lock, so every later turn
        // runs as it until the next switch. Whether it is steered into a running turn is
        // decided below, by the persona that turn runs as.
        match &input.persona {
            Some(persona)
                if self.settings.personas.resolve(&env.persona).map(|p| &p.id) != Some(persona) =>
            {
                if env.restricted {
                    tx.rollback().await?;
                    return Err(StoreError::Forbidden(format!(
                        "session {} is restricted (a group or a stranger): it always answers as \
                         its own persona; persona {persona:?} cannot be addressed here",
                        input.session_id
                    )));
                }
                env.persona = persona.clone();
                sqlx::query("UPDATE orch_sessions SET env = $1 WHERE id = $2")
                    .bind(encode(&env)?)
                    .bind(&input.session_id)
                    .execute(&mut *tx)
                    .await?;
            }
            _ => {}
        }
        if !env.restricted
            && input.message.sender_kind == SenderKind::Person
            && !input.message.sender_name.is_empty()
        {
            // A third party speaks only where unlabelled lines are known to be the owner's
            // (docs/security.md, "The owner and bridges"); the session's env is fixed at creation.
            tx.rollback().await?;
            return Err(StoreError::Forbidden(format!(
                "session {} is not restricted: a message labelled with a third party's \
                 sender_name goes only to a restricted session (create it with env.restricted)",
                input.session_id
            )));
        }

        if let Some(key) = &input.idempotency_key {
            let row = sqlx::query(
                "SELECT ack FROM orch_messages WHERE session_id = $1 AND idempotency_key = $2",
            )
            .bind(&input.session_id)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(row) = row {
                let ack: Option<String> = row.try_get(0)?;
                let ack = ack.ok_or_else(|| StoreError::Internal("message without ack".into()))?;
                let ack: SendAck = serde_json::from_str(&ack)
                    .map_err(|e| StoreError::Internal(format!("corrupt ack: {e}")))?;
                tx.rollback().await?;
                return Ok(Sent {
                    ack,
                    duplicate: true,
                    started: None,
                    pushed: None,
                });
            }
        }

        if input.context_only {
            let ack = SendAck {
                message_id: new_id(),
                seq: to_u64(seq),
                disposition: Disposition::ContextOnly,
                turn_id: String::new(),
            };
            sqlx::query(
                "INSERT INTO orch_messages (id, session_id, seq, client_id, idempotency_key, role, \
                 message, claimed_by_turn, steered, solo, reply_to, ack, created_at, queued, \
                 context) VALUES ($1, $2, $3, $4, $5, 'user', $6, NULL, 0, 0, NULL, $7, $8, 1, 1)",
            )
            .bind(&ack.message_id)
            .bind(&input.session_id)
            .bind(seq)
            .bind(&input.client_id)
            .bind(input.idempotency_key.clone())
            .bind(&message_json)
            .bind(encode(&ack)?)
            .bind(now)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            return Ok(Sent {
                ack,
                duplicate: false,
                started: None,
                pushed: None,
            });
        }

        // The session's first message: no turn runs in it, and nothing waits or was answered
        // before it (every message takes the next seq), so none of that is read.
        let earlier = match seq {
            1 => Earlier::None,
            _ => Earlier::Maybe,
        };
        let running = match earlier {
            Earlier::None => Vec::new(),
            Earlier::Maybe => Self::running_turns(&mut tx, &input.session_id).await?,
        };
        if input.policy == BusyPolicy::Reject && !input.solo && !running.is_empty() {
            // Reject policy: refused while a turn runs, nothing stored (not even the key, so
            // a resend once the session is idle is a new message).
            tx.rollback().await?;
            return Err(StoreError::Conflict(format!(
                "session {} is busy: a turn is running and its policy is reject; \
                 send again after its turn_ended event",
                input.session_id
            )));
        }
        let ask_chain = if input.ask_chain.is_empty() {
            None
        } else {
            Some(encode(&input.ask_chain)?)
        };
        let message_id = new_id();
        // A steerable message arriving while a turn runs is claimed for that turn right here,
        // in the transaction that stores it, and pushed to it after the commit: the turn takes
        // it in at its next boundary without asking (docs/orchestrator.md, "Steering").
        let steerable = !input.solo && input.policy != BusyPolicy::Enqueue;
        let parallel_leg = input.policy == BusyPolicy::Parallel
            && !input.solo
            && running.iter().all(|t| t.client_id != input.client_id);
        let taker = match running.is_empty() || parallel_leg || !steerable {
            true => None,
            false => RunningTurn::taker(&running, &input.client_id),
        };
        // Only a message for the persona a turn runs as is steered into it; one for another
        // persona (a switch, or a plain message after one) waits for the next turn, which runs
        // as the persona the session last used (docs/orchestrator.md, "Several personas").
        let addressed = self
            .settings
            .personas
            .resolve(&env.persona)
            .map(|p| p.id.as_str())
            .unwrap_or_default();
        let elsewhere = taker.is_some_and(|t| !t.persona.is_empty() && t.persona != addressed);
        let taker = if elsewhere { None } else { taker };
        // This message as the job of a turn it starts would carry it. Its row is written last,
        // with its claim and its ack: one statement instead of an insert and two updates.
        let this = Pending {
            id: message_id.clone(),
            seq,
            message: message_json.clone(),
            solo: input.solo,
            client_id: input.client_id.clone(),
            ask_chain: ask_chain.clone(),
            stored: false,
        };
        let pushed = taker.map(|t| Pushed {
            turn_id: t.turn_id.clone(),
            messages: vec![SteeredMessage {
                id: message_id.clone(),
                seq: to_u64(seq),
                message: input.message.clone(),
            }],
        });

        let (disposition, started) = if running.is_empty() {
            // No turn in flight: start one from the pending queue (normally just this message).
            // (An older solo message goes first, alone; this one then waits its turn.)
            let batch = self
                .pending_batch(&mut tx, &input.session_id, Some(this), earlier)
                .await?;
            let mine = batch.iter().any(|m| m.id == message_id);
            let turn = if batch.is_empty() {
                None
            } else {
                Some(
                    self.start_turn(
                        &mut tx,
                        &input.session_id,
                        &env,
                        batch,
                        String::new(),
                        None,
                        earlier,
                    )
                    .await?,
                )
            };
            let disposition = if mine {
                Disposition::TurnStarted
            } else {
                Disposition::Pending
            };
            (disposition, turn)
        } else if parallel_leg {
            // Parallel policy: a leg of its own, told what the newest live leg is doing.
            let other = running.last();
            let (step, tool_names) = other.map(|t| progress(&t.turn_id)).unwrap_or_default();
            // The messages waiting besides this one (not stored yet).
            let queued = Self::count_pending(&mut tx, &input.session_id).await?;
            let notice = ParallelNotice {
                other_message_id: other
                    .map(|t| t.first_message_id.clone())
                    .unwrap_or_default(),
                step,
                tool_names,
                queued: u32::try_from(queued.max(0)).unwrap_or(u32::MAX),
            };
            let row = Pending {
                solo: false,
                ask_chain: None,
                ..this
            };
            let turn = self
                .start_turn(
                    &mut tx,
                    &input.session_id,
                    &env,
                    vec![row],
                    new_id(),
                    Some(notice),
                    Earlier::Maybe,
                )
                .await?;
            (Disposition::ParallelLeg, Some(turn))
        } else {
            (Disposition::Pending, None)
        };

        let (started, turn_row) = match started {
            Some((turn, row)) => (Some(turn), Some(row)),
            None => (None, None),
        };
        let turn_id = match (&disposition, &started) {
            (Disposition::TurnStarted | Disposition::ParallelLeg, Some(t)) => t.turn_id.clone(),
            _ => String::new(),
        };
        let ack = SendAck {
            message_id: message_id.clone(),
            seq: to_u64(seq),
            disposition,
            turn_id,
        };
        // Claimed by the running turn that takes it in (steered), by the turn it starts, or by
        // no one (pending).
        let claimed_by = match (taker, ack.turn_id.is_empty()) {
            (Some(t), _) => Some(t.turn_id.clone()),
            (None, false) => Some(ack.turn_id.clone()),
            (None, true) => None,
        };
        // The message's row, and the row of the turn it started: on PostgreSQL one statement
        // (one round trip instead of two).
        let combined = match (&turn_row, self.backend) {
            (Some(_), Backend::Postgres) => concat!(
                "WITH turn AS (",
                insert_turn!(),
                " VALUES ",
                turn_values!(15),
                ") ",
                insert_message!()
            ),
            (Some(row), Backend::Sqlite) => {
                self.record_turn(&mut tx, row).await?;
                insert_message!()
            }
            (None, _) => insert_message!(),
        };
        let query = sqlx::query(combined)
            .bind(&message_id)
            .bind(&input.session_id)
            .bind(seq)
            .bind(&input.client_id)
            .bind(input.idempotency_key.clone())
            .bind(&message_json)
            .bind(i64::from(input.solo))
            .bind(input.reply_to.clone())
            .bind(now)
            .bind(i64::from(input.policy == BusyPolicy::Enqueue || elsewhere))
            .bind(ask_chain)
            .bind(claimed_by)
            .bind(i64::from(taker.is_some()))
            .bind(encode(&ack)?);
        let query = match (&turn_row, self.backend) {
            (Some(row), Backend::Postgres) => row.bind(query),
            _ => query,
        };
        query.execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(Sent {
            ack,
            duplicate: false,
            started,
            pushed,
        })
    }
}
