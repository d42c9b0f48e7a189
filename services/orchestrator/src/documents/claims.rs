//! The claims of chunk `seq`s (docs/documents.md, "Limits and errors", `conflict`): subjects
//! `$O.<bucket>.C.claim.<upload_id>.<seq>` in the bucket's stream.
//!
//! # Invariants
//! - A chunk `seq` of an upload is taken once, across replicas and racing requests: each later
//!   chunk first claims its `seq` ([`Documents::claim`], a JetStream publish expecting an empty
//!   subject); a second claim is `conflict`.
//! - The claims go with their upload ([`Documents::drop_claims`]); a claim whose chunk was not
//!   taken is purged so the chunk may be sent again.

use super::{BUCKET, Documents, unavailable};
use async_nats::jetstream;
use cyrene_protocol::{ErrorBody, ErrorCode};

/// The subject of the claim of chunk `seq` of an upload (in the bucket's stream, beside the
/// object store's own chunk subjects `$O.<bucket>.C.<nuid>`, which never hold a dot).
pub(super) fn claim_subject(upload_id: &str, seq: u32) -> String {
    format!("$O.{BUCKET}.C.claim.{upload_id}.{seq}")
}

impl Documents {
    /// Claims chunk `seq` of an upload, once across every replica: a publish to its claim
    /// subject that JetStream accepts only while the subject is empty. Of two requests with the
    /// same `seq` racing past the `info` check, one goes on and the other is `conflict`.
    pub(super) async fn claim(&self, upload_id: &str, seq: u32) -> Result<(), ErrorBody> {
        let publish = jetstream::message::PublishMessage::build().expected_last_subject_sequence(0);
        let conflict = || {
            ErrorBody::new(
                ErrorCode::Conflict,
                format!("chunk {seq} of this upload was already received"),
            )
        };
        let sent = self
            .js
            .send_publish(claim_subject(upload_id, seq), publish)
            .await;
        let acked = match sent {
            Ok(ack) => ack.await,
            Err(err) => Err(err),
        };
        match acked {
            Ok(_) => Ok(()),
            Err(err) if err.kind() == jetstream::context::PublishErrorKind::WrongLastSequence => {
                Err(conflict())
            }
            Err(err) => Err(unavailable("cannot claim the chunk", err)),
        }
    }

    /// Purges the claims of an upload (best effort: a claim left behind is a few bytes).
    pub(super) async fn drop_claims(&self, upload_id: &str) {
        let all = format!("$O.{BUCKET}.C.claim.{upload_id}.>");
        self.purge_claims(upload_id, &all).await;
    }

    /// Purges the claims on `filter`, a claim subject or pattern of `upload_id` (best effort).
    pub(super) async fn purge_claims(&self, upload_id: &str, filter: &str) {
        let purged = match self.js.get_stream(format!("OBJ_{BUCKET}")).await {
            Ok(stream) => stream
                .purge()
                .filter(filter)
                .await
                .map(drop)
                .map_err(async_nats::Error::from),
            Err(err) => Err(err.into()),
        };
        if let Err(err) = purged {
            tracing::debug!(error = %err, upload_id, "cannot purge an upload's chunk claims");
        }
    }
}
