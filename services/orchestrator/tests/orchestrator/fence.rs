//! Dispositions, the fence, steering, completion and idempotent sends, on both backends.

use crate::harness::*;
use cyrene_protocol::ErrorCode;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::{Disposition, SessionEventType};
use cyrene_test_support::subscribed;
use futures::StreamExt;

async fn dispositions_follow_the_fence(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica(backend).await;
    let c = &world.client;

    let m1 = send_ok(c, "s1", "first").await;
    assert_eq!(m1.disposition, Disposition::TurnStarted);
    assert_eq!(m1.seq, 1);
    assert!(!m1.turn_id.is_empty());
    let (job1, attempt) = jobs.next().await;
    assert_eq!(job1.turn_id, m1.turn_id);
    assert_eq!(job1.message_ids, vec![m1.message_id.clone()]);
    assert_eq!(job1.messages.len(), 1);
    assert_eq!(job1.messages[0].text_content(), "first");
    assert_eq!(job1.env.persona, "cyrene");
    assert_eq!(
        job1.persona_names.get("cyrene").map(String::as_str),
        Some("昔涟")
    );
    assert!(!job1.instructions.is_empty());
    assert_eq!(job1.base_seq, 1);
    assert!(job1.leg_id.is_empty() && job1.notice.is_none());

    // A turn is in flight: both wait.
    let m2 = send_ok(c, "s1", "second").await;
    let m3 = send_ok(c, "s1", "third").await;
    for m in [&m2, &m3] {
        assert_eq!(m.disposition, Disposition::Pending);
        assert!(m.turn_id.is_empty());
    }
    assert_eq!((m2.seq, m3.seq), (2, 3));
    // Another session is not fenced by this one.
    assert_eq!(
        send_ok(c, "s2", "elsewhere").await.disposition,
        Disposition::TurnStarted
    );
    let (other, _) = jobs.next().await;
    assert_eq!(other.session_id, "s2");

    // The turn ends first: the pending messages become the next turn, one turn for both.
    let ack = complete(c, &completion(&job1, attempt, "answer one"))
        .await
        .unwrap();
    assert!(ack.first);
    let (job2, _) = jobs.next().await;
    assert_eq!(job2.session_id, "s1");
    assert_eq!(
        job2.message_ids,
        vec![m2.message_id.clone(), m3.message_id.clone()]
    );
    let texts: Vec<String> = job2.messages.iter().map(|m| m.text_content()).collect();
    assert_eq!(texts, ["first", "answer one", "second", "third"]);
    assert_eq!(job2.messages[1].role, Role::Assistant);
    assert_eq!(job2.base_seq, 4, "the answer got seq 4");

    // Still one turn in flight: the next message is claimed for it and pushed to it at once
    // (the turn takes it in at its next boundary without asking).
    let turn_input = cyrene_protocol::subjects::turn_input(&job2.turn_id).unwrap();
    let mut input = subscribed(c, turn_input).await;
    let m4 = send_ok(c, "s1", "fourth").await;
    assert_eq!(m4.disposition, Disposition::Pending);
    let pushed = tokio::time::timeout(std::time::Duration::from_secs(10), input.next())
        .await
        .expect("a push to the running turn")
        .unwrap();
    let pushed: cyrene_protocol::turn::SteeredMessage =
        serde_json::from_slice(&pushed.payload).unwrap();
    assert_eq!(
        (pushed.id.as_str(), pushed.seq),
        (m4.message_id.as_str(), 5)
    );
    assert_eq!(pushed.message.text_content(), "fourth");

    let started = world
        .wait_event("turn_started of job 2", |e| {
            e.kind == SessionEventType::TurnStarted && e.turn_id == job2.turn_id
        })
        .await;
    assert_eq!(started.message_ids, job2.message_ids);
    let ended = world
        .wait_event("turn_ended of job 1", |e| {
            e.kind == SessionEventType::TurnEnded && e.turn_id == job1.turn_id
        })
        .await;
    assert_eq!(
        ended.message.as_ref().map(|m| m.text_content()).as_deref(),
        Some("answer one")
    );
    // turn_started(1) < turn_ended(1) < turn_started(2) on the session's subject.
    let order: Vec<(SessionEventType, String)> = world
        .events()
        .into_iter()
        .filter(|e| e.session_id == "s1")
        .map(|e| (e.kind, e.turn_id))
        .collect();
    let pos = |k: SessionEventType, t: &str| order.iter().position(|(a, b)| *a == k && b == t);
    assert!(
        pos(SessionEventType::TurnStarted, &job1.turn_id)
            < pos(SessionEventType::TurnEnded, &job1.turn_id)
    );
    assert!(
        pos(SessionEventType::TurnEnded, &job1.turn_id)
            < pos(SessionEventType::TurnStarted, &job2.turn_id)
    );

    let h = history(c, "s1").await;
    let seqs: Vec<u64> = h.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);
    assert_eq!(h[0].turn_id, job1.turn_id);
    assert_eq!(h[1].turn_id, job2.turn_id);
    assert_eq!(h[3].turn_id, job1.turn_id, "the answer carries its turn");
    assert_eq!(h[3].message.role, Role::Assistant);
    assert_eq!(
        h[4].turn_id, job2.turn_id,
        "the fourth message is claimed for the running turn"
    );
}

on_both_backends!(
    dispositions_follow_the_fence:
    dispositions_follow_the_fence_on_sqlite,
    dispositions_follow_the_fence_on_postgres
);

async fn steer_claims_once_replays_and_is_fenced(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica(backend).await;
    let c = &world.client;

    send_ok(c, "s1", "start").await;
    let (job, _) = jobs.next().await;
    // Nothing pending yet: an empty steer.
    assert!(
        steer(c, &job, 1, job.base_seq)
            .await
            .unwrap()
            .messages
            .is_empty()
    );
    let m2 = send_ok(c, "s1", "wait").await;
    let m3 = send_ok(c, "s1", "also this").await;
    let got = steer(c, &job, 1, 0).await.unwrap().messages;
    let ids: Vec<&str> = got.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids, [m2.message_id.as_str(), m3.message_id.as_str()]);
    assert_eq!(got[1].message.text_content(), "also this");
    // A resumed attempt asks again from the same cursor: the same messages, claimed once.
    let again = steer(c, &job, 1, 0).await.unwrap().messages;
    assert_eq!(again, got);
    let m4 = send_ok(c, "s1", "one more").await;
    let later = steer(c, &job, 1, m3.seq).await.unwrap().messages;
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].id, m4.message_id);
    // Nothing new since the cursor: nothing.
    assert!(steer(c, &job, 1, m4.seq).await.unwrap().messages.is_empty());

    // Attempt 2 takes over; attempt 1 is fenced off from steering and completing.
    let resumed = steer(c, &job, 2, 0).await.unwrap().messages;
    assert_eq!(resumed.len(), 3);
    assert_eq!(
        code(&steer(c, &job, 1, 0).await.unwrap_err()),
        ErrorCode::Conflict
    );
    let stale = complete(c, &completion(&job, 1, "zombie"))
        .await
        .unwrap_err();
    assert_eq!(code(&stale), ErrorCode::Conflict);
    let mut done = completion(&job, 2, "all four");
    done.steered_ids = resumed.iter().map(|m| m.id.clone()).collect();
    let first = complete(c, &done).await.unwrap();
    assert!(first.first);
    let second = complete(c, &completion(&job, 2, "a retry")).await.unwrap();
    assert!(!second.first, "a second completion changes nothing");
    assert_eq!(
        code(&steer(c, &job, 2, 0).await.unwrap_err()),
        ErrorCode::Conflict
    );

    let h = history(c, "s1").await;
    let texts: Vec<String> = h.iter().map(|e| e.message.text_content()).collect();
    assert_eq!(
        texts,
        ["start", "wait", "also this", "one more", "all four"]
    );
    assert!(h.iter().all(|e| e.turn_id == job.turn_id));
    // Every message was consumed and the fence is released: the next send starts a turn.
    let next = send_ok(c, "s1", "new topic").await;
    assert_eq!(next.disposition, Disposition::TurnStarted);
    let (job2, _) = jobs.next().await;
    assert_eq!(job2.message_ids, vec![next.message_id]);
    let texts: Vec<String> = job2.messages.iter().map(|m| m.text_content()).collect();
    assert_eq!(texts.last().map(String::as_str), Some("new topic"));
    assert_eq!(texts.len(), 6, "the whole transcript is seeded");

    // An unknown turn.
    let mut ghost = job2.clone();
    ghost.turn_id = "no-such-turn".into();
    assert_eq!(
        code(&steer(c, &ghost, 1, 0).await.unwrap_err()),
        ErrorCode::NotFound
    );
    assert_eq!(
        code(&complete(c, &completion(&ghost, 1, "x")).await.unwrap_err()),
        ErrorCode::NotFound
    );
}

/// I2 when a steer's reply is lost after its claim committed and the turn has no later boundary:
/// the message is not in the completion's `steered_ids`, so it goes back to pending and becomes
/// the next turn — answered, never dropped.
async fn a_claimed_message_the_turn_never_took_in_becomes_its_own_turn(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica(backend).await;
    let c = &world.client;

    send_ok(c, "s1", "start").await;
    let (job, _) = jobs.next().await;
    let late = send_ok(c, "s1", "late").await;
    let claimed = steer(c, &job, 1, job.base_seq).await.unwrap().messages;
    assert_eq!(claimed.len(), 1, "claimed (and, say, the reply is lost)");
    let done = complete(c, &completion(&job, 1, "answer to start"))
        .await
        .unwrap();
    assert!(done.first);

    let (next, _) = jobs.next().await;
    assert_ne!(next.turn_id, job.turn_id);
    assert_eq!(next.message_ids, vec![late.message_id.clone()]);
    let h = history(c, "s1").await;
    let late_entry = h.iter().find(|e| e.id == late.message_id).unwrap();
    assert_eq!(late_entry.turn_id, next.turn_id);
}

on_both_backends!(
    a_claimed_message_the_turn_never_took_in_becomes_its_own_turn:
    a_claimed_message_the_turn_never_took_in_becomes_its_own_turn_on_sqlite,
    a_claimed_message_the_turn_never_took_in_becomes_its_own_turn_on_postgres
);

on_both_backends!(
    steer_claims_once_replays_and_is_fenced:
    steer_claims_once_replays_and_is_fenced_on_sqlite,
    steer_claims_once_replays_and_is_fenced_on_postgres
);

async fn idempotent_send_returns_the_first_ack(backend: Backend) {
    let world = World::new(backend).await;
    let _orch = Replica::start(&world, world.config()).await;
    let c = &world.client;
    let first = send(c, &send_req("s1", "hello", "k1", "cli"))
        .await
        .unwrap();
    let again = send(c, &send_req("s1", "hello", "k1", "cli"))
        .await
        .unwrap();
    assert_eq!(again, first);
    // The key identifies the message even if the resend differs.
    let changed = send(c, &send_req("s1", "hello?", "k1", "cli"))
        .await
        .unwrap();
    assert_eq!(changed, first);
    // Keys are per session.
    let other = send(c, &send_req("s2", "hello", "k1", "cli"))
        .await
        .unwrap();
    assert_ne!(other.message_id, first.message_id);
    let pending = send(c, &send_req("s1", "next", "k2", "cli")).await.unwrap();
    assert_eq!(pending.disposition, Disposition::Pending);
    assert_eq!(
        send(c, &send_req("s1", "next", "k2", "cli")).await.unwrap(),
        pending
    );
    let h = history(c, "s1").await;
    assert_eq!(h.len(), 2);
    assert_eq!(h[0].id, first.message_id);
    assert_eq!(h[1].id, pending.message_id);
}

on_both_backends!(
    idempotent_send_returns_the_first_ack:
    idempotent_send_returns_the_first_ack_on_sqlite,
    idempotent_send_returns_the_first_ack_on_postgres
);

#[tokio::test(flavor = "multi_thread")]
async fn history_pages_backwards() {
    let (world, _orch) = sqlite_replica().await;
    let c = &world.client;
    for i in 0..5 {
        send_ok(c, "s1", &format!("m{i}")).await;
    }
    let req = |limit, before_seq| cyrene_protocol::session::HistoryRequest {
        session_id: "s1".into(),
        limit: Some(limit),
        before_seq,
    };
    let last2 = history_raw(c, &req(2, None)).await.unwrap();
    assert_eq!(
        last2.messages.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [4, 5]
    );
    assert_eq!(last2.next_before_seq, Some(4));
    let before = history_raw(c, &req(2, Some(4))).await.unwrap();
    assert_eq!(
        before.messages.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [2, 3]
    );
    let first = history_raw(c, &req(2, Some(2))).await.unwrap();
    assert_eq!(
        first.messages.iter().map(|e| e.seq).collect::<Vec<_>>(),
        [1]
    );
    assert_eq!(first.next_before_seq, None, "nothing older");
    assert!(history(c, "unknown").await.is_empty());
}

/// Five 240 KB messages: the default page (50 entries, 1.2 MB) would not fit one NATS message, so a
/// user could make their own history unreadable. The page stops at what fits, newest kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_history_page_never_outgrows_the_bus() {
    let (world, _orch) = sqlite_replica().await;
    let c = &world.client;
    for i in 0..5 {
        send_ok(c, "big", &format!("{i}{}", "x".repeat(240 * 1024))).await;
    }
    let req = |before_seq| cyrene_protocol::session::HistoryRequest {
        session_id: "big".into(),
        limit: None,
        before_seq,
    };
    let mut seqs = Vec::new();
    let mut before = None;
    for _page in 0..5 {
        let page = history_raw(c, &req(before)).await.unwrap();
        assert!(!page.messages.is_empty());
        let mut these: Vec<u64> = page.messages.iter().map(|e| e.seq).collect();
        these.extend(seqs);
        seqs = these;
        before = page.next_before_seq;
        if before.is_none() {
            break;
        }
    }
    assert_eq!(
        seqs,
        [1, 2, 3, 4, 5],
        "every entry once, by following next_before_seq"
    );
    let newest = history_raw(c, &req(None)).await.unwrap();
    assert!(newest.messages.len() < 5 && newest.next_before_seq.is_some());
    assert_eq!(newest.messages.last().map(|e| e.seq), Some(5));
}

/// A turn is recorded at attempt 1, its first delivery's count: that attempt's boundary with
/// nothing new is one unlocked read, answered while another transaction holds the session's row
/// lock (the locked path would wait for it). Attempt 0, which no delivery has, is refused.
#[tokio::test]
async fn a_first_attempts_empty_boundary_takes_no_lock() {
    use sqlx::{Connection, PgConnection};
    let (world, _orch, mut jobs) = one_replica(Backend::Postgres).await;
    let c = &world.client;
    send_ok(c, "s1", "start").await;
    let (job, attempt) = jobs.next().await;
    assert_eq!(attempt, 1);

    let url = &world.pg.as_ref().expect("a PostgreSQL world").url;
    let mut conn = PgConnection::connect(url).await.unwrap();
    let mut lock = conn.begin().await.unwrap();
    let locked = sqlx::query("SELECT id FROM orch_sessions WHERE id = 's1' FOR UPDATE")
        .fetch_all(&mut *lock)
        .await
        .unwrap();
    assert_eq!(locked.len(), 1);
    // `steer` gives up after the harness's request timeout: waiting on the lock fails here.
    let reply = steer(c, &job, 1, job.base_seq).await;
    lock.rollback().await.unwrap();
    assert!(reply.expect("answered under the lock").messages.is_empty());

    assert_eq!(
        code(&steer(c, &job, 0, job.base_seq).await.unwrap_err()),
        ErrorCode::Conflict
    );
    // The first attempt completes as usual.
    let done = complete(c, &completion(&job, 1, "answer")).await.unwrap();
    assert!(done.first);
}

/// A completion names its turn's session: one naming another session is refused and changes
/// nothing there or in the turn's own session, which its real completion then ends.
async fn a_completion_naming_another_session_is_refused(backend: Backend) {
    let (world, _orch, mut jobs) = one_replica(backend).await;
    let c = &world.client;
    send_ok(c, "s1", "mine").await;
    let (job, attempt) = jobs.next().await;
    send_ok(c, "s2", "theirs").await;
    let (other, _) = jobs.next().await;

    let mut wrong = completion(&job, attempt, "spoken into s2");
    wrong.session_id = other.session_id.clone();
    assert_eq!(
        code(&complete(c, &wrong).await.unwrap_err()),
        ErrorCode::BadRequest
    );
    let s2 = history_texts(c, "s2").await;
    assert_eq!(s2, ["theirs"], "nothing was written into s2");
    // The turn is still running: its own completion is the first.
    let done = complete(c, &completion(&job, attempt, "answer"))
        .await
        .unwrap();
    assert!(done.first);
    let again = complete(c, &completion(&job, attempt, "answer"))
        .await
        .unwrap();
    assert!(!again.first);
}

on_both_backends!(
    a_completion_naming_another_session_is_refused:
    a_completion_naming_another_session_is_refused_on_sqlite,
    a_completion_naming_another_session_is_refused_on_postgres
);
