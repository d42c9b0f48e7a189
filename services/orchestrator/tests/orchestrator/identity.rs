//! Who speaks (docs/security.md, "The owner and bridges"), over a real nats-server and real SQL:
//! only the bridge subject labels third parties and creates restricted sessions, and only in the
//! owner's sessions; the owner's messages stay unlabelled; another person's are labelled by the
//! runtime.

use crate::harness::*;
use cyrene_bus::request_json;
use cyrene_protocol::ErrorCode;
use cyrene_protocol::session::{Disposition, SendAck, SendRequest, SessionEnv};
use cyrene_protocol::subjects;

fn restricted() -> Option<SessionEnv> {
    Some(SessionEnv {
        restricted: true,
        persona: String::new(),
    })
}

/// A message to `session` labelled `name` (empty: unlabelled) with `env`.
fn labelled(session: &str, name: &str, env: Option<SessionEnv>, key: &str) -> SendRequest {
    SendRequest {
        message: user("hello there").sender(name),
        env,
        ..send_req(session, "", key, "matrix")
    }
}

async fn send_on(
    client: &async_nats::Client,
    subject: &str,
    req: &SendRequest,
) -> Result<SendAck, cyrene_bus::RequestError> {
    request_json(client, subject, req, TIMEOUT).await
}

/// The error code `req` on `subject` is refused with.
async fn refused(client: &async_nats::Client, subject: &str, req: &SendRequest) -> ErrorCode {
    code(&send_on(client, subject, req).await.unwrap_err())
}

async fn identity_scenario(backend: Backend) {
    let (world, _replica, mut jobs) =
        one_replica_with(backend, |c| c.owner = Some("alice".into())).await;
    let c = &world.client;
    let bridge = subjects::BRIDGE_SESSION_SEND;
    let alice = subjects::person("alice", subjects::PERSON_SESSION_SEND).unwrap();
    let bob = subjects::person("bob", subjects::PERSON_SESSION_SEND).unwrap();

    // A client or a person claiming a third party's name or a restricted session: forbidden,
    // and nothing is stored.
    for (subject, session) in [
        (subjects::SESSION_SEND, "g1"),
        (alice.as_str(), "alice.g1"),
        (bob.as_str(), "bob.g1"),
    ] {
        let name = labelled(session, "阿明", None, "k1");
        assert_eq!(
            refused(c, subject, &name).await,
            ErrorCode::Forbidden,
            "{subject}"
        );
        let env = labelled(session, "", restricted(), "k2");
        assert_eq!(
            refused(c, subject, &env).await,
            ErrorCode::Forbidden,
            "{subject}"
        );
        assert!(history(c, session).await.is_empty(), "{session}");
    }

    // The bridge: a stranger in a restricted session of the owner's, on the default persona.
    let group = labelled("alice.mx-g1", "阿明", restricted(), "$ev1");
    let ack = send_on(c, bridge, &group).await.unwrap();
    assert_eq!(ack.disposition, Disposition::TurnStarted);
    let (job, _) = jobs.next().await;
    assert!(job.env.restricted);
    assert_eq!(job.env.persona, "cyrene");
    assert_eq!(job.messages.last().unwrap().sender_name, "阿明");
    // The Matrix event id is the key: a resend is the same message.
    let again = send_on(c, bridge, &group).await.unwrap();
    assert_eq!(again, ack);
    // The owner's line in that session: unlabelled, on her own subject or the bridge's.
    let owner = labelled("alice.mx-g1", "", None, "o1");
    send_on(c, &alice, &owner).await.unwrap();

    // Another persona for a restricted session: refused.
    let persona = labelled(
        "alice.mx-g2",
        "阿明",
        Some(SessionEnv {
            restricted: true,
            persona: "hoshi".into(),
        }),
        "$ev2",
    );
    assert_eq!(refused(c, bridge, &persona).await, ErrorCode::BadRequest);
    // A third party in an open session (the owner's own chat, created unrestricted): refused.
    let dm = labelled("alice.dm", "", None, "$ev3");
    send_on(c, bridge, &dm).await.unwrap();
    let (job, _) = jobs.next().await;
    assert!(!job.env.restricted);
    assert_eq!(job.messages.last().unwrap().sender_name, "");
    let stranger = labelled("alice.dm", "阿明", restricted(), "$ev4");
    assert_eq!(refused(c, bridge, &stranger).await, ErrorCode::Forbidden);
    assert_eq!(history(c, "alice.dm").await.len(), 1, "nothing stored");
    // Nobody else's session: another person's, nobody's.
    for session in ["bob.g1", "g1"] {
        let other = labelled(session, "阿明", restricted(), "$ev5");
        assert_eq!(refused(c, bridge, &other).await, ErrorCode::Forbidden);
    }
    let blank = labelled("alice.mx-g3", " ", restricted(), "$ev6");
    assert_eq!(refused(c, bridge, &blank).await, ErrorCode::BadRequest);

    // Bob is not the owner: his message is labelled with his id, his session restricted.
    send_on(c, &bob, &labelled("bob.s1", "", None, "b1"))
        .await
        .unwrap();
    let (job, _) = jobs.next().await;
    assert_eq!(job.session_id, "bob.s1");
    assert!(job.env.restricted);
    assert_eq!(job.messages.last().unwrap().sender_name, "bob");
}

on_both_backends!(identity_scenario:
    identity_is_configuration_and_only_the_bridge_labels_third_parties_sqlite,
    identity_is_configuration_and_only_the_bridge_labels_third_parties_postgres);

#[tokio::test(flavor = "multi_thread")]
async fn without_an_owner_the_bridge_is_refused_and_nobody_is_labelled() {
    let (world, _replica, mut jobs) = one_replica(Backend::Sqlite).await;
    let c = &world.client;
    let group = labelled("alice.mx-g1", "阿明", restricted(), "$ev1");
    let refusal = refused(c, subjects::BRIDGE_SESSION_SEND, &group).await;
    assert_eq!(refusal, ErrorCode::Forbidden);
    let bob = subjects::person("bob", subjects::PERSON_SESSION_SEND).unwrap();
    send_on(c, &bob, &labelled("bob.s1", "", None, "b1"))
        .await
        .unwrap();
    let (job, _) = jobs.next().await;
    assert!(!job.env.restricted);
    assert_eq!(job.messages.last().unwrap().sender_name, "");
}

/// A context-only message from the bridge (docs/orchestrator.md, "Context-only messages"):
/// stored with its sender, idempotent by its key, no turn and no steer; every later turn's view
/// holds it in seq order. Only the bridge subject takes it.
async fn context_only_scenario(backend: Backend) {
    let (world, _replica, mut jobs) =
        one_replica_with(backend, |c| c.owner = Some("alice".into())).await;
    let c = &world.client;
    let bridge = subjects::BRIDGE_SESSION_SEND;
    let session = "alice.mxr-room1";
    let said = |name: &str, text: &str, key: &str, context_only: bool| SendRequest {
        message: user(text).sender(name),
        env: restricted(),
        context_only,
        ..send_req(session, "", key, "matrix")
    };

    // Nobody but the bridge passes something on as context.
    let alice = subjects::person("alice", subjects::PERSON_SESSION_SEND).unwrap();
    for (subject, to) in [(subjects::SESSION_SEND, "c1"), (alice.as_str(), "alice.c1")] {
        let mut req = send_req(to, "psst", "k1", "cli");
        req.context_only = true;
        assert_eq!(refused(c, subject, &req).await, ErrorCode::Forbidden);
        assert!(history(c, to).await.is_empty(), "{to}");
    }

    let lunch = said("阿明", "lunch at noon?", "$c1", true);
    let ack = send_on(c, bridge, &lunch).await.unwrap();
    assert_eq!(ack.disposition, Disposition::ContextOnly);
    assert!(ack.turn_id.is_empty());
    assert_eq!(send_on(c, bridge, &lunch).await.unwrap(), ack, "idempotent");

    // The next addressed message starts the next turn: had the context line started one, that
    // turn's job would come first, holding it alone.
    let ask = said("小红", "Cyrene, is noon fine?", "$a1", false);
    let started = send_on(c, bridge, &ask).await.unwrap();
    assert_eq!(started.disposition, Disposition::TurnStarted);
    let (job, attempt) = jobs.next().await;
    assert_eq!(job.turn_id, started.turn_id);
    let view: Vec<(String, String)> = job
        .messages
        .iter()
        .map(|m| (m.sender_name.clone(), m.text_content()))
        .collect();
    assert_eq!(
        view,
        [
            ("阿明".to_owned(), "lunch at noon?".to_owned()),
            ("小红".to_owned(), "Cyrene, is noon fine?".to_owned())
        ]
    );
    assert_eq!(job.message_ids, std::slice::from_ref(&started.message_id));

    // While the turn runs: context joins the transcript, is not steered, starts nothing.
    let late = said("阿明", "or one o'clock", "$c2", true);
    let late_ack = send_on(c, bridge, &late).await.unwrap();
    assert_eq!(late_ack.disposition, Disposition::ContextOnly);
    let steered = steer(c, &job, attempt, job.base_seq).await.unwrap();
    assert!(steered.messages.is_empty(), "{:?}", steered.messages);
    complete(c, &completion(&job, attempt, "Noon is fine."))
        .await
        .unwrap();

    // Nothing runs now (the next message starts a turn), and its view has everything in order.
    let again = said("小红", "Cyrene, and tomorrow?", "$a2", false);
    let next = send_on(c, bridge, &again).await.unwrap();
    assert_eq!(next.disposition, Disposition::TurnStarted);
    let (job, _) = jobs.next().await;
    assert_eq!(job.turn_id, next.turn_id);
    let texts: Vec<String> = job.messages.iter().map(|m| m.text_content()).collect();
    assert_eq!(
        texts,
        [
            "lunch at noon?",
            "Cyrene, is noon fine?",
            "or one o'clock",
            "Noon is fine.",
            "Cyrene, and tomorrow?"
        ]
    );
    assert_eq!(job.messages[2].sender_name, "阿明");
    // The transcript lists the context lines with no turn.
    let transcript = history(c, session).await;
    let context: Vec<&str> = transcript
        .iter()
        .filter(|e| e.turn_id.is_empty())
        .map(|e| e.id.as_str())
        .collect();
    assert_eq!(
        context,
        [ack.message_id.as_str(), late_ack.message_id.as_str()]
    );
}

on_both_backends!(context_only_scenario:
    a_context_only_message_joins_the_view_without_a_turn_sqlite,
    a_context_only_message_joins_the_view_without_a_turn_postgres);
