//! The configured personas as agents on the comm protocol (DESIGN §4, §6): an ask to persona `p`
//! runs as a turn of `p`'s ask session `ask-<p>` and the turn's final answer is the reply.
//!
//! # Invariants
//! - The asking replica subscribes to a private completion subject *before* storing the ask's
//!   message, and stores that subject with the message. Whichever replica records the turn that
//!   consumed the message publishes the answer there ([`crate::engine::TurnDone`]), so an ask is
//!   answered even when its turn completes on another replica.
//! - Ask messages are *solo*: never steered into another turn and never batched, so each ask is
//!   answered by a turn of its own; the session fence serialises them across replicas.
//! - Every ask ends: with the answer, `timeout` after `ask_timeout`, or `unavailable` when the
//!   orchestrator shuts down.

use crate::engine::{Engine, TurnDone};
use crate::store::NewMessage;
use cyrene_comm::{AgentHandle, Answer, CommError, Handler, Probe};
use cyrene_protocol::comm::Ask;
use cyrene_protocol::ids::{self, MAX_ID_LEN};
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::TurnOutcome;
use cyrene_protocol::{ErrorBody, ErrorCode};
use futures::StreamExt;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Prefix of the private completion subjects of asks.
pub const ASK_DONE_PREFIX: &str = "cyrene.orchestrator.ask";

/// The client id recorded on ask messages.
pub const ASK_CLIENT_ID: &str = "comm";

/// The ask session of a persona: `ask-<persona id>` (bounded to the id length limit).
pub fn ask_session_id(persona: &str) -> String {
    let token = subjects::token(persona);
    let room = MAX_ID_LEN - "ask-".len();
    let token: String = token.chars().take(room).collect();
    format!("ask-{token}")
}

/// Answers asks to one persona.
#[derive(Debug)]
pub struct PersonaAgent {
    engine: Arc<Engine>,
    persona: String,
    shutdown: CancellationToken,
}

impl Handler for PersonaAgent {
    async fn on_ask(&self, ask: Ask) -> Result<Answer, ErrorBody> {
        if ask.question.trim().is_empty() {
            return Err(ErrorBody::new(
                ErrorCode::BadRequest,
                "the question is empty",
            ));
        }
        let session_id = ask_session_id(&self.persona);
        let done_subject = format!("{ASK_DONE_PREFIX}.{}.done", ids::new_id());
        let mut done = self
            .engine
            .client()
            .subscribe(done_subject.clone())
            .await
            .map_err(|e| ErrorBody::new(ErrorCode::Unavailable, format!("subscribe: {e}")))?;
        let asker: String = ask
            .from
            .chars()
            .take(crate::engine::MAX_SENDER_NAME)
            .collect();
        let mut message = Message::text(Role::User, ask.question);
        message.sender_name = asker;
        let input = NewMessage {
            session_id,
            message,
            client_id: ASK_CLIENT_ID.to_owned(),
            idempotency_key: None,
            env: self.engine.ask_env(&self.persona),
            parallel: false,
            solo: true,
            reply_to: Some(done_subject),
        };
        crate::engine::check_user_message(&input.message, self.engine.config().max_message_bytes)?;
        let ack = self.engine.store_message(input).await?;
        let limit = self.engine.config().ask_timeout;
        let note = tokio::select! {
            _ = self.shutdown.cancelled() => {
                return Err(ErrorBody::new(ErrorCode::Unavailable, "the orchestrator is shutting down"));
            }
            next = tokio::time::timeout(limit, done.next()) => match next {
                Err(_) => {
                    return Err(ErrorBody::new(ErrorCode::Timeout, format!(
                        "{} did not answer within {limit:?} (message {})", self.persona, ack.message_id)));
                }
                Ok(None) => {
                    return Err(ErrorBody::new(ErrorCode::Unavailable, "the completion subscription closed"));
                }
                Ok(Some(m)) => m,
            },
        };
        let _ = done.unsubscribe().await;
        let note: TurnDone = serde_json::from_slice(&note.payload).map_err(|e| {
            ErrorBody::new(ErrorCode::Internal, format!("bad completion note: {e}"))
        })?;
        match (note.outcome, note.error) {
            (TurnOutcome::Final, _) => Ok(Answer::text(note.text)),
            (_, Some(err)) => Err(err),
            (outcome, None) => Err(ErrorBody::new(
                ErrorCode::Internal,
                format!("the turn ended without an answer ({outcome:?})"),
            )),
        }
    }
}

/// Registers every configured persona on the comm protocol.
pub async fn serve(
    engine: Arc<Engine>,
    shutdown: CancellationToken,
) -> Result<Vec<AgentHandle>, CommError> {
    let mut handles = Vec::new();
    let personas: Vec<String> = engine
        .config()
        .personas
        .personas
        .iter()
        .map(|p| p.id.clone())
        .collect();
    for persona in personas {
        let probe = Probe::new(engine.client().clone(), persona.clone());
        let agent = PersonaAgent {
            engine: engine.clone(),
            persona,
            shutdown: shutdown.clone(),
        };
        handles.push(probe.serve(Arc::new(agent)).await?);
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::ids::IdKind;

    #[test]
    fn ask_sessions_are_valid_ids() {
        assert_eq!(ask_session_id("cyrene"), "ask-cyrene");
        let long = ask_session_id(&"a".repeat(128));
        assert!(ids::validate(IdKind::Session, &long).is_ok());
        assert!(ids::validate(IdKind::Session, &ask_session_id("星.x")).is_ok());
    }
}
