//! The web chat (docs/web.md) in a real headless Chromium (Debian's `chromium` package, driven
//! by Playwright's `playwright-core` from `web/node_modules`): the real nats-server running
//! `deploy/nats/cyrene.conf` with its `websocket {}` block and its users, `cyrene up` (every
//! service, the offline scripted demo with its slow `search_notes` tool) serving the page, and
//! the browser logging in as the person users alice and bob and as the operator.
//!
//! The browser side is `web/tests/chat.test.mjs` (node's test runner); this test starts the
//! stack, runs it, and kills and starts nats-server again when the script asks (a line
//! `@@kill-nats` or `@@start-nats` on its stdout, answered by a line on its stdin once done).
//! `web/tests/approval.test.mjs` drives the approval cards against a stub of the orchestrator's
//! approval subjects (`approval_cards_in_a_real_browser`).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use cyrene_test_support::free_port;

use common::approval_stub::ApprovalStub;
use cyrene_protocol::approval::Decision;
use cyrene_test_support::NatsServer;
use cyrene_test_support::shipped::shipped_config;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// deploy/nats/cyrene.conf as shipped — users, permissions, websocket block — with the test's
/// passwords and WebSocket port, and one more user, `cyrene-up`, allowed everything: `cyrene up`
/// runs every service on one bus login. The browser logs in as the shipped person and operator
/// users only.
fn server(ws_port: u16) -> NatsServer {
    let config = shipped_config(repo(), i32::from(ws_port), &[("cyrene-up", "pw-up")]);
    NatsServer::builder().config(config).start()
}

fn chromium() -> PathBuf {
    let path = PathBuf::from(
        std::env::var("CYRENE_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()),
    );
    assert!(
        path.exists(),
        "{} is missing: the web tests drive Debian's chromium (make test installs it: \
         apt-get install chromium)",
        path.display()
    );
    path
}

/// Waits until a turn calls the demo tool `search_notes`: the loop worker finds tools by
/// discovery, refreshed every few seconds, so the first turns after `cyrene up` may not be
/// offered it yet. Asks as bob, in sessions of his own the browser tests never open.
async fn demo_tool_offered(port: u16) {
    let bob = async_nats::ConnectOptions::new()
        .user_and_password("person-bob".into(), "pw-bob".into())
        .custom_inbox_prefix("_INBOX_person-bob")
        .connect(format!("nats://127.0.0.1:{port}"))
        .await
        .unwrap();
    let mut events = bob.subscribe("cyrene.session.bob.*.events").await.unwrap();
    bob.flush().await.unwrap();
    for attempt in 0..30 {
        let session = format!("bob.warmup-{attempt}");
        let send = serde_json::json!({"session_id": session,
            "message": {"role": "user", "content": "search my notes"}});
        let _ = bob
            .request(
                "cyrene.person.bob.session.send",
                serde_json::to_vec(&send).unwrap().into(),
            )
            .await
            .unwrap();
        // this turn's events until it ends: did it call the tool?
        let called = tokio::time::timeout(Duration::from_secs(20), async {
            let mut called = false;
            while let Some(m) = futures::StreamExt::next(&mut events).await {
                let event: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                if event["session_id"] != session.as_str() {
                    continue;
                }
                called |=
                    event["type"] == "tool_call" && event.to_string().contains("\"search_notes\"");
                if event["type"] == "turn_ended" {
                    return called;
                }
            }
            false
        })
        .await
        .expect("a warm-up turn ends");
        if called {
            return;
        }
    }
    panic!("no turn was offered the demo tool search_notes");
}

/// `cyrene up` (every service, the offline demo, the page) on `server`, and the page's URL, once
/// it has printed it and an operator sees the four services; its stderr goes on to this test's
/// stderr.
async fn cyrene_up(
    server: &NatsServer,
    ws_port: u16,
    data: &Path,
) -> (tokio::process::Child, String) {
    let mut up = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["up", "--web-addr", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env(
            "NATS_URL",
            format!("nats://cyrene-up:pw-up@127.0.0.1:{}", server.port()),
        )
        .env(
            "CYRENE_WEB_NATS_WS_URL",
            format!("ws://127.0.0.1:{ws_port}"),
        )
        .env(
            "RUST_LOG",
            std::env::var("CYRENE_UP_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // `cyrene up` prints the page's URL once every service has started.
    let mut up_err = BufReader::new(up.stderr.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = up_err.next_line().await.unwrap() {
            eprintln!("up: {line}");
            if let Some(rest) = line.strip_prefix("cyrene: open ") {
                return rest.split_whitespace().next().unwrap().to_owned();
            }
        }
        panic!("cyrene up ended without printing the web chat's URL");
    })
    .await
    .expect("cyrene up prints the web chat's URL");
    tokio::spawn(async move {
        while let Ok(Some(line)) = up_err.next_line().await {
            eprintln!("up: {line}");
        }
    });
    let operator = async_nats::ConnectOptions::new()
        .user_and_password("cyrene-operator".into(), "pw-operator".into())
        .custom_inbox_prefix("_INBOX_cyrene-operator")
        .connect(server.url())
        .await
        .unwrap();
    common::wait_for_the_four_services(&operator).await;
    (up, url)
}

/// A browser test script of `web/tests` running under node against the page at `url`: its
/// stdin (for the driver's answers) and its stdout lines (its output and the driver's asks).
struct Browser {
    node: tokio::process::Child,
    stdin: tokio::process::ChildStdin,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

fn browser(script: &str, url: &str, chromium: &Path, shots: &Path) -> Browser {
    let mut node = Command::new("node")
        .arg(script)
        .current_dir(repo().join("web"))
        .env("CYRENE_WEB_URL", url)
        .env("CYRENE_CHROMIUM", chromium)
        .env("CYRENE_WEB_SHOTS", shots)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdin = node.stdin.take().unwrap();
    let lines = BufReader::new(node.stdout.take().unwrap()).lines();
    Browser { node, stdin, lines }
}

impl Browser {
    /// Runs the script to its end (within `minutes`), printing its output; `answer` does what
    /// each line it asks (`@@…`) says and tells whether it was an ask, which the driver then
    /// reports done. The script must succeed.
    async fn drive(mut self, minutes: u64, mut answer: impl AsyncFnMut(&str) -> bool) {
        let run = tokio::time::timeout(Duration::from_secs(minutes * 60), async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                println!("{line}");
                if answer(line.trim_start()).await {
                    done(&mut self.stdin).await;
                }
            }
            self.node.wait().await.unwrap()
        })
        .await
        .unwrap_or_else(|_| panic!("the browser tests end within {minutes} minutes"));
        assert!(
            run.success(),
            "the browser tests failed ({run}): see their output above"
        );
    }
}

/// Tells the script the driver did what it asked.
async fn done(stdin: &mut tokio::process::ChildStdin) {
    stdin.write_all(b"done\n").await.unwrap();
    stdin.flush().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_chat_in_a_real_browser() {
    let chromium = chromium();
    let ws_port = free_port();
    let mut server = server(ws_port);
    let data = tempfile::tempdir().unwrap();
    let shots = repo().join("target/web-screenshots");
    std::fs::create_dir_all(&shots).unwrap();

    let (mut up, url) = cyrene_up(&server, ws_port, data.path()).await;
    demo_tool_offered(server.port()).await;

    let mut restarts = 0;
    let mut kills = 0;
    let answer = async |asked: &str| {
        if asked.starts_with("@@kill-nats") {
            server.kill();
            kills += 1;
        } else if asked.starts_with("@@start-nats") {
            server.start_again();
            restarts += 1;
        } else {
            return false;
        }
        true
    };
    browser("tests/chat.test.mjs", &url, &chromium, &shots)
        .drive(8, answer)
        .await;
    assert_eq!(
        (kills, restarts),
        (1, 1),
        "the reconnect test stopped and started nats-server once"
    );
    for shot in ["chat.png", "phone.png", "operator.png"] {
        assert!(shots.join(shot).exists(), "screenshot {shot} was saved");
    }
    common::terminate(&up);
    let _ = tokio::time::timeout(Duration::from_secs(20), up.wait()).await;
}

/// One HTTP/1.1 GET over a plain TCP connection: the status line, headers and body as text.
async fn get(addr: &str, path: &str) -> String {
    use tokio::io::AsyncReadExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
}

/// `cyrene web` alone: it serves the page and `/config.json` with the strict CSP, connects to
/// no NATS (none runs here), and refuses a WebSocket URL that could widen the policy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cyrene_web_serves_the_page_and_its_config_without_nats() {
    let mut web = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args([
            "web",
            "--addr",
            "127.0.0.1:0",
            "--web-personas",
            "cyrene,hoshi",
        ])
        .env("CYRENE_WEB_NATS_WS_URL", "wss://nats.example.org/ws")
        // no NATS answers here: `cyrene web` must not need one
        .env("NATS_URL", "nats://127.0.0.1:1")
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut err = BufReader::new(web.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), err.next_line())
        .await
        .expect("cyrene web says where it listens")
        .unwrap()
        .unwrap();
    let addr = line
        .strip_prefix("cyrene: web chat at http://")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_owned();

    let config = get(&addr, "/config.json").await;
    assert!(config.starts_with("HTTP/1.1 200"), "{config}");
    assert!(
        config.ends_with(
            r#"{"nats_ws_url":"wss://nats.example.org/ws","personas":["cyrene","hoshi"]}"#
        ),
        "{config}"
    );
    let page = get(&addr, "/").await.to_ascii_lowercase();
    assert!(page.starts_with("http/1.1 200"), "{page}");
    assert!(page.contains(
        "content-security-policy: default-src 'none'; script-src 'self'; style-src 'self'; \
         img-src 'self' data:; connect-src 'self' wss://nats.example.org/ws; base-uri 'none'; \
         form-action 'none'; frame-ancestors 'none'\r\n"
    ));
    assert!(page.contains("x-content-type-options: nosniff\r\n"));
    assert!(page.contains(r#"<script type="module" src="/app.js"></script>"#));
    let script = get(&addr, "/app.js").await;
    assert!(
        script.contains("content-type: text/javascript"),
        "{}",
        &script[..300]
    );
    let missing = get(&addr, "/../etc/passwd").await;
    assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
    common::terminate(&web);
    let _ = web.wait().await;

    // a URL that would end the connect-src directive is refused at start
    let out = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["web", "--addr", "127.0.0.1:0"])
        .env("CYRENE_WEB_NATS_WS_URL", "ws://x; script-src *")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("must be one URL"), "{stderr}");
}

/// One person's turn after `cyrene up` has lived through nats-server restarts: a fresh
/// connection as alice (as a fresh login in the page makes), her events subscribed, one message
/// sent with a new idempotency key, and its answer awaited.
async fn alice_is_answered(port: u16, session: &str, text: &str) {
    let alice = async_nats::ConnectOptions::new()
        .user_and_password("person-alice".into(), "pw-alice".into())
        .custom_inbox_prefix("_INBOX_person-alice")
        .connect(format!("nats://127.0.0.1:{port}"))
        .await
        .unwrap();
    let mut events = alice
        .subscribe(format!("cyrene.session.{session}.events"))
        .await
        .unwrap();
    alice.flush().await.unwrap();
    let send = serde_json::json!({"session_id": session,
        "idempotency_key": format!("k-{text}"),
        "message": {"role": "user", "content": text}});
    // Until the services have reconnected too, nobody answers: sent again with the same key,
    // as the page's outbox does.
    let ack = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match alice
                .request(
                    "cyrene.person.alice.session.send",
                    serde_json::to_vec(&send).unwrap().into(),
                )
                .await
            {
                Ok(ack) => return ack,
                Err(err) if err.kind() == async_nats::client::RequestErrorKind::NoResponders => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(err) => panic!("sending {text:?}: {err}"),
            }
        }
    })
    .await
    .expect("the orchestrator answers a send within 30 s of the restart");
    let ack: serde_json::Value = serde_json::from_slice(&ack.payload).unwrap();
    assert!(ack.get("error").is_none(), "{ack}");
    let answer = tokio::time::timeout(Duration::from_secs(45), async {
        while let Some(m) = futures::StreamExt::next(&mut events).await {
            let event: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
            if event["type"] == "turn_ended" {
                return event["message"].to_string();
            }
        }
        panic!("alice's events ended");
    })
    .await
    .unwrap_or_else(|_| panic!("no answer to {text:?} within 45 s"));
    assert!(answer.contains(&format!("You said: {text}")), "{answer}");
}

/// The stack under `cyrene up` answers a person after nats-server was killed and started again,
/// several times over (issue 32's flake: a turn after the restart went unanswered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cyrene_up_answers_again_after_nats_restarts() {
    let ws_port = free_port();
    let mut server = server(ws_port);
    let data = tempfile::tempdir().unwrap();
    let (up, _url) = cyrene_up(&server, ws_port, data.path()).await;
    alice_is_answered(server.port(), "alice.restarts", "before any restart").await;
    let rounds: usize = std::env::var("CYRENE_RESTART_ROUNDS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    for round in 1..=rounds {
        server.kill();
        server.start_again();
        alice_is_answered(
            server.port(),
            "alice.restarts",
            &format!("after restart {round}"),
        )
        .await;
        eprintln!("round {round}: answered");
    }
    common::terminate(&up);
}

/// The session of the approval test.
const STUB_SESSION: &str = "alice.approvals";

/// `cyrene web` on `ws_port`'s NATS: the page's URL.
async fn cyrene_web(ws_port: u16) -> (tokio::process::Child, String) {
    let mut web = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["web", "--addr", "127.0.0.1:0"])
        .env(
            "CYRENE_WEB_NATS_WS_URL",
            format!("ws://127.0.0.1:{ws_port}"),
        )
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut err = BufReader::new(web.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), err.next_line())
        .await
        .expect("cyrene web says where it listens")
        .unwrap()
        .unwrap();
    let url = line
        .strip_prefix("cyrene: web chat at ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_owned();
    (web, url)
}

/// Approval cards (docs/web.md, "Approvals") in a real browser, against the page's side of the
/// contract alone (web/tests/approval.test.mjs): nats-server with the shipped users — so alice's
/// user must be allowed `session.approve` and `.approvals` — `cyrene web`, and an
/// [`ApprovalStub`] in place of the orchestrator (each `session.approve` body must parse as the
/// contract's `ApproveRequest`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approval_cards_in_a_real_browser() {
    let chromium = chromium();
    let ws_port = free_port();
    let server = server(ws_port);
    let shots = repo().join("target/web-screenshots");
    std::fs::create_dir_all(&shots).unwrap();
    let stub = async_nats::ConnectOptions::new()
        .user_and_password("cyrene-up".into(), "pw-up".into())
        .connect(server.url())
        .await
        .unwrap();
    let stub = ApprovalStub::start(stub, "cyrene.person.alice.", "person:alice").await;
    let (web, url) = cyrene_web(ws_port).await;

    let answer = async |asked: &str| {
        if let Some(ask) = asked.strip_prefix("@@ask ") {
            let ask: serde_json::Value = serde_json::from_str(ask).unwrap();
            let (call, tool) = (
                ask["call_id"].as_str().unwrap(),
                ask["tool"].as_str().unwrap(),
            );
            stub.ask(STUB_SESSION, call, tool, ask["arguments"].clone())
                .await;
        } else if let Some(call) = asked.strip_prefix("@@deadline ") {
            stub.decided_elsewhere(call, Decision::Deny, "deadline");
        } else if let Some(unknown) = asked.strip_prefix("@@unknown ") {
            let unknown: serde_json::Value = serde_json::from_str(unknown).unwrap();
            let (call, tool) = (
                unknown["call_id"].as_str().unwrap(),
                unknown["tool"].as_str().unwrap(),
            );
            stub.outcome_unknown(STUB_SESSION, call, tool, unknown["arguments"].clone())
                .await;
        } else {
            return false;
        }
        true
    };
    browser("tests/approval.test.mjs", &url, &chromium, &shots)
        .drive(5, answer)
        .await;
    // what the page sent, each a valid ApproveRequest: c1 approved, c2 denied with its reason,
    // c3 approved too late, c4 denied from the phone
    let sent: Vec<(String, Decision, Option<String>)> = stub
        .decisions()
        .into_iter()
        .map(|(session, call, decision, reason)| {
            assert_eq!(session, STUB_SESSION);
            (call, decision, reason)
        })
        .collect();
    assert_eq!(
        sent,
        [
            ("c1".into(), Decision::Approve, None),
            ("c2".into(), Decision::Deny, Some("not to my boss".into())),
            ("c3".into(), Decision::Approve, None),
            ("c4".into(), Decision::Deny, None),
        ]
    );
    for shot in ["approval.png", "approval-phone.png"] {
        assert!(shots.join(shot).exists(), "screenshot {shot} was saved");
    }
    common::terminate(&web);
}
