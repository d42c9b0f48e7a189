//! [`Probe`]: one agent's end of the comm protocol.
//!
//! # Invariants
//! - One ask at a time per asker: an asker's accepted asks run in arrival order, one after the
//!   other. Asks of different askers run side by side, at most [`AskLimits::concurrent`] at once
//!   (1 by default: one ask at a time for the whole agent).
//! - What is accepted is bounded ([`AskLimits`]): in asks, in bytes, and in bytes per asker. An
//!   ask over a bound is refused `unavailable` as it arrives; the subscription is never left
//!   unread, so a flood cannot make the server drop the connection as a slow consumer.
//! - Every accepted ask is answered: with the handler's answer or error, or `unavailable` when
//!   the agent stops before running it (or after the grace period, while it ran).
//! - Refusals never queue: a malformed ask (`bad_request`), one in another agent's name
//!   (`forbidden`) and one whose `chain` holds this agent (`conflict`, a cycle: the agent is
//!   already answering an ask this one serves, so waiting would deadlock) are answered as they
//!   arrive, and the handler never sees them (docs/comm.md, "Cycles").
//!
//! This file owns the [`Probe`] and [`CommError`]; the rest is split by concern: `ask` (asking
//! and waiting for the reply), `events` (sending and receiving events), `serve` (serving an agent
//! and stopping it), `lanes` (holding and running the accepted asks within [`AskLimits`]) and
//! `answer` (the [`Handler`], and checking, refusing and answering one ask).

mod answer;
mod ask;
mod events;
mod lanes;
mod serve;

pub use answer::{Answer, Handler};
pub use ask::{AskError, AskOptions};
pub use lanes::AskLimits;
pub use serve::{AgentHandle, DEFAULT_STOP_GRACE};

use ask::ReplyMux;
use async_nats::Client;
use bytes::Bytes;
use std::sync::Arc;
use tokio::sync::OnceCell;

/// Failures of fire-and-forget sends and of starting to serve.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("comm: publish failed: {0}")]
    Publish(#[from] async_nats::PublishError),
    #[error("comm: subscribe failed: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
}

/// One agent's end of the protocol. Clones share one reply subscription.
#[derive(Debug, Clone)]
pub struct Probe {
    client: Client,
    id: String,
    replies: Arc<OnceCell<Arc<ReplyMux>>>,
}

impl Probe {
    /// A probe acting as agent `id` (any text: it is sanitised into subject tokens).
    pub fn new(client: Client, id: impl Into<String>) -> Probe {
        Probe {
            client,
            id: id.into(),
            replies: Arc::new(OnceCell::new()),
        }
    }

    /// The agent id this probe speaks for.
    pub fn id(&self) -> &str {
        &self.id
    }
}

fn encode<T: serde::Serialize>(value: &T) -> Bytes {
    // Comm messages hold strings and JSON values only: serialising cannot fail.
    serde_json::to_vec(value).unwrap_or_default().into()
}
