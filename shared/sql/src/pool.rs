//! How both SQL services open their database: one pool shape ([`PoolSettings`]), one set of
//! SQLite connection settings ([`SqliteSettings`], with [`crate::WalTask`] beside a WAL file's
//! connections) and one migrations layout ([`Migrations`], built by [`crate::migrations!`]).

use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use std::str::FromStr;
use std::time::Duration;

/// How long after sqlx's check of a released connection it is handed out again unchecked
/// ([`PoolSettings::options`]).
pub const RECENTLY_CHECKED: Duration = Duration::from_secs(1);

/// The connection pool of a service: its size and how long a request waits for a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    /// Pool size (`--max-connections`).
    pub max_connections: u32,
    /// How long a request waits for a pooled connection (`--acquire-timeout`; short: fail fast
    /// during outages, answered `unavailable`).
    pub acquire_timeout: Duration,
}

impl Default for PoolSettings {
    fn default() -> Self {
        PoolSettings {
            max_connections: 8,
            acquire_timeout: Duration::from_secs(2),
        }
    }
}

impl PoolSettings {
    /// Appends every problem with the values to `problems`.
    pub fn check(&self, problems: &mut Vec<String>) {
        if self.max_connections == 0 {
            problems.push("max_connections must be at least 1".to_owned());
        }
        if self.acquire_timeout.is_zero() {
            problems.push("acquire_timeout must be longer than zero".to_owned());
        }
    }

    /// The pool options for any sqlx driver (a zero size is taken as 1).
    ///
    /// A connection is checked (a ping) before a request gets it only when it sat idle for
    /// [`RECENTLY_CHECKED`] or longer. A ping before every query would put one more round trip
    /// on each (on the loop worker's per-step save, a PostgreSQL round trip or a hop to
    /// SQLite's connection thread). The services query through [`crate::WarmPool`], which
    /// hands a connection whose use finished to the next caller with no check at all within
    /// that second; what sqlx takes back (an unfinished use, or one unused for longer) it pings
    /// on release and drops when that fails. A database lost within that moment fails one
    /// request with an I/O error (`unavailable`, retryable), as a loss during the query would.
    pub fn options<DB: sqlx::Database>(&self) -> sqlx::pool::PoolOptions<DB> {
        sqlx::pool::PoolOptions::new()
            .max_connections(self.max_connections.max(1))
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for < RECENTLY_CHECKED {
                        return Ok(true);
                    }
                    <DB::Connection as sqlx::Connection>::ping(conn)
                        .await
                        .map(|()| true)
                })
            })
    }
}

/// How an SQLite database file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqliteSettings {
    /// Write-ahead logging: readers run while one writer holds the lock. A WAL file's
    /// connections checkpoint inline only past [`crate::WAL_AUTOCHECKPOINT_PAGES`]: the service
    /// runs a [`crate::WalTask`] beside them.
    pub wal: bool,
    /// `PRAGMA synchronous`: `NORMAL` (with WAL, a commit survives a crash of the process but
    /// possibly not of the machine) or `FULL` (every commit is synced).
    pub synchronous: SqliteSynchronous,
    /// How long a writer waits for the lock before failing with SQLITE_BUSY (`unavailable`).
    pub busy_timeout: Duration,
}

impl SqliteSettings {
    /// The checkpoint store's: WAL, `synchronous = NORMAL` (a lost last checkpoint after a power
    /// cut costs one replayed step), 5 s busy timeout.
    pub const CHECKPOINTS: SqliteSettings = SqliteSettings {
        wal: true,
        synchronous: SqliteSynchronous::Normal,
        busy_timeout: Duration::from_secs(5),
    };
    /// The orchestrator's: WAL, `synchronous = FULL` (an accepted message is on disk), 5 s busy
    /// timeout.
    pub const SESSIONS: SqliteSettings = SqliteSettings {
        wal: true,
        synchronous: SqliteSynchronous::Full,
        busy_timeout: Duration::from_secs(5),
    };

    /// The connect options of `url` (`sqlite://path/file.db`): created if missing (its directory
    /// too), these settings, foreign keys on.
    pub fn connect_options(&self, url: &str) -> Result<SqliteConnectOptions, OpenError> {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(OpenError::while_("DATABASE_URL"))?
            .create_if_missing(true)
            .journal_mode(if self.wal {
                SqliteJournalMode::Wal
            } else {
                SqliteJournalMode::Delete
            })
            .synchronous(self.synchronous)
            .busy_timeout(self.busy_timeout)
            .foreign_keys(true);
        let options = match self.wal {
            true => options.pragma(
                "wal_autocheckpoint",
                crate::WAL_AUTOCHECKPOINT_PAGES.to_string(),
            ),
            false => options,
        };
        let file = options.get_filename();
        if file.as_os_str() != ":memory:"
            && let Some(parent) = file.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(OpenError::while_(format!(
                "cannot create {}",
                parent.display()
            )))?;
        }
        Ok(options)
    }

    /// The same settings as statements, for a connection opened through sqlx's `Any` driver
    /// (run on every new connection).
    pub fn pragmas(&self) -> Vec<String> {
        let synchronous = match self.synchronous {
            SqliteSynchronous::Off => "OFF",
            SqliteSynchronous::Normal => "NORMAL",
            SqliteSynchronous::Full => "FULL",
            SqliteSynchronous::Extra => "EXTRA",
        };
        let mut pragmas = Vec::new();
        if self.wal {
            pragmas.push("PRAGMA journal_mode = WAL".to_owned());
            pragmas.push(format!(
                "PRAGMA wal_autocheckpoint = {}",
                crate::WAL_AUTOCHECKPOINT_PAGES
            ));
        }
        pragmas.push(format!("PRAGMA synchronous = {synchronous}"));
        pragmas.push(format!(
            "PRAGMA busy_timeout = {}",
            self.busy_timeout.as_millis()
        ));
        pragmas.push("PRAGMA foreign_keys = ON".to_owned());
        pragmas
    }
}

/// Why a database could not be opened: what was being done, and the cause, kept whole.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct OpenError {
    pub what: String,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl OpenError {
    /// For `map_err`: `what` failed with the error given.
    pub fn while_<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        what: impl Into<String>,
    ) -> impl FnOnce(E) -> OpenError {
        let what = what.into();
        move |source| OpenError {
            what,
            source: source.into(),
        }
    }
}

/// A service's migrations, one set per backend, laid out as `migrations/postgres/*.sql` and
/// `migrations/sqlite/*.sql` beside the service's `Cargo.toml` (built by
/// [`crate::migrations!`]). A migration file is never edited once released: sqlx refuses to
/// start when an applied migration's checksum changed.
#[derive(Debug)]
pub struct Migrations {
    pub postgres: Migrator,
    pub sqlite: Migrator,
}

impl Migrations {
    /// The set for `backend` (`postgres` or `sqlite`, as [`crate::Database::backend`] names it).
    pub fn of(self, backend: &str) -> Migrator {
        if backend == "postgres" {
            self.postgres
        } else {
            self.sqlite
        }
    }
}

/// The calling crate's [`Migrations`]: `migrations/postgres` and `migrations/sqlite` next to its
/// `Cargo.toml`, embedded at compile time (the crate depends on `sqlx` with `migrate`).
/// `migrations!(postgres)` / `migrations!(sqlite)` give one set (a `static` `Migrator`).
#[macro_export]
macro_rules! migrations {
    (postgres) => {
        ::sqlx::migrate!("migrations/postgres")
    };
    (sqlite) => {
        ::sqlx::migrate!("migrations/sqlite")
    };
    () => {
        $crate::Migrations {
            postgres: $crate::migrations!(postgres),
            sqlite: $crate::migrations!(sqlite),
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_settings_list_every_problem() {
        let mut problems = Vec::new();
        PoolSettings::default().check(&mut problems);
        assert!(problems.is_empty());
        PoolSettings {
            max_connections: 0,
            acquire_timeout: Duration::ZERO,
        }
        .check(&mut problems);
        assert_eq!(problems.len(), 2);
    }

    #[test]
    fn sqlite_settings_create_the_directory_and_say_the_same_as_pragmas() {
        let dir = std::env::temp_dir().join(format!("cyrene-sql-{}", std::process::id()));
        let url = format!("sqlite://{}/nested/x.db", dir.display());
        let options = SqliteSettings::CHECKPOINTS.connect_options(&url).unwrap();
        assert!(dir.join("nested").is_dir());
        assert!(options.get_filename().ends_with("nested/x.db"));
        assert_eq!(
            SqliteSettings::CHECKPOINTS.pragmas(),
            [
                "PRAGMA journal_mode = WAL",
                "PRAGMA wal_autocheckpoint = 10000",
                "PRAGMA synchronous = NORMAL",
                "PRAGMA busy_timeout = 5000",
                "PRAGMA foreign_keys = ON"
            ]
        );
        assert!(SqliteSettings::SESSIONS.pragmas()[2].ends_with("FULL"));
        let _ = std::fs::remove_dir_all(dir);
    }
}
