//! Resume decisions: whether a turn continues from its owner's latest checkpoint or starts fresh
//! (docs/semantics.md#checkpoints-and-resume; docs/architecture.md §5).
//!
//! Only a **crash-left** run resumes: a snapshot whose last step ended mid tool loop
//! (`stop_reason == "tool_calls"`), written just before the process died, so the closing guard
//! never settled it, or whose last step's tool batch had started (`"tool_calls_started"`: the
//! step's tool calls are durable and were sent; that step's batch continues with those calls,
//! docs/loop-worker.md, "Tool calls with a durable intent"), or whose last step's batch waits
//! for a person's approval (`"awaiting_approval"`: nothing of it was sent; the job that carries
//! the decisions continues it, docs/reliability.md, "Approval"). Everything else starts fresh at
//! step 1.
//!
//! # Invariants
//! - Resume only from `tool_calls`, and never a window that ends in a final answer (an
//!   assistant message without tool calls), whatever its stop reason says. A final answer, a guardrail refusal, an exhausted budget or
//!   a safety-net stop is a finished run (resuming would regenerate an answer); `canceled`,
//!   `aborted` and `error` are settled unfinished exits the next turn must not inherit; an
//!   empty stop reason cannot prove a crash.
//! - Never resume a superseded window: when the snapshot's last user message appears in the new
//!   turn's messages while the new turn brings a newer user message, resuming would swallow the
//!   user's new message. Only that positive evidence counts: a snapshot with no overlap with the
//!   new messages still resumes (the accepted crash-recovery cost), and the same last message
//!   seeded again resumes.
//! - Resuming hands back the snapshot's window (tool calls and results of completed steps
//!   already folded in) and continues at `step + 1`, so a completed step's tools never run again
//!   and a completed answer is never regenerated.
//! - The user-message key is, in part order, the text of text and tool-result parts, `\0img:` +
//!   URL and `\0doc:` + name, exactly as the reference (docs/semantics.md#checkpoints-and-resume)
//!   writes every part's text field except for images and documents; role and speaker are not part
//!   of it. Tool-call parts add nothing (their text field is empty in the reference) and neither do
//!   reasoning parts (the reference's message has no such part).

use cyrene_protocol::checkpoint::{Checkpoint, CheckpointState};
use cyrene_protocol::message::{Message, Part, Role};

/// The step a fresh run starts at.
pub const FIRST_STEP: u32 = 1;

/// Stop reasons the loop writes into checkpoints.
pub mod stop_reason {
    /// A step ended with tool calls whose results are in the window: resumable at the next step.
    pub const TOOL_CALLS: &str = "tool_calls";
    /// A step's tool calls are durable and their batch has started: the window ends with the
    /// step's tool-call message and the results recorded so far. Resumable at the same step,
    /// whose batch continues with the same calls (never a new model call).
    pub const TOOL_CALLS_STARTED: &str = "tool_calls_started";
    /// A step's model call answered without tool calls: the final answer, whatever finish
    /// reason the provider gave (kept beside it as `finish_reason`; a provider may say
    /// `tool_calls` with no calls, which must never make an answered turn resumable).
    pub const STOP: &str = "stop";
    /// The turn's deadline had passed at a boundary: no further step started.
    pub const CANCELED: &str = "canceled";
    /// The turn's deadline passed during a model call, which was abandoned.
    pub const ABORTED: &str = "aborted";
    /// The turn failed (settled by the closing guard).
    pub const ERROR: &str = "error";
    /// A step's tool batch holds calls that wait for a person's approval: none of the batch
    /// was sent by the attempt that saved it (docs/reliability.md, "Approval"); the row's
    /// `unsent` names the calls known never to have been sent. Resumable at the same step, like
    /// `tool_calls_started`, by the job that carries the decisions (or a redelivery, which
    /// stops at the same calls again).
    pub const AWAITING_APPROVAL: &str = "awaiting_approval";
    /// `max_steps` reached and the safety net got no answer either.
    pub const BUDGET_EXHAUSTED: &str = "budget_exhausted";
    /// `max_steps` reached mid tool loop; the safety net's tool-less call answered (a final
    /// answer). A provider's refusal keeps the provider's finish reason beside `stop`.
    pub const SAFETY_NET: &str = "safety_net";
    /// The persona's guard denied a tool call or the answer, or failed closed: the person got
    /// the persona's configured message as the answer (docs/loop-worker.md, "Guardrails").
    pub const GUARDRAIL: &str = "guardrail";
}

/// Whether a checkpoint that ended with `stop_reason` is a crash-left run that may resume.
pub fn resumable_stop_reason(stop_reason: &str) -> bool {
    stop_reason == stop_reason::TOOL_CALLS
        || stop_reason == stop_reason::TOOL_CALLS_STARTED
        || stop_reason == stop_reason::AWAITING_APPROVAL
}

/// Whether a checkpointed window ends in a final answer: an assistant message without tool
/// calls. A window left mid tool loop ends in tool results, so such a row is a finished run
/// whatever stop reason it was saved under (rows written before the loop owned its stop reasons
/// could say `tool_calls`), and is never resumed.
pub fn holds_final_answer(messages: &[Message]) -> bool {
    messages.last().is_some_and(|m| {
        m.role == Role::Assistant && !m.content.iter().any(|p| matches!(p, Part::ToolCall { .. }))
    })
}

/// The comparison key of a user message: text and tool-result parts verbatim, `\0img:` + URL for
/// images and `\0doc:` + name for documents, in part order
/// (docs/semantics.md#checkpoints-and-resume). An image-only or document-only message thus still
/// has a key.
pub fn user_message_key(message: &Message) -> String {
    let mut key = String::new();
    for part in &message.content {
        match part {
            Part::Text { text } | Part::ToolResult { text, .. } => key.push_str(text),
            Part::ImageUrl { image_url } => {
                key.push_str("\0img:");
                key.push_str(image_url);
            }
            Part::Document { name, .. } => {
                key.push_str("\0doc:");
                key.push_str(name);
            }
            Part::ToolCall { .. } | Part::Reasoning { .. } => {}
        }
    }
    key
}

/// The key of the last user message, or `""` when there is none (or it has no comparable
/// content).
pub fn last_user_message_key(messages: &[Message]) -> String {
    messages
        .iter()
        .rev()
        .find(|m| m.role == Role::User)
        .map(user_message_key)
        .unwrap_or_default()
}

/// Whether the snapshot `window` has been superseded by the new `turn` messages: the
/// snapshot's last user message appears among the turn's user messages, and the turn's last
/// user message is a different, newer one.
pub fn superseded_window(window: &[Message], turn: &[Message]) -> bool {
    let window_last = last_user_message_key(window);
    if window_last.is_empty() {
        return false;
    }
    let turn_last = last_user_message_key(turn);
    if turn_last.is_empty() || turn_last == window_last {
        return false;
    }
    turn.iter()
        .any(|m| m.role == Role::User && user_message_key(m) == window_last)
}

/// Why a turn starts fresh.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FreshReason {
    /// The owner has no checkpoint (or it could not be loaded).
    NoCheckpoint,
    /// The latest checkpoint's state is not a valid [`CheckpointState`].
    Unparsable { error: String },
    /// The latest checkpoint was settled (final answer, cancel, error, budget, guardrail,
    /// empty): not a crash-left run.
    NotResumable { stop_reason: String },
    /// The snapshot's window was superseded by a newer user message in this turn.
    Superseded,
}

/// How a turn starts.
#[derive(Debug, Clone, PartialEq)]
pub enum ResumeDecision {
    /// Continue a crash-left run: use the snapshot's window and run `next_step` next.
    /// `steered_ids` are the steered messages the run had already taken in. `started`: the row
    /// was a started tool batch (`tool_calls_started`, `awaiting_approval`): `next_step` is
    /// that row's own step and its window ends with the batch (the calls and the results
    /// recorded so far); `unsent` names its calls known never to have been sent.
    Resume {
        messages: Vec<Message>,
        next_step: u32,
        steered_ids: Vec<String>,
        started: bool,
        unsent: Vec<String>,
    },
    /// Start at step 1 with the job's seeded messages.
    Fresh { reason: FreshReason },
}

impl ResumeDecision {
    /// The step to run next.
    pub fn next_step(&self) -> u32 {
        match self {
            ResumeDecision::Resume { next_step, .. } => *next_step,
            ResumeDecision::Fresh { .. } => FIRST_STEP,
        }
    }

    fn fresh(reason: FreshReason) -> ResumeDecision {
        ResumeDecision::Fresh { reason }
    }
}

/// Decides how a turn starts from the owner's latest checkpoint (`None` when there is none or
/// it could not be loaded) and the turn's seeded messages.
///
/// The step resumed from is the checkpoint row's `step` (docs/semantics.md#checkpoints-and-resume).
pub fn decide(latest: Option<Checkpoint>, seeded: &[Message]) -> ResumeDecision {
    let Some(checkpoint) = latest else {
        return ResumeDecision::fresh(FreshReason::NoCheckpoint);
    };
    let state: CheckpointState = match checkpoint.state.parse() {
        Ok(state) => state,
        Err(err) => {
            return ResumeDecision::fresh(FreshReason::Unparsable {
                error: err.to_string(),
            });
        }
    };
    if !resumable_stop_reason(&state.stop_reason) || holds_final_answer(&state.messages) {
        return ResumeDecision::fresh(FreshReason::NotResumable {
            stop_reason: state.stop_reason,
        });
    }
    if superseded_window(&state.messages, seeded) {
        return ResumeDecision::fresh(FreshReason::Superseded);
    }
    let started = state.stop_reason == stop_reason::TOOL_CALLS_STARTED
        || state.stop_reason == stop_reason::AWAITING_APPROVAL;
    ResumeDecision::Resume {
        messages: state.messages,
        next_step: if started {
            checkpoint.step
        } else {
            checkpoint.step.saturating_add(1)
        },
        steered_ids: state.steered_ids,
        started,
        unsent: state.unsent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::JsonObject;
    use cyrene_protocol::checkpoint::checkpoint_id;
    use cyrene_protocol::message::ToolCall;
    use serde_json::{Map, json};

    use crate::fixtures::{assistant, image, user, user_parts};

    fn document(name: &str) -> Part {
        crate::fixtures::pdf(name, 10)
    }

    fn tool_step() -> Vec<Message> {
        let call = ToolCall {
            id: "call_1".into(),
            name: "current_time".into(),
            args: Map::new(),
            args_error: None,
        };
        vec![
            Message::assistant_tool_calls(&[call]),
            Message::tool_result("call_1", "current_time", "12:00", false),
        ]
    }

    fn checkpoint(step: u32, messages: Vec<Message>, stop_reason: &str) -> Checkpoint {
        let state = CheckpointState {
            step,
            messages,
            stop_reason: stop_reason.into(),
            finish_reason: String::new(),
            turn_id: "t1".into(),
            steered_ids: vec![],
            guard_reason: String::new(),
            unsent: Vec::new(),
        };
        let state = JsonObject::encode(&state).unwrap();
        Checkpoint {
            id: checkpoint_id("s1", Some("t1"), step),
            agent_id: "s1".into(),
            step,
            state,
            turn_id: Some("t1".into()),
            attempt: Some(1),
            base: None,
            created_at: None,
            updated_at: None,
        }
    }

    /// A crash-left snapshot of the turn that answered "q1": one tool step done.
    fn crash_left(step: u32) -> (Checkpoint, Vec<Message>) {
        let mut window = vec![user("q1")];
        window.extend(tool_step());
        (
            checkpoint(step, window.clone(), stop_reason::TOOL_CALLS),
            window,
        )
    }

    /// The decision to resume `messages` at `next_step`, with nothing steered and no call held
    /// back; `started`: within a started tool batch.
    fn resumed(messages: Vec<Message>, next_step: u32, started: bool) -> ResumeDecision {
        ResumeDecision::Resume {
            messages,
            next_step,
            steered_ids: vec![],
            started,
            unsent: vec![],
        }
    }

    /// Asserts that the snapshot a crash left after step `step` is resumed, with its window, at
    /// `next_step` when the job is seeded with `seeded`. Returns the decision.
    fn assert_crash_left_resumes(step: u32, seeded: &[Message], next_step: u32) -> ResumeDecision {
        let (cp, window) = crash_left(step);
        let decision = decide(Some(cp), seeded);
        assert_eq!(decision, resumed(window, next_step, false));
        decision
    }

    // ---- user-message key ----

    #[test]
    fn key_of_text_is_the_text() {
        assert_eq!(user_message_key(&user("hello")), "hello");
    }

    #[test]
    fn key_concatenates_parts_in_order() {
        let m = user_parts(vec![
            Part::text("look "),
            image("https://x/a.png"),
            Part::text("and read"),
            document("d-1"),
        ]);
        assert_eq!(
            user_message_key(&m),
            "look \0img:https://x/a.pngand read\0doc:d-1"
        );
    }

    #[test]
    fn image_only_and_document_only_messages_have_keys() {
        let img = Message::image(Role::User, "", "data:image/png;base64,AAAA");
        assert_eq!(user_message_key(&img), "\0img:data:image/png;base64,AAAA");
        let doc = user_parts(vec![document("d-2")]);
        assert_eq!(user_message_key(&doc), "\0doc:d-2");
    }

    #[test]
    fn different_images_give_different_keys() {
        let a = Message::image(Role::User, "", "https://x/a.png");
        let b = Message::image(Role::User, "", "https://x/b.png");
        assert_ne!(user_message_key(&a), user_message_key(&b));
    }

    #[test]
    fn document_key_uses_the_name_not_the_url() {
        let a = user_parts(vec![Part::Document {
            name: "d-1".into(),
            mime: "text/plain".into(),
            url: "cyrene-doc://elsewhere".into(),
            size: 1,
        }]);
        assert_eq!(user_message_key(&a), "\0doc:d-1");
    }

    #[test]
    fn role_and_speaker_are_not_part_of_the_key() {
        let a = user("same").sender("阿明");
        let b = Message::text(Role::Assistant, "same");
        assert_eq!(user_message_key(&a), user_message_key(&b));
        assert_eq!(user_message_key(&a), user_message_key(&user("same")));
    }

    #[test]
    fn tool_result_text_is_in_the_key_and_tool_calls_and_reasoning_are_not() {
        let m = user_parts(vec![
            Part::text("a"),
            Part::ToolResult {
                tool_call_id: "c".into(),
                text: "result".into(),
                is_error: false,
            },
            Part::Reasoning {
                family: cyrene_protocol::message::ReasoningFamily::Openai,
                text: "thought".into(),
                signature: None,
                redacted: None,
            },
            Part::ToolCall {
                id: "c".into(),
                name: "n".into(),
                args: Map::new(),
                args_error: None,
            },
            Part::text("b"),
        ]);
        // The reference (docs/semantics.md#checkpoints-and-resume) writes `part.Text` for every
        // part but images and documents: a tool result's text is its body; a tool call has none;
        // the reference has no reasoning part.
        assert_eq!(user_message_key(&m), "aresultb");
    }

    #[test]
    fn messages_differing_only_in_tool_result_text_are_different_inputs() {
        let with = |text: &str| {
            user_parts(vec![Part::ToolResult {
                tool_call_id: "c".into(),
                text: text.into(),
                is_error: false,
            }])
        };
        assert_ne!(
            user_message_key(&with("old")),
            user_message_key(&with("new"))
        );
        // The snapshot's last user input reappears and a newer one follows: superseded.
        assert!(superseded_window(
            &[with("old")],
            &[with("old"), with("new")]
        ));
    }

    #[test]
    fn last_user_message_key_skips_other_roles() {
        let msgs = vec![user("first"), user("second"), assistant("answer")];
        assert_eq!(last_user_message_key(&msgs), "second");
        assert_eq!(last_user_message_key(&[assistant("x")]), "");
        assert_eq!(last_user_message_key(&[]), "");
    }

    // ---- stop reasons ----

    #[test]
    fn a_started_batch_resumes_at_its_own_step() {
        let mut window = vec![user("q1")];
        window.extend(tool_step());
        window.truncate(2); // the calls, no result recorded
        let cp = checkpoint(3, window.clone(), stop_reason::TOOL_CALLS_STARTED);
        assert_eq!(decide(Some(cp), &[user("q1")]), resumed(window, 3, true));
    }

    #[test]
    fn only_tool_calls_is_resumable() {
        assert!(resumable_stop_reason("tool_calls"));
        assert!(resumable_stop_reason("tool_calls_started"));
        for reason in [
            "stop",
            "end_turn",
            "canceled",
            "aborted",
            "error",
            "budget_exhausted",
            "guardrail",
            "safety_net",
            "",
            "TOOL_CALLS",
            "tool_use",
        ] {
            assert!(!resumable_stop_reason(reason), "{reason:?}");
        }
    }

    // ---- superseded window ----

    #[test]
    fn window_is_superseded_when_its_last_user_message_is_followed_by_a_newer_one() {
        let window = vec![user("q1"), assistant("partial")];
        let turn = vec![user("q1"), assistant("old answer"), user("q2")];
        assert!(superseded_window(&window, &turn));
    }

    #[test]
    fn same_last_message_reseeded_is_not_superseded() {
        let window = vec![user("q0"), assistant("a0"), user("q1")];
        let turn = vec![user("q0"), assistant("a0"), user("q1")];
        assert!(!superseded_window(&window, &turn));
        // Even seeded twice in a row.
        let turn = vec![user("q1"), user("q1")];
        assert!(!superseded_window(&window, &turn));
    }

    #[test]
    fn no_overlap_at_all_is_not_superseded() {
        let window = vec![user("before the restart")];
        let turn = vec![user("brand new")];
        assert!(!superseded_window(&window, &turn));
    }

    #[test]
    fn window_without_user_message_is_never_superseded() {
        assert!(!superseded_window(&[assistant("a")], &[user("q")]));
        assert!(!superseded_window(&[], &[user("q")]));
    }

    #[test]
    fn turn_without_user_message_never_supersedes() {
        assert!(!superseded_window(&[user("q")], &[assistant("a")]));
        assert!(!superseded_window(&[user("q")], &[]));
    }

    #[test]
    fn snapshot_message_only_as_assistant_text_does_not_count() {
        // The match must be a *user* message of the turn.
        let window = vec![user("q1")];
        let turn = vec![assistant("q1"), user("q2")];
        assert!(!superseded_window(&window, &turn));
    }

    #[test]
    fn newer_image_supersedes_a_text_snapshot() {
        let window = vec![user("q1")];
        let turn = vec![
            user("q1"),
            Message::image(Role::User, "", "https://x/new.png"),
        ];
        assert!(superseded_window(&window, &turn));
    }

    #[test]
    fn newer_document_supersedes_and_same_document_does_not() {
        let doc = |name: &str| user_parts(vec![document(name)]);
        let window = vec![doc("d-1")];
        assert!(superseded_window(&window, &[doc("d-1"), doc("d-2")]));
        assert!(!superseded_window(&window, &[doc("d-1")]));
    }

    // ---- the decision table ----

    #[test]
    fn no_checkpoint_starts_fresh() {
        let decision = decide(None, &[user("q")]);
        assert_eq!(
            decision,
            ResumeDecision::Fresh {
                reason: FreshReason::NoCheckpoint
            }
        );
        assert_eq!(decision.next_step(), FIRST_STEP);
    }

    #[test]
    fn unparsable_state_starts_fresh() {
        let (mut cp, _) = crash_left(2);
        cp.state = JsonObject::encode(&json!({"messages": "not a list"})).unwrap();
        let decision = decide(Some(cp), &[user("q1")]);
        assert!(
            matches!(
                &decision,
                ResumeDecision::Fresh {
                    reason: FreshReason::Unparsable { error }
                } if !error.is_empty()
            ),
            "{decision:?}"
        );
        assert_eq!(decision.next_step(), 1);
    }

    #[test]
    fn empty_state_object_is_unparsable() {
        let (mut cp, _) = crash_left(2);
        cp.state = JsonObject::empty();
        assert!(matches!(
            decide(Some(cp), &[user("q1")]),
            ResumeDecision::Fresh {
                reason: FreshReason::Unparsable { .. }
            }
        ));
    }

    #[test]
    fn settled_stop_reasons_start_fresh() {
        for reason in [
            "stop",
            "end_turn",
            stop_reason::CANCELED,
            stop_reason::ABORTED,
            stop_reason::ERROR,
            stop_reason::BUDGET_EXHAUSTED,
            stop_reason::GUARDRAIL,
            stop_reason::SAFETY_NET,
            "",
        ] {
            let cp = checkpoint(3, vec![user("q1"), assistant("done")], reason);
            assert_eq!(
                decide(Some(cp), &[user("q1")]),
                ResumeDecision::Fresh {
                    reason: FreshReason::NotResumable {
                        stop_reason: reason.to_owned()
                    }
                },
                "{reason:?}"
            );
        }
    }

    /// D18: a provider said `tool_calls` without calls and the row was saved under it (before
    /// the loop owned its stop reasons): the window ends in the answer, so it is never resumed.
    #[test]
    fn a_row_holding_a_final_answer_is_never_resumed_whatever_its_stop_reason() {
        let mut window = vec![user("q1")];
        window.extend(tool_step());
        window.push(assistant("It is noon."));
        let cp = checkpoint(2, window.clone(), stop_reason::TOOL_CALLS);
        assert!(holds_final_answer(&window));
        assert!(matches!(
            decide(Some(cp), &[user("q1")]),
            ResumeDecision::Fresh {
                reason: FreshReason::NotResumable { .. }
            }
        ));
        // Mid tool loop the window ends in results: resumable.
        assert!(!holds_final_answer(&window[..3]));
        assert!(!holds_final_answer(&window[..2]), "calls without results");
    }

    #[test]
    fn crash_left_checkpoint_resumes_at_the_next_step_with_its_window() {
        let decision = assert_crash_left_resumes(2, &[user("q1")], 3);
        assert_eq!(decision.next_step(), 3);
    }

    #[test]
    fn crash_left_checkpoint_resumes_without_any_overlap() {
        assert_crash_left_resumes(1, &[user("sent after the restart")], 2);
    }

    #[test]
    fn crash_left_checkpoint_resumes_when_the_same_message_is_reseeded() {
        let seeded = vec![user("q0"), assistant("a0"), user("q1")];
        assert_crash_left_resumes(4, &seeded, 5);
    }

    #[test]
    fn crash_left_checkpoint_with_empty_seed_resumes() {
        assert_crash_left_resumes(1, &[], 2);
    }

    #[test]
    fn superseded_crash_left_checkpoint_starts_fresh() {
        let (cp, _) = crash_left(2);
        let seeded = vec![user("q1"), user("q2")];
        assert_eq!(
            decide(Some(cp), &seeded),
            ResumeDecision::Fresh {
                reason: FreshReason::Superseded
            }
        );
    }

    #[test]
    fn settled_checkpoint_wins_over_window_comparison() {
        // Non-resumable is reported even when the window would also be superseded.
        let cp = checkpoint(2, vec![user("q1")], stop_reason::CANCELED);
        assert_eq!(
            decide(Some(cp), &[user("q1"), user("q2")]),
            ResumeDecision::Fresh {
                reason: FreshReason::NotResumable {
                    stop_reason: "canceled".into()
                }
            }
        );
    }

    #[test]
    fn resume_step_comes_from_the_checkpoint_row() {
        let (mut cp, _) = crash_left(2);
        cp.step = 7;
        assert_eq!(decide(Some(cp), &[user("q1")]).next_step(), 8);
    }

    #[test]
    fn unknown_state_fields_are_tolerated() {
        let (mut cp, window) = crash_left(2);
        let mut state = cp.state.to_map();
        state.insert("future_field".into(), json!(true));
        cp.state = state.into();
        assert_eq!(decide(Some(cp), &[user("q1")]), resumed(window, 3, false));
    }
}
