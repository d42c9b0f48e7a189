//! `cyrene-orchestrator`: the entry shape every Cyrene binary shares (`cyrene_runtime::entry`):
//! flags/env → checked config → NATS → run until SIGINT/SIGTERM. Exit codes: 0 clean stop,
//! 1 failure, 2 invalid configuration (every problem listed).

use cyrene_orchestrator::{Args, SERVICE_NAME, run};
use std::process::ExitCode;

/// mimalloc: glibc's malloc/free were a tenth of the CPU of a loop step.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    cyrene_runtime::entry::main::<Args, _, _, _>(SERVICE_NAME, run)
}
