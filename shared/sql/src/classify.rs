//! sqlx failures, classified once for every SQL-backed service.
//!
//! "Unavailable" means the database is down, busy or going away: the request may succeed later,
//! so callers answer `unavailable` (retryable) instead of `internal`.

use cyrene_protocol::ErrorCode;
use sqlx::postgres::PgDatabaseError;
use sqlx::sqlite::SqliteError;

/// A failed query as a store reports it, with the wire code it is answered with: `unavailable`
/// when the database is down, busy or going away ([`is_unavailable`]; retryable), else
/// `internal`.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", if *.code == ErrorCode::Unavailable { "database unavailable" } else { "database error" })]
pub struct QueryError {
    code: ErrorCode,
    #[source]
    source: sqlx::Error,
}

impl From<sqlx::Error> for QueryError {
    fn from(source: sqlx::Error) -> Self {
        let code = if is_unavailable(&source) {
            ErrorCode::Unavailable
        } else {
            ErrorCode::Internal
        };
        QueryError { code, source }
    }
}

impl QueryError {
    /// The wire code the caller is answered with: `unavailable` or `internal`.
    pub fn code(&self) -> ErrorCode {
        self.code
    }
}

/// Whether `err` means the database is down, busy or going away (retryable). Works for errors
/// from the PostgreSQL and SQLite drivers, also through `sqlx::Any`.
pub fn is_unavailable(err: &sqlx::Error) -> bool {
    use sqlx::Error as E;
    match err {
        E::Io(_)
        | E::Tls(_)
        | E::Protocol(_)
        | E::PoolTimedOut
        | E::PoolClosed
        | E::WorkerCrashed
        | E::BeginFailed => true,
        E::Database(db) => {
            if let Some(pg) = db.try_downcast_ref::<PgDatabaseError>() {
                postgres_unavailable(pg.code())
            } else if db.try_downcast_ref::<SqliteError>().is_some() {
                db.code().is_some_and(|code| sqlite_unavailable(&code))
            } else {
                false
            }
        }
        _ => false,
    }
}

/// PostgreSQL SQLSTATE: connection exceptions (08), insufficient resources (53), operator
/// intervention (57: shutdown, cannot connect now), transaction rollback (40: serialisation
/// failure, deadlock), and an unknown database (3D000, e.g. not created yet).
fn postgres_unavailable(code: &str) -> bool {
    ["08", "53", "57", "40"]
        .iter()
        .any(|class| code.starts_with(class))
        || code == "3D000"
}

/// SQLite (extended) result code: BUSY (5), LOCKED (6), IOERR (10), FULL (13) and CANTOPEN (14)
/// by their primary code (the low byte).
fn sqlite_unavailable(code: &str) -> bool {
    code.parse::<i64>()
        .is_ok_and(|c| matches!(c & 0xff, 5 | 6 | 10 | 13 | 14))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outages_are_unavailable_and_bugs_are_not() {
        assert!(is_unavailable(&sqlx::Error::PoolTimedOut));
        assert!(is_unavailable(&sqlx::Error::PoolClosed));
        assert!(!is_unavailable(&sqlx::Error::RowNotFound));
        for code in ["08006", "53300", "57P01", "40001", "40P01", "3D000"] {
            assert!(postgres_unavailable(code), "{code}");
        }
        for code in ["23505", "42P01", "22013"] {
            assert!(!postgres_unavailable(code), "{code}");
        }
        for code in ["5", "261", "6", "10", "3338", "13", "14"] {
            assert!(sqlite_unavailable(code), "{code}");
        }
        for code in ["19", "2067", "1"] {
            assert!(!sqlite_unavailable(code), "{code}");
        }
        let down = QueryError::from(sqlx::Error::PoolTimedOut);
        assert_eq!(down.code(), ErrorCode::Unavailable);
        assert!(
            down.to_string().starts_with("database unavailable: "),
            "{down}"
        );
        let bug = QueryError::from(sqlx::Error::RowNotFound);
        assert_eq!(bug.code(), ErrorCode::Internal);
        assert!(bug.to_string().starts_with("database error: "), "{bug}");
    }
}
