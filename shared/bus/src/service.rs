//! Micro-service helpers: typed errors onto the wire, JSON decoding with the size guard, and a
//! bounded serving loop for one endpoint.
//!
//! # Invariants
//! - Every request gets exactly one reply: the handler's value, or an error envelope. Malformed
//!   JSON, wrong types and oversized bodies are answered with `bad_request`/`too_large` and never
//!   reach the handler, so a bad client cannot take the service down.
//! - Every reply fits the bus: error messages are bounded (`ErrorBody::new`), and a value too
//!   large for the connection's `max_payload` is answered with `too_large` instead ([`respond`]).
//! - At most `max_in_flight` handlers run at once; the endpoint stream is read no faster than that
//!   (back-pressure goes to NATS, where a slow service shows up as request timeouts).
//!
//! # Pitfalls
//! - async-nats' own `respond(Err(..))` sends the headers with an *empty* body; Cyrene's contract
//!   wants the JSON envelope too, so errors go out through the vendored
//!   `Request::respond_error_with_payload` (vendor/async-nats/CYRENE-PATCH.md), which sends both
//!   and counts the error in `$SRV.STATS` — as its code only (`last_error` reads
//!   `service request error code: 404, status: not_found`): the message goes to the caller and
//!   nowhere else, since it may name a person's session or turn. Never answer an error with
//!   `respond_with_headers(Ok(..))`: `num_errors` would not see it.
//!
//! # Metrics
//! Every request [`serve_json`] answers is counted in `cyrene_requests_total{endpoint, code}` and
//! timed in `cyrene_request_duration_seconds{endpoint, code}` (`endpoint` is the micro endpoint
//! name, `code` is `ok` or the wire error code; docs/operations.md).
//! - Shutdown unsubscribes and then answers every request already delivered to this process. A
//!   request the server routed to us just before it saw the unsubscribe is discarded by the
//!   client library (async-nats endpoints cannot be drained), so its caller sees a timeout and
//!   must retry; that is why every Cyrene request has a deadline and idempotent writes.

use crate::{guard, headers, trace};
use async_nats::service::endpoint::Endpoint;
use async_nats::service::{NATS_SERVICE_ERROR, NATS_SERVICE_ERROR_CODE, Request};
use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use cyrene_protocol::{ErrorBody, ErrorCode, ErrorEnvelope};
use futures::StreamExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The micro error headers for `err`.
pub fn error_headers(err: &ErrorBody) -> HeaderMap {
    let mut headers = HeaderMap::new();
    // Header values cannot hold line breaks.
    let one_line: String = err.message.replace(['\r', '\n'], " ");
    // Neither can fail: constant names, no line break left in either value.
    let _ = headers::insert(&mut headers, NATS_SERVICE_ERROR, &one_line);
    let _ = headers::insert(
        &mut headers,
        NATS_SERVICE_ERROR_CODE,
        &err.code.status().to_string(),
    );
    headers
}

/// The JSON envelope for `err`.
pub fn error_payload(err: &ErrorBody) -> Bytes {
    // ErrorEnvelope holds only strings: serialising it cannot fail.
    serde_json::to_vec(&ErrorEnvelope { error: err.clone() })
        .unwrap_or_default()
        .into()
}

/// The error a reply carries, if it carries one: the JSON envelope when present, else what the
/// headers say (peers that send headers only).
pub fn error_from_message(message: &Message) -> Option<ErrorBody> {
    let headers = message.headers.as_ref()?;
    let status = headers.get(NATS_SERVICE_ERROR_CODE)?;
    if let Ok(envelope) = serde_json::from_slice::<ErrorEnvelope>(&message.payload) {
        return Some(envelope.error);
    }
    let code = status
        .as_str()
        .trim()
        .parse::<u16>()
        .map(ErrorCode::from_status);
    let text = headers
        .get(NATS_SERVICE_ERROR)
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    Some(ErrorBody::new(code.unwrap_or(ErrorCode::Internal), text))
}

/// Decodes a JSON body of at most `max` bytes, mapping failures onto the error set.
pub fn decode<T: DeserializeOwned>(payload: &[u8], max: usize) -> Result<T, ErrorBody> {
    guard::check_size(payload.len(), max)?;
    serde_json::from_slice(payload).map_err(|err| {
        let message = if payload.iter().all(u8::is_ascii_whitespace) {
            "empty request body; expected a JSON object".to_owned()
        } else {
            format!("invalid request: {err}")
        };
        ErrorBody::new(ErrorCode::BadRequest, message)
    })
}

/// Answers `request` with `result` as JSON or as the error envelope plus headers.
///
/// A reply the connection cannot carry (over the server's `max_payload`) is replaced by a
/// `too_large` error, so the caller always hears back instead of waiting out its deadline.
pub async fn respond<T: Serialize>(
    request: &Request,
    result: Result<T, ErrorBody>,
) -> Result<(), async_nats::PublishError> {
    respond_coded(request, result).await.1
}

/// [`respond`], also saying which code the caller was answered with (`None`: success).
async fn respond_coded<T: Serialize>(
    request: &Request,
    result: Result<T, ErrorBody>,
) -> (Option<ErrorCode>, Result<(), async_nats::PublishError>) {
    let sent = match result.and_then(|value| {
        serde_json::to_vec(&value).map_err(|e| {
            ErrorBody::new(
                ErrorCode::Internal,
                format!("could not encode the reply: {e}"),
            )
        })
    }) {
        Ok(bytes) => {
            let size = bytes.len();
            match request.respond(Ok(Bytes::from(bytes))).await {
                Err(err)
                    if err.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded =>
                {
                    tracing::warn!(
                        size,
                        "reply over the connection's max_payload; answered too_large"
                    );
                    let err = ErrorBody::new(
                        ErrorCode::TooLarge,
                        format!(
                            "the reply is {size} bytes, more than the bus carries (its \
                             max_payload); ask for less (a smaller limit or page)"
                        ),
                    );
                    return (Some(err.code), respond_error(request, &err).await);
                }
                sent => sent,
            }
        }
        Err(err) => return (Some(err.code), respond_error(request, &err).await),
    };
    (None, sent)
}

/// Sends `err` as the headers plus the JSON envelope, counted in the endpoint's `$SRV.STATS`
/// errors.
async fn respond_error(request: &Request, err: &ErrorBody) -> Result<(), async_nats::PublishError> {
    respond_error_with(request, err, error_payload(err)).await
}

/// Sends `err`'s headers with `payload` as the body (an endpoint whose error replies have a body
/// of their own shape), counted in the endpoint's `$SRV.STATS` errors under its code alone.
pub async fn respond_error_with(
    request: &Request,
    err: &ErrorBody,
    payload: Bytes,
) -> Result<(), async_nats::PublishError> {
    let headers = error_headers(err);
    // `$SRV.STATS` `last_error` is for operators: the code only. The message is the caller's —
    // it may name their session, turn or document (docs/security.md, "Private errors").
    let micro = async_nats::service::error::Error {
        status: err.code.as_str().to_owned(),
        code: usize::from(err.code.status()),
    };
    request
        .respond_error_with_payload(micro, payload, headers)
        .await
}

/// Counts an answered request in `cyrene_requests_total` and times it in
/// `cyrene_request_duration_seconds` (`code`: `None` for success).
pub fn count_request(request: &Request, code: Option<ErrorCode>, started: std::time::Instant) {
    let endpoint = request.endpoint_name().to_owned();
    let code = code.map_or("ok", ErrorCode::as_str);
    metrics::counter!("cyrene_requests_total", "endpoint" => endpoint.clone(), "code" => code)
        .increment(1);
    metrics::histogram!("cyrene_request_duration_seconds", "endpoint" => endpoint, "code" => code)
        .record(started.elapsed().as_secs_f64());
}

/// Room kept in a reply for what surrounds its items: the page's own fields, the JSON envelope,
/// the headers the server adds.
pub const REPLY_SLACK: usize = 8 * 1024;

/// The largest reply `client`'s connection carries, less [`REPLY_SLACK`]: the byte budget of a
/// page of results. The server's `max_payload` when known, else the NATS default (1 MiB).
pub fn reply_budget(client: &async_nats::Client) -> usize {
    guard::max_payload(client).saturating_sub(REPLY_SLACK)
}

/// The longest prefix of `items` whose JSON fits in `budget` bytes (always at least one item: a
/// single item too large for the bus is answered `too_large` by [`respond`]), and whether any
/// item was left out.
pub fn page_within<T: Serialize>(mut items: Vec<T>, budget: usize) -> (Vec<T>, bool) {
    let mut used = 0usize;
    let mut keep = 0usize;
    for item in &items {
        // `,` between items; an item that cannot be encoded is left to the reply to report.
        let size = serde_json::to_vec(item).map_or(0, |v| v.len()) + 1;
        if keep > 0 && used + size > budget {
            break;
        }
        used += size;
        keep += 1;
    }
    let cut = keep < items.len();
    items.truncate(keep);
    (items, cut)
}

/// What a handler sees besides the decoded body.
#[derive(Debug, Clone)]
pub struct RequestContext {
    /// The request subject (useful on wildcard endpoints).
    pub subject: String,
    /// The request headers (trace context, `Cyrene-Tool-Call-Id`, …).
    pub headers: HeaderMap,
}

/// Limits for [`serve_json`], and the answers that are not failures.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    pub max_in_flight: usize,
    pub max_payload: usize,
    /// Error codes this endpoint answers as a normal outcome (the checkpoint store's `latest` of
    /// a turn with no checkpoint yet is `not_found`): the reply is the same on the wire —
    /// error headers and envelope — but it is not counted in `$SRV.STATS` errors, and
    /// `cyrene_requests_total` counts it as `ok` (docs/operations.md, "Metrics").
    pub expected: &'static [ErrorCode],
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            max_in_flight: 256,
            max_payload: guard::DEFAULT_MAX_PAYLOAD,
            expected: &[],
        }
    }
}

/// Serves one endpoint until `shutdown` fires, then lets in-flight handlers finish.
///
/// Each request is decoded as `Req` (errors answered without calling `handler`), handled in its
/// own task under a span parented by the caller's trace context, and answered.
pub async fn serve_json<Req, Resp, F, Fut>(
    endpoint: Endpoint,
    options: ServeOptions,
    shutdown: CancellationToken,
    handler: F,
) where
    Req: DeserializeOwned + Send + 'static,
    Resp: Serialize + Send + 'static,
    F: Fn(Req, RequestContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ErrorBody>> + Send + 'static,
{
    let handler = Arc::new(handler);
    serve_requests(endpoint, options.max_in_flight, shutdown, move |request| {
        handle(
            request,
            handler.clone(),
            options.max_payload,
            options.expected,
        )
    })
    .await;
}

/// The serving loop under [`serve_json`], for endpoints that answer the raw [`Request`]
/// themselves (a streamed reply, say): each request goes to `handle` in its own task, at most
/// `max_in_flight` at once, until `shutdown` fires; then the endpoint is unsubscribed, what was
/// already delivered is handled too, and every task is awaited.
pub async fn serve_requests<F, Fut>(
    mut endpoint: Endpoint,
    max_in_flight: usize,
    shutdown: CancellationToken,
    handle: F,
) where
    F: Fn(Request) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(max_in_flight.max(1)));
    let mut tasks = JoinSet::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let request = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = endpoint.next() => match next {
                Some(r) => r,
                None => break,
            },
        };
        // Reap finished tasks so the set does not grow with the request count.
        while tasks.try_join_next().is_some() {}
        let handled = handle(request);
        tasks.spawn(async move {
            let _permit: OwnedSemaphorePermit = permit;
            handled.await
        });
    }
    // Unsubscribe, then answer what was already delivered to us: a request that reached this
    // process is handled, not dropped.
    if let Err(err) = endpoint.stop().await {
        tracing::warn!(error = %err, "could not unsubscribe the endpoint");
    }
    while let Ok(Some(request)) = tokio::time::timeout(DRAIN_WAIT, endpoint.next()).await {
        tasks.spawn(handle(request));
    }
    while tasks.join_next().await.is_some() {}
}

/// How long shutdown waits for requests already on their way to this process.
const DRAIN_WAIT: Duration = Duration::from_millis(200);

async fn handle<Req, Resp, F, Fut>(
    request: Request,
    handler: Arc<F>,
    max_payload: usize,
    expected: &'static [ErrorCode],
) where
    Req: DeserializeOwned,
    Resp: Serialize,
    F: Fn(Req, RequestContext) -> Fut,
    Fut: Future<Output = Result<Resp, ErrorBody>>,
{
    let started = std::time::Instant::now();
    let subject = request.message.subject.to_string();
    let span = tracing::info_span!("request", subject = %subject, trace_id = tracing::field::Empty);
    trace::set_parent(&span, request.message.headers.as_ref());
    async {
        let result = match decode::<Req>(&request.message.payload, max_payload) {
            Ok(body) => {
                let headers = request.message.headers.clone().unwrap_or_default();
                handler(body, RequestContext { subject, headers }).await
            }
            Err(err) => Err(err),
        };
        let (code, sent) = match result {
            Err(err) if expected.contains(&err.code) => {
                let headers = error_headers(&err);
                let sent = request
                    .respond_with_headers(Ok(error_payload(&err)), headers)
                    .await;
                (None, sent)
            }
            result => {
                if let Err(err) = &result {
                    tracing::debug!(code = %err.code, message = %err.message, "request failed");
                }
                respond_coded(&request, result).await
            }
        };
        if let Err(err) = sent {
            tracing::warn!(error = %err, "could not send the reply");
        }
        count_request(&request, code, started);
    }
    .instrument(span)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Body {
        id: String,
    }

    #[test]
    fn decode_maps_each_bad_input_to_a_code() {
        assert!(decode::<Body>(br#"{"id":"a"}"#, 100).is_ok());
        assert_eq!(
            decode::<Body>(b"{", 100).unwrap_err().code,
            ErrorCode::BadRequest
        );
        assert_eq!(
            decode::<Body>(br#"{"id":1}"#, 100).unwrap_err().code,
            ErrorCode::BadRequest
        );
        let unknown = decode::<Body>(br#"{"id":"a","x":1}"#, 100).unwrap_err();
        assert!(
            unknown.message.contains("unknown field"),
            "{}",
            unknown.message
        );
        assert!(
            decode::<Body>(b"  ", 100)
                .unwrap_err()
                .message
                .contains("empty")
        );
        assert_eq!(
            decode::<Body>(&[b' '; 101], 100).unwrap_err().code,
            ErrorCode::TooLarge
        );
    }

    #[test]
    fn pages_stop_at_the_byte_budget_but_never_come_back_empty() {
        let items: Vec<String> = (0..10).map(|i| format!("{i}").repeat(98)).collect();
        // Each item is 100 bytes of JSON (`"…"`) plus a comma.
        let (page, cut) = page_within(items.clone(), 350);
        assert_eq!((page.len(), cut), (3, true));
        let (page, cut) = page_within(items.clone(), 10_000);
        assert_eq!((page.len(), cut), (10, false));
        let (page, cut) = page_within(items, 5);
        assert_eq!(
            (page.len(), cut),
            (1, true),
            "one item even when it alone is over"
        );
        let (page, cut) = page_within(Vec::<String>::new(), 5);
        assert!(page.is_empty() && !cut);
    }

    #[test]
    fn error_headers_carry_status_and_a_one_line_message() {
        let headers = error_headers(&ErrorBody::new(ErrorCode::NotFound, "no\nsuch"));
        assert_eq!(
            headers.get(NATS_SERVICE_ERROR_CODE).map(|v| v.as_str()),
            Some("404")
        );
        assert_eq!(
            headers.get(NATS_SERVICE_ERROR).map(|v| v.as_str()),
            Some("no such")
        );
        // Echoed junk never panics the reply: line breaks, controls, a megabyte (cut to the bound).
        let huge = "é".repeat(1 << 19);
        for message in [
            "\r",
            "a\r\n\r\nInjected: yes",
            "\0\u{7f}\u{2028}",
            huge.as_str(),
        ] {
            let headers = error_headers(&ErrorBody::new(ErrorCode::BadRequest, message));
            let text = headers.get(NATS_SERVICE_ERROR).unwrap().as_str();
            assert!(!text.contains(['\r', '\n']), "{text:.40}");
            assert!(text.len() <= cyrene_protocol::error::MAX_ERROR_MESSAGE_BYTES);
        }
    }
}
