//! The transcript as the `history` endpoint reads it (docs/orchestrator.md, "`history`"), a
//! person's sessions (`session.list`) and the turns running now (`cyrene.turns.running`).
//!
//! # Invariants
//! - A read-only query outside any transaction: it never takes the session lock, so it never
//!   delays a writer; entries come back oldest first.

use super::{Store, StoreError, decode_env, decode_message, to_i64, to_u64};
use cyrene_protocol::message::Message;
use cyrene_protocol::session::{HistoryEntry, SessionSummary};
use cyrene_protocol::turn::RunningTurn;
use sqlx::Row;
use sqlx::any::AnyRow;

impl Store {
    /// What memory extraction reads of a turn (docs/memory.md, "Memory she gathers herself"):
    /// the messages the turn was started with and its answer, oldest first — never the messages
    /// steered into it, which lived only in its view. Empty for an unknown turn.
    pub async fn turn_window(&self, turn_id: &str) -> Result<Vec<Message>, StoreError> {
        let rows = sqlx::query(
            "SELECT message FROM orch_messages WHERE claimed_by_turn = $1 AND steered = 0 \
             ORDER BY seq",
        )
        .bind(turn_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r: &AnyRow| decode_message(&r.try_get::<String, _>(0)?))
            .collect()
    }

    /// The transcript of a session, oldest→newest: at most `limit` entries before `before_seq`.
    pub async fn history(
        &self,
        session_id: &str,
        limit: u32,
        before_seq: Option<u64>,
    ) -> Result<Vec<HistoryEntry>, StoreError> {
        let before = match before_seq {
            Some(b) => to_i64(b)?,
            None => i64::MAX,
        };
        let rows = sqlx::query(
            "SELECT id, seq, message, claimed_by_turn FROM orch_messages \
             WHERE session_id = $1 AND seq < $2 ORDER BY seq DESC LIMIT $3",
        )
        .bind(session_id)
        .bind(before)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        let mut out = rows
            .iter()
            .map(|r: &AnyRow| {
                let text: String = r.try_get(2)?;
                let turn: Option<String> = r.try_get(3)?;
                Ok(HistoryEntry {
                    id: r.try_get(0)?,
                    seq: to_u64(r.try_get(1)?),
                    message: decode_message(&text)?,
                    turn_id: turn.unwrap_or_default(),
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        out.reverse();
        Ok(out)
    }

    /// The sessions of `person` (`<person>.<name>`), the newest first, at most `limit`.
    /// `person` is a validated id (letters, digits, `-`, `_`): `_` is escaped for `LIKE`.
    pub async fn sessions_of(
        &self,
        person: &str,
        limit: u32,
    ) -> Result<Vec<SessionSummary>, StoreError> {
        let pattern = format!("{}.%", person.replace('_', "\\_"));
        let rows = sqlx::query(
            "SELECT id, env, created_at FROM orch_sessions WHERE id LIKE $1 ESCAPE '\\' \
             ORDER BY created_at DESC, id DESC LIMIT $2",
        )
        .bind(pattern)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r: &AnyRow| {
                let env = decode_env(&r.try_get::<String, _>(1)?)?;
                Ok(SessionSummary {
                    session_id: r.try_get(0)?,
                    persona: env.persona,
                    created_at_ms: r.try_get(2)?,
                })
            })
            .collect()
    }

    /// The session's newest running turn, `(turn_id, leg_id)`: the one a parallel leg's notice
    /// is about (the last of the send transaction's running turns, in the same order).
    pub async fn newest_running(
        &self,
        session_id: &str,
    ) -> Result<Option<(String, String)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT turn_id, leg_id FROM orch_turns WHERE session_id = $1 AND status = 'running' \
             ORDER BY created_at DESC, turn_id DESC LIMIT 1",
        )
        .bind(session_id)
        .fetch_optional(&self.pool)
        .await?)
    }

    /// The turns whose status is `running`, the oldest first: at most `limit`, each with its
    /// session's persona. Their step is the checkpoint store's (the caller reads it).
    pub async fn turns_in_flight(&self, limit: u32) -> Result<Vec<RunningTurn>, StoreError> {
        let rows = sqlx::query(
            "SELECT t.turn_id, t.session_id, t.leg_id, t.attempt, t.created_at, s.env \
             FROM orch_turns t JOIN orch_sessions s ON s.id = t.session_id \
             WHERE t.status = 'running' ORDER BY t.created_at, t.turn_id LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r: &AnyRow| {
                let env = decode_env(&r.try_get::<String, _>(5)?)?;
                let attempt: i64 = r.try_get(3)?;
                Ok(RunningTurn {
                    turn_id: r.try_get(0)?,
                    session_id: r.try_get(1)?,
                    leg_id: r.try_get(2)?,
                    persona: env.persona,
                    attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
                    step: 0,
                    started_at_ms: r.try_get(4)?,
                })
            })
            .collect()
    }
}
