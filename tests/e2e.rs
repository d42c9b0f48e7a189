//! End to end with the real service binaries over a real nats-server: the orchestrator (one or
//! two replicas), the checkpoint store and two loop workers as processes; the gateway in this
//! process so the scripted provider's request log can be read.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use common::{eventually, fresh_postgres, service, wait_for_service};
use cyrene_bus::request_json;
use cyrene_protocol::checkpoint::CheckpointState;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{
    BusyPolicy, Disposition, HistoryRequest, HistoryResponse, SendAck, SendRequest, SessionEvent,
    SessionEventType,
};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::TurnJob;
use cyrene_test_support::process::success_stdout;
use cyrene_test_support::{NatsServer, subscribed};
use futures::StreamExt;
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::process::Child;

const SESSIONS: usize = 20;
const PER_SESSION: usize = 10;

/// Who consumed which message, as seen on the wire: turn jobs and steer acks.
#[derive(Default)]
struct Consumption {
    /// message id → turn ids that took it in
    by_message: BTreeMap<String, BTreeSet<String>>,
}

struct World {
    bus: common::Bus,
    /// External tools (`count`, `hold`, …), up before the workers discover their tools.
    tools: Arc<common::TestTools>,
    consumption: Arc<Mutex<Consumption>>,
    database_url: Option<String>,
    data: tempfile::TempDir,
    children: Vec<Child>,
}

impl World {
    async fn start(database_url: Option<String>) -> World {
        World::scripted(database_url, json!([])).await
    }

    /// A world whose scripted model follows `rules` (docs/model-gateway.md).
    async fn scripted(database_url: Option<String>, rules: serde_json::Value) -> World {
        let bus = common::Bus::with_gateway(rules).await;
        let client = &bus.client;

        // Watch the wire: every job's message ids, every steer ack's.
        let consumption = Arc::new(Mutex::new(Consumption::default()));
        let mut jobs = client.subscribe(subjects::TURN_RUN).await.unwrap();
        let mut events = subscribed(client, subjects::SESSION_EVENTS_ALL).await;
        let c = consumption.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    Some(m) = jobs.next() => {
                        let job: TurnJob = serde_json::from_slice(&m.payload).unwrap();
                        let mut c = c.lock().unwrap();
                        for id in job.message_ids {
                            c.by_message.entry(id).or_default().insert(job.turn_id.clone());
                        }
                    }
                    Some(m) = events.next() => {
                        let e: SessionEvent = serde_json::from_slice(&m.payload).unwrap();
                        if e.kind == SessionEventType::SteerAck {
                            let mut c = c.lock().unwrap();
                            for id in e.message_ids {
                                c.by_message.entry(id).or_default().insert(e.turn_id.clone());
                            }
                        }
                    }
                    else => break,
                }
            }
        });

        let data = tempfile::tempdir().unwrap();
        let tools = common::TestTools::start(client, bus.shutdown.clone()).await;
        let mut world = World {
            bus,
            tools,
            consumption,
            database_url,
            data,
            children: vec![],
        };
        let store = world.service("cyrene-checkpoint-store");
        world.children.push(store);
        wait_for_service(&world.bus.client, "cyrene-checkpoint-store").await;
        for _ in 0..2 {
            world.add_worker();
        }
        world
    }

    /// One more loop-worker process (ack wait 2 s) on this world's bus.
    fn add_worker(&mut self) {
        let worker = service(
            "cyrene-loop-worker",
            &self.bus.server.url(),
            &[("CYRENE_WORKER_ACK_WAIT", "2s")],
        );
        self.children.push(worker);
    }

    /// A service binary with this world's bus, data dir and database.
    fn service(&self, name: &str) -> Child {
        self.service_with(name, &[])
    }

    /// [`World::service`] with more environment.
    fn service_with(&self, name: &str, more: &[(&str, &str)]) -> Child {
        let data = self.data.path().display().to_string();
        let mut envs = vec![
            ("CYRENE_STORE_DATA_DIR", data.as_str()),
            ("CYRENE_ORCHESTRATOR_DATA_DIR", data.as_str()),
        ];
        envs.extend_from_slice(more);
        if let Some(url) = &self.database_url {
            envs.push(("DATABASE_URL", url.as_str()));
        }
        service(name, &self.bus.server.url(), &envs)
    }

    /// An orchestrator process, once it answers `$SRV.PING`.
    async fn orchestrator(&self) -> Child {
        self.orchestrator_with(&[]).await
    }

    /// [`World::orchestrator`] with more environment.
    async fn orchestrator_with(&self, more: &[(&str, &str)]) -> Child {
        let child = self.service_with("cyrene-orchestrator", more);
        wait_for_service(&self.bus.client, "cyrene-orchestrator").await;
        child
    }

    /// Sends until acknowledged (idempotent by key: a retry after a lost ack is safe).
    async fn send(&self, session: &str, text: &str, key: &str) -> SendAck {
        self.send_to(session, text, key, "").await
    }

    /// [`World::send`] addressed to `persona` (empty: the one the session last used).
    async fn send_to(&self, session: &str, text: &str, key: &str, persona: &str) -> SendAck {
        self.send_as("e2e", session, text, key, persona, None).await
    }

    /// [`World::send_to`] from client `client_id`, with a when-busy policy.
    async fn send_as(
        &self,
        client_id: &str,
        session: &str,
        text: &str,
        key: &str,
        persona: &str,
        when_busy: Option<BusyPolicy>,
    ) -> SendAck {
        let request = SendRequest {
            session_id: session.to_owned(),
            message: Message::text(Role::User, text),
            client_id: client_id.into(),
            idempotency_key: key.to_owned(),
            env: None,
            parallel: false,
            when_busy,
            persona: persona.to_owned(),
            context_only: false,
        };
        common::send_until_acked(&self.bus.client, &request, Duration::from_secs(60))
            .await
            .unwrap_or_else(|err| panic!("send {key} never acknowledged: {err}"))
    }

    /// The session's transcript; asked again while no orchestrator answers (a test that killed
    /// one may read before its replacement has subscribed).
    async fn history(&self, session: &str) -> HistoryResponse {
        let request = HistoryRequest {
            session_id: session.to_owned(),
            limit: Some(1000),
            before_seq: None,
        };
        loop {
            match request_json(
                &self.bus.client,
                subjects::SESSION_HISTORY,
                &request,
                Duration::from_secs(5),
            )
            .await
            {
                Err(cyrene_bus::RequestError::NoResponders { .. }) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => return other.unwrap(),
            }
        }
    }

    /// Sends PER_SESSION messages into each of SESSIONS sessions, all sessions at once.
    async fn load(self: &Arc<Self>, tag: &str) -> Vec<(String, SendAck, String)> {
        let mut tasks = Vec::new();
        for s in 0..SESSIONS {
            let world = self.clone();
            let tag = tag.to_owned();
            tasks.push(tokio::spawn(async move {
                let session = format!("{tag}-s{s}");
                let mut acks = Vec::new();
                for m in 0..PER_SESSION {
                    let text = format!("{tag} message {m} of session {s}");
                    let ack = world.send(&session, &text, &format!("{session}-{m}")).await;
                    acks.push((session.clone(), ack, text));
                }
                acks
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        all
    }

    /// Waits until every session's transcript holds each of its messages, each answered by the
    /// turn that took it in.
    async fn settle(&self, sent: &[(String, SendAck, String)]) -> HashMap<String, HistoryResponse> {
        let sessions: BTreeSet<&String> = sent.iter().map(|(s, _, _)| s).collect();
        let mut histories = HashMap::new();
        let settled = tokio::time::timeout(Duration::from_secs(120), async {
            for session in sessions {
                loop {
                    let h = self.history(session).await;
                    let users = h
                        .messages
                        .iter()
                        .filter(|e| e.message.role == Role::User)
                        .count();
                    let consumed = h
                        .messages
                        .iter()
                        .filter(|e| e.message.role == Role::User && !e.turn_id.is_empty())
                        .count();
                    // Every turn that took a message in has answered. (The last entry being an
                    // answer is not enough: a message claimed for a turn that ended before
                    // taking it in is handed to a new turn, which may still be running when
                    // the earlier turn's answer is the newest entry.)
                    let answered: BTreeSet<&str> = h
                        .messages
                        .iter()
                        .filter(|e| e.message.role == Role::Assistant)
                        .map(|e| e.turn_id.as_str())
                        .collect();
                    let every_turn_answered = h
                        .messages
                        .iter()
                        .filter(|e| e.message.role == Role::User)
                        .all(|e| answered.contains(e.turn_id.as_str()));
                    if users == PER_SESSION && consumed == users && every_turn_answered {
                        histories.insert(session.clone(), h);
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        })
        .await;
        assert!(settled.is_ok(), "every session settles");
        // The transcripts are complete, so every job and steer ack was published before: let
        // the wire watcher (its own task) catch up before anything is asserted on what it saw.
        let consumption = self.consumption.clone();
        common::eventually(
            "the wire watcher saw every message taken into a turn",
            Duration::from_secs(10),
            || {
                let c = consumption.lock().unwrap();
                sent.iter()
                    .all(|(_, ack, _)| c.by_message.contains_key(&ack.message_id))
            },
        )
        .await;
        histories
    }

    /// The exactly-once checks over what `load` sent.
    fn assert_exactly_once(
        &self,
        sent: &[(String, SendAck, String)],
        histories: &HashMap<String, HistoryResponse>,
    ) {
        let consumption = self.consumption.lock().unwrap();
        let requests = self.bus.log.snapshot();
        for (session, ack, text) in sent {
            // Consumed by exactly one turn (a job's new message or a steer claim) …
            let turns = consumption
                .by_message
                .get(&ack.message_id)
                .cloned()
                .unwrap_or_default();
            assert_eq!(turns.len(), 1, "{text} consumed by {turns:?}");
            // … it reached the model …
            assert!(
                requests.iter().any(|r| r
                    .messages
                    .iter()
                    .any(|m| m.role == Role::User && m.text_content() == *text)),
                "{text} never reached the model"
            );
            // … and the transcript holds it once, attributed to that turn.
            let entries: Vec<_> = histories[session]
                .messages
                .iter()
                .filter(|e| e.message.role == Role::User && e.message.text_content() == *text)
                .collect();
            assert_eq!(
                entries.len(),
                1,
                "{text} in the transcript {} times",
                entries.len()
            );
            assert_eq!(entries[0].id, ack.message_id);
            assert!(
                turns.contains(&entries[0].turn_id),
                "{text}: transcript turn {} vs wire {turns:?}",
                entries[0].turn_id
            );
        }
        let ids: BTreeSet<&String> = sent.iter().map(|(_, a, _)| &a.message_id).collect();
        assert_eq!(ids.len(), sent.len(), "every message got its own id");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_messages_into_twenty_sessions_are_each_processed_exactly_once() {
    let world = Arc::new(World::start(None).await);
    let _orchestrator = world.orchestrator().await;
    let sent = world.load("once").await;
    let histories = world.settle(&sent).await;
    world.assert_exactly_once(&sent, &histories);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_orchestrator_replicas_on_one_postgres_keep_exactly_once_and_the_fence() {
    let Some(db) = fresh_postgres("cyrene_e2e").await else {
        panic!("PostgreSQL at 127.0.0.1:5432 is required for this test");
    };
    let world = Arc::new(World::start(Some(db.url.clone())).await);
    let _one = world.orchestrator().await;
    let _two = world.orchestrator().await;
    common::wait_for_replicas(&world.bus.client, "cyrene-orchestrator", "send", 2).await;
    let sent = world.load("replicas").await;
    let histories = world.settle(&sent).await;
    world.assert_exactly_once(&sent, &histories);

    // Both replicas took part.
    // Both replicas answer; a reply slowed by load still counts (bounded wait for the second).
    let served: Vec<u64> = cyrene_bus::discovery::gather(
        &world.bus.client,
        cyrene_bus::discovery::Verb::Stats,
        Some("cyrene-orchestrator"),
        Duration::from_secs(5),
        Some(2),
    )
    .await
    .unwrap()
    .iter()
    .map(|stats| cyrene_bus::discovery::endpoint_stat(stats, "send", "num_requests").unwrap())
    .collect();
    assert_eq!(served.len(), 2, "two replicas answer $SRV.STATS");
    assert!(
        served.iter().all(|n| *n > 0),
        "both replicas served sends: {served:?}"
    );

    // The fence: in every session, each answer follows the messages of its turn and no turn's
    // answer interleaves with another's (one turn in flight per session).
    for h in histories.values() {
        let mut seen_turns = Vec::new();
        for e in &h.messages {
            if e.message.role == Role::Assistant {
                assert!(
                    !seen_turns.contains(&e.turn_id),
                    "turn {} answered twice",
                    e.turn_id
                );
                seen_turns.push(e.turn_id.clone());
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orchestrator_killed_under_load_loses_nothing() {
    let world = Arc::new(World::start(None).await);
    // Kill the orchestrator while the load runs; sends retry until a new one answers.
    let mut victim = world.orchestrator().await;
    let loader = {
        let world = world.clone();
        tokio::spawn(async move { world.load("restart").await })
    };
    common::eventually(
        "some messages acknowledged",
        Duration::from_secs(30),
        || world.bus.log.len() >= 10,
    )
    .await;
    victim.start_kill().unwrap(); // SIGKILL mid-load
    victim.wait().await.unwrap();
    let replacement = world.service("cyrene-orchestrator");
    let sent = loader.await.unwrap();
    let histories = world.settle(&sent).await;
    world.assert_exactly_once(&sent, &histories);
    drop(replacement);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_persona_answers_an_ask_sent_by_cyrene_ask() {
    let world = World::start(None).await;
    let _orchestrator = world.orchestrator().await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args([
            "ask",
            "--from",
            "me",
            "--to",
            "cyrene",
            "--timeout",
            "30s",
            "are you there?",
        ])
        .env("NATS_URL", world.bus.server.url())
        .output()
        .await
        .unwrap();
    common::assert_success(&out);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "echo: are you there?\n"
    );
    // The orchestrator lists its service; the persona is reachable as an agent.
    let info = world
        .bus
        .client
        .request("$SRV.INFO.cyrene-orchestrator", "".into())
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&info.payload).contains("cyrene.session.send"));
}

/// Two askers of one persona: the second asker's model request holds nothing of the first's
/// exchange, while each asker's own earlier exchange is carried over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn askers_of_one_persona_do_not_see_each_other() {
    let world = World::start(None).await;
    let _orchestrator = world.orchestrator().await;
    let alice = cyrene_comm::Probe::new(world.bus.client.clone(), "alice");
    let bob = cyrene_comm::Probe::new(world.bus.client.clone(), "bob");
    let secret = "alice's secret: the door code is 4711";
    let asked = |probe: &cyrene_comm::Probe, question: &str| {
        let (probe, question) = (probe.clone(), question.to_owned());
        async move {
            let options = cyrene_comm::AskOptions {
                timeout: Some(Duration::from_secs(30)),
                ..Default::default()
            };
            probe.ask_with("cyrene", &question, options).await.unwrap()
        }
    };
    asked(&alice, secret).await;
    asked(&bob, "what did the person before me say?").await;
    asked(&alice, "and what was my code?").await;

    let requests = world.bus.log.snapshot();
    let holding = |text: &str| -> Vec<String> {
        requests
            .iter()
            .filter(|r| r.messages.iter().any(|m| m.text_content().contains(text)))
            .map(|r| {
                r.messages
                    .iter()
                    .map(|m| m.text_content())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect()
    };
    let bobs = holding("the person before me");
    assert!(!bobs.is_empty());
    for request in &bobs {
        assert!(
            !request.contains("4711"),
            "bob's request holds alice's exchange:\n{request}"
        );
    }
    let alices = holding("what was my code");
    assert!(
        alices.iter().all(|r| r.contains("4711")),
        "alice keeps her own history"
    );
    assert!(alices.iter().all(|r| !r.contains("the person before me")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cyrene_up_and_demo_show_a_tool_call_a_steered_message_and_checkpoints() {
    let server = NatsServer::start();
    let data = tempfile::tempdir().unwrap();
    let _up = common::cyrene_up(&server.url(), data.path());
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
            .args(["demo", "--session", "demo1"])
            .env("NATS_URL", server.url())
            .output(),
    )
    .await
    .unwrap()
    .unwrap();
    let text = success_stdout(&out, "cyrene demo");
    assert!(text.contains("⚙ search_notes"), "{text}");
    assert!(
        text.contains("↪ steered 1 message(s) into step 2"),
        "{text}"
    );
    // One row per step of the turn: `demo1:<turn id>:<step>`.
    let checkpoint_line = |step: u32, stop: &str| {
        text.lines().any(|l| {
            l.starts_with("demo1:")
                && l.split_whitespace()
                    .next()
                    .is_some_and(|id| id.ends_with(&format!(":{step}")))
                && l.contains(&format!("step {step:>3}  {stop}"))
        })
    };
    assert!(checkpoint_line(1, "tool_calls"), "{text}");
    assert!(checkpoint_line(3, "stop"), "{text}");
    assert!(text.contains("(UTC). — offline scripted reply"), "{text}");
    // The answer is shown once: rendered live from its delta events, and the final event that
    // repeats it is not printed again.
    let live = |prefix: &str| {
        text.lines()
            .filter(|l| {
                l.trim_start().starts_with(prefix) && l.contains("(UTC). — offline scripted reply")
            })
            .count()
    };
    assert_eq!(live("cyrene: "), 1, "{text}");
}

/// Asks cyrene, retrying only "nobody listens yet" (the personas register just after the
/// orchestrator's endpoints answer).
async fn ask_when_ready(
    probe: &cyrene_comm::Probe,
    question: &str,
    options: cyrene_comm::AskOptions,
) -> cyrene_protocol::comm::Reply {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match probe.ask_with("cyrene", question, options.clone()).await {
            Err(cyrene_comm::AskError::NoReply { .. })
                if tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other.unwrap(),
        }
    }
}

/// An ask's `data` reaches the model: the request answering it holds the question and, after
/// it, the data as a JSON block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_asks_data_reaches_the_model_request() {
    let world = World::start(None).await;
    let _orchestrator = world.orchestrator().await;
    let alice = cyrene_comm::Probe::new(world.bus.client.clone(), "alice");
    let options = cyrene_comm::AskOptions {
        timeout: Some(Duration::from_secs(30)),
        data: json!({"order": 4711, "items": ["oolong"]}),
        ..Default::default()
    };
    let reply = ask_when_ready(&alice, "what did I order?", options).await;
    assert!(reply.text.contains("what did I order?"), "{}", reply.text);
    let requests = world.bus.log.snapshot();
    let asked: Vec<_> = requests
        .iter()
        .filter_map(|r| {
            r.messages
                .iter()
                .find(|m| m.role == Role::User && m.text_content().contains("what did I order?"))
        })
        .collect();
    assert!(!asked.is_empty(), "the ask reached the model");
    for m in asked {
        let text = m.text_content();
        assert!(
            text.contains(r#"{"items":["oolong"],"order":4711}"#),
            "the data is in the request: {text}"
        );
    }
}

/// A persona's turn that asks the persona it is answering for (here: itself) gets an
/// `is_error` tool result at once instead of waiting on its own ask until the timeout, and the
/// outer ask is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ask_back_along_its_chain_is_an_error_result_not_a_stall() {
    let rules = json!([{"contains": "ask yourself",
        "tool_calls": [{"name": "ask_agent", "args": {"agent": "cyrene", "question": "hello me"}}],
        "after_tools": "the tool said: {tool_results}"}]);
    let world = World::scripted(None, rules).await;
    let _orchestrator = world.orchestrator().await;
    let alice = cyrene_comm::Probe::new(world.bus.client.clone(), "alice");
    let options = cyrene_comm::AskOptions {
        timeout: Some(Duration::from_secs(30)),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let reply = ask_when_ready(&alice, "please ask yourself", options).await;
    assert!(reply.text.contains("ask cycle"), "{}", reply.text);
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "answered without waiting for an ask timeout ({:?})",
        started.elapsed()
    );
    // The nested ask never reached the model.
    let requests = world.bus.log.snapshot();
    assert!(requests.iter().all(|r| {
        r.messages
            .iter()
            .all(|m| !m.text_content().starts_with("hello me"))
    }));
}

/// D16 (issue 29): a message sent while a tool runs, into a turn whose deadline passes before
/// the tool ends, is not consumed by that cancelled turn: it is answered by a turn of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_sent_into_a_turn_past_its_deadline_gets_a_turn_of_its_own() {
    let rules = json!([{"contains": "picnic", "tool_calls": [{"name": "hold"}],
        "after_tools": "found: {tool_results}"}]);
    let world = World::scripted(None, rules).await;
    let gate = Arc::new(tokio::sync::Notify::new());
    *world.tools.gate.lock().unwrap() = Some(gate.clone());
    let timeout_ms = 1_500;
    let personas = world.data.path().join("personas.json");
    let document = json!({"default": "cyrene", "personas": [
        {"id": "cyrene", "name": "昔涟", "turn_timeout_ms": timeout_ms}]});
    std::fs::write(&personas, document.to_string()).unwrap();
    let personas = personas.display().to_string();
    let _orchestrator = world
        .orchestrator_with(&[("CYRENE_ORCHESTRATOR_PERSONAS", personas.as_str())])
        .await;

    let first = world
        .send("sd", "search my notes about the picnic", "sd-1")
        .await;
    world.tools.hold_started("the held tool started").await;
    let second = world.send("sd", "and the weather?", "sd-2").await;
    // The turn's deadline (counted from before its tool started) passes; then the tool ends.
    tokio::time::sleep(Duration::from_millis(timeout_ms + 200)).await;
    *world.tools.gate.lock().unwrap() = None;
    gate.notify_waiters();

    let answered = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let history = world.history("sd").await;
            let entry = |id: &str| {
                history
                    .messages
                    .iter()
                    .find(|e| e.id == id)
                    .map(|e| e.turn_id.clone())
                    .unwrap_or_default()
            };
            let (first_turn, second_turn) = (entry(&first.message_id), entry(&second.message_id));
            let answer = history.messages.iter().find(|e| {
                e.message.role == Role::Assistant
                    && !second_turn.is_empty()
                    && e.turn_id == second_turn
            });
            if let Some(answer) = answer {
                return (first_turn, second_turn, answer.message.text_content());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let (first_turn, second_turn, answer) =
        answered.expect("the second message is answered by a turn");
    assert_ne!(first_turn, second_turn, "taken in by the cancelled turn");
    assert_eq!(answer, "echo: and the weather?");
}

/// The answers of session `mp` as (persona, text), once there are at least `n`.
async fn answers(world: &World, n: usize) -> Vec<(String, String)> {
    answers_in(world, "mp", n).await
}

/// The answers of `session` as (persona, text), once there are at least `n`.
async fn answers_in(world: &World, session: &str, n: usize) -> Vec<(String, String)> {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let said: Vec<(String, String)> = world
                .history(session)
                .await
                .messages
                .iter()
                .filter(|e| e.message.role == Role::Assistant)
                .map(|e| (e.message.sender_name.clone(), e.message.text_content()))
                .collect();
            if said.len() >= n {
                return said;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{n} answers"))
}

/// Several personas in one session, end to end (docs/orchestrator.md, "Several personas";
/// docs/semantics.md#attribution): cyrene twice (one persona: no lead, no notes), hoshi with a
/// tool and a message steered in while it runs, nova in a parallel leg from another client
/// meanwhile, nova again, cyrene again. Each persona's view carries
/// the reference's attribution byte for byte for the other personas' lines, and the transcript
/// keeps who said each answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_personas_take_turns_in_one_session_and_each_view_says_who_said_what() {
    const LEAD_TAIL: &str = "的身份对话。本会话此前由不同角色相继发言：下面凡是标了「发言归属」的发言，都只属于标注的那个角色——不要把别个角色说过的话当成你自己说过的，也不要继承他们的身份、口吻或立场；该标注从其出现处起生效，直到下一条「发言归属」为止。";
    let lead = |label: &str| format!("[会话角色] 你正以{label}{LEAD_TAIL}");
    let other = |label: &str| format!("[发言归属] 以下发言来自{label}，不是你说的。");
    let me = |label: &str| format!("[发言归属] 以下发言来自你自己——{label}。");
    let (cyrene, hoshi, nova) = ("「昔涟」（cyrene）", "「星」（hoshi）", "「nova」");

    let rules = json!([{"contains": "picnic", "tool_calls": [{"name": "hold"}],
        "after_tools": "found: {tool_results}"}]);
    let world = World::scripted(None, rules).await;
    let personas = world.data.path().join("personas.json");
    let document = json!({"default": "cyrene", "personas": [
        {"id": "cyrene", "name": "昔涟"}, {"id": "hoshi", "name": "星"}, {"id": "nova", "name": "nova"}]});
    std::fs::write(&personas, document.to_string()).unwrap();
    let personas = personas.display().to_string();
    let _orchestrator = world
        .orchestrator_with(&[("CYRENE_ORCHESTRATOR_PERSONAS", personas.as_str())])
        .await;
    // The views the model was asked with for a user text, as (role, text) lines.
    let views_for = |text: &str| -> Vec<Vec<(Role, String)>> {
        world
            .bus
            .log
            .snapshot()
            .iter()
            .filter(|r| {
                r.messages
                    .iter()
                    .any(|m| m.role == Role::User && m.text_content() == text)
            })
            .map(|r| {
                r.messages
                    .iter()
                    .map(|m| (m.role, m.text_content()))
                    .collect()
            })
            .collect()
    };
    let notes = |view: &[(Role, String)]| -> Vec<String> {
        view.iter()
            .filter(|(role, t)| {
                *role == Role::System
                    && (t.starts_with("[会话角色]") || t.starts_with("[发言归属]"))
            })
            .map(|(_, t)| t.clone())
            .collect()
    };

    world.send("mp", "hi", "mp-1").await;
    answers(&world, 1).await;
    world.send("mp", "how are you", "mp-2").await;
    answers(&world, 2).await;
    let one = views_for("how are you");
    assert!(!one.is_empty());
    assert!(
        one.iter().all(|v| notes(v).is_empty()),
        "one persona: no lead, no notes"
    );

    // hoshi, with a tool that holds; a message steered in while it runs.
    let gate = Arc::new(tokio::sync::Notify::new());
    *world.tools.gate.lock().unwrap() = Some(gate.clone());
    world
        .send_to("mp", "hoshi, plan the picnic", "mp-3", "hoshi")
        .await;
    world.tools.hold_started("the held tool started").await;
    world.send("mp", "and bring tea", "mp-4").await;
    // While hoshi's tool still runs, another client addresses nova in a parallel leg, which
    // answers first.
    let leg = world
        .send_as(
            "phone",
            "mp",
            "nova, quick one",
            "mp-4b",
            "nova",
            Some(BusyPolicy::Parallel),
        )
        .await;
    assert_eq!(leg.disposition, Disposition::ParallelLeg);
    answers(&world, 3).await;
    let leg_view = views_for("nova, quick one").pop().unwrap();
    assert_eq!(notes(&leg_view), [lead(nova), other(cyrene)]);
    *world.tools.gate.lock().unwrap() = None;
    gate.notify_waiters();
    answers(&world, 4).await;
    let hoshi_views = views_for("hoshi, plan the picnic");
    assert!(hoshi_views.len() >= 2, "a tool step and the answer");
    for view in &hoshi_views {
        let n = notes(view);
        assert_eq!(n[..2], [lead(hoshi), other(cyrene)], "{n:?}");
    }
    let last = hoshi_views.last().unwrap();
    assert!(
        last.iter()
            .any(|(role, t)| *role == Role::User && t == "and bring tea"),
        "the steered message is in hoshi's view"
    );

    world.send_to("mp", "nova, your turn", "mp-5", "nova").await;
    answers(&world, 5).await;
    let nova_view = views_for("nova, your turn").pop().unwrap();
    assert_eq!(
        notes(&nova_view),
        [lead(nova), other(cyrene), me(nova), other(hoshi)]
    );

    world
        .send_to("mp", "cyrene, sum up", "mp-6", "cyrene")
        .await;
    let said = answers(&world, 6).await;
    let cyrene_view = views_for("cyrene, sum up").pop().unwrap();
    assert_eq!(
        notes(&cyrene_view),
        [
            lead(cyrene),
            me(cyrene),
            other(nova),
            other(hoshi),
            other(nova)
        ]
    );
    // Each note stands right before the line it announces.
    let before = |note: &str| {
        let i = cyrene_view.iter().position(|(_, t)| t == note).unwrap();
        cyrene_view[i + 1].clone()
    };
    assert_eq!(
        before(&other(nova)),
        (Role::Assistant, "echo: nova, quick one".into()),
        "the leg's answer"
    );
    let last_nova = cyrene_view
        .iter()
        .rposition(|(_, t)| *t == other(nova))
        .unwrap();
    assert_eq!(
        cyrene_view[last_nova + 1],
        (Role::Assistant, "echo: nova, your turn".into())
    );
    assert_eq!(before(&me(cyrene)), (Role::Assistant, "echo: hi".into()));

    let speakers: Vec<&str> = said.iter().map(|(who, _)| who.as_str()).collect();
    assert_eq!(
        speakers,
        ["cyrene", "cyrene", "nova", "hoshi", "nova", "cyrene"]
    );
}

/// Guardrails end to end (docs/loop-worker.md, "Guardrails"): the real orchestrator, store and
/// worker processes, and a guard service in this test on `cyrene.guard.policy` that denies every
/// `count` call and any answer mentioning a secret. The denied tool never runs, the person gets
/// the persona's configured message (never the guard's reason), the checkpoints say
/// `guardrail`, and no delta of the guarded persona's answers reaches the session — while an
/// unguarded persona's answer in the same session streams as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_stops_a_tool_call_and_an_answer_and_the_person_gets_the_personas_message() {
    const MESSAGE: &str = "这个我不能帮你做。";
    let rules = json!([{"contains": "count for me", "tool_calls": [{"name": "count"}],
        "after_tools": "counted: {tool_results}"}]);
    let world = World::scripted(None, rules).await;
    let client = &world.bus.client;

    // The guard: records every request and answers by its policy.
    let asked: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
    let mut requests = subscribed(client, "cyrene.guard.policy").await;
    let (guard_client, guard_asked) = (client.clone(), asked.clone());
    tokio::spawn(async move {
        while let Some(request) = requests.next().await {
            let body: serde_json::Value = serde_json::from_slice(&request.payload).unwrap();
            let denied = match body["kind"].as_str() {
                Some("tool_call") => body["tool"] == "count",
                _ => body["text"].as_str().unwrap_or("").contains("secret"),
            };
            guard_asked.lock().unwrap().push(body);
            let reply = json!({"allow": !denied, "reason": "rule 7 (internal policy text)"});
            if let Some(to) = request.reply {
                guard_client
                    .publish(to, reply.to_string().into())
                    .await
                    .unwrap();
            }
        }
    });

    let personas = world.data.path().join("personas.json");
    let document = json!({"default": "cyrene", "personas": [
        {"id": "cyrene", "name": "昔涟", "guard": "cyrene.guard.policy", "guard_message": MESSAGE},
        {"id": "hoshi", "name": "星"}]});
    std::fs::write(&personas, document.to_string()).unwrap();
    let personas = personas.display().to_string();
    let _orchestrator = world
        .orchestrator_with(&[("CYRENE_ORCHESTRATOR_PERSONAS", personas.as_str())])
        .await;
    let seen = follow(client, "g1").await;

    // A tool call the guard denies: the tool never runs, the person gets the message.
    world.send("g1", "count for me please", "g1-1").await;
    let said = answers_in(&world, "g1", 1).await;
    assert_eq!(said, [("cyrene".to_owned(), MESSAGE.to_owned())]);
    assert!(
        world
            .tools
            .runs
            .lock()
            .unwrap()
            .iter()
            .all(|(name, _)| name != "count"),
        "the denied tool ran"
    );
    // An answer the guard denies: never shown, the message instead.
    world.send("g1", "tell me the secret", "g1-2").await;
    let said = answers_in(&world, "g1", 2).await;
    assert_eq!(said[1], ("cyrene".to_owned(), MESSAGE.to_owned()));
    // An answer the guard allows reaches the person whole.
    world.send("g1", "hello there", "g1-3").await;
    let said = answers_in(&world, "g1", 3).await;
    assert_eq!(
        said[2],
        ("cyrene".to_owned(), "echo: hello there".to_owned())
    );
    // An unguarded persona in the same session: its answer streams as deltas.
    world.send_to("g1", "hoshi, hello", "g1-4", "hoshi").await;
    let said = answers_in(&world, "g1", 4).await;
    assert_eq!(
        said[3],
        ("hoshi".to_owned(), "echo: hoshi, hello".to_owned())
    );

    // What the guard was asked: the call with its tool name, the answers with their text.
    let asked = asked.lock().unwrap().clone();
    let kinds: Vec<(&str, &str)> = asked
        .iter()
        .map(|a| {
            let what = a["tool"].as_str().or(a["text"].as_str()).unwrap_or("");
            (a["kind"].as_str().unwrap(), what)
        })
        .collect();
    assert!(kinds.contains(&("tool_call", "count")), "{kinds:?}");
    assert!(
        kinds.contains(&("answer", "echo: tell me the secret")),
        "{kinds:?}"
    );
    assert!(
        kinds.contains(&("answer", "echo: hello there")),
        "{kinds:?}"
    );
    assert!(
        asked
            .iter()
            .all(|a| a["persona"] == "cyrene" && a["session_id"] == "g1"),
        "only the guarded persona's turns ask: {asked:?}"
    );

    // The session saw no piece of a guarded answer and nothing of the guard's reason; hoshi's
    // answer was streamed.
    eventually("hoshi's final event", Duration::from_secs(30), || {
        seen.lock().unwrap().iter().any(|e| {
            e.kind == SessionEventType::Final
                && e.message.as_ref().is_some_and(|m| m.sender_name == "hoshi")
        })
    })
    .await;
    let seen = seen.lock().unwrap().clone();
    let deltas: Vec<&SessionEvent> = seen
        .iter()
        .filter(|e| e.kind == SessionEventType::Delta)
        .collect();
    assert!(!deltas.is_empty(), "an unguarded answer streams");
    assert!(
        deltas.iter().all(|e| e.sender_name == "hoshi"),
        "a guarded answer was previewed: {deltas:?}"
    );
    for event in &seen {
        let shown = serde_json::to_string(event).unwrap();
        assert!(
            !shown.contains("rule 7"),
            "the guard's reason reached the session: {shown}"
        );
        assert!(
            !shown.contains("echo: tell me the secret"),
            "a denied answer was shown: {shown}"
        );
    }

    // Two turns settled as `guardrail`, each with the guard's reason for operators.
    let checkpoints =
        cyrene_checkpoint_client::CheckpointClient::new(client.clone(), Duration::from_secs(5))
            .list("g1", Some(100))
            .await
            .unwrap();
    let mut reasons: Vec<String> = checkpoints
        .iter()
        .map(|c| c.state.parse::<CheckpointState>().unwrap())
        .filter(|s| s.stop_reason == "guardrail")
        .map(|s| s.guard_reason)
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "answer: rule 7 (internal policy text)",
            "tool_call count: rule 7 (internal policy text)"
        ]
    );
}

// ---- human approval (docs/reliability.md, "Approval") ----

/// A world whose model calls `tool` for "mail bob" (then answers `done: <results>`), and whose
/// persona needs approval for `tool`; its orchestrator is the returned child.
async fn approval_world(tool: &str) -> (World, Child) {
    let rules = json!([{"contains": "mail bob", "tool_calls": [{"name": tool, "args": {"to": "bob"}}],
        "after_tools": "done: {tool_results}"}]);
    let world = World::scripted(None, rules).await;
    let personas = world.data.path().join("personas.json");
    let document = json!({"default": "cyrene", "personas": [
        {"id": "cyrene", "name": "昔涟", "approval": [tool]}]});
    std::fs::write(&personas, document.to_string()).unwrap();
    let personas = personas.display().to_string();
    let orchestrator = world
        .orchestrator_with(&[("CYRENE_ORCHESTRATOR_PERSONAS", personas.as_str())])
        .await;
    (world, orchestrator)
}

/// Every event of `session` from now on.
async fn follow(client: &async_nats::Client, session: &str) -> Arc<Mutex<Vec<SessionEvent>>> {
    let mut events = subscribed(client, subjects::session_events(session).unwrap()).await;
    let seen: Arc<Mutex<Vec<SessionEvent>>> = Arc::default();
    let recorded = seen.clone();
    tokio::spawn(async move {
        while let Some(m) = events.next().await {
            let event: SessionEvent = serde_json::from_slice(&m.payload).unwrap();
            recorded.lock().unwrap().push(event);
        }
    });
    seen
}

/// The `approval_requested` events seen, once there are `n`.
async fn requested(seen: &Mutex<Vec<SessionEvent>>, n: usize) -> Vec<SessionEvent> {
    let of_kind = || -> Vec<SessionEvent> {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|e| e.kind == SessionEventType::ApprovalRequested)
            .cloned()
            .collect()
    };
    eventually("the approval is requested", Duration::from_secs(60), || {
        of_kind().len() >= n
    })
    .await;
    of_kind()
}

/// `cyrene <args>` on the world's bus; its stdout, which must say it succeeded.
async fn cyrene_cli(world: &World, args: &[&str]) -> String {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(args)
        .env("NATS_URL", world.bus.server.url())
        .env_remove("RUST_LOG")
        .output()
        .await
        .unwrap();
    success_stdout(&out, &format!("cyrene {}", args.join(" ")))
}

/// The session's answers' texts, once there are `n`.
async fn answered(world: &World, session: &str, n: usize) -> Vec<String> {
    answers_in(world, session, n)
        .await
        .into_iter()
        .map(|(_, text)| text)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_call_waits_for_cyrene_approve_then_runs_once_and_the_answer_arrives() {
    let (world, _orchestrator) = approval_world("count").await;
    let seen = follow(&world.bus.client, "ap1").await;
    world.send("ap1", "please mail bob", "ap1-1").await;
    let asked = requested(&seen, 1).await;
    let call = asked[0].call_id.clone().unwrap();
    assert_eq!(asked[0].tool.as_deref(), Some("count"));
    assert_eq!(asked[0].arguments.as_ref().unwrap()["to"], "bob");
    assert!(asked[0].deadline_ms.is_some());
    // Waiting: nothing ran, the turn did not end, and the list shows it.
    assert!(world.tools.ids_of("count").is_empty());
    let listed = cyrene_cli(&world, &["approvals", "-s", "ap1"]).await;
    assert!(
        listed.starts_with("waiting") && listed.contains(&call),
        "{listed}"
    );
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .all(|e| e.kind != SessionEventType::TurnEnded && e.kind != SessionEventType::Final)
    );

    let said = cyrene_cli(&world, &["approve", "-s", "ap1", &call]).await;
    assert_eq!(said.trim(), format!("approved {call} (by operator)"));
    let said = answered(&world, "ap1", 1).await;
    assert_eq!(said, [format!("done: count ran as {}", short(&call))]);
    assert_eq!(
        world.tools.ids_of("count"),
        std::slice::from_ref(&call),
        "ran once, under its id"
    );
    // A second decision changes nothing and says what holds.
    let again = tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["deny", "-s", "ap1", &call])
        .env("NATS_URL", world.bus.server.url())
        .output()
        .await
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&again.stderr).contains("already approved"));
    let decided: Vec<SessionEvent> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == SessionEventType::ApprovalDecided)
        .cloned()
        .collect();
    assert_eq!(decided.len(), 1);
    assert_eq!(decided[0].decided_by.as_deref(), Some("operator"));
    // The same turn ended, once.
    let ended: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == SessionEventType::TurnEnded)
        .map(|e| e.turn_id.clone())
        .collect();
    assert_eq!(ended, [asked[0].turn_id.clone()]);
}

/// SIGKILLs the world's loop workers (every child but the checkpoint store, the first).
async fn kill_workers(world: &mut World) {
    for child in world.children.iter_mut().skip(1) {
        let _ = child.start_kill();
        let _ = child.wait().await;
    }
}

/// A scripted call id without its conversation digest (the tool prints it so).
fn short(call_id: &str) -> String {
    common::short_call_id(call_id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_call_never_runs_and_the_model_is_told_why() {
    let (world, _orchestrator) = approval_world("count").await;
    let seen = follow(&world.bus.client, "ap2").await;
    world.send("ap2", "please mail bob", "ap2-1").await;
    let call = requested(&seen, 1).await[0].call_id.clone().unwrap();
    let said = cyrene_cli(
        &world,
        &["deny", "-s", "ap2", &call, "--reason", "not to bob"],
    )
    .await;
    assert_eq!(said.trim(), format!("denied {call} (by operator)"));
    let said = answered(&world, "ap2", 1).await;
    assert_eq!(
        said,
        ["done: This tool call was not approved, so it did not run. Reason: not to bob"]
    );
    assert!(
        world.tools.ids_of("count").is_empty(),
        "the denied tool ran"
    );
}

/// A worker SIGKILLed while an approved call of a tool that must not run twice runs: the
/// redelivery never runs it again, and the turn still answers (outcome unknown).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_call_in_flight_at_a_worker_kill_never_runs_twice() {
    let (mut world, _orchestrator) = approval_world("hold_once").await;
    let gate = Arc::new(tokio::sync::Notify::new());
    *world.tools.gate.lock().unwrap() = Some(gate.clone());
    let seen = follow(&world.bus.client, "ap3").await;
    world.send("ap3", "please mail bob", "ap3-1").await;
    let call = requested(&seen, 1).await[0].call_id.clone().unwrap();
    cyrene_cli(&world, &["approve", "-s", "ap3", &call]).await;
    world
        .tools
        .tool_started("hold_once", "the approved call started")
        .await;
    // Both workers die (whichever runs it); the held call is let go; a new worker takes over.
    kill_workers(&mut world).await;
    *world.tools.gate.lock().unwrap() = None;
    gate.notify_waiters();
    world.add_worker();

    let said = answered(&world, "ap3", 1).await;
    assert!(
        said[0].starts_with("done: The outcome of this tool call is unknown"),
        "{said:?}"
    );
    assert_eq!(world.tools.ids_of("hold_once"), [call], "ran exactly once");
}

/// The orchestrator dies after a decision committed and before the continued job was published:
/// a new one's dispatch sweeper publishes it, and the turn continues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orchestrator_killed_between_the_decision_and_the_dispatch_still_continues_the_turn() {
    let (mut world, mut orchestrator) = approval_world("count").await;
    let seen = follow(&world.bus.client, "ap4").await;
    world.send("ap4", "please mail bob", "ap4-1").await;
    let call = requested(&seen, 1).await[0].call_id.clone().unwrap();
    // No stream takes the job now: the decision commits, its dispatch fails …
    let js = async_nats::jetstream::new(world.bus.client.clone());
    js.delete_stream(cyrene_bus::streams::TURNS_STREAM)
        .await
        .unwrap();
    cyrene_cli(&world, &["approve", "-s", "ap4", &call]).await;
    // … and the orchestrator dies before anything published it (the workers, whose consumer
    // went with the stream, are replaced too).
    orchestrator.start_kill().unwrap();
    orchestrator.wait().await.unwrap();
    kill_workers(&mut world).await;
    assert!(world.tools.ids_of("count").is_empty());
    let personas = world
        .data
        .path()
        .join("personas.json")
        .display()
        .to_string();
    let _replacement = world
        .orchestrator_with(&[("CYRENE_ORCHESTRATOR_PERSONAS", personas.as_str())])
        .await;
    world.add_worker();

    let said = answered(&world, "ap4", 1).await;
    assert_eq!(said, [format!("done: count ran as {}", short(&call))]);
    assert_eq!(world.tools.ids_of("count"), [call]);
}
