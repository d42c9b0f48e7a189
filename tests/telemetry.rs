//! OTLP export from a real service binary: a request carrying a W3C `traceparent` produces a
//! span of the *caller's* trace, exported to the collector named by
//! `OTEL_EXPORTER_OTLP_ENDPOINT` with the service's `service.name`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{service, wait_for_service};
use cyrene_test_support::NatsServer;
use cyrene_test_support::otlp;
use serde_json::json;
use std::time::Duration;
use wiremock::MockServer;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// Whether one export holds both the trace id and the service name.
async fn exported(collector: &MockServer, trace_id: &str, service_name: &str) -> bool {
    let requests = collector.received_requests().await.unwrap_or_default();
    let trace = hex_bytes(trace_id);
    requests.iter().any(|r| {
        r.body.windows(trace.len()).any(|w| w == trace.as_slice())
            && r.body
                .windows(service_name.len())
                .any(|w| w == service_name.as_bytes())
    })
}

#[tokio::test]
async fn a_service_exports_its_spans_in_the_callers_trace() {
    let collector = otlp::collector().await;
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let mut store = service(
        "cyrene-checkpoint-store",
        &nats.url(),
        &[
            ("CYRENE_STORE_DATA_DIR", data.path().to_str().unwrap()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.uri()),
        ],
    );
    let client = nats.connect().await;
    wait_for_service(&client, "cyrene-checkpoint-store").await;

    let headers = common::traceparent(TRACE_ID, "00f067aa0ba902b7");
    let reply = client
        .request_with_headers(
            "cyrene.checkpoint.latest",
            headers,
            r#"{"agent_id":"s1"}"#.into(),
        )
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&reply.payload).contains("not_found"));

    // A clean stop flushes the spans still queued.
    common::terminate(&store);
    let status = tokio::time::timeout(Duration::from_secs(10), store.wait())
        .await
        .expect("the store stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");

    let requests = collector.received_requests().await.unwrap_or_default();
    assert!(!requests.is_empty(), "no export reached the collector");
    assert!(
        exported(&collector, TRACE_ID, "cyrene-checkpoint-store").await,
        "no exported span carries the caller's trace id and the service name"
    );
}

/// The four service binaries, in this order.
const BINARIES: [&str; 4] = [
    "cyrene-model-gateway",
    "cyrene-checkpoint-store",
    "cyrene-orchestrator",
    "cyrene-loop-worker",
];

/// The four binaries ([`BINARIES`]) on `nats`, each exporting its spans to `otlp` under its
/// `service.name` of `names`, the scripted model following `rules` (echoing the rest as it is),
/// their data in `data`; each with the name it exports under.
fn exporting_binaries(
    nats: &NatsServer,
    data: &std::path::Path,
    rules: serde_json::Value,
    otlp: &str,
    names: [&'static str; 4],
) -> Vec<(&'static str, tokio::process::Child)> {
    let models = common::models_file(data, &common::models_replying(rules, "{input}"));
    let dir = data.to_str().unwrap();
    let extras = [
        ("CYRENE_GATEWAY_MODELS", models.to_str().unwrap()),
        ("CYRENE_STORE_DATA_DIR", dir),
        ("CYRENE_ORCHESTRATOR_DATA_DIR", dir),
        ("CYRENE_WORKER_CONCURRENCY", "2"),
    ];
    BINARIES
        .into_iter()
        .zip(extras)
        .zip(names)
        .map(|((binary, extra), name)| {
            let envs = [
                extra,
                ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp),
                ("OTEL_SERVICE_NAME", name),
            ];
            (name, service(binary, &nats.url(), &envs))
        })
        .collect()
}

/// One turn is one trace: a message sent with a `traceparent` becomes spans of that trace in the
/// orchestrator (send, dispatch), the loop worker (the turn, its steer, saves, tool call and
/// completion), the gateway (the model calls) and the checkpoint store (the saves) — each exported
/// by its own binary under its own `service.name` (`OTEL_SERVICE_NAME` where set).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_turn_is_one_trace_across_the_four_services() {
    const TURN_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
    let collector = otlp::collector().await;
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let rules = json!([{"contains": "time", "tool_calls": [{"name": "current_time"}],
                        "after_tools": "It is {tool_results}."}]);
    let names = [
        "gateway-under-test",
        "store-under-test",
        "orchestrator-under-test",
        "worker-under-test",
    ];
    let mut children = exporting_binaries(&nats, data.path(), rules, &collector.uri(), names);
    let client = nats.connect().await;
    common::wait_for_the_four_services(&client).await;
    let mut events = client
        .subscribe("cyrene.session.traced.events")
        .await
        .unwrap();
    let headers = common::traceparent(TURN_TRACE, "b7ad6b7169203331");
    let send = r#"{"session_id":"traced","message":{"role":"user","content":"what time is it?"}}"#;
    let ack = client
        .request_with_headers("cyrene.session.send", headers, send.into())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&ack.payload).contains("turn_started"));
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        use futures::StreamExt;
        while let Some(m) = events.next().await {
            if String::from_utf8_lossy(&m.payload).contains("\"turn_ended\"") {
                return;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the turn did not end");

    // Clean stops flush the spans still queued.
    for (_, child) in &mut children {
        let pid = child.id().unwrap().to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap();
    }
    for (name, child) in &mut children {
        let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .unwrap_or_else(|_| panic!("{name} did not stop"))
            .unwrap();
        assert!(status.success(), "{name}: {status}");
    }
    for (name, _) in &children {
        assert!(
            exported(&collector, TURN_TRACE, name).await,
            "{name} exported no span of the turn's trace"
        );
    }
}

/// D14 (issue 34): "input steered" is a span event of the turn (docs/operations.md): a message
/// steered into a running turn shows in the turn's trace, exported by the loop worker, in the
/// same export as a span of that trace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steered_message_is_an_event_of_the_turns_trace() {
    const TURN_TRACE: &str = "5c1e3b7a9d2f4e6a8b0c1d2e3f4a5b6c";
    let collector = otlp::collector().await;
    let nats = NatsServer::start();
    let client = nats.connect().await;
    // The `hold` tool is up before the worker discovers its tools.
    let shutdown = tokio_util::sync::CancellationToken::new();
    let tools = common::TestTools::start(&client, shutdown.clone()).await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    *tools.gate.lock().unwrap() = Some(gate.clone());
    let data = tempfile::tempdir().unwrap();
    let rules = json!([{"contains": "picnic", "tool_calls": [{"name": "hold"}],
                        "after_tools": "found {tool_results}"}]);
    let names = ["steer-under-test"; 4];
    let mut children: Vec<_> =
        exporting_binaries(&nats, data.path(), rules, &collector.uri(), names)
            .into_iter()
            .zip(BINARIES)
            .map(|((_, child), binary)| (binary, child))
            .collect();
    common::wait_for_the_four_services(&client).await;
    let mut events = client
        .subscribe("cyrene.session.steered.events")
        .await
        .unwrap();
    let headers = common::traceparent(TURN_TRACE, "b7ad6b7169203332");
    let send = r#"{"session_id":"steered","message":{"role":"user","content":"plan the picnic"}}"#;
    let ack = client
        .request_with_headers("cyrene.session.send", headers, send.into())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&ack.payload).contains("turn_started"));
    tools.hold_started("the held tool started").await;
    let steer = r#"{"session_id":"steered","message":{"role":"user","content":"bring tea"}}"#;
    let ack = client
        .request("cyrene.session.send", steer.into())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&ack.payload).contains("pending"));
    *tools.gate.lock().unwrap() = None;
    gate.notify_waiters();
    let mut steered = false;
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        use futures::StreamExt;
        while let Some(m) = events.next().await {
            let text = String::from_utf8_lossy(&m.payload).into_owned();
            steered |= text.contains("\"steer_ack\"");
            if text.contains("\"turn_ended\"") {
                return;
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the turn did not end");
    assert!(steered, "the message was steered into the turn");

    for (_, child) in &children {
        common::terminate(child);
    }
    for (name, child) in &mut children {
        let status = tokio::time::timeout(Duration::from_secs(20), child.wait())
            .await
            .unwrap_or_else(|_| panic!("{name} did not stop"))
            .unwrap();
        assert!(status.success(), "{name}: {status}");
    }
    shutdown.cancel();
    let trace = hex_bytes(TURN_TRACE);
    let event = b"input steered";
    let requests = collector.received_requests().await.unwrap_or_default();
    assert!(
        requests.iter().any(|r| {
            r.body.windows(trace.len()).any(|w| w == trace.as_slice())
                && r.body.windows(event.len()).any(|w| w == event)
        }),
        "no export holds the turn's trace and the \"input steered\" event"
    );
}
