//! Process signals: a future for the CLI, a shutdown token for service mains.

use tokio_util::sync::CancellationToken;

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (Kubernetes), whichever comes first.
pub async fn signalled() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// Cancels `shutdown` on SIGINT or SIGTERM; returns at once if `shutdown` is cancelled first.
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    tokio::select! {
        _ = signalled() => {},
        _ = shutdown.cancelled() => return,
    }
    tracing::info!("shutdown signal received");
    shutdown.cancel();
}
