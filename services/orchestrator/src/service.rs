//! The micro service `cyrene-orchestrator`: nine named endpoints, each a bounded [`serve_json`]
//! loop in front of the [`Engine`].
//!
//! | endpoint   | subject                   | request          | reply             |
//! |------------|---------------------------|------------------|-------------------|
//! | `send`     | `cyrene.session.send`     | `SendRequest`    | `SendAck`         |
//! | `history`  | `cyrene.session.history`  | `HistoryRequest` | `HistoryResponse` |
//! | `steer`    | `cyrene.turn.steer`       | `SteerRequest`   | `SteerResponse`   |
//! | `complete` | `cyrene.turn.complete`    | `TurnComplete`   | `TurnCompleteAck` |
//! | `person-send`    | `cyrene.person.*.session.send`    | `SendRequest`    | `SendAck` |
//! | `person-history` | `cyrene.person.*.session.history` | `HistoryRequest` | `HistoryResponse` |
//! | `upload`   | `cyrene.document.upload`  | `UploadRequest`  | `UploadAck`       |
//! | `read`     | `cyrene.document.read`    | `ReadRequest`    | `ReadResponse`    |
//! | `memory_read`   | `cyrene.memory.read`   | `MemoryReadRequest`   | `MemoryReadResponse` |
//! | `memory_write`  | `cyrene.memory.write`  | `MemoryWriteRequest`  | `MemoryWriteAck`     |
//! | `memory_forget` | `cyrene.memory.forget` | `MemoryForgetRequest` | `MemoryForgetAck`    |
//!
//! # Invariants
//! - Every request is answered: bad input by the decoder or the engine's checks
//!   (`bad_request`/`too_large`), database trouble by `unavailable` within `db_timeout`.
//! - Replicas share the micro service queue group: each request reaches one replica.
//! - `send` and `history` reach a session only when the request subject's caller may touch it
//!   ([`crate::people::may_touch`]): a person their own sessions, the shared subjects the
//!   sessions of nobody in particular.

use crate::engine::Engine;
use crate::memory::MemoryStore;
use crate::{Error, SERVICE_NAME, people};
use async_nats::service::{Service, ServiceExt};
use cyrene_bus::service::{RequestContext, ServeOptions, serve_json};
use cyrene_protocol::document::{self, ReadRequest, UploadRequest};
use cyrene_protocol::memory as mem;
use cyrene_protocol::session::{HistoryRequest, SendRequest};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::{SteerRequest, TurnComplete};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Starts the micro service and spawns one serving loop per endpoint into `tasks`.
pub async fn start<M: MemoryStore + 'static>(
    engine: Arc<Engine>,
    memory: Arc<M>,
    tasks: &mut JoinSet<()>,
    shutdown: CancellationToken,
) -> Result<Service, Error> {
    let config = engine.config().clone();
    let service = engine
        .client()
        .service_builder()
        .description(
            "Cyrene sessions: exactly-once messages, the per-session turn fence, turn dispatch \
             (CYRENE_TURNS), steering and completion, history",
        )
        .metadata(HashMap::from([(
            "cyrene.backend".to_owned(),
            engine.store.backend().name().to_owned(),
        )]))
        .start(SERVICE_NAME, env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| Error::Bus(format!("cannot start the micro service: {e}")))?;
    let service_ref = &service;
    let person_send_all = subjects::person_all(subjects::PERSON_SESSION_SEND);
    let person_history_all = subjects::person_all(subjects::PERSON_SESSION_HISTORY);
    let endpoint = |name: &'static str, subject: &str| {
        let subject = subject.to_owned();
        async move {
            cyrene_bus::service::add_endpoint(service_ref, name, &subject)
                .await
                .map_err(Error::Bus)
        }
    };
    let send = endpoint("send", subjects::SESSION_SEND).await?;
    let history = endpoint("history", subjects::SESSION_HISTORY).await?;
    let steer = endpoint("steer", subjects::TURN_STEER).await?;
    let complete = endpoint("complete", subjects::TURN_COMPLETE).await?;
    let upload = endpoint("upload", document::DOCUMENT_UPLOAD).await?;
    let read = endpoint("read", document::DOCUMENT_READ).await?;
    let memory_read = endpoint("memory_read", mem::MEMORY_READ).await?;
    let memory_write = endpoint("memory_write", mem::MEMORY_WRITE).await?;
    let memory_forget = endpoint("memory_forget", mem::MEMORY_FORGET).await?;

    let options = ServeOptions {
        max_in_flight: config.max_in_flight,
        ..ServeOptions::default()
    };
    let person_send = endpoint("person-send", &person_send_all).await?;
    let person_history = endpoint("person-history", &person_history_all).await?;
    for send in [send, person_send] {
        let e = engine.clone();
        tasks.spawn(serve_json(
            send,
            options,
            shutdown.clone(),
            move |req: SendRequest, ctx: RequestContext| {
                let e = e.clone();
                async move {
                    people::may_touch(&ctx.subject, &req.session_id)?;
                    e.send(req).await
                }
            },
        ));
    }
    for history in [history, person_history] {
        let e = engine.clone();
        tasks.spawn(serve_json(
            history,
            options,
            shutdown.clone(),
            move |req: HistoryRequest, ctx: RequestContext| {
                let e = e.clone();
                async move {
                    people::may_touch(&ctx.subject, &req.session_id)?;
                    e.history(req).await
                }
            },
        ));
    }
    let e = engine.clone();
    tasks.spawn(serve_json(
        steer,
        options,
        shutdown.clone(),
        move |req: SteerRequest, _: RequestContext| {
            let e = e.clone();
            async move { e.steer(req).await }
        },
    ));
    let e = engine.clone();
    tasks.spawn(serve_json(
        upload,
        options,
        shutdown.clone(),
        move |req: UploadRequest, _: RequestContext| {
            let e = e.clone();
            async move { e.documents().upload(req).await }
        },
    ));
    let e = engine.clone();
    tasks.spawn(serve_json(
        read,
        options,
        shutdown.clone(),
        move |req: ReadRequest, _: RequestContext| {
            let e = e.clone();
            async move { e.documents().read(req).await }
        },
    ));
    let m = memory.clone();
    tasks.spawn(serve_json(
        memory_read,
        options,
        shutdown.clone(),
        move |req: mem::MemoryReadRequest, _: RequestContext| {
            let m = m.clone();
            async move { m.read(req).await }
        },
    ));
    let m = memory.clone();
    tasks.spawn(serve_json(
        memory_write,
        options,
        shutdown.clone(),
        move |req: mem::MemoryWriteRequest, _: RequestContext| {
            let m = m.clone();
            async move { m.write(req).await }
        },
    ));
    let m = memory;
    tasks.spawn(serve_json(
        memory_forget,
        options,
        shutdown.clone(),
        move |req: mem::MemoryForgetRequest, _: RequestContext| {
            let m = m.clone();
            async move { m.forget(req).await }
        },
    ));
    let e = engine;
    tasks.spawn(serve_json(
        complete,
        options,
        shutdown,
        move |req: TurnComplete, _: RequestContext| {
            let e = e.clone();
            async move { e.complete(req).await }
        },
    ));
    Ok(service)
}
