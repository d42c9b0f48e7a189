//! The OpenAI-compatible dialect: `POST {base_url}/chat/completions` (OpenAI, DeepSeek,
//! DashScope/Bailian, vLLM, Ollama, local proxies), translated natively both ways.
//!
//! Choices made here (documented in `docs/model-gateway.md`):
//! - A message without images is sent with `content` as one string (text parts joined by a
//!   newline): DeepSeek and several local servers reject the list form.
//! - Tool results have no error flag in this dialect: an `is_error` result is sent as a plain
//!   `role:"tool"` message with its text unchanged (no prefix is invented).
//! - `reasoning_content` parts (family `openai`) are sent back on assistant messages (DeepSeek
//!   rejects a tool-call turn without them); Anthropic reasoning is dropped here.
//! - `function.arguments` is a JSON *string*: `""` decodes to `{}`; invalid JSON (or JSON that is
//!   not an object) gives `args: {}` plus `args_error`.
//! - Thinking: DeepSeek `{"thinking":{"type":"enabled"|"disabled"}}` (a budget: WARN, not sent);
//!   DashScope `enable_thinking` / `thinking_budget` (a budget of 0 = the provider's default:
//!   not sent); other vendors have no switch (WARN, not sent).
//! - `reasoning_effort` is checked, exactly as given, against the vendor's documented whitelist
//!   (OpenAI, DeepSeek after its aliases) or the configured `reasoning_efforts`; a vendor with
//!   neither gets the value unchecked, with a WARN.
//! - `max_tokens` is sent as `max_completion_tokens` to OpenAI itself (its reasoning models
//!   refuse `max_tokens`), as `max_tokens` elsewhere.

use super::{
    Decode, DeltaSink, HttpDialect, ProviderError, StreamEvents, Upstream, event_json,
    model_named_or, normalise_effort, reply_model, strings, tool_choice_forces, tool_spec,
    upstream_message,
};
use crate::config::{ProviderConfig, Vendor};
use cyrene_protocol::message::{Message, Part, ReasoningFamily, Role, ToolCall};
use cyrene_protocol::model::{ModelRequest, ModelResponse, Thinking};
use cyrene_protocol::stream::Delta;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// A provider speaking `/chat/completions`.
#[derive(Debug)]
pub struct OpenAiProvider {
    upstream: Upstream,
    vendor: Vendor,
    /// The declared `reasoning_effort` whitelist; `None` = none declared (sent unchecked).
    efforts: Option<Vec<String>>,
}

/// The documented `reasoning_effort` values per vendor (after DeepSeek alias normalisation);
/// `None` for vendors that document none: their effort is sent unchecked, with a WARN, rather
/// than checked against a guessed list.
pub fn default_efforts(vendor: Vendor) -> Option<Vec<String>> {
    match vendor {
        Vendor::Openai => Some(strings(&[
            "none", "minimal", "low", "medium", "high", "xhigh",
        ])),
        Vendor::Deepseek => Some(strings(&["low", "high", "max"])),
        Vendor::Dashscope | Vendor::Generic => None,
    }
}

impl OpenAiProvider {
    pub fn new(
        name: &str,
        config: &ProviderConfig,
        api_key: Option<String>,
        http: reqwest::Client,
    ) -> OpenAiProvider {
        let vendor = config.vendor();
        OpenAiProvider {
            upstream: Upstream::new(name, config, "/chat/completions", api_key, http),
            vendor,
            efforts: config
                .reasoning_efforts
                .clone()
                .or_else(|| default_efforts(vendor)),
        }
    }

    fn encode_thinking(&self, req: &ModelRequest, body: &mut Map<String, Value>) {
        let thinking = req.thinking.as_ref();
        match self.vendor {
            Vendor::Deepseek => {
                if let Some(enable) = thinking.and_then(|t| t.enable) {
                    let kind = if enable { "enabled" } else { "disabled" };
                    body.insert("thinking".into(), json!({"type": kind}));
                }
                if thinking.and_then(Thinking::budget).is_some() {
                    tracing::warn!(
                        provider = %self.upstream.name,
                        "DeepSeek has no thinking budget; budget_tokens not sent"
                    );
                }
                // Thinking is on unless explicitly disabled; forcing a tool then is a 400.
                let thinking_on = thinking.and_then(|t| t.enable) != Some(false);
                if thinking_on && req.tool_choice.as_ref().is_some_and(tool_choice_forces) {
                    tracing::warn!(
                        provider = %self.upstream.name,
                        "forced tool_choice with DeepSeek thinking on is refused upstream; \
                         disable thinking explicitly (not changed here)"
                    );
                }
            }
            Vendor::Dashscope => {
                if let Some(enable) = thinking.and_then(|t| t.enable) {
                    body.insert("enable_thinking".into(), json!(enable));
                }
                // 0 = the provider's default budget: not sent (docs/semantics.md#model-vocabulary).
                if let Some(budget) = thinking.and_then(Thinking::budget) {
                    body.insert("thinking_budget".into(), json!(budget));
                }
            }
            Vendor::Openai | Vendor::Generic => {
                if thinking.is_some() {
                    tracing::warn!(
                        provider = %self.upstream.name,
                        "this provider has no thinking switch; thinking not sent \
                         (use reasoning_effort)"
                    );
                }
            }
        }
    }
}

impl HttpDialect for OpenAiProvider {
    type Events = StreamAccumulator;

    /// The request body for `model`.
    fn encode(&self, req: &ModelRequest, model: &str) -> Result<Value, ProviderError> {
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        body.insert(
            "messages".into(),
            Value::Array(encode_messages(&req.messages)?),
        );
        if let Some(t) = req.temperature {
            body.insert("temperature".into(), json!(t));
        }
        // 0 is "the provider's default" (docs/semantics.md#model-vocabulary): not sent.
        if let Some(max) = req.max_tokens.filter(|&m| m > 0) {
            let key = if self.vendor == Vendor::Openai {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            body.insert(key.into(), json!(max));
        }
        if !req.tools.is_empty() {
            let tools = req
                .tools
                .iter()
                .map(|t| json!({"type": "function", "function": tool_spec(t, "parameters")}))
                .collect();
            body.insert("tools".into(), Value::Array(tools));
        }
        if let Some(choice) = &req.tool_choice {
            body.insert("tool_choice".into(), tool_choice(choice));
        }
        self.encode_thinking(req, &mut body);
        if let Some(effort) = normalise_effort(
            &req.reasoning_effort,
            self.efforts.as_deref(),
            self.vendor == Vendor::Deepseek,
            &self.upstream.name,
        ) {
            body.insert("reasoning_effort".into(), json!(effort));
        }
        Ok(Value::Object(body))
    }

    /// `"stream": true` with `stream_options.include_usage`, so the last event carries the usage
    /// the non-streamed reply has; the events are put back together into that reply's shape and
    /// decoded by the same [`decode`].
    fn ask_for_stream(&self, body: &mut Map<String, Value>) {
        body.insert("stream".into(), json!(true));
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }

    fn post(&self) -> reqwest::RequestBuilder {
        let http = self.upstream.post();
        match &self.upstream.api_key {
            Some(key) => http.bearer_auth(key),
            None => http,
        }
    }

    const DECODE: Decode = decode;

    fn decode_usual(body: &[u8], model: &str) -> Option<ModelResponse> {
        decode_usual(body, model)
    }
}

/// The parts of a streamed `/chat/completions` reply seen so far (first choice only).
#[derive(Debug, Default)]
pub(crate) struct StreamAccumulator {
    model: String,
    text: String,
    reasoning: String,
    /// By the provider's tool-call index: id, name, argument characters.
    calls: BTreeMap<u64, (String, String, String)>,
    finish_reason: Option<String>,
    usage: Option<Value>,
    done: bool,
}

impl StreamEvents for StreamAccumulator {
    /// `true` at `[DONE]`.
    fn take(&mut self, data: &str, sink: &DeltaSink) -> Result<bool, ProviderError> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(true);
        }
        self.feed(&event_json(data)?, sink)?;
        Ok(false)
    }

    /// The non-streamed reply these events add up to, decoded.
    fn finish(self, model: &str) -> Result<ModelResponse, ProviderError> {
        if !self.done && self.finish_reason.is_none() {
            return Err(ProviderError::stream_ended(
                "the event stream ended before the reply did (no finish_reason, no [DONE])",
            ));
        }
        let calls: Vec<Value> = self
            .calls
            .into_values()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function",
                       "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        let mut message = json!({"role": "assistant", "content": self.text});
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = json!(self.reasoning);
        }
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        let reply = json!({
            "model": self.model,
            "choices": [{"message": message, "finish_reason": self.finish_reason}],
            "usage": self.usage.unwrap_or(Value::Null),
        });
        decode(&reply, model)
    }
}

impl StreamAccumulator {
    fn feed(&mut self, v: &Value, sink: &DeltaSink) -> Result<(), ProviderError> {
        if let Some(error) = v.get("error") {
            let body = serde_json::to_vec(&json!({ "error": error })).unwrap_or_default();
            return Err(ProviderError::bad_response(format!(
                "the provider reported an error mid-stream: {}",
                upstream_message(&body)
            )));
        }
        if self.model.is_empty()
            && let Some(m) = v.get("model").and_then(Value::as_str)
        {
            self.model = m.to_owned();
        }
        if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(usage.clone());
        }
        let Some(choice) = v.get("choices").and_then(Value::as_array).and_then(|c| {
            c.iter()
                .find(|c| c.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
        }) else {
            return Ok(());
        };
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
        let delta = choice.get("delta").unwrap_or(&Value::Null);
        if let Some(r) = delta
            .get("reasoning_content")
            .or_else(|| delta.get("reasoning"))
            .and_then(Value::as_str)
        {
            self.reasoning.push_str(r);
            sink.send(Delta::Reasoning { text: r.to_owned() });
        }
        match delta.get("content") {
            Some(Value::String(t)) => {
                self.text.push_str(t);
                sink.send(Delta::Text { text: t.clone() });
            }
            Some(Value::Array(parts)) => {
                for t in parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                {
                    self.text.push_str(t);
                    sink.send(Delta::Text { text: t.to_owned() });
                }
            }
            _ => {}
        }
        for call in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            let next = self.calls.len() as u64;
            let index = call.get("index").and_then(Value::as_u64).unwrap_or(next);
            let function = call.get("function").unwrap_or(&Value::Null);
            let id = str_of(call.get("id"));
            let name = str_of(function.get("name"));
            let args = str_of(function.get("arguments"));
            let entry = self.calls.entry(index).or_default();
            if entry.0.is_empty() {
                entry.0.clone_from(&id);
            }
            entry.1.push_str(&name);
            entry.2.push_str(&args);
            sink.send(Delta::ToolCall {
                index: u32::try_from(index).unwrap_or(u32::MAX),
                id,
                name,
                args,
            });
        }
        Ok(())
    }
}

/// Neutral → OpenAI tool_choice: the Anthropic-shaped neutral forms are translated, the
/// dialect's own forms (and anything unknown) pass through untouched.
fn tool_choice(choice: &Value) -> Value {
    let Some(obj) = choice.as_object() else {
        return choice.clone();
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("auto") if obj.len() == 1 => json!("auto"),
        Some("none") if obj.len() == 1 => json!("none"),
        Some("any") if obj.len() == 1 => json!("required"),
        Some("tool") => match obj.get("name") {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => choice.clone(),
        },
        _ => choice.clone(),
    }
}

fn encode_messages(messages: &[Message]) -> Result<Vec<Value>, ProviderError> {
    let mut out = Vec::with_capacity(messages.len());
    // Images tools returned: a tool message carries text only in this dialect, and the tool
    // messages of one batch must follow their call together, so the images go in one user
    // message after the batch, each call's under a line naming it.
    let mut tool_images = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        match m.role {
            Role::System => out.push(json!({"role": "system", "content": joined_text(m)})),
            Role::User => out.push(json!({"role": "user", "content": user_content(m)})),
            Role::Assistant => out.push(assistant(m)?),
            Role::Tool => {
                tool_messages(m, &mut out);
                if m.has_image() {
                    let id = tool_call_id_of(m);
                    tool_images.push(json!({"type": "text",
                        "text": format!("(the images tool call {id} returned)")}));
                    tool_images.extend(m.content.iter().filter_map(|p| match p {
                        Part::ImageUrl { image_url } => {
                            Some(json!({"type": "image_url", "image_url": {"url": image_url}}))
                        }
                        _ => None,
                    }));
                }
            }
        }
        let batch_goes_on = messages.get(i + 1).is_some_and(|n| n.role == Role::Tool);
        if !tool_images.is_empty() && !batch_goes_on {
            out.push(json!({"role": "user", "content": std::mem::take(&mut tool_images)}));
        }
    }
    Ok(out)
}

/// The call a tool message answers: its first result's id, else the message's own.
fn tool_call_id_of(m: &Message) -> &str {
    m.content
        .iter()
        .find_map(|p| match p {
            Part::ToolResult { tool_call_id, .. } if !tool_call_id.is_empty() => {
                Some(tool_call_id.as_str())
            }
            _ => None,
        })
        .unwrap_or(&m.tool_call_id)
}

fn joined_text(m: &Message) -> String {
    let texts: Vec<&str> = m
        .content
        .iter()
        .filter_map(|p| match p {
            Part::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    texts.join("\n")
}

fn user_content(m: &Message) -> Value {
    if !m.has_image() {
        return json!(joined_text(m));
    }
    let parts = m
        .content
        .iter()
        .filter_map(|p| match p {
            Part::Text { text } => Some(json!({"type": "text", "text": text})),
            // Data URIs and URLs both go as given: the dialect takes either.
            Part::ImageUrl { image_url } => {
                Some(json!({"type": "image_url", "image_url": {"url": image_url}}))
            }
            _ => None,
        })
        .collect();
    Value::Array(parts)
}

fn assistant(m: &Message) -> Result<Value, ProviderError> {
    let mut obj = Map::new();
    obj.insert("role".into(), json!("assistant"));
    let text = joined_text(m);
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for part in &m.content {
        match part {
            Part::Reasoning {
                family: ReasoningFamily::Openai,
                text,
                ..
            } => reasoning.push_str(text),
            Part::ToolCall { id, name, args, .. } => {
                let arguments = serde_json::to_string(args)
                    .map_err(|e| ProviderError::Invalid(format!("cannot encode args: {e}")))?;
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}}));
            }
            _ => {}
        }
    }
    if text.is_empty() && !calls.is_empty() {
        obj.insert("content".into(), Value::Null);
    } else {
        obj.insert("content".into(), json!(text));
    }
    if !calls.is_empty() {
        obj.insert("tool_calls".into(), Value::Array(calls));
    }
    if !reasoning.is_empty() {
        obj.insert("reasoning_content".into(), json!(reasoning));
    }
    Ok(Value::Object(obj))
}

fn tool_messages(m: &Message, out: &mut Vec<Value>) {
    let mut any = false;
    for part in &m.content {
        if let Part::ToolResult {
            tool_call_id, text, ..
        } = part
        {
            let id = if tool_call_id.is_empty() {
                &m.tool_call_id
            } else {
                tool_call_id
            };
            out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
            any = true;
        }
    }
    if !any {
        out.push(json!({"role": "tool", "tool_call_id": m.tool_call_id,
                        "content": joined_text(m)}));
    }
}

/// Decodes a `/chat/completions` reply (parsed JSON). `model` is used when the reply names none.
pub fn decode(v: &Value, model: &str) -> Result<ModelResponse, ProviderError> {
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| ProviderError::bad_response("no choices"))?;
    let msg = choice.get("message").unwrap_or(&Value::Null);
    let text = match msg.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    };
    let reasoning = msg
        .get("reasoning_content")
        .or_else(|| msg.get("reasoning"))
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let calls = msg
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|call| {
            let function = call.get("function").unwrap_or(&Value::Null);
            let (args, args_error) = decode_arguments(function.get("arguments"));
            ToolCall {
                id: str_of(call.get("id")),
                name: str_of(function.get("name")),
                args,
                args_error,
            }
        })
        .collect();
    let usage = v.get("usage").unwrap_or(&Value::Null);
    let present = |key: &str| usage.get(key).is_some();
    Ok(Decoded {
        model: reply_model(v, model),
        text,
        reasoning,
        calls,
        finish_reason: str_of(choice.get("finish_reason")),
        prompt: u64_at(usage, &["prompt_tokens"]),
        completion: u64_at(usage, &["completion_tokens"]),
        total: u64_at(usage, &["total_tokens"]),
        tiers: (present("prompt_cache_hit_tokens") || present("prompt_cache_miss_tokens")).then(
            || {
                (
                    u64_at(usage, &["prompt_cache_hit_tokens"]),
                    u64_at(usage, &["prompt_cache_miss_tokens"]),
                )
            },
        ),
        cached: usage
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64),
        reasoning_tokens: u64_at(usage, &["completion_tokens_details", "reasoning_tokens"]),
    }
    .response())
}

/// A whole reply's bytes read straight into the response, without a JSON tree, when they have
/// the usual shape: every field this dialect reads of the type it expects, each key once, at
/// least one choice. `None` for anything else, which [`decode`] then reads as before — so the
/// two give the same response wherever this one gives one (tested), and what a provider sends
/// is read as leniently as ever (docs/performance.md, "The door's answer read and written
/// without a JSON tree").
pub(crate) fn decode_usual(body: &[u8], model: &str) -> Option<ModelResponse> {
    let reply: usual::Reply = serde_json::from_slice(body).ok()?;
    let choice = reply.choices.into_iter().next()?;
    let msg = choice.message.unwrap_or_default();
    let usage = reply.usage.unwrap_or_default();
    let reasoning = match msg.reasoning_content {
        Some(named) => named,
        None => msg.reasoning,
    };
    let calls = msg
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .map(|call| {
            let function = call.function.unwrap_or_default();
            let (args, args_error) = match function.arguments {
                Some(text) => decode_argument_text(&text),
                None => (Map::new(), None),
            };
            ToolCall {
                id: call.id.unwrap_or_default(),
                name: function.name.unwrap_or_default(),
                args,
                args_error,
            }
        })
        .collect();
    let tiers = (usage.prompt_cache_hit_tokens.is_some()
        || usage.prompt_cache_miss_tokens.is_some())
    .then(|| {
        (
            usage.prompt_cache_hit_tokens.flatten().unwrap_or(0),
            usage.prompt_cache_miss_tokens.flatten().unwrap_or(0),
        )
    });
    Some(
        Decoded {
            model: model_named_or(reply.model.as_deref(), model),
            text: msg.content.unwrap_or_default(),
            reasoning: reasoning.unwrap_or_default(),
            calls,
            finish_reason: choice.finish_reason.unwrap_or_default(),
            prompt: usage.prompt_tokens.unwrap_or(0),
            completion: usage.completion_tokens.unwrap_or(0),
            total: usage.total_tokens.unwrap_or(0),
            tiers,
            cached: usage.prompt_tokens_details.and_then(|d| d.cached_tokens),
            reasoning_tokens: usage
                .completion_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
        }
        .response(),
    )
}

/// The usual shape of a whole reply ([`decode_usual`]). Unknown fields are skipped, as
/// [`decode`] skips them; a present `null` reads as absent except where [`decode`] tells the two
/// apart (`reasoning_content`, the cache tiers), which keep it as `Some(None)`.
mod usual {
    use serde::{Deserialize, Deserializer};

    /// A field that is present, `null` or not.
    fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Option<Option<T>>, D::Error> {
        Option::<T>::deserialize(d).map(Some)
    }

    #[derive(Deserialize)]
    pub(super) struct Reply {
        pub(super) model: Option<String>,
        pub(super) choices: Vec<Choice>,
        pub(super) usage: Option<Usage>,
    }

    #[derive(Deserialize)]
    pub(super) struct Choice {
        pub(super) message: Option<Message>,
        pub(super) finish_reason: Option<String>,
    }

    #[derive(Deserialize, Default)]
    pub(super) struct Message {
        pub(super) content: Option<String>,
        #[serde(default, deserialize_with = "present")]
        pub(super) reasoning_content: Option<Option<String>>,
        pub(super) reasoning: Option<String>,
        pub(super) tool_calls: Option<Vec<Call>>,
    }

    #[derive(Deserialize)]
    pub(super) struct Call {
        pub(super) id: Option<String>,
        pub(super) function: Option<Function>,
    }

    #[derive(Deserialize, Default)]
    pub(super) struct Function {
        pub(super) name: Option<String>,
        pub(super) arguments: Option<String>,
    }

    #[derive(Deserialize, Default)]
    pub(super) struct Usage {
        pub(super) prompt_tokens: Option<u64>,
        pub(super) completion_tokens: Option<u64>,
        pub(super) total_tokens: Option<u64>,
        #[serde(default, deserialize_with = "present")]
        pub(super) prompt_cache_hit_tokens: Option<Option<u64>>,
        #[serde(default, deserialize_with = "present")]
        pub(super) prompt_cache_miss_tokens: Option<Option<u64>>,
        pub(super) prompt_tokens_details: Option<Cached>,
        pub(super) completion_tokens_details: Option<Reasoning>,
    }

    #[derive(Deserialize)]
    pub(super) struct Cached {
        pub(super) cached_tokens: Option<u64>,
    }

    #[derive(Deserialize)]
    pub(super) struct Reasoning {
        pub(super) reasoning_tokens: Option<u64>,
    }
}

/// What a whole reply says, however it was read; [`Decoded::response`] makes the response.
struct Decoded {
    model: String,
    text: String,
    reasoning: String,
    calls: Vec<ToolCall>,
    finish_reason: String,
    prompt: u64,
    completion: u64,
    /// As reported (0 when absent).
    total: u64,
    /// DeepSeek's two tiers (hits, misses), when it reported either.
    tiers: Option<(u64, u64)>,
    /// `prompt_tokens_details.cached_tokens`: hits inside the prompt count (others).
    cached: Option<u64>,
    reasoning_tokens: u64,
}

impl Decoded {
    fn response(self) -> ModelResponse {
        let mut parts = Vec::new();
        if !self.reasoning.is_empty() {
            parts.push(Part::Reasoning {
                family: ReasoningFamily::Openai,
                text: self.reasoning,
                signature: None,
                redacted: None,
            });
        }
        if !self.text.is_empty() {
            parts.push(Part::text(self.text.clone()));
        }
        parts.extend(self.calls.iter().map(ToolCall::to_part));
        let total = match self.total {
            0 => self.prompt + self.completion,
            t => t,
        };
        // DeepSeek reports both tiers; others report cached_tokens (hits) inside the prompt count.
        let (hit, miss) = match (self.tiers, self.cached) {
            (Some(tiers), _) => tiers,
            (None, Some(cached)) => (cached, self.prompt.saturating_sub(cached)),
            (None, None) => (0, 0),
        };
        ModelResponse {
            model: self.model,
            content: self.text,
            message: Message::with_parts(Role::Assistant, parts),
            tool_calls: self.calls,
            stop_reason: self.finish_reason,
            prompt_tokens: self.prompt,
            completion_tokens: self.completion,
            total_tokens: total,
            cache_hit_tokens: hit,
            cache_miss_tokens: miss,
            reasoning_tokens: self.reasoning_tokens,
            provider: String::new(),
            offline: false,
        }
    }
}

/// `arguments` → object: `""`/absent → `{}`; invalid or non-object → `{}` + the reason.
fn decode_arguments(raw: Option<&Value>) -> (Map<String, Value>, Option<String>) {
    match raw {
        None | Some(Value::Null) => (Map::new(), None),
        Some(Value::Object(o)) => (o.clone(), None),
        Some(Value::String(s)) => decode_argument_text(s),
        Some(other) => (
            Map::new(),
            Some(format!(
                "arguments are neither a string nor an object: {other}"
            )),
        ),
    }
}

/// `arguments` sent as a JSON string (as OpenAI sends them).
fn decode_argument_text(s: &str) -> (Map<String, Value>, Option<String>) {
    if s.trim().is_empty() {
        return (Map::new(), None);
    }
    match serde_json::from_str::<Value>(s) {
        Ok(Value::Object(o)) => (o, None),
        Ok(other) => (
            Map::new(),
            Some(format!("arguments are not a JSON object: {other}")),
        ),
        Err(e) => (
            Map::new(),
            Some(format!("arguments are not valid JSON: {e}")),
        ),
    }
}

fn str_of(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or_default().to_owned()
}

pub(crate) fn u64_at(v: &Value, path: &[&str]) -> u64 {
    let mut cur = v;
    for key in path {
        match cur.get(key) {
            Some(next) => cur = next,
            None => return 0,
        }
    }
    cur.as_u64().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The typed read gives exactly the response the JSON-tree read gives, for every reply of
    /// the usual shape, and leaves every other reply to it (which still answers as before).
    #[test]
    fn the_usual_read_agrees_with_the_tree_read_and_leaves_it_the_rest() {
        let usual = [
            r#"{"id":"x","object":"chat.completion","model":"gpt-x","system_fingerprint":"fp",
                "choices":[{"index":0,"message":{"role":"assistant","content":"hi","refusal":null,
                "annotations":[]},"logprobs":null,"finish_reason":"stop"}],
                "usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11,
                "prompt_tokens_details":{"cached_tokens":4,"audio_tokens":0},
                "completion_tokens_details":{"reasoning_tokens":1}}}"#,
            r#"{"choices":[{"message":{"content":null,"tool_calls":[
                {"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}},
                {"id":"c2","function":{"name":"g","arguments":""}},
                {"id":"c3","function":{"name":"h","arguments":"not json"}},
                {"function":{"name":"i","arguments":"[1]"}},
                {"id":"c5"}]},"finish_reason":"tool_calls"}]}"#,
            r#"{"model":"","choices":[{"message":{"content":"a","reasoning_content":"think"}}],
                "usage":null}"#,
            r#"{"choices":[{"message":{"content":"a","reasoning":"other name"}}]}"#,
            r#"{"choices":[{"message":{"content":"a","reasoning_content":null,"reasoning":"x"}}]}"#,
            r#"{"choices":[{"message":{"content":"a"},"finish_reason":null}],
                "usage":{"prompt_tokens":7,"prompt_cache_hit_tokens":null,"prompt_cache_miss_tokens":5,
                "prompt_tokens_details":{"cached_tokens":3}}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":7,
                "prompt_cache_hit_tokens":6,"total_tokens":0,"completion_tokens":1}}"#,
            r#"{"choices":[{"finish_reason":"length"},{"message":{"content":"second"}}]}"#,
            r#"{"choices":[{"message":{"content":"a","tool_calls":null}}],
                "usage":{"prompt_tokens_details":{"cached_tokens":null}}}"#,
        ];
        for body in usual {
            let fast = decode_usual(body.as_bytes(), "asked")
                .unwrap_or_else(|| panic!("not read as usual: {body}"));
            let tree = decode(&serde_json::from_str(body).unwrap(), "asked").unwrap();
            assert_eq!(fast, tree, "{body}");
        }
        let unusual = [
            r#"{"choices":[{"message":{"content":[{"type":"text","text":"parts"}]}}]}"#,
            r#"{"choices":[{"message":{"tool_calls":[{"id":"c","function":{"name":"f",
                "arguments":{"a":1}}}]}}]}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"prompt_tokens":3.5}}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":{"completion_tokens":-1}}"#,
            r#"{"model":"one","model":"two","choices":[{"message":{"content":"a"}}]}"#,
            r#"{"choices":[{"message":{"content":"a","reasoning_content":7,"reasoning":"x"}}]}"#,
            r#"{"choices":[{"message":{"content":"a"}}],"usage":"none"}"#,
            r#"{"model":5,"choices":[{"message":{"content":"a"}}]}"#,
        ];
        for body in unusual {
            assert!(decode_usual(body.as_bytes(), "asked").is_none(), "{body}");
            assert!(
                decode(&serde_json::from_str(body).unwrap(), "asked").is_ok(),
                "{body}"
            );
        }
        for body in [r#"{"choices":[]}"#, r#"{"model":"m"}"#, "[]", "null"] {
            assert!(decode_usual(body.as_bytes(), "asked").is_none(), "{body}");
            assert!(
                decode(&serde_json::from_str(body).unwrap(), "asked").is_err(),
                "{body}"
            );
        }
    }

    /// Issue 36: a tool message carries text only in this dialect, so the images of a batch's
    /// results follow the whole batch in one user message, each call's under a line naming it.
    #[test]
    fn a_tool_batchs_images_follow_the_batch() {
        let mut first = Message::tool_result("c1", "t", "one", false);
        first.content.push(Part::ImageUrl {
            image_url: "data:image/png;base64,AAAA".into(),
        });
        let second = Message::tool_result("c2", "t", "two", false);
        let out = encode_messages(&[first, second, Message::text(Role::User, "and?")]).unwrap();
        let roles: Vec<&str> = out.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["tool", "tool", "user", "user"]);
        assert_eq!(out[0]["content"], "one");
        assert_eq!(
            out[2]["content"],
            json!([{"type":"text","text":"(the images tool call c1 returned)"},
                   {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}])
        );
    }

    #[test]
    fn arguments_decode_to_objects_or_an_args_error() {
        assert_eq!(decode_arguments(Some(&json!(""))), (Map::new(), None));
        assert_eq!(decode_arguments(None), (Map::new(), None));
        let (args, err) = decode_arguments(Some(&json!("{\"tz\":\"UTC\"}")));
        assert_eq!(args["tz"], "UTC");
        assert!(err.is_none());
        let (args, err) = decode_arguments(Some(&json!("{\"tz\":")));
        assert!(args.is_empty());
        assert!(err.unwrap().contains("not valid JSON"));
        let (args, err) = decode_arguments(Some(&json!("[1]")));
        assert!(args.is_empty());
        assert!(err.unwrap().contains("not a JSON object"));
    }

    #[test]
    fn neutral_tool_choices_translate_and_native_ones_pass_through() {
        assert_eq!(tool_choice(&json!({"type":"auto"})), json!("auto"));
        assert_eq!(tool_choice(&json!({"type":"any"})), json!("required"));
        assert_eq!(
            tool_choice(&json!({"type":"tool","name":"x"})),
            json!({"type":"function","function":{"name":"x"}})
        );
        assert_eq!(tool_choice(&json!("required")), json!("required"));
        let native = json!({"type":"function","function":{"name":"x"}});
        assert_eq!(tool_choice(&native), native);
    }

    #[test]
    fn missing_usage_fields_are_zero_never_an_error() {
        let resp = decode(
            &json!({"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}),
            "m",
        )
        .unwrap();
        assert_eq!(resp.model, "m");
        assert_eq!(resp.content, "hi");
        assert_eq!((resp.prompt_tokens, resp.cache_hit_tokens), (0, 0));
        assert_eq!(resp.cache_hit_rate(), 0.0);
        assert!(matches!(
            decode(&json!({"choices":[]}), "m"),
            Err(ProviderError::BadResponse { .. })
        ));
    }

    /// Cache hits (issue 32: they go into the call records the operator view shows): OpenAI's
    /// `prompt_tokens_details.cached_tokens` are hits inside the prompt count, the rest misses;
    /// DeepSeek's two tiers are taken as they are; a wrong type counts as none.
    #[test]
    fn cached_prompt_tokens_are_cache_hits() {
        let with = |usage: Value| {
            decode(
                &json!({"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}],
                    "usage":usage}),
                "m",
            )
            .unwrap()
        };
        let openai = with(json!({"prompt_tokens":2000,"completion_tokens":5,
            "prompt_tokens_details":{"cached_tokens":1536}}));
        assert_eq!(
            (openai.cache_hit_tokens, openai.cache_miss_tokens),
            (1536, 464)
        );
        let deepseek = with(json!({"prompt_tokens":100,"prompt_cache_hit_tokens":80,
            "prompt_cache_miss_tokens":20}));
        assert_eq!(
            (deepseek.cache_hit_tokens, deepseek.cache_miss_tokens),
            (80, 20)
        );
        let wrong =
            with(json!({"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":"many"}}));
        assert_eq!((wrong.cache_hit_tokens, wrong.cache_miss_tokens), (0, 0));
    }
}
