//! Id rules (docs/architecture.md §1): session, agent and leg ids are 1–128 chars of
//! `[A-Za-z0-9_-]`, checked at every entry point because they become subject tokens. Server-issued
//! ids are UUIDv7 (time ordered, so they sort by creation).

use std::fmt;

/// The longest id accepted.
pub const MAX_ID_LEN: usize = 128;

/// What an id names, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdKind {
    Session,
    Agent,
    Leg,
    Tool,
    Client,
    Person,
    /// A guard's name: the tokens after `cyrene.guard.` (crate::subjects::guard).
    Guard,
}

impl fmt::Display for IdKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IdKind::Session => "session id",
            IdKind::Agent => "agent id",
            IdKind::Leg => "leg id",
            IdKind::Tool => "tool name",
            IdKind::Client => "client id",
            IdKind::Person => "person id",
            IdKind::Guard => "guard name",
        })
    }
}

/// Why an id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("{0} is empty")]
    Empty(IdKind),
    #[error("{kind} is {len} characters long; at most {MAX_ID_LEN} are allowed")]
    TooLong { kind: IdKind, len: usize },
    #[error("{kind} {id:?} contains {bad:?}; only A-Z, a-z, 0-9, '_' and '-' are allowed")]
    BadChar { kind: IdKind, id: String, bad: char },
}

/// Checks `id` against the subject-token rule. A session id may also be a person's
/// (docs/security.md, "People"): `<person>.<name>`, both parts valid ids — two subject tokens,
/// so that the person's permissions can name their own sessions' subjects.
pub fn validate(kind: IdKind, id: &str) -> Result<(), IdError> {
    if kind == IdKind::Session
        && let Some((person, name)) = id.split_once('.')
    {
        validate_token(kind, person)?;
        return validate_token(kind, name);
    }
    validate_token(kind, id)
}

/// The person a session belongs to: `alice` for `alice.s1`, `None` for a session of nobody in
/// particular (`s1`). Assumes a valid id ([`validate`]).
pub fn session_person(session_id: &str) -> Option<&str> {
    session_id.split_once('.').map(|(person, _)| person)
}

fn validate_token(kind: IdKind, id: &str) -> Result<(), IdError> {
    if id.is_empty() {
        return Err(IdError::Empty(kind));
    }
    let len = id.chars().count();
    if len > MAX_ID_LEN {
        return Err(IdError::TooLong { kind, len });
    }
    if let Some(bad) = id.chars().find(|c| !is_token_char(*c)) {
        let shown: String = id.chars().take(40).collect();
        return Err(IdError::BadChar {
            kind,
            id: shown,
            bad,
        });
    }
    Ok(())
}

/// Whether `c` may appear in a subject token unchanged.
pub const fn is_token_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

/// A fresh server-issued id: a UUIDv7 in its 32-hex-digit form (time-ordered, token-safe).
pub fn new_id() -> String {
    uuid::Uuid::now_v7().simple().to_string()
}

/// When a [`new_id`] was made (Unix milliseconds, its first 48 bits); `None` for any other id.
pub fn id_unix_ms(id: &str) -> Option<u64> {
    let uuid = uuid::Uuid::try_parse(id).ok()?;
    let (secs, nanos) = uuid.get_timestamp()?.to_unix();
    Some(secs * 1000 + u64::from(nanos) / 1_000_000)
}

/// The Unix time now, in milliseconds.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_token_safe_ids_up_to_the_limit() {
        assert!(validate(IdKind::Session, "s1").is_ok());
        assert!(validate(IdKind::Agent, "cyrene_main-2").is_ok());
        assert!(validate(IdKind::Leg, &"a".repeat(128)).is_ok());
    }

    #[test]
    fn refuses_empty_long_and_subject_breaking_ids() {
        assert_eq!(
            validate(IdKind::Session, ""),
            Err(IdError::Empty(IdKind::Session))
        );
        assert!(matches!(
            validate(IdKind::Session, &"a".repeat(129)),
            Err(IdError::TooLong { len: 129, .. })
        ));
        for bad in ["a.b", "a*", "a>", "a b", "阿明", "a\n"] {
            assert!(
                matches!(validate(IdKind::Agent, bad), Err(IdError::BadChar { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_session_id_may_belong_to_a_person() {
        assert!(validate(IdKind::Session, "alice.s1").is_ok());
        assert_eq!(session_person("alice.s1"), Some("alice"));
        assert_eq!(session_person("s1"), None);
        for bad in ["alice.", ".s1", "a.b.c", "alice.*", "alice.>", "a b.s1"] {
            assert!(validate(IdKind::Session, bad).is_err(), "{bad}");
        }
        // only session ids have an owner part
        assert!(validate(IdKind::Leg, "alice.s1").is_err());
        assert!(validate(IdKind::Agent, "alice.s1").is_err());
    }

    #[test]
    fn a_new_id_says_when_it_was_made_and_other_ids_say_nothing() {
        let before = unix_ms();
        let at = id_unix_ms(&new_id()).unwrap();
        assert!(before <= at && at <= unix_ms(), "{before} {at}");
        assert_eq!(id_unix_ms("s-1"), None);
        assert_eq!(id_unix_ms("0123456789ab4def8123456789abcdef"), None);
    }

    #[test]
    fn new_ids_are_valid_unique_and_time_ordered() {
        let a = new_id();
        let b = new_id();
        assert!(validate(IdKind::Session, &a).is_ok());
        assert_ne!(a, b);
        assert!(a < b, "UUIDv7 sorts by creation: {a} then {b}");
    }
}
