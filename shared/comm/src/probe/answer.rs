//! Answering one ask: the [`Handler`] an agent serves with, the checks an ask passes as it
//! arrives (a malformed ask, one in another agent's name and a cycle are refused at once, never
//! queued), and sending the handler's [`Answer`] or error to the ask's reply-to.

use super::{Probe, encode};
use async_nats::client::PublishErrorKind;
use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use cyrene_bus::{service, trace};
use cyrene_protocol::comm::{Ask, Event, Reply};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use serde_json::Value;
use std::future::Future;
use tokio_util::sync::CancellationToken;

/// What an ask handler answers with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    pub text: String,
    pub data: Value,
}

impl Answer {
    pub fn text(text: impl Into<String>) -> Answer {
        Answer {
            text: text.into(),
            data: Value::Null,
        }
    }
}

/// An agent's behaviour. `on_ask` calls for one asker never overlap; with
/// [`AskLimits::concurrent`](super::AskLimits::concurrent) above 1, calls for different askers
/// may; `on_event` calls may.
pub trait Handler: Send + Sync + 'static {
    /// Answers one ask; an error is sent back as the error envelope.
    fn on_ask(&self, ask: Ask) -> impl Future<Output = Result<Answer, ErrorBody>> + Send;

    /// Receives one event (broadcast or addressed to this agent).
    fn on_event(&self, event: Event) -> impl Future<Output = ()> + Send {
        let _ = event;
        async {}
    }
}

impl Probe {
    /// Checks an ask as it arrives: the ask and its reply subject when it is for the handler;
    /// `None` when it was refused (answered here) or cannot be answered.
    pub(super) async fn check(&self, message: &Message) -> Option<(String, Ask)> {
        let Some(reply_to) = message.reply.as_ref().map(|r| r.to_string()) else {
            tracing::warn!(subject = %message.subject, bytes = message.payload.len(),
                "ask without a reply-to cannot be answered; dropped");
            return None;
        };
        let refused = match serde_json::from_slice::<Ask>(&message.payload) {
            Err(e) => ErrorBody::new(ErrorCode::BadRequest, format!("invalid ask: {e}")),
            Ok(ask) if !subjects::speaks_as(&message.subject, &ask.from) => {
                let err = impersonation(&message.subject, "ask", &ask.from);
                tracing::warn!(subject = %message.subject, error = %err, "ask refused");
                err
            }
            Ok(ask) if in_chain(&self.id, &ask.chain) => {
                let err = cycle(&self.id, &ask);
                tracing::info!(subject = %message.subject, error = %err, "ask refused: a cycle");
                err
            }
            Ok(ask) => return Some((reply_to, ask)),
        };
        self.refuse(reply_to, &refused).await;
        None
    }

    /// Answers `reply_to` with `err`.
    pub(super) async fn refuse(&self, reply_to: String, err: &ErrorBody) {
        let (headers, payload) = (service::error_headers(err), service::error_payload(err));
        self.send_reply(reply_to, headers, payload).await;
    }

    /// Runs the handler on an accepted ask and sends its reply or error; `unavailable` when
    /// `abort` fires first.
    pub(super) async fn answer<H: Handler>(
        &self,
        reply_to: String,
        ask: Ask,
        handler: &H,
        abort: &CancellationToken,
    ) {
        let (ask_id, asker) = (ask.id.clone(), ask.from.clone());
        let answered = tokio::select! {
            biased;
            _ = abort.cancelled() => Err(ErrorBody::new(
                ErrorCode::Unavailable,
                format!("{} stopped while answering this ask", self.id),
            )),
            answered = handler.on_ask(ask) => answered,
        };
        let (headers, payload) = match answered {
            Ok(answer) => {
                let reply = Reply {
                    ask_id,
                    from: self.id.clone(),
                    to: asker,
                    text: answer.text,
                    data: answer.data,
                };
                (HeaderMap::new(), encode(&reply))
            }
            Err(err) => (service::error_headers(&err), service::error_payload(&err)),
        };
        self.send_reply(reply_to, headers, payload).await;
    }

    /// Sends the reply; one the connection cannot carry (over the server's `max_payload`) is
    /// replaced by a `too_large` error, so the asker hears back instead of waiting out its
    /// deadline (as `cyrene_bus::service::respond` does for services).
    async fn send_reply(&self, reply_to: String, mut headers: HeaderMap, payload: Bytes) {
        trace::inject_current(&mut headers);
        let size = payload.len();
        let sent = match self
            .client
            .publish_with_headers(reply_to.clone(), headers, payload)
            .await
        {
            Err(err) if err.kind() == PublishErrorKind::MaxPayloadExceeded => {
                tracing::warn!(
                    size,
                    "answer over the connection's max_payload; answered too_large"
                );
                let err = ErrorBody::new(
                    ErrorCode::TooLarge,
                    format!(
                        "the answer is {size} bytes, more than the bus carries (its max_payload)"
                    ),
                );
                let mut headers = service::error_headers(&err);
                trace::inject_current(&mut headers);
                self.client
                    .publish_with_headers(reply_to, headers, service::error_payload(&err))
                    .await
            }
            sent => sent,
        };
        if let Err(err) = sent {
            tracing::warn!(error = %err, "could not send the reply");
        }
    }
}

/// The `forbidden` refusal of a message whose body `from` is not its subject's sender.
pub(super) fn impersonation(subject: &str, what: &str, from: &str) -> ErrorBody {
    // Both are echoed bounded: a refusal must always fit in a reply.
    let shown: String = from.chars().take(64).collect();
    let sender: String = subjects::agent_sender(subject)
        .unwrap_or_default()
        .chars()
        .take(128)
        .collect();
    ErrorBody::new(
        ErrorCode::Forbidden,
        format!(
            "{what} from {shown:?} sent on the subject of agent {sender:?}: \
             `from` must be the sender's own id (it sanitises to the subject's <from> token)"
        ),
    )
}

/// Whether agent `me` is already answering an ask of `chain` (compared as subject tokens, as
/// the subjects address agents).
pub fn in_chain(me: &str, chain: &[String]) -> bool {
    let me = subjects::token(me);
    chain.iter().any(|id| subjects::token(id) == me)
}

/// The `conflict` refusal of an ask that would wait on its own responder: the responder is
/// already answering an ask this one serves, so answering it would deadlock until the timeout.
fn cycle(me: &str, ask: &Ask) -> ErrorBody {
    let shown: Vec<String> = ask
        .chain
        .iter()
        .take(16)
        .map(|id| id.chars().take(64).collect())
        .collect();
    let me: String = me.chars().take(64).collect();
    ErrorBody::new(
        ErrorCode::Conflict,
        format!(
            "ask cycle: {me:?} is already answering an ask this one serves (chain {shown:?}); \
             answer without asking {me:?}"
        ),
    )
}
