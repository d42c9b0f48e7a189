//! Personas as agents on the comm protocol, and the parallel policy.

use crate::harness::*;
use cyrene_comm::{AskError, AskOptions, Probe};
use cyrene_orchestrator::agents::ask_session_id;
use cyrene_orchestrator::{Persona, Personas};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::message::{Role, SenderKind};
use cyrene_protocol::session::{BusyPolicy, Disposition, SendAck, SendRequest};
use cyrene_protocol::subjects;
use futures::StreamExt;
use serde_json::json;
use std::time::Duration;

fn two_personas() -> Personas {
    Personas {
        default: "cyrene".into(),
        personas: vec![
            Persona {
                id: "cyrene".into(),
                name: "昔涟".into(),
                instructions: "be warm".into(),
                restricted: false,
                tools: None,
                turn_timeout_ms: None,
                ..Default::default()
            },
            Persona {
                id: "hoshi".into(),
                name: "星".into(),
                instructions: "be bright".into(),
                restricted: true,
                tools: Some(vec!["current_time".into()]),
                turn_timeout_ms: Some(60_000),
                ..Default::default()
            },
        ],
    }
}

async fn ask(probe: &Probe, to: &str, question: &str) -> cyrene_protocol::comm::Reply {
    let options = || AskOptions {
        timeout: Some(Duration::from_secs(10)),
        ..AskOptions::default()
    };
    // The agents register just after the endpoints: retry only "nobody listens yet".
    wait_async("the agent to answer", || async {
        match probe.ask_with(to, question, options()).await {
            Ok(reply) => Some(reply),
            Err(AskError::NoReply { .. }) => None,
            Err(err) => panic!("ask failed: {err}"),
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ask_to_a_persona_is_answered_by_its_turn() {
    let world = World::new(Backend::Sqlite).await;
    let mut config = world.config();
    config.personas = two_personas();
    let _orch = Replica::start(&world, config).await;
    let worker = FakeWorker::start(&world, Duration::from_millis(20), 1).await;
    let alice = Probe::new(world.client.clone(), "alice");
    let bob = Probe::new(world.client.clone(), "bob");

    let reply = ask(&alice, "hoshi", "what is the plan?").await;
    assert_eq!(reply.from, "hoshi");
    assert_eq!(reply.to, "alice");
    assert_eq!(reply.text, "echo: what is the plan?");

    // Concurrent asks are answered one turn each, never merged.
    let (a, b) = tokio::join!(
        ask(&alice, "hoshi", "question A"),
        ask(&bob, "hoshi", "question B")
    );
    assert_eq!(a.text, "echo: question A");
    assert_eq!(b.text, "echo: question B");

    let jobs: Vec<_> = {
        let log = worker.log.lock().unwrap();
        log.turns.values().filter_map(|t| t.job.clone()).collect()
    };
    assert_eq!(jobs.len(), 3);
    for job in &jobs {
        assert_eq!(job.env.persona, "hoshi");
        assert!(job.env.restricted, "hoshi's askers are strangers");
        assert_eq!(job.instructions, "be bright");
        // The persona's allow-list and turn deadline travel with the job.
        assert_eq!(job.tools, Some(vec!["current_time".to_owned()]));
        let deadline = job.deadline_unix_ms.expect("a turn deadline");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        assert!(
            deadline > now && deadline <= now + 60_000,
            "{deadline} vs now {now}"
        );
        assert_eq!(job.message_ids.len(), 1);
        let asked = job.messages.last().unwrap();
        assert!(asked.sender_name == "alice" || asked.sender_name == "bob");
        assert_eq!(
            asked.sender_kind,
            SenderKind::Agent,
            "an asker is an agent, not a third-party person"
        );
        assert_eq!(job.session_id, ask_session_id("hoshi", &asked.sender_name));
    }
    let h = history(&world.client, &ask_session_id("hoshi", "alice")).await;
    assert_eq!(h.len(), 4, "alice's two questions and their answers");
    let h = history(&world.client, &ask_session_id("hoshi", "bob")).await;
    assert_eq!(h.len(), 2, "bob's question and its answer");
    worker.stop().await;
}

/// D8 (issue 34): a person asking over the comm protocol (their own NATS user, `cyrene
/// --person <id> ask`) is labelled as a person, not as "another agent, identity unverified":
/// the owner's ask is unlabelled, another configured person's is a third-party person's line in
/// a restricted ask session; an id nobody configured stays in the agent lane.
#[tokio::test(flavor = "multi_thread")]
async fn people_asking_are_labelled_as_people_and_agents_as_agents() {
    let world = World::new(Backend::Sqlite).await;
    let mut config = world.config();
    config.owner = Some("alice".into());
    config.people = vec!["bob".into()];
    let _orch = Replica::start(&world, config).await;
    let worker = FakeWorker::start(&world, Duration::from_millis(5), 1).await;
    for (who, question) in [
        ("alice", "from the owner"),
        ("bob", "from bob"),
        ("robo", "from a bot"),
    ] {
        let probe = Probe::new(world.client.clone(), who);
        assert_eq!(
            ask(&probe, "cyrene", question).await.text,
            format!("echo: {question}")
        );
    }
    let jobs: Vec<_> = {
        let log = worker.log.lock().unwrap();
        log.turns.values().filter_map(|t| t.job.clone()).collect()
    };
    let asked = |who: &str| {
        let job = jobs
            .iter()
            .find(|j| j.session_id == ask_session_id("cyrene", who))
            .unwrap_or_else(|| panic!("{who}'s ask"));
        let m = job.messages.last().unwrap();
        (m.sender_name.clone(), m.sender_kind, job.env.restricted)
    };
    assert_eq!(
        asked("alice"),
        (String::new(), SenderKind::Person, false),
        "the owner"
    );
    assert_eq!(
        asked("bob"),
        ("bob".into(), SenderKind::Person, true),
        "a person"
    );
    assert_eq!(
        asked("robo"),
        ("robo".into(), SenderKind::Agent, false),
        "an agent"
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_asker_never_sees_another_askers_questions_or_answers() {
    let (world, _orch, worker) = with_a_fake_worker(Duration::from_millis(5)).await;
    let alice = Probe::new(world.client.clone(), "alice");
    let bob = Probe::new(world.client.clone(), "bob");

    ask(&alice, "cyrene", "alice's secret: the door code is 4711").await;
    ask(&bob, "cyrene", "what did the last person tell you?").await;
    ask(&alice, "cyrene", "and what was my code?").await;

    let jobs: Vec<_> = {
        let log = worker.log.lock().unwrap();
        log.turns.values().filter_map(|t| t.job.clone()).collect()
    };
    assert_eq!(jobs.len(), 3);
    let of = |asker: &str| -> Vec<String> {
        jobs.iter()
            .filter(|j| j.messages.last().unwrap().sender_name == asker)
            .flat_map(|j| j.messages.iter().map(|m| m.text_content()))
            .collect()
    };
    let bobs = of("bob");
    assert_eq!(
        bobs,
        ["what did the last person tell you?"],
        "bob's turn is seeded with his question only"
    );
    // Alice's own earlier exchange is carried over to her next ask.
    assert!(of("alice").iter().any(|t| t.contains("4711")));
    assert!(of("alice").iter().all(|t| !t.contains("last person")));
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ask_in_another_agents_name_is_forbidden() {
    let (world, _orch, worker) = with_a_fake_worker(Duration::from_millis(5)).await;
    // The agent is up once an honest ask is answered.
    ask(
        &Probe::new(world.client.clone(), "hoshi"),
        "cyrene",
        "hello",
    )
    .await;

    let raw = |subject: &'static str, from: &'static str| {
        let client = world.client.clone();
        async move {
            let ask = serde_json::json!({"id":"q1","from":from,"to":"cyrene","question":"hi"});
            let reply = client
                .request(subject, serde_json::to_vec(&ask).unwrap().into())
                .await
                .unwrap();
            let body: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            body["error"]["code"]
                .as_str()
                .unwrap_or("answered")
                .to_owned()
        }
    };
    // hoshi's subject, someone else's name in the body.
    assert_eq!(
        raw("cyrene.agent.hoshi.cyrene.ask", "主人").await,
        "forbidden"
    );
    assert_eq!(
        raw("cyrene.agent.hoshi.cyrene.ask", "cyrene").await,
        "forbidden"
    );
    // A name with nothing printable in it is no asker at all.
    assert_eq!(raw("cyrene.agent.__.cyrene.ask", "[]").await, "bad_request");
    let turns = worker.log.lock().unwrap().turns.len();
    assert_eq!(turns, 1, "no turn ran for a refused ask");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ask_times_out_when_no_worker_runs_its_turn() {
    let world = World::new(Backend::Sqlite).await;
    let mut config = world.config();
    config.ask_timeout = Duration::from_millis(300);
    let _orch = Replica::start(&world, config).await;
    let probe = Probe::new(world.client.clone(), "alice");
    let err = wait_async("the agent to answer", || async {
        match probe
            .ask_with(
                "cyrene",
                "anyone?",
                AskOptions {
                    timeout: Some(Duration::from_secs(5)),
                    ..AskOptions::default()
                },
            )
            .await
        {
            Err(AskError::NoReply { .. }) => None,
            other => Some(other),
        }
    })
    .await
    .unwrap_err();
    match err {
        AskError::Remote { error, .. } => {
            assert_eq!(error.code, cyrene_protocol::ErrorCode::Timeout)
        }
        other => panic!("expected a timeout envelope, got {other}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parallel_client_gets_its_own_leg_with_a_notice() {
    let parallel = |config: &mut cyrene_orchestrator::Config| {
        config.busy.clients.parallel = vec!["phone".into()];
    };
    let (world, orch, mut jobs) = one_replica_with(Backend::Sqlite, parallel).await;
    let store = CheckpointStore::start(&world).await;
    let c = &world.client;

    let first = send_req("s1", "write about the sea", "k1", "desk");
    let (m1, leg1) = start_turn(c, &mut jobs, &first).await;
    // The live leg has saved three steps, as a worker would (no event is published), and the
    // replica that started it is replaced by one started mid-turn: the notice is read from the
    // checkpoints, so any replica builds the same.
    store
        .save_steps(&leg1, &[&["search"], &["read", "search"], &[]])
        .await;
    orch.stop().await;
    let mut config = world.config();
    parallel(&mut config);
    let _fresh = Replica::start(&world, config).await;
    // Same client: waits for its own leg.
    let m2 = send(c, &send_req("s1", "and make it short", "k2", "desk"))
        .await
        .unwrap();
    assert_eq!(m2.disposition, Disposition::Pending);

    // Another client under the parallel policy: a leg of its own, told about the live one.
    let m3 = send(c, &send_req("s1", "what's the weather", "k3", "phone"))
        .await
        .unwrap();
    assert_eq!(m3.disposition, Disposition::ParallelLeg);
    let (leg2, _) = jobs.next().await;
    assert_eq!(leg2.turn_id, m3.turn_id);
    assert!(!leg2.leg_id.is_empty());
    assert_eq!(leg2.message_ids, vec![m3.message_id.clone()]);
    let texts: Vec<String> = leg2.messages.iter().map(|m| m.text_content()).collect();
    assert_eq!(texts, ["what's the weather"], "no text of the other leg");
    let notice = leg2.notice.clone().expect("a parallel notice");
    assert_eq!(notice.other_message_id, m1.message_id);
    assert_eq!(notice.step, 3);
    assert_eq!(notice.tool_names, ["search", "read"]);
    assert_eq!(
        notice.queued, 0,
        "the desk's second message is already claimed by the desk's leg, not pending"
    );

    // Each leg steers its own client's messages.
    assert!(steer(c, &leg2, 1, 0).await.unwrap().messages.is_empty());
    let desk = steer(c, &leg1, 1, 0).await.unwrap().messages;
    assert_eq!(desk.len(), 1);
    assert_eq!(desk[0].id, m2.message_id);
    let m4 = send(c, &send_req("s1", "in celsius", "k4", "phone"))
        .await
        .unwrap();
    assert_eq!(
        m4.disposition,
        Disposition::Pending,
        "the phone's leg is running"
    );
    let phone = steer(c, &leg2, 1, 0).await.unwrap().messages;
    assert_eq!(phone.len(), 1);
    assert_eq!(phone[0].id, m4.message_id);

    // A per-send opt-in from a third client, told about the newest leg (leg2, whose rows are
    // its own owner's, `s1#<leg>`: leg1's calls are not named).
    store.save_steps(&leg2, &[&["weather"]]).await;
    let mut opt_in = send_req("s1", "me too", "k5", "tablet");
    opt_in.parallel = true;
    let m5 = send(c, &opt_in).await.unwrap();
    assert_eq!(m5.disposition, Disposition::ParallelLeg);
    let (leg3, _) = jobs.next().await;
    assert_ne!(leg3.leg_id, leg2.leg_id);
    let notice = leg3.notice.clone().expect("a parallel notice");
    assert_eq!(notice.other_message_id, m3.message_id);
    assert_eq!(
        (notice.step, notice.tool_names),
        (1, vec!["weather".to_owned()])
    );

    let took = |m: &SendAck| vec![m.message_id.clone()];
    for (job, answer, steered) in [
        (&leg1, "sea", took(&m2)),
        (&leg2, "sunny", took(&m4)),
        (&leg3, "you too", vec![]),
    ] {
        let mut done = completion(job, 1, answer);
        done.steered_ids = steered;
        assert!(complete(c, &done).await.unwrap().first);
    }
    let h = history(c, "s1").await;
    assert_eq!(
        h.iter()
            .filter(|e| e.message.role == Role::Assistant)
            .count(),
        3
    );
    assert!(h.iter().all(|e| !e.turn_id.is_empty()));
    // All legs are done: the session is back to single-leg mode.
    let next = send(c, &send_req("s1", "thanks", "k6", "desk"))
        .await
        .unwrap();
    assert_eq!(next.disposition, Disposition::TurnStarted);
    let (job, _) = jobs.next().await;
    assert!(job.leg_id.is_empty() && job.notice.is_none());
}

/// A new leg's notice counts the messages waiting besides its own (an enqueued one here).
#[tokio::test(flavor = "multi_thread")]
async fn a_parallel_legs_notice_counts_the_messages_waiting() {
    let (world, _orch, mut jobs) = one_replica_with(Backend::Postgres, |config| {
        config.busy.clients.parallel = vec!["phone".into()];
    })
    .await;
    let c = &world.client;
    let first = send_req("s1", "write about the sea", "k1", "desk");
    let (m1, _) = start_turn(c, &mut jobs, &first).await;
    for (i, text) in ["after that, the sky", "and the stars"].iter().enumerate() {
        let later = SendRequest {
            when_busy: Some(BusyPolicy::Enqueue),
            ..send_req("s1", text, &format!("q{i}"), "desk")
        };
        let ack = send(c, &later).await.unwrap();
        assert_eq!(ack.disposition, Disposition::Pending);
    }
    let m = send(c, &send_req("s1", "what's the weather", "k2", "phone"))
        .await
        .unwrap();
    assert_eq!(m.disposition, Disposition::ParallelLeg);
    let (leg, _) = jobs.next().await;
    let notice = leg.notice.expect("a parallel notice");
    assert_eq!(notice.other_message_id, m1.message_id);
    assert_eq!(
        notice.queued, 2,
        "the two enqueued messages, not the leg's own"
    );
    assert_eq!(leg.message_ids, vec![m.message_id]);
}

/// The turn of an ask may complete on the other replica: the answer still reaches the asker.
#[tokio::test(flavor = "multi_thread")]
async fn asks_are_answered_across_two_replicas() {
    let world = World::new(Backend::Postgres).await;
    let _a = Replica::start(&world, world.config()).await;
    let _b = Replica::start(&world, world.config()).await;
    let worker = FakeWorker::start(&world, Duration::from_millis(5), 1).await;
    let probe = Probe::new(world.client.clone(), "alice");
    for i in 0..6 {
        let question = format!("question {i}");
        let reply = ask(&probe, "cyrene", &question).await;
        assert_eq!(reply.text, format!("echo: {question}"));
    }
    let completes = endpoint_requests(&world.client, "complete").await;
    assert_eq!(completes.iter().sum::<u64>(), 6);
    worker.stop().await;
}

/// Waits until persona `to` answers asks at all (the agents register just after the endpoints):
/// an empty question is refused by the handler, which shows the ask was served.
async fn persona_serving(probe: &Probe, to: &str) {
    wait_async("the persona to serve asks", || async {
        match probe.ask_with(to, " ", AskOptions::default()).await {
            Err(AskError::NoReply { .. }) => None,
            Err(AskError::Remote { error, .. }) => {
                assert_eq!(error.code, cyrene_protocol::ErrorCode::BadRequest);
                Some(())
            }
            other => panic!("an empty question is refused, got {other:?}"),
        }
    })
    .await
}

/// issue 30, M4: an ask waits only behind its own asker's asks. Alice's ask turn never ends
/// here (the silent agent it waits on); bob's ask still gets its turn and its answer.
#[tokio::test(flavor = "multi_thread")]
async fn asks_of_different_askers_run_side_by_side() {
    let (world, _orch, mut jobs) = one_replica(Backend::Sqlite).await;
    let alice = Probe::new(world.client.clone(), "alice");
    let bob = Probe::new(world.client.clone(), "bob");
    persona_serving(&alice, "cyrene").await;
    let long = || AskOptions {
        timeout: Some(Duration::from_secs(30)),
        ..AskOptions::default()
    };
    let alices = tokio::spawn({
        let alice = alice.clone();
        async move { alice.ask_with("cyrene", "slow one?", long()).await }
    });
    let (job_a, _) = jobs.next().await;
    assert!(
        job_a.session_id.starts_with("alice."),
        "{}",
        job_a.session_id
    );
    let bobs = tokio::spawn({
        let bob = bob.clone();
        async move { bob.ask_with("cyrene", "quick one?", long()).await }
    });
    // Before the fix, bob's ask queued behind alice's and no job of his came.
    let (job_b, _) = jobs.next().await;
    assert!(job_b.session_id.starts_with("bob."), "{}", job_b.session_id);
    assert!(completes_first(&world.client, &job_b, 1, "bob's answer").await);
    let reply = bobs.await.unwrap().unwrap();
    assert_eq!(reply.text, "bob's answer");
    assert!(!alices.is_finished(), "alice's turn has not ended");
    assert!(completes_first(&world.client, &job_a, 1, "alice's answer").await);
    assert_eq!(alices.await.unwrap().unwrap().text, "alice's answer");
}

/// issue 30, M5: accepted asks are bounded in bytes, and every ask is answered — those over the
/// bound refused `unavailable` as they arrive, the accepted ones by their turns — never lost.
#[tokio::test(flavor = "multi_thread")]
async fn asks_over_the_byte_bound_are_refused_unavailable_and_none_is_lost() {
    let (world, _orch, mut jobs) = one_replica_with(Backend::Sqlite, |config| {
        // 64 KiB per asker
        config.ask_queue_bytes = 256 * 1024;
    })
    .await;
    let alice = Probe::new(world.client.clone(), "alice");
    persona_serving(&alice, "cyrene").await;
    // Eight asks of ~20 KB each, published in order on one connection, replies to `answers.<i>`.
    let mut replies = world.client.subscribe("answers.*").await.unwrap();
    let blob = "x".repeat(20_000);
    for i in 0..8 {
        let ask = json!({"id": format!("q{i}"), "from": "alice", "to": "cyrene",
                         "question": format!("question {i}"), "data": blob});
        world
            .client
            .publish_with_reply(
                subjects::agent_ask("alice", "cyrene"),
                format!("answers.{i}"),
                serde_json::to_vec(&ask).unwrap().into(),
            )
            .await
            .unwrap();
    }
    world.client.flush().await.unwrap();
    let reply_of = |m: &async_nats::Message| -> (usize, Result<String, ErrorCode>) {
        let i = m.subject.rsplit('.').next().unwrap().parse().unwrap();
        match cyrene_bus::service::error_from_message(m) {
            Some(err) => (i, Err(err.code)),
            None => {
                let reply: cyrene_protocol::comm::Reply =
                    serde_json::from_slice(&m.payload).unwrap();
                (i, Ok(reply.text))
            }
        }
    };
    // 64 KiB holds three: the running one and two waiting. The other five are refused while
    // the first turn still runs (before the fix they waited, and were lost on a slow consumer).
    let mut refused = Vec::new();
    while refused.len() < 5 {
        let m = tokio::time::timeout(Duration::from_secs(10), replies.next())
            .await
            .expect("the asks over the bound are refused at once")
            .unwrap();
        let (i, got) = reply_of(&m);
        assert_eq!(got, Err(ErrorCode::Unavailable), "ask {i}");
        refused.push(i);
    }
    refused.sort();
    assert_eq!(refused, vec![3, 4, 5, 6, 7]);
    // The three accepted are answered, in order, by their turns.
    for i in 0..3 {
        let (job, _) = jobs.next().await;
        let answer = format!("answer {i}");
        assert!(completes_first(&world.client, &job, 1, &answer).await);
        let m = tokio::time::timeout(Duration::from_secs(10), replies.next())
            .await
            .expect("an accepted ask is answered")
            .unwrap();
        assert_eq!(reply_of(&m), (i, Ok(answer)));
    }
}
