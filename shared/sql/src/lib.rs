//! What Cyrene's two SQL-backed services (the checkpoint store and the orchestrator) share, so
//! both treat databases the same way:
//! - [`Database`]: the one `DATABASE_URL` rule — `postgres://` / `postgresql://` for PostgreSQL,
//!   `sqlite:` for an SQLite file, unset for the embedded default file in the data directory;
//! - [`is_unavailable`]: which sqlx failures mean "down, busy or going away" (answered
//!   `unavailable`, retryable) rather than a bug (`internal`), and [`QueryError`], a failed
//!   query so classified, with its wire code;
//! - [`StoreError`]: the one error of a store operation, each variant one wire code, and
//!   [`bounded`], the one time limit on a store call;
//! - [`PoolSettings`], [`SqliteSettings`]: how a pool is sized and an SQLite file is opened;
//!   [`WarmPool`]: the pool the services query through, which hands a connection whose use
//!   finished straight to the next caller, without sqlx's check on release;
//!   [`WalTask`]: the task that checkpoints an SQLite file's WAL off its writers' path;
//! - [`Migrations`] ([`migrations!`]): the one migrations layout, `migrations/{postgres,sqlite}`
//!   beside each service's `Cargo.toml`;
//! - [`testing::TestDatabase`] (feature `testing`): a fresh PostgreSQL database per test, dropped
//!   afterwards, on the server named by `CYRENE_TEST_POSTGRES_URL`.
//!
//! Each service keeps its own migration files and its own queries, and the two query them in two
//! ways on purpose: the checkpoint store runs a few hot statements whose best SQL differs per
//! backend (array upserts, triggers, typed timestamps), so it types each dialect (`Dialect` in
//! its `store/sql.rs`), while the orchestrator's many transactional queries read the same on both
//! backends, so it writes each once through sqlx's `Any` driver and differs only in the session
//! lock (docs/architecture.md §6).

mod classify;
mod error;
mod pool;
#[cfg(feature = "testing")]
pub mod testing;
mod wal;
mod warm;

pub use classify::{QueryError, is_unavailable};
pub use error::{StoreError, bounded};
pub use pool::{Migrations, OpenError, PoolSettings, RECENTLY_CHECKED, SqliteSettings};
pub use wal::{WAL_AUTOCHECKPOINT_PAGES, WAL_CHECKPOINT_EVERY, WalTask};
pub use warm::{Warm, WarmPool, WarmTx};

use std::path::Path;

/// Which backend a service opens, with its URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    Postgres(String),
    Sqlite(String),
}

/// A `DATABASE_URL` whose scheme is neither PostgreSQL nor SQLite.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("DATABASE_URL scheme {scheme:?} is not supported; use postgres:// or sqlite://")]
pub struct UnsupportedUrl {
    pub scheme: String,
}

impl Database {
    /// The database of `url` (surrounding space ignored); unset or empty: the SQLite file
    /// `default_file` in `data_dir`.
    pub fn resolve(
        url: Option<&str>,
        data_dir: &Path,
        default_file: &str,
    ) -> Result<Database, UnsupportedUrl> {
        match url.map(str::trim) {
            None | Some("") => Ok(Database::Sqlite(format!(
                "sqlite://{}",
                data_dir.join(default_file).display()
            ))),
            Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
                Ok(Database::Postgres(without_implicit_tls(url)))
            }
            Some(url) if url.starts_with("sqlite:") => Ok(Database::Sqlite(url.to_owned())),
            Some(url) => Err(UnsupportedUrl {
                scheme: url.split_once(':').map_or("", |(s, _)| s).to_owned(),
            }),
        }
    }

    /// `postgres` or `sqlite`.
    pub fn backend(&self) -> &'static str {
        match self {
            Database::Postgres(_) => "postgres",
            Database::Sqlite(_) => "sqlite",
        }
    }

    /// The URL to connect to.
    pub fn url(&self) -> &str {
        match self {
            Database::Postgres(url) | Database::Sqlite(url) => url,
        }
    }
}

/// `url` with `sslmode=disable` added when it names no `sslmode`: TLS only when asked for
/// (`sslmode=require`, `verify-ca`, `verify-full`). libpq's default, `prefer`, would negotiate TLS
/// opportunistically — no protection against an active attacker, and over sqlx's TLS stream (no
/// `TCP_NODELAY`) a large checkpoint save stalls ~40 ms on delayed ACKs (measured: 44 ms per step
/// at a 200-message window, against ~1.2 ms in plain text). docs/operations.md says so. Public
/// so that a bench connecting directly connects as the services do.
pub fn without_implicit_tls(url: &str) -> String {
    let query = url.split_once('?').map_or("", |(_, q)| q);
    if query.split('&').any(|kv| kv.starts_with("sslmode=")) {
        return url.to_owned();
    }
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}sslmode=disable")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_url_rule_for_every_service() {
        let dir = Path::new("/var/lib/cyrene");
        assert_eq!(
            Database::resolve(None, dir, "x.db").unwrap(),
            Database::Sqlite("sqlite:///var/lib/cyrene/x.db".into())
        );
        assert_eq!(
            Database::resolve(Some("  "), dir, "x.db")
                .unwrap()
                .backend(),
            "sqlite"
        );
        for pg in [
            "postgres://u@h/db",
            "postgresql://u@h/db",
            " postgres://u@h/db ",
        ] {
            let db = Database::resolve(Some(pg), dir, "x.db").unwrap();
            let plain = format!("{}?sslmode=disable", pg.trim());
            assert_eq!((db.backend(), db.url()), ("postgres", plain.as_str()));
        }
        for (given, used) in [
            (
                "postgres://h/db?sslmode=require",
                "postgres://h/db?sslmode=require",
            ),
            (
                "postgres://h/db?application_name=x",
                "postgres://h/db?application_name=x&sslmode=disable",
            ),
            (
                "postgres://h/db?a=1&sslmode=verify-full",
                "postgres://h/db?a=1&sslmode=verify-full",
            ),
        ] {
            assert_eq!(
                Database::resolve(Some(given), dir, "x.db").unwrap().url(),
                used
            );
        }
        assert_eq!(
            Database::resolve(Some("sqlite://a.db"), dir, "x.db").unwrap(),
            Database::Sqlite("sqlite://a.db".into())
        );
        let err = Database::resolve(Some("mysql://h/db"), dir, "x.db").unwrap_err();
        assert_eq!(err.scheme, "mysql");
        assert!(err.to_string().contains("postgres://"));
    }
}
