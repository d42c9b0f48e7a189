//! Human approval against the in-memory bus: a gated call stops its batch before anything goes
//! out, and the job that carries the decisions continues it under the same ids.

use super::*;
use crate::runner::intents::{DENIED, DENIED_BY_DEADLINE};
use cyrene_protocol::approval::{CallDecision, Decision};

/// A tool that must not run twice and needs approval, and one that may run again.
const MAIL: &str = "send_mail";
const LOOKUP: &str = "lookup";

fn call(id: &str, name: &str) -> ToolCall {
    call_to(id, name, "bob@example.com".into())
}

fn reply_calls(calls: &[(&str, &str)]) -> Result<ModelResponse, ErrorBody> {
    reply_calling(calls.iter().map(|(id, name)| call(id, name)).collect())
}

fn declared(fake: Fake) -> Fake {
    declaring(fake, MAIL, LOOKUP)
}

/// The job of a persona whose `MAIL` calls need approval.
fn gated() -> TurnJob {
    TurnJob {
        approval: vec![MAIL.into()],
        ..job()
    }
}

/// [`gated`] continued after its approvals: `decisions` on step 1, attempts from 1 on.
fn continued(decisions: &[(&str, Decision, Option<&str>, &str)]) -> TurnJob {
    TurnJob {
        decisions: decisions
            .iter()
            .map(|(id, decision, reason, by)| CallDecision {
                step: 1,
                call_id: (*id).into(),
                decision: *decision,
                reason: reason.map(str::to_owned),
                decided_by: (*by).into(),
            })
            .collect(),
        attempt_base: 1,
        ..gated()
    }
}

/// The result of `call_id` (text, is error) as the model saw it in its first request.
fn first_result(fake: &Fake, call_id: &str) -> (String, bool) {
    fake.requests.lock().unwrap()[0]
        .messages
        .iter()
        .filter(|m| m.role == Role::Tool && m.tool_call_id == call_id)
        .flat_map(|m| &m.content)
        .find_map(|p| match p {
            Part::ToolResult { text, is_error, .. } => Some((text.clone(), *is_error)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no result for {call_id}"))
}

/// The first attempt of [`gated`] when the model calls `MAIL` (c1) and `LOOKUP` (c2): the row
/// it leaves, and its completion.
async fn stopped() -> (Fake, TurnComplete) {
    let fake = declared(Fake::scripted([reply_calls(&[
        ("c1", MAIL),
        ("c2", LOOKUP),
    ])]));
    let done = completed(run_turn(&fake, &gated(), 1, &CFG).await);
    (fake, done)
}

/// A bus whose store holds the last row [`stopped`] left: what the turn's next job finds.
async fn after_stop() -> Fake {
    let (first, _) = stopped().await;
    let last = first.saved.lock().unwrap().last().cloned().unwrap();
    declared(Fake::resuming(Some(last)))
}

#[tokio::test]
async fn a_gated_call_holds_its_batch_and_ends_the_job_without_running_anything() {
    let (fake, done) = stopped().await;
    assert_eq!(done.outcome, TurnOutcome::AwaitingApproval);
    assert_eq!(done.stop_reason, "awaiting_approval");
    assert_eq!(done.message, None);
    assert_eq!(done.approvals.len(), 1, "only the gated call waits");
    let asked = &done.approvals[0];
    assert_eq!(
        (asked.step, asked.call_id.as_str(), asked.tool.as_str()),
        (1, "c1", MAIL)
    );
    assert_eq!(asked.arguments["to"], "bob@example.com");
    // Nothing of the batch went out, not even the call that needs no approval; one save.
    assert!(fake.tool_runs.lock().unwrap().is_empty());
    assert_eq!(*fake.log.lock().unwrap(), ["save:awaiting_approval:1"]);
    let row = fake.saved_state(0);
    assert_eq!(row.unsent, ["c1", "c2"], "the row says nothing was sent");
    assert!(
        row.messages
            .last()
            .unwrap()
            .content
            .iter()
            .any(|p| matches!(p, Part::ToolCall { .. }))
    );
    // The turn is not over: no answer, no error.
    let events = fake.events.lock().unwrap();
    assert!(
        events
            .iter()
            .all(|e| e.kind != SessionEventType::Final && e.kind != SessionEventType::Error)
    );
}

#[tokio::test]
async fn a_tools_own_metadata_asks_for_approval_too() {
    let fake = declared(Fake::scripted([reply_calls(&[("c1", LOOKUP)])]));
    fake.approval.lock().unwrap().insert(LOOKUP.into());
    let done = completed(run_turn(&fake, &job(), 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::AwaitingApproval);
    assert_eq!(done.approvals[0].call_id, "c1");
    assert!(fake.tool_runs.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_redelivery_without_decisions_stops_at_the_same_calls_again() {
    let fake = after_stop().await;
    let done = completed(run_turn(&fake, &gated(), 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::AwaitingApproval);
    assert_eq!(done.approvals[0].call_id, "c1");
    assert!(fake.tool_runs.lock().unwrap().is_empty());
    assert!(
        fake.requests.lock().unwrap().is_empty(),
        "the model is not asked again"
    );
    assert_eq!(fake.saved_state(0).unsent, ["c1", "c2"]);
}

#[tokio::test]
async fn approved_the_call_runs_once_under_its_id_after_its_intent() {
    let fake = after_stop().await;
    fake.then_replies(reply_text("mailed"));
    let job = continued(&[("c1", Decision::Approve, None, "person:alice")]);
    let done = completed(run_turn(&fake, &job, 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    let mut runs = fake.tool_runs.lock().unwrap().clone();
    runs.sort();
    assert_eq!(runs, ["c1", "c2"], "the whole batch, under the model's ids");
    // The intent (nothing unsent any more) before either call.
    let log = fake.log.lock().unwrap().clone();
    assert_eq!(log[0], "save:tool_calls_started:1", "{log:?}");
    assert!(fake.saved_state(0).unsent.is_empty());
    assert_eq!(
        fake.requests.lock().unwrap().len(),
        1,
        "step 1 is not asked again"
    );
    assert_eq!(first_result(&fake, "c1"), ("result of c1".into(), false));
}

#[tokio::test]
async fn denied_the_model_is_told_why_and_the_call_never_runs() {
    let fake = after_stop().await;
    fake.then_replies(reply_text("I did not mail bob"));
    let job = continued(&[("c1", Decision::Deny, Some("not bob"), "operator")]);
    let done = completed(run_turn(&fake, &job, 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(*fake.tool_runs.lock().unwrap(), ["c2"]);
    assert_eq!(
        first_result(&fake, "c1"),
        (format!("{DENIED} Reason: not bob"), true)
    );
}

#[tokio::test]
async fn a_denial_by_the_deadline_says_so() {
    let fake = after_stop().await;
    fake.then_replies(reply_text("nobody answered"));
    let job = continued(&[("c1", Decision::Deny, Some("late"), "deadline")]);
    completed(run_turn(&fake, &job, 2, &CFG).await);
    assert_eq!(
        first_result(&fake, "c1"),
        (DENIED_BY_DEADLINE.to_owned(), true)
    );
}

#[tokio::test]
async fn a_crash_after_an_approved_call_started_never_runs_it_twice() {
    let approved = continued(&[("c1", Decision::Approve, None, "operator")]);
    // The continuing attempt saved its intent, then died with both calls in flight.
    let dying = after_stop().await;
    *dying.conflict_from.lock().unwrap() = Some(1);
    let _ = run_turn(&dying, &approved, 2, &CFG).await;
    let started = dying.saved.lock().unwrap()[0].clone();
    assert_eq!(state(&started).stop_reason, "tool_calls_started");

    let fake = declared(Fake::resuming(Some(started)));
    fake.then_replies(reply_text("maybe mailed"));
    let done = completed(run_turn(&fake, &approved, 3, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(
        *fake.tool_runs.lock().unwrap(),
        ["c2"],
        "the not-idempotent call is never run again; the idempotent one is, under its id"
    );
    assert_eq!(
        first_result(&fake, "c1"),
        (OUTCOME_UNKNOWN.to_owned(), true)
    );
}

#[tokio::test]
async fn a_decision_binds_to_its_step() {
    let fake = after_stop().await;
    let mut job = continued(&[("c1", Decision::Approve, None, "operator")]);
    job.decisions[0].step = 2;
    let done = completed(run_turn(&fake, &job, 2, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::AwaitingApproval, "asked again");
    assert!(fake.tool_runs.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_continued_job_counts_its_deliveries_from_its_own_first() {
    let fake = after_stop().await;
    let down = ErrorBody::new(ErrorCode::Unavailable, "gateway down");
    fake.then_replies(Err(down));
    // Attempt 3 is this job's 2nd delivery (base 1): not the last of 3, so handed back.
    let job = continued(&[("c1", Decision::Deny, None, "operator")]);
    let end = run_turn(&fake, &job, 3, &CFG).await;
    assert!(matches!(end, TurnEnd::Retry(_)), "{end:?}");
}
