//! The configured personas as agents on the comm protocol (docs/architecture.md §4, §6): an ask
//! from agent `a` to persona `p` runs as a turn of the ask session of the pair (`p`, `a`)
//! ([`ask_session_id`]) and the turn's final answer is the reply.
//!
//! # Invariants
//! - The asking replica subscribes to a private completion subject *before* storing the ask's
//!   message, and stores that subject with the message. Whichever replica records the turn that
//!   consumed the message publishes the answer there ([`crate::engine::TurnDone`]), so an ask is
//!   answered even when its turn completes on another replica.
//! - Ask messages are *solo*: never steered into another turn and never batched, so each ask is
//!   answered by a turn of its own; the session fence serialises them across replicas.
//! - Asks of different askers run side by side (each in its own ask session), at most
//!   `ask_concurrency` per persona; an asker's own asks one after the other. Accepted asks are
//!   bounded in bytes (`ask_queue_bytes`, a quarter per asker): over it an ask is refused
//!   `unavailable` as it arrives, never dropped ([`ask_limits`], `cyrene_comm::AskLimits`).
//! - Every ask ends: with the answer, `timeout` after `ask_timeout`, or `unavailable` when the
//!   orchestrator shuts down.
//! - Askers never see each other: each (persona, asker) pair has its own ask session, so an
//!   asker's turn is seeded only with that asker's earlier questions and the answers to them.
//!   The session is the asker's own (`<asker>.ask-…`): a person reads it, nobody else.
//! - The asker is who the subject says: the probe answers an ask whose `from` is not the
//!   subject's sender `forbidden` before it reaches [`PersonaAgent::on_ask`]. Its name is stored
//!   as `sender_name` in its normalised form ([`display_name`]), never raw, in the **agent lane**
//!   (`sender_kind: agent`): an asking agent is not a person, so in a restricted ask session it
//!   is neither a third party nor the owner.
//! - An ask's `data` reaches the turn as a second text part of its message ([`ask_message`]);
//!   its `chain`, followed by the persona, becomes the job's `ask_chain`, which the worker's
//!   `ask_agent` passes on, so an ask back along the chain is refused at once by the probe
//!   (docs/comm.md, "Cycles").

use crate::engine::{Engine, TurnDone};
use crate::store::NewMessage;
use cyrene_comm::{AgentHandle, Answer, AskLimits, CommError, Handler, Probe};
use cyrene_protocol::comm::Ask;
use cyrene_protocol::ids::{self, MAX_ID_LEN};
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::names::display_name;
use cyrene_protocol::session::BusyPolicy;
use cyrene_protocol::subjects;
use cyrene_protocol::turn::TurnOutcome;
use cyrene_protocol::{ErrorBody, ErrorCode};
use futures::StreamExt;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Prefix of the private completion subjects of asks.
pub const ASK_DONE_PREFIX: &str = "cyrene.orchestrator.ask";

/// The client id recorded on ask messages.
pub const ASK_CLIENT_ID: &str = "comm";

/// How many characters of the persona token a session id shows.
const ASK_SESSION_PART: usize = 40;

/// The ask session of asker `from` with `persona`: `<asker>.ask-<persona token>-<digest>`, a
/// session of the asker's own (docs/security.md, "People": a person reads their ask exchanges
/// on `cyrene.person.<asker>.…`, nobody else does). `<asker>` is the asker's subject token cut
/// to 128 characters (`_` when empty), the persona token is cut to 40, the digest is the first
/// 128 bits of SHA-256 over `persona`, a NUL and the raw `from`, in hex. The readable parts are
/// for operators; the digest makes the id one per pair even when tokens are cut, contain `-`,
/// or two ids sanitise alike (`阿明` and `主人` are both `__` on the wire but two askers).
pub fn ask_session_id(persona: &str, from: &str) -> String {
    let mut asker: String = subjects::token(from).chars().take(MAX_ID_LEN).collect();
    if asker.is_empty() {
        asker.push('_');
    }
    let shown: String = subjects::token(persona)
        .chars()
        .take(ASK_SESSION_PART)
        .collect();
    let mut hasher = Sha256::new();
    hasher.update(persona.as_bytes());
    hasher.update([0]);
    hasher.update(from.as_bytes());
    let digest = hasher.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{asker}.ask-{shown}-{hex}")
}

/// Deepest ask chain accepted (agents answering asks on each other's behalf).
pub const MAX_ASK_CHAIN: usize = 16;

/// The user message of an ask: the question, then — when the ask carries `data` — a second text
/// part holding it as a JSON block, so the model reads the payload beside the question and the
/// question's text stays as asked (docs/comm.md, "Data").
pub fn ask_message(question: String, data: &Value) -> Message {
    let mut message = Message::text(Role::User, question);
    if !data.is_null() {
        let json = serde_json::to_string(data).unwrap_or_default();
        message.content.push(Part::text(format!(
            "{ASK_DATA_LABEL}\n```json\n{json}\n```"
        )));
    }
    message
}

/// The line opening the `data` part of an ask's message.
pub const ASK_DATA_LABEL: &str = "Data sent with this question (JSON):";

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
        // The probe has checked that `from` is the sender's own id; what reaches a prompt is its
        // normalised form, and a name with nothing printable left is refused (an empty label
        // would read as the owner in a restricted session).
        let asker = display_name(&ask.from);
        if asker.is_empty() {
            return Err(ErrorBody::new(
                ErrorCode::BadRequest,
                "`from` has no printable characters",
            ));
        }
        let session_id = ask_session_id(&self.persona, &ask.from);
        let done_subject = format!("{ASK_DONE_PREFIX}.{}.done", ids::new_id());
        let mut done = self
            .engine
            .client()
            .subscribe(done_subject.clone())
            .await
            .map_err(|e| ErrorBody::new(ErrorCode::Unavailable, format!("subscribe: {e}")))?;
        // The agent lane: the asker is an agent (its id unverified by the runtime), never a
        // third-party person of a restricted session nor, unlabelled, its owner.
        if ask.chain.len() >= MAX_ASK_CHAIN {
            return Err(ErrorBody::new(
                ErrorCode::BadRequest,
                format!(
                    "the ask chain is {} agents deep; at most {MAX_ASK_CHAIN}",
                    ask.chain.len()
                ),
            ));
        }
        // The probe refused an ask whose chain holds this persona (a cycle, `conflict`); the
        // turn answering this one serves the chain and this persona.
        let mut ask_chain: Vec<String> = ask
            .chain
            .iter()
            .map(|id| subjects::token(id).chars().take(MAX_ID_LEN).collect())
            .collect();
        ask_chain.push(self.persona.clone());
        let message = ask_message(ask.question, &ask.data).from_agent(asker);
        let input = NewMessage {
            session_id,
            message,
            client_id: ASK_CLIENT_ID.to_owned(),
            idempotency_key: None,
            env: self.engine.ask_env(&self.persona),
            policy: BusyPolicy::Steer,
            solo: true,
            reply_to: Some(done_subject),
            ask_chain,
            context_only: false,
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

/// How a persona holds and runs asks: `ask_concurrency` askers side by side, `ask_queue_bytes`
/// accepted (a quarter per asker, so one asker cannot take it all).
pub fn ask_limits(config: &crate::Config) -> AskLimits {
    AskLimits {
        concurrent: config.ask_concurrency,
        accepted_bytes: config.ask_queue_bytes,
        asker_bytes: (config.ask_queue_bytes / 4).max(1),
        ..AskLimits::default()
    }
}

/// Registers every configured persona on the comm protocol.
pub async fn serve(
    engine: Arc<Engine>,
    shutdown: CancellationToken,
) -> Result<Vec<AgentHandle>, CommError> {
    let mut handles = Vec::new();
    let limits = ask_limits(engine.config());
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
        handles.push(probe.serve_with(Arc::new(agent), limits).await?);
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::ids::IdKind;

    #[test]
    fn ask_data_is_a_json_part_after_the_question() {
        let plain = ask_message("hi?".into(), &Value::Null);
        assert_eq!(plain.content, vec![Part::text("hi?")]);
        let with = ask_message("total?".into(), &serde_json::json!({"items":[1,2]}));
        assert_eq!(with.content.len(), 2);
        assert_eq!(with.content[0], Part::text("total?"));
        assert_eq!(
            with.content[1],
            Part::text(format!(
                "{ASK_DATA_LABEL}\n```json\n{{\"items\":[1,2]}}\n```"
            ))
        );
    }

    #[test]
    fn ask_sessions_are_valid_ids() {
        let id = ask_session_id("cyrene", "alice");
        assert!(id.starts_with("alice.ask-cyrene-"), "{id}");
        assert_eq!(id.len(), "alice.ask-cyrene-".len() + 32);
        assert_eq!(ids::session_person(&id), Some("alice"));
        let long = ask_session_id(&"a".repeat(128), &"b".repeat(10_000));
        assert!(ids::validate(IdKind::Session, &long).is_ok(), "{long}");
        for (persona, from) in [("cyrene", "星.x"), ("p", "x）\n[发言归属]"), ("p", "")] {
            let id = ask_session_id(persona, from);
            assert!(ids::validate(IdKind::Session, &id).is_ok(), "{id}");
        }
    }

    #[test]
    fn every_asker_of_a_persona_has_its_own_session() {
        let pairs = [
            ("cyrene", "alice"),
            ("cyrene", "bob"),
            ("hoshi", "alice"),
            // Sanitised alike on the wire, still two askers.
            ("cyrene", "阿明"),
            ("cyrene", "主人"),
            // The same readable parts.
            ("a-b", "c"),
            ("a", "b-c"),
            // Cut to the same 40 characters.
            ("cyrene", &"x".repeat(50)),
            ("cyrene", &"x".repeat(51)),
        ];
        let ids: std::collections::HashSet<String> =
            pairs.iter().map(|(p, f)| ask_session_id(p, f)).collect();
        assert_eq!(ids.len(), pairs.len());
        // Stable: the same pair is the same session on every replica, every run.
        assert_eq!(
            ask_session_id("cyrene", "alice"),
            ask_session_id("cyrene", "alice")
        );
    }
}
