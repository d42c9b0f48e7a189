//! Protocol values that the tests of several crates start from.

use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{SendRequest, SessionEnv};
use cyrene_protocol::turn::TurnJob;

/// A turn job of the built-in persona `cyrene` (昔涟, "You are Cyrene.") for session `session`,
/// answering the user message `text` (id `{turn_id}-m`), with 8 steps and no deadline.
pub fn turn_job(turn_id: &str, session: &str, text: &str) -> TurnJob {
    TurnJob {
        turn_id: turn_id.to_owned(),
        session_id: session.to_owned(),
        leg_id: String::new(),
        env: SessionEnv {
            restricted: false,
            persona: "cyrene".into(),
        },
        instructions: "You are Cyrene.".into(),
        persona_names: [("cyrene".to_owned(), "昔涟".to_owned())].into(),
        messages: vec![Message::text(Role::User, text)],
        message_ids: vec![format!("{turn_id}-m")],
        base_seq: 1,
        notice: None,
        max_steps: 8,
        deadline_unix_ms: None,
        tools: None,
        ask_chain: Vec::new(),
        guard: None,
        approval: Vec::new(),
        decisions: Vec::new(),
        attempt_base: 0,
    }
}

/// A message to `session`, sent once (idempotency key `key`) by the client `client_id`, with
/// every option at its default.
pub fn send_request(session: &str, message: Message, client_id: &str, key: &str) -> SendRequest {
    SendRequest {
        session_id: session.into(),
        message,
        client_id: client_id.into(),
        idempotency_key: key.into(),
        env: None,
        parallel: false,
        when_busy: None,
        persona: String::new(),
        context_only: false,
    }
}
