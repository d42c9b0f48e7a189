//! The vendor-neutral message vocabulary (docs/architecture.md §2, §9;
//! docs/semantics.md#model-vocabulary).
//!
//! # Invariants
//! - Tool-call `args` are a JSON object, never a JSON-encoded string. A provider reply whose
//!   arguments could not be decoded carries `args: {}` and an `args_error`; the loop answers such a
//!   call with an `is_error` result instead of running the tool.
//! - `content` may arrive as a plain string (one text part); it is always written as a list.
//! - `sender_name` is a *lane*, not an identity: the persona id on assistant messages, a
//!   third-party nickname on user messages in restricted sessions, empty when unlabelled.
//!   `sender_kind` tells the two user lanes apart: a labelled user message is a third-party
//!   *person* unless it is `agent` — an ask from another agent, whose `from` names an agent (and
//!   is unverified), never a person.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use serde_with::skip_serializing_none;

/// Who authored a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

/// The protocol family a reasoning part came from; it is sent back only to that family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningFamily {
    /// OpenAI-compatible `reasoning_content` (DeepSeek and friends).
    Openai,
    /// Anthropic `thinking` / `redacted_thinking` blocks.
    Anthropic,
}

/// Opens every speaker-switch note the loop worker writes (`[发言归属] …`, a system message;
/// docs/loop-worker.md, "Names in system text"). A note holds from where it appears until the
/// next one, so every dialect keeps it in its place in the conversation — never hoisted with
/// the opening system messages (docs/model-gateway.md, "System messages in the Anthropic
/// dialect").
pub const SPEAKER_SWITCH_MARKER: &str = "[发言归属] ";

/// Whether `message` is a system message that must keep its place in the conversation (a
/// speaker-switch note, [`SPEAKER_SWITCH_MARKER`]).
pub fn is_in_place_note(message: &Message) -> bool {
    message.role == Role::System
        && message
            .content
            .iter()
            .any(|p| matches!(p, Part::Text { text } if text.starts_with(SPEAKER_SWITCH_MARKER)))
}

/// One content part of a message.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Part {
    /// Plain text.
    Text { text: String },
    /// An image: a `data:` URI or an http(s) URL.
    ImageUrl { image_url: String },
    /// A call the assistant asked for.
    ToolCall {
        id: String,
        name: String,
        #[serde(default)]
        args: Map<String, Value>,
        /// Set when the provider's arguments were not valid JSON; `args` is then `{}`.
        args_error: Option<String>,
    },
    /// The outcome of a tool call.
    ToolResult {
        tool_call_id: String,
        text: String,
        #[serde(default)]
        is_error: bool,
    },
    /// A server-stored document (user turns only); replaced by text at assembly, never sent to a
    /// provider.
    Document {
        name: String,
        mime: String,
        url: String,
        size: u64,
    },
    /// The provider's reasoning, kept so it can be sent back to the family that produced it.
    Reasoning {
        family: ReasoningFamily,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        text: String,
        /// Anthropic `thinking.signature`.
        signature: Option<String>,
        /// Anthropic `redacted_thinking.data`.
        redacted: Option<String>,
    },
}

impl Part {
    pub fn text(text: impl Into<String>) -> Part {
        Part::Text { text: text.into() }
    }
}

/// A tool call as returned in a model response and carried in a `tool_call` part.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    #[serde(default)]
    pub args: Map<String, Value>,
    pub args_error: Option<String>,
}

impl ToolCall {
    /// The `tool_call` part carrying this call (what an assistant message holds).
    pub fn to_part(&self) -> Part {
        Part::ToolCall {
            id: self.id.clone(),
            name: self.name.clone(),
            args: self.args.clone(),
            args_error: self.args_error.clone(),
        }
    }
}

/// What a labelled user message's `sender_name` names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SenderKind {
    /// A person: on a user message in a restricted session, a third party (not the owner).
    #[default]
    Person,
    /// Another agent asking over the comm protocol; set only by the orchestrator's ask path.
    Agent,
}

impl SenderKind {
    /// Whether this is the default lane (not written on the wire).
    pub fn is_person(&self) -> bool {
        *self == SenderKind::Person
    }
}

/// One conversation turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    #[serde(deserialize_with = "content_from_string_or_list")]
    pub content: Vec<Part>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sender_name: String,
    /// The lane of a user message's `sender_name`: a person (default, not written) or an agent.
    #[serde(default, skip_serializing_if = "SenderKind::is_person")]
    pub sender_kind: SenderKind,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tool_call_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub tool_call_name: String,
}

impl Message {
    /// A message of one text part.
    pub fn text(role: Role, text: impl Into<String>) -> Message {
        Message::with_parts(role, vec![Part::text(text)])
    }

    /// A message with an optional text part followed by one image.
    pub fn image(role: Role, text: impl Into<String>, image_url: impl Into<String>) -> Message {
        let text = text.into();
        let mut parts = Vec::with_capacity(2);
        if !text.is_empty() {
            parts.push(Part::Text { text });
        }
        parts.push(Part::ImageUrl {
            image_url: image_url.into(),
        });
        Message::with_parts(role, parts)
    }

    /// A tool turn answering `tool_call_id`.
    pub fn tool_result(
        tool_call_id: impl Into<String>,
        tool_call_name: impl Into<String>,
        text: impl Into<String>,
        is_error: bool,
    ) -> Message {
        let id = tool_call_id.into();
        Message {
            role: Role::Tool,
            content: vec![Part::ToolResult {
                tool_call_id: id.clone(),
                text: text.into(),
                is_error,
            }],
            sender_name: String::new(),
            sender_kind: SenderKind::Person,
            tool_call_id: id,
            tool_call_name: tool_call_name.into(),
        }
    }

    /// An assistant turn declaring the calls it made, so the following tool turns correlate.
    pub fn assistant_tool_calls(calls: &[ToolCall]) -> Message {
        let parts = calls.iter().map(ToolCall::to_part).collect();
        Message::with_parts(Role::Assistant, parts)
    }

    pub fn with_parts(role: Role, content: Vec<Part>) -> Message {
        Message {
            role,
            content,
            sender_name: String::new(),
            sender_kind: SenderKind::Person,
            tool_call_id: String::new(),
            tool_call_name: String::new(),
        }
    }

    /// Sets the sender lane (persona id or third-party nickname).
    pub fn sender(mut self, name: impl Into<String>) -> Message {
        self.sender_name = name.into();
        self
    }

    /// Labels a user message as asked by agent `name` (the agent lane, not a person).
    pub fn from_agent(mut self, name: impl Into<String>) -> Message {
        self.sender_name = name.into();
        self.sender_kind = SenderKind::Agent;
        self
    }

    /// The concatenated text parts.
    pub fn text_content(&self) -> String {
        let mut out = String::new();
        for part in &self.content {
            if let Part::Text { text } = part {
                out.push_str(text);
            }
        }
        out
    }

    /// Whether any part is an image.
    pub fn has_image(&self) -> bool {
        self.content
            .iter()
            .any(|p| matches!(p, Part::ImageUrl { .. }))
    }
}

fn content_from_string_or_list<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Part>, D::Error> {
    // A visitor, not an untagged enum (that would hide the inner error of a bad part) nor a
    // detour through `Value` (a map per message, on every view of every step).
    struct Content;

    impl Content {
        fn refuse<E: serde::de::Error>(kind: &str) -> Result<Vec<Part>, E> {
            Err(E::custom(format!(
                "content must be a string or a list of parts, not {kind}"
            )))
        }
    }

    impl<'de> serde::de::Visitor<'de> for Content {
        type Value = Vec<Part>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a string or a list of parts")
        }

        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Vec<Part>, E> {
            Ok(vec![Part::text(s)])
        }

        fn visit_string<E: serde::de::Error>(self, s: String) -> Result<Vec<Part>, E> {
            Ok(vec![Part::Text { text: s }])
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Vec<Part>, A::Error> {
            let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(1).min(64));
            while let Some(part) = seq.next_element::<Part>()? {
                parts.push(part);
            }
            Ok(parts)
        }

        fn visit_unit<E: serde::de::Error>(self) -> Result<Vec<Part>, E> {
            Self::refuse("null")
        }

        fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Vec<Part>, E> {
            Self::refuse("a boolean")
        }

        fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Vec<Part>, E> {
            Self::refuse("a number")
        }

        fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Vec<Part>, E> {
            Self::refuse("a number")
        }

        fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Vec<Part>, E> {
            Self::refuse("a number")
        }

        fn visit_map<A: serde::de::MapAccess<'de>>(self, _: A) -> Result<Vec<Part>, A::Error> {
            Self::refuse("an object")
        }
    }

    d.deserialize_any(Content)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn round_trip<T>(value: &T, expected: Value)
    where
        T: Serialize + for<'de> Deserialize<'de> + PartialEq + std::fmt::Debug,
    {
        assert_eq!(serde_json::to_value(value).unwrap(), expected);
        let back: T = serde_json::from_value(expected).unwrap();
        assert_eq!(&back, value);
    }

    #[test]
    fn user_message_with_sender_matches_design() {
        let m = Message::text(Role::User, "hi").sender("阿明");
        round_trip(
            &m,
            json!({"role":"user","content":[{"type":"text","text":"hi"}],"sender_name":"阿明"}),
        );
    }

    #[test]
    fn an_agent_asker_is_its_own_lane_on_the_wire() {
        let m = Message::text(Role::User, "hi").from_agent("hoshi");
        round_trip(
            &m,
            json!({"role":"user","content":[{"type":"text","text":"hi"}],"sender_name":"hoshi","sender_kind":"agent"}),
        );
    }

    #[test]
    fn plain_string_content_is_one_text_part() {
        let m: Message = serde_json::from_str(r#"{"role":"user","content":"hello"}"#).unwrap();
        assert_eq!(m, Message::text(Role::User, "hello"));
        let out = serde_json::to_value(&m).unwrap();
        assert_eq!(out["content"], json!([{"type":"text","text":"hello"}]));
    }

    #[test]
    fn every_part_matches_design() {
        round_trip(&Part::text("…"), json!({"type":"text","text":"…"}));
        round_trip(
            &Part::ImageUrl {
                image_url: "data:image/png;base64,AAAA".into(),
            },
            json!({"type":"image_url","image_url":"data:image/png;base64,AAAA"}),
        );
        let mut args = Map::new();
        args.insert("tz".into(), json!("UTC"));
        round_trip(
            &Part::ToolCall {
                id: "call_1".into(),
                name: "get_time".into(),
                args,
                args_error: None,
            },
            json!({"type":"tool_call","id":"call_1","name":"get_time","args":{"tz":"UTC"}}),
        );
        round_trip(
            &Part::ToolCall {
                id: "c".into(),
                name: "n".into(),
                args: Map::new(),
                args_error: Some("expected value at line 1".into()),
            },
            json!({"type":"tool_call","id":"c","name":"n","args":{},
                   "args_error":"expected value at line 1"}),
        );
        round_trip(
            &Part::ToolResult {
                tool_call_id: "call_1".into(),
                text: "…".into(),
                is_error: false,
            },
            json!({"type":"tool_result","tool_call_id":"call_1","text":"…","is_error":false}),
        );
        round_trip(
            &Part::Document {
                name: "d-01J".into(),
                mime: "application/pdf".into(),
                url: "cyrene-doc://d-01J".into(),
                size: 1234,
            },
            json!({"type":"document","name":"d-01J","mime":"application/pdf",
                   "url":"cyrene-doc://d-01J","size":1234}),
        );
        round_trip(
            &Part::Reasoning {
                family: ReasoningFamily::Anthropic,
                text: "hmm".into(),
                signature: Some("sig".into()),
                redacted: None,
            },
            json!({"type":"reasoning","family":"anthropic","text":"hmm","signature":"sig"}),
        );
    }

    #[test]
    fn tool_turn_matches_design() {
        let m = Message::tool_result("call_1", "get_time", "12:00", false);
        round_trip(
            &m,
            json!({"role":"tool","tool_call_id":"call_1","tool_call_name":"get_time",
                   "content":[{"type":"tool_result","tool_call_id":"call_1","text":"12:00",
                               "is_error":false}]}),
        );
    }

    #[test]
    fn args_as_a_string_is_refused() {
        let err = serde_json::from_value::<Part>(
            json!({"type":"tool_call","id":"c","name":"n","args":"{\"a\":1}"}),
        );
        assert!(err.is_err());
    }

    #[test]
    fn wrong_content_types_are_refused_with_a_reason() {
        for (content, kind) in [
            ("7", "a number"),
            ("null", "null"),
            ("true", "a boolean"),
            (r#"{"type":"text","text":"x"}"#, "an object"),
        ] {
            let doc = format!(r#"{{"role":"user","content":{content}}}"#);
            let err = serde_json::from_str::<Message>(&doc).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "content must be a string or a list of parts, not {kind}"
                )),
                "{err}"
            );
        }
        // A bad part keeps its own reason.
        let err = serde_json::from_str::<Message>(
            r#"{"role":"user","content":[{"type":"text","text":1}]}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("invalid type"), "{err}");
        assert!(serde_json::from_str::<Message>(r#"{"role":"boss","content":"x"}"#).is_err());
        assert!(
            serde_json::from_str::<Message>(r#"{"role":"user","content":[{"type":"video"}]}"#)
                .is_err()
        );
    }

    #[test]
    fn constructors_build_the_documented_parts() {
        let img = Message::image(Role::User, "", "https://x/y.png");
        assert_eq!(img.content.len(), 1);
        assert!(img.has_image());
        let call = ToolCall {
            id: "1".into(),
            name: "t".into(),
            args: Map::new(),
            args_error: None,
        };
        let m = Message::assistant_tool_calls(&[call]);
        assert!(matches!(&m.content[0], Part::ToolCall { id, .. } if id == "1"));
        assert_eq!(Message::text(Role::User, "a").text_content(), "a");
    }
}
