//! The caller's side of the streamed model call (`cyrene.model.complete.stream`,
//! docs/model-gateway.md "Streaming"): a fresh inbox, the request published with it as the reply
//! subject, deltas handed to the caller in `seq` order, and the end marker's response returned.
//!
//! # Invariants
//! - A gap in `seq` (a delta lost to a slow subscription) is an error of the call, never silently
//!   skipped: the caller would show text with a hole in it.
//! - The subscription is dropped (unsubscribed) when the call returns, however it returns.

use crate::request::{self, RequestError};
use crate::{service, trace};
use async_nats::Client;
use async_nats::StatusCode;
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::stream::{Delta, StreamChunk};
use cyrene_protocol::subjects;
use futures::StreamExt;
use std::time::Duration;
use tokio::time::Instant;

/// Streams `request` through the gateway, calling `on_delta` for each delta in order, and
/// returns the whole response, all within `timeout`.
pub async fn complete_stream(
    client: &Client,
    request: &ModelRequest,
    timeout: Duration,
    mut on_delta: impl FnMut(u64, Delta),
) -> Result<ModelResponse, RequestError> {
    let subject = subjects::MODEL_COMPLETE_STREAM;
    let payload = serde_json::to_vec(request).map_err(RequestError::Encode)?;
    request::check_outgoing(client, payload.len())?;
    let transport = |e: &dyn std::fmt::Display| RequestError::Transport {
        subject: subject.to_owned(),
        message: e.to_string(),
    };
    let deadline = Instant::now() + timeout;
    let inbox = client.new_inbox();
    let mut replies = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| transport(&e))?;
    client
        .publish_with_reply_and_headers(subject, inbox, trace::current_headers(), payload.into())
        .await
        .map_err(|e| transport(&e))?;
    let mut expected = 0u64;
    loop {
        let message = match tokio::time::timeout_at(deadline, replies.next()).await {
            Err(_) => {
                return Err(RequestError::Timeout {
                    subject: subject.to_owned(),
                    after: timeout,
                });
            }
            Ok(None) => return Err(transport(&"the reply subscription closed")),
            Ok(Some(message)) => message,
        };
        if message.status == Some(StatusCode::NO_RESPONDERS) {
            return Err(RequestError::NoResponders {
                subject: subject.to_owned(),
            });
        }
        let chunk: StreamChunk = match serde_json::from_slice(&message.payload) {
            Ok(chunk) => chunk,
            // A peer that answers with headers and no chunk body.
            Err(source) => match service::error_from_message(&message) {
                Some(body) => return Err(RequestError::Remote(body)),
                None => {
                    return Err(RequestError::Decode {
                        subject: subject.to_owned(),
                        source,
                    });
                }
            },
        };
        if chunk.seq != expected {
            return Err(transport(&format!(
                "stream chunk {} arrived when {expected} was expected (a delta was lost)",
                chunk.seq
            )));
        }
        expected += 1;
        if let Some(error) = chunk.error {
            return Err(RequestError::Remote(error));
        }
        if let Some(done) = chunk.done {
            return Ok(*done);
        }
        if let Some(delta) = chunk.delta {
            on_delta(chunk.seq, delta);
        }
    }
}
