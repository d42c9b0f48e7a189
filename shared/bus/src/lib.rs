//! NATS plumbing shared by every Cyrene service and client (docs/architecture.md §1).
//!
//! Owns: the entry shape of every service binary ([`entry`]), the one way to host a micro service
//! and its endpoint table ([`host`]), its health and metrics listener ([`health`]), connecting from config ([`connect`]), turning typed errors into the micro error headers
//! plus the JSON envelope ([`service`]), bounded JSON requests that decode that envelope back
//! ([`request`]), W3C trace-context propagation in NATS headers ([`trace`]), writing headers
//! without panicking ([`headers`]) and the payload size guard ([`guard`]).
//!
//! # Invariants
//! - Every request has a deadline; no helper here waits without one.
//! - A failed reply always carries both the `Nats-Service-Error`/`Nats-Service-Error-Code` headers
//!   and a `{"error":{…}}` body, so header-only clients (`nats req`) and JSON clients both see it.

pub mod connect;
pub mod discovery;
pub mod entry;
pub mod env;
pub mod guard;
pub mod headers;
pub mod health;
pub mod host;
pub mod http;
pub mod model_stream;
pub mod request;
pub mod retry;
pub mod service;
pub mod signal;
pub mod streams;
pub mod trace;

pub use connect::{Auth, BusArgs, BusConfig, ConnectMode, Secret, connect};
pub use request::{RequestError, request_json};
