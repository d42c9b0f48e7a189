//! `cyrene-mcp-bridge`: the tools of MCP servers as Cyrene tools (docs/tools.md, "Bridging MCP
//! servers"). The bridge reads the `mcpServers` file MCP clients share, starts each stdio server
//! (and starts it again, with backoff, when it dies) or connects to each streamable-HTTP one, and
//! serves every tool as the micro endpoint `cyrene.tool.<server>__<tool>` of the micro service
//! `cyrene-mcp-bridge`, with the metadata the loop worker discovers.
//!
//! This crate owns:
//! - the configuration and the servers file ([`config`]);
//! - what an MCP tool and its result are to Cyrene ([`tools`]; pure);
//! - each server's connection, supervision and endpoints ([`bridge`]).
//!
//! # Invariants
//! - Replicas serve the same endpoints in the micro queue group: a call goes to one replica,
//!   and a replica that is gone takes no more calls (its micro service left the bus with it).
//! - A call is at-most-once at the MCP server per NATS request; the worker may send it again
//!   after a crash of its own (the `Cyrene-Tool-Call-Id` is not passed on: MCP has no
//!   idempotency key), which is why tools say whether they are idempotent.
//! - The bridge keeps no state: everything is in the servers file.

pub mod bridge;
pub mod config;
pub mod tools;

pub use config::{Args, Config, ConfigError, Server, Servers};

use async_nats::Client;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio_util::sync::CancellationToken;

/// The service name (logs, health, the NATS connection and its inbox prefix, the micro service).
pub const SERVICE_NAME: &str = "cyrene-mcp-bridge";

/// Why the bridge could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
}

cyrene_runtime::run_error!(Error::Config);

/// Runs the bridge until `shutdown`: every enabled server supervised in a task of its own.
/// Ready (`/readyz`) once every server had its first attempt, whatever its outcome: a server
/// that is down is retried in the background and its tools are simply not there yet.
pub async fn run(config: Config, client: Client, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    // reqwest is built without a crypto provider; install ring's (once per process).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = Arc::new(config);
    let servers: Vec<(String, Server)> = config
        .servers
        .enabled()
        .map(|(n, s)| (n.clone(), s.clone()))
        .collect();
    let waiting = Arc::new(AtomicUsize::new(servers.len()));
    let health = cyrene_runtime::health::global();
    health.set(SERVICE_NAME, servers.is_empty());
    if servers.is_empty() {
        tracing::warn!("the servers file names no enabled MCP server; nothing to bridge");
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (name, server) in servers {
        let waiting = waiting.clone();
        let first = move || {
            if waiting.fetch_sub(1, Ordering::AcqRel) == 1 {
                health.set(SERVICE_NAME, true);
            }
        };
        tasks.spawn(bridge::supervise(
            name,
            server,
            config.clone(),
            client.clone(),
            shutdown.clone(),
            first,
        ));
    }
    tracing::info!("mcp bridge running");
    shutdown.cancelled().await;
    while tasks.join_next().await.is_some() {}
    tracing::info!("mcp bridge stopped");
    Ok(())
}
