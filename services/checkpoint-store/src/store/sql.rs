//! The one code path of both SQL backends: [`SqlStore`] runs every [`CheckpointStore`] operation
//! on any [`Dialect`] — PostgreSQL ([`super::postgres`]) or SQLite ([`super::sqlite`]) — and a
//! dialect supplies only its SQL text, how it binds and reads timestamps, and how it opens a write
//! transaction.
//!
//! # Invariants
//! - Every step that must be atomic runs in one transaction opened by
//!   [`Dialect::begin_write`] (SQLite: `BEGIN IMMEDIATE`, so the write lock is taken up front):
//!   a base save's raise → check → upsert, base and clean-up, and each retention.
//! - A fenced save without a base needs no transaction ([`Dialect::FENCED_SAVE`]): one statement
//!   that raises the turn's attempt record and upserts the row, or one checked upsert whose write
//!   raises the record itself. Raises only ever go up, so once a newer attempt has raised, an
//!   older one writes nothing; one that raises later finds the row, as a fenced read would.
//! - A fenced read raises the turn's attempt record before it reads: in one transaction, or —
//!   [`Dialect::RAISE_COMMITS_FIRST`] — as a committed statement of its own first, so the read's
//!   snapshot sees every row an older attempt managed to write. A read by the first attempt
//!   ([`super::FIRST_ATTEMPT`]) has no older attempt to shut out and writes nothing: one
//!   statement ([`Dialect::FIRST_READ`]) reads the record and the row, like a plain read.
//! - Every write — a save, a fenced read's raise, a retention — goes through
//!   [`SqlStore`]'s `writer`, every plain read through its `pool`. On SQLite the writer is
//!   one connection (the file has one writer at a time anyway), so its page cache stays valid
//!   from one save to the next: a commit through another connection of the file would make the
//!   next one discard its whole cache and read back every page it touches. On PostgreSQL the
//!   two are the same pool.

use super::{
    CheckpointStore, FIRST_ATTEMPT, Fence, RawRow, SaveRow, StoreError, check_owner, check_page,
    check_progress, check_turn_read, cursor_gone, cutoff, fence, fenced, full, no_checkpoint,
    parse_id, prepare_save, retain_mode, tool_names,
};
use chrono::{DateTime, Utc};
use cyrene_protocol::checkpoint::{
    Checkpoint, ProgressRequest, RetainMode, RetainRequest, TurnProgress,
};
use cyrene_sql::{WarmPool, WarmTx};
use futures::future::BoxFuture;
use sqlx::query::Query;
use sqlx::{ColumnIndex, Database, Decode, Encode, Executor, IntoArguments, Row, Type};
use std::future::Future;
use std::sync::Arc;

/// How a dialect runs a fenced save's raise → check → upsert. Both forms are bound as
/// [`Dialect::UPSERT`].
#[derive(Debug, Clone, Copy)]
pub enum FencedSave {
    /// [`Dialect::RAISE_ATTEMPT`] and [`Dialect::UPSERT`] in one statement: returns `max_attempt`
    /// and, when written, `created_at`, `updated_at`.
    OneStatement(&'static str),
    /// An upsert that writes only while turn `$5`'s recorded attempt is not above `$6`, and whose
    /// write raises the record to `$6` in the same statement (SQLite: the triggers of migration
    /// 0004); returns `created_at`, `updated_at`, no row when refused.
    CheckedRaising(&'static str),
}

/// What differs between the SQL backends. Placeholders are numbered (`$1`, `?1`), so one value
/// may be used twice in a statement; every statement binds its values in the documented order.
pub trait Dialect: Database {
    /// `postgres` or `sqlite`.
    const BACKEND: &'static str;
    /// Every column of the owner `$1`'s most recently written row.
    const LATEST: &'static str;
    /// Every column of the most recently written row of owner `$1`'s turn `$2`.
    const LATEST_OF_TURN: &'static str;
    /// Every column of the row `$1`.
    const BY_ID: &'static str;
    /// The `write_seq` of the row `$1`.
    const WRITE_SEQ_OF: &'static str;
    /// Every column of at most `$3` rows of owner `$1` with a `write_seq` below `$2`, most
    /// recently written first.
    const PAGE: &'static str;
    /// The base state (text) of owner `$1`'s turn `$2`.
    const BASE_STATE: &'static str;
    /// The states (text) of owner `$1`'s turn `$2` up to step `$3`, by step.
    const CHAIN: &'static str;
    /// The highest step of owner `$1`'s turn `$2` (NULL: no row), through
    /// `checkpoints_turn_step`.
    const TURN_STEP: &'static str;
    /// Upserts a row: id, agent_id, step, state, turn_id, attempt, now, delta_from; returns
    /// `created_at`, `updated_at`.
    const UPSERT: &'static str;
    /// Records attempt `$2` of turn `$1` at `$3` unless a newer one is; returns `max_attempt`.
    const RAISE_ATTEMPT: &'static str;
    /// The first attempt's read of owner `$1`'s turn `$2`, one statement: always one row, with
    /// `recorded` (the turn's recorded attempt; NULL: none) and every column of the turn's most
    /// recently written row (all NULL: it has none).
    const FIRST_READ: &'static str;
    /// How a fenced save writes its row (see [`FencedSave`]).
    const FENCED_SAVE: FencedSave;
    /// Upserts the base of owner `$1`'s turn `$2`: state `$3`, attempt `$4`, at `$5`; where
    /// [`Dialect::DROP_EARLIER_START`] is `None`, it also deletes, in the same statement, the
    /// rows of that turn but the row `$6`.
    const UPSERT_BASE: &'static str;
    /// Deletes the rows of owner `$1`'s turn `$2` but the row `$3` (`None`: done by
    /// [`Dialect::UPSERT_BASE`]).
    const DROP_EARLIER_START: Option<&'static str>;
    /// Keeps the `$2` most recently written rows of owner `$1` and the earlier rows of their
    /// turns that they are rebuilt from; deletes the rest.
    const KEEP_LAST: &'static str;
    /// Drops the bases of turns that have no row left.
    const DROP_ORPHAN_BASES: &'static str;
    /// Deletes every row of the owners whose newest write is before `$1`.
    const DROP_IDLE_OWNERS: &'static str;
    /// Deletes the attempt records last raised before `$1`.
    const DROP_OLD_ATTEMPTS: &'static str;
    /// Whether a fenced read commits its raise before it reads (else both run in one write
    /// transaction).
    const RAISE_COMMITS_FIRST: bool;

    /// Opens a transaction that will write.
    fn begin_write(
        pool: &WarmPool<Self>,
    ) -> impl Future<Output = Result<WarmTx<Self>, sqlx::Error>> + Send;

    /// Binds the instant `at` as the dialect stores timestamps.
    fn bind_ts<'q>(
        query: Query<'q, Self, <Self as Database>::Arguments>,
        at: DateTime<Utc>,
    ) -> Query<'q, Self, <Self as Database>::Arguments>;

    /// How many rows a statement changed.
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// The timestamp in `column` as [`super::format_ts`] text (`None`: NULL).
    fn ts_text(row: &Self::Row, column: &str) -> Result<Option<String>, sqlx::Error>;
}

/// Where a step's fenced save goes instead of a transaction of its own: PostgreSQL's group
/// commit (`store/group.rs`), which still gives each save its own answer.
pub(super) trait SaveBatcher: Send + Sync + std::fmt::Debug {
    fn save_batched(
        self: Arc<Self>,
        row: SaveRow,
    ) -> BoxFuture<'static, Result<Checkpoint, StoreError>>;

    /// How many batches of more than one save were written, and how many saves they held.
    fn grouped(&self) -> (u64, u64);
}

/// Checkpoints in an SQL database of dialect `D`.
#[derive(Debug)]
pub struct SqlStore<D: Database> {
    /// Plain reads.
    pub(super) pool: WarmPool<D>,
    /// Every write (see the module's invariants): SQLite, a pool of one connection that writes
    /// queue for, as they would for the file's write lock; PostgreSQL, `pool` itself.
    pub(super) writer: WarmPool<D>,
    pub(super) max_state_bytes: usize,
    /// PostgreSQL: the group commit a step's fenced save goes through ([`SaveBatcher`]).
    pub(super) group: Option<Arc<dyn SaveBatcher>>,
    /// SQLite: the task that checkpoints the WAL off the saves' path, stopped when the last
    /// clone of the store is dropped or at [`CheckpointStore::close`].
    pub(super) wal: Option<Arc<cyrene_sql::WalTask>>,
}

impl<D: Database> Clone for SqlStore<D> {
    fn clone(&self) -> Self {
        SqlStore {
            pool: self.pool.clone(),
            writer: self.writer.clone(),
            max_state_bytes: self.max_state_bytes,
            group: self.group.clone(),
            wal: self.wal.clone(),
        }
    }
}

impl<D: Database> SqlStore<D> {
    /// The pool of plain reads (benchmarks compare against a direct upsert on it).
    pub fn pool(&self) -> &WarmPool<D> {
        &self.pool
    }
}

/// `impl<D: Dialect> [head] where …` with what the shared code path asks of sqlx, written once
/// for the two impls below (Rust does not imply a trait's where-clauses at its users).
macro_rules! on_every_dialect {
    ([$($head:tt)*] { $($body:tt)* }) => {
        impl<D: Dialect> $($head)*
        where
            for<'c> &'c mut D::Connection: Executor<'c, Database = D>,
            D::Arguments: IntoArguments<D>,
            for<'q> &'q str: Encode<'q, D> + Type<D>,
            for<'q> Option<&'q str>: Encode<'q, D> + Type<D>,
            for<'q> i64: Encode<'q, D> + Type<D>,
            for<'q> Option<i64>: Encode<'q, D> + Type<D>,
            for<'r> String: Decode<'r, D> + Type<D>,
            for<'r> Option<String>: Decode<'r, D> + Type<D>,
            for<'r> i64: Decode<'r, D>,
            for<'r> Option<i64>: Decode<'r, D>,
            for<'a> &'a str: ColumnIndex<D::Row>,
            usize: ColumnIndex<D::Row>,
        {
            $($body)*
        }
    };
}

/// A non-NULL timestamp column as text.
fn ts<D: Dialect>(row: &D::Row, column: &str) -> Result<String, StoreError> {
    D::ts_text(row, column)?.ok_or_else(|| StoreError::Internal(format!("{column} is NULL")))
}

on_every_dialect! {
[SqlStore<D>] {
    /// Upserts `row` unfenced; the row as stored.
    async fn upsert(
        conn: &mut D::Connection,
        row: &SaveRow,
    ) -> Result<(String, String), StoreError> {
        let stored = Self::bind_row(sqlx::query(D::UPSERT), row)
            .fetch_one(conn)
            .await?;
        Ok((
            ts::<D>(&stored, "created_at")?,
            ts::<D>(&stored, "updated_at")?,
        ))
    }

    /// [`Dialect::UPSERT`]'s values of `row`, in order.
    fn bind_row<'q>(
        query: Query<'q, D, D::Arguments>,
        row: &'q SaveRow,
    ) -> Query<'q, D, D::Arguments> {
        let query = query
            .bind(row.checkpoint.id.as_str())
            .bind(row.checkpoint.agent_id.as_str())
            .bind(i64::from(row.checkpoint.step))
            .bind(row.checkpoint.state.as_str())
            .bind(row.fence.as_ref().map(|f| f.turn_id.as_str()))
            .bind(row.fence.as_ref().map(|f| f.attempt));
        D::bind_ts(query, row.now).bind(row.delta_from)
    }

    /// Raises the turn's attempt record to `fence`; the refusal when a newer attempt is recorded.
    async fn raise(
        conn: &mut D::Connection,
        fence: &Fence,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let query = sqlx::query(D::RAISE_ATTEMPT)
            .bind(fence.turn_id.as_str())
            .bind(fence.attempt);
        let recorded: i64 = D::bind_ts(query, now)
            .fetch_one(conn)
            .await?
            .try_get(0usize)?;
        if recorded > fence.attempt {
            return Err(fenced(fence, recorded));
        }
        Ok(())
    }

    /// The fenced upsert of `row`: its timestamps, or the refusal when a newer attempt has
    /// written.
    pub(super) async fn fenced_upsert(
        conn: &mut D::Connection,
        row: &SaveRow,
        fence: &Fence,
    ) -> Result<(String, String), StoreError> {
        let sql = match D::FENCED_SAVE {
            FencedSave::OneStatement(sql) => sql,
            FencedSave::CheckedRaising(sql) => {
                let stored = Self::bind_row(sqlx::query(sql), row)
                    .fetch_optional(&mut *conn)
                    .await?;
                let Some(stored) = stored else {
                    // A newer attempt is recorded: raising (a no-op now, only on this refusal's
                    // path) reads it for the refusal.
                    Self::raise(conn, fence, row.now).await?;
                    return Err(StoreError::Internal(
                        "a checked upsert wrote nothing under a current attempt".to_owned(),
                    ));
                };
                return Ok((
                    ts::<D>(&stored, "created_at")?,
                    ts::<D>(&stored, "updated_at")?,
                ));
            }
        };
        let stored = Self::bind_row(sqlx::query(sql), row)
            .fetch_one(conn)
            .await?;
        let recorded: i64 = stored.try_get("max_attempt")?;
        let created = D::ts_text(&stored, "created_at")?;
        let updated = D::ts_text(&stored, "updated_at")?;
        match (created, updated) {
            (Some(created), Some(updated)) if recorded <= fence.attempt => Ok((created, updated)),
            _ => Err(fenced(fence, recorded)),
        }
    }

    async fn save_row(&self, row: SaveRow) -> Result<Checkpoint, StoreError> {
        // With whatever other steps' saves are waiting (PostgreSQL's group commit).
        if let (Some(_), None, Some(group)) = (&row.fence, &row.checkpoint.base, &self.group) {
            return group.clone().save_batched(row).await;
        }
        let (created, updated) = match (&row.fence, &row.checkpoint.base) {
            (None, _) => {
                let mut conn = self.writer.acquire().await?;
                let stored = Self::upsert(&mut conn, &row).await?;
                conn.finished();
                stored
            }
            // One statement: no transaction around it, and no write lock held between round
            // trips.
            (Some(fence), None) => {
                let mut conn = self.writer.acquire().await?;
                let stored = Self::fenced_upsert(&mut conn, &row, fence).await?;
                conn.finished();
                stored
            }
            (Some(fence), base) => {
                // Refused: the transaction rolls back when dropped.
                let mut tx = D::begin_write(&self.writer).await?;
                let stored = Self::fenced_upsert(&mut tx, &row, fence).await?;
                if let Some(base) = base {
                    // A turn (re)starting from its base: the rows of any earlier start are no
                    // longer part of its window.
                    let query = sqlx::query(D::UPSERT_BASE)
                        .bind(row.checkpoint.agent_id.as_str())
                        .bind(fence.turn_id.as_str())
                        .bind(base.as_str())
                        .bind(fence.attempt);
                    let query = D::bind_ts(query, row.now);
                    match D::DROP_EARLIER_START {
                        // One statement: it runs after the raise above took the turn's lock, so
                        // its snapshot holds every row an older attempt wrote.
                        None => {
                            query
                                .bind(row.checkpoint.id.as_str())
                                .execute(&mut *tx)
                                .await?;
                        }
                        Some(drop_earlier) => {
                            query.execute(&mut *tx).await?;
                            sqlx::query(drop_earlier)
                                .bind(row.checkpoint.agent_id.as_str())
                                .bind(fence.turn_id.as_str())
                                .bind(row.checkpoint.id.as_str())
                                .execute(&mut *tx)
                                .await?;
                        }
                    }
                }
                tx.commit().await?;
                stored
            }
        };
        Ok(row.stored(created, updated))
    }

    /// A row as the reads give it (delta rows rebuilt, see [`full`]).
    async fn full(&self, row: &D::Row) -> Result<Checkpoint, StoreError> {
        full(Self::raw(row)?, |agent_id, turn_id, step| async move {
            let base: Option<String> = sqlx::query_scalar(D::BASE_STATE)
                .bind(agent_id.as_str())
                .bind(turn_id.as_str())
                .fetch_optional(&self.pool)
                .await?;
            let chain: Vec<String> = sqlx::query_scalar(D::CHAIN)
                .bind(agent_id.as_str())
                .bind(turn_id.as_str())
                .bind(step)
                .fetch_all(&self.pool)
                .await?;
            Ok((base, chain))
        })
        .await
    }

    /// The columns of a read row.
    fn raw(row: &D::Row) -> Result<RawRow, StoreError> {
        Ok(RawRow {
            id: row.try_get("id")?,
            agent_id: row.try_get("agent_id")?,
            step: row.try_get("step")?,
            state: row.try_get("state")?,
            turn_id: row.try_get("turn_id")?,
            attempt: row.try_get("attempt")?,
            delta_from: row.try_get("delta_from")?,
            created_at: ts::<D>(row, "created_at")?,
            updated_at: ts::<D>(row, "updated_at")?,
        })
    }

    /// The row `found`, rebuilt; `NotFound` (naming `what`) when there is none.
    async fn found(&self, found: Option<D::Row>, what: &str) -> Result<Checkpoint, StoreError> {
        match found {
            Some(row) => self.full(&row).await,
            None => Err(no_checkpoint(what)),
        }
    }

    /// The checkpoint `sql` reads by its one parameter `key`; else not found, naming `what`.
    async fn find_by(
        &self,
        sql: &'static str,
        key: &str,
        what: &str,
    ) -> Result<Checkpoint, StoreError> {
        let row = sqlx::query(sql)
            .bind(key)
            .fetch_optional(&self.pool)
            .await?;
        self.found(row, what).await
    }
}
}

on_every_dialect! {
[CheckpointStore for SqlStore<D>] {
    async fn save(
        &self,
        checkpoint: Checkpoint,
        now: DateTime<Utc>,
    ) -> Result<Checkpoint, StoreError> {
        let row = prepare_save(checkpoint, now, self.max_state_bytes)?;
        self.save_row(row).await
    }

    async fn latest(&self, agent_id: &str) -> Result<Checkpoint, StoreError> {
        check_owner(agent_id)?;
        self.find_by(D::LATEST, agent_id, &format!("agent_id {agent_id}")).await
    }

    async fn latest_of_turn(
        &self,
        agent_id: &str,
        turn_id: &str,
        attempt: Option<u32>,
        now: DateTime<Utc>,
    ) -> Result<Checkpoint, StoreError> {
        check_turn_read(agent_id, turn_id)?;
        let read = || sqlx::query(D::LATEST_OF_TURN).bind(agent_id).bind(turn_id);
        let fence = attempt.map(|attempt| fence(turn_id, attempt)).transpose()?;
        let row = match fence {
            None => read().fetch_optional(&self.pool).await,
            // The first attempt: no older one can exist to shut out, so nothing is written (no
            // commit, and on SQLite not the writer connection). Refused when a newer attempt is
            // recorded; one that records itself after this read fences this attempt's saves.
            // The record and the row come in one statement (one snapshot, one round trip).
            Some(fence) if fence.attempt == i64::from(FIRST_ATTEMPT) => {
                let row = sqlx::query(D::FIRST_READ)
                    .bind(agent_id)
                    .bind(turn_id)
                    .fetch_one(&self.pool)
                    .await?;
                match row.try_get::<Option<i64>, _>("recorded")? {
                    Some(recorded) if recorded > fence.attempt => {
                        return Err(fenced(&fence, recorded));
                    }
                    _ => {}
                }
                let found: Option<String> = row.try_get("id")?;
                Ok(found.map(|_| row))
            }
            Some(fence) if D::RAISE_COMMITS_FIRST => {
                let mut conn = self.writer.acquire().await?;
                Self::raise(&mut conn, &fence, now).await?;
                let row = read().fetch_optional(&mut *conn).await?;
                conn.finished();
                Ok(row)
            }
            Some(fence) => {
                // Refused: the transaction rolls back when dropped.
                let mut tx = D::begin_write(&self.writer).await?;
                Self::raise(&mut tx, &fence, now).await?;
                let row = read().fetch_optional(&mut *tx).await?;
                tx.commit().await.map(|()| row)
            }
        }?;
        self.found(row, &format!("agent_id {agent_id} turn {turn_id}"))
            .await
    }

    async fn get(&self, id: &str) -> Result<Checkpoint, StoreError> {
        parse_id(id)?;
        self.find_by(D::BY_ID, id, &format!("id {id}")).await
    }

    async fn list_before(
        &self,
        agent_id: &str,
        count: u32,
        before: Option<&str>,
    ) -> Result<Vec<Checkpoint>, StoreError> {
        check_page(agent_id, before)?;
        let below = match before {
            None => i64::MAX,
            Some(id) => sqlx::query_scalar(D::WRITE_SEQ_OF)
                .bind(id)
                .fetch_optional(&self.pool)
                .await?
                .ok_or_else(|| cursor_gone(id))?,
        };
        let rows = sqlx::query(D::PAGE)
            .bind(agent_id)
            .bind(below)
            .bind(i64::from(count))
            .fetch_all(&self.pool)
            .await?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            out.push(self.full(row).await?);
        }
        Ok(out)
    }

    async fn progress(&self, request: &ProgressRequest) -> Result<Vec<TurnProgress>, StoreError> {
        check_progress(request)?;
        let mut out = Vec::with_capacity(request.turns.len());
        for turn in &request.turns {
            let (agent_id, turn_id) = (turn.agent_id.as_str(), turn.turn_id.as_str());
            let step: Option<i64> = sqlx::query_scalar(D::TURN_STEP)
                .bind(agent_id)
                .bind(turn_id)
                .fetch_one(&self.pool)
                .await?;
            let tool_names = match request.tool_names && step.is_some() {
                true => {
                    let states: Vec<String> = sqlx::query_scalar(D::CHAIN)
                        .bind(agent_id)
                        .bind(turn_id)
                        .bind(i64::MAX)
                        .fetch_all(&self.pool)
                        .await?;
                    tool_names(&states)
                }
                false => Vec::new(),
            };
            out.push(TurnProgress {
                agent_id: turn.agent_id.clone(),
                turn_id: turn.turn_id.clone(),
                step: step.map_or(0, |s| u32::try_from(s).unwrap_or(u32::MAX)),
                tool_names,
            });
        }
        Ok(out)
    }

    async fn retain(&self, request: &RetainRequest, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let mut tx = D::begin_write(&self.writer).await?;
        let done = match retain_mode(request)? {
            RetainMode::KeepLast {
                agent_id,
                keep_last,
            } => sqlx::query(D::KEEP_LAST)
                .bind(agent_id.as_str())
                .bind(i64::from(keep_last))
                .execute(&mut *tx)
                .await?,
            RetainMode::OlderThan { secs } => {
                let cut = cutoff(now, secs)?;
                let done = D::bind_ts(sqlx::query(D::DROP_IDLE_OWNERS), cut)
                    .execute(&mut *tx)
                    .await?;
                D::bind_ts(sqlx::query(D::DROP_OLD_ATTEMPTS), cut)
                    .execute(&mut *tx)
                    .await?;
                done
            }
        };
        sqlx::query(D::DROP_ORPHAN_BASES)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(D::rows_affected(&done))
    }

    fn backend(&self) -> &'static str {
        D::BACKEND
    }

    async fn close(&self) {
        if let Some(wal) = &self.wal {
            wal.close().await;
        }
        self.pool.close().await;
        self.writer.close().await;
    }

    async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}
}
