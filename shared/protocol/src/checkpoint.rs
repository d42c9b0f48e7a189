//! `cyrene.checkpoint.*` shapes (DESIGN §3, §5, §9; seed 003).
//!
//! The owner key (`agent_id`) is the session id for a single leg and `{session}#{leg}` for a true
//! parallel leg, so two legs never see each other's rows. The row id is `{owner}:{step}`.

use crate::ids::{self, IdError, IdKind};
use crate::message::Message;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One per-step snapshot as saved and returned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub id: String,
    pub agent_id: String,
    pub step: u32,
    /// A JSON object; see [`CheckpointState`] for what the loop worker puts there.
    pub state: Map<String, Value>,
    /// Fencing: the turn that wrote it …
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    /// … and that turn's delivery attempt; older attempts are refused once a newer one wrote.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// RFC 3339, set by the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<String>,
}

/// What the loop worker saves after every step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    pub step: u32,
    pub messages: Vec<Message>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stop_reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub turn_id: String,
}

/// `cyrene.checkpoint.latest` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestRequest {
    pub agent_id: String,
}

/// `cyrene.checkpoint.get` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetRequest {
    pub id: String,
}

/// `cyrene.checkpoint.list` request (newest step first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    pub agent_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// The owner key for a session and an optional parallel leg.
pub fn owner_key(session_id: &str, leg_id: Option<&str>) -> String {
    match leg_id {
        Some(leg) if !leg.is_empty() => format!("{session_id}#{leg}"),
        _ => session_id.to_owned(),
    }
}

/// The row id of an owner's step.
pub fn checkpoint_id(owner: &str, step: u32) -> String {
    format!("{owner}:{step}")
}

/// Validates an owner key: `session` or `session#leg`, each part a valid id.
pub fn validate_owner(owner: &str) -> Result<(), IdError> {
    match owner.split_once('#') {
        Some((session, leg)) => {
            ids::validate(IdKind::Session, session)?;
            ids::validate(IdKind::Leg, leg)
        }
        None => ids::validate(IdKind::Session, owner),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;
    use serde_json::json;

    #[test]
    fn save_body_matches_design() {
        let state = CheckpointState {
            step: 3,
            messages: vec![Message::text(Role::User, "hi")],
            stop_reason: "tool_calls".into(),
            turn_id: "t1".into(),
        };
        let Value::Object(state) = serde_json::to_value(&state).unwrap() else {
            panic!()
        };
        let cp = Checkpoint {
            id: checkpoint_id("s1", 3),
            agent_id: "s1".into(),
            step: 3,
            state,
            turn_id: None,
            attempt: None,
            created_at: None,
            updated_at: None,
        };
        let doc = json!({"id":"s1:3","agent_id":"s1","step":3,"state":{"step":3,"messages":[
            {"role":"user","content":[{"type":"text","text":"hi"}]}],"stop_reason":"tool_calls",
            "turn_id":"t1"}});
        assert_eq!(serde_json::to_value(&cp).unwrap(), doc);
        assert_eq!(serde_json::from_value::<Checkpoint>(doc).unwrap(), cp);
    }

    #[test]
    fn state_must_be_an_object() {
        let err = serde_json::from_value::<Checkpoint>(
            json!({"id":"s1:1","agent_id":"s1","step":1,"state":[1]}),
        );
        assert!(err.is_err());
    }

    #[test]
    fn requests_match_design() {
        let l: LatestRequest = serde_json::from_value(json!({"agent_id":"s1"})).unwrap();
        assert_eq!(serde_json::to_value(&l).unwrap(), json!({"agent_id":"s1"}));
        let g: GetRequest = serde_json::from_value(json!({"id":"s1:3"})).unwrap();
        assert_eq!(serde_json::to_value(&g).unwrap(), json!({"id":"s1:3"}));
        let doc = json!({"agent_id":"s1","limit":50});
        let li: ListRequest = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(serde_json::to_value(&li).unwrap(), doc);
    }

    #[test]
    fn owner_keys_separate_legs() {
        assert_eq!(owner_key("s1", None), "s1");
        assert_eq!(owner_key("s1", Some("leg2")), "s1#leg2");
        assert!(validate_owner("s1#leg2").is_ok());
        assert!(validate_owner("s1").is_ok());
        assert!(validate_owner("s1#").is_err());
        assert!(validate_owner("s.1").is_err());
        assert!(validate_owner("s1#a#b").is_err());
    }
}
