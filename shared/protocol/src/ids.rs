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
}

impl fmt::Display for IdKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IdKind::Session => "session id",
            IdKind::Agent => "agent id",
            IdKind::Leg => "leg id",
            IdKind::Tool => "tool name",
            IdKind::Client => "client id",
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

/// Checks `id` against the subject-token rule.
pub fn validate(kind: IdKind, id: &str) -> Result<(), IdError> {
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
    fn new_ids_are_valid_unique_and_time_ordered() {
        let a = new_id();
        let b = new_id();
        assert!(validate(IdKind::Session, &a).is_ok());
        assert_ne!(a, b);
        assert!(a < b, "UUIDv7 sorts by creation: {a} then {b}");
    }
}
