//! docs/architecture.md names every subject Cyrene uses, and only those: each `cyrene.…` subject
//! it names is one that `cyrene_protocol::subjects` builds (an id placeholder such as `<turn>`
//! standing for a token), and each subject `subjects` builds is named there in full.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_protocol::subjects as s;

const ID: &str = "ID";

/// Every subject the protocol builds, with each id token written `*`.
fn built() -> Vec<String> {
    let mut subjects: Vec<String> = [
        s::MODEL_COMPLETE,
        s::MODEL_COMPLETE_STREAM,
        s::MODEL_ROUTE,
        s::MODEL_CALLS,
        s::CHECKPOINT_SAVE,
        s::CHECKPOINT_LATEST,
        s::CHECKPOINT_GET,
        s::CHECKPOINT_LIST,
        s::CHECKPOINT_RETAIN,
        s::SESSION_SEND,
        s::SESSION_HISTORY,
        s::TURN_RUN,
        s::TURN_STEER,
        s::TURN_COMPLETE,
        s::MEMORY_READ,
        s::MEMORY_WRITE,
        s::MEMORY_FORGET,
        s::DOCUMENT_UPLOAD,
        s::DOCUMENT_READ,
    ]
    .map(str::to_owned)
    .to_vec();
    for what in [
        s::PERSON_SESSION_SEND,
        s::PERSON_SESSION_HISTORY,
        s::PERSON_SESSION_LIST,
        s::PERSON_DOCUMENT_UPLOAD,
        s::PERSON_CHECKPOINT_LATEST,
        s::PERSON_CHECKPOINT_GET,
        s::PERSON_CHECKPOINT_LIST,
    ] {
        subjects.push(s::person(ID, what).unwrap());
    }
    subjects.extend([
        s::model_complete_stream_at(ID),
        s::session_events(ID).unwrap(),
        s::session_events(&format!("{ID}.{ID}")).unwrap(),
        s::turn_input(ID).unwrap(),
        s::tool(ID).unwrap(),
        s::agent_ask(ID, ID),
        s::agent_reply(ID, ID, ID),
        s::agent_event(ID, ID),
        s::agent_broadcast(ID),
    ]);
    subjects
        .into_iter()
        .map(|subject| {
            subject
                .split('.')
                .map(|t| if t == ID { "*" } else { t })
                .collect::<Vec<_>>()
                .join(".")
        })
        .collect()
}

/// The subjects a page names: `cyrene.` and what follows of `[A-Za-z0-9_.<>*-]`, each `<…>`
/// token written `*`; a subject cut off by `…` (`cyrene.person.<id>.…`) is a prefix, kept with a
/// trailing `.>`.
fn named(page: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = page;
    while let Some(at) = rest.find("cyrene.") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || "_.<>*-".contains(c)))
            .unwrap_or(tail.len());
        let mut subject = tail[..end].trim_end_matches('.').to_owned();
        rest = &tail[end..];
        // `CYRENE-PATCH.md`, `cyrene.conf`, `vendor/…/cyrene.x`: not subjects.
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || "_-/".contains(c))
            || subject.ends_with(".md")
            || subject.ends_with(".conf")
            || subject.split('.').count() < 2
        {
            continue;
        }
        if rest.starts_with('…') {
            subject.push_str(".>");
        }
        let subject = subject
            .split('.')
            .map(|t| {
                if t.starts_with('<') && t.ends_with('>') {
                    "*"
                } else {
                    t
                }
            })
            .collect::<Vec<_>>()
            .join(".");
        found.push(subject);
    }
    found
}

/// NATS matching of a pattern (`*` one token, `>` the rest) against a subject whose `*` tokens
/// are ids.
fn matches(pattern: &str, subject: &str) -> bool {
    let (p, t): (Vec<_>, Vec<_>) = (pattern.split('.').collect(), subject.split('.').collect());
    for (i, token) in p.iter().enumerate() {
        if *token == ">" {
            return t.len() > i;
        }
        match t.get(i) {
            Some(s) if token == s || *token == "*" => {}
            _ => return false,
        }
    }
    p.len() == t.len()
}

#[test]
fn architecture_names_every_subject_and_only_real_ones() {
    let page = include_str!("../docs/architecture.md");
    let built = built();
    let named = named(page);
    assert!(named.len() > 20, "found too few subjects: {named:?}");
    for subject in &named {
        assert!(
            built.iter().any(|b| matches(subject, b)),
            "docs/architecture.md names {subject:?}, which shared/protocol/src/subjects.rs does not build"
        );
    }
    for subject in &built {
        assert!(
            named.contains(subject),
            "docs/architecture.md does not name {subject:?} in full"
        );
    }
}

#[test]
fn the_subject_scan_reads_placeholders_wildcards_and_prefixes() {
    assert_eq!(
        named("on `cyrene.turn.input.<turn>`, `cyrene.checkpoint.*`. And cyrene.person.<id>.… too"),
        [
            "cyrene.turn.input.*",
            "cyrene.checkpoint.*",
            "cyrene.person.*.>"
        ]
    );
    assert!(named("see CYRENE-PATCH.md and deploy/nats/cyrene.conf").is_empty());
    assert!(matches("cyrene.checkpoint.*", "cyrene.checkpoint.save"));
    assert!(matches("cyrene.person.*.>", "cyrene.person.*.session.send"));
    assert!(!matches("cyrene.turn.input", "cyrene.turn.input.*"));
    assert!(!matches("cyrene.turn.*", "cyrene.turn.input.*"));
}
