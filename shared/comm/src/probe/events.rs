//! Events: sending them ([`Probe::emit`], [`Probe::broadcast`]) and receiving a serving agent's,
//! each handled in its own task, at most [`MAX_CONCURRENT_EVENTS`] at once.

use super::answer::impersonation;
use super::{CommError, Handler, Probe, encode};
use async_nats::{Client, Message};
use cyrene_bus::{service, trace};
use cyrene_protocol::comm::Event;
use cyrene_protocol::subjects;
use futures::StreamExt;
use serde_json::Value;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How many event handlers of one agent may run at once.
const MAX_CONCURRENT_EVENTS: usize = 64;

impl Probe {
    /// Sends event `name` to agent `to`.
    pub async fn emit(&self, to: &str, name: &str, data: Value) -> Result<(), CommError> {
        self.publish_event(subjects::agent_event(&self.id, to), name, data)
            .await
    }

    /// Broadcasts event `name` to every agent.
    pub async fn broadcast(&self, name: &str, data: Value) -> Result<(), CommError> {
        self.publish_event(subjects::agent_broadcast(&self.id), name, data)
            .await
    }

    async fn publish_event(
        &self,
        subject: String,
        name: &str,
        data: Value,
    ) -> Result<(), CommError> {
        let event = Event {
            from: self.id.clone(),
            name: name.to_owned(),
            data,
        };
        self.client
            .publish_with_headers(subject, trace::current_headers(), encode(&event))
            .await?;
        Ok(())
    }
}

/// Receives events; each runs in its own task, at most [`MAX_CONCURRENT_EVENTS`] at once.
pub(super) async fn serve_events<H, S>(
    client: Client,
    mut events: S,
    handler: Arc<H>,
    shutdown: CancellationToken,
) where
    H: Handler,
    S: futures::Stream<Item = Message> + Unpin,
{
    let permits = Arc::new(Semaphore::new(MAX_CONCURRENT_EVENTS));
    let mut running = JoinSet::new();
    // Dropped (aborted) with this task when the agent is stopped past its grace period.
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = events.next() => match next { Some(m) => m, None => break },
        };
        while running.try_join_next().is_some() {}
        let event = match serde_json::from_slice::<Event>(&message.payload) {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "invalid event dropped");
                continue;
            }
        };
        if !subjects::speaks_as(&message.subject, &event.from) {
            let err = impersonation(&message.subject, "event", &event.from);
            tracing::warn!(subject = %message.subject, error = %err, "event refused");
            // Events have no reply; one sent as a request still learns why it was refused.
            if let Some(reply_to) = message.reply.clone() {
                let _ = client
                    .publish_with_headers(
                        reply_to,
                        service::error_headers(&err),
                        service::error_payload(&err),
                    )
                    .await;
            }
            continue;
        }
        let span = tracing::info_span!("event", subject = %message.subject, name = %event.name);
        trace::set_parent(&span, message.headers.as_ref());
        let handler = handler.clone();
        running.spawn(
            async move {
                let _permit = permit;
                handler.on_event(event).await;
            }
            .instrument(span),
        );
    }
    while running.join_next().await.is_some() {}
}
