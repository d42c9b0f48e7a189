//! The SQLite backend of [`CheckpointStore`] (the embedded default: `checkpoints.db` in the data
//! directory).
//!
//! `state` is JSON text (checked by `json_valid`); timestamps are fixed-width RFC 3339 text.
//!
//! # Invariants
//! - `write_seq` is the rowid (migration 0002): a new row gets max + 1, an overwrite moves its row
//!   to max + 1, so the most recent write has the highest.
//! - A fenced save runs `turn_attempts` upsert → check → checkpoint upsert in one
//!   `BEGIN IMMEDIATE` transaction: it takes SQLite's write lock up front, so concurrent saves of
//!   one turn serialise (no read-then-upgrade `SQLITE_BUSY_SNAPSHOT`). A fenced read raises the
//!   record and reads in one such transaction.
//!
//! # Pitfalls
//! - WAL mode lets readers run beside the single writer; writers queue on the lock for up to
//!   `busy_timeout`, after which the save fails with `unavailable` (SQLITE_BUSY).
//! - Placeholders are `?N` (numbered) so one value can be used twice in a statement.

use super::{
    CheckpointStore, Fence, RawRow, SaveRow, StoreError, StoreOptions, check_owner, check_page,
    check_turn_read, classify, cursor_gone, cutoff, fenced, format_ts, full, no_checkpoint,
    parse_id, prepare_save, retain_mode,
};
use chrono::{DateTime, Utc};
use cyrene_protocol::checkpoint::{Checkpoint, RetainMode, RetainRequest};
use cyrene_sql::SqliteSettings;
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqlitePool, SqliteRow};
use sqlx::{Executor, Row, Sqlite};

/// The SQLite migrations of this crate (`migrations/sqlite`), applied at start.
pub static MIGRATOR: Migrator = cyrene_sql::migrations!(sqlite);

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

const UPSERT: &str = "INSERT INTO checkpoints \
     (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) \
     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8) \
     ON CONFLICT (id) DO UPDATE SET write_seq = (SELECT MAX(write_seq) + 1 FROM checkpoints), \
     state = excluded.state, turn_id = excluded.turn_id, delta_from = excluded.delta_from, \
     attempt = excluded.attempt, updated_at = excluded.updated_at \
     RETURNING created_at, updated_at";

const RAISE_ATTEMPT: &str = "INSERT INTO turn_attempts (turn_id, max_attempt, updated_at) \
     VALUES (?1, ?2, ?3) \
     ON CONFLICT (turn_id) DO UPDATE SET \
     max_attempt = MAX(turn_attempts.max_attempt, excluded.max_attempt), \
     updated_at = excluded.updated_at \
     RETURNING max_attempt";

/// Keeps the `?2` most recently written rows of owner `?1` and the earlier rows of their turns
/// that they are rebuilt from; deletes the rest.
const KEEP_LAST: &str = "DELETE FROM checkpoints WHERE agent_id = ?1 AND write_seq NOT IN \
     (SELECT write_seq FROM checkpoints WHERE agent_id = ?1 ORDER BY write_seq DESC LIMIT ?2) \
     AND NOT EXISTS (SELECT 1 FROM checkpoints k WHERE k.agent_id = ?1 \
       AND k.turn_id = checkpoints.turn_id AND k.step > checkpoints.step \
       AND k.delta_from IS NOT NULL \
       AND k.write_seq IN (SELECT write_seq FROM checkpoints WHERE agent_id = ?1 \
         ORDER BY write_seq DESC LIMIT ?2))";

/// Drops the bases of turns that have no row left.
const DROP_ORPHAN_BASES: &str = "DELETE FROM checkpoint_bases WHERE NOT EXISTS \
     (SELECT 1 FROM checkpoints c WHERE c.agent_id = checkpoint_bases.agent_id \
      AND c.turn_id = checkpoint_bases.turn_id)";

/// Checkpoints in an SQLite file.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    max_state_bytes: usize,
}

impl SqliteStore {
    /// Opens (creating if missing, parent directory included) the database at `url`
    /// (`sqlite://path/to/file.db`), then applies the migrations.
    pub async fn open(url: &str, options: &StoreOptions) -> Result<SqliteStore, StoreError> {
        let connect = SqliteSettings::CHECKPOINTS
            .connect_options(url)
            .map_err(|e| StoreError::Open(e.to_string()))?;
        let pool = options
            .pool()
            .options::<Sqlite>()
            .connect_with(connect)
            .await
            .map_err(|e| StoreError::Open(format!("sqlite: {e}")))?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| StoreError::Open(format!("sqlite migrations: {e}")))?;
        Ok(SqliteStore {
            pool,
            max_state_bytes: options.max_state_bytes,
        })
    }

    /// The pool (benchmarks compare against a direct upsert on it).
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn upsert<'c, E>(executor: E, row: SaveRow) -> Result<Checkpoint, StoreError>
    where
        E: Executor<'c, Database = Sqlite>,
    {
        let now = format_ts(row.now);
        let stored = sqlx::query(UPSERT)
            .bind(&row.id)
            .bind(&row.agent_id)
            .bind(i64::from(row.step))
            .bind(row.state.as_str())
            .bind(row.fence.as_ref().map(|f| f.turn_id.as_str()))
            .bind(row.fence.as_ref().map(|f| f.attempt))
            .bind(&now)
            .bind(row.delta_from)
            .fetch_one(executor)
            .await
            .map_err(classify)?;
        let created: String = stored.try_get("created_at").map_err(classify)?;
        let updated: String = stored.try_get("updated_at").map_err(classify)?;
        Ok(row.stored(created, updated))
    }

    async fn save_row(&self, row: SaveRow) -> Result<Checkpoint, StoreError> {
        let Some(fence) = row.fence.clone() else {
            return Self::upsert(&self.pool, row).await;
        };
        let mut tx = self
            .pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(classify)?;
        let recorded: i64 = sqlx::query_scalar(RAISE_ATTEMPT)
            .bind(&fence.turn_id)
            .bind(fence.attempt)
            .bind(format_ts(row.now))
            .fetch_one(&mut *tx)
            .await
            .map_err(classify)?;
        if recorded > fence.attempt {
            let _ = tx.rollback().await;
            return Err(fenced(&fence, recorded));
        }
        let base = row.base.clone();
        let (agent_id, id, now) = (row.agent_id.clone(), row.id.clone(), format_ts(row.now));
        let saved = Self::upsert(&mut *tx, row).await?;
        if let Some(base) = base {
            // A turn (re)starting from its base: the rows of any earlier start are no longer
            // part of its window.
            sqlx::query(
                "INSERT INTO checkpoint_bases (agent_id, turn_id, state, attempt, updated_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (agent_id, turn_id) DO UPDATE SET \
                 state = excluded.state, attempt = excluded.attempt, \
                 updated_at = excluded.updated_at",
            )
            .bind(&agent_id)
            .bind(&fence.turn_id)
            .bind(base.as_str())
            .bind(fence.attempt)
            .bind(&now)
            .execute(&mut *tx)
            .await
            .map_err(classify)?;
            sqlx::query(
                "DELETE FROM checkpoints WHERE agent_id = ?1 AND turn_id = ?2 AND id <> ?3",
            )
            .bind(&agent_id)
            .bind(&fence.turn_id)
            .bind(&id)
            .execute(&mut *tx)
            .await
            .map_err(classify)?;
        }
        tx.commit().await.map_err(classify)?;
        Ok(saved)
    }

    /// A row as the reads give it (delta rows rebuilt, see [`full`]).
    async fn full(&self, row: &SqliteRow) -> Result<Checkpoint, StoreError> {
        full(raw(row)?, |agent_id, turn_id, step| async move {
            let base: Option<String> = sqlx::query_scalar(
                "SELECT state FROM checkpoint_bases WHERE agent_id = ?1 AND turn_id = ?2",
            )
            .bind(&agent_id)
            .bind(&turn_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(classify)?;
            let chain: Vec<String> = sqlx::query_scalar(
                "SELECT state FROM checkpoints WHERE agent_id = ?1 AND turn_id = ?2 \
                 AND step <= ?3 ORDER BY step",
            )
            .bind(&agent_id)
            .bind(&turn_id)
            .bind(step)
            .fetch_all(&self.pool)
            .await
            .map_err(classify)?;
            Ok((base, chain))
        })
        .await
    }
}

fn raw(row: &SqliteRow) -> Result<RawRow, StoreError> {
    Ok(RawRow {
        id: row.try_get("id").map_err(classify)?,
        agent_id: row.try_get("agent_id").map_err(classify)?,
        step: row.try_get("step").map_err(classify)?,
        state: row.try_get("state").map_err(classify)?,
        turn_id: row.try_get("turn_id").map_err(classify)?,
        attempt: row.try_get("attempt").map_err(classify)?,
        delta_from: row.try_get("delta_from").map_err(classify)?,
        created_at: row.try_get("created_at").map_err(classify)?,
        updated_at: row.try_get("updated_at").map_err(classify)?,
    })
}

impl CheckpointStore for SqliteStore {
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
        let row = sqlx::query(select!(
            "WHERE agent_id = ?1 ORDER BY write_seq DESC LIMIT 1"
        ))
        .bind(agent_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(classify)?;
        match row {
            Some(row) => self.full(&row).await,
            None => Err(no_checkpoint(&format!("agent_id {agent_id}"))),
        }
    }

    async fn latest_of_turn(
        &self,
        agent_id: &str,
        turn_id: &str,
        attempt: Option<u32>,
        now: DateTime<Utc>,
    ) -> Result<Checkpoint, StoreError> {
        check_turn_read(agent_id, turn_id)?;
        let query = select!("WHERE turn_id = ?2 AND agent_id = ?1 ORDER BY write_seq DESC LIMIT 1");
        let row = match attempt {
            None => sqlx::query(query)
                .bind(agent_id)
                .bind(turn_id)
                .fetch_optional(&self.pool)
                .await
                .map_err(classify)?,
            Some(attempt) => {
                let fence = Fence {
                    turn_id: turn_id.to_owned(),
                    attempt: i64::from(attempt),
                };
                let mut tx = self
                    .pool
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(classify)?;
                let recorded: i64 = sqlx::query_scalar(RAISE_ATTEMPT)
                    .bind(turn_id)
                    .bind(fence.attempt)
                    .bind(format_ts(now))
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(classify)?;
                if recorded > fence.attempt {
                    let _ = tx.rollback().await;
                    return Err(fenced(&fence, recorded));
                }
                let row = sqlx::query(query)
                    .bind(agent_id)
                    .bind(turn_id)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(classify)?;
                tx.commit().await.map_err(classify)?;
                row
            }
        };
        match row {
            Some(row) => self.full(&row).await,
            None => Err(no_checkpoint(&format!(
                "agent_id {agent_id} turn {turn_id}"
            ))),
        }
    }

    async fn get(&self, id: &str) -> Result<Checkpoint, StoreError> {
        parse_id(id)?;
        let row = sqlx::query(select!("WHERE id = ?1"))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(classify)?;
        match row {
            Some(row) => self.full(&row).await,
            None => Err(no_checkpoint(&format!("id {id}"))),
        }
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
            Some(id) => sqlx::query_scalar("SELECT write_seq FROM checkpoints WHERE id = ?1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(classify)?
                .ok_or_else(|| cursor_gone(id))?,
        };
        let rows = sqlx::query(select!(
            "WHERE agent_id = ?1 AND write_seq < ?2 ORDER BY write_seq DESC LIMIT ?3"
        ))
        .bind(agent_id)
        .bind(below)
        .bind(i64::from(count))
        .fetch_all(&self.pool)
        .await
        .map_err(classify)?;
        let mut out = Vec::with_capacity(rows.len());
        for row in &rows {
            out.push(self.full(row).await?);
        }
        Ok(out)
    }

    async fn retain(&self, request: &RetainRequest, now: DateTime<Utc>) -> Result<u64, StoreError> {
        match retain_mode(request)? {
            RetainMode::KeepLast {
                agent_id,
                keep_last,
            } => {
                let mut tx = self
                    .pool
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(classify)?;
                let done = sqlx::query(KEEP_LAST)
                    .bind(&agent_id)
                    .bind(i64::from(keep_last))
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                sqlx::query(DROP_ORPHAN_BASES)
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                tx.commit().await.map_err(classify)?;
                Ok(done.rows_affected())
            }
            RetainMode::OlderThan { secs } => {
                let cut = format_ts(cutoff(now, secs)?);
                let mut tx = self
                    .pool
                    .begin_with("BEGIN IMMEDIATE")
                    .await
                    .map_err(classify)?;
                let done = sqlx::query(
                    "DELETE FROM checkpoints WHERE agent_id IN \
                     (SELECT agent_id FROM checkpoints GROUP BY agent_id \
                      HAVING MAX(updated_at) < ?1)",
                )
                .bind(&cut)
                .execute(&mut *tx)
                .await
                .map_err(classify)?;
                sqlx::query("DELETE FROM turn_attempts WHERE updated_at < ?1")
                    .bind(&cut)
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                sqlx::query(DROP_ORPHAN_BASES)
                    .execute(&mut *tx)
                    .await
                    .map_err(classify)?;
                tx.commit().await.map_err(classify)?;
                Ok(done.rows_affected())
            }
        }
    }

    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn close(&self) {
        self.pool.close().await;
    }

    async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}
