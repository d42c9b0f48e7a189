//! The MCP bridge (`cyrene-mcp-bridge`, docs/tools.md) over a real nats-server with the official
//! MCP servers behind it: `mcp-server-time` (PyPI) over stdio and
//! `@modelcontextprotocol/server-everything` (npm) over stdio and streamable HTTP. The Makefile
//! installs both under `.tools` and passes their places as `CYRENE_MCP_TIME_PY` and
//! `CYRENE_MCP_EVERYTHING`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use cyrene_test_support::free_port;

use common::{Stack, eventually, job, service, worker_config};
use cyrene_protocol::turn::TurnOutcome;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where `mcp-server-time` is installed (a `pip --target` directory).
fn time_py() -> PathBuf {
    let path = std::env::var_os("CYRENE_MCP_TIME_PY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/py/mcp-server-time")
        });
    assert!(
        path.join("mcp_server_time").exists(),
        "mcp-server-time is not installed at {}: run `make test` (or scripts/py-tool.sh \
         mcp-server-time==2026.10.19 and set CYRENE_MCP_TIME_PY)",
        path.display()
    );
    path
}

/// The entry script of `@modelcontextprotocol/server-everything`.
fn everything_js() -> PathBuf {
    let path = std::env::var_os("CYRENE_MCP_EVERYTHING")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(
                ".tools/npm/node_modules/@modelcontextprotocol/server-everything/dist/index.js",
            )
        });
    assert!(
        path.exists(),
        "server-everything is not installed at {}: run `make test` (or `make mcp-servers`)",
        path.display()
    );
    path
}

/// The `time` server entry of an `mcpServers` file.
fn time_server() -> Value {
    json!({"command": "python3", "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"],
           "env": {"PYTHONPATH": time_py()}})
}

/// `everything` over stdio, started through `sh` so that its pid lands in `pidfile`.
fn everything_stdio(pidfile: &Path) -> Value {
    json!({"command": "sh", "args": ["-c",
        format!("echo $$ > {}; exec node {} stdio", pidfile.display(), everything_js().display())]})
}

/// A bridge process over `servers` (an `mcpServers` object) on `nats_url`.
fn bridge(nats_url: &str, dir: &Path, servers: Value) -> tokio::process::Child {
    let file = dir.join(format!("mcp-{}.json", cyrene_protocol::ids::new_id()));
    std::fs::write(&file, json!({"mcpServers": servers}).to_string()).unwrap();
    service(
        "cyrene-mcp-bridge",
        nats_url,
        &[
            ("CYRENE_MCP_BRIDGE_CONFIG", file.to_str().unwrap()),
            ("CYRENE_MCP_BRIDGE_CALL_TIMEOUT", "60s"),
        ],
    )
}

/// The `cyrene-mcp-bridge` micro service instances' `$SRV.INFO` answers.
async fn bridge_infos(client: &async_nats::Client) -> Vec<Value> {
    cyrene_bus::discovery::gather(
        client,
        cyrene_bus::discovery::Verb::Info,
        Some("cyrene-mcp-bridge"),
        Duration::from_millis(300),
        None,
    )
    .await
    .unwrap()
}

/// Waits until `n` bridge instances serve `endpoint`; returns its metadata.
async fn wait_for_endpoint(client: &async_nats::Client, endpoint: &str, n: usize) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    loop {
        let found: Vec<Value> = bridge_infos(client)
            .await
            .into_iter()
            .flat_map(|info| info["endpoints"].as_array().cloned().unwrap_or_default())
            .filter(|e| e["name"] == endpoint)
            .collect();
        if found.len() >= n {
            return found[0]["metadata"].clone();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} bridge(s) serve {endpoint}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Calls a bridged tool directly over NATS; the reply body.
async fn call(client: &async_nats::Client, tool: &str, args: Value) -> Value {
    let reply = tokio::time::timeout(
        Duration::from_secs(90),
        client.request(format!("cyrene.tool.{tool}"), args.to_string().into()),
    )
    .await
    .expect("the bridge answers")
    .unwrap();
    serde_json::from_slice(&reply.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_calling_an_mcp_tool_gets_the_real_result() {
    let rules = json!([{"contains": "time in Tokyo",
        "tool_calls": [{"name": "time__get_current_time", "args": {"timezone": "Asia/Tokyo"}}],
        "after_tools": "the clock says: {tool_results}"}]);
    let stack = Stack::start(rules, None).await;
    let _bridge = bridge(
        &stack.server.url(),
        stack.data.path(),
        json!({"time": time_server()}),
    );
    let meta = wait_for_endpoint(&stack.client, "time__get_current_time", 1).await;
    assert!(
        meta["cyrene.tool.description"]
            .as_str()
            .unwrap()
            .contains("time"),
        "{meta}"
    );
    let schema: Value =
        serde_json::from_str(meta["cyrene.tool.parameters"].as_str().unwrap()).unwrap();
    assert!(schema["properties"]["timezone"].is_object(), "{schema}");
    assert_eq!(
        meta["cyrene.tool.idempotent"], "true",
        "readOnlyHint maps to idempotent"
    );
    assert!(meta.get("cyrene.tool.approval").is_none(), "{meta}");

    stack.spawn_worker(worker_config()).await;
    stack
        .dispatch(&job("t1", "alice.s1", "what is the time in Tokyo?"))
        .await;
    let done = stack.orchestrator.wait_completed("t1").await;
    assert_eq!(done.outcome, TurnOutcome::Final, "{done:?}");
    let answer = done.message.map(|m| m.text_content()).unwrap_or_default();
    assert!(answer.contains("the clock says:"), "{answer}");
    assert!(
        answer.contains("Asia/Tokyo") && answer.contains("+09:00"),
        "the real server's result reached the model: {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn results_of_the_everything_server_over_streamable_http_keep_images_and_errors() {
    // A model that takes images, so the worker sends the tool's image as it is.
    let rules = json!({"vision": true, "rules": [{"contains": "tiny image",
        "tool_calls": [{"name": "everything__get-tiny-image", "args": {}}],
        "after_tools": "seen: {tool_results}"}]});
    let stack = Stack::start(rules, None).await;
    let port = free_port();
    let mut http = tokio::process::Command::new("node")
        .arg(everything_js())
        .arg("streamableHttp")
        .env("PORT", port.to_string())
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let _bridge = bridge(
        &stack.server.url(),
        stack.data.path(),
        json!({"everything": {"url": format!("http://127.0.0.1:{port}/mcp")}}),
    );
    wait_for_endpoint(&stack.client, "everything__get-tiny-image", 1).await;
    let image = call(&stack.client, "everything__get-tiny-image", json!({})).await;
    assert_eq!(image["is_error"], false, "{image}");
    let uri = image["images"][0].as_str().expect("an image part");
    assert!(uri.starts_with("data:image/png;base64,"), "{uri}");

    // In a turn, the image reaches the model: the tool's message carries it as an image part.
    let mut requests = stack
        .client
        .subscribe("cyrene.model.complete.>")
        .await
        .unwrap();
    stack.client.flush().await.unwrap();
    stack.spawn_worker(worker_config()).await;
    stack
        .dispatch(&job("t-img", "alice.s2", "show me the tiny image"))
        .await;
    let done = stack.orchestrator.wait_completed("t-img").await;
    assert_eq!(done.outcome, TurnOutcome::Final, "{done:?}");
    let mut tool_images = Vec::new();
    while let Ok(Some(request)) = tokio::time::timeout(
        Duration::from_millis(500),
        futures::StreamExt::next(&mut requests),
    )
    .await
    {
        let Ok(body) = serde_json::from_slice::<Value>(&request.payload) else {
            continue;
        };
        for message in body["messages"].as_array().into_iter().flatten() {
            if message["role"] == "tool" {
                for part in message["content"].as_array().into_iter().flatten() {
                    if part["type"] == "image_url" {
                        tool_images.push(part["image_url"].as_str().unwrap_or("").to_owned());
                    }
                }
            }
        }
    }
    assert_eq!(
        tool_images,
        [uri],
        "the model's view holds the tool's image"
    );
    let sum = call(
        &stack.client,
        "everything__get-sum",
        json!({"a": 2, "b": 40}),
    )
    .await;
    assert!(sum["text"].as_str().unwrap().contains("42"), "{sum}");
    // Wrong argument types are the server's to refuse: an error result, never a hang.
    let wrong = call(&stack.client, "everything__get-sum", json!({"a": "two"})).await;
    assert_eq!(wrong["is_error"], true, "{wrong}");
    // Not an object: refused by the bridge with a micro error.
    let reply = stack
        .client
        .request("cyrene.tool.everything__get-sum", "[1,2]".into())
        .await
        .unwrap();
    let status = reply
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Service-Error-Code"));
    assert!(status.is_some(), "a micro error");
    http.start_kill().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stdio_server_killed_mid_call_gives_an_error_result_and_is_started_again() {
    let stack = Stack::start(json!([]), None).await;
    let pidfile = stack.data.path().join("everything.pid");
    let _bridge = bridge(
        &stack.server.url(),
        stack.data.path(),
        json!({"everything": everything_stdio(&pidfile)}),
    );
    let tool = "everything__trigger-long-running-operation";
    wait_for_endpoint(&stack.client, tool, 1).await;
    let first_pid = std::fs::read_to_string(&pidfile).unwrap().trim().to_owned();

    // See the call on the bus, then kill the server under it.
    let mut seen = stack
        .client
        .subscribe(format!("cyrene.tool.{tool}"))
        .await
        .unwrap();
    stack.client.flush().await.unwrap();
    let client = stack.client.clone();
    let long =
        tokio::spawn(
            async move { call(&client, tool, json!({"duration": 60, "steps": 60})).await },
        );
    tokio::time::timeout(Duration::from_secs(30), futures::StreamExt::next(&mut seen))
        .await
        .unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-9", &first_pid])
        .status()
        .unwrap();
    assert!(killed.success());
    let reply = tokio::time::timeout(Duration::from_secs(30), long)
        .await
        .expect("the call answers at once, not after its 60 s")
        .unwrap();
    assert_eq!(reply["is_error"], true, "{reply}");
    assert!(
        reply["text"].as_str().unwrap().contains("stopped"),
        "{reply}"
    );

    // Started again: a new process, and calls work.
    let pidfile2 = pidfile.clone();
    eventually(
        "the server is started again",
        Duration::from_secs(60),
        || std::fs::read_to_string(&pidfile2).is_ok_and(|p| p.trim() != first_pid),
    )
    .await;
    wait_for_endpoint(&stack.client, "everything__echo", 1).await;
    let echo = call(
        &stack.client,
        "everything__echo",
        json!({"message": "again"}),
    )
    .await;
    assert_eq!(echo["is_error"], false, "{echo}");
    assert!(echo["text"].as_str().unwrap().contains("again"), "{echo}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bridge_replicas_one_sigkilled_under_calls_the_calls_go_on() {
    let stack = Stack::start(json!([]), None).await;
    let servers = json!({"time": time_server()});
    let mut first = bridge(&stack.server.url(), stack.data.path(), servers.clone());
    let _second = bridge(&stack.server.url(), stack.data.path(), servers);
    let tool = "time__get_current_time";
    wait_for_endpoint(&stack.client, tool, 2).await;

    // Both replicas take calls (one queue group).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let r = call(&stack.client, tool, json!({"timezone": "UTC"})).await;
        assert_eq!(r["is_error"], false, "{r}");
        let served: Vec<u64> = cyrene_bus::discovery::gather(
            &stack.client,
            cyrene_bus::discovery::Verb::Stats,
            Some("cyrene-mcp-bridge"),
            Duration::from_millis(300),
            None,
        )
        .await
        .unwrap()
        .iter()
        .map(|s| {
            s["endpoints"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["num_requests"].as_u64().unwrap_or(0))
                .sum()
        })
        .collect();
        if served.len() == 2 && served.iter().all(|n| *n > 0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{served:?}");
    }

    // Calls in flight while one replica is SIGKILLed.
    let client = stack.client.clone();
    let load = tokio::spawn(async move {
        let mut answered = 0;
        for _ in 0..200 {
            let r = client
                .request(
                    format!("cyrene.tool.{tool}"),
                    r#"{"timezone":"UTC"}"#.into(),
                )
                .await;
            if r.is_ok() {
                answered += 1;
            }
        }
        answered
    });
    first.start_kill().unwrap(); // SIGKILL
    first.wait().await.unwrap();
    // The process is dead, but the server drops its subscription only once it has read the
    // closed connection: a request in that gap goes to the dead replica and is never answered
    // (the bounded wait above is the caller's). Gone means gone from the server's view.
    let subject = format!("cyrene.tool.{tool}");
    let subscribed = || {
        let connections = stack.server.subscriptions();
        connections
            .iter()
            .filter(|subs| subs.contains(&subject))
            .count()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while subscribed() != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the server still routes {subject} to {} connections",
            subscribed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // After the replica is gone, every call is answered by the other one.
    for i in 0..20 {
        let r = call(&stack.client, tool, json!({"timezone": "Europe/Paris"})).await;
        assert_eq!(r["is_error"], false, "call {i} after the kill: {r}");
        assert!(r["text"].as_str().unwrap().contains("Europe/Paris"), "{r}");
    }
    let answered = load.await.unwrap();
    assert!(
        answered >= 190,
        "calls went on through the kill: {answered}/200"
    );
}

/// Where the official MCP Python SDK (`mcp` from PyPI) is installed.
fn mcp_py() -> PathBuf {
    let path = std::env::var_os("CYRENE_MCP_PY")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/py/mcp"));
    assert!(
        path.join("mcp").exists(),
        "the mcp SDK is not installed at {}: run `make test` (or scripts/py-tool.sh mcp==2.3.0 \
         and set CYRENE_MCP_PY)",
        path.display()
    );
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_official_python_sdk_lists_asks_and_reads_through_cyrene_mcp() {
    let server = cyrene_test_support::NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let _up = common::cyrene_up(&server.url(), data.path());
    common::wait_for_the_four_services(&server.connect().await).await;
    let stdio = python_report(
        &server.url(),
        &[env!("CARGO_BIN_EXE_cyrene"), "--person", "alice", "mcp"],
    )
    .await;
    check_report(&stdio);

    // The same over streamable HTTP, with its key; without the key, 401 before MCP.
    let port = free_port();
    let key = "a-key-of-sixteen-or-more";
    let _http = tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["--person", "alice", "mcp", "--http"])
        .arg(format!("127.0.0.1:{port}"))
        .env("CYRENE_MCP_KEY", key)
        .env("NATS_URL", server.url())
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/mcp");
    let http = cyrene_model_gateway::http_client().unwrap();
    let refused = loop {
        match http.post(&url).body("{}").send().await {
            Ok(response) => break response,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert_eq!(refused.status(), 401);
    let wrong = http
        .post(&url)
        .header("Authorization", "Bearer not-the-key-at-all")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    check_report(&python_report(&server.url(), &["--http", &url, key]).await);
}

/// Runs tests/mcp/client.py with `args` until ask_cyrene is answered (the personas register just
/// after the orchestrator's endpoints answer: a refused ask is an error result, asked again);
/// its report.
async fn python_report(nats_url: &str, args: &[&str]) -> Value {
    let client = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp/client.py");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        let mut child = tokio::process::Command::new("python3")
            .arg(client)
            .args(args)
            .env("PYTHONPATH", mcp_py())
            .env("NATS_URL", nats_url)
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        use tokio::io::AsyncWriteExt;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"what is the weather like?\n")
            .await
            .unwrap();
        drop(stdin);
        let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output())
            .await
            .expect("the MCP client finishes")
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "the python client failed: {stdout}");
        let report: Value = serde_json::from_str(stdout.trim()).unwrap();
        if report["answer_is_error"] == false {
            return report;
        }
        assert!(tokio::time::Instant::now() < deadline, "{report}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What the client saw: the one ask tool, a real turn's answer, a wrong argument refused, and
/// alice's own session readable as a resource.
fn check_report(report: &Value) {
    assert_eq!(report["tools"], json!(["ask_cyrene"]), "{report}");
    let answer = report["answer"][0].as_str().unwrap();
    assert!(
        answer.contains("offline scripted reply"),
        "a real turn answered: {report}"
    );
    assert_eq!(
        report["wrong_is_error"], true,
        "a question that is not a string: {report}"
    );
    // The ask ran in alice's own session, which is now hers to read.
    let resources = report["resources"].as_array().unwrap();
    assert!(
        !resources.is_empty()
            && resources
                .iter()
                .all(|r| r.as_str().unwrap().starts_with("cyrene://session/alice.")),
        "{report}"
    );
    assert!(
        report["transcript"]
            .as_str()
            .unwrap()
            .contains("offline scripted reply"),
        "{report}"
    );
}
