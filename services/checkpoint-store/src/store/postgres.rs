//! The PostgreSQL dialect of [`super::CheckpointStore`] (production), run by [`SqlStore`].
//!
//! `state` is `JSON` (bound as text and cast, so PostgreSQL validates it; stored and read back as
//! that very text — see migration 0002); timestamps are `TIMESTAMPTZ`.
//!
//! # Invariants
//! - `write_seq` comes from the sequence `checkpoints_write_seq` (migration 0003): the column
//!   default on insert, `nextval` again on overwrite, so the most recent write has the highest.
//! - A fenced save is **one statement** (`FENCED_SAVE`): the `turn_attempts` upsert, the
//!   check and the checkpoint upsert in data-modifying CTEs — atomic, and one round trip instead
//!   of four (BEGIN, raise, upsert, COMMIT) on the loop worker's per-step path. The
//!   `ON CONFLICT DO UPDATE` on `turn_attempts` row-locks the turn, so concurrent saves of one
//!   turn serialise: once attempt N has committed, attempt N-1 sees `max_attempt >= N` and writes
//!   no checkpoint.
//! - A step's fenced save (no base) goes through the group commit ([`super::group`]): the saves
//!   waiting together are that same statement over arrays, one commit for all, each answered on
//!   its own.
//! - A fenced read is two statements on purpose: the `turn_attempts` raise commits (waiting on the
//!   row lock of any save of the turn still running), and only then the read takes its snapshot,
//!   so it sees every row an older attempt managed to write — none can be written after it.
//!
//! # Pitfalls
//! - The pool reconnects by itself: after an outage the broken connections fail once (I/O error →
//!   `unavailable`) and are dropped; new ones are opened on demand, bounded by `acquire_timeout`.
//! - An `older_than_secs` retention racing a save of the same long-idle owner may delete that
//!   fresh row; retention is meant for owners idle far longer than any turn.

use super::sql::{Dialect, FencedSave, SaveBatcher, SqlStore};
use super::{StoreError, StoreOptions, format_ts};
use chrono::{DateTime, Utc};
use cyrene_sql::{WarmPool, WarmTx};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgQueryResult, PgRow};
use sqlx::query::Query;
use sqlx::{Database, Postgres, Row};
use std::sync::Arc;

/// The PostgreSQL migrations of this crate (`migrations/postgres`), applied at start.
pub static MIGRATOR: Migrator = cyrene_sql::migrations!(postgres);

/// Checkpoints in PostgreSQL.
pub type PgStore = SqlStore<Postgres>;

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

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";
    const LATEST: &'static str = select!("WHERE agent_id = $1 ORDER BY write_seq DESC LIMIT 1");
    /// The turn's few rows through `checkpoints_turn_step`, sorted (migration 0005).
    const LATEST_OF_TURN: &'static str =
        select!("WHERE turn_id = $2 AND agent_id = $1 ORDER BY write_seq DESC LIMIT 1");
    const BY_ID: &'static str = select!("WHERE id = $1");
    const WRITE_SEQ_OF: &'static str = "SELECT write_seq FROM checkpoints WHERE id = $1";
    const PAGE: &'static str =
        select!("WHERE agent_id = $1 AND write_seq < $2 ORDER BY write_seq DESC LIMIT $3");
    const BASE_STATE: &'static str =
        "SELECT state::text FROM checkpoint_bases WHERE agent_id = $1 AND turn_id = $2";
    const CHAIN: &'static str = "SELECT state::text FROM checkpoints WHERE agent_id = $1 \
         AND turn_id = $2 AND step <= $3 ORDER BY step";
    const TURN_STEP: &'static str =
        "SELECT MAX(step) FROM checkpoints WHERE agent_id = $1 AND turn_id = $2";
    const UPSERT: &'static str = "INSERT INTO checkpoints \
         (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) \
         VALUES ($1, $2, $3, $4::json, $5, $6, $7, $7, $8) \
         ON CONFLICT (id) DO UPDATE SET write_seq = nextval('checkpoints_write_seq'), \
         state = EXCLUDED.state, turn_id = EXCLUDED.turn_id, delta_from = EXCLUDED.delta_from, \
         attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at \
         RETURNING created_at, updated_at";
    const FIRST_READ: &'static str = concat!(
        "SELECT (SELECT max_attempt FROM turn_attempts WHERE turn_id = $2) AS recorded, c.* \
         FROM (SELECT 1) AS one LEFT JOIN (",
        select!("WHERE turn_id = $2 AND agent_id = $1 ORDER BY write_seq DESC LIMIT 1"),
        ") AS c ON true"
    );
    const RAISE_ATTEMPT: &'static str = "INSERT INTO turn_attempts (turn_id, max_attempt, updated_at) \
         VALUES ($1, $2, $3) \
         ON CONFLICT (turn_id) DO UPDATE SET \
         max_attempt = GREATEST(turn_attempts.max_attempt, EXCLUDED.max_attempt), \
         updated_at = EXCLUDED.updated_at \
         RETURNING max_attempt";
    /// Raise the turn's attempt record, then upsert the checkpoint only if this attempt is not
    /// older than the record; one row back: the recorded attempt and, when written, the
    /// timestamps.
    const FENCED_SAVE: FencedSave = FencedSave::OneStatement(
        "WITH fence AS ( \
           INSERT INTO turn_attempts (turn_id, max_attempt, updated_at) VALUES ($5, $6, $7) \
           ON CONFLICT (turn_id) DO UPDATE SET \
           max_attempt = GREATEST(turn_attempts.max_attempt, EXCLUDED.max_attempt), \
           updated_at = EXCLUDED.updated_at \
           RETURNING max_attempt), \
         saved AS ( \
           INSERT INTO checkpoints \
           (id, agent_id, step, state, turn_id, attempt, created_at, updated_at, delta_from) \
           SELECT $1, $2, $3, $4::json, $5, $6, $7, $7, $8 FROM fence \
           WHERE fence.max_attempt <= $6 \
           ON CONFLICT (id) DO UPDATE SET write_seq = nextval('checkpoints_write_seq'), \
           state = EXCLUDED.state, turn_id = EXCLUDED.turn_id, delta_from = EXCLUDED.delta_from, \
           attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at \
           RETURNING created_at, updated_at) \
         SELECT fence.max_attempt, saved.created_at, saved.updated_at \
         FROM fence LEFT JOIN saved ON true",
    );
    const UPSERT_BASE: &'static str = "WITH base AS ( \
           INSERT INTO checkpoint_bases (agent_id, turn_id, state, attempt, updated_at) \
           VALUES ($1, $2, $3::json, $4, $5) ON CONFLICT (agent_id, turn_id) DO UPDATE SET \
           state = EXCLUDED.state, attempt = EXCLUDED.attempt, updated_at = EXCLUDED.updated_at) \
         DELETE FROM checkpoints WHERE agent_id = $1 AND turn_id = $2 AND id <> $6";
    const DROP_EARLIER_START: Option<&'static str> = None;
    const KEEP_LAST: &'static str = "WITH kept AS (SELECT turn_id, step, write_seq, delta_from \
           FROM checkpoints WHERE agent_id = $1 ORDER BY write_seq DESC LIMIT $2) \
         DELETE FROM checkpoints c WHERE c.agent_id = $1 \
         AND c.write_seq NOT IN (SELECT write_seq FROM kept) \
         AND NOT EXISTS (SELECT 1 FROM kept k WHERE k.turn_id = c.turn_id AND k.step > c.step \
           AND k.delta_from IS NOT NULL)";
    const DROP_ORPHAN_BASES: &'static str = "DELETE FROM checkpoint_bases b WHERE NOT EXISTS \
         (SELECT 1 FROM checkpoints c WHERE c.agent_id = b.agent_id AND c.turn_id = b.turn_id)";
    const DROP_IDLE_OWNERS: &'static str = "DELETE FROM checkpoints WHERE agent_id IN \
         (SELECT agent_id FROM checkpoints GROUP BY agent_id HAVING MAX(updated_at) < $1)";
    const DROP_OLD_ATTEMPTS: &'static str = "DELETE FROM turn_attempts WHERE updated_at < $1";
    /// Two statements on purpose: see the module's invariants.
    const RAISE_COMMITS_FIRST: bool = true;

    async fn begin_write(pool: &WarmPool<Self>) -> Result<WarmTx<Self>, sqlx::Error> {
        pool.begin().await
    }

    fn bind_ts<'q>(
        query: Query<'q, Self, <Self as Database>::Arguments>,
        at: DateTime<Utc>,
    ) -> Query<'q, Self, <Self as Database>::Arguments> {
        query.bind(at)
    }

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }

    fn ts_text(row: &PgRow, column: &str) -> Result<Option<String>, sqlx::Error> {
        let at: Option<DateTime<Utc>> = row.try_get(column)?;
        Ok(at.map(format_ts))
    }
}

impl PgStore {
    /// The group commit's figures so far: batches of more than one step's save, and the saves
    /// they held.
    pub fn grouped_saves(&self) -> (u64, u64) {
        self.group.as_ref().map_or((0, 0), |g| g.grouped())
    }

    /// Connects to `url` (`postgres://…`), then applies the migrations.
    pub async fn connect(url: &str, options: &StoreOptions) -> Result<PgStore, StoreError> {
        let connect: PgConnectOptions = url.parse().map_err(StoreError::open("DATABASE_URL"))?;
        let pool = options
            .pool()
            .options::<Postgres>()
            .connect_with(connect)
            .await
            .map_err(StoreError::open("postgres"))?;
        MIGRATOR
            .run(&pool)
            .await
            .map_err(StoreError::open("postgres migrations"))?;
        let pool = WarmPool::new(pool);
        Ok(SqlStore {
            group: options.group_commit.then(|| -> Arc<dyn SaveBatcher> {
                super::group::SaveGroup::new(pool.clone(), options.max_connections)
            }),
            writer: pool.clone(),
            pool,
            max_state_bytes: options.max_state_bytes,
            wal: None,
        })
    }
}
