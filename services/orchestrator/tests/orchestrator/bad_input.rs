//! Bad input of each kind gets the documented error, and the service keeps serving; a database
//! outage gets `unavailable`, never an ack.

use crate::harness::*;
use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::session::Disposition;
use cyrene_protocol::subjects;
use serde_json::{Value, json};
use std::time::Duration;

/// Sends raw bytes; returns the error code from the body and checks the headers agree.
async fn refused(client: &async_nats::Client, subject: &str, body: Vec<u8>) -> (ErrorCode, String) {
    let reply = tokio::time::timeout(
        Duration::from_secs(5),
        client.request(subject.to_owned(), body.into()),
    )
    .await
    .expect("an answer, not a hang")
    .unwrap();
    let headers = reply.headers.clone().expect("micro error headers");
    let status: u16 = headers
        .get(NATS_SERVICE_ERROR_CODE)
        .unwrap()
        .as_str()
        .parse()
        .unwrap();
    assert!(headers.get(NATS_SERVICE_ERROR).is_some());
    let v: Value = serde_json::from_slice(&reply.payload).unwrap();
    let code: ErrorCode = serde_json::from_value(v["error"]["code"].clone()).unwrap();
    assert_eq!(code.status(), status, "headers and body agree");
    (
        code,
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

fn doc(v: Value) -> Vec<u8> {
    serde_json::to_vec(&v).unwrap()
}

/// A steer of `session`'s turn `turn` at step 1, attempt 1, after `after_seq`.
fn steer_doc(session: &str, turn: &str, after_seq: i64) -> Vec<u8> {
    doc(json!({"session_id":session,"turn_id":turn,"step":1,"after_seq":after_seq,"attempt":1}))
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_the_documented_error_and_the_service_keeps_serving() {
    let world = World::new(Backend::Sqlite).await;
    let mut config = world.config();
    config.max_message_bytes = 2048;
    let _orch = Replica::start(&world, config).await;
    let c = &world.client;
    let msg = json!({"role":"user","content":"hi"});
    let cases: Vec<(&str, Vec<u8>, ErrorCode, &str)> = vec![
        (
            subjects::SESSION_SEND,
            b"{".to_vec(),
            ErrorCode::BadRequest,
            "invalid request",
        ),
        (
            subjects::SESSION_SEND,
            b"".to_vec(),
            ErrorCode::BadRequest,
            "empty",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1","message":msg,"priority":1})),
            ErrorCode::BadRequest,
            "unknown field",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":7,"message":msg})),
            ErrorCode::BadRequest,
            "invalid type",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1.>","message":msg})),
            ErrorCode::BadRequest,
            "session_id",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1","message":msg,"client_id":"a b"})),
            ErrorCode::BadRequest,
            "client_id",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1",
            "message":{"role":"assistant","content":"hi"}})),
            ErrorCode::BadRequest,
            "role must be user",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1",
            "message":{"role":"user","content":"hi","sender_name":"hoshi","sender_kind":"agent"}})),
            ErrorCode::BadRequest,
            "sender_kind agent",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1","message":{"role":"user","content":" "}})),
            ErrorCode::BadRequest,
            "empty",
        ),
        (
            subjects::SESSION_SEND,
            doc(
                json!({"session_id":"s1","message":{"role":"user","content":[
            {"type":"tool_result","tool_call_id":"c","text":"x"}]}}),
            ),
            ErrorCode::BadRequest,
            "only hold",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1",
            "message":{"role":"user","content":"x".repeat(4000)}})),
            ErrorCode::TooLarge,
            "limit",
        ),
        (
            subjects::SESSION_SEND,
            doc(json!({"session_id":"s1","message":msg,
            "env":{"persona":"nobody"}})),
            ErrorCode::BadRequest,
            "unknown persona",
        ),
        (
            subjects::SESSION_HISTORY,
            doc(json!({"session_id":"s1","limit":0})),
            ErrorCode::BadRequest,
            "limit",
        ),
        (
            subjects::SESSION_HISTORY,
            doc(json!({"session":"s1"})),
            ErrorCode::BadRequest,
            "unknown field",
        ),
        (
            subjects::TURN_STEER,
            steer_doc("s1", "t.1", 0),
            ErrorCode::BadRequest,
            "turn_id",
        ),
        (
            subjects::TURN_STEER,
            steer_doc("s1", "t1", -1),
            ErrorCode::BadRequest,
            "invalid",
        ),
        (
            subjects::TURN_STEER,
            steer_doc("nope", "t1", 0),
            ErrorCode::NotFound,
            "no session",
        ),
        (
            subjects::TURN_COMPLETE,
            doc(json!({"session_id":"s1","turn_id":"t1","attempt":1,
            "outcome":"maybe"})),
            ErrorCode::BadRequest,
            "invalid",
        ),
        (
            subjects::TURN_COMPLETE,
            doc(json!({"session_id":"s1","turn_id":"t1","attempt":1,
            "outcome":"final","message":{"role":"user","content":"hi"}})),
            ErrorCode::BadRequest,
            "assistant",
        ),
    ];
    for (subject, body, want, needle) in cases {
        let (code, message) = refused(c, subject, body).await;
        assert_eq!(code, want, "{subject}: {message}");
        assert!(
            message.contains(needle),
            "{subject}: {message:?} lacks {needle:?}"
        );
    }
    // Still serving.
    let ack = send_ok(c, "s1", "still here").await;
    assert_eq!(ack.disposition, Disposition::TurnStarted);
    assert_eq!(ack.seq, 1, "no refused request stored anything");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lost_database_gets_unavailable_and_no_ack() {
    let world = World::new(Backend::Postgres).await;
    let mut config = world.config();
    config.db_timeout = Duration::from_secs(2);
    config.pool.acquire_timeout = Duration::from_millis(500);
    let _orch = Replica::start(&world, config).await;
    let c = &world.client;
    send_ok(c, "s1", "stored").await;
    world.pg.as_ref().unwrap().drop_now().await;
    for _ in 0..3 {
        let err = send(c, &send_req("s1", "lost?", "k", "cli"))
            .await
            .unwrap_err();
        assert_eq!(code(&err), ErrorCode::Unavailable, "{err}");
    }
    let err = history_raw(
        c,
        &cyrene_protocol::session::HistoryRequest {
            session_id: "s1".into(),
            limit: None,
            before_seq: None,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(code(&err), ErrorCode::Unavailable);
}
