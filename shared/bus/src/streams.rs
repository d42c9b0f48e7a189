//! JetStream streams shared by several services, defined once so every service creates them with
//! the same configuration (creating an existing stream with a different one is an error).
//!
//! # Pitfalls
//! - The replica count of `CYRENE_TURNS` is a setting of every process that creates the stream
//!   (the orchestrator and the loop workers, `--turns-replicas`): an existing stream whose count
//!   differs is updated to it, so give every process the same value or they undo each other.

use async_nats::jetstream::{self, stream};
use cyrene_protocol::subjects;
use std::time::Duration;

/// The work-queue stream of turn jobs.
pub const TURNS_STREAM: &str = "CYRENE_TURNS";

/// Replicas of `CYRENE_TURNS` unless configured: one (a single nats-server).
pub const DEFAULT_TURNS_REPLICAS: usize = 1;

/// How long JetStream remembers a `Nats-Msg-Id` (the turn id) to drop a duplicate dispatch.
pub const TURNS_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// `CYRENE_TURNS`: subject `cyrene.turn.run`, work-queue retention (a job is gone once acked),
/// file storage (jobs survive a server restart), dedupe by `Nats-Msg-Id`; one replica.
pub fn turns_stream_config() -> stream::Config {
    turns_stream_config_with(DEFAULT_TURNS_REPLICAS)
}

/// [`turns_stream_config`] with `replicas` copies (3 on a 3-node cluster; at least 1).
pub fn turns_stream_config_with(replicas: usize) -> stream::Config {
    stream::Config {
        name: TURNS_STREAM.to_owned(),
        description: Some("Cyrene turn jobs (one per turn; Nats-Msg-Id = turn id)".to_owned()),
        subjects: vec![subjects::TURN_RUN.to_owned()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: TURNS_DUPLICATE_WINDOW,
        num_replicas: replicas.max(1),
        ..Default::default()
    }
}

/// Why `CYRENE_TURNS` could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TurnsStreamError {
    #[error("cannot create or look up the turns stream: {0}")]
    Create(#[from] jetstream::context::CreateStreamError),
    #[error("cannot change the turns stream to {replicas} replicas: {source}")]
    Replicas {
        replicas: usize,
        source: jetstream::context::UpdateStreamError,
    },
}

/// Creates `CYRENE_TURNS` with one replica if missing (idempotent; safe from every replica at
/// once). An existing stream is taken as it is.
pub async fn ensure_turns_stream(
    js: &jetstream::Context,
) -> Result<stream::Stream, jetstream::context::CreateStreamError> {
    js.get_or_create_stream(turns_stream_config()).await
}

/// Creates `CYRENE_TURNS` with `replicas` copies if missing, and brings an existing stream with
/// another replica count to `replicas` (see the module's pitfalls).
pub async fn ensure_turns_stream_replicas(
    js: &jetstream::Context,
    replicas: usize,
) -> Result<stream::Stream, TurnsStreamError> {
    let config = turns_stream_config_with(replicas);
    let mut stream = js.get_or_create_stream(config.clone()).await?;
    if stream.cached_info().config.num_replicas != config.num_replicas {
        js.update_stream(&config)
            .await
            .map_err(|source| TurnsStreamError::Replicas { replicas, source })?;
        stream = js.get_or_create_stream(config).await?;
    }
    Ok(stream)
}
