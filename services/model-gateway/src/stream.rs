//! The streamed variant of `cyrene.model.complete` on the bus: endpoint `complete_stream` on
//! `cyrene.model.complete.stream` (docs/model-gateway.md, "Streaming").
//!
//! The caller subscribes to an inbox of its own and publishes the usual [`ModelRequest`] with
//! that inbox as the reply subject. The gateway publishes one [`StreamChunk`] per delta on the
//! inbox as the provider produces it, then the end marker (`done` with the whole response, or
//! `error`) as the micro reply — so `$SRV.STATS` counts the request and its errors like any
//! other, and the end marker carries the `Nats-Service-Error` headers too.
//!
//! # Invariants
//! - `seq` counts every message of one call from 0 without gaps; the end marker is last.
//! - Every request gets exactly one end marker (a malformed one too: `seq` 0, `bad_request`).
//! - The call record is published exactly as for the non-streamed call ([`Gateway::call`]).
//!
//! # Pitfalls
//! - Core NATS does not redeliver: a caller too slow for its deltas loses some and sees a gap in
//!   `seq`. The end marker's `done` always holds the whole answer, so nothing is lost for good.

use crate::Gateway;
use crate::providers::DeltaSink;
use async_nats::service::endpoint::Endpoint;
use async_nats::service::{NATS_SERVICE_ERROR, Request};
use bytes::Bytes;
use cyrene_bus::service::{ServeOptions, decode, error_headers};
use cyrene_protocol::model::ModelRequest;
use cyrene_protocol::stream::StreamChunk;
use cyrene_protocol::{ErrorBody, ErrorCode};
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How long shutdown waits for requests already on their way to this process.
const DRAIN_WAIT: Duration = Duration::from_millis(200);

/// Serves `endpoint` until `shutdown`, then finishes the calls already received.
pub async fn serve_stream(
    mut endpoint: Endpoint,
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    options: ServeOptions,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(options.max_in_flight.max(1)));
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
        while tasks.try_join_next().is_some() {}
        tasks.spawn(handle(
            request,
            gateway.clone(),
            client.clone(),
            options.max_payload,
            Some(permit),
        ));
    }
    if let Err(err) = endpoint.stop().await {
        tracing::warn!(error = %err, "could not unsubscribe the stream endpoint");
    }
    while let Ok(Some(request)) = tokio::time::timeout(DRAIN_WAIT, endpoint.next()).await {
        tasks.spawn(handle(
            request,
            gateway.clone(),
            client.clone(),
            options.max_payload,
            None,
        ));
    }
    while tasks.join_next().await.is_some() {}
}

async fn handle(
    request: Request,
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    max_payload: usize,
    permit: Option<OwnedSemaphorePermit>,
) {
    let _permit = permit;
    let started = std::time::Instant::now();
    let span = tracing::info_span!("stream", subject = %request.message.subject);
    cyrene_bus::trace::set_parent(&span, request.message.headers.as_ref());
    async {
        let Some(inbox) = request.message.reply.clone() else {
            tracing::debug!("streamed request without a reply subject ignored");
            return;
        };
        let (seq, result) = match decode::<ModelRequest>(&request.message.payload, max_payload) {
            Err(err) => (0, Err(err)),
            Ok(req) => forward(&gateway, &client, req, &inbox).await,
        };
        let code = match &result {
            Ok(_) => "ok",
            Err(err) => err.code.as_str(),
        };
        end(&request, seq, result).await;
        metrics::counter!("cyrene_requests_total", "endpoint" => crate::STREAM_ENDPOINT_NAME, "code" => code)
            .increment(1);
        metrics::histogram!("cyrene_request_duration_seconds", "endpoint" => crate::STREAM_ENDPOINT_NAME, "code" => code)
            .record(started.elapsed().as_secs_f64());
    }
    .instrument(span)
    .await
}

/// Runs the call in a task of its own, publishing each delta on `inbox` as it comes (so a burst
/// of provider events never holds up the first delta); the next `seq` and the outcome.
async fn forward(
    gateway: &Arc<Gateway>,
    client: &async_nats::Client,
    req: ModelRequest,
    inbox: &async_nats::Subject,
) -> (
    u64,
    Result<cyrene_protocol::model::ModelResponse, ErrorBody>,
) {
    let (sink, mut deltas) = DeltaSink::new();
    let call = tokio::spawn({
        let (gateway, client) = (gateway.clone(), client.clone());
        async move { gateway.call(&client, &req, Some(&sink)).await }
    });
    let mut seq = 0u64;
    // Ends when the call is over and its sink dropped.
    while let Some(delta) = deltas.recv().await {
        publish(client, inbox, &StreamChunk::delta(seq, delta)).await;
        seq += 1;
    }
    let result = call.await.unwrap_or_else(|e| {
        Err(ErrorBody::new(
            ErrorCode::Internal,
            format!("the call task failed: {e}"),
        ))
    });
    (seq, result)
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

/// The end marker as the micro reply: `done`, or `error` with the service-error headers.
async fn end(
    request: &Request,
    seq: u64,
    result: Result<cyrene_protocol::model::ModelResponse, ErrorBody>,
) {
    let err = match result {
        Ok(response) => {
            let bytes = serde_json::to_vec(&StreamChunk::done(seq, response)).unwrap_or_default();
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
    let headers = error_headers(&err);
    let micro = async_nats::service::error::Error {
        status: headers
            .get(NATS_SERVICE_ERROR)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default(),
        code: usize::from(err.code.status()),
    };
    let payload = serde_json::to_vec(&StreamChunk::error(seq, err)).unwrap_or_default();
    if let Err(e) = request
        .respond_error_with_payload(micro, payload.into(), headers)
        .await
    {
        tracing::warn!(error = %e, "could not send the error end marker");
    }
}
