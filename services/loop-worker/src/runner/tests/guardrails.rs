//! Guardrails (`super::guardrails`) against the in-memory bus: a denied call runs nothing of its
//! batch, a denied answer never reaches the session, and a guard that is down, slow or malformed
//! fails closed or open as configured.

use super::*;

const GUARD_MESSAGE: &str = "I can't help with that here.";

fn guarded(fail: GuardFail) -> TurnJob {
    TurnJob {
        guard: Some(GuardSpec {
            subject: "cyrene.guard.policy".into(),
            timeout_ms: 1_000,
            fail,
            message: GUARD_MESSAGE.into(),
        }),
        ..job()
    }
}

fn allow(_: &GuardRequest) -> Result<Vec<u8>, ErrorBody> {
    Ok(br#"{"allow":true}"#.to_vec())
}

/// Denies every call of `count` and any answer that mentions a secret.
fn policy(request: &GuardRequest) -> Result<Vec<u8>, ErrorBody> {
    let denied = match request.kind {
        GuardKind::ToolCall => request.tool.as_deref() == Some("count"),
        GuardKind::Answer => request.text.as_deref().unwrap_or("").contains("secret"),
    };
    Ok(serde_json::to_vec(&serde_json::json!({
        "allow": !denied,
        "reason": if denied { "policy 7: internal rule text" } else { "" },
    }))
    .unwrap())
}

fn named_calls(names: &[(&str, &str)]) -> Result<ModelResponse, ErrorBody> {
    let mut r = reply_tools(&names.iter().map(|(id, _)| *id).collect::<Vec<_>>())?;
    for (call, (_, name)) in r.tool_calls.iter_mut().zip(names) {
        call.name = (*name).into();
    }
    r.message = Message::assistant_tool_calls(&r.tool_calls);
    Ok(r)
}

/// Asserts a turn ended by its guard: the configured message as its answer, none of the
/// guard's reason for the person, a settled `guardrail` checkpoint holding the reason.
fn assert_guardrail(fake: &Fake, done: &TurnComplete, reason_has: &str) -> Checkpoint {
    assert_eq!(
        (done.outcome, done.stop_reason.as_str()),
        (TurnOutcome::Final, "guardrail")
    );
    let answer = done.message.clone().unwrap();
    assert_eq!(answer.text_content(), GUARD_MESSAGE);
    assert_eq!(answer.sender_name, "cyrene");
    let settled = fake.saved.lock().unwrap().last().cloned().unwrap();
    let st = state(&settled);
    assert_eq!(st.stop_reason, "guardrail");
    assert!(st.guard_reason.contains(reason_has), "{}", st.guard_reason);
    assert_eq!(st.messages.last(), Some(&answer));
    let events = fake.events.lock().unwrap();
    let last = events.last().unwrap();
    assert_eq!(last.kind, SessionEventType::Final);
    assert_eq!(last.message.as_ref().unwrap().text_content(), GUARD_MESSAGE);
    for event in events.iter() {
        let shown = serde_json::to_string(event).unwrap();
        assert!(
            !shown.contains("internal rule"),
            "the reason reached the session: {shown}"
        );
    }
    settled
}

#[tokio::test]
async fn a_denied_tool_call_never_runs_and_neither_does_its_batch() {
    let fake = Fake::scripted([
        named_calls(&[("c1", "current_time"), ("c2", "count")]),
        reply_text("never asked"),
    ]);
    *fake.guard_rule.lock().unwrap() = Some(policy);
    let j = guarded(GuardFail::Closed);
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);

    assert!(
        fake.tool_runs.lock().unwrap().is_empty(),
        "no call of the batch ran"
    );
    assert_eq!(fake.requests.lock().unwrap().len(), 1, "no further step");
    let settled = assert_guardrail(&fake, &done, "tool_call count: policy 7");
    assert_eq!(done.steps, 1);
    // Both calls were asked about, each with its name and arguments.
    let asks = fake.guard_asks.lock().unwrap().clone();
    assert_eq!(asks.len(), 2);
    for (subject, request) in &asks {
        assert_eq!(subject, "cyrene.guard.policy");
        assert_eq!(request.kind, GuardKind::ToolCall);
        assert_eq!(
            (request.session_id.as_str(), request.turn_id.as_str()),
            ("s1", "t1")
        );
        assert_eq!(request.persona, "cyrene");
        assert!(request.arguments.is_some() && request.text.is_none());
    }
    assert!(
        fake.events
            .lock()
            .unwrap()
            .iter()
            .all(|e| e.kind != SessionEventType::ToolCall),
        "a stopped call is not announced"
    );

    // Redelivered after the report was lost: reported again, nothing asked or run.
    let again = Fake::resuming(Some(settled));
    let redone = completed(run_turn(&again, &j, 2, &CFG).await);
    assert_eq!(
        (
            redone.stop_reason.as_str(),
            redone.message.unwrap().text_content()
        ),
        ("guardrail", GUARD_MESSAGE.to_owned())
    );
    assert!(again.requests.lock().unwrap().is_empty());
    assert!(again.guard_asks.lock().unwrap().is_empty());
    assert!(again.tool_runs.lock().unwrap().is_empty());
}

#[tokio::test]
async fn allowed_calls_run_and_calls_with_undecodable_args_are_not_asked_about() {
    let mut bad = named_calls(&[("c1", "current_time"), ("c2", "count")]).unwrap();
    bad.tool_calls[1].args_error = Some("expected value".into());
    let fake = Fake::scripted([Ok(bad), reply_text("It is noon.")]);
    *fake.guard_rule.lock().unwrap() = Some(policy);
    let done = completed(run_turn(&fake, &guarded(GuardFail::Closed), 1, &CFG).await);
    assert_eq!(
        (done.outcome, done.stop_reason.as_str()),
        (TurnOutcome::Final, "stop")
    );
    assert_eq!(done.message.unwrap().text_content(), "It is noon.");
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["c1"]);
    let kinds: Vec<(GuardKind, Option<String>)> = fake
        .guard_asks
        .lock()
        .unwrap()
        .iter()
        .map(|(_, r)| (r.kind, r.tool.clone()))
        .collect();
    assert_eq!(
        kinds,
        [
            (GuardKind::ToolCall, Some("current_time".into())),
            (GuardKind::Answer, None)
        ]
    );
}

#[tokio::test]
async fn a_denied_answer_never_reaches_the_session_or_the_checkpoint() {
    let fake = Fake::scripted([reply_text("the secret is 42")]);
    *fake.guard_rule.lock().unwrap() = Some(policy);
    let done = completed(run_turn(&fake, &guarded(GuardFail::Closed), 1, &CFG).await);
    let settled = assert_guardrail(&fake, &done, "answer: policy 7");
    let asks = fake.guard_asks.lock().unwrap().clone();
    assert_eq!(asks.len(), 1);
    assert_eq!(asks[0].1.kind, GuardKind::Answer);
    assert_eq!(asks[0].1.text.as_deref(), Some("the secret is 42"));
    assert!(asks[0].1.tool.is_none() && asks[0].1.arguments.is_none());
    for shown in [
        serde_json::to_string(&*fake.events.lock().unwrap()).unwrap(),
        settled.state.as_str().to_owned(),
    ] {
        assert!(!shown.contains("secret is 42"), "{shown}");
    }
    // No step of a guarded turn is previewed as deltas; an unguarded one is.
    let tags = fake.tags.lock().unwrap().clone();
    assert!(
        !tags.is_empty() && tags.iter().all(|t| !t.preview),
        "{tags:?}"
    );
    let open = Fake::scripted([reply_text("hello")]);
    let _ = run_turn(&open, &job(), 1, &CFG).await;
    assert!(open.tags.lock().unwrap().iter().all(|t| t.preview));
}

#[tokio::test]
async fn the_safety_net_answer_is_asked_about_too() {
    let fake = Fake::scripted(tool_steps_then(
        &["a", "b"],
        "the secret, from what I found",
    ));
    *fake.guard_rule.lock().unwrap() = Some(policy);
    let mut j = guarded(GuardFail::Closed);
    j.max_steps = 2;
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["a", "b"]);
    assert_guardrail(&fake, &done, "answer: policy 7");
}

#[tokio::test]
async fn a_guard_that_is_down_fails_closed_or_open_as_configured() {
    // Nobody listens (the fake's guard has no rule).
    let closed = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
    let done = completed(run_turn(&closed, &guarded(GuardFail::Closed), 1, &CFG).await);
    assert!(closed.tool_runs.lock().unwrap().is_empty());
    assert_guardrail(
        &closed,
        &done,
        "the guard failed: unavailable: no responders",
    );

    let open = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
    let done = completed(run_turn(&open, &guarded(GuardFail::Open), 1, &CFG).await);
    assert_eq!(*open.tool_runs.lock().unwrap(), ["c1"]);
    assert_eq!(
        (done.outcome, done.stop_reason.as_str()),
        (TurnOutcome::Final, "stop")
    );
    assert_eq!(done.message.unwrap().text_content(), "It is noon.");
    assert_eq!(
        open.guard_asks.lock().unwrap().len(),
        2,
        "asked, failed, let through"
    );
}

#[tokio::test(start_paused = true)]
async fn a_guard_slower_than_its_timeout_fails_closed_or_open_as_configured() {
    for fail in [GuardFail::Closed, GuardFail::Open] {
        let fake = Fake::scripted([reply_text("It is noon.")]);
        *fake.guard_rule.lock().unwrap() = Some(allow);
        // Longer than the spec's 1 s: the reply would allow, but it comes too late.
        *fake.guard_delay.lock().unwrap() = Some(std::time::Duration::from_secs(60));
        let done = completed(run_turn(&fake, &guarded(fail), 1, &CFG).await);
        match fail {
            GuardFail::Closed => {
                assert_guardrail(&fake, &done, "no reply within 1s");
            }
            GuardFail::Open => {
                assert_eq!(done.stop_reason, "stop");
                assert_eq!(done.message.unwrap().text_content(), "It is noon.");
            }
        }
    }
    // Within the timeout the reply counts.
    let fake = Fake::scripted([reply_text("It is noon.")]);
    *fake.guard_rule.lock().unwrap() = Some(allow);
    *fake.guard_delay.lock().unwrap() = Some(std::time::Duration::from_millis(900));
    let done = completed(run_turn(&fake, &guarded(GuardFail::Closed), 1, &CFG).await);
    assert_eq!(done.stop_reason, "stop");
}

#[tokio::test]
async fn a_malformed_guard_reply_is_a_failure_never_a_panic() {
    let rules: [GuardRule; 6] = [
        |_| Ok(b"yes".to_vec()),
        |_| Ok(br#"{"reason":"allow missing"}"#.to_vec()),
        |_| Ok(br#"{"allow":"true"}"#.to_vec()),
        |_| Ok(br#"{"allow":true,"reason":["x"]}"#.to_vec()),
        |_| {
            let mut huge = br#"{"allow":true,"reason":""#.to_vec();
            huge.extend(std::iter::repeat_n(b'x', 70 * 1024));
            huge.extend(br#""}"#);
            Ok(huge)
        },
        |_| Err(ErrorBody::new(ErrorCode::Internal, "the guard crashed")),
    ];
    for (i, rule) in rules.into_iter().enumerate() {
        let closed = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
        *closed.guard_rule.lock().unwrap() = Some(rule);
        let done = completed(run_turn(&closed, &guarded(GuardFail::Closed), 1, &CFG).await);
        assert!(closed.tool_runs.lock().unwrap().is_empty(), "rule {i}");
        assert_guardrail(&closed, &done, "the guard failed");

        let open = Fake::scripted([reply_tools(&["c1"]), reply_text("It is noon.")]);
        *open.guard_rule.lock().unwrap() = Some(rule);
        let done = completed(run_turn(&open, &guarded(GuardFail::Open), 1, &CFG).await);
        assert_eq!(*open.tool_runs.lock().unwrap(), ["c1"], "rule {i}");
        assert_eq!(done.stop_reason, "stop", "rule {i}");
    }
}

#[tokio::test]
async fn a_deny_beats_failing_open() {
    let fake = Fake::scripted([named_calls(&[("c1", "count")]), reply_text("x")]);
    *fake.guard_rule.lock().unwrap() = Some(policy);
    let done = completed(run_turn(&fake, &guarded(GuardFail::Open), 1, &CFG).await);
    assert!(fake.tool_runs.lock().unwrap().is_empty());
    assert_guardrail(&fake, &done, "policy 7");
}
