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
//!
//! - Hostile clients are bounded (docs/security.md, "The HTTP front door"): connections,
//!   header and body read times, requests in flight and the body bytes they hold
//!   ([`HttpLimits`]); a request without a valid key is answered 401 and its connection closed
//!   at once; a call whose client has left is dropped, and with it the upstream request.
//!
//! This file holds routing, authentication, admission and error responses; `listener.rs` the
//! connections; `wire.rs` the translation between OpenAI's chat JSON and the gateway's request
//! and response; `sse.rs` the streamed answer.

mod listener;
mod sse;
mod wire;

pub use listener::{HttpLimits, descriptor_budget};

use crate::Gateway;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use cyrene_protocol::{ErrorBody, ErrorCode};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
    pub limits: HttpLimits,
}

/// Shared by every request as one `Arc`: axum clones its state for each request, and one `Arc`
/// is cheaper to clone than the NATS client and the key list (a `String` per key).
#[derive(Debug)]
struct AppState {
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    keys: ClientKeys,
    /// One permit per authenticated request in flight ([`HttpLimits::max_requests`]).
    requests: Arc<Semaphore>,
    /// One permit per body byte held ([`HttpLimits::body_budget`]).
    body_bytes: Arc<Semaphore>,
    body_timeout: std::time::Duration,
}

/// What an admitted request holds until its answer is complete (the last byte of a stream).
#[derive(Debug)]
struct Admitted {
    _request: OwnedSemaphorePermit,
    _body: OwnedSemaphorePermit,
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
    let limits = config.limits.within_descriptors();
    let app = router(AppState {
        gateway,
        client,
        keys: config.keys,
        requests: Arc::new(Semaphore::new(limits.max_requests)),
        body_bytes: Arc::new(Semaphore::new(
            limits.body_budget.min(Semaphore::MAX_PERMITS),
        )),
        body_timeout: limits.body_timeout,
    });
    tracing::info!(addr = %bound, max_connections = limits.max_connections,
        max_requests = limits.max_requests, "OpenAI-compatible HTTP front door listening");
    let task = tokio::spawn(listener::accept_loop(listener, app, limits, shutdown));
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
        .with_state(Arc::new(state))
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

/// `response` with `Connection: close`: hyper closes the connection once it is written.
fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    response
}

/// Admits an authenticated request within [`HttpLimits::max_requests`] and
/// [`HttpLimits::body_budget`], counting its `Content-Length` (the largest body when absent);
/// `too_large` past [`MAX_BODY`], 429 when the door is full.
fn admit(state: &AppState, headers: &HeaderMap) -> Result<Admitted, Box<Response>> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > MAX_BODY) {
        return Err(Box::new(closing(error_response(&ErrorBody::new(
            ErrorCode::TooLarge,
            format!("the request body is over {MAX_BODY} bytes"),
        )))));
    }
    let busy = || {
        let mut response = openai_error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            Some("too_many_requests_in_flight"),
            "the front door has as many requests in flight as it takes: retry shortly",
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        metrics::counter!("cyrene_http_refused_total", "reason" => "busy").increment(1);
        Box::new(response)
    };
    let request = state
        .requests
        .clone()
        .try_acquire_owned()
        .map_err(|_| busy())?;
    let bytes = u32::try_from(declared.unwrap_or(MAX_BODY).max(1)).unwrap_or(u32::MAX);
    let body = state
        .body_bytes
        .clone()
        .try_acquire_many_owned(bytes)
        .map_err(|_| busy())?;
    Ok(Admitted {
        _request: request,
        _body: body,
    })
}

fn authorised(state: &AppState, headers: &HeaderMap) -> Result<(), Box<Response>> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(key) if state.keys.accepts(key) => Ok(()),
        Some(_) => Err(Box::new(closing(openai_error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("invalid_api_key"),
            "incorrect API key provided",
        )))),
        None => Err(Box::new(closing(openai_error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            Some("missing_api_key"),
            "no API key provided: send Authorization: Bearer <key>",
        )))),
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

async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(denied) = authorised(&state, &headers) {
        return *denied;
    }
    let data: Vec<Value> = model_ids(&state.gateway)
        .into_iter()
        .map(|(id, owner)| json!({"id": id, "object": "model", "created": 0, "owned_by": owner}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    if let Err(denied) = authorised(&state, &headers) {
        return *denied;
    }
    let admitted = match admit(&state, &headers) {
        Ok(admitted) => admitted,
        Err(refused) => return *refused,
    };
    let read = tokio::time::timeout(state.body_timeout, axum::body::to_bytes(body, MAX_BODY));
    let bytes = match read.await {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => {
            return closing(error_response(&ErrorBody::new(
                ErrorCode::TooLarge,
                format!("the request body is over {MAX_BODY} bytes (or could not be read)"),
            )));
        }
        Err(_) => {
            metrics::counter!("cyrene_http_refused_total", "reason" => "body_timeout").increment(1);
            return closing(openai_error(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                Some("body_timeout"),
                &format!(
                    "the request body did not arrive within {:?}",
                    state.body_timeout
                ),
            ));
        }
    };
    let (req, answer) = match wire::parse(&bytes, &state.gateway) {
        Ok(parsed) => parsed,
        Err(err) => return error_response(&err),
    };
    let id = format!("chatcmpl-{}", uuid::Uuid::now_v7().simple());
    if !answer.stream {
        // Dropped with this future when the client leaves (hyper drops a request's future when
        // its connection closes), and the upstream request with it.
        let answer = match state.gateway.call(&state.client, &req, None).await {
            Ok(response) => axum::Json(wire::completion(&id, &response)).into_response(),
            Err(err) => error_response(&err),
        };
        drop(admitted);
        return answer;
    }
    sse::stream_response(state, req, id, answer.model, answer.include_usage, admitted).await
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
}
