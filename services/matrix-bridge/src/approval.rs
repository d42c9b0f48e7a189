//! Human approval in a room (docs/matrix-bridge.md, "Approving"): the notice the bridge posts
//! when a call waits, the owner's reply that decides it, and the notice of the decision that
//! holds. Pure: no I/O.
//!
//! # Invariants
//! - Only a whole message is a reply: `approve <call_id>` or `deny <call_id> [reason]` (the
//!   word in any case), or — quoting the bridge's notice (a Matrix reply) — `approve` or
//!   `deny [reason]`. Anything else, or anything said by someone other than the owner, is an
//!   ordinary message (the bridge checks the sender; this module only reads text).
//! - What the bridge posts is plain text (`body` only, no `formatted_body`) with empty
//!   `m.mentions`: a hostile tool name or argument shows as text and pings nobody.

use cyrene_protocol::approval::{DECIDED_BY_BRIDGE, DECIDED_BY_DEADLINE, DECIDED_BY_OPERATOR};
pub use cyrene_protocol::approval::{Decision, MAX_REASON_BYTES};
use serde_json::{Map, Value, json};

/// The notice's content field naming the call it asks about (read back from a reply's quoted
/// notice).
pub const CALL_ID_FIELD: &str = "org.cyrene.call_id";
/// The notice's content field naming the session of the call.
pub const SESSION_ID_FIELD: &str = "org.cyrene.session_id";
/// The longest arguments text a notice shows (characters); longer is cut with "…".
const MAX_ARGUMENTS_CHARS: usize = 1500;

/// The owner's decision as written in a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub decision: Decision,
    /// The call: named in the text, or the quoted notice's.
    pub call_id: String,
    /// What follows a denial's call id (or `deny` in a reply), trimmed; `None` when empty.
    pub reason: Option<String>,
}

/// The decision a message states, given the call of the notice it quotes (`quoted`, when it is
/// a Matrix reply to the bridge's notice). `None`: not a decision, an ordinary message.
pub fn parse(text: &str, quoted: Option<&str>) -> Option<Reply> {
    let text = text.trim();
    let (word, rest) = match text.split_once(char::is_whitespace) {
        Some((word, rest)) => (word, rest.trim_start()),
        None => (text, ""),
    };
    let decision = if word.eq_ignore_ascii_case("approve") {
        Decision::Approve
    } else if word.eq_ignore_ascii_case("deny") {
        Decision::Deny
    } else {
        return None;
    };
    let (first, after) = match rest.split_once(char::is_whitespace) {
        Some((first, after)) => (first, after.trim()),
        None => (rest, ""),
    };
    let (call_id, reason) = match quoted {
        // quoting the notice: the call is the notice's; naming it again is allowed
        Some(call) if first == call => (call, after),
        Some(call) => (call, rest.trim()),
        None if first.is_empty() => return None,
        None => (first, after),
    };
    // an approval takes no reason: "approve c1 and more" is not a decision
    if decision == Decision::Approve && !reason.is_empty() {
        return None;
    }
    Some(Reply {
        decision,
        call_id: call_id.to_owned(),
        reason: (!reason.is_empty()).then(|| reason.to_owned()),
    })
}

/// Whether `text` begins with `approve` or `deny` (a cheap look before [`parse`] needs the
/// quoted notice).
pub fn starts_like_a_decision(text: &str) -> bool {
    let word = text.split_whitespace().next().unwrap_or_default();
    word.eq_ignore_ascii_case("approve") || word.eq_ignore_ascii_case("deny")
}

/// The text of the notice asking for a decision.
pub fn request_text(tool: &str, call_id: &str, arguments: &Map<String, Value>) -> String {
    let mut args = serde_json::to_string(arguments).unwrap_or_else(|_| "{}".into());
    if args.chars().count() > MAX_ARGUMENTS_CHARS {
        args = args.chars().take(MAX_ARGUMENTS_CHARS).collect::<String>() + "…";
    }
    format!(
        "Cyrene wants to run {tool} ({call_id}) with {args}. Reply 'approve {call_id}' or \
         'deny {call_id} [reason]'."
    )
}

/// The content of the notice asking for a decision: plain text that mentions nobody, and the
/// call it is about (for a Matrix reply to it).
pub fn request_content(
    session_id: &str,
    tool: &str,
    call_id: &str,
    arguments: &Map<String, Value>,
) -> Value {
    json!({
        "msgtype": "m.notice",
        "body": request_text(tool, call_id, arguments),
        "m.mentions": {},
        CALL_ID_FIELD: call_id,
        SESSION_ID_FIELD: session_id,
    })
}

/// Who decided, as the room reads it (`decided_by` of docs/orchestrator.md, "Approvals").
fn decider(decided_by: &str) -> String {
    match decided_by {
        DECIDED_BY_BRIDGE => "by the owner here".into(),
        DECIDED_BY_OPERATOR => "by the operator".into(),
        DECIDED_BY_DEADLINE => "by itself: nobody decided in time".into(),
        other => match other.strip_prefix("person:") {
            Some(person) => format!("by {person}"),
            None => format!("by {other}"),
        },
    }
}

/// The text of the notice of the decision that holds. The same call gives the same text
/// whichever path posts it (the reply's answer or the `approval_decided` event), so the one
/// transaction id posts it once.
pub fn decision_text(
    decision: Decision,
    call_id: &str,
    decided_by: &str,
    reason: Option<&str>,
) -> String {
    let word = match decision {
        Decision::Approve => "Approved",
        Decision::Deny => "Denied",
    };
    let mut text = format!("{word} {call_id}, {}", decider(decided_by));
    if let Some(reason) = reason.filter(|r| !r.is_empty()) {
        text.push_str(": ");
        text.push_str(reason);
    }
    text.push('.');
    text
}

/// A plain notice that mentions nobody.
pub fn notice(body: &str) -> Value {
    json!({"msgtype": "m.notice", "body": body, "m.mentions": {}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(decision: Decision, call_id: &str, reason: Option<&str>) -> Option<Reply> {
        Some(Reply {
            decision,
            call_id: call_id.to_owned(),
            reason: reason.map(str::to_owned),
        })
    }

    #[test]
    fn the_owners_reply_names_the_call_and_may_give_a_reason() {
        assert_eq!(
            parse("approve call_1", None),
            reply(Decision::Approve, "call_1", None)
        );
        assert_eq!(
            parse("  Approve   call_1 \n", None),
            reply(Decision::Approve, "call_1", None)
        );
        assert_eq!(
            parse("deny call_1", None),
            reply(Decision::Deny, "call_1", None)
        );
        assert_eq!(
            parse("DENY call_1 not to my boss,\n please", None),
            reply(Decision::Deny, "call_1", Some("not to my boss,\n please"))
        );
    }

    #[test]
    fn anything_else_is_an_ordinary_message() {
        for text in [
            "",
            "approve",
            "deny",
            "approved call_1",
            "I approve call_1",
            "please approve call_1",
            "approve call_1 and send it twice",
            "approve of this plan?",
            "denying call_1",
        ] {
            assert_eq!(parse(text, None), None, "{text:?}");
        }
    }

    #[test]
    fn a_reply_to_the_notice_takes_its_call() {
        assert_eq!(
            parse("approve", Some("c1")),
            reply(Decision::Approve, "c1", None)
        );
        assert_eq!(
            parse("approve c1", Some("c1")),
            reply(Decision::Approve, "c1", None)
        );
        assert_eq!(
            parse("deny too risky", Some("c1")),
            reply(Decision::Deny, "c1", Some("too risky"))
        );
        assert_eq!(
            parse("deny c1 too risky", Some("c1")),
            reply(Decision::Deny, "c1", Some("too risky"))
        );
        // naming another call in a reply to this one: not a decision about either
        assert_eq!(parse("approve c2", Some("c1")), None);
        assert_eq!(parse("thanks", Some("c1")), None);
    }

    #[test]
    fn notices_are_plain_text_that_ping_nobody() {
        let args: Map<String, Value> =
            serde_json::from_value(json!({"to": "<img src=x onerror=alert(1)> @room"})).unwrap();
        let content = request_content("alice.mx-1", "send_email", "c1", &args);
        assert_eq!(content["msgtype"], "m.notice");
        assert_eq!(content["m.mentions"], json!({}));
        assert!(content.get("formatted_body").is_none());
        assert_eq!(content[CALL_ID_FIELD], "c1");
        assert_eq!(content[SESSION_ID_FIELD], "alice.mx-1");
        assert_eq!(
            content["body"],
            "Cyrene wants to run send_email (c1) with {\"to\":\"<img src=x onerror=alert(1)> \
             @room\"}. Reply 'approve c1' or 'deny c1 [reason]'."
        );
        let long: Map<String, Value> =
            serde_json::from_value(json!({"text": "x".repeat(5000)})).unwrap();
        assert!(request_text("t", "c", &long).chars().count() < 1700);
    }

    #[test]
    fn the_decision_says_who_made_it() {
        assert_eq!(
            decision_text(Decision::Approve, "c1", "bridge", None),
            "Approved c1, by the owner here."
        );
        assert_eq!(
            decision_text(Decision::Deny, "c1", "person:alice", Some("not now")),
            "Denied c1, by alice: not now."
        );
        assert_eq!(
            decision_text(Decision::Deny, "c1", "deadline", None),
            "Denied c1, by itself: nobody decided in time."
        );
        assert_eq!(
            decision_text(Decision::Approve, "c1", "operator", Some("")),
            "Approved c1, by the operator."
        );
    }
}
