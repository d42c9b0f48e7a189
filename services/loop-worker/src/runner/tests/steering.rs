//! Steering (`super::steering`) against the in-memory bus: steered and pushed input reach the
//! next view and never a checkpoint, and a message counts as taken in only once a model call
//! that saw it answered.

use super::*;

#[tokio::test]
async fn a_steered_message_reaches_the_next_step_but_never_a_checkpoint() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("done")]);
    let steered = SteeredMessage {
        id: "m2".into(),
        seq: 2,
        message: Message::text(Role::User, "and the date too"),
    };
    fake.steers.lock().unwrap().extend([
        Ok(SteerResponse::default()),
        Ok(SteerResponse {
            messages: vec![steered.clone()],
        }),
    ]);
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);

    assert_eq!(done.steered_ids, ["m2"]);
    let requests = fake.requests.lock().unwrap();
    assert!(!requests[0].messages.contains(&steered.message));
    assert_eq!(requests[1].messages.last(), Some(&steered.message));
    for cp in fake.saved.lock().unwrap().iter() {
        assert!(
            !state(cp).messages.contains(&steered.message),
            "steered text in {}",
            cp.id
        );
    }
    let steers = fake.steer_requests.lock().unwrap();
    assert_eq!((steers[0].step, steers[0].after_seq), (1, 1));
    assert_eq!((steers[1].step, steers[1].after_seq), (2, 1));
    let ack = fake
        .events
        .lock()
        .unwrap()
        .iter()
        .find(|e| e.kind == SessionEventType::SteerAck)
        .cloned();
    let ack = ack.expect("a steer_ack event");
    assert_eq!(
        (ack.at_step, ack.message_ids),
        (Some(2), vec!["m2".to_owned()])
    );
}

#[tokio::test]
async fn pushed_input_reaches_the_next_boundary_without_a_steer_request() {
    let (push, receiver) = futures::channel::mpsc::unbounded();
    let fake = Fake::scripted(tool_steps_then(&["c1", "c2"], "done"));
    *fake.pushes.lock().unwrap() = Some(receiver);
    let pushed = |id: &str, seq: u64| SteeredMessage {
        id: id.into(),
        seq,
        message: Message::text(Role::User, format!("pushed {id}")),
    };
    // Two pushes before the second boundary, out of order, one of them also returned by the
    // first steer: taken in once each, in seq order.
    fake.then_steers(Ok(SteerResponse {
        messages: vec![pushed("m2", 2)],
    }));
    push.unbounded_send(pushed("m3", 3)).unwrap();
    push.unbounded_send(pushed("m2", 2)).unwrap();
    push.unbounded_send(pushed("m4", 4)).unwrap();
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);

    assert_eq!(done.steered_ids, ["m2", "m3", "m4"]);
    let steers = fake.steer_requests.lock().unwrap();
    assert_eq!(steers.len(), 1, "only the first boundary asks");
    assert_eq!(steers[0].step, 1);
    let requests = fake.requests.lock().unwrap();
    let texts = |i: usize| -> Vec<String> {
        requests[i]
            .messages
            .iter()
            .map(Message::text_content)
            .filter(|t| t.starts_with("pushed"))
            .collect()
    };
    assert_eq!(texts(0), ["pushed m2"]);
    assert_eq!(texts(1), ["pushed m2", "pushed m3", "pushed m4"]);
    assert_eq!(texts(2), texts(1));
}

#[tokio::test]
async fn a_failed_steer_yields_nothing_and_the_turn_goes_on() {
    let fake = Fake::scripted([reply_text("fine")]);
    fake.then_steers(Err(ErrorBody::new(ErrorCode::Timeout, "slow")));
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert!(done.steered_ids.is_empty());
}

/// D16: the deadline passes while step 1's tool runs and a message waits to be steered in at
/// step 2. The turn ends without taking it (no steer, not in `steered_ids` or a checkpoint),
/// so the orchestrator hands it back to pending and it gets a turn of its own.
#[tokio::test]
async fn a_message_waiting_when_the_deadline_passes_is_not_taken_in() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("too late")]);
    fake.steers.lock().unwrap().extend([
        Ok(SteerResponse::default()),
        Ok(SteerResponse {
            messages: vec![steered("m2", 2, "and the weather?")],
        }),
    ]);
    let mut j = job();
    let deadline = now_unix_ms() + 2_000;
    j.deadline_unix_ms = Some(deadline);
    *fake.tool_until.lock().unwrap() = Some(deadline);
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);

    assert_eq!(done.outcome, TurnOutcome::Cancelled);
    assert_eq!(fake.requests.lock().unwrap().len(), 1, "step 1 ran");
    assert!(done.steered_ids.is_empty(), "{:?}", done.steered_ids);
    assert_eq!(
        fake.steer_requests.lock().unwrap().len(),
        1,
        "a turn past its deadline steers no more"
    );
    for cp in fake.saved.lock().unwrap().iter() {
        assert!(state(cp).steered_ids.is_empty(), "{}", cp.id);
    }
}

/// D16: a message counts as taken in only once a model call that saw it answered. Attempt 1
/// steers `m2` in and dies before its model call answers; attempt 2 (a redelivery past the
/// deadline, or one whose model call fails) must not report `m2` as taken in.
#[tokio::test]
async fn a_message_steered_in_before_a_crash_is_taken_in_only_by_a_model_call() {
    let first = Fake::scripted([reply_text("never sent")]);
    *first.model_delay.lock().unwrap() = Some(std::time::Duration::from_secs(3600));
    first.then_steers(Ok(SteerResponse {
        messages: vec![steered("m2", 2, "and the weather?")],
    }));
    let crashed = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        run_turn(&first, &job(), 1, &CFG),
    )
    .await;
    assert!(crashed.is_err(), "attempt 1 died in its model call");
    assert_eq!(first.steer_requests.lock().unwrap().len(), 1);

    // The orchestrator answers attempt 2's first steer with everything claimed for the turn.
    let again = || {
        let fake = Fake::default();
        fake.then_steers(Ok(SteerResponse {
            messages: vec![steered("m2", 2, "and the weather?")],
        }));
        fake
    };
    // Redelivered after the deadline: cancelled, and m2 goes back to pending.
    let late = again();
    let mut j = job();
    j.deadline_unix_ms = Some(1);
    let done = completed(run_turn(&late, &j, 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Cancelled);
    assert!(done.steered_ids.is_empty(), "{:?}", done.steered_ids);

    // Redelivered on its last attempt and the model call fails: an error, m2 not taken in.
    let failing = again();
    failing.then_replies(Err(ErrorBody::new(ErrorCode::Upstream, "400")));
    let done = completed(run_turn(&failing, &job(), 3, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Error);
    assert!(done.steered_ids.is_empty(), "{:?}", done.steered_ids);
    assert!(failing.saved_state(0).steered_ids.is_empty());

    // Redelivered and answered: m2 was in the answering call's view, so it is taken in.
    let answered = again();
    answered.then_replies(reply_text("sunny"));
    let done = completed(run_turn(&answered, &job(), 2, &CFG).await);
    assert_eq!(done.steered_ids, ["m2"]);
    assert_eq!(answered.saved_state(0).steered_ids, ["m2"]);
}

/// A resumed turn keeps what its checkpoint says was taken in, even when it ends before a
/// model call of its own.
#[tokio::test]
async fn a_resumed_turn_keeps_the_messages_its_checkpoint_took_in() {
    let (mut j, step2) = step_two_took_in_m2().await;
    let late = Fake::resuming(Some(step2));
    j.deadline_unix_ms = Some(1);
    let done = completed(run_turn(&late, &j, 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Cancelled);
    assert_eq!(done.steered_ids, ["m2"]);
}

/// A resumed turn whose checkpoint took in a steered message gets its text back only from its
/// first steer; when that steer fails, the job goes back instead of answering without it (which
/// would report the message answered). The next delivery's steer brings it, and the answer's
/// view holds it.
#[tokio::test]
async fn a_resumed_turn_whose_first_steer_fails_hands_the_job_back() {
    let (j, step2) = step_two_took_in_m2().await;
    let down = Fake::resuming(Some(step2.clone()));
    down.then_replies(reply_text("the answer"));
    down.then_steers(Err(ErrorBody::new(ErrorCode::Unavailable, "no responders")));
    let end = run_turn(&down, &j, 2, &CFG).await;
    assert!(
        matches!(end, TurnEnd::Retry(ref e) if e.code == ErrorCode::Unavailable),
        "{end:?}"
    );
    assert!(
        down.requests.lock().unwrap().is_empty(),
        "the model was asked without the steered message"
    );

    let up = Fake::resuming(Some(step2));
    up.then_replies(reply_text("the answer"));
    up.then_steers(Ok(SteerResponse {
        messages: vec![steered("m2", 2, "and the date")],
    }));
    let done = completed(run_turn(&up, &j, 3, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.steered_ids, ["m2"]);
    let requests = up.requests.lock().unwrap();
    let view = &requests.last().unwrap().messages;
    assert!(
        view.iter()
            .any(|m| m.text_content().contains("and the date")),
        "the answer's view lacks the steered message"
    );
}

/// A first delivery (of a four-step job) whose step 2 saw the steered message `m2` and asked for
/// tools: the job, and step 2's row, which is what a crash after its save leaves.
async fn step_two_took_in_m2() -> (TurnJob, Checkpoint) {
    let first = Fake::scripted([reply_tools(&["c1"]), reply_tools(&["c2"])]);
    first.steers.lock().unwrap().extend([
        Ok(SteerResponse::default()),
        Ok(SteerResponse {
            messages: vec![steered("m2", 2, "and the date")],
        }),
    ]);
    let mut j = job();
    j.max_steps = 4;
    let _ = run_turn(&first, &j, 1, &CFG).await;
    let step2 = first
        .saved
        .lock()
        .unwrap()
        .iter()
        .find(|c| c.step == 2)
        .cloned()
        .unwrap();
    assert_eq!(state(&step2).steered_ids, ["m2"]);
    (j, step2)
}
