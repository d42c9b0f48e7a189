//! `make bench`: the loop worker's per-step runtime overhead and turn throughput.
//!
//! Scripted model (through the real gateway), a no-op tool (`current_time`), the real checkpoint
//! store on PostgreSQL and on SQLite, a steer endpoint that answers at once: what is measured is
//! the runtime — view assembly, the bus round trips, the checkpoint write, the steer claim.
//! Per step = the time between two consecutive `step` events of one turn. Turns are short (5
//! tool rounds), so the window stays near its seeded size (10 or 200 messages).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench that cannot run should stop loudly

#[path = "../tests/common/mod.rs"]
mod common;

use common::{Stack, job, worker_config};
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

// The services' allocator, as in their binaries.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROUNDS: usize = 5;
const TURNS_PER_CASE: usize = 150;
const THROUGHPUT_TURNS: usize = 200;

fn rules() -> serde_json::Value {
    let round = json!([{"name": "current_time"}]);
    let more: Vec<_> = (1..ROUNDS).map(|_| round.clone()).collect();
    json!([
        {"contains": "steps", "tool_calls": [{"name": "current_time"}], "more_rounds": more,
         "after_tools": "done"},
        {"contains": "quick", "tool_calls": [{"name": "current_time"}], "after_tools": "ok"}
    ])
}

fn window(n: usize) -> Vec<Message> {
    let mut messages = Vec::with_capacity(n);
    for i in 0..n - 1 {
        let role = if i % 2 == 0 {
            Role::User
        } else {
            Role::Assistant
        };
        messages.push(Message::text(
            role,
            format!("earlier message {i} with a few words in it"),
        ));
    }
    messages.push(Message::text(Role::User, "run the steps"));
    messages
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

async fn per_step(stack: &Stack, case: &str, window_len: usize) -> (f64, f64, usize) {
    let mut deltas = Vec::new();
    for t in 0..TURNS_PER_CASE {
        let session = format!("bench-{case}-{window_len}-{t}");
        let mut events = stack
            .client
            .subscribe(format!("cyrene.session.{session}.events"))
            .await
            .unwrap();
        stack.client.flush().await.unwrap();
        let mut j = job(&format!("{session}-turn"), &session, "run the steps");
        j.messages = window(window_len);
        j.max_steps = ROUNDS as u32 + 1;
        stack.dispatch(&j).await;
        let mut last: Option<Instant> = None;
        loop {
            let m = tokio::time::timeout(Duration::from_secs(60), events.next())
                .await
                .unwrap()
                .unwrap();
            let event: SessionEvent = serde_json::from_slice(&m.payload).unwrap();
            match event.kind {
                SessionEventType::Step => {
                    let now = Instant::now();
                    if let Some(prev) = last {
                        deltas.push(now - prev);
                    }
                    last = Some(now);
                }
                SessionEventType::Final | SessionEventType::Error => break,
                _ => {}
            }
        }
    }
    deltas.sort();
    (pct(&deltas, 0.5), pct(&deltas, 0.99), deltas.len())
}

async fn throughput(stack: &Stack, workers: usize, tag: &str) -> f64 {
    let mut children = Vec::new();
    for _ in 0..workers {
        children.push(
            tokio::process::Command::new(common::workspace_binary("cyrene-loop-worker"))
                .env("NATS_URL", stack.server.url())
                .env("RUST_LOG", "error")
                .env("CYRENE_WORKER_CONCURRENCY", "16")
                .kill_on_drop(true)
                .spawn()
                .unwrap(),
        );
    }
    common::wait_for_service(&stack.client, "cyrene-loop-worker").await;
    // Warm up every worker.
    for i in 0..workers * 4 {
        stack
            .dispatch(&job(
                &format!("warm-{tag}-{i}"),
                &format!("warm-{tag}-{i}"),
                "quick",
            ))
            .await;
    }
    for i in 0..workers * 4 {
        stack
            .orchestrator
            .wait_completed(&format!("warm-{tag}-{i}"))
            .await;
    }
    let start = Instant::now();
    for i in 0..THROUGHPUT_TURNS {
        stack
            .dispatch(&job(
                &format!("tp-{tag}-{i}"),
                &format!("tp-{tag}-{i}"),
                "quick",
            ))
            .await;
    }
    for i in 0..THROUGHPUT_TURNS {
        stack
            .orchestrator
            .wait_completed(&format!("tp-{tag}-{i}"))
            .await;
    }
    let rate = THROUGHPUT_TURNS as f64 / start.elapsed().as_secs_f64();
    drop(children);
    rate
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "loop worker: per durable step (scripted model, no-op tool, checkpoint + steer each step)"
    );
    let pg = common::fresh_postgres("cyrene_bench").await;
    let mut backends = vec![("sqlite", None)];
    match &pg {
        Some(db) => backends.insert(0, ("postgres", Some(db.url.clone()))),
        None => println!("  (PostgreSQL at 127.0.0.1:5432 unreachable: skipped)"),
    }
    for (name, url) in backends {
        let stack = Stack::start(rules(), url).await;
        stack.spawn_worker(worker_config()).await;
        let _ = per_step(&stack, &format!("warm-{name}"), 10).await;
        for window_len in [10, 200] {
            let (p50, p99, n) = per_step(&stack, name, window_len).await;
            println!(
                "  {name:<8} window {window_len:>3}: p50 {p50:.3} ms  p99 {p99:.3} ms  ({n} steps){}",
                if name == "postgres" && window_len == 10 {
                    format!(
                        "   target p50 ≤ 1.0 ms: {}",
                        if p50 <= 1.0 { "met" } else { "MISSED" }
                    )
                } else {
                    String::new()
                }
            );
        }
    }
    println!(
        "  for scale: LangGraph 1.2 + PostgresSaver, fake model, ~5.0 ms per step (1.5 ms without a checkpointer)"
    );

    println!(
        "loop worker: turns/s ({THROUGHPUT_TURNS} two-step turns, worker processes, SQLite store)"
    );
    let stack = Stack::start(rules(), None).await;
    let one = throughput(&stack, 1, "one").await;
    println!("  1 worker process : {one:>7.1} turns/s");
    let stack = Stack::start(rules(), None).await;
    let two = throughput(&stack, 2, "two").await;
    println!(
        "  2 worker processes: {two:>7.1} turns/s  ({:.2}× one; 2 cores shared with nats-server and the other services)",
        two / one
    );
}
