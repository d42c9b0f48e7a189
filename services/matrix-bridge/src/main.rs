//! `cyrene-matrix-bridge`: the entry shape every Cyrene binary shares (`cyrene_runtime::entry`):
//! flags/env → checked config → NATS → run until SIGINT/SIGTERM. Exit codes: 0 clean stop,
//! 1 failure (the homeserver refuses the login, NATS unreachable), 2 invalid configuration
//! (every problem listed).

use cyrene_matrix_bridge::{Args, SERVICE_NAME, run};
use std::process::ExitCode;

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    cyrene_runtime::entry::main::<Args, _, _, _>(SERVICE_NAME, run)
}
