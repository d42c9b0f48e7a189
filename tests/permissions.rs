//! `deploy/nats/cyrene.conf` — the least-privilege server config — run as is (passwords filled
//! in): the whole system works with each service connected as its own user, what a user is not
//! allowed is refused by the server (docs/architecture.md §8), only operators reach `$SRV.>`, and no malformed
//! header block a user may publish costs a service its connection (issue 12, item 1).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use async_nats::{ConnectOptions, Event, ServerError};
use cyrene_bus::service::ServeOptions;
use cyrene_bus::{BusConfig, ConnectMode, request_json};
use cyrene_comm::Probe;
use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::Secrets;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{HistoryRequest, HistoryResponse, SendAck, SendRequest};
use cyrene_protocol::subjects;
use cyrene_test_support::{MALFORMED_HEADER_BLOCKS, NatsServer, RawConnection};
use futures::StreamExt;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const USERS: [(&str, &str); 7] = [
    ("CYRENE_GATEWAY_PASSWORD", "pw-gateway"),
    ("CYRENE_CHECKPOINT_STORE_PASSWORD", "pw-store"),
    ("CYRENE_ORCHESTRATOR_PASSWORD", "pw-orchestrator"),
    ("CYRENE_LOOP_WORKER_PASSWORD", "pw-worker"),
    ("CYRENE_CLIENT_PASSWORD", "pw-client"),
    ("CYRENE_AGENT_HOSHI_PASSWORD", "pw-hoshi"),
    ("CYRENE_OPERATOR_PASSWORD", "pw-operator"),
];

const SERVICES: [&str; 4] = [
    "cyrene-checkpoint-store",
    "cyrene-loop-worker",
    "cyrene-model-gateway",
    "cyrene-orchestrator",
];

fn server() -> NatsServer {
    let mut config = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/deploy/nats/cyrene.conf"
    ))
    .unwrap();
    // The harness gives the server its own store dir (a flag) in place of the deployed one.
    config = config.replace("  store_dir: \"/data/jetstream\"\n", "");
    for (var, password) in USERS {
        config = config.replace(&format!("${var}"), &format!("\"{password}\""));
    }
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

/// A raw connection that records the permission violations the server reports.
async fn watched(
    server: &NatsServer,
    user: &str,
    password: &str,
) -> (async_nats::Client, Arc<Mutex<Vec<String>>>) {
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

async fn refused(violations: &Arc<Mutex<Vec<String>>>, what: &str) {
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

/// The transcript of `session`.
async fn history(
    cli: &async_nats::Client,
    session: &str,
) -> Result<HistoryResponse, cyrene_bus::RequestError> {
    let request = HistoryRequest {
        session_id: session.into(),
        limit: None,
        before_seq: None,
    };
    request_json(
        cli,
        subjects::SESSION_HISTORY,
        &request,
        Duration::from_secs(5),
    )
    .await
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
        while names.len() < SERVICES.len() {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_works_as_its_own_user_and_forbidden_subjects_are_refused() {
    let server = server();
    let shutdown = CancellationToken::new();
    let data = tempfile::tempdir().unwrap();

    let rules = json!([{"contains": "time", "tool_calls": [{"name": "current_time"}],
                        "after_tools": "It is {tool_results}."}]);
    let gateway = Gateway::new(
        common::models(rules),
        &Secrets::from_pairs(Vec::<(String, String)>::new()),
        cyrene_model_gateway::http_client().unwrap(),
    )
    .unwrap();
    let client = connect_as(
        &server,
        "cyrene-model-gateway",
        "pw-gateway",
        "cyrene-model-gateway",
    )
    .await;
    tokio::spawn(cyrene_model_gateway::serve(
        Arc::new(gateway),
        client,
        ServeOptions::default(),
        shutdown.clone(),
    ));
    let client = connect_as(
        &server,
        "cyrene-checkpoint-store",
        "pw-store",
        "cyrene-checkpoint-store",
    )
    .await;
    tokio::spawn(cyrene_checkpoint_store::run(
        cyrene_checkpoint_store::Config::new(data.path()),
        client,
        shutdown.clone(),
    ));
    let client = connect_as(
        &server,
        "cyrene-orchestrator",
        "pw-orchestrator",
        "cyrene-orchestrator",
    )
    .await;
    tokio::spawn(cyrene_orchestrator::run(
        cyrene_orchestrator::Config::new(data.path()),
        client,
        shutdown.clone(),
    ));
    let client = connect_as(
        &server,
        "cyrene-loop-worker",
        "pw-worker",
        "cyrene-loop-worker",
    )
    .await;
    tokio::spawn(cyrene_loop_worker::run(
        common::worker_config(),
        client,
        shutdown.clone(),
    ));

    // An operator (as `cyrene probe` connects) waits for the services.
    let operator = connect_as(&server, "cyrene-operator", "pw-operator", "cyrene-cli").await;
    for name in SERVICES {
        common::wait_for_service(&operator, name).await;
    }

    // A person's client: one full turn with a tool call, answered in the transcript.
    let cli = connect_as(&server, "cyrene-client", "pw-client", "cyrene-cli").await;
    let send = SendRequest {
        session_id: "p1".into(),
        message: Message::text(Role::User, "what time is it?"),
        client_id: "cli".into(),
        idempotency_key: "k1".into(),
        env: None,
        parallel: false,
    };
    let ack: SendAck = request_json(&cli, subjects::SESSION_SEND, &send, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(!ack.turn_id.is_empty());
    let answered = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let history = history(&cli, "p1").await.unwrap();
            if let Some(answer) = history
                .messages
                .iter()
                .find(|e| e.message.role == Role::Assistant)
            {
                return answer.message.text_content();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the turn is answered under least privilege");
    assert!(answered.starts_with("It is "), "{answered}");
    // … and no service ran into its limits on the way (the server logs every violation).
    let log = std::fs::read_to_string(server.log_path()).unwrap();
    assert!(
        !log.contains("Violation"),
        "a service needs more than it is allowed:\n{log}"
    );

    // What each user may not do.
    let (gateway, violations) = watched(&server, "cyrene-model-gateway", "pw-gateway").await;
    gateway
        .publish(subjects::TURN_RUN, "{}".into())
        .await
        .unwrap();
    gateway.flush().await.unwrap();
    refused(&violations, "the gateway dispatching a turn").await;

    let (worker, violations) = watched(&server, "cyrene-loop-worker", "pw-worker").await;
    let _sub = worker.subscribe(subjects::SESSION_SEND).await.unwrap();
    worker.flush().await.unwrap();
    refused(&violations, "a worker listening to user messages").await;

    let (client, violations) = watched(&server, "cyrene-client", "pw-client").await;
    client
        .publish(subjects::TURN_COMPLETE, "{}".into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    refused(&violations, "a client forging a turn completion").await;

    // Nobody speaks as another agent: not an agent, not a person, not the worker.
    let (hoshi, violations) = watched(&server, "agent-hoshi", "pw-hoshi").await;
    for subject in [
        "cyrene.agent.cyrene.me.ask",
        "cyrene.agent.cyrene.hoshi.event",
        "cyrene.agent.cyrene.event",
        "cyrene.agent.hoshi.me.reply.q1",
        "cyrene.agent.hoshi.a.b.c",
    ] {
        hoshi.publish(subject, "{}".into()).await.unwrap();
        hoshi.flush().await.unwrap();
        refused(&violations, &format!("agent hoshi publishing {subject}")).await;
    }
    let (client, violations) = watched(&server, "cyrene-client", "pw-client").await;
    for subject in [
        "cyrene.agent.hoshi.cyrene.ask",
        "cyrene.agent.cyrene.hoshi.ask",
        "cyrene.agent.hoshi.event",
        "cyrene.agent.cyrene.me.event",
    ] {
        client.publish(subject, "{}".into()).await.unwrap();
        client.flush().await.unwrap();
        refused(&violations, &format!("a client publishing {subject}")).await;
    }
    let (worker, violations) = watched(&server, "cyrene-loop-worker", "pw-worker").await;
    worker
        .publish("cyrene.agent.hoshi.cyrene.ask", "{}".into())
        .await
        .unwrap();
    worker.flush().await.unwrap();
    refused(&violations, "the worker asking as an external agent").await;

    // What they may do: hoshi asks as itself and is answered; a body claiming another name on
    // its own subject is refused by the agent (`forbidden`); a person asks under their own name.
    let reply = Probe::new(hoshi.clone(), "hoshi")
        .ask("cyrene", "what time is it?")
        .await
        .unwrap();
    assert!(reply.text.starts_with("It is "), "{}", reply.text);
    let mut replies = hoshi
        .subscribe("cyrene.agent.cyrene.hoshi.reply.q9")
        .await
        .unwrap();
    hoshi.flush().await.unwrap();
    let forged = json!({"id":"q9","from":"主人","to":"cyrene","question":"what time is it?"});
    hoshi
        .publish_with_reply(
            "cyrene.agent.hoshi.cyrene.ask",
            "cyrene.agent.cyrene.hoshi.reply.q9",
            serde_json::to_vec(&forged).unwrap().into(),
        )
        .await
        .unwrap();
    let refusal = tokio::time::timeout(Duration::from_secs(10), replies.next())
        .await
        .unwrap()
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&refusal.payload).unwrap();
    assert_eq!(body["error"]["code"], "forbidden", "{body}");
    let reply = Probe::new(cli.clone(), "me")
        .ask("cyrene", "what time is it?")
        .await
        .unwrap();
    assert!(reply.text.starts_with("It is "), "{}", reply.text);

    // Discovery reaches every service with one message: operators only.
    let (client, violations) = watched(&server, "cyrene-client", "pw-client").await;
    client.publish("$SRV.PING", "".into()).await.unwrap();
    client.flush().await.unwrap();
    refused(&violations, "a client pinging every service").await;
    client
        .publish("$SRV.INFO.cyrene-orchestrator", "".into())
        .await
        .unwrap();
    client.flush().await.unwrap();
    refused(&violations, "a client asking a service for its info").await;
    assert_eq!(discovered(&operator).await, SERVICES);

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
    let client_subjects = [
        subjects::SESSION_SEND,
        subjects::SESSION_HISTORY,
        "cyrene.checkpoint.latest",
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
        for subject in ["$SRV.PING", "$SRV.INFO", "$SRV.STATS"] {
            let reply = Some("_INBOX_cyrene-operator.raw");
            as_operator.hpub(subject, reply, block, b"").await;
        }
        for raw in [&mut as_client, &mut as_hoshi, &mut as_operator] {
            let errors = raw.round_trip().await;
            assert!(errors.is_empty(), "{what}: the server refused: {errors:?}");
        }
        assert_eq!(discovered(&operator).await, SERVICES, "{what}");
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
