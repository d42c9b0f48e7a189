//! `cyrene`: the command-line client of a Cyrene runtime.
//!
//! Every command talks to the bus given by `--nats-url` / `NATS_URL`. Exit codes: 0 success,
//! 1 failure (connection, bad input), 2 usage, 3 timeout, 4 no responder, 5 the peer answered
//! with an error.

mod cli;

use clap::Parser;
use std::process::ExitCode;

/// mimalloc: glibc's malloc/free were a tenth of the CPU of a loop step.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    let _telemetry = cyrene_telemetry::init_with("cyrene", "warn");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(err) => {
            eprintln!("cyrene: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("cyrene: {err}");
            ExitCode::from(err.exit_code())
        }
    }
}
