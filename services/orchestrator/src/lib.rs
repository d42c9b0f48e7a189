//! `cyrene-orchestrator`: sessions, transcripts, the pending queue, the per-session turn fence,
//! turn dispatch to the loop workers, parallel legs and the personas as agents
//! (docs/architecture.md §4, §5, §6, §9; docs/semantics.md#steering), served as the micro service
//! `cyrene-orchestrator`.
//!
//! This crate owns:
//! - the SQL schema and every query ([`store`]; PostgreSQL and SQLite through one code path,
//!   migrations in `migrations/{postgres,sqlite}` applied at start);
//! - what a new turn's job holds ([`job`]: batch, window budget, persona; no SQL);
//! - the behaviour behind the endpoints ([`engine`]): input checks, dispositions, dispatch of
//!   `TurnJob`s to `CYRENE_TURNS`, session events, the dispatch sweeper;
//! - the endpoints `send`, `history`, `steer`, `complete` ([`service`]);
//! - approvals of tool calls: the waiting turn, the decisions and their deadline ([`approvals`],
//!   `store/approvals.rs`; docs/orchestrator.md, "Approvals");
//! - the document service: uploads into the object store, `cyrene-doc://` references, reads
//!   ([`documents`], endpoints `upload` and `read`; docs/documents.md);
//! - persona memory: the [`memory::MemoryStore`] interface behind `cyrene.memory.*` and its SQL
//!   default (docs/memory.md), and the memory she gathers herself after a turn ([`extraction`],
//!   JetStream stream `CYRENE_MEMORY`);
//! - the personas ([`personas`]) and their comm agents ([`agents`]);
//! - who speaks: the owner, third parties and the chat bridge ([`identity`]);
//! - the configuration ([`config`]).
//!
//! Wire shapes live in `cyrene_protocol::{session, turn}`; `docs/orchestrator.md` documents each
//! endpoint.
//!
//! # Invariants
//! - I1: in single-leg mode at most one turn per session is `running`; a new turn starts only
//!   when the previous one has completed (SQL-atomic, safe across replicas).
//! - I2: every acknowledged user message is consumed by exactly one turn — claimed by the job
//!   that starts it or at one of its steer boundaries — and appears once in the transcript.
//! - A message is committed before it is acknowledged; a database outage gets `unavailable`.
//! - Bad input gets a documented error code and the service keeps serving.

pub mod agents;
pub mod approvals;
pub mod config;
pub mod documents;
pub mod engine;
pub mod extraction;
pub mod identity;
pub mod job;
pub mod memory;
pub mod people;
pub mod personas;
pub mod service;
pub mod store;

pub use config::{Args, BusyPolicies, Config, ConfigError, Database, PolicyLists};
pub use engine::{Engine, TurnDone};
pub use personas::{Persona, Personas};
pub use store::{Backend, JobSettings, Store, StoreError, StoreOptions};

use async_nats::Client;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The micro service name (`nats micro ls`).
pub const SERVICE_NAME: &str = "cyrene-orchestrator";

/// How long shutdown lets running ask handlers finish.
const AGENT_STOP_GRACE: Duration = Duration::from_secs(2);

/// Why the service could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("nats: {what}")]
    Bus {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(transparent)]
    Host(#[from] cyrene_bus::host::HostError),
}

cyrene_runtime::run_error!(Error::Config);

/// Opens the store described by `config` (applying the migrations).
pub async fn open_store(config: &Config) -> Result<Store, Error> {
    config.validate()?;
    let url = match config.database()? {
        Database::Postgres(url) | Database::Sqlite(url) => url,
    };
    let options = StoreOptions {
        acquire_timeout: config.pool.acquire_timeout,
        max_connections: config.pool.max_connections,
    };
    let settings = JobSettings {
        personas: config.personas.clone(),
        window: config.window,
        max_steps: config.max_steps,
        max_job_bytes: config.max_job_bytes,
    };
    Ok(Store::open(&url, &options, settings).await?)
}

/// Runs the orchestrator until `shutdown` fires: endpoints, agents and the dispatch sweeper; then
/// drains them and closes the database.
pub async fn run(config: Config, client: Client, shutdown: CancellationToken) -> Result<(), Error> {
    let store = open_store(&config).await?;
    // A signal before the bus is reachable is a clean stop (exit 0), at once.
    if !ensure_stream(&client, config.turns_replicas, &shutdown).await {
        tracing::info!("stopped before start-up finished");
        store.close().await;
        return Ok(());
    }
    let js = async_nats::jetstream::new(client.clone());
    let documents = tokio::select! {
        opened = documents::Documents::open(
            &js,
            config.turns_replicas,
            config.document_limits(),
        ) => opened.map_err(|e| Error::Bus {
            what: "cannot open the documents' object store",
            source: e.into(),
        })?,
        _ = shutdown.cancelled() => {
            tracing::info!("stopped before start-up finished");
            store.close().await;
            return Ok(());
        }
    };
    let config = Arc::new(config);
    let engine = Arc::new(Engine::new(
        store.clone(),
        client.clone(),
        config.clone(),
        documents,
    ));
    let memory = Arc::new(memory::SqlMemory::new(
        store.pool().clone(),
        config.db_timeout,
    ));
    let extractions = extraction::open(&js, config.turns_replicas, config.memory_max_deliver)
        .await
        .map_err(|source| Error::Bus {
            what: "cannot open the memory extraction stream",
            source,
        })?;
    // The personas subscribe before the micro service answers `$SRV.PING`: a client that waits
    // for the service (a test, an init container) may ask a persona at once.
    let agents = if config.serve_agents {
        agents::serve(engine.clone(), shutdown.clone())
            .await
            .map_err(|e| Error::Bus {
                what: "cannot register the agents",
                source: e.into(),
            })?
    } else {
        Vec::new()
    };
    let mut host = service::start(engine.clone(), memory.clone(), shutdown.clone()).await?;
    host.spawn(extraction::consume(
        engine.clone(),
        memory,
        extractions,
        shutdown.clone(),
    ));
    host.spawn(sweeper(engine.clone(), shutdown.clone()));
    host.spawn(document_sweeper(engine.clone(), shutdown.clone()));
    // The database is open and every endpoint registered: ready.
    cyrene_runtime::health::global().set(cyrene_runtime::health::DATABASE_CHECK, true);
    cyrene_runtime::health::global().set(SERVICE_NAME, true);
    tracing::info!(
        backend = store.backend().name(),
        agents = agents.len(),
        "orchestrator serving"
    );

    shutdown.cancelled().await;
    for agent in agents {
        agent.stop_within(AGENT_STOP_GRACE).await;
    }
    host.run().await;
    store.close().await;
    tracing::info!("orchestrator stopped");
    Ok(())
}

/// Creates `CYRENE_TURNS` if missing, retrying while JetStream is not reachable yet; `false`
/// when shutdown came first (the attempt under way is abandoned).
async fn ensure_stream(client: &Client, replicas: usize, shutdown: &CancellationToken) -> bool {
    let js = async_nats::jetstream::new(client.clone());
    cyrene_bus::retry::until_ready(
        cyrene_bus::retry::STARTUP,
        shutdown,
        || cyrene_bus::streams::ensure_turns_stream_replicas(&js, replicas),
        |err| tracing::warn!(error = %err, "cannot create the turns stream yet"),
    )
    .await
    .is_some()
}

/// Sweeps abandoned uploads and recounts the document quotas, every quarter of `upload_ttl`
/// (at least every 5 minutes, at most every second).
async fn document_sweeper(engine: Arc<Engine>, shutdown: CancellationToken) {
    let every =
        (engine.config().upload_ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(300));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        if let Err(err) = engine.documents().sweep(std::time::SystemTime::now()).await {
            tracing::warn!(error = %err, "document sweep failed; the next one tries again");
        }
    }
}

/// How often the session gauges are read from the database (two counting statements).
const GAUGES_EVERY: Duration = Duration::from_secs(10);

/// Republishes unconfirmed dispatches and denies approvals past their deadline, every
/// `sweep_interval`; reads the session gauges every [`GAUGES_EVERY`].
async fn sweeper(engine: Arc<Engine>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(engine.config().sweep_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sampled: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        engine.sweep().await;
        engine.sweep_approvals().await;
        if sampled.is_none_or(|at| at.elapsed() >= GAUGES_EVERY) {
            engine.sample_gauges().await;
            sampled = Some(tokio::time::Instant::now());
        }
    }
}
