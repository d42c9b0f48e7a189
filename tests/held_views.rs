//! A turn's held view over the real stack, in the loop bench's shape (benches/loop.rs): a
//! session with history, started by `cyrene.session.send` through the real orchestrator, whose
//! turn runs several tool rounds on the real gateway (scripted provider).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use cyrene::stack::Stack;
use cyrene_test_support::NatsServer;
use serde_json::Value;
use std::time::Duration;

const ROUNDS: usize = 5;
const WINDOW: usize = 10;

/// Sends `text` to `session` and waits for its turn to end; the number of `step` events.
async fn turn(client: &async_nats::Client, session: &str, text: &str) -> usize {
    common::turn_steps(client, session, text, "test", Duration::from_secs(30))
        .await
        .len()
}

/// How many requests the gateway's endpoints `complete_stream` (a view sent whole) and
/// `complete_stream_replica` (a held view continued) have served.
async fn views_served(client: &async_nats::Client) -> (u64, u64) {
    let stats = client
        .request("$SRV.STATS.cyrene-model-gateway", "".into())
        .await
        .unwrap();
    let stats: Value = serde_json::from_slice(&stats.payload).unwrap();
    let served = |name: &str| {
        stats["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .map_or(0, |e| e["num_requests"].as_u64().unwrap())
    };
    (served("complete_stream"), served("complete_stream_replica"))
}

/// Only a turn's first call sends its view whole: every later step of a tool-round turn in a
/// session with history continues the view the gateway holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_round_turn_sends_its_view_whole_only_once() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let data = tempfile::tempdir().unwrap();
    let stack = Stack::builder(common::bus_config(&server), data.path())
        .models(common::models(common::tool_rounds_rules(ROUNDS)))
        .orchestrator_with(|orchestrator| {
            orchestrator.window = WINDOW;
            orchestrator.max_steps = ROUNDS as u32 + 2;
        })
        .workers(1, common::worker_config())
        .start()
        .await
        .unwrap();
    common::wait_for_stack(&stack, &client).await;
    let session = "held-view";
    for i in 0..WINDOW / 2 {
        turn(&client, session, &format!("earlier message {i}")).await;
    }
    for _ in 0..3 {
        let (whole, continued) = views_served(&client).await;
        let steps = turn(&client, session, "run the steps").await;
        assert_eq!(steps, ROUNDS + 1);
        let (whole_after, continued_after) = views_served(&client).await;
        assert_eq!(
            (whole_after - whole, continued_after - continued),
            (1, ROUNDS as u64),
            "(whole, continued) calls of one turn"
        );
    }
    drop(stack);
}
