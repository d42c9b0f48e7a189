//! Exactly once at volume: one replica, two replicas on one PostgreSQL database, a replica
//! restarted under load, and the dispatch sweeper.

use crate::harness::*;
use cyrene_bus::RequestError;
use cyrene_orchestrator::store::{NewMessage, Store};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::ids::new_id;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::{Disposition, SendAck, SessionEnv};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SESSIONS: usize = 20;
const PER_SESSION: usize = 10;

/// Sends `SESSIONS × PER_SESSION` messages concurrently, each resent with its key until
/// acknowledged (a replica may be down for a moment). Returns the acks by key.
async fn send_all(
    client: &async_nats::Client,
    acked: Arc<Mutex<HashMap<String, SendAck>>>,
) -> HashMap<String, SendAck> {
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..SESSIONS {
        let client = client.clone();
        let acked = acked.clone();
        tasks.spawn(async move {
            // One sender per session, messages in order; sessions run concurrently.
            for i in 0..PER_SESSION {
                let key = format!("k-{s}-{i}");
                let req = send_req(&format!("vol-{s}"), &format!("msg {s}/{i}"), &key, "cli");
                let start = Instant::now();
                let ack = loop {
                    match send(&client, &req).await {
                        Ok(ack) => break ack,
                        Err(RequestError::Remote(body)) if body.code == ErrorCode::BadRequest => {
                            panic!("refused: {body}")
                        }
                        Err(err) => {
                            assert!(
                                start.elapsed() < Duration::from_secs(30),
                                "send kept failing: {err}"
                            );
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                    }
                };
                acked.lock().unwrap().insert(key, ack);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    acked.lock().unwrap().clone()
}

/// Waits until every acked message was consumed by a completed turn, then checks exactly once
/// (worker side and transcript side) and the fence.
async fn check_exactly_once(world: &World, worker: &FakeWorker, acks: &HashMap<String, SendAck>) {
    assert_eq!(acks.len(), SESSIONS * PER_SESSION);
    let ids: Vec<String> = acks.values().map(|a| a.message_id.clone()).collect();
    wait_for(
        "every message consumed by a completed turn",
        Duration::from_secs(60),
        || {
            let log = worker.log.lock().unwrap();
            let consumers = log.consumers();
            let all = ids.iter().all(|id| {
                consumers.get(id).is_some_and(|turns| {
                    turns
                        .iter()
                        .all(|t| log.turns.get(t).is_some_and(|s| s.completed))
                })
            });
            all.then_some(())
        },
    )
    .await;
    let (turns, steered) = {
        let log = worker.log.lock().unwrap();
        assert!(
            log.overlaps.is_empty(),
            "two turns in flight at once in {:?}",
            log.overlaps
        );
        let consumers = log.consumers();
        for id in &ids {
            assert_eq!(
                consumers[id].len(),
                1,
                "message {id} consumed by {:?}",
                consumers[id]
            );
        }
        assert_eq!(
            consumers.len(),
            ids.len(),
            "no unknown message was consumed"
        );
        let turns = log.turns.len();
        let steered: usize = log.turns.values().map(|t| t.steered_ids.len()).sum();
        (turns, steered)
    };

    let mut answers = 0;
    for s in 0..SESSIONS {
        let h = history(&world.client, &format!("vol-{s}")).await;
        let users: Vec<&str> = h
            .iter()
            .filter(|e| e.message.role == Role::User)
            .map(|e| e.id.as_str())
            .collect();
        let mut expected: Vec<&str> = acks
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("k-{s}-")))
            .map(|(_, a)| a.message_id.as_str())
            .collect();
        expected.sort_by_key(|id| h.iter().position(|e| e.id == *id));
        assert_eq!(
            users, expected,
            "session vol-{s}: each message once, in seq order"
        );
        assert!(
            h.iter().all(|e| !e.turn_id.is_empty()),
            "nothing left pending"
        );
        answers += h
            .iter()
            .filter(|e| e.message.role == Role::Assistant)
            .count();
        let seqs: Vec<u64> = h.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=h.len() as u64).collect::<Vec<_>>());
    }
    assert_eq!(answers, turns, "one answer per turn");
    println!("{} messages, {turns} turns, {steered} steered", ids.len());
}

async fn exactly_once_at_volume(backend: Backend, replicas: usize) {
    let world = World::new(backend).await;
    let mut running = Vec::new();
    for _ in 0..replicas {
        running.push(Replica::start(&world, world.config()).await);
    }
    let worker = FakeWorker::start(&world, Duration::from_millis(5), 2).await;
    let acks = send_all(&world.client, Arc::default()).await;
    let started = acks
        .values()
        .filter(|a| a.disposition == Disposition::TurnStarted)
        .count();
    assert!(
        started >= SESSIONS,
        "each session started at least one turn"
    );
    assert!(
        acks.values().any(|a| a.disposition == Disposition::Pending),
        "some messages arrived while a turn ran"
    );
    check_exactly_once(&world, &worker, &acks).await;
    for endpoint in ["send", "steer", "complete"] {
        let served = endpoint_requests(&world.client, endpoint).await;
        assert_eq!(served.len(), replicas);
        assert!(
            served.iter().all(|n| *n > 0),
            "every replica served {endpoint}: {served:?}"
        );
    }
    worker.stop().await;
    for r in running {
        r.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn exactly_once_at_volume_on_sqlite() {
    exactly_once_at_volume(Backend::Sqlite, 1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn exactly_once_at_volume_with_two_replicas_on_postgres() {
    exactly_once_at_volume(Backend::Postgres, 2).await;
}

async fn restart_under_load_loses_nothing(backend: Backend) {
    let world = World::new(backend).await;
    let first = Replica::start(&world, world.config()).await;
    let worker = FakeWorker::start(&world, Duration::from_millis(5), 1).await;
    let acked = Arc::new(Mutex::new(HashMap::new()));
    let sender = {
        let client = world.client.clone();
        let acked = acked.clone();
        tokio::spawn(async move { send_all(&client, acked).await })
    };
    wait_for(
        "a quarter of the messages acked",
        Duration::from_secs(30),
        || (acked.lock().unwrap().len() >= SESSIONS * PER_SESSION / 4).then_some(()),
    )
    .await;
    first.stop().await;
    let during = acked.lock().unwrap().len();
    let _second = Replica::start(&world, world.config()).await;
    let acks = sender.await.unwrap();
    assert!(
        during < acks.len(),
        "messages were also acked after the restart"
    );
    check_exactly_once(&world, &worker, &acks).await;
    worker.stop().await;
}

on_both_backends!(
    restart_under_load_loses_nothing:
    restart_under_load_loses_nothing_on_sqlite,
    restart_under_load_loses_nothing_on_postgres
);

/// A turn committed but never published (a crash between commit and publish) is republished by
/// the sweeper of whichever replica runs next.
#[tokio::test(flavor = "multi_thread")]
async fn sweeper_publishes_a_turn_whose_dispatch_was_lost() {
    let world = World::new(Backend::Sqlite).await;
    let config = world.config();
    let store: Store = cyrene_orchestrator::open_store(&config).await.unwrap();
    let input = NewMessage {
        session_id: "s1".into(),
        message: user("lost in the crash"),
        client_id: "cli".into(),
        idempotency_key: Some(new_id()),
        env: SessionEnv::default(),
        policy: cyrene_protocol::session::BusyPolicy::Steer,
        solo: false,
        reply_to: None,
        ask_chain: Vec::new(),
        context_only: false,
    };
    let sent = store.send(input, &|_: &str| (0, Vec::new())).await.unwrap();
    assert_eq!(sent.ack.disposition, Disposition::TurnStarted);
    let turn = sent.started.unwrap();
    store.close().await;

    let _orch = Replica::start(&world, config).await;
    let mut jobs = JobQueue::new(&world.client).await;
    let (job, attempt) = jobs.next().await;
    assert_eq!(job.turn_id, turn.turn_id);
    assert_eq!(job.messages[0].text_content(), "lost in the crash");
    assert!(
        complete(&world.client, &completion(&job, attempt, "found"))
            .await
            .unwrap()
            .first
    );
    let h = history(&world.client, "s1").await;
    assert_eq!(h.len(), 2);
}
