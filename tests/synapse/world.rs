//! The services a Matrix bridge talks to, in this process on a nats-server of their own: the
//! gateway on a scripted model (vision on: an image stays an image), the checkpoint store, the
//! orchestrator with owner `alice` (its personas ask for approval of every `count` call), a loop
//! worker and the test tools (tests/matrix.rs and benches/matrix.rs).

use crate::common;
use cyrene_bus::service::ServeOptions;
use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_model_gateway::providers::scripted::RequestLog;
use cyrene_test_support::NatsServer;
use serde_json::json;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The services of one test, in this process, on a nats-server of their own.
pub struct World {
    pub server: NatsServer,
    pub client: async_nats::Client,
    pub model: RequestLog,
    pub tools: Arc<common::TestTools>,
    _data: tempfile::TempDir,
    shutdown: CancellationToken,
}

impl Drop for World {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub async fn world() -> World {
    let server = NatsServer::start();
    let client = server.connect().await;
    let shutdown = CancellationToken::new();
    let data = tempfile::tempdir().unwrap();
    let rules = json!([{"contains": "slow", "tool_calls": [{"name": "hold"}],
                        "after_tools": "done after the wait"},
                       {"contains": "count", "tool_calls": [{"name": "count"}],
                        "after_tools": "counted: {tool_results}"}]);
    // The scripted model takes images itself (vision), so the view keeps them.
    let models: ModelsConfig = serde_json::from_value(json!({
        "providers": {"offline": {"protocol": "scripted", "models": {"scripted": {"vision": true}},
            "script": {"rules": rules, "default_reply": "echo: {input}"}}},
        "groups": {"default": [{"provider": "offline", "model": "scripted"}]},
        "active_group": "default"
    }))
    .unwrap();
    let secrets = Secrets::from_pairs(Vec::<(String, String)>::new());
    let http = cyrene_model_gateway::http_client().unwrap();
    let gateway = Gateway::new(models, &secrets, http).unwrap();
    let model = gateway.request_log("offline").unwrap();
    tokio::spawn(cyrene_model_gateway::serve(
        Arc::new(gateway),
        server.connect().await,
        ServeOptions::default(),
        shutdown.clone(),
    ));
    tokio::spawn(cyrene_checkpoint_store::run(
        cyrene_checkpoint_store::Config::new(data.path()),
        server.connect().await,
        shutdown.clone(),
    ));
    let mut orchestrator = cyrene_orchestrator::Config::new(data.path());
    orchestrator.owner = Some("alice".into());
    // Every call of the test tool `count` waits for a person's approval (docs/matrix-bridge.md,
    // "Approving").
    for persona in &mut orchestrator.personas.personas {
        persona.approval = vec!["count".into()];
    }
    tokio::spawn(cyrene_orchestrator::run(
        orchestrator,
        server.connect().await,
        shutdown.clone(),
    ));
    tokio::spawn(cyrene_loop_worker::run(
        common::worker_config(),
        server.connect().await,
        shutdown.clone(),
    ));
    let tools = common::TestTools::start(&server.connect().await, shutdown.clone()).await;
    common::wait_for_the_four_services(&client).await;
    common::wait_for_service(&client, "test-tools").await;
    World {
        server,
        client,
        model,
        tools,
        _data: data,
        shutdown,
    }
}
