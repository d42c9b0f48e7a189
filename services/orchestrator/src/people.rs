//! Who may touch a session (docs/security.md, "People").
//!
//! A person's sessions are `<person>.<name>`; the person asks on `cyrene.person.<person>.…`,
//! which only their NATS user may publish, so the request subject proves who asks. Requests on
//! the shared subjects (`cyrene.session.send`, `.history`: the `cyrene-client` user, `cyrene up`)
//! reach only sessions of nobody in particular.
//!
//! # Invariants
//! - A person touches only their own sessions; the shared subjects never reach a person's.
//! - The caller comes from the subject alone, never from the body.

use cyrene_protocol::error::{ErrorBody, ErrorCode};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::subjects::{self, Trespass};

/// Checks that the caller of a request on `subject` may touch `session_id`: `bad_request` for
/// an invalid id, `forbidden` for somebody else's session.
pub fn may_touch(subject: &str, session_id: &str) -> Result<(), ErrorBody> {
    ids::validate(IdKind::Session, session_id)
        .map_err(|e| ErrorBody::new(ErrorCode::BadRequest, format!("session_id: {e}")))?;
    subjects::may_reach(subject, ids::session_person(session_id)).map_err(|trespass| {
        let message = match trespass {
            Trespass::NotTheirs { caller } => format!(
                "session {session_id:?} is not one of {caller:?}'s: their sessions are named \
                 {caller}.<name>"
            ),
            Trespass::OwnersOnly { owner } => format!(
                "session {session_id:?} is {owner:?}'s: only they reach it, on \
                 cyrene.person.{owner}.…"
            ),
        };
        ErrorBody::new(ErrorCode::Forbidden, message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_person_touches_only_their_own_sessions() {
        let alice = "cyrene.person.alice.session.send";
        assert!(may_touch(alice, "alice.s1").is_ok());
        for other in ["bob.s1", "s1", "alice_x.s1"] {
            let err = may_touch(alice, other).unwrap_err();
            assert_eq!(err.code, ErrorCode::Forbidden, "{other}");
        }
        assert!(may_touch("cyrene.session.send", "s1").is_ok());
        let err = may_touch("cyrene.session.history", "alice.s1").unwrap_err();
        assert_eq!(err.code, ErrorCode::Forbidden);
        let err = may_touch(alice, "alice.s1.x").unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
    }
}
