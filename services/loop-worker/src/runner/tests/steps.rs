//! The step loop against the in-memory bus: a checkpoint per step, the answer, the step budget
//! and its safety net, the deadline, retryable failures, and what tool calls carry.

use super::*;

#[tokio::test]
async fn a_tool_turn_checkpoints_every_step_and_ends_with_the_answer() {
    let fake = Fake::scripted([reply_tools(&["c1", "c2"]), reply_text("It is noon.")]);
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);

    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.steps, 2);
    let answer = done.message.unwrap();
    assert_eq!(answer.text_content(), "It is noon.");
    assert_eq!(answer.sender_name, "cyrene");
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["c1", "c2"]);

    let saved = fake.saved.lock().unwrap();
    assert_eq!(saved.len(), 2);
    assert_eq!(
        (saved[0].id.as_str(), saved[0].attempt),
        ("s1:t1:1", Some(1))
    );
    assert_eq!(state(&saved[0]).stop_reason, "tool_calls");
    // user, assistant tool calls, two results in call order
    let window = state(&saved[0]).messages;
    assert_eq!(window.len(), 4);
    assert_eq!(window[2].tool_call_id, "c1");
    assert_eq!(window[3].tool_call_id, "c2");
    assert_eq!(state(&saved[1]).stop_reason, "stop");
    assert_eq!(state(&saved[1]).messages.len(), 5);

    // The second model call saw the tool results; both started with the instructions.
    let requests = fake.requests.lock().unwrap();
    assert_eq!(
        requests[0].messages[0],
        Message::text(Role::System, "You are Cyrene.")
    );
    // instructions, time block, user, assistant calls, two results: the assistant message is
    // labelled with its persona, but only one persona spoke, so attribution renders nothing
    // (docs/semantics.md#attribution).
    assert_eq!(requests[1].messages.len(), 6);
    assert!(
        requests[1]
            .messages
            .iter()
            .all(|m| !m.text_content().starts_with("[会话角色]")
                && !m.text_content().starts_with("[发言归属]"))
    );
    assert_eq!(requests[0].persona_id, "cyrene");

    let kinds: Vec<_> = fake.events.lock().unwrap().iter().map(|e| e.kind).collect();
    use SessionEventType::*;
    assert_eq!(kinds, [Step, ToolCall, ToolResult, ToolResult, Step, Final]);
}

#[tokio::test]
async fn retryable_model_failures_retry_until_the_last_attempt_then_settle() {
    let fake = Fake::scripted([Err(ErrorBody::new(ErrorCode::Unavailable, "no gateway"))]);
    assert!(matches!(
        run_turn(&fake, &job(), 1, &CFG).await,
        TurnEnd::Retry(_)
    ));
    assert!(
        fake.saved.lock().unwrap().is_empty(),
        "nothing settled: the next attempt runs"
    );

    fake.then_replies(Err(ErrorBody::new(ErrorCode::Unavailable, "no gateway")));
    let done = completed(run_turn(&fake, &job(), 3, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Error);
    assert_eq!(done.error.unwrap().code, ErrorCode::Unavailable);
    assert_eq!(fake.saved_state(0).stop_reason, "error");
    assert!(
        fake.events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == SessionEventType::Error)
    );

    let bad = Fake::scripted([Err(ErrorBody::new(
        ErrorCode::Upstream,
        "400 from provider",
    ))]);
    assert_eq!(
        completed(run_turn(&bad, &job(), 1, &CFG).await).outcome,
        TurnOutcome::Error
    );
}

#[tokio::test]
async fn running_out_of_steps_settles_as_budget_exhausted() {
    let fake = Fake::scripted([reply_tools(&["a"]), reply_tools(&["b"])]);
    let mut j = job();
    j.max_steps = 2;
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::BudgetExhausted);
    let last = fake.saved.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (last.step, state(&last).stop_reason.as_str()),
        (2, "budget_exhausted")
    );
}

#[tokio::test]
async fn a_call_with_undecodable_args_gets_an_error_result_without_running() {
    let mut r = reply_tools(&["bad"]).unwrap();
    r.tool_calls[0].args_error = Some("expected value at line 1".into());
    let fake = Fake::scripted([Ok(r), reply_text("sorry")]);
    let _ = run_turn(&fake, &job(), 1, &CFG).await;
    assert!(fake.tool_runs.lock().unwrap().is_empty());
    let window = fake.saved_state(0).messages;
    assert!(
        matches!(&window[2].content[0], Part::ToolResult { is_error: true, text, .. }
        if text.contains("not valid JSON"))
    );
}

#[tokio::test]
async fn a_passed_deadline_settles_as_cancelled() {
    let fake = Fake::default();
    let mut j = job();
    j.deadline_unix_ms = Some(1);
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Cancelled);
    assert!(fake.requests.lock().unwrap().is_empty());
    assert_eq!(fake.saved_state(0).stop_reason, "canceled");
}

#[tokio::test]
async fn the_step_budget_ends_with_a_safety_net_answer_without_tools() {
    let fake = Fake::scripted(tool_steps_then(&["a", "b"], "From what I found: noon."));
    let mut j = job();
    j.max_steps = 2;
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.stop_reason, "safety_net");
    assert_eq!(done.steps, 2);
    assert_eq!(
        done.message.unwrap().text_content(),
        "From what I found: noon."
    );
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["a", "b"]);
    let last = fake.requests.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.tool_choice, Some(serde_json::json!({"type": "none"})));
    assert_eq!(
        last.messages.last().unwrap().text_content(),
        SAFETY_NET_NOTE
    );
    let settled = fake.saved.lock().unwrap().last().cloned().unwrap();
    let settled_state = state(&settled);
    assert_eq!(
        (settled.step, settled_state.stop_reason.as_str()),
        (2, "safety_net")
    );
    assert!(
        settled_state
            .messages
            .iter()
            .all(|m| m.text_content() != SAFETY_NET_NOTE),
        "the note is view only"
    );

    // Redelivered after the report was lost: reported again, not rerun.
    let again = Fake::resuming(Some(settled));
    let done = completed(run_turn(&again, &j, 2, &CFG).await);
    assert_eq!(
        (done.outcome, done.stop_reason.as_str()),
        (TurnOutcome::Final, "safety_net")
    );
    assert!(again.requests.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_model_call_still_running_at_the_deadline_is_abandoned_as_aborted() {
    let fake = Fake::scripted([reply_text("too late")]);
    *fake.model_delay.lock().unwrap() = Some(std::time::Duration::from_secs(30));
    let mut j = job();
    j.deadline_unix_ms = Some(now_unix_ms() + 150);
    let started = std::time::Instant::now();
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    assert_eq!(done.outcome, TurnOutcome::Cancelled);
    assert_eq!(done.stop_reason, "aborted");
    assert_eq!(fake.saved_state(0).stop_reason, "aborted");
}

#[tokio::test]
async fn tool_calls_carry_the_turns_allow_list() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("ok")]);
    let mut j = job();
    j.tools = Some(vec!["current_time".into()]);
    let _ = run_turn(&fake, &j, 1, &CFG).await;
    let contexts = fake.tool_contexts.lock().unwrap();
    assert_eq!(contexts[0].allowed, Some(vec!["current_time".to_owned()]));
}
