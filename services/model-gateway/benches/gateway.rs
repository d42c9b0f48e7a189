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
//!
//! Then the HTTP front door (the same gateway process, `--http-addr`), three paths side by side,
//! each through [`common::RawClient`] (one kept-alive connection per request in flight, so the
//! client costs the same on every path):
//! - *mock*: the mock upstream read directly;
//! - *proxy*: a minimal pass-through proxy of the same HTTP stack ([`common::ProxyProcess`]),
//!   the physical floor of any HTTP hop in front of the mock;
//! - *door*: `POST /v1/chat/completions`.
//!
//! At 1 in flight the three alternate request by request; at 32 in flight each path runs alone
//! for a block, the blocks in rotation, and each path's req/s is the median of its blocks. The
//! bench ends with the summary of issue 37's rows (`COST …` lines, docs/performance.md).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use common::KEY;

use async_nats::client::RequestError;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::subjects::MODEL_COMPLETE;
use cyrene_test_support::cost;
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

// The gateway's allocator, so the pass-through proxy (this binary, re-run) allocates like it.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const HTTP_SEQUENTIAL: usize = 3_000;
const HTTP_IN_FLIGHT: usize = 32;
const HTTP_PER_CONNECTION: usize = 600;
const HTTP_BLOCKS: usize = 3;

/// The HTTP paths, in the order they alternate.
const HTTP_PATHS: [&str; 3] = ["mock", "proxy", "door"];

/// Where each HTTP path is, and what a request to it is.
struct HttpPaths {
    upstream: String,
    proxy: String,
    door: String,
}

impl HttpPaths {
    async fn client(&self, path: &str) -> common::RawClient {
        let body = direct_body();
        match path {
            "mock" => {
                common::RawClient::connect(&self.upstream, "/chat/completions", &[], &body).await
            }
            "proxy" => {
                common::RawClient::connect(&self.proxy, "/chat/completions", &[], &body).await
            }
            _ => {
                let auth = format!("authorization: Bearer {KEY}");
                common::RawClient::connect(&self.door, "/v1/chat/completions", &[&auth], &body)
                    .await
            }
        }
    }
}

/// One call on `client`, timed; its answer checked for the mock's text.
async fn timed(client: &mut common::RawClient) -> Duration {
    let started = Instant::now();
    let body = client.call().await;
    let took = started.elapsed();
    assert!(
        body.windows(9).any(|w| w == b"Hello! Ho"),
        "{}",
        String::from_utf8_lossy(body)
    );
    took
}

/// p50 and p99 per HTTP path at 1 in flight, the paths alternating request by request.
async fn http_sequential(paths: &HttpPaths, n: usize) -> Vec<(f64, f64)> {
    let mut clients = Vec::new();
    for path in HTTP_PATHS {
        clients.push(paths.client(path).await);
    }
    let mut times = vec![Vec::with_capacity(n); HTTP_PATHS.len()];
    for _ in 0..n {
        for (client, times) in clients.iter_mut().zip(times.iter_mut()) {
            times.push(timed(client).await);
        }
    }
    times
        .into_iter()
        .map(|mut t| {
            t.sort();
            (percentile(&t, 0.5), percentile(&t, 0.99))
        })
        .collect()
}

/// Requests per second on `path` with `in_flight` connections, each making `per_connection`
/// requests one after the other.
async fn http_rate(paths: &HttpPaths, path: &str, in_flight: usize, per_connection: usize) -> f64 {
    let mut clients = Vec::new();
    for _ in 0..in_flight {
        clients.push(paths.client(path).await);
    }
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for mut client in clients {
        tasks.spawn(async move {
            for _ in 0..per_connection {
                client.call().await;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    (in_flight * per_connection) as f64 / started.elapsed().as_secs_f64()
}

/// The median req/s of each HTTP path over `blocks` rotations.
async fn http_rates(paths: &HttpPaths, blocks: usize) -> Vec<f64> {
    let mut rates = vec![Vec::new(); HTTP_PATHS.len()];
    for _ in 0..blocks {
        for (path, rates) in HTTP_PATHS.iter().zip(rates.iter_mut()) {
            rates.push(http_rate(paths, path, HTTP_IN_FLIGHT, HTTP_PER_CONNECTION).await);
        }
    }
    rates
        .into_iter()
        .map(|mut r| {
            r.sort_by(f64::total_cmp);
            r[r.len() / 2]
        })
        .collect()
}

/// The HTTP front door's rows of issue 37, against the mock and the pass-through proxy.
async fn http_door(paths: &HttpPaths) -> Vec<cost::Row> {
    // Warm-up: connection pools (the door's and the proxy's upstream clients), allocators.
    http_sequential(paths, 300).await;
    for path in HTTP_PATHS {
        http_rate(paths, path, HTTP_IN_FLIGHT, 30).await;
    }
    let one = http_sequential(paths, HTTP_SEQUENTIAL).await;
    let (mock, proxy, door) = (one[0], one[1], one[2]);
    println!(
        "HTTP, 1 in flight ({HTTP_SEQUENTIAL} req/path, alternating): mock p50 {:.3} ms p99 {:.3} \
         ms | proxy p50 {:.3} ms p99 {:.3} ms | door p50 {:.3} ms p99 {:.3} ms",
        mock.0, mock.1, proxy.0, proxy.1, door.0, door.1
    );
    let rates = http_rates(paths, HTTP_BLOCKS).await;
    println!(
        "HTTP, {HTTP_IN_FLIGHT} in flight (median of {HTTP_BLOCKS} blocks of {} req/path): mock \
         {:.0} req/s | proxy {:.0} req/s | door {:.0} req/s",
        HTTP_IN_FLIGHT * HTTP_PER_CONNECTION,
        rates[0],
        rates[1],
        rates[2]
    );
    let added = door.0 - mock.0;
    let floor = proxy.0 - mock.0;
    vec![
        cost::Row::new(
            "http_added_1_in_flight",
            "HTTP front door, added p50 over the mock, 1 in flight",
            format!("+{added:.3} ms"),
            format!(
                "pass-through proxy +{floor:.3} ms (the door is +{:.3} ms over it; mock {:.3} ms)",
                door.0 - proxy.0,
                mock.0
            ),
            "≤ +0.05 ms",
            added <= 0.05,
        ),
        cost::Row::new(
            "http_32_in_flight",
            format!("HTTP front door, req/s at {HTTP_IN_FLIGHT} in flight"),
            format!("{:.0} req/s", rates[2]),
            format!(
                "proxy {:.0} req/s ({:.2}× the door), mock alone {:.0} req/s",
                rates[1],
                rates[1] / rates[2],
                rates[0]
            ),
            "≥ 40000 req/s",
            rates[2] >= 40_000.0,
        ),
    ]
}

fn main() {
    run_echo_if_asked();
    common::main("gateway", run());
}

async fn run() {
    let upstream = mock_upstream().await;
    let stage = common::Stage::start(&upstream).await;
    let _echo = EchoProcess::start(&stage.server.url()).await;
    let nats = stage.server.connect().await;
    let http = cyrene_model_gateway::http_client().unwrap();
    let http_paths = HttpPaths {
        upstream: upstream.clone(),
        proxy: stage.proxy.clone(),
        door: stage.front_door.clone(),
    };
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

    let started = Instant::now();
    println!("cyrene-model-gateway bench (release; same run; mock upstream = raw tokio HTTP/1.1)");
    // `GATEWAY_BENCH_ONLY=http` measures the HTTP front door alone (while profiling it).
    if std::env::var("GATEWAY_BENCH_ONLY").is_ok_and(|only| only == "http") {
        let rows = http_door(&http_paths).await;
        print!(
            "{}",
            cost::summary("cyrene-model-gateway --bench gateway", &rows)
        );
        return;
    }
    // Warm up both paths (connection pools, allocator, branch predictors).
    sequential(&paths, 300).await;
    concurrent(&paths, 32, 30).await;
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
    let rows = http_door(&http_paths).await;
    println!("measured in {:.1} s", started.elapsed().as_secs_f64());
    print!(
        "{}",
        cost::summary("cyrene-model-gateway --bench gateway", &rows)
    );
}
