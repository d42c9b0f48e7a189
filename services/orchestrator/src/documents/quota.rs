//! What each owner stores, as this replica counts it, and the quota checks every chunk passes
//! (docs/documents.md, "Limits and errors", **Quotas**).
//!
//! # Invariants
//! - Every chunk is checked first against the store's total (`store_bytes`) and against its
//!   owner's quota (`owner_bytes`; the owner is the session's person, and sessions of nobody in
//!   particular count as one owner): `too_large` over either ([`Documents::reserve`]).
//! - Bytes reserved for what is then not stored, or deleted, are given back
//!   ([`Documents::release`]); the sweep (`sweep`) replaces the counts with what the bucket holds.
//!
//! # Pitfalls
//! - Quotas are counted per replica between sweeps: what a replica stored since the last sweep
//!   is added to the sweep's count, so each replica may let an owner pass the quota by what it
//!   stores in one sweep interval, at most; the bucket's `max_bytes` is exact.

use super::Documents;
use cyrene_protocol::ids;
use cyrene_protocol::{ErrorBody, ErrorCode};
use std::collections::HashMap;

/// What each owner stores: the last sweep's count plus what this replica stored (or removed)
/// since.
#[derive(Debug, Default)]
pub(super) struct Usage {
    pub(super) counted: HashMap<String, u64>,
    pub(super) counted_total: u64,
    pub(super) since: HashMap<String, i64>,
    pub(super) since_total: i64,
}

impl Usage {
    fn of(&self, owner: &str) -> u64 {
        let counted = self.counted.get(owner).copied().unwrap_or(0);
        add_signed(counted, self.since.get(owner).copied().unwrap_or(0))
    }

    pub(super) fn total(&self) -> u64 {
        add_signed(self.counted_total, self.since_total)
    }

    pub(super) fn add(&mut self, owner: &str, bytes: i64) {
        *self.since.entry(owner.to_owned()).or_default() += bytes;
        self.since_total += bytes;
    }
}

fn add_signed(base: u64, delta: i64) -> u64 {
    if delta >= 0 {
        base.saturating_add(delta.unsigned_abs())
    } else {
        base.saturating_sub(delta.unsigned_abs())
    }
}

pub(super) fn signed(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The owner a session's documents count against: its person, or `""` for sessions of nobody in
/// particular.
pub(super) fn owner_of(session_id: &str) -> String {
    ids::session_person(session_id)
        .unwrap_or_default()
        .to_owned()
}

impl Documents {
    pub(super) fn usage(&self) -> std::sync::MutexGuard<'_, Usage> {
        // Every operation leaves the counts consistent: a poisoned lock is still usable.
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes `session_id`'s owner stores, as this replica counts them.
    pub fn stored_by(&self, session_id: &str) -> u64 {
        self.usage().of(&owner_of(session_id))
    }

    /// Takes `bytes` more for `session_id`'s owner, or says which quota they would pass.
    pub(super) fn reserve(&self, session_id: &str, bytes: u64) -> Result<(), ErrorBody> {
        let owner = owner_of(session_id);
        let mut usage = self.usage();
        let (mine, all) = (usage.of(&owner), usage.total());
        let over = if all.saturating_add(bytes) > self.limits.store_bytes {
            Some(format!(
                "the document store is full ({all} of {} bytes)",
                self.limits.store_bytes
            ))
        } else if mine.saturating_add(bytes) > self.limits.owner_bytes {
            Some(format!(
                "this session's owner stores {mine} bytes of documents; the quota is {}",
                self.limits.owner_bytes
            ))
        } else {
            None
        };
        if let Some(why) = over {
            return Err(ErrorBody::new(
                ErrorCode::TooLarge,
                format!("{why}; the upload is dropped"),
            ));
        }
        usage.add(&owner, signed(bytes));
        Ok(())
    }

    /// Gives back `bytes` of `session_id`'s owner (deleted, or never stored).
    pub(super) fn release(&self, session_id: &str, bytes: u64) {
        self.usage().add(&owner_of(session_id), -signed(bytes));
    }
}
