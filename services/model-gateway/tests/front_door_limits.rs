//! The HTTP front door against hostile clients (docs/security.md, "The HTTP front door"; issue
//! 30, H3): idle sockets cannot take the descriptors bus calls and new requests need, a request
//! without a key is refused and its connection closed, a body that does not come is answered,
//! requests past the limit are refused, and a client that leaves takes its upstream call with
//! it. Raw sockets on both sides, so what is observed is what a client and a provider see.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cyrene_model_gateway::http::{ClientKeys, HttpConfig, HttpLimits};
use cyrene_test_support::NatsServer;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const KEY: &str = "limits-test-key";
/// How long anything the door must do may take before the test calls it a hang.
const DEADLINE: Duration = Duration::from_secs(30);

/// A models config whose only model is the openai-protocol upstream at `base_url`.
fn models(base_url: &str) -> Value {
    json!({
        "providers":{"up":{"protocol":"openai","base_url":base_url,"models":{"m":{}}}},
        "groups":{"g":[{"provider":"up","model":"m"}]},
        "active_group":"g"})
}

const CHAT: &str = r#"{"model":"default","messages":[{"role":"user","content":"hi"}]}"#;
const CHAT_STREAMED: &str =
    r#"{"model":"default","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

/// A POST of `body` to the chat endpoint, with the key when `key`.
fn post(body: &str, key: bool) -> String {
    let auth = if key {
        format!("Authorization: Bearer {KEY}\r\n")
    } else {
        String::new()
    };
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: door\r\n{auth}Content-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Everything the door writes on `stream` until it closes the connection.
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut out))
        .await
        .expect("the door closed the connection")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads until `stream` has shown an HTTP response head (its status line).
async fn status_of(stream: &mut TcpStream) -> u16 {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(DEADLINE, async {
        while !out.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed before a response");
            out.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("a response in time");
    let head = String::from_utf8_lossy(&out);
    head.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// An upstream that takes connections and reads requests but never answers; `closed` counts
/// the connections the gateway closed.
struct SilentUpstream {
    url: String,
    closed: tokio::sync::mpsc::UnboundedReceiver<()>,
    opened: tokio::sync::mpsc::UnboundedReceiver<()>,
}

async fn silent_upstream() -> SilentUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (opened_tx, opened) = tokio::sync::mpsc::unbounded_channel();
    let (closed_tx, closed) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut stream, _) = listener.accept().await.unwrap();
            let (opened_tx, closed_tx) = (opened_tx.clone(), closed_tx.clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let mut told = false;
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) if !told => {
                            told = true;
                            let _ = opened_tx.send(());
                        }
                        Ok(_) => {}
                    }
                }
                let _ = closed_tx.send(());
            });
        }
    });
    SilentUpstream {
        url,
        closed,
        opened,
    }
}

/// The front door in this process over `models`, with `limits`.
async fn door(models: Value, limits: HttpLimits) -> (SocketAddr, NatsServer, CancellationToken) {
    let gateway = common::shared_gateway(models);
    let nats = NatsServer::start();
    let client = nats.connect().await;
    let shutdown = CancellationToken::new();
    let config = HttpConfig {
        addr: "127.0.0.1:0".parse().unwrap(),
        keys: KEY.parse::<ClientKeys>().unwrap(),
        limits,
    };
    let (addr, _task) =
        cyrene_model_gateway::http::serve(config, gateway, client, shutdown.clone())
            .await
            .unwrap();
    (addr, nats, shutdown)
}

#[tokio::test]
async fn a_request_without_a_valid_key_is_refused_and_its_connection_closed() {
    let (addr, _nats, _shutdown) = door(models("http://127.0.0.1:9"), HttpLimits::default()).await;
    for request in [
        post("{}", false),
        post("{}", false).replace("Host: door", "Host: door\r\nAuthorization: Bearer nope"),
    ] {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        // Keep-alive is HTTP/1.1's default: only a door that closes lets this read end.
        let answer = read_to_close(&mut stream).await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
        assert!(answer.contains("api_key"), "{answer}");
    }
}

#[tokio::test]
async fn a_body_that_does_not_come_is_answered_408() {
    let limits = HttpLimits {
        body_timeout: Duration::from_millis(300),
        ..HttpLimits::default()
    };
    let (addr, _nats, _shutdown) = door(models("http://127.0.0.1:9"), limits).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let request = post(CHAT, true);
    // The headers and half the body, then nothing.
    let half = request.len() - CHAT.len() / 2;
    stream.write_all(&request.as_bytes()[..half]).await.unwrap();
    let answer = read_to_close(&mut stream).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
}

#[tokio::test]
async fn requests_past_the_limit_are_answered_429_and_a_leaving_client_frees_its_place() {
    let mut upstream = silent_upstream().await;
    let limits = HttpLimits {
        max_requests: 1,
        ..HttpLimits::default()
    };
    let (addr, _nats, _shutdown) = door(models(&upstream.url), limits).await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    first.write_all(post(CHAT, true).as_bytes()).await.unwrap();
    tokio::time::timeout(DEADLINE, upstream.opened.recv())
        .await
        .expect("the first call reached the upstream");
    let mut second = TcpStream::connect(addr).await.unwrap();
    second.write_all(post(CHAT, true).as_bytes()).await.unwrap();
    assert_eq!(status_of(&mut second).await, 429);
    // The first client leaves: its call and the upstream request end, its place is free.
    drop(first);
    tokio::time::timeout(DEADLINE, upstream.closed.recv())
        .await
        .expect("the upstream request was cancelled when its client left");
    let mut third = TcpStream::connect(addr).await.unwrap();
    third.write_all(post(CHAT, true).as_bytes()).await.unwrap();
    tokio::time::timeout(DEADLINE, upstream.opened.recv())
        .await
        .expect("the freed place took the next call");
}

#[tokio::test]
async fn a_streamed_call_whose_client_leaves_is_cancelled_upstream() {
    let mut upstream = silent_upstream().await;
    let (addr, _nats, _shutdown) = door(models(&upstream.url), HttpLimits::default()).await;
    let mut client = TcpStream::connect(addr).await.unwrap();
    client
        .write_all(post(CHAT_STREAMED, true).as_bytes())
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, upstream.opened.recv())
        .await
        .expect("the call reached the upstream");
    drop(client);
    tokio::time::timeout(DEADLINE, upstream.closed.recv())
        .await
        .expect("the upstream request was cancelled when its client left");
}

/// The gateway binary with at most `files` open files (`prlimit --nofile`), its front door on
/// `http` and its models config at `models`.
fn gateway_with_files(
    files: u64,
    nats_url: &str,
    http: SocketAddr,
    models: &std::path::Path,
) -> tokio::process::Child {
    tokio::process::Command::new("prlimit")
        .arg(format!("--nofile={files}:{files}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_cyrene-model-gateway"))
        .env("NATS_URL", nats_url)
        .env("RUST_LOG", "warn")
        .env("CYRENE_GATEWAY_MODELS", models)
        .env("CYRENE_GATEWAY_HTTP_ADDR", http.to_string())
        .env("CYRENE_GATEWAY_HTTP_KEYS", KEY)
        .env("CYRENE_GATEWAY_HTTP_HEADER_TIMEOUT", "1s")
        .kill_on_drop(true)
        .spawn()
        .expect("prlimit (util-linux) runs the gateway")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_cannot_take_what_bus_calls_and_new_requests_need() {
    let upstream = common::openai_upstream(json!({
        "model":"m","choices":[{"message":{"role":"assistant","content":"from upstream"},
                                "finish_reason":"stop"}]}))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("models.json");
    std::fs::write(&path, models(&upstream.uri()).to_string()).unwrap();
    let nats = NatsServer::start();
    let client = nats.connect().await;
    let http = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    // 128 descriptors: the door may hold 32 connections; the flood is ten times that.
    let _gateway = gateway_with_files(128, &nats.url(), http, &path);
    assert!(
        cyrene_bus::discovery::wait_for(
            &client,
            "cyrene-model-gateway",
            DEADLINE,
            Duration::from_millis(200)
        )
        .await
    );
    let connect = || async {
        loop {
            if let Ok(stream) = TcpStream::connect(http).await {
                return stream;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let mut flood = Vec::new();
    for _ in 0..320 {
        flood.push(tokio::time::timeout(DEADLINE, connect()).await.unwrap());
    }

    // A bus call needs a descriptor for its upstream connection: there is one.
    let reply: Value = cyrene_bus::request_json(
        &client,
        "cyrene.model.complete",
        &json!({"messages":[{"role":"user","content":"over the bus"}]}),
        DEADLINE,
    )
    .await
    .expect("a bus model call during the flood");
    assert_eq!(reply["content"], "from upstream", "{reply}");

    // A new HTTP request is served: idle sockets are closed after the header timeout.
    let mut fresh = connect().await;
    fresh.write_all(post(CHAT, true).as_bytes()).await.unwrap();
    assert_eq!(status_of(&mut fresh).await, 200);

    // And the idle ones were closed by the door, not left open.
    let first = flood.first_mut().unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(DEADLINE, first.read(&mut buf))
        .await
        .expect("an idle socket is closed")
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
}
