//! The streamed answer: OpenAI's server-sent `chat.completion.chunk` events from the gateway's
//! deltas.
//!
//! # Invariants
//! - The HTTP status waits for the first delta or the outcome: a call that fails before any
//!   output (after every fallback) is an ordinary error response, not a stream.
//! - Once streaming, every event is written in order, deltas already received go out in one
//!   write, and the stream always ends with the finish (or `error`) event and `data: [DONE]`.

use super::wire::{finish_reason, now_secs, usage};
use super::{Admitted, AppState, error_response};
use crate::providers::DeltaSink;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::stream::Delta;
use cyrene_protocol::{ErrorBody, ErrorCode};
use serde_json::{Value, json};
use std::sync::Arc;

/// A streamed call: the HTTP status waits for the first delta or the outcome, so a call that
/// fails before any output (after every fallback) is an ordinary error response.
pub(super) async fn stream_response(
    state: Arc<AppState>,
    req: ModelRequest,
    id: String,
    model: String,
    include_usage: bool,
    admitted: Admitted,
) -> Response {
    let (sink, mut deltas) = DeltaSink::new();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let call = tokio::spawn(async move {
        let result = state.gateway.call(&state.client, &req, Some(&sink)).await;
        drop(sink);
        let _ = done_tx.send(result);
    });
    // Held by the answer until its last byte: when the client leaves (the body is dropped, or
    // this future before the first delta), the call — and its upstream request — is aborted,
    // and the admission freed.
    let held = Held {
        call: call.abort_handle(),
        _admitted: admitted,
    };
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
        (chunks, Some(first), deltas, Some(done_rx), true, held),
        |(mut chunks, pending, mut deltas, done, opening, held)| async move {
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
                    (chunks, None, deltas, done, false, held),
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
                        (chunks, None, deltas, Some(done), false, held),
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
                    Some((
                        Ok(Bytes::from(out)),
                        (chunks, None, deltas, None, false, held),
                    ))
                }
            }
        },
    );
    sse_response(Body::from_stream(stream))
}

/// A streamed answer's hold on its call and its admission; dropping it aborts the call.
struct Held {
    call: tokio::task::AbortHandle,
    _admitted: Admitted,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.call.abort();
    }
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
