//! The poison-document rule (docs/loop-worker.md, "Poison documents"): PDF extraction is the
//! one place where a client's bytes drive in-process work, so each one is recorded in the
//! JetStream key-value bucket [`BUCKET`] before it starts and cleared when it ends. A start
//! that never ended is a worker that died extracting. A document with
//! [`Config::poison_after`](crate::Config::poison_after) such starts is not extracted again —
//! by any turn, on any worker — and reads as "could not extract" (the manifest line), so the
//! job that carried it completes instead of killing worker after worker until JetStream gives
//! it up (`max_deliver`).
//!
//! # Invariants
//! - The start is durable (acknowledged by JetStream) before the extraction begins: a crash at
//!   any line after it leaves the count raised. The end is best effort: a lost end counts one
//!   start too many, which only brings the rule nearer.
//! - Keyed by document name (`d-…`, server-issued and unique), not by turn: a poison document
//!   stays in the session's window, and every later turn that shows it would otherwise crash
//!   again.
//! - Unfinished starts are at-least-once counted, never lost while the bucket answers; when
//!   the bucket does not answer the extraction runs anyway (the budgets of crate::pdf still
//!   bound it) — availability over the backstop.
//!
//! # Pitfalls
//! - Two turns extracting the same document at once share one count (read, then write: a
//!   concurrent start can be counted once); the first to end clears it for both.
//! - An extraction that was running when its worker died for another reason (another turn's
//!   fault, a `kill -9`) counts too: the rule needs `poison_after` of them.

use async_nats::jetstream::{self, kv};
use std::time::Duration;

/// The key-value bucket of extractions in progress (stream `KV_CYRENE_EXTRACTIONS`).
pub const BUCKET: &str = "CYRENE_EXTRACTIONS";

/// How long a record is kept: a document found poison stays refused this long.
pub const KEEP: Duration = Duration::from_secs(30 * 24 * 3600);

/// The record of extractions in progress.
#[derive(Debug, Clone)]
pub struct Extractions {
    store: kv::Store,
    poison_after: u32,
}

/// What [`Extractions::start`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// Recorded (or the record did not answer): extract, then call [`Extractions::end`].
    Go,
    /// This many earlier starts never ended: do not extract.
    Poison(u32),
}

impl Extractions {
    /// Creates (or opens) the bucket with `replicas` replicas.
    pub async fn open(
        js: &jetstream::Context,
        replicas: usize,
        poison_after: u32,
    ) -> Result<Extractions, String> {
        let config = kv::Config {
            bucket: BUCKET.to_owned(),
            description: "Cyrene PDF extractions in progress (docs/loop-worker.md)".to_owned(),
            history: 1,
            max_age: KEEP,
            num_replicas: replicas,
            ..Default::default()
        };
        let store = match js.create_key_value(config).await {
            Ok(store) => store,
            // Made by another worker with other settings (e.g. replicas): use it as it is.
            Err(create) => js
                .get_key_value(BUCKET)
                .await
                .map_err(|err| format!("{create}; {err}"))?,
        };
        Ok(Extractions {
            store,
            poison_after,
        })
    }

    /// Records that document `name` is about to be extracted, unless it is poison.
    pub async fn start(&self, name: &str) -> Start {
        let earlier = match self.store.get(name).await {
            Ok(value) => value
                .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u32>().ok())
                .unwrap_or(0),
            Err(err) => {
                tracing::warn!(document = name, error = %err, "extraction record unreadable; extracting anyway");
                return Start::Go;
            }
        };
        if earlier >= self.poison_after {
            return Start::Poison(earlier);
        }
        let next = (earlier + 1).to_string();
        if let Err(err) = self.store.put(name, next.into()).await {
            tracing::warn!(document = name, error = %err, "extraction start not recorded; extracting anyway");
        }
        Start::Go
    }

    /// Records that the extraction of `name` ended (the worker survived it).
    pub async fn end(&self, name: &str) {
        if let Err(err) = self.store.delete(name).await {
            tracing::warn!(document = name, error = %err, "extraction end not recorded");
        }
    }
}
