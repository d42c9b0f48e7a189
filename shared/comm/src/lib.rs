//! The agent-to-agent comm protocol on real NATS (docs/architecture.md §4; docs/semantics.md#comm).
//!
//! A [`Probe`] is bound to one agent id. It can ask another agent and wait for the reply, emit an
//! event to one agent, or broadcast one; [`Probe::serve`] makes it answer asks and receive events.
//!
//! ```text
//! ask:         cyrene.agent.<from>.<to>.ask
//! reply:       cyrene.agent.<from>.<to>.reply.<askId>     (from = replier, to = asker)
//! event (to):  cyrene.agent.<from>.<to>.event
//! event (bc):  cyrene.agent.<from>.event
//! receive:     cyrene.agent.*.<me>.ask ; cyrene.agent.*.event and cyrene.agent.*.<me>.event
//! ```
//! Every id goes through [`cyrene_protocol::subjects::token`].
//!
//! # Invariants
//! - Every ask has its own private reply subject, sent as the NATS reply-to, and is subscribed
//!   to *before* the ask is published (through the probe's one `cyrene.agent.*.<me>.reply.*`
//!   subscription, flushed to the server on first use), so a reply can never arrive before
//!   anyone listens, and concurrent asks of one agent never see each other's replies.
//! - A responder answers the message's reply-to, whatever it is: a plain `nats req` (reply-to an
//!   `_INBOX`) gets the answer too.
//! - One agent's ask handler runs one ask at a time per asker, and asks of different askers side
//!   by side up to [`AskLimits::concurrent`] (1 by default); accepted asks are bounded in count
//!   and bytes, and an ask over them is refused `unavailable` at once; every accepted ask is
//!   answered, `unavailable` when the agent stops first. Its event handlers may run concurrently
//!   (bounded). Replicas of one agent share a queue group named after its token, so each ask or
//!   event reaches one replica.
//! - Every ask ends: with the reply, [`AskError::Timeout`] at the deadline (the shorter of the
//!   caller's and [`DEFAULT_ASK_TIMEOUT`], which is a cap, not only a default),
//!   [`AskError::NoReply`] when undeliverable, or [`AskError::Cancelled`].
//!
//! - Nobody speaks as another agent: an ask or event is handled only when its body `from`
//!   sanitises to the subject's `<from>` token ([`cyrene_protocol::subjects::speaks_as`]); NATS
//!   permissions decide who may publish on that token. Any other ask is answered `forbidden`, any
//!   other event dropped (logged at WARN). A reply counts only when its subject names the agent
//!   that was asked as the replier.
//!
//! # Pitfalls
//! - Asks with no reply-to cannot be answered; they are logged at WARN, never silently dropped.
//! - A malformed ask that has a reply-to is answered with a `bad_request` error envelope.

mod probe;

pub use probe::{
    AgentHandle, Answer, AskError, AskLimits, AskOptions, CommError, DEFAULT_STOP_GRACE, Handler,
    Probe,
};

use std::time::Duration;

/// The longest an ask waits for its reply: the wait when the caller gives no deadline, and the
/// cap on a longer one (docs/semantics.md#comm: a silent agent never hangs its caller).
pub const DEFAULT_ASK_TIMEOUT: Duration = Duration::from_secs(30);
