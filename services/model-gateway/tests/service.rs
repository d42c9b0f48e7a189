//! The gateway as a micro service over a real nats-server: request/response through the
//! scripted provider and through an HTTP provider, call records on `cyrene.model.calls`, bad
//! input of each kind, and the service still serving afterwards.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE};
use common::{call_records, openai_upstream, shared_gateway};
use cyrene_bus::RequestError;
use cyrene_bus::request::request_json;
use cyrene_bus::service::ServeOptions;
use cyrene_model_gateway::Gateway;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::{
    CallRecord, ModelRequest, ModelResponse, RouteRequest, RouteResponse, RouteStep,
};
use cyrene_protocol::subjects::{MODEL_COMPLETE, MODEL_ROUTE};
use cyrene_protocol::{ErrorCode, ErrorEnvelope};
use cyrene_test_support::NatsServer;
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use wiremock::MockServer;

const MAX_PAYLOAD: usize = 16 * 1024;
const WAIT: Duration = Duration::from_secs(10);

struct Running {
    _server: NatsServer,
    _upstream: MockServer,
    client: async_nats::Client,
    gateway: Arc<Gateway>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .unwrap()
            .unwrap();
    }
}

async fn start() -> Running {
    let upstream = openai_upstream(json!({
        "model":"m","choices":[{"message":{"role":"assistant","content":"from http"},
                                "finish_reason":"stop"}],
        "usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6}}))
    .await;
    let broken = format!("{}/broken", upstream.uri());
    let gateway = shared_gateway(json!({
        "providers":{
          "offline":{"protocol":"scripted","models":{"scripted":{}},"script":{"rules":[
              {"contains":"time","tool_calls":[{"name":"get_time","args":{"tz":"UTC"}}],
               "after_tools":"It is {tool_results}."}]}},
          "http":{"protocol":"openai","base_url":upstream.uri(),"models":{"m":{},"v":{"vision":true}}},
          "down":{"protocol":"openai","base_url":broken,"models":{"m":{}}}},
        "groups":{"default":[{"provider":"offline","model":"scripted"}]},
        "active_group":"default",
        "persona_providers":{"wire":[{"provider":"http","model":"m"}]}}));
    let server = NatsServer::start();
    let client = server.connect().await;
    let shutdown = CancellationToken::new();
    let options = ServeOptions {
        max_in_flight: 16,
        max_payload: MAX_PAYLOAD,
        ..ServeOptions::default()
    };
    let task = tokio::spawn({
        let (gateway, client, shutdown) = (gateway.clone(), client.clone(), shutdown.clone());
        async move {
            cyrene_model_gateway::serve(gateway, client, options, shutdown)
                .await
                .unwrap();
        }
    });
    // Ready once the endpoint answers anything (an empty object is a bad request).
    let mut ready = false;
    for _ in 0..100 {
        if let Ok(Ok(_)) = tokio::time::timeout(
            Duration::from_millis(500),
            client.request(MODEL_COMPLETE, "{}".into()),
        )
        .await
        {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "the gateway never answered");
    Running {
        _server: server,
        _upstream: upstream,
        client,
        gateway,
        shutdown,
        task,
    }
}

fn ask(text: &str) -> ModelRequest {
    ModelRequest {
        messages: vec![Message::text(Role::User, text)],
        purpose: "chat".into(),
        ..Default::default()
    }
}

async fn complete(client: &async_nats::Client, req: &ModelRequest) -> ModelResponse {
    request_json(client, MODEL_COMPLETE, req, WAIT)
        .await
        .unwrap()
}

async fn next_record(sub: &mut async_nats::Subscriber) -> CallRecord {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await
        .unwrap()
        .unwrap();
    serde_json::from_slice(&msg.payload).unwrap()
}

/// Sends raw bytes and returns (status header, envelope).
async fn raw_error(client: &async_nats::Client, payload: Vec<u8>) -> (String, ErrorEnvelope) {
    let reply = tokio::time::timeout(WAIT, client.request(MODEL_COMPLETE, payload.into()))
        .await
        .unwrap()
        .unwrap();
    let headers = reply.headers.as_ref().expect("error headers");
    assert!(headers.get(NATS_SERVICE_ERROR).is_some());
    let status = headers.get(NATS_SERVICE_ERROR_CODE).unwrap().to_string();
    (status, serde_json::from_slice(&reply.payload).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_call_answers_offline_and_publishes_its_call_record() {
    let gw = start().await;
    let log = gw.gateway.request_log("offline").unwrap();
    let mut calls = call_records(&gw.client).await;
    let resp = complete(&gw.client, &ask("hello there")).await;
    assert!(resp.offline);
    assert_eq!(resp.provider, "offline");
    assert_eq!(
        resp.content,
        "(offline scripted reply) You said: hello there"
    );
    let record = next_record(&mut calls).await;
    assert_eq!(record.model, "scripted");
    assert_eq!(record.purpose, "chat");
    assert_eq!(record.provider, "offline");
    assert_eq!(record.tokens, resp.total_tokens);
    assert_eq!(log.snapshot().last().unwrap(), &ask("hello there"));
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_tool_round_trip_works_over_the_bus() {
    let gw = start().await;
    let mut req = ask("what time is it?");
    let first = complete(&gw.client, &req).await;
    assert_eq!(first.stop_reason, "tool_calls");
    assert_eq!(first.tool_calls[0].name, "get_time");
    req.messages.push(first.message.clone());
    req.messages.push(Message::tool_result(
        first.tool_calls[0].id.clone(),
        "get_time",
        "12:00 UTC",
        false,
    ));
    let second = complete(&gw.client, &req).await;
    assert_eq!(second.content, "It is 12:00 UTC.");
    assert!(second.offline);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_through_an_http_provider_is_answered_and_recorded() {
    let gw = start().await;
    let mut calls = call_records(&gw.client).await;
    let mut req = ask("hi");
    req.persona_id = "wire".into();
    let resp = complete(&gw.client, &req).await;
    assert_eq!(resp.content, "from http");
    assert_eq!(resp.provider, "http");
    assert!(!resp.offline);
    let record = next_record(&mut calls).await;
    assert_eq!(
        (
            record.provider.as_str(),
            record.model.as_str(),
            record.tokens
        ),
        ("http", "m", 6)
    );
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_tells_the_main_model_and_whether_it_sees_images() {
    let running = start().await;
    let route = |req: RouteRequest| {
        let client = running.client.clone();
        async move {
            // The route endpoint registers just after `complete`: retry briefly.
            for _ in 0..50 {
                match request_json::<_, RouteResponse>(&client, MODEL_ROUTE, &req, WAIT).await {
                    Err(RequestError::NoResponders { .. }) => {
                        tokio::time::sleep(Duration::from_millis(20)).await
                    }
                    other => return other,
                }
            }
            panic!("no route endpoint");
        }
    };
    let default = route(RouteRequest::default()).await.unwrap();
    assert_eq!(
        default.steps,
        [RouteStep {
            provider: "offline".into(),
            model: "scripted".into(),
            vision: false
        }]
    );
    let persona = route(RouteRequest {
        persona_id: "wire".into(),
        ..Default::default()
    })
    .await;
    assert_eq!(persona.unwrap().steps[0].provider, "http");
    let vision = route(RouteRequest {
        model: "v".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(vision.main_has_vision());
    let unknown = route(RouteRequest {
        model: "nope".into(),
        ..Default::default()
    })
    .await;
    assert!(matches!(unknown, Err(RequestError::Remote(e)) if e.code == ErrorCode::BadRequest));
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_calls_publish_no_call_record() {
    let gw = start().await;
    let mut calls = call_records(&gw.client).await;
    // Model "m" is declared by `down` and `http`, tried in name order; `down` points at a path
    // the mock does not serve, so it answers 404: an upstream refusal, returned at once.
    let req = ModelRequest {
        model: "m".into(),
        ..ask("hi")
    };
    let err = request_json::<_, ModelResponse>(&gw.client, MODEL_COMPLETE, &req, WAIT).await;
    let body = match err {
        Err(cyrene_bus::RequestError::Remote(body)) => body,
        other => panic!("expected an upstream error, got {other:?}"),
    };
    assert_eq!(body.code, ErrorCode::Upstream);
    assert!(body.message.contains("provider down"), "{}", body.message);
    // The next success is the first record on the subject: the failure published none.
    complete(&gw.client, &ask("after")).await;
    let record = next_record(&mut calls).await;
    assert_eq!(record.provider, "offline");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_of_each_kind_is_answered_and_the_service_keeps_serving() {
    let gw = start().await;
    let cases: Vec<(&str, Vec<u8>, &str, ErrorCode, &str)> = vec![
        (
            "malformed",
            b"{\"messages\":[".to_vec(),
            "400",
            ErrorCode::BadRequest,
            "invalid request",
        ),
        (
            "empty body",
            Vec::new(),
            "400",
            ErrorCode::BadRequest,
            "empty request body",
        ),
        (
            "wrong types",
            br#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"many"}"#.to_vec(),
            "400",
            ErrorCode::BadRequest,
            "invalid type",
        ),
        (
            "unknown field",
            br#"{"messages":[{"role":"user","content":"x"}],"top_p":0.9}"#.to_vec(),
            "400",
            ErrorCode::BadRequest,
            "unknown field `top_p`",
        ),
        (
            "oversized",
            serde_json::to_vec(&ask(&"x".repeat(MAX_PAYLOAD))).unwrap(),
            "413",
            ErrorCode::TooLarge,
            "limit",
        ),
        (
            "empty messages",
            br#"{"messages":[]}"#.to_vec(),
            "400",
            ErrorCode::BadRequest,
            "messages must not be empty",
        ),
        (
            "document part",
            br#"{"messages":[{"role":"user","content":[{"type":"document","name":"d",
               "mime":"application/pdf","url":"cyrene-doc://d","size":1}]}]}"#
                .to_vec(),
            "400",
            ErrorCode::BadRequest,
            "document parts never reach a provider",
        ),
        (
            "unknown model",
            br#"{"messages":[{"role":"user","content":"x"}],"model":"gpt-9"}"#.to_vec(),
            "400",
            ErrorCode::BadRequest,
            "unknown model",
        ),
    ];
    for (what, payload, status, code, needle) in cases {
        let (got_status, envelope) = raw_error(&gw.client, payload).await;
        assert_eq!(got_status, status, "{what}");
        assert_eq!(envelope.error.code, code, "{what}");
        assert!(
            envelope.error.message.contains(needle),
            "{what}: {}",
            envelope.error.message
        );
    }
    let resp = complete(&gw.client, &ask("still there?")).await;
    assert!(resp.content.contains("still there?"));
    let wire: Value = serde_json::to_value(&resp).unwrap();
    assert_eq!(wire["offline"], json!(true));
    gw.stop().await;
}
