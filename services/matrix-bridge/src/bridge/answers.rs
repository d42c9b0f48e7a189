//! Her answers back into the rooms: the listener of the owner's sessions' events (typing while a
//! turn runs, approvals, the answer when it ends) and the posting of answers and notices
//! (docs/matrix-bridge.md, "Exactly once across restarts").
//!
//! # Invariants
//! - Outbound is at least once, posted once: answers are read from the transcript
//!   (`cyrene.bridge.session.history`), never from the event that announced them, and posted
//!   with the transcript entry's id as the Matrix transaction id; the homeserver drops a second
//!   post of the same transaction by the same device (the access token is kept in the state).
//!   They are read when a turn ends, at start (what ended while the bridge was down), and every
//!   [`SWEEP_EVERY`] for sessions still waiting (an event lost in a reconnect).
//! - What was posted (`posted_seq`) is saved after each answer; answers are read and posted by
//!   one caller at a time (`Bridge::posting`).
//! - A failed turn is told to the room once per turn (transaction `cyrene-failed-<turn>`).

use super::{Bridge, SWEEP_EVERY, lock, notices, txn_safe};
use crate::matrix::MatrixError;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::{HistoryRequest, HistoryResponse, SessionEvent, SessionEventType};
use cyrene_protocol::subjects;
use futures::StreamExt;
use ruma::api::client::message::send_message_event;
use ruma::events::MessageLikeEventType;
use ruma::serde::Raw;
use ruma::{OwnedRoomId, OwnedTransactionId};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The transcript page read for answers.
const HISTORY_PAGE: u32 = 50;

impl Bridge {
    /// Follows the owner's sessions' events until `shutdown`: typing while a turn runs, the
    /// answer when it ends.
    pub async fn follow(
        self: Arc<Self>,
        mut events: async_nats::Subscriber,
        shutdown: CancellationToken,
    ) {
        let mut sweep = tokio::time::interval(SWEEP_EVERY);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let message = tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = sweep.tick() => {
                    let waiting: Vec<String> = lock(&self.waiting).iter().cloned().collect();
                    for session in waiting {
                        self.catch_up(&session).await;
                    }
                    continue;
                }
                message = events.next() => message,
            };
            let Some(message) = message else { break };
            let Ok(event) = serde_json::from_slice::<SessionEvent>(&message.payload) else {
                continue;
            };
            match event.kind {
                SessionEventType::TurnStarted => self.typing_on(&event.session_id).await,
                SessionEventType::ApprovalRequested => {
                    self.typing_off(&event.session_id);
                    if let (Some(call_id), Some(tool)) = (&event.call_id, &event.tool) {
                        let arguments = event.arguments.clone().unwrap_or_default();
                        self.ask(&event.session_id, call_id, tool, &arguments).await;
                    }
                }
                SessionEventType::ApprovalDecided => self.decided(&event).await,
                SessionEventType::TurnEnded => {
                    self.typing_off(&event.session_id);
                    if event.message.is_none() && event.error.is_some() {
                        self.turn_failed(&event).await;
                    }
                    self.catch_up(&event.session_id).await;
                }
                _ => {}
            }
        }
        for (_, typing) in lock(&self.typing).drain() {
            typing.cancel();
        }
    }

    /// Posts the answers of `session_id` not posted yet (the module's outbound rules).
    pub async fn catch_up(&self, session_id: &str) {
        let _posting = self.posting.lock().await;
        let Some(known) = self.state.lock().await.sessions.get(session_id).cloned() else {
            return;
        };
        let Ok(room_id) = OwnedRoomId::try_from(known.room_id.as_str()) else {
            return;
        };
        let request = HistoryRequest {
            session_id: session_id.to_owned(),
            limit: Some(HISTORY_PAGE),
            before_seq: None,
        };
        let history: HistoryResponse = match self
            .request(subjects::BRIDGE_SESSION_HISTORY, &request)
            .await
        {
            Ok(history) => history,
            Err(err) => {
                tracing::warn!(session = %session_id, error = %err, "cannot read the transcript");
                return;
            }
        };
        let mut posted = known.posted_seq;
        for entry in &history.messages {
            if entry.seq <= posted || entry.message.role != Role::Assistant {
                continue;
            }
            let text = entry.message.text_content();
            if !text.trim().is_empty() {
                let txn = format!("cyrene-{}", txn_safe(&entry.id));
                if let Err(err) = self.post(&room_id, &txn, "m.text", &text).await {
                    tracing::warn!(session = %session_id, error = %err, "cannot post an answer");
                    break;
                }
                metrics::counter!("cyrene_matrix_bridge_answers_total").increment(1);
            }
            posted = entry.seq;
            let mut state = self.state.lock().await;
            if let Some(session) = state.sessions.get_mut(session_id) {
                session.posted_seq = posted;
            }
            if let Err(err) = state.save(&self.config.data_dir) {
                tracing::error!(error = %err, "cannot save what was posted");
            }
        }
        let answered = history
            .messages
            .last()
            .is_none_or(|last| last.message.role == Role::Assistant && last.seq <= posted);
        if answered {
            lock(&self.waiting).remove(session_id);
        }
    }

    /// Tells the room a turn failed (once per turn).
    async fn turn_failed(&self, event: &SessionEvent) {
        let Some(room_id) = self.room_of(&event.session_id).await else {
            return;
        };
        let txn = format!("cyrene-failed-{}", txn_safe(&event.turn_id));
        if let Err(err) = self
            .post(&room_id, &txn, "m.notice", notices::TURN_FAILED)
            .await
        {
            tracing::warn!(error = %err, "cannot tell the room a turn failed");
        }
    }

    /// Posts `body` as one message of `msgtype`, transaction `txn`.
    pub(super) async fn post(
        &self,
        room_id: &OwnedRoomId,
        txn: &str,
        msgtype: &str,
        body: &str,
    ) -> Result<(), MatrixError> {
        let content = serde_json::json!({"msgtype": msgtype, "body": body});
        self.post_content(room_id, txn, content).await
    }

    /// Posts one `m.room.message` with `content`, transaction `txn`.
    pub(super) async fn post_content(
        &self,
        room_id: &OwnedRoomId,
        txn: &str,
        content: serde_json::Value,
    ) -> Result<(), MatrixError> {
        let raw = serde_json::value::to_raw_value(&content).map_err(|e| MatrixError::Build {
            path: "send".into(),
            source: e.into(),
        })?;
        let request = send_message_event::v3::Request::new_raw(
            room_id.clone(),
            OwnedTransactionId::from(txn),
            MessageLikeEventType::RoomMessage,
            Raw::from_json(raw),
        );
        self.hs.call(request).await.map(drop)
    }
}
