//! The one pull loop over a shared durable JetStream consumer (the loop workers' turn jobs, the
//! orchestrators' memory extraction jobs): pull as many messages as there are free slots, run
//! each in a task of its own, drain at shutdown.
//!
//! # Invariants
//! - At most [`Pull::concurrency`] handlers run at once, and a pull asks for no more messages
//!   than there are free slots, so no pulled message waits unheard (its `ack_wait` runs).
//! - A pull request lives on the server it was sent to: after a reconnect nobody answers it
//!   (neither messages nor the end-of-batch status), so the batch is given up at once — not at
//!   the client's own timer (expiry + 5 s) — and a new pull goes out.
//! - A failed pull is retried after a short pause; only shutdown ends the loop.
//! - At shutdown, handlers under way get [`Pull::grace`]; those still running then are aborted
//!   and left to redelivery (a handler must commit its effects atomically or idempotently).

use async_nats::Client;
use async_nats::jetstream::{self, consumer::PullConsumer};
use futures::StreamExt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How often a waiting pull looks whether the connection was made anew.
const RECONNECT_CHECK: Duration = Duration::from_millis(100);
/// The pause after a failed pull.
const PULL_RETRY: Duration = Duration::from_millis(500);

/// What happens to messages already delivered to a pull when shutdown fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtShutdown {
    /// They still run (within the grace): a message pulled is a job started.
    RunDelivered,
    /// They are left to redelivery, and the pull is not waited out.
    LeaveDelivered,
}

/// How one consumer is pulled.
#[derive(Debug, Clone, Copy)]
pub struct Pull {
    /// What the messages are, for logs ("turn jobs").
    pub what: &'static str,
    /// Handlers running at once at the most.
    pub concurrency: usize,
    /// How long one pull request waits for messages.
    pub expires: Duration,
    /// How long a shutdown waits for the handlers under way before it aborts them.
    pub grace: Duration,
    pub at_shutdown: AtShutdown,
}

/// Pulls `consumer` and runs `handle` on each message until `shutdown`, then drains (see the
/// module's invariants). `client` is the consumer's connection (its reconnects are watched).
pub async fn consume<F, Fut>(
    client: &Client,
    consumer: &PullConsumer,
    pull: Pull,
    shutdown: &CancellationToken,
    mut handle: F,
) where
    F: FnMut(jetstream::Message) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let what = pull.what;
    let permits = Arc::new(Semaphore::new(pull.concurrency));
    let mut running = JoinSet::new();
    'pull: loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let mut slots = vec![first];
        while let Ok(p) = permits.clone().try_acquire_owned() {
            slots.push(p);
        }
        while running.try_join_next().is_some() {}
        let batch = consumer
            .batch()
            .max_messages(slots.len())
            .expires(pull.expires)
            .messages();
        let mut batch = tokio::select! {
            _ = shutdown.cancelled() => break,
            b = batch => match b {
                Ok(b) => b,
                Err(err) => {
                    tracing::warn!(error = %err, what, "pull failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(PULL_RETRY) => continue 'pull,
                    }
                }
            },
        };
        let connects = client.statistics().connects.load(Ordering::Relaxed);
        let mut watch = tokio::time::interval(RECONNECT_CHECK);
        let leave = pull.at_shutdown == AtShutdown::LeaveDelivered;
        loop {
            let next = tokio::select! {
                next = batch.next() => next,
                _ = shutdown.cancelled(), if leave => break 'pull,
                _ = watch.tick() => {
                    if client.statistics().connects.load(Ordering::Relaxed) != connects {
                        tracing::debug!(what, "reconnected: the pull request died with the connection");
                        break;
                    }
                    continue;
                }
            };
            let message = match next {
                None => break,
                Some(Err(err)) => {
                    tracing::debug!(error = %err, what, "pull batch ended");
                    break;
                }
                Some(Ok(message)) => message,
            };
            let Some(slot) = slots.pop() else {
                // More than asked for cannot happen; leave it to redelivery if it does.
                tracing::warn!(what, "received more messages than requested");
                break;
            };
            let work = handle(message);
            running.spawn(async move {
                let _slot = slot;
                work.await;
            });
        }
    }
    let grace = pull.grace;
    let drained = tokio::time::timeout(grace, async {
        while running.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            left = running.len(),
            what,
            "still running at shutdown: aborted and left to redelivery"
        );
        running.abort_all();
        while running.join_next().await.is_some() {}
    }
}
