//! Configuration of the checkpoint store: the command line / environment ([`Args`], the
//! [`ServiceArgs`] of the binary and of `cyrene up`) and the [`Config`] that [`crate::run`] takes
//! (tests build it directly).

use crate::store::{DEFAULT_MAX_STATE_BYTES, StoreOptions};
use cyrene_runtime::entry::{Problems, ServiceArgs};
pub use cyrene_sql::{Database, PoolSettings};
use std::path::PathBuf;
use std::time::Duration;

/// File name of the default SQLite database inside the data directory.
pub const DEFAULT_SQLITE_FILE: &str = "checkpoints.db";

/// Everything [`crate::run`] needs besides the NATS client.
#[derive(Debug, Clone)]
pub struct Config {
    /// `postgres://…` / `postgresql://…` or `sqlite://…`; `None` = an SQLite file
    /// [`DEFAULT_SQLITE_FILE`] in `data_dir` (created if missing).
    pub database_url: Option<String>,
    /// Where the default SQLite database lives.
    pub data_dir: PathBuf,
    /// Largest serialised `state` a save accepts (`too_large` above).
    pub max_state_bytes: usize,
    /// Bound on one database operation; past it the request is answered `unavailable`.
    pub db_timeout: Duration,
    /// Database pool size and how long a request waits for a pooled connection.
    pub pool: PoolSettings,
    /// Requests handled at once per endpoint.
    pub max_in_flight: usize,
}

impl Config {
    /// Defaults with the given data directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Config {
        Config {
            database_url: None,
            data_dir: data_dir.into(),
            max_state_bytes: DEFAULT_MAX_STATE_BYTES,
            db_timeout: Duration::from_secs(5),
            pool: PoolSettings::default(),
            max_in_flight: 256,
        }
    }

    /// Every problem with the values, at once.
    pub fn validate(&self) -> Result<(), Problems> {
        let mut problems = Vec::new();
        if self.max_state_bytes == 0 {
            problems.push("max_state_bytes must be at least 1".to_owned());
        }
        if self.db_timeout.is_zero() {
            problems.push("db_timeout must be longer than zero".to_owned());
        }
        self.pool.check(&mut problems);
        if self.max_in_flight == 0 {
            problems.push("max_in_flight must be at least 1".to_owned());
        }
        if let Err(err) = self.resolve_database() {
            problems.push(err.to_string());
        }
        Problems::check(problems)
    }

    /// Checks the values and resolves which database to open.
    pub fn database(&self) -> Result<Database, ConfigError> {
        self.validate()?;
        Ok(self.resolve_database()?)
    }

    fn resolve_database(&self) -> Result<Database, cyrene_sql::UnsupportedUrl> {
        Database::resolve(
            self.database_url.as_deref(),
            &self.data_dir,
            DEFAULT_SQLITE_FILE,
        )
    }

    /// The pool settings for the store.
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            max_state_bytes: self.max_state_bytes,
            acquire_timeout: self.pool.acquire_timeout,
            max_connections: self.pool.max_connections,
            group_commit: true,
        }
    }
}

/// An invalid configuration value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The values' problems ([`Config::validate`]).
    #[error(transparent)]
    Invalid(#[from] Problems),
    /// A database URL of a scheme no store speaks.
    #[error(transparent)]
    Database(#[from] cyrene_sql::UnsupportedUrl),
}

/// Command line and environment of the `cyrene-checkpoint-store` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "cyrene-checkpoint-store",
    version,
    about = "Cyrene checkpoint store: per-step snapshots in PostgreSQL or SQLite, served on \
             cyrene.checkpoint.{save,latest,get,list,retain}."
)]
pub struct Args {
    #[command(flatten)]
    pub common: cyrene_runtime::entry::ServiceFlags,
    /// Database: postgres://user@host:port/db or sqlite://path/file.db. Default: an SQLite file
    /// checkpoints.db in the data directory.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Directory of the default SQLite database (created if missing).
    #[arg(long, env = "CYRENE_STORE_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,
    /// Largest serialised checkpoint state accepted, in bytes (larger saves get too_large).
    #[arg(long, env = "CYRENE_STORE_MAX_STATE_BYTES", default_value_t = DEFAULT_MAX_STATE_BYTES)]
    pub max_state_bytes: usize,
    /// Bound on one database operation (e.g. 5s); past it the request gets unavailable.
    #[arg(long, env = "CYRENE_STORE_DB_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub db_timeout: Duration,
    /// How long a request waits for a database connection (e.g. 2s).
    #[arg(long, env = "CYRENE_STORE_ACQUIRE_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub acquire_timeout: Duration,
    /// Database connection pool size (SQLite: the reads' pool; writes have one connection of
    /// their own).
    #[arg(long, env = "CYRENE_STORE_MAX_CONNECTIONS", default_value_t = 8)]
    pub max_connections: u32,
    /// Requests handled at once per endpoint.
    #[arg(long, env = "CYRENE_STORE_MAX_IN_FLIGHT", default_value_t = 256)]
    pub max_in_flight: usize,
}

impl ServiceArgs for Args {
    type Config = Config;

    fn into_config(self) -> Result<Config, Problems> {
        let config = self.config();
        config.validate()?;
        Ok(config)
    }
}

impl Args {
    /// The service configuration these arguments describe (not yet checked).
    pub fn config(&self) -> Config {
        Config {
            database_url: self.database_url.clone(),
            data_dir: self.data_dir.clone(),
            max_state_bytes: self.max_state_bytes,
            db_timeout: self.db_timeout,
            pool: PoolSettings {
                max_connections: self.max_connections,
                acquire_timeout: self.acquire_timeout,
            },
            max_in_flight: self.max_in_flight,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn default_database_is_sqlite_in_the_data_dir() {
        let config = Config::new("/var/lib/cyrene");
        assert_eq!(config.max_state_bytes, 4 * 1024 * 1024);
        assert_eq!(config.pool.acquire_timeout, Duration::from_secs(2));
        assert_eq!(
            config.database().unwrap(),
            Database::Sqlite("sqlite:///var/lib/cyrene/checkpoints.db".into())
        );
    }

    #[test]
    fn database_url_picks_the_backend() {
        let mut config = Config::new("d");
        config.database_url = Some("postgres://postgres@127.0.0.1:5432/x".into());
        assert!(matches!(config.database(), Ok(Database::Postgres(_))));
        config.database_url = Some("sqlite://x.db".into());
        assert_eq!(
            config.database().unwrap(),
            Database::Sqlite("sqlite://x.db".into())
        );
        config.database_url = Some("mysql://x".into());
        assert!(config.database().unwrap_err().to_string().contains("mysql"));
        config.database_url = None;
        config.max_state_bytes = 0;
        assert!(config.database().is_err());
    }

    #[test]
    fn flags_parse_into_a_config() {
        let args = Args::try_parse_from([
            "cyrene-checkpoint-store",
            "--database-url",
            "sqlite://a.db",
            "--max-state-bytes",
            "1024",
            "--db-timeout",
            "750ms",
        ])
        .unwrap();
        let config = args.config();
        assert_eq!(config.max_state_bytes, 1024);
        assert_eq!(config.db_timeout, Duration::from_millis(750));
        assert_eq!(config.database_url.as_deref(), Some("sqlite://a.db"));
    }
}
