//! External tool calls over a real nats-server.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_loop_worker::ports::ToolContext;
use cyrene_loop_worker::tools::Tools;
use cyrene_protocol::message::ToolCall;
use cyrene_test_support::NatsServer;
use std::time::Duration;

#[tokio::test]
async fn a_tool_call_id_that_cannot_be_a_header_is_an_error_result_not_a_panic() {
    let server = NatsServer::start();
    let tools = Tools::new(
        server.connect().await,
        Duration::from_secs(1),
        Duration::from_secs(1),
    );
    let context = ToolContext {
        agent_id: "cyrene".into(),
        session_id: "s".into(),
        turn_id: "t".into(),
    };
    let call = |id: &str| ToolCall {
        id: id.into(),
        name: "lookup".into(),
        args: Default::default(),
        args_error: None,
    };
    // The model's id goes into `Cyrene-Tool-Call-Id`: a line break would panic async-nats.
    for id in ["a\r\nInjected: yes", "\n", "a\rb"] {
        let out = tools.call(&context, &call(id)).await;
        assert!(out.is_error, "{id:?}");
        assert!(out.text.contains("was not called"), "{id:?}: {}", out.text);
    }
    // Any other id is sent (here: nobody serves the tool).
    let out = tools.call(&context, &call("昔涟 \u{7f}")).await;
    assert!(out.is_error);
    assert!(out.text.contains("not available"), "{}", out.text);
}
