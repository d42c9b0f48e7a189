//! `deploy/nats/cyrene.conf` — the least-privilege server config — run as is (passwords filled
//! in): the whole system works with each service connected as its own user, what a user is not
//! allowed is refused by the server (docs/architecture.md §8), only operators reach `$SRV.>`,
//! external tools run as `cyrene-tools`, and no malformed header block a user may publish costs a
//! service its connection. The full matrix — every user, every subject family, publish and
//! subscribe — is checked against the server and against docs/security.md.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use async_nats::{ConnectOptions, Event, ServerError};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene::stack::Stack;
use cyrene_bus::{Auth, BusConfig, ConnectMode, Secret, request_json};
use cyrene_comm::Probe;
use cyrene_model_gateway::providers::scripted::RequestLog;
use cyrene_protocol::document::{DOCUMENT_UPLOAD, MAX_CHUNK_BYTES, UploadAck, UploadRequest};
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{HistoryRequest, HistoryResponse, SendAck, SendRequest, SessionEnv};
use cyrene_protocol::subjects;
use cyrene_test_support::fixtures::send_request;
use cyrene_test_support::shipped::shipped_config;
use cyrene_test_support::{MALFORMED_HEADER_BLOCKS, NatsServer, RawConnection, subscribed};
use futures::StreamExt;
use serde_json::json;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Every user of the config, in the order of `SHIPPED_PASSWORDS` and of the matrix's columns.
const MATRIX_USERS: [(&str, &str); 13] = [
    ("cyrene-model-gateway", "pw-gateway"),
    ("cyrene-checkpoint-store", "pw-store"),
    ("cyrene-orchestrator", "pw-orchestrator"),
    ("cyrene-loop-worker", "pw-worker"),
    ("cyrene-tools", "pw-tools"),
    ("cyrene-mcp-bridge", "pw-mcp-bridge"),
    ("cyrene-guard", "pw-guard"),
    ("cyrene-client", "pw-client"),
    ("cyrene-operator", "pw-operator"),
    ("agent-hoshi", "pw-hoshi"),
    ("person-alice", "pw-alice"),
    ("person-bob", "pw-bob"),
    ("cyrene-bridge", "pw-bridge"),
];

/// Who may publish (`pub`) and subscribe (`sub`) on what: one row per subject family (a
/// concrete subject of it, what the row means), one cell per user of [`MATRIX_USERS`] but the
/// last (`cyrene-bridge`, whose few permitted cells are [`BRIDGE_COLUMN`]). Replies
/// through `allow_responses` (to the reply subject of a request the user received) are not
/// rows: they exist only while a request is answered. docs/security.md holds this table as
/// [`render_matrix`] prints it.
const MATRIX: &[(&str, &str, [&str; 10])] = {
    const N: &str = "—";
    const P: &str = "pub";
    const S: &str = "sub";
    const PS: &str = "pub sub";
    &[
        // subject, what; gateway, store, orchestrator, worker, tools, client, operator, hoshi,
        // alice, bob
        (
            "cyrene.session.send",
            "a person sends a message",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.session.history",
            "a transcript is read",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.session.approve",
            "a tool call that waits is decided",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.session.approvals",
            "a session's approvals are listed",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.session.s1.events",
            "a session's live events",
            [N, N, P, P, N, S, N, N, N, N],
        ),
        (
            "cyrene.person.alice.session.send",
            "a person sends to their own session",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.session.history",
            "a person reads their own transcript",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.checkpoint.latest",
            "a person's last checkpoint",
            [N, S, N, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.checkpoint.get",
            "one checkpoint of a person's",
            [N, S, N, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.checkpoint.list",
            "a person's checkpoints",
            [N, S, N, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.session.list",
            "a person lists their sessions",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.document.upload",
            "a person uploads a document",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.session.approve",
            "a person decides a call of their own session",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.alice.session.approvals",
            "a person lists their session's approvals",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.person.bob.session.approve",
            "another person decides",
            [N, N, S, N, N, N, N, N, N, P],
        ),
        (
            "cyrene.person.bob.session.send",
            "another person sends",
            [N, N, S, N, N, N, N, N, N, P],
        ),
        (
            "cyrene.bridge.session.send",
            "a chat bridge sends to the owner's session",
            [N, N, S, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.bridge.session.history",
            "a chat bridge reads the owner's transcript",
            [N, N, S, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.bridge.document.upload",
            "a chat bridge uploads a file posted in a room",
            [N, N, S, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.bridge.session.approve",
            "a chat bridge decides a call of the owner's session",
            [N, N, S, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.bridge.session.approvals",
            "a chat bridge lists the owner's session's approvals",
            [N, N, S, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.session.alice.s1.events",
            "a person's session's live events",
            [N, N, P, P, N, N, N, N, S, N],
        ),
        (
            "cyrene.session.bob.s1.events",
            "another person's session's events",
            [N, N, P, P, N, N, N, N, N, S],
        ),
        (
            "cyrene.agent.alice.cyrene.ask",
            "a person asks a persona as themself",
            [N, N, S, N, N, N, N, N, P, N],
        ),
        (
            "cyrene.agent.cyrene.alice.reply.q1",
            "a persona answers a person",
            [N, N, N, N, N, N, N, N, S, N],
        ),
        (
            "cyrene.agent.bob.event",
            "a person broadcasts as themself",
            [N, N, S, N, N, N, N, S, N, P],
        ),
        (
            "cyrene.turn.steer",
            "a turn takes in new messages",
            [N, N, S, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.turn.input.t1",
            "a message pushed to a running turn",
            [N, N, P, S, N, N, N, N, N, N],
        ),
        (
            "cyrene.turn.complete",
            "a turn ends",
            [N, N, S, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.document.upload",
            "a person uploads a document",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.document.read",
            "a turn reads a document",
            [N, N, S, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.memory.read",
            "a persona's memory is read",
            [N, N, S, P, N, N, P, N, N, N],
        ),
        (
            "cyrene.memory.write",
            "a persona's memory is written",
            [N, N, S, N, N, N, P, N, N, N],
        ),
        (
            "cyrene.turn.run",
            "a turn is dispatched (JetStream)",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.memory.extract.t1",
            "a memory extraction is queued (JetStream)",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.checkpoint.save",
            "a step is checkpointed",
            [N, S, N, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.checkpoint.latest",
            "the last checkpoint (the worker resumes a turn)",
            [N, S, N, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.checkpoint.get",
            "one checkpoint",
            [N, S, N, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.checkpoint.list",
            "checkpoints of an owner",
            [N, S, N, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.checkpoint.retain",
            "checkpoints are deleted",
            [N, S, N, N, N, N, P, N, N, N],
        ),
        (
            "cyrene.checkpoint.progress",
            "how far running turns have got",
            [N, S, P, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.turns.running",
            "the turns in flight are listed",
            [N, N, S, N, N, N, P, N, N, N],
        ),
        (
            "cyrene.model.complete",
            "a model call",
            [S, N, P, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.model.complete.stream",
            "a streamed model call",
            [S, N, N, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.model.complete.stream.r1",
            "a held view continues on its replica",
            [S, N, N, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.model.route",
            "a route is explained",
            [S, N, N, P, N, N, N, N, N, N],
        ),
        (
            "cyrene.model.calls",
            "call records",
            [P, N, N, N, N, N, S, N, N, N],
        ),
        (
            "cyrene.agent.me.cyrene.ask",
            "a person asks a persona",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.agent.me.hoshi.ask",
            "a person asks an agent",
            [N, N, N, N, N, P, N, S, N, N],
        ),
        (
            "cyrene.agent.hoshi.cyrene.ask",
            "an agent asks a persona",
            [N, N, S, N, N, N, N, P, N, N],
        ),
        (
            "cyrene.agent.cyrene.hoshi.ask",
            "a persona asks an agent",
            [N, N, N, P, N, N, N, S, N, N],
        ),
        (
            "cyrene.agent.hoshi.me.ask",
            "an agent asks a person",
            [N, N, N, N, N, N, N, P, N, N],
        ),
        (
            "cyrene.agent.cyrene.me.reply.q1",
            "a persona answers a person",
            [N, N, N, N, N, S, N, N, N, N],
        ),
        (
            "cyrene.agent.hoshi.cyrene.reply.q1",
            "an agent answers a persona",
            [N, N, N, S, N, N, N, N, N, N],
        ),
        (
            "cyrene.agent.cyrene.hoshi.reply.q1",
            "a persona answers an agent",
            [N, N, N, N, N, N, N, S, N, N],
        ),
        (
            "cyrene.agent.me.cyrene.event",
            "a person notifies a persona",
            [N, N, S, N, N, P, N, N, N, N],
        ),
        (
            "cyrene.agent.hoshi.cyrene.event",
            "an agent notifies a persona",
            [N, N, S, N, N, N, N, P, N, N],
        ),
        (
            "cyrene.agent.cyrene.hoshi.event",
            "a persona notifies an agent",
            [N, N, N, P, N, N, N, S, N, N],
        ),
        (
            "cyrene.agent.me.event",
            "a person broadcasts",
            [N, N, S, N, N, P, N, S, N, N],
        ),
        (
            "cyrene.agent.cyrene.event",
            "a persona broadcasts",
            [N, N, S, P, N, N, N, S, N, N],
        ),
        (
            "cyrene.agent.hoshi.event",
            "an agent broadcasts",
            [N, N, S, N, N, N, N, PS, N, N],
        ),
        (
            "cyrene.orchestrator.ask.a1.done",
            "an ask's turn ended (between replicas)",
            [N, N, PS, N, N, N, N, N, N, N],
        ),
        (
            "cyrene.tool.search_notes",
            "a tool call",
            [N, N, N, P, S, N, N, N, N, N],
        ),
        (
            "cyrene.guard.policy",
            "a persona's guard is asked",
            [N, N, N, P, N, N, N, N, N, N],
        ),
        (
            "$SRV.PING",
            "discovery of every service",
            [S, S, S, S, S, N, P, N, N, N],
        ),
        (
            "$SRV.INFO",
            "tools and endpoints of every service",
            [S, S, S, PS, S, N, P, N, N, N],
        ),
        (
            "$SRV.STATS.cyrene-orchestrator",
            "one service's figures",
            [S, S, S, S, S, N, P, N, N, N],
        ),
        (
            "$JS.API.INFO",
            "JetStream account info",
            [N, N, P, P, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.CREATE.CYRENE_TURNS",
            "the turn queue is created",
            [N, N, P, P, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.DELETE.CYRENE_TURNS",
            "the turn queue is deleted",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.PURGE.CYRENE_TURNS",
            "the turn queue is purged",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "$O.CYRENE_DOCUMENTS.C.x",
            "document bytes are stored (object store)",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.CREATE.OBJ_CYRENE_DOCUMENTS",
            "the document bucket is created",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.UPDATE.OBJ_CYRENE_DOCUMENTS",
            "the document bucket's size limit is set",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.DELETE.OBJ_CYRENE_DOCUMENTS",
            "the document bucket is deleted",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.CREATE.CYRENE_MEMORY",
            "the memory extraction queue is created",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.PURGE.CYRENE_MEMORY",
            "the memory extraction queue is purged",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.CONSUMER.MSG.NEXT.CYRENE_MEMORY.cyrene-memory",
            "an orchestrator pulls a memory extraction",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "$JS.ACK.CYRENE_MEMORY.cyrene-memory.1.1.1.1.0",
            "an orchestrator acknowledges a memory extraction",
            [N, N, P, N, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.MSG.GET.CYRENE_TURNS",
            "a queued turn is read",
            [N, N, N, P, N, N, N, N, N, N],
        ),
        (
            "$JS.API.CONSUMER.MSG.NEXT.CYRENE_TURNS.loop-workers",
            "a worker pulls a turn",
            [N, N, N, P, N, N, N, N, N, N],
        ),
        (
            "$JS.ACK.CYRENE_TURNS.loop-workers.1.1.1.1.0",
            "a worker acknowledges a turn",
            [N, N, N, P, N, N, N, N, N, N],
        ),
        (
            "$KV.CYRENE_EXTRACTIONS.d-1",
            "a PDF extraction is recorded",
            [N, N, N, P, N, N, N, N, N, N],
        ),
        (
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.CYRENE_TURNS.loop-workers",
            "a turn ran out of deliveries",
            [N, N, N, S, N, N, N, N, N, N],
        ),
        (
            "$JS.API.STREAM.CREATE.OTHER",
            "any other stream",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "_INBOX.a1",
            "default inboxes",
            [N, N, N, N, N, S, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-cli.a1",
            "replies to the cyrene CLI",
            [N, N, N, N, N, S, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-operator.a1",
            "replies to an operator's nats CLI",
            [N, N, N, N, N, N, S, N, N, N],
        ),
        (
            "_INBOX_person-alice.a1",
            "replies to a person",
            [N, N, N, N, N, N, N, N, S, N],
        ),
        (
            "_INBOX_person-bob.a1",
            "replies to another person",
            [N, N, N, N, N, N, N, N, N, S],
        ),
        (
            "_INBOX_cyrene-matrix-bridge.a1",
            "replies to the bridge",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-mcp-bridge.a1",
            "replies to the MCP bridge",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-model-gateway.a1",
            "replies to the gateway",
            [S, N, N, N, N, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-checkpoint-store.a1",
            "replies to the store",
            [N, S, N, N, N, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-orchestrator.a1",
            "replies to the orchestrator",
            [N, N, S, N, N, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-loop-worker.a1",
            "replies to the worker",
            [N, N, N, S, N, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-tools.a1",
            "replies to a tool",
            [N, N, N, N, S, N, N, N, N, N],
        ),
        (
            "_INBOX_cyrene-guard.a1",
            "replies to a guard",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "$SYS.REQ.SERVER.PING",
            "the server's system account",
            [N, N, N, N, N, N, N, N, N, N],
        ),
        (
            "anything.else",
            "any other subject",
            [N, N, N, N, N, N, N, N, N, N],
        ),
    ]
};

/// The `cyrene-bridge` column of the matrix: the subjects (rows of [`MATRIX`]) it may use, `—`
/// on every other row. The owner of the shipped file is `alice`.
const BRIDGE_COLUMN: &[(&str, &str)] = &[
    ("cyrene.session.alice.s1.events", "sub"),
    ("cyrene.bridge.session.send", "pub"),
    ("cyrene.bridge.session.history", "pub"),
    ("cyrene.bridge.document.upload", "pub"),
    ("cyrene.bridge.session.approve", "pub"),
    ("cyrene.bridge.session.approvals", "pub"),
    ("_INBOX_cyrene-matrix-bridge.a1", "sub"),
];

/// The `cyrene-mcp-bridge` column of the matrix (after `cyrene-tools`): like [`BRIDGE_COLUMN`].
/// It serves tools and answers discovery, nothing more.
const MCP_BRIDGE_COLUMN: &[(&str, &str)] = &[
    ("cyrene.tool.search_notes", "sub"),
    ("$SRV.PING", "sub"),
    ("$SRV.INFO", "sub"),
    ("$SRV.STATS.cyrene-orchestrator", "sub"),
    ("_INBOX_cyrene-mcp-bridge.a1", "sub"),
];

/// The `cyrene-guard` column of the matrix (after `cyrene-mcp-bridge`): like [`BRIDGE_COLUMN`].
/// A guard is asked on `cyrene.guard.<name>` and answers discovery, nothing more.
const GUARD_COLUMN: &[(&str, &str)] = &[
    ("cyrene.guard.policy", "sub"),
    ("$SRV.PING", "sub"),
    ("$SRV.INFO", "sub"),
    ("$SRV.STATS.cyrene-orchestrator", "sub"),
    ("_INBOX_cyrene-guard.a1", "sub"),
];

/// The full row of the matrix: its cells with the MCP bridge's and the guard's after
/// `cyrene-tools` and the chat bridge's last.
fn full_row<'a>(subject: &str, cells: &[&'a str; 10]) -> Vec<&'a str> {
    let cell = |column: &[(&str, &'static str)]| {
        column
            .iter()
            .find(|(s, _)| *s == subject)
            .map_or("—", |(_, cell)| *cell)
    };
    let (services, people) = cells.split_at(5);
    services
        .iter()
        .copied()
        .chain([cell(MCP_BRIDGE_COLUMN), cell(GUARD_COLUMN)])
        .chain(people.iter().copied())
        .chain([cell(BRIDGE_COLUMN)])
        .collect()
}

const SERVICES: [&str; 4] = [
    "cyrene-checkpoint-store",
    "cyrene-loop-worker",
    "cyrene-model-gateway",
    "cyrene-orchestrator",
];

/// What `$SRV.PING` finds: the services and the test's tools (run as `cyrene-tools`), by name.
const DISCOVERABLE: [&str; 5] = [
    "cyrene-checkpoint-store",
    "cyrene-loop-worker",
    "cyrene-model-gateway",
    "cyrene-orchestrator",
    "test-tools",
];

/// deploy/nats/users.conf, the users and their permissions.
fn users_conf() -> String {
    std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/nats/users.conf"
    ))
    .unwrap()
}

fn server() -> NatsServer {
    // The WebSocket listener on a port of its own (tests run side by side).
    let config = shipped_config(Path::new(env!("CARGO_MANIFEST_DIR")), -1, &[]);
    NatsServer::builder().config(config).start()
}

fn url(server: &NatsServer, user: &str, password: &str) -> String {
    format!("nats://{user}:{password}@127.0.0.1:{}", server.port())
}

/// Connects as `user`; the connection name `name` sets the inbox prefix (`_INBOX_<name>`).
async fn connect_as(
    server: &NatsServer,
    user: &str,
    password: &str,
    name: &str,
) -> async_nats::Client {
    let config = BusConfig::new(url(server, user, password), name, ConnectMode::Client);
    cyrene_bus::connect(&config).await.unwrap()
}

/// The permission violations the server reported to a [`watched`] connection.
type Violations = Arc<Mutex<Vec<String>>>;

/// A raw connection that records the permission violations the server reports.
async fn watched(
    server: &NatsServer,
    user: &str,
    password: &str,
) -> (async_nats::Client, Violations) {
    let violations = Arc::new(Mutex::new(Vec::new()));
    let v = violations.clone();
    let client = ConnectOptions::new()
        .user_and_password(user.into(), password.into())
        .custom_inbox_prefix(format!("_INBOX_{user}"))
        .event_callback(move |event| {
            let v = v.clone();
            async move {
                if let Event::ServerError(ServerError::Other(message)) = event {
                    v.lock().unwrap().push(message);
                }
            }
        })
        .connect(format!("nats://127.0.0.1:{}", server.port()))
        .await
        .unwrap();
    (client, violations)
}

async fn refused(violations: &Violations, what: &str) {
    let v = violations.clone();
    common::eventually(
        &format!("the server refuses: {what}"),
        Duration::from_secs(10),
        move || {
            v.lock()
                .unwrap()
                .iter()
                .any(|m| m.to_lowercase().contains("permissions violation"))
        },
    )
    .await;
    violations.lock().unwrap().clear();
}

/// `client` (a [`watched`] connection) publishes `body` on `subject`; the server refuses it.
async fn publish_refused(
    client: &async_nats::Client,
    violations: &Violations,
    subject: &str,
    body: &'static str,
    what: &str,
) {
    client
        .publish(subject.to_owned(), body.into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    refused(violations, what).await;
}

/// `user`, on a [`watched`] connection of its own, publishes on each of `subjects`; the server
/// refuses every one (`who` says who tries, for the failure message). Returns the connection.
async fn publishing_refused(
    server: &NatsServer,
    (user, password): (&str, &str),
    subjects: &[&str],
    who: &str,
) -> async_nats::Client {
    let (client, violations) = watched(server, user, password).await;
    for subject in subjects {
        let what = format!("{who} {subject}");
        publish_refused(&client, &violations, subject, "{}", &what).await;
    }
    client
}

/// `client` (a [`watched`] connection) subscribes to `subject`; the server refuses it. The
/// subscription is returned so that the caller decides how long it lives.
async fn subscribe_refused(
    client: &async_nats::Client,
    violations: &Violations,
    subject: &str,
    what: &str,
) -> async_nats::Subscriber {
    let subscription = subscribed(client, subject.to_owned()).await;
    refused(violations, what).await;
    subscription
}

/// `client` asks the persona as `me` on its own subject with a body that names `forged` as the
/// sender; the persona refuses it as `forbidden`.
async fn forged_ask_is_forbidden(client: &async_nats::Client, me: &str, forged: &str) {
    let ask = format!("cyrene.agent.{me}.cyrene.ask");
    let reply = format!("cyrene.agent.cyrene.{me}.reply.q9");
    let forged = json!({"id":"q9","from":forged,"to":"cyrene","question":"what time is it?"});
    let mut replies = subscribed(client, reply.clone()).await;
    let payload = serde_json::to_vec(&forged).unwrap().into();
    client
        .publish_with_reply(ask, reply.clone(), payload)
        .await
        .unwrap();
    let refusal = tokio::time::timeout(Duration::from_secs(10), replies.next())
        .await
        .unwrap()
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&refusal.payload).unwrap();
    assert_eq!(body["error"]["code"], "forbidden", "{body}");
}

/// Sends `send` on `subject` as `client`; the orchestrator acknowledges it.
async fn sent(client: &async_nats::Client, subject: &str, send: &SendRequest) -> SendAck {
    request_json(client, subject, send, Duration::from_secs(5))
        .await
        .unwrap()
}

/// The first assistant answer in `session`'s transcript (read on `subject`), polled for until
/// there is one.
async fn first_answer(client: &async_nats::Client, subject: &str, session: &str) -> String {
    loop {
        let history = history_on(client, subject, session).await.unwrap();
        if let Some(answer) = history
            .messages
            .iter()
            .find(|e| e.message.role == Role::Assistant)
        {
            return answer.message.text_content();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`first_answer`] within 30 s; `what` names the turn that must be answered.
async fn answered(client: &async_nats::Client, subject: &str, session: &str, what: &str) -> String {
    tokio::time::timeout(
        Duration::from_secs(30),
        first_answer(client, subject, session),
    )
    .await
    .expect(what)
}

/// The transcript of `session`.
async fn history(
    cli: &async_nats::Client,
    session: &str,
) -> Result<HistoryResponse, cyrene_bus::RequestError> {
    history_on(cli, subjects::SESSION_HISTORY, session).await
}

/// The transcript of `session`, read on `subject`.
async fn history_on(
    cli: &async_nats::Client,
    subject: &str,
    session: &str,
) -> Result<HistoryResponse, cyrene_bus::RequestError> {
    let request = HistoryRequest {
        session_id: session.into(),
        limit: None,
        before_seq: None,
    };
    request_json(cli, subject, &request, Duration::from_secs(5)).await
}

/// The services answering one `$SRV.PING`, by name (what `nats micro ls` gathers).
async fn discovered(operator: &async_nats::Client) -> Vec<String> {
    let inbox = operator.new_inbox();
    let mut replies = operator.subscribe(inbox.clone()).await.unwrap();
    operator
        .publish_with_reply("$SRV.PING", inbox, "".into())
        .await
        .unwrap();
    let mut names = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while names.len() < DISCOVERABLE.len() {
            let Some(reply) = replies.next().await else {
                return;
            };
            let info: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            names.push(info["name"].as_str().unwrap_or_default().to_owned());
        }
    })
    .await;
    names.sort();
    names
}

/// The services of [`start_services`] and their data dir; stopped when dropped.
struct Running {
    _stack: Stack,
    _data: tempfile::TempDir,
}

/// The four services, each connected as its own user, and the test tools as `cyrene-tools`;
/// returns once an operator sees every one of them (the operator, the tools, the running
/// services, what the model was asked). The owner is `alice`.
async fn start_services(
    server: &NatsServer,
    shutdown: &CancellationToken,
) -> (
    async_nats::Client,
    Arc<common::TestTools>,
    Running,
    RequestLog,
) {
    let data = tempfile::tempdir().unwrap();

    let rules = json!([{"contains": "time", "tool_calls": [{"name": "current_time"}],
                        "after_tools": "It is {tool_results}."},
                       {"contains": "count", "tool_calls": [{"name": "count"}],
                        "after_tools": "Counted: {tool_results}."}]);
    let mut stack = Stack::builder(common::bus_config(server), data.path())
        .shutdown(shutdown.clone())
        .models(common::models(rules))
        .orchestrator_with(|orchestrator| orchestrator.owner = Some("alice".into()))
        .workers(1, common::worker_config());
    // Each service as its own user, and external tools as the tools user.
    for (user, password) in MATRIX_USERS {
        if SERVICES.contains(&user) || user == "cyrene-tools" {
            let password = Secret::new(password);
            let auth = Auth::UserPassword {
                user: user.into(),
                password,
            };
            stack = stack.user(user, auth);
        }
    }
    let stack = stack.start().await.unwrap();
    let model = stack.model_log("offline").unwrap();
    let client = stack.connect("cyrene-tools").await.unwrap();
    let tools = common::TestTools::start(&client, shutdown.clone()).await;

    // An operator (as `cyrene probe` connects) waits for the services.
    let operator = connect_as(server, "cyrene-operator", "pw-operator", "cyrene-operator").await;
    for name in SERVICES.into_iter().chain(["test-tools"]) {
        common::wait_for_service(&operator, name).await;
    }

    let running = Running {
        _stack: stack,
        _data: data,
    };
    (operator, tools, running, model)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_works_as_its_own_user_and_forbidden_subjects_are_refused() {
    let server = server();
    let shutdown = CancellationToken::new();
    let (operator, tools, _data, _model) = start_services(&server, &shutdown).await;

    // A person's client: one full turn with a tool call, answered in the transcript.
    let cli = connect_as(&server, "cyrene-client", "pw-client", "cyrene-cli").await;
    let send = send_request(
        "p1",
        Message::text(Role::User, "what time is it?"),
        "cli",
        "k1",
    );
    let ack = sent(&cli, subjects::SESSION_SEND, &send).await;
    assert!(!ack.turn_id.is_empty());
    let what = "the turn is answered under least privilege";
    let answer = answered(&cli, subjects::SESSION_HISTORY, "p1", what).await;
    assert!(answer.starts_with("It is "), "{answer}");
    // A turn calls an external tool served by the tools user (once the worker has discovered
    // it: a turn before that is answered with an unknown-tool result, so each try is a new
    // session).
    let counted = tokio::time::timeout(Duration::from_secs(30), async {
        for attempt in 0_u32.. {
            let session = format!("tools{attempt}");
            let message = Message::text(Role::User, "count, please");
            let send = send_request(&session, message, "cli", &format!("t{attempt}"));
            sent(&cli, subjects::SESSION_SEND, &send).await;
            let answer = first_answer(&cli, subjects::SESSION_HISTORY, &session).await;
            if answer.contains("count ran as") {
                return answer;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        String::new()
    })
    .await
    .expect("a turn calls the tool served as cyrene-tools");
    assert!(counted.starts_with("Counted: "), "{counted}");
    assert!(!tools.runs.lock().unwrap().is_empty());
    // A document uploaded in two chunks by a person reaches the model through the worker's
    // read: the object store works under the orchestrator's permissions, the read under the
    // worker's.
    let mut text = "the tea is oolong. ".repeat(40_000).into_bytes();
    text.truncate(700 * 1024);
    let mut upload_id = String::new();
    let mut document = None;
    for (seq, piece) in text.chunks(MAX_CHUNK_BYTES).enumerate() {
        let last = (seq + 1) * MAX_CHUNK_BYTES >= text.len();
        let request = UploadRequest {
            session_id: "doc1".into(),
            name: "tea.txt".into(),
            upload_id: upload_id.clone(),
            seq: seq as u32,
            data: BASE64.encode(piece),
            last,
            ..Default::default()
        };
        let ack: UploadAck = request_json(&cli, DOCUMENT_UPLOAD, &request, Duration::from_secs(5))
            .await
            .unwrap();
        upload_id = ack.upload_id;
        document = ack.document;
    }
    let document = document.expect("the last chunk issues the document");
    let message = Message {
        content: vec![document.part],
        ..Message::text(Role::User, "")
    };
    sent(
        &cli,
        subjects::SESSION_SEND,
        &send_request("doc1", message, "cli", "d1"),
    )
    .await;
    let what = "the document turn is answered under least privilege";
    let read = answered(&cli, subjects::SESSION_HISTORY, "doc1", what).await;
    assert!(read.contains("the tea is oolong."), "{read}");
    // … and no service ran into its limits on the way (the server logs every violation).
    let log = std::fs::read_to_string(server.log_path()).unwrap();
    assert!(
        !log.contains("Violation"),
        "a service needs more than it is allowed:\n{log}"
    );

    // What each user may not do.
    let (gateway, violations) = watched(&server, "cyrene-model-gateway", "pw-gateway").await;
    let what = "the gateway dispatching a turn";
    publish_refused(&gateway, &violations, subjects::TURN_RUN, "{}", what).await;

    let (worker, violations) = watched(&server, "cyrene-loop-worker", "pw-worker").await;
    let what = "a worker listening to user messages";
    let _sub = subscribe_refused(&worker, &violations, subjects::SESSION_SEND, what).await;
    let what = "a worker deleting checkpoints";
    publish_refused(
        &worker,
        &violations,
        subjects::CHECKPOINT_RETAIN,
        "{}",
        what,
    )
    .await;

    let (orchestrator, violations) =
        watched(&server, "cyrene-orchestrator", "pw-orchestrator").await;
    let what = "the orchestrator listening to asks meant for hoshi";
    let _sub = subscribe_refused(
        &orchestrator,
        &violations,
        "cyrene.agent.me.hoshi.ask",
        what,
    )
    .await;

    let (client, violations) = watched(&server, "cyrene-client", "pw-client").await;
    let what = "a client forging a turn completion";
    publish_refused(&client, &violations, subjects::TURN_COMPLETE, "{}", what).await;

    // Nobody speaks as another agent: not an agent, not a person, not the worker.
    let who = "agent hoshi publishing";
    let subjects = [
        "cyrene.agent.cyrene.me.ask",
        "cyrene.agent.cyrene.hoshi.event",
        "cyrene.agent.cyrene.event",
        "cyrene.agent.hoshi.me.reply.q1",
        "cyrene.agent.hoshi.a.b.c",
    ];
    let hoshi = publishing_refused(&server, ("agent-hoshi", "pw-hoshi"), &subjects, who).await;
    let who = "a client publishing";
    let subjects = [
        "cyrene.agent.hoshi.cyrene.ask",
        "cyrene.agent.cyrene.hoshi.ask",
        "cyrene.agent.hoshi.event",
        "cyrene.agent.cyrene.me.event",
    ];
    publishing_refused(&server, ("cyrene-client", "pw-client"), &subjects, who).await;
    let (worker, violations) = watched(&server, "cyrene-loop-worker", "pw-worker").await;
    let what = "the worker asking as an external agent";
    let subject = "cyrene.agent.hoshi.cyrene.ask";
    publish_refused(&worker, &violations, subject, "{}", what).await;

    // What they may do: hoshi asks as itself and is answered; a body claiming another name on
    // its own subject is refused by the agent (`forbidden`); a person asks under their own name.
    let reply = Probe::new(hoshi.clone(), "hoshi")
        .ask("cyrene", "what time is it?")
        .await
        .unwrap();
    assert!(reply.text.starts_with("It is "), "{}", reply.text);
    forged_ask_is_forbidden(&hoshi, "hoshi", "主人").await;
    let reply = Probe::new(cli.clone(), "me")
        .ask("cyrene", "what time is it?")
        .await
        .unwrap();
    assert!(reply.text.starts_with("It is "), "{}", reply.text);

    // Discovery reaches every service with one message: operators only.
    let (client, violations) = watched(&server, "cyrene-client", "pw-client").await;
    let what = "a client pinging every service";
    publish_refused(&client, &violations, "$SRV.PING", "", what).await;
    let what = "a client asking a service for its info";
    let subject = "$SRV.INFO.cyrene-orchestrator";
    publish_refused(&client, &violations, subject, "", what).await;
    assert_eq!(discovered(&operator).await, DISCOVERABLE);
    // `cyrene probe` run by an operator: its replies come to the operator's own inbox prefix,
    // never the clients' `_INBOX_cyrene-cli` (issue 30, L1).
    let probe = tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["probe", "--json", "cyrene-orchestrator"])
        .env("NATS_URL", url(&server, "cyrene-operator", "pw-operator"))
        .env_remove("NATS_USER")
        .env_remove("NATS_PASSWORD")
        .env_remove("NATS_CREDS")
        .env_remove("NATS_NKEY")
        .env_remove("CYRENE_CLI_PERSON")
        .env_remove("CYRENE_CLI_INBOX_PREFIX")
        .kill_on_drop(true)
        .output();
    let probe = tokio::time::timeout(Duration::from_secs(30), probe)
        .await
        .unwrap()
        .unwrap();
    let out = String::from_utf8_lossy(&probe.stdout);
    assert!(probe.status.success(), "{out}");
    let line: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(line["stats"]["name"], "cyrene-orchestrator", "{out}");

    // The server logged the refusals above (so the clean log earlier meant something).
    let log = std::fs::read_to_string(server.log_path()).unwrap();
    assert!(log.contains("Violation"), "{log}");

    // Every malformed header block, on every subject a client or an agent may publish and on
    // discovery: no service loses its connection, and each still answers.
    let connections = server.connection_ids();
    let port = server.port();
    let mut as_client = RawConnection::connect(port, Some(("cyrene-client", "pw-client"))).await;
    let mut as_hoshi = RawConnection::connect(port, Some(("agent-hoshi", "pw-hoshi"))).await;
    let mut as_operator =
        RawConnection::connect(port, Some(("cyrene-operator", "pw-operator"))).await;
    let mut as_alice = RawConnection::connect(port, Some(("person-alice", "pw-alice"))).await;
    let alice_subjects = [
        "cyrene.person.alice.session.send",
        "cyrene.person.alice.session.history",
        "cyrene.person.alice.checkpoint.latest",
        "cyrene.person.alice.checkpoint.get",
        "cyrene.person.alice.checkpoint.list",
        "cyrene.person.alice.session.list",
        "cyrene.person.alice.document.upload",
        "cyrene.person.alice.session.approve",
        "cyrene.person.alice.session.approvals",
        "cyrene.agent.alice.cyrene.ask",
    ];
    let client_subjects = [
        subjects::SESSION_SEND,
        subjects::SESSION_HISTORY,
        subjects::SESSION_APPROVE,
        subjects::SESSION_APPROVALS,
        "cyrene.checkpoint.get",
        "cyrene.checkpoint.list",
        "cyrene.agent.cli.cyrene.ask",
        "cyrene.agent.cli.cyrene.event",
        "cyrene.agent.cli.event",
    ];
    for (what, block) in MALFORMED_HEADER_BLOCKS {
        for subject in client_subjects {
            let reply = Some("_INBOX_cyrene-cli.raw");
            as_client.hpub(subject, reply, block, b"{}").await;
        }
        as_hoshi
            .hpub("cyrene.agent.hoshi.cyrene.ask", None, block, b"{}")
            .await;
        for subject in alice_subjects {
            let reply = Some("_INBOX_person-alice.raw");
            as_alice.hpub(subject, reply, block, b"{}").await;
        }
        for subject in ["$SRV.PING", "$SRV.INFO", "$SRV.STATS"] {
            let reply = Some("_INBOX_cyrene-operator.raw");
            as_operator.hpub(subject, reply, block, b"").await;
        }
        for raw in [
            &mut as_client,
            &mut as_hoshi,
            &mut as_operator,
            &mut as_alice,
        ] {
            let errors = raw.round_trip().await;
            assert!(errors.is_empty(), "{what}: the server refused: {errors:?}");
        }
        assert_eq!(discovered(&operator).await, DISCOVERABLE, "{what}");
        let history = history(&cli, "p1")
            .await
            .unwrap_or_else(|err| panic!("{what}: the orchestrator stopped answering: {err}"));
        assert!(!history.messages.is_empty(), "{what}");
        let mut now = server.connection_ids();
        now.retain(|id| connections.contains(id));
        assert_eq!(
            now, connections,
            "{what}: a connection was dropped or replaced"
        );
    }
    shutdown.cancel();
}

/// The permission matrix as a Markdown table (docs/security.md holds it verbatim).
fn render_matrix(matrix: &[(&str, &str, Vec<&str>)]) -> String {
    let mut table = String::from("| subject | what |");
    for (user, _) in MATRIX_USERS {
        table.push_str(&format!(" `{user}` |"));
    }
    table.push_str("\n|---|---|");
    table.push_str(&"---|".repeat(MATRIX_USERS.len()));
    table.push('\n');
    for (subject, what, cells) in matrix {
        table.push_str(&format!("| `{subject}` | {what} |"));
        for cell in cells {
            table.push_str(&format!(" {cell} |"));
        }
        table.push('\n');
    }
    table
}

/// What the server permits `user` on `subject`: `pub`, `sub`, `pub sub` or `—`. One raw
/// connection per user; each attempt is followed by a round trip, so every `-ERR` is the
/// answer to that attempt.
async fn permitted(raw: &mut RawConnection, subject: &str, sid: u64) -> &'static str {
    raw.publish(subject.as_bytes(), None, b"").await;
    let publish = raw.round_trip().await;
    raw.subscribe(subject, sid).await;
    let subscribe = raw.round_trip().await;
    raw.unsubscribe(sid).await;
    for error in publish.iter().chain(&subscribe) {
        assert!(
            error.contains("Permissions Violation"),
            "{subject}: unexpected {error}"
        );
    }
    match (publish.is_empty(), subscribe.is_empty()) {
        (true, true) => "pub sub",
        (true, false) => "pub",
        (false, true) => "sub",
        (false, false) => "—",
    }
}

/// The matrix of docs/security.md is what the shipped config does: every user tries to publish
/// and to subscribe on every subject family, against a real nats-server running the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_config_permits_exactly_the_permission_matrix() {
    let server = server();
    for (subject, _) in BRIDGE_COLUMN
        .iter()
        .chain(MCP_BRIDGE_COLUMN)
        .chain(GUARD_COLUMN)
    {
        assert!(
            MATRIX.iter().any(|(s, _, _)| s == subject),
            "{subject}: a bridge cell names no row"
        );
    }
    let mut observed: Vec<(&str, &str, Vec<&str>)> = MATRIX
        .iter()
        .map(|(subject, what, _)| (*subject, *what, vec!["?"; MATRIX_USERS.len()]))
        .collect();
    for (column, (user, password)) in MATRIX_USERS.into_iter().enumerate() {
        let mut raw = RawConnection::connect(server.port(), Some((user, password))).await;
        for (row, (subject, _, _)) in MATRIX.iter().enumerate() {
            observed[row].2[column] = permitted(&mut raw, subject, row as u64 + 1).await;
        }
    }
    let full: Vec<(&str, &str, Vec<&str>)> = MATRIX
        .iter()
        .map(|(subject, what, cells)| (*subject, *what, full_row(subject, cells)))
        .collect();
    let expected = render_matrix(&full);
    let observed = render_matrix(&observed);
    assert_eq!(
        observed, expected,
        "deploy/nats/users.conf permits (left) what the matrix does not say (right)"
    );

    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/security.md")).unwrap();
    assert!(
        doc.contains(&expected),
        "docs/security.md must hold the permission matrix as tests/permissions.rs renders it:\n\n{expected}"
    );

    // Every user of the config is in the matrix.
    let conf = users_conf();
    let users: Vec<&str> = conf
        .lines()
        .filter_map(|line| line.trim().strip_prefix("user: "))
        .collect();
    let columns: Vec<&str> = MATRIX_USERS.iter().map(|(user, _)| *user).collect();
    assert_eq!(users, columns, "users of deploy/nats/users.conf");
}

/// A person's client as `cyrene --person <id>` connects: the person's user, the connection name
/// `person-<id>`, so the private inbox prefix `_INBOX_person-<id>`.
async fn person(server: &NatsServer, id: &str) -> async_nats::Client {
    connect_as(
        server,
        &format!("person-{id}"),
        &format!("pw-{id}"),
        &format!("person-{id}"),
    )
    .await
}

/// A request that the service must refuse with `code`.
async fn refused_with<Req: serde::Serialize>(
    client: &async_nats::Client,
    subject: &str,
    request: &Req,
    code: &str,
) {
    let answer: Result<serde_json::Value, _> =
        request_json(client, subject, request, Duration::from_secs(5)).await;
    match answer {
        Err(cyrene_bus::RequestError::Remote(body)) => {
            assert_eq!(body.code.as_str(), code, "{subject}: {body}")
        }
        other => panic!("{subject}: expected {code}, got {other:?}"),
    }
}

/// Collects every message of `subscriber` until the test looks.
fn record(mut subscriber: async_nats::Subscriber) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    tokio::spawn(async move {
        while let Some(message) = subscriber.next().await {
            let text = String::from_utf8_lossy(&message.payload).into_owned();
            s.lock()
                .unwrap()
                .push(format!("{}: {text}", message.subject));
        }
    });
    seen
}

/// Issue 12, item 3: two people with separate identities (the shipped `person-alice` and
/// `person-bob`) cannot read each other's events, history, checkpoints or replies, the shared
/// client cannot either, and nobody — person or agent — asks or emits as another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_people_cannot_read_each_others_sessions_or_speak_as_each_other() {
    let server = server();
    let shutdown = CancellationToken::new();
    let (_operator, _tools, _data, _model) = start_services(&server, &shutdown).await;
    let alice = person(&server, "alice").await;
    let bob = person(&server, "bob").await;
    let shared = connect_as(&server, "cyrene-client", "pw-client", "cyrene-cli").await;
    assert!(alice.new_inbox().starts_with("_INBOX_person-alice."));

    // What bob and the shared client may listen to, listened to the whole time.
    let mut spies = Vec::new();
    for subject in ["cyrene.session.bob.*.events", "cyrene.agent.*.bob.reply.*"] {
        spies.push((subject, record(bob.subscribe(subject).await.unwrap())));
    }
    for subject in [
        "cyrene.session.*.events",
        "cyrene.agent.*.*.reply.*",
        "_INBOX.>",
        "_INBOX_cyrene-cli.>",
    ] {
        spies.push((subject, record(shared.subscribe(subject).await.unwrap())));
    }
    // What alice may listen to: her own sessions' events (so the spies' silence means something).
    let own_events = record(
        alice
            .subscribe("cyrene.session.alice.*.events")
            .await
            .unwrap(),
    );
    bob.flush().await.unwrap();
    shared.flush().await.unwrap();
    alice.flush().await.unwrap();

    // Bob cannot even subscribe to alice's events, replies or inbox, nor to every session.
    let (bob_watched, violations) = watched(&server, "person-bob", "pw-bob").await;
    for subject in [
        "cyrene.session.alice.*.events",
        "cyrene.session.*.*.events",
        "cyrene.session.*.events",
        "cyrene.agent.*.alice.reply.*",
        "_INBOX_person-alice.>",
        "_INBOX.>",
        ">",
    ] {
        let what = format!("bob subscribing to {subject}");
        let _sub = subscribe_refused(&bob_watched, &violations, subject, &what).await;
    }

    // Alice: a turn with a tool call in her own session, on her own subject.
    let alice_send = subjects::person("alice", subjects::PERSON_SESSION_SEND).unwrap();
    let alice_history = subjects::person("alice", subjects::PERSON_SESSION_HISTORY).unwrap();
    let message = Message::text(Role::User, "what time is it? secret-of-alice");
    let send = send_request("alice.s1", message, "alice-phone", "a1");
    let ack = sent(&alice, &alice_send, &send).await;
    assert!(!ack.turn_id.is_empty());
    let own = HistoryRequest {
        session_id: "alice.s1".into(),
        limit: None,
        before_seq: None,
    };
    let answer = answered(
        &alice,
        &alice_history,
        "alice.s1",
        "alice's turn is answered",
    )
    .await;
    assert!(answer.starts_with("It is "), "{answer}");
    let list = cyrene_protocol::checkpoint::ListRequest {
        agent_id: "alice.s1".into(),
        limit: None,
        before: None,
    };
    let alice_list = subjects::person("alice", subjects::PERSON_CHECKPOINT_LIST).unwrap();
    let checkpoints: cyrene_protocol::checkpoint::ListResponse =
        request_json(&alice, &alice_list, &list, Duration::from_secs(5))
            .await
            .unwrap();
    let first = checkpoints
        .checkpoints
        .first()
        .expect("alice reads her checkpoints")
        .id
        .clone();
    // Alice asks the persona as herself; the answer comes back to her alone.
    let reply = Probe::new(alice.clone(), "alice")
        .ask("cyrene", "what time is it? ask-of-alice")
        .await
        .unwrap();
    assert!(reply.text.starts_with("It is "), "{}", reply.text);
    let ask_session = cyrene_orchestrator::agents::ask_session_id("cyrene", "alice");
    let asked = HistoryRequest {
        session_id: ask_session.clone(),
        limit: None,
        before_seq: None,
    };
    let history: HistoryResponse =
        request_json(&alice, &alice_history, &asked, Duration::from_secs(5))
            .await
            .unwrap();
    assert!(!history.messages.is_empty(), "alice reads her ask session");

    // The CLI as a person (`--person`): her private inbox prefix (person-alice may not subscribe
    // to any other), her subjects, `-s s1` taken as `alice.s1`; bob's CLI is refused hers.
    let cli = |user: &str, password: &str, args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
            .env("NATS_URL", server.url())
            .env("NATS_USER", user)
            .env("NATS_PASSWORD", password)
            .args(args)
            .output()
            .unwrap()
    };
    let out = cli(
        "person-alice",
        "pw-alice",
        &["--person", "alice", "history", "-s", "s1"],
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && printed.contains("It is "),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(
        "person-alice",
        "pw-alice",
        &["--person", "alice", "checkpoints", "s1"],
    );
    common::assert_success(&out);
    let out = cli(
        "person-bob",
        "pw-bob",
        &["--person", "bob", "history", "-s", "alice.s1"],
    );
    let printed = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{printed}");
    assert!(printed.contains("forbidden"), "{printed}");
    // Without its prefix, alice's client cannot even hear its replies.
    let out = cli("person-alice", "pw-alice", &["history", "-s", "alice.s1"]);
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    // Bob, on his own subjects, is refused everything of alice's.
    let bob_history = subjects::person("bob", subjects::PERSON_SESSION_HISTORY).unwrap();
    refused_with(&bob, &bob_history, &own, "forbidden").await;
    refused_with(&bob, &bob_history, &asked, "forbidden").await;
    let steal = SendRequest {
        idempotency_key: "b1".into(),
        ..send.clone()
    };
    let bob_send = subjects::person("bob", subjects::PERSON_SESSION_SEND).unwrap();
    refused_with(&bob, &bob_send, &steal, "forbidden").await;
    let bob_list = subjects::person("bob", subjects::PERSON_CHECKPOINT_LIST).unwrap();
    refused_with(&bob, &bob_list, &list, "forbidden").await;
    let bob_latest = subjects::person("bob", subjects::PERSON_CHECKPOINT_LATEST).unwrap();
    let latest = json!({"agent_id": "alice.s1"});
    refused_with(&bob, &bob_latest, &latest, "forbidden").await;
    let bob_get = subjects::person("bob", subjects::PERSON_CHECKPOINT_GET).unwrap();
    refused_with(&bob, &bob_get, &json!({"id": first}), "forbidden").await;
    // … and the server refuses him alice's subjects outright.
    let who = "bob publishing on";
    for subject in [
        alice_history.as_str(),
        alice_send.as_str(),
        alice_list.as_str(),
        subjects::SESSION_HISTORY,
        subjects::CHECKPOINT_LATEST,
        subjects::CHECKPOINT_LIST,
    ] {
        let what = format!("{who} {subject}");
        publish_refused(&bob_watched, &violations, subject, "{}", &what).await;
    }

    // Alice saw her session's events; nobody else saw anything of hers (checked before the
    // shared client's own refused requests, whose answers name alice, reach its inbox).
    let own_events = own_events.lock().unwrap().clone();
    assert!(
        own_events.iter().any(|e| e.contains("turn_ended")),
        "{own_events:?}"
    );
    for (subject, seen) in spies {
        let seen = seen.lock().unwrap().clone();
        let leaked: Vec<&String> = seen
            .iter()
            .filter(|m| m.contains("alice") || m.contains("It is "))
            .collect();
        assert!(leaked.is_empty(), "{subject} saw alice's: {leaked:?}");
    }

    // The shared client reaches no person's session either.
    refused_with(&shared, subjects::SESSION_HISTORY, &own, "forbidden").await;
    refused_with(&shared, subjects::SESSION_HISTORY, &asked, "forbidden").await;
    refused_with(&shared, subjects::SESSION_SEND, &steal, "forbidden").await;
    refused_with(&shared, subjects::CHECKPOINT_LIST, &list, "forbidden").await;
    refused_with(
        &shared,
        subjects::CHECKPOINT_GET,
        &json!({"id": first}),
        "forbidden",
    )
    .await;
    // Documents (issue 30, L3): alice stores one in her own session on her own subject; nobody
    // stores one in hers on another subject, and she none outside hers.
    let upload = |session: &str| UploadRequest {
        session_id: session.into(),
        name: "notes.txt".into(),
        data: BASE64.encode(b"alice's notes"),
        last: true,
        ..Default::default()
    };
    let alice_upload = subjects::person("alice", subjects::PERSON_DOCUMENT_UPLOAD).unwrap();
    let wait = Duration::from_secs(5);
    let ack: UploadAck = request_json(&alice, &alice_upload, &upload("alice.s1"), wait)
        .await
        .unwrap();
    assert!(ack.document.is_some(), "{ack:?}");
    refused_with(&alice, &alice_upload, &upload("s1"), "forbidden").await;
    refused_with(&shared, DOCUMENT_UPLOAD, &upload("alice.s1"), "forbidden").await;
    let bob_upload = subjects::person("bob", subjects::PERSON_DOCUMENT_UPLOAD).unwrap();
    refused_with(&bob, &bob_upload, &upload("alice.s1"), "forbidden").await;

    let who = "the shared client publishing";
    let subjects = [
        subjects::CHECKPOINT_LATEST,
        alice_history.as_str(),
        "cyrene.agent.alice.cyrene.ask",
    ];
    publishing_refused(&server, ("cyrene-client", "pw-client"), &subjects, who).await;

    // Nobody asks or emits as another: not bob as alice, not alice as bob or as an agent or a
    // persona, not an agent as a person.
    let impostors: [((&str, &str), &str, &[&str]); 2] = [
        (
            ("person-alice", "pw-alice"),
            "alice publishing",
            &[
                "cyrene.agent.bob.cyrene.ask",
                "cyrene.agent.bob.event",
                "cyrene.agent.hoshi.cyrene.ask",
                "cyrene.agent.cyrene.hoshi.event",
                "cyrene.person.bob.session.send",
            ],
        ),
        (
            ("agent-hoshi", "pw-hoshi"),
            "agent hoshi publishing",
            &[
                "cyrene.agent.alice.cyrene.ask",
                "cyrene.agent.alice.event",
                "cyrene.person.alice.session.send",
            ],
        ),
    ];
    for (user, who, subjects) in impostors {
        publishing_refused(&server, user, subjects, who).await;
    }
    // On her own subject, a body that names someone else is refused by the persona.
    forged_ask_is_forbidden(&alice, "alice", "bob").await;

    shutdown.cancel();
}

/// The third-party note (docs/semantics.md#attribution) for `name`, byte for byte.
fn third_party_note(name: &str) -> String {
    format!(
        "[发言归属] 以下发言来自「{name}」——本会话里的第三方人员（非管理员账户），不是主人，也不是你说的。"
    )
}

/// Whether the model was shown `note` as a system message.
fn model_saw(model: &RequestLog, note: &str) -> bool {
    model.snapshot().iter().any(|request| {
        request
            .messages
            .iter()
            .any(|m| m.role == Role::System && m.text_content() == note)
    })
}

/// Issue 33: the owner is configuration (`alice` here) and only the bridge labels third
/// parties. A client or a person claiming `sender_name` or `restricted` is refused; the bridge
/// creates a restricted session of the owner's where a stranger's line reaches the model under
/// the stranger's name; a person who is not the owner is labelled by the runtime; and the
/// bridge reaches no session but the owner's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_bridge_speaks_for_third_parties_and_nobody_else_as_the_owner() {
    let server = server();
    let shutdown = CancellationToken::new();
    let (_operator, _tools, _data, model) = start_services(&server, &shutdown).await;
    let alice = person(&server, "alice").await;
    let bob = person(&server, "bob").await;
    let shared = connect_as(&server, "cyrene-client", "pw-client", "cyrene-cli").await;
    let bridge = connect_as(
        &server,
        "cyrene-bridge",
        "pw-bridge",
        "cyrene-matrix-bridge",
    )
    .await;
    let alice_send = subjects::person("alice", subjects::PERSON_SESSION_SEND).unwrap();
    let alice_history = subjects::person("alice", subjects::PERSON_SESSION_HISTORY).unwrap();
    let bob_send = subjects::person("bob", subjects::PERSON_SESSION_SEND).unwrap();
    let bob_history = subjects::person("bob", subjects::PERSON_SESSION_HISTORY).unwrap();
    let labelled = |session: &str, name: &str, key: &str| SendRequest {
        env: Some(SessionEnv {
            restricted: true,
            persona: String::new(),
        }),
        ..send_request(
            session,
            Message::text(Role::User, "hello there").sender(name),
            "matrix",
            key,
        )
    };
    let restricted = |session: &str| SendRequest {
        env: Some(SessionEnv {
            restricted: true,
            persona: String::new(),
        }),
        ..send_request(session, Message::text(Role::User, "hi"), "cli", "r1")
    };
    let unlabelled = |session: &str| SendRequest {
        env: None,
        ..labelled(session, "", "u1")
    };

    // Nobody but the bridge labels a line or restricts a session: not the shared client, not
    // the owner, not another person.
    let send = subjects::SESSION_SEND;
    refused_with(&shared, send, &labelled("g1", "alice", "k1"), "forbidden").await;
    refused_with(&shared, send, &restricted("g1"), "forbidden").await;
    refused_with(
        &alice,
        &alice_send,
        &labelled("alice.g1", "阿明", "k1"),
        "forbidden",
    )
    .await;
    refused_with(&alice, &alice_send, &restricted("alice.g1"), "forbidden").await;
    refused_with(
        &bob,
        &bob_send,
        &labelled("bob.g1", "alice", "k1"),
        "forbidden",
    )
    .await;
    refused_with(&bob, &bob_send, &restricted("bob.g1"), "forbidden").await;
    // … and the server refuses the bridge's subjects to all of them.
    for (user, password) in [
        ("cyrene-client", "pw-client"),
        ("person-alice", "pw-alice"),
        ("agent-hoshi", "pw-hoshi"),
    ] {
        let subjects = [
            subjects::BRIDGE_SESSION_SEND,
            subjects::BRIDGE_SESSION_HISTORY,
        ];
        publishing_refused(&server, (user, password), &subjects, user).await;
    }

    // The bridge: a stranger in a group room, one restricted session of the owner's. The model
    // sees the stranger's line under the stranger's name.
    let group = labelled("alice.mx-g1", "阿明", "$event-1");
    let ack = sent(&bridge, subjects::BRIDGE_SESSION_SEND, &group).await;
    assert!(!ack.turn_id.is_empty());
    let history = subjects::BRIDGE_SESSION_HISTORY;
    answered(&bridge, history, "alice.mx-g1", "the stranger is answered").await;
    assert!(
        model_saw(&model, &third_party_note("阿明")),
        "{:#?}",
        model.snapshot()
    );
    // The owner reads that session on her own subject: the stranger's line is labelled.
    let page = history_on(&alice, &alice_history, "alice.mx-g1")
        .await
        .unwrap();
    assert_eq!(page.messages[0].message.sender_name, "阿明");

    // The bridge reaches no other session — another person's, nobody's — and labels no line of
    // the owner's own (unrestricted) chat.
    let other = labelled("bob.g1", "阿明", "$event-2");
    refused_with(&bridge, subjects::BRIDGE_SESSION_SEND, &other, "forbidden").await;
    let nobodys = labelled("g1", "阿明", "$event-2");
    refused_with(
        &bridge,
        subjects::BRIDGE_SESSION_SEND,
        &nobodys,
        "forbidden",
    )
    .await;
    sent(
        &bridge,
        subjects::BRIDGE_SESSION_SEND,
        &unlabelled("alice.dm"),
    )
    .await;
    let into_open = SendRequest {
        env: None,
        ..labelled("alice.dm", "阿明", "$event-3")
    };
    refused_with(
        &bridge,
        subjects::BRIDGE_SESSION_SEND,
        &into_open,
        "forbidden",
    )
    .await;
    let bridge_watched = publishing_refused(
        &server,
        ("cyrene-bridge", "pw-bridge"),
        &[subjects::SESSION_SEND, "cyrene.person.alice.session.send"],
        "the bridge publishing",
    )
    .await;
    drop(bridge_watched);

    // Bob is not the owner: his own session is restricted and his line labelled with his id.
    let ack = sent(&bob, &bob_send, &unlabelled("bob.s1")).await;
    assert!(!ack.turn_id.is_empty());
    answered(&bob, &bob_history, "bob.s1", "bob is answered").await;
    assert!(model_saw(&model, &third_party_note("bob")));
    let page = history_on(&bob, &bob_history, "bob.s1").await.unwrap();
    assert_eq!(page.messages[0].message.sender_name, "bob");

    shutdown.cancel();
}
