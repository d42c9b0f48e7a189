//! The PostgreSQL backend of [`CheckpointStore`] (production).
//!
//! `state` is `JSON` (bound as text and cast, so PostgreSQL validates it; stored and read back as
//! that very text — see migration 0002); timestamps are `TIMESTAMPTZ`.
//!
//! # Invariants
//! - `write_seq` comes from the sequence `checkpoints_write_seq` (migration 0003): the column
//!   default on insert, `nextval` again on overwrite, so the most recent write has the highest.
//! - A fenced save is **one statement** ([`FENCED_UPSERT`]): the `turn_attempts` upsert, the
//!   check and the checkpoint upsert in data-modifying CTEs — atomic, and one round trip instead
//!   of four (BEGIN, raise, upsert, COMMIT) on the loop worker's per-step path. The
//!   `ON CONFLICT DO UPDATE` on `turn_attempts` row-locks the turn, so concurrent saves of one
//!   turn serialise: once attempt N has committed, attempt N-1 sees `max_attempt >= N` and writes
//!   no checkpoint.
//! - A fenced read is two statements on purpose: the `turn_attempts` raise commits (waiting on the
//!   row lock of any save of the turn still running), and only then the read takes its snapshot,
//!   so it sees every row an older attempt managed to write — none can be written after it.
//!
//! # Pitfalls
//! - The pool reconnects by itself: after an outage the broken connections fail once (I/O error →
//!   `unavailable`) and are dropped; new ones are opened on demand, bounded by `acquire_timeout`.
//! - An `older_than_secs` retention racing a save of the same long-idle owner may delete that
//!   fresh row; retention is meant for owners idle far longer than any turn.

use super::{
    CheckpointStore, Fence, RawRow, SaveRow, StoreError, StoreOptions, check_owner, check_page,
    check_turn_read, classify, cursor_gone, cutoff, fenced, format_ts, full, no_checkpoint,
    parse_id, prepare_save, retain_mode,
};
use chrono::{DateTime, Utc};
use cyrene_protocol::checkpoint::{Checkpoint, RetainMode, RetainRequest};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPool, PgRow};
use sqlx::{Executor, Postgres, Row};

/// The PostgreSQL migrations of this crate (`migrations/postgres`), applied at start.
pub static MIGRATOR: Migrator = cyrene_sql::migrations!(postgres);

/// `SELECT <every column> FROM checkpoints <rest>` as one static string.
macro_rules! select {
    ($rest:literal) => {
        concat!(
            "SELECT id, agent_id, step, state::text AS state, turn_id, attempt, \
             delta_from, created_at, updated_at FROM checkpoints ",
            $rest
        )
    };
}

const UPSERT: &str = "INSERT INTO checkpoints \
     (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) \
     VALUES ($1, $2, $3, $4::json, $5, $6, $7, $7, $8) \
     ON CONFLICT (id) DO UPDATE SET write_seq = nextval('checkpoints_write_seq'), \
     state = EXCLUDED.state, turn_id = EXCLUDED.turn_id, delta_from = EXCLUDED.delta_from, \
     attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at \
     RETURNING created_at, updated_at";

/// Records an attempt as its turn's newest unless a newer one is; returns the recorded newest.
const RAISE_ATTEMPT: &str = "INSERT INTO turn_attempts (turn_id, max_attempt, updated_at) \
     VALUES ($1, $2, $3) \
     ON CONFLICT (turn_id) DO UPDATE SET \
     max_attempt = GREATEST(turn_attempts.max_attempt, EXCLUDED.max_attempt), \
     updated_at = EXCLUDED.updated_at \
     RETURNING max_attempt";

/// Raise the turn's attempt record, then upsert the checkpoint only if this attempt is not older
/// than the record; one row back: the recorded attempt and, when written, the timestamps.
const FENCED_UPSERT: &str = "WITH fence AS ( \
       INSERT INTO turn_attempts (turn_id, max_attempt, updated_at) VALUES ($5, $6, $7) \
       ON CONFLICT (turn_id) DO UPDATE SET \
       max_attempt = GREATEST(turn_attempts.max_attempt, EXCLUDED.max_attempt), \
       updated_at = EXCLUDED.updated_at \
       RETURNING max_attempt), \
     saved AS ( \
       INSERT INTO checkpoints \
       (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) \
       SELECT $1, $2, $3, $4::json, $5, $6, $7, $7, $8 FROM fence WHERE fence.max_attempt <= $6 \
       ON CONFLICT (id) DO UPDATE SET write_seq = nextval('checkpoints_write_seq'), \
       state = EXCLUDED.state, turn_id = EXCLUDED.turn_id, delta_from = EXCLUDED.delta_from, \
       attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at \
       RETURNING created_at, updated_at) \
     SELECT fence.max_attempt, saved.created_at, saved.updated_at \
     FROM fence LEFT JOIN saved ON true";

/// Keeps the `$2` most recently written rows of owner `$1` and the earlier rows of their turns
/// that they are rebuilt from; deletes the rest.
const KEEP_LAST: &str = "WITH kept AS (SELECT turn_id, step, write_seq, delta_from FROM checkpoints \
       WHERE agent_id = $1 ORDER BY write_seq DESC LIMIT $2) \
     DELETE FROM checkpoints c WHERE c.agent_id = $1 \
     AND c.write_seq NOT IN (SELECT write_seq FROM kept) \
     AND NOT EXISTS (SELECT 1 FROM kept k WHERE k.turn_id = c.turn_id AND k.step > c.step \
       AND k.delta_from IS NOT NULL)";

/// Drops the bases of turns that have no row left.
const DROP_ORPHAN_BASES: &str = "DELETE FROM checkpoint_bases b WHERE NOT EXISTS \
     (SELECT 1 FROM checkpoints c WHERE c.agent_id = b.agent_id AND c.turn_id = b.turn_id)";

/// Checkpoints in PostgreSQL.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    max_state_bytes: usize,
}

impl PgStore {
    /// Connects to `url` (`postgres://…`), then applies the migrations.
    pub async fn connect(url: &str, options: &StoreOptions) -> Result<PgStore, StoreError> {
        let connect: PgConnectOptions = url
            .parse()
            .map_err(|e| StoreError::Open(format!("DATABASE_URL: {e}")))?;
        let pool = options
            .pool()
            .options::<Postgres>()
            .connect_with(connect)
            .await
            .map_err(|e| StoreError::Open(format!("postgres: {e}")))?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| StoreError::Open(format!("postgres migrations: {e}")))?;
        Ok(PgStore {
            pool,
            max_state_bytes: options.max_state_bytes,
        })
    }

    /// The pool (benchmarks compare against a direct upsert on it).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    async fn upsert<'c, E>(executor: E, row: SaveRow) -> Result<Checkpoint, StoreError>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let stored = sqlx::query(UPSERT)
            .bind(&row.id)
            .bind(&row.agent_id)
            .bind(i64::from(row.step))
            .bind(row.state.as_str())
            .bind(row.fence.as_ref().map(|f| f.turn_id.as_str()))
            .bind(row.fence.as_ref().map(|f| f.attempt))
            .bind(row.now)
            .bind(row.delta_from)
            .fetch_one(executor)
            .await
            .map_err(classify)?;
        let created: DateTime<Utc> = stored.try_get("created_at").map_err(classify)?;
        let updated: DateTime<Utc> = stored.try_get("updated_at").map_err(classify)?;
        Ok(row.stored(format_ts(created), format_ts(updated)))
    }

    async fn save_row(&self, row: SaveRow) -> Result<Checkpoint, StoreError> {
        let Some(fence) = &row.fence else {
            return Self::upsert(&self.pool, row).await;
        };
        if row.base.is_some() {
            return self.save_with_base(row).await;
        }
        let (created, updated) = Self::fenced_upsert(&self.pool, &row, fence).await?;
        Ok(row.stored(format_ts(created), format_ts(updated)))
    }

    /// [`FENCED_UPSERT`]: the row's timestamps, or the refusal when a newer attempt has written.
    async fn fenced_upsert<'c, E>(
        executor: E,
        row: &SaveRow,
        fence: &Fence,
    ) -> Result<(DateTime<Utc>, DateTime<Utc>), StoreError>
    where
        E: Executor<'c, Database = Postgres>,
    {
        let stored = sqlx::query(FENCED_UPSERT)
            .bind(&row.id)
            .bind(&row.agent_id)
            .bind(i64::from(row.step))
            .bind(row.state.as_str())
            .bind(&fence.turn_id)
            .bind(fence.attempt)
            .bind(row.now)
            .bind(row.delta_from)
            .fetch_one(executor)
            .await
            .map_err(classify)?;
        let recorded: i64 = stored.try_get("max_attempt").map_err(classify)?;
        let created: Option<DateTime<Utc>> = stored.try_get("created_at").map_err(classify)?;
        let updated: Option<DateTime<Utc>> = stored.try_get("updated_at").map_err(classify)?;
        match (created, updated) {
            (Some(created), Some(updated)) if recorded <= fence.attempt => Ok((created, updated)),
            _ => Err(fenced(fence, recorded)),
        }
    }
}

impl PgStore {
    /// A fenced save that (re)starts its turn from a base: the fenced upsert, the base, and the
    /// removal of the turn's rows from any earlier start, in one transaction.
    async fn save_with_base(&self, row: SaveRow) -> Result<Checkpoint, StoreError> {
        let (Some(fence), Some(base)) = (row.fence.clone(), row.base.clone()) else {
            return Err(StoreError::Internal(
                "a base save without fence or base".into(),
            ));
        };
        let mut tx = self.pool.begin().await.map_err(classify)?;
        // Refused: the transaction rolls back when dropped.
        let (created, updated) = Self::fenced_upsert(&mut *tx, &row, &fence).await?;
        sqlx::query(
            "INSERT INTO checkpoint_bases (agent_id, turn_id, state, attempt, updated_at) \
             VALUES ($1, $2, $3::json, $4, $5) ON CONFLICT (agent_id, turn_id) DO UPDATE SET \
             state = EXCLUDED.state, attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at",
        )
        .bind(&row.agent_id)
        .bind(&fence.turn_id)
        .bind(base.as_str())
        .bind(fence.attempt)
        .bind(row.now)
        .execute(&mut *tx)
        .await
        .map_err(classify)?;
        sqlx::query("DELETE FROM checkpoints WHERE agent_id = $1 AND turn_id = $2 AND id <> $3")
            .bind(&row.agent_id)
            .bind(&fence.turn_id)
            .bind(&row.id)
            .execute(&mut *tx)
            .await
            .map_err(classify)?;
        tx.commit().await.map_err(classify)?;
        Ok(row.stored(format_ts(created), format_ts(updated)))
    }

    /// A row as the reads give it (delta rows rebuilt, see [`full`]).
    async fn full(&self, row: &PgRow) -> Result<Checkpoint, StoreError> {
        full(raw(row)?, |agent_id, turn_id, step| async move {
            let base: Option<String> = sqlx::query_scalar(
                "SELECT state::text FROM checkpoint_bases WHERE agent_id = $1 AND turn_id = $2",
            )
            .bind(&agent_id)
            .bind(&turn_id)
            .fetch_optional(&self.pool)
            .await
            .map_err(classify)?;
            let chain: Vec<String> = sqlx::query_scalar(
                "SELECT state::text FROM checkpoints WHERE agent_id = $1 AND turn_id = $2 \
                 AND step <= $3 ORDER BY step",
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

fn raw(row: &PgRow) -> Result<RawRow, StoreError> {
    let created: DateTime<Utc> = row.try_get("created_at").map_err(classify)?;
    let updated: DateTime<Utc> = row.try_get("updated_at").map_err(classify)?;
    Ok(RawRow {
        id: row.try_get("id").map_err(classify)?,
        agent_id: row.try_get("agent_id").map_err(classify)?,
        step: row.try_get("step").map_err(classify)?,
        state: row.try_get("state").map_err(classify)?,
        turn_id: row.try_get("turn_id").map_err(classify)?,
        attempt: row.try_get("attempt").map_err(classify)?,
        delta_from: row.try_get("delta_from").map_err(classify)?,
        created_at: format_ts(created),
        updated_at: format_ts(updated),
    })
}

impl CheckpointStore for PgStore {
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
            "WHERE agent_id = $1 ORDER BY write_seq DESC LIMIT 1"
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
        if let Some(attempt) = attempt {
            let fence = Fence {
                turn_id: turn_id.to_owned(),
                attempt: i64::from(attempt),
            };
            let recorded: i64 = sqlx::query_scalar(RAISE_ATTEMPT)
                .bind(turn_id)
                .bind(fence.attempt)
                .bind(now)
                .fetch_one(&self.pool)
                .await
                .map_err(classify)?;
            if recorded > fence.attempt {
                return Err(fenced(&fence, recorded));
            }
        }
        let row = sqlx::query(select!(
            "WHERE turn_id = $2 AND agent_id = $1 ORDER BY write_seq DESC LIMIT 1"
        ))
        .bind(agent_id)
        .bind(turn_id)
        .fetch_optional(&self.pool)
        .await
        .map_err(classify)?;
        match row {
            Some(row) => self.full(&row).await,
            None => Err(no_checkpoint(&format!(
                "agent_id {agent_id} turn {turn_id}"
            ))),
        }
    }

    async fn get(&self, id: &str) -> Result<Checkpoint, StoreError> {
        parse_id(id)?;
        let row = sqlx::query(select!("WHERE id = $1"))
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
            Some(id) => sqlx::query_scalar("SELECT write_seq FROM checkpoints WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(classify)?
                .ok_or_else(|| cursor_gone(id))?,
        };
        let rows = sqlx::query(select!(
            "WHERE agent_id = $1 AND write_seq < $2 ORDER BY write_seq DESC LIMIT $3"
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
                let mut tx = self.pool.begin().await.map_err(classify)?;
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
                let cut = cutoff(now, secs)?;
                let mut tx = self.pool.begin().await.map_err(classify)?;
                let done = sqlx::query(
                    "DELETE FROM checkpoints WHERE agent_id IN \
                     (SELECT agent_id FROM checkpoints GROUP BY agent_id \
                      HAVING MAX(updated_at) < $1)",
                )
                .bind(cut)
                .execute(&mut *tx)
                .await
                .map_err(classify)?;
                sqlx::query("DELETE FROM turn_attempts WHERE updated_at < $1")
                    .bind(cut)
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
        "postgres"
    }

    async fn close(&self) {
        self.pool.close().await;
    }

    async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}
