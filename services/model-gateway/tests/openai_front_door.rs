//! The OpenAI-compatible HTTP front door with clients no one here wrote: the official `openai`
//! Python SDK (installed by scripts/py-tool.sh, as the Makefile does) runs
//! tests/openai_sdk/front_door.py against it — models, non-streamed and streamed text, streamed
//! tool calls, a tool round trip, images, reasoning_effort, error statuses — and raw HTTP checks
//! that hostile input gets OpenAI's error JSON. Calls go through the same gateway as the bus
//! (call records on a real nats-server).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{call_records, openai_upstream, shared_gateway};
use cyrene_model_gateway::http::{ClientKeys, HttpConfig, HttpLimits};
use cyrene_protocol::model::CallRecord;
use cyrene_test_support::NatsServer;
use cyrene_test_support::process::success_stdout;
use futures::StreamExt;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

const KEY: &str = "cyrene-test-client-key";
/// The SDK version the Makefile installs.
const OPENAI_SPEC: &str = "openai==3.57.0";

struct Door {
    _nats: NatsServer,
    upstream: MockServer,
    _down: MockServer,
    client: async_nats::Client,
    addr: SocketAddr,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

async fn start() -> Door {
    let upstream = openai_upstream(json!({
        "model":"m","choices":[{"message":{"role":"assistant","content":"from upstream"},
                                "finish_reason":"stop"}],
        "usage":{"prompt_tokens":4,"completion_tokens":2,"total_tokens":6,
                 "prompt_tokens_details":{"cached_tokens":3}}}))
    .await;
    let down = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(503).set_body_json(json!({"error":{"message":"overloaded"}})),
        )
        .mount(&down)
        .await;
    let gateway = shared_gateway(json!({
        "providers":{
          "offline":{"protocol":"scripted","models":{"scripted":{},"eyes":{"vision":true}},
            "script":{"rules":[
              {"contains":"time","tool_calls":[{"name":"get_time","args":{"tz":"UTC"}}],
               "after_tools":"It is {tool_results}."}],
             "default_reply":"(offline) you said: {input}"}},
          "up":{"protocol":"openai","base_url":upstream.uri(),"vendor":"openai","models":{"m":{}}},
          "broken":{"protocol":"openai","base_url":down.uri(),"models":{"down":{}}}},
        "groups":{"g":[{"provider":"offline","model":"scripted"}]},
        "active_group":"g"}));
    let nats = NatsServer::start();
    let client = nats.connect().await;
    let shutdown = CancellationToken::new();
    let config = HttpConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        keys: format!("other-key,{KEY}").parse::<ClientKeys>().unwrap(),
        limits: HttpLimits::default(),
    };
    let (addr, task) =
        cyrene_model_gateway::http::serve(config, gateway, client.clone(), shutdown.clone())
            .await
            .unwrap();
    Door {
        _nats: nats,
        upstream,
        _down: down,
        client,
        addr,
        shutdown,
        task,
    }
}

/// Where the `openai` package is: `CYRENE_OPENAI_PY` (the Makefile sets it), else installed now
/// by scripts/py-tool.sh exactly as the Makefile would.
fn openai_python_path() -> PathBuf {
    if let Some(dir) = std::env::var_os("CYRENE_OPENAI_PY") {
        return PathBuf::from(dir);
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(root.join("scripts/py-tool.sh"))
        .arg(OPENAI_SPEC)
        .output()
        .expect("scripts/py-tool.sh runs");
    let path = success_stdout(&out, &format!("installing {OPENAI_SPEC}"));
    PathBuf::from(path.trim())
}

#[tokio::test]
async fn the_official_openai_sdk_works_against_the_front_door() {
    let door = start().await;
    let mut records = call_records(&door.client).await;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_sdk/front_door.py");
    let pythonpath = openai_python_path();
    let base_url = format!("http://{}/v1", door.addr);
    let out = tokio::process::Command::new("python3")
        .arg(&script)
        .arg(&base_url)
        .arg(KEY)
        .env("PYTHONPATH", &pythonpath)
        .output()
        .await
        .unwrap();
    let stdout = success_stdout(&out, "the SDK script");
    for case in [
        "models",
        "non_stream",
        "stream_text",
        "stream_tool_call",
        "tool_round_trip",
        "image",
        "reasoning_effort",
        "error_404",
        "error_503",
        "error_503_stream",
        "error_400",
        "error_401",
    ] {
        assert!(
            stdout.lines().any(|l| l == format!("ok {case}")),
            "{case} missing:\n{stdout}"
        );
    }
    // reasoning_effort reached the provider in its own dialect.
    let sent: Vec<Value> = door
        .upstream
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.body_json().unwrap())
        .collect();
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0]["reasoning_effort"], "high");
    // Successful calls leave call records like bus calls do, tagged `http`.
    let record = tokio::time::timeout(Duration::from_secs(10), records.next())
        .await
        .unwrap()
        .unwrap();
    let record: CallRecord = serde_json::from_slice(&record.payload).unwrap();
    assert_eq!(record.purpose, "http");
    door.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), door.task)
        .await
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn hostile_http_input_gets_openai_error_json() {
    let door = start().await;
    let http = reqwest::Client::new();
    let url = |p: &str| format!("http://{}{p}", door.addr);
    let chat = url("/v1/chat/completions");
    let huge = vec![b'x'; cyrene_model_gateway::http::MAX_BODY + 1];
    let cases: Vec<(reqwest::RequestBuilder, u16)> = vec![
        (http.post(&chat).body("{}"), 401),
        (http.post(&chat).bearer_auth("nope").body("{}"), 401),
        (http.post(&chat).bearer_auth(KEY).body("{"), 400),
        (
            http.post(&chat).bearer_auth(KEY).body(vec![0xff, 0xfe]),
            400,
        ),
        (http.post(&chat).bearer_auth(KEY).body("[]"), 400),
        (
            http.post(&chat)
                .bearer_auth(KEY)
                .body(r#"{"model":"scripted","messages":[]}"#),
            400,
        ),
        (
            http.post(&chat)
                .bearer_auth(KEY)
                .body(r#"{"model":"scripted","messages":[{"role":"wizard","content":"x"}]}"#),
            400,
        ),
        (
            http.post(&chat)
                .bearer_auth(KEY)
                .body(r#"{"model":"scripted","messages":[{"role":"user","content":"x"}],"n":3}"#),
            400,
        ),
        (http.post(&chat).bearer_auth(KEY).body(huge), 413),
        (http.get(&chat).bearer_auth(KEY), 405),
        (http.get(url("/v1/nothing")).bearer_auth(KEY), 404),
    ];
    for (i, (request, status)) in cases.into_iter().enumerate() {
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), status, "case {i}");
        let body: Value = response.json().await.unwrap();
        assert!(body["error"]["message"].is_string(), "case {i}: {body}");
        assert!(body["error"]["type"].is_string(), "case {i}: {body}");
        assert!(!body.to_string().contains(KEY), "case {i} echoed the key");
    }
    // Still serving.
    let models: Value = http
        .get(url("/v1/models"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    door.shutdown.cancel();
}
