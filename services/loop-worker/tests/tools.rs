//! External tool calls over a real nats-server.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_loop_worker::ports::ToolContext;
use cyrene_loop_worker::ports::ToolOutput;
use cyrene_loop_worker::tools::Tools;
use cyrene_protocol::message::ToolCall;
use cyrene_test_support::NatsServer;
use cyrene_test_support::micro::{add_tool, start_service};
use futures::StreamExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

fn context(allowed: Option<&[&str]>) -> ToolContext {
    ToolContext {
        agent_id: "cyrene".into(),
        session_id: "s".into(),
        turn_id: "t".into(),
        allowed: allowed.map(|a| a.iter().map(|s| (*s).to_owned()).collect()),
        ask_chain: Vec::new(),
    }
}

fn call(name: &str, id: &str) -> ToolCall {
    ToolCall {
        id: id.into(),
        name: name.into(),
        args: Default::default(),
        args_error: None,
    }
}

/// `tools` calls `name` (call id `id`) for a turn allowed `allowed` (None: every tool).
async fn call_with(tools: &Tools, allowed: Option<&[&str]>, name: &str, id: &str) -> ToolOutput {
    tools.call(&context(allowed), &call(name, id)).await
}

/// Serves `cyrene.tool.<name>` as a discoverable micro endpoint; counts the requests.
async fn serve_tool(client: &async_nats::Client, name: &str) -> Arc<AtomicUsize> {
    let service = start_service(client, "test-tools", "0.0.0").await;
    let mut endpoint = add_tool(&service, name, "a test tool", r#"{"type":"object"}"#).await;
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        let _service = service;
        while let Some(request) = endpoint.next().await {
            count.fetch_add(1, Ordering::SeqCst);
            let _ = request
                .respond(Ok(r#"{"text":"ran","is_error":false}"#.into()))
                .await;
        }
    });
    client.flush().await.unwrap();
    served
}

/// Answers `cyrene.tool.<name>` without announcing it as a tool (plain subscription).
async fn undiscoverable_tool(client: &async_nats::Client, name: &str) -> Arc<AtomicUsize> {
    let mut sub = client
        .subscribe(format!("cyrene.tool.{name}"))
        .await
        .unwrap();
    let served = Arc::new(AtomicUsize::new(0));
    let (count, client2) = (served.clone(), client.clone());
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            count.fetch_add(1, Ordering::SeqCst);
            if let Some(reply) = m.reply {
                let _ = client2
                    .publish(reply, r#"{"text":"leaked","is_error":false}"#.into())
                    .await;
            }
        }
    });
    client.flush().await.unwrap();
    served
}

#[tokio::test]
async fn a_tool_call_id_that_cannot_be_a_header_is_an_error_result_not_a_panic() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let served = serve_tool(&client, "lookup").await;
    let tools = Tools::new(client, Duration::from_secs(1), Duration::from_secs(1));
    assert_eq!(tools.discover(Duration::from_millis(500)).await, 1);
    // The model's id goes into `Cyrene-Tool-Call-Id`: a line break would panic async-nats.
    for id in ["a\r\nInjected: yes", "\n", "a\rb"] {
        let out = call_with(&tools, None, "lookup", id).await;
        assert!(out.is_error, "{id:?}");
        assert!(out.text.contains("was not called"), "{id:?}: {}", out.text);
    }
    assert_eq!(served.load(Ordering::SeqCst), 0);
    // Any other id is sent.
    let out = call_with(&tools, None, "lookup", "昔涟 \u{7f}").await;
    assert_eq!(served.load(Ordering::SeqCst), 1);
    assert!(!out.is_error, "{}", out.text);
}

#[tokio::test]
async fn only_discovered_and_allowed_tools_are_called() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let lookup = serve_tool(&client, "lookup").await;
    let hidden = undiscoverable_tool(&client, "hidden").await;
    let tools = Tools::new(
        client.clone(),
        Duration::from_secs(1),
        Duration::from_secs(1),
    );
    tools.discover(Duration::from_millis(500)).await;

    // Not discovered (no tool metadata): refused, nothing sent, although someone answers.
    let out = call_with(&tools, None, "hidden", "c1").await;
    assert!(out.is_error);
    assert!(out.text.contains("not available"), "{}", out.text);
    assert_eq!(
        hidden.load(Ordering::SeqCst),
        0,
        "an undiscovered tool was called"
    );

    // Discovered but outside the allow-list: refused, nothing sent; same for a built-in.
    let only_time = context(Some(&["current_time"]));
    let out = tools.call(&only_time, &call("lookup", "c2")).await;
    assert!(out.is_error);
    assert!(out.text.contains("not allowed"), "{}", out.text);
    assert_eq!(
        lookup.load(Ordering::SeqCst),
        0,
        "a tool outside the list was called"
    );
    let out = call_with(&tools, Some(&[]), "current_time", "c3").await;
    assert!(
        out.is_error && out.text.contains("not allowed"),
        "{}",
        out.text
    );
    assert!(
        !tools
            .call(&only_time, &call("current_time", "c4"))
            .await
            .is_error
    );

    // The offered specs follow the same list.
    let names = |allowed: Option<&[String]>| -> Vec<String> {
        tools.specs(allowed).into_iter().map(|s| s.name).collect()
    };
    assert_eq!(names(Some(&["lookup".to_owned()])), ["lookup"]);
    assert!(names(None).contains(&"lookup".to_owned()));
    assert!(!names(None).contains(&"hidden".to_owned()));

    // Allowed and discovered: called.
    let out = call_with(&tools, Some(&["lookup"]), "lookup", "c5").await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(lookup.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_tool_registered_after_the_last_discovery_is_found_on_its_first_call() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let tools = Tools::new(
        client.clone(),
        Duration::from_secs(1),
        Duration::from_secs(1),
    );
    assert_eq!(tools.discover(Duration::from_millis(200)).await, 0);
    let late = serve_tool(&client, "late").await;
    let out = call_with(&tools, None, "late", "c1").await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(late.load(Ordering::SeqCst), 1);
}

/// An agent that answers "ok" and keeps every ask it was handed.
#[derive(Default)]
struct Recorder(std::sync::Mutex<Vec<cyrene_protocol::comm::Ask>>);

impl cyrene_comm::Handler for Recorder {
    async fn on_ask(
        &self,
        ask: cyrene_protocol::comm::Ask,
    ) -> Result<cyrene_comm::Answer, cyrene_protocol::ErrorBody> {
        self.0.lock().unwrap().push(ask);
        Ok(cyrene_comm::Answer::text("ok"))
    }
}

#[tokio::test]
async fn ask_agent_sends_the_turns_chain_and_data_and_a_cycle_is_an_error_result() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let hoshi = Arc::new(Recorder::default());
    let _agent = cyrene_comm::Probe::new(client.clone(), "hoshi")
        .serve(hoshi.clone())
        .await
        .unwrap();
    let tools = Tools::new(client, Duration::from_secs(1), Duration::from_secs(5));
    let ask = |data: serde_json::Value| ToolCall {
        id: "c1".into(),
        name: "ask_agent".into(),
        args: serde_json::json!({"agent":"hoshi","question":"which tea?","data":data})
            .as_object()
            .unwrap()
            .clone(),
        args_error: None,
    };

    // cyrene answers an ask of alice's: its chain is [cyrene]; hoshi is not in it.
    let mut answering = context(None);
    answering.ask_chain = vec!["cyrene".into()];
    let out = tools
        .call(&answering, &ask(serde_json::json!({"cups": 2})))
        .await;
    assert!(!out.is_error, "{}", out.text);
    assert_eq!(out.text, "ok");
    {
        let seen = hoshi.0.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].chain, ["cyrene"]);
        assert_eq!(seen[0].data, serde_json::json!({"cups": 2}));
    }

    // cyrene answers an ask of hoshi's: asking hoshi back is a cycle, an error result at once.
    answering.ask_chain = vec!["hoshi".into(), "cyrene".into()];
    let started = std::time::Instant::now();
    let out = tools.call(&answering, &ask(serde_json::Value::Null)).await;
    assert!(out.is_error);
    assert!(out.text.contains("cycle"), "{}", out.text);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(hoshi.0.lock().unwrap().len(), 1, "the handler never saw it");
}

/// A tool that declares `cyrene.tool.idempotent` and never answers: the call is sent, and its
/// output says no reply came (the runner then calls it again under its id, or reports its outcome
/// unknown); a micro error is an answer, not a lost reply.
#[tokio::test]
async fn a_reply_that_never_comes_is_marked_unanswered_and_a_tool_declares_its_idempotence() {
    use cyrene_loop_worker::ports::Idempotence;
    use cyrene_test_support::micro::add_tool_declaring;
    let server = NatsServer::start();
    let client = server.connect().await;
    let service = start_service(&client, "silent-tools", "0.0.0").await;
    // A tool with no parameters that declares `cyrene.tool.idempotent` = `idempotent`.
    async fn declaring(
        service: &async_nats::service::Service,
        name: &str,
        description: &str,
        idempotent: &str,
    ) -> async_nats::service::endpoint::Endpoint {
        let declared = [("cyrene.tool.idempotent", idempotent)];
        add_tool_declaring(
            service,
            name,
            description,
            r#"{"type":"object"}"#,
            &declared,
        )
        .await
    }
    let mut silent = declaring(&service, "silent", "never answers", "true").await;
    let mut failing = declaring(&service, "failing", "answers with an error", "false").await;
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    tokio::spawn(async move {
        let _service = service;
        loop {
            tokio::select! {
                Some(_request) = silent.next() => { count.fetch_add(1, Ordering::SeqCst); }
                Some(request) = failing.next() => {
                    let err = async_nats::service::error::Error {
                        status: "no such record".into(),
                        code: 404,
                    };
                    let _ = request.respond(Err(err)).await;
                }
                else => break,
            }
        }
    });
    client.flush().await.unwrap();
    let tools = Tools::new(client, Duration::from_millis(300), Duration::from_secs(1));
    assert_eq!(tools.discover(Duration::from_millis(500)).await, 2);
    assert_eq!(tools.idempotence("silent"), Idempotence::Idempotent);
    assert_eq!(tools.idempotence("failing"), Idempotence::NotIdempotent);
    assert_eq!(tools.idempotence("current_time"), Idempotence::ReadOnly);
    assert_eq!(tools.idempotence("ask_agent"), Idempotence::NotIdempotent);
    assert_eq!(tools.idempotence("never_seen"), Idempotence::NotIdempotent);

    let out = call_with(&tools, None, "silent", "c1").await;
    assert!(out.unanswered && out.is_error, "{out:?}");
    assert_eq!(served.load(Ordering::SeqCst), 1, "the request went out");
    let out = call_with(&tools, None, "failing", "c2").await;
    assert!(out.is_error && !out.unanswered, "{out:?}");
}
