//! The micro-service helpers over a real nats-server: JSON in, JSON or the error envelope out,
//! bad input answered without reaching the handler, trace context carried across the bus.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_bus::service::{RequestContext, ServeOptions, serve_json};
use cyrene_bus::{RequestError, request_json};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_test_support::micro::{self, add_endpoint, start_service};
use cyrene_test_support::{NatsServer, subscribed};
use opentelemetry::trace::TraceContextExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Greet {
    name: String,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Greeting {
    text: String,
    traceparent: Option<String>,
}

async fn greet(req: Greet, ctx: RequestContext) -> Result<Greeting, ErrorBody> {
    if req.name == "nobody" {
        return Err(ErrorBody::new(ErrorCode::NotFound, "nobody is here"));
    }
    if req.name == "everybody" {
        // A valid value the bus cannot carry (the test server's max_payload is 1 MiB).
        return Ok(Greeting {
            text: "hello ".repeat(300_000),
            traceparent: None,
        });
    }
    let traceparent = ctx
        .headers
        .get("traceparent")
        .map(|v| v.as_str().to_owned());
    Ok(Greeting {
        text: format!("hello {}", req.name),
        traceparent,
    })
}

const T: Duration = Duration::from_secs(5);

async fn start(server: &NatsServer, max_payload: usize) -> (async_nats::Client, CancellationToken) {
    let client = server.connect().await;
    let service = start_service(&client, "greeter", "0.1.0").await;
    let endpoint = add_endpoint(&service, "greet", "test.greet").await;
    let shutdown = CancellationToken::new();
    let options = ServeOptions {
        max_payload,
        ..ServeOptions::default()
    };
    tokio::spawn(serve_json(endpoint, options, shutdown.clone(), greet));
    client.flush().await.unwrap();
    // Keep the service (and its stats/info handlers) alive for the test.
    std::mem::forget(service);
    (client, shutdown)
}

/// Asks the greeter to greet `name`.
async fn ask_greeting(client: &async_nats::Client, name: &str) -> Result<Greeting, RequestError> {
    request_json(client, "test.greet", &json!({ "name": name }), T).await
}

#[tokio::test]
async fn answers_json_and_maps_handler_errors_to_the_envelope() {
    let server = NatsServer::start();
    let (client, _shutdown) = start(&server, 1024).await;

    let ok: Greeting = ask_greeting(&client, "ann").await.unwrap();
    assert_eq!(ok.text, "hello ann");

    let err = ask_greeting(&client, "nobody").await.unwrap_err();
    match err {
        RequestError::Remote(body) => {
            assert_eq!(body, ErrorBody::new(ErrorCode::NotFound, "nobody is here"))
        }
        other => panic!("expected the error envelope, got {other:?}"),
    }
}

#[tokio::test]
async fn bad_input_gets_a_structured_error_and_the_service_keeps_serving() {
    let server = NatsServer::start();
    let (client, _shutdown) = start(&server, 64).await;
    let cases: [(&[u8], &str, &str); 5] = [
        (b"{not json", "bad_request", "400"),
        (br#"{"name":7}"#, "bad_request", "400"),
        (br#"{"name":"a","extra":1}"#, "bad_request", "400"),
        (b"", "bad_request", "400"),
        (&[b' '; 65], "too_large", "413"),
    ];
    for (payload, code, status) in cases {
        let reply = client
            .request("test.greet", payload.to_vec().into())
            .await
            .unwrap();
        let headers = reply.headers.expect("error headers");
        assert_eq!(
            headers.get("Nats-Service-Error-Code").map(|v| v.as_str()),
            Some(status)
        );
        assert!(headers.get("Nats-Service-Error").is_some());
        let body: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(
            body["error"]["code"],
            code,
            "{}",
            String::from_utf8_lossy(payload)
        );
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    let ok: Greeting = ask_greeting(&client, "bo").await.unwrap();
    assert_eq!(ok.text, "hello bo");
}

#[tokio::test]
async fn every_reply_fits_the_bus_whatever_the_request_echoes() {
    let server = NatsServer::start();
    let (client, _shutdown) = start(&server, 1024 * 1024).await;
    // A 600 KB field name is quoted by the decoder's error: cut, header and body alike.
    let field = "f".repeat(600_000);
    let reply = client
        .request(
            "test.greet",
            format!(r#"{{"{field}":1}}"#).into_bytes().into(),
        )
        .await
        .unwrap();
    assert!(reply.payload.len() < 2048, "{} bytes", reply.payload.len());
    let body: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(body["error"]["code"], "bad_request");
    let header = reply.headers.unwrap();
    assert!(header.get("Nats-Service-Error").unwrap().as_str().len() <= 1024);

    // A reply over max_payload becomes a structured too_large instead of silence.
    let err = ask_greeting(&client, "everybody").await.unwrap_err();
    match err {
        RequestError::Remote(body) => assert_eq!(body.code, ErrorCode::TooLarge, "{body}"),
        other => panic!("expected too_large, got {other:?}"),
    }
    let ok: Greeting = ask_greeting(&client, "cy").await.unwrap();
    assert_eq!(ok.text, "hello cy");
}

#[tokio::test]
async fn no_responders_timeout_and_oversize_are_distinct_request_errors() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let err = request_json::<_, Greeting>(&client, "test.nobody", &json!({}), T)
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::NoResponders { .. }), "{err:?}");
    assert_eq!(err.code(), ErrorCode::Unavailable);

    let _silent = subscribed(&client, "test.silent").await;
    let short = Duration::from_millis(100);
    let err = request_json::<_, Greeting>(&client, "test.silent", &json!({}), short)
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::Timeout { .. }), "{err:?}");

    let huge = "x".repeat(2 * 1024 * 1024);
    let err = request_json::<_, Greeting>(&client, "test.silent", &huge, T)
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::TooLarge { .. }), "{err:?}");
    assert_eq!(err.code(), ErrorCode::TooLarge);
}

#[tokio::test]
async fn the_callers_trace_context_reaches_the_handler() {
    let _telemetry = cyrene_telemetry::init("bus-test");
    let server = NatsServer::start();
    let (client, _shutdown) = start(&server, 1024).await;
    let span = tracing::info_span!("caller");
    let trace_id = span.context().span().span_context().trace_id();
    assert!(
        span.context().span().span_context().is_valid(),
        "the test span has a trace id"
    );
    let reply: Greeting = request_json(&client, "test.greet", &json!({"name":"t"}), T)
        .instrument(span)
        .await
        .unwrap();
    let traceparent = reply.traceparent.expect("traceparent header sent");
    assert!(
        traceparent.contains(&trace_id.to_string()),
        "{traceparent} carries {trace_id}"
    );
}

#[tokio::test]
async fn shutdown_stops_the_endpoint() {
    let server = NatsServer::start();
    let (client, shutdown) = start(&server, 1024).await;
    let _: Greeting = ask_greeting(&client, "a").await.unwrap();
    shutdown.cancel();
    let gone = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            // A request racing the unsubscribe can go unanswered (see the module's Pitfalls):
            // each try is short.
            let short = Duration::from_millis(200);
            let body = json!({"name":"a"});
            let r = request_json::<_, Greeting>(&client, "test.greet", &body, short).await;
            if let Err(RequestError::NoResponders { .. }) = r {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(gone.is_ok(), "the endpoint unsubscribes after shutdown");
}

#[tokio::test]
async fn errors_are_counted_in_srv_stats_and_keep_their_envelope() {
    let server = NatsServer::start();
    let (client, _shutdown) = start(&server, 1024).await;
    let _: Greeting = ask_greeting(&client, "ann").await.unwrap();
    // A handler error and a body that never reaches the handler.
    let err = ask_greeting(&client, "nobody").await.unwrap_err();
    assert!(
        matches!(err, RequestError::Remote(ref b) if b.code == ErrorCode::NotFound),
        "{err:?}"
    );
    let reply = client
        .request("test.greet", "{not json".into())
        .await
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(body["error"]["code"], "bad_request");

    let stats = micro::answer(&client, "STATS", "greeter").await;
    let greet = &stats["endpoints"][0];
    assert_eq!(greet["name"], "greet", "{stats}");
    assert_eq!(greet["num_requests"], 3, "{stats}");
    assert_eq!(greet["num_errors"], 2, "{stats}");
    let last = greet["last_error"].as_str().unwrap_or_default();
    assert!(last.contains("400"), "{stats}");
}

/// issue 30, L1: `$SRV.STATS` is read by operators; an error's message is the caller's (it may
/// name a person's session or turn), so the stats keep its code only.
#[tokio::test]
async fn srv_stats_never_repeat_an_error_message() {
    let server = NatsServer::start();
    let (client, _shutdown) = start(&server, 1024).await;
    let err = ask_greeting(&client, "nobody").await.unwrap_err();
    let RequestError::Remote(body) = err else {
        panic!("{err:?}")
    };
    assert!(
        body.message.contains("nobody"),
        "the caller hears why: {body:?}"
    );
    let stats = micro::answer(&client, "STATS", "greeter").await;
    let last = stats["endpoints"][0]["last_error"]
        .as_str()
        .unwrap_or_default();
    assert!(last.contains("not_found"), "{stats}");
    assert!(!last.contains("nobody"), "{stats}");
}
