//! Reading a provider's Server-Sent Events stream: events are parsed by `eventsource-stream`
//! (never by hand), each JSON `data:` handed to the dialect, and the whole read bounded by the
//! attempt's deadline.
//!
//! # Invariants
//! - A stream that breaks (transport error, bytes that are not UTF-8 or not SSE) or passes the
//!   deadline is a [`ProviderError`] like any other; whether the router may still fall back is
//!   the router's decision (only before the first delta, docs/model-gateway.md "Streaming").

use super::ProviderError;
use eventsource_stream::{Event, Eventsource};
use futures::{Stream, StreamExt};
use std::pin::Pin;
use tokio::time::Instant;

type Events = Pin<
    Box<
        dyn Stream<Item = Result<Event, eventsource_stream::EventStreamError<reqwest::Error>>>
            + Send,
    >,
>;

/// The events of one streamed reply.
pub(crate) struct SseReader {
    events: Events,
    deadline: Instant,
    started: Instant,
}

impl SseReader {
    /// Reads `response`'s body as SSE until `deadline`; `started` is when the attempt began.
    pub(crate) fn new(response: reqwest::Response, started: Instant, deadline: Instant) -> Self {
        SseReader {
            events: Box::pin(response.bytes_stream().eventsource()),
            deadline,
            started,
        }
    }

    /// The next event with data (comments and keep-alives skipped); `None` at the end of the body.
    pub(crate) async fn next(&mut self) -> Result<Option<Event>, ProviderError> {
        loop {
            let next = tokio::time::timeout_at(self.deadline, self.events.next()).await;
            let event = match next {
                Err(_) => {
                    return Err(ProviderError::Timeout(
                        self.deadline.saturating_duration_since(self.started),
                    ));
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(eventsource_stream::EventStreamError::Transport(e)))) => {
                    return Err(ProviderError::transport(e));
                }
                Ok(Some(Err(e))) => {
                    return Err(ProviderError::unreadable(
                        "the event stream is malformed",
                        e,
                    ));
                }
                Ok(Some(Ok(event))) => event,
            };
            if !event.data.is_empty() {
                return Ok(Some(event));
            }
        }
    }
}
