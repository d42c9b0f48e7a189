//! The orchestrator over a real nats-server and real SQL (SQLite files and fresh PostgreSQL
//! databases), with a fake loop worker or a test playing the worker by hand.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod agents;
mod bad_input;
mod documents;
mod extraction;
mod fence;
mod harness;
mod identity;
mod operators;
mod people;
mod personas;
mod policies;
mod volume;
