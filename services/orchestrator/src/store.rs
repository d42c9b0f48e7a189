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
//! - `attempt` of a turn only grows; steer and complete from an older attempt get `conflict`.
//! - **Double-texting.** A message sent under `enqueue` is stored `queued = 1`: steer claims
//!   never take it, so it stays pending until the job of the next turn claims it (I2 holds: it
//!   is claimed once, by that job). Under `reject` the decision is read under the session lock
//!   *before* anything is written: a refused send rolls back and leaves no row, no seq.
//!
//! # Pitfalls
//! - SQLite must start write transactions with `BEGIN IMMEDIATE`: a deferred transaction that
//!   reads and then writes fails with `SQLITE_BUSY` (no busy wait) when another writer got in
//!   between.
//! - Any stores JSON as text and flags as 0/1 integers: `Any` cannot decode SQLite integers as
//!   booleans.
//! - Timestamps come from this process's clock (unix ms); replicas should run NTP, though only
//!   the sweeper's grace period depends on them.

use crate::personas::Personas;
use cyrene_protocol::ids::new_id;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{BusyPolicy, Disposition, HistoryEntry, SendAck, SessionEnv};
use cyrene_protocol::turn::{ParallelNotice, SteerRequest, SteeredMessage, TurnComplete, TurnJob};
use cyrene_protocol::{ErrorBody, ErrorCode};
use sqlx::any::AnyRow;
use sqlx::{Any, AnyPool, Row, Transaction};
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

/// Why a store operation failed; each variant maps onto one wire [`ErrorCode`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    /// Fenced off (an older attempt) or too late (the turn already completed).
    #[error("{0}")]
    Conflict(String),
    /// The database cannot be reached or is busy; retrying later may succeed.
    #[error("database unavailable: {0}")]
    Unavailable(String),
    /// Opening the database or applying the migrations failed.
    #[error("could not open the database: {0}")]
    Open(String),
    /// Any other failure (a bug or a corrupt row).
    #[error("database error: {0}")]
    Internal(String),
}

impl StoreError {
    pub fn code(&self) -> ErrorCode {
        match self {
            StoreError::BadRequest(_) => ErrorCode::BadRequest,
            StoreError::NotFound(_) => ErrorCode::NotFound,
            StoreError::Conflict(_) => ErrorCode::Conflict,
            StoreError::Unavailable(_) | StoreError::Open(_) => ErrorCode::Unavailable,
            StoreError::Internal(_) => ErrorCode::Internal,
        }
    }

    pub fn to_body(&self) -> ErrorBody {
        ErrorBody::new(self.code(), self.to_string())
    }
}

impl cyrene_bus::service::WireError for StoreError {
    fn to_body(&self) -> ErrorBody {
        StoreError::to_body(self)
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        if cyrene_sql::is_unavailable(&err) {
            StoreError::Unavailable(err.to_string())
        } else {
            StoreError::Internal(err.to_string())
        }
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

/// What a turn job is built from besides the session's transcript.
#[derive(Debug, Clone)]
pub struct JobSettings {
    pub personas: Personas,
    /// Persisted transcript messages (newest) seeded into each job.
    pub window: usize,
    pub max_steps: u32,
    /// Byte budget of the seeded messages.
    pub max_job_bytes: usize,
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
}

/// A turn that has not been confirmed as published.
#[derive(Debug, Clone)]
pub struct Undispatched {
    pub turn_id: String,
    pub job: String,
}

/// Progress of a live leg, for the parallel notice: `(step, tool names)`.
pub type ProgressOf<'a> = &'a (dyn Fn(&str) -> (u32, Vec<String>) + Send + Sync);

/// The orchestrator's database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    settings: std::sync::Arc<JobSettings>,
}

struct RunningTurn {
    turn_id: String,
    client_id: String,
    first_message_id: String,
    base_seq: i64,
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

struct PendingRow {
    id: String,
    seq: i64,
    message: String,
    solo: bool,
    client_id: String,
    /// JSON list: the ask chain of an ask's message.
    ask_chain: Option<String>,
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

fn decode_message(text: &str) -> Result<Message, StoreError> {
    serde_json::from_str(text)
        .map_err(|e| StoreError::Internal(format!("corrupt message row: {e}")))
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
            return Err(StoreError::Open(format!(
                "unsupported database URL {url:?}"
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
            .map_err(|e| StoreError::Open(e.to_string()))?;
        let mut migrator = cyrene_sql::migrations!().of(backend.name());
        migrator.dangerous_set_table_name(MIGRATIONS_TABLE);
        migrator
            .run(&pool)
            .await
            .map_err(|e| StoreError::Open(format!("{} migrations: {e}", backend.name())))?;
        Ok(Store {
            pool,
            backend,
            settings: std::sync::Arc::new(settings),
        })
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn settings(&self) -> &JobSettings {
        &self.settings
    }

    /// The connection pool, for the SQL default of other interfaces ([`crate::memory`]).
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Closes the pool.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// A write transaction (SQLite: `BEGIN IMMEDIATE`, so the write lock is taken up front).
    async fn begin(&self) -> Result<Transaction<'static, Any>, StoreError> {
        Ok(match self.backend {
            Backend::Postgres => self.pool.begin().await?,
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
        })
    }

    /// Locks the session row; `None` when the session does not exist.
    async fn lock_session(
        &self,
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
    ) -> Result<Option<SessionEnv>, StoreError> {
        let sql = match self.backend {
            Backend::Postgres => "SELECT env FROM orch_sessions WHERE id = $1 FOR UPDATE",
            Backend::Sqlite => "SELECT env FROM orch_sessions WHERE id = $1",
        };
        let row = sqlx::query(sql)
            .bind(session_id)
            .fetch_optional(&mut **tx)
            .await?;
        match row {
            None => Ok(None),
            Some(row) => {
                let env: String = row.try_get(0)?;
                serde_json::from_str(&env)
                    .map(Some)
                    .map_err(|e| StoreError::Internal(format!("corrupt session env: {e}")))
            }
        }
    }

    async fn next_seq(
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
    ) -> Result<i64, StoreError> {
        let row = sqlx::query(
            "UPDATE orch_sessions SET last_seq = last_seq + 1 WHERE id = $1 RETURNING last_seq",
        )
        .bind(session_id)
        .fetch_one(&mut **tx)
        .await?;
        Ok(row.try_get(0)?)
    }

    async fn running_turns(
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
    ) -> Result<Vec<RunningTurn>, StoreError> {
        let rows = sqlx::query(
            "SELECT turn_id, client_id, first_message_id, base_seq FROM orch_turns \
             WHERE session_id = $1 AND status = 'running' ORDER BY created_at, turn_id",
        )
        .bind(session_id)
        .fetch_all(&mut **tx)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(RunningTurn {
                    turn_id: r.try_get(0)?,
                    client_id: r.try_get(1)?,
                    first_message_id: r.try_get(2)?,
                    base_seq: r.try_get(3)?,
                })
            })
            .collect()
    }

    async fn count_pending(
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
    ) -> Result<i64, StoreError> {
        let row = sqlx::query(
            "SELECT COUNT(*) FROM orch_messages \
             WHERE session_id = $1 AND claimed_by_turn IS NULL",
        )
        .bind(session_id)
        .fetch_one(&mut **tx)
        .await?;
        Ok(row.try_get(0)?)
    }

    /// The next batch of pending messages to start a turn with: the oldest pending message alone
    /// when it is solo, else every pending non-solo message (oldest first, bounded).
    async fn pending_batch(
        &self,
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
    ) -> Result<Vec<PendingRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, seq, message, solo, client_id, ask_chain FROM orch_messages \
             WHERE session_id = $1 AND claimed_by_turn IS NULL ORDER BY seq LIMIT $2",
        )
        .bind(session_id)
        .bind(MAX_BATCH)
        .fetch_all(&mut **tx)
        .await?;
        let mut batch = Vec::new();
        let mut bytes = 0usize;
        for r in &rows {
            let row = PendingRow {
                id: r.try_get(0)?,
                seq: r.try_get(1)?,
                message: r.try_get(2)?,
                solo: r.try_get::<i64, _>(3)? != 0,
                client_id: r.try_get(4)?,
                ask_chain: r.try_get(5)?,
            };
            if batch.is_empty() && row.solo {
                batch.push(row);
                break;
            }
            if row.solo {
                continue;
            }
            // Keep the job under its byte budget; what is left waits for the next turn.
            if !batch.is_empty() && bytes + row.message.len() > self.settings.max_job_bytes / 2 {
                break;
            }
            bytes += row.message.len();
            batch.push(row);
        }
        Ok(batch)
    }

    /// Claims `batch` for a new turn, seeds its window and records it (not yet dispatched).
    async fn start_turn(
        &self,
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
        env: &SessionEnv,
        batch: Vec<PendingRow>,
        leg_id: String,
        notice: Option<ParallelNotice>,
    ) -> Result<NewTurn, StoreError> {
        let turn_id = new_id();
        let now = now_ms();
        for m in &batch {
            let claimed = sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 0 \
                 WHERE id = $2 AND claimed_by_turn IS NULL",
            )
            .bind(&turn_id)
            .bind(&m.id)
            .execute(&mut **tx)
            .await?;
            if claimed.rows_affected() != 1 {
                // Impossible under the session lock; refuse rather than double-claim.
                return Err(StoreError::Internal(format!(
                    "message {} was claimed concurrently",
                    m.id
                )));
            }
        }

        // The window: the newest answered transcript (user messages of completed turns and the
        // answers), oldest first, then the messages this turn answers.
        let batch_bytes: usize = batch.iter().map(|m| m.message.len()).sum();
        let mut budget = self.settings.max_job_bytes.saturating_sub(batch_bytes);
        let window = i64::try_from(self.settings.window).unwrap_or(i64::MAX);
        let rows = sqlx::query(
            "SELECT m.seq, m.message FROM orch_messages m \
             JOIN orch_turns t ON t.turn_id = m.claimed_by_turn \
             WHERE m.session_id = $1 AND t.status = 'completed' \
             ORDER BY m.seq DESC LIMIT $2",
        )
        .bind(session_id)
        .bind(window)
        .fetch_all(&mut **tx)
        .await?;
        let mut history = Vec::new();
        for r in &rows {
            let seq: i64 = r.try_get(0)?;
            let text: String = r.try_get(1)?;
            if text.len() > budget {
                break;
            }
            budget -= text.len();
            history.push((seq, decode_message(&text)?));
        }
        history.reverse();
        let mut base_seq = history.iter().map(|(s, _)| *s).max().unwrap_or(0);
        let mut messages: Vec<Message> = history.into_iter().map(|(_, m)| m).collect();
        // An ask is answered by a turn of its own (solo): its chain is the turn's.
        let ask_chain: Vec<String> = match batch.as_slice() {
            [only] => match &only.ask_chain {
                Some(text) => serde_json::from_str(text)
                    .map_err(|e| StoreError::Internal(format!("corrupt ask chain: {e}")))?,
                None => Vec::new(),
            },
            _ => Vec::new(),
        };
        let mut message_ids = Vec::with_capacity(batch.len());
        for m in &batch {
            base_seq = base_seq.max(m.seq);
            messages.push(decode_message(&m.message)?);
            message_ids.push(m.id.clone());
        }

        let persona = self
            .settings
            .personas
            .resolve(&env.persona)
            .or_else(|| self.settings.personas.resolve(""))
            .ok_or_else(|| StoreError::Internal("no default persona".into()))?;
        let job = TurnJob {
            turn_id: turn_id.clone(),
            session_id: session_id.to_owned(),
            leg_id: leg_id.clone(),
            env: SessionEnv {
                restricted: env.restricted,
                persona: persona.id.clone(),
            },
            instructions: persona.instructions.clone(),
            persona_names: self.settings.personas.names(),
            messages,
            message_ids: message_ids.clone(),
            base_seq: to_u64(base_seq),
            notice,
            max_steps: self.settings.max_steps,
            // The persona's limits (`CYRENE_PERSONAS`): its turn timeout from now, its tools.
            deadline_unix_ms: persona
                .turn_timeout_ms
                .map(|ms| to_u64(now).saturating_add(ms)),
            tools: persona.tools.clone(),
            ask_chain,
        };
        let job_json = encode(&job)?;
        let client_id = batch
            .first()
            .map(|m| m.client_id.clone())
            .unwrap_or_default();
        let first_message_id = message_ids.first().cloned().unwrap_or_default();
        sqlx::query(
            "INSERT INTO orch_turns (turn_id, session_id, leg_id, client_id, status, attempt, \
             base_seq, first_message_id, job, dispatched, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, 'running', 0, $5, $6, $7, 0, $8, $8)",
        )
        .bind(&turn_id)
        .bind(session_id)
        .bind(&leg_id)
        .bind(&client_id)
        .bind(base_seq)
        .bind(&first_message_id)
        .bind(&job_json)
        .bind(now)
        .execute(&mut **tx)
        .await?;
        Ok(NewTurn {
            turn_id,
            session_id: session_id.to_owned(),
            leg_id,
            message_ids,
            job: job_json,
        })
    }

    /// Stores a user message durably with a server id and the next seq, and decides its
    /// disposition (one transaction). Idempotent by `idempotency_key`.
    pub async fn send(
        &self,
        input: NewMessage,
        progress: ProgressOf<'_>,
    ) -> Result<Sent, StoreError> {
        let message_json = encode(&input.message)?;
        let env_json = encode(&input.env)?;
        let now = now_ms();
        let mut tx = self.begin().await?;
        sqlx::query(
            "INSERT INTO orch_sessions (id, env, last_seq, created_at) VALUES ($1, $2, 0, $3) \
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(&input.session_id)
        .bind(&env_json)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        let env = self
            .lock_session(&mut tx, &input.session_id)
            .await?
            .ok_or_else(|| StoreError::Internal("session vanished".into()))?;

        if let Some(key) = &input.idempotency_key {
            let row = sqlx::query(
                "SELECT ack FROM orch_messages WHERE session_id = $1 AND idempotency_key = $2",
            )
            .bind(&input.session_id)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(row) = row {
                let ack: Option<String> = row.try_get(0)?;
                let ack = ack.ok_or_else(|| StoreError::Internal("message without ack".into()))?;
                let ack: SendAck = serde_json::from_str(&ack)
                    .map_err(|e| StoreError::Internal(format!("corrupt ack: {e}")))?;
                tx.rollback().await?;
                return Ok(Sent {
                    ack,
                    duplicate: true,
                    started: None,
                    pushed: None,
                });
            }
        }

        let running = Self::running_turns(&mut tx, &input.session_id).await?;
        if input.policy == BusyPolicy::Reject && !input.solo && !running.is_empty() {
            // Reject policy: refused while a turn runs, nothing stored (not even the key, so
            // a resend once the session is idle is a new message).
            tx.rollback().await?;
            return Err(StoreError::Conflict(format!(
                "session {} is busy: a turn is running and its policy is reject; \
                 send again after its turn_ended event",
                input.session_id
            )));
        }
        let ask_chain = if input.ask_chain.is_empty() {
            None
        } else {
            Some(encode(&input.ask_chain)?)
        };
        let seq = Self::next_seq(&mut tx, &input.session_id).await?;
        let message_id = new_id();
        // A steerable message arriving while a turn runs is claimed for that turn right here,
        // in the transaction that stores it, and pushed to it after the commit: the turn takes
        // it in at its next boundary without asking (docs/orchestrator.md, "Steering").
        let steerable = !input.solo && input.policy != BusyPolicy::Enqueue;
        let parallel_leg = input.policy == BusyPolicy::Parallel
            && !input.solo
            && running.iter().all(|t| t.client_id != input.client_id);
        let taker = match running.is_empty() || parallel_leg || !steerable {
            true => None,
            false => RunningTurn::taker(&running, &input.client_id),
        };
        sqlx::query(
            "INSERT INTO orch_messages (id, session_id, seq, client_id, idempotency_key, role, \
             message, claimed_by_turn, steered, solo, reply_to, ack, created_at, queued, \
             ask_chain) \
             VALUES ($1, $2, $3, $4, $5, 'user', $6, $12, $13, $7, $8, NULL, $9, $10, $11)",
        )
        .bind(&message_id)
        .bind(&input.session_id)
        .bind(seq)
        .bind(&input.client_id)
        .bind(input.idempotency_key.clone())
        .bind(&message_json)
        .bind(i64::from(input.solo))
        .bind(input.reply_to.clone())
        .bind(now)
        .bind(i64::from(input.policy == BusyPolicy::Enqueue))
        .bind(ask_chain)
        .bind(taker.map(|t| t.turn_id.clone()))
        .bind(i64::from(taker.is_some()))
        .execute(&mut *tx)
        .await?;
        let pushed = taker.map(|t| Pushed {
            turn_id: t.turn_id.clone(),
            messages: vec![SteeredMessage {
                id: message_id.clone(),
                seq: to_u64(seq),
                message: input.message.clone(),
            }],
        });

        let (disposition, started) = if running.is_empty() {
            // No turn in flight: start one from the pending queue (normally just this message).
            // (An older solo message goes first, alone; this one then waits its turn.)
            let batch = self.pending_batch(&mut tx, &input.session_id).await?;
            let mine = batch.iter().any(|m| m.id == message_id);
            let turn = if batch.is_empty() {
                None
            } else {
                Some(
                    self.start_turn(&mut tx, &input.session_id, &env, batch, String::new(), None)
                        .await?,
                )
            };
            let disposition = if mine {
                Disposition::TurnStarted
            } else {
                Disposition::Pending
            };
            (disposition, turn)
        } else if parallel_leg {
            // Parallel policy: a leg of its own, told what the newest live leg is doing.
            let other = running.last();
            let (step, tool_names) = other.map(|t| progress(&t.turn_id)).unwrap_or_default();
            let queued = Self::count_pending(&mut tx, &input.session_id).await? - 1;
            let notice = ParallelNotice {
                other_message_id: other
                    .map(|t| t.first_message_id.clone())
                    .unwrap_or_default(),
                step,
                tool_names,
                queued: u32::try_from(queued.max(0)).unwrap_or(u32::MAX),
            };
            let row = PendingRow {
                id: message_id.clone(),
                seq,
                message: message_json.clone(),
                solo: false,
                client_id: input.client_id.clone(),
                ask_chain: None,
            };
            let turn = self
                .start_turn(
                    &mut tx,
                    &input.session_id,
                    &env,
                    vec![row],
                    new_id(),
                    Some(notice),
                )
                .await?;
            (Disposition::ParallelLeg, Some(turn))
        } else {
            (Disposition::Pending, None)
        };

        let turn_id = match (&disposition, &started) {
            (Disposition::TurnStarted | Disposition::ParallelLeg, Some(t)) => t.turn_id.clone(),
            _ => String::new(),
        };
        let ack = SendAck {
            message_id: message_id.clone(),
            seq: to_u64(seq),
            disposition,
            turn_id,
        };
        sqlx::query("UPDATE orch_messages SET ack = $1 WHERE id = $2")
            .bind(encode(&ack)?)
            .bind(&message_id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Sent {
            ack,
            duplicate: false,
            started,
            pushed,
        })
    }

    /// Claims the session's unclaimed messages for the asking turn and returns every message
    /// claimed by it at a boundary with `seq > after_seq`, in seq order.
    pub async fn steer(&self, req: &SteerRequest) -> Result<Vec<SteeredMessage>, StoreError> {
        let after = to_i64(req.after_seq)?;
        if self.nothing_to_steer(req, after).await? {
            return Ok(Vec::new());
        }
        let mut tx = self.begin().await?;
        if self.lock_session(&mut tx, &req.session_id).await?.is_none() {
            return Err(StoreError::NotFound(format!(
                "no session {:?}",
                req.session_id
            )));
        }
        let turn = self
            .fence(&mut tx, &req.turn_id, &req.session_id, req.attempt)
            .await?;
        if turn.completed {
            return Err(StoreError::Conflict(format!(
                "turn {} has already completed",
                req.turn_id
            )));
        }
        let running = Self::running_turns(&mut tx, &req.session_id).await?;
        let floor = Self::claim_floor(&mut tx, &req.turn_id, turn.base_seq).await?;
        // Alone in its session, a turn takes every pending message; beside other legs only its
        // own client's (the other legs take theirs).
        let claim = if running.len() <= 1 {
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 1 \
                 WHERE session_id = $2 AND claimed_by_turn IS NULL AND solo = 0 AND queued = 0 \
                 AND seq > $3",
            )
            .bind(&req.turn_id)
            .bind(&req.session_id)
            .bind(floor)
        } else {
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 1 \
                 WHERE session_id = $2 AND claimed_by_turn IS NULL AND solo = 0 AND queued = 0 \
                 AND seq > $3 \
                 AND client_id = $4",
            )
            .bind(&req.turn_id)
            .bind(&req.session_id)
            .bind(floor)
            .bind(turn.client_id.clone())
        };
        claim.execute(&mut *tx).await?;
        let rows = sqlx::query(
            "SELECT id, seq, message FROM orch_messages \
             WHERE claimed_by_turn = $1 AND steered = 1 AND seq > $2 ORDER BY seq",
        )
        .bind(&req.turn_id)
        .bind(after)
        .fetch_all(&mut *tx)
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let text: String = r.try_get(2)?;
            out.push(SteeredMessage {
                id: r.try_get(0)?,
                seq: to_u64(r.try_get(1)?),
                message: decode_message(&text)?,
            });
        }
        tx.commit().await?;
        Ok(out)
    }

    /// The common boundary, read in one statement without a lock or a commit to flush: the turn
    /// is in its session, running, at exactly this attempt, no steerable message waits in its
    /// session and it holds none beyond `after`. Anything else (something to claim or hand
    /// back, a newer or stale attempt, an unknown or completed turn) takes the locked path,
    /// which also produces the errors. A message that arrives just after this read stays
    /// pending for the next boundary or the next turn, as it would after the locked path.
    async fn nothing_to_steer(&self, req: &SteerRequest, after: i64) -> Result<bool, StoreError> {
        let row = sqlx::query(
            "SELECT t.session_id, t.status, t.attempt, \
             CAST(CASE WHEN EXISTS (SELECT 1 FROM orch_messages m \
               WHERE m.session_id = t.session_id AND m.claimed_by_turn IS NULL \
               AND m.solo = 0 AND m.queued = 0 AND m.seq > t.base_seq) \
               THEN 1 ELSE 0 END AS BIGINT), \
             CAST(CASE WHEN EXISTS (SELECT 1 FROM orch_messages m \
               WHERE m.claimed_by_turn = t.turn_id AND m.steered = 1 AND m.seq > $2) \
               THEN 1 ELSE 0 END AS BIGINT) \
             FROM orch_turns t WHERE t.turn_id = $1",
        )
        .bind(&req.turn_id)
        .bind(after)
        .fetch_optional(&self.pool)
        .await?;
        let Some(row) = row else {
            return Ok(false);
        };
        let session: String = row.try_get(0)?;
        let status: String = row.try_get(1)?;
        let attempt: i64 = row.try_get(2)?;
        let pending: i64 = row.try_get(3)?;
        let held_beyond_after: i64 = row.try_get(4)?;
        Ok(session == req.session_id
            && status == "running"
            && attempt == i64::from(req.attempt)
            && pending == 0
            && held_beyond_after == 0)
    }

    /// Checks the `{turn_id, attempt}` fence and raises the recorded attempt.
    async fn fence(
        &self,
        tx: &mut Transaction<'static, Any>,
        turn_id: &str,
        session_id: &str,
        attempt: u32,
    ) -> Result<TurnRow, StoreError> {
        let row = sqlx::query(
            "SELECT session_id, client_id, status, attempt, base_seq, leg_id FROM orch_turns \
             WHERE turn_id = $1",
        )
        .bind(turn_id)
        .fetch_optional(&mut **tx)
        .await?
        .ok_or_else(|| StoreError::NotFound(format!("no turn {turn_id:?}")))?;
        let turn = TurnRow::from_row(&row)?;
        if turn.session_id != session_id {
            return Err(StoreError::BadRequest(format!(
                "turn {turn_id} belongs to another session"
            )));
        }
        let attempt = i64::from(attempt);
        if attempt < turn.attempt {
            return Err(StoreError::Conflict(format!(
                "attempt {attempt} of turn {turn_id} is stale: attempt {} has taken over",
                turn.attempt
            )));
        }
        if attempt > turn.attempt {
            sqlx::query("UPDATE orch_turns SET attempt = $1, updated_at = $2 WHERE turn_id = $3")
                .bind(attempt)
                .bind(now_ms())
                .bind(turn_id)
                .execute(&mut **tx)
                .await?;
        }
        Ok(turn)
    }

    /// Records a turn's completion (idempotent, fenced), appends its answer to the transcript,
    /// releases the fence and starts the next turn from pending messages.
    pub async fn complete(&self, req: &TurnComplete) -> Result<Completed, StoreError> {
        let answer = match &req.message {
            Some(m) if m.role != Role::Assistant => {
                return Err(StoreError::BadRequest(format!(
                    "the final message must have role assistant, not {:?}",
                    m.role
                )));
            }
            Some(m) => Some(encode(m)?),
            None => None,
        };
        let outcome = encode(&req.outcome)?;
        let outcome = outcome.trim_matches('"').to_owned();
        let mut tx = self.begin().await?;
        let Some(env) = self.lock_session(&mut tx, &req.session_id).await? else {
            return Err(StoreError::NotFound(format!(
                "no session {:?}",
                req.session_id
            )));
        };
        let turn = self
            .fence(&mut tx, &req.turn_id, &req.session_id, req.attempt)
            .await?;
        if turn.completed {
            tx.rollback().await?;
            return Ok(Completed {
                first: false,
                session_id: req.session_id.clone(),
                leg_id: turn.leg_id,
                reply_to: Vec::new(),
                next: None,
                pushed: None,
            });
        }
        let now = now_ms();
        sqlx::query(
            "UPDATE orch_turns SET status = 'completed', outcome = $1, updated_at = $2 \
             WHERE turn_id = $3",
        )
        .bind(&outcome)
        .bind(now)
        .bind(&req.turn_id)
        .execute(&mut *tx)
        .await?;
        if let Some(answer) = answer {
            let seq = Self::next_seq(&mut tx, &req.session_id).await?;
            sqlx::query(
                "INSERT INTO orch_messages (id, session_id, seq, client_id, idempotency_key, \
                 role, message, claimed_by_turn, steered, solo, reply_to, ack, created_at) \
                 VALUES ($1, $2, $3, '', NULL, 'assistant', $4, $5, 0, 0, NULL, NULL, $6)",
            )
            .bind(new_id())
            .bind(&req.session_id)
            .bind(seq)
            .bind(&answer)
            .bind(&req.turn_id)
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        Self::release_unsteered(&mut tx, req).await?;
        let rows = sqlx::query(
            "SELECT reply_to FROM orch_messages \
             WHERE claimed_by_turn = $1 AND reply_to IS NOT NULL ORDER BY seq",
        )
        .bind(&req.turn_id)
        .fetch_all(&mut *tx)
        .await?;
        let reply_to = rows
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<Vec<_>, _>>()?;
        let running = Self::running_turns(&mut tx, &req.session_id).await?;
        let (next, pushed) = match running.as_slice() {
            [] => {
                let batch = self.pending_batch(&mut tx, &req.session_id).await?;
                if batch.is_empty() {
                    (None, None)
                } else {
                    let next = self
                        .start_turn(&mut tx, &req.session_id, &env, batch, String::new(), None)
                        .await?;
                    (Some(next), None)
                }
            }
            // One leg left: it is now alone in its session and takes every pending message,
            // as its next boundary would have claimed them.
            [only] => (
                None,
                Self::claim_pending(&mut tx, &req.session_id, only).await?,
            ),
            _ => (None, None),
        };
        tx.commit().await?;
        Ok(Completed {
            first: true,
            session_id: req.session_id.clone(),
            leg_id: turn.leg_id,
            reply_to,
            next,
            pushed,
        })
    }

    /// The seq a turn's next claim starts after: past everything it holds and its own base, so
    /// an `after_seq` cursor never skips a claimed message.
    async fn claim_floor(
        tx: &mut Transaction<'static, Any>,
        turn_id: &str,
        base_seq: i64,
    ) -> Result<i64, StoreError> {
        let row = sqlx::query("SELECT MAX(seq) FROM orch_messages WHERE claimed_by_turn = $1")
            .bind(turn_id)
            .fetch_one(&mut **tx)
            .await?;
        let held: Option<i64> = row.try_get(0)?;
        Ok(held.unwrap_or(0).max(base_seq))
    }

    /// Claims for `turn`, the only running turn of its session, every steerable pending message
    /// past what it holds (as the locked steer path would), to push to it.
    async fn claim_pending(
        tx: &mut Transaction<'static, Any>,
        session_id: &str,
        turn: &RunningTurn,
    ) -> Result<Option<Pushed>, StoreError> {
        let floor = Self::claim_floor(tx, &turn.turn_id, turn.base_seq).await?;
        let rows = sqlx::query(
            "SELECT id, seq, message FROM orch_messages \
             WHERE session_id = $1 AND claimed_by_turn IS NULL AND solo = 0 AND queued = 0 \
             AND seq > $2 ORDER BY seq",
        )
        .bind(session_id)
        .bind(floor)
        .fetch_all(&mut **tx)
        .await?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut messages = Vec::with_capacity(rows.len());
        for r in &rows {
            let message = SteeredMessage {
                id: r.try_get(0)?,
                seq: to_u64(r.try_get(1)?),
                message: decode_message(&r.try_get::<String, _>(2)?)?,
            };
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = $1, steered = 1 \
                 WHERE id = $2 AND claimed_by_turn IS NULL",
            )
            .bind(&turn.turn_id)
            .bind(&message.id)
            .execute(&mut **tx)
            .await?;
            messages.push(message);
        }
        Ok(Some(Pushed {
            turn_id: turn.turn_id.clone(),
            messages,
        }))
    }

    /// Gives back to pending every message this turn claimed at a boundary but never took in
    /// (absent from `steered_ids`): a steer whose reply was lost, or that the worker gave up on,
    /// after the claim committed, with no later boundary to hand it back. Pending again, it is
    /// answered as its own turn (I2: never lost).
    async fn release_unsteered(
        tx: &mut Transaction<'static, Any>,
        req: &TurnComplete,
    ) -> Result<(), StoreError> {
        let rows =
            sqlx::query("SELECT id FROM orch_messages WHERE claimed_by_turn = $1 AND steered = 1")
                .bind(&req.turn_id)
                .fetch_all(&mut **tx)
                .await?;
        for row in &rows {
            let id: String = row.try_get(0)?;
            if req.steered_ids.contains(&id) {
                continue;
            }
            // Routine when a message was pushed after the turn's last boundary.
            tracing::info!(turn = %req.turn_id, message = %id,
                "a message claimed for the turn never reached it; it is pending again");
            sqlx::query(
                "UPDATE orch_messages SET claimed_by_turn = NULL, steered = 0 \
                 WHERE id = $1 AND claimed_by_turn = $2",
            )
            .bind(&id)
            .bind(&req.turn_id)
            .execute(&mut **tx)
            .await?;
        }
        Ok(())
    }

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
        let rows = sqlx::query(
            "SELECT turn_id, job FROM orch_turns \
             WHERE dispatched = 0 AND status = 'running' AND created_at <= $1 \
             ORDER BY created_at LIMIT 100",
        )
        .bind(cutoff)
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Undispatched {
                    turn_id: r.try_get(0)?,
                    job: r.try_get(1)?,
                })
            })
            .collect()
    }
}

struct TurnRow {
    session_id: String,
    client_id: String,
    completed: bool,
    attempt: i64,
    base_seq: i64,
    leg_id: String,
}

impl TurnRow {
    fn from_row(row: &AnyRow) -> Result<TurnRow, StoreError> {
        let status: String = row.try_get(2)?;
        Ok(TurnRow {
            session_id: row.try_get(0)?,
            client_id: row.try_get(1)?,
            completed: status == "completed",
            attempt: row.try_get(3)?,
            base_seq: row.try_get(4)?,
            leg_id: row.try_get(5)?,
        })
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
        std::fs::create_dir_all(parent)
            .map_err(|e| StoreError::Open(format!("cannot create {}: {e}", parent.display())))?;
    }
    if url.contains("mode=") {
        Ok(url.to_owned())
    } else if url.contains('?') {
        Ok(format!("{url}&mode=rwc"))
    } else {
        Ok(format!("{url}?mode=rwc"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
