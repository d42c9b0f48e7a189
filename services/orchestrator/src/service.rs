//! The micro service `cyrene-orchestrator`: the endpoint table below, hosted by
//! [`cyrene_bus::host::Host`] in front of the [`Engine`] and the [`MemoryStore`].
//!
//! | endpoint   | subject                   | request          | reply             |
//! |------------|---------------------------|------------------|-------------------|
//! | `send`     | `cyrene.session.send`     | `SendRequest`    | `SendAck`         |
//! | `history`  | `cyrene.session.history`  | `HistoryRequest` | `HistoryResponse` |
//! | `steer`    | `cyrene.turn.steer`       | `SteerRequest`   | `SteerResponse`   |
//! | `complete` | `cyrene.turn.complete`    | `TurnComplete`   | `TurnCompleteAck` |
//! | `person-send`    | `cyrene.person.*.session.send`    | `SendRequest`    | `SendAck` |
//! | `person-history` | `cyrene.person.*.session.history` | `HistoryRequest` | `HistoryResponse` |
//! | `person-sessions` | `cyrene.person.*.session.list` | `SessionListRequest` | `SessionListResponse` |
//! | `person-upload` | `cyrene.person.*.document.upload` | `UploadRequest` | `UploadAck` |
//! | `bridge-send`    | `cyrene.bridge.session.send`      | `SendRequest`    | `SendAck` |
//! | `bridge-history` | `cyrene.bridge.session.history`   | `HistoryRequest` | `HistoryResponse` |
//! | `bridge-upload`  | `cyrene.bridge.document.upload`   | `UploadRequest`  | `UploadAck` |
//! | `turns-running`  | `cyrene.turns.running` | `RunningTurnsRequest` | `RunningTurnsResponse` |
//! | `approve`        | `cyrene.session.approve`          | `ApproveRequest`   | `ApproveResponse`   |
//! | `approvals`      | `cyrene.session.approvals`        | `ApprovalsRequest` | `ApprovalsResponse` |
//! | `person-approve` | `cyrene.person.*.session.approve` | `ApproveRequest`   | `ApproveResponse`   |
//! | `person-approvals` | `cyrene.person.*.session.approvals` | `ApprovalsRequest` | `ApprovalsResponse` |
//! | `bridge-approve` | `cyrene.bridge.session.approve`   | `ApproveRequest`   | `ApproveResponse`   |
//! | `bridge-approvals` | `cyrene.bridge.session.approvals` | `ApprovalsRequest` | `ApprovalsResponse` |
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
//! - `send`, `history`, `upload` and `person-upload` reach a session only when the request
//!   subject's caller may touch it ([`crate::people::may_touch`]): a person their own sessions,
//!   the shared subjects the sessions of nobody in particular; the bridge subjects the owner's
//!   ([`crate::identity`]).
//! - The approval endpoints follow the same rule, but answer `not_found` where the others say
//!   `forbidden` (crate::approvals).
//! - Only `bridge-send` takes a third party's `sender_name` or `env.restricted`
//!   ([`crate::identity::speaker`]).
//! - `turns-running` is read-only and names sessions of every person: only the operator's NATS
//!   user may publish on its subject (deploy/nats/users.conf, docs/security.md).

use crate::approvals::hide_forbidden;
use crate::engine::Engine;
use crate::identity::{self, Caller};
use crate::memory::MemoryStore;
use crate::{Error, SERVICE_NAME, people};
use cyrene_bus::host::{Endpoint, Host, ServiceSpec, with_state};
use cyrene_bus::service::ServeOptions;
use cyrene_protocol::approval::{ApprovalsRequest, ApproveRequest};
use cyrene_protocol::document::{self, ReadRequest, UploadRequest};
use cyrene_protocol::memory as mem;
use cyrene_protocol::session::{HistoryRequest, SendRequest, SessionListRequest};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::{RunningTurnsRequest, SteerRequest, TurnComplete};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Starts the micro service with its endpoint table, served until `shutdown`.
pub async fn start<M: MemoryStore + 'static>(
    engine: Arc<Engine>,
    memory: Arc<M>,
    shutdown: CancellationToken,
) -> Result<Host, Error> {
    let spec = ServiceSpec::new(
        SERVICE_NAME,
        env!("CARGO_PKG_VERSION"),
        "Cyrene sessions: exactly-once messages, the per-session turn fence, turn dispatch \
         (CYRENE_TURNS), steering and completion, history",
    )
    .with_metadata("cyrene.backend", engine.store.backend().name());
    let options = ServeOptions {
        max_in_flight: engine.config().max_in_flight,
        ..ServeOptions::default()
    };
    let endpoints = endpoints(&engine, &memory)
        .into_iter()
        .map(|endpoint| endpoint.options(options))
        .collect();
    Ok(Host::start(engine.client(), spec, endpoints, shutdown).await?)
}

/// The endpoint table, in registration order (`$SRV.INFO` lists them so).
fn endpoints<M: MemoryStore + 'static>(engine: &Arc<Engine>, memory: &Arc<M>) -> Vec<Endpoint> {
    let send = || {
        with_state(engine, |e, req: SendRequest, ctx| async move {
            people::may_touch(&ctx.subject, &req.session_id)?;
            e.send(req, Caller::of(&ctx.subject)).await
        })
    };
    let history = || {
        with_state(engine, |e, req: HistoryRequest, ctx| async move {
            people::may_touch(&ctx.subject, &req.session_id)?;
            e.history(req).await
        })
    };
    let upload = || {
        with_state(engine, |e, req: UploadRequest, ctx| async move {
            people::may_touch(&ctx.subject, &req.session_id)?;
            e.documents().upload(req).await
        })
    };
    let person_upload = subjects::person_all(subjects::PERSON_DOCUMENT_UPLOAD);
    let bridge_send = with_state(engine, |e, req: SendRequest, _| async move {
        identity::bridge_may_touch(e.config().owner.as_deref(), &req.session_id)?;
        e.send(req, Caller::Bridge).await
    });
    let bridge_history = with_state(engine, |e, req: HistoryRequest, _| async move {
        identity::bridge_may_touch(e.config().owner.as_deref(), &req.session_id)?;
        e.history(req).await
    });
    let bridge_upload = with_state(engine, |e, req: UploadRequest, _| async move {
        identity::bridge_may_touch(e.config().owner.as_deref(), &req.session_id)?;
        e.documents().upload(req).await
    });
    let approve = || {
        with_state(engine, |e, req: ApproveRequest, ctx| async move {
            people::may_touch(&ctx.subject, &req.session_id).map_err(hide_forbidden)?;
            e.approve(req, Caller::of(&ctx.subject)).await
        })
    };
    let approvals = || {
        with_state(engine, |e, req: ApprovalsRequest, ctx| async move {
            people::may_touch(&ctx.subject, &req.session_id).map_err(hide_forbidden)?;
            e.approvals(req).await
        })
    };
    let bridge_approve = with_state(engine, |e, req: ApproveRequest, _| async move {
        identity::bridge_may_touch(e.config().owner.as_deref(), &req.session_id)
            .map_err(hide_forbidden)?;
        e.approve(req, Caller::Bridge).await
    });
    let bridge_approvals = with_state(engine, |e, req: ApprovalsRequest, _| async move {
        identity::bridge_may_touch(e.config().owner.as_deref(), &req.session_id)
            .map_err(hide_forbidden)?;
        e.approvals(req).await
    });
    let person_send = subjects::person_all(subjects::PERSON_SESSION_SEND);
    let person_history = subjects::person_all(subjects::PERSON_SESSION_HISTORY);
    vec![
        Endpoint::json("send", subjects::SESSION_SEND, send()),
        Endpoint::json("history", subjects::SESSION_HISTORY, history()),
        Endpoint::json(
            "steer",
            subjects::TURN_STEER,
            with_state(engine, |e, req: SteerRequest, _| async move {
                e.steer(req).await
            }),
        ),
        Endpoint::json(
            "complete",
            subjects::TURN_COMPLETE,
            with_state(engine, |e, req: TurnComplete, _| async move {
                e.complete(req).await
            }),
        ),
        Endpoint::json("upload", document::DOCUMENT_UPLOAD, upload()),
        Endpoint::json(
            "read",
            document::DOCUMENT_READ,
            with_state(engine, |e, req: ReadRequest, _| async move {
                e.documents().read(req).await
            }),
        ),
        Endpoint::json(
            "memory_read",
            mem::MEMORY_READ,
            with_state(memory, |m, req: mem::MemoryReadRequest, _| async move {
                m.read(req).await
            }),
        ),
        Endpoint::json(
            "memory_write",
            mem::MEMORY_WRITE,
            with_state(memory, |m, req: mem::MemoryWriteRequest, _| async move {
                m.write(req).await
            }),
        ),
        Endpoint::json(
            "memory_forget",
            mem::MEMORY_FORGET,
            with_state(memory, |m, req: mem::MemoryForgetRequest, _| async move {
                m.forget(req).await
            }),
        ),
        Endpoint::json("person-send", person_send, send()),
        Endpoint::json("person-history", person_history, history()),
        Endpoint::json(
            "person-sessions",
            subjects::person_all(subjects::PERSON_SESSION_LIST),
            // the person is the subject's (only their NATS user publishes there), never the body's
            with_state(engine, |e, req: SessionListRequest, ctx| async move {
                let person = subjects::person_of(&ctx.subject).unwrap_or_default();
                e.sessions(person, req).await
            }),
        ),
        Endpoint::json("person-upload", person_upload, upload()),
        Endpoint::json("bridge-send", subjects::BRIDGE_SESSION_SEND, bridge_send),
        Endpoint::json(
            "bridge-history",
            subjects::BRIDGE_SESSION_HISTORY,
            bridge_history,
        ),
        Endpoint::json(
            "bridge-upload",
            subjects::BRIDGE_DOCUMENT_UPLOAD,
            bridge_upload,
        ),
        Endpoint::json("approve", subjects::SESSION_APPROVE, approve()),
        Endpoint::json("approvals", subjects::SESSION_APPROVALS, approvals()),
        Endpoint::json(
            "person-approve",
            subjects::person_all(subjects::PERSON_SESSION_APPROVE),
            approve(),
        ),
        Endpoint::json(
            "person-approvals",
            subjects::person_all(subjects::PERSON_SESSION_APPROVALS),
            approvals(),
        ),
        Endpoint::json(
            "bridge-approve",
            subjects::BRIDGE_SESSION_APPROVE,
            bridge_approve,
        ),
        Endpoint::json(
            "bridge-approvals",
            subjects::BRIDGE_SESSION_APPROVALS,
            bridge_approvals,
        ),
        Endpoint::json(
            "turns-running",
            subjects::TURNS_RUNNING,
            with_state(engine, |e, req: RunningTurnsRequest, _| async move {
                e.running_turns(req).await
            }),
        ),
    ]
}
