//! Streaming through the gateway (`cargo bench -p cyrene-model-gateway --bench streaming`).
//!
//! One run, four paths interleaved call by call against the same streaming mock upstream (raw
//! tokio HTTP/1.1 answering every request with the same OpenAI-style SSE reply of [`CHUNKS`]
//! text chunks, each event in a write of its own 1 ms after the one before, as a provider sends
//! them one by one):
//! - *direct*: this process reads the mock's event stream itself (reqwest + eventsource-stream);
//! - *proxy*: the same through a minimal pass-through proxy of the front door's HTTP stack
//!   ([`common::ProxyProcess`]): the physical floor of an HTTP hop;
//! - *NATS*: `cyrene.model.complete.stream` to a `cyrene-model-gateway` process (the real
//!   binary), deltas on this process's inbox (`cyrene_model_client`);
//! - *HTTP*: the same gateway process's OpenAI-compatible front door with `"stream": true`.
//!
//! Time to first token (TTFT) = request sent → first text delta in hand; the gateway's added TTFT
//! is a path's percentile minus direct's. Whole reply = request sent → the end of the stream
//! (`[DONE]`, or the NATS reply); what a path adds per chunk is its whole reply's p50 minus
//! direct's, over [`CHUNKS`]. Chunks per second = text chunks of one call / (last chunk − first
//! chunk), median over the calls. Everything shares this machine's cores, so the figures are
//! indicative; the bench ends with issue 37's streaming rows (`COST …`, docs/performance.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use common::KEY;

use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::ModelRequest;
use cyrene_protocol::stream::Delta;
use cyrene_test_support::cost;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

const CALLS: usize = 300;
const CHUNKS: usize = 12;
/// The pause between two events of the mock's reply: each event crosses every hop on its own,
/// as a model's tokens do, so what a path adds per chunk is measured per chunk.
const GAP: Duration = Duration::from_millis(1);
const TIMEOUT: Duration = Duration::from_secs(20);

/// The reply's events: the first text chunk, then one event per write.
fn sse_events() -> Vec<String> {
    let event = |delta: serde_json::Value, finish: Option<&str>| {
        let chunk = json!({"id":"c","model":"bench-model",
            "choices":[{"index":0,"delta":delta,"finish_reason":finish}]});
        format!("data: {chunk}\n\n")
    };
    let mut events = vec![event(json!({"role":"assistant","content":"tok0 "}), None)];
    for i in 1..CHUNKS {
        events.push(event(json!({"content": format!("tok{i} ")}), None));
    }
    events.push(event(json!({}), Some("stop")));
    events.push(format!(
        "data: {}\n\ndata: [DONE]\n\n",
        json!({"id":"c","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":CHUNKS,
               "total_tokens":12 + CHUNKS}})
    ));
    events
}

/// The mock upstream answering every request with the SSE reply: the headers and the first
/// event in one write, then each event in a write of its own, [`GAP`] after the one before.
async fn mock_upstream() -> String {
    let events = sse_events();
    let length: usize = events.iter().map(String::len).sum();
    let mut writes: Vec<Vec<u8>> = events.into_iter().map(String::into_bytes).collect();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {length}\r\n\r\n"
    );
    writes[0].splice(0..0, head.into_bytes());
    common::mock_upstream_paced(writes, GAP).await
}

/// One call's timings: first text chunk after the request, first → last text chunk, and the
/// request → the end of the stream.
#[derive(Clone, Copy)]
struct Call {
    ttft: Duration,
    span: Duration,
    whole: Duration,
    chunks: usize,
}

struct Paths {
    http: reqwest::Client,
    upstream: String,
    proxy: String,
    front_door: String,
    nats: async_nats::Client,
}

fn question() -> ModelRequest {
    ModelRequest {
        messages: vec![Message::text(Role::User, "Tell me a long story.")],
        model: "bench-model".into(),
        purpose: "bench".into(),
        ..Default::default()
    }
}

/// Reads an OpenAI-style SSE response, timing its content deltas.
async fn read_sse(response: reqwest::Response, started: Instant) -> Call {
    let mut events = response.bytes_stream().eventsource();
    let (mut first, mut last, mut chunks) = (None, started, 0usize);
    let mut last_event = started;
    while let Some(event) = events.next().await {
        let event = event.unwrap();
        if event.data == "[DONE]" {
            last_event = Instant::now();
            break;
        }
        if event.data.contains("\"content\":\"tok") {
            let now = Instant::now();
            first.get_or_insert(now);
            last = now;
            chunks += 1;
        }
    }
    let first = first.expect("no content chunk");
    Call {
        ttft: first - started,
        span: last - first,
        whole: last_event - started,
        chunks,
    }
}

impl Paths {
    async fn direct(&self) -> Call {
        self.openai(&self.upstream).await
    }

    async fn proxy(&self) -> Call {
        self.openai(&self.proxy).await
    }

    /// The streamed question as the gateway asks it, to the `/chat/completions` of `base`.
    async fn openai(&self, base: &str) -> Call {
        let body = json!({"model":"bench-model","stream":true,"stream_options":{"include_usage":true},
                          "messages":[{"role":"user","content":"Tell me a long story."}]});
        let started = Instant::now();
        let response = self
            .http
            .post(format!("{base}/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        read_sse(response, started).await
    }

    async fn front_door(&self) -> Call {
        let body = json!({"model":"bench-model","stream":true,
                          "messages":[{"role":"user","content":"Tell me a long story."}]});
        let started = Instant::now();
        let response = self
            .http
            .post(format!("{}/v1/chat/completions", self.front_door))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert!(response.status().is_success(), "{}", response.status());
        read_sse(response, started).await
    }

    async fn nats(&self) -> Call {
        let started = Instant::now();
        let (mut first, mut last, mut chunks) = (None, started, 0usize);
        let response =
            cyrene_model_client::complete_stream(&self.nats, &question(), TIMEOUT, |_, delta| {
                if let Delta::Text { .. } = delta {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = now;
                    chunks += 1;
                }
            })
            .await
            .unwrap();
        let whole = started.elapsed();
        assert_eq!(response.provider, "mock");
        let first = first.expect("no delta");
        Call {
            ttft: first - started,
            span: last - first,
            whole,
            chunks,
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A path's figures over its calls.
struct Summary {
    ttft_p50: f64,
    ttft_p99: f64,
    /// Median chunks per second.
    rate: f64,
    /// p50 of the whole reply.
    whole: f64,
}

fn summary(calls: &[Call]) -> Summary {
    let mut ttft: Vec<Duration> = calls.iter().map(|c| c.ttft).collect();
    ttft.sort();
    let pick = |p: f64| ms(ttft[((ttft.len() as f64 - 1.0) * p).round() as usize]);
    let mut whole: Vec<Duration> = calls.iter().map(|c| c.whole).collect();
    whole.sort();
    let mut rates: Vec<f64> = calls
        .iter()
        .map(|c| (c.chunks.saturating_sub(1)) as f64 / c.span.as_secs_f64().max(1e-9))
        .collect();
    rates.sort_by(f64::total_cmp);
    Summary {
        ttft_p50: pick(0.5),
        ttft_p99: pick(0.99),
        rate: rates[rates.len() / 2],
        whole: ms(whole[whole.len() / 2]),
    }
}

fn main() {
    common::main("streaming", run());
}

async fn run() {
    let upstream = mock_upstream().await;
    let stage = common::Stage::start(&upstream).await;
    let paths = Paths {
        http: cyrene_model_gateway::http_client().unwrap(),
        upstream,
        proxy: stage.proxy.clone(),
        front_door: stage.front_door.clone(),
        nats: stage.server.connect().await,
    };
    // Ready when both doors answer (bounded).
    let mut ready = false;
    for _ in 0..200 {
        let nats = cyrene_model_client::complete_stream(
            &paths.nats,
            &question(),
            Duration::from_millis(500),
            |_, _| {},
        )
        .await;
        let http = paths
            .http
            .get(format!("{}/v1/models", paths.front_door))
            .bearer_auth(KEY)
            .send()
            .await;
        if nats.is_ok() && http.is_ok_and(|r| r.status().is_success()) {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "the gateway process never answered");
    for _ in 0..30 {
        paths.direct().await;
        paths.proxy().await;
        paths.nats().await;
        paths.front_door().await;
    }
    let started = Instant::now();
    let (mut direct, mut proxied, mut nats, mut http) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..CALLS {
        direct.push(paths.direct().await);
        proxied.push(paths.proxy().await);
        nats.push(paths.nats().await);
        http.push(paths.front_door().await);
    }
    for (path, calls) in [("direct", &direct), ("proxy", &proxied), ("http", &http)] {
        let short = calls.iter().find(|c| c.chunks != CHUNKS);
        assert!(
            short.is_none(),
            "every text chunk arrived on the {path} path: {:?} of {CHUNKS}",
            short.map(|c| c.chunks)
        );
    }
    // The NATS stream may carry text that arrived together as one delta (docs/model-gateway.md,
    // "Streaming"): every call has at least one.
    assert!(
        nats.iter().all(|c| c.chunks >= 1),
        "the NATS path's text arrived"
    );
    let d = summary(&direct);
    println!(
        "cyrene-model-gateway streaming bench (same run, interleaved; {CALLS} calls per path, \
         {CHUNKS} text chunks each, one write each)"
    );
    println!(
        "direct (mock upstream):   TTFT p50 {:.3} ms p99 {:.3} ms | whole reply p50 {:.3} ms | \
         {:.0} chunks/s",
        d.ttft_p50, d.ttft_p99, d.whole, d.rate
    );
    let mut added = Vec::new();
    for (label, calls) in [
        ("via pass-through proxy:", &proxied),
        ("via NATS stream:", &nats),
        ("via HTTP front door:", &http),
    ] {
        let s = summary(calls);
        println!(
            "{label:<25} TTFT p50 {:.3} ms p99 {:.3} ms | whole reply p50 {:.3} ms | {:.0} \
             chunks/s | added TTFT p50 {:.3} ms p99 {:.3} ms, whole reply p50 {:.3} ms",
            s.ttft_p50,
            s.ttft_p99,
            s.whole,
            s.rate,
            s.ttft_p50 - d.ttft_p50,
            s.ttft_p99 - d.ttft_p99,
            s.whole - d.whole,
        );
        added.push((s.ttft_p50 - d.ttft_p50, (s.whole - d.whole) / CHUNKS as f64));
    }
    println!("measured in {:.1} s", started.elapsed().as_secs_f64());
    let (proxy, door) = (added[0], added[2]);
    let rows = [
        cost::Row::new(
            "stream_ttft_added",
            "streaming through the HTTP front door, time to first token added over the mock (p50)",
            format!("+{:.3} ms", door.0),
            format!("pass-through proxy +{:.3} ms", proxy.0),
            "≤ +0.15 ms",
            door.0 <= 0.15,
        ),
        cost::Row::new(
            "stream_per_chunk_added",
            format!(
                "streaming through the HTTP front door, whole {CHUNKS}-chunk reply added over the \
                 mock (p50), per chunk"
            ),
            format!(
                "+{:.3} ms a chunk (+{:.3} ms the reply)",
                door.1,
                door.1 * CHUNKS as f64
            ),
            format!(
                "pass-through proxy +{:.3} ms a chunk (+{:.3} ms the reply)",
                proxy.1,
                proxy.1 * CHUNKS as f64
            ),
            "≤ +0.05 ms a chunk",
            door.1 <= 0.05,
        ),
    ];
    print!(
        "{}",
        cost::summary("cyrene-model-gateway --bench streaming", &rows)
    );
}
