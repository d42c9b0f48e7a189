//! The runner's checkpoints (`super::checkpoint`) against the in-memory bus: deltas from the
//! last stored point, failed saves, fencing.

use super::*;

#[tokio::test]
async fn each_save_sends_only_what_its_step_added_and_the_base_once() {
    let fake = Fake::scripted([
        reply_tools(&["c1"]),
        reply_tools(&["c2", "c3"]),
        reply_text("done"),
    ]);
    let mut j = job();
    j.messages = (0..50)
        .map(|i| Message::text(Role::User, format!("old {i}")))
        .collect();
    completed(run_turn(&fake, &j, 1, &CFG).await);

    let deltas = fake.deltas.lock().unwrap();
    let shape = |cp: &Checkpoint| {
        let map = cp.state.to_map();
        let added = map["messages"].as_array().unwrap().len();
        (map["from"].as_u64().unwrap(), added, cp.base.is_some())
    };
    // The base (50 seeded messages) goes once, with the first save; then each step's call
    // and results, then the answer.
    assert_eq!(
        deltas.iter().map(shape).collect::<Vec<_>>(),
        [(50, 2, true), (52, 3, false), (55, 1, false)]
    );
    let base = deltas[0].base.as_ref().unwrap().to_map();
    assert_eq!(base["messages"].as_array().unwrap().len(), 50);
    // What a read rebuilds is the whole window.
    let last = state(fake.saved.lock().unwrap().last().unwrap());
    assert_eq!(last.messages.len(), 56);
    assert_eq!(last.messages[..50], j.messages[..]);
}

#[tokio::test]
async fn after_a_failed_save_the_next_one_resends_from_the_last_stored_point() {
    let fake = Fake::scripted(tool_steps_then(&["c1", "c2"], "done"));
    // The first save (with the base) fails: the second carries the base and both steps.
    *fake.failing_saves.lock().unwrap() = 1;
    completed(run_turn(&fake, &job(), 1, &CFG).await);
    let deltas = fake.deltas.lock().unwrap();
    let first = deltas[0].state.to_map();
    assert_eq!(deltas[0].step, 2);
    assert!(deltas[0].base.is_some(), "the base was never stored");
    assert_eq!(first["from"], 1);
    assert_eq!(first["messages"].as_array().unwrap().len(), 4);
    let last = state(fake.saved.lock().unwrap().last().unwrap());
    assert_eq!(last.messages.len(), 6);
}

#[tokio::test]
async fn other_non_conflict_save_failures_do_not_fail_the_turn() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("ok")]);
    *fake.save_error.lock().unwrap() = Some(ErrorBody::new(ErrorCode::Unavailable, "db down"));
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
}

#[tokio::test]
async fn a_fenced_off_attempt_stops_without_reporting() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("x")]);
    *fake.save_error.lock().unwrap() = Some(ErrorBody::new(ErrorCode::Conflict, "attempt 1 < 2"));
    assert_eq!(run_turn(&fake, &job(), 1, &CFG).await, TurnEnd::Stale);
    // The next model call overlaps the refused save, but no tool runs after the refusal.
    assert_eq!(
        *fake.tool_runs.lock().unwrap(),
        ["c1"],
        "no tool after the refusal"
    );
    assert!(fake.saved.lock().unwrap().is_empty());

    let fenced = Fake::default();
    fenced.then_steers(Err(ErrorBody::new(ErrorCode::Conflict, "old")));
    assert_eq!(run_turn(&fenced, &job(), 1, &CFG).await, TurnEnd::Stale);
    assert!(fenced.requests.lock().unwrap().is_empty());
}
