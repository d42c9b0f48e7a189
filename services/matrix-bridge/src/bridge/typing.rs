//! The typing notice in a session's room while one of its turns runs (docs/matrix-bridge.md,
//! "Mapping": "While a turn runs").
//!
//! # Invariants
//! - At most one notice task per session: a new turn cancels the old one's task; a turn's end,
//!   an approval request, or the listener stopping cancels it.
//! - A notice lasts [`TYPING_TIMEOUT`] and is renewed every [`TYPING_RENEW`], for at most
//!   [`TYPING_LIMIT`]; the task always ends by saying "not typing". Failures are only logged.

use super::{Bridge, lock};
use ruma::OwnedRoomId;
use ruma::api::client::typing::create_typing_event;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long one typing notice lasts; it is renewed every [`TYPING_RENEW`] while a turn runs.
const TYPING_TIMEOUT: Duration = Duration::from_secs(30);
const TYPING_RENEW: Duration = Duration::from_secs(20);
/// The longest a typing notice is kept up for one turn.
const TYPING_LIMIT: Duration = Duration::from_secs(600);

impl Bridge {
    pub(super) async fn typing_on(self: &Arc<Self>, session_id: &str) {
        let Some(room_id) = self.room_of(session_id).await else {
            return;
        };
        let stop = CancellationToken::new();
        if let Some(old) = lock(&self.typing).insert(session_id.to_owned(), stop.clone()) {
            old.cancel();
        }
        let bridge = self.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            while started.elapsed() < TYPING_LIMIT {
                let typing = create_typing_event::v3::Typing::Yes(
                    create_typing_event::v3::TypingInfo::new(TYPING_TIMEOUT),
                );
                bridge.typing(&room_id, typing).await;
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(TYPING_RENEW) => {}
                }
            }
            bridge
                .typing(&room_id, create_typing_event::v3::Typing::No)
                .await;
        });
    }

    pub(super) fn typing_off(&self, session_id: &str) {
        if let Some(typing) = lock(&self.typing).remove(session_id) {
            typing.cancel();
        }
    }

    async fn typing(&self, room_id: &OwnedRoomId, typing: create_typing_event::v3::Typing) {
        let request =
            create_typing_event::v3::Request::new(self.bot.clone(), room_id.clone(), typing);
        if let Err(err) = self.hs.call(request).await {
            tracing::debug!(error = %err, "cannot show typing");
        }
    }
}
