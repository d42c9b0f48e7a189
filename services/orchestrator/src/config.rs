//! Configuration of the orchestrator: the command line / environment ([`Args`], read only by
//! `main`) and the validated [`Config`] that [`crate::run`] takes (tests build it directly).

use crate::personas::{Personas, PersonasError};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::session::BusyPolicy;
use cyrene_protocol::turn::DEFAULT_MAX_STEPS;
use cyrene_runtime::entry::{Problems, ServiceArgs};
pub use cyrene_sql::{Database, PoolSettings};
use std::path::PathBuf;
use std::time::Duration;

/// File name of the default SQLite database inside the data directory.
pub const DEFAULT_SQLITE_FILE: &str = "orchestrator.db";
/// Default number of persisted transcript messages seeded into a turn job.
pub const DEFAULT_WINDOW: usize = 40;
/// Default largest serialised user message accepted by `send`.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 256 * 1024;
/// Default byte budget of a turn job (the NATS default `max_payload` is 1 MiB).
pub const DEFAULT_MAX_JOB_BYTES: usize = 768 * 1024;
/// Default number of asks to one persona that run at once (each of a different asker).
pub const DEFAULT_ASK_CONCURRENCY: usize = 16;
/// Default bytes of the asks one persona holds (waiting or running); a quarter per asker.
pub const DEFAULT_ASK_QUEUE_BYTES: usize = 32 * 1024 * 1024;

/// Everything [`crate::run`] needs besides the NATS client.
#[derive(Debug, Clone)]
pub struct Config {
    /// `postgres://…` / `postgresql://…` or `sqlite://…`; `None` = an SQLite file
    /// [`DEFAULT_SQLITE_FILE`] in `data_dir` (created if missing).
    pub database_url: Option<String>,
    /// Where the default SQLite database lives.
    pub data_dir: PathBuf,
    /// The personas (built-in `cyrene`/昔涟 unless a file is given).
    pub personas: Personas,
    /// Persisted transcript messages (user + assistant, newest) seeded into each turn job.
    pub window: usize,
    /// Step budget put into every turn job.
    pub max_steps: u32,
    /// The sessions and clients under a double-texting policy other than `steer`.
    pub busy: BusyPolicies,
    /// Largest serialised user message `send` accepts (`too_large` above).
    pub max_message_bytes: usize,
    /// Byte budget of a turn job: the oldest window messages are left out to stay under it.
    pub max_job_bytes: usize,
    /// Largest document an upload may store (`too_large` above; docs/documents.md).
    pub max_document_bytes: u64,
    /// The whole document store (the bucket's `max_bytes`; `too_large` past it).
    pub document_store_bytes: u64,
    /// What one person (or the sessions of nobody in particular, together) may store.
    pub document_owner_bytes: u64,
    /// How long an unfinished upload's staged chunks are kept before the sweep deletes them.
    pub upload_ttl: Duration,
    /// How long an agent ask waits for the turn that answers it (then `timeout`).
    pub ask_timeout: Duration,
    /// Register every persona on the comm protocol (answer `cyrene.agent.*.<persona>.ask`).
    pub serve_agents: bool,
    /// Asks to one persona that run at once, each of a different asker (an asker's own asks
    /// run one after the other).
    pub ask_concurrency: usize,
    /// Bytes of the asks one persona holds, waiting or running (a quarter of it per asker);
    /// an ask over it is refused `unavailable` (docs/comm.md, "Limits").
    pub ask_queue_bytes: usize,
    /// How often the sweeper republishes turns whose dispatch was not confirmed.
    pub sweep_interval: Duration,
    /// How old an unconfirmed dispatch must be before the sweeper republishes it.
    pub dispatch_grace: Duration,
    /// Bound on one database operation; past it the request is answered `unavailable`.
    pub db_timeout: Duration,
    /// Database pool size and how long a request waits for a pooled connection.
    pub pool: PoolSettings,
    /// Requests handled at once per endpoint.
    pub max_in_flight: usize,
    /// Replicas of the `CYRENE_TURNS` stream (3 on a 3-node cluster); the same value must be
    /// given to every process that creates it (see `cyrene_bus::streams`).
    pub turns_replicas: usize,
    /// The owner (主人): the person id whose messages are unlabelled everywhere, and whose
    /// sessions a chat bridge reaches ([`crate::identity`]). `None`: nobody is the owner, no
    /// person is labelled and the bridge subject answers `forbidden`.
    pub owner: Option<String>,
    /// The person ids (besides the owner) whose NATS users ask as themselves over the comm
    /// protocol (`cyrene --person <id> ask`): their asks are a person's lines, labelled as a
    /// person — the owner's unlabelled — never "another agent" (docs/comm.md, "People asking").
    pub people: Vec<String>,
    /// Memory extraction (docs/memory.md, "Memory she gathers herself"): how long a failed job
    /// waits before its next delivery (doubling each time) …
    pub memory_retry_delay: Duration,
    /// … and how many deliveries it gets before it is dropped.
    pub memory_max_deliver: u32,
}

impl Config {
    /// Defaults with the given data directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Config {
        Config {
            database_url: None,
            data_dir: data_dir.into(),
            personas: Personas::builtin(),
            window: DEFAULT_WINDOW,
            max_steps: DEFAULT_MAX_STEPS,
            busy: BusyPolicies::default(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_job_bytes: DEFAULT_MAX_JOB_BYTES,
            max_document_bytes: crate::documents::DEFAULT_MAX_DOCUMENT_BYTES,
            document_store_bytes: crate::documents::DEFAULT_STORE_BYTES,
            document_owner_bytes: crate::documents::DEFAULT_OWNER_BYTES,
            upload_ttl: crate::documents::DEFAULT_UPLOAD_TTL,
            ask_timeout: Duration::from_secs(120),
            serve_agents: true,
            ask_concurrency: DEFAULT_ASK_CONCURRENCY,
            ask_queue_bytes: DEFAULT_ASK_QUEUE_BYTES,
            sweep_interval: Duration::from_secs(1),
            dispatch_grace: Duration::from_secs(2),
            db_timeout: Duration::from_secs(5),
            pool: PoolSettings::default(),
            max_in_flight: 256,
            turns_replicas: cyrene_bus::streams::DEFAULT_TURNS_REPLICAS,
            owner: None,
            people: Vec::new(),
            memory_retry_delay: Duration::from_secs(10),
            memory_max_deliver: 5,
        }
    }

    /// Whether `id` asks as a person over the comm protocol: the owner or one of [`Config::people`].
    pub fn is_person(&self, id: &str) -> bool {
        self.owner.as_deref() == Some(id) || self.people.iter().any(|p| p == id)
    }

    /// The document store's bounds.
    pub fn document_limits(&self) -> crate::documents::DocumentLimits {
        crate::documents::DocumentLimits {
            max_document_bytes: self.max_document_bytes,
            store_bytes: self.document_store_bytes,
            owner_bytes: self.document_owner_bytes,
            upload_ttl: self.upload_ttl,
        }
    }

    /// Checks every value; all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(self.problems()?)
    }

    /// Every problem with the values.
    pub fn problems(&self) -> Result<(), Problems> {
        let mut problems = Vec::new();
        if let Err(err) = self.personas.validate() {
            problems.push(err.to_string());
        }
        if self.max_steps == 0 {
            problems.push("max_steps must be at least 1".to_owned());
        }
        if self.max_message_bytes == 0 || self.max_job_bytes < self.max_message_bytes {
            problems.push("max_message_bytes must be at least 1 and at most max_job_bytes".into());
        }
        for (name, d) in [
            ("ask_timeout", self.ask_timeout),
            ("upload_ttl", self.upload_ttl),
            ("sweep_interval", self.sweep_interval),
            ("db_timeout", self.db_timeout),
            ("memory_retry_delay", self.memory_retry_delay),
        ] {
            if d.is_zero() {
                problems.push(format!("{name} must be longer than zero"));
            }
        }
        if self.max_document_bytes == 0 {
            problems.push("max_document_bytes must be at least 1".to_owned());
        }
        if self.document_owner_bytes < self.max_document_bytes
            || self.document_store_bytes < self.document_owner_bytes
        {
            problems.push(
                "document_owner_bytes must be at least max_document_bytes, and \
                 document_store_bytes at least document_owner_bytes"
                    .to_owned(),
            );
        }
        for (name, n) in [
            ("max_in_flight", self.max_in_flight),
            ("turns_replicas", self.turns_replicas),
            ("ask_concurrency", self.ask_concurrency),
            ("ask_queue_bytes", self.ask_queue_bytes),
            ("memory_max_deliver", self.memory_max_deliver as usize),
        ] {
            if n == 0 {
                problems.push(format!("{name} must be at least 1"));
            }
        }
        self.busy
            .sessions
            .check(IdKind::Session, "sessions", &mut problems);
        self.busy
            .clients
            .check(IdKind::Client, "clients", &mut problems);
        if let Some(owner) = &self.owner
            && let Err(e) = ids::validate(IdKind::Person, owner)
        {
            problems.push(format!("owner: {e}"));
        }
        for person in &self.people {
            if let Err(e) = ids::validate(IdKind::Person, person) {
                problems.push(format!("people: {e}"));
            }
        }
        self.pool.check(&mut problems);
        if let Err(err) = self.database() {
            problems.push(err.to_string());
        }
        Problems::check(problems)
    }

    /// The double-texting policy of a message without its own `when_busy`: its client's list
    /// first, then its session's; `steer` when neither is listed.
    pub fn busy_policy(&self, session_id: &str, client_id: &str) -> BusyPolicy {
        self.busy
            .clients
            .policy_of(client_id)
            .or_else(|| self.busy.sessions.policy_of(session_id))
            .unwrap_or(BusyPolicy::Steer)
    }

    /// Which database to open.
    pub fn database(&self) -> Result<Database, ConfigError> {
        Ok(Database::resolve(
            self.database_url.as_deref(),
            &self.data_dir,
            DEFAULT_SQLITE_FILE,
        )?)
    }
}

/// An invalid configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The values' problems ([`Config::validate`]).
    #[error(transparent)]
    Invalid(#[from] Problems),
    /// A database URL of a scheme no store speaks.
    #[error(transparent)]
    Database(#[from] cyrene_sql::UnsupportedUrl),
    #[error(transparent)]
    Personas(#[from] PersonasError),
}

/// Command line and environment of the `cyrene-orchestrator` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "cyrene-orchestrator",
    version,
    about = "Cyrene orchestrator: sessions, exactly-once messages, turn dispatch to CYRENE_TURNS, \
             agents. Serves cyrene.session.{send,history} and cyrene.turn.{steer,complete}."
)]
pub struct Args {
    #[command(flatten)]
    pub common: cyrene_runtime::entry::ServiceFlags,
    /// Database: postgres://user@host:port/db or sqlite://path/file.db. Default: an SQLite file
    /// orchestrator.db in the data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Directory of the default SQLite database (created if missing).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,
    /// Personas file (JSON: {"default":"…","personas":[{"id","name","instructions","restricted"}]}).
    /// Default: the built-in persona cyrene (昔涟).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_PERSONAS")]
    pub personas: Option<PathBuf>,
    /// Persisted transcript messages seeded into each turn job.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_WINDOW", default_value_t = DEFAULT_WINDOW)]
    pub window: usize,
    /// Model steps a turn may take.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MAX_STEPS", default_value_t = DEFAULT_MAX_STEPS)]
    pub max_steps: u32,
    /// Sessions under the parallel policy (comma-separated ids).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_PARALLEL_SESSIONS",
        value_delimiter = ','
    )]
    pub parallel_sessions: Vec<String>,
    /// Clients under the parallel policy (comma-separated ids).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_PARALLEL_CLIENTS",
        value_delimiter = ','
    )]
    pub parallel_clients: Vec<String>,
    /// Sessions under the enqueue policy (comma-separated ids).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_ENQUEUE_SESSIONS",
        value_delimiter = ','
    )]
    pub enqueue_sessions: Vec<String>,
    /// Clients under the enqueue policy (comma-separated ids).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_ENQUEUE_CLIENTS",
        value_delimiter = ','
    )]
    pub enqueue_clients: Vec<String>,
    /// Sessions under the reject policy (comma-separated ids).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_REJECT_SESSIONS",
        value_delimiter = ','
    )]
    pub reject_sessions: Vec<String>,
    /// Clients under the reject policy (comma-separated ids).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_REJECT_CLIENTS",
        value_delimiter = ','
    )]
    pub reject_clients: Vec<String>,
    /// Largest serialised user message accepted, in bytes.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MAX_MESSAGE_BYTES", default_value_t = DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: usize,
    /// Largest document an upload may store, in bytes.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MAX_DOCUMENT_BYTES", default_value_t = crate::documents::DEFAULT_MAX_DOCUMENT_BYTES)]
    pub max_document_bytes: u64,
    /// Bytes the whole document store may hold (the bucket's max_bytes).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_DOCUMENT_STORE_BYTES", default_value_t = crate::documents::DEFAULT_STORE_BYTES)]
    pub document_store_bytes: u64,
    /// Bytes of documents one person (or all sessions without a person together) may store.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_DOCUMENT_OWNER_BYTES", default_value_t = crate::documents::DEFAULT_OWNER_BYTES)]
    pub document_owner_bytes: u64,
    /// How long an unfinished upload is kept (e.g. 1h); then its chunks are swept.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_UPLOAD_TTL", default_value = "1h", value_parser = humantime::parse_duration)]
    pub upload_ttl: Duration,
    /// How long an agent ask waits for its turn (e.g. 120s).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_ASK_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    pub ask_timeout: Duration,
    /// Do not register the personas on the comm protocol.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_NO_AGENTS")]
    pub no_agents: bool,
    /// Asks to one persona that run at once, each of a different asker.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_ASK_CONCURRENCY", default_value_t = DEFAULT_ASK_CONCURRENCY)]
    pub ask_concurrency: usize,
    /// Bytes of the asks one persona holds (a quarter per asker); more are refused unavailable.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_ASK_QUEUE_BYTES", default_value_t = DEFAULT_ASK_QUEUE_BYTES)]
    pub ask_queue_bytes: usize,
    /// Bound on one database operation (e.g. 5s); past it the request gets unavailable.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_DB_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub db_timeout: Duration,
    /// How long a request waits for a database connection (e.g. 2s).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_ACQUIRE_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub acquire_timeout: Duration,
    /// Database connection pool size.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MAX_CONNECTIONS", default_value_t = 8)]
    pub max_connections: u32,
    /// Requests handled at once per endpoint.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MAX_IN_FLIGHT", default_value_t = 256)]
    pub max_in_flight: usize,
    /// Replicas of the CYRENE_TURNS stream (e.g. 3 on a 3-node cluster); give the loop workers
    /// the same value.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_TURNS_REPLICAS", default_value_t = cyrene_bus::streams::DEFAULT_TURNS_REPLICAS)]
    pub turns_replicas: usize,
    /// Byte budget of a turn job (below the server's max_payload); the oldest window messages
    /// are left out to stay under it.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MAX_JOB_BYTES", default_value_t = DEFAULT_MAX_JOB_BYTES)]
    pub max_job_bytes: usize,
    /// How often the sweeper republishes turn jobs whose dispatch JetStream never confirmed.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_SWEEP_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub sweep_interval: Duration,
    /// How old an unconfirmed dispatch must be before the sweeper republishes it.
    #[arg(long, env = "CYRENE_ORCHESTRATOR_DISPATCH_GRACE", default_value = "2s", value_parser = humantime::parse_duration)]
    pub dispatch_grace: Duration,
    /// The owner's person id (主人): their messages are unlabelled; every other person's are
    /// labelled, and a chat bridge reaches only the owner's sessions (docs/security.md).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_OWNER")]
    pub owner: Option<String>,
    /// Person ids (comma-separated) besides the owner: their asks over the comm protocol are
    /// labelled as a person's, not as another agent's (docs/comm.md, "People asking").
    #[arg(long, env = "CYRENE_ORCHESTRATOR_PEOPLE", value_delimiter = ',')]
    pub people: Vec<String>,
    /// How long a failed memory extraction waits before its next try (doubling each time).
    #[arg(long, env = "CYRENE_ORCHESTRATOR_MEMORY_RETRY_DELAY", default_value = "10s", value_parser = humantime::parse_duration)]
    pub memory_retry_delay: Duration,
    /// Tries of one memory extraction before it is dropped (a WARN and a metric).
    #[arg(
        long,
        env = "CYRENE_ORCHESTRATOR_MEMORY_MAX_DELIVER",
        default_value_t = 5
    )]
    pub memory_max_deliver: u32,
}

impl ServiceArgs for Args {
    type Config = Config;

    fn into_config(self) -> Result<Config, Problems> {
        let config = self.config().map_err(|e| Problems(vec![e.to_string()]))?;
        config.problems()?;
        Ok(config)
    }
}

impl Args {
    /// The service configuration these arguments describe (reads the personas file).
    pub fn config(&self) -> Result<Config, ConfigError> {
        let mut config = Config::new(&self.data_dir);
        config.database_url = self.database_url.clone();
        if let Some(path) = &self.personas {
            config.personas = Personas::load(path)?;
        }
        config.window = self.window;
        config.max_steps = self.max_steps;
        config.busy = BusyPolicies {
            sessions: PolicyLists {
                parallel: clean(&self.parallel_sessions),
                enqueue: clean(&self.enqueue_sessions),
                reject: clean(&self.reject_sessions),
            },
            clients: PolicyLists {
                parallel: clean(&self.parallel_clients),
                enqueue: clean(&self.enqueue_clients),
                reject: clean(&self.reject_clients),
            },
        };
        config.max_message_bytes = self.max_message_bytes;
        config.max_document_bytes = self.max_document_bytes;
        config.document_store_bytes = self.document_store_bytes;
        config.document_owner_bytes = self.document_owner_bytes;
        config.upload_ttl = self.upload_ttl;
        config.ask_timeout = self.ask_timeout;
        config.serve_agents = !self.no_agents;
        config.ask_concurrency = self.ask_concurrency;
        config.ask_queue_bytes = self.ask_queue_bytes;
        config.db_timeout = self.db_timeout;
        config.pool = PoolSettings {
            max_connections: self.max_connections,
            acquire_timeout: self.acquire_timeout,
        };
        config.max_in_flight = self.max_in_flight;
        config.turns_replicas = self.turns_replicas;
        config.max_job_bytes = self.max_job_bytes;
        config.sweep_interval = self.sweep_interval;
        config.dispatch_grace = self.dispatch_grace;
        config.owner = self
            .owner
            .as_deref()
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned);
        config.people = clean(&self.people);
        config.memory_retry_delay = self.memory_retry_delay;
        config.memory_max_deliver = self.memory_max_deliver;
        Ok(config)
    }
}

/// Which sessions and which clients are under a double-texting policy other than `steer`
/// (docs/orchestrator.md); a client's policy comes before its session's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BusyPolicies {
    pub sessions: PolicyLists,
    pub clients: PolicyLists,
}

/// The ids (of sessions, or of clients) under each policy other than `steer`; an id is in one
/// list at most.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyLists {
    /// A message from another client while a turn runs starts its own leg.
    pub parallel: Vec<String>,
    /// A message sent while a turn runs waits for the next turn and is never steered into the
    /// running one.
    pub enqueue: Vec<String>,
    /// A message sent while a turn runs is refused with `conflict` and nothing is stored.
    pub reject: Vec<String>,
}

impl PolicyLists {
    fn lists(&self) -> [(&'static str, &Vec<String>, BusyPolicy); 3] {
        [
            ("parallel", &self.parallel, BusyPolicy::Parallel),
            ("enqueue", &self.enqueue, BusyPolicy::Enqueue),
            ("reject", &self.reject, BusyPolicy::Reject),
        ]
    }

    /// The policy `id` is listed under (an empty id never is).
    pub fn policy_of(&self, id: &str) -> Option<BusyPolicy> {
        if id.is_empty() {
            return None;
        }
        self.lists()
            .into_iter()
            .find(|(_, list, _)| list.iter().any(|x| x == id))
            .map(|(_, _, policy)| policy)
    }

    /// Adds a problem for every invalid id and every id in two lists; `scope` names the lists
    /// as the flags do (`parallel_sessions`).
    fn check(&self, kind: IdKind, scope: &str, problems: &mut Vec<String>) {
        let mut policy_of = std::collections::BTreeMap::new();
        for (policy, list, _) in self.lists() {
            let name = format!("{policy}_{scope}");
            for id in list {
                if let Err(e) = ids::validate(kind, id) {
                    problems.push(format!("{name}: {e}"));
                }
                if let Some(other) = policy_of.insert(id.as_str(), name.clone())
                    && other != name
                {
                    problems.push(format!(
                        "{id:?} is in both {other} and {name}: one policy each"
                    ));
                }
            }
        }
    }
}

fn clean(list: &[String]) -> Vec<String> {
    list.iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn defaults_are_valid_and_pick_sqlite_in_the_data_dir() {
        let config = Config::new("/tmp/x");
        assert!(config.validate().is_ok());
        assert_eq!(
            config.database().unwrap(),
            Database::Sqlite("sqlite:///tmp/x/orchestrator.db".into())
        );
    }

    #[test]
    fn refuses_bad_values() {
        let mut c = Config::new("/tmp/x");
        c.database_url = Some("mysql://x".into());
        assert!(c.validate().is_err());
        let mut c = Config::new("/tmp/x");
        c.busy.clients.parallel = vec!["a b".into()];
        assert!(c.validate().is_err());
        let mut c = Config::new("/tmp/x");
        c.busy.sessions.parallel = vec!["s1".into()];
        c.busy.sessions.reject = vec!["s1".into()];
        assert!(c.validate().is_err(), "one policy per session");
        let mut c = Config::new("/tmp/x");
        c.max_steps = 0;
        assert!(c.validate().is_err());
        let mut c = Config::new("/tmp/x");
        c.owner = Some("alice.x".into());
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("owner"), "{err}");
    }

    #[test]
    fn flags_build_a_config() {
        let args = Args::parse_from([
            "cyrene-orchestrator",
            "--database-url",
            "postgres://u@h/db",
            "--parallel-clients",
            "phone, watch",
            "--window",
            "10",
            "--owner",
            "alice",
        ]);
        let config = args.config().unwrap();
        assert_eq!(config.busy.clients.parallel, vec!["phone", "watch"]);
        assert_eq!(config.busy_policy("s", "phone"), BusyPolicy::Parallel);
        assert_eq!(config.busy_policy("s", "desk"), BusyPolicy::Steer);
        assert_eq!(config.window, 10);
        assert_eq!(config.owner.as_deref(), Some("alice"));
        assert_eq!(
            config.database().unwrap(),
            Database::Postgres("postgres://u@h/db?sslmode=disable".into())
        );
    }

    #[test]
    fn a_client_policy_wins_over_a_session_policy() {
        let mut c = Config::new("/tmp/x");
        c.busy.sessions.enqueue = vec!["s1".into()];
        c.busy.clients.reject = vec!["bot".into()];
        assert!(c.validate().is_ok());
        assert_eq!(c.busy_policy("s1", "phone"), BusyPolicy::Enqueue);
        assert_eq!(c.busy_policy("s1", "bot"), BusyPolicy::Reject);
        assert_eq!(c.busy_policy("s2", "bot"), BusyPolicy::Reject);
        assert_eq!(c.busy_policy("s2", ""), BusyPolicy::Steer);
    }
}
