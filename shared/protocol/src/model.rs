//! `cyrene.model.complete` request/response and the `cyrene.model.calls` record
//! (docs/architecture.md §2, §9).

use crate::message::{Message, Role, ToolCall};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_with::skip_serializing_none;

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// JSON schema of the args object.
    #[serde(default = "empty_object")]
    pub parameters: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// Reasoning knobs. Absent = do not interfere (DeepSeek thinks by default).
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Thinking {
    /// The thinking budget (a target, not a hard cap); absent or 0 = the provider's default.
    pub budget_tokens: Option<u32>,
    /// An explicit on/off switch; absent = no explicit switch.
    pub enable: Option<bool>,
}

impl Thinking {
    /// The budget the caller asked for: `None` when absent **or 0**, which both mean "the
    /// provider's default" (docs/semantics.md#model-vocabulary).
    pub fn budget(&self) -> Option<u32> {
        self.budget_tokens.filter(|b| *b > 0)
    }
}

/// A completion request. No top_p and no penalties on purpose (docs/semantics.md#model-vocabulary:
/// they are silently ignored or become hard floors on one side of the thinking switch).
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRequest {
    pub messages: Vec<Message>,
    /// Explicit model override; empty = routed.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
    pub temperature: Option<f64>,
    pub max_tokens: Option<u32>,
    /// Accounting tag.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub purpose: String,
    /// Routing key for persona chains; empty = the active group's default chain.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persona_id: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<ToolSpec>,
    /// Opaque, passed through.
    pub tool_choice: Option<Value>,
    pub thinking: Option<Thinking>,
    /// Matched against the provider's declared whitelist exactly as given; empty = do not
    /// interfere.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reasoning_effort: String,
    /// Bounds **one** HTTP call to a provider (docs/semantics.md#model-vocabulary); absent or 0 =
    /// the provider's own `timeout_ms`. Each fallback attempt gets its own.
    pub timeout_ms: Option<u64>,
    /// Bounds the whole request, every fallback attempt included (the caller's deadline); absent
    /// or 0 = the gateway's `default_timeout_ms`.
    pub total_timeout_ms: Option<u64>,
    /// The view this request continues, held by one gateway replica between calls: streamed
    /// calls only (docs/model-gateway.md, "Held views").
    pub view: Option<ViewRef>,
    /// Set by the gateway replica that resolved [`ModelRequest::view`], never sent nor read from
    /// the wire.
    #[serde(skip)]
    pub held: HeldPrefix,
}

/// Which of a request's messages a provider may have seen before, unchanged and in the same
/// order: its first `base` messages, with which every later call of the same `lineage` begins.
///
/// A held view only grows at its end between calls, and a view sent whole starts a new lineage,
/// so whatever a provider derived from a lineage's first `n` messages on one call holds for the
/// first `n` messages of each later call with `base ≥ n`. The scripted provider keeps its word
/// count and conversation digest this way (docs/model-gateway.md, "Held views").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HeldPrefix {
    /// The replica's number for the view since it was last sent whole; 0: the request names no
    /// view.
    pub lineage: u64,
    /// How many of the request's messages the replica held before this call.
    pub base: usize,
}

/// A view the gateway holds between the steps of a turn, so a step sends only what it added.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ViewRef {
    /// The caller's name for the view: unguessable (the loop worker's are new UUIDv7 ids, 74
    /// random bits), 8 to 64 of `A-Z a-z 0-9 _ -`.
    pub id: String,
    /// How many messages of the view the gateway holds and `messages` follow; 0: `messages` is
    /// the whole view (and replaces whatever was held under `id`).
    #[serde(default)]
    pub base: u32,
}

impl ViewRef {
    /// Whether `id` is a view id the gateway accepts.
    pub fn valid_id(id: &str) -> bool {
        (8..=64).contains(&id.len()) && id.chars().all(crate::ids::is_token_char)
    }
}

/// A normalised completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelResponse {
    pub model: String,
    #[serde(default)]
    pub content: String,
    pub message: Message,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// The provider's raw stop reason (`stop`, `length`, `tool_calls`, `end_turn`, …).
    #[serde(default)]
    pub stop_reason: String,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub total_tokens: u64,
    #[serde(default)]
    pub cache_hit_tokens: u64,
    #[serde(default)]
    pub cache_miss_tokens: u64,
    #[serde(default)]
    pub reasoning_tokens: u64,
    /// The provider (config key) that served the call.
    #[serde(default)]
    pub provider: String,
    /// True when an offline (scripted) provider answered: never a real model.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub offline: bool,
}

impl ModelResponse {
    /// A finished plain-text answer (`stop`, no tool calls, no usage) of an offline stand-in
    /// model `model` served as `provider`: what a test's scripted model answers.
    pub fn offline_text(model: &str, provider: &str, text: &str) -> ModelResponse {
        ModelResponse {
            model: model.to_owned(),
            content: text.to_owned(),
            message: Message::text(Role::Assistant, text),
            tool_calls: Vec::new(),
            stop_reason: "stop".to_owned(),
            prompt_tokens: 0,
            completion_tokens: 0,
            total_tokens: 0,
            cache_hit_tokens: 0,
            cache_miss_tokens: 0,
            reasoning_tokens: 0,
            provider: provider.to_owned(),
            offline: true,
        }
    }

    /// hit / (hit + miss); 0 when nothing was reported.
    pub fn cache_hit_rate(&self) -> f64 {
        let total = self.cache_hit_tokens + self.cache_miss_tokens;
        if total == 0 {
            0.0
        } else {
            self.cache_hit_tokens as f64 / total as f64
        }
    }
}

/// `cyrene.model.route` request: which chain would serve a text request of this persona (or
/// this explicit model).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persona_id: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub model: String,
}

/// One step of a chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteStep {
    pub provider: String,
    pub model: String,
    /// The model accepts image parts.
    #[serde(default)]
    pub vision: bool,
}

/// `cyrene.model.route` reply: the chain in order; its first step is the main model.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RouteResponse {
    #[serde(default)]
    pub steps: Vec<RouteStep>,
}

impl RouteResponse {
    /// Whether the main model (the chain's first step) takes images itself.
    pub fn main_has_vision(&self) -> bool {
        self.steps.first().is_some_and(|s| s.vision)
    }
}

/// Published on `cyrene.model.calls` for every successful call; failed attempts publish none.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    pub model: String,
    #[serde(default)]
    pub purpose: String,
    pub tokens: u64,
    pub took_ms: u64,
    #[serde(default)]
    pub provider: String,
    /// Prompt tokens the provider served from its prompt cache ([`ModelResponse::cache_hit_tokens`]:
    /// OpenAI's `prompt_tokens_details.cached_tokens`, DeepSeek's `prompt_cache_hit_tokens`,
    /// Anthropic's `cache_read_input_tokens`); 0 when the provider reports none.
    #[serde(default)]
    pub cache_hit_tokens: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;
    use serde_json::json;

    #[test]
    fn request_matches_design() {
        let doc = json!({"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "model":"m","temperature":0.3,"max_tokens":512,"purpose":"chat","persona_id":"cyrene",
            "tools":[{"name":"get_time","description":"now","parameters":{"type":"object"}}],
            "tool_choice":{"type":"auto"},"thinking":{"budget_tokens":1024,"enable":true},
            "reasoning_effort":"high","timeout_ms":30000,"total_timeout_ms":90000});
        let req: ModelRequest = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(req.max_tokens, Some(512));
        assert_eq!(req.thinking.as_ref().and_then(|t| t.enable), Some(true));
        assert_eq!(req.total_timeout_ms, Some(90000));
        assert_eq!(serde_json::to_value(&req).unwrap(), doc);
    }

    #[test]
    fn a_zero_thinking_budget_means_the_provider_default() {
        let t = |budget_tokens| Thinking {
            budget_tokens,
            enable: Some(true),
        };
        assert_eq!(t(Some(0)).budget(), None);
        assert_eq!(t(None).budget(), None);
        assert_eq!(t(Some(2048)).budget(), Some(2048));
    }

    #[test]
    fn minimal_request_omits_empty_fields() {
        let req = ModelRequest {
            messages: vec![Message::text(Role::User, "hi")],
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            json!({"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]})
        );
    }

    /// What a gateway replica tells its providers about a held view is never taken from a
    /// caller, nor sent.
    #[test]
    fn the_held_prefix_is_neither_read_nor_written() {
        let err = serde_json::from_value::<ModelRequest>(
            json!({"messages":[],"held":{"lineage":7,"base":3}}),
        );
        assert!(err.unwrap_err().to_string().contains("held"));
        let req = ModelRequest {
            held: HeldPrefix {
                lineage: 7,
                base: 3,
            },
            ..Default::default()
        };
        assert_eq!(serde_json::to_value(&req).unwrap(), json!({"messages":[]}));
    }

    #[test]
    fn request_refuses_unknown_fields() {
        let err = serde_json::from_value::<ModelRequest>(json!({"messages":[],"top_p":0.9}));
        assert!(err.unwrap_err().to_string().contains("top_p"));
    }

    #[test]
    fn response_matches_design() {
        let doc = json!({"model":"m","content":"","message":{"role":"assistant","content":[
                {"type":"tool_call","id":"call_1","name":"get_time","args":{}}]},
            "tool_calls":[{"id":"call_1","name":"get_time","args":{}}],
            "stop_reason":"tool_calls","prompt_tokens":10,"completion_tokens":5,"total_tokens":15,
            "cache_hit_tokens":0,"cache_miss_tokens":10,"reasoning_tokens":0,"provider":"primary"});
        let resp: ModelResponse = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(resp.tool_calls.len(), 1);
        assert!(!resp.offline);
        assert_eq!(serde_json::to_value(&resp).unwrap(), doc);
        assert_eq!(resp.cache_hit_rate(), 0.0);
    }

    #[test]
    fn cache_hit_rate_is_hits_over_inputs() {
        let mut resp: ModelResponse = serde_json::from_value(json!({"model":"m",
            "message":{"role":"assistant","content":"x"}}))
        .unwrap();
        resp.cache_hit_tokens = 30;
        resp.cache_miss_tokens = 10;
        assert!((resp.cache_hit_rate() - 0.75).abs() < 1e-9);
    }

    #[test]
    fn route_shapes_round_trip() {
        let req: RouteRequest = serde_json::from_value(json!({"persona_id":"hoshi"})).unwrap();
        assert_eq!(
            serde_json::to_value(&req).unwrap(),
            json!({"persona_id":"hoshi"})
        );
        let doc = json!({"steps":[{"provider":"primary","model":"deepseek-chat","vision":false},
            {"provider":"claude","model":"claude-sonnet-4-5","vision":true}]});
        let resp: RouteResponse = serde_json::from_value(doc.clone()).unwrap();
        assert!(!resp.main_has_vision());
        assert_eq!(serde_json::to_value(&resp).unwrap(), doc);
        assert!(!RouteResponse::default().main_has_vision());
    }

    #[test]
    fn call_record_matches_design() {
        let doc = json!({"model":"m","purpose":"chat","tokens":15,"took_ms":12,"provider":"primary",
            "cache_hit_tokens":8});
        let rec: CallRecord = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(serde_json::to_value(&rec).unwrap(), doc);
        // a record from before cache hits were carried reads as none
        let old = json!({"model":"m","tokens":15,"took_ms":12});
        let rec: CallRecord = serde_json::from_value(old).unwrap();
        assert_eq!(rec.cache_hit_tokens, 0);
    }
}
