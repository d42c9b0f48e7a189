//! Process signals as a shutdown token, for service mains.

use tokio_util::sync::CancellationToken;

/// Cancels `shutdown` on SIGINT (Ctrl-C) or SIGTERM (Kubernetes), whichever comes first.
pub async fn cancel_on_signal(shutdown: CancellationToken) {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {},
                    _ = term.recv() => {},
                    _ = shutdown.cancelled() => return,
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
    tracing::info!("shutdown signal received");
    shutdown.cancel();
}
