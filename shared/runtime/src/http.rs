//! Serving an HTTP/1 [`axum::Router`] on a listener within bounds: the accept loop shared by
//! every HTTP listener of a service process (the health and metrics listener of [`crate::health`];
//! docs/security.md, "Limits").
//!
//! # Invariants
//! - At most [`ConnLimits::max_connections`] connections are open at once: a connection is
//!   accepted only with a free slot; past it, new ones wait in the kernel's listen backlog, which
//!   costs this process no descriptor.
//! - A connection that does not send a request's headers within [`ConnLimits::header_timeout`]
//!   — the first request's, or the next one's on a kept-alive connection — is closed (hyper's
//!   header read timeout): an idle socket holds a slot no longer than that.
//! - On shutdown, connections finish the request they are serving and close.
//!
//! # Pitfalls
//! - An accept that fails (`EMFILE` when the process is out of descriptors) is retried after a
//!   short pause, never a busy loop and never the end of the listener.

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The bounds of one listener's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once (further ones wait in the listen backlog).
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers, and may sit idle between
    /// requests, before it is closed.
    pub header_timeout: Duration,
}

/// Accepts connections on `listener` and serves `app` on each within `limits` until
/// `shutdown`; then waits for the open connections to finish their requests. `name` labels the
/// accept-error log line and `cyrene_http_accept_errors_total`.
pub async fn serve_connections(
    name: &'static str,
    listener: TcpListener,
    app: axum::Router,
    limits: ConnLimits,
    shutdown: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut connections = JoinSet::new();
    loop {
        while connections.try_join_next().is_some() {}
        let slot = tokio::select! {
            _ = shutdown.cancelled() => break,
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    tracing::warn!(listener = name, error = %err, "cannot accept; pausing");
                    metrics::counter!("cyrene_http_accept_errors_total", "listener" => name)
                        .increment(1);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Replies are small writes: never wait for Nagle's timer.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                _ = shutdown.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(err) = served {
                tracing::debug!(listener = name, error = %err, "an HTTP connection ended with an error");
            }
        });
    }
    while connections.join_next().await.is_some() {}
}
