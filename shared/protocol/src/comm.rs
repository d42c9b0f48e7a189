//! Agent-to-agent comm messages (docs/architecture.md §4, §9; docs/semantics.md#comm).

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A question from one agent to another, answered by one [`Reply`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ask {
    pub id: String,
    pub from: String,
    pub to: String,
    pub question: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub data: Value,
    /// The agents already answering an ask this one serves, outermost first (the asker last
    /// when it is itself answering one). An agent listed here is waiting on this ask: a
    /// responder that finds itself in it refuses the ask at once with `conflict` instead of
    /// waiting on itself (docs/comm.md, "Cycles"). Empty for a top-level ask.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chain: Vec<String>,
}

/// The answer to an [`Ask`]; `from` is the replier, `to` the asker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    pub ask_id: String,
    pub from: String,
    pub to: String,
    pub text: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub data: Value,
}

/// A one-way notification, broadcast or addressed to one agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub from: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub data: Value,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn comm_messages_match_design() {
        let ask = json!({"id":"q1","from":"a","to":"b","question":"?","data":{"k":1}});
        let a: Ask = serde_json::from_value(ask.clone()).unwrap();
        assert_eq!(serde_json::to_value(&a).unwrap(), ask);
        let reply = json!({"ask_id":"q1","from":"b","to":"a","text":"!","data":{"k":2}});
        let r: Reply = serde_json::from_value(reply.clone()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), reply);
        let ev = json!({"from":"a","name":"task.progress","data":{"pct":50}});
        let e: Event = serde_json::from_value(ev.clone()).unwrap();
        assert_eq!(serde_json::to_value(&e).unwrap(), ev);
    }

    #[test]
    fn an_asks_chain_is_optional_and_round_trips() {
        let ask = json!({"id":"q2","from":"b","to":"c","question":"?","chain":["a","b"]});
        let a: Ask = serde_json::from_value(ask.clone()).unwrap();
        assert_eq!(a.chain, ["a", "b"]);
        assert_eq!(serde_json::to_value(&a).unwrap(), ask);
    }

    #[test]
    fn data_is_optional() {
        let a: Ask =
            serde_json::from_str(r#"{"id":"1","from":"a","to":"b","question":"q"}"#).unwrap();
        assert!(a.data.is_null());
        assert!(a.chain.is_empty(), "a top-level ask");
        assert_eq!(
            serde_json::to_value(&a).unwrap(),
            json!({"id":"1","from":"a","to":"b","question":"q"})
        );
    }
}
