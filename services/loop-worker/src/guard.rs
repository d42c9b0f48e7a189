//! Guardrails (docs/loop-worker.md, "Guardrails"): the persona's guard is asked before each tool
//! call runs and before each answer is sent, and its reply — or its failure, under the persona's
//! `fail` policy — becomes a [`Verdict`].
//!
//! # Invariants
//! - A reply counts only when it is at most [`MAX_GUARD_REPLY_BYTES`] of JSON with a boolean
//!   `allow` (and a string `reason`, if any). Anything else — nobody listening, no reply within
//!   the persona's `timeout_ms`, an error envelope, a subject that is not `cyrene.guard.<name>`,
//!   a request that cannot be sent — is a *failure*, which denies under `closed` and allows under
//!   `open`. Nothing a guard sends can panic the worker.
//! - The reason kept (for logs and the checkpoint, never the person) is at most
//!   [`MAX_GUARD_REASON_CHARS`] characters.
//!
//! # Pitfalls
//! - The guard is asked at least once per call and per answer, not exactly once: a step re-run
//!   after a crash or a redelivery asks again about what its new model call produced.

use crate::ports::TurnPorts;
use cyrene_protocol::guard::{
    GuardFail, GuardKind, GuardReply, GuardRequest, GuardSpec, MAX_GUARD_REASON_CHARS,
    MAX_GUARD_REPLY_BYTES, MAX_GUARD_TIMEOUT_MS,
};
use cyrene_protocol::subjects;
use std::time::Duration;

/// What the guard decided about one call or answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Go on (the guard allowed it, or failed under `open`).
    Allow,
    /// End the turn with stop reason `guardrail`: the guard denied it (`failed: false`) or
    /// failed under `closed` (`failed: true`); `reason` is for logs and the checkpoint only.
    Deny { reason: String, failed: bool },
}

/// Asks the guard of `spec` about `request`, bounded by the spec's timeout.
pub async fn check<P: TurnPorts>(ports: &P, spec: &GuardSpec, request: &GuardRequest) -> Verdict {
    let outcome = ask(ports, spec, request).await;
    let kind = request.kind.as_str();
    let verdict = match outcome {
        Ok(reply) if reply.allow => Verdict::Allow,
        Ok(reply) => Verdict::Deny {
            reason: bounded(&reply.reason),
            failed: false,
        },
        Err(why) => match spec.fail {
            GuardFail::Closed => Verdict::Deny {
                reason: bounded(&format!("the guard failed: {why}")),
                failed: true,
            },
            GuardFail::Open => {
                tracing::warn!(turn = %request.turn_id, kind, subject = %spec.subject,
                    error = %why, "the guard failed; failing open");
                metrics::counter!("cyrene_guard_checks_total", "kind" => kind, "verdict" => "failed_open")
                    .increment(1);
                return Verdict::Allow;
            }
        },
    };
    let label = match &verdict {
        Verdict::Allow => "allow",
        Verdict::Deny { failed: false, .. } => "deny",
        Verdict::Deny { failed: true, .. } => "failed_closed",
    };
    metrics::counter!("cyrene_guard_checks_total", "kind" => kind, "verdict" => label).increment(1);
    verdict
}

/// The guard's reply, or why there is none worth reading.
async fn ask<P: TurnPorts>(
    ports: &P,
    spec: &GuardSpec,
    request: &GuardRequest,
) -> Result<GuardReply, String> {
    if !subjects::is_guard(&spec.subject) {
        return Err(format!(
            "{:?} is not a guard subject cyrene.guard.<name>",
            spec.subject
        ));
    }
    let payload = serde_json::to_vec(request).map_err(|e| format!("cannot encode: {e}"))?;
    let timeout = Duration::from_millis(spec.timeout_ms.clamp(1, MAX_GUARD_TIMEOUT_MS));
    let bytes =
        match tokio::time::timeout(timeout, ports.guard(&spec.subject, payload, timeout)).await {
            Err(_) => return Err(format!("no reply within {timeout:?}")),
            Ok(Err(err)) => return Err(err.to_string()),
            Ok(Ok(bytes)) => bytes,
        };
    decode(&bytes)
}

/// A reply as the guard sent it: at most [`MAX_GUARD_REPLY_BYTES`], `{"allow": bool, …}`.
pub fn decode(bytes: &[u8]) -> Result<GuardReply, String> {
    if bytes.len() > MAX_GUARD_REPLY_BYTES {
        return Err(format!(
            "a reply of {} bytes (at most {MAX_GUARD_REPLY_BYTES} are read)",
            bytes.len()
        ));
    }
    let malformed = |e: &dyn std::fmt::Display| {
        format!("a reply that is not {{\"allow\": bool, \"reason\": …}}: {e}")
    };
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| malformed(&e))?;
    // Only an object: serde would also read a struct from an array (`[true]`).
    if !value.is_object() {
        return Err(malformed(&"not an object"));
    }
    serde_json::from_value::<GuardReply>(value).map_err(|e| malformed(&e))
}

/// `reason` cut to [`MAX_GUARD_REASON_CHARS`] characters.
fn bounded(reason: &str) -> String {
    reason.chars().take(MAX_GUARD_REASON_CHARS).collect()
}

/// The request about a tool call.
pub fn tool_call(
    job: &cyrene_protocol::turn::TurnJob,
    call: &cyrene_protocol::message::ToolCall,
) -> GuardRequest {
    GuardRequest {
        session_id: job.session_id.clone(),
        turn_id: job.turn_id.clone(),
        persona: job.env.persona.clone(),
        kind: GuardKind::ToolCall,
        tool: Some(call.name.clone()),
        arguments: Some(call.args.clone()),
        text: None,
    }
}

/// The request about an answer.
pub fn answer(job: &cyrene_protocol::turn::TurnJob, text: String) -> GuardRequest {
    GuardRequest {
        session_id: job.session_id.clone(),
        turn_id: job.turn_id.clone(),
        persona: job.env.persona.clone(),
        kind: GuardKind::Answer,
        tool: None,
        arguments: None,
        text: Some(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_bounded_object_with_a_boolean_allow_is_a_reply() {
        assert_eq!(
            decode(br#"{"allow":true}"#),
            Ok(GuardReply {
                allow: true,
                reason: String::new()
            })
        );
        assert_eq!(
            decode(br#"{"allow":false,"reason":"pii"}"#).unwrap().reason,
            "pii"
        );
        for bad in [
            &b"not json"[..],
            b"",
            b"{}",
            br#"{"allow":"true"}"#,
            br#"{"allow":null}"#,
            br#"{"allow":false,"reason":7}"#,
            b"[true]",
            b"\xff\xfe",
        ] {
            assert!(decode(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let huge = format!(
            r#"{{"allow":true,"reason":"{}"}}"#,
            "x".repeat(MAX_GUARD_REPLY_BYTES)
        );
        assert!(decode(huge.as_bytes()).unwrap_err().contains("bytes"));
    }

    #[test]
    fn a_long_reason_is_cut_on_a_character() {
        let reason = "理".repeat(MAX_GUARD_REASON_CHARS + 10);
        assert_eq!(bounded(&reason).chars().count(), MAX_GUARD_REASON_CHARS);
    }
}
