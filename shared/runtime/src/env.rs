//! The one env naming rule (docs/operations.md, "Settings"): every setting of a service is a flag
//! with an env var `CYRENE_<SERVICE>_<SETTING>` (SERVICE = `GATEWAY`, `WORKER`, `STORE`,
//! `ORCHESTRATOR`); settings every process shares keep one name (`CYRENE_HEALTH_ADDR`,
//! `CYRENE_LOG_FORMAT`) or the standard one (`NATS_URL`, `NATS_USER`, `NATS_PASSWORD`,
//! `NATS_CREDS`, `NATS_NKEY`, `DATABASE_URL`, `OTEL_*`).
//!
//! The names used before the rule keep working for one release: [`RENAMED`] lists them, and
//! [`parse`] turns an old name that is set into the flag of its new name, with a warning naming
//! the new variable. The environment is read through a lookup function, so the rule is tested
//! with a map and never by setting the process environment.
//!
//! # Invariants
//! - A flag on the command line wins over both names, and the new name wins over the old one
//!   (the old one is then ignored, with a warning saying so).
//! - An old name applies only to a command that has a flag with its new name's env var: the old
//!   `CYRENE_DATA_DIR` reaches both the checkpoint store and the orchestrator, each under its own
//!   new name.

use std::ffi::OsString;

/// A setting's env var before the naming rule, and after.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renamed {
    pub old: &'static str,
    pub new: &'static str,
}

const fn renamed(old: &'static str, new: &'static str) -> Renamed {
    Renamed { old, new }
}

/// Every env var renamed by the rule. Drop the table (and this module's translation) one release
/// after the rename.
pub const RENAMED: &[Renamed] = &[
    // model gateway
    renamed("CYRENE_MODELS", "CYRENE_GATEWAY_MODELS"),
    // loop worker
    renamed("CYRENE_MODEL_TIMEOUT", "CYRENE_WORKER_MODEL_TIMEOUT"),
    renamed("CYRENE_TOOL_TIMEOUT", "CYRENE_WORKER_TOOL_TIMEOUT"),
    renamed("CYRENE_TURNS_REPLICAS", "CYRENE_WORKER_TURNS_REPLICAS"),
    // checkpoint store
    renamed("CYRENE_DATA_DIR", "CYRENE_STORE_DATA_DIR"),
    renamed(
        "CYRENE_CHECKPOINT_MAX_STATE_BYTES",
        "CYRENE_STORE_MAX_STATE_BYTES",
    ),
    renamed("CYRENE_CHECKPOINT_DB_TIMEOUT", "CYRENE_STORE_DB_TIMEOUT"),
    renamed(
        "CYRENE_CHECKPOINT_ACQUIRE_TIMEOUT",
        "CYRENE_STORE_ACQUIRE_TIMEOUT",
    ),
    renamed(
        "CYRENE_CHECKPOINT_MAX_CONNECTIONS",
        "CYRENE_STORE_MAX_CONNECTIONS",
    ),
    renamed(
        "CYRENE_CHECKPOINT_MAX_IN_FLIGHT",
        "CYRENE_STORE_MAX_IN_FLIGHT",
    ),
    // orchestrator
    renamed("CYRENE_DATA_DIR", "CYRENE_ORCHESTRATOR_DATA_DIR"),
    renamed("CYRENE_PERSONAS", "CYRENE_ORCHESTRATOR_PERSONAS"),
    renamed("CYRENE_WINDOW", "CYRENE_ORCHESTRATOR_WINDOW"),
    renamed("CYRENE_MAX_STEPS", "CYRENE_ORCHESTRATOR_MAX_STEPS"),
    renamed(
        "CYRENE_PARALLEL_SESSIONS",
        "CYRENE_ORCHESTRATOR_PARALLEL_SESSIONS",
    ),
    renamed(
        "CYRENE_PARALLEL_CLIENTS",
        "CYRENE_ORCHESTRATOR_PARALLEL_CLIENTS",
    ),
    renamed(
        "CYRENE_ENQUEUE_SESSIONS",
        "CYRENE_ORCHESTRATOR_ENQUEUE_SESSIONS",
    ),
    renamed(
        "CYRENE_ENQUEUE_CLIENTS",
        "CYRENE_ORCHESTRATOR_ENQUEUE_CLIENTS",
    ),
    renamed(
        "CYRENE_REJECT_SESSIONS",
        "CYRENE_ORCHESTRATOR_REJECT_SESSIONS",
    ),
    renamed(
        "CYRENE_REJECT_CLIENTS",
        "CYRENE_ORCHESTRATOR_REJECT_CLIENTS",
    ),
    renamed(
        "CYRENE_MAX_MESSAGE_BYTES",
        "CYRENE_ORCHESTRATOR_MAX_MESSAGE_BYTES",
    ),
    renamed("CYRENE_ASK_TIMEOUT", "CYRENE_ORCHESTRATOR_ASK_TIMEOUT"),
    renamed("CYRENE_NO_AGENTS", "CYRENE_ORCHESTRATOR_NO_AGENTS"),
    renamed(
        "CYRENE_TURNS_REPLICAS",
        "CYRENE_ORCHESTRATOR_TURNS_REPLICAS",
    ),
];

/// Reads one env var; `None` when unset. `main` passes [`process`], tests a map.
pub type Lookup<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment (a value that is not UTF-8 counts as unset, as it does for clap).
pub fn process(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// What an old name did to a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub old: &'static str,
    pub new: &'static str,
    /// `false` when the new name or the flag was given as well, so the old one was not used.
    pub used: bool,
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Warning { old, new, used } = self;
        if *used {
            write!(
                f,
                "{old} is deprecated and will stop working in the next release; set {new} instead"
            )
        } else {
            write!(
                f,
                "{old} is deprecated and ignored here: {new} (or its flag) is given as well"
            )
        }
    }
}

impl Warning {
    /// Logs the warning (WARN, with both names as fields).
    pub fn log(&self) {
        tracing::warn!(old = self.old, new = self.new, "{self}");
    }
}

/// The flags that carry the settings `env` gives only under an old name of `table`, to append to
/// `argv` (the program name first, then the flags given), and one warning per old name set.
pub fn legacy_flags(
    command: &clap::Command,
    argv: &[OsString],
    table: &[Renamed],
    env: Lookup<'_>,
) -> (Vec<OsString>, Vec<Warning>) {
    let mut flags = Vec::new();
    let mut warnings = Vec::new();
    for Renamed { old, new } in table {
        let Some(value) = env(old) else { continue };
        let Some(arg) = command
            .get_arguments()
            .find(|arg| arg.get_env().is_some_and(|e| e == *new))
        else {
            continue;
        };
        let Some(long) = arg.get_long() else { continue };
        let on_command_line = argv.iter().skip(1).any(|given| {
            given.to_str().is_some_and(|given| {
                given
                    .strip_prefix("--")
                    .and_then(|rest| rest.strip_prefix(long))
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
            })
        });
        let used = !on_command_line && env(new).is_none();
        warnings.push(Warning { old, new, used });
        if !used {
            continue;
        }
        if arg.get_action().takes_values() {
            flags.push(OsString::from(format!("--{long}={value}")));
        } else if !is_falsey(&value) {
            flags.push(OsString::from(format!("--{long}")));
        }
    }
    (flags, warnings)
}

/// How clap reads a flag's env var: these values (and empty) mean "off".
fn is_falsey(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "" | "n" | "no" | "f" | "false" | "off" | "0"
    )
}

/// Parses `A` from `argv` and the environment, old names of [`RENAMED`] included; the warnings
/// are returned for the caller to log once logging is set up.
pub fn parse<A: clap::Parser>(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
    env: Lookup<'_>,
) -> Result<(A, Vec<Warning>), clap::Error> {
    let (argv, warnings) = with_legacy_flags::<A>(argv, env);
    Ok((A::try_parse_from(argv)?, warnings))
}

/// [`parse`], also reading `P`, a part flattened into `A`, from the same command line: how
/// [`crate::entry::main`] reads the flags every service shares.
pub fn parse_with_part<A: clap::Parser, P: clap::FromArgMatches>(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
    env: Lookup<'_>,
) -> Result<(A, P, Vec<Warning>), clap::Error> {
    let (argv, warnings) = with_legacy_flags::<A>(argv, env);
    let mut matches = A::command().try_get_matches_from(argv)?;
    let typed = |err: clap::Error| err.format(&mut A::command());
    let part = P::from_arg_matches(&matches).map_err(typed)?;
    let args = A::from_arg_matches_mut(&mut matches).map_err(typed)?;
    Ok((args, part, warnings))
}

/// `argv` with the [`legacy_flags`] of [`RENAMED`] appended, and their warnings.
fn with_legacy_flags<A: clap::CommandFactory>(
    argv: impl IntoIterator<Item = impl Into<OsString>>,
    env: Lookup<'_>,
) -> (Vec<OsString>, Vec<Warning>) {
    let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let (flags, warnings) = legacy_flags(&A::command(), &argv, RENAMED, env);
    argv.extend(flags);
    (argv, warnings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, Parser};
    use std::collections::HashMap;

    /// The env names here are never set in the process environment, so clap only sees what the
    /// translation adds.
    #[derive(Debug, Parser)]
    struct Args {
        #[arg(long, env = "CYRENE_TESTSVC_WINDOW", default_value_t = 40)]
        window: usize,
        #[arg(long, env = "CYRENE_TESTSVC_IDS", value_delimiter = ',')]
        ids: Vec<String>,
        #[arg(long, env = "CYRENE_TESTSVC_NO_AGENTS")]
        no_agents: bool,
    }

    const TABLE: &[Renamed] = &[
        renamed("CYRENE_OLD_WINDOW", "CYRENE_TESTSVC_WINDOW"),
        renamed("CYRENE_OLD_IDS", "CYRENE_TESTSVC_IDS"),
        renamed("CYRENE_OLD_NO_AGENTS", "CYRENE_TESTSVC_NO_AGENTS"),
        renamed("CYRENE_OLD_ELSEWHERE", "CYRENE_OTHER_SERVICE_SETTING"),
    ];

    fn parse_with(argv: &[&str], env: &[(&str, &str)]) -> (Args, Vec<Warning>) {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let lookup = |name: &str| env.get(name).cloned();
        let mut argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let (flags, warnings) = legacy_flags(&Args::command(), &argv, TABLE, &lookup);
        argv.extend(flags);
        (Args::try_parse_from(argv).unwrap(), warnings)
    }

    /// A part flattened into a command, as [`crate::entry::ServiceFlags`] is into every `Args`.
    #[derive(Debug, Clone, PartialEq, clap::Args)]
    struct Part {
        #[arg(long, env = "CYRENE_TESTSVC_LEVEL", default_value_t = 1)]
        level: u32,
    }

    #[derive(Debug, Parser)]
    struct WithPart {
        #[command(flatten)]
        part: Part,
        #[arg(long, env = "CYRENE_TESTSVC_WINDOW", default_value_t = 40)]
        window: usize,
    }

    #[test]
    fn a_flattened_part_is_read_from_the_same_command_line() {
        let none = |_: &str| None;
        let argv = ["svc", "--level", "3", "--window", "7"];
        let (args, part, warnings) = parse_with_part::<WithPart, Part>(argv, &none).unwrap();
        assert_eq!(part, Part { level: 3 });
        assert_eq!((args.part, args.window), (part, 7));
        assert!(warnings.is_empty());
        let (_, part, _) = parse_with_part::<WithPart, Part>(["svc"], &none).unwrap();
        assert_eq!(part.level, 1, "the part's defaults apply");
    }

    #[test]
    fn an_old_name_still_sets_its_setting_and_warns_naming_the_new_one() {
        let (args, warnings) = parse_with(
            &["svc"],
            &[
                ("CYRENE_OLD_WINDOW", "7"),
                ("CYRENE_OLD_IDS", "a,b"),
                ("CYRENE_OLD_NO_AGENTS", "true"),
            ],
        );
        assert_eq!(args.window, 7);
        assert_eq!(args.ids, ["a", "b"]);
        assert!(args.no_agents);
        assert_eq!(warnings.len(), 3);
        assert!(warnings.iter().all(|w| w.used));
        let text = warnings[0].to_string();
        assert!(
            text.contains("CYRENE_OLD_WINDOW") && text.contains("set CYRENE_TESTSVC_WINDOW"),
            "{text}"
        );
    }

    #[test]
    fn the_flag_and_the_new_name_win_over_the_old_name() {
        let (args, warnings) = parse_with(&["svc", "--window", "3"], &[("CYRENE_OLD_WINDOW", "7")]);
        assert_eq!(args.window, 3);
        assert_eq!(
            warnings,
            [Warning {
                old: "CYRENE_OLD_WINDOW",
                new: "CYRENE_TESTSVC_WINDOW",
                used: false
            }]
        );
        let (args, warnings) = parse_with(&["svc", "--window=4"], &[("CYRENE_OLD_WINDOW", "7")]);
        assert_eq!((args.window, warnings[0].used), (4, false));
        // The new name set: the old one is not turned into a flag (clap reads the new one
        // from the real environment, unset here, so the default shows through).
        let (args, warnings) = parse_with(
            &["svc"],
            &[("CYRENE_OLD_WINDOW", "7"), ("CYRENE_TESTSVC_WINDOW", "9")],
        );
        assert_eq!((args.window, warnings[0].used), (40, false));
    }

    #[test]
    fn unset_falsey_and_foreign_old_names_add_nothing() {
        let (args, warnings) = parse_with(&["svc"], &[]);
        assert_eq!((args.window, args.no_agents), (40, false));
        assert!(warnings.is_empty());
        let (args, warnings) = parse_with(
            &["svc"],
            &[
                ("CYRENE_OLD_NO_AGENTS", "off"),
                ("CYRENE_OLD_ELSEWHERE", "x"),
            ],
        );
        assert!(!args.no_agents);
        assert_eq!(warnings.len(), 1, "only the old name of this command warns");
    }

    #[test]
    fn every_new_name_follows_the_rule_and_every_old_one_differs() {
        for Renamed { old, new } in RENAMED {
            assert_ne!(old, new);
            let rest = ["GATEWAY_", "WORKER_", "STORE_", "ORCHESTRATOR_"]
                .iter()
                .find_map(|service| new.strip_prefix("CYRENE_")?.strip_prefix(service));
            assert!(rest.is_some_and(|r| !r.is_empty()), "{new}");
        }
    }
}
