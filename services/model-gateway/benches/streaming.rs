//! Streaming through the gateway (`cargo bench -p cyrene-model-gateway --bench streaming`).
//!
//! One run, three paths interleaved call by call against the same streaming mock upstream (raw
//! tokio HTTP/1.1 answering every request with the same OpenAI-style SSE reply of [`CHUNKS`]
//! text chunks; the first is written at once, the rest right after):
//! - *direct*: this process reads the mock's event stream itself (reqwest + eventsource-stream);
//! - *NATS*: `cyrene.model.complete.stream` to a `cyrene-model-gateway` process (the real
//!   binary), deltas on this process's inbox (`cyrene_bus::model_stream`);
//! - *HTTP*: the same gateway process's OpenAI-compatible front door with `"stream": true`.
//!
//! Time to first token (TTFT) = request sent → first text delta in hand; the gateway's added TTFT
//! is a path's percentile minus direct's. Chunks per second = text chunks of one call / (last
//! chunk − first chunk), median over the calls. Everything shares this machine's cores, so the
//! figures are indicative.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::ModelRequest;
use cyrene_protocol::stream::Delta;
use cyrene_test_support::NatsServer;
use eventsource_stream::Eventsource;
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

const CALLS: usize = 300;
const CHUNKS: usize = 200;
const KEY: &str = "bench-client-key";
const TIMEOUT: Duration = Duration::from_secs(20);

fn sse_body() -> (String, String) {
    let event = |delta: serde_json::Value, finish: Option<&str>| {
        let chunk = json!({"id":"c","model":"bench-model",
            "choices":[{"index":0,"delta":delta,"finish_reason":finish}]});
        format!("data: {chunk}\n\n")
    };
    let first = event(json!({"role":"assistant","content":"tok0 "}), None);
    let mut rest = String::new();
    for i in 1..CHUNKS {
        rest.push_str(&event(json!({"content": format!("tok{i} ")}), None));
    }
    rest.push_str(&event(json!({}), Some("stop")));
    rest.push_str(&format!(
        "data: {}\n\ndata: [DONE]\n\n",
        json!({"id":"c","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":CHUNKS,
               "total_tokens":12 + CHUNKS}})
    ));
    (first, rest)
}

/// The mock upstream answering every request with the SSE reply: headers and the first event
/// in one write, the rest in a second.
async fn mock_upstream() -> String {
    let (first, rest) = sse_body();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n{first}",
        first.len() + rest.len()
    );
    common::mock_upstream(vec![head.into_bytes(), rest.into_bytes()]).await
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The gateway with its OpenAI-compatible front door on `http`, open to [`KEY`].
fn start_gateway(
    nats_url: &str,
    upstream: &str,
    http: &str,
    dir: &std::path::Path,
) -> common::GatewayProcess {
    common::start_gateway(nats_url, upstream, dir, |command| {
        command
            .arg("--http-addr")
            .arg(http)
            .env("CYRENE_GATEWAY_HTTP_KEYS", KEY);
    })
}

/// One call's timings: first text chunk after the request, and first → last text chunk.
#[derive(Clone, Copy)]
struct Call {
    ttft: Duration,
    span: Duration,
    chunks: usize,
}

struct Paths {
    http: reqwest::Client,
    upstream: String,
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
    while let Some(event) = events.next().await {
        let event = event.unwrap();
        if event.data == "[DONE]" {
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
        chunks,
    }
}

impl Paths {
    async fn direct(&self) -> Call {
        let body = json!({"model":"bench-model","stream":true,"stream_options":{"include_usage":true},
                          "messages":[{"role":"user","content":"Tell me a long story."}]});
        let started = Instant::now();
        let response = self
            .http
            .post(format!("{}/chat/completions", self.upstream))
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
        let response = cyrene_bus::model_stream::complete_stream(
            &self.nats,
            &question(),
            TIMEOUT,
            |_, delta| {
                if let Delta::Text { .. } = delta {
                    let now = Instant::now();
                    first.get_or_insert(now);
                    last = now;
                    chunks += 1;
                }
            },
        )
        .await
        .unwrap();
        assert_eq!(response.provider, "mock");
        let first = first.expect("no delta");
        Call {
            ttft: first - started,
            span: last - first,
            chunks,
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (p50, p99) TTFT in ms and the median chunks per second.
fn summary(calls: &[Call]) -> (f64, f64, f64) {
    let mut ttft: Vec<Duration> = calls.iter().map(|c| c.ttft).collect();
    ttft.sort();
    let pick = |p: f64| ms(ttft[((ttft.len() as f64 - 1.0) * p).round() as usize]);
    let mut rates: Vec<f64> = calls
        .iter()
        .map(|c| (c.chunks.saturating_sub(1)) as f64 / c.span.as_secs_f64().max(1e-9))
        .collect();
    rates.sort_by(f64::total_cmp);
    (pick(0.5), pick(0.99), rates[rates.len() / 2])
}

fn main() {
    if common::filtered_out("streaming") {
        return;
    }
    common::block_on(run());
}

async fn run() {
    let upstream = mock_upstream().await;
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let http_addr = format!("127.0.0.1:{}", free_port());
    let _gateway = start_gateway(&server.url(), &upstream, &http_addr, dir.path());
    let paths = Paths {
        http: cyrene_model_gateway::http_client().unwrap(),
        upstream,
        front_door: format!("http://{http_addr}"),
        nats: server.connect().await,
    };
    // Ready when both doors answer (bounded).
    let mut ready = false;
    for _ in 0..200 {
        let nats = cyrene_bus::model_stream::complete_stream(
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
        paths.nats().await;
        paths.front_door().await;
    }
    let started = Instant::now();
    let (mut direct, mut nats, mut http) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..CALLS {
        direct.push(paths.direct().await);
        nats.push(paths.nats().await);
        http.push(paths.front_door().await);
    }
    for calls in [&direct, &nats, &http] {
        assert!(
            calls.iter().all(|c| c.chunks == CHUNKS),
            "every text chunk arrived"
        );
    }
    let d = summary(&direct);
    println!(
        "cyrene-model-gateway streaming bench (same run, interleaved; {CALLS} calls per path, \
         {CHUNKS} text chunks each)"
    );
    println!(
        "direct (mock upstream):   TTFT p50 {:.3} ms p99 {:.3} ms | {:.0} chunks/s",
        d.0, d.1, d.2
    );
    for (label, calls) in [("via NATS stream:", &nats), ("via HTTP front door:", &http)] {
        let s = summary(calls);
        println!(
            "{label:<25} TTFT p50 {:.3} ms p99 {:.3} ms | {:.0} chunks/s | added TTFT p50 {:.3} ms \
             p99 {:.3} ms",
            s.0,
            s.1,
            s.2,
            s.0 - d.0,
            s.1 - d.1
        );
    }
    println!("measured in {:.1} s", started.elapsed().as_secs_f64());
}
