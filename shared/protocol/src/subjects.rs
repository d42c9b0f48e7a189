//! Every NATS subject Cyrene uses, one builder each (docs/architecture.md §1–§6, §9).
//!
//! # Invariants
//! - Comm subjects pass every id through [`token`] (docs/semantics.md#comm, part of the spec).
//! - Every other subject that embeds an id takes it validated ([`crate::ids::validate`]) and
//!   returns the [`IdError`] otherwise: no subject is built from unvalidated text.

use crate::ids::{self, IdError, IdKind};

// Defined beside their shapes; named here too so that this file lists every subject.
pub use crate::approval::{
    BRIDGE_SESSION_APPROVALS, BRIDGE_SESSION_APPROVE, PERSON_SESSION_APPROVALS,
    PERSON_SESSION_APPROVE, SESSION_APPROVALS, SESSION_APPROVE,
};
pub use crate::document::{DOCUMENT_READ, DOCUMENT_UPLOAD};
pub use crate::memory::{MEMORY_EXTRACT_ALL, MEMORY_FORGET, MEMORY_READ, MEMORY_WRITE};

/// Model completions (micro endpoint `complete`).
pub const MODEL_COMPLETE: &str = "cyrene.model.complete";
/// Streamed model completions (micro endpoint `complete_stream`): deltas and an end marker on the
/// caller's reply inbox (docs/model-gateway.md, "Streaming").
pub const MODEL_COMPLETE_STREAM: &str = "cyrene.model.complete.stream";

/// The streamed completions of one gateway replica (`cyrene.model.complete.stream.<replica>`):
/// where a held view's next call goes (docs/model-gateway.md, "Held views"). `replica` is the
/// gateway's own: letters and digits only.
pub fn model_complete_stream_at(replica: &str) -> String {
    format!("{MODEL_COMPLETE_STREAM}.{replica}")
}
/// Which chain (and main model) serves a persona (micro endpoint `route`).
pub const MODEL_ROUTE: &str = "cyrene.model.route";
/// Call records, one per successful model call.
pub const MODEL_CALLS: &str = "cyrene.model.calls";
pub const CHECKPOINT_SAVE: &str = "cyrene.checkpoint.save";
pub const CHECKPOINT_LATEST: &str = "cyrene.checkpoint.latest";
pub const CHECKPOINT_GET: &str = "cyrene.checkpoint.get";
pub const CHECKPOINT_LIST: &str = "cyrene.checkpoint.list";
/// Explicit retention (keep the last N steps of an owner, or drop owners older than an age).
pub const CHECKPOINT_RETAIN: &str = "cyrene.checkpoint.retain";
/// How far some turns have got, as of their last saved step (the orchestrator's parallel notice
/// and running-turns list).
pub const CHECKPOINT_PROGRESS: &str = "cyrene.checkpoint.progress";
pub const SESSION_SEND: &str = "cyrene.session.send";
pub const SESSION_HISTORY: &str = "cyrene.session.history";
/// A chat bridge sends a message (docs/security.md, "Bridges"): the one subject on which a
/// message may carry a third party's `sender_name` or create a restricted session. Only the
/// `cyrene-bridge` NATS user may publish it; it reaches only the owner's sessions.
pub const BRIDGE_SESSION_SEND: &str = "cyrene.bridge.session.send";
/// A chat bridge reads a transcript of one of the owner's sessions.
pub const BRIDGE_SESSION_HISTORY: &str = "cyrene.bridge.session.history";
/// A chat bridge uploads a file posted in a room as a document of one of the owner's sessions
/// (the shape of `cyrene.document.upload`, docs/documents.md).
pub const BRIDGE_DOCUMENT_UPLOAD: &str = "cyrene.bridge.document.upload";
/// Turn jobs (JetStream work queue `CYRENE_TURNS`).
pub const TURN_RUN: &str = "cyrene.turn.run";
pub const TURN_STEER: &str = "cyrene.turn.steer";
pub const TURN_COMPLETE: &str = "cyrene.turn.complete";
/// Operators list the turns running now (docs/orchestrator.md, "Turns in flight"): only the
/// `cyrene-operator` NATS user may publish it.
pub const TURNS_RUNNING: &str = "cyrene.turns.running";
/// Subscribe pattern for every running turn's input (see [`turn_input`]).
pub const TURN_INPUT_ALL: &str = "cyrene.turn.input.*";
/// Subscribe pattern for the events of every session of nobody in particular (`s1`).
pub const SESSION_EVENTS_ALL: &str = "cyrene.session.*.events";
/// Subscribe pattern for the events of every person's session (`alice.s1`).
pub const SESSION_EVENTS_PERSONS_ALL: &str = "cyrene.session.*.*.events";

/// A person's requests (docs/security.md, "People"): `cyrene.person.<person>.<what>`, where
/// `<what>` is one of these. Only person `<person>` may publish there (its NATS user), so the
/// subject proves who asks; the services answer only for that person's sessions.
pub const PERSON_SESSION_SEND: &str = "session.send";
pub const PERSON_SESSION_HISTORY: &str = "session.history";
/// The person's sessions (docs/orchestrator.md, "`session.list`"; only the person form exists).
pub const PERSON_SESSION_LIST: &str = "session.list";
/// A document uploaded into one of the person's sessions (docs/documents.md).
pub const PERSON_DOCUMENT_UPLOAD: &str = "document.upload";
pub const PERSON_CHECKPOINT_LATEST: &str = "checkpoint.latest";
pub const PERSON_CHECKPOINT_GET: &str = "checkpoint.get";
pub const PERSON_CHECKPOINT_LIST: &str = "checkpoint.list";

const PERSON_PREFIX: &str = "cyrene.person";

/// `cyrene.person.<person>.<what>`, `what` one of the `PERSON_*` suffixes.
pub fn person(person: &str, what: &str) -> Result<String, IdError> {
    ids::validate(IdKind::Person, person)?;
    Ok(format!("{PERSON_PREFIX}.{person}.{what}"))
}

/// `cyrene.person.*.<what>`: what a service serves for every person.
pub fn person_all(what: &str) -> String {
    format!("{PERSON_PREFIX}.*.{what}")
}

/// The person of a request subject `cyrene.person.<person>.…`; `None` for any other subject.
pub fn person_of(subject: &str) -> Option<&str> {
    let rest = subject.strip_prefix(PERSON_PREFIX)?.strip_prefix('.')?;
    let (person, tail) = rest.split_once('.')?;
    (!person.is_empty() && !tail.is_empty()).then_some(person)
}

/// Why a request may not touch what it names (docs/security.md, "People").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trespass<'a> {
    /// A person asked about something that is not theirs.
    NotTheirs { caller: &'a str },
    /// A shared subject asked about a person's thing: only that person reaches it.
    OwnersOnly { owner: &'a str },
}

/// The one ownership rule of every service that answers people: a request on a person's subject
/// (`cyrene.person.<person>.…`) reaches only what `owner` says is that person's; a request on a
/// shared subject only what belongs to nobody in particular (`owner` `None`).
pub fn may_reach<'a>(subject: &'a str, owner: Option<&'a str>) -> Result<(), Trespass<'a>> {
    match (person_of(subject), owner) {
        (None, None) => Ok(()),
        (Some(caller), Some(owner)) if caller == owner => Ok(()),
        (Some(caller), _) => Err(Trespass::NotTheirs { caller }),
        (None, Some(owner)) => Err(Trespass::OwnersOnly { owner }),
    }
}

/// `cyrene.session.<person>.*.events`: the events of every session of `person`.
pub fn person_session_events(person: &str) -> Result<String, IdError> {
    ids::validate(IdKind::Person, person)?;
    Ok(format!("cyrene.session.{person}.*.events"))
}

const AGENT_PREFIX: &str = "cyrene.agent";

/// Sanitises an id into one subject token: every char (Unicode scalar, not byte) outside
/// `[A-Za-z0-9_-]` becomes one `_`, so dots, wildcards and spaces never leak into a token.
pub fn token(s: &str) -> String {
    s.chars()
        .map(|c| if ids::is_token_char(c) { c } else { '_' })
        .collect()
}

/// `cyrene.agent.<from>.<to>.ask`
pub fn agent_ask(from: &str, to: &str) -> String {
    format!("{AGENT_PREFIX}.{}.{}.ask", token(from), token(to))
}

/// `cyrene.agent.<from>.<to>.reply.<askId>` — `from` is the replier, `to` the asker.
pub fn agent_reply(from: &str, to: &str, ask_id: &str) -> String {
    format!(
        "{AGENT_PREFIX}.{}.{}.reply.{}",
        token(from),
        token(to),
        token(ask_id)
    )
}

/// `cyrene.agent.*.<me>.reply.*`: every private reply subject of `me`'s asks.
pub fn agent_reply_receive(me: &str) -> String {
    format!("{AGENT_PREFIX}.*.{}.reply.*", token(me))
}

/// `cyrene.agent.<from>.<to>.event`
pub fn agent_event(from: &str, to: &str) -> String {
    format!("{AGENT_PREFIX}.{}.{}.event", token(from), token(to))
}

/// `cyrene.agent.<from>.event`
pub fn agent_broadcast(from: &str) -> String {
    format!("{AGENT_PREFIX}.{}.event", token(from))
}

/// `cyrene.agent.*.<me>.ask`: where an agent receives asks.
pub fn agent_ask_receive(me: &str) -> String {
    format!("{AGENT_PREFIX}.*.{}.ask", token(me))
}

/// `cyrene.agent.*.event` and `cyrene.agent.*.<me>.event`: broadcasts and events to `me`.
pub fn agent_event_receive(me: &str) -> [String; 2] {
    [
        format!("{AGENT_PREFIX}.*.event"),
        format!("{AGENT_PREFIX}.*.{}.event", token(me)),
    ]
}

/// The sender token of a comm subject: `<from>` of `cyrene.agent.<from>.…` (ask, reply — where
/// it is the replier —, event, broadcast); `None` for any other subject. A message's body `from`
/// must sanitise to this token ([`speaks_as`]): the subject is what NATS permissions guard.
pub fn agent_sender(subject: &str) -> Option<&str> {
    let rest = subject.strip_prefix(AGENT_PREFIX)?.strip_prefix('.')?;
    let (sender, tail) = rest.split_once('.')?;
    (!sender.is_empty() && !tail.is_empty()).then_some(sender)
}

/// Whether a comm message whose body says `from` may travel on `subject`: `token(from)` must be
/// the subject's sender token. Equality after sanitising (not byte equality) because ids are
/// any text (docs/semantics.md#comm): `a.b` speaks on `cyrene.agent.a_b.…`.
pub fn speaks_as(subject: &str, from: &str) -> bool {
    agent_sender(subject).is_some_and(|sender| token(from) == sender)
}

/// `cyrene.session.<sid>.events` (`cyrene.session.<person>.<name>.events` for a person's session)
pub fn session_events(session_id: &str) -> Result<String, IdError> {
    ids::validate(IdKind::Session, session_id)?;
    Ok(format!("cyrene.session.{session_id}.events"))
}

/// `cyrene.memory.extract.<turn_id>`: the memory extraction job of a turn that ended with an
/// answer (JetStream stream `CYRENE_MEMORY`; docs/memory.md).
pub fn memory_extract(turn_id: &str) -> Result<String, IdError> {
    ids::validate(IdKind::Leg, turn_id)?;
    Ok(format!("cyrene.memory.extract.{turn_id}"))
}

/// `cyrene.turn.input.<turn_id>`: the messages the orchestrator claimed for a running turn,
/// pushed to the worker running it (docs/orchestrator.md, "Steering").
pub fn turn_input(turn_id: &str) -> Result<String, IdError> {
    // A turn id is one subject token: 1–128 of `[A-Za-z0-9_-]` (the plain id rule; never a
    // person's two-token session id).
    ids::validate(IdKind::Leg, turn_id)?;
    Ok(format!("cyrene.turn.input.{turn_id}"))
}

/// `cyrene.tool.<name>`
pub fn tool(name: &str) -> Result<String, IdError> {
    ids::validate(IdKind::Tool, name)?;
    Ok(format!("cyrene.tool.{name}"))
}

const GUARD_PREFIX: &str = "cyrene.guard";

/// The most tokens a guard's name may have.
pub const MAX_GUARD_NAME_TOKENS: usize = 4;

/// `cyrene.guard.<name>`: where the loop worker asks a persona's guard (docs/loop-worker.md,
/// "Guardrails"). `name` is 1 to [`MAX_GUARD_NAME_TOKENS`] dot-separated tokens, each a valid
/// id (no wildcard, no empty token), so NATS permissions can let the worker publish only under
/// `cyrene.guard.>`.
pub fn guard(name: &str) -> Result<String, IdError> {
    let tokens: Vec<&str> = name.split('.').collect();
    if tokens.len() > MAX_GUARD_NAME_TOKENS {
        return Err(IdError::TooLong {
            kind: IdKind::Guard,
            len: name.chars().count(),
        });
    }
    for token in tokens {
        ids::validate(IdKind::Guard, token)?;
    }
    Ok(format!("{GUARD_PREFIX}.{name}"))
}

/// Whether `subject` is a guard's subject as [`guard`] builds it.
pub fn is_guard(subject: &str) -> bool {
    subject
        .strip_prefix(GUARD_PREFIX)
        .and_then(|rest| rest.strip_prefix('.'))
        .is_some_and(|name| guard(name).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_replaces_each_unicode_char_once() {
        for (raw, want) in [
            ("a.b*c>d e", "a_b_c_d_e"),
            ("阿明", "__"),
            ("ok_-09AZ", "ok_-09AZ"),
            ("😀x", "_x"),
            ("", ""),
        ] {
            assert_eq!(token(raw), want, "token({raw:?})");
        }
    }

    #[test]
    fn comm_subjects_match_the_seed() {
        assert_eq!(agent_ask("a", "b"), "cyrene.agent.a.b.ask");
        assert_eq!(agent_reply("b", "a", "q1"), "cyrene.agent.b.a.reply.q1");
        assert_eq!(agent_event("a", "b"), "cyrene.agent.a.b.event");
        assert_eq!(agent_broadcast("a.x"), "cyrene.agent.a_x.event");
        assert_eq!(agent_ask_receive("b c"), "cyrene.agent.*.b_c.ask");
        assert_eq!(agent_reply_receive("a.b"), "cyrene.agent.*.a_b.reply.*");
        assert_eq!(
            agent_event_receive("星"),
            [
                "cyrene.agent.*.event".to_string(),
                "cyrene.agent.*._.event".to_string()
            ]
        );
    }

    #[test]
    fn a_person_reaches_only_their_own_and_a_shared_subject_only_nobodys() {
        let alice = "cyrene.person.alice.session.send";
        let shared = SESSION_SEND;
        assert_eq!(may_reach(alice, Some("alice")), Ok(()));
        assert_eq!(may_reach(shared, None), Ok(()));
        assert_eq!(
            may_reach(alice, Some("bob")),
            Err(Trespass::NotTheirs { caller: "alice" })
        );
        assert_eq!(
            may_reach(alice, None),
            Err(Trespass::NotTheirs { caller: "alice" })
        );
        assert_eq!(
            may_reach(shared, Some("bob")),
            Err(Trespass::OwnersOnly { owner: "bob" })
        );
    }

    #[test]
    fn the_sender_of_a_comm_subject_is_its_third_token() {
        for (subject, want) in [
            ("cyrene.agent.a.b.ask", Some("a")),
            ("cyrene.agent.a.event", Some("a")),
            ("cyrene.agent.b.a.reply.q1", Some("b")),
            ("cyrene.agent.a", None),
            ("cyrene.agentx.a.b.ask", None),
            ("cyrene.session.s1.events", None),
        ] {
            assert_eq!(agent_sender(subject), want, "agent_sender({subject:?})");
        }
        assert!(speaks_as(&agent_ask("a.b", "c"), "a.b"));
        assert!(speaks_as(&agent_broadcast("星"), "月"));
        assert!(!speaks_as(&agent_ask("hoshi", "cyrene"), "主人"));
        assert!(!speaks_as(&agent_event("hoshi", "cyrene"), "cyrene"));
        assert!(!speaks_as("cyrene.session.s1.events", "s1"));
    }

    #[test]
    fn person_subjects_name_the_person_in_their_third_token() {
        let send = person("alice", PERSON_SESSION_SEND).unwrap();
        assert_eq!(send, "cyrene.person.alice.session.send");
        assert_eq!(person_of(&send), Some("alice"));
        assert_eq!(
            person_all(PERSON_CHECKPOINT_GET),
            "cyrene.person.*.checkpoint.get"
        );
        assert_eq!(person_of("cyrene.person.alice"), None);
        assert_eq!(person_of("cyrene.personx.alice.session.send"), None);
        assert_eq!(person_of("cyrene.session.send"), None);
        assert!(person("a.b", PERSON_SESSION_SEND).is_err());
        assert!(person("*", PERSON_SESSION_SEND).is_err());
        assert_eq!(
            person_session_events("alice").unwrap(),
            "cyrene.session.alice.*.events"
        );
    }

    #[test]
    fn id_subjects_refuse_unvalidated_ids() {
        assert_eq!(session_events("s1").unwrap(), "cyrene.session.s1.events");
        assert!(session_events("s1.>").is_err());
        assert!(session_events("").is_err());
        assert_eq!(
            session_events("alice.s1").unwrap(),
            "cyrene.session.alice.s1.events"
        );
        assert!(session_events("alice.s1.x").is_err());
        assert_eq!(tool("get_time").unwrap(), "cyrene.tool.get_time");
        assert_eq!(turn_input("t-1").unwrap(), "cyrene.turn.input.t-1");
        assert!(turn_input("t.>").is_err());
        assert!(tool("a*").is_err());
    }

    #[test]
    fn a_guard_subject_is_tokens_under_cyrene_guard_and_never_a_wildcard() {
        assert_eq!(guard("policy").unwrap(), "cyrene.guard.policy");
        assert_eq!(guard("team.strict").unwrap(), "cyrene.guard.team.strict");
        for bad in ["", "a..b", "*", ">", "a.>", "a b", "a.b.c.d.e", "a."] {
            assert!(guard(bad).is_err(), "{bad:?}");
        }
        assert!(is_guard("cyrene.guard.policy"));
        assert!(is_guard("cyrene.guard.a.b-c_1"));
        for bad in [
            "cyrene.guard",
            "cyrene.guard.",
            "cyrene.guard.*",
            "cyrene.guard.>",
            "cyrene.guardx.p",
            "cyrene.tool.p",
            "cyrene.guard.p q",
            " cyrene.guard.p",
        ] {
            assert!(!is_guard(bad), "{bad:?}");
        }
    }
}
