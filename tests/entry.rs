//! One entry shape for every binary: a bad configuration exits 2 and lists every problem at once,
//! and `cyrene up` starts each service from its own `Args`, so every service env var works there.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use cyrene_test_support::free_port;

use common::workspace_binary;
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_protocol::{ErrorCode, subjects};
use cyrene_test_support::NatsServer;
use serde_json::json;
use std::collections::BTreeMap;
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
type Case = (String, Vec<String>, BTreeMap<String, String>, Vec<String>);

#[tokio::test]
async fn every_binary_exits_2_on_a_bad_configuration_and_lists_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    // One row per binary, in `json!` so that rustfmt leaves the table compact.
    let mysql = json!({"DATABASE_URL": "mysql://db/x"});
    let cases: [Case; 6] = serde_json::from_value(json!([
        ["cyrene-model-gateway", ["--max-in-flight", "0", "--models", "/nonexistent/models.json"],
            {}, ["max_in_flight must be at least 1", "/nonexistent/models.json"]],
        ["cyrene-checkpoint-store",
            ["--max-state-bytes", "0", "--max-connections", "0", "--data-dir", data], mysql,
            ["max_state_bytes must be at least 1", "max_connections must be at least 1",
             "\"mysql\" is not supported"]],
        ["cyrene-orchestrator",
            ["--max-steps", "0", "--parallel-sessions", "not.an.id", "--data-dir", data], mysql,
            ["max_steps must be at least 1", "parallel_sessions", "\"mysql\" is not supported"]],
        ["cyrene-loop-worker", ["--concurrency", "0", "--ack-wait", "10ms"],
            {"CYRENE_WORKER_MAX_DELIVER": "0"},
            ["concurrency must be at least 1", "max_deliver must be at least 1",
             "ack_wait must be at least 200ms"]],
        ["cyrene-matrix-bridge", ["--homeserver", "matrix.example.org", "--owner", "alice"],
            {"CYRENE_MATRIX_BRIDGE_OWNER_PERSON": "alice"},
            ["CYRENE_MATRIX_BRIDGE_USER is required", "is not an http(s) URL",
             "password or an access token"]],
        ["cyrene-mcp-bridge", ["--call-timeout", "0s"], {},
            ["CYRENE_MCP_BRIDGE_CONFIG is required", "call_timeout must be longer than zero"]]
    ]))
    .unwrap();
    for (binary, args, envs, problems) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let (code, stderr) = run_binary(workspace_binary(&binary), &args, &envs).await;
        assert_eq!(code, 2, "{binary}: {stderr}");
        assert!(
            stderr.contains("invalid configuration"),
            "{binary}: {stderr}"
        );
        for problem in &problems {
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
        (
            "cyrene-matrix-bridge",
            cyrene_matrix_bridge::Args::command(),
        ),
        ("cyrene-mcp-bridge", cyrene_mcp_bridge::Args::command()),
    ];
    let mut table = String::from("| binary | flag | env | default |\n|---|---|---|---|\n");
    let mut row = |binary: &str, arg: &clap::Arg| {
        let id = arg.get_id().as_str();
        if matches!(id, "help" | "version") {
            return;
        }
        // Every setting is a flag with an env var (docs/operations.md, "Settings").
        let (Some(long), Some(env)) = (arg.get_long(), arg.get_env()) else {
            panic!("{binary}: setting {id:?} must have both a --flag and an env var");
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

/// An unparsable `NATS_URL` is a bad setting like any other: exit 2 before any connection, the
/// URL named (its password hidden). It used to exit 1, as a failure to connect.
#[tokio::test]
async fn an_unparsable_nats_url_exits_2_and_is_named_without_its_password() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    for binary in [
        "cyrene-model-gateway",
        "cyrene-checkpoint-store",
        "cyrene-orchestrator",
        "cyrene-loop-worker",
        "cyrene-matrix-bridge",
        "cyrene-mcp-bridge",
    ] {
        for url in ["http://127.0.0.1:4222", "nats://gw:s3cret@[::1"] {
            let (code, stderr) = run_binary(
                workspace_binary(binary),
                &[],
                &[
                    ("NATS_URL", url),
                    ("CYRENE_STORE_DATA_DIR", data),
                    ("CYRENE_ORCHESTRATOR_DATA_DIR", data),
                ],
            )
            .await;
            assert_eq!(code, 2, "{binary} {url}: {stderr}");
            assert!(
                stderr.contains("invalid configuration") && stderr.contains("NATS_URL"),
                "{binary} {url}: {stderr}"
            );
            assert!(!stderr.contains("s3cret"), "{binary}: {stderr}");
        }
    }
    // The CLI too: a usage problem (2), not a failure to connect (1).
    let out = Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["probe"])
        .env("NATS_URL", "http://127.0.0.1:4222")
        .env("RUST_LOG", "off")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("NATS_URL"), "{stderr}");
}

/// Every field of every service's `Config` is set by a flag (each flag given a value other than
/// its default, each field checked): a field added without a flag does not compile here (the
/// destructuring names every field), and one whose flag is not wired fails.
#[test]
fn every_setting_of_every_service_is_a_flag() {
    use clap::Parser;
    use cyrene_runtime::entry::ServiceArgs;
    let s = Duration::from_secs;
    let dir = tempfile::tempdir().unwrap();

    let cyrene_loop_worker::Config {
        concurrency,
        consumer,
        ack_wait,
        max_deliver,
        poison_after,
        retry_delay,
        model_timeout,
        checkpoint_timeout,
        steer_timeout,
        tool_timeout,
        ask_timeout,
        tool_refresh,
        shutdown_grace,
        turns_replicas,
    } = cyrene_loop_worker::Args::try_parse_from([
        "cyrene-loop-worker",
        "--concurrency=3",
        "--consumer=w-2",
        "--ack-wait=2s",
        "--max-deliver=4",
        "--poison-after=5",
        "--retry-delay=5s",
        "--model-timeout=6s",
        "--checkpoint-timeout=7s",
        "--steer-timeout=8s",
        "--tool-timeout=9s",
        "--ask-timeout=11s",
        "--tool-refresh=12s",
        "--shutdown-grace=13s",
        "--turns-replicas=3",
    ])
    .unwrap()
    .into_config()
    .unwrap();
    assert_eq!(
        (
            concurrency,
            consumer.as_str(),
            max_deliver,
            poison_after,
            turns_replicas
        ),
        (3, "w-2", 4, 5, 3)
    );
    assert_eq!(
        [
            ack_wait,
            retry_delay,
            model_timeout,
            checkpoint_timeout,
            steer_timeout,
            tool_timeout,
            ask_timeout,
            tool_refresh,
            shutdown_grace
        ],
        [s(2), s(5), s(6), s(7), s(8), s(9), s(11), s(12), s(13)]
    );

    let personas = dir.path().join("personas.json");
    std::fs::write(
        &personas,
        r#"{"default":"zed","personas":[{"id":"zed","name":"Zed","instructions":"Be brief."}]}"#,
    )
    .unwrap();
    let cyrene_orchestrator::Config {
        database_url,
        data_dir,
        personas,
        window,
        max_steps,
        busy,
        max_message_bytes,
        max_job_bytes,
        max_document_bytes,
        document_store_bytes,
        document_owner_bytes,
        upload_ttl,
        ask_timeout,
        serve_agents,
        ask_concurrency,
        ask_queue_bytes,
        sweep_interval,
        dispatch_grace,
        db_timeout,
        pool,
        max_in_flight,
        turns_replicas,
        owner,
        people,
        memory_retry_delay,
        memory_max_deliver,
    } = cyrene_orchestrator::Args::try_parse_from([
        "cyrene-orchestrator",
        "--database-url=sqlite://o.db",
        "--data-dir=/o",
        &format!("--personas={}", personas.display()),
        "--window=7",
        "--max-steps=8",
        "--parallel-sessions=ps",
        "--parallel-clients=pc",
        "--enqueue-sessions=es",
        "--enqueue-clients=ec",
        "--reject-sessions=rs",
        "--reject-clients=rc",
        "--max-message-bytes=100",
        "--max-job-bytes=200",
        "--max-document-bytes=300",
        "--document-store-bytes=500",
        "--document-owner-bytes=400",
        "--upload-ttl=9s",
        "--ask-concurrency=2",
        "--ask-queue-bytes=1000",
        "--ask-timeout=4s",
        "--no-agents",
        "--sweep-interval=5s",
        "--dispatch-grace=6s",
        "--db-timeout=7s",
        "--acquire-timeout=8s",
        "--max-connections=9",
        "--max-in-flight=10",
        "--turns-replicas=3",
        "--owner=alice",
        "--people=bob, carol",
        "--memory-retry-delay=3s",
        "--memory-max-deliver=4",
    ])
    .unwrap()
    .into_config()
    .unwrap();
    assert_eq!(people, ["bob", "carol"]);
    assert_eq!(
        (memory_retry_delay, memory_max_deliver),
        (Duration::from_secs(3), 4)
    );
    assert_eq!(database_url.as_deref(), Some("sqlite://o.db"));
    assert_eq!(data_dir, std::path::PathBuf::from("/o"));
    assert_eq!(personas.default, "zed");
    let lists = |l: &cyrene_orchestrator::PolicyLists| {
        [l.parallel.clone(), l.enqueue.clone(), l.reject.clone()].concat()
    };
    assert_eq!(lists(&busy.sessions), ["ps", "es", "rs"]);
    assert_eq!(lists(&busy.clients), ["pc", "ec", "rc"]);
    assert_eq!(
        (window, max_steps, max_message_bytes, max_job_bytes),
        (7, 8, 100, 200)
    );
    assert_eq!(
        (
            max_document_bytes,
            serve_agents,
            max_in_flight,
            turns_replicas
        ),
        (300, false, 10, 3)
    );
    assert_eq!(
        [
            ask_timeout,
            sweep_interval,
            dispatch_grace,
            db_timeout,
            upload_ttl
        ],
        [s(4), s(5), s(6), s(7), s(9)]
    );
    assert_eq!(
        (
            document_store_bytes,
            document_owner_bytes,
            ask_concurrency,
            ask_queue_bytes
        ),
        (500, 400, 2, 1000)
    );
    assert_eq!((pool.max_connections, pool.acquire_timeout), (9, s(8)));
    assert_eq!(owner.as_deref(), Some("alice"));

    let cyrene_checkpoint_store::Config {
        database_url,
        data_dir,
        max_state_bytes,
        db_timeout,
        pool,
        max_in_flight,
    } = cyrene_checkpoint_store::Args::try_parse_from([
        "cyrene-checkpoint-store",
        "--database-url=sqlite://c.db",
        "--data-dir=/c",
        "--max-state-bytes=100",
        "--db-timeout=2s",
        "--acquire-timeout=3s",
        "--max-connections=4",
        "--max-in-flight=5",
    ])
    .unwrap()
    .into_config()
    .unwrap();
    assert_eq!(database_url.as_deref(), Some("sqlite://c.db"));
    assert_eq!(data_dir, std::path::PathBuf::from("/c"));
    assert_eq!((max_state_bytes, db_timeout, max_in_flight), (100, s(2), 5));
    assert_eq!((pool.max_connections, pool.acquire_timeout), (4, s(3)));

    // A model config file: the offline demo's (`cyrene up`).
    let dir = tempfile::tempdir().unwrap();
    let models = dir.path().join("models.json");
    let demo = cyrene::stack::demo::models().unwrap();
    std::fs::write(&models, serde_json::to_vec(&demo).unwrap()).unwrap();
    let models = models.display().to_string();
    let cyrene_model_gateway::Config {
        models: read,
        // API keys: read from the variables the model config names (`api_key_env`), not settings.
        secrets: _,
        serve,
        http,
    } = cyrene_model_gateway::Args::try_parse_from([
        "cyrene-model-gateway",
        &format!("--models={models}"),
        "--max-in-flight=7",
        "--http-addr=127.0.0.1:8088",
        "--http-keys=k1,k2",
        "--http-max-connections=16",
        "--http-header-timeout=3s",
        "--http-body-timeout=4s",
        "--http-max-requests=8",
        "--http-body-budget=100000000",
    ])
    .unwrap()
    .into_config()
    .unwrap();
    let want = cyrene_model_gateway::config::ModelsConfig::from_file(std::path::Path::new(&models))
        .unwrap();
    assert_eq!(format!("{read:?}"), format!("{want:?}"));
    assert_eq!(serve.max_in_flight, 7);
    let cyrene_model_gateway::http::HttpConfig { addr, keys, limits } = http.unwrap();
    assert_eq!(addr, "127.0.0.1:8088".parse().unwrap());
    assert!(!keys.is_empty());
    let cyrene_model_gateway::http::HttpLimits {
        max_connections,
        header_timeout,
        body_timeout,
        max_requests,
        body_budget,
    } = limits;
    assert_eq!(
        (max_connections, max_requests, body_budget),
        (16, 8, 100_000_000)
    );
    assert_eq!([header_timeout, body_timeout], [s(3), s(4)]);

    let cyrene_matrix_bridge::Config {
        homeserver,
        user,
        password,
        access_token,
        owner,
        owner_person,
        data_dir,
        join,
        group_answers,
        sync_timeout,
        max_image_bytes,
        max_file_bytes,
        request_timeout,
    } = cyrene_matrix_bridge::Args::try_parse_from([
        "cyrene-matrix-bridge",
        "--homeserver=https://m.example.org",
        "--user=@cyrene:example.org",
        "--password=pw",
        "--owner=@alice:example.org",
        "--owner-person=alice",
        "--data-dir=/m",
        "--join=any",
        "--group-answers=all",
        "--sync-timeout=4s",
        "--max-image-bytes=1000",
        "--max-file-bytes=2000",
        "--request-timeout=5s",
    ])
    .unwrap()
    .into_config()
    .unwrap();
    assert_eq!(
        (
            homeserver.as_str(),
            user.as_str(),
            owner.as_str(),
            owner_person.as_str()
        ),
        (
            "https://m.example.org",
            "@cyrene:example.org",
            "@alice:example.org",
            "alice"
        )
    );
    assert_eq!(
        password.map(|p| p.expose().to_owned()).as_deref(),
        Some("pw")
    );
    assert!(access_token.is_none(), "the other of the two");
    assert_eq!(data_dir, std::path::PathBuf::from("/m"));
    assert_eq!(
        (join, group_answers, max_image_bytes, max_file_bytes),
        (
            cyrene_matrix_bridge::JoinPolicy::Any,
            cyrene_matrix_bridge::GroupAnswers::All,
            1000,
            2000
        )
    );
    assert_eq!([sync_timeout, request_timeout], [s(4), s(5)]);

    let servers_file = dir.path().join("mcp.json");
    std::fs::write(
        &servers_file,
        r#"{"mcpServers": {"time": {"command": "mcp-server-time"}}}"#,
    )
    .unwrap();
    let cyrene_mcp_bridge::Config {
        servers,
        call_timeout,
        restart_max,
        connect_timeout,
    } = cyrene_mcp_bridge::Args::try_parse_from([
        "cyrene-mcp-bridge",
        &format!("--config={}", servers_file.display()),
        "--call-timeout=6s",
        "--restart-max=7s",
        "--connect-timeout=8s",
    ])
    .unwrap()
    .into_config()
    .unwrap();
    assert_eq!(servers.servers.keys().collect::<Vec<_>>(), ["time"]);
    assert_eq!(
        [call_timeout, restart_max, connect_timeout],
        [s(6), s(7), s(8)]
    );
}

/// Issue 29, item 6: every binary pointed at a bus it cannot reach (a closed port) stops at once
/// on SIGTERM or SIGINT, with exit code 0 — not after a request timeout, not with 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_binary_that_cannot_reach_nats_stops_at_once_with_0_on_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let closed = format!("nats://127.0.0.1:{}", free_port());
    let mut running = Vec::new();
    for (i, binary) in [
        "cyrene-loop-worker",
        "cyrene-orchestrator",
        "cyrene-checkpoint-store",
        "cyrene-model-gateway",
    ]
    .into_iter()
    .enumerate()
    {
        let health = format!("127.0.0.1:{}", free_port());
        let child = Command::new(workspace_binary(binary))
            .env("NATS_URL", &closed)
            .env("CYRENE_HEALTH_ADDR", &health)
            .env("CYRENE_STORE_DATA_DIR", data)
            .env("CYRENE_ORCHESTRATOR_DATA_DIR", data)
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // Up (its signal handler is installed before the health listener) and trying the bus.
        tokio::time::timeout(Duration::from_secs(20), async {
            while tokio::net::TcpStream::connect(&health).await.is_err() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{binary} serves its health endpoint"));
        tokio::time::sleep(Duration::from_millis(300)).await; // well into its start-up
        let signal = if i % 2 == 0 { "-TERM" } else { "-INT" };
        let pid = child.id().unwrap().to_string();
        let sent = std::process::Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap();
        assert!(sent.success());
        running.push((binary, signal, child));
    }
    for (binary, signal, child) in running {
        let out = tokio::time::timeout(Duration::from_secs(10), child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{binary} still running 10 s after {signal}"))
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{binary} after {signal}: {stderr}"
        );
    }
}
