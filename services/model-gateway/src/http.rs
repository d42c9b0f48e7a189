//! The OpenAI-compatible HTTP front door (off by default; `--http-addr` /
//! `CYRENE_GATEWAY_HTTP_ADDR`, docs/model-gateway.md "OpenAI-compatible HTTP front door"):
//! `POST /v1/chat/completions` (streamed and not) and `GET /v1/models`, served by the same
//! [`Gateway`] as the bus endpoints — same router, fallback, cooldown and call records.
//!
//! # Invariants
//! - Every request needs `Authorization: Bearer <key>` with one of the configured client keys;
//!   the keys are never logged or echoed (hand-written `Debug`).
//! - Every failure is OpenAI's error JSON (`{"error":{"message","type","param","code"}}`) with the
//!   matching HTTP status — malformed JSON, unknown fields, oversized bodies, unknown paths and
//!   methods included. Nothing a client sends can panic the listener.
//! - A streamed call answers with an HTTP error status when it fails before its first delta
//!   (fallback happens before that); after it, the failure is an `error` event in the stream.

use crate::Gateway;
use crate::providers::DeltaSink;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cyrene_protocol::message::{Message, Part, Role, ToolCall};
use cyrene_protocol::model::{ModelRequest, ModelResponse, ToolSpec};
use cyrene_protocol::stream::Delta;
use cyrene_protocol::{ErrorBody, ErrorCode};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The largest request body accepted (images travel inline as data URIs; this path does not
/// cross the bus, so it is not bound by NATS' max_payload).
pub const MAX_BODY: usize = 16 * 1024 * 1024;
/// The model id that means "the active group's chain" rather than one declared model.
pub const DEFAULT_MODEL: &str = "default";
/// The `purpose` of calls made through this door, in call records.
pub const PURPOSE: &str = "http";

/// The client API keys (comma-separated in `CYRENE_GATEWAY_HTTP_KEYS`); never formatted.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct ClientKeys(Vec<String>);

impl fmt::Debug for ClientKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ClientKeys(<{} redacted>)", self.0.len())
    }
}

impl FromStr for ClientKeys {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(ClientKeys(
            s.split(',')
                .map(str::trim)
                .filter(|k| !k.is_empty())
                .map(str::to_owned)
                .collect(),
        ))
    }
}

impl ClientKeys {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `given` is one of the keys (compared without an early exit on the first
    /// differing byte).
    fn accepts(&self, given: &str) -> bool {
        self.0.iter().fold(false, |found, key| {
            let same = key.len() == given.len()
                && key
                    .bytes()
                    .zip(given.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0;
            found | same
        })
    }
}

/// Where and for whom the front door listens.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    pub addr: SocketAddr,
    pub keys: ClientKeys,
}

#[derive(Debug, Clone)]
struct AppState {
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    keys: ClientKeys,
}

/// Binds `config.addr` and serves until `shutdown`; returns the bound address (port 0 picks one)
/// and the serving task.
pub async fn serve(
    config: HttpConfig,
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    shutdown: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(config.addr).await?;
    let bound = listener.local_addr()?;
    let app = router(AppState {
        gateway,
        client,
        keys: config.keys,
    });
    tracing::info!(addr = %bound, "OpenAI-compatible HTTP front door listening");
    let task = tokio::spawn(async move {
        let serving = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await });
        if let Err(err) = serving.await {
            tracing::warn!(error = %err, "the HTTP front door stopped");
        }
    });
    Ok((bound, task))
}

fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .fallback(|| async {
            openai_error(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("unknown_url"),
                "no such endpoint: this server serves POST /v1/chat/completions and GET /v1/models",
            )
        })
        .method_not_allowed_fallback(|| async {
            openai_error(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                Some("method_not_allowed"),
                "method not allowed on this endpoint",
            )
        })
        .with_state(state)
}

/// OpenAI's error JSON with `status`.
fn openai_error(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    (status, axum::Json(body)).into_response()
}

/// A gateway error as OpenAI's error JSON with the matching HTTP status.
fn error_response(err: &ErrorBody) -> Response {
    let (status, kind) = match err.code {
        ErrorCode::BadRequest => (StatusCode::BAD_REQUEST, "invalid_request_error"),
        ErrorCode::Forbidden => (StatusCode::FORBIDDEN, "permission_error"),
        ErrorCode::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error"),
        ErrorCode::Conflict => (StatusCode::CONFLICT, "invalid_request_error"),
        ErrorCode::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error"),
        ErrorCode::Upstream => (StatusCode::BAD_GATEWAY, "upstream_error"),
        ErrorCode::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "api_error"),
        ErrorCode::Timeout => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        ErrorCode::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "api_error"),
    };
    openai_error(status, kind, Some(err.code.as_str()), &err.message)
}

fn authorised(state: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(key) if state.keys.accepts(key) => Ok(()),
        Some(_) => Err(Box::new(openai_error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "incorrect API key provided",
        ))),
        None => Err(Box::new(openai_error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("missing_api_key"),
            "no API key provided: send Authorization: Bearer <key>",
        ))),
    }
}

/// The ids a client may ask for: `default` (the active group's chain) and every declared model.
fn model_ids(gateway: &Gateway) -> BTreeMap<String, String> {
    let mut ids = BTreeMap::new();
    for (provider, p) in &gateway.config().providers {
        for model in p.models.keys() {
            ids.entry(model.clone()).or_insert_with(|| provider.clone());
        }
    }
    ids.insert(DEFAULT_MODEL.to_owned(), "cyrene".to_owned());
    ids
}

async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(denied) = authorised(&state, &headers) {
        return *denied;
    }
    let data: Vec<Value> = model_ids(&state.gateway)
        .into_iter()
        .map(|(id, owner)| json!({"id": id, "object": "model", "created": 0, "owned_by": owner}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
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

#[derive(Debug, Deserialize)]
struct ChatMessage {
    role: String,
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
struct ChatToolCall {
    id: String,
    function: ChatCallFunction,
}

#[derive(Debug, Deserialize)]
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
    } else if model_ids(gateway).contains_key(&chat.model) {
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
fn finish_reason(response: &ModelResponse) -> &'static str {
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

fn usage(response: &ModelResponse) -> Value {
    json!({
        "prompt_tokens": response.prompt_tokens,
        "completion_tokens": response.completion_tokens,
        "total_tokens": response.total_tokens,
        "prompt_tokens_details": {"cached_tokens": response.cache_hit_tokens},
        "completion_tokens_details": {"reasoning_tokens": response.reasoning_tokens},
    })
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

fn completion(id: &str, response: &ModelResponse) -> Value {
    let mut message = Map::new();
    message.insert("role".into(), json!("assistant"));
    message.insert(
        "content".into(),
        if response.content.is_empty() && !response.tool_calls.is_empty() {
            Value::Null
        } else {
            json!(response.content)
        },
    );
    let reasoning: String = response
        .message
        .content
        .iter()
        .filter_map(|p| match p {
            Part::Reasoning { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect();
    if !reasoning.is_empty() {
        message.insert("reasoning_content".into(), json!(reasoning));
    }
    if !response.tool_calls.is_empty() {
        let calls: Vec<Value> = response
            .tool_calls
            .iter()
            .map(|c| {
                json!({"id": c.id, "type": "function", "function": {"name": c.name,
                       "arguments": serde_json::to_string(&c.args).unwrap_or_default()}})
            })
            .collect();
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    json!({
        "id": id,
        "object": "chat.completion",
        "created": now_secs(),
        "model": response.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason(response)}],
        "usage": usage(response),
    })
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(denied) = authorised(&state, &headers) {
        return *denied;
    }
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return error_response(&ErrorBody::new(
                ErrorCode::TooLarge,
                format!("the request body is over {MAX_BODY} bytes (or could not be read)"),
            ));
        }
    };
    let chat: ChatRequest = match serde_json::from_slice(&bytes) {
        Ok(c) => c,
        Err(err) => return error_response(&bad(format!("invalid request: {err}"))),
    };
    let stream = chat.stream;
    let include_usage = chat
        .stream_options
        .as_ref()
        .is_some_and(|o| o.include_usage);
    let requested_model = chat.model.clone();
    let req = match to_model_request(chat, &state.gateway) {
        Ok(r) => r,
        Err(err) => return error_response(&err),
    };
    let id = format!("chatcmpl-{}", uuid::Uuid::now_v7().simple());
    if !stream {
        return match state.gateway.call(&state.client, &req, None).await {
            Ok(response) => axum::Json(completion(&id, &response)).into_response(),
            Err(err) => error_response(&err),
        };
    }
    stream_response(state, req, id, requested_model, include_usage).await
}

/// A streamed call: the HTTP status waits for the first delta or the outcome, so a call that
/// fails before any output (after every fallback) is an ordinary error response.
async fn stream_response(
    state: AppState,
    req: ModelRequest,
    id: String,
    model: String,
    include_usage: bool,
) -> Response {
    let (sink, mut deltas) = DeltaSink::new();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let AppState {
        gateway, client, ..
    } = state;
    tokio::spawn(async move {
        let result = gateway.call(&client, &req, Some(&sink)).await;
        drop(sink);
        let _ = done_tx.send(result);
    });
    let mut done_rx = done_rx;
    let first = tokio::select! {
        biased;
        Some(delta) = deltas.recv() => delta,
        result = &mut done_rx => match result {
            Ok(Err(err)) => return error_response(&err),
            // Succeeded without a delta (an empty answer), or the task is gone: stream anyway.
            Ok(Ok(response)) => {
                let events = Chunks::new(id, model, include_usage);
                let body = events.finish_all(Ok(response));
                return sse_response(Body::from(body));
            }
            Err(_) => return error_response(&ErrorBody::new(ErrorCode::Internal, "the call task ended without an answer")),
        },
    };
    let chunks = Chunks::new(id, model, include_usage);
    let stream = futures::stream::unfold(
        (chunks, Some(first), deltas, Some(done_rx), true),
        |(mut chunks, pending, mut deltas, done, opening)| async move {
            let mut out = String::new();
            if opening {
                out.push_str(&chunks.event(json!({"role": "assistant", "content": ""}), None));
            }
            if let Some(delta) = pending {
                out.push_str(&chunks.delta(delta));
                // What is already there goes out in the same write.
                while let Ok(delta) = deltas.try_recv() {
                    out.push_str(&chunks.delta(delta));
                }
                return Some((
                    Ok::<_, std::convert::Infallible>(Bytes::from(out)),
                    (chunks, None, deltas, done, false),
                ));
            }
            let done = done?;
            match deltas.recv().await {
                Some(delta) => {
                    out.push_str(&chunks.delta(delta));
                    while let Ok(delta) = deltas.try_recv() {
                        out.push_str(&chunks.delta(delta));
                    }
                    Some((
                        Ok(Bytes::from(out)),
                        (chunks, None, deltas, Some(done), false),
                    ))
                }
                None => {
                    let result = done.await.unwrap_or_else(|_| {
                        Err(ErrorBody::new(
                            ErrorCode::Internal,
                            "the call task ended without an answer",
                        ))
                    });
                    out.push_str(&chunks.finish_all(result));
                    Some((Ok(Bytes::from(out)), (chunks, None, deltas, None, false)))
                }
            }
        },
    );
    sse_response(Body::from_stream(stream))
}

fn sse_response(body: Body) -> Response {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// The `chat.completion.chunk` events of one streamed call.
struct Chunks {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
}

impl Chunks {
    fn new(id: String, model: String, include_usage: bool) -> Chunks {
        Chunks {
            id,
            model,
            created: now_secs(),
            include_usage,
        }
    }

    fn event(&self, delta: Value, finish: Option<&str>) -> String {
        let chunk = json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    }

    fn delta(&mut self, delta: Delta) -> String {
        let delta = match delta {
            Delta::Text { text } => json!({"content": text}),
            Delta::Reasoning { text } => json!({"reasoning_content": text}),
            Delta::ToolCall {
                index,
                id,
                name,
                args,
            } => {
                let mut call = json!({"index": index, "function": {"arguments": args}});
                if !id.is_empty() {
                    call["id"] = json!(id);
                    call["type"] = json!("function");
                }
                if !name.is_empty() {
                    call["function"]["name"] = json!(name);
                }
                json!({"tool_calls": [call]})
            }
        };
        self.event(delta, None)
    }

    /// The closing events: the finish reason (and usage when asked), or the error, then `[DONE]`.
    fn finish_all(&self, result: Result<ModelResponse, ErrorBody>) -> String {
        let mut out = String::new();
        match result {
            Ok(response) => {
                out.push_str(&self.event(json!({}), Some(finish_reason(&response))));
                if self.include_usage {
                    let chunk = json!({"id": self.id, "object": "chat.completion.chunk",
                        "created": self.created, "model": self.model, "choices": [],
                        "usage": usage(&response)});
                    out.push_str(&format!("data: {chunk}\n\n"));
                }
            }
            Err(err) => {
                let chunk = json!({"error": {"message": err.message, "type": "api_error",
                    "param": null, "code": err.code.as_str()}});
                out.push_str(&format!("data: {chunk}\n\n"));
            }
        }
        out.push_str("data: [DONE]\n\n");
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keys_parse_from_a_list_and_never_print() {
        let keys: ClientKeys = " a1 ,, b2 ".parse().unwrap();
        assert!(keys.accepts("a1") && keys.accepts("b2"));
        assert!(!keys.accepts("a") && !keys.accepts("a1 ") && !keys.accepts(""));
        assert!(!format!("{keys:?}").contains("a1"));
        assert!("".parse::<ClientKeys>().unwrap().is_empty());
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
