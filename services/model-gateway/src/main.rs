//! `cyrene-model-gateway`: serves `cyrene.model.complete` (see `docs/model-gateway.md`).
//!
//! Exit codes: 0 after a clean shutdown (SIGINT/SIGTERM), 1 on a config, connection or service
//! error.

use clap::Parser;
use cyrene_bus::{BusConfig, ConnectMode};
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_model_gateway::{Config, SERVICE_NAME};
use std::path::PathBuf;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

/// The Cyrene model gateway: routes model calls to LLM providers.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// NATS server URL(s), comma-separated.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Path to the model config (JSON, or TOML when it ends in .toml). Absent: a built-in offline
    /// config whose only provider is the scripted one (replies are marked offline).
    #[arg(long, env = "CYRENE_MODELS")]
    models: Option<PathBuf>,
    /// Requests handled at once.
    #[arg(long, env = "CYRENE_GATEWAY_MAX_IN_FLIGHT", default_value_t = 256)]
    max_in_flight: usize,
}

/// mimalloc: glibc's malloc/free were a tenth of the CPU of a loop step.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let _telemetry = cyrene_telemetry::init(SERVICE_NAME);
    let args = Args::parse();
    match serve(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err:#}");
            eprintln!("{SERVICE_NAME}: {err:#}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let models = match &args.models {
        Some(path) => ModelsConfig::from_file(path)?,
        None => {
            tracing::warn!("no --models/CYRENE_MODELS: using the offline scripted provider only");
            ModelsConfig::offline()
        }
    };
    // The only place the environment is read for keys.
    let secrets = Secrets::resolve(&models, |name| std::env::var(name).ok());
    let serve = cyrene_bus::service::ServeOptions {
        max_in_flight: args.max_in_flight,
        ..Default::default()
    };
    let config = Config {
        models,
        secrets,
        serve,
    };
    let client = cyrene_bus::connect(&BusConfig::new(
        &args.nats_url,
        SERVICE_NAME,
        ConnectMode::Service,
    ))
    .await?;
    let shutdown = CancellationToken::new();
    tokio::spawn(cyrene_bus::signal::cancel_on_signal(shutdown.clone()));
    cyrene_model_gateway::run(config, client, shutdown).await?;
    Ok(())
}
