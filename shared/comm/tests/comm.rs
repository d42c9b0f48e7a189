//! The comm protocol over a real nats-server (one per test).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_comm::{AgentHandle, Answer, AskError, AskOptions, Handler, Probe};
use cyrene_protocol::comm::{Ask, Event, Reply};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_test_support::NatsServer;
use futures::StreamExt;
use serde_json::json;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Answers every ask with its own question; counts what it saw.
#[derive(Default)]
struct Echo {
    asks: AtomicUsize,
    events: tokio::sync::Mutex<Vec<Event>>,
    event_seen: Notify,
}

impl Handler for Echo {
    async fn on_ask(&self, ask: Ask) -> Result<Answer, ErrorBody> {
        self.asks.fetch_add(1, Ordering::SeqCst);
        if ask.question == "fail" {
            return Err(ErrorBody::new(ErrorCode::NotFound, "nothing about that"));
        }
        Ok(Answer {
            text: ask.question,
            data: json!({"from": ask.from}),
        })
    }

    async fn on_event(&self, event: Event) {
        self.events.lock().await.push(event);
        self.event_seen.notify_waiters();
    }
}

/// `id`'s agent on `client`, handled by `handler`.
async fn serving<H: Handler>(
    client: &async_nats::Client,
    id: &str,
    handler: Arc<H>,
) -> AgentHandle {
    Probe::new(client.clone(), id).serve(handler).await.unwrap()
}

/// A server, a client of it, and on that client agent `b` answering with [`Echo`].
async fn echo_agent_b() -> (NatsServer, async_nats::Client, Arc<Echo>, AgentHandle) {
    let server = NatsServer::start();
    let client = server.connect().await;
    let echo = Arc::new(Echo::default());
    let agent = serving(&client, "b", echo.clone()).await;
    (server, client, echo, agent)
}

/// A plain NATS request of `body` on `subject`, not through a probe.
async fn raw_request(
    client: &async_nats::Client,
    subject: &str,
    body: &serde_json::Value,
) -> async_nats::Message {
    let payload = serde_json::to_vec(body).unwrap().into();
    client.request(subject.to_owned(), payload).await.unwrap()
}

/// `asker` asks `to` the `question`, waiting at most `timeout`.
async fn ask_within(
    asker: &Probe,
    to: &str,
    question: &str,
    timeout: Duration,
) -> Result<Reply, AskError> {
    let options = AskOptions {
        timeout: Some(timeout),
        ..Default::default()
    };
    asker.ask_with(to, question, options).await
}

/// Never answers.
struct Silent;

impl Handler for Silent {
    async fn on_ask(&self, _ask: Ask) -> Result<Answer, ErrorBody> {
        std::future::pending().await
    }
}

async fn wait_for_events(echo: &Echo, n: usize) -> Vec<Event> {
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let notified = echo.event_seen.notified();
            {
                let events = echo.events.lock().await;
                if events.len() >= n {
                    return events.clone();
                }
            }
            notified.await;
        }
    })
    .await
    .expect("events arrive")
}

#[tokio::test]
async fn odd_ids_become_the_documented_subjects_on_the_wire() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let mut wire = client.subscribe("cyrene.agent.>").await.unwrap();
    client.flush().await.unwrap();

    let asker = Probe::new(client.clone(), "a.b*c");
    let answerer_id = "星 x>";
    let echo = Arc::new(Echo::default());
    let agent = Probe::new(client.clone(), answerer_id)
        .serve(echo.clone())
        .await
        .unwrap();

    let reply = asker.ask(answerer_id, "hello").await.unwrap();
    assert_eq!(reply.text, "hello");
    assert_eq!(reply.from, answerer_id);
    assert_eq!(reply.to, "a.b*c");
    asker
        .emit(answerer_id, "task.progress", json!({"pct": 5}))
        .await
        .unwrap();
    asker.broadcast("tool.used", json!(null)).await.unwrap();
    let events = wait_for_events(&echo, 2).await;
    assert!(
        events
            .iter()
            .any(|e| e.name == "task.progress" && e.data == json!({"pct": 5}))
    );

    let mut seen = Vec::new();
    while seen.len() < 4 {
        let m = tokio::time::timeout(Duration::from_secs(5), wire.next())
            .await
            .unwrap()
            .unwrap();
        seen.push(m.subject.to_string());
    }
    assert_eq!(seen[0], "cyrene.agent.a_b_c.__x_.ask");
    assert_eq!(
        seen[1],
        format!("cyrene.agent.__x_.a_b_c.reply.{}", reply.ask_id)
    );
    assert_eq!(seen[2], "cyrene.agent.a_b_c.__x_.event");
    assert_eq!(seen[3], "cyrene.agent.a_b_c.event");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_concurrent_asks_get_their_own_replies() {
    let (_server, client, echo, agent) = echo_agent_b().await;
    let asker = Probe::new(client, "a");

    let asks = (0..200).map(|i| {
        let asker = asker.clone();
        async move { (i, asker.ask("b", &format!("question {i}")).await) }
    });
    let results = futures::future::join_all(asks).await;
    let mut ask_ids = HashSet::new();
    for (i, result) in results {
        let reply: Reply = result.unwrap();
        assert_eq!(reply.text, format!("question {i}"));
        assert!(ask_ids.insert(reply.ask_id));
    }
    assert_eq!(echo.asks.load(Ordering::SeqCst), 200);
    agent.stop().await;
}

#[tokio::test]
async fn timeout_no_responders_and_cancellation_are_distinct() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let silent = serving(&client, "silent", Arc::new(Silent)).await;
    let asker = Probe::new(client, "a");

    let timeout = ask_within(&asker, "silent", "?", Duration::from_millis(200)).await;
    assert!(
        matches!(timeout, Err(AskError::Timeout { ref to, .. }) if to == "silent"),
        "{timeout:?}"
    );

    let nobody = asker.ask("nobody", "?").await;
    assert!(
        matches!(nobody, Err(AskError::NoReply { .. })),
        "{nobody:?}"
    );

    let cancel = CancellationToken::new();
    let ask = asker.ask_with(
        "silent",
        "?",
        AskOptions {
            cancel: Some(cancel.clone()),
            ..Default::default()
        },
    );
    let (result, ()) = tokio::join!(ask, async { cancel.cancel() });
    assert!(
        matches!(result, Err(AskError::Cancelled { .. })),
        "{result:?}"
    );
    silent.stop_within(Duration::ZERO).await;
}

#[tokio::test]
async fn handler_errors_come_back_as_the_error_envelope() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let agent = serving(&client, "b", Arc::new(Echo::default())).await;
    let err = Probe::new(client, "a").ask("b", "fail").await.unwrap_err();
    match err {
        AskError::Remote { error, .. } => {
            assert_eq!(error.code, ErrorCode::NotFound);
            assert_eq!(error.message, "nothing about that");
        }
        other => panic!("expected a remote error, got {other:?}"),
    }
    agent.stop().await;
}

/// Tracks how many calls overlap.
#[derive(Default)]
struct Overlap {
    asks_now: AtomicUsize,
    asks_max: AtomicUsize,
    events_now: AtomicUsize,
    events_max: AtomicUsize,
    all_events_in: Notify,
}

const EVENTS: usize = 4;

impl Handler for Overlap {
    async fn on_ask(&self, ask: Ask) -> Result<Answer, ErrorBody> {
        let now = self.asks_now.fetch_add(1, Ordering::SeqCst) + 1;
        self.asks_max.fetch_max(now, Ordering::SeqCst);
        // Give a second ask every chance to start while this one runs.
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.asks_now.fetch_sub(1, Ordering::SeqCst);
        Ok(Answer::text(ask.question))
    }

    async fn on_event(&self, _event: Event) {
        let now = self.events_now.fetch_add(1, Ordering::SeqCst) + 1;
        self.events_max.fetch_max(now, Ordering::SeqCst);
        if now == EVENTS {
            self.all_events_in.notify_waiters();
        }
        // Each event handler stays until all of them are running at once: this only finishes
        // if event handlers run concurrently.
        let wait = async {
            while self.events_now.load(Ordering::SeqCst) < EVENTS {
                let notified = self.all_events_in.notified();
                if self.events_now.load(Ordering::SeqCst) >= EVENTS {
                    break;
                }
                notified.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(10), wait).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asks_of_one_agent_never_overlap_while_events_do() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let overlap = Arc::new(Overlap::default());
    let agent = serving(&client, "b", overlap.clone()).await;
    let asker = Probe::new(client, "a");

    let asks = (0..20).map(|i| {
        let asker = asker.clone();
        async move { asker.ask("b", &i.to_string()).await }
    });
    for r in futures::future::join_all(asks).await {
        r.unwrap();
    }
    assert_eq!(overlap.asks_max.load(Ordering::SeqCst), 1);

    let all_in = overlap.all_events_in.notified();
    for i in 0..EVENTS {
        asker
            .emit("b", &format!("e{i}"), json!(null))
            .await
            .unwrap();
    }
    // Only reached when all EVENTS handlers were running at the same moment.
    tokio::time::timeout(Duration::from_secs(10), all_in)
        .await
        .expect("events overlap");
    agent.stop().await;
    assert_eq!(overlap.events_max.load(Ordering::SeqCst), EVENTS);
}

#[tokio::test]
async fn a_plain_request_with_an_inbox_reply_to_is_answered() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let agent = serving(&client, "b", Arc::new(Echo::default())).await;

    let ask = json!({"id":"q1","from":"cli","to":"b","question":"ping"});
    let message = raw_request(&client, "cyrene.agent.cli.b.ask", &ask).await;
    let reply: Reply = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(
        (
            reply.ask_id.as_str(),
            reply.from.as_str(),
            reply.to.as_str()
        ),
        ("q1", "b", "cli")
    );
    assert_eq!(reply.text, "ping");

    let bad = client
        .request("cyrene.agent.cli.b.ask", "{not json".into())
        .await
        .unwrap();
    let headers = bad.headers.expect("error headers");
    assert_eq!(
        headers.get("Nats-Service-Error-Code").map(|v| v.as_str()),
        Some("400")
    );
    let body: serde_json::Value = serde_json::from_slice(&bad.payload).unwrap();
    assert_eq!(body["error"]["code"], "bad_request");

    // The agent is still serving.
    let again = Probe::new(client, "a")
        .ask("b", "still there?")
        .await
        .unwrap();
    assert_eq!(again.text, "still there?");
    agent.stop().await;
}

#[tokio::test]
async fn replicas_of_one_agent_share_each_ask() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let (one, two) = (Arc::new(Echo::default()), Arc::new(Echo::default()));
    let r1 = serving(&client, "b", one.clone()).await;
    let r2 = serving(&client, "b", two.clone()).await;
    let asker = Probe::new(client, "a");
    for i in 0..40 {
        asker.ask("b", &i.to_string()).await.unwrap();
    }
    assert_eq!(
        one.asks.load(Ordering::SeqCst) + two.asks.load(Ordering::SeqCst),
        40
    );
    r1.stop().await;
    r2.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_keeps_working_after_the_server_restarts() {
    let mut server = NatsServer::start();
    let client = server.connect().await;
    let agent = serving(&client, "b", Arc::new(Echo::default())).await;
    let asker = Probe::new(client.clone(), "a");
    assert_eq!(asker.ask("b", "before").await.unwrap().text, "before");

    let before = server.pid();
    server.restart();
    assert_ne!(server.pid(), before, "a new server process");

    // Reconnecting takes a moment; each try is bounded and the whole wait is bounded.
    let answered = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let options = AskOptions {
                timeout: Some(Duration::from_millis(500)),
                ..Default::default()
            };
            match asker.ask_with("b", "after", options).await {
                Ok(reply) => break reply,
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    })
    .await
    .expect("the probe answers again after the restart");
    assert_eq!(answered.text, "after");
    agent.stop().await;
}

/// The error code of a failed reply, from its body.
fn error_code(message: &async_nats::Message) -> String {
    let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
    body["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn an_ask_whose_from_is_not_the_subject_sender_is_forbidden() {
    let (_server, client, echo, agent) = echo_agent_b().await;

    // hoshi's subject, cyrene's name; and a made-up owner name on hoshi's subject.
    for from in ["cyrene", "主人", "hoshi2", ""] {
        let ask = json!({"id":"q1","from":from,"to":"b","question":"who am I?"});
        let message = raw_request(&client, "cyrene.agent.hoshi.b.ask", &ask).await;
        let headers = message.headers.clone().expect("error headers");
        assert_eq!(
            headers.get("Nats-Service-Error-Code").map(|v| v.as_str()),
            Some("403"),
            "{from}"
        );
        assert_eq!(error_code(&message), "forbidden", "{from}");
    }
    assert_eq!(
        echo.asks.load(Ordering::SeqCst),
        0,
        "the handler never saw them"
    );

    // The sender's own id — also one that is sanitised into its token — is answered.
    for (subject, from) in [
        ("cyrene.agent.hoshi.b.ask", "hoshi"),
        ("cyrene.agent.a_b.b.ask", "a.b"),
    ] {
        let ask = json!({"id":"q2","from":from,"to":"b","question":"me"});
        let message = raw_request(&client, subject, &ask).await;
        let reply: Reply = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(reply.to, from);
    }
    agent.stop().await;
}

#[tokio::test]
async fn an_event_whose_from_is_not_the_subject_sender_is_dropped() {
    let (_server, client, echo, agent) = echo_agent_b().await;

    // Directed and broadcast, each claiming to be cyrene on hoshi's subject.
    let forged = json!({"from":"cyrene","name":"forged"});
    for subject in ["cyrene.agent.hoshi.b.event", "cyrene.agent.hoshi.event"] {
        client
            .publish(subject, serde_json::to_vec(&forged).unwrap().into())
            .await
            .unwrap();
    }
    // Sent as a request, the refusal is answered.
    let message = raw_request(&client, "cyrene.agent.hoshi.b.event", &forged).await;
    assert_eq!(error_code(&message), "forbidden");
    // Then an honest one: once it is in, the forged ones (sent before it) are known dropped.
    Probe::new(client.clone(), "hoshi")
        .emit("b", "honest", json!(null))
        .await
        .unwrap();
    let events = wait_for_events(&echo, 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let events_now = echo.events.lock().await.clone();
    assert_eq!(events_now, events);
    assert_eq!(
        events_now
            .iter()
            .map(|e| (e.from.as_str(), e.name.as_str()))
            .collect::<Vec<_>>(),
        vec![("hoshi", "honest")]
    );
    agent.stop().await;
}

#[tokio::test]
async fn a_reply_from_an_agent_that_was_not_asked_is_ignored() {
    let server = NatsServer::start();
    let client = server.connect().await;
    // `mallory` watches the wire and answers first in b's name; `b` exists but answers slowly.
    let mut asks = client.subscribe("cyrene.agent.a.b.ask").await.unwrap();
    let agent = serving(&client, "b", Arc::new(Slow)).await;
    client.flush().await.unwrap();
    let spy = client.clone();
    let forger = tokio::spawn(async move {
        let ask = asks.next().await.unwrap();
        let ask: Ask = serde_json::from_slice(&ask.payload).unwrap();
        let forged = json!({"ask_id":ask.id,"from":"b","to":"a","text":"forged"});
        spy.publish(
            format!("cyrene.agent.mallory.a.reply.{}", ask.id),
            serde_json::to_vec(&forged).unwrap().into(),
        )
        .await
        .unwrap();
        spy.flush().await.unwrap();
    });
    let reply = Probe::new(client, "a").ask("b", "hello").await.unwrap();
    forger.await.unwrap();
    assert_eq!(reply.text, "slow hello");
    agent.stop().await;
}

/// Answers after a pause, long enough for a forged reply to arrive first.
struct Slow;

impl Handler for Slow {
    async fn on_ask(&self, ask: Ask) -> Result<Answer, ErrorBody> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(Answer::text(format!("slow {}", ask.question)))
    }
}

#[tokio::test]
async fn the_default_ask_timeout_caps_a_longer_caller_deadline() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let silent = serving(&client, "silent", Arc::new(Silent)).await;
    client.flush().await.unwrap();
    let asker = Probe::new(client, "a");
    // Connected and subscribed in real time; the wait itself runs on the paused clock, which
    // jumps to the next timer whenever nothing else is ready.
    tokio::time::pause();
    let started = tokio::time::Instant::now();
    let result = ask_within(&asker, "silent", "?", Duration::from_secs(120)).await;
    let waited = started.elapsed();
    tokio::time::resume();
    match result {
        Err(AskError::Timeout { after, .. }) => {
            assert_eq!(after, cyrene_comm::DEFAULT_ASK_TIMEOUT);
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(waited < Duration::from_secs(31), "waited {waited:?}");
    silent.stop_within(Duration::ZERO).await;
}

/// Answers every ask with more text than the bus carries.
struct Huge;

impl Handler for Huge {
    async fn on_ask(&self, _ask: Ask) -> Result<Answer, ErrorBody> {
        Ok(Answer {
            text: "x".repeat(2 * 1024 * 1024),
            data: json!(null),
        })
    }
}

#[tokio::test]
async fn an_answer_the_bus_cannot_carry_comes_back_as_too_large() {
    let server = NatsServer::start();
    let client = server.connect().await;
    let _agent = serving(&client, "b", Arc::new(Huge)).await;
    let asker = Probe::new(client.clone(), "a");
    match ask_within(&asker, "b", "tell me everything", Duration::from_secs(10)).await {
        Err(AskError::Remote { error, .. }) => {
            assert_eq!(error.code, ErrorCode::TooLarge, "{error:?}")
        }
        other => panic!("expected a too_large error, got {other:?}"),
    }
}
