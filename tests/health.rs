//! Health and metrics of the four real binaries (docs/operations.md): each answers `/livez`,
//! `/readyz` and `/metrics` on `CYRENE_HEALTH_ADDR`; after a real tool turn `/metrics` is
//! parsable Prometheus text with the documented series; readiness follows the NATS connection;
//! `$SRV.STATS` counts error replies.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use common::{service, wait_for_service};
use cyrene_bus::request_json;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{HistoryRequest, HistoryResponse, SendAck, SendRequest};
use cyrene_protocol::subjects;
use cyrene_test_support::{NatsServer, micro};
use serde_json::json;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Child;

const BINARIES: [&str; 4] = [
    "cyrene-model-gateway",
    "cyrene-checkpoint-store",
    "cyrene-orchestrator",
    "cyrene-loop-worker",
];

/// A free local port (bound, then released for the binary to take).
fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// One `GET`: the status code and the body; `None` when nothing answers.
async fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.ok()?;
        let text = String::from_utf8(raw).ok()?;
        let (head, body) = text.split_once("\r\n\r\n")?;
        let status = head.split_whitespace().nth(1)?.parse().ok()?;
        Some((status, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .ok()
        .flatten()
}

/// Waits until `path` answers `status` on every address.
async fn wait_status(
    addrs: &BTreeMap<&str, SocketAddr>,
    path: &str,
    status: u16,
    within: Duration,
) {
    let deadline = tokio::time::Instant::now() + within;
    for (name, addr) in addrs {
        loop {
            let got = get(*addr, path).await;
            if got.as_ref().is_some_and(|(s, _)| *s == status) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name} {path}: expected {status}, got {got:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The samples of a Prometheus text exposition, by series name (labels dropped), checking
/// every line's syntax on the way.
fn parse_prometheus(text: &str) -> BTreeMap<String, Vec<f64>> {
    let mut samples: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(comment) = line.strip_prefix('#') {
            let words: Vec<&str> = comment.split_whitespace().collect();
            if words.first() == Some(&"TYPE") {
                assert!(
                    matches!(
                        words.get(2),
                        Some(&"counter" | &"gauge" | &"histogram" | &"summary" | &"untyped")
                    ),
                    "bad TYPE line: {line}"
                );
            }
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("bad line: {line}"));
        let name = series.split('{').next().unwrap();
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad series name: {line}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "bad labels: {line}"
            );
        }
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().unwrap_or_else(|_| panic!("bad value: {line}")),
        };
        samples.entry(name.to_owned()).or_default().push(value);
    }
    samples
}

struct Binaries {
    addrs: BTreeMap<&'static str, SocketAddr>,
    children: BTreeMap<&'static str, Child>,
    _data: tempfile::TempDir,
}

async fn start_binaries(server: &NatsServer, client: &async_nats::Client) -> Binaries {
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().display().to_string();
    // The scripted provider answers a question about the time with a current_time call first.
    let rules = json!([{"contains": "time", "tool_calls": [{"name": "current_time"}],
                        "after_tools": "It is {tool_results}."},
                       {"contains": "hold", "tool_calls": [{"name": "hold"}],
                        "after_tools": "Held: {tool_results}."}]);
    let models = common::models_file(data.path(), &common::models(rules));
    let models = models.display().to_string();
    let mut addrs = BTreeMap::new();
    let mut children = BTreeMap::new();
    for name in BINARIES {
        let addr = free_addr();
        let health = addr.to_string();
        children.insert(
            name,
            service(
                name,
                &server.url(),
                &[
                    ("CYRENE_HEALTH_ADDR", health.as_str()),
                    ("CYRENE_STORE_DATA_DIR", data_dir.as_str()),
                    ("CYRENE_ORCHESTRATOR_DATA_DIR", data_dir.as_str()),
                    ("CYRENE_GATEWAY_MODELS", models.as_str()),
                ],
            ),
        );
        addrs.insert(name, addr);
    }
    for name in BINARIES {
        wait_for_service(client, name).await;
    }
    Binaries {
        addrs,
        children,
        _data: data,
    }
}

/// Sends `text` into `session` (acknowledged, not answered).
async fn send(client: &async_nats::Client, session: &str, text: &str) {
    let send = SendRequest {
        session_id: session.to_owned(),
        message: Message::text(Role::User, text),
        client_id: "health".into(),
        idempotency_key: format!("{session}-1"),
        env: None,
        parallel: false,
        when_busy: None,
        persona: String::new(),
        context_only: false,
    };
    let _: SendAck = request_json(
        client,
        subjects::SESSION_SEND,
        &send,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
}

/// Sends `text` into `session` and waits for the assistant's answer in the transcript.
async fn run_turn(client: &async_nats::Client, session: &str, text: &str) {
    send(client, session, text).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let history: HistoryResponse = request_json(
            client,
            subjects::SESSION_HISTORY,
            &HistoryRequest {
                session_id: session.to_owned(),
                limit: Some(100),
                before_seq: None,
            },
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let answered = history.messages.iter().any(|e| {
            e.message.role == Role::Assistant
                && serde_json::to_string(&e.message).is_ok_and(|m| m.contains("It is "))
        });
        if answered {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no answer in {session}: {history:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_binary_serves_probes_and_the_documented_metrics_after_a_tool_turn() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let binaries = start_binaries(&server, &client).await;
    wait_status(&binaries.addrs, "/livez", 200, Duration::from_secs(20)).await;
    wait_status(&binaries.addrs, "/readyz", 200, Duration::from_secs(20)).await;

    run_turn(&client, "health-s1", "what time is it?").await;
    // The turn's worker asked the store for a checkpoint the fresh turn did not have yet: an
    // expected `not_found`, which is no error of the store's (issue 37).
    let store = micro::answer(&client, "STATS", "cyrene-checkpoint-store").await;
    let endpoints = store["endpoints"].as_array().unwrap();
    let latest = endpoints.iter().find(|e| e["name"] == "latest").unwrap();
    assert!(latest["num_requests"].as_u64().unwrap() >= 1, "{store}");
    let errors: u64 = endpoints
        .iter()
        .map(|e| e["num_errors"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(errors, 0, "a healthy turn counts no store error: {store}");
    // A bad request: answered bad_request and counted as an error by $SRV.STATS and /metrics.
    let reply = client
        .request(subjects::SESSION_SEND, "{not json".into())
        .await
        .unwrap();
    assert!(
        reply.headers.is_some(),
        "an error reply carries the error headers"
    );
    // A message that decodes but is refused (the agent lane is the ask path's only): a
    // `rejected` disposition.
    let refused = client
        .request(
            subjects::SESSION_SEND,
            serde_json::to_vec(&serde_json::json!({"session_id": "health-s2",
                "message": {"role": "user", "content": "hi", "sender_kind": "agent"}}))
            .unwrap()
            .into(),
        )
        .await
        .unwrap();
    assert!(refused.headers.is_some(), "refused: {refused:?}");
    let stats = micro::answer(&client, "STATS", "cyrene-orchestrator").await;
    let errors: u64 = stats["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["num_errors"].as_u64().unwrap_or(0))
        .sum();
    assert!(errors >= 1, "$SRV.STATS counts no error: {stats}");

    let expected: [(&str, &[&str]); 4] = [
        (
            "cyrene-model-gateway",
            &[
                "cyrene_requests_total",
                "cyrene_request_duration_seconds_bucket",
                "cyrene_provider_call_duration_seconds_bucket",
                "cyrene_provider_tokens_total",
            ],
        ),
        (
            "cyrene-checkpoint-store",
            &[
                "cyrene_requests_total",
                "cyrene_checkpoint_save_duration_seconds_bucket",
            ],
        ),
        (
            "cyrene-orchestrator",
            &[
                "cyrene_requests_total",
                "cyrene_request_duration_seconds_count",
                "cyrene_messages_total",
                "cyrene_answer_seconds_bucket",
                "cyrene_dispatch_lag_seconds_bucket",
                "cyrene_sessions_active",
                "cyrene_messages_waiting",
            ],
        ),
        (
            "cyrene-loop-worker",
            &[
                "cyrene_turns_started_total",
                "cyrene_turns_completed_total",
                "cyrene_turn_steps_bucket",
                "cyrene_tool_calls_total",
                "cyrene_tool_call_duration_seconds_bucket",
                "cyrene_turns_ack_pending",
                "cyrene_steer_claims_total",
                "cyrene_model_views_total",
            ],
        ),
    ];
    for (name, series) in expected {
        let addr = binaries.addrs[name];
        let (status, body) = get(addr, "/metrics").await.unwrap();
        assert_eq!(status, 200, "{name}");
        let samples = parse_prometheus(&body);
        assert!(
            body.contains("# HELP cyrene_requests_total ") || name == "cyrene-loop-worker",
            "{name}: the series are not described:\n{body}"
        );
        for wanted in series {
            assert!(
                samples.contains_key(*wanted),
                "{name} /metrics lacks {wanted}:\n{body}"
            );
        }
        if name == "cyrene-orchestrator" {
            assert!(
                body.lines().any(|l| l.starts_with("cyrene_requests_total")
                    && l.contains("code=\"bad_request\"")),
                "the bad request is not counted:\n{body}"
            );
            // The tool turn's message started a turn; the bad one was rejected; the answer's
            // latency is counted under the persona that gave it.
            for line in [
                "cyrene_messages_total{disposition=\"turn_started\"}",
                "cyrene_messages_total{disposition=\"rejected\"}",
            ] {
                assert!(body.contains(line), "{line} is missing:\n{body}");
            }
            assert!(
                body.lines()
                    .any(|l| l.starts_with("cyrene_answer_seconds_count")
                        && l.contains("outcome=\"final\"")
                        && l.contains("persona=\"")),
                "no answer latency by persona:\n{body}"
            );
        }
    }
    let (status, _) = get(binaries.addrs["cyrene-loop-worker"], "/nothing")
        .await
        .unwrap();
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn readiness_follows_the_nats_connection() {
    let mut server = NatsServer::start();
    let client = server.connect().await;
    let binaries = start_binaries(&server, &client).await;
    wait_status(&binaries.addrs, "/readyz", 200, Duration::from_secs(20)).await;

    server.kill();
    wait_status(&binaries.addrs, "/readyz", 503, Duration::from_secs(20)).await;
    // Alive all the same: a lost bus is not a reason to restart the process.
    wait_status(&binaries.addrs, "/livez", 200, Duration::from_secs(5)).await;

    server.start_again();
    wait_status(&binaries.addrs, "/readyz", 200, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_draining_worker_is_alive_but_not_ready() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let tools_stop = tokio_util::sync::CancellationToken::new();
    let _stop_tools = tools_stop.clone().drop_guard();
    let tools = common::TestTools::start(&server.connect().await, tools_stop).await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    *tools.gate.lock().unwrap() = Some(gate.clone());
    let mut binaries = start_binaries(&server, &client).await;
    wait_status(&binaries.addrs, "/readyz", 200, Duration::from_secs(20)).await;

    // A turn blocked in the `hold` tool keeps the worker draining after SIGTERM.
    send(&client, "health-drain", "please hold").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !tools
        .runs
        .lock()
        .unwrap()
        .iter()
        .any(|(name, _)| name == "hold")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hold tool never ran"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let worker = binaries.children.get_mut("cyrene-loop-worker").unwrap();
    common::terminate(worker);
    let only_worker: BTreeMap<&str, SocketAddr> =
        [("cyrene-loop-worker", binaries.addrs["cyrene-loop-worker"])].into();
    wait_status(&only_worker, "/readyz", 503, Duration::from_secs(5)).await;
    let (status, body) = get(only_worker["cyrene-loop-worker"], "/readyz")
        .await
        .unwrap();
    assert_eq!(status, 503);
    assert!(body.contains("draining"), "{body}");
    wait_status(&only_worker, "/livez", 200, Duration::from_secs(1)).await;

    gate.notify_waiters();
    let worker = binaries.children.get_mut("cyrene-loop-worker").unwrap();
    let exited = tokio::time::timeout(Duration::from_secs(20), worker.wait())
        .await
        .expect("the worker stops once its turn is done")
        .unwrap();
    assert!(exited.success(), "{exited}");
}
