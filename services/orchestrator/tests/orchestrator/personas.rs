//! Several personas in one session (docs/orchestrator.md, "Several personas"), over a real
//! nats-server and real SQL: a message may address a configured persona, the session's turns run
//! as it from then on, the transcript keeps who said each answer, a restricted session refuses
//! a switch.

use crate::harness::*;
use cyrene_orchestrator::{Persona, Personas};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::{Disposition, SendRequest, SessionEnv};
use cyrene_protocol::subjects;

fn persona(id: &str, name: &str) -> Persona {
    Persona {
        id: id.into(),
        name: name.into(),
        instructions: format!("you are {id}"),
        restricted: false,
        tools: None,
        turn_timeout_ms: None,
        ..Default::default()
    }
}

fn three_personas() -> Personas {
    Personas {
        default: "cyrene".into(),
        personas: vec![
            persona("cyrene", "昔涟"),
            persona("hoshi", "星"),
            persona("nova", "新星"),
        ],
    }
}

fn to(session: &str, text: &str, persona: &str) -> SendRequest {
    SendRequest {
        persona: persona.into(),
        ..send_req(session, text, &cyrene_protocol::ids::new_id(), "cli")
    }
}

async fn three_personas_alternate(backend: Backend) {
    let (world, _replica, mut jobs) =
        one_replica_with(backend, |c| c.personas = three_personas()).await;
    let c = &world.client;

    // No persona named: the session's own (the default).
    let (_, t1) = start_turn(c, &mut jobs, &to("s1", "hi", "")).await;
    assert_eq!(t1.env.persona, "cyrene");
    assert_eq!(t1.instructions, "you are cyrene");
    assert!(completes_first(c, &t1, 1, "hello, I am Cyrene").await);

    // Addressing hoshi: this turn runs as hoshi, with the earlier answer still cyrene's.
    let (_, t2) = start_turn(c, &mut jobs, &to("s1", "hoshi, are you there?", "hoshi")).await;
    assert_eq!(t2.env.persona, "hoshi");
    assert_eq!(t2.instructions, "you are hoshi");
    let said: Vec<(Role, &str)> = t2
        .messages
        .iter()
        .map(|m| (m.role, m.sender_name.as_str()))
        .collect();
    assert_eq!(
        said,
        [
            (Role::User, ""),
            (Role::Assistant, "cyrene"),
            (Role::User, "")
        ]
    );
    assert!(completes_first(c, &t2, 1, "yes, hoshi here").await);

    // No persona named: the one the session last used.
    let (_, t3) = start_turn(c, &mut jobs, &to("s1", "and the weather?", "")).await;
    assert_eq!(t3.env.persona, "hoshi");

    // While hoshi's turn runs: a plain message is steered into it; one addressing nova is not
    // (it waits, and the next turn is nova's).
    let steered = send(c, &to("s1", "in Kyoto", "")).await.unwrap();
    assert_eq!(steered.disposition, Disposition::Pending);
    let for_nova = send(c, &to("s1", "nova, what do you think?", "nova"))
        .await
        .unwrap();
    assert_eq!(for_nova.disposition, Disposition::Pending);
    // After the switch a plain message is for nova too: it waits with it.
    let after = send(c, &to("s1", "briefly, please", "")).await.unwrap();
    assert_eq!(after.disposition, Disposition::Pending);
    let taken = steer(c, &t3, 1, 0).await.unwrap().messages;
    let ids: Vec<&str> = taken.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(
        ids,
        [steered.message_id.as_str()],
        "only the message sent to hoshi"
    );
    let mut done = completion(&t3, 1, "sunny in Kyoto");
    done.steered_ids = vec![steered.message_id.clone()];
    assert_eq!(
        done.message.as_ref().map(|m| m.sender_name.as_str()),
        Some("hoshi")
    );
    assert!(complete(c, &done).await.unwrap().first);

    let (t4, _) = jobs.next().await;
    assert_eq!(t4.env.persona, "nova");
    assert_eq!(
        t4.message_ids,
        [for_nova.message_id.clone(), after.message_id.clone()]
    );
    assert!(completes_first(c, &t4, 1, "I think so too").await);

    // Back to cyrene, by name.
    let (_, t5) = start_turn(c, &mut jobs, &to("s1", "cyrene?", "cyrene")).await;
    assert_eq!(t5.env.persona, "cyrene");
    let speakers: Vec<&str> = t5
        .messages
        .iter()
        .filter(|m| m.role == Role::Assistant)
        .map(|m| m.sender_name.as_str())
        .collect();
    assert_eq!(speakers, ["cyrene", "hoshi", "hoshi", "nova"]);
    assert!(completes_first(c, &t5, 1, "here").await);

    // The transcript keeps who said each answer.
    let answers: Vec<(String, String)> = history(c, "s1")
        .await
        .iter()
        .filter(|e| e.message.role == Role::Assistant)
        .map(|e| (e.message.sender_name.clone(), e.message.text_content()))
        .collect();
    let answers: Vec<(&str, &str)> = answers
        .iter()
        .map(|(a, b)| (a.as_str(), b.as_str()))
        .collect();
    assert_eq!(
        answers,
        [
            ("cyrene", "hello, I am Cyrene"),
            ("hoshi", "yes, hoshi here"),
            ("hoshi", "sunny in Kyoto"),
            ("nova", "I think so too"),
            ("cyrene", "here"),
        ]
    );

    // An unknown persona: refused, nothing stored.
    let before = history(c, "s1").await.len();
    let err = send(c, &to("s1", "anyone?", "ghost")).await.unwrap_err();
    assert_eq!(code(&err), ErrorCode::BadRequest);
    assert_eq!(history(c, "s1").await.len(), before);
}

on_both_backends!(three_personas_alternate: three_personas_alternate_on_sqlite, three_personas_alternate_on_postgres);

async fn bridge(
    c: &async_nats::Client,
    req: &SendRequest,
) -> Result<cyrene_protocol::session::SendAck, cyrene_bus::RequestError> {
    cyrene_bus::request_json(c, subjects::BRIDGE_SESSION_SEND, req, TIMEOUT).await
}

/// A restricted session (a group, a stranger) always answers as its own persona: a switch is
/// refused with `forbidden` and nothing is stored; naming its own persona is no switch.
#[tokio::test(flavor = "multi_thread")]
async fn a_restricted_session_refuses_a_persona_switch() {
    let (world, _replica, mut jobs) = one_replica_with(Backend::Sqlite, |c| {
        c.personas = three_personas();
        c.owner = Some("alice".into());
    })
    .await;
    let c = &world.client;
    let group = SendRequest {
        env: Some(SessionEnv {
            restricted: true,
            persona: String::new(),
        }),
        message: user("hello all").sender("阿明"),
        ..to("alice.mx-g1", "", "")
    };
    bridge(c, &group).await.unwrap();
    let (job, _) = jobs.next().await;
    assert_eq!(job.env.persona, "cyrene");
    assert!(completes_first(c, &job, 1, "hi").await);

    let switch = SendRequest {
        persona: "hoshi".into(),
        idempotency_key: "k-switch".into(),
        ..group.clone()
    };
    let err = bridge(c, &switch).await.unwrap_err();
    assert_eq!(code(&err), ErrorCode::Forbidden, "{err}");
    assert!(err.to_string().contains("restricted"), "{err}");
    assert_eq!(history(c, "alice.mx-g1").await.len(), 2, "nothing stored");

    let same = SendRequest {
        persona: "cyrene".into(),
        idempotency_key: "k-same".into(),
        ..group
    };
    bridge(c, &same).await.unwrap();
    let (job, _) = jobs.next().await;
    assert_eq!(job.env.persona, "cyrene");
}
