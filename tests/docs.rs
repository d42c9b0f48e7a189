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
        s::memory_extract(ID).unwrap(),
        s::tool(ID).unwrap(),
        s::guard(ID).unwrap(),
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
        "memory_extract",
        "tool",
        "guard",
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
        "is_guard",
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

/// The metric names a PromQL text uses: each `cyrene_…` word, a histogram's `_bucket`, `_count`
/// and `_sum` read as the histogram.
fn queried_series(promql: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = promql;
    while let Some(at) = rest.find("cyrene_") {
        let word: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + word.len()..];
        let name = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| word.strip_suffix(suffix))
            .unwrap_or(&word);
        names.push(name.to_owned());
    }
    names
}

/// Issue 37: deploy/grafana/cyrene.json and deploy/prometheus/cyrene-rules.yml query only series
/// the binaries export (`cyrene_runtime::health::SERIES`, which every binary describes and
/// tests/health.rs finds in `/metrics`) and docs/operations.md documents; the rules pass
/// `promtool check rules` (Prometheus' own checker, from Debian: scripts/promtool.sh).
#[test]
fn the_dashboard_and_the_alert_rules_query_only_exported_series() {
    let exported: Vec<&str> = cyrene_runtime::health::SERIES
        .iter()
        .map(|(name, _, _)| *name)
        .collect();
    let operations = include_str!("../docs/operations.md");
    let dashboard: serde_json::Value =
        serde_json::from_str(include_str!("../deploy/grafana/cyrene.json")).unwrap();
    let mut exprs = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            exprs.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    let rules = include_str!("../deploy/prometheus/cyrene-rules.yml");
    assert!(exprs.len() >= 10, "{exprs:?}");
    let queried: Vec<String> = exprs
        .iter()
        .map(String::as_str)
        .chain([rules])
        .flat_map(queried_series)
        .collect();
    for wanted in [
        "cyrene_answer_seconds",
        "cyrene_turn_redeliveries_total",
        "cyrene_provider_cooldowns_total",
        "cyrene_turns_pending",
        "cyrene_checkpoint_save_duration_seconds",
    ] {
        assert!(
            queried.iter().any(|q| q == wanted),
            "nothing shows {wanted}"
        );
    }
    for name in &queried {
        assert!(
            exported.contains(&name.as_str()),
            "{name} is queried but no binary exports it"
        );
        assert!(
            operations.contains(&format!("`{name}`")),
            "{name} is not documented in docs/operations.md"
        );
    }

    let promtool = std::env::var("CYRENE_PROMTOOL").unwrap_or_else(|_| {
        concat!(env!("CARGO_MANIFEST_DIR"), "/.tools/prometheus/promtool").to_owned()
    });
    assert!(
        std::path::Path::new(&promtool).exists(),
        "no promtool at {promtool}: run `make test` (scripts/promtool.sh installs it)"
    );
    let out = std::process::Command::new(&promtool)
        .args(["check", "rules"])
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/prometheus/cyrene-rules.yml"
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "promtool check rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_series_scan_reads_histograms_as_their_name() {
    assert_eq!(
        queried_series(
            "histogram_quantile(0.9, rate(cyrene_answer_seconds_bucket[5m])) / cyrene_x_total"
        ),
        ["cyrene_answer_seconds", "cyrene_x_total"]
    );
}
