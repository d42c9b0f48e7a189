//! The transcript as the `history` endpoint reads it (docs/orchestrator.md, "`history`").
//!
//! # Invariants
//! - A read-only query outside any transaction: it never takes the session lock, so it never
//!   delays a writer; entries come back oldest first.

use super::{Store, StoreError, decode_env, decode_message, to_i64, to_u64};
use cyrene_protocol::session::{HistoryEntry, SessionSummary};
use sqlx::Row;
use sqlx::any::AnyRow;

impl Store {
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
}
