//! Typed NATS client of `cyrene-checkpoint-store` (docs/architecture.md §3, §9): `save`, `latest`,
//! `get`, `list`, `retain` and `progress`, each one bounded request on `cyrene.checkpoint.*` with
//! the Cyrene error envelope decoded into a small [`Error`] enum.
//!
//! The loop worker saves after every step and must never fail a turn because of the store
//! (docs/architecture.md §5): it matches [`Error::Conflict`] (fenced off — a newer attempt owns the
//! turn) and treats everything else as a soft failure; [`Error::is_retryable`] says whether sending
//! again later may help.
//!
//! ```no_run
//! # async fn demo(nats: async_nats::Client) -> Result<(), cyrene_checkpoint_client::Error> {
//! use cyrene_checkpoint_client::CheckpointClient;
//! use std::time::Duration;
//! let store = CheckpointClient::new(nats, Duration::from_secs(2));
//! match store.latest("s1").await {
//!     Ok(cp) => println!("resume after step {}", cp.step),
//!     Err(cyrene_checkpoint_client::Error::NotFound(_)) => println!("start fresh"),
//!     Err(other) => return Err(other),
//! }
//! # Ok(()) }
//! ```

use async_nats::Client;
use cyrene_bus::{RequestError, request_json};
use cyrene_protocol::checkpoint::{
    Checkpoint, GetRequest, LatestRequest, ListRequest, ListResponse, ProgressRequest,
    ProgressResponse, RetainRequest, RetainResponse, TurnProgress,
};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Why a checkpoint request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No such checkpoint (`latest` of an owner without any, `get` of an unknown id).
    #[error("not found: {}", .0.message)]
    NotFound(ErrorBody),
    /// Fenced off: a newer attempt of the turn has already written.
    #[error("conflict: {}", .0.message)]
    Conflict(ErrorBody),
    /// The request was refused as invalid (`bad_request`) or too large (`too_large`).
    #[error("{0}")]
    Invalid(ErrorBody),
    /// The store or its database is down, or nobody serves the subject (the request's failure,
    /// kept whole).
    #[error(transparent)]
    Unavailable(RequestError),
    /// No reply within the client's timeout, or the store's own time limit ran out.
    #[error(transparent)]
    Timeout(RequestError),
    /// Anything else (an `internal` error, an undecodable reply, a transport failure).
    #[error("{0}")]
    Other(ErrorBody),
}

impl Error {
    /// The wire code this failure corresponds to.
    pub fn code(&self) -> ErrorCode {
        match self {
            Error::NotFound(_) => ErrorCode::NotFound,
            Error::Conflict(_) => ErrorCode::Conflict,
            Error::Invalid(body) | Error::Other(body) => body.code,
            Error::Unavailable(_) => ErrorCode::Unavailable,
            Error::Timeout(_) => ErrorCode::Timeout,
        }
    }

    /// Whether the same request may succeed if sent again later.
    pub fn is_retryable(&self) -> bool {
        self.code().is_retryable()
    }
}

impl From<RequestError> for Error {
    fn from(err: RequestError) -> Self {
        match err {
            RequestError::Remote(body) => match body.code {
                ErrorCode::NotFound => Error::NotFound(body),
                ErrorCode::Conflict => Error::Conflict(body),
                ErrorCode::BadRequest | ErrorCode::TooLarge => Error::Invalid(body),
                ErrorCode::Unavailable => Error::Unavailable(RequestError::Remote(body)),
                ErrorCode::Timeout => Error::Timeout(RequestError::Remote(body)),
                _ => Error::Other(body),
            },
            RequestError::Timeout { .. } => Error::Timeout(err),
            RequestError::NoResponders { .. } | RequestError::Transport { .. } => {
                Error::Unavailable(err)
            }
            other => Error::Other(other.to_body()),
        }
    }
}

/// A handle on the checkpoint store; cheap to clone.
#[derive(Debug, Clone)]
pub struct CheckpointClient {
    client: Client,
    timeout: Duration,
}

impl CheckpointClient {
    /// Every request waits at most `timeout` for its reply.
    pub fn new(client: Client, timeout: Duration) -> Self {
        CheckpointClient { client, timeout }
    }

    async fn call<Req, Resp>(&self, subject: &str, body: &Req) -> Result<Resp, Error>
    where
        Req: Serialize + ?Sized,
        Resp: DeserializeOwned,
    {
        Ok(request_json(&self.client, subject, body, self.timeout).await?)
    }

    /// Upserts `checkpoint` and returns the stored row with its timestamps. A fenced save gives
    /// `turn_id` and `attempt` and the id `{agent_id}:{turn_id}:{step}`; an unfenced one neither,
    /// and the id `{agent_id}:{step}` (`cyrene_protocol::checkpoint::checkpoint_id`).
    pub async fn save(&self, checkpoint: &Checkpoint) -> Result<Checkpoint, Error> {
        self.call(subjects::CHECKPOINT_SAVE, checkpoint).await
    }

    /// The owner's most recently written checkpoint; [`Error::NotFound`] when none.
    pub async fn latest(&self, agent_id: &str) -> Result<Checkpoint, Error> {
        let req = LatestRequest::owner(agent_id);
        self.call(subjects::CHECKPOINT_LATEST, &req).await
    }

    /// The most recently written checkpoint of one turn; [`Error::NotFound`] when it has none.
    /// With `attempt`, a fenced read: [`Error::Conflict`] when a newer attempt of the turn has
    /// already read or written, and no older attempt can write afterwards.
    pub async fn latest_of_turn(
        &self,
        agent_id: &str,
        turn_id: &str,
        attempt: Option<u32>,
    ) -> Result<Checkpoint, Error> {
        let req = LatestRequest {
            agent_id: agent_id.to_owned(),
            turn_id: Some(turn_id.to_owned()),
            attempt,
        };
        self.call(subjects::CHECKPOINT_LATEST, &req).await
    }

    /// One checkpoint by id (`{owner}:{turn_id}:{step}` or `{owner}:{step}`).
    pub async fn get(&self, id: &str) -> Result<Checkpoint, Error> {
        let req = GetRequest { id: id.to_owned() };
        self.call(subjects::CHECKPOINT_GET, &req).await
    }

    /// The owner's checkpoints, most recently written first (default 50, at most 1000).
    pub async fn list(&self, agent_id: &str, limit: Option<u32>) -> Result<Vec<Checkpoint>, Error> {
        Ok(self.list_page(agent_id, limit, None).await?.checkpoints)
    }

    /// One page of the owner's checkpoints written before the row `before` (from the newest when
    /// `None`); the reply's `next_before` continues the listing.
    pub async fn list_page(
        &self,
        agent_id: &str,
        limit: Option<u32>,
        before: Option<&str>,
    ) -> Result<ListResponse, Error> {
        let req = ListRequest {
            agent_id: agent_id.to_owned(),
            limit,
            before: before.map(str::to_owned),
        };
        self.call(subjects::CHECKPOINT_LIST, &req).await
    }

    /// How far the turns of `request` have got, in the order asked (their highest saved step,
    /// and with `tool_names` the tools they called).
    pub async fn progress(&self, request: &ProgressRequest) -> Result<Vec<TurnProgress>, Error> {
        let resp: ProgressResponse = self.call(subjects::CHECKPOINT_PROGRESS, request).await?;
        Ok(resp.turns)
    }

    /// Runs one retention operation; returns how many rows were deleted.
    pub async fn retain(&self, request: &RetainRequest) -> Result<u64, Error> {
        let resp: RetainResponse = self.call(subjects::CHECKPOINT_RETAIN, request).await?;
        Ok(resp.deleted)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_codes_map_onto_variants() {
        let remote = |code| RequestError::Remote(ErrorBody::new(code, "m"));
        assert!(matches!(
            Error::from(remote(ErrorCode::NotFound)),
            Error::NotFound(_)
        ));
        assert!(matches!(
            Error::from(remote(ErrorCode::Conflict)),
            Error::Conflict(_)
        ));
        assert!(matches!(
            Error::from(remote(ErrorCode::TooLarge)),
            Error::Invalid(_)
        ));
        let down = Error::from(remote(ErrorCode::Unavailable));
        assert!(matches!(down, Error::Unavailable(_)));
        assert!(down.is_retryable());
        let bug = Error::from(remote(ErrorCode::Internal));
        assert_eq!(bug.code(), ErrorCode::Internal);
        assert!(!bug.is_retryable());
        let none = Error::from(RequestError::NoResponders {
            subject: "cyrene.checkpoint.save".into(),
        });
        assert!(matches!(none, Error::Unavailable(_)));
        let slow = Error::from(RequestError::Timeout {
            subject: "x".into(),
            after: Duration::from_secs(1),
        });
        assert!(matches!(slow, Error::Timeout(_)));
        assert!(slow.is_retryable());
    }
}
