//! `make bench`: a message posted in a Matrix room → her first model request, p50, beside the
//! floor measured in the same run: a plain Synapse send → another client's `/sync` seeing it
//! (the homeserver's own delivery, which every bridge waits for).
//!
//! A real Synapse (`CYRENE_SYNAPSE_PY`, as tests/matrix.rs), the bridge (in this process, its
//! library's `run`, default 30 s long-poll) and the real services (tests/synapse/world.rs: the
//! gateway on a scripted model). Bridge case: the owner posts in her DM; the time until the
//! scripted model has received the turn's request (its request log, read every millisecond), then
//! the answer is awaited before the next post. Floor case: the owner posts in another room; the
//! time until a second user's long-poll `/sync` returns it. The cases alternate in blocks so both
//! see the same machine.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench that cannot run should stop loudly

#[path = "../tests/common/mod.rs"]
mod common;
#[path = "../tests/synapse/mod.rs"]
mod synapse;

use cyrene_matrix_bridge::matrix::Homeserver;
use cyrene_matrix_bridge::ruma::api::client::sync::sync_events;
use std::time::{Duration, Instant};
use synapse::Synapse;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const WARMUP: usize = 3;
const BLOCKS: usize = 10;
const PER_BLOCK: usize = 3;
const LIMIT: Duration = Duration::from_secs(60);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Long-polls `/sync` as `hs` until `stop`, reporting each `floor-…` message with the instant
/// its sync answer arrived.
async fn watch(hs: Homeserver, seen: mpsc::UnboundedSender<(String, Instant)>) {
    let mut since: Option<String> = None;
    loop {
        let mut request = sync_events::v3::Request::new();
        request.timeout = Some(if since.is_none() {
            Duration::ZERO
        } else {
            Duration::from_secs(30)
        });
        request.since = since.clone();
        let Ok(answer) = hs.call(request).await else {
            return;
        };
        let now = Instant::now();
        for room in answer.rooms.join.values() {
            for raw in &room.timeline.events {
                let event: serde_json::Value =
                    serde_json::from_str(raw.json().get()).unwrap_or_default();
                if let Some(body) = event["content"]["body"].as_str()
                    && body.starts_with("floor-")
                    && seen.send((body.to_owned(), now)).is_err()
                {
                    return;
                }
            }
        }
        since = Some(answer.next_batch);
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let synapse = Synapse::start().await;
    let bot = synapse.person("cyrene").await;
    let alice = synapse.person("alice").await;
    let watcher = synapse.person("watcher").await;
    let world = synapse::world::world().await;

    // The bridge, in this process; ready once its first sync is done.
    let data = tempfile::tempdir().unwrap();
    let mut config = cyrene_matrix_bridge::Config::new(
        &synapse.url,
        "@cyrene:localhost",
        "@alice:localhost",
        "alice",
        data.path(),
    );
    config.password = Some(cyrene_matrix_bridge::Secret::new("pw-cyrene"));
    let health = cyrene_runtime::health::global();
    health.set(cyrene_matrix_bridge::SERVICE_NAME, false);
    let shutdown = CancellationToken::new();
    tokio::spawn(cyrene_matrix_bridge::run(
        config,
        world.server.connect().await,
        shutdown.clone(),
    ));
    let start = Instant::now();
    while health
        .readiness()
        .1
        .iter()
        .any(|c| c == cyrene_matrix_bridge::SERVICE_NAME)
    {
        assert!(start.elapsed() < LIMIT, "the bridge never got ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let dm = alice.create_room(&[&bot.id], true).await;
    alice.wait_joined(&dm, &bot.id).await;
    let floor_room = alice.create_room(&[&watcher.id], false).await;
    watcher.join(&floor_room).await;
    let (seen_tx, mut seen) = mpsc::unbounded_channel();
    let watching = tokio::spawn(watch(watcher.hs.clone(), seen_tx));

    let mut answered = 0;
    let mut bridge_sample = async |n: usize| -> Duration {
        let text = format!("bench-{n}");
        let before = world.model.len();
        let t = Instant::now();
        alice.say(&dm, &text, &[]).await;
        while world.model.len() <= before {
            assert!(t.elapsed() < LIMIT, "{text}: no model request");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let took = t.elapsed();
        let shown = world.model.snapshot().into_iter().nth(before).unwrap();
        assert!(
            shown.messages.iter().any(|m| m.text_content() == text),
            "{text}: the request after it is its turn's"
        );
        answered += 1;
        alice.wait_for(&dm, &bot.id, answered, "answered").await;
        took
    };
    let mut floor_sample = async |n: usize| -> Duration {
        let text = format!("floor-{n}");
        let t = Instant::now();
        alice.say(&floor_room, &text, &[]).await;
        loop {
            let (body, at) = tokio::time::timeout(LIMIT, seen.recv())
                .await
                .expect("the watcher's sync")
                .expect("the watcher");
            if body == text {
                return at.duration_since(t);
            }
        }
    };

    for n in 0..WARMUP {
        floor_sample(n).await;
        bridge_sample(n).await;
    }
    let (mut floor, mut bridge) = (Vec::new(), Vec::new());
    for block in 0..BLOCKS {
        for i in 0..PER_BLOCK {
            let n = WARMUP + block * PER_BLOCK + i;
            floor.push(floor_sample(n).await);
        }
        for i in 0..PER_BLOCK {
            let n = WARMUP + block * PER_BLOCK + i;
            bridge.push(bridge_sample(n).await);
        }
    }
    floor.sort();
    bridge.sort();
    let (floor50, bridge50) = (percentile(&floor, 0.5), percentile(&bridge, 0.5));
    println!(
        "Matrix event → first model request vs Synapse send → /sync ({} each, one Synapse)",
        bridge.len()
    );
    println!(
        "  Synapse send → sync (floor)      p50 {:>8.1} ms   p90 {:>8.1} ms",
        millis(floor50),
        millis(percentile(&floor, 0.9))
    );
    println!(
        "  event → first model request      p50 {:>8.1} ms   p90 {:>8.1} ms",
        millis(bridge50),
        millis(percentile(&bridge, 0.9))
    );
    println!(
        "  bridge + runtime above the floor p50 {:>8.1} ms   ratio {:>6.2}×",
        millis(bridge50.saturating_sub(floor50)),
        millis(bridge50) / millis(floor50)
    );
    watching.abort();
    shutdown.cancel();
}
