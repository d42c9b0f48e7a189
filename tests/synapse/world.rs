//! The services a Matrix bridge talks to, in this process on a nats-server of their own: the
//! gateway on a scripted model (vision on: an image stays an image), the checkpoint store, the
//! orchestrator with owner `alice` (its personas ask for approval of every `count` call), a loop
//! worker and the test tools (tests/matrix.rs and benches/matrix.rs).

use crate::common;
use cyrene::stack::Stack;
use cyrene_model_gateway::providers::scripted::RequestLog;
use cyrene_test_support::NatsServer;
use serde_json::json;
use std::sync::Arc;

/// The services of one test, in this process, on a nats-server of their own.
pub struct World {
    /// Stops the services when dropped (first: before the server goes).
    _stack: Stack,
    pub server: NatsServer,
    pub client: async_nats::Client,
    pub model: RequestLog,
    pub tools: Arc<common::TestTools>,
    _data: tempfile::TempDir,
}

pub async fn world() -> World {
    let server = NatsServer::start();
    let client = server.connect().await;
    let data = tempfile::tempdir().unwrap();
    let rules = json!([{"contains": "slow", "tool_calls": [{"name": "hold"}],
                        "after_tools": "done after the wait"},
                       {"contains": "count", "tool_calls": [{"name": "count"}],
                        "after_tools": "counted: {tool_results}"}]);
    // The scripted model takes images itself (vision), so the view keeps them.
    let models = common::models(json!({"rules": rules, "vision": true}));
    let stack = Stack::builder(common::bus_config(&server), data.path())
        .models(models)
        .orchestrator_with(|orchestrator| {
            orchestrator.owner = Some("alice".into());
            // Every call of the test tool `count` waits for a person's approval
            // (docs/matrix-bridge.md, "Approving").
            for persona in &mut orchestrator.personas.personas {
                persona.approval = vec!["count".into()];
            }
        })
        .workers(1, common::worker_config())
        .start()
        .await
        .unwrap();
    let model = stack.model_log("offline").unwrap();
    let tools = common::TestTools::start(&server.connect().await, stack.shutdown().clone()).await;
    common::wait_for_stack(&stack, &client).await;
    common::wait_for_service(&client, "test-tools").await;
    World {
        _stack: stack,
        server,
        client,
        model,
        tools,
        _data: data,
    }
}
