//! The one error type of a SQL-backed store, and the one way a store call is bounded in time.
//!
//! Both SQL services answer the same failures with the same wire codes: a caller's mistake is
//! `bad_request`/`not_found`/`conflict`/`too_large`, a database that is down or busy is
//! `unavailable` (retryable), and a bug or a corrupt row is `internal`.

use crate::{OpenError, QueryError};
use cyrene_protocol::{ErrorBody, ErrorCode};
use std::future::Future;
use std::time::Duration;

/// Why a store operation failed; each variant maps onto one wire [`ErrorCode`].
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The input is invalid (ids, fencing fields, limits).
    #[error("{0}")]
    BadRequest(String),
    /// No such row.
    #[error("{0}")]
    NotFound(String),
    /// Fenced off (a newer attempt already wrote) or too late (the turn already completed).
    #[error("{0}")]
    Conflict(String),
    /// The caller may not do this to what it names (a rule the stored row decides).
    #[error("{0}")]
    Forbidden(String),
    /// A state is over the configured limit (the checkpoint store's `max_state_bytes`).
    #[error("state is {size} bytes; the limit is {max}")]
    TooLarge { size: usize, max: usize },
    /// A query failed: `unavailable` when the database cannot be reached or is busy (retrying
    /// later may succeed), else `internal`.
    #[error(transparent)]
    Query(#[from] QueryError),
    /// Opening the database or applying the migrations failed.
    #[error("could not open the database: {0}")]
    Open(#[from] OpenError),
    /// A row that cannot be represented (a bug or a corrupt row).
    #[error("database error: {0}")]
    Internal(String),
}

impl StoreError {
    /// The wire code of this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            StoreError::BadRequest(_) => ErrorCode::BadRequest,
            StoreError::NotFound(_) => ErrorCode::NotFound,
            StoreError::Conflict(_) => ErrorCode::Conflict,
            StoreError::Forbidden(_) => ErrorCode::Forbidden,
            StoreError::TooLarge { .. } => ErrorCode::TooLarge,
            StoreError::Query(err) => err.code(),
            StoreError::Open(_) => ErrorCode::Unavailable,
            StoreError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// For `map_err`: opening the database failed while doing `what`.
    pub fn open<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        what: impl Into<String>,
    ) -> impl FnOnce(E) -> StoreError {
        let open = OpenError::while_(what);
        move |source| StoreError::Open(open(source))
    }

    /// The error envelope body sent to the caller.
    pub fn to_body(&self) -> ErrorBody {
        ErrorBody::new(self.code(), self.to_string())
    }
}

/// Classified by [`QueryError`].
impl From<sqlx::Error> for StoreError {
    fn from(err: sqlx::Error) -> Self {
        StoreError::Query(err.into())
    }
}

/// Runs a store operation within `limit`: a failure keeps its code, a timeout becomes
/// `unavailable` (a silent database never hangs a request); what an operator should see is
/// logged (`unavailable` as WARN, `internal` as ERROR).
pub async fn bounded<T>(
    limit: Duration,
    op: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, ErrorBody> {
    match tokio::time::timeout(limit, op).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => {
            let body = err.to_body();
            match body.code {
                ErrorCode::Unavailable => tracing::warn!(error = %err, "database unavailable"),
                ErrorCode::Internal => tracing::error!(error = %err, "database error"),
                _ => {}
            }
            Err(body)
        }
        Err(_) => {
            tracing::warn!(after = ?limit, "database did not answer in time");
            Err(ErrorBody::new(
                ErrorCode::Unavailable,
                format!("the database did not answer within {limit:?}"),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_silent_database_is_unavailable_and_a_failure_keeps_its_code() {
        let silent = bounded::<()>(Duration::from_millis(1), std::future::pending()).await;
        assert_eq!(silent.unwrap_err().code, ErrorCode::Unavailable);
        let refused = bounded::<()>(Duration::from_secs(1), async {
            Err(StoreError::Conflict("x".into()))
        })
        .await;
        assert_eq!(
            refused.unwrap_err(),
            ErrorBody::new(ErrorCode::Conflict, "x")
        );
        let closed = StoreError::from(sqlx::Error::PoolClosed);
        assert_eq!(closed.code(), ErrorCode::Unavailable);
    }
}
