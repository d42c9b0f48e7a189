//! The service over a real nats-server: every endpoint with the docs/architecture.md §9 shapes,
//! every bad input answered with its documented code (headers and body) while the service keeps
//! serving, the micro-service metadata, and the typed client against the running service.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE};
use common::{PgTestDb, RunningService, big_state, checkpoint, fenced, note};
use cyrene_checkpoint_client::{CheckpointClient, Error as ClientError};
use cyrene_checkpoint_store::Config;
use cyrene_protocol::checkpoint::{Checkpoint, RetainRequest};
use cyrene_protocol::{ErrorCode, ErrorEnvelope, subjects};
use cyrene_test_support::{NatsServer, micro};
use serde_json::{Value, json};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

fn sqlite_config(dir: &tempfile::TempDir) -> Config {
    let mut config = Config::new(dir.path().join("data"));
    config.max_state_bytes = 2048;
    config
}

/// Sends raw bytes and returns the reply as JSON, or the error code after checking that the
/// headers and the envelope agree.
async fn raw(client: &async_nats::Client, subject: &str, body: &[u8]) -> Result<Value, ErrorCode> {
    let reply = tokio::time::timeout(
        TIMEOUT,
        client.request(subject.to_owned(), body.to_vec().into()),
    )
    .await
    .expect("a reply within the timeout")
    .expect("a reply");
    let Some(headers) = reply
        .headers
        .as_ref()
        .filter(|h| h.get(NATS_SERVICE_ERROR_CODE).is_some())
    else {
        return Ok(serde_json::from_slice(&reply.payload).unwrap());
    };
    let envelope: ErrorEnvelope = serde_json::from_slice(&reply.payload).unwrap();
    let status = headers.get(NATS_SERVICE_ERROR_CODE).unwrap().as_str();
    assert_eq!(status, envelope.error.code.status().to_string());
    assert!(!envelope.error.message.is_empty());
    assert!(headers.get(NATS_SERVICE_ERROR).is_some());
    Err(envelope.error.code)
}

async fn json_req(
    client: &async_nats::Client,
    subject: &str,
    body: Value,
) -> Result<Value, ErrorCode> {
    raw(client, subject, body.to_string().as_bytes()).await
}

/// `cp` saved over the bus: the saved row, or the code it was refused with.
async fn save(client: &async_nats::Client, cp: &Checkpoint) -> Result<Value, ErrorCode> {
    let body = serde_json::to_vec(cp).unwrap();
    raw(client, subjects::CHECKPOINT_SAVE, &body).await
}

/// A request that must be answered (not refused).
async fn answered(client: &async_nats::Client, subject: &str, body: Value) -> Value {
    json_req(client, subject, body).await.unwrap()
}

/// A nats-server and the service on a SQLite store in a temp dir ([`sqlite_config`]); the
/// server and the dir are returned to live as long as the test.
async fn sqlite_service() -> ((NatsServer, tempfile::TempDir), RunningService) {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service = RunningService::start(&nats.url(), sqlite_config(&dir)).await;
    ((nats, dir), service)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_answers_with_the_documented_shapes() {
    let ((nats, _dir), service) = sqlite_service().await;
    let c = nats.connect().await;

    let saved = answered(
        &c,
        subjects::CHECKPOINT_SAVE,
        json!({"id":"s1:t1:3","agent_id":"s1","step":3,"state":{"step":3,"messages":[
            {"role":"user","content":[{"type":"text","text":"hi"}]}],"stop_reason":"tool_calls",
            "turn_id":"t1"},"turn_id":"t1","attempt":1}),
    )
    .await;
    assert_eq!(saved["id"], "s1:t1:3");
    assert_eq!(saved["attempt"], 1);
    assert_eq!(saved["state"]["stop_reason"], "tool_calls");
    assert!(saved["created_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(saved["created_at"], saved["updated_at"]);
    let progress = answered(
        &c,
        subjects::CHECKPOINT_PROGRESS,
        json!({"turns":[{"agent_id":"s1","turn_id":"t1"},{"agent_id":"s1","turn_id":"t2"}]}),
    )
    .await;
    assert_eq!(
        progress,
        json!({"turns":[{"agent_id":"s1","turn_id":"t1","step":3},
                        {"agent_id":"s1","turn_id":"t2","step":0}]})
    );
    answered(
        &c,
        subjects::CHECKPOINT_SAVE,
        json!({"id":"s1:4","agent_id":"s1","step":4,"state":{"step":4}}),
    )
    .await;

    let latest = answered(&c, subjects::CHECKPOINT_LATEST, json!({"agent_id":"s1"})).await;
    assert_eq!(latest["step"], 4);
    let of_turn = answered(
        &c,
        subjects::CHECKPOINT_LATEST,
        json!({"agent_id":"s1","turn_id":"t1","attempt":2}),
    )
    .await;
    assert_eq!(of_turn, saved, "the turn's own latest, read fenced");
    assert_eq!(
        json_req(
            &c,
            subjects::CHECKPOINT_LATEST,
            json!({"agent_id":"s1","turn_id":"t1","attempt":1})
        )
        .await,
        Err(ErrorCode::Conflict),
        "attempt 2 has read: attempt 1 is fenced off"
    );
    assert_eq!(
        json_req(
            &c,
            subjects::CHECKPOINT_LATEST,
            json!({"agent_id":"s1","attempt":1})
        )
        .await,
        Err(ErrorCode::BadRequest)
    );
    let got = answered(&c, subjects::CHECKPOINT_GET, json!({"id":"s1:t1:3"})).await;
    assert_eq!(got, saved);
    let list = answered(
        &c,
        subjects::CHECKPOINT_LIST,
        json!({"agent_id":"s1","limit":50}),
    )
    .await;
    let steps: Vec<u64> = list["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, [4, 3]);
    let retained = answered(
        &c,
        subjects::CHECKPOINT_RETAIN,
        json!({"agent_id":"s1","keep_last":1}),
    )
    .await;
    assert_eq!(retained, json!({"deleted":1}));
    let aged = answered(
        &c,
        subjects::CHECKPOINT_RETAIN,
        json!({"older_than_secs":86400}),
    )
    .await;
    assert_eq!(aged, json!({"deleted":0}));
    assert_eq!(
        json_req(
            &c,
            subjects::CHECKPOINT_LATEST,
            json!({"agent_id":"nobody"})
        )
        .await,
        Err(ErrorCode::NotFound)
    );
    assert_eq!(
        json_req(&c, subjects::CHECKPOINT_GET, json!({"id":"s1:t1:3"})).await,
        Err(ErrorCode::NotFound),
        "retention deleted step 3"
    );
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_input_gets_its_code_and_the_service_keeps_serving() {
    let big = serde_json::to_string(&big_state(4096)).unwrap();
    let oversized = format!(r#"{{"id":"s1:1","agent_id":"s1","step":1,"state":{big}}}"#);
    let ((nats, _dir), service) = sqlite_service().await;
    let c = nats.connect().await;
    // Each subject's refused bodies, in order; each case is numbered across all of them.
    let refused = |subject: &'static str, code: ErrorCode, bodies: &[&[u8]]| {
        bodies
            .iter()
            .map(|body| (subject, body.to_vec(), code))
            .collect::<Vec<_>>()
    };
    let cases: Vec<(&str, Vec<u8>, ErrorCode)> = [
        refused(
            subjects::CHECKPOINT_SAVE,
            ErrorCode::BadRequest,
            &[
                b"{",
                b"",
                b"not json",
                br#"{"id":"s1:1"}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":1}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":"one","state":{}}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":1,"state":[1]}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":1,"state":"text"}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":1,"state":null}"#,
                br#"{"id":"s.1.2:1","agent_id":"s.1.2","step":1,"state":{}}"#,
                br#"{"id":"s1:2","agent_id":"s1","step":1,"state":{}}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":1,"state":{},"attempt":2}"#,
                br#"{"id":"s1:1","agent_id":"s1","step":-1,"state":{}}"#,
            ],
        ),
        refused(
            subjects::CHECKPOINT_SAVE,
            ErrorCode::TooLarge,
            &[oversized.as_bytes()],
        ),
        refused(
            subjects::CHECKPOINT_LATEST,
            ErrorCode::BadRequest,
            &[
                b"{}",
                br#"{"agent_id":"s1","extra":1}"#,
                br#"{"agent_id":"s1.>"}"#,
            ],
        ),
        refused(
            subjects::CHECKPOINT_GET,
            ErrorCode::BadRequest,
            &[br#"{"id":"s1"}"#, br#"{"id":7}"#],
        ),
        refused(
            subjects::CHECKPOINT_LIST,
            ErrorCode::BadRequest,
            &[
                br#"{"agent_id":"s1","limit":0}"#,
                br#"{"agent_id":"s1","limit":-5}"#,
            ],
        ),
        refused(
            subjects::CHECKPOINT_RETAIN,
            ErrorCode::BadRequest,
            &[
                b"{}",
                br#"{"agent_id":"s1","keep_last":1,"older_than_secs":1}"#,
                br#"{"keep_last":1}"#,
            ],
        ),
        refused(
            subjects::CHECKPOINT_PROGRESS,
            ErrorCode::BadRequest,
            &[
                b"{}",
                br#"{"turns":{}}"#,
                br#"{"turns":[{"agent_id":"s1"}]}"#,
                br#"{"turns":[{"agent_id":"s1","turn_id":"t1","text":"x"}]}"#,
                br#"{"turns":[{"agent_id":"s1.>","turn_id":"t1"}]}"#,
                br#"{"turns":[{"agent_id":"s1","turn_id":"<b>t1</b>"}]}"#,
                br#"{"turns":[],"tool_names":"yes"}"#,
                br#"{"turns":[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]}"#,
            ],
        ),
    ]
    .concat();
    for (n, (subject, body, code)) in cases.into_iter().enumerate() {
        let shown = String::from_utf8_lossy(&body[..body.len().min(80)]).into_owned();
        assert_eq!(
            raw(&c, subject, &body).await,
            Err(code),
            "case {n}: {subject} {shown}"
        );
        // The service still serves after every refusal.
        let step = u32::try_from(n).unwrap() + 1;
        save(&c, &checkpoint("alive", step, "ok")).await.unwrap();
        let latest = answered(&c, subjects::CHECKPOINT_LATEST, json!({"agent_id":"alive"})).await;
        assert_eq!(latest["step"], step);
    }
    let untouched = json_req(&c, subjects::CHECKPOINT_LATEST, json!({"agent_id":"s1"})).await;
    assert_eq!(
        untouched,
        Err(ErrorCode::NotFound),
        "no refused save wrote anything"
    );
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_saves_over_nats_answer_conflict() {
    let ((nats, _dir), service) = sqlite_service().await;
    let c = nats.connect().await;
    save(&c, &fenced("s1", 1, "a2", "t1", 2)).await.unwrap();
    assert_eq!(
        save(&c, &fenced("s1", 1, "a1", "t1", 1)).await,
        Err(ErrorCode::Conflict)
    );
    let row = answered(&c, subjects::CHECKPOINT_GET, json!({"id":"s1:t1:1"})).await;
    assert_eq!(row["state"]["note"], "a2");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_micro_service_lists_its_named_endpoints() {
    let ((nats, _dir), service) = sqlite_service().await;
    let c = nats.connect().await;
    let info = micro::answer(&c, "INFO", "cyrene-checkpoint-store").await;
    assert_eq!(info["name"], "cyrene-checkpoint-store");
    let mut endpoints: Vec<(String, String)> = info["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_owned(),
                e["subject"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    endpoints.sort();
    let expected = [
        ("get", subjects::CHECKPOINT_GET),
        ("latest", subjects::CHECKPOINT_LATEST),
        ("list", subjects::CHECKPOINT_LIST),
        ("person-get", "cyrene.person.*.checkpoint.get"),
        ("person-latest", "cyrene.person.*.checkpoint.latest"),
        ("person-list", "cyrene.person.*.checkpoint.list"),
        ("progress", subjects::CHECKPOINT_PROGRESS),
        ("retain", subjects::CHECKPOINT_RETAIN),
        ("save", subjects::CHECKPOINT_SAVE),
    ]
    .map(|(n, s)| (n.to_owned(), s.to_owned()));
    assert_eq!(endpoints, expected);
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_database_is_created_in_the_data_dir() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new(dir.path().join("nested/data"));
    let service = RunningService::start(&nats.url(), config).await;
    assert!(dir.path().join("nested/data/checkpoints.db").is_file());
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typed_client_speaks_to_the_running_service() {
    let ((nats, _dir), service) = sqlite_service().await;
    let store = CheckpointClient::new(nats.connect().await, TIMEOUT);
    typed_client_round_trip(&store).await;

    // Once the service is gone the client says so instead of hanging.
    service.stop().await.unwrap();
    let err = store.latest("s1").await.unwrap_err();
    assert!(matches!(err, ClientError::Unavailable(_)), "{err}");
    assert!(err.is_retryable());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_and_client_work_on_postgres() {
    let nats = NatsServer::start();
    let db = PgTestDb::create(common::PG_PREFIX).await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = sqlite_config(&dir);
    config.database_url = Some(db.url.clone());
    let service = RunningService::start(&nats.url(), config).await;
    let store = CheckpointClient::new(nats.connect().await, TIMEOUT);
    typed_client_round_trip(&store).await;
    service.stop().await.unwrap();
    assert!(
        !dir.path().join("data/checkpoints.db").exists(),
        "no SQLite file when DATABASE_URL names PostgreSQL"
    );
}

/// The code a page of `wide` before the cursor `before` is refused with.
async fn refused_cursor(store: &CheckpointClient, before: &str) -> ErrorCode {
    store
        .list_page("wide", None, Some(before))
        .await
        .unwrap_err()
        .code()
}

async fn typed_client_round_trip(store: &CheckpointClient) {
    assert!(matches!(
        store.latest("s1").await,
        Err(ClientError::NotFound(_))
    ));
    for step in 1..=3 {
        let saved = store
            .save(&fenced("s1", step, &format!("step {step}"), "t1", 1))
            .await
            .unwrap();
        assert_eq!(saved.step, step);
        assert!(saved.created_at.is_some());
    }
    store.save(&checkpoint("s1#leg", 9, "leg")).await.unwrap();
    assert_eq!(note(&store.latest("s1").await.unwrap()), "step 3");
    assert_eq!(note(&store.latest("s1#leg").await.unwrap()), "leg");
    let of_turn = store.latest_of_turn("s1", "t1", Some(1)).await.unwrap();
    assert_eq!(note(&of_turn), "step 3");
    assert!(matches!(
        store.latest_of_turn("s1", "t9", Some(1)).await,
        Err(ClientError::NotFound(_))
    ));
    assert_eq!(note(&store.get("s1:t1:2").await.unwrap()), "step 2");
    let steps: Vec<u32> = store
        .list("s1", Some(2))
        .await
        .unwrap()
        .iter()
        .map(|c| c.step)
        .collect();
    assert_eq!(steps, [3, 2]);

    store
        .save(&fenced("s1", 4, "attempt 2", "t1", 2))
        .await
        .unwrap();
    let fenced_off = store
        .save(&fenced("s1", 5, "zombie", "t1", 1))
        .await
        .unwrap_err();
    assert!(
        matches!(fenced_off, ClientError::Conflict(_)),
        "{fenced_off}"
    );
    assert!(!fenced_off.is_retryable());

    let invalid = store.latest("s 1").await.unwrap_err();
    assert!(matches!(invalid, ClientError::Invalid(_)), "{invalid}");
    assert_eq!(invalid.code(), ErrorCode::BadRequest);
    let mut too_big = checkpoint("s1", 6, "");
    too_big.state = big_state(4096);
    let err = store.save(&too_big).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::TooLarge, "{err}");

    assert_eq!(
        store
            .retain(&RetainRequest::keep_last("s1", 2))
            .await
            .unwrap(),
        2
    );
    assert_eq!(store.list("s1", None).await.unwrap().len(), 2);
    assert_eq!(
        store
            .retain(&RetainRequest::older_than(3600))
            .await
            .unwrap(),
        0
    );
    assert!(matches!(
        store.get("s1:1").await,
        Err(ClientError::NotFound(_))
    ));
}

/// Whatever the store accepts, it can give back: a state too large for a reply is refused at
/// save (not stored and then unreadable), and a listing is paged by bytes as well as by count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stored_checkpoint_can_be_read_back_over_the_bus() {
    let nats = NatsServer::start(); // max_payload: the default 1 MiB
    let dir = tempfile::tempdir().unwrap();
    let config = Config::new(dir.path().join("data")); // --max-state-bytes: 4 MiB
    let service = RunningService::start(&nats.url(), config).await;
    let c = nats.connect().await;
    let store = CheckpointClient::new(c.clone(), Duration::from_secs(10));

    // Just under 1 MiB fits a request but not the ack: refused, nothing stored.
    let mut almost = checkpoint("big", 1, "");
    almost.state = big_state(1024 * 1024 - 6 * 1024);
    let err = store.save(&almost).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::TooLarge, "{err}");
    assert!(matches!(
        store.latest("big").await,
        Err(ClientError::NotFound(_))
    ));
    // What is accepted comes back, by latest and by get.
    let mut fits = checkpoint("big", 1, "");
    fits.state = big_state(1000 * 1024);
    store.save(&fits).await.unwrap();
    assert_eq!(store.latest("big").await.unwrap().state, fits.state);
    assert_eq!(store.get("big:1").await.unwrap().state, fits.state);

    // Three 400 KB states: the default page (50 rows) would be 1.2 MB; it stops at what fits.
    for step in 1..=3 {
        let mut cp = checkpoint("wide", step, "");
        cp.state = big_state(400 * 1024);
        store.save(&cp).await.unwrap();
    }
    let first = store.list_page("wide", None, None).await.unwrap();
    let ids: Vec<&str> = first.checkpoints.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["wide:3", "wide:2"]);
    assert_eq!(first.next_before.as_deref(), Some("wide:2"));
    let rest = store
        .list_page("wide", None, first.next_before.as_deref())
        .await
        .unwrap();
    let ids: Vec<&str> = rest.checkpoints.iter().map(|c| c.id.as_str()).collect();
    assert_eq!((ids, rest.next_before), (vec!["wide:1"], None));
    // Paging by count says where to go on too; a cursor of another owner is refused.
    let one = store.list_page("wide", Some(1), None).await.unwrap();
    assert_eq!(one.next_before.as_deref(), Some("wide:3"));
    assert_eq!(refused_cursor(&store, "big:1").await, ErrorCode::BadRequest);
    assert_eq!(refused_cursor(&store, "wide:9").await, ErrorCode::NotFound);
    service.stop().await.unwrap();
}

/// M2 of issue 30: a person's read of their own `latest` must never raise a turn's attempt
/// record. A fenced read (`attempt`) on `cyrene.person.<p>.checkpoint.latest` is refused before
/// the store is touched, so a turn id a person learned cannot be fenced off from its worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_cannot_raise_a_turns_fence() {
    let ((nats, _dir), service) = sqlite_service().await;
    let c = nats.connect().await;
    save(&c, &fenced("s1", 1, "a1", "t1", 1)).await.unwrap();
    let alice = "cyrene.person.alice.checkpoint.latest";
    for asked in [
        // her own session, someone else's turn
        json!({"agent_id":"alice.s1","turn_id":"t1","attempt":99}),
        // someone else's session
        json!({"agent_id":"s1","turn_id":"t1","attempt":99}),
        json!({"agent_id":"alice.s1","attempt":99}),
    ] {
        assert_eq!(
            json_req(&c, alice, asked.clone()).await,
            Err(ErrorCode::Forbidden),
            "{asked}"
        );
    }
    // her unfenced read of her own session stays hers (and finds nothing of t1)
    assert_eq!(
        json_req(&c, alice, json!({"agent_id":"alice.s1","turn_id":"t1"})).await,
        Err(ErrorCode::NotFound)
    );
    // the turn's worker still writes with its attempt
    save(&c, &fenced("s1", 2, "a1", "t1", 1)).await.unwrap();
    // and the worker's own fenced read still raises the record
    answered(
        &c,
        subjects::CHECKPOINT_LATEST,
        json!({"agent_id":"s1","turn_id":"t1","attempt":2}),
    )
    .await;
    assert_eq!(
        save(&c, &fenced("s1", 3, "a1", "t1", 1)).await,
        Err(ErrorCode::Conflict)
    );
    service.stop().await.unwrap();
}
