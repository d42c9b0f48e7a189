//! The Anthropic dialect: `POST {base_url}/v1/messages`, translated natively both ways.
//!
//! Choices made here (documented in `docs/model-gateway.md`):
//! - The dialect has no system role inside `messages`. The system messages that open the
//!   conversation (before its first user/assistant/tool message) become the top-level `system`
//!   string (joined by a blank line). A system message *inside* the conversation — an
//!   attribution note, a parallel-leg notice — keeps its position: it becomes its own `text`
//!   block of the `user` turn at that point (docs/semantics.md#attribution: notes hold from where
//!   they appear until the next one, so hoisting them would detach every note from the messages it
//!   describes). Its text is never joined to a user's text. A speaker-switch note
//!   ([`cyrene_protocol::message::SPEAKER_SWITCH_MARKER`]) is never hoisted, even before the
//!   first message: it starts the conversation.
//! - Tool turns become `user` messages of `tool_result` blocks (`is_error: true` only when set);
//!   consecutive messages of one role are merged, as the dialect requires alternation.
//! - Images: a data URI becomes a base64 `source`, anything else a `url` source.
//! - Reasoning parts of family `anthropic` go back as `thinking` (with `signature`) or
//!   `redacted_thinking` blocks in their original position; OpenAI reasoning is dropped.
//! - `max_tokens` is required here: 4096 when not given (budget + 4096 when a thinking budget
//!   would not fit).
//! - Thinking: `{"type":"disabled"}` for `enable: false`; else, when asked, per model capability
//!   `{"type":"enabled","budget_tokens":N}` (absent or 0 = 1024) or `{"type":"adaptive"}`. A
//!   budget the request gives but the body cannot carry (adaptive, or disabled) is a WARN.
//! - `tool_choice` is sent exactly as given (docs/semantics.md#model-vocabulary: passed through to
//!   the dialect that has one); the neutral forms are this dialect's own.
//! - `reasoning_effort` → `output_config.effort`, matched as given against `low`, `medium`,
//!   `high`, `max` unless configured.
//! - Usage: hits = `cache_read_input_tokens`; misses = `input_tokens +
//!   cache_creation_input_tokens`; prompt tokens = hits + misses; reasoning tokens are not
//!   reported by this dialect (they are inside `output_tokens`) and stay 0.

use super::openai::u64_at;
use super::{
    Decode, DeltaSink, HttpDialect, ProviderError, StreamEvents, Upstream, event_json,
    normalise_effort, parse_data_uri, reply_model, strings, tool_spec, upstream_message,
};
use crate::config::{ModelCaps, ProviderConfig, ThinkingStyle};
use cyrene_protocol::message::{Message, Part, ReasoningFamily, Role, ToolCall, is_in_place_note};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::stream::Delta;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

/// The API version header sent with every request.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";
/// `max_tokens` when the request gives none (the dialect requires one).
pub const DEFAULT_MAX_TOKENS: u32 = 4096;
/// `budget_tokens` when thinking is asked for without a budget (the dialect's minimum).
pub const DEFAULT_THINKING_BUDGET: u32 = 1024;

/// A provider speaking `/v1/messages`.
#[derive(Debug)]
pub struct AnthropicProvider {
    upstream: Upstream,
    models: BTreeMap<String, ModelCaps>,
    /// The `output_config.effort` whitelist (always declared for this dialect).
    efforts: Vec<String>,
}

impl AnthropicProvider {
    pub fn new(
        name: &str,
        config: &ProviderConfig,
        api_key: Option<String>,
        http: reqwest::Client,
    ) -> AnthropicProvider {
        AnthropicProvider {
            upstream: Upstream::new(name, config, "/v1/messages", api_key, http),
            models: config.models.clone(),
            efforts: config
                .reasoning_efforts
                .clone()
                .unwrap_or_else(|| strings(&["low", "medium", "high", "max"])),
        }
    }
}

impl HttpDialect for AnthropicProvider {
    type Events = StreamAccumulator;

    /// The request body for `model`.
    fn encode(&self, req: &ModelRequest, model: &str) -> Result<Value, ProviderError> {
        let mut body = Map::new();
        body.insert("model".into(), json!(model));
        let style = self
            .models
            .get(model)
            .and_then(|c| c.thinking)
            .unwrap_or_default();
        let thinking = thinking(req, style, &self.upstream.name);
        let budget = thinking
            .as_ref()
            .and_then(|t| t.get("budget_tokens"))
            .and_then(Value::as_u64)
            .and_then(|b| u32::try_from(b).ok());
        // 0 is "the provider's default" (docs/semantics.md#model-vocabulary), like absent.
        let max_tokens = match (req.max_tokens.filter(|&m| m > 0), budget) {
            (Some(m), _) => m,
            (None, Some(b)) if b >= DEFAULT_MAX_TOKENS => b.saturating_add(DEFAULT_MAX_TOKENS),
            (None, _) => DEFAULT_MAX_TOKENS,
        };
        body.insert("max_tokens".into(), json!(max_tokens));
        let (system, messages) = encode_messages(&req.messages)?;
        if !system.is_empty() {
            body.insert("system".into(), json!(system));
        }
        body.insert("messages".into(), Value::Array(messages));
        if let Some(t) = req.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if !req.tools.is_empty() {
            let tools = req
                .tools
                .iter()
                .map(|t| Value::Object(tool_spec(t, "input_schema")))
                .collect();
            body.insert("tools".into(), Value::Array(tools));
        }
        if let Some(choice) = &req.tool_choice {
            // As given: the neutral forms are this dialect's own
            // (docs/semantics.md#model-vocabulary).
            body.insert("tool_choice".into(), choice.clone());
        }
        if let Some(thinking) = thinking {
            body.insert("thinking".into(), thinking);
        }
        if let Some(effort) = normalise_effort(
            &req.reasoning_effort,
            Some(&self.efforts),
            false,
            &self.upstream.name,
        ) {
            body.insert("output_config".into(), json!({"effort": effort}));
        }
        Ok(Value::Object(body))
    }

    /// `"stream": true`: the events (`message_start`, `content_block_*` with text, thinking,
    /// signature and `input_json` deltas, `message_delta`, `message_stop`) are put back together
    /// into the non-streamed reply's shape and decoded by the same [`decode`].
    fn ask_for_stream(&self, body: &mut Map<String, Value>) {
        body.insert("stream".into(), json!(true));
    }

    fn post(&self) -> reqwest::RequestBuilder {
        let http = self
            .upstream
            .post()
            .header("anthropic-version", ANTHROPIC_VERSION);
        match &self.upstream.api_key {
            Some(key) => http.header("x-api-key", key),
            None => http,
        }
    }

    const DECODE: Decode = decode;
}

/// The blocks of a streamed `/v1/messages` reply seen so far.
#[derive(Debug, Default)]
pub(crate) struct StreamAccumulator {
    model: String,
    /// By block index: the block as the non-streamed reply would hold it.
    blocks: BTreeMap<u64, Value>,
    /// `input_json_delta` characters of tool_use blocks, by block index.
    partial_json: BTreeMap<u64, String>,
    /// Block index → the tool call's position among the reply's tool calls.
    tool_index: BTreeMap<u64, u32>,
    usage: Map<String, Value>,
    stop_reason: Value,
    stopped: bool,
}

impl StreamEvents for StreamAccumulator {
    /// `true` once `message_stop` arrived.
    fn take(&mut self, data: &str, sink: &DeltaSink) -> Result<bool, ProviderError> {
        self.feed(&event_json(data)?, sink)
    }

    /// The non-streamed reply these events add up to, decoded.
    fn finish(self, model: &str) -> Result<ModelResponse, ProviderError> {
        if !self.stopped {
            return Err(ProviderError::stream_ended(
                "the event stream ended before message_stop",
            ));
        }
        let reply = json!({
            "model": self.model,
            "content": self.blocks.into_values().collect::<Vec<_>>(),
            "stop_reason": self.stop_reason,
            "usage": Value::Object(self.usage),
        });
        decode(&reply, model)
    }
}

impl StreamAccumulator {
    /// Takes one event; `true` once `message_stop` arrived.
    fn feed(&mut self, v: &Value, sink: &DeltaSink) -> Result<bool, ProviderError> {
        let index = v.get("index").and_then(Value::as_u64).unwrap_or(0);
        match v.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let message = v.get("message").unwrap_or(&Value::Null);
                self.model = str_of(message.get("model"));
                self.merge_usage(message.get("usage"));
            }
            Some("content_block_start") => {
                let mut block = v.get("content_block").cloned().unwrap_or(Value::Null);
                match block.get("type").and_then(Value::as_str) {
                    Some("text") => sink.send(Delta::Text {
                        text: str_of(block.get("text")),
                    }),
                    Some("thinking") => sink.send(Delta::Reasoning {
                        text: str_of(block.get("thinking")),
                    }),
                    Some("tool_use") => {
                        let position = self.tool_index.len() as u32;
                        self.tool_index.insert(index, position);
                        // The input arrives as input_json_delta characters.
                        block["input"] = json!({});
                        sink.send(Delta::ToolCall {
                            index: position,
                            id: str_of(block.get("id")),
                            name: str_of(block.get("name")),
                            args: String::new(),
                        });
                    }
                    _ => {}
                }
                self.blocks.insert(index, block);
            }
            Some("content_block_delta") => {
                let delta = v.get("delta").unwrap_or(&Value::Null);
                let Some(block) = self.blocks.get_mut(&index) else {
                    return Err(ProviderError::bad_response(format!(
                        "content_block_delta for block {index}, which never started"
                    )));
                };
                let piece = |key: &str| str_of(delta.get(key));
                match delta.get("type").and_then(Value::as_str) {
                    Some("text_delta") => {
                        let text = piece("text");
                        append(block, "text", &text);
                        sink.send(Delta::Text { text });
                    }
                    Some("thinking_delta") => {
                        let text = piece("thinking");
                        append(block, "thinking", &text);
                        sink.send(Delta::Reasoning { text });
                    }
                    Some("signature_delta") => append(block, "signature", &piece("signature")),
                    Some("input_json_delta") => {
                        let args = piece("partial_json");
                        self.partial_json.entry(index).or_default().push_str(&args);
                        if let Some(&position) = self.tool_index.get(&index) {
                            sink.send(Delta::ToolCall {
                                index: position,
                                id: String::new(),
                                name: String::new(),
                                args,
                            });
                        }
                    }
                    other => tracing::debug!(delta_type = ?other, "unknown block delta ignored"),
                }
            }
            Some("content_block_stop") => {
                if let (Some(raw), Some(block)) = (
                    self.partial_json.remove(&index),
                    self.blocks.get_mut(&index),
                ) {
                    // Not JSON: kept as a string, so decode reports it as `args_error`.
                    block["input"] = if raw.trim().is_empty() {
                        json!({})
                    } else {
                        serde_json::from_str(&raw).unwrap_or(Value::String(raw))
                    };
                }
            }
            Some("message_delta") => {
                if let Some(reason) = v.get("delta").and_then(|d| d.get("stop_reason")) {
                    self.stop_reason = reason.clone();
                }
                self.merge_usage(v.get("usage"));
            }
            Some("message_stop") => {
                self.stopped = true;
                return Ok(true);
            }
            Some("error") => {
                let body = serde_json::to_vec(v).unwrap_or_default();
                return Err(ProviderError::bad_response(format!(
                    "the provider reported an error mid-stream: {}",
                    upstream_message(&body)
                )));
            }
            _ => {} // ping, and event types added later
        }
        Ok(false)
    }

    fn merge_usage(&mut self, usage: Option<&Value>) {
        if let Some(Value::Object(u)) = usage {
            for (k, v) in u {
                if !v.is_null() {
                    self.usage.insert(k.clone(), v.clone());
                }
            }
        }
    }
}

/// Appends `text` to the string field `key` of `block`.
fn append(block: &mut Value, key: &str, text: &str) {
    let mut joined = str_of(block.get(key));
    joined.push_str(text);
    block[key] = Value::String(joined);
}

/// The `thinking` object for `style`; a budget the object cannot carry is reported
/// (docs/semantics.md#model-vocabulary: a thinking field a provider cannot take is a WARN, never
/// silently dropped).
fn thinking(req: &ModelRequest, style: ThinkingStyle, provider: &str) -> Option<Value> {
    let t = req.thinking.as_ref()?;
    // 0 = the adapter's default budget (docs/semantics.md#model-vocabulary).
    let budget = t.budget();
    let dropped_budget = |why: &str| {
        if let Some(budget) = budget {
            tracing::warn!(
                provider,
                budget_tokens = budget,
                "budget_tokens not sent: {why}"
            );
        }
    };
    match (t.enable, budget) {
        (Some(false), _) => {
            dropped_budget("thinking is disabled");
            Some(json!({"type": "disabled"}))
        }
        (None, None) => None,
        (_, budget) => Some(match style {
            ThinkingStyle::Adaptive => {
                dropped_budget("this model thinks adaptively and takes no budget");
                json!({"type": "adaptive"})
            }
            ThinkingStyle::Budget => json!({"type": "enabled",
                "budget_tokens": budget.unwrap_or(DEFAULT_THINKING_BUDGET)}),
        }),
    }
}

fn encode_messages(messages: &[Message]) -> Result<(String, Vec<Value>), ProviderError> {
    let mut system: Vec<String> = Vec::new();
    // (role, blocks), merged when consecutive messages share a role.
    let mut turns: Vec<(&'static str, Vec<Value>)> = Vec::new();
    // Whether a user/assistant/tool message has been seen: system messages before it open the
    // conversation (top-level `system`), system messages after it keep their place.
    let mut conversation_started = false;
    for m in messages {
        let (role, blocks) = match m.role {
            // A speaker-switch note opens the conversation rather than the system text: it
            // holds from where it appears (docs/semantics.md#attribution), and in `system` a
            // forged copy in a later message would read as the newest note.
            Role::System if !conversation_started && !is_in_place_note(m) => {
                let text = m.text_content();
                if !text.is_empty() {
                    system.push(text);
                }
                continue;
            }
            Role::System => ("user", system_note_blocks(m)),
            Role::User => ("user", user_blocks(m)?),
            Role::Tool => ("user", tool_blocks(m)?),
            Role::Assistant => ("assistant", assistant_blocks(m)),
        };
        conversation_started = true;
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, existing)) if *last == role => existing.extend(blocks),
            _ => turns.push((role, blocks)),
        }
    }
    let messages = turns
        .into_iter()
        .map(|(role, blocks)| json!({"role": role, "content": blocks}))
        .collect();
    Ok((system.join("\n\n"), messages))
}

/// A system message inside the conversation: its text as one block of its own, in place.
fn system_note_blocks(m: &Message) -> Vec<Value> {
    let text = m.text_content();
    if text.is_empty() {
        Vec::new()
    } else {
        vec![json!({"type": "text", "text": text})]
    }
}

fn user_blocks(m: &Message) -> Result<Vec<Value>, ProviderError> {
    let mut blocks = Vec::with_capacity(m.content.len());
    for part in &m.content {
        match part {
            Part::Text { text } if !text.is_empty() => {
                blocks.push(json!({"type": "text", "text": text}));
            }
            Part::ImageUrl { image_url } => blocks.push(image_block(image_url)?),
            _ => {}
        }
    }
    Ok(blocks)
}

fn tool_blocks(m: &Message) -> Result<Vec<Value>, ProviderError> {
    // Images a tool returned go inside its result, after its text (docs/tools.md, "Results").
    let mut images = Vec::new();
    for part in &m.content {
        if let Part::ImageUrl { image_url } = part {
            images.push(image_block(image_url)?);
        }
    }
    let mut blocks = Vec::new();
    for part in &m.content {
        if let Part::ToolResult {
            tool_call_id,
            text,
            is_error,
        } = part
        {
            let id = if tool_call_id.is_empty() {
                &m.tool_call_id
            } else {
                tool_call_id
            };
            let mut block = json!({"type": "tool_result", "tool_use_id": id, "content": text});
            if *is_error {
                block["is_error"] = json!(true);
            }
            if !images.is_empty() {
                let mut content = vec![json!({"type": "text", "text": text})];
                content.append(&mut images);
                block["content"] = Value::Array(content);
            }
            blocks.push(block);
        }
    }
    if blocks.is_empty() {
        blocks.push(json!({"type": "tool_result", "tool_use_id": m.tool_call_id,
                           "content": m.text_content()}));
    }
    Ok(blocks)
}

/// An image block for a `data:` URI or an http(s) URL.
fn image_block(image_url: &str) -> Result<Value, ProviderError> {
    let source = match parse_data_uri(image_url).map_err(ProviderError::Invalid)? {
        Some(d) => json!({"type": "base64", "media_type": d.media_type, "data": d.data}),
        None => json!({"type": "url", "url": image_url}),
    };
    Ok(json!({"type": "image", "source": source}))
}

fn assistant_blocks(m: &Message) -> Vec<Value> {
    let mut blocks = Vec::with_capacity(m.content.len());
    for part in &m.content {
        match part {
            Part::Reasoning {
                family: ReasoningFamily::Anthropic,
                text,
                signature,
                redacted,
            } => match redacted {
                Some(data) => blocks.push(json!({"type": "redacted_thinking", "data": data})),
                None => blocks.push(json!({"type": "thinking", "thinking": text,
                    "signature": signature.as_deref().unwrap_or_default()})),
            },
            Part::Text { text } if !text.is_empty() => {
                blocks.push(json!({"type": "text", "text": text}));
            }
            Part::ToolCall { id, name, args, .. } => {
                blocks.push(json!({"type": "tool_use", "id": id, "name": name, "input": args}));
            }
            _ => {}
        }
    }
    blocks
}

/// Decodes a `/v1/messages` reply (parsed JSON). `model` is used when the reply names none.
pub fn decode(v: &Value, model: &str) -> Result<ModelResponse, ProviderError> {
    let blocks = v
        .get("content")
        .and_then(Value::as_array)
        .ok_or_else(|| ProviderError::bad_response("no content list"))?;
    let mut parts = Vec::with_capacity(blocks.len());
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for block in blocks {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                let t = block
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                text.push_str(t);
                parts.push(Part::text(t));
            }
            Some("thinking") => parts.push(Part::Reasoning {
                family: ReasoningFamily::Anthropic,
                text: str_of(block.get("thinking")),
                signature: block
                    .get("signature")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                redacted: None,
            }),
            Some("redacted_thinking") => parts.push(Part::Reasoning {
                family: ReasoningFamily::Anthropic,
                text: String::new(),
                signature: None,
                redacted: Some(str_of(block.get("data"))),
            }),
            Some("tool_use") => {
                let (args, args_error) = match block.get("input") {
                    Some(Value::Object(o)) => (o.clone(), None),
                    None | Some(Value::Null) => (Map::new(), None),
                    Some(other) => (
                        Map::new(),
                        Some(format!("input is not a JSON object: {other}")),
                    ),
                };
                let call = ToolCall {
                    id: str_of(block.get("id")),
                    name: str_of(block.get("name")),
                    args,
                    args_error,
                };
                parts.push(call.to_part());
                tool_calls.push(call);
            }
            other => {
                tracing::debug!(block_type = ?other, "unknown content block ignored");
            }
        }
    }
    let usage = v.get("usage").unwrap_or(&Value::Null);
    let hit = u64_at(usage, &["cache_read_input_tokens"]);
    let miss = u64_at(usage, &["input_tokens"]) + u64_at(usage, &["cache_creation_input_tokens"]);
    let completion = u64_at(usage, &["output_tokens"]);
    Ok(ModelResponse {
        model: reply_model(v, model),
        content: text,
        message: Message::with_parts(Role::Assistant, parts),
        tool_calls,
        stop_reason: str_of(v.get("stop_reason")),
        prompt_tokens: hit + miss,
        completion_tokens: completion,
        total_tokens: hit + miss + completion,
        cache_hit_tokens: hit,
        cache_miss_tokens: miss,
        reasoning_tokens: 0,
        provider: String::new(),
        offline: false,
    })
}

fn str_of(v: Option<&Value>) -> String {
    v.and_then(Value::as_str).unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::model::Thinking;

    #[test]
    fn thinking_follows_the_model_style_and_absent_means_untouched() {
        let req = |enable, budget| ModelRequest {
            thinking: Some(Thinking {
                budget_tokens: budget,
                enable,
            }),
            ..Default::default()
        };
        let budget = |r: &ModelRequest| thinking(r, ThinkingStyle::Budget, "p");
        assert_eq!(budget(&ModelRequest::default()), None);
        assert_eq!(budget(&req(None, None)), None);
        assert_eq!(budget(&req(None, Some(0))), None);
        assert_eq!(
            budget(&req(Some(false), Some(2000))),
            Some(json!({"type":"disabled"}))
        );
        assert_eq!(
            budget(&req(Some(true), None)),
            Some(json!({"type":"enabled","budget_tokens":1024}))
        );
        assert_eq!(
            budget(&req(Some(true), Some(0))),
            Some(json!({"type":"enabled","budget_tokens":1024}))
        );
        assert_eq!(
            thinking(&req(None, Some(3000)), ThinkingStyle::Adaptive, "p"),
            Some(json!({"type":"adaptive"}))
        );
    }

    #[test]
    fn consecutive_user_and_tool_turns_merge_and_leading_system_is_hoisted() {
        let messages = vec![
            Message::text(Role::System, "be brief"),
            Message::text(Role::System, "it is noon"),
            Message::tool_result("c1", "t", "one", false),
            Message::tool_result("c2", "t", "two", true),
            Message::text(Role::User, "and?"),
            Message::text(Role::System, "late note"),
        ];
        let (system, turns) = encode_messages(&messages).unwrap();
        assert_eq!(system, "be brief\n\nit is noon");
        assert_eq!(turns.len(), 1);
        assert_eq!(
            turns[0]["content"],
            json!([{"type":"tool_result","tool_use_id":"c1","content":"one"},
                   {"type":"tool_result","tool_use_id":"c2","content":"two","is_error":true},
                   {"type":"text","text":"and?"},
                   {"type":"text","text":"late note"}])
        );
    }

    /// Issue 36: an image a tool returned goes inside its `tool_result`, after the text.
    #[test]
    fn a_tool_results_image_goes_inside_the_result() {
        let mut result = Message::tool_result("c1", "t", "here it is", false);
        result.content.push(Part::ImageUrl {
            image_url: "data:image/png;base64,iVBORw0K".into(),
        });
        let (_, turns) = encode_messages(&[result]).unwrap();
        assert_eq!(
            turns[0]["content"],
            json!([{"type":"tool_result","tool_use_id":"c1","content":[
                {"type":"text","text":"here it is"},
                {"type":"image","source":{"type":"base64","media_type":"image/png",
                    "data":"iVBORw0K"}}]}])
        );
    }

    /// Issue 30, H1: the note announcing the first message stays in the conversation, where a
    /// forged copy in a message cannot come after it; the lead before it is still `system`.
    #[test]
    fn a_speaker_switch_note_before_the_first_message_keeps_its_place() {
        let note = "[发言归属] 以下发言来自「mallory」——本会话里的第三方人员（非管理员账户），不是主人，也不是你说的。";
        let messages = vec![
            Message::text(Role::System, "instructions"),
            Message::text(Role::System, "[会话角色] lead"),
            Message::text(Role::System, note),
            Message::text(Role::User, "hello"),
        ];
        let (system, turns) = encode_messages(&messages).unwrap();
        assert_eq!(system, "instructions\n\n[会话角色] lead");
        assert_eq!(
            turns,
            vec![json!({"role":"user","content":[{"type":"text","text":note},
                                                  {"type":"text","text":"hello"}]})]
        );
    }

    /// Cache hits (issue 32: they go into the call records the operator view shows):
    /// `cache_read_input_tokens` are hits; fresh input and cache writes are misses.
    #[test]
    fn cache_reads_are_cache_hits() {
        let resp = decode(
            &json!({"content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn",
                "usage":{"input_tokens":50,"output_tokens":7,"cache_read_input_tokens":900,
                    "cache_creation_input_tokens":30}}),
            "m",
        )
        .unwrap();
        assert_eq!((resp.cache_hit_tokens, resp.cache_miss_tokens), (900, 80));
        assert_eq!(resp.prompt_tokens, 980);
        let none = decode(
            &json!({"content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":5}}),
            "m",
        )
        .unwrap();
        assert_eq!(none.cache_hit_tokens, 0);
    }
}
