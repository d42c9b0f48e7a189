//! Dispatch bookkeeping: a turn's job is marked once JetStream acknowledged it, and the sweeper
//! finds the running turns never confirmed (docs/orchestrator.md, "Turn jobs").
//!
//! # Invariants
//! - `dispatched` only goes from 0 to 1 for one job of a turn; republishing is safe because
//!   JetStream drops a duplicate by its `Nats-Msg-Id` (the turn id; `<turn_id>.<n>` for the
//!   job that continues it after approvals, `store/approvals.rs`, which sets it back to 0).
//! - A mark names the job by that id, so a late mark of a turn's earlier job never confirms
//!   the job that continues it.
//! - Marks are written in groups: one writer at a time takes every mark waiting (at most
//!   [`MOST_MARKS`]) and writes them in one statement; each caller is answered after the commit
//!   that holds its mark. A mark that is never written (a crash, an outage) only lets the
//!   sweeper publish that job once more.

use super::{Store, StoreError, Undispatched, now_ms};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::oneshot;

/// The most marks one statement writes.
const MOST_MARKS: usize = 64;

/// Marks waiting for the writer, and whether one is running.
#[derive(Debug, Default)]
pub(super) struct Marks {
    state: Mutex<MarkState>,
}

#[derive(Debug, Default)]
struct MarkState {
    waiting: Vec<(String, oneshot::Sender<bool>)>,
    writing: bool,
    /// Statements written so far.
    #[cfg(test)]
    statements: u64,
}

/// Should the writer panic, the next mark starts another (its batch's callers hear `false`).
struct StopWriting<'a>(&'a Marks);

impl Drop for StopWriting<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .writing = false;
        }
    }
}

impl Store {
    /// Marks a turn's job as published (JetStream acknowledged it), with whatever other marks
    /// are waiting; returns once the mark is committed. `msg_id` is the job's `Nats-Msg-Id`
    /// ([`super::job_msg_id`]).
    pub async fn mark_dispatched(&self, msg_id: &str) -> Result<(), StoreError> {
        let (done, written) = oneshot::channel();
        let start_writer = {
            let mut state = self.marks.state.lock().unwrap_or_else(|e| e.into_inner());
            state.waiting.push((msg_id.to_owned(), done));
            !std::mem::replace(&mut state.writing, true)
        };
        if start_writer {
            // A task of its own: no caller waits for marks beyond its own batch.
            let store = self.clone();
            tokio::spawn(async move { store.write_marks().await });
        }
        match written.await {
            Ok(true) => Ok(()),
            // The writer logged why.
            _ => Err(StoreError::Internal(
                "the dispatch mark was not written".to_owned(),
            )),
        }
    }

    /// Writes the waiting marks, batch after batch, until none waits.
    async fn write_marks(&self) {
        let _unwinding = StopWriting(&self.marks);
        loop {
            let batch = {
                let mut state = self.marks.state.lock().unwrap_or_else(|e| e.into_inner());
                if state.waiting.is_empty() {
                    state.writing = false;
                    return;
                }
                let n = state.waiting.len().min(MOST_MARKS);
                #[cfg(test)]
                {
                    state.statements += 1;
                }
                state.waiting.drain(..n).collect::<Vec<_>>()
            };
            let ids: Vec<&str> = batch.iter().map(|(id, _)| id.as_str()).collect();
            let ok = match self.mark_many(&ids).await {
                Ok(()) => true,
                Err(err) => {
                    tracing::warn!(error = %err, marks = ids.len(), "dispatch marks not written");
                    false
                }
            };
            for (_, done) in batch {
                let _ = done.send(ok);
            }
        }
    }

    /// `dispatched = 1` for the job of every `Nats-Msg-Id` in `ids`, one statement.
    async fn mark_many(&self, ids: &[&str]) -> Result<(), StoreError> {
        let list = (0..ids.len())
            .map(|i| format!("(turn_id = ${} AND resumes = ${})", 2 * i + 1, 2 * i + 2))
            .collect::<Vec<_>>()
            .join(" OR ");
        let sql = format!("UPDATE orch_turns SET dispatched = 1 WHERE {list}");
        // Only numbered placeholders are formatted in; the ids are bound.
        let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
        for id in ids {
            // `<turn_id>.<n>`; a turn id itself holds no dot.
            let (turn_id, resumes) = match id.split_once('.') {
                Some((turn_id, n)) => (turn_id, n.parse::<i64>().unwrap_or(-1)),
                None => (*id, 0),
            };
            query = query.bind(turn_id).bind(resumes);
        }
        query.execute(&self.pool).await?;
        Ok(())
    }

    /// Running turns whose publication was not confirmed and that are older than `older_than`.
    pub async fn undispatched(
        &self,
        older_than: Duration,
    ) -> Result<Vec<Undispatched>, StoreError> {
        self.undispatched_at(now_ms(), older_than).await
    }

    /// [`Store::undispatched`] as seen at `now_ms` (Unix milliseconds): a turn is the sweeper's
    /// once `older_than` has passed since its creation (a turn continued after its approvals:
    /// since it was continued), not a millisecond before. A turn waiting for approval never is. The cutoff is
    /// wall time compared in SQL, so the clock is a parameter here for its test.
    pub(crate) async fn undispatched_at(
        &self,
        now_ms: i64,
        older_than: Duration,
    ) -> Result<Vec<Undispatched>, StoreError> {
        let cutoff =
            now_ms.saturating_sub(i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX));
        Ok(sqlx::query_as(
            "SELECT turn_id, job, resumes FROM orch_turns \
             WHERE dispatched = 0 AND status = 'running' AND awaiting_since IS NULL \
             AND (CASE WHEN resumes = 0 THEN created_at ELSE updated_at END) <= $1 \
             ORDER BY created_at LIMIT 100",
        )
        .bind(cutoff)
        .fetch_all(&self.pool)
        .await?)
    }

    /// Sessions with a turn running, and messages stored but not yet claimed by a turn (for the
    /// `cyrene_sessions_active` and `cyrene_messages_waiting` gauges).
    pub async fn gauges(&self) -> Result<(i64, i64), StoreError> {
        let active: i64 = sqlx::query_scalar(
            "SELECT COUNT(DISTINCT session_id) FROM orch_turns \
             WHERE dispatched IN (0, 1) AND status = 'running'",
        )
        .fetch_one(&self.pool)
        .await?;
        let waiting: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM orch_messages WHERE claimed_by_turn IS NULL AND context = 0",
        )
        .fetch_one(&self.pool)
        .await?;
        Ok((active, waiting))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store_on(url: &str) -> Store {
        crate::store::testing::store_on(url, crate::Personas::builtin()).await
    }

    /// Marks asked for together are written in fewer statements than marks, and every one of
    /// them is committed by the time its caller hears back: none is left for the sweeper.
    async fn marks_asked_for_together_are_written_together(store: &Store) {
        sqlx::query(
            "INSERT INTO orch_sessions (id, env, last_seq, created_at) VALUES ('s', '{}', 0, 0)",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        let turns: Vec<String> = (0..40).map(|i| format!("turn-{i}")).collect();
        for turn in &turns {
            sqlx::query(
                "INSERT INTO orch_turns (turn_id, session_id, status, base_seq, first_message_id, \
                 job, created_at, updated_at) VALUES ($1, 's', 'running', 0, 'm', '{}', 0, 0)",
            )
            .bind(turn)
            .execute(&store.pool)
            .await
            .unwrap();
        }
        assert_eq!(store.undispatched(Duration::ZERO).await.unwrap().len(), 40);
        let marks = turns.iter().map(|t| store.mark_dispatched(t));
        for marked in futures::future::join_all(marks).await {
            marked.unwrap();
        }
        assert!(store.undispatched(Duration::ZERO).await.unwrap().is_empty());
        let statements = store.marks.state.lock().unwrap().statements;
        assert!(
            (1..40).contains(&statements),
            "40 marks in {statements} statements"
        );
        // The writer is done: a later mark starts another and is written too.
        assert!(!store.marks.state.lock().unwrap().writing);
        store.mark_dispatched("turn-0").await.unwrap();
    }

    /// The dispatch grace: a running turn whose publication was never confirmed is left to its
    /// own publisher until the grace has passed since its creation, and is the sweeper's from
    /// that millisecond on; a confirmed or finished turn never is.
    async fn the_sweeper_takes_a_turn_exactly_when_its_grace_has_passed(store: &Store) {
        const CREATED: i64 = 1_700_000_000_000;
        let grace = Duration::from_secs(2);
        sqlx::query(
            "INSERT INTO orch_sessions (id, env, last_seq, created_at) VALUES ('s', '{}', 0, 0)",
        )
        .execute(&store.pool)
        .await
        .unwrap();
        for (turn, status, dispatched) in [
            ("lost", "running", 0_i64),
            ("confirmed", "running", 1),
            ("finished", "completed", 0),
        ] {
            sqlx::query(
                "INSERT INTO orch_turns (turn_id, session_id, status, base_seq, first_message_id, \
                 job, created_at, updated_at, dispatched) \
                 VALUES ($1, 's', $2, 0, 'm', '{}', $3, $3, $4)",
            )
            .bind(turn)
            .bind(status)
            .bind(CREATED)
            .bind(dispatched)
            .execute(&store.pool)
            .await
            .unwrap();
        }
        let at = |offset_ms: i64| store.undispatched_at(CREATED + offset_ms, grace);
        assert!(
            at(0).await.unwrap().is_empty(),
            "a new turn is its publisher's"
        );
        assert!(
            at(1_999).await.unwrap().is_empty(),
            "a millisecond before the grace"
        );
        let swept: Vec<String> = at(2_000)
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.turn_id)
            .collect();
        assert_eq!(swept, ["lost"]);
        assert_eq!(
            at(3_600_000).await.unwrap().len(),
            1,
            "and for as long as it is lost"
        );
        store.mark_dispatched("lost").await.unwrap();
        assert!(
            at(3_600_000).await.unwrap().is_empty(),
            "until it is confirmed"
        );
    }

    crate::store::testing::on_both_backends!(
        store_on, "orch_dispatch";
        the_sweeper_takes_a_turn_exactly_when_its_grace_has_passed,
        marks_asked_for_together_are_written_together,
    );
}
