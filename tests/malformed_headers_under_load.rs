//! Issue 12, "Done when", first point: every malformed header block of
//! `cyrene_test_support::MALFORMED_HEADER_BLOCKS`, published to every subject the four service
//! binaries listen on and to `$SRV.PING|INFO|STATS` (all services at once and each by name),
//! while a load of well-formed requests runs alongside: no service loses its connection (the
//! server's `/connz` lists the same connection ids before and after — a reconnect would be a new
//! id), no process ends, and every request of the load is answered with a success.
//! vendor/async-nats/CYRENE-PATCH.md is the fix this guards; docs/security.md the threat.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use cyrene_test_support::{MALFORMED_HEADER_BLOCKS, NatsServer, RawConnection};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const SERVICES: [&str; 4] = [
    "cyrene-model-gateway",
    "cyrene-checkpoint-store",
    "cyrene-orchestrator",
    "cyrene-loop-worker",
];

/// Well-formed requests in the load, and how many run at once.
const LOAD: usize = 400;
const IN_FLIGHT: usize = 8;
/// Rounds of the flood (every block on every subject), spread over the load.
const ROUNDS: usize = 5;

/// Each subject a service binary subscribes to: request endpoints, wildcard subscriptions, the
/// turn queue, discovery. The body is `{}` — refused at once where it is decoded — so the flood
/// tests the header block, not the services' capacity.
fn service_subjects() -> Vec<String> {
    let mut subjects: Vec<String> = [
        "cyrene.session.send",
        "cyrene.session.history",
        "cyrene.person.alice.session.send",
        "cyrene.person.alice.session.history",
        "cyrene.turn.steer",
        "cyrene.turn.complete",
        "cyrene.checkpoint.save",
        "cyrene.checkpoint.latest",
        "cyrene.checkpoint.get",
        "cyrene.checkpoint.list",
        "cyrene.checkpoint.retain",
        "cyrene.person.alice.checkpoint.latest",
        "cyrene.person.alice.checkpoint.get",
        "cyrene.person.alice.checkpoint.list",
        "cyrene.model.complete",
        "cyrene.model.route",
        "cyrene.agent.junk.cyrene.ask",
        "cyrene.agent.junk.cyrene.event",
        "cyrene.agent.junk.event",
        // the orchestrator's progress listeners
        "cyrene.session.junk.events",
        "cyrene.session.alice.junk.events",
        // the turn queue: JetStream stores the block, a worker pulls it
        "cyrene.turn.run",
    ]
    .map(str::to_owned)
    .to_vec();
    for verb in ["PING", "INFO", "STATS"] {
        subjects.push(format!("$SRV.{verb}"));
        for service in SERVICES {
            subjects.push(format!("$SRV.{verb}.{service}"));
        }
    }
    subjects
}

/// One well-formed request of the load, and whether its reply is a success.
async fn one_request(client: &async_nats::Client, i: usize) -> Result<(), String> {
    let (subject, body) = match i % 6 {
        0 => (
            "cyrene.session.send".to_owned(),
            json!({"session_id": format!("load{}", i % 17), "client_id": "load",
                   "idempotency_key": format!("k{i}"),
                   "message": {"role": "user", "content": format!("message {i}")}}),
        ),
        1 => (
            "cyrene.session.history".to_owned(),
            json!({"session_id": format!("load{}", i % 17), "limit": 5}),
        ),
        2 => (
            "cyrene.checkpoint.save".to_owned(),
            json!({"id": format!("load-cp{i}:1"), "agent_id": format!("load-cp{i}"),
                   "step": 1, "state": {"step": 1, "n": i}}),
        ),
        3 => (
            "cyrene.checkpoint.list".to_owned(),
            json!({"agent_id": format!("load-cp{}", i - 1), "limit": 5}),
        ),
        4 => (
            "cyrene.model.route".to_owned(),
            json!({"persona_id": "cyrene"}),
        ),
        _ => (format!("$SRV.PING.{}", SERVICES[i % 4]), Value::Null),
    };
    let payload = if body.is_null() {
        Vec::new()
    } else {
        serde_json::to_vec(&body).unwrap()
    };
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        client.request(subject.clone(), payload.into()),
    )
    .await
    .map_err(|_| format!("#{i} {subject}: no reply"))?
    .map_err(|e| format!("#{i} {subject}: {e}"))?;
    let answer: Value = serde_json::from_slice(&reply.payload)
        .map_err(|e| format!("#{i} {subject}: not JSON: {e}"))?;
    if answer.get("error").is_some() {
        return Err(format!("#{i} {subject}: {answer}"));
    }
    Ok(())
}

/// `cid → name` of the connections open now (`/connz`), for messages.
fn connections(server: &NatsServer) -> BTreeMap<u64, String> {
    let connz = server.monitor_json("/connz?limit=1024").expect("/connz");
    connz["connections"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let name = c["name"].as_str().unwrap_or_default().to_owned();
            Some((c["cid"].as_u64()?, name))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_header_blocks_on_every_service_subject_cost_no_connection_and_no_request() {
    let (server, client, _data, dir) = common::bus_with_data_dir().await;
    let mut children = Vec::new();
    for name in SERVICES {
        let envs = [("CYRENE_DATA_DIR", dir.as_str()), ("RUST_LOG", "error")];
        children.push((name, common::service(name, &server.url(), &envs)));
        common::wait_for_service(&client, name).await;
    }
    let before = connections(&server);
    for name in SERVICES {
        assert!(
            before.values().any(|n| n == name),
            "{name} is connected: {before:?}"
        );
    }

    // The load: LOAD well-formed requests, IN_FLIGHT at a time, from their own connection.
    let loader = server.connect().await;
    let next = Arc::new(AtomicUsize::new(0));
    // Request i starts only after flood round i * ROUNDS / LOAD went out, and round r only
    // after request r * LOAD / ROUNDS was taken: the two interleave whatever the speed.
    let rounds_out = Arc::new(AtomicUsize::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..IN_FLIGHT {
        let (loader, next, rounds_out) = (loader.clone(), next.clone(), rounds_out.clone());
        workers.spawn(async move {
            let mut failures = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= LOAD {
                    return failures;
                }
                while rounds_out.load(Ordering::SeqCst) <= i * ROUNDS / LOAD {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                if let Err(failure) = one_request(&loader, i).await {
                    failures.push(failure);
                }
            }
        });
    }

    // Meanwhile: every block on every subject, ROUNDS times, spread over the load.
    let mut raw = RawConnection::connect(server.port(), None).await;
    let subjects = service_subjects();
    let mut published = 0;
    for round in 0..ROUNDS {
        while next.load(Ordering::SeqCst) < round * LOAD / ROUNDS {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for (_, block) in MALFORMED_HEADER_BLOCKS {
            for subject in &subjects {
                raw.hpub(subject, Some("junk.reply"), block, b"{}").await;
                published += 1;
            }
        }
        let refused = raw.round_trip().await;
        assert!(refused.is_empty(), "the server refused: {refused:?}");
        rounds_out.fetch_add(1, Ordering::SeqCst);
    }
    let mut failures = Vec::new();
    while let Some(done) = workers.join_next().await {
        failures.extend(done.unwrap());
    }
    assert_eq!(
        published,
        ROUNDS * MALFORMED_HEADER_BLOCKS.len() * subjects.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {LOAD} requests of the load were lost or failed: {failures:#?}",
        failures.len()
    );

    // No process ended, no service connection was dropped or replaced.
    for (name, child) in &mut children {
        assert!(
            matches!(child.try_wait(), Ok(None)),
            "{name} ended: {:?}",
            child.try_wait()
        );
    }
    let after = connections(&server);
    let lost: Vec<&String> = before
        .iter()
        .filter(|(cid, _)| !after.contains_key(cid))
        .map(|(_, name)| name)
        .collect();
    assert!(
        lost.is_empty(),
        "connections dropped or replaced: {lost:?} (before {before:?}, after {after:?})"
    );
    assert_eq!(
        server.connection_ids().len(),
        after.len(),
        "the monitor agrees with itself"
    );
    // … every service still answers, and what the load wrote is there: each checkpoint saved,
    // each message sent in its session's transcript.
    for name in SERVICES {
        common::wait_for_service(&client, name).await;
    }
    for i in (0..LOAD).filter(|i| i % 6 == 2) {
        let latest: Value = cyrene_bus::request_json(
            &client,
            "cyrene.checkpoint.latest",
            &json!({"agent_id": format!("load-cp{i}")}),
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|e| panic!("checkpoint of #{i}: {e}"));
        assert_eq!(latest["state"]["n"], i, "{latest}");
    }
    let mut sent: BTreeMap<String, usize> = BTreeMap::new();
    for i in (0..LOAD).filter(|i| i % 6 == 0) {
        *sent.entry(format!("load{}", i % 17)).or_default() += 1;
    }
    for (session, count) in &sent {
        let history: Value = cyrene_bus::request_json(
            &client,
            "cyrene.session.history",
            &json!({"session_id": session, "limit": 1000}),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
        let users = history["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["message"]["role"] == "user")
            .count();
        assert_eq!(
            users, *count,
            "{session}: every acknowledged message is stored"
        );
    }
    eprintln!(
        "{published} malformed messages in {ROUNDS} rounds over {} subjects alongside {LOAD} \
         requests: 0 lost, {} service connections kept",
        subjects.len(),
        before.len()
    );
}
