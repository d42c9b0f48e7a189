//! `cyrene.turns.running`: the turns in flight, for operators (docs/orchestrator.md, "Turns in
//! flight"). Who may ask is the NATS server's to enforce (tests/permissions.rs); here, what the
//! answer holds.

use crate::harness::*;
use cyrene_bus::request_json;
use cyrene_protocol::ErrorCode;
use cyrene_protocol::subjects;
use cyrene_protocol::turn::{RunningTurnsRequest, RunningTurnsResponse};

async fn running(
    client: &async_nats::Client,
    limit: Option<u32>,
) -> Result<RunningTurnsResponse, cyrene_bus::RequestError> {
    request_json(
        client,
        subjects::TURNS_RUNNING,
        &RunningTurnsRequest { limit },
        TIMEOUT,
    )
    .await
}

async fn turns_in_flight_are_listed_with_their_step_until_they_end(backend: Backend) {
    let (world, _replica, mut jobs) = one_replica(backend).await;
    let c = &world.client;
    assert_eq!(
        running(c, None).await.unwrap(),
        RunningTurnsResponse::default()
    );

    send_ok(c, "s1", "first").await;
    let (first, attempt) = jobs.next().await;
    send_ok(c, "s2", "second").await;
    let (second, _) = jobs.next().await;
    let listed = running(c, None).await.unwrap();
    let ids: Vec<&str> = listed.turns.iter().map(|t| t.turn_id.as_str()).collect();
    assert_eq!(
        ids,
        [first.turn_id.as_str(), second.turn_id.as_str()],
        "oldest first"
    );
    assert!(!listed.more);
    let one = &listed.turns[0];
    assert_eq!(one.session_id, "s1");
    // no checkpoint store answers yet: the list is still given, every step 0
    assert_eq!((one.attempt, one.step), (1, 0));
    assert!(one.started_at_ms > 0);

    // the step is the turn's last saved step, from the checkpoint store (none runs yet: 0)
    let store = CheckpointStore::start(&world).await;
    assert_eq!(running(c, None).await.unwrap().turns[0].step, 0);
    store.save_steps(&first, &[&["search"], &[], &[]]).await;
    let listed = running(c, None).await.unwrap();
    let steps: Vec<u32> = listed.turns.iter().map(|t| t.step).collect();
    assert_eq!(steps, [3, 0]);

    // a page of one says there is more
    let page = running(c, Some(1)).await.unwrap();
    assert_eq!(page.turns.len(), 1);
    assert!(page.more);
    let err = running(c, Some(0)).await.unwrap_err();
    assert_eq!(code(&err), ErrorCode::BadRequest);
    // hostile input: a body that is not the request is bad_request, and the service stays up
    let raw = c
        .request(
            subjects::TURNS_RUNNING,
            r#"{"limit":"all","x":[[[[]]]]}"#.into(),
        )
        .await
        .unwrap();
    assert!(String::from_utf8_lossy(&raw.payload).contains("bad_request"));

    // a completed turn is no longer listed
    complete(c, &completion(&first, attempt, "done"))
        .await
        .unwrap();
    let left = running(c, None).await.unwrap();
    let ids: Vec<&str> = left.turns.iter().map(|t| t.turn_id.as_str()).collect();
    assert_eq!(ids, [second.turn_id.as_str()]);
}

on_both_backends!(turns_in_flight_are_listed_with_their_step_until_they_end:
    turns_in_flight_are_listed_with_their_step_until_they_end_sqlite,
    turns_in_flight_are_listed_with_their_step_until_they_end_postgres);
