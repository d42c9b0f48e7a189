//! Starting a turn: the batch of pending messages it answers, claimed for it, and its job
//! recorded as not yet dispatched — all in the caller's transaction, under the session lock.
//!
//! # Invariants
//! - Every message of the batch goes from unclaimed to this turn (`steered = 0`) or the whole
//!   transaction fails (I2: a message is claimed once). The one message not stored yet (the
//!   send's own, [`Pending::stored`]) is written afterwards by that send, claimed in its row,
//!   and with it the turn's row (on PostgreSQL one statement writes both). Every other caller
//!   writes the turn's row at once ([`Store::record_turn`]).
//! - The job is decided by [`crate::job`] from what is read here; the stored JSON is exactly what
//!   is published, and republished by the sweeper.
//! - A session's first message (seq 1: every message takes the next seq, so none came before)
//!   reads no pending batch and no window: there is nothing to read ([`Earlier::None`]).

use super::{NewTurn, Store, StoreError, encode, now_ms};
use crate::job::{self, Pending, TurnSeed};
use cyrene_protocol::ids::new_id;
use cyrene_protocol::session::SessionEnv;
use cyrene_protocol::turn::ParallelNotice;
use cyrene_sql::WarmTx;
use sqlx::{Any, Row};

/// A new turn's row ([`Store::start_turn`]).
pub(super) struct TurnRow {
    pub turn_id: String,
    pub session_id: String,
    pub leg_id: String,
    pub client_id: String,
    pub base_seq: i64,
    pub first_message_id: String,
    /// The exact job JSON published.
    pub job: String,
    pub now: i64,
    pub persona: String,
}

impl TurnRow {
    /// Binds the row's values, in the order [`turn_values!`] numbers them, after `query`'s.
    pub fn bind<'q>(
        &'q self,
        query: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments>,
    ) -> sqlx::query::Query<'q, Any, sqlx::any::AnyArguments> {
        query
            .bind(&self.turn_id)
            .bind(&self.session_id)
            .bind(&self.leg_id)
            .bind(&self.client_id)
            .bind(self.base_seq)
            .bind(&self.first_message_id)
            .bind(&self.job)
            .bind(self.now)
            .bind(&self.persona)
    }
}

/// The insert of a [`TurnRow`], its values bound in the field order from `$n`
/// ([`turn_values!`]). Recorded at attempt 1, the first delivery's count (JetStream counts from
/// 1): the first attempt's steers match the record, so a boundary with nothing new takes the
/// unlocked read (`nothing_to_steer`) instead of raising the record under the session's lock.
macro_rules! insert_turn {
    () => {
        "INSERT INTO orch_turns (turn_id, session_id, leg_id, client_id, status, attempt, \
         base_seq, first_message_id, job, dispatched, created_at, updated_at, persona)"
    };
}
pub(super) use insert_turn;

/// The values of [`insert_turn!`] from parameter `$n` on (1 or 15: the two places it is bound).
macro_rules! turn_values {
    (1) => {
        "($1, $2, $3, $4, 'running', 1, $5, $6, $7, 0, $8, $8, $9)"
    };
    (15) => {
        "($15, $16, $17, $18, 'running', 1, $19, $20, $21, 0, $22, $22, $23)"
    };
}
pub(super) use turn_values;

/// What a session holds before the messages a turn is started with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Earlier {
    /// Perhaps something: read it.
    Maybe,
    /// Nothing: the batch is the session's first message, seq 1.
    None,
}

impl Store {
    /// The next batch of pending messages to start a turn with (see [`job::batch`]); `unstored`
    /// is the message of the send asking, newer than every stored one and not written yet.
    /// With [`Earlier::None`] nothing is stored, so nothing is read.
    pub(super) async fn pending_batch(
        &self,
        tx: &mut WarmTx<Any>,
        session_id: &str,
        unstored: Option<Pending>,
        earlier: Earlier,
    ) -> Result<Vec<Pending>, StoreError> {
        if earlier == Earlier::None {
            return Ok(job::batch(
                unstored.into_iter().collect::<Vec<_>>(),
                self.settings.max_job_bytes,
            ));
        }
        let rows = sqlx::query(
            "SELECT id, seq, message, solo, client_id, ask_chain FROM orch_messages \
             WHERE session_id = $1 AND claimed_by_turn IS NULL AND context = 0 \
             ORDER BY seq LIMIT $2",
        )
        .bind(session_id)
        .bind(super::MAX_BATCH)
        .fetch_all(&mut **tx)
        .await?;
        let mut pending = rows
            .iter()
            .map(|r| {
                Ok(Pending {
                    id: r.try_get(0)?,
                    seq: r.try_get(1)?,
                    message: r.try_get(2)?,
                    solo: r.try_get::<i64, _>(3)? != 0,
                    client_id: r.try_get(4)?,
                    ask_chain: r.try_get(5)?,
                    stored: true,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        // As if stored: last by seq, and only while the batch read was not cut by its limit.
        if let Some(unstored) = unstored
            && i64::try_from(pending.len()).is_ok_and(|n| n < super::MAX_BATCH)
        {
            pending.push(unstored);
        }
        Ok(job::batch(pending, self.settings.max_job_bytes))
    }

    /// Writes a started turn's row by itself.
    pub(super) async fn record_turn(
        &self,
        tx: &mut WarmTx<Any>,
        row: &TurnRow,
    ) -> Result<(), StoreError> {
        row.bind(sqlx::query(concat!(
            insert_turn!(),
            " VALUES ",
            turn_values!(1)
        )))
        .execute(&mut **tx)
        .await?;
        Ok(())
    }

    /// Claims `batch` for a new turn, seeds its window (none read with [`Earlier::None`]) and
    /// decides its row (not yet dispatched), which the caller writes in its transaction:
    /// [`Store::record_turn`], or `send` with the message that started it (send.rs).
    #[allow(clippy::too_many_arguments)] // the turn's parts, each from its caller's decision
    pub(super) async fn start_turn(
        &self,
        tx: &mut WarmTx<Any>,
        session_id: &str,
        env: &SessionEnv,
        batch: Vec<Pending>,
        leg_id: String,
        notice: Option<ParallelNotice>,
        earlier: Earlier,
    ) -> Result<(NewTurn, TurnRow), StoreError> {
        let turn_id = new_id();
        let now = now_ms();
        for m in batch.iter().filter(|m| m.stored) {
            let claimed = sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 0 \
                 WHERE id = $2 AND claimed_by_turn IS NULL",
            )
            .bind(&turn_id)
            .bind(&m.id)
            .execute(&mut **tx)
            .await?;
            if claimed.rows_affected() != 1 {
                // Impossible under the session lock; refuse rather than double-claim.
                return Err(StoreError::Internal(format!(
                    "message {} was claimed concurrently",
                    m.id
                )));
            }
        }

        // The window's candidates: the newest answered transcript (user messages of completed
        // turns, the answers, and context-only messages), newest first; the job takes what fits
        // its budget.
        let window = i64::try_from(self.settings.window).unwrap_or(i64::MAX);
        let rows = match earlier {
            Earlier::None => Vec::new(),
            Earlier::Maybe => {
                sqlx::query(
                    "SELECT m.seq, m.message FROM orch_messages m \
                     LEFT JOIN orch_turns t ON t.turn_id = m.claimed_by_turn \
                     WHERE m.session_id = $1 AND (t.status = 'completed' OR m.context = 1) \
                     ORDER BY m.seq DESC LIMIT $2",
                )
                .bind(session_id)
                .bind(window)
                .fetch_all(&mut **tx)
                .await?
            }
        };
        let answered = rows
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
            .collect::<Result<Vec<(i64, String)>, StoreError>>()?;
        let built = job::build(
            &self.settings,
            TurnSeed {
                turn_id: &turn_id,
                session_id,
                leg_id: &leg_id,
                env,
                batch: &batch,
                answered: &answered,
                notice,
                now_ms: now,
            },
        )?;
        let job_json = encode(&built.job)?;
        let client_id = batch
            .first()
            .map(|m| m.client_id.clone())
            .unwrap_or_default();
        let message_ids = built.job.message_ids;
        let first_message_id = message_ids.first().cloned().unwrap_or_default();
        let row = TurnRow {
            turn_id: turn_id.clone(),
            session_id: session_id.to_owned(),
            leg_id: leg_id.clone(),
            client_id,
            base_seq: built.base_seq,
            first_message_id,
            job: job_json.clone(),
            now,
            persona: built.job.env.persona,
        };
        let turn = NewTurn {
            turn_id,
            session_id: session_id.to_owned(),
            leg_id,
            message_ids,
            job: job_json,
            resumes: 0,
        };
        Ok((turn, row))
    }
}
