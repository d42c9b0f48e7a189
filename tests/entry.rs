//! One entry shape for every binary: a bad configuration exits 2 and lists every problem at once,
//! and `cyrene up` starts each service from its own `Args`, so every service env var works there.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use common::workspace_binary;
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_protocol::{ErrorCode, subjects};
use cyrene_test_support::NatsServer;
use serde_json::json;
use std::time::Duration;
use tokio::process::Command;

async fn run_binary(
    path: std::path::PathBuf,
    args: &[&str],
    envs: &[(&str, &str)],
) -> (i32, String) {
    let mut cmd = Command::new(path);
    // Nothing listens here: the configuration must be refused before any connection is tried.
    cmd.env("NATS_URL", "nats://127.0.0.1:1")
        .env("RUST_LOG", "off")
        .args(args)
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .expect("the binary exits by itself")
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A binary, its flags, its env, and the problems it must list.
type Case<'a> = (&'a str, Vec<&'a str>, Vec<(&'a str, &'a str)>, Vec<&'a str>);

#[tokio::test]
async fn every_binary_exits_2_on_a_bad_configuration_and_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let cases: [Case; 4] = [
        (
            "cyrene-model-gateway",
            vec![
                "--max-in-flight",
                "0",
                "--models",
                "/nonexistent/models.json",
            ],
            vec![],
            vec![
                "max_in_flight must be at least 1",
                "/nonexistent/models.json",
            ],
        ),
        (
            "cyrene-checkpoint-store",
            vec![
                "--max-state-bytes",
                "0",
                "--max-connections",
                "0",
                "--data-dir",
                data,
            ],
            vec![("DATABASE_URL", "mysql://db/x")],
            vec![
                "max_state_bytes must be at least 1",
                "max_connections must be at least 1",
                "\"mysql\" is not supported",
            ],
        ),
        (
            "cyrene-orchestrator",
            vec![
                "--max-steps",
                "0",
                "--parallel-sessions",
                "not.an.id",
                "--data-dir",
                data,
            ],
            vec![("DATABASE_URL", "mysql://db/x")],
            vec![
                "max_steps must be at least 1",
                "parallel_sessions",
                "\"mysql\" is not supported",
            ],
        ),
        (
            "cyrene-loop-worker",
            vec!["--concurrency", "0", "--ack-wait", "10ms"],
            vec![("CYRENE_WORKER_MAX_DELIVER", "0")],
            vec![
                "concurrency must be at least 1",
                "max_deliver must be at least 1",
                "ack_wait must be at least 300ms",
            ],
        ),
    ];
    for (binary, args, envs, problems) in cases {
        let (code, stderr) = run_binary(workspace_binary(binary), &args, &envs).await;
        assert_eq!(code, 2, "{binary}: {stderr}");
        assert!(
            stderr.contains("invalid configuration"),
            "{binary}: {stderr}"
        );
        for problem in problems {
            assert!(
                stderr.contains(problem),
                "{binary} did not list {problem:?}: {stderr}"
            );
        }
    }
    // A flag clap itself refuses is a configuration problem too.
    let (code, _) = run_binary(
        workspace_binary("cyrene-loop-worker"),
        &["--concurrency", "many"],
        &[],
    )
    .await;
    assert_eq!(code, 2);
}

/// One env var per service, each observable from outside, set only in `cyrene up`'s environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cyrene_up_starts_every_service_from_its_own_env_vars() {
    let server = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let mut up = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["up", "--data-dir", dir.path().to_str().unwrap()])
        .env("NATS_URL", server.url())
        .env("RUST_LOG", "off")
        .env("CYRENE_STORE_MAX_STATE_BYTES", "64")
        .env("CYRENE_ORCHESTRATOR_MAX_MESSAGE_BYTES", "40")
        .env("CYRENE_WORKER_ACK_WAIT", "7s")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let client = server.connect().await;
    common::wait_for_the_four_services(&client).await;
    let t = Duration::from_secs(5);

    // checkpoint store: CYRENE_STORE_MAX_STATE_BYTES
    let state = cyrene_protocol::JsonObject::encode(&json!({"note": "x".repeat(100)})).unwrap();
    let big = Checkpoint::unfenced("s1", 1, state);
    let err =
        cyrene_bus::request_json::<_, Checkpoint>(&client, subjects::CHECKPOINT_SAVE, &big, t)
            .await
            .unwrap_err();
    assert_eq!(err.to_body().code, ErrorCode::TooLarge, "{err}");

    // orchestrator: CYRENE_ORCHESTRATOR_MAX_MESSAGE_BYTES
    let send = json!({"session_id":"s1","message":{"role":"user","content":"x".repeat(100)}});
    let err =
        cyrene_bus::request_json::<_, serde_json::Value>(&client, subjects::SESSION_SEND, &send, t)
            .await
            .unwrap_err();
    assert_eq!(err.to_body().code, ErrorCode::TooLarge, "{err}");

    // loop worker: CYRENE_WORKER_ACK_WAIT reaches the shared consumer.
    let js = async_nats::jetstream::new(client.clone());
    let mut consumer = js
        .get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
            "cyrene-loop-worker",
            cyrene_bus::streams::TURNS_STREAM,
        )
        .await
        .unwrap();
    assert_eq!(
        consumer.info().await.unwrap().config.ack_wait,
        Duration::from_secs(7)
    );
    up.start_kill().unwrap();
    let _ = up.wait().await;

    // model gateway: CYRENE_GATEWAY_MAX_IN_FLIGHT — refused, by name, before anything starts.
    let out = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["up", "--data-dir", dir.path().to_str().unwrap()])
        .env("NATS_URL", server.url())
        .env("RUST_LOG", "off")
        .env("CYRENE_GATEWAY_MAX_IN_FLIGHT", "0")
        .stdin(std::process::Stdio::null())
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), out)
        .await
        .unwrap()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cyrene-model-gateway") && stderr.contains("max_in_flight"),
        "{stderr}"
    );
}

/// A setting under its name from before the naming rule still takes effect, for one release, and
/// the binary warns naming the new variable.
#[tokio::test]
async fn an_old_env_name_still_works_and_warns_naming_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stderr) = run_binary(
        workspace_binary("cyrene-checkpoint-store"),
        &[],
        &[
            ("RUST_LOG", "warn"),
            ("CYRENE_LOG_FORMAT", "text"),
            ("CYRENE_CHECKPOINT_MAX_STATE_BYTES", "0"),
            ("CYRENE_DATA_DIR", dir.path().to_str().unwrap()),
        ],
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("max_state_bytes must be at least 1"),
        "the old name did not reach the setting: {stderr}"
    );
    for (old, new) in [
        (
            "CYRENE_CHECKPOINT_MAX_STATE_BYTES",
            "CYRENE_STORE_MAX_STATE_BYTES",
        ),
        ("CYRENE_DATA_DIR", "CYRENE_STORE_DATA_DIR"),
    ] {
        assert!(
            stderr
                .lines()
                .any(|l| l.contains("WARN") && l.contains(old) && l.contains(new)),
            "no warning naming {new}: {stderr}"
        );
    }
    // The new name wins over the old one.
    let (code, stderr) = run_binary(
        workspace_binary("cyrene-checkpoint-store"),
        &[],
        &[
            ("CYRENE_CHECKPOINT_MAX_STATE_BYTES", "0"),
            ("CYRENE_STORE_MAX_STATE_BYTES", "-1"),
            ("CYRENE_STORE_DATA_DIR", dir.path().to_str().unwrap()),
        ],
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("-1"), "{stderr}");
}

/// docs/operations.md's settings table is this test's rendering of every binary's flags, so it
/// cannot drift from the code; on a mismatch the test prints the table to paste.
#[test]
fn docs_list_every_setting_of_every_service() {
    use clap::CommandFactory;
    const SHARED: [&str; 6] = [
        "NATS_URL",
        "NATS_USER",
        "NATS_PASSWORD",
        "NATS_CREDS",
        "NATS_NKEY",
        "CYRENE_HEALTH_ADDR",
    ];
    let binaries = [
        (
            "cyrene-model-gateway",
            cyrene_model_gateway::Args::command(),
        ),
        ("cyrene-loop-worker", cyrene_loop_worker::Args::command()),
        (
            "cyrene-checkpoint-store",
            cyrene_checkpoint_store::Args::command(),
        ),
        ("cyrene-orchestrator", cyrene_orchestrator::Args::command()),
    ];
    let mut table = String::from("| binary | flag | env | default |\n|---|---|---|---|\n");
    let mut row = |binary: &str, arg: &clap::Arg| {
        let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) else {
            return;
        };
        let default: Vec<_> = arg
            .get_default_values()
            .iter()
            .filter(|v| !v.is_empty())
            .map(|v| format!("`{}`", v.to_string_lossy()))
            .collect();
        let default = if default.is_empty() {
            "—".to_owned()
        } else {
            default.join(", ")
        };
        let env = env.to_string_lossy();
        table.push_str(&format!(
            "| {binary} | `--{long}` | `{env}` | {default} |\n"
        ));
    };
    for arg in binaries[0].1.get_arguments() {
        if arg
            .get_env()
            .is_some_and(|e| SHARED.iter().any(|s| e == *s))
        {
            row("every service", arg);
        }
    }
    for (binary, command) in &binaries {
        for arg in command.get_arguments() {
            if !arg
                .get_env()
                .is_some_and(|e| SHARED.iter().any(|s| e == *s))
            {
                row(binary, arg);
            }
        }
    }
    let docs = include_str!("../docs/operations.md");
    assert!(
        docs.contains(&table),
        "docs/operations.md (\"Settings\") must hold this table:\n{table}"
    );
}
