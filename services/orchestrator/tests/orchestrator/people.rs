//! `cyrene.person.<p>.session.list`: a person's sessions, never another's (docs/web.md).

use crate::harness::*;
use cyrene_bus::request_json;
use cyrene_protocol::ErrorCode;
use cyrene_protocol::ids::new_id;
use cyrene_protocol::session::{SessionListRequest, SessionListResponse};
use cyrene_protocol::subjects;

async fn list(
    client: &async_nats::Client,
    person: &str,
    limit: Option<u32>,
) -> Result<SessionListResponse, cyrene_bus::RequestError> {
    let subject = subjects::person(person, subjects::PERSON_SESSION_LIST).unwrap();
    request_json(client, &subject, &SessionListRequest { limit }, TIMEOUT).await
}

fn ids(reply: &SessionListResponse) -> Vec<&str> {
    reply
        .sessions
        .iter()
        .map(|s| s.session_id.as_str())
        .collect()
}

async fn a_person_lists_their_own_sessions_only(backend: Backend) {
    let (world, _replica, _jobs) = one_replica(backend).await;
    let c = &world.client;
    for (person, session) in [
        ("alice", "alice.s1"),
        ("alice", "alice.s2"),
        // `_` is a LIKE wildcard: alice_x's sessions are not alice's, nor alicex's
        ("alice_x", "alice_x.s1"),
        ("alicex", "alicex.s1"),
        ("bob", "bob.s1"),
    ] {
        let subject = subjects::person(person, subjects::PERSON_SESSION_SEND).unwrap();
        let req = send_req(session, "hi", &new_id(), "web");
        let _: cyrene_protocol::session::SendAck =
            request_json(c, &subject, &req, TIMEOUT).await.unwrap();
    }
    // a session of nobody in particular is nobody's to list
    send_ok(c, "s1", "hi").await;

    let alice = list(c, "alice", None).await.unwrap();
    let mut got = ids(&alice);
    got.sort_unstable();
    assert_eq!(got, ["alice.s1", "alice.s2"]);
    assert!(alice.sessions.iter().all(|s| s.created_at_ms > 0));
    assert_eq!(
        ids(&list(c, "alice_x", None).await.unwrap()),
        ["alice_x.s1"]
    );
    assert_eq!(ids(&list(c, "bob", None).await.unwrap()), ["bob.s1"]);
    assert_eq!(list(c, "alice", Some(1)).await.unwrap().sessions.len(), 1);
    assert!(list(c, "carol", None).await.unwrap().sessions.is_empty());
    let err = list(c, "alice", Some(0)).await.unwrap_err();
    assert_eq!(code(&err), ErrorCode::BadRequest);
}

on_both_backends!(a_person_lists_their_own_sessions_only:
    a_person_lists_their_own_sessions_only_sqlite,
    a_person_lists_their_own_sessions_only_postgres);

#[tokio::test(flavor = "multi_thread")]
async fn a_person_uploads_documents_into_their_own_sessions_only() {
    use base64::Engine as _;
    use cyrene_protocol::document::{UploadAck, UploadRequest};
    let (world, _replica) = sqlite_replica().await;
    let c = &world.client;
    let subject = subjects::person("alice", subjects::PERSON_DOCUMENT_UPLOAD).unwrap();
    let upload = |session: &str| UploadRequest {
        session_id: session.into(),
        name: "notes.txt".into(),
        mime: "image/png".into(),
        data: base64::engine::general_purpose::STANDARD.encode("picnic: tea, cake"),
        last: true,
        ..UploadRequest::default()
    };
    let ack: UploadAck = request_json(c, &subject, &upload("alice.s1"), TIMEOUT)
        .await
        .unwrap();
    let document = ack.document.expect("the last chunk issues the document");
    match document.part {
        cyrene_protocol::message::Part::Document { mime, .. } => {
            assert!(
                mime.starts_with("text/plain"),
                "sniffed, not claimed: {mime}"
            );
        }
        other => panic!("not a document part: {other:?}"),
    }
    for other in ["bob.s1", "s1"] {
        let err = request_json::<_, UploadAck>(c, &subject, &upload(other), TIMEOUT)
            .await
            .unwrap_err();
        assert_eq!(code(&err), ErrorCode::Forbidden, "{other}");
    }
}
