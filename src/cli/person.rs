//! `--person <id>`: act as one person (docs/security.md, "People"). Their sessions are
//! `<id>.<name>` — a session given without a dot is taken as theirs (`-s s1` is `<id>.s1`) —,
//! their requests go to `cyrene.person.<id>.…`, which only their NATS user may publish, and
//! replies come to the private inbox prefix `_INBOX_person-<id>`. Without `--person` the CLI
//! uses the shared subjects (`cyrene up`, the `cyrene-client` user).

use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::subjects;
use std::sync::OnceLock;

static PERSON: OnceLock<Option<String>> = OnceLock::new();

/// Sets the person for this process (once, at start); `Err` for an invalid id.
pub fn set(person: Option<String>) -> Result<(), String> {
    if let Some(p) = &person {
        ids::validate(IdKind::Person, p).map_err(|e| format!("--person: {e}"))?;
    }
    let _ = PERSON.set(person);
    Ok(())
}

/// The person the CLI acts as, if any.
pub fn person() -> Option<&'static str> {
    PERSON.get().and_then(|p| p.as_deref())
}

/// The connection name of an operator's command (`cyrene probe`): replies on
/// `_INBOX_cyrene-operator`, which only the `cyrene-operator` user subscribes to.
pub const OPERATOR_CONNECTION: &str = "cyrene-operator";

/// The connection name (it names the inbox prefix, `_INBOX_<name>`).
pub fn connection_name() -> String {
    match person() {
        Some(p) => format!("person-{p}"),
        None => "cyrene-cli".to_owned(),
    }
}

/// The session id as the services know it: `<person>.<id>` for an id without a dot when acting
/// as a person, else `id` unchanged. A `session#leg` owner key is qualified the same way.
pub fn session(id: &str) -> String {
    match person() {
        Some(p) if !id.contains('.') => format!("{p}.{id}"),
        _ => id.to_owned(),
    }
}

/// The subject of a request: `shared` (e.g. `cyrene.session.send`), or the person's own
/// `cyrene.person.<person>.<what>` when acting as a person.
pub fn subject(shared: &str, what: &str) -> String {
    match person().and_then(|p| subjects::person(p, what).ok()) {
        Some(own) => own,
        None => shared.to_owned(),
    }
}

/// What `cyrene events` follows without `-s`: every session this caller may see.
pub fn all_events() -> String {
    match person().and_then(|p| subjects::person_session_events(p).ok()) {
        Some(own) => own,
        None => subjects::SESSION_EVENTS_ALL.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_person_s_sessions_and_subjects_are_their_own() {
        set(Some("alice".into())).unwrap();
        assert_eq!(session("s1"), "alice.s1");
        assert_eq!(session("s1#l1"), "alice.s1#l1");
        assert_eq!(session("alice.s1"), "alice.s1");
        assert_eq!(
            subject(subjects::SESSION_SEND, subjects::PERSON_SESSION_SEND),
            "cyrene.person.alice.session.send"
        );
        assert_eq!(all_events(), "cyrene.session.alice.*.events");
        assert_eq!(connection_name(), "person-alice");
        assert!(set(Some("a.b".into())).is_err());
    }
}
