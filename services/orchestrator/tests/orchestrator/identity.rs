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
