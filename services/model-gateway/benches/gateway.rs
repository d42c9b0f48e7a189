//! The gateway's added latency and throughput (`cargo bench -p cyrene-model-gateway`).
//!
//! Measured in one run, side by side:
//! - *direct*: this process calls a minimal mock upstream (raw tokio HTTP/1.1, keep-alive, a
//!   fixed OpenAI-style reply) over HTTP with reqwest;
//! - *via gateway*: this process sends the same question over NATS to a `cyrene-model-gateway`
//!   process (the real binary), which calls the same mock upstream.
//!
//! At 1 in flight a third path is interleaved: a raw NATS request of the same payload to a bare
//! echo responder in its own process — the floor any service behind NATS pays on this machine.
//!
//! Added latency = the gateway path's percentile minus the direct path's, at 1 and 32 requests
//! in flight (the two paths are interleaved so drift hits both alike); throughput = requests per
//! second one gateway process completes with 64 in flight. Everything shares this machine's
//! cores (nats-server, gateway, this process), so the figures are conservative.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use async_nats::client::RequestError;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::subjects::MODEL_COMPLETE;
use cyrene_test_support::NatsServer;
use cyrene_test_support::echo::{ECHO_SUBJECT, EchoProcess, run_echo_if_asked};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SEQUENTIAL: usize = 3_000;
const CONCURRENT_PER_WORKER: usize = 300;
const THROUGHPUT_REQUESTS: usize = 30_000;
const TIMEOUT: Duration = Duration::from_secs(10);

const REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I help you today?"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":9,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":0}}}"#;

/// The mock upstream answering every request with [`REPLY`].
async fn mock_upstream() -> String {
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{REPLY}",
        REPLY.len()
    );
    common::mock_upstream(vec![response.into_bytes()]).await
}

fn question() -> ModelRequest {
    ModelRequest {
        messages: vec![
            Message::text(Role::System, "You are a helpful assistant."),
            Message::text(Role::User, "Hello there, who are you?"),
        ],
        max_tokens: Some(256),
        purpose: "bench".into(),
        ..Default::default()
    }
}

/// The body the gateway itself would send upstream, so both paths move the same bytes.
fn direct_body() -> Vec<u8> {
    serde_json::to_vec(&json!({"model":"bench-model","max_tokens":256,"messages":[
        {"role":"system","content":"You are a helpful assistant."},
        {"role":"user","content":"Hello there, who are you?"}]}))
    .unwrap()
}

#[derive(Clone)]
struct Paths {
    http: reqwest::Client,
    url: String,
    body: Arc<Vec<u8>>,
    nats: async_nats::Client,
    payload: bytes::Bytes,
}

impl Paths {
    async fn direct(&self) -> Duration {
        let started = Instant::now();
        let reply = self
            .http
            .post(&self.url)
            .header("content-type", "application/json")
            .body(self.body.as_ref().clone())
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let v: Value = serde_json::from_slice(&reply).unwrap();
        assert!(v.get("choices").is_some());
        started.elapsed()
    }

    async fn echo(&self) -> Duration {
        let started = Instant::now();
        self.nats
            .request(ECHO_SUBJECT, self.payload.clone())
            .await
            .unwrap();
        started.elapsed()
    }

    /// The question, once, to the gateway over NATS.
    async fn ask_gateway(&self, timeout: Duration) -> Result<async_nats::Message, RequestError> {
        let request = async_nats::Request::new()
            .payload(self.payload.clone())
            .timeout(Some(timeout));
        self.nats.send_request(MODEL_COMPLETE, request).await
    }

    async fn gateway(&self) -> Duration {
        let started = Instant::now();
        let reply = self.ask_gateway(TIMEOUT).await.unwrap();
        let resp: ModelResponse = serde_json::from_slice(&reply.payload)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&reply.payload)));
        assert_eq!(resp.provider, "mock");
        started.elapsed()
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

struct Figures {
    direct: (f64, f64),
    gateway: (f64, f64),
    /// p50 of the raw echo, when measured.
    echo: Option<f64>,
}

fn figures(mut direct: Vec<Duration>, mut gateway: Vec<Duration>) -> Figures {
    direct.sort();
    gateway.sort();
    Figures {
        direct: (percentile(&direct, 0.5), percentile(&direct, 0.99)),
        gateway: (percentile(&gateway, 0.5), percentile(&gateway, 0.99)),
        echo: None,
    }
}

async fn sequential(paths: &Paths, n: usize) -> Figures {
    let mut direct = Vec::with_capacity(n);
    let mut gateway = Vec::with_capacity(n);
    let mut echo = Vec::with_capacity(n);
    for _ in 0..n {
        direct.push(paths.direct().await);
        gateway.push(paths.gateway().await);
        echo.push(paths.echo().await);
    }
    echo.sort();
    Figures {
        echo: Some(percentile(&echo, 0.5)),
        ..figures(direct, gateway)
    }
}

async fn concurrent(paths: &Paths, workers: usize, per_worker: usize) -> Figures {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let paths = paths.clone();
        tasks.spawn(async move {
            let mut d = Vec::with_capacity(per_worker);
            let mut g = Vec::with_capacity(per_worker);
            for _ in 0..per_worker {
                d.push(paths.direct().await);
                g.push(paths.gateway().await);
            }
            (d, g)
        });
    }
    let mut direct = Vec::new();
    let mut gateway = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (d, g) = done.unwrap();
        direct.extend(d);
        gateway.extend(g);
    }
    figures(direct, gateway)
}

async fn throughput(paths: &Paths, workers: usize, total: usize) -> f64 {
    let per_worker = total / workers;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let paths = paths.clone();
        tasks.spawn(async move {
            for _ in 0..per_worker {
                paths.gateway().await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    (per_worker * workers) as f64 / started.elapsed().as_secs_f64()
}

fn report(label: &str, f: &Figures, targets: Option<(f64, f64)>) {
    let added = (f.gateway.0 - f.direct.0, f.gateway.1 - f.direct.1);
    let target = |t: Option<f64>| {
        t.map(|t| format!(" (target <= {t} ms)"))
            .unwrap_or_default()
    };
    println!(
        "{label}: direct p50 {:.3} ms p99 {:.3} ms | via gateway p50 {:.3} ms p99 {:.3} ms",
        f.direct.0, f.direct.1, f.gateway.0, f.gateway.1
    );
    println!(
        "{label}: added  p50 {:.3} ms{}  p99 {:.3} ms{}",
        added.0,
        target(targets.map(|t| t.0)),
        added.1,
        target(targets.map(|t| t.1)),
    );
    if let Some(echo) = f.echo {
        println!(
            "{label}: raw NATS echo p50 {echo:.3} ms (the floor); the gateway adds {:.3} ms \
             at p50 over direct + echo",
            (added.0 - echo).max(0.0)
        );
    }
}

fn main() {
    if common::filtered_out("gateway") {
        return;
    }
    run_echo_if_asked();
    common::block_on(run());
}

async fn run() {
    let upstream = mock_upstream().await;
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let _gateway = common::start_gateway(&server.url(), &upstream, dir.path(), |_| {});
    let _echo = EchoProcess::start(&server.url()).await;
    let nats = server.connect().await;
    let http = cyrene_model_gateway::http_client().unwrap();
    let paths = Paths {
        http,
        url: format!("{upstream}/chat/completions"),
        body: Arc::new(direct_body()),
        nats,
        payload: serde_json::to_vec(&question()).unwrap().into(),
    };
    // Ready when the gateway answers (bounded).
    let mut ready = false;
    for _ in 0..200 {
        let reply = paths.ask_gateway(Duration::from_millis(500)).await;
        if reply.is_ok_and(|r| r.headers.is_none()) {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(ready, "the gateway process never answered");

    // Warm up both paths (connection pools, allocator, branch predictors).
    sequential(&paths, 300).await;
    concurrent(&paths, 32, 30).await;

    let started = Instant::now();
    println!("cyrene-model-gateway bench (release; same run; mock upstream = raw tokio HTTP/1.1)");
    let one = sequential(&paths, SEQUENTIAL).await;
    report(
        &format!("1 in flight  ({SEQUENTIAL} req/path)"),
        &one,
        Some((0.25, 0.5)),
    );
    let many = concurrent(&paths, 32, CONCURRENT_PER_WORKER).await;
    report(
        &format!("32 in flight ({} req/path)", 32 * CONCURRENT_PER_WORKER),
        &many,
        None,
    );
    let rps = throughput(&paths, 64, THROUGHPUT_REQUESTS).await;
    println!(
        "throughput: {rps:.0} req/s through one gateway process, 64 in flight \
         (target >= 5000 req/s)"
    );
    println!("measured in {:.1} s", started.elapsed().as_secs_f64());
}
