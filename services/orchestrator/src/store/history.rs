//! The transcript as the `history` endpoint reads it (docs/orchestrator.md, "`history`").
//!
//! # Invariants
//! - A read-only query outside any transaction: it never takes the session lock, so it never
//!   delays a writer; entries come back oldest first.

use super::{Store, StoreError, decode_message, to_i64, to_u64};
use cyrene_protocol::session::HistoryEntry;
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
}
