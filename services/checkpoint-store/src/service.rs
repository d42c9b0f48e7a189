//! The micro service: the endpoint table of `cyrene.checkpoint.*` (six shared endpoints and a
//! person's three reads), hosted by [`cyrene_bus::host::Host`] in front of one
//! [`CheckpointStore`].
//!
//! # Invariants
//! - Every request is answered: bad input by the decoder (`bad_request`/`too_large`) or the store
//!   checks, database trouble by `unavailable`, and every database operation is bounded by
//!   `db_timeout`, so a silent database can never hang a caller.
//! - A person reads only their own sessions' checkpoints, on `cyrene.person.<person>.checkpoint.*`
//!   (`person-latest`, `person-get`, `person-list`); the shared `get` and `list` never reach a
//!   person's ([`may_read`], docs/security.md "People"). The shared `latest` is the loop worker's
//!   (it resumes every session); the shipped NATS config grants it to nobody else.
//! - Only the shared `latest` raises a turn's attempt record (a fenced read, `attempt` set): a
//!   person's `latest` with an `attempt` is `forbidden` before the store is touched
//!   ([`may_fence`]).
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
use chrono::Utc;
use cyrene_bus::host::{Endpoint, Host, ServiceSpec, with_state};
use cyrene_bus::service::{ServeOptions, page_within, reply_budget};
use cyrene_protocol::checkpoint::owner_person;
use cyrene_protocol::checkpoint::{
    Checkpoint, GetRequest, LatestRequest, ListRequest, ListResponse, ProgressRequest,
    ProgressResponse, RetainRequest, RetainResponse,
};
use cyrene_protocol::error::{ErrorBody, ErrorCode};
use cyrene_protocol::subjects::{self, Trespass};
use cyrene_sql::bounded;
use std::sync::Arc;
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
    let spec = ServiceSpec::new(
        SERVICE_NAME,
        env!("CARGO_PKG_VERSION"),
        "Per-step checkpoints of Cyrene turns: save (upsert, fenced), latest, get, list, retain, \
         progress",
    );
    let endpoints = endpoints(&store, config, reply_budget(&client));
    let mut host = Host::start(&client, spec, endpoints, shutdown.clone()).await?;
    // Registered, and the database opened (with its migrations) by `run`: ready while the
    // database keeps answering.
    cyrene_runtime::health::global().set(cyrene_runtime::health::DATABASE_CHECK, true);
    cyrene_runtime::health::global().set(SERVICE_NAME, true);
    let (s, limit) = (store.clone(), config.db_timeout);
    host.spawn(cyrene_runtime::health::watch(
        cyrene_runtime::health::DATABASE_CHECK,
        DATABASE_CHECK_EVERY,
        move || {
            let s = s.clone();
            async move { tokio::time::timeout(limit, s.ping()).await.unwrap_or(false) }
        },
        shutdown,
    ));
    tracing::info!(backend = store.backend(), "checkpoint store serving");
    host.run().await;
    store.close().await;
    tracing::info!("checkpoint store stopped");
    Ok(())
}

/// The endpoint table: the shared subjects and a person's own (`person-*`, the reads only).
fn endpoints<S: CheckpointStore>(store: &Arc<S>, config: &Config, budget: usize) -> Vec<Endpoint> {
    let limit = config.db_timeout;
    let small = ServeOptions {
        max_in_flight: config.max_in_flight,
        ..ServeOptions::default()
    };
    let save_options = ServeOptions {
        max_in_flight: config.max_in_flight,
        max_payload: config.max_state_bytes.saturating_add(SAVE_ENVELOPE_SLACK),
        expected: &[],
    };
    // A fresh turn has no checkpoint yet: its `latest` is `not_found`, a normal answer.
    let latest_options = ServeOptions {
        expected: &[ErrorCode::NotFound],
        ..small
    };
    let person = |what: &str| subjects::person_all(what);
    let save = with_state(store, move |s, cp: Checkpoint, _| async move {
        let started = std::time::Instant::now();
        let saved = bounded(limit, s.save(cp, Utc::now())).await;
        let outcome = saved.as_ref().map_or_else(|e| e.code.as_str(), |_| "ok");
        metrics::histogram!("cyrene_checkpoint_save_duration_seconds", "outcome" => outcome)
            .record(started.elapsed().as_secs_f64());
        saved
    });
    let latest = || {
        with_state(store, move |s, req: LatestRequest, ctx| async move {
            may_read(&ctx.subject, &req.agent_id)?;
            may_fence(&ctx.subject, req.attempt)?;
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
        })
    };
    let get = || {
        with_state(store, move |s, req: GetRequest, ctx| async move {
            may_read(&ctx.subject, &req.id)?;
            bounded(limit, s.get(&req.id)).await
        })
    };
    let list = || {
        with_state(store, move |s, req: ListRequest, ctx| async move {
            may_read(&ctx.subject, &req.agent_id)?;
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
        })
    };
    let retain = with_state(store, move |s, req: RetainRequest, _| async move {
        let deleted = bounded(limit, s.retain(&req, Utc::now())).await?;
        tracing::info!(?req, deleted, "retention ran");
        Ok(RetainResponse { deleted })
    });
    // The orchestrator's (the shipped NATS config grants it to nobody else): step and tool
    // names of any session's turns, never their text.
    let progress = with_state(store, move |s, req: ProgressRequest, _| async move {
        let turns = bounded(limit, s.progress(&req)).await?;
        Ok(ProgressResponse { turns })
    });
    vec![
        Endpoint::json("save", subjects::CHECKPOINT_SAVE, save).options(save_options),
        Endpoint::json("latest", subjects::CHECKPOINT_LATEST, latest()).options(latest_options),
        Endpoint::json("get", subjects::CHECKPOINT_GET, get()).options(small),
        Endpoint::json("list", subjects::CHECKPOINT_LIST, list()).options(small),
        Endpoint::json("retain", subjects::CHECKPOINT_RETAIN, retain).options(small),
        Endpoint::json("progress", subjects::CHECKPOINT_PROGRESS, progress).options(small),
        Endpoint::json(
            "person-latest",
            person(subjects::PERSON_CHECKPOINT_LATEST),
            latest(),
        )
        .options(latest_options),
        Endpoint::json("person-get", person(subjects::PERSON_CHECKPOINT_GET), get()).options(small),
        Endpoint::json(
            "person-list",
            person(subjects::PERSON_CHECKPOINT_LIST),
            list(),
        )
        .options(small),
    ]
}

/// Whether the caller of a read on `subject` may read the checkpoints of `owner_or_id` (an
/// owner key or a checkpoint id): a person (`cyrene.person.<p>.checkpoint.*`) only their own
/// sessions'; the shared `get` and `list` only sessions of nobody in particular; the shared
/// `latest` (the loop worker's) any. `forbidden` otherwise; ids are checked by the store.
fn may_read(subject: &str, owner_or_id: &str) -> Result<(), ErrorBody> {
    if subject == subjects::CHECKPOINT_LATEST {
        return Ok(());
    }
    subjects::may_reach(subject, owner_person(owner_or_id)).map_err(|trespass| {
        let message = match trespass {
            Trespass::NotTheirs { caller } => format!(
                "{:?} is not a checkpoint of {caller:?}'s sessions ({caller}.<name>)",
                cut(owner_or_id)
            ),
            Trespass::OwnersOnly { owner } => format!(
                "{:?} is {owner:?}'s: only they read it, on cyrene.person.{owner}.checkpoint.*",
                cut(owner_or_id)
            ),
        };
        ErrorBody::new(ErrorCode::Forbidden, message)
    })
}

/// Whether a `latest` read on `subject` may carry an `attempt` (a fenced read, which raises the
/// turn's attempt record). Only the loop worker's shared `latest` may: the worker fences the turn
/// of the job it runs. A person's read never raises a record (`forbidden`), whatever turn it names:
/// otherwise a turn id a person learned would fence that turn off from its own worker.
fn may_fence(subject: &str, attempt: Option<u32>) -> Result<(), ErrorBody> {
    if attempt.is_none() || subject == subjects::CHECKPOINT_LATEST {
        return Ok(());
    }
    Err(ErrorBody::new(
        ErrorCode::Forbidden,
        "a person's read carries no attempt: only the loop worker fences a turn",
    ))
}

/// At most 160 characters of a caller's value in an error message.
fn cut(value: &str) -> String {
    value.chars().take(160).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_person_reads_only_their_own_sessions_checkpoints() {
        let alice = "cyrene.person.alice.checkpoint.list";
        assert!(may_read(alice, "alice.s1").is_ok());
        assert!(may_read("cyrene.person.alice.checkpoint.get", "alice.s1#l1:t1:3").is_ok());
        for other in ["bob.s1", "s1", "s1#l1:2"] {
            let err = may_read(alice, other).unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{other}");
        }
        assert!(may_read(subjects::CHECKPOINT_LIST, "s1").is_ok());
        for shared in [subjects::CHECKPOINT_LIST, subjects::CHECKPOINT_GET] {
            let err = may_read(shared, "alice.s1:3").unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{shared}");
        }
        // the loop worker resumes every session
        assert!(may_read(subjects::CHECKPOINT_LATEST, "alice.s1").is_ok());
    }

    #[test]
    fn only_the_workers_latest_raises_a_fence() {
        assert!(may_fence(subjects::CHECKPOINT_LATEST, Some(3)).is_ok());
        assert!(may_fence("cyrene.person.alice.checkpoint.latest", None).is_ok());
        let err = may_fence("cyrene.person.alice.checkpoint.latest", Some(3)).unwrap_err();
        assert_eq!(err.code, ErrorCode::Forbidden);
    }
}
