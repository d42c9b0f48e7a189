//! The SQLite dialect of [`super::CheckpointStore`] (the embedded default: `checkpoints.db` in the data
//! directory).
//!
//! `state` is JSON text (checked by `json_valid`); timestamps are fixed-width RFC 3339 text.
//!
//! # Invariants
//! - `write_seq` is the rowid (migration 0002): a new row gets max + 1, an overwrite moves its row
//!   to max + 1, so the most recent write has the highest.
//! - A step's fenced save is one autocommit statement (`FENCED_SAVE`): the checkpoint upsert,
//!   which writes only while the turn's recorded attempt is not above its own, and whose write
//!   raises the record (`turn_attempts`) through the triggers of migration 0004 — since 0006 only
//!   when its attempt is above the record's: a save of the recorded attempt leaves the record's
//!   page unwritten. A write statement takes SQLite's write lock as it starts, so the check, the
//!   write and the raise are atomic and concurrent saves of one turn serialise (no read-then-upgrade
//!   `SQLITE_BUSY_SNAPSHOT`). A save that also stores the turn's base, and a fenced read by a
//!   later attempt than the first (raise, then read), run in one `BEGIN IMMEDIATE` transaction,
//!   which takes the lock up front; the first attempt's fenced read writes nothing.
//! - Every write of a row with a turn and an attempt raises that turn's record to that attempt
//!   (the triggers), so no statement here may write such a row for an attempt that is not allowed
//!   to fence the turn.
//! - A record's `updated_at` is when its attempt was last raised, not the turn's last save: a
//!   turn is idle for retention when neither its record nor any of its rows was written since
//!   the cut-off (`DROP_OLD_ATTEMPTS`), and a deleted row hands its write time to its turn's
//!   record (migration 0006's delete trigger), so `keep_last` cannot make a live turn look idle.
//! - Every write runs on one connection, the store's `writer` (plain reads use the pool): SQLite
//!   takes one writer at a time anyway, and a connection that alone writes keeps its page cache.
//!   Each commit through one connection of a WAL file makes every other connection drop its
//!   whole page cache when it next begins, and read back every page it then touches: with the
//!   pool's connections taken in turn, every step's save did that for its b-trees and the
//!   attempt record.
//! - The WAL is copied into the database file (checkpointed) by a task of the store's own
//!   ([`cyrene_sql::WalTask`], every 250 ms, on a connection of its own), not inside whichever
//!   commit crosses SQLite's automatic threshold: that copy and its sync stalled one step's save
//!   in a few hundred by tens of milliseconds. The writer still checkpoints inline past
//!   [`cyrene_sql::WAL_AUTOCHECKPOINT_PAGES`], so a stalled task cannot let the WAL grow without
//!   bound. A checkpoint commits nothing: it does not empty the other connections' page caches.
//!
//! # Pitfalls
//! - WAL mode lets readers run beside the single writer; writes queue for the `writer` connection
//!   for up to `busy_timeout` (as they would for the file's lock), after which the save fails
//!   with `unavailable`. Another process writing the same file still takes the lock from it
//!   (SQLITE_BUSY after `busy_timeout`), and empties the writer's page cache once.
//! - Placeholders are `?N` (numbered) so one value can be used twice in a statement.

use super::sql::{Dialect, FencedSave, SqlStore};
use super::{StoreError, StoreOptions, format_ts};
use chrono::{DateTime, Utc};
use cyrene_sql::{PoolSettings, SqliteSettings, WarmPool, WarmTx};
use sqlx::migrate::Migrator;
use sqlx::query::Query;
use sqlx::sqlite::{SqliteQueryResult, SqliteRow};
use sqlx::{Database, Row, Sqlite};
use std::sync::Arc;

/// The SQLite migrations of this crate (`migrations/sqlite`), applied at start.
pub static MIGRATOR: Migrator = cyrene_sql::migrations!(sqlite);

/// Checkpoints in an SQLite file.
pub type SqliteStore = SqlStore<Sqlite>;

/// `SELECT <every column> FROM checkpoints <rest>` as one static string.
macro_rules! select {
    ($rest:literal) => {
        concat!(
            "SELECT id, agent_id, step, state, turn_id, attempt, delta_from, created_at, \
             updated_at FROM checkpoints ",
            $rest
        )
    };
}

/// The upsert of a checkpoint row from `$source` (the values `?1`…`?8` in
/// [`Dialect::UPSERT`]'s order) as one static string; returns `created_at`, `updated_at`.
macro_rules! upsert {
    ($source:literal) => {
        concat!(
            "INSERT INTO checkpoints \
             (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) ",
            $source,
            " ON CONFLICT (id) DO UPDATE SET \
             write_seq = (SELECT MAX(write_seq) + 1 FROM checkpoints), \
             state = excluded.state, turn_id = excluded.turn_id, delta_from = excluded.delta_from, \
             attempt = excluded.attempt, updated_at = excluded.updated_at \
             RETURNING created_at, updated_at"
        )
    };
}

impl Dialect for Sqlite {
    const BACKEND: &'static str = "sqlite";
    const LATEST: &'static str = select!("WHERE agent_id = ?1 ORDER BY write_seq DESC LIMIT 1");
    /// The turn's few rows through `checkpoints_turn_step`, sorted: `+write_seq` keeps the
    /// planner from walking the owner's every row backwards through `checkpoints_owner_written`
    /// (migration 0005 dropped the index on `(turn_id, write_seq)`).
    const LATEST_OF_TURN: &'static str =
        select!("WHERE turn_id = ?2 AND agent_id = ?1 ORDER BY +write_seq DESC LIMIT 1");
    const BY_ID: &'static str = select!("WHERE id = ?1");
    const WRITE_SEQ_OF: &'static str = "SELECT write_seq FROM checkpoints WHERE id = ?1";
    const PAGE: &'static str =
        select!("WHERE agent_id = ?1 AND write_seq < ?2 ORDER BY write_seq DESC LIMIT ?3");
    const BASE_STATE: &'static str =
        "SELECT state FROM checkpoint_bases WHERE agent_id = ?1 AND turn_id = ?2";
    const CHAIN: &'static str = "SELECT state FROM checkpoints WHERE agent_id = ?1 \
         AND turn_id = ?2 AND step <= ?3 ORDER BY step";
    const TURN_STEP: &'static str =
        "SELECT MAX(step) FROM checkpoints WHERE agent_id = ?1 AND turn_id = ?2";
    const UPSERT: &'static str = upsert!("VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8)");
    const FIRST_READ: &'static str = concat!(
        "SELECT (SELECT max_attempt FROM turn_attempts WHERE turn_id = ?2) AS recorded, c.* \
         FROM (SELECT 1) AS one LEFT JOIN (",
        select!("WHERE turn_id = ?2 AND agent_id = ?1 ORDER BY +write_seq DESC LIMIT 1"),
        ") AS c ON 1"
    );
    const RAISE_ATTEMPT: &'static str = "INSERT INTO turn_attempts (turn_id, max_attempt, updated_at) \
         VALUES (?1, ?2, ?3) \
         ON CONFLICT (turn_id) DO UPDATE SET \
         max_attempt = MAX(turn_attempts.max_attempt, excluded.max_attempt), \
         updated_at = excluded.updated_at \
         RETURNING max_attempt";
    /// No data-modifying CTEs in SQLite: this upsert checks the record in its `WHERE` (which
    /// also tells the parser that `ON CONFLICT` is the upsert's), and its write raises the record
    /// (migration 0004's triggers). One statement, one commit and one round trip to the
    /// connection's thread (two commits as the raise and then the upsert; four round trips with
    /// the lock held across them as `BEGIN IMMEDIATE` … `COMMIT`).
    const FENCED_SAVE: FencedSave = FencedSave::CheckedRaising(upsert!(
        "SELECT ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8 \
         WHERE COALESCE((SELECT max_attempt FROM turn_attempts WHERE turn_id = ?5), 0) <= ?6"
    ));
    const UPSERT_BASE: &'static str = "INSERT INTO checkpoint_bases (agent_id, turn_id, state, attempt, updated_at) \
         VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (agent_id, turn_id) DO UPDATE SET \
         state = excluded.state, attempt = excluded.attempt, updated_at = excluded.updated_at";
    const DROP_EARLIER_START: Option<&'static str> =
        Some("DELETE FROM checkpoints WHERE agent_id = ?1 AND turn_id = ?2 AND id <> ?3");
    const KEEP_LAST: &'static str = "DELETE FROM checkpoints WHERE agent_id = ?1 \
         AND write_seq NOT IN \
         (SELECT write_seq FROM checkpoints WHERE agent_id = ?1 ORDER BY write_seq DESC LIMIT ?2) \
         AND NOT EXISTS (SELECT 1 FROM checkpoints k WHERE k.agent_id = ?1 \
           AND k.turn_id = checkpoints.turn_id AND k.step > checkpoints.step \
           AND k.delta_from IS NOT NULL \
           AND k.write_seq IN (SELECT write_seq FROM checkpoints WHERE agent_id = ?1 \
             ORDER BY write_seq DESC LIMIT ?2))";
    const DROP_ORPHAN_BASES: &'static str = "DELETE FROM checkpoint_bases WHERE NOT EXISTS \
         (SELECT 1 FROM checkpoints c WHERE c.agent_id = checkpoint_bases.agent_id \
          AND c.turn_id = checkpoint_bases.turn_id)";
    const DROP_IDLE_OWNERS: &'static str = "DELETE FROM checkpoints WHERE agent_id IN \
         (SELECT agent_id FROM checkpoints GROUP BY agent_id HAVING MAX(updated_at) < ?1)";
    /// A record last raised before `?1` whose turn has no row written since (a save of the
    /// recorded attempt leaves the record alone, migration 0006; a deleted row's time went into
    /// the record). The turns with a recent row are read once (`NOT IN` over a list).
    const DROP_OLD_ATTEMPTS: &'static str = "DELETE FROM turn_attempts WHERE updated_at < ?1 \
         AND turn_id NOT IN (SELECT turn_id FROM checkpoints \
           WHERE updated_at >= ?1 AND turn_id IS NOT NULL)";
    /// One `BEGIN IMMEDIATE` transaction raises and reads.
    const RAISE_COMMITS_FIRST: bool = false;

    async fn begin_write(pool: &WarmPool<Self>) -> Result<WarmTx<Self>, sqlx::Error> {
        pool.begin_with(Some(sqlx::SqlStr::from_static("BEGIN IMMEDIATE")))
            .await
    }

    fn bind_ts<'q>(
        query: Query<'q, Self, <Self as Database>::Arguments>,
        at: DateTime<Utc>,
    ) -> Query<'q, Self, <Self as Database>::Arguments> {
        query.bind(format_ts(at))
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }

    fn ts_text(row: &SqliteRow, column: &str) -> Result<Option<String>, sqlx::Error> {
        row.try_get(column)
    }
}

impl SqliteStore {
    /// Opens (creating if missing, parent directory included) the database at `url`
    /// (`sqlite://path/to/file.db`), then applies the migrations.
    pub async fn open(url: &str, options: &StoreOptions) -> Result<SqliteStore, StoreError> {
        let settings = SqliteSettings::CHECKPOINTS;
        let connect = settings.connect_options(url)?;
        let pool = options
            .pool()
            .options::<Sqlite>()
            .connect_with(connect.clone())
            .await
            .map_err(StoreError::open("sqlite"))?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(StoreError::open("sqlite migrations"))?;
        // One connection for every write (the module's invariants); a write waits for it as long
        // as it would wait for the file's write lock.
        let one = PoolSettings {
            max_connections: 1,
            acquire_timeout: settings.busy_timeout,
        };
        let writer = one
            .options::<Sqlite>()
            .connect_with(connect.clone())
            .await
            .map_err(StoreError::open("sqlite"))?;
        let wal = cyrene_sql::WalTask::start(connect, cyrene_sql::WAL_CHECKPOINT_EVERY)
            .await
            .map_err(StoreError::open("sqlite"))?;
        Ok(SqlStore {
            group: None,
            pool: WarmPool::new(pool),
            writer: WarmPool::new(writer),
            max_state_bytes: options.max_state_bytes,
            wal: Some(Arc::new(wal)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CheckpointStore;
    use cyrene_protocol::checkpoint::{Checkpoint, RetainRequest, checkpoint_id};
    use serde_json::json;
    use std::time::Duration;

    /// Step `step` of turn `t1` (attempt 1): a delta from message 0, with the turn's base when
    /// `base`.
    fn step(step: u32, base: bool) -> Checkpoint {
        serde_json::from_value(json!({
            "id": checkpoint_id("s1", Some("t1"), step),
            "agent_id": "s1", "step": step, "turn_id": "t1", "attempt": 1,
            "state": {"from": 0, "step": step, "messages": []},
            "base": base.then(|| json!({"messages": []})),
        }))
        .unwrap()
    }

    /// An unfenced save of owner `s2`.
    fn unfenced() -> Checkpoint {
        serde_json::from_value(json!({
            "id": "s2:1", "agent_id": "s2", "step": 1, "state": {"step": 1, "messages": []},
        }))
        .unwrap()
    }

    async fn open(options: &StoreOptions) -> (SqliteStore, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("c.db").display());
        (SqliteStore::open(&url, options).await.unwrap(), dir)
    }

    /// Every kind of write runs on the one writer connection: `PRAGMA data_version` there changes
    /// only when another connection commits to the file (which would also empty its page
    /// cache), and it does not move through saves, a fenced read, retentions and a checkpoint
    /// of the WAL task's — until one write goes through the read pool.
    #[tokio::test]
    async fn every_write_runs_on_the_one_writer_connection() {
        let (store, _dir) = open(&StoreOptions::default()).await;
        let version =
            || sqlx::query_scalar::<_, i64>("PRAGMA data_version").fetch_one(&store.writer);
        let before = version().await.unwrap();
        let now = Utc::now();
        let plain = unfenced();
        store.save(plain, now).await.unwrap();
        store.save(step(1, true), now).await.unwrap();
        store.save(step(2, false), now).await.unwrap();
        store
            .latest_of_turn("s1", "t1", Some(2), now)
            .await
            .unwrap();
        assert_eq!(store.list("s1", None).await.unwrap().len(), 2);
        store
            .retain(&RetainRequest::keep_last("s1", 5), now)
            .await
            .unwrap();
        store
            .retain(&RetainRequest::older_than(3600), now)
            .await
            .unwrap();
        // The WAL task's checkpoint changes no data: it leaves the writer's cache valid too.
        let checkpointer = store.wal.as_ref().unwrap().pool();
        let (busy, frames, copied): (i64, i64, i64) =
            sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
                .fetch_one(checkpointer)
                .await
                .unwrap();
        assert_eq!((busy, frames), (0, copied), "the WAL was not all copied");
        assert_eq!(
            version().await.unwrap(),
            before,
            "a write ran on another connection"
        );
        sqlx::query("DELETE FROM turn_attempts")
            .execute(&store.pool)
            .await
            .unwrap();
        assert_ne!(
            version().await.unwrap(),
            before,
            "a commit on another connection shows"
        );
    }

    /// A fenced read by the first attempt writes nothing (there is no older attempt to shut out):
    /// no attempt record, and the file's `data_version` as another connection sees it does not
    /// move; a later attempt's read records itself.
    #[tokio::test]
    async fn the_first_attempts_read_writes_nothing() {
        let (store, _dir) = open(&StoreOptions::default()).await;
        let mut reader = store.pool.acquire().await.unwrap();
        let mut version = async || {
            sqlx::query_scalar::<_, i64>("PRAGMA data_version")
                .fetch_one(&mut *reader)
                .await
                .unwrap()
        };
        let records = || {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM turn_attempts")
                .fetch_one(&store.pool)
        };
        let before = version().await;
        let now = Utc::now();
        for _ in 0..2 {
            let err = store.latest_of_turn("s1", "t1", Some(1), now).await;
            assert_eq!(
                err.unwrap_err().code(),
                cyrene_protocol::ErrorCode::NotFound
            );
        }
        assert_eq!(version().await, before, "the first attempt's read wrote");
        assert_eq!(records().await.unwrap(), 0);
        let err = store.latest_of_turn("s1", "t1", Some(2), now).await;
        assert_eq!(
            err.unwrap_err().code(),
            cyrene_protocol::ErrorCode::NotFound
        );
        assert_ne!(
            version().await,
            before,
            "a later attempt's read records itself"
        );
        assert_eq!(records().await.unwrap(), 1);
    }

    /// The WAL reaches the database file through the store's own task, not through a save: the
    /// writer checkpoints inline only past [`cyrene_sql::WAL_AUTOCHECKPOINT_PAGES`], yet the file takes in
    /// the saves' pages soon after them; closing the store stops the task.
    #[tokio::test]
    async fn the_wal_is_checkpointed_off_the_saves_path() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.db");
        let url = format!("sqlite://{}", file.display());
        let store = SqliteStore::open(&url, &StoreOptions::default())
            .await
            .unwrap();
        let threshold: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(&store.writer)
            .await
            .unwrap();
        assert_eq!(threshold, i64::from(cyrene_sql::WAL_AUTOCHECKPOINT_PAGES));
        // Only a checkpoint writes to the database file itself (a commit appends to the WAL).
        let size = || std::fs::metadata(&file).unwrap().len();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let before = size();
        let note = "x".repeat(2000);
        for n in 1..=100 {
            let cp = serde_json::from_value(json!({
                "id": format!("s3:{n}"), "agent_id": "s3", "step": n,
                "state": {"step": n, "messages": [], "note": note},
            }))
            .unwrap();
            store.save(cp, Utc::now()).await.unwrap();
        }
        while size() <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the WAL never reached the file"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let wal = store.wal.clone().unwrap();
        store.close().await;
        assert!(wal.pool().is_closed());
        assert!(wal.is_stopped());
    }

    /// Writes never wait for a read connection: with the only one held, saves of every kind and
    /// a retention still go through.
    #[tokio::test]
    async fn writes_do_not_wait_for_the_read_pool() {
        let options = StoreOptions {
            max_connections: 1,
            acquire_timeout: Duration::from_millis(200),
            ..StoreOptions::default()
        };
        let (store, _dir) = open(&options).await;
        let _held = store.pool.acquire().await.unwrap();
        let now = Utc::now();
        let plain = unfenced();
        store.save(plain, now).await.unwrap();
        store.save(step(1, true), now).await.unwrap();
        store.save(step(2, false), now).await.unwrap();
        store
            .retain(&RetainRequest::keep_last("s2", 0), now)
            .await
            .unwrap();
    }

    /// `latest` of a turn reads that turn's rows through `checkpoints_turn_step` and sorts the
    /// few of them, instead of walking the owner's every row newest first through
    /// `checkpoints_owner_written` (what the planner picks for `ORDER BY write_seq` once
    /// migration 0005 dropped the index on `(turn_id, write_seq)`).
    #[tokio::test]
    async fn a_turns_latest_reads_only_that_turns_rows() {
        let (store, _dir) = open(&StoreOptions::default()).await;
        let plan: Vec<String> = sqlx::query(sqlx::AssertSqlSafe(format!(
            "EXPLAIN QUERY PLAN {}",
            <Sqlite as Dialect>::LATEST_OF_TURN
        )))
        .bind("s1")
        .bind("t1")
        .fetch_all(&store.pool)
        .await
        .unwrap()
        .iter()
        .map(|row| row.get("detail"))
        .collect();
        assert!(
            plan.iter().any(|step| step
                .contains("USING INDEX checkpoints_turn_step (agent_id=? AND turn_id=?)")),
            "{plan:?}"
        );
    }

    /// A save of the turn's recorded attempt writes its row and leaves the attempt record as it
    /// was (migration 0006: one WAL page fewer a save), and the record still fences: an older
    /// attempt is refused after it, and a newer one raises it as it writes.
    #[tokio::test]
    async fn a_save_of_the_recorded_attempt_leaves_the_record_alone_and_still_fences() {
        let (store, _dir) = open(&StoreOptions::default()).await;
        let record = || {
            sqlx::query_as::<_, (i64, String)>(
                "SELECT max_attempt, updated_at FROM turn_attempts WHERE turn_id = 't1'",
            )
            .fetch_one(&store.pool)
        };
        let attempt = |step: u32, attempt: u32| {
            let mut cp = self::step(step, false);
            cp.attempt = Some(attempt);
            cp
        };
        let start = Utc::now() - chrono::TimeDelta::seconds(60);
        store.save(attempt(1, 2), start).await.unwrap();
        let first = record().await.unwrap();
        assert_eq!(first, (2, format_ts(start)));
        store.save(attempt(2, 2), Utc::now()).await.unwrap();
        assert_eq!(
            record().await.unwrap(),
            first,
            "the record was written again"
        );
        let late = store.save(attempt(3, 1), Utc::now()).await.unwrap_err();
        assert_eq!(late.code(), cyrene_protocol::ErrorCode::Conflict, "{late}");
        let now = Utc::now();
        store.save(attempt(3, 3), now).await.unwrap();
        assert_eq!(
            record().await.unwrap(),
            (3, format_ts(now)),
            "a newer attempt raises it"
        );
        let late = store.save(attempt(4, 2), Utc::now()).await.unwrap_err();
        assert_eq!(late.code(), cyrene_protocol::ErrorCode::Conflict, "{late}");
    }

    /// The fenced save is the checked upsert alone: it writes nothing once a newer attempt
    /// raised the record (a fenced read), and its own write raises the record, so an older
    /// attempt is refused after it without any separate raise.
    #[tokio::test]
    async fn the_checked_upsert_is_fenced_and_its_write_raises_the_record() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("c.db").display());
        let store = SqliteStore::open(&url, &StoreOptions::default())
            .await
            .unwrap();
        let FencedSave::CheckedRaising(checked) = <Sqlite as Dialect>::FENCED_SAVE else {
            panic!("SQLite saves with a checked upsert");
        };
        let now = format_ts(Utc::now());
        let raise = |attempt: i64| {
            sqlx::query(<Sqlite as Dialect>::RAISE_ATTEMPT)
                .bind("turn1")
                .bind(attempt)
                .bind(now.clone())
                .execute(&store.pool)
        };
        let upsert = |attempt: i64| {
            sqlx::query(checked)
                .bind("s1:turn1:1")
                .bind("s1")
                .bind(1_i64)
                .bind(format!("{{\"attempt\":{attempt}}}"))
                .bind("turn1")
                .bind(attempt)
                .bind(now.clone())
                .bind(None::<i64>)
                .fetch_optional(&store.pool)
        };
        let recorded = || {
            sqlx::query_scalar::<_, i64>(
                "SELECT max_attempt FROM turn_attempts WHERE turn_id = 'turn1'",
            )
            .fetch_optional(&store.pool)
        };
        let state = || {
            sqlx::query_scalar::<_, String>("SELECT state FROM checkpoints WHERE id = 's1:turn1:1'")
                .fetch_optional(&store.pool)
        };
        assert!(upsert(1).await.unwrap().is_some(), "the first write");
        assert_eq!(
            recorded().await.unwrap(),
            Some(1),
            "the write raised the record"
        );
        raise(2).await.unwrap();
        assert!(
            upsert(1).await.unwrap().is_none(),
            "attempt 1 wrote after 2 raised"
        );
        assert_eq!(state().await.unwrap().as_deref(), Some("{\"attempt\":1}"));
        assert!(upsert(2).await.unwrap().is_some());
        assert!(
            upsert(3).await.unwrap().is_some(),
            "a newer attempt than recorded writes"
        );
        assert_eq!(
            recorded().await.unwrap(),
            Some(3),
            "and raises the record as it writes"
        );
        assert!(
            upsert(2).await.unwrap().is_none(),
            "attempt 2 wrote after 3 wrote, with no raise in between"
        );
        assert_eq!(state().await.unwrap().as_deref(), Some("{\"attempt\":3}"));
    }
}
