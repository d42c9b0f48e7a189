//! The document service (docs/documents.md): uploads over the bus into the JetStream object
//! store bucket [`BUCKET`], server-issued `cyrene-doc://` references, byte-sniffed MIME types,
//! and the reads the loop worker resolves references with.
//!
//! Endpoints (micro service `cyrene-orchestrator`): `upload` on `cyrene.document.upload`
//! (`UploadRequest` → `UploadAck`) and `read` on `cyrene.document.read` (`ReadRequest` →
//! `ReadResponse`).
//!
//! # Invariants
//! - The server names every stored document (`d-<uuid>`); the client's file name is kept only
//!   as a [`title`] (basename, [`display_name`] rules) in the object's metadata.
//! - The MIME type is [`sniff`]ed from the bytes; the client's claim is ignored.
//! - Every document records the session it was uploaded in; `read` and `send` refuse it in any
//!   other session with `forbidden`.
//! - Nothing is ever fetched from a URL: a reference that is not `cyrene-doc://d-…` is
//!   `bad_request`.
//! - An upload never exceeds `max_document_bytes` (`too_large`, the partial upload is dropped)
//!   and no chunk exceeds [`MAX_CHUNK_BYTES`] decoded, so every request and reply fits
//!   `max_payload`.
//! - State lives only in the bucket (staged chunks are objects `upload/<id>/<seq>` whose
//!   metadata carries session, title, running total and when it was staged), so any replica can
//!   take any chunk.
//! - The store is bounded ([`DocumentLimits`]): the bucket's JetStream `max_bytes` is
//!   `store_bytes` (JetStream reserves it and refuses writes past it, so documents never take
//!   the room the turn queue shares), and every chunk is checked first against the total and
//!   against its owner's quota (`owner_bytes`; the owner is the session's person, and sessions
//!   of nobody in particular count as one owner): `too_large` over either.
//! - [`Documents::sweep`] (every replica, periodically) deletes the staged chunks of uploads
//!   abandoned for `upload_ttl` and recounts what each owner stores.
//! - A chunk `seq` of an upload is taken once, across replicas and racing requests: each later
//!   chunk first claims its `seq` ([`Documents::claim`], a JetStream publish expecting an empty
//!   subject); a second claim is `conflict`. The claims go with their upload.
//!
//! # Pitfalls
//! - Quotas are counted per replica between sweeps: what a replica stored since the last sweep
//!   is added to the sweep's count, so each replica may let an owner pass the quota by what it
//!   stores in one sweep interval, at most; the bucket's `max_bytes` is exact.

use async_nats::jetstream::{self, object_store};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_protocol::document::{
    self, DocumentInfo, ReadRequest, ReadResponse, UploadAck, UploadRequest,
};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::message::{Message, Part};
use cyrene_protocol::names::display_name;
use cyrene_protocol::{ErrorBody, ErrorCode};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::AsyncReadExt;

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

/// The subject of the claim of chunk `seq` of an upload (in the bucket's stream, beside the
/// object store's own chunk subjects `$O.<bucket>.C.<nuid>`, which never hold a dot).
fn claim_subject(upload_id: &str, seq: u32) -> String {
    format!("$O.{BUCKET}.C.claim.{upload_id}.{seq}")
}
const UPLOAD_PREFIX: &str = "u-";

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

/// What each owner stores: the last sweep's count plus what this replica stored (or removed)
/// since.
#[derive(Debug, Default)]
struct Usage {
    counted: HashMap<String, u64>,
    counted_total: u64,
    since: HashMap<String, i64>,
    since_total: i64,
}

impl Usage {
    fn of(&self, owner: &str) -> u64 {
        let counted = self.counted.get(owner).copied().unwrap_or(0);
        add_signed(counted, self.since.get(owner).copied().unwrap_or(0))
    }

    fn total(&self) -> u64 {
        add_signed(self.counted_total, self.since_total)
    }

    fn add(&mut self, owner: &str, bytes: i64) {
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

fn signed(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The owner a session's documents count against: its person, or `""` for sessions of nobody in
/// particular.
fn owner_of(session_id: &str) -> String {
    ids::session_person(session_id)
        .unwrap_or_default()
        .to_owned()
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

/// What one [`Documents::sweep`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Staged chunks of abandoned uploads deleted.
    pub deleted: usize,
    /// Bytes stored afterwards, in all.
    pub stored: u64,
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

/// The client's file name as kept: its last path segment under the [`display_name`] rules.
pub fn title(raw: &str) -> String {
    let base = raw.rsplit(['/', '\\']).next().unwrap_or_default();
    display_name(base)
}

/// The MIME type of `bytes`, from the bytes alone; `title` (already sanitised) only tells the
/// text formats apart (`.md` → `text/markdown`, `.csv` → `text/csv`).
///
/// 1. a magic number known to `infer` (PDF, images, archives, executables, …) decides;
/// 2. otherwise UTF-8 text without control characters (tab, line breaks and form feed aside)
///    is text: `application/json` when it parses as JSON, else by extension, else `text/plain`;
/// 3. anything else is `application/octet-stream`.
pub fn sniff(bytes: &[u8], title: &str) -> String {
    if let Some(kind) = infer::get(bytes) {
        return kind.mime_type().to_owned();
    }
    let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(bytes);
    let Ok(text) = std::str::from_utf8(body) else {
        return "application/octet-stream".to_owned();
    };
    let printable = text
        .chars()
        .all(|c| !c.is_control() || matches!(c, '\t' | '\n' | '\r' | '\u{c}'));
    if !printable {
        return "application/octet-stream".to_owned();
    }
    if serde_json::from_str::<serde_json::Value>(text).is_ok_and(|v| v.is_object() || v.is_array())
    {
        return "application/json".to_owned();
    }
    let extension = title
        .rsplit_once('.')
        .map(|(_, ext)| ext.to_ascii_lowercase())
        .unwrap_or_default();
    match extension.as_str() {
        "md" | "markdown" => "text/markdown",
        "csv" => "text/csv",
        _ => "text/plain",
    }
    .to_owned()
}

fn chunk_name(upload_id: &str, seq: u32) -> String {
    format!("upload/{upload_id}/{seq}")
}

fn check_upload_id(id: &str) -> Result<(), ErrorBody> {
    let ok = id.strip_prefix(UPLOAD_PREFIX).is_some_and(|rest| {
        !rest.is_empty() && rest.len() <= 64 && rest.chars().all(|c| c.is_ascii_alphanumeric())
    });
    if ok {
        Ok(())
    } else {
        Err(bad("upload_id: not an id this service issued"))
    }
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

    fn usage(&self) -> std::sync::MutexGuard<'_, Usage> {
        // Every operation leaves the counts consistent: a poisoned lock is still usable.
        self.usage.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes `session_id`'s owner stores, as this replica counts them.
    pub fn stored_by(&self, session_id: &str) -> u64 {
        self.usage().of(&owner_of(session_id))
    }

    /// Takes `bytes` more for `session_id`'s owner, or says which quota they would pass.
    fn reserve(&self, session_id: &str, bytes: u64) -> Result<(), ErrorBody> {
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
    fn release(&self, session_id: &str, bytes: u64) {
        self.usage().add(&owner_of(session_id), -signed(bytes));
    }

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

    /// `cyrene.document.upload`: one chunk.
    pub async fn upload(&self, req: UploadRequest) -> Result<UploadAck, ErrorBody> {
        ids::validate(IdKind::Session, &req.session_id)
            .map_err(|e| bad(format!("session_id: {e}")))?;
        // A chunk's base64 is at most 4/3 of the chunk: refuse a larger one before decoding.
        if req.data.len() > MAX_CHUNK_BYTES.div_ceil(3) * 4 {
            return Err(ErrorBody::new(
                ErrorCode::TooLarge,
                format!("a chunk holds at most {MAX_CHUNK_BYTES} bytes"),
            ));
        }
        let data = BASE64
            .decode(req.data.as_bytes())
            .map_err(|e| bad(format!("data is not standard base64: {e}")))?;
        // Base64 of 512 KiB + 1 or + 2 bytes is no longer than a full chunk's: check the bytes.
        if data.len() > MAX_CHUNK_BYTES {
            return Err(ErrorBody::new(
                ErrorCode::TooLarge,
                format!("a chunk holds at most {MAX_CHUNK_BYTES} bytes"),
            ));
        }
        if !req.mime.is_empty() {
            tracing::debug!(claimed = %req.mime, "client MIME claim ignored (the bytes decide)");
        }
        if req.upload_id.is_empty() {
            self.first_chunk(req, data).await
        } else {
            self.next_chunk(req, data).await
        }
    }

    fn too_large(&self) -> ErrorBody {
        ErrorBody::new(
            ErrorCode::TooLarge,
            format!(
                "the document exceeds the limit of {} bytes; the upload is dropped",
                self.limits.max_document_bytes
            ),
        )
    }

    async fn first_chunk(&self, req: UploadRequest, data: Vec<u8>) -> Result<UploadAck, ErrorBody> {
        if req.seq != 0 {
            return Err(bad(
                "an upload starts with seq 0 and no upload_id; later chunks carry the upload_id",
            ));
        }
        let total = data.len() as u64;
        if total > self.limits.max_document_bytes {
            return Err(self.too_large());
        }
        self.reserve(&req.session_id, total)?;
        let upload_id = format!("{UPLOAD_PREFIX}{}", ids::new_id());
        let title = title(&req.name);
        let acked = if req.last {
            self.finish(&req.session_id, &title, data, 0)
                .await
                .map(|document| UploadAck {
                    upload_id,
                    seq: 0,
                    received: total,
                    document: Some(document),
                })
        } else {
            self.stage(upload_id, 0, &req.session_id, title, total, &data)
                .await
        };
        acked.inspect_err(|_| self.release(&req.session_id, total))
    }

    async fn next_chunk(&self, req: UploadRequest, data: Vec<u8>) -> Result<UploadAck, ErrorBody> {
        check_upload_id(&req.upload_id)?;
        if req.seq == 0 {
            return Err(bad("seq 0 starts a new upload: send it without upload_id"));
        }
        let previous = match self
            .bucket
            .info(chunk_name(&req.upload_id, req.seq - 1))
            .await
        {
            Ok(info) if !info.deleted => info,
            Ok(_) => return Err(self.missing_chunk(&req).await),
            Err(err) if is_not_found(&err) => return Err(self.missing_chunk(&req).await),
            Err(err) => return Err(unavailable("cannot read the upload", err)),
        };
        let meta = |key: &str| previous.metadata.get(key).cloned().unwrap_or_default();
        if meta(META_SESSION) != req.session_id {
            return Err(ErrorBody::new(
                ErrorCode::Forbidden,
                "this upload belongs to another session",
            ));
        }
        match self.bucket.info(chunk_name(&req.upload_id, req.seq)).await {
            Ok(info) if !info.deleted => {
                return Err(ErrorBody::new(
                    ErrorCode::Conflict,
                    format!("chunk {} of this upload was already received", req.seq),
                ));
            }
            Ok(_) => {}
            Err(err) if is_not_found(&err) => {}
            Err(err) => return Err(unavailable("cannot read the upload", err)),
        }
        self.claim(&req.upload_id, req.seq).await?;
        let (upload_id, seq) = (req.upload_id.clone(), req.seq);
        let taken = self.take_chunk(req, data, &previous.metadata).await;
        if taken.is_err() {
            // Not taken: the chunk may be sent again.
            self.purge_claims(&upload_id, &claim_subject(&upload_id, seq))
                .await;
        }
        taken
    }

    /// Stages (or, the last, finishes with) a chunk whose `seq` this request has claimed;
    /// `previous` is the metadata of the chunk before it.
    async fn take_chunk(
        &self,
        req: UploadRequest,
        data: Vec<u8>,
        previous: &HashMap<String, String>,
    ) -> Result<UploadAck, ErrorBody> {
        let meta = |key: &str| previous.get(key).cloned().unwrap_or_default();
        let staged = meta(META_TOTAL).parse::<u64>().unwrap_or(u64::MAX);
        let total = staged.saturating_add(data.len() as u64);
        if total > self.limits.max_document_bytes {
            self.drop_upload(&req.session_id, &req.upload_id, req.seq, staged)
                .await;
            return Err(self.too_large());
        }
        if let Err(err) = self.reserve(&req.session_id, data.len() as u64) {
            self.drop_upload(&req.session_id, &req.upload_id, req.seq, staged)
                .await;
            return Err(err);
        }
        let data_len = data.len() as u64;
        let title = meta(META_TITLE);
        if req.last {
            let mut all = Vec::with_capacity(usize::try_from(total).unwrap_or(0));
            for seq in 0..req.seq {
                let mut object = self
                    .bucket
                    .get(chunk_name(&req.upload_id, seq))
                    .await
                    .map_err(|e| unavailable("cannot read a staged chunk", e))?;
                object
                    .read_to_end(&mut all)
                    .await
                    .map_err(|e| unavailable("cannot read a staged chunk", e))?;
            }
            all.extend_from_slice(&data);
            if all.len() as u64 != total {
                self.release(&req.session_id, data_len);
                return Err(ErrorBody::new(
                    ErrorCode::Conflict,
                    "the staged chunks changed during the upload; upload again",
                ));
            }
            // The chunk's bytes were taken: the document itself replaces the staged chunks.
            let document = self.finish(&req.session_id, &title, all, staged).await;
            let document = document.inspect_err(|_| self.release(&req.session_id, data_len))?;
            self.drop_upload(&req.session_id, &req.upload_id, req.seq, staged)
                .await;
            return Ok(UploadAck {
                upload_id: req.upload_id,
                seq: req.seq,
                received: total,
                document: Some(document),
            });
        }
        let staged_ack = self
            .stage(req.upload_id, req.seq, &req.session_id, title, total, &data)
            .await;
        staged_ack.inspect_err(|_| self.release(&req.session_id, data_len))
    }

    /// Stages chunk `seq` of an upload that goes on, labelled with what the next chunk checks
    /// and needs (the session, the title, the bytes received so far), and acknowledges it.
    async fn stage(
        &self,
        upload_id: String,
        seq: u32,
        session_id: &str,
        title: String,
        total: u64,
        data: &[u8],
    ) -> Result<UploadAck, ErrorBody> {
        let metadata = HashMap::from([
            (META_SESSION.to_owned(), session_id.to_owned()),
            (META_TITLE.to_owned(), title),
            (META_TOTAL.to_owned(), total.to_string()),
            (
                META_STAGED_AT.to_owned(),
                unix_ms(SystemTime::now()).to_string(),
            ),
        ]);
        self.put(&chunk_name(&upload_id, seq), metadata, data)
            .await?;
        Ok(UploadAck {
            upload_id,
            seq,
            received: total,
            document: None,
        })
    }

    /// The error for a chunk whose predecessor is not staged: an unknown upload, or a gap.
    async fn missing_chunk(&self, req: &UploadRequest) -> ErrorBody {
        match self.bucket.info(chunk_name(&req.upload_id, 0)).await {
            Ok(info) if !info.deleted => bad(format!(
                "chunk {} does not follow the last chunk received; chunks go 0, 1, 2, … in order",
                req.seq
            )),
            _ => ErrorBody::new(ErrorCode::NotFound, "no such upload in progress"),
        }
    }

    /// Claims chunk `seq` of an upload, once across every replica: a publish to its claim
    /// subject that JetStream accepts only while the subject is empty. Of two requests with the
    /// same `seq` racing past the `info` check, one goes on and the other is `conflict`.
    async fn claim(&self, upload_id: &str, seq: u32) -> Result<(), ErrorBody> {
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
    async fn drop_claims(&self, upload_id: &str) {
        let all = format!("$O.{BUCKET}.C.claim.{upload_id}.>");
        self.purge_claims(upload_id, &all).await;
    }

    /// Purges the claims on `filter`, a claim subject or pattern of `upload_id` (best effort).
    async fn purge_claims(&self, upload_id: &str, filter: &str) {
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

    /// Deletes the staged chunks `0..upto` of an upload (best effort), `staged` bytes in all,
    /// and its claims, and gives the bytes back to the session's owner.
    async fn drop_upload(&self, session_id: &str, upload_id: &str, upto: u32, staged: u64) {
        for seq in 0..upto {
            if let Err(err) = self.bucket.delete(chunk_name(upload_id, seq)).await {
                tracing::debug!(error = %err, upload_id, seq, "cannot delete a staged chunk");
            }
        }
        self.drop_claims(upload_id).await;
        self.release(session_id, staged);
    }

    async fn put(
        &self,
        name: &str,
        metadata: HashMap<String, String>,
        data: &[u8],
    ) -> Result<object_store::ObjectInfo, ErrorBody> {
        let meta = object_store::ObjectMetadata {
            name: name.to_owned(),
            metadata,
            ..Default::default()
        };
        let mut reader = data;
        self.bucket
            .put(meta, &mut reader)
            .await
            .map_err(|e| unavailable("cannot store the bytes", e))
    }

    /// Stores a whole document under a fresh server name and issues its reference. `staged`
    /// bytes of it were counted already (its staged chunks, about to be dropped): the rest is
    /// taken from the owner's quota here.
    async fn finish(
        &self,
        session_id: &str,
        title: &str,
        bytes: Vec<u8>,
        staged: u64,
    ) -> Result<DocumentInfo, ErrorBody> {
        if bytes.is_empty() {
            return Err(bad("the document is empty"));
        }
        let mime = sniff(&bytes, title);
        let name = format!("{}{}", document::NAME_PREFIX, ids::new_id());
        let metadata = HashMap::from([
            (META_SESSION.to_owned(), session_id.to_owned()),
            (META_TITLE.to_owned(), title.to_owned()),
            (META_MIME.to_owned(), mime.clone()),
        ]);
        self.usage().add(&owner_of(session_id), signed(staged));
        if let Err(err) = self.put(&name, metadata, &bytes).await {
            self.release(session_id, staged);
            return Err(err);
        }
        tracing::info!(document = %name, %mime, size = bytes.len(), "document stored");
        Ok(DocumentInfo {
            part: Part::Document {
                url: format!("{}{name}", document::URL_SCHEME),
                name,
                mime,
                size: bytes.len() as u64,
            },
            title: title.to_owned(),
        })
    }

    /// The stored record behind `url`, checked to belong to `session_id`.
    async fn lookup(
        &self,
        session_id: &str,
        url: &str,
    ) -> Result<(String, object_store::ObjectInfo), ErrorBody> {
        let Some(name) = document::name_of_url(url) else {
            return Err(bad(
                "document url must be a server-issued cyrene-doc://d-… reference (no other URL is ever fetched)",
            ));
        };
        let info = match self.bucket.info(name).await {
            Ok(info) if !info.deleted => info,
            Ok(_) => return Err(ErrorBody::new(ErrorCode::NotFound, "no such document")),
            Err(err) if is_not_found(&err) => {
                return Err(ErrorBody::new(ErrorCode::NotFound, "no such document"));
            }
            Err(err) => return Err(unavailable("cannot read the document", err)),
        };
        if info.metadata.get(META_SESSION).map(String::as_str) != Some(session_id) {
            return Err(ErrorBody::new(
                ErrorCode::Forbidden,
                "this document belongs to another session",
            ));
        }
        Ok((name.to_owned(), info))
    }

    /// `cyrene.document.read`: up to one chunk of a document of the caller's session.
    pub async fn read(&self, req: ReadRequest) -> Result<ReadResponse, ErrorBody> {
        ids::validate(IdKind::Session, &req.session_id)
            .map_err(|e| bad(format!("session_id: {e}")))?;
        let (name, info) = self.lookup(&req.session_id, &req.url).await?;
        let size = info.size as u64;
        if req.offset > size {
            return Err(bad(format!(
                "offset {} is past the end ({size} bytes)",
                req.offset
            )));
        }
        let max = match req.max_bytes as usize {
            0 => MAX_CHUNK_BYTES,
            n => n.min(MAX_CHUNK_BYTES),
        } as u64;
        let end = (req.offset + max).min(size);
        let mut object = self
            .bucket
            .get(&name)
            .await
            .map_err(|e| unavailable("cannot read the document", e))?;
        let mut bytes = Vec::with_capacity(usize::try_from(end).unwrap_or(0));
        (&mut object)
            .take(end)
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| unavailable("cannot read the document", e))?;
        let start = usize::try_from(req.offset)
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        let meta = |key: &str| info.metadata.get(key).cloned().unwrap_or_default();
        Ok(ReadResponse {
            name,
            mime: meta(META_MIME),
            size,
            title: meta(META_TITLE),
            offset: req.offset,
            data: BASE64.encode(&bytes[start..]),
            eof: end == size,
        })
    }

    /// Checks every `document` part of a user message sent in `session_id` against the store
    /// and replaces its name, MIME type and size by the stored ones: a client cannot send a
    /// reference of another session (`forbidden`), an unknown one (`not_found`), or its own
    /// idea of a document's type.
    pub async fn bind(&self, session_id: &str, message: &mut Message) -> Result<(), ErrorBody> {
        for part in &mut message.content {
            let Part::Document {
                name,
                mime,
                url,
                size,
            } = part
            else {
                continue;
            };
            let (stored, info) = self.lookup(session_id, url).await?;
            *mime = info.metadata.get(META_MIME).cloned().unwrap_or_default();
            *size = info.size as u64;
            *name = stored;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bytes_decide_the_type() {
        assert_eq!(sniff(b"%PDF-1.4\n%...", "notes.txt"), "application/pdf");
        let exe = b"MZ\x90\x00\x03\x00\x00\x00\x04\x00\x00\x00\xff\xff\x00\x00";
        assert_ne!(sniff(exe, "readme.txt"), "text/plain");
        assert!(!sniff(exe, "readme.txt").starts_with("text/"));
        assert_eq!(
            sniff(b"\x00\x01\x02junk", "a.txt"),
            "application/octet-stream"
        );
        assert_eq!(sniff(b"hello\nworld\n", "a.bin"), "text/plain");
        assert_eq!(sniff(b"# Title\n\ntext", "README.md"), "text/markdown");
        assert_eq!(sniff(b"a,b\n1,2\n", "t.CSV"), "text/csv");
        assert_eq!(sniff(br#"{"a":1}"#, "x.txt"), "application/json");
        assert_eq!(sniff(b"\xEF\xBB\xBFplain", "x"), "text/plain");
        assert_eq!(sniff(b"bad \xff utf8", "x.txt"), "application/octet-stream");
        assert_eq!(sniff(b"esc \x1b[31m", "x.txt"), "application/octet-stream");
    }

    #[test]
    fn titles_are_basenames_under_the_display_name_rules() {
        assert_eq!(title("../../etc/passwd"), "passwd");
        assert_eq!(
            title("C:\\Users\\me\\report [final].pdf"),
            "report final .pdf"
        );
        assert_eq!(title("a\nb.txt"), "a b.txt");
        assert_eq!(title(""), "");
        assert!(title(&"x".repeat(500)).chars().count() <= 64);
    }

    #[test]
    fn upload_ids_must_have_the_issued_shape() {
        assert!(check_upload_id("u-0190abc").is_ok());
        for bad in ["", "u-", "x-1", "u-1/../2", "u-1.2", "u-1 2"] {
            assert!(check_upload_id(bad).is_err(), "{bad}");
        }
    }
}
