//! Redeliveries against the in-memory bus: resuming a crash-left row, reporting a settled turn
//! again (`super::settle`), never another turn's row, a failed or fenced read.

use super::*;

#[tokio::test]
async fn a_crash_left_checkpoint_resumes_without_rerunning_tools() {
    let crash_left = tool_step_left_by(1).await;

    let second = Fake::scripted([reply_text("It is noon.")]);
    *second.latest.lock().unwrap() = Some(crash_left);
    let done = completed(run_turn(&second, &job(), 2, &CFG).await);

    assert_eq!(done.steps, 2);
    assert!(
        second.tool_runs.lock().unwrap().is_empty(),
        "step 1's tool ran again"
    );
    assert_eq!(second.requests.lock().unwrap().len(), 1);
    assert_eq!(second.saved.lock().unwrap()[0].id, "s1:t1:2");
    assert_eq!(second.saved.lock().unwrap()[0].attempt, Some(2));
}

#[tokio::test]
async fn a_settled_turn_is_reported_again_not_rerun() {
    let settled = rows_left_by([reply_text("It is noon.")], 1).await.pop();

    let again = Fake::resuming(settled);
    let done = completed(run_turn(&again, &job(), 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.message.unwrap().text_content(), "It is noon.");
    assert!(again.requests.lock().unwrap().is_empty());
    assert!(again.saved.lock().unwrap().is_empty());
}

/// D18: a provider that finishes with `tool_calls` but sends no calls. The answer is
/// settled as the loop's `stop` (the raw reason beside it), and a redelivery after the save
/// reports it again instead of calling the model for a second answer.
#[tokio::test]
async fn an_answer_the_provider_calls_tool_calls_is_settled_and_never_answered_twice() {
    let mut odd = reply_text("It is noon.").unwrap();
    odd.stop_reason = "tool_calls".into();
    let first = Fake::scripted([Ok(odd)]);
    let done = completed(run_turn(&first, &job(), 1, &CFG).await);
    assert_eq!(
        (done.outcome, done.stop_reason.as_str()),
        (TurnOutcome::Final, "stop")
    );
    let settled = first.saved.lock().unwrap().last().cloned().unwrap();
    let saved = state(&settled);
    assert_eq!(
        (saved.stop_reason.as_str(), saved.finish_reason.as_str()),
        ("stop", "tool_calls")
    );

    let again = Fake::scripted([reply_text("a second answer")]);
    *again.latest.lock().unwrap() = Some(settled.clone());
    let redone = completed(run_turn(&again, &job(), 2, &CFG).await);
    assert_eq!(redone.message.unwrap().text_content(), "It is noon.");
    assert!(again.requests.lock().unwrap().is_empty(), "asked again");
    assert!(
        again.events.lock().unwrap().is_empty(),
        "a second final event"
    );

    // A row an older worker saved under the provider's `tool_calls`: the same.
    let mut legacy = settled;
    let mut map = legacy.state.to_map();
    map.insert("stop_reason".into(), serde_json::json!("tool_calls"));
    map.remove("finish_reason");
    legacy.state = map.into();
    let old = Fake::scripted([reply_text("a second answer")]);
    *old.latest.lock().unwrap() = Some(legacy);
    let redone = completed(run_turn(&old, &job(), 2, &CFG).await);
    assert_eq!(
        (redone.outcome, redone.stop_reason.as_str()),
        (TurnOutcome::Final, "stop")
    );
    assert_eq!(redone.message.unwrap().text_content(), "It is noon.");
    assert!(old.requests.lock().unwrap().is_empty(), "asked again");
}

#[tokio::test]
async fn a_settled_turn_is_reported_again_with_its_steered_messages() {
    let first = Fake::scripted([reply_text("Noon, and sunny.")]);
    first.then_steers(Ok(SteerResponse {
        messages: vec![SteeredMessage {
            id: "m2".into(),
            seq: 2,
            message: Message::text(Role::User, "and the weather?"),
        }],
    }));
    let reported = completed(run_turn(&first, &job(), 1, &CFG).await);
    assert_eq!(reported.steered_ids, ["m2"]);
    let settled = first.saved.lock().unwrap().last().cloned();

    // The report never arrived; the worker died; the redelivery must say the same.
    let again = Fake::resuming(settled);
    let done = completed(run_turn(&again, &job(), 2, &CFG).await);
    assert_eq!(
        done.steered_ids,
        ["m2"],
        "its steered message would be answered twice"
    );
    assert!(again.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn another_turns_checkpoint_is_never_resumed_or_reported() {
    let other_turn = tool_step_left_by(1).await;

    let fake = Fake::scripted([reply_text("fresh")]);
    *fake.latest.lock().unwrap() = Some(other_turn);
    let mut next = job();
    next.turn_id = "t2".into();
    let done = completed(run_turn(&fake, &next, 1, &CFG).await);
    assert_eq!((done.steps, done.turn_id.as_str()), (1, "t2"));
    assert_eq!(fake.saved.lock().unwrap()[0].id, "s1:t2:1");
}

#[tokio::test]
async fn a_failed_checkpoint_read_hands_the_job_back_instead_of_starting_fresh() {
    let fake = Fake::scripted([reply_tools(&["c1"])]);
    *fake.load_error.lock().unwrap() = Some(ErrorBody::new(ErrorCode::Unavailable, "store down"));
    let end = run_turn(&fake, &job(), 2, &CFG).await;
    assert_handed_back(&end, &fake);
    assert!(fake.tool_runs.lock().unwrap().is_empty(), "a tool ran");
    assert!(fake.steer_requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn an_attempt_older_than_the_latest_writer_stops_at_once() {
    let written_by_3 = tool_step_left_by(3).await;

    let zombie = Fake::resuming(Some(written_by_3));
    assert_eq!(run_turn(&zombie, &job(), 2, &CFG).await, TurnEnd::Stale);
    assert!(zombie.requests.lock().unwrap().is_empty());
    assert!(zombie.steer_requests.lock().unwrap().is_empty());
}
