//! The runner against an in-memory bus ([`Fake`]): scripted model replies and steer answers,
//! a store that keeps deltas and rebuilds the snapshots a read would return, and everything else
//! recorded. The tests are split by the part of the runner they show.

use super::*;
use crate::fixtures::reply_text;
use crate::notice::PARALLEL_NOTICE_HEADER;
use crate::ports::{ToolContext, ToolOutput, TurnInput};
use cyrene_protocol::JsonObject;
use cyrene_protocol::checkpoint::{Checkpoint, CheckpointState, checkpoint_id};
use cyrene_protocol::guard::{GuardFail, GuardKind, GuardRequest, GuardSpec};
use cyrene_protocol::message::{Part, ToolCall};
use cyrene_protocol::turn::{ParallelNotice, SteerResponse, SteeredMessage};
use cyrene_protocol::turn::{SteerRequest, TurnComplete, TurnOutcome};
use serde_json::Map;
use std::collections::VecDeque;
use std::sync::Mutex;

/// An in-memory bus: scripted model replies and steer answers, recorded everything else.
#[derive(Default)]
struct Fake {
    replies: Mutex<VecDeque<Result<ModelResponse, ErrorBody>>>,
    steers: Mutex<VecDeque<Result<SteerResponse, ErrorBody>>>,
    latest: Mutex<Option<Checkpoint>>,
    load_error: Mutex<Option<ErrorBody>>,
    save_error: Mutex<Option<ErrorBody>>,
    requests: Mutex<Vec<ModelRequest>>,
    saved: Mutex<Vec<Checkpoint>>,
    tool_runs: Mutex<Vec<String>>,
    events: Mutex<Vec<SessionEvent>>,
    steer_requests: Mutex<Vec<SteerRequest>>,
    vision: Mutex<Option<bool>>,
    vision_asks: Mutex<usize>,
    /// How long each model call takes.
    model_delay: Mutex<Option<std::time::Duration>>,
    /// The contexts tools were called with.
    tool_contexts: Mutex<Vec<ToolContext>>,
    /// Every tool runs until this unix millisecond (the turn's deadline passes during it).
    tool_until: Mutex<Option<u64>>,
    /// How many of the next saves fail (without landing).
    failing_saves: Mutex<usize>,
    /// Saves as sent (deltas) and the window they rebuild.
    deltas: Mutex<Vec<Checkpoint>>,
    window: Mutex<Vec<Message>>,
    /// Pushed input: `None` = no subscription (every boundary asks).
    pushes: Mutex<Option<futures::channel::mpsc::UnboundedReceiver<SteeredMessage>>>,
    /// The document service's next answers (then `not_found`), and how often it was asked.
    documents: Mutex<VecDeque<Result<crate::ports::FetchedDocument, ErrorBody>>>,
    document_reads: Mutex<usize>,
    /// What tools declare (by name); otherwise as the built-ins, or not idempotent.
    idempotence: Mutex<std::collections::HashMap<String, crate::ports::Idempotence>>,
    /// Saves (`save:<stop>:<step>`) and tool runs (`run:<id>`), in order.
    log: Mutex<Vec<String>>,
    /// Call ids whose next run gets no reply (its request went out).
    unanswered: Mutex<std::collections::HashSet<String>>,
    /// How long each run of a tool (by name) takes.
    tool_delay: Mutex<std::collections::HashMap<String, std::time::Duration>>,
    /// From this save on (0-based), every save is refused as `conflict`.
    conflict_from: Mutex<Option<usize>>,
    save_count: Mutex<usize>,
    /// The guard's reply to each request (none: nobody listens), after `guard_delay`; every
    /// request asked, with its subject.
    guard_rule: Mutex<Option<GuardRule>>,
    guard_delay: Mutex<Option<std::time::Duration>>,
    guard_asks: Mutex<Vec<(String, GuardRequest)>>,
    /// The delta tags of the streamed step calls.
    tags: Mutex<Vec<crate::deltas::DeltaTag>>,
    /// Tools whose metadata asks for approval of every call.
    approval: Mutex<std::collections::HashSet<String>>,
    /// The view the fake gateway replica (`r1`) holds for the turn's step calls, as the real
    /// one does (docs/model-gateway.md, "Held views"): the model is asked with it followed by
    /// what a continuing call sends.
    held: Mutex<Vec<Message>>,
    /// How each step call was sent: `None` whole, `Some(n)` continuing the held view with `n`
    /// messages.
    sent: Mutex<Vec<Option<usize>>>,
}

type GuardRule = fn(&GuardRequest) -> Result<Vec<u8>, ErrorBody>;

impl TurnPorts for Fake {
    async fn document(
        &self,
        _session_id: &str,
        _url: &str,
    ) -> Result<crate::ports::FetchedDocument, ErrorBody> {
        *self.document_reads.lock().unwrap() += 1;
        self.documents
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(|| Err(ErrorBody::new(ErrorCode::NotFound, "no such document")))
    }

    /// Like the store: the turn's own latest row, fenced by the attempts that wrote it.
    async fn turn_checkpoint(
        &self,
        _owner: &str,
        turn_id: &str,
        attempt: u32,
    ) -> Result<Option<Checkpoint>, ErrorBody> {
        if let Some(err) = self.load_error.lock().unwrap().clone() {
            return Err(err);
        }
        let latest = self.latest.lock().unwrap().clone();
        let latest = latest.filter(|c| c.turn_id.as_deref() == Some(turn_id));
        if latest.as_ref().and_then(|c| c.attempt) > Some(attempt) {
            return Err(ErrorBody::new(ErrorCode::Conflict, "a newer attempt read"));
        }
        // The rows a resumed turn's next delta builds on.
        if let Some(cp) = &latest {
            *self.window.lock().unwrap() = state(cp).messages;
        }
        Ok(latest)
    }
    /// Like the store: keeps the delta as sent (`deltas`) and the full snapshot a read
    /// would rebuild from it (`saved`).
    async fn save_checkpoint(&self, checkpoint: Checkpoint) -> Result<(), ErrorBody> {
        let nth = {
            let mut count = self.save_count.lock().unwrap();
            *count += 1;
            *count - 1
        };
        if self
            .conflict_from
            .lock()
            .unwrap()
            .is_some_and(|from| nth >= from)
        {
            return Err(ErrorBody::new(ErrorCode::Conflict, "a newer attempt wrote"));
        }
        if let Some(err) = self.save_error.lock().unwrap().clone() {
            return Err(err);
        }
        {
            let mut failing = self.failing_saves.lock().unwrap();
            if *failing > 0 {
                *failing -= 1;
                return Err(ErrorBody::new(ErrorCode::Timeout, "no answer"));
            }
        }
        #[derive(serde::Deserialize)]
        struct Delta {
            from: Option<usize>,
            messages: Vec<Message>,
        }
        #[derive(serde::Deserialize)]
        struct Base {
            messages: Vec<Message>,
        }
        let mut window = self.window.lock().unwrap();
        if let Some(base) = &checkpoint.base {
            *window = base.parse::<Base>().unwrap().messages;
        }
        let delta: Delta = checkpoint.state.parse().unwrap();
        let from = delta.from.expect("a turn saves deltas");
        assert!(from <= window.len(), "a delta past the stored window");
        window.truncate(from);
        window.extend(delta.messages);
        let mut full: CheckpointState = checkpoint.state.parse().unwrap();
        self.log
            .lock()
            .unwrap()
            .push(format!("save:{}:{}", full.stop_reason, checkpoint.step));
        full.messages = window.clone();
        let mut assembled = checkpoint.clone();
        assembled.state = JsonObject::encode(&full).unwrap();
        assembled.base = None;
        self.deltas.lock().unwrap().push(checkpoint);
        self.saved.lock().unwrap().push(assembled);
        Ok(())
    }
    async fn turn_input(&self, _turn_id: &str) -> TurnInput {
        match self.pushes.lock().unwrap().take() {
            Some(receiver) => TurnInput::new(receiver),
            None => TurnInput::none(),
        }
    }
    async fn steer(&self, request: SteerRequest) -> Result<SteerResponse, ErrorBody> {
        self.steer_requests.lock().unwrap().push(request);
        self.steers
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Ok(SteerResponse::default()))
    }
    async fn main_model_vision(&self, _persona: &str) -> Result<bool, ErrorBody> {
        *self.vision_asks.lock().unwrap() += 1;
        self.vision
            .lock()
            .unwrap()
            .ok_or_else(|| ErrorBody::new(ErrorCode::Unavailable, "no gateway"))
    }
    async fn complete(&self, request: ModelRequest) -> Result<ModelResponse, ErrorBody> {
        if request.purpose == "vision" {
            return reply_text("a red kite over the sea");
        }
        self.requests.lock().unwrap().push(request);
        let delay = *self.model_delay.lock().unwrap();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        self.replies
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or_else(|| Err(ErrorBody::new(ErrorCode::Internal, "script ran out")))
    }
    fn tool_specs(&self, _allowed: Option<&[String]>) -> Vec<cyrene_protocol::model::ToolSpec> {
        crate::tools::builtin_specs()
    }
    async fn call_tool(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        self.tool_contexts.lock().unwrap().push(context.clone());
        self.tool_runs.lock().unwrap().push(call.id.clone());
        self.log.lock().unwrap().push(format!("run:{}", call.id));
        let until = *self.tool_until.lock().unwrap();
        while until.is_some_and(|until| now_unix_ms() <= until) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let delay = self.tool_delay.lock().unwrap().get(&call.name).copied();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        if self.unanswered.lock().unwrap().remove(&call.id) {
            return ToolOutput {
                unanswered: true,
                ..ToolOutput::error("request timed out")
            };
        }
        ToolOutput::ok(format!("result of {}", call.id))
    }
    fn tool_idempotence(&self, name: &str) -> crate::ports::Idempotence {
        let declared = self.idempotence.lock().unwrap().get(name).copied();
        declared
            .or_else(|| crate::tools::builtin_idempotence(name))
            .unwrap_or(crate::ports::Idempotence::NotIdempotent)
    }
    fn tool_approval(&self, name: &str) -> bool {
        self.approval.lock().unwrap().contains(name)
    }
    async fn publish(&self, event: SessionEvent) {
        self.events.lock().unwrap().push(event);
    }
    async fn complete_streamed(
        &self,
        mut request: ModelRequest,
        tag: crate::deltas::DeltaTag,
        view: &mut crate::deltas::SentView,
    ) -> Result<ModelResponse, ErrorBody> {
        self.tags.lock().unwrap().push(tag);
        // As the worker's NATS ports do (crate::nats): what the step added, to the replica
        // holding the rest; else the whole view, which the replica holds from then on.
        let (messages, asked) = match view.continued(&mut request) {
            Some((subject, mut continued)) => {
                assert_eq!(subject, "cyrene.model.complete.stream.r1");
                let added = std::mem::take(&mut continued.messages);
                let mut held = self.held.lock().unwrap();
                let base = continued.view.take().map(|v| v.base as usize);
                assert_eq!(base, Some(held.len()), "a continuation of the held view");
                held.extend(added.iter().cloned());
                continued.messages = held.clone();
                self.sent.lock().unwrap().push(Some(added.len()));
                (added, continued)
            }
            None => {
                view.whole(&mut request);
                *self.held.lock().unwrap() = request.messages.clone();
                self.sent.lock().unwrap().push(None);
                (request.messages.clone(), request)
            }
        };
        let response = self.complete(asked).await;
        match &response {
            Ok(_) => view.answered(messages, Some("r1".into())),
            Err(_) => view.forget(),
        }
        response
    }
    async fn guard(
        &self,
        subject: &str,
        payload: Vec<u8>,
        _timeout: std::time::Duration,
    ) -> Result<Vec<u8>, ErrorBody> {
        let request: GuardRequest = serde_json::from_slice(&payload).unwrap();
        self.guard_asks
            .lock()
            .unwrap()
            .push((subject.to_owned(), request.clone()));
        let delay = *self.guard_delay.lock().unwrap();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        let rule = *self.guard_rule.lock().unwrap();
        match rule {
            Some(rule) => rule(&request),
            None => Err(ErrorBody::new(
                ErrorCode::Unavailable,
                "no responders on cyrene.guard.policy",
            )),
        }
    }
}

impl Fake {
    /// A bus whose model gives `replies`, in order.
    fn scripted(replies: impl IntoIterator<Item = Result<ModelResponse, ErrorBody>>) -> Self {
        let fake = Self::default();
        fake.replies.lock().unwrap().extend(replies);
        fake
    }

    /// A bus whose store already holds `latest` as the turn's newest row (a redelivery).
    fn resuming(latest: Option<Checkpoint>) -> Self {
        let fake = Self::default();
        *fake.latest.lock().unwrap() = latest;
        fake
    }

    /// Queues `reply` as the model's next answer.
    fn then_replies(&self, reply: Result<ModelResponse, ErrorBody>) {
        self.replies.lock().unwrap().push_back(reply);
    }

    /// Queues `steer` as the next answer to a steer request.
    fn then_steers(&self, steer: Result<SteerResponse, ErrorBody>) {
        self.steers.lock().unwrap().push_back(steer);
    }

    /// The state of the `index`th full snapshot saved.
    fn saved_state(&self, index: usize) -> CheckpointState {
        state(&self.saved.lock().unwrap()[index])
    }
}

/// The full snapshots attempt `attempt` of `job()` saves when the model gives `replies`:
/// what a later attempt finds in the store.
async fn rows_left_by(
    replies: impl IntoIterator<Item = Result<ModelResponse, ErrorBody>>,
    attempt: u32,
) -> Vec<Checkpoint> {
    let fake = Fake::scripted(replies);
    let _ = run_turn(&fake, &job(), attempt, &CFG).await;
    fake.saved.lock().unwrap().clone()
}

/// The row of step 1 that attempt `attempt` of `job()` saves when that step calls tool `c1`:
/// what a crash after the step leaves in the store.
async fn tool_step_left_by(attempt: u32) -> Checkpoint {
    rows_left_by([reply_tools(&["c1"]), reply_text("x")], attempt)
        .await
        .swap_remove(0)
}

/// One step calling tool `id` for each of `ids`, then the final answer `answer`.
fn tool_steps_then(ids: &[&str], answer: &str) -> Vec<Result<ModelResponse, ErrorBody>> {
    ids.iter()
        .map(|id| reply_tools(&[id]))
        .chain([reply_text(answer)])
        .collect()
}

fn reply_tools(ids: &[&str]) -> Result<ModelResponse, ErrorBody> {
    let calls: Vec<ToolCall> = ids
        .iter()
        .map(|id| ToolCall {
            id: (*id).into(),
            name: "current_time".into(),
            args: Map::new(),
            args_error: None,
        })
        .collect();
    reply_calling(calls)
}

/// The model's answer calling `calls`.
fn reply_calling(calls: Vec<ToolCall>) -> Result<ModelResponse, ErrorBody> {
    let mut r = reply_text("")?;
    r.message = Message::assistant_tool_calls(&calls);
    r.tool_calls = calls;
    r.stop_reason = "tool_calls".into();
    Ok(r)
}

/// A call of tool `name` whose one argument is `to`.
fn call_to(id: &str, name: &str, to: String) -> ToolCall {
    let mut args = serde_json::Map::new();
    args.insert("to".into(), serde_json::Value::String(to));
    ToolCall {
        id: id.into(),
        name: name.into(),
        args,
        args_error: None,
    }
}

/// `fake` with its tools declaring `once` not idempotent and `again` idempotent.
fn declaring(fake: Fake, once: &str, again: &str) -> Fake {
    let mut kinds = fake.idempotence.lock().unwrap();
    kinds.insert(once.into(), crate::ports::Idempotence::NotIdempotent);
    kinds.insert(again.into(), crate::ports::Idempotence::Idempotent);
    drop(kinds);
    fake
}

fn job() -> TurnJob {
    TurnJob {
        message_ids: vec!["m1".into()],
        max_steps: 4,
        ..cyrene_test_support::fixtures::turn_job("t1", "s1", "what time is it?")
    }
}

fn state(cp: &Checkpoint) -> CheckpointState {
    cp.state.parse().unwrap()
}

/// Asserts that the attempt handed its job back (`unavailable`, for redelivery) before it asked
/// the model anything.
fn assert_handed_back(end: &TurnEnd, fake: &Fake) {
    assert!(
        matches!(end, TurnEnd::Retry(e) if e.code == ErrorCode::Unavailable),
        "{end:?}"
    );
    assert!(
        fake.requests.lock().unwrap().is_empty(),
        "the model was asked"
    );
}

fn completed(end: TurnEnd) -> TurnComplete {
    match end {
        TurnEnd::Complete(done) => *done,
        other => panic!("expected a completion, got {other:?}"),
    }
}

const CFG: RunnerConfig = RunnerConfig {
    purpose: String::new(),
    max_attempts: 3,
};

fn steered(id: &str, seq: u64, text: &str) -> SteeredMessage {
    SteeredMessage {
        id: id.into(),
        seq,
        message: Message::text(Role::User, text),
    }
}

/// Human approval of tool calls (`super::intents`).
mod approvals;
mod checkpoint;
mod guardrails;
/// Tool calls with a durable intent (`super::intents`).
mod intents;
mod request;
mod resume;
mod steering;
mod steps;
