//! The runner's tool intents against the in-memory bus: the intent is durable before a call goes
//! out, a redelivery continues a started batch under the same ids, lost replies, fencing.

use super::*;

/// A tool that must not run twice, one that may run again under its id, and their calls.
const ONCE: &str = "send_mail";
const AGAIN: &str = "lookup";

fn call(id: &str, name: &str) -> ToolCall {
    call_to(id, name, format!("{id}@example.com"))
}

fn reply_calls(calls: &[(&str, &str)]) -> Result<ModelResponse, ErrorBody> {
    reply_calling(calls.iter().map(|(id, name)| call(id, name)).collect())
}

/// A bus whose tools declare `ONCE` not idempotent and `AGAIN` idempotent.
fn declared(fake: Fake) -> Fake {
    declaring(fake, ONCE, AGAIN)
}

/// A [`declared`] bus whose model calls `AGAIN` (c1) and `ONCE` (c2) in one step, then answers.
fn again_and_once() -> Fake {
    declared(Fake::scripted([
        reply_calls(&[("c1", AGAIN), ("c2", ONCE)]),
        reply_text("ok"),
    ]))
}

/// The tool result for `call_id` in `messages`.
fn result_of<'m>(messages: &'m [Message], call_id: &str) -> &'m Message {
    messages
        .iter()
        .find(|m| m.role == Role::Tool && m.tool_call_id == call_id)
        .unwrap_or_else(|| panic!("no result for {call_id}"))
}

/// The text of the tool result for `call_id` in `messages`.
fn result_text(messages: &[Message], call_id: &str) -> String {
    result_of(messages, call_id)
        .content
        .iter()
        .find_map(|p| match p {
            Part::ToolResult { text, .. } => Some(text.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

fn is_error(message: &Message) -> bool {
    message
        .content
        .iter()
        .any(|p| matches!(p, Part::ToolResult { is_error: true, .. }))
}

/// What a crash while step `step`'s batch ran leaves: the started row, the batch's tool-call
/// message and the results recorded before the crash.
fn started_row(step: u32, calls: &[(&str, &str)], recorded: &[&str]) -> Checkpoint {
    let calls: Vec<ToolCall> = calls.iter().map(|(id, name)| call(id, name)).collect();
    let mut messages = vec![Message::text(Role::User, "what time is it?")];
    messages.push(Message::assistant_tool_calls(&calls));
    for id in recorded {
        let name = &calls.iter().find(|c| c.id == *id).unwrap().name;
        messages.push(Message::tool_result(
            *id,
            name,
            format!("recorded {id}"),
            false,
        ));
    }
    let state = CheckpointState {
        step,
        messages,
        stop_reason: stop_reason::TOOL_CALLS_STARTED.into(),
        finish_reason: String::new(),
        turn_id: "t1".into(),
        steered_ids: vec![],
        guard_reason: Default::default(),
        unsent: Vec::new(),
    };
    Checkpoint {
        id: checkpoint_id("s1", Some("t1"), step),
        agent_id: "s1".into(),
        step,
        state: JsonObject::encode(&state).unwrap(),
        turn_id: Some("t1".into()),
        attempt: Some(1),
        base: None,
        created_at: None,
        updated_at: None,
    }
}

fn unknown_events(fake: &Fake) -> Vec<SessionEvent> {
    fake.events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| e.kind == SessionEventType::ToolOutcomeUnknown)
        .cloned()
        .collect()
}

#[tokio::test]
async fn the_step_and_its_calls_are_durable_before_the_first_call_goes_out() {
    let fake = declared(Fake::scripted([
        reply_calls(&[("c1", ONCE), ("c2", AGAIN)]),
        reply_text("sent"),
    ]));
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);

    let log = fake.log.lock().unwrap().clone();
    // The intent first; the calls after it (c1's result, back while c2 had not returned, is
    // recorded between them); the step's save after both.
    assert_eq!(log[0], "save:tool_calls_started:1", "{log:?}");
    let n = log.len();
    assert!(log[1..n - 2].contains(&"run:c1".to_owned()), "{log:?}");
    assert!(log[1..n - 2].contains(&"run:c2".to_owned()), "{log:?}");
    assert_eq!(log[n - 2..], ["save:tool_calls:1", "save:stop:2"]);
    // The started row holds the step's calls and their ids, and no result.
    let started = fake.saved_state(0);
    let last = started.messages.last().unwrap();
    assert_eq!(
        last,
        &Message::assistant_tool_calls(&[call("c1", ONCE), call("c2", AGAIN)]).sender("cyrene")
    );
    // The step's own row (same id) then holds the results, so the window is rebuilt whole.
    let saved = fake.saved.lock().unwrap();
    let step = &saved[saved.len() - 2];
    assert_eq!(
        (step.id.as_str(), state(step).messages.len()),
        ("s1:t1:1", 4)
    );
}

#[tokio::test]
async fn a_batch_of_read_only_calls_records_no_intent() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("noon")]);
    completed(run_turn(&fake, &job(), 1, &CFG).await);
    assert_eq!(
        *fake.log.lock().unwrap(),
        ["run:c1", "save:tool_calls:1", "save:stop:2"]
    );
}

#[tokio::test]
async fn a_redelivered_started_batch_continues_its_calls_under_their_ids() {
    // The batch had three calls; c3's result was recorded, c1 and c2 were running.
    let row = started_row(1, &[("c1", ONCE), ("c2", AGAIN), ("c3", ONCE)], &["c3"]);
    let fake = declared(Fake::resuming(Some(row)));
    fake.then_replies(reply_text("done"));
    let done = completed(run_turn(&fake, &job(), 2, &CFG).await);

    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(done.steps, 2, "step 1 continued, step 2 answered");
    // Only the idempotent call ran again, under its own id; the model was not asked for step 1.
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["c2"]);
    let requests = fake.requests.lock().unwrap();
    assert_eq!(requests.len(), 1);
    let view = &requests[0].messages;
    assert_eq!(result_text(view, "c1"), OUTCOME_UNKNOWN);
    assert!(is_error(result_of(view, "c1")));
    assert_eq!(result_text(view, "c2"), "result of c2");
    assert_eq!(result_text(view, "c3"), "recorded c3");
    // Results in call order, right after the calls.
    let ids: Vec<&str> = view
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.tool_call_id.as_str())
        .collect();
    assert_eq!(ids, ["c1", "c2", "c3"]);

    let events = unknown_events(&fake);
    assert_eq!(events.len(), 1);
    let e = &events[0];
    assert_eq!(
        (e.call_id.as_deref(), e.tool.as_deref(), e.at_step),
        (Some("c1"), Some(ONCE), Some(1))
    );
    assert_eq!(e.arguments.as_ref().unwrap()["to"], "c1@example.com");

    // The continued step's row is saved again from the end of the turn's base (a read does not
    // say where the started row began) and holds the unknown outcome: what `cyrene
    // checkpoints` shows.
    let deltas = fake.deltas.lock().unwrap();
    assert!(deltas[0].base.is_none());
    assert_eq!(deltas[0].state.to_map()["from"], 1);
    let step = fake.saved_state(0);
    assert_eq!(
        (step.stop_reason.as_str(), step.messages.len()),
        ("tool_calls", 5)
    );
    assert_eq!(result_text(&step.messages, "c1"), OUTCOME_UNKNOWN);
}

#[tokio::test]
async fn a_lost_reply_is_called_again_under_its_id_only_if_the_tool_is_idempotent() {
    let fake = again_and_once();
    fake.unanswered
        .lock()
        .unwrap()
        .extend(["c1".to_owned(), "c2".to_owned()]);
    completed(run_turn(&fake, &job(), 1, &CFG).await);

    let runs = fake.tool_runs.lock().unwrap().clone();
    assert_eq!(runs.iter().filter(|id| *id == "c1").count(), 2, "{runs:?}");
    assert_eq!(runs.iter().filter(|id| *id == "c2").count(), 1, "{runs:?}");
    // The second run of c1 came after a fenced save of the started row.
    let log = fake.log.lock().unwrap().clone();
    let first = log.iter().position(|l| l == "run:c1").unwrap();
    let again = log.iter().rposition(|l| l == "run:c1").unwrap();
    assert!(
        log[first..again].contains(&"save:tool_calls_started:1".to_owned()),
        "{log:?}"
    );
    let view = &fake.requests.lock().unwrap()[1].messages;
    assert_eq!(result_text(view, "c1"), "result of c1");
    assert_eq!(result_text(view, "c2"), OUTCOME_UNKNOWN);
    let events = unknown_events(&fake);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].call_id.as_deref(), Some("c2"));
}

#[tokio::test(start_paused = true)]
async fn a_result_back_while_others_still_run_is_recorded_at_once() {
    let fake = again_and_once();
    fake.tool_delay
        .lock()
        .unwrap()
        .insert(AGAIN.into(), std::time::Duration::from_secs(5));
    completed(run_turn(&fake, &job(), 1, &CFG).await);

    let log = fake.log.lock().unwrap().clone();
    assert_eq!(
        log[..3],
        ["save:tool_calls_started:1", "run:c1", "run:c2"],
        "{log:?}"
    );
    // c2 returned while c1 ran: recorded, then the step's save holds both.
    assert_eq!(
        log[3..],
        [
            "save:tool_calls_started:1",
            "save:tool_calls:1",
            "save:stop:2"
        ]
    );
    let record = fake.saved_state(1);
    assert_eq!(record.stop_reason, "tool_calls_started");
    assert_eq!(result_text(&record.messages, "c2"), "result of c2");
    assert!(record.messages.iter().all(|m| m.tool_call_id != "c1"));
    let step = fake.saved_state(2);
    let ids: Vec<&str> = step
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool)
        .map(|m| m.tool_call_id.as_str())
        .collect();
    assert_eq!(ids, ["c1", "c2"], "results in call order");
}

#[tokio::test]
async fn a_refused_intent_stops_the_attempt_before_any_call() {
    let fake = declared(Fake::scripted([
        reply_calls(&[("c1", ONCE)]),
        reply_text("x"),
    ]));
    *fake.save_error.lock().unwrap() = Some(ErrorBody::new(ErrorCode::Conflict, "newer"));
    assert_eq!(run_turn(&fake, &job(), 1, &CFG).await, TurnEnd::Stale);
    assert!(fake.tool_runs.lock().unwrap().is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_intent_that_cannot_be_saved_hands_the_job_back_before_any_call() {
    let fake = declared(Fake::scripted([
        reply_calls(&[("c1", ONCE)]),
        reply_text("x"),
    ]));
    *fake.save_error.lock().unwrap() = Some(ErrorBody::new(ErrorCode::Unavailable, "db down"));
    let end = run_turn(&fake, &job(), 1, &CFG).await;
    assert!(
        matches!(end, TurnEnd::Retry(ref e) if e.code == ErrorCode::Unavailable),
        "{end:?}"
    );
    assert!(fake.tool_runs.lock().unwrap().is_empty());
    assert_eq!(*fake.save_count.lock().unwrap(), 3, "tried a few times");
}

#[tokio::test]
async fn a_fenced_off_attempt_calls_nothing_again_after_a_lost_reply() {
    let fake = declared(Fake::scripted([
        reply_calls(&[("c1", AGAIN)]),
        reply_text("x"),
    ]));
    fake.unanswered.lock().unwrap().insert("c1".into());
    // The intent lands; then a newer attempt takes the turn.
    *fake.conflict_from.lock().unwrap() = Some(1);
    assert_eq!(run_turn(&fake, &job(), 1, &CFG).await, TurnEnd::Stale);
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["c1"]);
}

#[tokio::test]
async fn a_started_row_with_every_result_recorded_runs_nothing_again() {
    let row = started_row(2, &[("c1", ONCE), ("c2", ONCE)], &["c2", "c1"]);
    let fake = declared(Fake::resuming(Some(row)));
    fake.then_replies(reply_text("done"));
    let done = completed(run_turn(&fake, &job(), 2, &CFG).await);
    assert_eq!(done.steps, 3);
    assert!(fake.tool_runs.lock().unwrap().is_empty());
    assert!(unknown_events(&fake).is_empty());
    let view = &fake.requests.lock().unwrap()[0].messages;
    assert_eq!(result_text(view, "c1"), "recorded c1");
}
