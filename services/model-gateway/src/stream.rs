//! The streamed variant of `cyrene.model.complete` on the bus: endpoint `complete_stream` on
//! `cyrene.model.complete.stream` (docs/model-gateway.md, "Streaming").
//!
//! The caller subscribes to an inbox of its own and publishes the usual [`ModelRequest`] with
//! that inbox as the reply subject. The gateway publishes one [`StreamChunk`] per delta (of the
//! kinds the caller wants, [`DELTAS_HEADER`]) on the inbox as the provider produces it, then the
//! end marker (`done` with the whole response, or
//! `error`) as the micro reply — so `$SRV.STATS` counts the request and its errors like any
//! other, and the end marker carries the `Nats-Service-Error` headers too.
//!
//! # Invariants
//! - `seq` counts every message of one call from 0 without gaps; the end marker is last.
//! - Every request gets exactly one end marker (a malformed one too: `seq` 0, `bad_request`).
//! - **Every stream ends** (issue 30, M7): a caller's reply permission allows a bounded number
//!   of messages (`allow_responses: {max: 100000}` in deploy/nats/users.conf), so the deltas of
//!   one call stay far below it. Deltas that are already waiting go out merged as one message
//!   ([`coalesce`]); after [`EAGER_MESSAGES`] messages, at most one goes out per
//!   [`LATE_FLUSH_EVERY`]; past [`MAX_DELTA_MESSAGES`] no more deltas are published (the end
//!   marker's `done` holds the whole answer). So the end marker always fits in the permission.
//! - The call record is published exactly as for the non-streamed call ([`Gateway::call`]).
//! - A caller that asked for heartbeats ([`HEARTBEAT_HEADER`]) gets one whenever nothing was
//!   published for the asked interval while the call runs, the first one interval after the
//!   call started (none at all for a call that answers sooner); when this replica dies they
//!   stop, which is how the caller notices it (docs/model-gateway.md, "A replica that dies
//!   mid-call").
//!
//! # Pitfalls
//! - Core NATS does not redeliver: a caller too slow for its deltas loses some and sees a gap in
//!   `seq`. The end marker's `done` always holds the whole answer, so nothing is lost for good.

use crate::Gateway;
use crate::providers::{DeltaSink, caught, until_delta};
use async_nats::service::Request;
use bytes::Bytes;
use cyrene_bus::service::{count_request, respond_error_with};
use cyrene_protocol::model::ModelRequest;
use cyrene_protocol::stream::{
    DELTAS_HEADER, Delta, DeltaKinds, HEARTBEAT_HEADER, HEARTBEAT_MAX_MS, HEARTBEAT_MIN_MS,
    StreamChunk,
};
use cyrene_protocol::{ErrorBody, ErrorCode};
use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument;

/// Delta messages of one call published as soon as they are there.
pub const EAGER_MESSAGES: u64 = 10_000;
/// After [`EAGER_MESSAGES`], deltas are gathered and sent at most this often.
pub const LATE_FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(250);
/// The most delta messages of one call: half the reply permission's `max` (100,000), so the
/// end marker always gets through.
pub const MAX_DELTA_MESSAGES: u64 = 50_000;

/// `deltas` with each run of neighbours that continue one another merged into one: text with
/// text, reasoning with reasoning, a tool call's arguments with the same call's delta before.
pub fn coalesce(deltas: Vec<Delta>) -> Vec<Delta> {
    let mut out: Vec<Delta> = Vec::with_capacity(deltas.len().min(4));
    for delta in deltas {
        let merged = match (out.last_mut(), &delta) {
            (Some(Delta::Text { text }), Delta::Text { text: more })
            | (Some(Delta::Reasoning { text }), Delta::Reasoning { text: more }) => {
                text.push_str(more);
                true
            }
            (
                Some(Delta::ToolCall { index, args, .. }),
                Delta::ToolCall {
                    index: next,
                    id,
                    name,
                    args: more,
                },
            ) if index == next && id.is_empty() && name.is_empty() => {
                args.push_str(more);
                true
            }
            _ => false,
        };
        if !merged {
            out.push(delta);
        }
    }
    out
}

/// Answers one streamed request: the deltas on its reply inbox, then the end marker as the micro
/// reply (the bounded loop around it is the host's, [`cyrene_bus::host::Endpoint::raw`]).
pub async fn handle(
    request: Request,
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    max_payload: usize,
) {
    let started = std::time::Instant::now();
    let span = tracing::info_span!("stream", subject = %request.message.subject);
    cyrene_bus::trace::set_parent(&span, request.message.headers.as_ref());
    async {
        let Some(inbox) = request.message.reply.clone() else {
            tracing::debug!("streamed request without a reply subject ignored");
            return;
        };
        let payload = &request.message.payload;
        let (seq, result, replica) = match gateway.views.decode(payload, max_payload) {
            Err(err) => (0, Err(err), None),
            Ok(mut req) => match gateway.views.resolve(&mut req, payload.len()) {
                Err(err) => (0, Err(err), None),
                Ok(held) => {
                    let heartbeat = heartbeat_of(&request);
                    let kinds = kinds_of(&request);
                    let (seq, result, req) =
                        forward(&gateway, &client, req, &inbox, heartbeat, kinds).await;
                    let replica = match held {
                        Some(held) => {
                            gateway.views.hold(held, req.messages);
                            Some(gateway.replica.clone())
                        }
                        None => None,
                    };
                    (seq, result, replica)
                }
            },
        };
        let code = result.as_ref().err().map(|err| err.code);
        end(&request, seq, result, replica).await;
        count_request(&request, code, started);
    }
    .instrument(span)
    .await
}

/// The heartbeat interval the caller asked for ([`HEARTBEAT_HEADER`], milliseconds, clamped);
/// `None` when it asked for none or the value is no number.
fn heartbeat_of(request: &Request) -> Option<Duration> {
    let value = request.message.headers.as_ref()?.get(HEARTBEAT_HEADER)?;
    let ms: u64 = value.as_str().trim().parse().ok()?;
    Some(Duration::from_millis(
        ms.clamp(HEARTBEAT_MIN_MS, HEARTBEAT_MAX_MS),
    ))
}

/// The kinds of delta the caller wants ([`DELTAS_HEADER`]); every kind without the header.
fn kinds_of(request: &Request) -> DeltaKinds {
    match request
        .message
        .headers
        .as_ref()
        .and_then(|h| h.get(DELTAS_HEADER))
    {
        Some(value) => DeltaKinds::parse(value.as_str()),
        None => DeltaKinds::ALL,
    }
}

/// What woke the forwarding loop.
enum Next {
    /// The call passed on deltas.
    Deltas,
    /// The call is over with this outcome; every delta it made is already in the channel.
    Done(Box<Result<cyrene_protocol::model::ModelResponse, ErrorBody>>),
    /// Gathered deltas are due (after [`EAGER_MESSAGES`]).
    Flush,
    /// Nothing was published for the heartbeat interval.
    Beat,
}

/// Runs the call, publishing each delta of a wanted kind on `inbox` as it comes, and a heartbeat
/// whenever `heartbeat` passed without one; the next `seq`, the outcome and the request back.
///
/// The call is polled by this task, not spawned: a delta reaches the bus without a hand-off
/// between threads (one wake-up fewer a call, docs/performance.md "One task a streamed call").
/// While a delta is being published the call is not polled, so a caller's slow inbox slows the
/// upstream read rather than piling deltas up here; deltas made in one poll go out coalesced.
async fn forward(
    gateway: &Arc<Gateway>,
    client: &async_nats::Client,
    req: ModelRequest,
    inbox: &async_nats::Subject,
    heartbeat: Option<Duration>,
    kinds: DeltaKinds,
) -> (
    u64,
    Result<cyrene_protocol::model::ModelResponse, ErrorBody>,
    ModelRequest,
) {
    let mut seq = 0u64;
    // No heartbeat goes out as the call starts: the first one is due one interval after it, and
    // only if nothing else was published by then. A call that answers within one interval (a
    // tool round of a fast model) sends none; the caller's first-message grace is ten intervals.
    let (sink, mut deltas) = DeltaSink::new();
    let result = {
        // A panic in the call is its outcome: the caller still gets its end marker.
        let mut call = std::pin::pin!(caught(gateway.call(client, &req, Some(&sink))));
        // A far deadline stands for "no heartbeats": the branch never fires.
        let every = heartbeat.unwrap_or(Duration::from_secs(86_400));
        let mut beat = tokio::time::Instant::now() + every;
        let mut pending: Vec<Delta> = Vec::new();
        let mut last_flush = tokio::time::Instant::now();
        let mut withheld = 0u64;
        // Ends when the call is over and what it made is published.
        let result = loop {
            let late = seq >= EAGER_MESSAGES;
            let gathering = late && !pending.is_empty();
            let next = tokio::select! {
                biased;
                done = until_delta(&mut call, &deltas) => match done {
                    Some(result) => Next::Done(Box::new(result)),
                    None => Next::Deltas,
                },
                _ = tokio::time::sleep_until(last_flush + LATE_FLUSH_EVERY), if gathering => Next::Flush,
                _ = tokio::time::sleep_until(beat) => Next::Beat,
            };
            let outcome = match next {
                Next::Deltas | Next::Flush => None,
                Next::Done(result) => Some(*result),
                Next::Beat => {
                    publish(client, inbox, &StreamChunk::heartbeat(seq)).await;
                    seq += 1;
                    beat = tokio::time::Instant::now() + every;
                    continue;
                }
            };
            // A delta the caller does not want is never published (nor counted in `seq`).
            while let Ok(delta) = deltas.try_recv() {
                pending.extend(Some(delta).filter(|d| kinds.wants(d)));
            }
            let due = !late || outcome.is_some() || last_flush.elapsed() >= LATE_FLUSH_EVERY;
            if due && !pending.is_empty() {
                for delta in coalesce(std::mem::take(&mut pending)) {
                    if seq >= MAX_DELTA_MESSAGES {
                        withheld += 1;
                        continue;
                    }
                    publish(client, inbox, &StreamChunk::delta(seq, delta)).await;
                    seq += 1;
                }
                last_flush = tokio::time::Instant::now();
                beat = last_flush + every;
            }
            if let Some(result) = outcome {
                break result;
            }
        };
        if withheld > 0 {
            tracing::warn!(
                withheld,
                "a streamed call reached its delta message limit; the rest is in the end marker"
            );
        }
        result
    };
    (seq, result, req)
}

async fn publish(client: &async_nats::Client, inbox: &async_nats::Subject, chunk: &StreamChunk) {
    let payload = match serde_json::to_vec(chunk) {
        Ok(p) => p,
        Err(err) => {
            tracing::warn!(error = %err, "cannot encode a stream chunk");
            return;
        }
    };
    if let Err(err) = client.publish(inbox.clone(), payload.into()).await {
        tracing::warn!(error = %err, "cannot publish a stream chunk");
    }
}

/// The end marker as the micro reply: `done` (with the replica holding the call's view, if it
/// named one), or `error` with the service-error headers.
async fn end(
    request: &Request,
    seq: u64,
    result: Result<cyrene_protocol::model::ModelResponse, ErrorBody>,
    replica: Option<String>,
) {
    let err = match result {
        Ok(response) => {
            let mut done = StreamChunk::done(seq, response);
            done.replica = replica;
            let bytes = serde_json::to_vec(&done).unwrap_or_default();
            let size = bytes.len();
            match request.respond(Ok(Bytes::from(bytes))).await {
                Ok(()) => return,
                Err(err)
                    if err.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded =>
                {
                    ErrorBody::new(
                        ErrorCode::TooLarge,
                        format!("the response is {size} bytes, more than the bus carries"),
                    )
                }
                Err(err) => {
                    tracing::warn!(error = %err, "could not send the end marker");
                    return;
                }
            }
        }
        Err(err) => err,
    };
    let payload = serde_json::to_vec(&StreamChunk::error(seq, err.clone())).unwrap_or_default();
    if let Err(e) = respond_error_with(request, &err, payload.into()).await {
        tracing::warn!(error = %e, "could not send the error end marker");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str) -> Delta {
        Delta::Text { text: t.into() }
    }

    fn call(index: u32, id: &str, args: &str) -> Delta {
        Delta::ToolCall {
            index,
            id: id.into(),
            name: if id.is_empty() {
                String::new()
            } else {
                "f".into()
            },
            args: args.into(),
        }
    }

    #[test]
    fn neighbouring_deltas_that_continue_each_other_are_merged() {
        let reasoning = Delta::Reasoning { text: "r".into() };
        assert_eq!(
            coalesce(vec![
                text("a"),
                text("b"),
                reasoning.clone(),
                reasoning,
                text("c"),
                call(0, "c0", "{"),
                call(0, "", "}"),
                call(1, "c1", ""),
                call(1, "", "{}"),
            ]),
            vec![
                text("ab"),
                Delta::Reasoning { text: "rr".into() },
                text("c"),
                call(0, "c0", "{}"),
                call(1, "c1", "{}"),
            ]
        );
        assert!(coalesce(Vec::new()).is_empty());
    }
}
