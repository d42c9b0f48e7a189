//! `cyrene-loop-worker`: runs turn jobs from `CYRENE_TURNS` until SIGINT/SIGTERM.

use clap::Parser;
use cyrene_bus::{BusConfig, ConnectMode};
use cyrene_loop_worker::{Config, run};
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Cyrene loop worker.
#[derive(Debug, Parser)]
#[command(name = "cyrene-loop-worker", version)]
struct Args {
    /// NATS server URL(s), comma-separated.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// Turns this process runs at once.
    #[arg(long, env = "CYRENE_WORKER_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
    /// Redelivery delay of a job whose worker stopped acking: the failover time after a worker
    /// dies (live workers send in-progress acks every quarter of it).
    #[arg(long, env = "CYRENE_WORKER_ACK_WAIT", default_value = "800ms", value_parser = humantime::parse_duration)]
    ack_wait: Duration,
    /// Deliveries of a job before it is reported as failed.
    #[arg(long, env = "CYRENE_WORKER_MAX_DELIVER", default_value_t = 10)]
    max_deliver: u32,
    /// Deadline of one model call.
    #[arg(long, env = "CYRENE_MODEL_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    model_timeout: Duration,
    /// Deadline of one external tool call.
    #[arg(long, env = "CYRENE_TOOL_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    tool_timeout: Duration,
    /// Replicas of the CYRENE_TURNS stream (e.g. 3 on a 3-node cluster); the orchestrator's value.
    #[arg(long, env = "CYRENE_TURNS_REPLICAS", default_value_t = cyrene_bus::streams::DEFAULT_TURNS_REPLICAS)]
    turns_replicas: usize,
}

/// mimalloc: glibc's malloc/free were a tenth of the CPU of a loop step.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Args::parse();
    let _telemetry = cyrene_telemetry::init("cyrene-loop-worker");
    let Ok(runtime) = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    else {
        eprintln!("cyrene-loop-worker: cannot start the async runtime");
        return ExitCode::FAILURE;
    };
    runtime.block_on(async move {
        let config = Config {
            concurrency: args.concurrency,
            ack_wait: args.ack_wait,
            max_deliver: args.max_deliver,
            model_timeout: args.model_timeout,
            tool_timeout: args.tool_timeout,
            turns_replicas: args.turns_replicas,
            ..Config::default()
        };
        let bus = BusConfig::new(&args.nats_url, "cyrene-loop-worker", ConnectMode::Service);
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
                tracing::error!(error = %err, "loop worker failed");
                ExitCode::FAILURE
            }
        }
    })
}
