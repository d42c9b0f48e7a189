//! Turn-job shapes shared by the orchestrator and the loop workers (docs/architecture.md §5, §6;
//! docs/semantics.md#steering).
//!
//! The orchestrator publishes a [`TurnJob`] on `cyrene.turn.run` (stream `CYRENE_TURNS`,
//! `Nats-Msg-Id` = turn id); a loop worker runs it, asks `cyrene.turn.steer` once at the first
//! boundary of each delivery ([`SteerRequest`] → [`SteerResponse`]), takes in what the
//! orchestrator pushes to `cyrene.turn.input.<turn_id>` ([`SteeredMessage`]) at every later one,
//! and reports `cyrene.turn.complete` ([`TurnComplete`] → [`TurnCompleteAck`]).
//!
//! # Invariants
//! - `attempt` is the JetStream delivery count of the job. Steer claims, checkpoint saves and the
//!   completion carry `{turn_id, attempt}`; once a newer attempt wrote, an older one is refused
//!   with `conflict` (a zombie worker cannot answer twice).
//! - Steered messages come back *claimed by this turn* with `seq > after_seq`, so a turn resumed
//!   on another worker (starting again from the job's `base_seq`) gets them all back.

use crate::ErrorBody;
use crate::message::Message;
use crate::session::SessionEnv;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;
use std::collections::BTreeMap;

/// One turn to run: everything a worker needs, so workers stay stateless.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TurnJob {
    pub turn_id: String,
    pub session_id: String,
    /// Set for a true parallel leg: checkpoints go under `{session_id}#{leg_id}`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub leg_id: String,
    /// Session facts: restricted (group/stranger) or not, and the answering persona id.
    pub env: SessionEnv,
    /// The answering persona's instructions (the first system message of every view).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub instructions: String,
    /// Persona id → display name, for attribution labels `「name」（id）`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub persona_names: BTreeMap<String, String>,
    /// The seeded window: recent persisted messages plus the new one(s).
    pub messages: Vec<Message>,
    /// Server ids of the user messages this turn answers (the ones that started it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub message_ids: Vec<String>,
    /// The highest session seq already in `messages`: the first steer asks for `seq > base_seq`.
    #[serde(default)]
    pub base_seq: u64,
    /// Attached when this is a second leg (docs/semantics.md#parallel-notice).
    pub notice: Option<ParallelNotice>,
    /// Model steps allowed before the turn ends as budget exhausted.
    #[serde(default = "default_max_steps")]
    pub max_steps: u32,
    /// Wall-clock deadline of the turn, unix milliseconds (the persona's turn timeout counted
    /// from the turn's creation); none = no deadline. Past it, no further step starts and a
    /// model call in flight is abandoned.
    pub deadline_unix_ms: Option<u64>,
    /// The tools this turn may offer and call (the persona's allow-list): none = every
    /// discovered tool and the built-ins; a list = only those of them (empty = no tool at all).
    pub tools: Option<Vec<String>>,
    /// For a turn answering an agent ask: the agents already answering an ask this turn serves,
    /// outermost first, ending with this turn's persona. The worker's `ask_agent` sends it as
    /// the ask's `chain`, so an ask back to any of them is refused at once (docs/comm.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ask_chain: Vec<String>,
    /// The persona's guard (docs/loop-worker.md, "Guardrails"): asked before each tool call
    /// runs and before the answer is sent; none = no guard. A worker that does not know this
    /// field refuses the job (unknown fields are refused), so a guarded turn never runs
    /// unguarded.
    pub guard: Option<crate::guard::GuardSpec>,
    /// The persona's tools whose every call waits for a person's approval (docs/reliability.md,
    /// "Approval"); a tool's own metadata may ask for it too. A worker that does not know this
    /// field refuses the job, so a gated call never runs unasked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approval: Vec<String>,
    /// A turn continued after its calls were decided: the decisions, one per waiting call. The
    /// worker applies them only to the calls of this turn's saved tool batch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<crate::approval::CallDecision>,
    /// Added to the JetStream delivery count to make the attempt: 0 for a turn's first job; a
    /// job that continues a turn after its approvals starts past every attempt the job before it
    /// made or can still make ([`MAX_JOB_DELIVERIES`]), so its attempts fence every earlier one
    /// off.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attempt_base: u32,
}

/// The most deliveries one job of a turn may have: a loop worker refuses a larger
/// `max_deliver`. A job that continues a turn after its approvals starts its attempts at least
/// this far past the job before it, so a delivery of that earlier job still queued — its ack
/// lost while the turn waited — can never take an attempt number of the new one.
pub const MAX_JOB_DELIVERIES: u32 = 1000;

/// The default step budget of a turn.
pub const DEFAULT_MAX_STEPS: u32 = 16;

fn default_max_steps() -> u32 {
    DEFAULT_MAX_STEPS
}

/// `cyrene.turn.steer` request, sent at the first boundary of a delivery (and at every boundary by
/// a worker that could not subscribe to its turn's input).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SteerRequest {
    pub session_id: String,
    pub turn_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub leg_id: String,
    /// The step about to start (its view will hold what is returned).
    pub step: u32,
    /// Return messages claimed by this turn with a greater seq.
    pub after_seq: u64,
    pub attempt: u32,
}

/// A user message steered into a running turn: an item of the steer reply, and the body of a
/// push on `cyrene.turn.input.<turn_id>` (claimed for that turn before it is pushed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SteeredMessage {
    pub id: String,
    pub seq: u64,
    pub message: Message,
}

/// `cyrene.turn.steer` reply: in seq order.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SteerResponse {
    #[serde(default)]
    pub messages: Vec<SteeredMessage>,
}

/// How a turn ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnOutcome {
    /// A final answer (`message` holds it).
    Final,
    /// The step budget ran out.
    BudgetExhausted,
    /// The deadline passed or the turn was cancelled.
    Cancelled,
    /// A failure the worker could not recover from (`error` says which).
    Error,
    /// The turn stopped at calls that wait for a person's decision (`approvals` lists them).
    /// The turn is not over: the orchestrator dispatches it again once they are decided.
    AwaitingApproval,
}

/// `cyrene.turn.complete` request: idempotent by turn id, fenced by attempt, retried by the worker
/// until acknowledged.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TurnComplete {
    pub turn_id: String,
    pub session_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub leg_id: String,
    pub attempt: u32,
    pub outcome: TurnOutcome,
    /// The final assistant message (persona id in `sender_name`).
    pub message: Option<Message>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stop_reason: String,
    /// Steps run (1-based count).
    #[serde(default)]
    pub steps: u32,
    /// Ids of the steered messages this turn consumed (besides `TurnJob::message_ids`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steered_ids: Vec<String>,
    pub error: Option<ErrorBody>,
    /// On `awaiting_approval`: the calls of the step's tool batch that wait for a decision.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approvals: Vec<crate::approval::PendingCall>,
}

/// `cyrene.turn.complete` reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnCompleteAck {
    /// False when this turn had already been completed (a retry or a redelivery): nothing changed.
    pub first: bool,
}

/// A metadata-only snapshot of the *other* leg running in the same session, attached by the
/// orchestrator when it starts a second leg (docs/semantics.md#parallel-notice).
///
/// # Invariants
/// - No field can carry the other leg's text: a half sentence would invite this leg to complete
///   or pre-empt it. The snapshot is taken when the leg starts and never updated mid-run.
/// - Every field is optional; an all-empty notice is still a meaningful signal ("another leg is
///   running, answer independently"), so *attached* and *empty* are different things: carry it
///   as `Option<ParallelNotice>`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelNotice {
    /// Server id of the other leg's user message; empty = not rendered.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub other_message_id: String,
    /// The step (1-based) the other leg has reached; 0 = not rendered.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub step: u32,
    /// Tools the other leg has called, in call order, deduplicated; empty = not rendered.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_names: Vec<String>,
    /// Messages of the session still pending (claimed by no leg); 0 = not rendered.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub queued: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;
    use serde_json::json;

    #[test]
    fn turn_job_round_trips_and_defaults() {
        let doc = json!({"turn_id":"t1","session_id":"s1","env":{"restricted":true,"persona":"cyrene"},
            "instructions":"be kind","persona_names":{"cyrene":"昔涟"},
            "messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "message_ids":["m1"],"base_seq":7,"notice":{"step":2},"max_steps":8,
            "deadline_unix_ms":1700000000000u64,"tools":["current_time"],"leg_id":"l1",
            "ask_chain":["hoshi","cyrene"],"approval":["send_email"],
            "decisions":[{"step":2,"call_id":"c1","decision":"approve",
                "decided_by":"operator"}],
            "attempt_base":3,
            "guard":{"subject":"cyrene.guard.p","timeout_ms":500,"fail":"open","message":"no"}});
        let job: TurnJob = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(job.messages[0], Message::text(Role::User, "hi"));
        assert_eq!(serde_json::to_value(&job).unwrap(), doc);
        let min: TurnJob = serde_json::from_value(json!({"turn_id":"t","session_id":"s",
            "env":{},"messages":[]}))
        .unwrap();
        assert_eq!(min.max_steps, DEFAULT_MAX_STEPS);
        assert_eq!(min.base_seq, 0);
        assert!(min.notice.is_none());
        assert_eq!(min.tools, None, "no list: every tool");
        assert!(min.ask_chain.is_empty(), "not an ask's turn");
        assert_eq!(min.guard, None, "no guard");
        let none: TurnJob = serde_json::from_value(json!({"turn_id":"t","session_id":"s",
            "env":{},"messages":[],"tools":[]}))
        .unwrap();
        assert_eq!(none.tools, Some(vec![]), "an empty list: no tool at all");
    }

    #[test]
    fn steer_and_complete_round_trip() {
        let req = json!({"session_id":"s1","turn_id":"t1","step":2,"after_seq":7,"attempt":1});
        let r: SteerRequest = serde_json::from_value(req.clone()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), req);
        let resp = json!({"messages":[{"id":"m2","seq":8,"message":{"role":"user",
            "content":[{"type":"text","text":"also"}]}}]});
        let r: SteerResponse = serde_json::from_value(resp.clone()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), resp);
        let done = json!({"turn_id":"t1","session_id":"s1","attempt":2,"outcome":"final",
            "message":{"role":"assistant","content":[{"type":"text","text":"ok"}],
            "sender_name":"cyrene"},"stop_reason":"stop","steps":3,"steered_ids":["m2"]});
        let c: TurnComplete = serde_json::from_value(done.clone()).unwrap();
        assert_eq!(c.outcome, TurnOutcome::Final);
        assert_eq!(serde_json::to_value(&c).unwrap(), done);
        for o in [
            "final",
            "budget_exhausted",
            "cancelled",
            "error",
            "awaiting_approval",
        ] {
            let v: TurnOutcome = serde_json::from_value(json!(o)).unwrap();
            assert_eq!(serde_json::to_value(v).unwrap(), json!(o));
        }
        let ack = TurnCompleteAck { first: false };
        assert_eq!(serde_json::to_value(ack).unwrap(), json!({"first":false}));
    }

    #[test]
    fn full_notice_round_trips() {
        let notice = ParallelNotice {
            other_message_id: "msg-1".into(),
            step: 3,
            tool_names: vec!["search_documents".into(), "document-read".into()],
            queued: 2,
        };
        let doc = json!({"other_message_id":"msg-1","step":3,
            "tool_names":["search_documents","document-read"],"queued":2});
        assert_eq!(serde_json::to_value(&notice).unwrap(), doc);
        assert_eq!(
            serde_json::from_value::<ParallelNotice>(doc).unwrap(),
            notice
        );
    }

    #[test]
    fn empty_fields_are_omitted_and_default_on_input() {
        assert_eq!(
            serde_json::to_value(ParallelNotice::default()).unwrap(),
            json!({})
        );
        let n: ParallelNotice = serde_json::from_value(json!({"queued":1})).unwrap();
        assert_eq!(
            n,
            ParallelNotice {
                queued: 1,
                ..ParallelNotice::default()
            }
        );
    }

    #[test]
    fn a_text_field_is_refused() {
        let err =
            serde_json::from_value::<ParallelNotice>(json!({"text":"half an answer"})).unwrap_err();
        assert!(err.to_string().contains("text"), "{err}");
        assert!(serde_json::from_value::<ParallelNotice>(json!({"step":-1})).is_err());
    }
}

/// `cyrene.turns.running` request (operators only): the turns running now, the oldest first.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunningTurnsRequest {
    pub limit: Option<u32>,
}

/// The default page of `cyrene.turns.running`.
pub const RUNNING_TURNS_DEFAULT_LIMIT: u32 = 100;
/// The most turns one `cyrene.turns.running` reply names.
pub const RUNNING_TURNS_MAX_LIMIT: u32 = 1000;

/// One turn in flight, as `cyrene.turns.running` names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunningTurn {
    pub turn_id: String,
    pub session_id: String,
    /// The parallel leg it runs on (empty: the session's main line).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub leg_id: String,
    /// The answering persona of its session (empty: the default).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persona: String,
    /// The JetStream delivery running it (0 before a worker has taken it; above 1: redelivered).
    pub attempt: u32,
    /// Its last saved step, from the checkpoint store (0 before its first checkpoint, or when
    /// the checkpoint store did not answer).
    pub step: u32,
    /// When the turn was started, unix milliseconds.
    pub started_at_ms: i64,
}

/// `cyrene.turns.running` reply.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RunningTurnsResponse {
    #[serde(default)]
    pub turns: Vec<RunningTurn>,
    /// More turns run than the reply names (raise `limit`, up to the maximum).
    #[serde(default)]
    pub more: bool,
}
