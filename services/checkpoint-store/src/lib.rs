//! `cyrene-checkpoint-store`: durable per-step snapshots of agent turns (docs/architecture.md §3,
//! §5 "Fencing", §9; docs/semantics.md#checkpoints-and-resume), served over NATS as the micro
//! service `cyrene-checkpoint-store`.
//!
//! This crate owns:
//! - the [`store::CheckpointStore`] trait and its two SQL backends, [`store::PgStore`]
//!   (PostgreSQL) and [`store::SqliteStore`] (the embedded default), with their migrations
//!   (`migrations/postgres`, `migrations/sqlite`) applied at start;
//! - the endpoints `save`, `latest`, `get`, `list` and `retain` on `cyrene.checkpoint.*`
//!   ([`service`]);
//! - the configuration ([`config::Config`], [`config::Args`]).
//!
//! Wire shapes live in `cyrene_protocol::checkpoint`; the typed client is
//! `cyrene-checkpoint-client`; `docs/checkpoint-store.md` documents each endpoint.
//!
//! # Invariants
//! - Save is an upsert on the row id — `{agent_id}:{turn_id}:{step}` for a turn's save,
//!   `{agent_id}:{step}` otherwise — so the turns of one owner never overwrite each other; reads
//!   never delete; only `retain` deletes; `latest` is the most recent write (see [`store`]).
//! - Owner keys (`session` or `session#leg`) are validated at every entry point, and rows are only
//!   addressed by their owner key, so parallel legs never see each other's snapshots.
//! - A save from an older attempt of a turn, once a newer attempt has read (fenced) or written, is
//!   refused with `conflict` (fencing), atomically with the upsert.
//! - Bad input gets a documented error code and the service keeps serving; database trouble gets
//!   `unavailable` within a bounded time, and the pool reconnects by itself.

pub mod config;
pub mod service;
pub mod store;

pub use config::{Args, Config, ConfigError, Database};
pub use service::serve;
pub use store::{CheckpointStore, PgStore, SqliteStore, StoreError, StoreOptions};

use async_nats::Client;
use tokio_util::sync::CancellationToken;

/// The micro service name (`nats micro ls`).
pub const SERVICE_NAME: &str = "cyrene-checkpoint-store";

/// Why the service could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Host(#[from] cyrene_bus::host::HostError),
}

cyrene_runtime::run_error!(Error::Config);

/// Opens the configured database (applying its migrations) and serves it until `shutdown` fires.
pub async fn run(config: Config, client: Client, shutdown: CancellationToken) -> Result<(), Error> {
    let mut options = config.store_options();
    // Never accept a state that could not be read back: a save's ack and every later read carry
    // the whole state in one message.
    let carried = cyrene_bus::service::reply_budget(&client);
    if options.max_state_bytes > carried {
        tracing::warn!(
            configured = options.max_state_bytes,
            limit = carried,
            "the bus's max_payload is smaller than --max-state-bytes: states are limited to what \
             a reply can carry (raise max_payload in the nats-server config for larger ones)"
        );
        options.max_state_bytes = carried;
    }
    match config.database()? {
        Database::Postgres(url) => {
            let store = PgStore::connect(&url, &options).await?;
            serve(store, &config, client, shutdown).await
        }
        Database::Sqlite(url) => {
            let store = SqliteStore::open(&url, &options).await?;
            serve(store, &config, client, shutdown).await
        }
    }
}
