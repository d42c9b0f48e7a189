//! What both gateway benches run: a minimal keep-alive HTTP/1.1 mock upstream, the real
//! `cyrene-model-gateway` binary pointed at it, and the `main` around a bench.
#![allow(clippy::unwrap_used, clippy::expect_used)]

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
                    for write in writes.iter() {
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
    let mut command = Command::new(env!("CARGO_BIN_EXE_cyrene-model-gateway"));
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

/// Runs `bench` on a multi-threaded runtime.
pub fn block_on(bench: impl Future<Output = ()>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(bench);
}
