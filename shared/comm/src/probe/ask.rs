//! Asking: [`Probe::ask_with`] publishes an ask with its own private reply subject and waits
//! for the reply, the deadline or cancellation; one [`ReplyMux`] per probe routes the replies of
//! all its asks from one subscription.

use super::{Probe, encode};
use crate::DEFAULT_ASK_TIMEOUT;
use async_nats::{Message, StatusCode};
use cyrene_bus::{service, trace};
use cyrene_protocol::comm::{Ask, Reply};
use cyrene_protocol::{ErrorBody, ids, subjects};
use futures::StreamExt;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// Why an ask got no answer.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    /// No reply before the deadline.
    #[error("comm: reply timeout: {to} did not answer within {after:?}")]
    Timeout { to: String, after: Duration },
    /// The ask could not be delivered (no responders, or the bus refused it).
    #[error("comm: no reply: {to} cannot be reached ({reason})")]
    NoReply { to: String, reason: String },
    /// The caller cancelled the ask.
    #[error("comm: ask to {to} cancelled")]
    Cancelled { to: String },
    /// The responder answered with an error envelope.
    #[error("comm: {to} answered with an error: {error}")]
    Remote { to: String, error: ErrorBody },
    /// The reply was not a valid `Reply`.
    #[error("comm: {to} sent an invalid reply: {reason}")]
    InvalidReply { to: String, reason: String },
}

/// Per-ask knobs.
#[derive(Debug, Clone, Default)]
pub struct AskOptions {
    /// Structured payload sent with the question.
    pub data: Value,
    /// The caller's deadline. The ask waits for the **shorter** of this and
    /// [`DEFAULT_ASK_TIMEOUT`]: the default is a cap, so a silent agent never holds its caller
    /// longer than that, whatever deadline the caller brings.
    pub timeout: Option<Duration>,
    /// Cancelling this ends the ask with [`AskError::Cancelled`].
    pub cancel: Option<CancellationToken>,
    /// The ask chain this ask serves (the asker's own chain when it is answering an ask):
    /// sent as the ask's `chain` (docs/comm.md, "Cycles").
    pub chain: Vec<String>,
}

/// How long an ask waits: the shorter of the caller's deadline and [`DEFAULT_ASK_TIMEOUT`].
fn ask_deadline(caller: Option<Duration>) -> Duration {
    caller.map_or(DEFAULT_ASK_TIMEOUT, |t| t.min(DEFAULT_ASK_TIMEOUT))
}

/// Routes replies to waiting asks by ask id.
///
/// # Invariants
/// - One wildcard subscription `cyrene.agent.*.<me>.reply.*` per probe, created (and flushed to
///   the server) before the probe's first ask is published; every ask still has its own private
///   reply subject `cyrene.agent.<to>.<me>.reply.<askId>`, registered here before publishing.
/// - An entry lives exactly as long as its ask waits ([`PendingReply`] removes it on drop), so a
///   late reply to a timed-out ask finds nobody and is discarded.
///
/// # Pitfalls
/// - Per-ask subscriptions would be simpler but cost a SUB and an UNSUB per ask, which a cluster
///   propagates to every route; the shared subscription is how NATS clients do requests.
#[derive(Debug)]
pub(super) struct ReplyMux {
    /// Ask id → (the token of the agent asked, the waiting ask). A reply counts only when it
    /// arrives on a subject whose replier token is that agent's: nobody answers for another.
    waiting: Mutex<HashMap<String, Waiter>>,
    /// Stops the dispatch task when the last probe clone is gone.
    _stop: tokio_util::sync::DropGuard,
}

type Waiter = (String, oneshot::Sender<Message>);

impl ReplyMux {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiter>> {
        // The map stays consistent even if a holder panicked: every operation is one call.
        self.waiting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Removes its ask from the [`ReplyMux`] when the ask stops waiting, however it ends.
struct PendingReply<'a> {
    mux: &'a ReplyMux,
    ask_id: &'a str,
}

impl Drop for PendingReply<'_> {
    fn drop(&mut self) {
        self.mux.lock().remove(self.ask_id);
    }
}

impl Probe {
    /// The reply subscription, created on first use.
    async fn replies(&self) -> Result<&Arc<ReplyMux>, async_nats::SubscribeError> {
        self.replies
            .get_or_try_init(|| async {
                let pattern = subjects::agent_reply_receive(&self.id);
                let mut sub = self.client.subscribe(pattern).await?;
                // The subscription is on the server before any ask is published.
                if let Err(err) = self.client.flush().await {
                    tracing::warn!(agent = %self.id, error = %err, "flush after subscribe failed");
                }
                let stop = CancellationToken::new();
                let mux = Arc::new(ReplyMux {
                    waiting: Mutex::new(HashMap::new()),
                    _stop: stop.clone().drop_guard(),
                });
                let weak = Arc::downgrade(&mux);
                tokio::spawn(async move {
                    loop {
                        let message = tokio::select! {
                            _ = stop.cancelled() => break,
                            next = sub.next() => match next { Some(m) => m, None => break },
                        };
                        let Some(mux) = weak.upgrade() else { break };
                        let ask_id = message.subject.rsplit('.').next().unwrap_or_default();
                        let replier = subjects::agent_sender(&message.subject).unwrap_or_default();
                        let waiter = {
                            let mut waiting = mux.lock();
                            match waiting.get(ask_id) {
                                Some((asked, _)) if asked == replier => waiting.remove(ask_id),
                                Some(_) => {
                                    tracing::warn!(subject = %message.subject,
                                        "reply from an agent that was not asked; dropped");
                                    continue;
                                }
                                None => None,
                            }
                        };
                        match waiter {
                            Some((_, tx)) => {
                                let _ = tx.send(message);
                            }
                            None => tracing::debug!(subject = %message.subject,
                                "reply for an ask nobody waits for (late or another replica's)"),
                        }
                    }
                    let _ = sub.unsubscribe().await;
                });
                Ok(mux)
            })
            .await
    }

    /// Asks `to` with the default deadline.
    pub async fn ask(&self, to: &str, question: &str) -> Result<Reply, AskError> {
        self.ask_with(to, question, AskOptions::default()).await
    }

    /// Asks `to` and waits for its reply, the deadline, or cancellation.
    pub async fn ask_with(
        &self,
        to: &str,
        question: &str,
        options: AskOptions,
    ) -> Result<Reply, AskError> {
        let ask_id = ids::new_id();
        let ask = Ask {
            id: ask_id.clone(),
            from: self.id.clone(),
            to: to.to_owned(),
            question: question.to_owned(),
            data: options.data,
            chain: options.chain,
        };
        let after = ask_deadline(options.timeout);
        let cancel = options.cancel.unwrap_or_default();
        let no_reply = |reason: String| AskError::NoReply {
            to: to.to_owned(),
            reason,
        };

        // Register the private reply subject first, then publish: the reply cannot outrun it.
        let mux = self.replies().await.map_err(|e| no_reply(e.to_string()))?;
        let (tx, rx) = oneshot::channel();
        mux.lock().insert(ask_id.clone(), (subjects::token(to), tx));
        let _pending = PendingReply {
            mux,
            ask_id: &ask_id,
        };
        let reply_subject = subjects::agent_reply(to, &self.id, &ask_id);
        let subject = subjects::agent_ask(&self.id, to);
        let payload = encode(&ask);
        let headers = trace::current_headers();
        let published = if headers.is_empty() {
            self.client
                .publish_with_reply(subject, reply_subject, payload)
                .await
        } else {
            self.client
                .publish_with_reply_and_headers(subject, reply_subject, headers, payload)
                .await
        };
        published.map_err(|e| no_reply(e.to_string()))?;

        let message = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(AskError::Cancelled { to: to.to_owned() }),
            next = tokio::time::timeout(after, rx) => match next {
                Err(_) => return Err(AskError::Timeout { to: to.to_owned(), after }),
                Ok(Err(_)) => return Err(no_reply("the reply subscription closed".into())),
                Ok(Ok(message)) => message,
            },
        };
        decode_reply(to, message)
    }
}

fn decode_reply(to: &str, message: Message) -> Result<Reply, AskError> {
    if message.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(AskError::NoReply {
            to: to.to_owned(),
            reason: "no responders".into(),
        });
    }
    if let Some(error) = service::error_from_message(&message) {
        return Err(AskError::Remote {
            to: to.to_owned(),
            error,
        });
    }
    serde_json::from_slice(&message.payload).map_err(|e| AskError::InvalidReply {
        to: to.to_owned(),
        reason: e.to_string(),
    })
}
