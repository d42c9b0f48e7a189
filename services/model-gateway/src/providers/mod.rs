//! Providers: one trait, one file per wire dialect (`openai`, `anthropic`, `scripted`), plus the
//! pieces both HTTP dialects share (sending with a deadline, classifying failures, effort
//! whitelists, data URIs).
//!
//! # Invariants
//! - A provider translates; it never routes, retries or falls back (the router does).
//! - Every failure is classified once, here: [`ProviderError::is_retryable`] decides whether the
//!   router may try the next step (transport, timeout, 429, 5xx, an unreadable 2xx body) or must
//!   answer at once (any other 4xx, a request that cannot be translated).
//! - API keys live inside the provider and are never formatted: the `Debug` impls are written
//!   by hand.
//!
//! # Pitfalls
//! - The deadline covers sending *and* reading the body: a provider that sends headers quickly
//!   and then trickles the body still times out.

pub mod anthropic;
pub mod openai;
pub mod scripted;
pub mod sse;

use crate::config::Step;
use cyrene_protocol::model::{ModelRequest, ModelResponse, ToolSpec};
use cyrene_protocol::stream::Delta;
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_runtime::entry::with_sources;
use futures::future::BoxFuture;
use serde_json::{Map, Value, json};
use std::borrow::Cow;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Where a streaming provider puts its deltas; remembers whether any output was produced (the
/// router falls back only before the first one).
#[derive(Debug, Clone)]
pub struct DeltaSink {
    tx: mpsc::UnboundedSender<Delta>,
    started: Arc<AtomicBool>,
}

impl DeltaSink {
    /// A sink and the receiving end of its deltas.
    pub fn new() -> (DeltaSink, mpsc::UnboundedReceiver<Delta>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            DeltaSink {
                tx,
                started: Arc::new(AtomicBool::new(false)),
            },
            rx,
        )
    }

    /// Passes `delta` on (an empty one is dropped); from now on output has started.
    pub fn send(&self, delta: Delta) {
        if delta.is_empty() {
            return;
        }
        self.started.store(true, Ordering::Release);
        // The receiver gone = the caller stopped listening; the call still completes.
        let _ = self.tx.send(delta);
    }

    /// Whether any output has been passed on.
    pub fn started(&self) -> bool {
        self.started.load(Ordering::Acquire)
    }
}

/// Polls `call` — the call feeding `deltas` — until it is over (its output) or has passed on a
/// delta (`None`; the deltas are in `deltas`).
///
/// For a caller that polls the call itself rather than spawning it (one hand-off between
/// threads fewer per delta, docs/performance.md "One task a streamed call"). Deltas come only
/// from the call, so after each poll of it what it made is already in the channel: no waker is
/// registered on the channel, since a call sending into a channel its own task waits on would
/// wake that task again for nothing.
pub async fn until_delta<F: Future + Unpin>(
    call: &mut F,
    deltas: &mpsc::UnboundedReceiver<Delta>,
) -> Option<F::Output> {
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut *call).poll(cx) {
        std::task::Poll::Ready(output) => std::task::Poll::Ready(Some(output)),
        std::task::Poll::Pending if !deltas.is_empty() => std::task::Poll::Ready(None),
        std::task::Poll::Pending => std::task::Poll::Pending,
    })
    .await
}

/// `call` with a panic inside it made its outcome (`internal`), so a caller that polls the call
/// itself ([`until_delta`]) still answers, as when the call ran in a task of its own.
pub fn caught(
    call: impl Future<Output = Result<ModelResponse, ErrorBody>>,
) -> impl Future<Output = Result<ModelResponse, ErrorBody>> {
    futures::FutureExt::map(
        futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(call)),
        |outcome| {
            outcome.unwrap_or_else(|_| {
                Err(ErrorBody::new(
                    ErrorCode::Internal,
                    "the call failed: it panicked",
                ))
            })
        },
    )
}

/// One upstream (or the offline script) that can complete a request.
pub trait Provider: Send + Sync + std::fmt::Debug {
    /// Completes `request` with `step.model`, giving up at `deadline`.
    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        step: &'a Step,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<ModelResponse, ProviderError>>;

    /// Like [`Provider::complete`], passing output to `sink` as it is produced; the returned
    /// response is the one `complete` would have given. The default completes first and then
    /// passes the whole answer on as one delta per part.
    fn stream<'a>(
        &'a self,
        request: &'a ModelRequest,
        step: &'a Step,
        deadline: Instant,
        sink: &'a DeltaSink,
    ) -> BoxFuture<'a, Result<ModelResponse, ProviderError>> {
        Box::pin(async move {
            let response = self.complete(request, step, deadline).await?;
            for delta in response_deltas(&response) {
                sink.send(delta);
            }
            Ok(response)
        })
    }
}

/// A whole response as deltas: reasoning, text, then one per tool call (arguments as JSON).
pub fn response_deltas(response: &ModelResponse) -> Vec<Delta> {
    use cyrene_protocol::message::Part;
    let mut out = Vec::new();
    for part in &response.message.content {
        match part {
            Part::Reasoning { text, .. } => out.push(Delta::Reasoning { text: text.clone() }),
            Part::Text { text } => out.push(Delta::Text { text: text.clone() }),
            _ => {}
        }
    }
    for (i, call) in response.tool_calls.iter().enumerate() {
        out.push(Delta::ToolCall {
            index: i as u32,
            id: call.id.clone(),
            name: call.name.clone(),
            args: serde_json::to_string(&call.args).unwrap_or_default(),
        });
    }
    out
}

/// A foreign error kept whole under a [`ProviderError`] (reqwest's, serde_json's, the event
/// stream parser's); shared, so that the error stays `Clone`.
pub type Cause = Arc<dyn std::error::Error + Send + Sync>;

/// Why one attempt failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ProviderError {
    /// Connecting, sending or reading failed: the HTTP client's error, or (no `source`) an event
    /// stream that ended before the reply did, which `what` says.
    #[error("transport error: {}", describe(what, source.as_ref()))]
    Transport {
        /// Our words; empty when `source` says it all.
        what: Cow<'static, str>,
        #[source]
        source: Option<Cause>,
    },
    /// The attempt's deadline passed.
    #[error("no answer within {} ms", .0.as_millis())]
    Timeout(Duration),
    /// The provider answered with a non-2xx status; `message` is the provider's own.
    #[error("HTTP {status}: {message}")]
    Status {
        status: u16,
        message: String,
        retry_after: Option<Duration>,
    },
    /// A 2xx whose body is not the dialect's response: what is wrong with it, and the decoder's
    /// error when one failed.
    #[error("unreadable response: {}", describe(what, source.as_ref()))]
    BadResponse {
        what: Cow<'static, str>,
        #[source]
        source: Option<Cause>,
    },
    /// The request cannot be expressed in this dialect (e.g. a malformed data URI).
    #[error("{0}")]
    Invalid(String),
}

impl ProviderError {
    /// Whether the router may try the next step of the chain.
    pub fn is_retryable(&self) -> bool {
        match self {
            ProviderError::Transport { .. }
            | ProviderError::Timeout(_)
            | ProviderError::BadResponse { .. } => true,
            ProviderError::Status { status, .. } => *status == 429 || *status >= 500,
            ProviderError::Invalid(_) => false,
        }
    }

    /// The HTTP client failed to connect, send or read.
    pub(crate) fn transport(source: reqwest::Error) -> Self {
        ProviderError::Transport {
            what: Cow::Borrowed(""),
            source: Some(Arc::new(source)),
        }
    }

    /// An event stream that ended before the reply did (`what` says how it should have ended).
    pub(crate) fn stream_ended(what: &'static str) -> Self {
        ProviderError::Transport {
            what: Cow::Borrowed(what),
            source: None,
        }
    }

    /// A 2xx body that is not the dialect's response, for a reason we found ourselves.
    pub(crate) fn bad_response(what: impl Into<Cow<'static, str>>) -> Self {
        ProviderError::BadResponse {
            what: what.into(),
            source: None,
        }
    }

    /// A 2xx body that `source` (a decoder) could not read; `what` names the part.
    pub(crate) fn unreadable(
        what: &'static str,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        ProviderError::BadResponse {
            what: Cow::Borrowed(what),
            source: Some(Arc::new(source)),
        }
    }

    /// The cooldown the provider asked for (`Retry-After` on 429/503).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ProviderError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// What one HTTP dialect (OpenAI chat completions, Anthropic messages) supplies; the call
/// itself — encode, POST, decode, or stream with the whole-reply fallback — is [`http_complete`]
/// and [`http_stream`], the same for every dialect.
pub(crate) trait HttpDialect: Send + Sync {
    /// The accumulator of a streamed reply.
    type Events: StreamEvents;
    /// The request body for `model`.
    fn encode(&self, request: &ModelRequest, model: &str) -> Result<Value, ProviderError>;
    /// Adds the fields that ask for a streamed reply to `body`.
    fn ask_for_stream(&self, body: &mut Map<String, Value>);
    /// A POST to the dialect's endpoint with its authentication headers.
    fn post(&self) -> reqwest::RequestBuilder;
    /// Decodes a whole (non-streamed) reply; `model` is used when the reply names none.
    const DECODE: Decode;
    /// Reads a whole reply's bytes straight into the response when they have the dialect's
    /// usual shape; `None` sends them to [`Self::DECODE`] (parsed as JSON first), which must
    /// give the same response for every reply this one reads.
    fn decode_usual(_body: &[u8], _model: &str) -> Option<ModelResponse> {
        None
    }
}

/// How a dialect decodes a whole reply (parsed JSON) asked of `model`.
pub(crate) type Decode = fn(&Value, &str) -> Result<ModelResponse, ProviderError>;

/// A whole reply's bytes, decoded by the dialect `D`.
fn decode_whole<D: HttpDialect>(body: &[u8], model: &str) -> Result<ModelResponse, ProviderError> {
    if let Some(response) = D::decode_usual(body, model) {
        return Ok(response);
    }
    let reply: Value =
        serde_json::from_slice(body).map_err(|e| ProviderError::unreadable("not JSON", e))?;
    (D::DECODE)(&reply, model)
}

/// Where an HTTP dialect posts, and with which key; its `Debug` never shows the key.
pub(crate) struct Upstream {
    /// The provider's name in the model config (for logs and errors).
    pub(crate) name: String,
    pub(crate) url: String,
    /// `url` parsed once, not on every request (`None` when it does not parse: then each
    /// request fails with reqwest's own error, as before).
    parsed: Option<reqwest::Url>,
    pub(crate) api_key: Option<String>,
    pub(crate) http: reqwest::Client,
}

impl Upstream {
    /// The provider `name` configured by `config`, posting to `path` below its `base_url`.
    pub(crate) fn new(
        name: &str,
        config: &crate::config::ProviderConfig,
        path: &str,
        api_key: Option<String>,
        http: reqwest::Client,
    ) -> Upstream {
        let url = format!("{}{path}", config.base_url.trim_end_matches('/'));
        Upstream {
            name: name.to_owned(),
            parsed: reqwest::Url::parse(&url).ok(),
            url,
            api_key,
            http,
        }
    }

    /// A POST to the upstream's URL.
    pub(crate) fn post(&self) -> reqwest::RequestBuilder {
        match &self.parsed {
            Some(url) => self.http.post(url.clone()),
            None => self.http.post(&self.url),
        }
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

/// A tool as both dialects declare it: its name, its description when it has one, and its
/// parameters' JSON schema under `schema_key`.
pub(crate) fn tool_spec(tool: &ToolSpec, schema_key: &str) -> Map<String, Value> {
    let mut spec = Map::new();
    spec.insert("name".into(), json!(tool.name));
    if !tool.description.is_empty() {
        spec.insert("description".into(), json!(tool.description));
    }
    spec.insert(schema_key.into(), tool.parameters.clone());
    spec
}

/// The model a reply names, else `asked`.
pub(crate) fn reply_model(reply: &Value, asked: &str) -> String {
    model_named_or(reply.get("model").and_then(Value::as_str), asked)
}

/// The model a reply names, or `asked` when it names none (or an empty one).
pub(crate) fn model_named_or(named: Option<&str>, asked: &str) -> String {
    named.filter(|m| !m.is_empty()).unwrap_or(asked).to_owned()
}

/// A streamed reply put back together event by event into the whole reply's shape.
pub(crate) trait StreamEvents: Default + Send {
    /// Takes one event's data, passing output on to `sink`; `true` once the stream is over.
    fn take(&mut self, data: &str, sink: &DeltaSink) -> Result<bool, ProviderError>;
    /// The response the events make up.
    fn finish(self, model: &str) -> Result<ModelResponse, ProviderError>;
}

/// A stream event's data as JSON.
pub(crate) fn event_json(data: &str) -> Result<Value, ProviderError> {
    serde_json::from_str(data)
        .map_err(|e| ProviderError::unreadable("a stream event is not JSON", e))
}

/// `body` as the request's bytes.
fn body_bytes(body: &Value) -> Result<Vec<u8>, ProviderError> {
    serde_json::to_vec(body).map_err(|e| ProviderError::Invalid(format!("cannot encode: {e}")))
}

/// Every HTTP dialect is a provider.
impl<D: HttpDialect + std::fmt::Debug> Provider for D {
    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        step: &'a Step,
        deadline: Instant,
    ) -> BoxFuture<'a, Result<ModelResponse, ProviderError>> {
        Box::pin(http_complete(self, request, step, deadline))
    }

    fn stream<'a>(
        &'a self,
        request: &'a ModelRequest,
        step: &'a Step,
        deadline: Instant,
        sink: &'a DeltaSink,
    ) -> BoxFuture<'a, Result<ModelResponse, ProviderError>> {
        Box::pin(http_stream(self, request, step, deadline, sink))
    }
}

/// [`Provider::complete`] of an HTTP dialect.
async fn http_complete<D: HttpDialect>(
    dialect: &D,
    request: &ModelRequest,
    step: &Step,
    deadline: Instant,
) -> Result<ModelResponse, ProviderError> {
    let body = dialect.encode(request, &step.model)?;
    let reply = post_json(dialect.post(), body_bytes(&body)?, deadline).await?;
    decode_whole::<D>(&reply, &step.model)
}

/// [`Provider::stream`] of an HTTP dialect: the events are put back together into the
/// non-streamed reply's shape; a server that ignores the stream request and answers whole is
/// decoded as such, its answer passed on as deltas.
async fn http_stream<D: HttpDialect>(
    dialect: &D,
    request: &ModelRequest,
    step: &Step,
    deadline: Instant,
    sink: &DeltaSink,
) -> Result<ModelResponse, ProviderError> {
    let started = Instant::now();
    let mut body = dialect.encode(request, &step.model)?;
    if let Some(obj) = body.as_object_mut() {
        dialect.ask_for_stream(obj);
    }
    let response = post_for_stream(dialect.post(), body_bytes(&body)?, deadline).await?;
    let response = match whole_reply(response, started, deadline).await? {
        Ok(whole) => {
            let response = decode_whole::<D>(&whole, &step.model)?;
            for delta in response_deltas(&response) {
                sink.send(delta);
            }
            return Ok(response);
        }
        Err(events) => events,
    };
    let mut events = sse::SseReader::new(response, started, deadline);
    let mut acc = D::Events::default();
    while let Some(event) = events.next().await? {
        if acc.take(&event.data, sink)? {
            break;
        }
    }
    acc.finish(&step.model)
}

/// Sends a JSON POST and reads the whole reply before `deadline`.
pub(crate) async fn post_json(
    request: reqwest::RequestBuilder,
    body: Vec<u8>,
    deadline: Instant,
) -> Result<bytes::Bytes, ProviderError> {
    within(deadline, async {
        let response = send(request, body).await?;
        response.bytes().await.map_err(ProviderError::transport)
    })
    .await
}

/// Sends a JSON POST and returns the response once its status is 2xx (the body still to read),
/// or the failure a non-2xx status (its body read) means — the classification [`post_json`]
/// uses, before `deadline`.
pub(crate) async fn post_for_stream(
    request: reqwest::RequestBuilder,
    body: Vec<u8>,
    deadline: Instant,
) -> Result<reqwest::Response, ProviderError> {
    let request = request.header(reqwest::header::ACCEPT, "text/event-stream");
    within(deadline, send(request, body)).await
}

/// Sends `body` as JSON; a 2xx response as it is, any other status as the failure it means
/// (its body read for the provider's message).
async fn send(
    request: reqwest::RequestBuilder,
    body: Vec<u8>,
) -> Result<reqwest::Response, ProviderError> {
    let response = request
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await
        .map_err(ProviderError::transport)?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(parse_retry_after);
    let bytes = response.bytes().await.map_err(ProviderError::transport)?;
    Err(ProviderError::Status {
        status: status.as_u16(),
        message: upstream_message(&bytes),
        retry_after,
    })
}

/// `call`, or a timeout at `deadline`.
async fn within<T>(
    deadline: Instant,
    call: impl Future<Output = Result<T, ProviderError>>,
) -> Result<T, ProviderError> {
    let started = Instant::now();
    match tokio::time::timeout_at(deadline, call).await {
        Ok(result) => result,
        Err(_) => Err(ProviderError::Timeout(
            deadline.saturating_duration_since(started),
        )),
    }
}

/// A 2xx reply to a streaming request that is not an event stream (a server that ignores
/// `"stream": true`): its whole body, to be decoded as the non-streamed reply (`Ok(Ok)`); an
/// event stream is handed back (`Ok(Err)`).
pub(crate) async fn whole_reply(
    response: reqwest::Response,
    started: Instant,
    deadline: Instant,
) -> Result<Result<bytes::Bytes, reqwest::Response>, ProviderError> {
    let is_stream = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("text/event-stream"));
    if is_stream {
        return Ok(Err(response));
    }
    match tokio::time::timeout_at(deadline, response.bytes()).await {
        Ok(Ok(bytes)) => Ok(Ok(bytes)),
        Ok(Err(e)) => Err(ProviderError::transport(e)),
        Err(_) => Err(ProviderError::Timeout(
            deadline.saturating_duration_since(started),
        )),
    }
}

/// `Retry-After` in seconds (the HTTP-date form is not used by LLM providers; ignored).
fn parse_retry_after(value: &str) -> Option<Duration> {
    let secs: f64 = value.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(3600.0)))
}

/// The provider's own error message: `error.message` in both dialects, else the raw body.
pub(crate) fn upstream_message(body: &[u8]) -> String {
    if let Ok(v) = serde_json::from_slice::<Value>(body) {
        let error = v.get("error").unwrap_or(&v);
        if let Some(msg) = error.get("message").and_then(Value::as_str) {
            return match error.get("type").and_then(Value::as_str) {
                Some(kind) => format!("{kind}: {msg}"),
                None => msg.to_owned(),
            };
        }
        if let Some(msg) = error.as_str() {
            return msg.to_owned();
        }
    }
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if text.is_empty() {
        "(empty body)".to_owned()
    } else {
        text.chars().take(500).collect()
    }
}

/// `what: <source's chain>` (reqwest's top level alone says only "error sending request"), or
/// whichever of the two there is (the text of
/// [`ProviderError::Transport`] and [`ProviderError::BadResponse`] on the wire).
fn describe(what: &str, source: Option<&Cause>) -> String {
    match source {
        None => what.to_owned(),
        Some(source) if what.is_empty() => with_sources(source.as_ref()),
        Some(source) => format!("{what}: {}", with_sources(source.as_ref())),
    }
}

/// A parsed `data:<mime>;base64,<data>` URI.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct DataUri<'a> {
    pub media_type: &'a str,
    pub data: &'a str,
}

/// Parses a base64 data URI; `Ok(None)` for anything that is not a `data:` URI.
pub(crate) fn parse_data_uri(url: &str) -> Result<Option<DataUri<'_>>, String> {
    let Some(rest) = url.strip_prefix("data:") else {
        return Ok(None);
    };
    let (meta, data) = rest
        .split_once(',')
        .ok_or_else(|| "malformed data URI: no ',' before the data".to_owned())?;
    let media_type = meta
        .strip_suffix(";base64")
        .ok_or_else(|| "data URIs must be base64 (data:<mime>;base64,<data>)".to_owned())?;
    if media_type.is_empty() || !media_type.contains('/') {
        return Err(format!("data URI has no media type: {media_type:?}"));
    }
    Ok(Some(DataUri { media_type, data }))
}

/// Checks `effort` against the provider's declared `whitelist`, exactly as given (no trimming,
/// no case folding), after DeepSeek's documented aliases when `deepseek_aliases`. A value not on
/// the whitelist is dropped with a WARN, never replaced by another level. A provider without a
/// declared whitelist (`None`) gets the value unchanged, with a WARN that nobody checked it.
pub(crate) fn normalise_effort(
    effort: &str,
    whitelist: Option<&[String]>,
    deepseek_aliases: bool,
    provider: &str,
) -> Option<String> {
    if effort.is_empty() {
        return None;
    }
    let effort = match effort {
        "minimal" if deepseek_aliases => "low",
        "medium" | "xhigh" if deepseek_aliases => "high",
        "ultra" if deepseek_aliases => "max",
        other => other,
    };
    let Some(whitelist) = whitelist else {
        tracing::warn!(
            provider,
            reasoning_effort = %effort,
            "this provider declares no reasoning_effort whitelist; sent unchecked \
             (set reasoning_efforts in the model config to check it)"
        );
        return Some(effort.to_owned());
    };
    if whitelist.iter().any(|w| w == effort) {
        Some(effort.to_owned())
    } else {
        tracing::warn!(
            provider,
            reasoning_effort = %effort,
            accepted = ?whitelist,
            "reasoning_effort not recognised by this provider; dropped (not replaced)"
        );
        None
    }
}

/// Whether a tool_choice forces a tool (`required`/`any`/a named tool), in either dialect.
pub(crate) fn tool_choice_forces(choice: &Value) -> bool {
    match choice {
        Value::String(s) => s == "required" || s == "any",
        Value::Object(o) => matches!(
            o.get("type").and_then(Value::as_str),
            Some("any" | "tool" | "function" | "required")
        ),
        _ => false,
    }
}

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use serde_json::json;

    /// A caller polling the call itself learns of each batch of deltas, waits while the call
    /// waits, and gets the output once the call is over, with every delta it made in the channel.
    #[tokio::test]
    async fn until_delta_returns_at_each_batch_of_deltas_then_the_output() {
        let text = |t: &str| Delta::Text { text: t.into() };
        let (sink, mut deltas) = DeltaSink::new();
        let (go, gate) = tokio::sync::oneshot::channel::<()>();
        let mut call = Box::pin(async move {
            sink.send(Delta::Text { text: "a".into() });
            sink.send(Delta::Text { text: "b".into() });
            let _ = gate.await;
            sink.send(Delta::Text { text: "c".into() });
            7
        });
        assert_eq!(until_delta(&mut call, &deltas).await, None);
        assert_eq!(deltas.try_recv().ok(), Some(text("a")));
        assert_eq!(deltas.try_recv().ok(), Some(text("b")));
        // Nothing new until the call goes on.
        assert!(until_delta(&mut call, &deltas).now_or_never().is_none());
        go.send(()).unwrap();
        assert_eq!(until_delta(&mut call, &deltas).await, Some(7));
        assert_eq!(deltas.try_recv().ok(), Some(text("c")));
        assert!(deltas.try_recv().is_err());
    }

    #[test]
    fn retryable_failures_are_transport_timeout_429_and_5xx() {
        let status = |status| ProviderError::Status {
            status,
            message: String::new(),
            retry_after: None,
        };
        assert!(status(429).is_retryable());
        assert!(status(500).is_retryable());
        assert!(status(503).is_retryable());
        assert!(!status(400).is_retryable());
        assert!(!status(401).is_retryable());
        assert!(!status(404).is_retryable());
        assert!(ProviderError::stream_ended("x").is_retryable());
        assert!(ProviderError::bad_response("x").is_retryable());
        assert!(ProviderError::Timeout(Duration::from_millis(1)).is_retryable());
        assert!(!ProviderError::Invalid("x".into()).is_retryable());
    }

    #[test]
    fn data_uris_split_into_media_type_and_data() {
        assert_eq!(
            parse_data_uri("data:image/png;base64,AAAA").unwrap(),
            Some(DataUri {
                media_type: "image/png",
                data: "AAAA"
            })
        );
        assert_eq!(parse_data_uri("https://x/y.png").unwrap(), None);
        assert!(parse_data_uri("data:image/png,AAAA").is_err());
        assert!(parse_data_uri("data:;base64,AAAA").is_err());
        assert!(parse_data_uri("data:image/png;base64").is_err());
    }

    #[test]
    fn deepseek_effort_aliases_normalise_and_unknown_values_drop() {
        let ds = strings(&["low", "high", "max"]);
        let ds = Some(ds.as_slice());
        assert_eq!(
            normalise_effort("minimal", ds, true, "p").as_deref(),
            Some("low")
        );
        assert_eq!(
            normalise_effort("medium", ds, true, "p").as_deref(),
            Some("high")
        );
        assert_eq!(
            normalise_effort("xhigh", ds, true, "p").as_deref(),
            Some("high")
        );
        assert_eq!(
            normalise_effort("ultra", ds, true, "p").as_deref(),
            Some("max")
        );
        assert_eq!(normalise_effort("extreme", ds, true, "p"), None);
        let oa = strings(&["low", "medium", "high"]);
        assert_eq!(normalise_effort("ultra", Some(&oa), false, "p"), None);
        assert_eq!(normalise_effort("", Some(&oa), false, "p"), None);
    }

    #[test]
    fn effort_is_matched_as_given_and_passes_unchecked_without_a_whitelist() {
        let ds = strings(&["low", "high", "max"]);
        // No case folding, no trimming: "MAX" is not "max" (docs/semantics.md#model-vocabulary).
        assert_eq!(normalise_effort("MAX", Some(&ds), true, "p"), None);
        assert_eq!(normalise_effort(" high", Some(&ds), true, "p"), None);
        assert_eq!(normalise_effort("Minimal", Some(&ds), true, "p"), None);
        // No declared whitelist: sent as given (with a WARN), never guessed.
        assert_eq!(
            normalise_effort("turbo", None, false, "p").as_deref(),
            Some("turbo")
        );
        assert_eq!(normalise_effort("", None, false, "p"), None);
    }

    #[test]
    fn upstream_messages_are_kept_in_both_dialects() {
        assert_eq!(
            upstream_message(
                br#"{"error":{"message":"bad model","type":"invalid_request_error"}}"#
            ),
            "invalid_request_error: bad model"
        );
        assert_eq!(
            upstream_message(
                br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#
            ),
            "overloaded_error: Overloaded"
        );
        assert_eq!(upstream_message(b"gateway down"), "gateway down");
        assert_eq!(parse_retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn forced_tool_choices_are_recognised() {
        assert!(tool_choice_forces(&json!("required")));
        assert!(tool_choice_forces(&json!({"type":"tool","name":"x"})));
        assert!(tool_choice_forces(&json!({"type":"any"})));
        assert!(!tool_choice_forces(&json!({"type":"auto"})));
        assert!(!tool_choice_forces(&json!("none")));
    }
}
