//! The streamed answer: OpenAI's server-sent `chat.completion.chunk` events from the gateway's
//! deltas.
//!
//! # Invariants
//! - The HTTP status waits for the first delta or the outcome: a call that fails before any
//!   output (after every fallback) is an ordinary error response, not a stream.
//! - Once streaming, every event is written in order, deltas already received go out in one
//!   write, and the stream always ends with the finish (or `error`) event and `data: [DONE]`.
//! - The call runs inside the answer (no task of its own): a client that leaves drops the
//!   answer, and with it the call and its upstream request.
//!
//! # Pitfalls
//! - The call is polled only while hyper asks for more of the body, so a client that reads
//!   slowly slows the upstream read with it (backpressure, as through a proxy) instead of piling
//!   deltas up here. The call's deadline keeps running meanwhile: a client that has not read
//!   the whole reply by then may get the deadline's `error` event after what it did read.

use super::wire::{finish_reason, now_secs, usage};
use super::{Admitted, AppState, error_response};
use crate::providers::{DeltaSink, caught, until_delta};
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use cyrene_protocol::ErrorBody;
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::stream::Delta;
use serde_json::{Value, json};
use std::future::Future;
use std::pin::Pin;
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
    let (sink, deltas) = DeltaSink::new();
    // A panic in the call is its outcome (an `error` event or status), not the connection's.
    let call = caught(async move { state.gateway.call(&state.client, &req, Some(&sink)).await });
    // Held by the answer until its last byte: when the client leaves (the body is dropped, or
    // this future before the first delta), the call — and its upstream request — is dropped, and
    // the admission freed.
    let mut live = Live {
        chunks: Chunks::new(id, model, include_usage),
        call: Call::Running(Box::pin(call)),
        deltas,
        out: String::new(),
        _admitted: admitted,
    };
    live.wait().await;
    if live.out.is_empty()
        && let Some(outcome) = live.closing()
    {
        return match outcome {
            Err(err) => error_response(&err),
            // Succeeded without a delta (an empty answer): stream anyway.
            Ok(response) => sse_response(Body::from(live.chunks.finish_all(Ok(response)))),
        };
    }
    let opening = live
        .chunks
        .event(json!({"role": "assistant", "content": ""}), None);
    live.out.insert_str(0, &opening);
    let stream = futures::stream::unfold(live, |mut live| async move {
        if matches!(live.call, Call::Closed) {
            return None;
        }
        if live.out.is_empty() {
            live.wait().await;
        }
        if let Some(outcome) = live.closing() {
            let end = live.chunks.finish_all(outcome);
            live.out.push_str(&end);
        }
        let bytes = Bytes::from(std::mem::take(&mut live.out));
        Some((Ok::<_, std::convert::Infallible>(bytes), live))
    });
    sse_response(Body::from_stream(stream))
}

type Outcome = Result<ModelResponse, ErrorBody>;

/// Where a streamed answer's call is.
enum Call {
    /// Polled as the answer is written.
    Running(Pin<Box<dyn Future<Output = Outcome> + Send>>),
    /// Over, its closing events not written yet.
    Over(Box<Outcome>),
    /// The closing events are written (or the answer went out whole).
    Closed,
}

/// A streamed answer in progress. The call is polled by the task writing the answer, not
/// spawned: a delta reaches the client's socket without a hand-off between threads
/// (docs/performance.md, "One task a streamed call"). Dropping it drops the call.
struct Live {
    chunks: Chunks,
    call: Call,
    deltas: tokio::sync::mpsc::UnboundedReceiver<Delta>,
    /// Events rendered and not yet written.
    out: String,
    _admitted: Admitted,
}

impl Live {
    /// Waits until a delta arrives or the call is over; renders every delta already there.
    async fn wait(&mut self) {
        self.drain();
        if !self.out.is_empty() {
            return;
        }
        let Call::Running(call) = &mut self.call else {
            return;
        };
        if let Some(outcome) = until_delta(call, &self.deltas).await {
            self.call = Call::Over(Box::new(outcome));
        }
        // What the call made while it was polled (all of it, when it is over) goes out together.
        self.drain();
    }

    /// The outcome of a call that is over, its answer closed from now on; `None` while it runs.
    fn closing(&mut self) -> Option<Outcome> {
        if !matches!(self.call, Call::Over(_)) {
            return None;
        }
        match std::mem::replace(&mut self.call, Call::Closed) {
            Call::Over(outcome) => Some(*outcome),
            _ => None,
        }
    }

    fn drain(&mut self) {
        while let Ok(delta) = self.deltas.try_recv() {
            let event = self.chunks.delta(delta);
            self.out.push_str(&event);
        }
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
