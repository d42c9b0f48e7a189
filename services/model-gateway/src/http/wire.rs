//! OpenAI's chat JSON ↔ the gateway's [`ModelRequest`] and [`ModelResponse`]: the part of the
//! request this door understands, and the `chat.completion` answer.
//!
//! # Invariants
//! - Unknown request fields and content parts are refused by name (`bad_request`), never
//!   ignored: a client is never answered as if the gateway had honoured them.
//! - `model` is `default` (the active group's chain) or a declared model id; anything else is
//!   `not_found`.
//! - Tool choice reaches the providers in the neutral form both dialects translate.

use super::{DEFAULT_MODEL, PURPOSE};
use crate::Gateway;
use cyrene_protocol::message::{Message, Part, Role, ToolCall};
use cyrene_protocol::model::{ModelRequest, ModelResponse, ToolSpec};
use cyrene_protocol::{ErrorBody, ErrorCode};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

/// How a chat request wants its answer (besides the model call itself).
pub(super) struct Answer {
    pub(super) stream: bool,
    /// `stream_options.include_usage`: a usage chunk before `[DONE]`.
    pub(super) include_usage: bool,
    /// The model id as the client asked for it (echoed in the chunks).
    pub(super) model: String,
}

/// A request body → the gateway's request and how to answer it.
pub(super) fn parse(bytes: &[u8], gateway: &Gateway) -> Result<(ModelRequest, Answer), ErrorBody> {
    let chat: ChatRequest =
        serde_json::from_slice(bytes).map_err(|err| bad(format!("invalid request: {err}")))?;
    let answer = Answer {
        stream: chat.stream,
        include_usage: chat
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage),
        model: chat.model.clone(),
    };
    Ok((to_model_request(chat, gateway)?, answer))
}

/// The part of OpenAI's chat request this door understands; anything else is refused by name.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    tools: Vec<ChatTool>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    /// Only 1 is accepted.
    #[serde(default)]
    n: Option<u32>,
    /// Accepted and ignored (no effect on routing).
    #[serde(default)]
    #[allow(dead_code)]
    user: Option<String>,
    #[serde(default)]
    #[allow(dead_code)]
    parallel_tool_calls: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatTool {
    #[serde(rename = "type")]
    kind: String,
    function: ChatFunction,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// Unknown fields inside a message are refused by name, as on the request (docs/model-gateway.md).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatMessage {
    role: String,
    /// OpenAI's assistant messages carry it (null); accepted and ignored.
    #[serde(default)]
    #[allow(dead_code)]
    refusal: Option<Value>,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ChatToolCall>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatToolCall {
    id: String,
    /// Always `function` in OpenAI's calls; accepted and ignored.
    #[serde(default, rename = "type")]
    #[allow(dead_code)]
    kind: Option<String>,
    function: ChatCallFunction,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatCallFunction {
    name: String,
    #[serde(default)]
    arguments: String,
}

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::BadRequest, message)
}

/// The text and image parts of an OpenAI `content` (a string or a list of parts).
fn content_parts(i: usize, content: Option<&Value>, images: bool) -> Result<Vec<Part>, ErrorBody> {
    match content {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![Part::text(s.clone())]),
        Some(Value::Array(items)) => {
            let mut parts = Vec::with_capacity(items.len());
            for item in items {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => parts.push(Part::text(
                        item.get("text").and_then(Value::as_str).unwrap_or_default(),
                    )),
                    Some("image_url") if images => {
                        let url = item
                            .get("image_url")
                            .and_then(|u| u.get("url").or(Some(u)))
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                bad(format!("messages[{i}]: image_url without a url"))
                            })?;
                        parts.push(Part::ImageUrl {
                            image_url: url.to_owned(),
                        });
                    }
                    other => {
                        return Err(bad(format!(
                            "messages[{i}]: content part type {other:?} is not supported here"
                        )));
                    }
                }
            }
            Ok(parts)
        }
        Some(other) => Err(bad(format!(
            "messages[{i}]: content must be a string or a list of parts, not {other}"
        ))),
    }
}

/// OpenAI's request → the gateway's request; `Err` for what cannot be expressed.
fn to_model_request(chat: ChatRequest, gateway: &Gateway) -> Result<ModelRequest, ErrorBody> {
    if chat.n.is_some_and(|n| n != 1) {
        return Err(bad("n must be 1: one choice per request"));
    }
    let model = if chat.model == DEFAULT_MODEL {
        String::new()
    } else if gateway
        .config()
        .providers
        .values()
        .any(|p| p.models.contains_key(&chat.model))
    {
        chat.model.clone()
    } else {
        return Err(ErrorBody::new(
            ErrorCode::NotFound,
            format!(
                "the model {:?} does not exist here (GET /v1/models lists them)",
                chat.model
            ),
        ));
    };
    let mut messages = Vec::with_capacity(chat.messages.len());
    for (i, m) in chat.messages.into_iter().enumerate() {
        let message = match m.role.as_str() {
            "system" | "developer" => {
                Message::with_parts(Role::System, content_parts(i, m.content.as_ref(), false)?)
            }
            "user" => {
                let mut msg =
                    Message::with_parts(Role::User, content_parts(i, m.content.as_ref(), true)?);
                if let Some(name) = m.name {
                    msg = msg.sender(name);
                }
                msg
            }
            "assistant" => {
                let mut parts = content_parts(i, m.content.as_ref(), false)?;
                for call in m.tool_calls {
                    let args = match call.function.arguments.trim() {
                        "" => Map::new(),
                        raw => match serde_json::from_str::<Value>(raw) {
                            Ok(Value::Object(o)) => o,
                            _ => {
                                return Err(bad(format!(
                                    "messages[{i}]: tool call {:?} arguments are not a JSON object",
                                    call.id
                                )));
                            }
                        },
                    };
                    parts.push(
                        ToolCall {
                            id: call.id,
                            name: call.function.name,
                            args,
                            args_error: None,
                        }
                        .to_part(),
                    );
                }
                Message::with_parts(Role::Assistant, parts)
            }
            "tool" => {
                let id = m.tool_call_id.ok_or_else(|| {
                    bad(format!("messages[{i}]: a tool message needs tool_call_id"))
                })?;
                let text = content_parts(i, m.content.as_ref(), false)?
                    .into_iter()
                    .filter_map(|p| match p {
                        Part::Text { text } => Some(text),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                Message::tool_result(id, m.name.unwrap_or_default(), text, false)
            }
            other => return Err(bad(format!("messages[{i}]: unknown role {other:?}"))),
        };
        messages.push(message);
    }
    let mut tools = Vec::with_capacity(chat.tools.len());
    for (i, t) in chat.tools.into_iter().enumerate() {
        if t.kind != "function" {
            return Err(bad(format!(
                "tools[{i}]: only function tools are supported"
            )));
        }
        tools.push(ToolSpec {
            name: t.function.name,
            description: t.function.description.unwrap_or_default(),
            parameters: t
                .function
                .parameters
                .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        });
    }
    let tool_choice = chat.tool_choice.map(neutral_tool_choice);
    Ok(ModelRequest {
        messages,
        model,
        temperature: chat.temperature,
        max_tokens: chat.max_completion_tokens.or(chat.max_tokens),
        purpose: PURPOSE.to_owned(),
        tools,
        tool_choice,
        reasoning_effort: chat.reasoning_effort.unwrap_or_default(),
        ..Default::default()
    })
}

/// OpenAI's tool_choice → the neutral form both dialects translate.
fn neutral_tool_choice(choice: Value) -> Value {
    match &choice {
        Value::String(s) => match s.as_str() {
            "auto" => json!({"type": "auto"}),
            "none" => json!({"type": "none"}),
            "required" => json!({"type": "any"}),
            _ => choice,
        },
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("function").and_then(|f| f.get("name")) {
                Some(name) => json!({"type": "tool", "name": name}),
                None => choice,
            }
        }
        _ => choice,
    }
}

/// The provider's stop reason in OpenAI's vocabulary.
pub(super) fn finish_reason(response: &ModelResponse) -> &'static str {
    if !response.tool_calls.is_empty() {
        return "tool_calls";
    }
    match response.stop_reason.as_str() {
        "length" | "max_tokens" => "length",
        "content_filter" | "refusal" => "content_filter",
        "tool_calls" | "tool_use" => "tool_calls",
        _ => "stop",
    }
}

/// OpenAI's `usage` object of a response.
#[derive(Debug, Serialize)]
pub(super) struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
    prompt_tokens_details: CachedTokens,
    completion_tokens_details: ReasoningTokens,
}

#[derive(Debug, Serialize)]
struct CachedTokens {
    cached_tokens: u64,
}

#[derive(Debug, Serialize)]
struct ReasoningTokens {
    reasoning_tokens: u64,
}

pub(super) fn usage(response: &ModelResponse) -> Usage {
    Usage {
        prompt_tokens: response.prompt_tokens,
        completion_tokens: response.completion_tokens,
        total_tokens: response.total_tokens,
        prompt_tokens_details: CachedTokens {
            cached_tokens: response.cache_hit_tokens,
        },
        completion_tokens_details: ReasoningTokens {
            reasoning_tokens: response.reasoning_tokens,
        },
    }
}

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// A `chat.completion` answer, serialised straight from the response it borrows (no JSON tree
/// built first: docs/performance.md, "The door's answer read and written without a JSON tree").
#[derive(Debug, Serialize)]
pub(super) struct Completion<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [Choice<'a>; 1],
    usage: Usage,
}

#[derive(Debug, Serialize)]
struct Choice<'a> {
    index: u32,
    message: AnswerMessage<'a>,
    finish_reason: &'static str,
}

#[derive(Debug, Serialize)]
struct AnswerMessage<'a> {
    role: &'static str,
    /// `null` for an answer that is only tool calls.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "String::is_empty")]
    reasoning_content: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<AnswerCall<'a>>,
}

#[derive(Debug, Serialize)]
struct AnswerCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: AnswerFunction<'a>,
}

#[derive(Debug, Serialize)]
struct AnswerFunction<'a> {
    name: &'a str,
    /// The arguments as a JSON string, as OpenAI sends them.
    arguments: String,
}

pub(super) fn completion<'a>(id: &'a str, response: &'a ModelResponse) -> Completion<'a> {
    let content = if response.content.is_empty() && !response.tool_calls.is_empty() {
        None
    } else {
        Some(response.content.as_str())
    };
    let reasoning_content: String = response
        .message
        .content
        .iter()
        .filter_map(|p| match p {
            Part::Reasoning { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    let tool_calls = response
        .tool_calls
        .iter()
        .map(|c| AnswerCall {
            id: &c.id,
            kind: "function",
            function: AnswerFunction {
                name: &c.name,
                arguments: serde_json::to_string(&c.args).unwrap_or_default(),
            },
        })
        .collect();
    Completion {
        id,
        object: "chat.completion",
        created: now_secs(),
        model: &response.model,
        choices: [Choice {
            index: 0,
            message: AnswerMessage {
                role: "assistant",
                content,
                reasoning_content,
                tool_calls,
            },
            finish_reason: finish_reason(response),
        }],
        usage: usage(response),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The answer written from the typed structs is OpenAI's `chat.completion`: `content` null
    /// only beside tool calls, `reasoning_content` and `tool_calls` only when there are some,
    /// arguments as a JSON string, and the whole usage object.
    #[test]
    fn the_answer_is_openais_completion_json() {
        let reply = |message: Value, finish: &str, usage: Value| {
            let reply = json!({"model": "m", "choices": [{"message": message,
                "finish_reason": finish}], "usage": usage});
            crate::providers::openai::decode(&reply, "m").unwrap()
        };
        let text = reply(
            json!({"role": "assistant", "content": "hi", "reasoning_content": "hm"}),
            "stop",
            json!({"prompt_tokens": 3, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 1},
                "completion_tokens_details": {"reasoning_tokens": 1}}),
        );
        let got = serde_json::to_value(completion("chatcmpl-1", &text)).unwrap();
        assert!(got["created"].as_u64().unwrap() > 1_700_000_000);
        assert_eq!(
            got,
            json!({"id": "chatcmpl-1", "object": "chat.completion", "created": got["created"],
                "model": "m", "choices": [{"index": 0, "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "hi", "reasoning_content": "hm"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                    "prompt_tokens_details": {"cached_tokens": 1},
                    "completion_tokens_details": {"reasoning_tokens": 1}}})
        );
        let calls = reply(
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]}),
            "tool_calls",
            Value::Null,
        );
        let got = serde_json::to_value(completion("chatcmpl-2", &calls)).unwrap();
        assert_eq!(
            got["choices"],
            json!([{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
                "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": "{\"a\":1}"}}]}}])
        );
        assert_eq!(got["usage"]["total_tokens"], 0);
    }

    /// issue 30, L4: unknown fields inside a message are refused, as on the request.
    #[test]
    fn unknown_fields_inside_messages_are_refused() {
        let ok = json!({"role":"assistant","content":null,"refusal":null,
            "tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]});
        assert!(serde_json::from_value::<ChatMessage>(ok).is_ok());
        for bad in [
            json!({"role":"user","content":"hi","priority":1}),
            json!({"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"f"},"x":1}]}),
            json!({"role":"assistant","tool_calls":[{"id":"c1","function":{"name":"f","y":2}}]}),
        ] {
            let err = serde_json::from_value::<ChatMessage>(bad.clone()).unwrap_err();
            assert!(err.to_string().contains("unknown field"), "{bad}: {err}");
        }
    }

    #[test]
    fn tool_choices_become_the_neutral_form() {
        assert_eq!(
            neutral_tool_choice(json!("required")),
            json!({"type":"any"})
        );
        assert_eq!(
            neutral_tool_choice(json!({"type":"function","function":{"name":"f"}})),
            json!({"type":"tool","name":"f"})
        );
    }
}
