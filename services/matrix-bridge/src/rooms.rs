//! What a Matrix room and a message in it are to Cyrene (docs/matrix-bridge.md, "Mapping"):
//! which session, restricted or not, who is speaking, whether she is addressed. Pure: no I/O.
//!
//! # Invariants
//! - A room with exactly two members (the bot and one person) is direct; more is a group. The
//!   owner's direct room is the owner's own session (unrestricted); every group room and every
//!   stranger's direct room is a restricted session of its own.
//! - A session name is derived from the room id and its kind alone (a digest), so the same room
//!   of the same kind is the same session across restarts; a room that changes kind (a third
//!   person joins a DM) continues in a new session of the new kind — a session's `restricted`
//!   is fixed when it is created.
//! - A third party's name comes from the platform — their display name in that room, else their
//!   user id — never from message text. The owner is never labelled.

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// Longest `sender_name` the orchestrator takes (characters).
pub const MAX_SENDER_NAME: usize = 128;

/// What a room is, from its members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomKind {
    /// The bot and the owner.
    OwnerDirect,
    /// The bot and one other person.
    StrangerDirect,
    /// More than two members (or the bot alone).
    Group,
}

impl RoomKind {
    /// The kind of a room whose joined members are `members` (the bot among them).
    pub fn of<'a>(members: impl IntoIterator<Item = &'a str>, bot: &str, owner: &str) -> RoomKind {
        let others: Vec<&str> = members.into_iter().filter(|m| *m != bot).collect();
        match others.as_slice() {
            [one] if *one == owner => RoomKind::OwnerDirect,
            [_] => RoomKind::StrangerDirect,
            _ => RoomKind::Group,
        }
    }

    /// Whether its session is restricted (third parties speak there).
    pub fn restricted(self) -> bool {
        self != RoomKind::OwnerDirect
    }

    /// Whether every message is answered (a direct room), or only those addressed to her.
    pub fn direct(self) -> bool {
        self != RoomKind::Group
    }
}

/// The session of a room of `kind`: `<owner_person>.mx-<digest>` for the owner's direct room,
/// `<owner_person>.mxr-<digest>` (restricted) for the others. 32 hex digits of SHA-256 of the
/// room id: a valid session id for any room id.
pub fn session_id(owner_person: &str, room_id: &str, kind: RoomKind) -> String {
    let digest = Sha256::digest(room_id.as_bytes());
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    let prefix = if kind.restricted() { "mxr" } else { "mx" };
    format!("{owner_person}.{prefix}-{hex}")
}

/// The `sender_name` of a third party: their display name in the room (trimmed, when it has
/// anything printable), else their user id; at most [`MAX_SENDER_NAME`] characters.
pub fn sender_name(display_name: Option<&str>, user_id: &str) -> String {
    let name = display_name
        .map(str::trim)
        .filter(|n| n.chars().any(|c| !c.is_control() && !c.is_whitespace()))
        .unwrap_or(user_id);
    name.chars().take(MAX_SENDER_NAME).collect()
}

/// The parts of an `m.room.message` event the bridge reads (the rest is ignored).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct MessageEvent {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub event_id: String,
    #[serde(default)]
    pub sender: String,
    #[serde(default)]
    pub content: MessageContent,
}

/// `content` of an `m.room.message`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct MessageContent {
    pub msgtype: String,
    pub body: String,
    /// `mxc://…` of an image or file.
    pub url: Option<String>,
    pub info: Option<MediaInfo>,
    pub filename: Option<String>,
    #[serde(rename = "m.mentions")]
    pub mentions: Option<Mentions>,
    #[serde(rename = "m.relates_to")]
    pub relates_to: Option<RelatesTo>,
    /// An edit's new content: edits are not passed on (the original was).
    #[serde(rename = "m.new_content")]
    pub new_content: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct MediaInfo {
    pub mimetype: Option<String>,
    pub size: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct Mentions {
    pub user_ids: Vec<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct RelatesTo {
    #[serde(rename = "m.in_reply_to")]
    pub in_reply_to: Option<InReplyTo>,
    pub rel_type: Option<String>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct InReplyTo {
    pub event_id: String,
}

impl MessageContent {
    /// The event a reply answers, if it is one.
    pub fn reply_to(&self) -> Option<&str> {
        self.relates_to
            .as_ref()?
            .in_reply_to
            .as_ref()
            .map(|r| r.event_id.as_str())
            .filter(|id| !id.is_empty())
    }

    /// Whether this is an edit (`m.replace`) of an earlier message.
    pub fn is_edit(&self) -> bool {
        self.new_content.is_some()
            || self.relates_to.as_ref().and_then(|r| r.rel_type.as_deref()) == Some("m.replace")
    }

    /// The text a person wrote: `body` without the quoted fallback of a reply (`> …` lines
    /// followed by a blank line, from older clients).
    pub fn text(&self) -> String {
        if self.reply_to().is_none() || !self.body.starts_with("> ") {
            return self.body.clone();
        }
        let mut lines = self.body.lines().skip_while(|l| l.starts_with("> "));
        let first = lines.next();
        let rest: Vec<&str> = match first {
            Some("") => lines.collect(),
            Some(line) => std::iter::once(line).chain(lines).collect(),
            None => Vec::new(),
        };
        rest.join("\n")
    }

    /// Whether the message names the bot: `m.mentions.user_ids`, or its user id or (non-empty)
    /// display name in the text, case-insensitively.
    pub fn mentions(&self, bot: &str, bot_display_name: &str) -> bool {
        if self
            .mentions
            .as_ref()
            .is_some_and(|m| m.user_ids.iter().any(|u| u == bot))
        {
            return true;
        }
        let text = self.text().to_lowercase();
        let name = bot_display_name.trim().to_lowercase();
        text.contains(&bot.to_lowercase()) || (!name.is_empty() && text.contains(&name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const BOT: &str = "@cyrene:localhost";
    const OWNER: &str = "@alice:localhost";

    #[test]
    fn two_members_are_direct_more_are_a_group() {
        assert_eq!(
            RoomKind::of([BOT, OWNER], BOT, OWNER),
            RoomKind::OwnerDirect
        );
        let stranger = RoomKind::of([BOT, "@ming:localhost"], BOT, OWNER);
        assert_eq!(stranger, RoomKind::StrangerDirect);
        let group = RoomKind::of([BOT, OWNER, "@ming:localhost"], BOT, OWNER);
        assert_eq!(group, RoomKind::Group);
        assert!(stranger.restricted() && group.restricted());
        assert!(!RoomKind::OwnerDirect.restricted());
        assert!(stranger.direct() && !group.direct());
    }

    #[test]
    fn a_room_is_one_session_per_kind_and_always_a_valid_id() {
        let room = "!weird.room*id>:example.org";
        let dm = session_id("alice", room, RoomKind::OwnerDirect);
        let group = session_id("alice", room, RoomKind::Group);
        assert!(dm.starts_with("alice.mx-") && group.starts_with("alice.mxr-"));
        assert_eq!(dm, session_id("alice", room, RoomKind::OwnerDirect));
        assert_eq!(group, session_id("alice", room, RoomKind::StrangerDirect));
        for id in [dm, group] {
            cyrene_protocol::ids::validate(cyrene_protocol::ids::IdKind::Session, &id).unwrap();
        }
    }

    #[test]
    fn a_third_party_is_named_by_the_platform() {
        assert_eq!(sender_name(Some(" 阿明 "), "@ming:localhost"), "阿明");
        assert_eq!(sender_name(None, "@ming:localhost"), "@ming:localhost");
        assert_eq!(
            sender_name(Some("  "), "@ming:localhost"),
            "@ming:localhost"
        );
        assert_eq!(
            sender_name(Some("\u{7}"), "@ming:localhost"),
            "@ming:localhost"
        );
        assert_eq!(
            sender_name(Some(&"x".repeat(300)), "@m:l").chars().count(),
            128
        );
    }

    fn content(value: serde_json::Value) -> MessageContent {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn mentions_by_pill_name_or_id_and_nothing_else() {
        let pill = content(json!({"msgtype":"m.text","body":"hey you",
            "m.mentions":{"user_ids":[BOT]}}));
        assert!(pill.mentions(BOT, "Cyrene"));
        let name = content(json!({"msgtype":"m.text","body":"cyrene, what time is it?"}));
        assert!(name.mentions(BOT, "Cyrene"));
        let id = content(json!({"msgtype":"m.text","body":"ask @cyrene:localhost"}));
        assert!(id.mentions(BOT, ""));
        let other = content(json!({"msgtype":"m.text","body":"lunch?",
            "m.mentions":{"user_ids":[OWNER]}}));
        assert!(!other.mentions(BOT, "Cyrene"));
        assert!(!other.mentions(BOT, ""));
    }

    #[test]
    fn a_reply_loses_its_quoted_fallback() {
        let reply = content(json!({"msgtype":"m.text",
            "body":"> <@cyrene:localhost> It is noon.\n> more\n\nthanks!",
            "m.relates_to":{"m.in_reply_to":{"event_id":"$e1"}}}));
        assert_eq!(reply.reply_to(), Some("$e1"));
        assert_eq!(reply.text(), "thanks!");
        let plain = content(json!({"msgtype":"m.text","body":"> quoting is fine"}));
        assert_eq!(plain.text(), "> quoting is fine");
        let edit = content(json!({"msgtype":"m.text","body":"* fixed",
            "m.new_content":{"msgtype":"m.text","body":"fixed"},
            "m.relates_to":{"rel_type":"m.replace","event_id":"$e1"}}));
        assert!(edit.is_edit());
    }
}
