//! The bridge itself: the `/sync` loop that carries room messages into sessions, and the events
//! listener that carries her answers (and her typing) back into the rooms.
//!
//! # Invariants
//! - Inbound is at least once, stored exactly once: every `m.room.message` of a sync batch is
//!   sent to `cyrene.bridge.session.send` with its Matrix event id as the idempotency key, and
//!   the batch's `next_batch` token is saved only after the orchestrator acknowledged each of
//!   them (or refused it for good). A crash anywhere re-reads the batch; a resend returns the
//!   first ack.
//! - A group message that does not address her is sent `context_only`: it enters the session's
//!   transcript (the next turn's view shows it, attributed) without starting a turn or being
//!   steered; it is never answered, and a refusal of it is not told to the room.
//! - Outbound is at least once, posted once: answers are read from the transcript
//!   (`cyrene.bridge.session.history`), never from the event that announced them, and posted
//!   with the transcript entry's id as the Matrix transaction id; the homeserver drops a second
//!   post of the same transaction by the same device (the access token is kept in the state).
//!   They are read when a turn ends, at start (what ended while the bridge was down), and every
//!   [`SWEEP_EVERY`] for sessions still waiting (an event lost in a reconnect).
//! - The bot's own messages are never sent back in; edits are not sent (the original was).
//! - Approval (docs/matrix-bridge.md, "Approving"): an `approval_requested` event is posted as a
//!   notice in the session's room once (transaction `cyrene-approval-<call>`, and `asked` in the
//!   state across restarts; at start the pending approvals of every known session are posted if
//!   they were not). Only the owner's decision reply ([`approval::parse`]) about a call of the
//!   room's session sends `cyrene.bridge.session.approve`, and is not passed on as a message;
//!   anyone else's is an ordinary message. The decision that holds is posted once per call
//!   (transaction `cyrene-decided-<call>`), by the answer or by the `approval_decided` event,
//!   whichever comes first, with the same text.
//!
//! # Pitfalls
//! - The first sync of a bridge with no saved token only records where "now" is: messages from
//!   before the bridge's first start are not answered. A sync whose timeline was `limited` (the
//!   bridge was down long and a room was busy) skips what the homeserver left out.

use crate::approval::{self, Reply};
use crate::config::{Config, GroupAnswers, JoinPolicy};
use crate::matrix::{Homeserver, MatrixError};
use crate::rooms::{self, MessageEvent, RoomKind};
use crate::state::State;
use base64::Engine as _;
use cyrene_bus::{RequestError, request_json};
use cyrene_protocol::approval::{
    ApprovalsRequest, ApprovalsResponse, ApproveRequest, ApproveResponse, DECIDED_BY_BRIDGE,
};
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::session::{
    HistoryRequest, HistoryResponse, SendAck, SendRequest, SessionEnv, SessionEvent,
    SessionEventType,
};
use cyrene_protocol::{ErrorCode, subjects};
use futures::StreamExt;
use ruma::api::client::{
    authenticated_media::get_content, membership::join_room_by_id, membership::joined_members,
    message::send_message_event, room::get_room_event, sync::sync_events,
    typing::create_typing_event,
};
use ruma::events::MessageLikeEventType;
use ruma::serde::Raw;
use ruma::{OwnedEventId, OwnedMxcUri, OwnedRoomId, OwnedTransactionId, OwnedUserId};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How often sessions still waiting for an answer are read again.
pub const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// How long the members of a room are trusted without a member event.
const MEMBERS_TTL: Duration = Duration::from_secs(300);
/// How long one typing notice lasts; it is renewed every [`TYPING_RENEW`] while a turn runs.
const TYPING_TIMEOUT: Duration = Duration::from_secs(30);
const TYPING_RENEW: Duration = Duration::from_secs(20);
/// The longest a typing notice is kept up for one turn.
const TYPING_LIMIT: Duration = Duration::from_secs(600);
/// The client id of every message the bridge sends (the double-texting policy's "client").
pub const CLIENT_ID: &str = "matrix";
/// The transcript page read for answers.
const HISTORY_PAGE: u32 = 50;

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

/// The members of a room as last read: user id → display name.
#[derive(Debug, Clone)]
struct Members {
    read_at: Instant,
    names: BTreeMap<String, Option<String>>,
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
    members: std::sync::Mutex<HashMap<String, Members>>,
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

    /// Sends one room message to its session (the module's inbound rules).
    async fn pass_on(&self, room_id: &OwnedRoomId, event: &MessageEvent) -> Result<(), Retry> {
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

    /// The decision the owner's `event` states, and the session of its call: a reply to the
    /// bridge's notice, or `approve <call>` / `deny <call> [reason]` naming a call of
    /// `session_id` (listed by `cyrene.bridge.session.approvals`, pending or decided). `None`:
    /// an ordinary message.
    async fn decision_in(
        &self,
        room_id: &OwnedRoomId,
        session_id: &str,
        event: &MessageEvent,
    ) -> Result<Option<(String, Reply)>, Retry> {
        let content = &event.content;
        if content.msgtype != "m.text" {
            return Ok(None);
        }
        let text = content.text();
        if !approval::starts_like_a_decision(&text) {
            return Ok(None);
        }
        if let Some(event_id) = content.reply_to()
            && let Some((session, call)) = self.quoted_notice(room_id, event_id).await
        {
            return Ok(approval::parse(&text, Some(&call)).map(|reply| (session, reply)));
        }
        let Some(reply) = approval::parse(&text, None) else {
            return Ok(None);
        };
        match self.approvals(session_id).await {
            Ok(listed) if listed.approvals.iter().any(|a| a.call_id == reply.call_id) => {
                Ok(Some((session_id.to_owned(), reply)))
            }
            Ok(_) => Ok(None),
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => Ok(None),
            Err(err) => Err(Retry(format!("approvals of {session_id}: {err}"))),
        }
    }

    /// The session and call of the bridge's approval notice `event_id`, if it is one.
    async fn quoted_notice(
        &self,
        room_id: &OwnedRoomId,
        event_id: &str,
    ) -> Option<(String, String)> {
        let event_id = OwnedEventId::try_from(event_id).ok()?;
        let request = get_room_event::v3::Request::new(room_id.clone(), event_id);
        let found = self.hs.call(request).await.ok()?;
        let envelope = serde_json::from_str::<Envelope>(found.event.json().get()).ok()?;
        if envelope.sender != self.bot.as_str() {
            return None;
        }
        let field = |name: &str| envelope.content.get(name)?.as_str().map(str::to_owned);
        Some((
            field(approval::SESSION_ID_FIELD)?,
            field(approval::CALL_ID_FIELD)?,
        ))
    }

    /// Sends the owner's decision (`cyrene.bridge.session.approve`) and posts the decision that
    /// holds; a refusal is told to the room.
    async fn decide(
        &self,
        room_id: &OwnedRoomId,
        session_id: &str,
        event_id: &str,
        reply: Reply,
    ) -> Result<(), Retry> {
        let request = ApproveRequest {
            session_id: session_id.to_owned(),
            call_id: reply.call_id.clone(),
            decision: reply.decision,
            reason: reply.reason.clone(),
        };
        let sent: Result<ApproveResponse, RequestError> = self
            .request(subjects::BRIDGE_SESSION_APPROVE, &request)
            .await;
        let (txn, body) = match sent {
            Ok(held) => {
                // A batch read again repeats the bridge's own decision: still its own.
                let mine = !held.already_decided
                    || (held.decided_by == DECIDED_BY_BRIDGE && held.decision == reply.decision);
                metrics::counter!("cyrene_matrix_bridge_decisions_total",
                    "outcome" => if mine { "decided" } else { "already_decided" })
                .increment(1);
                if mine {
                    let text = approval::decision_text(
                        held.decision,
                        &held.call_id,
                        &held.decided_by,
                        reply.reason.as_deref(),
                    );
                    (decided_txn(&held.call_id), text)
                } else {
                    let text = approval::decision_text(
                        held.decision,
                        &held.call_id,
                        &held.decided_by,
                        None,
                    );
                    (
                        format!("cyrene-already-{}", txn_safe(event_id)),
                        format!("Already decided: {text}"),
                    )
                }
            }
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => {
                tracing::warn!(session = %session_id, code = %body.code, error = %body.message,
                    "the orchestrator refused a decision");
                metrics::counter!("cyrene_matrix_bridge_decisions_total", "outcome" => "refused")
                    .increment(1);
                let text = if body.code == ErrorCode::NotFound {
                    format!("No call {} waits for a decision here.", reply.call_id)
                } else {
                    format!(
                        "I couldn't take that decision about {} ({}). A reason may have at most \
                         {} bytes.",
                        reply.call_id,
                        body.code,
                        approval::MAX_REASON_BYTES
                    )
                };
                (format!("cyrene-refused-{}", txn_safe(event_id)), text)
            }
            Err(err) => return Err(Retry(format!("decision in {session_id}: {err}"))),
        };
        if let Err(err) = self
            .post_content(room_id, &txn, approval::notice(&body))
            .await
        {
            tracing::warn!(error = %err, "cannot post a decision");
        }
        Ok(())
    }

    /// The user message of a room message: its text, an image part, a document part (a file,
    /// uploaded into `session_id`), or a note of what it was.
    async fn message_of(&self, session_id: &str, event: &MessageEvent) -> Result<Message, Retry> {
        let content = &event.content;
        let text = |t: &str| Message::text(Role::User, t);
        Ok(match content.msgtype.as_str() {
            "m.text" | "m.notice" => text(&content.text()),
            "m.emote" => text(&format!("* {}", content.text())),
            "m.image" => match self.image(content).await? {
                Some(uri) => {
                    Message::with_parts(Role::User, vec![Part::ImageUrl { image_url: uri }])
                }
                None => text(notices::IMAGE_TOO_LARGE),
            },
            "m.file" => match self.document(session_id, content).await? {
                Ok(part) => Message::with_parts(Role::User, vec![part]),
                Err(note) => text(note),
            },
            _ => text(notices::UNSUPPORTED),
        })
    }

    /// The media of `content` (`mxc://…`, authenticated media), its bytes and type, when it is
    /// at most `max` bytes (declared and actual: the download is cut off past it). `None` when
    /// it is too large, missing or refused; a transient failure retries the batch.
    async fn download(
        &self,
        content: &rooms::MessageContent,
        max: usize,
    ) -> Result<Option<(Vec<u8>, String)>, Retry> {
        if content
            .info
            .as_ref()
            .and_then(|i| i.size)
            .is_some_and(|size| size > max as u64)
        {
            return Ok(None);
        }
        let Some(url) = content.url.clone() else {
            return Ok(None);
        };
        let mxc = OwnedMxcUri::from(url);
        let Ok((server, media_id)) = mxc.parts() else {
            return Ok(None);
        };
        let request = get_content::v1::Request::new(media_id.to_owned(), server.to_owned());
        let file = match self.hs.call_limited(request, Some(max)).await {
            Ok(file) => file,
            Err(err) if err.is_transient() => return Err(Retry(err.to_string())),
            Err(err) => {
                tracing::warn!(error = %err, "cannot download a file posted in a room");
                return Ok(None);
            }
        };
        let mime = file
            .content_type
            .clone()
            .or_else(|| content.info.as_ref().and_then(|i| i.mimetype.clone()))
            .unwrap_or_default();
        if file.file.len() > max {
            return Ok(None);
        }
        Ok(Some((file.file, mime)))
    }

    /// An image as a `data:` URI, or `None` when it is too large or not an image.
    async fn image(&self, content: &rooms::MessageContent) -> Result<Option<String>, Retry> {
        let Some((bytes, mime)) = self.download(content, self.config.max_image_bytes).await? else {
            return Ok(None);
        };
        if !mime.starts_with("image/") {
            return Ok(None);
        }
        let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
        Ok(Some(format!("data:{mime};base64,{data}")))
    }

    /// A file posted in a room, uploaded as a document of `session_id`
    /// (`cyrene.bridge.document.upload`): its `document` part, or the note of why not.
    ///
    /// At least once: a crash between the upload and the send uploads it again when the batch
    /// is read again (the first copy is then referenced by nothing).
    async fn document(
        &self,
        session_id: &str,
        content: &rooms::MessageContent,
    ) -> Result<Result<Part, &'static str>, Retry> {
        let Some((bytes, mime)) = self.download(content, self.config.max_file_bytes).await? else {
            return Ok(Err(notices::FILE_TOO_LARGE));
        };
        if bytes.is_empty() {
            return Ok(Err(notices::FILE));
        }
        let name = content
            .filename
            .clone()
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| content.body.clone());
        let sent = cyrene_bus::upload::upload_document(
            &self.nats,
            subjects::BRIDGE_DOCUMENT_UPLOAD,
            session_id,
            &name,
            &mime,
            &bytes,
            self.config.request_timeout,
        )
        .await;
        match sent {
            Ok(Some(document)) => Ok(Ok(document.part)),
            Ok(None) => Ok(Err(notices::FILE)),
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => {
                tracing::warn!(session = %session_id, code = %body.code, error = %body.message,
                    "the orchestrator refused a file");
                Ok(Err(if body.code == ErrorCode::TooLarge {
                    notices::FILE_TOO_LARGE
                } else {
                    notices::FILE
                }))
            }
            Err(err) => Err(Retry(format!("upload to {session_id}: {err}"))),
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

    fn forget_members(&self, room_id: &str) {
        lock(&self.members).remove(room_id);
    }

    async fn remember(&self, session_id: &str, room_id: &str) {
        let mut state = self.state.lock().await;
        state
            .sessions
            .entry(session_id.to_owned())
            .or_default()
            .room_id = room_id.to_owned();
    }

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

    /// Asks the orchestrator over the bridge subjects, waiting at most the configured
    /// request timeout.
    async fn request<Req, Resp>(&self, subject: &str, request: &Req) -> Result<Resp, RequestError>
    where
        Req: serde::Serialize,
        Resp: serde::de::DeserializeOwned,
    {
        request_json(&self.nats, subject, request, self.config.request_timeout).await
    }

    /// The approvals of `session_id`, decided or not.
    async fn approvals(&self, session_id: &str) -> Result<ApprovalsResponse, RequestError> {
        let request = ApprovalsRequest {
            session_id: session_id.to_owned(),
        };
        self.request(subjects::BRIDGE_SESSION_APPROVALS, &request)
            .await
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

    /// The room a session's answers go to.
    async fn room_of(&self, session_id: &str) -> Option<OwnedRoomId> {
        let state = self.state.lock().await;
        let known = state.sessions.get(session_id)?;
        OwnedRoomId::try_from(known.room_id.as_str()).ok()
    }

    /// Posts the notice asking for a decision about `call_id`, unless it was posted before.
    async fn ask(
        &self,
        session_id: &str,
        call_id: &str,
        tool: &str,
        arguments: &serde_json::Map<String, serde_json::Value>,
    ) {
        let asked = {
            let state = self.state.lock().await;
            state
                .sessions
                .get(session_id)
                .is_some_and(|s| s.asked.contains(call_id))
        };
        let Some(room_id) = self.room_of(session_id).await else {
            return;
        };
        if asked {
            return;
        }
        let content = approval::request_content(session_id, tool, call_id, arguments);
        let txn = format!("cyrene-approval-{}", txn_safe(call_id));
        if let Err(err) = self.post_content(&room_id, &txn, content).await {
            tracing::warn!(session = %session_id, error = %err, "cannot ask for a decision");
            return;
        }
        metrics::counter!("cyrene_matrix_bridge_approvals_asked_total").increment(1);
        let mut state = self.state.lock().await;
        if let Some(session) = state.sessions.get_mut(session_id) {
            session.asked.insert(call_id.to_owned());
        }
        if let Err(err) = state.save(&self.config.data_dir) {
            tracing::error!(error = %err, "cannot save what was asked");
        }
    }

    /// Posts the decision that holds (an `approval_decided` event), once per call.
    async fn decided(&self, event: &SessionEvent) {
        let (Some(call_id), Some(decision)) = (&event.call_id, event.decision) else {
            return;
        };
        let Some(room_id) = self.room_of(&event.session_id).await else {
            return;
        };
        let text = approval::decision_text(
            decision,
            call_id,
            event.decided_by.as_deref().unwrap_or_default(),
            event.reason.as_deref(),
        );
        if let Err(err) = self
            .post_content(&room_id, &decided_txn(call_id), approval::notice(&text))
            .await
        {
            tracing::warn!(error = %err, "cannot post a decision");
        }
        let mut state = self.state.lock().await;
        if let Some(session) = state.sessions.get_mut(&event.session_id)
            && session.asked.remove(call_id)
            && let Err(err) = state.save(&self.config.data_dir)
        {
            tracing::error!(error = %err, "cannot save what was decided");
        }
    }

    /// Posts the calls of `session_id` that wait for a decision and were not asked about yet
    /// (they were requested while the bridge was down), and forgets those decided since.
    pub async fn ask_pending(&self, session_id: &str) {
        let listed = match self.approvals(session_id).await {
            Ok(listed) => listed,
            Err(err) => {
                tracing::debug!(session = %session_id, error = %err, "cannot list the approvals");
                return;
            }
        };
        let pending: Vec<_> = listed
            .approvals
            .iter()
            .filter(|a| a.decision.is_none())
            .collect();
        for a in &pending {
            self.ask(session_id, &a.call_id, &a.tool, &a.arguments)
                .await;
        }
        let mut state = self.state.lock().await;
        if let Some(session) = state.sessions.get_mut(session_id) {
            let before = session.asked.len();
            session
                .asked
                .retain(|call| pending.iter().any(|a| a.call_id == *call));
            if session.asked.len() != before
                && let Err(err) = state.save(&self.config.data_dir)
            {
                tracing::error!(error = %err, "cannot save what was decided");
            }
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
    async fn post(
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
    async fn post_content(
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

    async fn typing_on(self: &Arc<Self>, session_id: &str) {
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

    fn typing_off(&self, session_id: &str) {
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

    /// The sessions the bridge knows (read at start, for answers missed while it was down).
    pub async fn sessions(&self) -> Vec<String> {
        self.state.lock().await.sessions.keys().cloned().collect()
    }
}

/// The transaction of the notice of the decision that holds about `call_id`.
fn decided_txn(call_id: &str) -> String {
    format!("cyrene-decided-{}", txn_safe(call_id))
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

/// Sleeps `pause`; `true` when `shutdown` fired first.
async fn sleep_or_stop(pause: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(pause) => false,
    }
}
