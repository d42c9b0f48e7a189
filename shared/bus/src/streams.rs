//! JetStream streams shared by several services, defined once so every service creates them with
//! the same configuration (creating an existing stream with a different one is an error).

use async_nats::jetstream::{self, stream};
use cyrene_protocol::subjects;
use std::time::Duration;

/// The work-queue stream of turn jobs.
pub const TURNS_STREAM: &str = "CYRENE_TURNS";

/// How long JetStream remembers a `Nats-Msg-Id` (the turn id) to drop a duplicate dispatch.
pub const TURNS_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// `CYRENE_TURNS`: subject `cyrene.turn.run`, work-queue retention (a job is gone once acked),
/// file storage (jobs survive a server restart), dedupe by `Nats-Msg-Id`.
pub fn turns_stream_config() -> stream::Config {
    stream::Config {
        name: TURNS_STREAM.to_owned(),
        description: Some("Cyrene turn jobs (one per turn; Nats-Msg-Id = turn id)".to_owned()),
        subjects: vec![subjects::TURN_RUN.to_owned()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: TURNS_DUPLICATE_WINDOW,
        ..Default::default()
    }
}

/// Creates `CYRENE_TURNS` if missing (idempotent; safe from every replica at once).
pub async fn ensure_turns_stream(
    js: &jetstream::Context,
) -> Result<stream::Stream, jetstream::context::CreateStreamError> {
    js.get_or_create_stream(turns_stream_config()).await
}
