//! The loop worker over a real nats-server with the real gateway (scripted provider) and the real
//! checkpoint store; only the orchestrator's steer/complete endpoints are a test double.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use common::{Stack, job, worker_config};
use cyrene_loop_worker::nats::{NatsPorts, Timeouts};
use cyrene_loop_worker::runner::{RunnerConfig, TurnEnd, run_turn};
use cyrene_loop_worker::tools::Tools;
use cyrene_protocol::checkpoint::CheckpointState;
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::turn::{SteeredMessage, TurnComplete, TurnOutcome};
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;

fn rules() -> Value {
    json!([
        {"contains": "plan", "tool_calls": [{"name": "count"}], "more_rounds": [[{"name": "count"}]],
         "after_tools": "done: {tool_results}"},
        {"contains": "crash", "tool_calls": [{"name": "count"}], "more_rounds": [[{"name": "hold"}]],
         "after_tools": "survived: {tool_results}"},
        {"contains": "slow", "tool_calls": [{"name": "slow"}], "after_tools": "slow done"},
        {"contains": "leg", "tool_calls": [{"name": "count"}], "after_tools": "leg done"},
        {"contains": "broken", "tool_calls": [{"name": "broken"}], "after_tools": "saw: {tool_results}"},
        {"contains": "repeatable", "tool_calls": [{"name": "hold"}], "after_tools": "after: {tool_results}"},
        {"contains": "only once", "tool_calls": [{"name": "hold_once"}], "after_tools": "after: {tool_results}"}
    ])
}

fn state(cp: &cyrene_protocol::checkpoint::Checkpoint) -> CheckpointState {
    cp.state.parse().unwrap()
}

/// A stack with an in-process worker running turn `turn` ("make a plan") in `session`, whose
/// events are watched from before the dispatch.
async fn a_plan_watched(turn: &str, session: &str) -> (Stack, async_nats::Subscriber) {
    let stack = Stack::start(rules(), None).await;
    let events = session_events(&stack, session).await;
    stack.spawn_worker(worker_config()).await;
    stack.dispatch(&job(turn, session, "make a plan")).await;
    (stack, events)
}

/// A second worker process takes over; `turn` ends with its final answer, `how` (completed,
/// finished) by a redelivery. The worker is returned to live as long as the test.
async fn finished_by_a_second_worker(
    stack: &Stack,
    turn: &str,
    how: &str,
) -> (tokio::process::Child, TurnComplete) {
    let second = stack.worker_process("second");
    let done = stack.orchestrator.wait_completed(turn).await;
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert!(
        done.attempt >= 2,
        "{how} by a redelivery, attempt {}",
        done.attempt
    );
    (second, done)
}

/// The live events of `session`, subscribed to before the turn runs.
async fn session_events(stack: &Stack, session: &str) -> async_nats::Subscriber {
    let subject = format!("cyrene.session.{session}.events");
    stack.client.subscribe(subject).await.unwrap()
}

/// The next session event, within 10 s.
async fn next_event(events: &mut async_nats::Subscriber) -> SessionEvent {
    let m = tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .unwrap()
        .unwrap();
    serde_json::from_slice(&m.payload).unwrap()
}

/// The steps of `session`'s checkpoints, newest first.
async fn checkpointed_steps(stack: &Stack, session: &str) -> Vec<u32> {
    stack
        .checkpoints(session)
        .await
        .iter()
        .map(|c| c.step)
        .collect()
}

/// The first tool result in a checkpointed window: its text and whether it is an error.
fn first_tool_result(window: &[Message]) -> Option<(String, bool)> {
    window
        .iter()
        .flat_map(|m| &m.content)
        .find_map(|p| match p {
            Part::ToolResult { text, is_error, .. } => Some((text.clone(), *is_error)),
            _ => None,
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_step_tool_turn_runs_over_the_bus_and_checkpoints_every_step() {
    let (stack, mut events) = a_plan_watched("t1", "s1").await;

    let done = stack.orchestrator.wait_completed("t1").await;
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.steps, 3);
    assert_eq!(done.attempt, 1);
    let answer = done.message.unwrap();
    assert_eq!(
        answer.text_content(),
        "done: count ran as call_1_1\ncount ran as call_2_1"
    );
    assert_eq!(answer.sender_name, "cyrene");

    let checkpoints = stack.checkpoints("s1").await;
    let steps: Vec<u32> = checkpoints.iter().map(|c| c.step).collect();
    assert_eq!(steps, [3, 2, 1]);
    assert_eq!(state(&checkpoints[2]).stop_reason, "tool_calls");
    assert_eq!(state(&checkpoints[0]).stop_reason, "stop");
    assert_eq!(checkpoints[0].turn_id.as_deref(), Some("t1"));
    assert_eq!(stack.tools.runs.lock().unwrap().len(), 2);

    // The model saw the whole view every step. Steps 2 and 3 sent only what the step before
    // added, to the gateway replica holding the rest (docs/model-gateway.md, "Held views"): with
    // one persona in the session no attribution block appears (docs/semantics.md#attribution),
    // so each view continues the one before.
    let views: Vec<usize> = stack
        .log
        .snapshot()
        .iter()
        .map(|r| r.messages.len())
        .collect();
    assert_eq!(views.len(), 3);
    assert!(views.windows(2).all(|w| w[1] > w[0]), "{views:?}");
    let stats = stack
        .client
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
            .map(|e| e["num_requests"].as_u64().unwrap())
    };
    assert_eq!(served("complete_stream"), Some(1), "{stats}");
    assert_eq!(served("complete_stream_replica"), Some(2), "{stats}");

    let mut kinds = Vec::new();
    while kinds.last() != Some(&SessionEventType::Final) {
        let event = next_event(&mut events).await;
        assert_eq!(event.turn_id, "t1");
        // The answer's text deltas: a_streamed_turn_publishes_ordered_deltas_… checks them.
        if event.kind != SessionEventType::Delta {
            kinds.push(event.kind);
        }
    }
    use SessionEventType::*;
    assert_eq!(
        kinds,
        [
            Step, ToolCall, ToolResult, Step, ToolCall, ToolResult, Step, Final
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_turn_publishes_ordered_deltas_that_add_up_to_the_final_answer() {
    let (stack, mut events) = a_plan_watched("t9", "s9").await;

    // Everything up to the final event, in publication order.
    let mut deltas = Vec::new();
    let final_event = loop {
        let event = next_event(&mut events).await;
        match event.kind {
            SessionEventType::Delta => deltas.push(event),
            SessionEventType::Final => break event,
            _ => {}
        }
    };
    let answer = final_event.message.unwrap().text_content();
    assert_eq!(answer, "done: count ran as call_1_1\ncount ran as call_2_1");
    // Only the answering step (3) streams: the tool-call steps had no text. The scripted
    // provider hands the gateway every word at once, and deltas already waiting go out merged
    // (docs/model-gateway.md, "Streaming"), so there may be one delta or several.
    assert!(!deltas.is_empty(), "{deltas:?}");
    for (i, d) in deltas.iter().enumerate() {
        assert_eq!(d.turn_id, "t9");
        assert_eq!(d.at_step, Some(3));
        assert_eq!(d.attempt, Some(1));
        assert_eq!(d.sender_name, "cyrene");
        assert_eq!(d.seq, Some(i as u64), "in order, without gaps");
    }
    let joined: String = deltas.iter().map(|d| d.delta.clone().unwrap()).collect();
    assert_eq!(joined, answer);
    let done = stack.orchestrator.wait_completed("t9").await;
    assert_eq!(done.message.unwrap().text_content(), joined);
    // Checkpoints hold completed steps only, exactly as without streaming.
    let steps = checkpointed_steps(&stack, "s9").await;
    assert_eq!(steps, [3, 2, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steered_message_reaches_the_model_at_the_next_step_and_never_a_checkpoint() {
    let stack = Stack::start(rules(), None).await;
    let steered = Message::text(Role::User, "also tell me a joke");
    stack.orchestrator.steer_at.lock().unwrap().insert(
        ("t2".into(), 2),
        vec![SteeredMessage {
            id: "m2".into(),
            seq: 2,
            message: steered.clone(),
        }],
    );
    stack.spawn_worker(worker_config()).await;
    stack.dispatch(&job("t2", "s2", "make a plan")).await;
    let done = stack.orchestrator.wait_completed("t2").await;
    assert_eq!(done.steered_ids, ["m2"]);

    // Step 1 did not see it; step 2 did, as the last message before nothing else.
    let requests = stack.log.snapshot();
    assert!(!requests[0].messages.contains(&steered));
    assert!(requests[1].messages.contains(&steered));
    // The steered text becomes the last user text, so the script answers it by default.
    assert_eq!(
        done.message.unwrap().text_content(),
        "echo: also tell me a joke"
    );
    for cp in stack.checkpoints("s2").await {
        assert!(
            !state(&cp).messages.contains(&steered),
            "steered text in checkpoint {}",
            cp.id
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_killed_after_a_step_is_resumed_by_another_without_rerunning_tools() {
    let stack = Stack::start(rules(), None).await;
    let gate = Arc::new(tokio::sync::Notify::new());
    *stack.tools.gate.lock().unwrap() = Some(gate.clone());
    let mut first = stack.worker_process("first");
    stack.dispatch(&job("t3", "s3", "crash test")).await;

    // Step 1 (count) is checkpointed and step 2's tool (hold) is running in the first worker,
    // its intent saved as step 2's started row.
    stack.hold_started("step 2's tool started").await;
    let latest = &stack.checkpoints("s3").await[0];
    assert_eq!(
        (latest.step, state(latest).stop_reason.as_str()),
        (2, "tool_calls_started")
    );
    stack.kill_and_release(&mut first, &gate).await;

    let (_second, done) = finished_by_a_second_worker(&stack, "t3", "completed").await;
    assert_eq!(done.steps, 3);
    // Step 1's tool ran exactly once; step 2's (idempotent) was in flight at the crash and ran
    // again under the same id.
    assert_eq!(stack.tools.runs_of("call_1_1"), 1);
    let held = stack.tools.ids_of("hold");
    assert_eq!(held.len(), 2, "{held:?}");
    assert_eq!(held[0], held[1]);
    let steps = checkpointed_steps(&stack, "s3").await;
    assert_eq!(steps, [3, 2, 1]);
}

/// A worker SIGKILLed between a tool call's `started` intent and its result: the next delivery
/// continues that step's batch with the same call instead of asking the model again.
async fn killed_while(
    tool: &str,
    text: &str,
    turn: &str,
    session: &str,
) -> (Stack, Vec<SessionEvent>, TurnComplete) {
    let stack = Stack::start(rules(), None).await;
    let mut events = session_events(&stack, session).await;
    let gate = Arc::new(tokio::sync::Notify::new());
    *stack.tools.gate.lock().unwrap() = Some(gate.clone());
    let mut first = stack.worker_process("first");
    stack.dispatch(&job(turn, session, text)).await;
    stack.tools.tool_started(tool, "the tool started").await;
    // The intent is durable: the step's started row holds the call, no result.
    let latest = &stack.checkpoints(session).await[0];
    let started = state(latest);
    assert_eq!(
        (latest.step, started.stop_reason.as_str()),
        (1, "tool_calls_started")
    );
    let calls: Vec<&str> = started
        .messages
        .iter()
        .flat_map(|m| &m.content)
        .filter_map(|p| match p {
            Part::ToolCall { id, .. } => Some(id.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(calls, stack.tools.ids_of(tool));
    stack.kill_and_release(&mut first, &gate).await;
    let (_second, done) = finished_by_a_second_worker(&stack, turn, "finished").await;
    let mut seen = Vec::new();
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), events.next()).await {
        seen.extend(serde_json::from_slice::<SessionEvent>(&m.payload).ok());
    }
    (stack, seen, done)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_tool_running_at_a_kill_runs_again_once_under_the_same_call_id() {
    let (stack, events, done) = killed_while("hold", "repeatable", "ti", "si").await;
    let ids = stack.tools.ids_of("hold");
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(ids[0], ids[1], "the same Cyrene-Tool-Call-Id");
    assert_eq!(done.steps, 2);
    assert_eq!(
        done.message.unwrap().text_content(),
        "after: hold ran as call_1_1"
    );
    // The model was asked once for step 1 (by the first worker) and once for step 2.
    assert_eq!(stack.log.len(), 2);
    assert!(
        events
            .iter()
            .all(|e| e.kind != SessionEventType::ToolOutcomeUnknown)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_idempotent_tool_running_at_a_kill_is_never_run_again_and_its_outcome_is_unknown() {
    let (stack, events, done) = killed_while("hold_once", "only once", "tu", "su").await;
    let ids = stack.tools.ids_of("hold_once");
    assert_eq!(ids.len(), 1, "never run twice: {ids:?}");
    assert_eq!(done.steps, 2);
    // The model got the deterministic outcome-unknown result for that call.
    let requests = stack.log.snapshot();
    assert_eq!(requests.len(), 2, "step 1 was not asked again");
    let result = first_tool_result(&requests[1].messages);
    assert_eq!(
        result,
        Some((cyrene_loop_worker::runner::OUTCOME_UNKNOWN.to_owned(), true))
    );
    // The session was told, with the call's id, tool and arguments.
    let unknown: Vec<&SessionEvent> = events
        .iter()
        .filter(|e| e.kind == SessionEventType::ToolOutcomeUnknown)
        .collect();
    assert_eq!(unknown.len(), 1, "{events:?}");
    assert_eq!(unknown[0].call_id.as_deref(), Some(ids[0].as_str()));
    assert_eq!(unknown[0].tool.as_deref(), Some("hold_once"));
    assert_eq!(unknown[0].arguments, Some(serde_json::Map::new()));
    // The checkpoints show the intent's outcome: step 1's row holds the unknown result.
    let step1 = stack
        .checkpoints("su")
        .await
        .into_iter()
        .find(|c| c.step == 1)
        .unwrap();
    assert_eq!(state(&step1).stop_reason, "tool_calls");
    assert_eq!(
        first_tool_result(&state(&step1).messages),
        Some((cyrene_loop_worker::runner::OUTCOME_UNKNOWN.to_owned(), true))
    );
    assert_eq!(checkpointed_steps(&stack, "su").await, [2, 1]);
}

/// Issue 10's bug: a session's second turn, killed after its step 1, must resume from its own
/// step 1 — not start over because the first turn's step 3 is the owner's highest step.
async fn a_second_turn_killed_after_its_first_step_resumes_it(database_url: Option<String>) {
    let stack = Stack::start(rules(), database_url).await;
    let count_runs = |tools: &common::TestTools| {
        let runs = tools.runs.lock().unwrap();
        runs.iter().filter(|(name, _)| name == "count").count()
    };
    let mut first = stack.worker_process("first");
    // Turn 1: two tool steps, then the answer (steps 1, 2, 3).
    stack.dispatch(&job("turn1", "s", "make a plan")).await;
    assert_eq!(stack.orchestrator.wait_completed("turn1").await.steps, 3);
    assert_eq!(count_runs(&stack.tools), 2);

    // Turn 2: step 1 runs `count` and is checkpointed; step 2's tool holds until the kill.
    let gate = Arc::new(tokio::sync::Notify::new());
    *stack.tools.gate.lock().unwrap() = Some(gate.clone());
    stack.dispatch(&job("turn2", "s", "crash test")).await;
    stack.hold_started("turn 2's step 2 started").await;
    let rows = stack.checkpoints("s").await;
    assert_eq!(
        (rows[0].id.as_str(), rows[1].id.as_str()),
        ("s:turn2:2", "s:turn2:1"),
        "the latest is the last write: turn 2's started step 2, after its step 1"
    );
    assert_eq!(rows.len(), 5, "turn 1's three rows are all still there");
    stack.kill_and_release(&mut first, &gate).await;

    let (_second, done) = finished_by_a_second_worker(&stack, "turn2", "finished").await;
    assert_eq!(done.steps, 3, "resumed at step 2, not started over");
    assert_eq!(
        count_runs(&stack.tools),
        3,
        "turn 2's step-1 tool ran again"
    );
    let turn2: Vec<u32> = stack
        .checkpoints("s")
        .await
        .iter()
        .filter(|c| c.turn_id.as_deref() == Some("turn2"))
        .map(|c| c.step)
        .collect();
    assert_eq!(turn2, [3, 2, 1]);
    assert_eq!(
        completion_count(&stack, "turn1"),
        1,
        "turn 1 was not run again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_killed_after_its_first_step_resumes_it_on_sqlite() {
    a_second_turn_killed_after_its_first_step_resumes_it(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_turn_killed_after_its_first_step_resumes_it_on_postgres() {
    let db = common::fresh_postgres("cyrene_lw")
        .await
        .expect("PostgreSQL at 127.0.0.1:5432 (make test starts one)");
    a_second_turn_killed_after_its_first_step_resumes_it(Some(db.url.clone())).await;
}

/// Failover is bounded by a short `ack_wait`, but a live worker waiting far longer than that (on
/// a tool here; a model call is the same to the heartbeat) keeps its job: no redelivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_five_times_the_ack_wait_is_no_failover() {
    let stack = Stack::start(rules(), None).await;
    let gate = Arc::new(tokio::sync::Notify::new());
    *stack.tools.gate.lock().unwrap() = Some(gate.clone());
    let mut config = worker_config();
    config.ack_wait = Duration::from_millis(400);
    stack.spawn_worker(config).await;
    stack.dispatch(&job("tw", "sw", "crash test")).await;
    stack.hold_started("the held tool started").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    *stack.tools.gate.lock().unwrap() = None;
    gate.notify_waiters();
    let done = stack.orchestrator.wait_completed("tw").await;
    assert_eq!(
        done.attempt, 1,
        "the job was redelivered while its worker was alive"
    );
    assert_eq!(stack.tools.runs_of("call_2_1"), 1);
}

/// A held view whose replica is gone costs one more call, not the turn: the step sends its view
/// whole to another replica (docs/model-gateway.md, "Held views").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_whose_view_replica_is_gone_sends_the_view_whole_to_another() {
    let stack = Stack::start_with(rules(), None, false).await;
    let first = tokio_util::sync::CancellationToken::new();
    let gateway = common::scripted_gateway(rules());
    let first_log = gateway.request_log("offline").unwrap();
    let serving = tokio::spawn(cyrene_model_gateway::serve(
        Arc::new(gateway),
        stack.server.connect().await,
        cyrene_bus::service::ServeOptions::default(),
        first.clone(),
    ));
    let gate = Arc::new(tokio::sync::Notify::new());
    *stack.tools.gate.lock().unwrap() = Some(gate.clone());
    stack.spawn_worker(worker_config()).await;
    // Step 1 runs `count`, step 2 `hold`: the first gateway holds step 2's view.
    stack.dispatch(&job("tg", "sg", "crash test")).await;
    stack.hold_started("step 2's tool started").await;
    assert_eq!(first_log.len(), 2);
    // That gateway stops (nothing on the bus answers for it any more); another one starts.
    first.cancel();
    serving.await.unwrap().unwrap();
    loop {
        let ping = stack
            .client
            .request("$SRV.PING.cyrene-model-gateway", "".into());
        match tokio::time::timeout(Duration::from_millis(200), ping).await {
            Ok(Err(err)) if err.kind() == async_nats::RequestErrorKind::NoResponders => break,
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    let second = tokio_util::sync::CancellationToken::new();
    let second_log = common::spawn_scripted_gateway(rules(), stack.server.connect().await, &second);
    // The other replica answers before the tool is let go: the step must find it there (a step
    // that finds no gateway at all is a retryable failure, which is another test's subject).
    loop {
        let ping = stack
            .client
            .request("$SRV.PING.cyrene-model-gateway", "".into());
        match tokio::time::timeout(Duration::from_millis(200), ping).await {
            Ok(Ok(_)) => break,
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    *stack.tools.gate.lock().unwrap() = None;
    gate.notify_waiters();

    let done = stack.orchestrator.wait_completed("tg").await;
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(
        done.attempt, 1,
        "the step went on, the turn was not redelivered"
    );
    assert_eq!(done.steps, 3);
    // The second gateway got step 3's view whole: step 2's view and what step 2 added.
    let seen = second_log.snapshot();
    assert_eq!(seen.len(), 1);
    let held = first_log.snapshot().pop().unwrap().messages;
    assert_eq!(seen[0].messages[..held.len()], held[..]);
    assert_eq!(seen[0].messages.len(), held.len() + 2);
    assert_eq!(stack.tools.runs_of("call_2_1"), 1, "step 2's tool ran once");
    second.cancel();
}

/// A runner's ports over `stack`'s bus: tools and checkpoints bounded at 5 s, steers at 2 s,
/// model calls at `model`.
fn ports_on(stack: &Stack, model: Duration) -> NatsPorts {
    NatsPorts::new(
        stack.client.clone(),
        Tools::new(
            stack.client.clone(),
            Duration::from_secs(5),
            Duration::from_secs(5),
        ),
        Timeouts {
            model,
            checkpoint: Duration::from_secs(5),
            steer: Duration::from_secs(2),
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_attempt_is_refused_once_a_newer_attempt_wrote() {
    let stack = Stack::start(rules(), None).await;
    let ports = ports_on(&stack, Duration::from_secs(5));
    let cfg = RunnerConfig {
        purpose: "chat".into(),
        max_attempts: 5,
    };
    let j = job("t4", "s4", "leg of a zombie");
    // Attempt 2 runs the turn to completion first …
    let live = run_turn(&ports, &j, 2, &cfg).await;
    assert!(
        matches!(live, TurnEnd::Complete(ref c) if c.outcome == TurnOutcome::Final),
        "{live:?}"
    );
    // … then the stalled attempt 1 wakes up: it sees the newer attempt and stops.
    let before = stack.checkpoints("s4").await;
    let zombie = run_turn(&ports, &j, 1, &cfg).await;
    assert_eq!(zombie, TurnEnd::Stale);
    assert_eq!(
        stack.checkpoints("s4").await,
        before,
        "the zombie wrote nothing"
    );
    // Had it tried, the store would have refused its writes.
    let checkpoints = cyrene_checkpoint_client::CheckpointClient::new(
        stack.client.clone(),
        Duration::from_secs(5),
    );
    let mut stale = before[0].clone();
    stale.attempt = Some(1);
    let refused = checkpoints.save(&stale).await.unwrap_err();
    assert_eq!(refused.code(), cyrene_protocol::ErrorCode::Conflict);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_parallel_legs_keep_separate_checkpoints() {
    let stack = Stack::start(rules(), None).await;
    stack.spawn_worker(worker_config()).await;
    let mut a = job("t5a", "s5", "first leg");
    a.leg_id = "a".into();
    let mut b = job("t5b", "s5", "second leg");
    b.leg_id = "b".into();
    b.notice = Some(Default::default());
    stack.dispatch(&a).await;
    stack.dispatch(&b).await;
    stack.orchestrator.wait_completed("t5a").await;
    stack.orchestrator.wait_completed("t5b").await;

    let leg_a = stack.checkpoints("s5#a").await;
    let leg_b = stack.checkpoints("s5#b").await;
    assert_eq!(leg_a.len(), 2);
    assert_eq!(leg_b.len(), 2);
    assert!(leg_a.iter().all(|c| c.turn_id.as_deref() == Some("t5a")));
    assert!(leg_b.iter().all(|c| c.turn_id.as_deref() == Some("t5b")));
    assert_eq!(state(&leg_a[0]).messages[0].text_content(), "first leg");
    assert_eq!(state(&leg_b[0]).messages[0].text_content(), "second leg");
    assert!(
        stack.checkpoints("s5").await.is_empty(),
        "no rows under the bare session"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_tool_is_never_cancelled_by_steering() {
    let stack = Stack::start(rules(), None).await;
    // A message is waiting to be steered from the very first boundary on.
    stack.orchestrator.steer_at.lock().unwrap().insert(
        ("t6".into(), 2),
        vec![SteeredMessage {
            id: "m6".into(),
            seq: 2,
            message: Message::text(Role::User, "hurry up"),
        }],
    );
    stack.spawn_worker(worker_config()).await;
    stack.dispatch(&job("t6", "s6", "slow please")).await;
    let done = stack.orchestrator.wait_completed("t6").await;

    let finished = stack.tools.finished.lock().unwrap().clone();
    assert_eq!(finished.len(), 1, "the slow tool ran to its end");
    // Pushed while the tool ran, taken in only at the boundary after it.
    assert_eq!(done.steered_ids, ["m6"]);
    let requests = stack.log.snapshot();
    let hurry = |i: usize| {
        requests[i]
            .messages
            .iter()
            .any(|m| m.text_content() == "hurry up")
    };
    assert!(
        !hurry(0) && hurry(1),
        "seen by the step after the tool batch, not before"
    );
    let window = state(&stack.checkpoints("s6").await.last().cloned().unwrap()).messages;
    let result = first_tool_result(&window);
    assert_eq!(result, Some(("slow ran as call_1_1".to_owned(), false)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_tool_becomes_an_error_result_and_the_turn_goes_on() {
    let stack = Stack::start(rules(), None).await;
    stack.spawn_worker(worker_config()).await;
    stack
        .dispatch(&job("t7", "s7", "use the broken tool"))
        .await;
    let done = stack.orchestrator.wait_completed("t7").await;
    assert_eq!(done.outcome, TurnOutcome::Final);
    let window = state(&stack.checkpoints("s7").await[0]).messages;
    let result = first_tool_result(&window);
    let (text, is_error) = result.expect("a tool result");
    assert!(is_error, "a micro error is an is_error result: {text}");
    assert!(text.contains("no such record"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_out_of_deliveries_is_reported_as_an_error() {
    // No gateway: every model call fails retryably, so each delivery naks until the last.
    let stack = Stack::start_with(rules(), None, false).await;
    let mut events = session_events(&stack, "s8").await;
    let mut config = worker_config();
    config.max_deliver = 2;
    config.model_timeout = Duration::from_millis(300);
    stack.spawn_worker(config).await;
    stack.dispatch(&job("t8", "s8", "anyone there?")).await;

    let done = stack.orchestrator.wait_completed("t8").await;
    assert_eq!(done.outcome, TurnOutcome::Error);
    assert_eq!(done.attempt, 2, "reported by the last delivery");
    assert_eq!(
        done.error.unwrap().code,
        cyrene_protocol::ErrorCode::Unavailable
    );
    let error = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let m = events.next().await.unwrap();
            let e: SessionEvent = serde_json::from_slice(&m.payload).unwrap();
            if e.kind == SessionEventType::Error {
                return e;
            }
        }
    })
    .await
    .expect("an error event");
    assert_eq!(error.turn_id, "t8");
    let settled = &stack.checkpoints("s8").await[0];
    assert_eq!(
        state(settled).stop_reason,
        "error",
        "settled: the next turn starts fresh"
    );
    assert_eq!(completion_count(&stack, "t8"), 1);
}

fn completion_count(stack: &Stack, turn: &str) -> usize {
    common::completion_counts(&stack.orchestrator)
        .get(turn)
        .copied()
        .unwrap_or(0)
}

/// The `tool_choice` values a dialect's schema accepts: Anthropic only objects
/// (`auto`/`any`/`tool`/`none`), OpenAI strings (`none`/`auto`/`required`) or a named function.
fn tool_choice_fits(protocol: &str, choice: &Value) -> bool {
    match protocol {
        "anthropic" => {
            choice.is_object()
                && ["auto", "any", "tool", "none"].contains(&choice["type"].as_str().unwrap_or(""))
        }
        _ => {
            ["none", "auto", "required"].contains(&choice.as_str().unwrap_or(""))
                || (choice["type"] == "function" && choice["function"]["name"].is_string())
        }
    }
}

/// A provider of `protocol` that refuses (400) a `tool_choice` its schema does not accept, and
/// keeps calling `current_time` until tool use is switched off, then answers in text.
async fn a_tool_happy_provider(protocol: &'static str) -> wiremock::MockServer {
    let server = wiremock::MockServer::start().await;
    let respond = move |request: &wiremock::Request| {
        let body: Value = request.body_json().unwrap();
        let choice = body.get("tool_choice").cloned();
        if let Some(choice) = &choice
            && !tool_choice_fits(protocol, choice)
        {
            let error = json!({"type": "error", "error": {"type": "invalid_request_error",
                "message": format!("tool_choice: invalid value {choice}")}});
            return wiremock::ResponseTemplate::new(400).set_body_json(error);
        }
        let off = choice.is_some();
        let reply = match (protocol, off) {
            ("anthropic", false) => json!({"id": "msg_1", "type": "message", "role": "assistant",
                "model": "m", "content": [{"type": "tool_use", "id": format!("toolu_{}", rand_id()),
                "name": "current_time", "input": {}}], "stop_reason": "tool_use",
                "usage": {"input_tokens": 3, "output_tokens": 2}}),
            ("anthropic", true) => json!({"id": "msg_2", "type": "message", "role": "assistant",
                "model": "m", "content": [{"type": "text", "text": "From what I found: noon."}],
                "stop_reason": "end_turn", "usage": {"input_tokens": 3, "output_tokens": 2}}),
            (_, false) => json!({"id": "c1", "model": "m", "choices": [{"index": 0,
                "message": {"role": "assistant", "content": null, "tool_calls": [{"id":
                format!("call_{}", rand_id()), "type": "function", "function": {"name": "current_time",
                "arguments": "{}"}}]}, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
            (_, true) => json!({"id": "c2", "model": "m", "choices": [{"index": 0,
                "message": {"role": "assistant", "content": "From what I found: noon."},
                "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
        };
        wiremock::ResponseTemplate::new(200).set_body_json(reply)
    };
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(respond)
        .mount(&server)
        .await;
    server
}

fn rand_id() -> String {
    cyrene_protocol::ids::new_id()
}

/// D17 (issue 29): the step-limit safety net answers on both dialects: its `tool_choice` is the
/// neutral `{"type":"none"}`, which Anthropic takes as is and the OpenAI dialect sends as
/// `"none"`, each against a provider that enforces its own schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_safety_net_answers_on_both_dialects() {
    for protocol in ["anthropic", "openai"] {
        let upstream = a_tool_happy_provider(protocol).await;
        let stack = stack_over(protocol, &upstream).await;
        let ports = ports_on(&stack, Duration::from_secs(10));
        let mut j = job(
            &format!("tn-{protocol}"),
            &format!("sn-{protocol}"),
            "what time?",
        );
        j.max_steps = 2;
        let end = run_turn(&ports, &j, 1, &RunnerConfig::default()).await;
        let TurnEnd::Complete(done) = end else {
            panic!("{protocol}: {end:?}");
        };
        assert_eq!(
            (done.outcome, done.stop_reason.as_str()),
            (TurnOutcome::Final, "safety_net"),
            "{protocol}"
        );
        assert_eq!(
            done.message.unwrap().text_content(),
            "From what I found: noon.",
            "{protocol}"
        );
        let requests = upstream.received_requests().await.unwrap();
        assert_eq!(
            requests.len(),
            3,
            "{protocol}: two steps and the safety net"
        );
        let last: Value = requests[2].body_json().unwrap();
        let sent = if protocol == "anthropic" {
            json!({"type": "none"})
        } else {
            json!("none")
        };
        assert_eq!(last["tool_choice"], sent, "{protocol}");
    }
}

/// Starts gateway processes on `stack`'s bus, each named by its argument (`OTEL_SERVICE_NAME`),
/// whose one provider speaks OpenAI at `base_url` (the model config is in the stack's data dir).
fn openai_gateways(
    stack: &Stack,
    base_url: &str,
) -> impl Fn(&str) -> tokio::process::Child + use<> {
    let models = stack.data.path().join("models.json");
    let config = json!({"providers": {"p": {"protocol": "openai", "base_url": base_url,
        "models": {"m": {}}}}, "groups": {"g": [{"provider": "p", "model": "m"}]},
        "active_group": "g"});
    std::fs::write(&models, config.to_string()).unwrap();
    let models = models.display().to_string();
    let url = stack.server.url();
    move |name| {
        common::service(
            "cyrene-model-gateway",
            &url,
            &[
                ("CYRENE_GATEWAY_MODELS", models.as_str()),
                ("OTEL_SERVICE_NAME", name),
            ],
        )
    }
}

/// A stack whose gateway (in this process) has one provider of `protocol` at `upstream`.
async fn stack_over(protocol: &str, upstream: &wiremock::MockServer) -> Stack {
    let stack = Stack::start_with(rules(), None, false).await;
    let models: cyrene_model_gateway::config::ModelsConfig = serde_json::from_value(json!({
        "providers": {"p": {"protocol": protocol, "base_url": upstream.uri(),
            "models": {"m": {}}}},
        "groups": {"g": [{"provider": "p", "model": "m"}]}, "active_group": "g"}))
    .unwrap();
    let gateway = cyrene_model_gateway::Gateway::new(
        models,
        &cyrene_model_gateway::config::Secrets::default(),
        cyrene_model_gateway::http_client().unwrap(),
    )
    .unwrap();
    tokio::spawn(cyrene_model_gateway::serve(
        Arc::new(gateway),
        stack.server.connect().await,
        cyrene_bus::service::ServeOptions::default(),
        stack.shutdown.clone(),
    ));
    common::wait_for_service(&stack.client, "cyrene-model-gateway").await;
    stack
}

/// D18 (issue 29): a provider answers with text but `finish_reason: "tool_calls"` and no calls
/// (vLLM tool-parser failures, some proxies). The worker saves the answer and is SIGKILLed
/// before its report lands; the redelivery reports the same answer: no second model call, no
/// second `final` event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_saved_before_a_kill_is_reported_again_not_answered_twice() {
    let upstream = wiremock::MockServer::start().await;
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_body_json(json!({
            "id": "c", "model": "m", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": "It is noon."},
            "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})))
        .mount(&upstream)
        .await;
    let stack = stack_over("openai", &upstream).await;
    let mut events = session_events(&stack, "sk").await;
    let orchestrator = stack.orchestrator.clone();
    orchestrator
        .refuse_completions
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let mut first = stack.worker_process("first");
    stack.dispatch(&job("tk", "sk", "what time is it?")).await;

    // The answer is saved and the report is being sent: the worker dies there.
    common::eventually("the first report was sent", Duration::from_secs(30), || {
        orchestrator
            .refused
            .load(std::sync::atomic::Ordering::SeqCst)
            > 0
    })
    .await;
    first.start_kill().unwrap(); // SIGKILL
    first.wait().await.unwrap();
    orchestrator
        .refuse_completions
        .store(false, std::sync::atomic::Ordering::SeqCst);

    let (_second, done) = finished_by_a_second_worker(&stack, "tk", "reported").await;
    assert_eq!(done.message.unwrap().text_content(), "It is noon.");
    assert_eq!(
        upstream.received_requests().await.unwrap().len(),
        1,
        "the model was asked again"
    );
    assert_eq!(done.stop_reason, "stop");
    let mut finals = 0;
    while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(500), events.next()).await {
        let event: SessionEvent = serde_json::from_slice(&m.payload).unwrap();
        finals += usize::from(event.kind == SessionEventType::Final);
    }
    assert_eq!(finals, 1, "one final event");
    let settled = state(&stack.checkpoints("sk").await[0]);
    assert_eq!(
        (settled.stop_reason.as_str(), settled.finish_reason.as_str()),
        ("stop", "tool_calls"),
        "settled under the loop's stop, the provider's reason beside it"
    );
}

/// How many replies a request on `subject` gathers within `wait` (e.g. live replicas on a
/// `$SRV.PING` subject).
async fn responders(client: &async_nats::Client, subject: &str, wait: Duration) -> usize {
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.unwrap();
    client
        .publish_with_reply(subject.to_owned(), inbox, "".into())
        .await
        .unwrap();
    let mut n = 0;
    while let Ok(Some(_)) = tokio::time::timeout(wait, replies.next()).await {
        n += 1;
    }
    n
}

/// Issue 29, item 4: the gateway replica serving a step's model call is SIGKILLed mid-call. Its
/// heartbeats stop, the worker notices within about a second and sends the call to the other
/// replica: the turn completes in the same attempt, long before the model timeout (60 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_call_costs_a_retry_on_another_replica_not_the_model_timeout() {
    let reply = json!({"id": "c", "model": "m", "choices": [{"index": 0,
        "message": {"role": "assistant", "content": "It is noon."}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}});
    let upstream = wiremock::MockServer::start().await;
    // The first call hangs (its replica dies during it); later ones answer at once.
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(
            wiremock::ResponseTemplate::new(200)
                .set_delay(Duration::from_secs(600))
                .set_body_json(reply.clone()),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .mount(&upstream)
        .await;
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_body_json(reply))
        .mount(&upstream)
        .await;
    let stack = Stack::start_with(rules(), None, false).await;
    let gateway = openai_gateways(&stack, &upstream.uri());
    let mut first = gateway("first");
    common::wait_for_service(&stack.client, "cyrene-model-gateway").await;
    let mut config = worker_config();
    config.model_timeout = Duration::from_secs(60);
    stack.spawn_worker(config).await;
    stack.dispatch(&job("tv", "sv", "what time is it?")).await;
    tokio::time::timeout(Duration::from_secs(30), async {
        while upstream.received_requests().await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the first replica took the call");
    let _second = gateway("second");
    let ping = "$SRV.PING.cyrene-model-gateway";
    tokio::time::timeout(Duration::from_secs(30), async {
        while responders(&stack.client, ping, Duration::from_millis(200)).await < 2 {}
    })
    .await
    .expect("the second replica is up");

    first.start_kill().unwrap(); // SIGKILL, mid-call
    first.wait().await.unwrap();
    let done = tokio::time::timeout(
        Duration::from_secs(20),
        stack.orchestrator.wait_completed("tv"),
    )
    .await
    .expect("completed long before the model timeout");
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.message.unwrap().text_content(), "It is noon.");
    assert_eq!(
        done.attempt, 1,
        "retried within the attempt, not redelivered"
    );
    assert_eq!(upstream.received_requests().await.unwrap().len(), 2);
}

/// Issue 29, item 5: a job waiting when a worker starts is taken only once the worker's first
/// tool discovery is over, so its first model request already offers the external tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_worker_offers_the_discovered_tools_from_its_first_job_on() {
    let stack = Stack::start(rules(), None).await;
    stack.dispatch(&job("td", "sd", "hello")).await;
    stack.spawn_worker(worker_config()).await;
    let done = stack.orchestrator.wait_completed("td").await;
    assert_eq!(done.outcome, TurnOutcome::Final);
    let first = stack
        .log
        .snapshot()
        .into_iter()
        .next()
        .expect("a model request");
    let offered: Vec<&str> = first.tools.iter().map(|t| t.name.as_str()).collect();
    for tool in ["count", "hold", "slow", "broken"] {
        assert!(offered.contains(&tool), "{tool} not offered: {offered:?}");
    }
}

/// A provider speaking the OpenAI dialect over raw HTTP/1.1 (a body ended by closing the
/// connection): the first call streams `Hel` and then hangs forever; every later one streams
/// `Hello there` to its end.
async fn a_provider_that_hangs_after_its_first_words() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let chunk = |delta: Value, finish: Value| {
        let event = json!({"id": "c", "model": "m", "choices": [{"index": 0, "delta": delta,
            "finish_reason": finish}]});
        format!("data: {event}\n\n")
    };
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let started = chunk(json!({"role": "assistant", "content": "Hel"}), Value::Null);
    let whole = [
        chunk(
            json!({"role": "assistant", "content": "Hello there"}),
            Value::Null,
        ),
        chunk(json!({}), json!("stop")),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            let body = if std::mem::take(&mut first) {
                None
            } else {
                Some(whole.clone())
            };
            let started = started.clone();
            tokio::spawn(async move {
                // The request: headers, then a Content-Length body (read and dropped).
                let mut seen = Vec::new();
                let mut buf = [0u8; 8192];
                loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    seen.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&seen).to_lowercase();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length: usize = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse().ok())
                            .unwrap_or(0);
                        if seen.len() >= end + 4 + length {
                            break;
                        }
                    }
                    if n == 0 {
                        return;
                    }
                }
                match body {
                    Some(body) => {
                        let _ = socket.write_all(format!("{head}{body}").as_bytes()).await;
                    }
                    None => {
                        let _ = socket
                            .write_all(format!("{head}{started}").as_bytes())
                            .await;
                        let _ = socket.flush().await;
                        std::future::pending::<()>().await;
                    }
                }
            });
        }
    });
    url
}

/// Issue 29, item 4: the replica serving a step's call streamed text and was then SIGKILLed.
/// The call sent again to the other replica is a new try, marked as such: its deltas carry
/// `retry: 1` and start again at seq 0, and the answer is the retried call's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_streamed_before_a_gateway_died_is_superseded_by_a_marked_retry() {
    let base_url = a_provider_that_hangs_after_its_first_words().await;
    let stack = Stack::start_with(rules(), None, false).await;
    let gateway = openai_gateways(&stack, &base_url);
    let mut first = gateway("first");
    common::wait_for_service(&stack.client, "cyrene-model-gateway").await;
    let mut events = session_events(&stack, "sr").await;
    stack.spawn_worker(worker_config()).await;
    stack.dispatch(&job("tr", "sr", "say hello")).await;
    let mut deltas = Vec::new();
    while deltas.is_empty() {
        let event = next_event(&mut events).await;
        if event.kind == SessionEventType::Delta {
            deltas.push(event);
        }
    }
    let _second = gateway("second");
    let ping = "$SRV.PING.cyrene-model-gateway";
    tokio::time::timeout(Duration::from_secs(30), async {
        while responders(&stack.client, ping, Duration::from_millis(200)).await < 2 {}
    })
    .await
    .expect("the second replica is up");
    first.start_kill().unwrap(); // SIGKILL, after its first words
    first.wait().await.unwrap();

    let done = tokio::time::timeout(
        Duration::from_secs(20),
        stack.orchestrator.wait_completed("tr"),
    )
    .await
    .expect("completed long before the model timeout");
    assert_eq!(done.message.unwrap().text_content(), "Hello there");
    assert_eq!(done.attempt, 1);
    loop {
        let event = next_event(&mut events).await;
        match event.kind {
            SessionEventType::Delta => deltas.push(event),
            SessionEventType::Final => break,
            _ => {}
        }
    }
    let seen: Vec<(Option<u32>, Option<u64>, String)> = deltas
        .iter()
        .map(|d| (d.retry, d.seq, d.delta.clone().unwrap()))
        .collect();
    assert_eq!(
        seen,
        [
            (None, Some(0), "Hel".to_owned()),
            (Some(1), Some(0), "Hello there".to_owned())
        ]
    );
}
