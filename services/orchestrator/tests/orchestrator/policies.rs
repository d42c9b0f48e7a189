//! Double-texting policies (`enqueue`, `reject`; `steer` and `parallel` are in fence.rs and
//! agents.rs) and asks between agents (their `data`, their chain), on both backends.

use crate::harness::*;
use cyrene_comm::{AskError, AskOptions, Probe};
use cyrene_orchestrator::agents::{ASK_DATA_LABEL, ask_session_id};
use cyrene_orchestrator::{Persona, Personas};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::message::{Part, Role};
use cyrene_protocol::session::{BusyPolicy, Disposition};
use std::time::{Duration, Instant};

/// An enqueued message waits for the next turn: no boundary of the running turn claims it, even
/// when a later (steered) message is claimed there; the next turn consumes it, once.
async fn an_enqueued_message_waits_for_the_next_turn(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica_with(backend, |config| {
        config.busy.sessions.enqueue = vec!["s2".into()];
    })
    .await;
    let c = &world.client;

    let (m1, turn1) = start_turn(c, &mut jobs, &send_req("s1", "write a poem", "k1", "desk")).await;
    // Per message: `when_busy: enqueue`.
    let mut later = send_req("s1", "then a limerick", "k2", "desk");
    later.when_busy = Some(BusyPolicy::Enqueue);
    let m2 = send(c, &later).await.unwrap();
    assert_eq!(m2.disposition, Disposition::Pending);
    assert!(m2.turn_id.is_empty());
    // A resend of the key gets the first ack back, unchanged.
    assert_eq!(send(c, &later).await.unwrap(), m2);
    // A plain message after it is steered in; the enqueued one is not.
    let m3 = send(c, &send_req("s1", "make it rhyme", "k3", "desk"))
        .await
        .unwrap();
    assert_eq!(m3.disposition, Disposition::Pending);
    let steered = steer(c, &turn1, 1, 0).await.unwrap().messages;
    let ids: Vec<&str> = steered.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [m3.message_id.as_str()], "only the plain message");
    assert_eq!(steer(c, &turn1, 1, 0).await.unwrap().messages, steered);

    let mut done = completion(&turn1, 1, "a poem that rhymes");
    done.steered_ids = vec![m3.message_id.clone()];
    assert!(complete(c, &done).await.unwrap().first);
    let (turn2, _) = jobs.next().await;
    assert_eq!(turn2.message_ids, vec![m2.message_id.clone()]);
    assert_eq!(
        turn2.messages.last().map(|m| m.text_content()).as_deref(),
        Some("then a limerick")
    );
    assert!(steer(c, &turn2, 1, 0).await.unwrap().messages.is_empty());
    assert!(completes_first(c, &turn2, 1, "a limerick").await);

    let h = history(c, "s1").await;
    let turn_of = |id: &str| {
        let found: Vec<_> = h.iter().filter(|e| e.id == id).collect();
        assert_eq!(found.len(), 1, "{id} appears once");
        found[0].turn_id.clone()
    };
    assert_eq!(turn_of(&m1.message_id), turn1.turn_id);
    assert_eq!(turn_of(&m3.message_id), turn1.turn_id);
    assert_eq!(
        turn_of(&m2.message_id),
        turn2.turn_id,
        "consumed by the next turn"
    );

    // Per session (`--enqueue-sessions`): the same, without a field on the message.
    send(c, &send_req("s2", "first", "k1", "desk"))
        .await
        .unwrap();
    let (s2_turn1, _) = jobs.next().await;
    let queued = send(c, &send_req("s2", "second", "k2", "phone"))
        .await
        .unwrap();
    assert_eq!(queued.disposition, Disposition::Pending);
    assert!(steer(c, &s2_turn1, 1, 0).await.unwrap().messages.is_empty());
    assert!(completes_first(c, &s2_turn1, 1, "one").await);
    let (s2_turn2, _) = jobs.next().await;
    assert_eq!(s2_turn2.message_ids, vec![queued.message_id]);
}

on_both_backends!(
    an_enqueued_message_waits_for_the_next_turn:
    an_enqueued_message_waits_for_the_next_turn_on_sqlite,
    an_enqueued_message_waits_for_the_next_turn_on_postgres
);

/// While a turn runs, a message under the reject policy gets `conflict` and nothing is stored;
/// once the session is idle the same message (same key) starts a turn.
async fn a_rejected_message_is_refused_and_not_stored(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica_with(backend, |config| {
        config.busy.clients.reject = vec!["bot".into()];
    })
    .await;
    let c = &world.client;

    // Idle: the reject policy does not apply.
    let (_, turn1) = start_turn(
        c,
        &mut jobs,
        &send_req("s1", "summarise the news", "k1", "bot"),
    )
    .await;
    // By client list, and per message.
    let by_client = send_req("s1", "are you done?", "k2", "bot");
    let err = send(c, &by_client).await.unwrap_err();
    assert_eq!(code(&err), ErrorCode::Conflict, "{err}");
    let mut by_field = send_req("s1", "hurry", "k3", "desk");
    by_field.when_busy = Some(BusyPolicy::Reject);
    assert_eq!(
        code(&send(c, &by_field).await.unwrap_err()),
        ErrorCode::Conflict
    );
    // Nothing stored: no history entry, nothing to steer.
    assert_eq!(history(c, "s1").await.len(), 1);
    assert!(steer(c, &turn1, 1, 0).await.unwrap().messages.is_empty());
    // A session that does not exist yet and is busy cannot happen; one that is idle accepts.
    assert!(completes_first(c, &turn1, 1, "the news").await);
    let again = send(c, &by_client).await.unwrap();
    assert_eq!(again.disposition, Disposition::TurnStarted);
    let (turn2, _) = jobs.next().await;
    assert_eq!(turn2.message_ids, vec![again.message_id.clone()]);
    let h = history(c, "s1").await;
    assert_eq!(h.len(), 3, "m1, its answer, the accepted resend");

    // `parallel: true` and another `when_busy` disagree.
    let mut both = send_req("s1", "x", "k9", "desk");
    both.parallel = true;
    both.when_busy = Some(BusyPolicy::Enqueue);
    assert_eq!(
        code(&send(c, &both).await.unwrap_err()),
        ErrorCode::BadRequest
    );
}

on_both_backends!(
    a_rejected_message_is_refused_and_not_stored:
    a_rejected_message_is_refused_and_not_stored_on_sqlite,
    a_rejected_message_is_refused_and_not_stored_on_postgres
);

fn two_personas() -> Personas {
    let persona = |id: &str, name: &str| Persona {
        id: id.into(),
        name: name.into(),
        instructions: format!("be {name}"),
        restricted: false,
        tools: None,
        turn_timeout_ms: None,
        ..Default::default()
    };
    Personas {
        default: "cyrene".into(),
        personas: vec![persona("cyrene", "昔涟"), persona("hoshi", "星")],
    }
}

/// Asks with retries while the agents register.
async fn ask_with(probe: &Probe, to: &str, question: &str, options: AskOptions) -> AskResult {
    let started = Instant::now();
    loop {
        let result = probe.ask_with(to, question, options.clone()).await;
        match result {
            Err(AskError::NoReply { .. }) if started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

type AskResult = Result<cyrene_protocol::comm::Reply, AskError>;

/// alice asks hoshi; hoshi's turn asks cyrene; cyrene's turn asks hoshi back. The last ask
/// would wait on hoshi, who waits on cyrene: it is refused at once with `conflict`, and the
/// outer asks are still answered. The ask's `data` reaches the turn as a JSON part.
async fn an_ask_back_along_the_chain_is_refused_at_once(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica_with(backend, |config| {
        config.personas = two_personas();
    })
    .await;
    let c = &world.client;
    let options = |chain: Vec<String>| AskOptions {
        timeout: Some(Duration::from_secs(20)),
        data: serde_json::json!({"order": 4711, "items": ["tea"]}),
        chain,
        ..AskOptions::default()
    };

    let alice = Probe::new(c.clone(), "alice");
    let outer = tokio::spawn({
        let (alice, options) = (alice.clone(), options(Vec::new()));
        async move { ask_with(&alice, "hoshi", "what did I order?", options).await }
    });
    let (hoshi_turn, _) = jobs.next().await;
    assert_eq!(hoshi_turn.session_id, ask_session_id("hoshi", "alice"));
    assert_eq!(hoshi_turn.ask_chain, vec!["hoshi".to_owned()]);
    // The data is a part of the ask's message, after the question.
    let asked = hoshi_turn.messages.last().unwrap();
    assert_eq!(asked.role, Role::User);
    assert_eq!(asked.content[0], Part::text("what did I order?"));
    assert_eq!(
        asked.content[1],
        Part::text(format!(
            "{ASK_DATA_LABEL}\n```json\n{{\"items\":[\"tea\"],\"order\":4711}}\n```"
        ))
    );

    // hoshi's turn asks cyrene (as the worker's ask_agent does: the job's chain).
    let hoshi = Probe::new(c.clone(), "hoshi");
    let middle = tokio::spawn({
        let (hoshi, options) = (hoshi.clone(), options(hoshi_turn.ask_chain.clone()));
        async move { ask_with(&hoshi, "cyrene", "do you know?", options).await }
    });
    let (cyrene_turn, _) = jobs.next().await;
    assert_eq!(cyrene_turn.session_id, ask_session_id("cyrene", "hoshi"));
    assert_eq!(cyrene_turn.ask_chain, ["hoshi", "cyrene"]);

    // cyrene's turn asks hoshi back: a cycle, refused at once.
    let cyrene = Probe::new(c.clone(), "cyrene");
    let started = Instant::now();
    let cyrene_chain = || options(cyrene_turn.ask_chain.clone());
    let back = ask_with(&cyrene, "hoshi", "what did alice order?", cyrene_chain()).await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "refused at once"
    );
    match back {
        Err(AskError::Remote { error, .. }) => {
            assert_eq!(error.code, ErrorCode::Conflict);
            assert!(error.message.contains("cycle"), "{}", error.message);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    // So is an ask to itself, and nothing was stored for either.
    let own = ask_with(&cyrene, "cyrene", "me?", cyrene_chain()).await;
    assert!(
        matches!(own, Err(AskError::Remote { ref error, .. }) if error.code == ErrorCode::Conflict)
    );
    assert!(
        history(c, &ask_session_id("hoshi", "cyrene"))
            .await
            .is_empty()
    );

    // The chain unwinds: cyrene answers hoshi, hoshi answers alice.
    assert!(completes_first(c, &cyrene_turn, 1, "tea, I think").await);
    assert_eq!(middle.await.unwrap().unwrap().text, "tea, I think");
    assert!(completes_first(c, &hoshi_turn, 1, "tea").await);
    assert_eq!(outer.await.unwrap().unwrap().text, "tea");
}

on_both_backends!(
    an_ask_back_along_the_chain_is_refused_at_once:
    an_ask_back_along_the_chain_is_refused_at_once_on_sqlite,
    an_ask_back_along_the_chain_is_refused_at_once_on_postgres
);
