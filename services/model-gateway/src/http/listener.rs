//! The front door's connections (docs/model-gateway.md, "Limits of the front door";
//! docs/security.md, "The HTTP front door"): its bounds, served by the bounded accept loop of
//! `cyrene_runtime::http`, so that no number of sockets a client opens can take the descriptors the
//! bus path needs.
//!
//! # Invariants
//! - At most [`HttpLimits::max_connections`] client connections are open, and never more than a
//!   quarter of the process's open-file soft limit ([`descriptor_budget`]): a connection is
//!   accepted only with a free slot; past it, new ones wait in the kernel's listen backlog, which
//!   costs this process no descriptor. Another quarter bounds the upstream calls of the door
//!   ([`HttpLimits::max_requests`]), so at least half stays for the bus path.
//! - A connection that does not send a request's headers within
//!   [`HttpLimits::header_timeout`] — the first request's, or the next one's on a kept-alive
//!   connection — is closed (hyper's header read timeout): an idle socket holds a slot that long.
//! - On shutdown, connections finish the request they are serving and close.
//!
//! # Pitfalls
//! - An accept that fails (`EMFILE` when the process is out of descriptors anyway) is retried
//!   after a short pause, never a busy loop and never the end of the door.

use cyrene_runtime::http::ConnLimits;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The front door's bounds; [`HttpLimits::default`] is what `cyrene-model-gateway` runs with
/// unless told otherwise (`CYRENE_GATEWAY_HTTP_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpLimits {
    /// Client connections open at once (further ones wait in the listen backlog); capped at a
    /// quarter of the open-file soft limit.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers (and may sit idle between
    /// requests) before it is closed.
    pub header_timeout: Duration,
    /// How long an authenticated request may take to send its body.
    pub body_timeout: Duration,
    /// Authenticated requests in flight at once (each holds its body and one upstream call);
    /// more are answered 429. Capped at a quarter of the open-file soft limit.
    pub max_requests: usize,
    /// Request body bytes held at once by the requests in flight (each counts its
    /// `Content-Length`, or the largest body when it has none); more are answered 429.
    pub body_budget: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_requests: 64,
            body_budget: 64 * 1024 * 1024,
        }
    }
}

impl HttpLimits {
    /// Every problem with these limits.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.max_connections == 0 {
            problems.push("http max_connections must be at least 1".to_owned());
        }
        if self.max_requests == 0 {
            problems.push("http max_requests must be at least 1".to_owned());
        }
        if self.header_timeout.is_zero() || self.body_timeout.is_zero() {
            problems.push("http header and body timeouts must be longer than zero".to_owned());
        }
        if self.body_budget < super::MAX_BODY {
            problems.push(format!(
                "http body_budget must be at least one largest body ({} bytes)",
                super::MAX_BODY
            ));
        }
        problems
    }

    /// These limits within the process's descriptor budget: connections and requests each at
    /// most a quarter of the open-file soft limit (when it can be read).
    pub fn within_descriptors(mut self) -> HttpLimits {
        if let Some(budget) = descriptor_budget() {
            self.max_connections = self.max_connections.min(budget);
            self.max_requests = self.max_requests.min(budget);
        }
        self
    }
}

/// A quarter of this process's open-file soft limit (`/proc/self/limits`), at least 1; `None`
/// where it cannot be read (not Linux) or is unlimited.
pub fn descriptor_budget() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    soft_open_files(&limits).map(|soft| (soft / 4).max(1))
}

fn soft_open_files(limits: &str) -> Option<usize> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Accepts connections on `listener` and serves `app` on each, within `limits`, until
/// `shutdown`; then waits for the connections to finish their requests (the accept loop every
/// HTTP listener of a service shares: `cyrene_runtime::http`).
pub(super) async fn accept_loop(
    listener: TcpListener,
    app: axum::Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
) {
    let connections = ConnLimits {
        max_connections: limits.max_connections,
        header_timeout: limits.header_timeout,
    };
    cyrene_runtime::http::serve_connections("http", listener, app, connections, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_open_file_limit_is_read_from_proc() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max cpu time              unlimited            unlimited            seconds   \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(soft_open_files(limits), Some(1024));
        assert_eq!(
            soft_open_files("Max open files  unlimited unlimited files"),
            None
        );
        assert_eq!(soft_open_files(""), None);
    }

    #[test]
    fn limits_stay_within_a_quarter_of_the_descriptors() {
        let limits = HttpLimits {
            max_connections: usize::MAX,
            max_requests: usize::MAX,
            ..HttpLimits::default()
        }
        .within_descriptors();
        if let Some(budget) = descriptor_budget() {
            assert_eq!(limits.max_connections, budget);
            assert_eq!(limits.max_requests, budget);
        }
        assert!(HttpLimits::default().problems().is_empty());
        let zero = HttpLimits {
            max_connections: 0,
            body_budget: 1,
            ..HttpLimits::default()
        };
        assert_eq!(zero.problems().len(), 2);
    }
}
