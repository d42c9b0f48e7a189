//! OTLP export from a real service binary: a request carrying a W3C `traceparent` produces a
//! span of the *caller's* trace, exported to the collector named by
//! `OTEL_EXPORTER_OTLP_ENDPOINT` with the service's `service.name`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{service, wait_for_service};
use cyrene_test_support::NatsServer;
use std::time::Duration;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

fn hex_bytes(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test]
async fn a_service_exports_its_spans_in_the_callers_trace() {
    let collector = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/traces"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&collector)
        .await;
    let nats = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let mut store = service(
        "cyrene-checkpoint-store",
        &nats.url(),
        &[
            ("CYRENE_DATA_DIR", data.path().to_str().unwrap()),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.uri()),
        ],
    );
    let client = nats.connect().await;
    wait_for_service(&client, "cyrene-checkpoint-store").await;

    let mut headers = async_nats::HeaderMap::new();
    cyrene_bus::headers::insert(
        &mut headers,
        "traceparent",
        &format!("00-{TRACE_ID}-00f067aa0ba902b7-01"),
    )
    .unwrap();
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
    let pid = store.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(10), store.wait())
        .await
        .expect("the store stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");

    let requests = collector.received_requests().await.unwrap_or_default();
    assert!(!requests.is_empty(), "no export reached the collector");
    let trace = hex_bytes(TRACE_ID);
    let exported = requests.iter().any(|r| {
        r.body.windows(trace.len()).any(|w| w == trace.as_slice())
            && r.body
                .windows(b"cyrene-checkpoint-store".len())
                .any(|w| w == b"cyrene-checkpoint-store")
    });
    assert!(
        exported,
        "no exported span carries the caller's trace id and the service name"
    );
}
