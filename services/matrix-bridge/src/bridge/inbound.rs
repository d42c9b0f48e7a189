//! One room message into its session: `cyrene.bridge.session.send` with the Matrix event id as
//! the idempotency key (docs/matrix-bridge.md, "Mapping": "When she answers", "What she hears
//! without answering"), and the cache of each room's members it needs to tell a direct room
//! from a group and to name the speaker.
//!
//! # Invariants
//! - The bot's own messages are never sent back in; edits are not sent (the original was).
//! - A group message that does not address her is sent `context_only`: it enters the session's
//!   transcript (the next turn's view shows it, attributed) without starting a turn or being
//!   steered; it is never answered, and a refusal of it is not told to the room.
//! - The session is remembered (its room, in the [`State`](crate::state::State)) before the
//!   send: the turn it starts may end before the ack arrives.
//! - The owner's decision reply about a call of the room's session is a decision
//!   (`approvals`), not a message.
//! - A room's members are trusted for [`MEMBERS_TTL`], or until a member event (`sync`).

use super::{Bridge, CLIENT_ID, Envelope, Retry, lock, notices, txn_safe};
use crate::config::GroupAnswers;
use crate::rooms::{self, MessageEvent, RoomKind};
use cyrene_bus::RequestError;
use cyrene_protocol::session::{SendAck, SendRequest, SessionEnv};
use cyrene_protocol::{ErrorCode, subjects};
use ruma::api::client::{membership::joined_members, room::get_room_event};
use ruma::{OwnedEventId, OwnedRoomId};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long the members of a room are trusted without a member event.
const MEMBERS_TTL: Duration = Duration::from_secs(300);

/// The members of a room as last read: user id → display name.
#[derive(Debug, Clone)]
pub(super) struct Members {
    read_at: Instant,
    names: BTreeMap<String, Option<String>>,
}

impl Bridge {
    /// Sends one room message to its session (the module's inbound rules).
    pub(super) async fn pass_on(
        &self,
        room_id: &OwnedRoomId,
        event: &MessageEvent,
    ) -> Result<(), Retry> {
        if event.sender == self.bot.as_str() || event.content.is_edit() || event.event_id.is_empty()
        {
            return Ok(());
        }
        let members = self.members(room_id).await?;
        let kind = RoomKind::of(
            members.keys().map(String::as_str),
            self.bot.as_str(),
            &self.owner,
        );
        let addressed = kind.direct()
            || self.config.group_answers == GroupAnswers::All
            || event.content.mentions(self.bot.as_str(), &self.bot_name)
            || self.replies_to_me(room_id, &event.content).await;
        // Not addressed to her: still said in her hearing, so it enters the conversation as
        // context only (no turn; docs/matrix-bridge.md, "Group rooms").
        let context_only = !addressed;
        let session_id = rooms::session_id(&self.config.owner_person, room_id.as_str(), kind);
        // The owner deciding a call that waits: a decision, not a message.
        if event.sender == self.owner
            && let Some((session, reply)) = self.decision_in(room_id, &session_id, event).await?
        {
            return self.decide(room_id, &session, &event.event_id, reply).await;
        }
        let mut message = self.message_of(&session_id, event).await?;
        if event.sender != self.owner {
            let display = members.get(&event.sender).cloned().flatten();
            message.sender_name = rooms::sender_name(display.as_deref(), &event.sender);
        }
        let request = SendRequest {
            session_id: session_id.clone(),
            message,
            client_id: CLIENT_ID.into(),
            idempotency_key: event.event_id.clone(),
            env: kind.restricted().then(|| SessionEnv {
                restricted: true,
                persona: String::new(),
            }),
            parallel: false,
            when_busy: None,
            persona: String::new(),
            context_only,
        };
        // Known before the send: the turn it starts may end before the ack arrives.
        self.remember(&session_id, room_id.as_str()).await;
        let sent: Result<SendAck, RequestError> =
            self.request(subjects::BRIDGE_SESSION_SEND, &request).await;
        match sent {
            Ok(ack) if context_only => {
                tracing::debug!(session = %session_id, message_id = %ack.message_id,
                    "passed on as context");
                metrics::counter!("cyrene_matrix_bridge_messages_total", "outcome" => "context")
                    .increment(1);
                Ok(())
            }
            Ok(ack) => {
                tracing::debug!(session = %session_id, message_id = %ack.message_id, "passed on");
                metrics::counter!("cyrene_matrix_bridge_messages_total", "outcome" => "sent")
                    .increment(1);
                lock(&self.waiting).insert(session_id);
                Ok(())
            }
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => {
                tracing::warn!(session = %session_id, code = %body.code, error = %body.message,
                    "the orchestrator refused a message");
                metrics::counter!("cyrene_matrix_bridge_messages_total", "outcome" => "refused")
                    .increment(1);
                if context_only {
                    // Nobody asked her anything: no notice in the room (logged and counted).
                    return Ok(());
                }
                let notice = if body.code == ErrorCode::TooLarge {
                    notices::TOO_LARGE
                } else {
                    notices::REFUSED
                };
                let txn = format!("cyrene-refused-{}", txn_safe(&event.event_id));
                if let Err(err) = self.post(room_id, &txn, "m.notice", notice).await {
                    tracing::warn!(error = %err, "cannot tell the room");
                }
                Ok(())
            }
            Err(err) => Err(Retry(format!("{session_id}: {err}"))),
        }
    }

    /// Whether `content` replies to one of the bot's messages.
    async fn replies_to_me(&self, room_id: &OwnedRoomId, content: &rooms::MessageContent) -> bool {
        let Some(event_id) = content.reply_to() else {
            return false;
        };
        let Ok(event_id) = OwnedEventId::try_from(event_id) else {
            return false;
        };
        let request = get_room_event::v3::Request::new(room_id.clone(), event_id);
        match self.hs.call(request).await {
            Ok(found) => serde_json::from_str::<Envelope>(found.event.json().get())
                .is_ok_and(|e| e.sender == self.bot.as_str()),
            Err(_) => false,
        }
    }

    /// The joined members of a room (cached until a member event or [`MEMBERS_TTL`]).
    async fn members(
        &self,
        room_id: &OwnedRoomId,
    ) -> Result<BTreeMap<String, Option<String>>, Retry> {
        if let Some(known) = lock(&self.members).get(room_id.as_str())
            && known.read_at.elapsed() < MEMBERS_TTL
        {
            return Ok(known.names.clone());
        }
        let request = joined_members::v3::Request::new(room_id.clone());
        let joined = self
            .hs
            .call(request)
            .await
            .map_err(|e| Retry(format!("members of {room_id}: {e}")))?;
        let names: BTreeMap<String, Option<String>> = joined
            .joined
            .into_iter()
            .map(|(user, member)| (user.to_string(), member.display_name))
            .collect();
        lock(&self.members).insert(
            room_id.to_string(),
            Members {
                read_at: Instant::now(),
                names: names.clone(),
            },
        );
        Ok(names)
    }

    pub(super) fn forget_members(&self, room_id: &str) {
        lock(&self.members).remove(room_id);
    }
}
