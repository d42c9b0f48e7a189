//! The `cyrene` binary against a real nats-server: ask, emit, agent, probe.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_test_support::micro::{add_endpoint, start_described_service};
use cyrene_test_support::{NatsServer, subscribed};
use std::process::{Output, Stdio};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

fn cyrene(server: &NatsServer) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cyrene"));
    cmd.env("NATS_URL", server.url())
        .env_remove("RUST_LOG")
        .kill_on_drop(true);
    cmd
}

async fn run(server: &NatsServer, args: &[&str]) -> Output {
    tokio::time::timeout(Duration::from_secs(30), cyrene(server).args(args).output())
        .await
        .expect("the command ends")
        .expect("the command runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Starts `cyrene agent` and waits until it answers.
async fn agent(
    server: &NatsServer,
    id: &str,
    reply: &str,
) -> (Child, Lines<BufReader<ChildStdout>>) {
    let mut child = cyrene(server)
        .args(["agent", "--id", id, "--reply", reply])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let out = run(
                server,
                &[
                    "ask",
                    "--from",
                    "probe",
                    "--to",
                    id,
                    "--timeout",
                    "200ms",
                    "ready?",
                ],
            )
            .await;
            if out.status.success() {
                break;
            }
        }
    })
    .await;
    assert!(ready.is_ok(), "the agent answers");
    (child, lines)
}

async fn next_json(lines: &mut Lines<BufReader<ChildStdout>>) -> serde_json::Value {
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("a line arrives")
        .unwrap()
        .expect("the agent is still running");
    serde_json::from_str(&line).unwrap()
}

#[tokio::test]
async fn ask_prints_the_agents_reply_and_the_agent_prints_what_it_received() {
    let server = NatsServer::start();
    let (_agent, mut lines) = agent(&server, "b", "pong").await;
    // Skip the readiness asks.
    let out = run(&server, &["ask", "--from", "a", "--to", "b", "ping?"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), "pong\n");
    loop {
        let line = next_json(&mut lines).await;
        if line["ask"]["question"] == "ping?" {
            assert_eq!(line["ask"]["from"], "a");
            assert_eq!(line["ask"]["to"], "b");
            break;
        }
    }

    let out = run(
        &server,
        &[
            "emit",
            "--from",
            "a",
            "--to",
            "b",
            "task.progress",
            r#"{"pct":50}"#,
        ],
    )
    .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let line = next_json(&mut lines).await;
    assert_eq!(
        line["event"],
        serde_json::json!({"from":"a","name":"task.progress","data":{"pct":50}})
    );

    let out = run(&server, &["emit", "--from", "a", "hello.all"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let line = next_json(&mut lines).await;
    assert_eq!(line["event"]["name"], "hello.all");
}

/// `out` exited with `code` and said why (`cause`) in one line on stderr.
fn fails_in_one_line(out: &std::process::Output, code: i32, cause: &str) {
    assert_eq!(out.status.code(), Some(code), "{}", stderr(out));
    assert!(stderr(out).contains(cause), "{}", stderr(out));
    assert_eq!(stderr(out).lines().count(), 1, "one line: {}", stderr(out));
}

#[tokio::test]
async fn ask_failures_name_their_cause_and_exit_non_zero() {
    let server = NatsServer::start();
    let out = run(&server, &["ask", "--from", "a", "--to", "nobody", "hi"]).await;
    fails_in_one_line(&out, 4, "no responder");

    // Somebody listens but never answers.
    let client = server.connect().await;
    let _silent = subscribed(&client, "cyrene.agent.*.silent.ask").await;
    let out = run(
        &server,
        &[
            "ask",
            "--from",
            "a",
            "--to",
            "silent",
            "--timeout",
            "300ms",
            "hi",
        ],
    )
    .await;
    fails_in_one_line(&out, 3, "timeout");

    let out = run(
        &server,
        &["ask", "--from", "a", "--to", "b", "--timeout", "soon", "hi"],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "a usage error: {}",
        stderr(&out)
    );
}

#[tokio::test]
async fn an_unreachable_server_is_a_one_line_error() {
    let server = NatsServer::start();
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        cyrene(&server)
            .args([
                "--nats-url",
                "nats://127.0.0.1:1",
                "ask",
                "--from",
                "a",
                "--to",
                "b",
                "hi",
            ])
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("cannot connect to NATS at nats://127.0.0.1:1"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test]
async fn probe_lists_the_micro_services_on_the_bus() {
    let server = NatsServer::start();
    let out = run(&server, &["probe"]).await;
    assert!(out.status.success());
    assert!(
        stderr(&out).contains("no micro services"),
        "{}",
        stderr(&out)
    );

    let client = server.connect().await;
    let service =
        start_described_service(&client, "cyrene-model-gateway", "0.1.0", "test service").await;
    let _endpoint = add_endpoint(&service, "complete", "cyrene.model.complete").await;
    client.flush().await.unwrap();

    let out = run(&server, &["probe"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("cyrene-model-gateway"), "{text}");
    assert!(text.contains("complete=cyrene.model.complete"), "{text}");
    assert!(text.contains("0.1.0"), "{text}");

    let out = run(&server, &["probe", "--json", "cyrene-model-gateway"]).await;
    let line: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(line["info"]["name"], "cyrene-model-gateway");
    assert_eq!(line["stats"]["name"], "cyrene-model-gateway");
}
