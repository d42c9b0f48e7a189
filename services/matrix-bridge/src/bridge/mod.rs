//! The bridge itself: the `/sync` loop that carries room messages into sessions, and the events
//! listener that carries her answers (and her typing) back into the rooms (docs/matrix-bridge.md).
//!
//! One [`Bridge`] holds what every part shares — the configuration, the NATS client, the
//! homeserver, the bot's identity and the [`State`] — and each file owns one concern of it:
//! - `sync`: the `/sync` loop, invitations, and when the sync token is saved;
//! - `inbound`: one room message → `cyrene.bridge.session.send` (who speaks, whether it
//!   addresses her, the room's members);
//! - `media`: what a message's content becomes (text, an image part, a document uploaded on
//!   `cyrene.bridge.document.upload`);
//! - `approvals`: asking for decisions in the room and passing the owner's on
//!   (docs/matrix-bridge.md, "Approving");
//! - `answers`: the events listener, and posting answers and notices;
//! - `typing`: the typing notice while a turn runs.
//!
//! # Invariants
//! - The bridge keeps no conversation of its own: the [`State`] holds where to resume (the sync
//!   token), the access token, and per session its room, which answers were posted and which
//!   calls were asked about. The rest is in memory and lost on a restart without harm: the
//!   members cache, the typing tasks, and the sessions waiting for an answer (at start every
//!   known session is read again).
//! - Inbound is at least once, stored exactly once; outbound is at least once, posted once
//!   (docs/matrix-bridge.md, "Exactly once across restarts"): every post carries a transaction id
//!   made of the id of what it is about (`txn_safe`), so the homeserver drops a repeat.
//! - Messages the bridge sends carry the client id [`CLIENT_ID`].

mod answers;
mod approvals;
mod inbound;
mod media;
mod sync;
mod typing;

use crate::config::Config;
use crate::matrix::Homeserver;
use crate::state::State;
use cyrene_bus::{RequestError, request_json};
use cyrene_protocol::subjects;
use ruma::{OwnedRoomId, OwnedUserId};
use serde::Deserialize;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often sessions still waiting for an answer are read again.
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// The client id of every message the bridge sends (the double-texting policy's "client").
pub const CLIENT_ID: &str = "matrix";

/// What a person in the room sees when something goes wrong: short, and saying what to do.
pub mod notices {
    pub const TOO_LARGE: &str =
        "That was too large for me to take in — please send something shorter or a smaller image.";
    pub const REFUSED: &str =
        "I couldn't take that message in. Please rephrase it, or ask my owner to check the bridge.";
    pub const TURN_FAILED: &str =
        "Sorry — I couldn't finish my answer. Please try again in a moment.";
    pub const FILE: &str = "(sent a file I cannot open here)";
    pub const FILE_TOO_LARGE: &str = "(sent a file too large for me to read)";
    pub const IMAGE_TOO_LARGE: &str = "(sent an image too large for me to look at)";
    pub const UNSUPPORTED: &str = "(sent something I cannot read here)";
}

/// The running bridge.
#[derive(Debug)]
pub struct Bridge {
    config: Config,
    nats: async_nats::Client,
    hs: Homeserver,
    bot: OwnedUserId,
    bot_name: String,
    owner: String,
    state: tokio::sync::Mutex<State>,
    members: std::sync::Mutex<HashMap<String, inbound::Members>>,
    typing: std::sync::Mutex<HashMap<String, CancellationToken>>,
    /// Sessions with a message sent and no answer posted since.
    waiting: std::sync::Mutex<HashSet<String>>,
    /// Serialises reading and posting answers (two at once would post one answer twice: the
    /// homeserver would drop the second, but not before both were sent).
    posting: tokio::sync::Mutex<()>,
}

/// Why a message could not be handled now: the batch is read again later.
#[derive(Debug)]
pub struct Retry(pub String);

/// A timeline event's envelope, enough to route it.
#[derive(Debug, Deserialize)]
struct Envelope {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    sender: String,
    #[serde(default)]
    state_key: Option<String>,
    #[serde(default)]
    content: serde_json::Value,
}

impl Bridge {
    pub fn new(
        config: Config,
        nats: async_nats::Client,
        hs: Homeserver,
        bot: OwnedUserId,
        bot_name: String,
        state: State,
    ) -> Bridge {
        let owner = config.owner.clone();
        Bridge {
            config,
            nats,
            hs,
            bot,
            bot_name,
            owner,
            state: tokio::sync::Mutex::new(state),
            members: Default::default(),
            typing: Default::default(),
            waiting: Default::default(),
            posting: tokio::sync::Mutex::new(()),
        }
    }

    /// Asks the orchestrator over the bridge subjects, waiting at most the configured
    /// request timeout.
    async fn request<Req, Resp>(&self, subject: &str, request: &Req) -> Result<Resp, RequestError>
    where
        Req: serde::Serialize,
        Resp: serde::de::DeserializeOwned,
    {
        request_json(&self.nats, subject, request, self.config.request_timeout).await
    }

    /// The room a session's answers go to.
    async fn room_of(&self, session_id: &str) -> Option<OwnedRoomId> {
        let state = self.state.lock().await;
        let known = state.sessions.get(session_id)?;
        OwnedRoomId::try_from(known.room_id.as_str()).ok()
    }

    async fn remember(&self, session_id: &str, room_id: &str) {
        let mut state = self.state.lock().await;
        state
            .sessions
            .entry(session_id.to_owned())
            .or_default()
            .room_id = room_id.to_owned();
    }

    /// The sessions the bridge knows (read at start, for answers missed while it was down).
    pub async fn sessions(&self) -> Vec<String> {
        self.state.lock().await.sessions.keys().cloned().collect()
    }
}

/// A transaction id made of an id: characters outside `[A-Za-z0-9_-]` become `_`.
fn txn_safe(id: &str) -> String {
    subjects::token(id)
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
