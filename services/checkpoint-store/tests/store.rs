//! The store contract, written once generic over [`CheckpointStore`] and run against both
//! backends: SQLite (a temp file) and the real local PostgreSQL (a fresh database per test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use chrono::{DateTime, TimeDelta, Utc};
use common::{SqliteTestDb, big_state, checkpoint, fenced, note, pg_store};
use cyrene_checkpoint_store::{CheckpointStore, StoreError, StoreOptions};
use cyrene_protocol::checkpoint::{
    Checkpoint, PROGRESS_MAX_TOOL_TURNS, PROGRESS_MAX_TURNS, ProgressRequest, RetainRequest,
    TurnRef,
};
use cyrene_protocol::{ErrorCode, JsonObject};
use serde_json::{Value, json};
use std::time::Duration;

/// Small state limit so the too_large path is cheap to reach.
const MAX_STATE: usize = 4096;

fn options() -> StoreOptions {
    StoreOptions {
        max_state_bytes: MAX_STATE,
        acquire_timeout: Duration::from_secs(5),
        max_connections: 8,
        group_commit: true,
    }
}

fn t(secs_ago: i64) -> DateTime<Utc> {
    Utc::now() - TimeDelta::seconds(secs_ago)
}

/// Runs each named generic test on a fresh SQLite store and a fresh PostgreSQL store.
macro_rules! for_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = super::SqliteTestDb::new();
                    let store = db.open(&super::options()).await;
                    super::$name(&store).await;
                    super::CheckpointStore::close(&store).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let (store, _db) = super::pg_store(&super::options()).await;
                    super::$name(&store).await;
                    super::CheckpointStore::close(&store).await;
                }
            )*
        }
    };
}

for_both_backends!(
    save_returns_the_stored_row_with_timestamps,
    save_is_an_upsert_that_keeps_created_at,
    latest_is_the_last_write_not_the_highest_step,
    turns_of_one_owner_never_overwrite_or_mask_each_other,
    a_turns_latest_is_its_last_write_not_its_highest_step,
    a_fenced_read_shuts_out_older_attempts,
    the_first_attempts_read_fences_as_the_others_do,
    reads_of_missing_rows_are_not_found,
    list_is_most_recent_write_first_and_limited,
    legs_never_see_each_others_rows,
    reads_never_delete,
    fencing_refuses_older_attempts_of_a_turn,
    fencing_is_per_turn_and_optional,
    concurrent_attempts_leave_the_newest_attempts_row,
    many_turns_saving_at_once_each_get_their_own_answer,
    bad_input_is_refused_with_its_code_and_the_store_keeps_working,
    retain_keep_last_keeps_the_newest_steps_of_one_owner,
    retain_older_than_drops_only_idle_owners,
    retention_drops_an_attempt_record_only_when_its_turn_is_idle,
    deltas_are_read_back_as_whole_windows,
    a_turn_restarting_from_its_base_drops_its_earlier_rows,
    a_delta_after_a_full_row_builds_on_it,
    retention_keeps_what_a_kept_delta_is_built_on,
    progress_names_the_highest_step_and_the_tools_called,
);

fn msg(text: &str) -> Value {
    json!({"role": "user", "content": [{"type": "text", "text": text}]})
}

fn texts(cp: &Checkpoint) -> Vec<String> {
    let state = cp.state.to_map();
    state["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"][0]["text"].as_str().unwrap().to_owned())
        .collect()
}

/// A turn's step as the loop worker saves it: only the messages from `from` on, and the base
/// when given.
fn delta(
    step: u32,
    from: usize,
    added: &[&str],
    base: Option<&[&str]>,
    attempt: u32,
) -> Checkpoint {
    let added: Vec<Value> = added.iter().map(|t| msg(t)).collect();
    let Value::Object(state) = json!({"step": step, "from": from, "messages": added,
        "stop_reason": "tool_calls", "turn_id": "t1"})
    else {
        unreachable!()
    };
    let base = base.map(|b| {
        let messages: Vec<Value> = b.iter().map(|t| msg(t)).collect();
        let Value::Object(base) = json!({"messages": messages}) else {
            unreachable!()
        };
        JsonObject::from(base)
    });
    Checkpoint {
        base,
        state: state.into(),
        ..fenced("s1", step, "", "t1", attempt)
    }
}

/// The code a refused store call answered with.
fn code<T: std::fmt::Debug>(result: Result<T, StoreError>) -> ErrorCode {
    result.unwrap_err().code()
}

/// `owner`'s rows, as `list` pages them by default.
async fn rows<S: CheckpointStore>(store: &S, owner: &str) -> Vec<Checkpoint> {
    store.list(owner, None).await.unwrap()
}

/// A fenced read of `turn` by `attempt` (None: unfenced), now.
async fn read_turn<S: CheckpointStore>(
    store: &S,
    owner: &str,
    turn: &str,
    attempt: Option<u32>,
) -> Result<Checkpoint, StoreError> {
    store.latest_of_turn(owner, turn, attempt, t(0)).await
}

/// Applies `request` now; returns how many rows it deleted.
async fn retain<S: CheckpointStore>(store: &S, request: RetainRequest) -> u64 {
    store.retain(&request, t(0)).await.unwrap()
}

/// Runs `sql` on a PostgreSQL connection.
async fn pg_apply(conn: &mut sqlx::PgConnection, sql: &'static str) {
    use sqlx::Executor;
    conn.execute(sqlx::raw_sql(sql)).await.unwrap();
}

/// The PostgreSQL store at `url`.
async fn pg_connect(url: &str) -> Result<cyrene_checkpoint_store::PgStore, StoreError> {
    cyrene_checkpoint_store::PgStore::connect(url, &options()).await
}

/// Saves `cp` as written at `at`; the save must succeed.
async fn put<S: CheckpointStore>(store: &S, cp: Checkpoint, at: DateTime<Utc>) -> Checkpoint {
    store.save(cp, at).await.unwrap()
}

/// Attempt 1 of turn `t1`: steps 1 to 3 (`a1` … `a3`) on the base `seed`.
async fn three_steps_on_a_seed<S: CheckpointStore>(store: &S) {
    put(store, delta(1, 1, &["a1"], Some(&["seed"]), 1), t(0)).await;
    put(store, delta(2, 2, &["a2"], None, 1), t(0)).await;
    put(store, delta(3, 3, &["a3"], None, 1), t(0)).await;
}

async fn deltas_are_read_back_as_whole_windows<S: CheckpointStore>(store: &S) {
    let seed: Vec<String> = (0..50).map(|i| format!("old {i}")).collect();
    let seed: Vec<&str> = seed.iter().map(String::as_str).collect();
    let one = delta(1, 50, &["call 1", "result 1"], Some(&seed), 1);
    let two = delta(2, 52, &["call 2", "result 2"], None, 1);
    let three = delta(3, 54, &["answer"], None, 1);
    let mut sizes = Vec::new();
    for cp in [one, two, three] {
        sizes.push(cp.state.as_str().len());
        let saved = put(store, cp, t(0)).await;
        assert!(saved.base.is_none(), "a reply never carries the base");
    }
    // What each row stores does not depend on the window's 50 messages.
    assert!(sizes.iter().all(|&n| n < 400), "{sizes:?}");
    let latest = store.latest("s1").await.unwrap();
    let window = texts(&latest);
    assert_eq!(window.len(), 55);
    assert_eq!(window[..2], ["old 0", "old 1"]);
    assert_eq!(
        window[50..],
        ["call 1", "result 1", "call 2", "result 2", "answer"]
    );
    assert!(
        !latest.state.to_map().contains_key("from"),
        "a read is a full snapshot"
    );
    assert_eq!(latest.state.to_map()["stop_reason"], "tool_calls");
    // The first attempt's read (one statement with the attempt record) rebuilds it too.
    let first_read = read_turn(store, "s1", "t1", Some(1)).await.unwrap();
    assert_eq!(first_read.state, latest.state);
    assert_eq!(first_read.id, "s1:t1:3");
    let fenced_read = read_turn(store, "s1", "t1", Some(2)).await.unwrap();
    assert_eq!(fenced_read.state, latest.state);
    let two = store.get("s1:t1:2").await.unwrap();
    assert_eq!(texts(&two).len(), 54);
    let listed = rows(store, "s1").await;
    let lens: Vec<usize> = listed.iter().map(|c| texts(c).len()).collect();
    assert_eq!(lens, [55, 54, 52]);
    // A delta without its turn, or a base without a delta, is refused.
    let mut unfenced = delta(4, 55, &["x"], None, 1);
    unfenced.turn_id = None;
    unfenced.attempt = None;
    unfenced.id = "s1:4".into();
    let err = store.save(unfenced, t(0)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::BadRequest, "{err}");
    let mut stray = fenced("s1", 4, "", "t1", 1);
    stray.base = delta(1, 0, &[], Some(&["b"]), 1).base;
    let err = store.save(stray, t(0)).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::BadRequest, "{err}");
}

async fn a_turn_restarting_from_its_base_drops_its_earlier_rows<S: CheckpointStore>(store: &S) {
    three_steps_on_a_seed(store).await;
    // Attempt 2 starts the turn again from a new base: attempt 1's rows are not its window.
    put(store, delta(1, 1, &["b1"], Some(&["seed v2"]), 2), t(0)).await;
    let rows = rows(store, "s1").await;
    let ids: Vec<&str> = rows.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["s1:t1:1"]);
    assert_eq!(texts(&rows[0]), ["seed v2", "b1"]);
    // A later delta of the old attempt is fenced off and changes nothing.
    let err = store
        .save(delta(4, 4, &["a4"], None, 1), t(0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    // A delta that resends from an earlier point (its previous save was lost) replaces the tail.
    put(store, delta(2, 2, &["b2"], None, 2), t(0)).await;
    put(store, delta(3, 2, &["b2", "b3"], None, 2), t(0)).await;
    assert_eq!(
        texts(&store.latest("s1").await.unwrap()),
        ["seed v2", "b1", "b2", "b3"]
    );
}

async fn a_delta_after_a_full_row_builds_on_it<S: CheckpointStore>(store: &S) {
    // A row written before incremental checkpoints (a whole window, no `from`), then a worker
    // resuming it with deltas.
    let Value::Object(state) = json!({"step": 1, "messages": [msg("seed"), msg("call")],
        "stop_reason": "tool_calls", "turn_id": "t1"})
    else {
        unreachable!()
    };
    let mut old = fenced("s1", 1, "", "t1", 1);
    old.state = state.into();
    put(store, old, t(0)).await;
    put(store, delta(2, 2, &["result", "answer"], None, 2), t(0)).await;
    assert_eq!(
        texts(&store.latest("s1").await.unwrap()),
        ["seed", "call", "result", "answer"]
    );
    // A delta whose base and earlier rows are missing cannot be rebuilt: `internal`, never a
    // wrong window.
    let mut orphan = delta(5, 9, &["x"], None, 1);
    orphan.turn_id = Some("t9".into());
    orphan.id = "s1:t9:5".into();
    put(store, orphan, t(0)).await;
    let err = store.get("s1:t9:5").await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::Internal, "{err}");
}

async fn retention_keeps_what_a_kept_delta_is_built_on<S: CheckpointStore>(store: &S) {
    three_steps_on_a_seed(store).await;
    let deleted = retain(store, RetainRequest::keep_last("s1", 1)).await;
    assert_eq!(deleted, 0, "steps 1 and 2 are what step 3 is built on");
    assert_eq!(
        texts(&store.latest("s1").await.unwrap()),
        ["seed", "a1", "a2", "a3"]
    );
    let all = retain(store, RetainRequest::keep_last("s1", 0)).await;
    assert_eq!(all, 3);
    // The base went with its rows: a new delta of the turn without a base cannot be rebuilt.
    put(store, delta(4, 4, &["a4"], None, 1), t(0)).await;
    assert_eq!(code(store.latest("s1").await), ErrorCode::Internal);
}

async fn save_returns_the_stored_row_with_timestamps<S: CheckpointStore>(store: &S) {
    let now = t(0);
    let saved = put(store, checkpoint("s1", 1, "a"), now).await;
    assert_eq!(saved.id, "s1:1");
    assert_eq!(saved.agent_id, "s1");
    assert_eq!(saved.step, 1);
    assert_eq!(note(&saved), "a");
    let created = saved.created_at.clone().unwrap();
    assert_eq!(saved.updated_at.as_deref(), Some(created.as_str()));
    let parsed = DateTime::parse_from_rfc3339(&created).unwrap();
    assert!(
        (parsed.to_utc() - now).num_milliseconds().abs() < 1,
        "{created}"
    );
    assert_eq!(store.get("s1:1").await.unwrap(), saved);
}

async fn save_is_an_upsert_that_keeps_created_at<S: CheckpointStore>(store: &S) {
    let first = put(store, checkpoint("s1", 2, "first"), t(60)).await;
    let second = put(store, checkpoint("s1", 2, "second"), t(0)).await;
    assert_eq!(second.created_at, first.created_at);
    assert!(second.updated_at > first.updated_at);
    assert_eq!(note(&second), "second");
    let rows = rows(store, "s1").await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0], second);
}

async fn latest_is_the_last_write_not_the_highest_step<S: CheckpointStore>(store: &S) {
    put(store, checkpoint("s1", 5, "five"), t(0)).await;
    // Written later by a replica whose clock is behind: write order wins, not the clock.
    put(store, checkpoint("s1", 3, "three"), t(10)).await;
    let latest = store.latest("s1").await.unwrap();
    assert_eq!((latest.step, note(&latest)), (3, "three"));
    // Overwriting a row makes it the latest again.
    put(store, checkpoint("s1", 5, "five again"), t(0)).await;
    assert_eq!(note(&store.latest("s1").await.unwrap()), "five again");
}

/// The bug this identity fixes: turn 1 ran three steps; turn 2's step 1 used to overwrite `s1:1`
/// while turn 1's step 3 stayed "latest", so a crashed turn 2 started over.
async fn turns_of_one_owner_never_overwrite_or_mask_each_other<S: CheckpointStore>(store: &S) {
    for (step, note) in [(1, "t1 tools"), (2, "t1 tools 2"), (3, "t1 answer")] {
        put(store, fenced("s1", step, note, "turn1", 1), t(0)).await;
    }
    let second = put(store, fenced("s1", 1, "t2 tools", "turn2", 1), t(0)).await;
    assert_eq!(second.id, "s1:turn2:1");

    assert_eq!(note(&store.latest("s1").await.unwrap()), "t2 tools");
    let turn2 = read_turn(store, "s1", "turn2", None).await.unwrap();
    assert_eq!((turn2.step, note(&turn2)), (1, "t2 tools"));
    let turn1 = read_turn(store, "s1", "turn1", None).await.unwrap();
    assert_eq!((turn1.step, note(&turn1)), (3, "t1 answer"));
    // Every row of the earlier turn is still there, by id and in the list.
    assert_eq!(note(&store.get("s1:turn1:1").await.unwrap()), "t1 tools");
    let ids: Vec<String> = rows(store, "s1").await.into_iter().map(|c| c.id).collect();
    assert_eq!(
        ids,
        ["s1:turn2:1", "s1:turn1:3", "s1:turn1:2", "s1:turn1:1"]
    );
    // A turn of another owner with the same id is not this owner's.
    assert_eq!(
        code(read_turn(store, "s1#a", "turn1", None).await),
        ErrorCode::NotFound
    );
}

/// `latest` of a turn goes by write order within the turn, whatever the owner wrote since in other
/// turns (migration 0005 reads it through `(agent_id, turn_id, step)`, sorted by `write_seq`).
async fn a_turns_latest_is_its_last_write_not_its_highest_step<S: CheckpointStore>(store: &S) {
    for (step, note) in [(1, "one"), (2, "two"), (3, "three")] {
        put(store, fenced("s1", step, note, "turn1", 1), t(0)).await;
    }
    put(store, fenced("s1", 1, "turn2 one", "turn2", 1), t(0)).await;
    // Step 2 written again (a tool step's results after its intent), then more of turn 2.
    put(store, fenced("s1", 2, "two again", "turn1", 1), t(0)).await;
    put(store, fenced("s1", 5, "turn2 five", "turn2", 1), t(0)).await;
    let turn1 = read_turn(store, "s1", "turn1", None).await.unwrap();
    assert_eq!((turn1.step, note(&turn1)), (2, "two again"));
    let turn1 = read_turn(store, "s1", "turn1", Some(1)).await.unwrap();
    assert_eq!(
        (turn1.step, note(&turn1)),
        (2, "two again"),
        "the fenced read too"
    );
    let turn2 = read_turn(store, "s1", "turn2", None).await.unwrap();
    assert_eq!((turn2.step, note(&turn2)), (5, "turn2 five"));
    assert_eq!(note(&store.latest("s1").await.unwrap()), "turn2 five");
}

async fn a_fenced_read_shuts_out_older_attempts<S: CheckpointStore>(store: &S) {
    put(store, fenced("s1", 1, "a1 step1", "turn1", 1), t(0)).await;
    // Attempt 2 (a redelivery) reads before it writes anything.
    let read = read_turn(store, "s1", "turn1", Some(2)).await.unwrap();
    assert_eq!(note(&read), "a1 step1");
    // Attempt 1's save still in flight lands after the read: refused, so the read was the truth.
    let late = store
        .save(fenced("s1", 2, "a1 step2", "turn1", 1), t(0))
        .await
        .unwrap_err();
    assert_eq!(late.code(), ErrorCode::Conflict, "{late}");
    assert_eq!(
        code(read_turn(store, "s1", "turn1", Some(1)).await),
        ErrorCode::Conflict,
        "an older attempt's read is refused too"
    );
    // The same attempt may read again; an unfenced read changes nothing.
    read_turn(store, "s1", "turn1", Some(2)).await.unwrap();
    read_turn(store, "s1", "turn1", None).await.unwrap();
    // A turn with no rows yet: not found, but its attempt is recorded all the same.
    assert_eq!(
        code(read_turn(store, "s1", "turn9", Some(3)).await),
        ErrorCode::NotFound
    );
    let err = store
        .save(fenced("s1", 1, "old", "turn9", 2), t(0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    for (owner, turn, attempt) in [
        ("s.1.2", "turn1", 1),
        ("s1", "t.1", 1),
        ("s1", "", 1),
        ("s1", "turn1", 0),
    ] {
        assert_eq!(
            code(read_turn(store, owner, turn, Some(attempt)).await),
            ErrorCode::BadRequest,
            "{owner} {turn} {attempt}"
        );
    }
}

/// The first attempt's fenced read records nothing (no attempt is older), yet is refused once a
/// newer attempt is recorded, and the first attempt's saves stay fenced by what it read.
async fn the_first_attempts_read_fences_as_the_others_do<S: CheckpointStore>(store: &S) {
    assert_eq!(
        code(read_turn(store, "s1", "turn1", Some(1)).await),
        ErrorCode::NotFound
    );
    put(store, fenced("s1", 1, "a1 step1", "turn1", 1), t(0)).await;
    let read = read_turn(store, "s1", "turn1", Some(1)).await.unwrap();
    assert_eq!(note(&read), "a1 step1");
    // A newer attempt took the turn over (its read raised the record).
    read_turn(store, "s1", "turn1", Some(2)).await.unwrap();
    assert_eq!(
        code(read_turn(store, "s1", "turn1", Some(1)).await),
        ErrorCode::Conflict
    );
    let late = store
        .save(fenced("s1", 2, "a1 step2", "turn1", 1), t(0))
        .await;
    assert_eq!(code(late), ErrorCode::Conflict);
    // A newer attempt that only saved (no read) fences the first attempt's read too.
    put(store, fenced("s1", 1, "a3 step1", "turn2", 3), t(0)).await;
    assert_eq!(
        code(read_turn(store, "s1", "turn2", Some(1)).await),
        ErrorCode::Conflict
    );
}

async fn reads_of_missing_rows_are_not_found<S: CheckpointStore>(store: &S) {
    assert_eq!(code(store.latest("nobody").await), ErrorCode::NotFound);
    assert_eq!(code(store.get("nobody:1").await), ErrorCode::NotFound);
    assert!(rows(store, "nobody").await.is_empty());
}

async fn list_is_most_recent_write_first_and_limited<S: CheckpointStore>(store: &S) {
    for step in 1..=60 {
        put(store, checkpoint("s1", step, "x"), t(100 - i64::from(step))).await;
    }
    let steps = |rows: Vec<Checkpoint>| rows.into_iter().map(|c| c.step).collect::<Vec<_>>();
    let page = steps(rows(store, "s1").await);
    assert_eq!(
        page,
        (11..=60).rev().collect::<Vec<_>>(),
        "default limit 50"
    );
    assert_eq!(
        steps(store.list("s1", Some(3)).await.unwrap()),
        [60, 59, 58]
    );
    assert_eq!(store.list("s1", Some(5000)).await.unwrap().len(), 60);
    put(store, checkpoint("s1", 7, "again"), t(0)).await;
    assert_eq!(
        steps(store.list("s1", Some(3)).await.unwrap()),
        [7, 60, 59],
        "an overwrite is the most recent write"
    );
}

async fn legs_never_see_each_others_rows<S: CheckpointStore>(store: &S) {
    put(store, checkpoint("s1", 2, "main"), t(3)).await;
    put(store, checkpoint("s1#a", 2, "leg a"), t(2)).await;
    put(store, checkpoint("s1#a", 7, "leg a7"), t(1)).await;
    put(store, checkpoint("s1#b", 1, "leg b"), t(0)).await;
    assert_eq!(note(&store.latest("s1").await.unwrap()), "main");
    assert_eq!(note(&store.latest("s1#a").await.unwrap()), "leg a7");
    assert_eq!(note(&store.latest("s1#b").await.unwrap()), "leg b");
    assert_eq!(note(&store.get("s1:2").await.unwrap()), "main");
    assert_eq!(note(&store.get("s1#a:2").await.unwrap()), "leg a");
    assert_eq!(rows(store, "s1").await.len(), 1);
    assert_eq!(rows(store, "s1#a").await.len(), 2);
    assert!(rows(store, "s1#c").await.is_empty());
    let kept = retain(store, RetainRequest::keep_last("s1#a", 0)).await;
    assert_eq!(kept, 2);
    assert_eq!(note(&store.latest("s1").await.unwrap()), "main");
    assert_eq!(note(&store.latest("s1#b").await.unwrap()), "leg b");
}

async fn reads_never_delete<S: CheckpointStore>(store: &S) {
    for step in 1..=4 {
        put(store, checkpoint("s1", step, "x"), t(0)).await;
    }
    for _ in 0..3 {
        store.latest("s1").await.unwrap();
        store.get("s1:2").await.unwrap();
        store.list("s1", Some(2)).await.unwrap();
    }
    assert_eq!(rows(store, "s1").await.len(), 4);
    for step in 1..=4 {
        store.get(&format!("s1:{step}")).await.unwrap();
    }
}

async fn fencing_refuses_older_attempts_of_a_turn<S: CheckpointStore>(store: &S) {
    put(store, fenced("s1", 1, "a1", "turn1", 1), t(5)).await;
    let live = put(store, fenced("s1", 1, "a2", "turn1", 2), t(4)).await;
    assert_eq!(live.attempt, Some(2));
    assert_eq!(live.turn_id.as_deref(), Some("turn1"));

    // The zombie attempt 1 wakes up: neither its overwrite nor its next step lands.
    let err = store
        .save(fenced("s1", 1, "zombie", "turn1", 1), t(3))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict, "{err}");
    let err = store
        .save(fenced("s1", 2, "zombie", "turn1", 1), t(3))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    assert_eq!(note(&store.get("s1:turn1:1").await.unwrap()), "a2");
    assert_eq!(code(store.get("s1:turn1:2").await), ErrorCode::NotFound);

    // Equal and newer attempts are accepted; the newer one raises the bar.
    put(store, fenced("s1", 2, "a2 step2", "turn1", 2), t(2)).await;
    put(store, fenced("s1", 3, "a3", "turn1", 3), t(1)).await;
    let err = store
        .save(fenced("s1", 4, "late a2", "turn1", 2), t(0))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::Conflict);
    assert_eq!(store.latest("s1").await.unwrap().step, 3);
}

async fn fencing_is_per_turn_and_optional<S: CheckpointStore>(store: &S) {
    put(store, fenced("s1", 1, "t1", "turn1", 5), t(3)).await;
    // Another turn starts at attempt 1 regardless of turn1's attempts.
    put(store, fenced("s1", 2, "t2", "turn2", 1), t(2)).await;
    // A save without a fencing token is never fenced.
    let plain = put(store, checkpoint("s1", 1, "plain"), t(1)).await;
    assert_eq!(plain.turn_id, None);
    assert_eq!(plain.attempt, None);
    assert_eq!(note(&store.get("s1:1").await.unwrap()), "plain");
    assert_eq!(note(&store.get("s1:turn1:1").await.unwrap()), "t1");
}

async fn concurrent_attempts_leave_the_newest_attempts_row<S: CheckpointStore>(store: &S) {
    let now = t(0);
    let saves = (1..=8).rev().map(|attempt| {
        store.save(
            fenced("s1", 1, &format!("attempt {attempt}"), "turn1", attempt),
            now,
        )
    });
    let results = futures::future::join_all(saves).await;
    for result in &results {
        if let Err(err) = result {
            assert_eq!(err.code(), ErrorCode::Conflict, "{err}");
        }
    }
    assert!(results[0].is_ok(), "the newest attempt is never fenced off");
    let row = store.get("s1:turn1:1").await.unwrap();
    assert_eq!(row.attempt, Some(8));
    assert_eq!(note(&row), "attempt 8");
}

/// On PostgreSQL these are written in batches (group commit): each save still gets its own
/// answer — its own timestamps, or its own refusal.
async fn many_turns_saving_at_once_each_get_their_own_answer<S: CheckpointStore>(store: &S) {
    put(store, fenced("s0", 1, "live", "stale", 2), t(1)).await;
    let at = |i: i64| DateTime::from_timestamp(1_800_000_000 + i, 0).unwrap();
    let mut saves = Vec::new();
    for i in 0..40 {
        let owner = format!("s{}", i % 5 + 1);
        let cp = fenced(&owner, 1, &format!("turn {i}"), &format!("turn{i}"), 1);
        saves.push(store.save(cp, at(i)));
    }
    // An older attempt of a live turn, in the middle of them.
    saves.insert(
        20,
        store.save(fenced("s0", 2, "zombie", "stale", 1), at(99)),
    );
    let mut results = futures::future::join_all(saves).await;
    assert_eq!(code(results.remove(20)), ErrorCode::Conflict);
    assert_eq!(code(store.get("s0:stale:2").await), ErrorCode::NotFound);
    for (i, result) in results.into_iter().enumerate() {
        let saved = result.unwrap();
        assert_eq!(note(&saved), format!("turn {i}"));
        let read = store.get(&saved.id).await.unwrap();
        assert_eq!(note(&read), format!("turn {i}"));
        // Every save had its own time: a mixed-up answer would carry another save's.
        assert_eq!(saved.updated_at, read.updated_at, "save {i}");
        assert_eq!(saved.created_at, read.created_at, "save {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_writes_concurrent_steps_saves_in_batches() {
    let (store, _db) = pg_store(&options()).await;
    many_turns_saving_at_once_each_get_their_own_answer(&store).await;
    let (batches, saves) = store.grouped_saves();
    assert!(
        batches >= 1 && saves >= 2 * batches,
        "{batches} batches, {saves} saves"
    );
    store.close().await;
}

/// States over the TOAST threshold are compressed with lz4 where the server was built with it
/// (migration 0006): both state columns ask for it, and a large state saved now is stored so.
#[tokio::test]
async fn postgres_compresses_large_states_with_lz4_where_the_server_has_it() {
    use sqlx::Connection;
    let (store, db) = pg_store(&options()).await;
    let columns = [("checkpoint_bases", "state"), ("checkpoints", "state")];
    let (has_lz4, methods) = db.column_compression(&columns).await;
    let want = if has_lz4 { "l" } else { "" };
    assert_eq!(methods, [want, want]);
    let mut conn = sqlx::PgConnection::connect(&db.url).await.unwrap();
    store
        .save(checkpoint("big", 1, &"a".repeat(3500)), Utc::now())
        .await
        .unwrap();
    let stored: Option<String> =
        sqlx::query_scalar("SELECT pg_column_compression(state) FROM checkpoints")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    let want = if has_lz4 { "lz4" } else { "pglz" };
    assert_eq!(stored.as_deref(), Some(want));
    store.close().await;
}

async fn bad_input_is_refused_with_its_code_and_the_store_keeps_working<S: CheckpointStore>(
    store: &S,
) {
    let now = t(0);
    let mut bad_saves = vec![
        checkpoint("s.1.2", 1, "bad owner"),
        checkpoint("s1#", 1, "empty leg"),
        checkpoint("s1#a#b", 1, "two legs"),
        checkpoint(&"s".repeat(129), 1, "too long"),
        Checkpoint {
            id: "s1:2".into(),
            ..checkpoint("s1", 1, "id and step disagree")
        },
        Checkpoint {
            id: "s2:1".into(),
            ..checkpoint("s1", 1, "id and owner disagree")
        },
        Checkpoint {
            attempt: Some(1),
            ..checkpoint("s1", 1, "attempt without turn")
        },
        Checkpoint {
            turn_id: Some("t1".into()),
            ..checkpoint("s1", 1, "turn without attempt")
        },
        fenced("s1", 1, "bad turn id", "t.1", 1),
        fenced("s1", 1, "attempt 0: no delivery is numbered so", "t1", 0),
    ];
    for cp in bad_saves.drain(..) {
        let what = note(&cp).to_owned();
        let err = store.save(cp, now).await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadRequest, "{what}: {err}");
    }
    let too_big = Checkpoint {
        state: big_state(MAX_STATE + 1),
        ..checkpoint("s1", 1, "")
    };
    let err = store.save(too_big, now).await.unwrap_err();
    assert_eq!(err.code(), ErrorCode::TooLarge, "{err}");

    for owner in ["", "s 1", "s1#", "s*"] {
        assert_eq!(code(store.latest(owner).await), ErrorCode::BadRequest);
        assert_eq!(code(store.list(owner, None).await), ErrorCode::BadRequest);
    }
    for id in [
        "s1", "s1:", "s1:x", "s1:01", "s.1.2:1", ":1", "s1::1", "s1:t.1:1",
    ] {
        assert_eq!(code(store.get(id).await), ErrorCode::BadRequest, "{id}");
    }
    assert_eq!(code(store.list("s1", Some(0)).await), ErrorCode::BadRequest);
    for req in [
        RetainRequest::default(),
        RetainRequest {
            older_than_secs: Some(1),
            ..RetainRequest::keep_last("s1", 1)
        },
        RetainRequest::keep_last("s.1.2", 1),
        RetainRequest::older_than(u64::MAX),
    ] {
        assert_eq!(
            code(store.retain(&req, now).await),
            ErrorCode::BadRequest,
            "{req:?}"
        );
    }

    // Nothing was written, and the store still serves.
    assert!(rows(store, "s1").await.is_empty());
    let just_fits = Checkpoint {
        state: big_state(MAX_STATE - 100),
        ..checkpoint("s1", 1, "")
    };
    put(store, just_fits, now).await;
    assert_eq!(store.latest("s1").await.unwrap().step, 1);
}

async fn retain_keep_last_keeps_the_newest_steps_of_one_owner<S: CheckpointStore>(store: &S) {
    for step in 1..=10 {
        put(store, checkpoint("s1", step, "x"), t(0)).await;
        put(store, checkpoint("s1#a", step, "x"), t(0)).await;
    }
    let deleted = retain(store, RetainRequest::keep_last("s1", 3)).await;
    assert_eq!(deleted, 7);
    let steps: Vec<u32> = rows(store, "s1").await.iter().map(|c| c.step).collect();
    assert_eq!(steps, [10, 9, 8]);
    assert_eq!(rows(store, "s1#a").await.len(), 10);
    let again = retain(store, RetainRequest::keep_last("s1", 3)).await;
    assert_eq!(again, 0, "retention is idempotent");
    let all = retain(store, RetainRequest::keep_last("s1", 0)).await;
    assert_eq!(all, 3);
    assert_eq!(code(store.latest("s1").await), ErrorCode::NotFound);
}

async fn retain_older_than_drops_only_idle_owners<S: CheckpointStore>(store: &S) {
    const DAY: i64 = 86_400;
    // Idle owner: every row three days old, written by a fenced turn.
    put(store, fenced("idle", 1, "x", "old-turn", 5), t(3 * DAY)).await;
    put(store, checkpoint("idle", 2, "x"), t(3 * DAY - 10)).await;
    // Mixed owner: an old row, but its newest row is fresh, so all of it stays.
    put(store, checkpoint("mixed", 1, "x"), t(3 * DAY)).await;
    put(store, checkpoint("mixed", 2, "x"), t(3600)).await;
    put(store, checkpoint("fresh", 1, "x"), t(0)).await;

    let deleted = retain(store, RetainRequest::older_than(DAY as u64)).await;
    assert_eq!(deleted, 2);
    assert_eq!(code(store.latest("idle").await), ErrorCode::NotFound);
    assert_eq!(rows(store, "mixed").await.len(), 2);
    assert_eq!(rows(store, "fresh").await.len(), 1);
    // The idle turn's fencing record went with it: a new attempt 1 of that id is accepted.
    put(store, fenced("idle", 1, "x", "old-turn", 1), t(0)).await;
}

/// An `older_than_secs` retention drops a turn's attempt record only when the turn has neither
/// raised it nor saved since the cut-off — also where a save of the recorded attempt did not
/// rewrite the record (SQLite, migration 0006), and where `keep_last` removed the turn's recent
/// rows. A record dropped too early would let a stalled older attempt write again.
async fn retention_drops_an_attempt_record_only_when_its_turn_is_idle<S: CheckpointStore>(
    store: &S,
) {
    const DAY: i64 = 86_400;
    // A turn started three days ago that saved a minute ago.
    put(store, fenced("live", 1, "x", "long-turn", 2), t(3 * DAY)).await;
    put(store, fenced("live", 2, "x", "long-turn", 2), t(60)).await;
    // A turn that saved an hour ago, whose rows `keep_last` then removed.
    put(store, fenced("kept", 1, "x", "cut-turn", 2), t(3 * DAY)).await;
    put(store, fenced("kept", 2, "x", "cut-turn", 2), t(3600)).await;
    assert_eq!(retain(store, RetainRequest::keep_last("kept", 0)).await, 2);
    // A turn idle for three days, of an owner with a fresh row of another turn.
    put(store, fenced("idle", 1, "x", "idle-turn", 2), t(3 * DAY)).await;
    put(store, fenced("idle", 1, "x", "new-turn", 1), t(0)).await;

    retain(store, RetainRequest::older_than(DAY as u64)).await;
    for (owner, turn) in [("live", "long-turn"), ("kept", "cut-turn")] {
        let late = store.save(fenced(owner, 9, "zombie", turn, 1), t(0)).await;
        assert_eq!(
            code(late),
            ErrorCode::Conflict,
            "{turn}'s record was dropped"
        );
    }
    // The idle turn's record went: its attempt 1 writes again.
    put(store, fenced("idle", 9, "attempt 1", "idle-turn", 1), t(0)).await;
}

/// A database created by the first migration (state as `jsonb`) keeps its rows through the
/// second (state as `json`), and the store serves them; new saves come back as sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_written_as_jsonb_survive_the_move_to_json() {
    use sqlx::{Connection, Executor, PgConnection};
    let db = common::PgTestDb::create(common::PG_PREFIX).await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    pg_apply(
        &mut conn,
        include_str!("../migrations/postgres/0001_checkpoints.sql"),
    )
    .await;
    conn.execute(
        "INSERT INTO checkpoints (id, agent_id, step, state, created_at, updated_at) \
         VALUES ('s1:1', 's1', 1, '{\"note\": \"old\", \"step\": 1}'::jsonb, now(), now())",
    )
    .await
    .unwrap();
    let _ = conn.close().await;

    let store = pg_connect(&db.url).await.unwrap();
    let old = store.latest("s1").await.unwrap();
    assert_eq!(note(&old), "old");
    let mut new = checkpoint("s1", 2, "new");
    new.state = cyrene_protocol::JsonObject::from_text(r#"{"note":"new",  "b":1}"#.into()).unwrap();
    put(&store, new, Utc::now()).await;
    assert_eq!(
        store.latest("s1").await.unwrap().state.as_str(),
        r#"{"note":"new",  "b":1}"#
    );
    store.close().await;
}

/// Rows written before checkpoints had per-turn ids are carried over: numbered in the order they
/// were last written (so `latest` is the last write), still readable by their old ids, and a new
/// turn's step 1 no longer collides with an old `s1:1`.
async fn old_rows_survive_the_move_to_turn_rows<S: CheckpointStore>(store: &S) {
    let latest = store.latest("s1").await.unwrap();
    assert_eq!(
        (latest.id.as_str(), note(&latest)),
        ("s1:1", "written last")
    );
    assert_eq!(note(&store.get("s1:2").await.unwrap()), "written first");
    // An in-flight turn from before the upgrade still finds its own rows by turn id.
    let old_turn = store
        .latest_of_turn("s1", "old-turn", Some(2), Utc::now())
        .await
        .unwrap();
    assert_eq!(old_turn.id, "s1:2");
    put(store, fenced("s1", 1, "new turn", "turn2", 1), Utc::now()).await;
    assert_eq!(note(&store.latest("s1").await.unwrap()), "new turn");
    assert_eq!(rows(store, "s1").await.len(), 3);
}

const OLD_ROWS: &str = "INSERT INTO checkpoints \
     (id, agent_id, step, state, turn_id, attempt, created_at, updated_at) VALUES \
     ('s1:2', 's1', 2, '{\"note\":\"written first\"}', 'old-turn', 1, \
      '2026-01-01T00:00:01.000000Z', '2026-01-01T00:00:01.000000Z'), \
     ('s1:1', 's1', 1, '{\"note\":\"written last\"}', NULL, NULL, \
      '2026-01-01T00:00:00.000000Z', '2026-01-01T00:00:09.000000Z')";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_rows_from_before_turn_rows_are_carried_over() {
    use sqlx::{Connection, Executor, SqliteConnection};
    let db = SqliteTestDb::new();
    let mut conn = SqliteConnection::connect(&format!("{}?mode=rwc", db.url))
        .await
        .unwrap();
    conn.execute(sqlx::raw_sql(include_str!(
        "../migrations/sqlite/0001_checkpoints.sql"
    )))
    .await
    .unwrap();
    // Recorded as applied, as a store of the previous release would have left it.
    let first = &cyrene_checkpoint_store::store::sqlite::MIGRATOR.migrations[0];
    conn.execute(sqlx::raw_sql(
        "CREATE TABLE _sqlx_migrations (version BIGINT PRIMARY KEY, description TEXT NOT NULL, \
         installed_on TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, success BOOLEAN NOT NULL, \
         checksum BLOB NOT NULL, execution_time BIGINT NOT NULL)",
    ))
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (?1, ?2, 1, ?3, 0)",
    )
    .bind(first.version)
    .bind(first.description.as_ref())
    .bind(first.checksum.as_ref())
    .execute(&mut conn)
    .await
    .unwrap();
    conn.execute(OLD_ROWS).await.unwrap();
    let _ = conn.close().await;
    let store = db.open(&options()).await;
    old_rows_survive_the_move_to_turn_rows(&store).await;
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_rows_from_before_turn_rows_are_carried_over() {
    use sqlx::{Connection, Executor, PgConnection};
    let db = common::PgTestDb::create(common::PG_PREFIX).await;
    // Everything before 0003, through the migrator, as the previous release left it.
    let store = pg_connect(&db.url).await.unwrap();
    store.close().await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    pg_apply(
        &mut conn,
        "DROP TABLE checkpoints; DROP SEQUENCE IF EXISTS checkpoints_write_seq; \
         DELETE FROM _sqlx_migrations WHERE version >= 3;",
    )
    .await;
    pg_apply(
        &mut conn,
        include_str!("../migrations/postgres/0001_checkpoints.sql"),
    )
    .await;
    pg_apply(
        &mut conn,
        include_str!("../migrations/postgres/0002_state_json.sql"),
    )
    .await;
    conn.execute(OLD_ROWS).await.unwrap();
    let _ = conn.close().await;
    let store = pg_connect(&db.url).await.unwrap();
    old_rows_survive_the_move_to_turn_rows(&store).await;
    store.close().await;
}

/// `DATABASE_URL` with `sslmode=require` (or `verify-ca` / `verify-full` with `sslrootcert`) reaches
/// PostgreSQL over TLS (rustls): the server reports the store's own connection as encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_when_the_url_asks_for_it() {
    let db = common::PgTestDb::create(common::PG_PREFIX).await;
    let encrypted = |store: &cyrene_checkpoint_store::PgStore| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let plain = pg_connect(&format!("{}?sslmode=disable", db.url))
        .await
        .unwrap();
    assert!(!encrypted(&plain).await);
    plain.close().await;
    let tls = pg_connect(&format!("{}?sslmode=require", db.url))
        .await
        .unwrap();
    assert!(encrypted(&tls).await, "sslmode=require did not encrypt");
    put(&tls, checkpoint("s1", 1, "over tls"), Utc::now()).await;
    assert_eq!(note(&tls.latest("s1").await.unwrap()), "over tls");
    tls.close().await;
    // The server's certificate checked against a CA file (Debian's self-signed one, where the
    // local server uses it): verify-ca passes, and a wrong CA is refused.
    let snakeoil = "/etc/ssl/certs/ssl-cert-snakeoil.pem";
    if std::path::Path::new(snakeoil).exists() {
        let url = format!("{}?sslmode=verify-ca&sslrootcert={snakeoil}", db.url);
        let verified = pg_connect(&url).await.unwrap();
        assert!(encrypted(&verified).await);
        verified.close().await;
        let public_cas = "/etc/ssl/certs/ca-certificates.crt";
        if std::path::Path::new(public_cas).exists() {
            let url = format!("{}?sslmode=verify-ca&sslrootcert={public_cas}", db.url);
            let refused = pg_connect(&url).await;
            assert!(
                refused.is_err(),
                "a certificate no given CA signed was accepted"
            );
        }
    }
}

/// A step of turn `turn` of owner `owner` that called `tools` (an assistant message of tool
/// calls and their results), as the loop worker saves it: a delta from `from`.
fn tool_step(owner: &str, turn: &str, step: u32, from: usize, tools: &[&str]) -> Checkpoint {
    let calls: Vec<Value> = tools
        .iter()
        .map(|name| json!({"type": "tool_call", "id": format!("c-{name}"), "name": name, "args": {}}))
        .collect();
    let results: Vec<Value> = tools
        .iter()
        .map(|name| {
            json!({"role": "tool", "content": [{"type": "tool_result",
            "tool_call_id": format!("c-{name}"), "name": format!("result-{name}"), "text": "ok"}]})
        })
        .collect();
    let mut messages = vec![json!({"role": "assistant", "content": calls})];
    messages.extend(results);
    let Value::Object(state) = json!({"step": step, "from": from, "messages": messages,
        "stop_reason": "tool_calls", "turn_id": turn})
    else {
        unreachable!()
    };
    let base = (step == 1).then(|| {
        let Value::Object(base) = json!({"messages": [msg("hello")]}) else {
            unreachable!()
        };
        JsonObject::from(base)
    });
    Checkpoint {
        base,
        state: state.into(),
        ..fenced(owner, step, "", turn, 1)
    }
}

fn turn_ref(agent_id: &str, turn_id: &str) -> TurnRef {
    TurnRef {
        agent_id: agent_id.into(),
        turn_id: turn_id.into(),
    }
}

/// `cyrene.checkpoint.progress` (docs/checkpoint-store.md): each turn's highest saved step and,
/// when asked, the tools its delta rows called — in call order, each once, never a result's name
/// or another turn's or leg's call; a turn without rows is at step 0; bad input is refused.
async fn progress_names_the_highest_step_and_the_tools_called<S: CheckpointStore>(store: &S) {
    put(
        store,
        tool_step("s1", "t1", 1, 1, &["search", "read"]),
        t(0),
    )
    .await;
    put(
        store,
        tool_step("s1", "t1", 2, 4, &["search", "fetch"]),
        t(0),
    )
    .await;
    // another turn of the owner, and another leg, with calls of their own
    put(store, tool_step("s1", "t0", 1, 1, &["older"]), t(0)).await;
    put(store, tool_step("s1#l2", "t1", 1, 1, &["leg"]), t(0)).await;
    let ask = |tool_names| ProgressRequest {
        turns: vec![
            turn_ref("s1", "t1"),
            turn_ref("s1", "t9"),
            turn_ref("s1#l2", "t1"),
        ],
        tool_names,
    };
    let got = store.progress(&ask(true)).await.unwrap();
    let summary: Vec<(&str, &str, u32, Vec<&str>)> = got
        .iter()
        .map(|p| {
            let names = p.tool_names.iter().map(String::as_str).collect();
            (p.agent_id.as_str(), p.turn_id.as_str(), p.step, names)
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("s1", "t1", 2, vec!["search", "read", "fetch"]),
            ("s1", "t9", 0, vec![]),
            ("s1#l2", "t1", 1, vec!["leg"]),
        ]
    );
    let steps_only = store.progress(&ask(false)).await.unwrap();
    assert!(steps_only.iter().all(|p| p.tool_names.is_empty()));
    assert_eq!(
        steps_only.iter().map(|p| p.step).collect::<Vec<_>>(),
        [2, 0, 1]
    );
    assert!(
        store
            .progress(&ProgressRequest::default())
            .await
            .unwrap()
            .is_empty()
    );

    // Hostile input: too many turns, bad ids; the store keeps answering.
    let many = |n: usize, tool_names| ProgressRequest {
        turns: (0..n).map(|i| turn_ref("s1", &format!("t{i}"))).collect(),
        tool_names,
    };
    assert_eq!(
        store
            .progress(&many(PROGRESS_MAX_TURNS, false))
            .await
            .unwrap()
            .len(),
        PROGRESS_MAX_TURNS
    );
    for refused in [
        many(PROGRESS_MAX_TURNS + 1, false),
        many(PROGRESS_MAX_TOOL_TURNS + 1, true),
        ProgressRequest {
            turns: vec![turn_ref("s1", "t1'; DROP TABLE checkpoints; --")],
            tool_names: false,
        },
        ProgressRequest {
            turns: vec![turn_ref("", "t1")],
            tool_names: true,
        },
        ProgressRequest {
            turns: vec![turn_ref(&"s".repeat(100_000), "t1")],
            tool_names: false,
        },
    ] {
        let err = store.progress(&refused).await.unwrap_err();
        assert_eq!(err.code(), ErrorCode::BadRequest, "{err}");
    }
    assert_eq!(store.progress(&ask(false)).await.unwrap()[0].step, 2);
}
