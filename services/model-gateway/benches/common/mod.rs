//! What both gateway benches run: a minimal keep-alive HTTP/1.1 mock upstream, the real
//! `cyrene-model-gateway` binary pointed at it, the pass-through proxy that is the HTTP front
//! door's floor (together a [`Stage`]), a minimal HTTP client, and the `main` around a bench.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// Each bench uses a part of this module.
#![allow(dead_code)]

use serde_json::json;
use std::future::Future;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A keep-alive HTTP/1.1 server on a free port answering every request (headers, then
/// content-length bytes of body) with `writes`, each in one `write_all`, in order. Returns its
/// base URL.
pub async fn mock_upstream(writes: Vec<Vec<u8>>) -> String {
    mock_upstream_paced(writes, std::time::Duration::ZERO).await
}

/// [`mock_upstream`] with `gap` between two writes of an answer, as a provider sends the
/// events of a streamed reply one by one as its model produces them.
pub async fn mock_upstream_paced(writes: Vec<Vec<u8>>, gap: std::time::Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let writes: Arc<[Vec<u8>]> = writes.into();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let _ = socket.set_nodelay(true);
            let writes = writes.clone();
            tokio::spawn(async move {
                let mut buf = Vec::with_capacity(16 * 1024);
                loop {
                    // Read one request: headers, then content-length bytes of body.
                    let header_end = loop {
                        if let Some(i) = find(&buf, b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 8192];
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let length = content_length(&buf[..header_end]);
                    while buf.len() < header_end + length {
                        let mut chunk = [0u8; 8192];
                        match socket.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..header_end + length);
                    for (i, write) in writes.iter().enumerate() {
                        if i > 0 && !gap.is_zero() {
                            tokio::time::sleep(gap).await;
                        }
                        if socket.write_all(write).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn content_length(head: &[u8]) -> usize {
    String::from_utf8_lossy(head)
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// A `cyrene-model-gateway` process, killed when dropped.
pub struct GatewayProcess(Child);

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The gateway binary on `nats_url` with one provider, the mock `upstream` serving
/// `bench-model`; its models file goes in `dir`. `more` adds the bench's own flags and env.
pub fn start_gateway(
    nats_url: &str,
    upstream: &str,
    dir: &Path,
    more: impl FnOnce(&mut Command),
) -> GatewayProcess {
    let config = json!({"providers":{"mock":{"protocol":"openai","base_url":upstream,
                          "models":{"bench-model":{}}}},
                        "groups":{"default":[{"provider":"mock","model":"bench-model"}]},
                        "active_group":"default"});
    let path = dir.join("models.json");
    std::fs::write(&path, config.to_string()).unwrap();
    // CYRENE_BENCH_GATEWAY_BIN runs another build of the gateway (an earlier commit's, to
    // compare a change against the same floors).
    let binary = std::env::var("CYRENE_BENCH_GATEWAY_BIN")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_cyrene-model-gateway").to_owned());
    let mut command = Command::new(binary);
    command
        .arg("--nats-url")
        .arg(nats_url)
        .arg("--models")
        .arg(&path);
    more(&mut command);
    let child = command
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn cyrene-model-gateway");
    GatewayProcess(child)
}

/// Whether `cargo bench` was given a filter argument that names something other than `bench`
/// (it passes `--bench` itself): then this bench does not run.
pub fn filtered_out(bench: &str) -> bool {
    std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !bench.contains(a.as_str()))
}

/// A bench binary's `main`: nothing when `cargo bench` filtered `bench` out, the proxy when
/// this process is a [`ProxyProcess`], else `run` to its end.
pub fn main(bench: &str, run: impl Future<Output = ()>) {
    if filtered_out(bench) {
        return;
    }
    run_proxy_if_asked();
    block_on(run);
}

/// The key bench clients present at the front door.
pub const KEY: &str = "bench-client-key";

/// What both benches measure against, on `upstream`: a nats-server, the gateway with its HTTP
/// front door (keyed [`KEY`]) and the pass-through proxy that is the door's floor, each on a
/// free port; all stopped when dropped.
pub struct Stage {
    /// The front door's base URL (`http://…`).
    pub front_door: String,
    /// The proxy's base URL (`http://…`).
    pub proxy: String,
    // Dropped in this order: the processes before the models file and the server they use.
    _proxy: ProxyProcess,
    _gateway: GatewayProcess,
    _dir: tempfile::TempDir,
    pub server: cyrene_test_support::NatsServer,
}

impl Stage {
    /// Starts everything; the proxy listens when this returns, the gateway may not yet.
    pub async fn start(upstream: &str) -> Stage {
        let server = cyrene_test_support::NatsServer::start();
        let dir = tempfile::tempdir().unwrap();
        let door = format!("127.0.0.1:{}", free_port());
        let gateway = start_gateway(&server.url(), upstream, dir.path(), |command| {
            command
                .arg("--http-addr")
                .arg(&door)
                .env("CYRENE_GATEWAY_HTTP_KEYS", KEY);
        });
        let proxy = format!("127.0.0.1:{}", free_port());
        let proxy_process = ProxyProcess::start(&proxy, upstream).await;
        Stage {
            front_door: format!("http://{door}"),
            proxy: format!("http://{proxy}"),
            _proxy: proxy_process,
            _gateway: gateway,
            _dir: dir,
            server,
        }
    }
}

/// Runs `bench` on a multi-threaded runtime.
pub fn block_on(bench: impl Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(bench);
}

/// Set in the child [`ProxyProcess::start`] runs: `<listen addr> <upstream base URL>`.
const PROXY_ENV: &str = "CYRENE_BENCH_PROXY";

/// The physical floor under the HTTP front door: a pass-through proxy on the same HTTP stack
/// (axum served by the accept loop the door uses, `cyrene_runtime::http`: hyper's HTTP/1.1 server
/// with `TCP_NODELAY`; the gateway's own reqwest client upstream), in its own process like the
/// gateway. It forwards a request's body unread to the
/// upstream's `/chat/completions` and relays the answer: whole when it is JSON, chunk by chunk as
/// it arrives when it is an event stream. Nothing is decoded, checked or re-encoded.
pub struct ProxyProcess(Child);

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl ProxyProcess {
    /// This very binary as a proxy on `addr` to `upstream`; waits until it accepts connections.
    pub async fn start(addr: &str, upstream: &str) -> ProxyProcess {
        let child = Command::new(std::env::current_exe().unwrap())
            .env(PROXY_ENV, format!("{addr} {upstream}"))
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn the proxy");
        // Killed and waited for on drop, whether it listens or not.
        let process = ProxyProcess(child);
        for _ in 0..200 {
            if tokio::net::TcpStream::connect(addr).await.is_ok() {
                return process;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        panic!("the proxy never listened on {addr}");
    }
}

/// In the child [`ProxyProcess::start`] runs: proxies until killed. Anywhere else: returns.
pub fn run_proxy_if_asked() {
    let Ok(spec) = std::env::var(PROXY_ENV) else {
        return;
    };
    let (addr, upstream) = spec.split_once(' ').unwrap();
    let upstream = format!("{upstream}/chat/completions");
    block_on(async move {
        let client = cyrene_model_gateway::http_client().unwrap();
        let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
            let client = client.clone();
            let upstream = upstream.clone();
            async move { forward(&client, &upstream, request).await }
        });
        let listener = TcpListener::bind(addr).await.unwrap();
        // The accept loop the front door serves on (TCP_NODELAY, hyper's HTTP/1.1), unbounded
        // for the bench's connections.
        let limits = cyrene_runtime::http::ConnLimits {
            max_connections: 1024,
            header_timeout: std::time::Duration::from_secs(60),
        };
        let shutdown = tokio_util::sync::CancellationToken::new();
        cyrene_runtime::http::serve_connections("proxy", listener, app, limits, shutdown).await;
    });
    std::process::exit(0);
}

async fn forward(
    client: &reqwest::Client,
    upstream: &str,
    request: axum::extract::Request,
) -> axum::response::Response {
    use axum::http::header::CONTENT_TYPE;
    let body = axum::body::to_bytes(request.into_body(), usize::MAX)
        .await
        .unwrap();
    let answer = client
        .post(upstream)
        .header(CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16();
    let kind = answer.headers().get(CONTENT_TYPE).cloned();
    let streamed = kind
        .as_ref()
        .is_some_and(|k| k.as_bytes().starts_with(b"text/event-stream"));
    let body = if streamed {
        axum::body::Body::from_stream(answer.bytes_stream())
    } else {
        axum::body::Body::from(answer.bytes().await.unwrap())
    };
    let mut response = axum::response::Response::new(body);
    *response.status_mut() = axum::http::StatusCode::from_u16(status).unwrap();
    if let Some(kind) = kind {
        response.headers_mut().insert(CONTENT_TYPE, kind);
    }
    response
}

/// A free TCP port on 127.0.0.1 (the one helper every test and bench uses).
pub use cyrene_test_support::free_port;

/// The cheapest HTTP/1.1 client: one kept-alive connection, one request at a time, written in
/// one `write_all` and read until its `Content-Length` body is in, so the client's own cost is
/// the same small one on every path it measures.
pub struct RawClient {
    stream: tokio::net::TcpStream,
    request: Vec<u8>,
    buf: Vec<u8>,
}

impl RawClient {
    /// A connection to `base` (`http://host:port`) that POSTs `body` to `path` with `headers`
    /// (each `Name: value`) on every [`RawClient::call`].
    pub async fn connect(base: &str, path: &str, headers: &[&str], body: &[u8]) -> RawClient {
        let host = base.trim_start_matches("http://");
        let stream = tokio::net::TcpStream::connect(host).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let mut request = format!(
            "POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
             content-length: {}\r\n",
            body.len()
        );
        for h in headers {
            request.push_str(h);
            request.push_str("\r\n");
        }
        request.push_str("\r\n");
        let mut request = request.into_bytes();
        request.extend_from_slice(body);
        RawClient {
            stream,
            request,
            buf: Vec::with_capacity(16 * 1024),
        }
    }

    /// One request and its whole answer; panics unless the status is 200. Returns the body.
    pub async fn call(&mut self) -> &[u8] {
        self.stream.write_all(&self.request).await.unwrap();
        self.buf.clear();
        let header_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i + 4;
            }
            self.read_more().await;
        };
        assert!(
            self.buf.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&self.buf[..header_end])
        );
        let length = content_length(&self.buf[..header_end]);
        assert!(length > 0, "an answer with a Content-Length");
        while self.buf.len() < header_end + length {
            self.read_more().await;
        }
        &self.buf[header_end..header_end + length]
    }

    async fn read_more(&mut self) {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).await.unwrap();
        assert!(n > 0, "the server closed the connection");
        self.buf.extend_from_slice(&chunk[..n]);
    }
}
