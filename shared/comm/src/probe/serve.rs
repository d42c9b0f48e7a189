//! Serving an agent: [`Probe::serve_with`] subscribes to its asks and events and starts the
//! tasks that handle them; [`AgentHandle`] stops them, draining within a grace period.

use super::events::serve_events;
use super::lanes::serve_asks;
use super::{AskLimits, CommError, Handler, Probe};
use cyrene_protocol::subjects;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How long [`AgentHandle::stop`] lets running handlers finish.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(5);

/// A serving agent. Dropping it aborts its tasks; [`AgentHandle::stop`] drains them first.
#[derive(Debug)]
pub struct AgentHandle {
    shutdown: CancellationToken,
    /// Fired when the grace period is over: a running ask stops and is answered `unavailable`.
    abort: CancellationToken,
    tasks: JoinSet<()>,
}

impl AgentHandle {
    /// Stops receiving and lets running handlers finish within [`DEFAULT_STOP_GRACE`].
    pub async fn stop(self) {
        self.stop_within(DEFAULT_STOP_GRACE).await;
    }

    /// Stops receiving (asks still waiting are answered `unavailable`), waits up to `grace` for
    /// running handlers, then stops them, answering their asks `unavailable`.
    pub async fn stop_within(mut self, grace: Duration) {
        self.shutdown.cancel();
        let drained = tokio::time::timeout(grace, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                ?grace,
                "agent handlers still running after the grace period; stopped"
            );
            self.abort.cancel();
            // Each stopped ask only sends its refusal; a task stuck even then is aborted.
            let refused = tokio::time::timeout(grace, async {
                while self.tasks.join_next().await.is_some() {}
            })
            .await;
            if refused.is_err() {
                self.tasks.abort_all();
                while self.tasks.join_next().await.is_some() {}
            }
        }
    }
}

impl Probe {
    /// Answers asks to this agent and receives its events until [`AgentHandle::stop`], one ask
    /// at a time ([`AskLimits::default`]).
    ///
    /// The subscriptions exist when this returns (flushed to the server), so an ask sent after
    /// `serve` returns reaches the handler.
    pub async fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<AgentHandle, CommError> {
        self.serve_with(handler, AskLimits::default()).await
    }

    /// [`Probe::serve`] with the asks held and run within `limits`.
    pub async fn serve_with<H: Handler>(
        &self,
        handler: Arc<H>,
        limits: AskLimits,
    ) -> Result<AgentHandle, CommError> {
        let queue = subjects::token(&self.id);
        let asks = self
            .client
            .queue_subscribe(subjects::agent_ask_receive(&self.id), queue.clone())
            .await?;
        let [broadcast, direct] = subjects::agent_event_receive(&self.id);
        let broadcasts = self
            .client
            .queue_subscribe(broadcast, queue.clone())
            .await?;
        let directs = self.client.queue_subscribe(direct, queue).await?;
        // A failed flush only means the subscriptions reach the server after reconnecting.
        if let Err(err) = self.client.flush().await {
            tracing::warn!(agent = %self.id, error = %err, "flush after subscribe failed");
        }

        let shutdown = CancellationToken::new();
        let abort = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(serve_asks(
            self.clone(),
            asks,
            handler.clone(),
            limits,
            (shutdown.clone(), abort.clone()),
        ));
        let events = futures::stream::select(broadcasts, directs);
        tasks.spawn(serve_events(
            self.client.clone(),
            events,
            handler,
            shutdown.clone(),
        ));
        Ok(AgentHandle {
            shutdown,
            abort,
            tasks,
        })
    }
}
