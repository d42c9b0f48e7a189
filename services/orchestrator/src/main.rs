//! `cyrene-orchestrator`: parses flags/env, connects to NATS and runs the service until
//! SIGINT/SIGTERM. Exit codes: 0 clean stop, 1 failure, 2 invalid configuration.

use clap::Parser;
use cyrene_bus::{BusConfig, ConnectMode};
use cyrene_orchestrator::{Args, Error, SERVICE_NAME, run};
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

/// mimalloc: glibc's malloc/free were a tenth of the CPU of a loop step.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let _telemetry = cyrene_telemetry::init(SERVICE_NAME);
    let config = match args.config() {
        Ok(config) => config,
        Err(err) => {
            tracing::error!(error = %err, "invalid configuration");
            return ExitCode::from(2);
        }
    };
    let bus = BusConfig::new(&args.nats_url, SERVICE_NAME, ConnectMode::Service);
    let client = match cyrene_bus::connect(&bus).await {
        Ok(client) => client,
        Err(err) => {
            tracing::error!(error = %err, "cannot connect to NATS");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = CancellationToken::new();
    tokio::spawn(cyrene_bus::signal::cancel_on_signal(shutdown.clone()));
    match run(config, client, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = %err, "orchestrator failed");
            ExitCode::from(if matches!(err, Error::Config(_)) {
                2
            } else {
                1
            })
        }
    }
}
