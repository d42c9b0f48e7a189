//! What Cyrene's two SQL-backed services (the checkpoint store and the orchestrator) share, so
//! both treat databases the same way:
//! - [`Database`]: the one `DATABASE_URL` rule — `postgres://` / `postgresql://` for PostgreSQL,
//!   `sqlite:` for an SQLite file, unset for the embedded default file in the data directory;
//! - [`is_unavailable`]: which sqlx failures mean "down, busy or going away" (answered
//!   `unavailable`, retryable) rather than a bug (`internal`);
//! - [`testing::TestDatabase`] (feature `testing`): a fresh PostgreSQL database per test, dropped
//!   afterwards, on the server named by `CYRENE_TEST_POSTGRES_URL`.
//!
//! Each service keeps its own migrations (`services/<name>/migrations/{postgres,sqlite}`) and its
//! own queries.

mod classify;
#[cfg(feature = "testing")]
pub mod testing;

pub use classify::is_unavailable;

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
                Ok(Database::Postgres(url.to_owned()))
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
            assert_eq!((db.backend(), db.url()), ("postgres", pg.trim()));
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
