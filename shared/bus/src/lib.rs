//! NATS plumbing shared by every Cyrene service and client (docs/architecture.md, crate map):
//! talking to the bus, as a client or as a micro service.
//!
//! Owns: connecting from config ([`connect`]), bounded JSON requests that decode the error
//! envelope ([`request`]), `$SRV` discovery ([`discovery`]), the one way to host a micro service
//! and its endpoint table ([`host`]), turning typed errors into the micro error headers plus the
//! JSON envelope and the bounded serving loop ([`service`]), the JetStream streams several
//! services create ([`streams`]) and the one pull loop over a shared consumer ([`pull`]), the retry schedule of every loop that waits for the bus or a
//! peer ([`retry`]), the client side of a chunked document upload ([`upload`]), W3C trace-context propagation in NATS headers ([`trace`]), writing headers
//! without panicking ([`headers`]) and the payload size guard ([`guard`]).
//!
//! Not here: a binary's process runtime (entry, settings, signals, health and metrics) is
//! `cyrene-runtime`; the typed model client is `cyrene-model-client`, the checkpoint client
//! `cyrene-checkpoint-client`.
//!
//! # Invariants
//! - Every request has a deadline; no helper here waits without one.
//! - A failed reply always carries both the `Nats-Service-Error`/`Nats-Service-Error-Code` headers
//!   and a `{"error":{…}}` body, so header-only clients (`nats req`) and JSON clients both see it.

pub mod connect;
pub mod discovery;
pub mod guard;
pub mod headers;
pub mod host;
pub mod pull;
pub mod request;
pub mod retry;
pub mod service;
pub mod streams;
pub mod trace;
pub mod upload;

pub use connect::{Auth, BusArgs, BusConfig, ConnectMode, Secret, connect};
pub use request::{RequestError, request_json};
