//! The micro service: five named endpoints on `cyrene.checkpoint.*`, each a bounded
//! [`serve_json`] loop in front of one [`CheckpointStore`].
//!
//! # Invariants
//! - Every request is answered: bad input by the decoder (`bad_request`/`too_large`) or the store
//!   checks, database trouble by `unavailable`, and every database operation is bounded by
//!   `db_timeout`, so a silent database can never hang a caller.
//! - On shutdown the endpoints stop taking requests, in-flight handlers finish, then the pool is
//!   closed.
//!
//! # Pitfalls
//! - Endpoint names are explicit (`save`, `latest`, …): a name derived from a subject would break
//!   `nats micro ls` if the subject ever had a wildcard.

use crate::config::Config;
use crate::store::{CheckpointStore, StoreError};
use crate::{Error, SERVICE_NAME};
use async_nats::Client;
use async_nats::service::ServiceExt;
use chrono::Utc;
use cyrene_bus::service::database_call as bounded;
use cyrene_bus::service::{RequestContext, ServeOptions, page_within, reply_budget, serve_json};
use cyrene_protocol::checkpoint::{
    Checkpoint, GetRequest, LatestRequest, ListRequest, ListResponse, RetainRequest, RetainResponse,
};
use cyrene_protocol::subjects;
use std::sync::Arc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Room for the JSON around `state` in a save request (ids, step, fencing fields).
const SAVE_ENVELOPE_SLACK: usize = 64 * 1024;

/// How often the `database` readiness check queries the database.
const DATABASE_CHECK_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `store` on the bus until `shutdown` fires, then closes it.
pub async fn serve<S: CheckpointStore>(
    store: S,
    config: &Config,
    client: Client,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let store = Arc::new(store);
    let service = client
        .service_builder()
        .description(
            "Per-step checkpoints of Cyrene turns: save (upsert, fenced), latest, get, list, \
             retain",
        )
        .start(SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| Error::Bus(format!("cannot start the micro service: {e}")))?;
    let service_ref = &service;
    let endpoint = |name: &'static str, subject: &'static str| async move {
        cyrene_bus::service::add_endpoint(service_ref, name, subject)
            .await
            .map_err(Error::Bus)
    };
    let save = endpoint("save", subjects::CHECKPOINT_SAVE).await?;
    let latest = endpoint("latest", subjects::CHECKPOINT_LATEST).await?;
    let get = endpoint("get", subjects::CHECKPOINT_GET).await?;
    let list = endpoint("list", subjects::CHECKPOINT_LIST).await?;
    let retain = endpoint("retain", subjects::CHECKPOINT_RETAIN).await?;

    let limit = config.db_timeout;
    let budget = reply_budget(&client);
    let small = ServeOptions {
        max_in_flight: config.max_in_flight,
        ..ServeOptions::default()
    };
    let save_options = ServeOptions {
        max_in_flight: config.max_in_flight,
        max_payload: config.max_state_bytes.saturating_add(SAVE_ENVELOPE_SLACK),
    };
    // Registered, and the database opened (with its migrations) by `run`: ready while the
    // database keeps answering.
    cyrene_bus::health::global().set(cyrene_bus::health::DATABASE_CHECK, true);
    cyrene_bus::health::global().set(SERVICE_NAME, true);
    let mut tasks = JoinSet::new();
    let s = store.clone();
    tasks.spawn(cyrene_bus::health::watch(
        cyrene_bus::health::DATABASE_CHECK,
        DATABASE_CHECK_EVERY,
        move || {
            let s = s.clone();
            async move { tokio::time::timeout(limit, s.ping()).await.unwrap_or(false) }
        },
        shutdown.clone(),
    ));
    let s = store.clone();
    tasks.spawn(serve_json(
        save,
        save_options,
        shutdown.clone(),
        move |cp: Checkpoint, _: RequestContext| {
            let s = s.clone();
            async move {
                let started = std::time::Instant::now();
                let saved = bounded(limit, s.save(cp, Utc::now())).await;
                let outcome = saved.as_ref().map_or_else(|e| e.code.as_str(), |_| "ok");
                metrics::histogram!("cyrene_checkpoint_save_duration_seconds", "outcome" => outcome)
                    .record(started.elapsed().as_secs_f64());
                saved
            }
        },
    ));
    let s = store.clone();
    tasks.spawn(serve_json(
        latest,
        small,
        shutdown.clone(),
        move |req: LatestRequest, _: RequestContext| {
            let s = s.clone();
            async move {
                match (req.turn_id.as_deref(), req.attempt) {
                    (None, None) => bounded(limit, s.latest(&req.agent_id)).await,
                    (Some(turn), attempt) => {
                        let read = s.latest_of_turn(&req.agent_id, turn, attempt, Utc::now());
                        bounded(limit, read).await
                    }
                    (None, Some(_)) => Err(StoreError::BadRequest(
                        "attempt needs turn_id: a fenced read is of one turn".into(),
                    )
                    .to_body()),
                }
            }
        },
    ));
    let s = store.clone();
    tasks.spawn(serve_json(
        get,
        small,
        shutdown.clone(),
        move |req: GetRequest, _: RequestContext| {
            let s = s.clone();
            async move { bounded(limit, s.get(&req.id)).await }
        },
    ));
    let s = store.clone();
    tasks.spawn(serve_json(
        list,
        small,
        shutdown.clone(),
        move |req: ListRequest, _: RequestContext| {
            let s = s.clone();
            async move {
                let count = crate::store::list_limit(req.limit).map_err(|e| e.to_body())?;
                // One row more than asked tells whether another page follows.
                let read = s.list_before(&req.agent_id, count + 1, req.before.as_deref());
                let mut rows = bounded(limit, read).await?;
                let more = rows.len() > count as usize;
                rows.truncate(count as usize);
                let (checkpoints, cut) = page_within(rows, budget);
                let next_before = (more || cut)
                    .then(|| checkpoints.last().map(|c| c.id.clone()))
                    .flatten();
                Ok(ListResponse {
                    checkpoints,
                    next_before,
                })
            }
        },
    ));
    let s = store.clone();
    tasks.spawn(serve_json(
        retain,
        small,
        shutdown.clone(),
        move |req: RetainRequest, _: RequestContext| {
            let s = s.clone();
            async move {
                let deleted = bounded(limit, s.retain(&req, Utc::now())).await?;
                tracing::info!(?req, deleted, "retention ran");
                Ok(RetainResponse { deleted })
            }
        },
    ));
    tracing::info!(backend = store.backend(), "checkpoint store serving");

    while let Some(joined) = tasks.join_next().await {
        if let Err(err) = joined {
            tracing::error!(error = %err, "an endpoint loop failed");
        }
    }
    if let Err(err) = service.stop().await {
        tracing::debug!(error = %err, "stopping the micro service");
    }
    store.close().await;
    tracing::info!("checkpoint store stopped");
    Ok(())
}
