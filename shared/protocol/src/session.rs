//! `cyrene.session.*` shapes (docs/architecture.md §6, §9).

use crate::message::Message;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// Session facts taken when the session is created.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionEnv {
    /// A group or stranger chat: unlabelled user messages are the owner's.
    #[serde(default)]
    pub restricted: bool,
    /// The answering persona; the default persona when empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persona: String,
}

/// `cyrene.session.send` request.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SendRequest {
    pub session_id: String,
    pub message: Message,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub client_id: String,
    /// Client-chosen key: a resend with the same key gets the first ack back.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub idempotency_key: String,
    pub env: Option<SessionEnv>,
    /// Per-send opt-in to the parallel policy: when a turn of *another* client is in flight, this
    /// message starts its own leg (`parallel_leg`) instead of waiting (`pending`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub parallel: bool,
    /// Per-send double-texting policy: what happens to this message when a turn of its session
    /// is in flight. Absent = the configured policy of its client or session (default `steer`).
    /// `parallel: true` is the same as `"when_busy":"parallel"`; the two may not disagree.
    pub when_busy: Option<BusyPolicy>,
    /// The configured persona this message addresses (docs/orchestrator.md, "Several personas"):
    /// the session's turns run as it from this message on. Empty = the persona the session last
    /// used (initially its env's, else the default). A restricted session refuses a switch.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persona: String,
    /// Context only (`cyrene.bridge.session.send` alone): the message enters the session's
    /// transcript — the next turn's view shows it in order — but starts no turn and is never
    /// steered into a running one (docs/orchestrator.md, "Context-only messages").
    #[serde(default, skip_serializing_if = "is_false")]
    pub context_only: bool,
}

/// The double-texting policy: what a message sent while a turn of its session is in flight
/// does (docs/orchestrator.md, "Double-texting").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BusyPolicy {
    /// Steered into the running turn at its next boundary (or the next turn if it ends first).
    Steer,
    /// A leg of its own when the running turn belongs to another client.
    Parallel,
    /// Waits for the next turn; never steered into the running one.
    Enqueue,
    /// Refused with `conflict` while a turn runs; nothing is stored.
    Reject,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// What happened to a sent message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Disposition {
    /// No turn was in flight: a turn was started for it.
    TurnStarted,
    /// A turn is in flight: steered in at its next boundary, or the next turn.
    Pending,
    /// The parallel policy started another leg for it.
    ParallelLeg,
    /// A context-only message (the bridge's): stored in the transcript, no turn.
    ContextOnly,
}

/// `cyrene.session.send` reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendAck {
    pub message_id: String,
    pub seq: u64,
    pub disposition: Disposition,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub turn_id: String,
}

/// The kind of a live session event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionEventType {
    TurnStarted,
    SteerAck,
    Step,
    ToolCall,
    ToolResult,
    Final,
    Error,
    TurnEnded,
    /// A piece of the answer text while the model produces it (docs/loop-worker.md, "Deltas").
    Delta,
    /// A tool call whose outcome is unknown: it was started, not idempotent, and its result was
    /// lost (the runtime stopped while it ran, or its reply never came); it was not run again
    /// and the model got a result saying so (docs/reliability.md, "Tool calls in flight").
    /// Carries `call_id`, `tool` and `arguments`.
    ToolOutcomeUnknown,
    /// A call waits for a person's decision (docs/orchestrator.md, "Approvals"); the turn stopped
    /// at it without `final`/`turn_ended`. Carries `turn_id`, `call_id`, `tool`, `arguments`
    /// and `deadline_ms`.
    ApprovalRequested,
    /// A waiting call was decided. Carries `turn_id`, `call_id`, `tool`, `decision`,
    /// `decided_by` and `reason` when one was given.
    ApprovalDecided,
}

/// Published on `cyrene.session.<sid>.events`.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionEvent {
    #[serde(rename = "type")]
    pub kind: SessionEventType,
    pub session_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub turn_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub leg_id: String,
    pub at_step: Option<u32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub message_ids: Vec<String>,
    pub message: Option<Message>,
    /// On `error` events: what went wrong.
    pub error: Option<crate::ErrorBody>,
    /// On `delta` events: the text piece.
    pub delta: Option<String>,
    /// On `delta` events: 0, 1, 2, … within one (turn, attempt, step).
    pub seq: Option<u64>,
    /// On `delta` events: the turn's delivery attempt (1-based); a higher one re-streams.
    pub attempt: Option<u32>,
    /// On `delta` events: within one attempt, how many times the step's model call was sent
    /// again because the gateway replica serving it died mid-call (absent = the first try). A
    /// higher one re-streams the step's text from `seq` 0, as a higher `attempt` does.
    pub retry: Option<u32>,
    /// On `delta` events: who is speaking (the persona id the `final` message will carry).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sender_name: String,
    /// On `tool_outcome_unknown` and approval events: the call's id (the `Cyrene-Tool-Call-Id`
    /// it is sent with).
    pub call_id: Option<String>,
    /// On `tool_outcome_unknown` and approval events: the tool's name.
    pub tool: Option<String>,
    /// On `tool_outcome_unknown` and `approval_requested` events: the call's arguments.
    pub arguments: Option<serde_json::Map<String, serde_json::Value>>,
    /// On `approval_requested` events: when the deadline denies the call, unix milliseconds.
    pub deadline_ms: Option<i64>,
    /// On `approval_decided` events: the decision that holds.
    pub decision: Option<crate::approval::Decision>,
    /// On `approval_decided` events: the decision's reason, when one was given.
    pub reason: Option<String>,
    /// On `approval_decided` events: who decided (`person:<p>`, `operator`, `bridge`,
    /// `deadline`).
    pub decided_by: Option<String>,
}

impl SessionEvent {
    /// An event of `kind` for a session, every optional field empty.
    pub fn new(kind: SessionEventType, session_id: impl Into<String>) -> SessionEvent {
        SessionEvent {
            kind,
            session_id: session_id.into(),
            turn_id: String::new(),
            leg_id: String::new(),
            at_step: None,
            message_ids: Vec::new(),
            message: None,
            error: None,
            delta: None,
            seq: None,
            attempt: None,
            retry: None,
            sender_name: String::new(),
            call_id: None,
            tool: None,
            arguments: None,
            deadline_ms: None,
            decision: None,
            reason: None,
            decided_by: None,
        }
    }
}

/// `cyrene.session.history` request: the transcript, oldest→newest, at most `limit` messages
/// (default [`HISTORY_DEFAULT_LIMIT`], at most [`HISTORY_MAX_LIMIT`]), all before `before_seq`
/// when given (paging backwards).
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HistoryRequest {
    pub session_id: String,
    pub limit: Option<u32>,
    pub before_seq: Option<u64>,
}

/// The default page size of `cyrene.session.history`.
pub const HISTORY_DEFAULT_LIMIT: u32 = 50;
/// The largest page `cyrene.session.history` returns.
pub const HISTORY_MAX_LIMIT: u32 = 1000;

/// One transcript entry: a user message (with the turn that consumed it; none while pending) or
/// an assistant answer (with the turn that produced it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HistoryEntry {
    pub id: String,
    pub seq: u64,
    pub message: Message,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub turn_id: String,
}

/// `cyrene.session.history` reply, oldest→newest.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct HistoryResponse {
    #[serde(default)]
    pub messages: Vec<HistoryEntry>,
    /// Set when older entries were left out of this page (by `limit` or because the page
    /// reached what the bus carries in one message): pass it as `before_seq` for the next page.
    pub next_before_seq: Option<u64>,
}

/// `cyrene.person.<person>.session.list` request: the person's sessions, the newest first, at
/// most `limit` (default [`SESSION_LIST_DEFAULT_LIMIT`], at most [`SESSION_LIST_MAX_LIMIT`]).
/// The person is the subject's; nobody lists another person's sessions.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionListRequest {
    pub limit: Option<u32>,
}

/// The default page of `cyrene.person.<person>.session.list`.
pub const SESSION_LIST_DEFAULT_LIMIT: u32 = 100;
/// The most sessions one `session.list` reply names.
pub const SESSION_LIST_MAX_LIMIT: u32 = 1000;

/// One session of a person, as `session.list` names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionSummary {
    pub session_id: String,
    /// The answering persona recorded when the session was created (empty: the default).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persona: String,
    /// When the session was created, unix milliseconds.
    pub created_at_ms: i64,
}

/// `cyrene.person.<person>.session.list` reply, the newest session first.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SessionListResponse {
    #[serde(default)]
    pub sessions: Vec<SessionSummary>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;
    use serde_json::json;

    #[test]
    fn send_and_ack_match_design() {
        let doc = json!({"session_id":"s1","message":{"role":"user","content":[{"type":"text",
            "text":"hi"}]},"client_id":"cli-1","idempotency_key":"k1",
            "env":{"restricted":false,"persona":"cyrene"}});
        let req: SendRequest = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(req.message, Message::text(Role::User, "hi"));
        assert_eq!(serde_json::to_value(&req).unwrap(), doc);

        for (d, s) in [
            (Disposition::TurnStarted, "turn_started"),
            (Disposition::Pending, "pending"),
            (Disposition::ParallelLeg, "parallel_leg"),
            (Disposition::ContextOnly, "context_only"),
        ] {
            let ack = SendAck {
                message_id: "m".into(),
                seq: 7,
                disposition: d,
                turn_id: "t".into(),
            };
            let doc = json!({"message_id":"m","seq":7,"disposition":s,"turn_id":"t"});
            assert_eq!(serde_json::to_value(&ack).unwrap(), doc);
            assert_eq!(serde_json::from_value::<SendAck>(doc).unwrap(), ack);
        }
    }

    #[test]
    fn session_event_matches_design() {
        let doc = json!({"type":"steer_ack","session_id":"s1","turn_id":"t","leg_id":"l",
            "at_step":2,"message_ids":["m1"],"message":{"role":"assistant","content":[
            {"type":"text","text":"ok"}]}});
        let ev: SessionEvent = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(ev.kind, SessionEventType::SteerAck);
        assert_eq!(serde_json::to_value(&ev).unwrap(), doc);
        for t in [
            "turn_started",
            "step",
            "tool_call",
            "tool_result",
            "final",
            "error",
            "turn_ended",
            "tool_outcome_unknown",
            "approval_requested",
            "approval_decided",
        ] {
            let ev: SessionEvent =
                serde_json::from_value(json!({"type":t,"session_id":"s1"})).unwrap();
            assert_eq!(
                serde_json::to_value(ev).unwrap(),
                json!({"type":t,"session_id":"s1"})
            );
        }
    }

    #[test]
    fn approval_events_carry_the_contracts_fields() {
        let doc = json!({"type":"approval_requested","session_id":"s1","turn_id":"t",
            "call_id":"c1","tool":"send_email","arguments":{"to":"a@b"},"deadline_ms":5});
        let ev: SessionEvent = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(ev.deadline_ms, Some(5));
        assert_eq!(serde_json::to_value(&ev).unwrap(), doc);
        let doc = json!({"type":"approval_decided","session_id":"s1","turn_id":"t",
            "call_id":"c1","tool":"send_email","decision":"deny","reason":"no",
            "decided_by":"person:alice"});
        let ev: SessionEvent = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(ev.decision, Some(crate::approval::Decision::Deny));
        assert_eq!(serde_json::to_value(&ev).unwrap(), doc);
    }

    #[test]
    fn session_list_matches_the_docs() {
        let req: SessionListRequest = serde_json::from_value(json!({})).unwrap();
        assert_eq!(req.limit, None);
        assert!(serde_json::from_value::<SessionListRequest>(json!({"person":"bob"})).is_err());
        let reply = SessionListResponse {
            sessions: vec![
                SessionSummary {
                    session_id: "alice.s2".into(),
                    persona: "hoshi".into(),
                    created_at_ms: 2,
                },
                SessionSummary {
                    session_id: "alice.s1".into(),
                    persona: String::new(),
                    created_at_ms: 1,
                },
            ],
        };
        assert_eq!(
            serde_json::to_value(&reply).unwrap(),
            json!({"sessions":[
                {"session_id":"alice.s2","persona":"hoshi","created_at_ms":2},
                {"session_id":"alice.s1","created_at_ms":1}]})
        );
    }

    #[test]
    fn parallel_opt_in_is_omitted_when_false() {
        let doc = json!({"session_id":"s1","message":{"role":"user","content":[{"type":"text",
            "text":"hi"}]},"parallel":true});
        let req: SendRequest = serde_json::from_value(doc.clone()).unwrap();
        assert!(req.parallel);
        assert_eq!(serde_json::to_value(&req).unwrap(), doc);
        let plain = SendRequest {
            parallel: false,
            when_busy: None,
            ..req
        };
        assert!(
            serde_json::to_value(&plain)
                .unwrap()
                .get("parallel")
                .is_none()
        );
    }

    #[test]
    fn when_busy_is_optional_and_snake_case() {
        for (policy, name) in [
            (BusyPolicy::Steer, "steer"),
            (BusyPolicy::Parallel, "parallel"),
            (BusyPolicy::Enqueue, "enqueue"),
            (BusyPolicy::Reject, "reject"),
        ] {
            let doc = json!({"session_id":"s1","message":{"role":"user","content":[{"type":"text",
                "text":"hi"}]},"when_busy":name});
            let req: SendRequest = serde_json::from_value(doc.clone()).unwrap();
            assert_eq!(req.when_busy, Some(policy));
            assert_eq!(serde_json::to_value(&req).unwrap(), doc);
        }
        // Old senders: no field, same meaning as before.
        let old = json!({"session_id":"s1","message":{"role":"user","content":"hi"}});
        let req: SendRequest = serde_json::from_value(old).unwrap();
        assert_eq!(req.when_busy, None);
        assert!(
            serde_json::to_value(&req)
                .unwrap()
                .get("when_busy")
                .is_none()
        );
        let bad = json!({"session_id":"s1","message":{"role":"user","content":"hi"},
            "when_busy":"interrupt"});
        assert!(serde_json::from_value::<SendRequest>(bad).is_err());
    }

    #[test]
    fn history_shapes_round_trip() {
        let doc = json!({"session_id":"s1","limit":50,"before_seq":9});
        let req: HistoryRequest = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(serde_json::to_value(&req).unwrap(), doc);
        let min: HistoryRequest = serde_json::from_value(json!({"session_id":"s1"})).unwrap();
        assert_eq!((min.limit, min.before_seq), (None, None));
        assert!(serde_json::from_value::<HistoryRequest>(json!({"session_id":"s","x":1})).is_err());
        let resp = json!({"messages":[
            {"id":"m1","seq":1,"message":{"role":"user","content":[{"type":"text","text":"hi"}]},
             "turn_id":"t1"},
            {"id":"m2","seq":2,"message":{"role":"user","content":[{"type":"text","text":"later"}]}}]});
        let r: HistoryResponse = serde_json::from_value(resp.clone()).unwrap();
        assert_eq!(r.messages[1].turn_id, "");
        assert_eq!(serde_json::to_value(&r).unwrap(), resp);
    }

    #[test]
    fn send_refuses_unknown_fields_and_missing_message() {
        assert!(serde_json::from_value::<SendRequest>(json!({"session_id":"s1"})).is_err());
        let err = serde_json::from_value::<SendRequest>(json!({"session_id":"s1",
            "message":{"role":"user","content":"x"},"priority":1}));
        assert!(err.unwrap_err().to_string().contains("priority"));
    }
}
