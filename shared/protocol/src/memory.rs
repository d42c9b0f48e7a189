//! Persona memory on the bus (docs/memory.md): what a persona remembers, read by the loop worker
//! before every turn and shown as the working-memory and memory blocks of the view.
//!
//! Any service may answer these subjects; the orchestrator serves them from SQL by default.
//!
//! # Invariants
//! - Memory belongs to a persona. An entry with a `session_id` is **working memory** of that
//!   conversation; one without is the persona's **long-term memory**, shown in every session.
//! - A read returns the newest entries (at most [`MAX_READ_ENTRIES`] of each kind), oldest
//!   first.

use serde::{Deserialize, Serialize};

/// Read a persona's memory for a session (micro endpoint `memory_read`).
pub const MEMORY_READ: &str = "cyrene.memory.read";
/// Add one entry (micro endpoint `memory_write`).
pub const MEMORY_WRITE: &str = "cyrene.memory.write";
/// Delete one entry (micro endpoint `memory_forget`).
pub const MEMORY_FORGET: &str = "cyrene.memory.forget";
/// Subscribe pattern of the memory extraction jobs, `cyrene.memory.extract.<turn_id>` (the
/// subjects of the JetStream stream `CYRENE_MEMORY`; `crate::subjects::memory_extract`).
pub const MEMORY_EXTRACT_ALL: &str = "cyrene.memory.extract.*";

/// The most entries of each kind one read returns.
pub const MAX_READ_ENTRIES: usize = 50;
/// The longest entry text, in bytes.
pub const MAX_ENTRY_BYTES: usize = 2048;

/// `cyrene.memory.read`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryReadRequest {
    pub persona_id: String,
    /// The session whose working memory is read too.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub session_id: String,
}

/// One remembered thing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryEntry {
    pub id: String,
    pub text: String,
    /// When it was written (Unix milliseconds).
    pub created_unix_ms: u64,
    /// Where it came from when memory extraction wrote it; absent for an entry written by hand
    /// (`cyrene.memory.write`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<MemorySource>,
}

/// The turn an extracted entry was gathered from (docs/memory.md, "Memory she gathers herself").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemorySource {
    pub session_id: String,
    pub turn_id: String,
    /// The persona the turn ran as (whose memory the entry is).
    pub persona: String,
}

/// The job of one memory extraction, published on `cyrene.memory.extract.<turn_id>` (JetStream
/// stream `CYRENE_MEMORY`, `Nats-Msg-Id` = the turn id) when a turn ends with an answer. The
/// orchestrator both publishes and consumes it; what the turn said is read from its transcript.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryExtractJob {
    pub session_id: String,
    pub turn_id: String,
    pub persona: String,
}

/// The reply to `cyrene.memory.read`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryReadResponse {
    /// The session's working memory, oldest first.
    #[serde(default)]
    pub working_memory: Vec<MemoryEntry>,
    /// The persona's long-term memory, oldest first.
    #[serde(default)]
    pub memory: Vec<MemoryEntry>,
}

/// `cyrene.memory.write`: remember `text`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryWriteRequest {
    pub persona_id: String,
    /// Set: working memory of this session; empty: long-term memory.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub session_id: String,
    pub text: String,
}

/// The reply to `cyrene.memory.write`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryWriteAck {
    pub id: String,
}

/// `cyrene.memory.forget`: delete one entry of a persona.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryForgetRequest {
    pub persona_id: String,
    pub id: String,
}

/// The reply to `cyrene.memory.forget`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryForgetAck {
    /// Whether an entry was deleted.
    pub forgotten: bool,
}
