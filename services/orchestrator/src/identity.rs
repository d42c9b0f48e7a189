//! Who speaks in a session (docs/security.md, "The owner and bridges"): the owner, a third
//! party, or a chat bridge speaking for either.
//!
//! The owner is configuration ([`crate::Config::owner`], `CYRENE_ORCHESTRATOR_OWNER`), never a
//! claim. The caller of a send comes from its request subject alone ([`Caller::of`]):
//!
//! - the shared subjects (`cyrene.session.send`) and the owner's own person subject send
//!   unlabelled messages to unrestricted sessions: they may not set `sender_name` or
//!   `env.restricted` (`forbidden`);
//! - another person's subject (`cyrene.person.<id>.…`, `<id>` not the owner) may not set them
//!   either; when an owner is configured the orchestrator labels that person's messages with
//!   their id and creates their sessions restricted, so the model never takes them for the owner;
//! - the bridge's subject (`cyrene.bridge.session.send`, published only by the `cyrene-bridge`
//!   NATS user) reaches only the owner's sessions (`<owner>.<name>`) and is the one place a
//!   message may carry a third party's `sender_name`, create a restricted session, or be
//!   `context_only` (in the conversation without starting a turn).
//!
//! # Invariants
//! - A third-party label lives only in a restricted session: the store refuses a labelled
//!   person message to a session that is not restricted, whatever the subject (`store/send.rs`).
//! - A restricted session created by a client runs the default persona.
//! - No request body can make a message the owner's in a restricted session except by being
//!   unlabelled on a subject only the owner's clients (or the bridge) may publish.

use crate::config::Config;
use cyrene_protocol::error::{ErrorBody, ErrorCode};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::session::{SendRequest, SessionEnv};
use cyrene_protocol::subjects;

/// Who asks, as the request subject proves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caller<'a> {
    /// A shared subject (`cyrene.session.…`): a client of nobody in particular.
    Shared,
    /// `cyrene.person.<id>.…`: that person.
    Person(&'a str),
    /// `cyrene.bridge.…`: the chat bridge.
    Bridge,
}

impl<'a> Caller<'a> {
    /// The caller of a request on `subject`.
    pub fn of(subject: &'a str) -> Caller<'a> {
        if subject.starts_with("cyrene.bridge.") {
            Caller::Bridge
        } else if let Some(person) = subjects::person_of(subject) {
            Caller::Person(person)
        } else {
            Caller::Shared
        }
    }
}

fn forbidden(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::Forbidden, message)
}

/// Checks that the bridge may touch `session_id`: one of the owner's sessions, `<owner>.<name>`.
/// `forbidden` when no owner is configured or the session is somebody else's.
pub fn bridge_may_touch(owner: Option<&str>, session_id: &str) -> Result<(), ErrorBody> {
    ids::validate(IdKind::Session, session_id)
        .map_err(|e| ErrorBody::new(ErrorCode::BadRequest, format!("session_id: {e}")))?;
    let Some(owner) = owner else {
        return Err(forbidden(
            "no owner is configured (CYRENE_ORCHESTRATOR_OWNER): a bridge speaks only in the \
             owner's sessions",
        ));
    };
    if ids::session_person(session_id) != Some(owner) {
        return Err(forbidden(format!(
            "session {session_id:?} is not the owner's: a bridge reaches only sessions named \
             {owner}.<name>"
        )));
    }
    Ok(())
}

/// Applies the speaking rules to a send from `caller` (see the module docs): refuses the
/// fields only a bridge may set, labels a non-owner person, and keeps restricted sessions on the
/// default persona.
pub fn speaker(
    caller: Caller<'_>,
    config: &Config,
    req: &mut SendRequest,
) -> Result<(), ErrorBody> {
    let mut env = req.env.clone().unwrap_or_default();
    match caller {
        Caller::Bridge => {
            let name = &req.message.sender_name;
            if !name.is_empty() && name.trim().is_empty() {
                return Err(ErrorBody::new(
                    ErrorCode::BadRequest,
                    "sender_name is blank: name the third party, or leave it empty for the owner",
                ));
            }
        }
        Caller::Shared | Caller::Person(_) => {
            if !req.message.sender_name.is_empty() {
                return Err(forbidden(format!(
                    "sender_name labels a third party: only a chat bridge sets it, on {}",
                    subjects::BRIDGE_SESSION_SEND
                )));
            }
            if env.restricted {
                return Err(forbidden(format!(
                    "env.restricted: only a chat bridge creates restricted sessions, on {}",
                    subjects::BRIDGE_SESSION_SEND
                )));
            }
            if req.context_only {
                return Err(forbidden(format!(
                    "context_only: only a chat bridge passes on what was said without asking \
                     for an answer, on {}",
                    subjects::BRIDGE_SESSION_SEND
                )));
            }
        }
    }
    if let (Caller::Person(person), Some(owner)) = (caller, config.owner.as_deref())
        && person != owner
    {
        // Not the owner: a third party in a session of their own, labelled by the runtime.
        req.message.sender_name = person.to_owned();
        env.restricted = true;
    }
    if env.restricted {
        let default = config.personas.default.as_str();
        if !env.persona.is_empty() && env.persona != default {
            return Err(ErrorBody::new(
                ErrorCode::BadRequest,
                format!(
                    "env.persona: a restricted session runs the default persona {default:?}, \
                     not {:?}",
                    env.persona
                ),
            ));
        }
        req.env = Some(SessionEnv {
            restricted: true,
            persona: String::new(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::message::{Message, Role};

    fn config(owner: Option<&str>) -> Config {
        let mut config = Config::new("/tmp/x");
        config.owner = owner.map(str::to_owned);
        config
    }

    fn send(session: &str, sender: &str, env: Option<SessionEnv>) -> SendRequest {
        SendRequest {
            session_id: session.into(),
            message: Message::text(Role::User, "hi").sender(sender),
            client_id: String::new(),
            idempotency_key: String::new(),
            env,
            parallel: false,
            when_busy: None,
            context_only: false,
        }
    }

    fn restricted(persona: &str) -> Option<SessionEnv> {
        Some(SessionEnv {
            restricted: true,
            persona: persona.into(),
        })
    }

    #[test]
    fn the_caller_comes_from_the_subject() {
        assert_eq!(Caller::of("cyrene.session.send"), Caller::Shared);
        assert_eq!(
            Caller::of("cyrene.person.alice.session.send"),
            Caller::Person("alice")
        );
        assert_eq!(Caller::of(subjects::BRIDGE_SESSION_SEND), Caller::Bridge);
    }

    #[test]
    fn only_the_bridge_labels_or_restricts() {
        let config = config(Some("alice"));
        for caller in [
            Caller::Shared,
            Caller::Person("alice"),
            Caller::Person("bob"),
        ] {
            let mut labelled = send("s1", "阿明", None);
            let err = speaker(caller, &config, &mut labelled).unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{caller:?}");
            assert!(err.message.contains("sender_name"), "{}", err.message);
            let mut claimed = send("s1", "", restricted(""));
            let err = speaker(caller, &config, &mut claimed).unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{caller:?}");
            assert!(err.message.contains("restricted"), "{}", err.message);
            let mut context = send("s1", "", None);
            context.context_only = true;
            let err = speaker(caller, &config, &mut context).unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{caller:?}");
            assert!(err.message.contains("context_only"), "{}", err.message);
        }
        let mut context = send("alice.g1", "阿明", restricted(""));
        context.context_only = true;
        speaker(Caller::Bridge, &config, &mut context).unwrap();
        let mut bridged = send("alice.g1", "阿明", restricted(""));
        speaker(Caller::Bridge, &config, &mut bridged).unwrap();
        assert_eq!(bridged.message.sender_name, "阿明");
        assert_eq!(bridged.env, restricted(""));
        // The owner through the bridge: unlabelled, and a session as asked.
        let mut owner = send("alice.dm", "", None);
        speaker(Caller::Bridge, &config, &mut owner).unwrap();
        assert_eq!((owner.message.sender_name.as_str(), owner.env), ("", None));
    }

    #[test]
    fn a_person_who_is_not_the_owner_is_labelled_in_a_restricted_session() {
        let config = config(Some("alice"));
        let mut bob = send("bob.s1", "", None);
        speaker(Caller::Person("bob"), &config, &mut bob).unwrap();
        assert_eq!(bob.message.sender_name, "bob");
        assert_eq!(bob.env, restricted(""));
        let mut alice = send("alice.s1", "", None);
        speaker(Caller::Person("alice"), &config, &mut alice).unwrap();
        assert_eq!((alice.message.sender_name.as_str(), alice.env), ("", None));
        // Without an owner nobody is labelled (and no session is restricted).
        let mut bob = send("bob.s1", "", None);
        speaker(Caller::Person("bob"), &self::config(None), &mut bob).unwrap();
        assert_eq!((bob.message.sender_name.as_str(), bob.env), ("", None));
    }

    #[test]
    fn a_restricted_session_runs_the_default_persona() {
        let config = config(Some("alice"));
        let mut other = send("alice.g1", "阿明", restricted("hoshi"));
        let err = speaker(Caller::Bridge, &config, &mut other).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.message.contains("default persona"), "{}", err.message);
        let mut named = send("alice.g1", "阿明", restricted("cyrene"));
        speaker(Caller::Bridge, &config, &mut named).unwrap();
        assert_eq!(named.env, restricted(""));
        let mut bob = send(
            "bob.s1",
            "",
            Some(SessionEnv {
                restricted: false,
                persona: "hoshi".into(),
            }),
        );
        let err = speaker(Caller::Person("bob"), &config, &mut bob).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        let mut blank = send("alice.g1", "  ", restricted(""));
        let err = speaker(Caller::Bridge, &config, &mut blank).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
    }

    #[test]
    fn the_bridge_reaches_only_the_owners_sessions() {
        assert!(bridge_may_touch(Some("alice"), "alice.g1").is_ok());
        for (owner, session) in [
            (Some("alice"), "bob.g1"),
            (Some("alice"), "g1"),
            (None, "alice.g1"),
        ] {
            let err = bridge_may_touch(owner, session).unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{owner:?} {session}");
        }
        let err = bridge_may_touch(Some("alice"), "alice.g1.x").unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
    }
}
