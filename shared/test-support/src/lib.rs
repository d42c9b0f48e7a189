//! Test harness that runs a real `nats-server` per test.
//!
//! This crate owns:
//!
//! - finding a `nats-server` binary that is new enough ([`nats_server_binary`]);
//! - [`NatsServer`]: one server process with JetStream on by default, bound to
//!   `127.0.0.1` on a free port, with its own store directory and log file in a
//!   temporary directory. It can be killed and started again on the same port
//!   and store directory, so connected clients reconnect and JetStream data
//!   survives ([`NatsServer::restart`], [`NatsServer::kill`],
//!   [`NatsServer::start_again`]);
//! - [`RawConnection`]: a hand-written client connection for publishing what a
//!   client library will not (malformed header blocks, [`MALFORMED_HEADER_BLOCKS`]);
//! - [`NatsCluster`]: several JetStream nodes routed into one cluster, each
//!   node a [`NatsServer`] that can be killed and restarted on its own;
//! - [`pdf::tiny_pdf`]: a one-page PDF with a known text, for document tests;
//! - [`fixtures`]: protocol values (a turn job) the tests of several crates start from;
//! - [`otlp::collector`]: an OTLP/HTTP trace collector that keeps every export;
//! - [`process::success_stdout`]: the output of a child process that must have succeeded;
//! - [`subscribed`]: a subscription the server already has when the test goes on;
//! - [`shipped::shipped_config`]: `deploy/nats/cyrene.conf` as shipped, with the tests' passwords.
//!
//! Starting, stopping and restarting are synchronous and need no Tokio
//! runtime: readiness is checked with plain TCP (the server's `INFO` line) and
//! plain HTTP against the monitoring port (`/healthz`). Only the `connect`
//! helpers are `async`.
//!
//! ```no_run
//! # async fn demo() {
//! let server = cyrene_test_support::NatsServer::start();
//! let client = server.connect().await;
//! client.publish("greet", "hi".into()).await.unwrap();
//! # }
//! ```
//!
//! # Binary lookup
//!
//! In order: the `NATS_SERVER_BIN` environment variable, then
//! `<workspace root>/.tools/nats/bin/nats-server` (installed by `make tools`),
//! then `nats-server` on `PATH`. The version must be at least 2.10, otherwise
//! the test panics and says to run `make tools`.
//!
//! # Pitfalls
//!
//! - The Debian `nats-server` package (`/usr/sbin/nats-server`) is 2.9 and too
//!   old; run `make tools` or set `NATS_SERVER_BIN`.
//! - Start, restart, kill and drop block the calling thread (up to 10 s for a
//!   single server, 20 s for a cluster). Inside a current-thread
//!   `#[tokio::test]` no other task runs meanwhile — including the client's
//!   connection task; it simply reconnects afterwards. Tests that need
//!   background tasks to make progress during a restart should use
//!   `#[tokio::test(flavor = "multi_thread")]`.
//! - Processes are stopped with SIGKILL (a crash, not a graceful shutdown):
//!   there is no lame-duck mode, clients see the connection drop. JetStream
//!   file-store data survives because it is in the OS page cache.
//! - After a restart async-nats reconnects with back-off (up to 4 s between
//!   attempts); wait for it with a bounded loop, never a fixed sleep.
//! - [`NatsCluster::urls`] is comma-joined for configuration strings;
//!   `async_nats::connect` does **not** split on commas — use
//!   [`NatsCluster::client_urls`] or [`NatsCluster::connect`].
//! - [`NatsServer::restart`] on a cluster node only waits until that node
//!   serves clients and has JetStream enabled; use
//!   [`NatsCluster::restart_node`] or [`NatsCluster::wait_formed`] to also
//!   wait for the cluster: routes, and all running nodes agreeing on a leader
//!   for the meta group and every stream and consumer. `/healthz` alone is not
//!   enough: after a stream leader is killed and quickly restarted, the other
//!   nodes keep naming it as leader (and answer healthy) for a few seconds,
//!   while JetStream API requests for that stream time out.
//! - Cluster ports are picked by binding port 0 and releasing it, so another
//!   process may grab one in between; the cluster start retries a few times
//!   when a node fails to bind.
//! - The temporary directory (store, config, log) is deleted on drop, also
//!   when a test panics; a readiness failure panics with the tail of the
//!   server log, so the log path in that message is usually gone already.
//! - If the test process itself is killed (SIGKILL, e.g. a nextest timeout),
//!   `Drop` does not run and the `nats-server` child is left behind.

// A harness failure should fail the test loudly: panicking is the error
// handling of this crate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod binary;
mod cluster;
pub mod cost;
pub mod echo;
pub mod fixtures;
pub mod micro;
pub mod otlp;
pub mod pdf;
mod probe;
pub mod process;
pub mod raw;
pub mod rng;
mod server;
pub mod shipped;
mod subscribe;

pub use binary::nats_server_binary;
pub use cluster::NatsCluster;
pub use echo::EchoProcess;
pub use raw::{MALFORMED_HEADER_BLOCKS, RawConnection};
pub use server::{NatsServer, NatsServerBuilder};
pub use subscribe::subscribed;

/// A free TCP port on 127.0.0.1 (bound and released: another process may take it meanwhile).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
