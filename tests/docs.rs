//! docs/architecture.md names every subject Cyrene uses, and only those: each `cyrene.…` subject
//! it names is one that `cyrene_protocol::subjects` builds (an id placeholder such as `<turn>`
//! standing for a token), and each subject `subjects` builds is named there in full.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use cyrene_protocol::subjects as s;

const ID: &str = "ID";

/// The source of the subject builders: their constants are read from it, so a constant added
/// there is checked here without editing this test.
const SUBJECTS_RS: &str = include_str!("../shared/protocol/src/subjects.rs");

/// `(NAME, value)` of every `pub const NAME: &str = "value";` in `subjects.rs`.
fn constants() -> Vec<(&'static str, &'static str)> {
    SUBJECTS_RS
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("pub const ")?;
            let (name, rest) = rest.split_once(": &str = \"")?;
            Some((name, rest.strip_suffix("\";")?))
        })
        .collect()
}

/// Every subject the protocol builds, with each id token written `*`.
fn built() -> Vec<String> {
    // Defined beside their shapes and re-exported by `subjects.rs`.
    let mut subjects: Vec<String> = [
        s::MEMORY_READ,
        s::MEMORY_WRITE,
        s::MEMORY_FORGET,
        s::DOCUMENT_UPLOAD,
        s::DOCUMENT_READ,
    ]
    .map(str::to_owned)
    .to_vec();
    for (name, value) in constants() {
        if name.starts_with("PERSON_") {
            subjects.push(s::person(ID, value).unwrap());
        } else if !value.contains('*') {
            // Subscribe patterns (`…_ALL`) are not subjects of their own.
            subjects.push(value.to_owned());
        }
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

/// Every `pub fn` of `subjects.rs` is either a builder [`built`] calls or one that builds no
/// subject of its own: a new builder fails here until it is added above.
#[test]
fn every_subject_builder_is_checked() {
    let builders: Vec<&str> = SUBJECTS_RS
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("pub fn ")?;
            Some(&rest[..rest.find(['(', '<'])?])
        })
        .collect();
    let known = [
        // called by `built`
        "model_complete_stream_at",
        "person",
        "session_events",
        "turn_input",
        "tool",
        "agent_ask",
        "agent_reply",
        "agent_event",
        "agent_broadcast",
        // subscribe patterns and readers of subjects
        "person_all",
        "person_of",
        "may_reach",
        "person_session_events",
        "token",
        "agent_reply_receive",
        "agent_ask_receive",
        "agent_event_receive",
        "agent_sender",
        "speaks_as",
    ];
    for builder in &builders {
        assert!(
            known.contains(builder),
            "subjects.rs has a new builder {builder:?}: add it to tests/docs.rs"
        );
    }
    assert!(constants().len() > 20, "{:?}", constants());
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

/// Every `semantics.md#<anchor>` cited in the repository's code and docs is an anchor that
/// docs/semantics.md declares (`<a id="<anchor>"></a>`), so a renamed section cannot leave a
/// comment pointing nowhere.
#[test]
fn every_cited_semantics_anchor_exists() {
    let page = include_str!("../docs/semantics.md");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    let mut dirs: Vec<_> = ["src", "services", "shared", "tests", "docs", "benches"]
        .iter()
        .map(|d| root.join(d))
        .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "md") {
                files.push(path);
            }
        }
    }
    let mut cited = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (at, _) in text.match_indices("semantics.md#") {
            let anchor: String = text[at + "semantics.md#".len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            if anchor.is_empty() {
                continue; // this test's own `semantics.md#<anchor>`
            }
            cited += 1;
            assert!(
                page.contains(&format!("<a id=\"{anchor}\"></a>")),
                "{} cites docs/semantics.md#{anchor}, which docs/semantics.md does not declare",
                file.display()
            );
        }
    }
    assert!(cited > 30, "only {cited} citations found");
}
