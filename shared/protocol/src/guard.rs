//! Guardrails on the bus (docs/loop-worker.md, "Guardrails"): a persona may name a guard, a
//! service the loop worker asks before each tool call runs and before each answer is sent.
//!
//! The orchestrator puts the persona's [`GuardSpec`] on the turn job; the worker sends a
//! [`GuardRequest`] to its `subject` (always `cyrene.guard.<name>`, see
//! [`crate::subjects::guard`]) and reads a [`GuardReply`].
//!
//! # Invariants
//! - A guard that denies, or that fails (no reply in `timeout_ms`, nobody listening, an error
//!   envelope, a reply that is not `{"allow": bool, …}`), under [`GuardFail::Closed`], ends the
//!   turn with stop reason `guardrail` and `message` as the answer; the denied tool never runs
//!   and the denied answer never reaches the session. Under [`GuardFail::Open`] a failure lets
//!   the call or the answer through; a deny never does.
//! - The guard's `reason` is for logs and the checkpoint only, never for the person: it may hold
//!   policy text.

use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// The guard's wait when the persona names none.
pub const DEFAULT_GUARD_TIMEOUT_MS: u64 = 2_000;
/// The longest wait a persona may give its guard.
pub const MAX_GUARD_TIMEOUT_MS: u64 = 30_000;
/// What the person is told on a deny (or a closed failure) when the persona names nothing.
pub const DEFAULT_GUARD_MESSAGE: &str = "Sorry, I can't help with that.";
/// The longest configured message, in bytes.
pub const MAX_GUARD_MESSAGE_BYTES: usize = 4096;
/// The largest guard reply read; a longer one is a failure of the guard.
pub const MAX_GUARD_REPLY_BYTES: usize = 64 * 1024;
/// The longest reason kept (in characters) for logs and the checkpoint.
pub const MAX_GUARD_REASON_CHARS: usize = 500;

/// What a guard that fails (down, slow, malformed) means.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardFail {
    /// A failure denies: the turn ends with stop reason `guardrail`.
    #[default]
    Closed,
    /// A failure allows: the call runs, the answer is sent (a WARN and a metric say so).
    Open,
}

/// A persona's guard, as the turn job carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuardSpec {
    /// `cyrene.guard.<name>`: where the worker asks.
    pub subject: String,
    /// How long the worker waits for each reply (1..=[`MAX_GUARD_TIMEOUT_MS`]).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    #[serde(default)]
    pub fail: GuardFail,
    /// What the person is told when the turn ends by the guard.
    #[serde(default = "default_message")]
    pub message: String,
}

fn default_timeout_ms() -> u64 {
    DEFAULT_GUARD_TIMEOUT_MS
}

fn default_message() -> String {
    DEFAULT_GUARD_MESSAGE.to_owned()
}

/// What the guard is asked about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GuardKind {
    /// A tool call about to run (`tool` and `arguments` are set).
    ToolCall,
    /// An answer about to be sent (`text` is set).
    Answer,
}

impl GuardKind {
    /// The wire name (`tool_call`, `answer`).
    pub fn as_str(self) -> &'static str {
        match self {
            GuardKind::ToolCall => "tool_call",
            GuardKind::Answer => "answer",
        }
    }
}

/// The request sent to a guard: the fields that apply to its `kind`.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GuardRequest {
    pub session_id: String,
    pub turn_id: String,
    /// The answering persona's id.
    pub persona: String,
    pub kind: GuardKind,
    /// The tool's name (`tool_call`).
    pub tool: Option<String>,
    /// The call's arguments, a JSON object (`tool_call`).
    pub arguments: Option<serde_json::Map<String, serde_json::Value>>,
    /// The answer's text (`answer`).
    pub text: Option<String>,
}

/// A guard's reply: `{"allow": bool, "reason": "…"}`; unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuardReply {
    pub allow: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_spec_defaults_to_closed_two_seconds_and_the_default_message() {
        let spec: GuardSpec = serde_json::from_value(json!({"subject":"cyrene.guard.p"})).unwrap();
        assert_eq!(spec.timeout_ms, DEFAULT_GUARD_TIMEOUT_MS);
        assert_eq!(spec.fail, GuardFail::Closed);
        assert_eq!(spec.message, DEFAULT_GUARD_MESSAGE);
        let open: GuardSpec = serde_json::from_value(
            json!({"subject":"cyrene.guard.p","timeout_ms":50,"fail":"open","message":"no"}),
        )
        .unwrap();
        assert_eq!(open.fail, GuardFail::Open);
        assert!(
            serde_json::from_value::<GuardSpec>(json!({"subject":"x","fail":"maybe"})).is_err()
        );
    }

    #[test]
    fn a_request_carries_only_the_fields_of_its_kind() {
        let call = GuardRequest {
            session_id: "s1".into(),
            turn_id: "t1".into(),
            persona: "cyrene".into(),
            kind: GuardKind::ToolCall,
            tool: Some("count".into()),
            arguments: json!({"n": 1}).as_object().cloned(),
            text: None,
        };
        assert_eq!(
            serde_json::to_value(&call).unwrap(),
            json!({"session_id":"s1","turn_id":"t1","persona":"cyrene","kind":"tool_call",
                "tool":"count","arguments":{"n":1}})
        );
        let answer = GuardRequest {
            kind: GuardKind::Answer,
            tool: None,
            arguments: None,
            text: Some("noon".into()),
            ..call
        };
        assert_eq!(
            serde_json::to_value(&answer).unwrap(),
            json!({"session_id":"s1","turn_id":"t1","persona":"cyrene","kind":"answer",
                "text":"noon"})
        );
    }

    #[test]
    fn a_reply_needs_a_boolean_allow() {
        let ok: GuardReply =
            serde_json::from_str(r#"{"allow":false,"reason":"pii","x":1}"#).unwrap();
        assert_eq!((ok.allow, ok.reason.as_str()), (false, "pii"));
        for bad in [
            r#"{}"#,
            r#"{"allow":"yes"}"#,
            r#"{"allow":1}"#,
            "[]",
            "allow",
        ] {
            assert!(serde_json::from_str::<GuardReply>(bad).is_err(), "{bad}");
        }
    }
}
