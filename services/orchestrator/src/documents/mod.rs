//! The document service (docs/documents.md): uploads over the bus into the JetStream object
//! store bucket [`BUCKET`], server-issued `cyrene-doc://` references, byte-sniffed MIME types,
//! and the reads the loop worker resolves references with.
//!
//! Endpoints (micro service `cyrene-orchestrator`): `upload` on `cyrene.document.upload`
//! (`UploadRequest` → `UploadAck`) and `read` on `cyrene.document.read` (`ReadRequest` →
//! `ReadResponse`).
//!
//! This module owns the bucket ([`Documents::open`]), its [`DocumentLimits`] and the object
//! metadata every part reads; the parts, one concern each:
//! - `labels`: a document's title and MIME type ([`title`], [`sniff`]);
//! - `upload`: the chunked upload protocol, staging and storing documents;
//! - `claims`: the once-only claim of each chunk `seq` across replicas;
//! - `quota`: what each owner stores, and the quota checks;
//! - `sweep`: abandoned uploads deleted, the quotas recounted;
//! - `read`: reading a document and binding the references of a message to the stored ones.
//!
//! # Invariants
//! - State lives only in the bucket (staged chunks are objects `upload/<id>/<seq>` whose
//!   metadata carries session, title, running total and when it was staged), so any replica can
//!   take any chunk.
//! - The store is bounded ([`DocumentLimits`]): the bucket's JetStream `max_bytes` is
//!   `store_bytes` (JetStream reserves it and refuses writes past it, so documents never take
//!   the room the turn queue shares); [`Documents::open`] sets it on an existing bucket too.
//! - Every document records the session it was uploaded in (`META_SESSION`); `read`, `send`
//!   and an upload's later chunks refuse it in any other session with `forbidden`.

mod claims;
mod labels;
mod quota;
mod read;
mod sweep;
mod upload;

use async_nats::jetstream::{self, object_store};
use cyrene_protocol::{ErrorBody, ErrorCode};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

pub use labels::{sniff, title};
pub use sweep::SweepReport;

use quota::Usage;

/// The object store bucket (stream `OBJ_CYRENE_DOCUMENTS`).
pub const BUCKET: &str = "CYRENE_DOCUMENTS";
pub use cyrene_protocol::document::MAX_CHUNK_BYTES;
/// Default largest document.
pub const DEFAULT_MAX_DOCUMENT_BYTES: u64 = 8 * 1024 * 1024;
/// Default size of the whole document store (the bucket's `max_bytes`).
pub const DEFAULT_STORE_BYTES: u64 = 1024 * 1024 * 1024;
/// Default quota of one owner (a person, or the sessions of nobody in particular).
pub const DEFAULT_OWNER_BYTES: u64 = 128 * 1024 * 1024;
/// Default age at which an unfinished upload's staged chunks are swept.
pub const DEFAULT_UPLOAD_TTL: Duration = Duration::from_secs(3600);

const META_SESSION: &str = "cyrene-session";
const META_TITLE: &str = "cyrene-title";
const META_MIME: &str = "cyrene-mime";
const META_TOTAL: &str = "cyrene-total";
const META_STAGED_AT: &str = "cyrene-staged-at";
const STAGED_PREFIX: &str = "upload/";

/// The bounds of the document store (docs/documents.md, "Limits").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DocumentLimits {
    /// The largest document.
    pub max_document_bytes: u64,
    /// The whole store: the bucket's `max_bytes`, and the total every chunk is checked against.
    pub store_bytes: u64,
    /// What one owner (a person, or the sessions of nobody in particular) may store.
    pub owner_bytes: u64,
    /// How long an unfinished upload's staged chunks are kept.
    pub upload_ttl: Duration,
}

impl Default for DocumentLimits {
    fn default() -> Self {
        DocumentLimits {
            max_document_bytes: DEFAULT_MAX_DOCUMENT_BYTES,
            store_bytes: DEFAULT_STORE_BYTES,
            owner_bytes: DEFAULT_OWNER_BYTES,
            upload_ttl: DEFAULT_UPLOAD_TTL,
        }
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Why the document bucket could not be opened or swept: what was being done, and JetStream's
/// error.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct BucketError {
    what: &'static str,
    #[source]
    source: Box<dyn std::error::Error + Send + Sync>,
}

impl BucketError {
    /// The `map_err` of a JetStream call doing `what`.
    fn of<E: std::error::Error + Send + Sync + 'static>(
        what: &'static str,
    ) -> impl FnOnce(E) -> Self {
        move |source| BucketError {
            what,
            source: Box::new(source),
        }
    }
}

/// The document store: one object store bucket and its limits.
#[derive(Clone)]
pub struct Documents {
    bucket: object_store::ObjectStore,
    /// For the chunk claims ([`Documents::claim`]) and their purge.
    js: jetstream::Context,
    limits: DocumentLimits,
    usage: Arc<Mutex<Usage>>,
}

impl std::fmt::Debug for Documents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Documents")
            .field("bucket", &BUCKET)
            .field("limits", &self.limits)
            .finish()
    }
}

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::BadRequest, message)
}

fn unavailable(what: &str, err: impl std::fmt::Display) -> ErrorBody {
    tracing::warn!(error = %err, "document store: {what}");
    ErrorBody::new(
        ErrorCode::Unavailable,
        format!("document store unavailable: {what}"),
    )
}

fn is_not_found(err: &object_store::InfoError) -> bool {
    matches!(err.kind(), object_store::InfoErrorKind::NotFound)
}

impl Documents {
    /// Opens the bucket, creating it when missing (`replicas` copies; the same value as the
    /// turns stream) and setting its `max_bytes` to `limits.store_bytes`; then counts what is
    /// stored (a first [`Documents::sweep`]).
    pub async fn open(
        js: &jetstream::Context,
        replicas: usize,
        limits: DocumentLimits,
    ) -> Result<Documents, BucketError> {
        let max_bytes = i64::try_from(limits.store_bytes).unwrap_or(i64::MAX);
        let bucket = match js.get_object_store(BUCKET).await {
            Ok(bucket) => bucket,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: BUCKET.to_owned(),
                    description: Some("Cyrene documents (docs/documents.md)".to_owned()),
                    num_replicas: replicas,
                    max_bytes,
                    ..Default::default()
                })
                .await
                .map_err(BucketError::of("cannot create the document bucket"))?,
        };
        // A bucket made before the limit (or with another one) gets it.
        let stream_name = format!("OBJ_{BUCKET}");
        let mut stream = js
            .get_stream(&stream_name)
            .await
            .map_err(BucketError::of("cannot read the document bucket"))?;
        let info = stream
            .info()
            .await
            .map_err(BucketError::of("cannot read the document bucket"))?;
        if info.config.max_bytes != max_bytes {
            let mut config = info.config.clone();
            config.max_bytes = max_bytes;
            js.update_stream(config).await.map_err(BucketError::of(
                "cannot set the document bucket's max_bytes",
            ))?;
        }
        let documents = Documents {
            bucket,
            js: js.clone(),
            limits,
            usage: Arc::default(),
        };
        documents.sweep(SystemTime::now()).await?;
        Ok(documents)
    }

    /// The largest document accepted.
    pub fn max_bytes(&self) -> u64 {
        self.limits.max_document_bytes
    }

    /// The store's limits.
    pub fn limits(&self) -> DocumentLimits {
        self.limits
    }
}
