//! Human approval of tool calls (docs/reliability.md, "Approval"; docs/orchestrator.md,
//! "Approvals").
//!
//! A persona's `approval` list or a tool's micro metadata `cyrene.tool.approval` = `required`
//! makes a call wait for a person's decision. The worker stops the turn at such a call and
//! reports it ([`crate::turn::TurnOutcome::AwaitingApproval`] with [`PendingCall`]s); the
//! orchestrator records it, publishes `approval_requested`, and takes one decision per call
//! ([`ApproveRequest`] → [`ApproveResponse`]); once every call of the turn is decided it
//! dispatches the same turn again with the [`CallDecision`]s on the job.
//!
//! # Invariants
//! - The first decision of a call holds: a later request gets it back with `already_decided`.
//! - A decision belongs to one `(turn_id, call_id)`; it is never applied to another turn.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use serde_with::skip_serializing_none;

/// The operator's decision (the CLI's default subject).
pub const SESSION_APPROVE: &str = "cyrene.session.approve";
/// The operator lists a session's approvals.
pub const SESSION_APPROVALS: &str = "cyrene.session.approvals";
/// A chat bridge decides, for one of the owner's sessions only (docs/security.md, "Bridges").
pub const BRIDGE_SESSION_APPROVE: &str = "cyrene.bridge.session.approve";
/// A chat bridge lists the approvals of one of the owner's sessions.
pub const BRIDGE_SESSION_APPROVALS: &str = "cyrene.bridge.session.approvals";
/// A person decides (`cyrene.person.<person>.session.approve`, see [`crate::subjects::person`]).
pub const PERSON_SESSION_APPROVE: &str = "session.approve";
/// A person lists the approvals of one of their sessions.
pub const PERSON_SESSION_APPROVALS: &str = "session.approvals";

/// The longest reason a decision may carry, in bytes.
pub const MAX_REASON_BYTES: usize = 1024;
/// How many decided approvals `session.approvals` lists (the newest), after the pending ones.
pub const APPROVALS_DECIDED_LIMIT: usize = 50;
/// How long a call waits for a decision when its persona says nothing: 24 hours.
pub const DEFAULT_APPROVAL_TIMEOUT_MS: u64 = 86_400_000;
/// The shortest wait a persona may configure.
pub const MIN_APPROVAL_TIMEOUT_MS: u64 = 1_000;
/// The longest wait a persona may configure: 30 days.
pub const MAX_APPROVAL_TIMEOUT_MS: u64 = 30 * 86_400_000;
/// The micro metadata key by which a tool asks for approval of every call…
pub const TOOL_APPROVAL_METADATA: &str = "cyrene.tool.approval";
/// …when its value is this.
pub const TOOL_APPROVAL_REQUIRED: &str = "required";

/// `decided_by` of the operator's decisions.
pub const DECIDED_BY_OPERATOR: &str = "operator";
/// `decided_by` of a chat bridge's decisions.
pub const DECIDED_BY_BRIDGE: &str = "bridge";
/// `decided_by` of the deadline's denials.
pub const DECIDED_BY_DEADLINE: &str = "deadline";

/// `decided_by` of a person's decision: `person:<person>`.
pub fn decided_by_person(person: &str) -> String {
    format!("person:{person}")
}

/// A person's answer to a call that waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The call runs (under its own call id).
    Approve,
    /// The call does not run; the model gets a denial result (with the reason).
    Deny,
}

impl Decision {
    /// The wire name: `approve` / `deny`.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Approve => "approve",
            Decision::Deny => "deny",
        }
    }
}

/// `cyrene.session.approve` (and the person's and bridge's) request.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApproveRequest {
    pub session_id: String,
    pub call_id: String,
    pub decision: Decision,
    /// Why (at most [`MAX_REASON_BYTES`]); the model sees a denial's reason.
    pub reason: Option<String>,
}

/// `cyrene.session.approve` reply: the decision that holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApproveResponse {
    pub session_id: String,
    pub call_id: String,
    /// The decision that holds (the first one taken).
    pub decision: Decision,
    /// True when this request did not make the decision (it had been taken before).
    pub already_decided: bool,
    /// Who took the decision that holds (`person:<p>`, `operator`, `bridge`, `deadline`).
    pub decided_by: String,
}

/// `cyrene.session.approvals` (and the person's and bridge's) request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApprovalsRequest {
    pub session_id: String,
}

/// One call that asked for approval.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Approval {
    pub turn_id: String,
    pub call_id: String,
    pub tool: String,
    pub arguments: Map<String, Value>,
    /// When the turn asked, unix milliseconds.
    pub requested_at_ms: i64,
    /// When the deadline denies it, unix milliseconds.
    pub deadline_ms: i64,
    /// None while it waits.
    pub decision: Option<Decision>,
    pub reason: Option<String>,
    pub decided_by: Option<String>,
}

/// `cyrene.session.approvals` reply: the pending calls first, then the last
/// [`APPROVALS_DECIDED_LIMIT`] decided ones, oldest→newest within each group.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ApprovalsResponse {
    #[serde(default)]
    pub approvals: Vec<Approval>,
}

/// A call a turn stopped at (on [`crate::turn::TurnComplete::approvals`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PendingCall {
    /// The step whose tool batch holds the call: a decision binds to it, so a model that
    /// repeats a call id in a later step of the turn is asked again.
    pub step: u32,
    pub call_id: String,
    pub tool: String,
    #[serde(default)]
    pub arguments: Map<String, Value>,
}

/// A decision the orchestrator hands the worker that continues the turn (on
/// [`crate::turn::TurnJob::decisions`]).
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallDecision {
    /// The step of the call's batch ([`PendingCall::step`]): the worker applies the decision
    /// only to that batch.
    pub step: u32,
    pub call_id: String,
    pub decision: Decision,
    pub reason: Option<String>,
    pub decided_by: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn approve_request_and_response_match_the_contract() {
        let doc = json!({"session_id":"alice.s1","call_id":"c1","decision":"deny",
            "reason":"not today"});
        let req: ApproveRequest = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(req.decision, Decision::Deny);
        assert_eq!(serde_json::to_value(&req).unwrap(), doc);
        let bare: ApproveRequest =
            serde_json::from_value(json!({"session_id":"s1","call_id":"c1","decision":"approve"}))
                .unwrap();
        assert_eq!(bare.reason, None);
        assert!(
            serde_json::from_value::<ApproveRequest>(
                json!({"session_id":"s1","call_id":"c1","decision":"maybe"})
            )
            .is_err()
        );
        assert!(
            serde_json::from_value::<ApproveRequest>(
                json!({"session_id":"s1","call_id":"c1","decision":"approve","turn_id":"t"})
            )
            .is_err(),
            "unknown fields are refused"
        );
        let resp = ApproveResponse {
            session_id: "s1".into(),
            call_id: "c1".into(),
            decision: Decision::Approve,
            already_decided: true,
            decided_by: decided_by_person("alice"),
        };
        assert_eq!(
            serde_json::to_value(&resp).unwrap(),
            json!({"session_id":"s1","call_id":"c1","decision":"approve",
                "already_decided":true,"decided_by":"person:alice"})
        );
    }

    #[test]
    fn approvals_list_omits_what_is_not_decided() {
        let doc = json!({"approvals":[
            {"turn_id":"t1","call_id":"c1","tool":"send_email","arguments":{"to":"x"},
             "requested_at_ms":1,"deadline_ms":2},
            {"turn_id":"t0","call_id":"c0","tool":"send_email","arguments":{},
             "requested_at_ms":0,"deadline_ms":1,"decision":"deny","decided_by":"deadline"}]});
        let list: ApprovalsResponse = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(list.approvals[0].decision, None);
        assert_eq!(serde_json::to_value(&list).unwrap(), doc);
        assert!(
            serde_json::from_value::<ApprovalsRequest>(json!({"session_id":"s","x":1})).is_err()
        );
    }

    #[test]
    fn subjects_are_the_contracts() {
        assert_eq!(
            crate::subjects::person("alice", PERSON_SESSION_APPROVE).unwrap(),
            "cyrene.person.alice.session.approve"
        );
        assert_eq!(
            crate::subjects::person("alice", PERSON_SESSION_APPROVALS).unwrap(),
            "cyrene.person.alice.session.approvals"
        );
    }
}
