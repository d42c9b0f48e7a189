//! Bounded JSON requests that understand the Cyrene error envelope.

use crate::{guard, service, trace};
use async_nats::client::RequestErrorKind;
use async_nats::{Client, HeaderMap};
use cyrene_protocol::{ErrorBody, ErrorCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Why a request produced no usable reply.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Nobody listens on the subject.
    #[error("no responders on {subject}")]
    NoResponders { subject: String },
    /// Somebody listens but did not answer in time.
    #[error("no reply on {subject} within {after:?}")]
    Timeout { subject: String, after: Duration },
    /// The responder answered with an error envelope.
    #[error("{0}")]
    Remote(ErrorBody),
    /// The request is larger than the server accepts.
    #[error("request is {size} bytes; the server accepts at most {max}")]
    TooLarge { size: usize, max: usize },
    #[error("could not encode the request: {0}")]
    Encode(#[source] serde_json::Error),
    #[error("could not decode the reply from {subject}: {source}")]
    Decode {
        subject: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("request on {subject} failed: {message}")]
    Transport { subject: String, message: String },
    /// A streamed call whose responder went silent mid-call: no message (not even a heartbeat)
    /// for `silent`. The responder died or lost its connection; the call will never end.
    #[error("the responder on {subject} went silent for {silent:?} mid-call (gone)")]
    Vanished { subject: String, silent: Duration },
}

impl RequestError {
    /// The closed-set code this failure maps to when reported further.
    pub fn code(&self) -> ErrorCode {
        match self {
            RequestError::NoResponders { .. }
            | RequestError::Transport { .. }
            | RequestError::Vanished { .. } => ErrorCode::Unavailable,
            RequestError::Timeout { .. } => ErrorCode::Timeout,
            RequestError::Remote(body) => body.code,
            RequestError::TooLarge { .. } => ErrorCode::TooLarge,
            RequestError::Encode(_) | RequestError::Decode { .. } => ErrorCode::Internal,
        }
    }

    /// As an envelope body (for services relaying a downstream failure).
    pub fn to_body(&self) -> ErrorBody {
        match self {
            RequestError::Remote(body) => body.clone(),
            other => ErrorBody::new(other.code(), other.to_string()),
        }
    }
}

/// Refuses a request of `len` bytes that `client`'s server would not accept; else its limit.
pub fn check_outgoing(client: &Client, len: usize) -> Result<usize, RequestError> {
    let max = guard::max_payload(client);
    if len > max {
        return Err(RequestError::TooLarge { size: len, max });
    }
    Ok(max)
}

/// Sends `body` as JSON to `subject` with the current trace context and waits at most `timeout`
/// for a reply, decoding either `Resp` or the error envelope.
pub async fn request_json<Req, Resp>(
    client: &Client,
    subject: &str,
    body: &Req,
    timeout: Duration,
) -> Result<Resp, RequestError>
where
    Req: Serialize + ?Sized,
    Resp: DeserializeOwned,
{
    let payload = serde_json::to_vec(body).map_err(RequestError::Encode)?;
    let reply = request_raw(client, subject, trace::current_headers(), payload, timeout).await?;
    serde_json::from_slice(&reply.payload).map_err(|source| RequestError::Decode {
        subject: subject.to_owned(),
        source,
    })
}

/// Sends raw bytes; a reply carrying the micro error headers becomes [`RequestError::Remote`].
pub async fn request_raw(
    client: &Client,
    subject: &str,
    headers: HeaderMap,
    payload: Vec<u8>,
    timeout: Duration,
) -> Result<async_nats::Message, RequestError> {
    let max = check_outgoing(client, payload.len())?;
    let request = async_nats::Request::new()
        .payload(payload.into())
        .headers(headers)
        .timeout(Some(timeout));
    // The client's own timer is the deadline; the outer one guards against a stuck send queue.
    let sent = tokio::time::timeout(
        timeout + Duration::from_millis(100),
        client.send_request(subject.to_owned(), request),
    )
    .await;
    let message = match sent {
        Err(_) => {
            return Err(RequestError::Timeout {
                subject: subject.to_owned(),
                after: timeout,
            });
        }
        Ok(Err(err)) => {
            return Err(match err.kind() {
                RequestErrorKind::NoResponders => RequestError::NoResponders {
                    subject: subject.to_owned(),
                },
                RequestErrorKind::TimedOut => RequestError::Timeout {
                    subject: subject.to_owned(),
                    after: timeout,
                },
                RequestErrorKind::MaxPayloadExceeded => RequestError::TooLarge {
                    size: usize::MAX,
                    max,
                },
                _ => RequestError::Transport {
                    subject: subject.to_owned(),
                    message: err.to_string(),
                },
            });
        }
        Ok(Ok(message)) => message,
    };
    if let Some(body) = service::error_from_message(&message) {
        return Err(RequestError::Remote(body));
    }
    Ok(message)
}
