//! The `cyrene` library: what the CLI binary (`src/main.rs`), the top-level tests and the
//! benches share — the one [`stack::Stack`] that composes the four services in one process.

pub mod stack;
