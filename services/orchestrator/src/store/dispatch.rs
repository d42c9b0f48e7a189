//! Dispatch bookkeeping: a turn's job is marked once JetStream acknowledged it, and the sweeper
//! finds the running turns never confirmed (docs/orchestrator.md, "Turn jobs").
//!
//! # Invariants
//! - `dispatched` only goes from 0 to 1; republishing is safe because JetStream drops a
//!   duplicate by its `Nats-Msg-Id` (the turn id).

use super::{Store, StoreError, Undispatched, now_ms};
use std::time::Duration;

impl Store {
    /// Marks a turn's job as published (JetStream acknowledged it).
    pub async fn mark_dispatched(&self, turn_id: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE orch_turns SET dispatched = 1 WHERE turn_id = $1")
            .bind(turn_id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Running turns whose publication was not confirmed and that are older than `older_than`.
    pub async fn undispatched(
        &self,
        older_than: Duration,
    ) -> Result<Vec<Undispatched>, StoreError> {
        let cutoff = now_ms() - i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        Ok(sqlx::query_as(
            "SELECT turn_id, job FROM orch_turns \
             WHERE dispatched = 0 AND status = 'running' AND created_at <= $1 \
             ORDER BY created_at LIMIT 100",
        )
        .bind(cutoff)
        .fetch_all(&self.pool)
        .await?)
    }
}
