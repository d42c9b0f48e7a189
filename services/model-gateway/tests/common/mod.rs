//! Helpers shared by the gateway's test crates: mock upstreams and what they received,
//! gateways built from a JSON models config, and the call-record subject watched over NATS.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // each test crate uses a part

use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_protocol::subjects::MODEL_CALLS;
use cyrene_test_support::subscribed;
use serde_json::Value;
use std::sync::Arc;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

/// The JSON bodies of every request `server` received, in order.
pub async fn bodies(server: &MockServer) -> Vec<Value> {
    server
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.body_json::<Value>().unwrap())
        .collect()
}

/// How many requests `server` received.
pub async fn hits(server: &MockServer) -> usize {
    server.received_requests().await.unwrap().len()
}

/// A mock openai-protocol upstream answering every `/chat/completions` call with `reply`.
pub async fn openai_upstream(reply: Value) -> MockServer {
    let upstream = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/chat/completions"))
        .respond_with(ResponseTemplate::new(200).set_body_json(reply))
        .mount(&upstream)
        .await;
    upstream
}

/// A gateway over the models config `models`, with no secrets.
pub fn shared_gateway(models: Value) -> Arc<Gateway> {
    let models: ModelsConfig = serde_json::from_value(models).unwrap();
    let http = cyrene_model_gateway::http_client().unwrap();
    Arc::new(Gateway::new(models, &Secrets::default(), http).unwrap())
}

/// Call records on `cyrene.model.calls`, subscribed to before the test's first call.
pub async fn call_records(client: &async_nats::Client) -> async_nats::Subscriber {
    subscribed(client, MODEL_CALLS).await
}
