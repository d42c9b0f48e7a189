//! The Cyrene wire contract: every JSON shape that crosses NATS, the id rules, and the subject
//! builders (docs/architecture.md §1, §2, §4, §9).
//!
//! This crate owns *shapes*, not behaviour: it depends on nothing of ours and does no I/O, so any
//! service, the CLI and tests can share one definition of the bytes on the wire.
//!
//! # Invariants
//! - Every type serialises to exactly the JSON documented in docs/architecture.md §9: snake_case
//!   keys, optional fields omitted when empty, `content` always a list on output (a plain string
//!   is accepted on input as one text part), tool-call `args` always a JSON object.
//!   An `Option` field is left out when `None` by `#[skip_serializing_none]` on its type (above
//!   the `#[derive]`), which knows `Option<…>` by name only: a type alias of it is not skipped.
//! - A subject is never built from unvalidated text: session/agent/leg ids go through
//!   [`ids::validate`], comm ids through [`subjects::token`].
//! - A client-chosen name reaches system text only through [`names::display_name`].

pub mod approval;
pub mod checkpoint;
pub mod comm;
pub mod document;
pub mod error;
pub mod guard;
pub mod ids;
pub mod json;
pub mod memory;
pub mod message;
pub mod model;
pub mod names;
pub mod session;
pub mod stream;
pub mod subjects;
pub mod turn;

pub use error::{ErrorBody, ErrorCode, ErrorEnvelope};
pub use json::JsonObject;
pub use message::{Message, Part, Role};
