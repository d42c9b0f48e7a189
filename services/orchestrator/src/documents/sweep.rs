//! The periodic sweep (docs/documents.md, "Limits and errors", **The sweep**): the staged
//! chunks of abandoned uploads deleted, with their claims, and what each owner stores recounted.
//!
//! # Invariants
//! - [`Documents::sweep`] (every replica, periodically) deletes the staged chunks of uploads
//!   abandoned for `upload_ttl` and recounts what each owner stores. Deleting a chunk twice is
//!   harmless, so replicas need not agree on who sweeps.
//! - What this replica stored while the bucket was listed stays counted on top of the new count
//!   (maybe twice, until the next sweep), so a sweep never forgets a chunk stored meanwhile.

use super::quota::owner_of;
use super::{BucketError, Documents, META_SESSION, META_STAGED_AT, STAGED_PREFIX, unix_ms};
use futures::StreamExt;
use std::collections::HashMap;
use std::time::SystemTime;

/// What one [`Documents::sweep`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Staged chunks of abandoned uploads deleted.
    pub deleted: usize,
    /// Bytes stored afterwards, in all.
    pub stored: u64,
}

impl Documents {
    /// Deletes the staged chunks of uploads last touched before `now - upload_ttl` and recounts
    /// what every owner stores. Each replica sweeps; deleting a chunk twice is harmless.
    pub async fn sweep(&self, now: SystemTime) -> Result<SweepReport, BucketError> {
        let cutoff = unix_ms(now)
            .saturating_sub(u64::try_from(self.limits.upload_ttl.as_millis()).unwrap_or(u64::MAX));
        let (since, since_total) = {
            let usage = self.usage();
            (usage.since.clone(), usage.since_total)
        };
        let mut list = self
            .bucket
            .list()
            .await
            .map_err(BucketError::of("cannot list the document bucket"))?;
        let (mut counted, mut total, mut stale) = (HashMap::<String, u64>::new(), 0u64, Vec::new());
        while let Some(info) = list.next().await {
            let info = info.map_err(BucketError::of("cannot list the document bucket"))?;
            if info.deleted {
                continue;
            }
            if info.name.starts_with(STAGED_PREFIX) {
                let staged_at = info
                    .metadata
                    .get(META_STAGED_AT)
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                if staged_at < cutoff {
                    stale.push(info.name);
                    continue;
                }
            }
            let owner = owner_of(info.metadata.get(META_SESSION).map_or("", String::as_str));
            *counted.entry(owner).or_default() += info.size as u64;
            total += info.size as u64;
        }
        let mut deleted = 0;
        let mut uploads = std::collections::BTreeSet::new();
        for name in stale {
            match self.bucket.delete(&name).await {
                Ok(()) => deleted += 1,
                Err(err) => tracing::debug!(error = %err, %name, "cannot sweep a staged chunk"),
            }
            if let Some(id) = name
                .strip_prefix(STAGED_PREFIX)
                .and_then(|r| r.split('/').next())
            {
                uploads.insert(id.to_owned());
            }
        }
        for upload_id in uploads {
            self.drop_claims(&upload_id).await;
        }
        let mut usage = self.usage();
        usage.counted = counted;
        usage.counted_total = total;
        // What was stored during the listing stays counted (maybe twice, until the next sweep).
        for (owner, bytes) in since {
            if let Some(now) = usage.since.get_mut(&owner) {
                *now -= bytes;
            }
        }
        usage.since.retain(|_, bytes| *bytes != 0);
        usage.since_total -= since_total;
        if deleted > 0 {
            tracing::info!(deleted, "swept the staged chunks of abandoned uploads");
        }
        Ok(SweepReport {
            deleted,
            stored: usage.total(),
        })
    }
}
