//! The process runtime of every Cyrene service binary (docs/architecture.md, crate map): what a
//! `main` owns besides the bus — the entry shape and exit codes ([`entry`]), the one env naming
//! rule of every setting ([`env`]), process signals ([`signal`]), and the health and metrics
//! listener ([`health`]) with the bounded HTTP/1 accept loop under it ([`http`]).
//!
//! Talking NATS (connecting, requests, micro services, streams, trace context) is
//! `cyrene-bus`'s; this crate uses it to connect and to follow the connection's state.
//!
//! # Invariants
//! - Every bad setting exits 2, a run error 1, a clean stop 0 ([`entry`]).
//! - One readiness registry per process ([`health::global`]).

pub mod entry;
pub mod env;
pub mod health;
pub mod http;
pub mod signal;
