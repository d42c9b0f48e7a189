//! `cargo bench -p cyrene-orchestrator` (part of `make bench`): the steer a loop worker sends at
//! every step boundary, through NATS to a real orchestrator on PostgreSQL and on SQLite.
//!
//! Two cases, interleaved: a boundary with nothing new (the common one: one read-only
//! statement), and a boundary that claims a message that arrived meanwhile (the locked path:
//! lock the session, check the fence, claim, read back, commit). p50/p99 of each.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

#[path = "../tests/orchestrator/harness.rs"]
#[allow(dead_code)]
mod harness;

use harness::{Backend, one_replica, send_ok, steer};
use std::time::{Duration, Instant};

/// Measured boundaries per case (after a warm-up).
const ROUNDS: usize = 600;
const WARMUP: usize = 100;

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

async fn bench(backend: Backend) {
    let (world, _orchestrator, mut jobs) = one_replica(backend).await;
    let c = &world.client;
    send_ok(c, "bench", "start").await;
    let (job, _) = jobs.next().await;

    let (mut empty, mut claiming) = (Vec::new(), Vec::new());
    let mut after = job.base_seq;
    for i in 0..WARMUP + ROUNDS {
        let t = Instant::now();
        let got = steer(c, &job, 1, after).await.unwrap();
        let nothing = t.elapsed();
        assert!(got.messages.is_empty());

        let sent = send_ok(c, "bench", &format!("meanwhile {i}")).await;
        let t = Instant::now();
        let got = steer(c, &job, 1, after).await.unwrap();
        let claimed = t.elapsed();
        assert_eq!(got.messages.len(), 1);
        after = sent.seq;
        if i >= WARMUP {
            empty.push(nothing);
            claiming.push(claimed);
        }
    }
    empty.sort();
    claiming.sort();
    let name = match backend {
        Backend::Postgres => "postgres",
        Backend::Sqlite => "sqlite",
    };
    println!(
        "  {name:<9} nothing new: p50 {:.3} ms p99 {:.3} ms | claims one: p50 {:.3} ms p99 {:.3} ms",
        pct(&empty, 0.5),
        pct(&empty, 0.99),
        pct(&claiming, 0.5),
        pct(&claiming, 0.99)
    );
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("orchestrator steer through NATS ({ROUNDS} boundaries per case, one session)");
    runtime.block_on(async {
        bench(Backend::Postgres).await;
        bench(Backend::Sqlite).await;
    });
}
