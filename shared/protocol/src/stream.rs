//! The streamed model call (`cyrene.model.complete.stream`, docs/model-gateway.md "Streaming"):
//! the deltas a provider produces while it answers, and the messages the gateway publishes on
//! the caller's inbox.
//!
//! # Invariants
//! - Every message on the inbox is one [`StreamChunk`] with `seq` counting from 0 without gaps;
//!   exactly one of `delta`, `done`, `error` is set, and the last message (`done` or `error`) is
//!   the end marker.
//! - A caller that asked for heartbeats ([`HEARTBEAT_HEADER`]) also gets `heartbeat` chunks (a
//!   `seq` of their own, nothing else set): one whenever the gateway published nothing for the
//!   asked interval while the call runs; a caller that did not ask never gets one.
//! - A caller that names the deltas it wants ([`DELTAS_HEADER`]) gets only those kinds; without
//!   the header it gets every kind. `done` is whole either way.
//! - `done` is the same [`ModelResponse`] the non-streamed call answers: the deltas are a preview
//!   of it, never a second source of truth (concatenating the `text` deltas gives its `content`).

use crate::ErrorBody;

/// The request header a streamed call's caller sets to get heartbeats: the interval in
/// milliseconds (docs/model-gateway.md, "Streaming"). A gateway replica that dies mid-call stops
/// them, so the caller notices a vanished replica within a few intervals instead of waiting for
/// its model timeout.
pub const HEARTBEAT_HEADER: &str = "Cyrene-Stream-Heartbeat";

/// The shortest and longest heartbeat interval a gateway honours (others are clamped).
pub const HEARTBEAT_MIN_MS: u64 = 50;
pub const HEARTBEAT_MAX_MS: u64 = 10_000;

/// The request header a streamed call's caller sets to name the kinds of delta it wants, comma
/// separated: `text`, `reasoning`, `tool_call` (`none` for none). Without it every kind is
/// published. A caller that shows only answer text (the loop worker) spares the bus a message
/// per tool call it would drop (docs/model-gateway.md, "Streaming").
pub const DELTAS_HEADER: &str = "Cyrene-Stream-Deltas";

/// The kinds of [`Delta`] a caller wants ([`DELTAS_HEADER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaKinds {
    pub text: bool,
    pub reasoning: bool,
    pub tool_calls: bool,
}

impl DeltaKinds {
    /// Every kind: what a caller that sends no header gets.
    pub const ALL: DeltaKinds = DeltaKinds {
        text: true,
        reasoning: true,
        tool_calls: true,
    };
    /// Answer text only.
    pub const TEXT: DeltaKinds = DeltaKinds {
        text: true,
        reasoning: false,
        tool_calls: false,
    };
    /// No delta at all: the end marker only.
    pub const NONE: DeltaKinds = DeltaKinds {
        text: false,
        reasoning: false,
        tool_calls: false,
    };

    /// The header's value: the wanted kinds' names, comma separated, or `none`.
    pub fn header_value(&self) -> String {
        if *self == DeltaKinds::NONE {
            return "none".to_owned();
        }
        [
            (self.text, "text"),
            (self.reasoning, "reasoning"),
            (self.tool_calls, "tool_call"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect::<Vec<_>>()
        .join(",")
    }

    /// The kinds a header value names; names it does not know are ignored (a later kind asked
    /// of an older gateway is simply not sent).
    pub fn parse(value: &str) -> DeltaKinds {
        let mut kinds = DeltaKinds::NONE;
        for name in value.split(',').map(str::trim) {
            match name {
                "text" => kinds.text = true,
                "reasoning" => kinds.reasoning = true,
                "tool_call" => kinds.tool_calls = true,
                _ => {}
            }
        }
        kinds
    }

    /// Whether `delta` is of a wanted kind.
    pub fn wants(&self, delta: &Delta) -> bool {
        match delta {
            Delta::Text { .. } => self.text,
            Delta::Reasoning { .. } => self.reasoning,
            Delta::ToolCall { .. } => self.tool_calls,
        }
    }
}
use crate::model::ModelResponse;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// A piece of output, in the order the provider produced it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Delta {
    /// User-visible answer text.
    Text { text: String },
    /// Reasoning ("thinking") text: not user-visible answer text.
    Reasoning { text: String },
    /// Part of tool call number `index` (0-based, in call order): its first delta carries `id`
    /// and `name`, later ones further characters of its JSON arguments.
    ToolCall {
        index: u32,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        id: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        name: String,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        args: String,
    },
}

impl Delta {
    /// Whether the delta carries nothing (never published).
    pub fn is_empty(&self) -> bool {
        match self {
            Delta::Text { text } | Delta::Reasoning { text } => text.is_empty(),
            Delta::ToolCall { id, name, args, .. } => {
                id.is_empty() && name.is_empty() && args.is_empty()
            }
        }
    }
}

/// One message on the caller's inbox.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamChunk {
    /// 0, 1, 2, … per call: a gap means a message was lost (core NATS does not redeliver).
    pub seq: u64,
    pub delta: Option<Delta>,
    /// End marker of a successful call: the whole response.
    pub done: Option<Box<ModelResponse>>,
    /// End marker of a failed call.
    pub error: Option<ErrorBody>,
    /// On the end marker of a call that named a view: the gateway replica now holding it; the
    /// view's next call goes to `cyrene.model.complete.stream.<replica>` (docs/model-gateway.md,
    /// "Held views").
    pub replica: Option<String>,
    /// A heartbeat (only to a caller that asked for them, [`HEARTBEAT_HEADER`]): the call is
    /// still running on a live replica.
    pub heartbeat: Option<bool>,
}

impl StreamChunk {
    pub fn delta(seq: u64, delta: Delta) -> StreamChunk {
        StreamChunk {
            seq,
            delta: Some(delta),
            done: None,
            error: None,
            replica: None,
            heartbeat: None,
        }
    }

    pub fn done(seq: u64, response: ModelResponse) -> StreamChunk {
        StreamChunk {
            seq,
            delta: None,
            done: Some(Box::new(response)),
            error: None,
            replica: None,
            heartbeat: None,
        }
    }

    pub fn error(seq: u64, error: ErrorBody) -> StreamChunk {
        StreamChunk {
            seq,
            delta: None,
            done: None,
            error: Some(error),
            replica: None,
            heartbeat: None,
        }
    }

    /// A heartbeat, number `seq` of the call's messages.
    pub fn heartbeat(seq: u64) -> StreamChunk {
        StreamChunk {
            seq,
            delta: None,
            done: None,
            error: None,
            replica: None,
            heartbeat: Some(true),
        }
    }

    /// Whether this is the end marker.
    pub fn is_end(&self) -> bool {
        self.done.is_some() || self.error.is_some()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn delta_kinds_go_through_their_header_and_unknown_names_are_ignored() {
        for kinds in [DeltaKinds::ALL, DeltaKinds::TEXT, DeltaKinds::NONE] {
            assert_eq!(DeltaKinds::parse(&kinds.header_value()), kinds);
        }
        assert_eq!(DeltaKinds::ALL.header_value(), "text,reasoning,tool_call");
        assert_eq!(DeltaKinds::NONE.header_value(), "none");
        assert_eq!(DeltaKinds::parse(" text , later_kind"), DeltaKinds::TEXT);
        let call = Delta::ToolCall {
            index: 0,
            id: "c".into(),
            name: "f".into(),
            args: String::new(),
        };
        assert!(!DeltaKinds::TEXT.wants(&call));
        assert!(DeltaKinds::TEXT.wants(&Delta::Text { text: "a".into() }));
        assert!(!DeltaKinds::TEXT.wants(&Delta::Reasoning { text: "r".into() }));
    }

    #[test]
    fn chunks_have_the_documented_shape() {
        let text = StreamChunk::delta(0, Delta::Text { text: "Hel".into() });
        assert_eq!(
            serde_json::to_value(&text).unwrap(),
            json!({"seq":0,"delta":{"type":"text","text":"Hel"}})
        );
        let call = StreamChunk::delta(
            1,
            Delta::ToolCall {
                index: 0,
                id: "c1".into(),
                name: "get_time".into(),
                args: String::new(),
            },
        );
        assert_eq!(
            serde_json::to_value(&call).unwrap(),
            json!({"seq":1,"delta":{"type":"tool_call","index":0,"id":"c1","name":"get_time"}})
        );
        let err = StreamChunk::error(2, ErrorBody::new(crate::ErrorCode::Unavailable, "x"));
        assert!(err.is_end());
        let back: StreamChunk =
            serde_json::from_value(serde_json::to_value(&err).unwrap()).unwrap();
        assert_eq!(back, err);
        assert!(serde_json::from_value::<StreamChunk>(json!({"seq":0,"x":1})).is_err());
        assert_eq!(
            serde_json::to_value(StreamChunk::heartbeat(3)).unwrap(),
            json!({"seq":3,"heartbeat":true})
        );
    }
}
