//! The `/sync` loop: invitations accepted by the join policy, then every `m.room.message` of a
//! batch passed on in order (`inbound`), then the batch's `next_batch` token saved
//! (docs/matrix-bridge.md, "Mapping": "Invitations"; "Exactly once across restarts").
//!
//! # Invariants
//! - Inbound is at least once, stored exactly once: the batch's `next_batch` token is saved only
//!   after the orchestrator acknowledged each of its messages (or refused it for good). A
//!   [`Retry`] reads the same batch again; a crash anywhere re-reads it; a resend returns the
//!   first ack.
//! - A member event forgets the room's cached members (`inbound`).
//!
//! # Pitfalls
//! - The first sync of a bridge with no saved token only records where "now" is: messages from
//!   before the bridge's first start are not answered. A sync whose timeline was `limited` (the
//!   bridge was down long and a room was busy) skips what the homeserver left out.

use super::{Bridge, Envelope, Retry};
use crate::config::JoinPolicy;
use crate::rooms::MessageEvent;
use ruma::api::client::{membership::join_room_by_id, sync::sync_events};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl Bridge {
    /// Syncs until `shutdown`: invitations, room messages, then the saved token. `ready` is
    /// called after the first successful sync.
    pub async fn sync_loop(self: &Arc<Self>, shutdown: &CancellationToken, ready: impl Fn()) {
        let mut since = self.state.lock().await.since.clone();
        let mut pause = Duration::from_millis(200);
        let mut announced = false;
        loop {
            let mut request = sync_events::v3::Request::new();
            request.since = since.clone();
            request.timeout = Some(if since.is_none() {
                Duration::ZERO
            } else {
                self.config.sync_timeout
            });
            let answer = tokio::select! {
                _ = shutdown.cancelled() => return,
                answer = self.hs.call(request) => answer,
            };
            let response = match answer {
                Ok(response) => response,
                Err(err) => {
                    tracing::warn!(error = %err, "sync failed; trying again");
                    if sleep_or_stop(pause, shutdown).await {
                        return;
                    }
                    pause = (pause * 2).min(Duration::from_secs(10));
                    continue;
                }
            };
            pause = Duration::from_millis(200);
            let first = since.is_none();
            match self.apply(response.rooms, first, shutdown).await {
                Ok(()) => {}
                Err(Retry(why)) => {
                    tracing::warn!(%why, "a message could not be passed on; reading the batch again");
                    if sleep_or_stop(Duration::from_secs(1), shutdown).await {
                        return;
                    }
                    continue;
                }
            }
            since = Some(response.next_batch);
            {
                let mut state = self.state.lock().await;
                state.since = since.clone();
                if let Err(err) = state.save(&self.config.data_dir) {
                    tracing::error!(error = %err, "cannot save the sync token");
                }
            }
            if !announced {
                announced = true;
                ready();
            }
        }
    }

    /// Handles one sync batch: joins, then every message in order.
    async fn apply(
        self: &Arc<Self>,
        rooms: sync_events::v3::Rooms,
        first: bool,
        shutdown: &CancellationToken,
    ) -> Result<(), Retry> {
        for (room_id, invited) in &rooms.invite {
            let inviter = invited.invite_state.events.iter().find_map(|raw| {
                let event: Envelope = serde_json::from_str(raw.json().get()).ok()?;
                let me = event.state_key.as_deref() == Some(self.bot.as_str());
                let invite =
                    event.content.get("membership").and_then(|m| m.as_str()) == Some("invite");
                (event.kind == "m.room.member" && me && invite).then_some(event.sender)
            });
            let accept = match self.config.join {
                JoinPolicy::Any => true,
                JoinPolicy::Owner => inviter.as_deref() == Some(self.owner.as_str()),
            };
            if !accept {
                tracing::info!(room = %room_id, ?inviter, "invitation not from the owner; not joining");
                continue;
            }
            match self
                .hs
                .call(join_room_by_id::v3::Request::new(room_id.clone()))
                .await
            {
                Ok(_) => tracing::info!(room = %room_id, "joined"),
                Err(err) => tracing::warn!(room = %room_id, error = %err, "cannot join"),
            }
        }
        for (room_id, joined) in &rooms.join {
            if joined.timeline.limited {
                tracing::warn!(room = %room_id, "the homeserver left out part of this room's timeline");
            }
            for raw in &joined.timeline.events {
                if shutdown.is_cancelled() {
                    return Err(Retry("stopping".into()));
                }
                let json = raw.json().get();
                let Ok(envelope) = serde_json::from_str::<Envelope>(json) else {
                    continue;
                };
                if envelope.kind == "m.room.member" {
                    self.forget_members(room_id.as_str());
                    continue;
                }
                if envelope.kind != "m.room.message" || first {
                    continue;
                }
                let Ok(event) = serde_json::from_str::<MessageEvent>(json) else {
                    continue;
                };
                self.pass_on(room_id, &event).await?;
            }
        }
        Ok(())
    }
}

/// Sleeps `pause`; `true` when `shutdown` fired first.
async fn sleep_or_stop(pause: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(pause) => false,
    }
}
