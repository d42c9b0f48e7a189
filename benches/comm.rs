//! `make bench`: comm ask round trip beside a raw NATS request/reply, measured in one run against
//! one nats-server, interleaved in blocks so both see the same machine conditions.
//! Target: comm p50 ≤ 1.15 × raw p50.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench that cannot run should stop loudly

use cyrene_comm::{Answer, Handler, Probe};
use cyrene_protocol::ErrorBody;
use cyrene_protocol::comm::Ask;
use cyrene_test_support::NatsServer;
use futures::StreamExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

const BLOCKS: usize = 20;
const PER_BLOCK: usize = 500;
const WARMUP: usize = 500;

struct Echo;

impl Handler for Echo {
    async fn on_ask(&self, ask: Ask) -> Result<Answer, ErrorBody> {
        Ok(Answer::text(ask.question))
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let server = NatsServer::start();
    let asker_conn = server.connect().await;
    let responder_conn = server.connect().await;

    // Raw: a plain subscriber that answers the reply-to with the request payload.
    let mut raw_sub = responder_conn.subscribe("bench.raw").await.unwrap();
    let raw_responder = responder_conn.clone();
    tokio::spawn(async move {
        while let Some(m) = raw_sub.next().await {
            if let Some(reply) = m.reply {
                raw_responder.publish(reply, m.payload).await.unwrap();
            }
        }
    });
    // Comm: an agent answering every ask with its question.
    let agent = Probe::new(responder_conn.clone(), "bench-b")
        .serve(Arc::new(Echo))
        .await
        .unwrap();
    responder_conn.flush().await.unwrap();
    let asker = Probe::new(asker_conn.clone(), "bench-a");
    let question = "how are you today?";
    // The raw payload is the size of a comm Reply, so bytes on the wire are comparable.
    let raw_payload: bytes::Bytes = format!(
        r#"{{"ask_id":"{}","from":"bench-b","to":"bench-a","text":"{question}"}}"#,
        "0".repeat(32)
    )
    .into();

    for _ in 0..WARMUP {
        asker_conn
            .request("bench.raw", raw_payload.clone())
            .await
            .unwrap();
        asker.ask("bench-b", question).await.unwrap();
    }

    let mut raw = Vec::with_capacity(BLOCKS * PER_BLOCK);
    let mut comm = Vec::with_capacity(BLOCKS * PER_BLOCK);
    for _ in 0..BLOCKS {
        for _ in 0..PER_BLOCK {
            let t = Instant::now();
            asker_conn
                .request("bench.raw", raw_payload.clone())
                .await
                .unwrap();
            raw.push(t.elapsed());
        }
        for _ in 0..PER_BLOCK {
            let t = Instant::now();
            let reply = asker.ask("bench-b", question).await.unwrap();
            comm.push(t.elapsed());
            assert_eq!(reply.text, question);
        }
    }
    raw.sort();
    comm.sort();
    let (raw50, raw99) = (percentile(&raw, 0.50), percentile(&raw, 0.99));
    let (comm50, comm99) = (percentile(&comm, 0.50), percentile(&comm, 0.99));
    let ratio50 = micros(comm50) / micros(raw50);
    let ratio99 = micros(comm99) / micros(raw99);
    println!(
        "comm ask round trip vs raw NATS request/reply ({} each, one nats-server)",
        raw.len()
    );
    println!(
        "  raw request/reply   p50 {:>8.1} µs   p99 {:>8.1} µs",
        micros(raw50),
        micros(raw99)
    );
    println!(
        "  comm ask/reply      p50 {:>8.1} µs   p99 {:>8.1} µs",
        micros(comm50),
        micros(comm99)
    );
    println!(
        "  ratio comm/raw      p50 {ratio50:>8.2}×    p99 {ratio99:>8.2}×    (target p50 ≤ 1.15×: {})",
        if ratio50 <= 1.15 { "met" } else { "MISSED" }
    );
    agent.stop().await;
}
