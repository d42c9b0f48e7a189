//! Health and metrics of a service process: the readiness registry every part of the process
//! reports to, and the HTTP listener (`--health-addr` / `CYRENE_HEALTH_ADDR`) that answers
//! `/livez`, `/readyz` and `/metrics` (docs/operations.md).
//!
//! Readiness is a set of named checks, each `true` or `false`. [`crate::entry`] registers
//! `nats` (follows the connection state) and the service's own name (false until the service's
//! `run` calls [`Health::set`] with `true` once its endpoints or consumer are registered); a
//! service that uses a database adds `database`. The process is ready when every check is true
//! and it is not draining.
//!
//! # Invariants
//! - One registry per process ([`global`]): a check set by a service's `run` is the one the
//!   listener reads, without threading a handle through every `run` (`cyrene up` runs four
//!   services in one process; each sets its own check, and it starts no listener).
//! - Draining is one-way: after [`Health::drain`] (the shutdown signal) `/readyz` answers 503
//!   until the process exits, whatever the checks say.
//! - The listener only reads: a probe never blocks a request or takes a lock held across I/O.
//!
//! # Pitfalls
//! - The listener is axum on hyper's HTTP/1 (already in every binary for the gateway's front
//!   door), served through [`crate::http::serve_connections`]: at most 16 connections, and one
//!   that sends no request head within 5 s is closed, so idle sockets cannot hold it.
//! - Metrics are recorded through the `metrics` facade everywhere; without the listener no
//!   recorder is installed and recording is a no-op.

use crate::http::ConnLimits;
use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The readiness checks of this process.
#[derive(Debug, Default)]
pub struct Health {
    checks: Mutex<BTreeMap<String, bool>>,
    draining: AtomicBool,
}

/// The process-wide registry.
pub fn global() -> &'static Health {
    static HEALTH: OnceLock<Health> = OnceLock::new();
    HEALTH.get_or_init(Health::default)
}

impl Health {
    /// Sets check `name` (registering it when new).
    pub fn set(&self, name: &str, ok: bool) {
        if let Ok(mut checks) = self.checks.lock() {
            checks.insert(name.to_owned(), ok);
        }
    }

    /// From now on the process is not ready (shutdown started).
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether every check passes and the process is not draining, and the failing checks.
    pub fn readiness(&self) -> (bool, Vec<String>) {
        let mut failing: Vec<String> = match self.checks.lock() {
            Ok(checks) => checks
                .iter()
                .filter(|(_, ok)| !**ok)
                .map(|(name, _)| name.clone())
                .collect(),
            Err(_) => vec!["registry".to_owned()],
        };
        if self.draining.load(Ordering::Relaxed) {
            failing.push("draining".to_owned());
        }
        (failing.is_empty(), failing)
    }
}

/// Histogram buckets in seconds for every `*_seconds` series.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
/// Buckets of `cyrene_turn_steps`.
const STEP_BUCKETS: &[f64] = &[1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0];

/// Why the listener could not start.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    #[error("cannot listen on {addr} for health and metrics: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot install the metrics recorder: {0}")]
    Recorder(String),
}

/// Installs the Prometheus recorder for this process, binds `addr` and serves `/livez`,
/// `/readyz` and `/metrics` until `shutdown`. Returns the bound address (port 0 picks one).
pub async fn serve(
    addr: SocketAddr,
    shutdown: CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), HealthError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(Matcher::Full("cyrene_turn_steps".into()), STEP_BUCKETS)
        })
        .map_err(|e| HealthError::Recorder(e.to_string()))?
        .install_recorder()
        .map_err(|e| HealthError::Recorder(e.to_string()))?;
    describe_series();
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| HealthError::Bind { addr, source })?;
    let bound = listener.local_addr().unwrap_or(addr);
    tracing::info!(addr = %bound, "health and metrics listening");
    let task = tokio::spawn(serve_until(listener, handle, shutdown));
    Ok((bound, task))
}

/// Every `cyrene_*` series: name, type and `# HELP` text. docs/operations.md documents each with
/// its labels (a unit test checks it names them all); add a series here when adding one.
pub const SERIES: &[(&str, Kind, &str)] = &[
    (
        "cyrene_requests_total",
        Kind::Counter,
        "Requests answered, by endpoint and code (ok or the wire error code).",
    ),
    (
        "cyrene_request_duration_seconds",
        Kind::Histogram,
        "From request receipt to reply sent, by endpoint and code.",
    ),
    (
        "cyrene_provider_call_duration_seconds",
        Kind::Histogram,
        "One provider attempt, by provider, model and outcome.",
    ),
    (
        "cyrene_provider_tokens_total",
        Kind::Counter,
        "Tokens reported by providers, by provider, model and kind.",
    ),
    (
        "cyrene_provider_fallbacks_total",
        Kind::Counter,
        "Attempts that failed retryably so the chain moved on.",
    ),
    (
        "cyrene_provider_cooldowns_total",
        Kind::Counter,
        "Times a provider entered a cooldown.",
    ),
    (
        "cyrene_provider_skipped_cooling_total",
        Kind::Counter,
        "Chain steps skipped because their provider was cooling down.",
    ),
    (
        "cyrene_checkpoint_save_duration_seconds",
        Kind::Histogram,
        "One checkpoint save against the database, by outcome.",
    ),
    (
        "cyrene_turns_started_total",
        Kind::Counter,
        "Turn jobs taken from CYRENE_TURNS (every delivery).",
    ),
    (
        "cyrene_turn_redeliveries_total",
        Kind::Counter,
        "Turn job deliveries with a delivery count above 1.",
    ),
    (
        "cyrene_turns_completed_total",
        Kind::Counter,
        "Turns that reached an end, by outcome.",
    ),
    (
        "cyrene_turns_failed_total",
        Kind::Counter,
        "Turn attempts that failed, by reason (error, retry, stale, invalid_job).",
    ),
    (
        "cyrene_turn_steps",
        Kind::Histogram,
        "Steps of each completed turn.",
    ),
    (
        "cyrene_steer_claims_total",
        Kind::Counter,
        "Steer claims made at step boundaries.",
    ),
    (
        "cyrene_steered_messages_total",
        Kind::Counter,
        "Messages steered into running turns.",
    ),
    (
        "cyrene_tool_calls_total",
        Kind::Counter,
        "Tool calls, by tool and outcome.",
    ),
    (
        "cyrene_tool_call_duration_seconds",
        Kind::Histogram,
        "Tool call latency, by tool and outcome.",
    ),
    (
        "cyrene_turns_ack_pending",
        Kind::Gauge,
        "The worker consumer's num_ack_pending (sampled).",
    ),
    (
        "cyrene_turns_pending",
        Kind::Gauge,
        "The worker consumer's num_pending (sampled).",
    ),
    (
        "cyrene_turns_redelivered",
        Kind::Gauge,
        "The worker consumer's num_redelivered (sampled).",
    ),
    (
        "cyrene_messages_total",
        Kind::Counter,
        "Messages sent to sessions, by disposition (turn_started, pending, parallel_leg, context_only, rejected) and those steered into a running turn (steered).",
    ),
    (
        "cyrene_answer_seconds",
        Kind::Histogram,
        "From the oldest message a turn answers being acknowledged to the turn's completion, by persona and outcome.",
    ),
    (
        "cyrene_dispatch_lag_seconds",
        Kind::Histogram,
        "From a turn's creation to its job confirmed in the CYRENE_TURNS stream.",
    ),
    (
        "cyrene_memory_extractions_total",
        Kind::Counter,
        "Memory extraction deliveries, by outcome (written, already_done, skipped, malformed, retry, dropped).",
    ),
    (
        "cyrene_sessions_active",
        Kind::Gauge,
        "Sessions with a turn running (sampled every 10 s from the database).",
    ),
    (
        "cyrene_messages_waiting",
        Kind::Gauge,
        "Messages stored but not yet taken by a turn (sampled every 10 s from the database).",
    ),
    (
        "cyrene_http_accept_errors_total",
        Kind::Counter,
        "Accepts an HTTP listener could not make (out of descriptors), by listener (health, http).",
    ),
    (
        "cyrene_matrix_bridge_messages_total",
        Kind::Counter,
        "Matrix room messages, by outcome (sent, refused, not_addressed).",
    ),
    (
        "cyrene_matrix_bridge_answers_total",
        Kind::Counter,
        "Answers the Matrix bridge posted to a room.",
    ),
    (
        "cyrene_matrix_bridge_rate_limited_total",
        Kind::Counter,
        "Homeserver 429s the Matrix bridge waited out.",
    ),
];

/// The type of a series in [`SERIES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Gives every series in [`SERIES`] its `# HELP` line (and `_seconds` histograms their unit).
fn describe_series() {
    for (name, kind, help) in SERIES {
        let (name, help) = (*name, *help);
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram if name.ends_with("_seconds") => {
                metrics::describe_histogram!(name, metrics::Unit::Seconds, help)
            }
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
}

/// The bounds of the health and metrics listener: a few probes and a scraper at a time.
const LIMITS: ConnLimits = ConnLimits {
    max_connections: 16,
    header_timeout: Duration::from_secs(5),
};

/// Serves the three paths until `shutdown`, and drains histograms into their buckets every 5 s
/// (no exporter task does it).
async fn serve_until(
    listener: TcpListener,
    metrics: PrometheusHandle,
    shutdown: CancellationToken,
) {
    let upkeep = {
        let (metrics, shutdown) = (metrics.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tick.tick() => metrics.run_upkeep(),
                }
            }
        })
    };
    crate::http::serve_connections("health", listener, router(metrics), LIMITS, shutdown).await;
    let _ = upkeep.await;
}

/// `/livez`, `/readyz` and `/metrics` (`GET`, and `HEAD` with the same headers); anything else
/// is 404, another method on these paths 405.
fn router(metrics: PrometheusHandle) -> Router {
    Router::new()
        .route(
            "/livez",
            get(|| async { text(StatusCode::OK, "ok\n".to_owned()) }),
        )
        .route("/readyz", get(readyz))
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    let mut response = text(StatusCode::OK, metrics.render());
                    response.headers_mut().insert(
                        header::CONTENT_TYPE,
                        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                    );
                    response
                }
            }),
        )
        .fallback(|| async {
            text(
                StatusCode::NOT_FOUND,
                "not found; try /livez, /readyz, /metrics\n".to_owned(),
            )
        })
}

async fn readyz() -> Response {
    match global().readiness() {
        (true, _) => text(StatusCode::OK, "ready\n".to_owned()),
        (false, failing) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", failing.join(", ")),
        ),
    }
}

/// A plain-text answer no cache keeps.
fn text(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Keeps check `nats` equal to whether `client` is connected, until `shutdown`.
pub async fn follow_connection(client: async_nats::Client, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        let connected = client.connection_state() == async_nats::connection::State::Connected;
        global().set(NATS_CHECK, connected);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
    }
}

/// Keeps check `name` equal to what `check` says, asked every `every`, until `shutdown`.
pub async fn watch<F, Fut>(name: &str, every: Duration, mut check: F, shutdown: CancellationToken)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    loop {
        let ok = tokio::select! {
            _ = shutdown.cancelled() => break,
            ok = check() => ok,
        };
        global().set(name, ok);
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// The check that follows the NATS connection.
pub const NATS_CHECK: &str = "nats";
/// The check a service that uses a database keeps up to date.
pub const DATABASE_CHECK: &str = "database";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_series_is_documented_in_operations_md() {
        let docs = include_str!("../../../docs/operations.md");
        for (name, _, _) in SERIES {
            assert!(
                docs.contains(&format!("`{name}`")),
                "{name} is not in docs/operations.md"
            );
            assert!(name.starts_with("cyrene_"), "{name}");
        }
    }

    /// Sends `request` on a fresh connection and reads the whole answer.
    async fn exchange(addr: SocketAddr, request: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        String::from_utf8(raw).unwrap()
    }

    #[tokio::test]
    async fn probes_are_answered_even_while_idle_sockets_fill_every_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = PrometheusBuilder::new().build_recorder().handle();
        let shutdown = CancellationToken::new();
        let server = tokio::spawn(serve_until(listener, metrics, shutdown.clone()));

        // A silent socket in every slot: the probe waits in the backlog until the header
        // timeout closes them (without one it would wait for ever: the bound below fails it).
        let mut idle = Vec::new();
        for _ in 0..LIMITS.max_connections {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let live = tokio::time::timeout(
            Duration::from_secs(60),
            exchange(
                addr,
                "GET /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            ),
        )
        .await
        .expect("idle sockets held the listener");
        assert!(live.starts_with("HTTP/1.1 200"), "{live}");
        assert!(
            live.to_ascii_lowercase()
                .contains("cache-control: no-store"),
            "{live}"
        );
        assert!(live.ends_with("ok\n"), "{live}");

        let head = exchange(
            addr,
            "HEAD /livez HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(
            head.starts_with("HTTP/1.1 200") && head.ends_with("\r\n\r\n"),
            "{head}"
        );
        let post = exchange(
            addr,
            "POST /readyz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(post.starts_with("HTTP/1.1 405"), "{post}");
        let junk = exchange(addr, "\u{1}\u{2} /<script> HTTP/9\r\n\r\n").await;
        assert!(
            junk.is_empty() || junk.starts_with("HTTP/1.1 400"),
            "{junk}"
        );
        let missing = exchange(
            addr,
            "GET /../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");

        drop(idle);
        shutdown.cancel();
        server.await.unwrap();
    }

    #[test]
    fn ready_only_when_every_check_passes_and_not_draining() {
        let health = Health::default();
        assert_eq!(health.readiness(), (true, vec![]));
        health.set("nats", false);
        health.set("svc", true);
        assert_eq!(health.readiness(), (false, vec!["nats".to_owned()]));
        health.set("nats", true);
        assert!(health.readiness().0);
        health.drain();
        assert_eq!(health.readiness(), (false, vec!["draining".to_owned()]));
    }
}
