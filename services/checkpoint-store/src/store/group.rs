//! Group commit of a step's fenced saves on PostgreSQL: the saves that arrive while earlier ones
//! are being written go to the database together, as one statement and one commit, instead of
//! a round trip and a commit each (docs/checkpoint-store.md, "Group commit").
//!
//! # Invariants
//! - Only fenced saves without a base come here (a step's save); a save with a base keeps its
//!   own transaction ([`super::sql`]).
//! - One save alone is written exactly as without the group ([`FencedSave::OneStatement`]): at
//!   low load nothing changes but a task hand-off.
//! - A batch holds at most one save of a turn and one save of a checkpoint id: the statement's
//!   `ON CONFLICT DO UPDATE` may touch a row once. A later save of the same turn waits for the
//!   next batch, so the saves of a turn are still written in the order they came.
//! - Each save's answer is its own: the batch statement returns, per row, the turn's recorded
//!   attempt and, when written, the timestamps — the same check as a single fenced save. When
//!   the batch statement fails as a whole (one row's value refused, a deadlock, an outage),
//!   every row is written alone, so one bad row never fails another.
//! - The fence rows are raised in `turn_id` order, so two batches in flight lock them in the same
//!   order and cannot deadlock each other.
//! - At most as many batches are in flight as the pool has connections; while they are, new
//!   saves wait and the next batch takes them all (up to [`MOST_ROWS`]): saves are grouped only
//!   when each would otherwise wait for a connection, and the busier the store, the larger the
//!   batches.
//!
//! # Pitfalls
//! - A save whose request is dropped (its caller went away) is still written: the batch owns it.

use super::sql::{SaveBatcher, SqlStore};
use super::{SaveRow, StoreError, fenced, format_ts};
use chrono::{DateTime, Utc};
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_sql::WarmPool;
use sqlx::{Postgres, Row};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::oneshot;

/// Saves in one batch at most.
pub const MOST_ROWS: usize = 64;

/// Many fenced saves in one statement; `$1`…`$8` are arrays of the rows' id, agent_id, step,
/// state, turn_id, attempt, time and delta_from. One row back per save: its position (from 1),
/// the turn's recorded attempt and, when written, the timestamps.
const FENCED_SAVE_MANY: &str = "WITH input AS ( \
       SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[], $5::text[], \
         $6::bigint[], $7::timestamptz[], $8::bigint[]) WITH ORDINALITY \
       AS i(id, agent_id, step, state, turn_id, attempt, at, delta_from, n)), \
     fence AS ( \
       INSERT INTO turn_attempts AS t (turn_id, max_attempt, updated_at) \
       SELECT turn_id, attempt, at FROM input ORDER BY turn_id \
       ON CONFLICT (turn_id) DO UPDATE SET \
       max_attempt = GREATEST(t.max_attempt, EXCLUDED.max_attempt), \
       updated_at = EXCLUDED.updated_at \
       RETURNING turn_id, max_attempt), \
     saved AS ( \
       INSERT INTO checkpoints \
       (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) \
       SELECT i.id, i.agent_id, i.step, i.state::json, i.turn_id, i.attempt, i.at, i.at, \
         i.delta_from \
       FROM input i JOIN fence f ON f.turn_id = i.turn_id WHERE f.max_attempt <= i.attempt \
       ORDER BY i.id \
       ON CONFLICT (id) DO UPDATE SET write_seq = nextval('checkpoints_write_seq'), \
       state = EXCLUDED.state, turn_id = EXCLUDED.turn_id, delta_from = EXCLUDED.delta_from, \
       attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at \
       RETURNING id, created_at, updated_at) \
     SELECT i.n, f.max_attempt, s.created_at, s.updated_at \
     FROM input i JOIN fence f ON f.turn_id = i.turn_id LEFT JOIN saved s ON s.id = i.id";

/// A save's timestamps, or why it was not written.
type Answer = Result<(String, String), StoreError>;

struct Waiting {
    row: SaveRow,
    /// Told the row as stored, or why it was not.
    done: oneshot::Sender<Result<Checkpoint, StoreError>>,
}

impl Waiting {
    fn answer(self, answer: Answer) {
        let stored = answer.map(|(created, updated)| self.row.stored(created, updated));
        let _ = self.done.send(stored);
    }
}

#[derive(Default)]
struct Queue {
    waiting: VecDeque<Waiting>,
    /// Batches being written now.
    flushers: usize,
}

/// The group commit of one store's pool.
pub struct SaveGroup {
    pool: WarmPool<Postgres>,
    /// Batches in flight at once at most: the pool's size, so saves wait to be grouped only
    /// when each would otherwise wait for a connection.
    flushers: usize,
    queue: Mutex<Queue>,
    /// Batches of more than one save written so far, and the saves in them.
    grouped: (AtomicU64, AtomicU64),
}

impl std::fmt::Debug for SaveGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("SaveGroup")
            .field("waiting", &queue.waiting.len())
            .field("flushers", &queue.flushers)
            .finish()
    }
}

impl SaveBatcher for SaveGroup {
    fn save_batched(
        self: Arc<Self>,
        row: SaveRow,
    ) -> futures::future::BoxFuture<'static, Result<Checkpoint, StoreError>> {
        Box::pin(async move { self.save(row).await })
    }

    fn grouped(&self) -> (u64, u64) {
        (
            self.grouped.0.load(Ordering::Relaxed),
            self.grouped.1.load(Ordering::Relaxed),
        )
    }
}

impl SaveGroup {
    pub fn new(pool: WarmPool<Postgres>, flushers: u32) -> Arc<SaveGroup> {
        Arc::new(SaveGroup {
            pool,
            flushers: usize::try_from(flushers).unwrap_or(1).max(1),
            queue: Mutex::default(),
            grouped: (AtomicU64::new(0), AtomicU64::new(0)),
        })
    }

    /// Writes `row` (fenced, no base) with whatever else is waiting; the row as stored, or the
    /// refusal.
    pub async fn save(self: &Arc<Self>, row: SaveRow) -> Result<Checkpoint, StoreError> {
        let (done, answer) = oneshot::channel();
        let start = {
            let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
            queue.waiting.push_back(Waiting { row, done });
            let start = queue.flushers < self.flushers;
            if start {
                queue.flushers += 1;
            }
            start
        };
        if start {
            tokio::spawn(Arc::clone(self).flush());
        }
        answer.await.unwrap_or_else(|_| {
            Err(StoreError::Internal(
                "a grouped save ended without an answer".to_owned(),
            ))
        })
    }

    /// Writes batches until nothing waits.
    async fn flush(self: Arc<Self>) {
        loop {
            let batch = self.take();
            if batch.is_empty() {
                return;
            }
            self.write(batch).await;
        }
    }

    /// The next batch: waiting saves in order, at most one per turn and per id, at most
    /// [`MOST_ROWS`]. Empty = nothing waits, and this flusher is done (counted out here, under
    /// the lock a new save takes, so no save is left waiting without a flusher).
    fn take(&self) -> Vec<Waiting> {
        let mut queue = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        let mut batch = Vec::new();
        let mut later = VecDeque::new();
        let mut turns = HashSet::new();
        let mut ids = HashSet::new();
        while let Some(waiting) = queue.waiting.pop_front() {
            let turn = waiting.row.fence.as_ref().map(|f| f.turn_id.clone());
            let id = waiting.row.checkpoint.id.clone();
            if batch.len() < MOST_ROWS && !turns.contains(&turn) && !ids.contains(&id) {
                turns.insert(turn);
                ids.insert(id);
                batch.push(waiting);
            } else {
                later.push_back(waiting);
            }
        }
        queue.waiting = later;
        if batch.is_empty() {
            queue.flushers -= 1;
        }
        batch
    }

    /// Writes `batch` and answers each save.
    async fn write(&self, batch: Vec<Waiting>) {
        metrics::histogram!("cyrene_checkpoint_save_batch_rows").record(batch.len() as f64);
        if batch.len() > 1 {
            self.grouped.0.fetch_add(1, Ordering::Relaxed);
            self.grouped
                .1
                .fetch_add(batch.len() as u64, Ordering::Relaxed);
            match self.write_many(&batch).await {
                Ok(answers) => {
                    for (waiting, answer) in batch.into_iter().zip(answers) {
                        waiting.answer(answer);
                    }
                    return;
                }
                Err(err) => {
                    tracing::debug!(error = %err, rows = batch.len(),
                        "a grouped save failed as a whole; writing its rows one by one");
                }
            }
        }
        for waiting in batch {
            let answer = self.write_one(&waiting.row).await;
            waiting.answer(answer);
        }
    }

    /// One save alone, as without the group.
    async fn write_one(&self, row: &SaveRow) -> Answer {
        let Some(fence) = &row.fence else {
            return Err(StoreError::Internal(
                "an unfenced save in the group".to_owned(),
            ));
        };
        let mut conn = self.pool.acquire().await?;
        let stored = SqlStore::<Postgres>::fenced_upsert(&mut conn, row, fence).await?;
        conn.finished();
        Ok(stored)
    }

    /// The batch in one statement; one answer per save, in order.
    async fn write_many(&self, batch: &[Waiting]) -> Result<Vec<Answer>, StoreError> {
        let mut ids = Vec::with_capacity(batch.len());
        let mut owners = Vec::with_capacity(batch.len());
        let mut steps = Vec::with_capacity(batch.len());
        let mut states = Vec::with_capacity(batch.len());
        let mut turns = Vec::with_capacity(batch.len());
        let mut attempts = Vec::with_capacity(batch.len());
        let mut times: Vec<DateTime<Utc>> = Vec::with_capacity(batch.len());
        let mut froms = Vec::with_capacity(batch.len());
        let mut fences = Vec::with_capacity(batch.len());
        for Waiting { row, .. } in batch {
            let Some(fence) = &row.fence else {
                return Err(StoreError::Internal(
                    "an unfenced save in the group".to_owned(),
                ));
            };
            ids.push(row.checkpoint.id.as_str());
            owners.push(row.checkpoint.agent_id.as_str());
            steps.push(i64::from(row.checkpoint.step));
            states.push(row.checkpoint.state.as_str());
            turns.push(fence.turn_id.as_str());
            attempts.push(fence.attempt);
            times.push(row.now);
            froms.push(row.delta_from);
            fences.push(fence);
        }
        let rows = sqlx::query(FENCED_SAVE_MANY)
            .bind(&ids)
            .bind(&owners)
            .bind(&steps)
            .bind(&states)
            .bind(&turns)
            .bind(&attempts)
            .bind(&times)
            .bind(&froms)
            .fetch_all(&self.pool)
            .await?;
        let mut answers: Vec<Option<Answer>> = batch.iter().map(|_| None).collect();
        for stored in rows {
            let n: i64 = stored.try_get(0)?;
            let recorded: i64 = stored.try_get(1)?;
            let created: Option<DateTime<Utc>> = stored.try_get(2)?;
            let updated: Option<DateTime<Utc>> = stored.try_get(3)?;
            let at = usize::try_from(n - 1)
                .ok()
                .filter(|at| *at < batch.len())
                .ok_or_else(|| StoreError::Internal(format!("a grouped save's row {n}?")))?;
            answers[at] = Some(match (created, updated) {
                (Some(created), Some(updated)) if recorded <= fences[at].attempt => {
                    Ok((format_ts(created), format_ts(updated)))
                }
                _ => Err(fenced(fences[at], recorded)),
            });
        }
        answers
            .into_iter()
            .map(|answer| {
                answer.ok_or_else(|| {
                    StoreError::Internal("a grouped save got no row back".to_owned())
                })
            })
            .collect()
    }
}
