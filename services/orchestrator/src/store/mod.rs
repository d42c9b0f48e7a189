//! The orchestrator's SQL: sessions, the transcript (user messages and assistant answers, one
//! per-session seq each), the pending queue (user messages no turn has claimed) and turns.
//!
//! One code path serves PostgreSQL and SQLite through sqlx's `Any` driver with runtime queries;
//! only the session lock differs (`SELECT … FOR UPDATE` vs `BEGIN IMMEDIATE`).
//!
//! # Invariants
//! - **The fence (I1).** Every write that touches a session's messages or turns runs in one
//!   transaction that first locks the session row (PostgreSQL: row lock; SQLite: the database
//!   write lock). Decisions ("is a turn in flight?", "which messages are unclaimed?") are read
//!   under that lock, so any number of orchestrator replicas on one database agree. In
//!   single-leg mode a turn is only created when no turn of the session is `running`.
//! - **Exactly once (I2).** A user message is claimed by at most one turn:
//!   `claimed_by_turn` goes from NULL to a turn id exactly once, under the session lock, either
//!   by the job that starts a turn (`steered = 0`) or at a steer boundary (`steered = 1`). A
//!   steer returns the messages claimed *by this turn* at steer boundaries, so a retried or
//!   resumed steer gets the same messages back and no other turn ever sees them.
//! - A message is durable (committed) before its ack exists; the ack is stored with it, so an
//!   idempotent resend gets the very same ack.
//! - Steer claims only messages with a seq above everything the turn already holds (its
//!   `base_seq` and earlier claims): what a worker has seen is always a prefix, so an `after_seq`
//!   cursor never skips a claimed message.
//! - `attempt` of a turn starts at 1 (the first delivery) and only grows; steer and complete
//!   from an older attempt get `conflict`.
//! - **Double-texting.** A message sent under `enqueue` is stored `queued = 1`: steer claims
//!   never take it, so it stays pending until the job of the next turn claims it (I2 holds: it
//!   is claimed once, by that job). Under `reject` the decision is read under the session lock
//!   *before* anything is written: a refused send rolls back and leaves no row, no seq.
//! - **Context only.** A context-only message is stored `context = 1`, `queued = 1`, claimed by
//!   no turn, ever: it is never pending (no batch takes it, no steer claims it, it starts no
//!   turn), and the window of every later turn reads it beside the answered transcript, in seq
//!   order (docs/orchestrator.md, "Context-only messages").
//!
//! # Pitfalls
//! - SQLite must start write transactions with `BEGIN IMMEDIATE`: a deferred transaction that
//!   reads and then writes fails with `SQLITE_BUSY` (no busy wait) when another writer got in
//!   between.
//! - Any stores JSON as text and flags as 0/1 integers: `Any` cannot decode SQLite integers as
//!   booleans.
//! - Timestamps come from this process's clock (unix ms); replicas should run NTP, though only
//!   the sweeper's grace period depends on them.
//!
//! # Layout
//! This file holds the types, opening the database and the helpers every operation shares
//! (the write transaction, the session lock, seqs, running turns); one file per operation:
//! [`send`](Store::send) in `send.rs`, [`steer`](Store::steer) and the fence and claims in
//! `steer.rs`, [`complete`](Store::complete) in `complete.rs`, starting a turn in `start.rs`
//! (the job itself is decided by [`crate::job`], without SQL), the transcript in `history.rs`
//! and the dispatch bookkeeping in `dispatch.rs`.

mod approvals;
mod complete;
mod dispatch;
mod history;
mod send;
mod start;
mod steer;

pub use crate::job::JobSettings;
use crate::job::{JobError, Pending};
pub use approvals::{ApprovalRow, Awaited, CallRef, Decided, NewDecision};
use cyrene_protocol::message::Message;
use cyrene_protocol::session::{BusyPolicy, SendAck, SessionEnv};
use cyrene_protocol::turn::SteeredMessage;
use cyrene_sql::{WarmPool, WarmTx};
use sqlx::{Any, Row};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Which SQL backend a [`Store`] talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }
}

/// The migrations table of this service (kept apart from other services sharing the database).
pub const MIGRATIONS_TABLE: &str = "orch_migrations";

/// Largest number of pending messages one new turn claims at once.
pub const MAX_BATCH: i64 = 256;

/// Why a store operation failed: the one error of both SQL services ([`cyrene_sql::StoreError`]).
pub use cyrene_sql::StoreError;

/// A job that cannot be built means a corrupt row or no persona: never the caller's fault.
impl From<JobError> for StoreError {
    fn from(err: JobError) -> Self {
        StoreError::Internal(err.to_string())
    }
}

/// Pool settings.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    pub acquire_timeout: Duration,
    pub max_connections: u32,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            acquire_timeout: Duration::from_secs(2),
            max_connections: 8,
        }
    }
}

/// A user message to store (already validated).
#[derive(Debug, Clone)]
pub struct NewMessage {
    pub session_id: String,
    pub message: Message,
    pub client_id: String,
    pub idempotency_key: Option<String>,
    /// The env recorded if this message creates the session (resolved persona).
    pub env: SessionEnv,
    /// What the message does when a turn of its session is in flight (double-texting).
    pub policy: BusyPolicy,
    /// Answered by a turn of its own: never steered into another turn, never batched (asks).
    pub solo: bool,
    /// Where the completing replica reports the answer (asks): a core NATS subject.
    pub reply_to: Option<String>,
    /// An ask's chain including the asked persona (empty for a person's message): the job of
    /// the turn answering it carries it as `ask_chain`.
    pub ask_chain: Vec<String>,
    /// The configured persona this message addresses (checked by the caller); `None` = the one
    /// the session last used (docs/orchestrator.md, "Several personas").
    pub persona: Option<String>,
    /// Context only (the bridge's): stored in the transcript, no turn, never steered.
    pub context_only: bool,
}

/// A turn that was created and must now be dispatched (and announced).
#[derive(Debug, Clone, PartialEq)]
pub struct NewTurn {
    pub turn_id: String,
    pub session_id: String,
    pub leg_id: String,
    pub message_ids: Vec<String>,
    /// The exact `TurnJob` JSON to publish.
    pub job: String,
    /// How many times the turn was continued after its approvals (0: its first job).
    pub resumes: i64,
}

impl NewTurn {
    /// The job's `Nats-Msg-Id` ([`job_msg_id`]).
    pub fn msg_id(&self) -> String {
        job_msg_id(&self.turn_id, self.resumes)
    }
}

/// The `Nats-Msg-Id` of a turn's job: the turn id for its first job, `<turn_id>.<n>` for the
/// job that continues it after its `n`th round of approvals. Each is published (and
/// republished by the sweeper) under its own id, so JetStream's duplicate window drops a
/// repeat of one job but never the job that continues the turn.
pub fn job_msg_id(turn_id: &str, resumes: i64) -> String {
    match resumes {
        0 => turn_id.to_owned(),
        n => format!("{turn_id}.{n}"),
    }
}

/// What `send` did.
#[derive(Debug, Clone)]
pub struct Sent {
    pub ack: SendAck,
    /// True when this was a resend of an already stored idempotency key (nothing changed).
    pub duplicate: bool,
    /// A turn created by this send (for this message, or for older pending ones).
    pub started: Option<NewTurn>,
    /// This message, claimed for the running turn that takes it in: push it to that turn.
    pub pushed: Option<Pushed>,
}

/// Messages claimed (durably, in the transaction that returned this) for a running turn, to be
/// pushed to the worker running it on `cyrene.turn.input.<turn_id>`. A push that never arrives
/// costs nothing: the turn's completion hands every claimed message it did not take in back.
#[derive(Debug, Clone, PartialEq)]
pub struct Pushed {
    pub turn_id: String,
    pub messages: Vec<SteeredMessage>,
}

/// What `complete` did.
#[derive(Debug, Clone)]
pub struct Completed {
    /// False when the turn had already been completed: nothing changed.
    pub first: bool,
    pub session_id: String,
    pub leg_id: String,
    /// Core NATS subjects of the asks this turn answered.
    pub reply_to: Vec<String>,
    /// The turn started from pending messages, if any.
    pub next: Option<NewTurn>,
    /// Pending messages claimed for the one leg still running, to push to it.
    pub pushed: Option<Pushed>,
    /// The session's persona (empty: the default one).
    pub persona: String,
    /// From the oldest message the turn answered being stored (acknowledged) to the commit.
    pub waited_ms: Option<i64>,
    /// The memory extraction this completion asks for (docs/memory.md, "Memory she gathers
    /// herself"): a final answer in a session that is not restricted, to no ask. Set on a
    /// repeated completion too, so that its publish is retried; whether the persona extracts
    /// at all is the engine's decision.
    pub memory_job: Option<cyrene_protocol::memory::MemoryExtractJob>,
}

/// A turn that has not been confirmed as published (a row of `orch_turns`).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Undispatched {
    pub turn_id: String,
    pub job: String,
    pub resumes: i64,
}

/// Progress of a live leg, for the parallel notice: `(step, tool names)`.
pub type ProgressOf<'a> = &'a (dyn Fn(&str) -> (u32, Vec<String>) + Send + Sync);

/// The orchestrator's database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: WarmPool<Any>,
    backend: Backend,
    settings: std::sync::Arc<JobSettings>,
    /// Dispatch marks waiting to be written together (`dispatch.rs`).
    marks: std::sync::Arc<dispatch::Marks>,
    /// SQLite (a file): the task that checkpoints the WAL off the commits' path
    /// ([`cyrene_sql::WalTask`]), stopped when the last clone is dropped or at [`Store::close`].
    wal: Option<std::sync::Arc<cyrene_sql::WalTask>>,
}

/// A running turn of a session (a row of `orch_turns`).
#[derive(sqlx::FromRow)]
struct RunningTurn {
    turn_id: String,
    client_id: String,
    first_message_id: String,
    base_seq: i64,
    /// The persona it runs as (empty for turns written before personas were recorded).
    persona: String,
}

impl RunningTurn {
    /// The running turn a new steerable message from `client_id` goes to, as a boundary would
    /// claim it: the only turn of the session, or — beside other legs — its client's own leg.
    fn taker<'r>(running: &'r [RunningTurn], client_id: &str) -> Option<&'r RunningTurn> {
        match running {
            [only] => Some(only),
            _ => running.iter().find(|t| t.client_id == client_id),
        }
    }
}

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn to_i64(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::BadRequest(format!("{v} is out of range")))
}

fn decode_env(text: &str) -> Result<SessionEnv, StoreError> {
    serde_json::from_str(text)
        .map_err(|e| StoreError::Internal(format!("corrupt session env: {e}")))
}

fn decode_message(text: &str) -> Result<Message, StoreError> {
    Ok(crate::job::decode_message(text)?)
}

fn encode<T: serde::Serialize>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Internal(format!("encode: {e}")))
}

impl Store {
    /// Connects to `url` (`postgres://…` or `sqlite://…`), creating an SQLite file and its
    /// directory when missing, and applies the migrations.
    pub async fn open(
        url: &str,
        options: &StoreOptions,
        settings: JobSettings,
    ) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else {
            // The scheme alone: the rest of a URL may hold a password.
            let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
            return Err(StoreError::open("DATABASE_URL")(format!(
                "unsupported database URL scheme {scheme:?}"
            )));
        };
        let url = match backend {
            Backend::Postgres => url.to_owned(),
            Backend::Sqlite => sqlite_url(url)?,
        };
        let pool = cyrene_sql::PoolSettings {
            max_connections: options.max_connections,
            acquire_timeout: options.acquire_timeout,
        }
        .options::<sqlx::Any>();
        // WAL lets readers (history, the sweeper) run while one writer holds the lock.
        let pool = if backend == Backend::Sqlite {
            let pragmas = cyrene_sql::SqliteSettings::SESSIONS.pragmas();
            pool.after_connect(move |conn, _| {
                let pragmas = pragmas.clone();
                Box::pin(async move {
                    for pragma in &pragmas {
                        // Built from constants by cyrene_sql, never from input.
                        sqlx::query(sqlx::AssertSqlSafe(pragma.clone()))
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
        } else {
            pool
        };
        let pool = pool
            .connect(&url)
            .await
            .map_err(StoreError::open(backend.name()))?;
        let mut migrator = cyrene_sql::migrations!().of(backend.name());
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator
            .run(&pool)
            .await
            .map_err(StoreError::open(format!("{} migrations", backend.name())))?;
        // An in-memory database has no WAL.
        let wal = match backend {
            Backend::Sqlite if !url.contains(":memory:") => {
                let options = cyrene_sql::SqliteSettings::SESSIONS.connect_options(&url)?;
                let task = cyrene_sql::WalTask::start(options, cyrene_sql::WAL_CHECKPOINT_EVERY)
                    .await
                    .map_err(StoreError::open("sqlite"))?;
                Some(std::sync::Arc::new(task))
            }
            _ => None,
        };
        Ok(Store {
            pool: WarmPool::new(pool),
            backend,
            settings: std::sync::Arc::new(settings),
            marks: Default::default(),
            wal,
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn settings(&self) -> &JobSettings {
        &self.settings
    }

    /// The connection pool, for the SQL default of other interfaces ([`crate::memory`]).
    pub fn pool(&self) -> &WarmPool<Any> {
        &self.pool
    }

    /// Closes the pool, and stops the WAL task.
    pub async fn close(&self) {
        if let Some(wal) = &self.wal {
            wal.close().await;
        }
        self.pool.close().await;
    }

    /// A write transaction (SQLite: `BEGIN IMMEDIATE`, so the write lock is taken up front).
    async fn begin(&self) -> Result<WarmTx<Any>, StoreError> {
        Ok(match self.backend {
            Backend::Postgres => self.pool.begin().await?,
            Backend::Sqlite => {
                self.pool
                    .begin_with(Some(sqlx::SqlStr::from_static("BEGIN IMMEDIATE")))
                    .await?
            }
        })
    }

    /// What a send starts with, in one statement: creates the session with `env_json` unless it
    /// exists, locks its row (PostgreSQL: the upsert's row lock; SQLite: the write lock the
    /// transaction already holds) and takes its next seq. Returns the session's env and that
    /// seq; a send that then stores nothing rolls back, and the seq with it.
    async fn open_session(
        tx: &mut WarmTx<Any>,
        session_id: &str,
        env_json: &str,
        now: i64,
    ) -> Result<(SessionEnv, i64), StoreError> {
        let row = sqlx::query(
            "INSERT INTO orch_sessions (id, env, last_seq, created_at) VALUES ($1, $2, 1, $3) \
             ON CONFLICT (id) DO UPDATE SET last_seq = orch_sessions.last_seq + 1 \
             RETURNING env, last_seq",
        )
        .bind(session_id)
        .bind(env_json)
        .bind(now)
        .fetch_one(&mut **tx)
        .await?;
        Ok((decode_env(&row.try_get::<String, _>(0)?)?, row.try_get(1)?))
    }

    /// Locks the session row and, with `take_seq`, takes its next seq in the same statement;
    /// `not_found` when the session does not exist.
    async fn lock_session(
        &self,
        tx: &mut WarmTx<Any>,
        session_id: &str,
        take_seq: bool,
    ) -> Result<(SessionEnv, Option<i64>), StoreError> {
        let sql = match (take_seq, self.backend) {
            (true, _) => {
                "UPDATE orch_sessions SET last_seq = last_seq + 1 WHERE id = $1 \
                 RETURNING env, last_seq"
            }
            (false, Backend::Postgres) => "SELECT env FROM orch_sessions WHERE id = $1 FOR UPDATE",
            (false, Backend::Sqlite) => "SELECT env FROM orch_sessions WHERE id = $1",
        };
        let row = sqlx::query(sql)
            .bind(session_id)
            .fetch_optional(&mut **tx)
            .await?;
        let Some(row) = row else {
            return Err(StoreError::NotFound(format!("no session {session_id:?}")));
        };
        let env = decode_env(&row.try_get::<String, _>(0)?)?;
        let seq = match take_seq {
            true => Some(row.try_get(1)?),
            false => None,
        };
        Ok((env, seq))
    }

    async fn running_turns(
        tx: &mut WarmTx<Any>,
        session_id: &str,
    ) -> Result<Vec<RunningTurn>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT turn_id, client_id, first_message_id, base_seq, persona FROM orch_turns \
             WHERE session_id = $1 AND status = 'running' ORDER BY created_at, turn_id",
        )
        .bind(session_id)
        .fetch_all(&mut **tx)
        .await?)
    }

    async fn count_pending(tx: &mut WarmTx<Any>, session_id: &str) -> Result<i64, StoreError> {
        let row = sqlx::query(
            "SELECT COUNT(*) FROM orch_messages \
             WHERE session_id = $1 AND claimed_by_turn IS NULL AND context = 0",
        )
        .bind(session_id)
        .fetch_one(&mut **tx)
        .await?;
        Ok(row.try_get(0)?)
    }
}

/// Makes sure the SQLite file (and its directory) can be created: adds `mode=rwc`.
fn sqlite_url(url: &str) -> Result<String, StoreError> {
    let path = url
        .trim_start_matches("sqlite://")
        .trim_start_matches("sqlite:");
    let file = path.split('?').next().unwrap_or_default();
    if !file.is_empty()
        && file != ":memory:"
        && let Some(parent) = std::path::Path::new(file).parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).map_err(StoreError::open(format!(
            "cannot create {}",
            parent.display()
        )))?;
    }
    if url.contains("mode=") {
        Ok(url.to_owned())
    } else if url.contains('?') {
        Ok(format!("{url}&mode=rwc"))
    } else {
        Ok(format!("{url}?mode=rwc"))
    }
}

/// What the store's unit tests (and the memory's) open their stores with.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod testing {
    use super::{JobSettings, Store, StoreOptions};

    /// A store on `url` (migrated) with `personas` and a 40-message window, 8 steps and
    /// 768 KiB jobs.
    pub(crate) async fn store_on(url: &str, personas: crate::Personas) -> Store {
        let settings = JobSettings {
            personas,
            window: 40,
            max_steps: 8,
            max_job_bytes: 768 * 1024,
        };
        Store::open(url, &StoreOptions::default(), settings)
            .await
            .unwrap()
    }

    /// A test per backend of each `async fn(&Store)` named: `sqlite::<name>` on a fresh file,
    /// `postgres::<name>` on a fresh database named after `$db`; `$open` is the test module's
    /// `async fn(&str) -> Store`, and the store is closed after the test.
    macro_rules! on_both_backends {
        ($open:ident, $db:literal; $($name:ident),* $(,)?) => {
            mod sqlite {
                $(
                    #[tokio::test]
                    async fn $name() {
                        let dir = tempfile::tempdir().unwrap();
                        let url = format!("sqlite://{}/orch.db", dir.path().display());
                        let store = super::$open(&url).await;
                        super::$name(&store).await;
                        store.close().await;
                    }
                )*
            }
            mod postgres {
                $(
                    #[tokio::test]
                    async fn $name() {
                        let db = cyrene_sql::testing::TestDatabase::create($db).await;
                        let store = super::$open(&db.url).await;
                        super::$name(&store).await;
                        store.close().await;
                    }
                )*
            }
        };
    }
    pub(crate) use on_both_backends;
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::ErrorCode;
    use cyrene_protocol::ids::new_id;

    #[test]
    fn sqlite_urls_get_create_mode() {
        let dir = std::env::temp_dir().join(format!("orch-url-{}", new_id()));
        let url = format!("sqlite://{}/x.db", dir.display());
        assert_eq!(sqlite_url(&url).unwrap(), format!("{url}?mode=rwc"));
        assert!(dir.is_dir());
        assert_eq!(
            sqlite_url("sqlite::memory:?cache=shared").unwrap(),
            "sqlite::memory:?cache=shared&mode=rwc"
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A file's connections leave the WAL to the store's own task (SQLite's inline threshold is
    /// raised on each of them), whose checkpoint copies every committed page into the file;
    /// closing the store stops it. In memory there is no WAL and no task.
    #[tokio::test]
    async fn an_sqlite_file_has_its_wal_checkpointed_by_a_task() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/orch.db", dir.path().display());
        let store = testing::store_on(&url, crate::Personas::default()).await;
        let threshold: i64 = sqlx::query_scalar("PRAGMA wal_autocheckpoint")
            .fetch_one(store.pool())
            .await
            .unwrap();
        assert_eq!(threshold, i64::from(cyrene_sql::WAL_AUTOCHECKPOINT_PAGES));
        let wal = store.wal.clone().unwrap();
        let (busy, frames, copied): (i64, i64, i64) =
            sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
                .fetch_one(wal.pool())
                .await
                .unwrap();
        assert_eq!(
            (busy, frames),
            (0, copied),
            "the task's connection is the file's"
        );
        assert!(frames > 0, "the migrations' pages were in the WAL");
        store.close().await;
        assert!(wal.is_stopped() && wal.pool().is_closed());

        let memory = testing::store_on("sqlite::memory:", crate::Personas::default()).await;
        assert!(memory.wal.is_none());
        memory.close().await;
    }

    /// A turn's job and a message are compressed with lz4 where the server was built with it
    /// (migration 202612050401).
    #[tokio::test]
    async fn postgres_compresses_large_documents_with_lz4_where_the_server_has_it() {
        let db = cyrene_sql::testing::TestDatabase::create("orch_lz4").await;
        let store = testing::store_on(&db.url, crate::Personas::default()).await;
        let columns = [("orch_turns", "job"), ("orch_messages", "message")];
        let (has_lz4, methods) = db.column_compression(&columns).await;
        let want = if has_lz4 { "l" } else { "" };
        assert_eq!(methods, [want, want]);
        store.close().await;
    }

    #[test]
    fn database_outages_map_to_unavailable() {
        assert!(cyrene_sql::is_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(!cyrene_sql::is_unavailable(&sqlx::Error::RowNotFound));
        assert_eq!(
            StoreError::from(sqlx::Error::PoolClosed).code(),
            ErrorCode::Unavailable
        );
    }
}
