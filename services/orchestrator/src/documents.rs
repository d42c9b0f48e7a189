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
//! - An upload never exceeds `max_bytes` (`too_large`, the partial upload is dropped) and no
//!   chunk exceeds [`MAX_CHUNK_BYTES`], so every request and reply fits `max_payload`.
//! - State lives only in the bucket (staged chunks are objects `upload/<id>/<seq>` whose
//!   metadata carries session, title and running total), so any replica can take any chunk.
//!
//! # Pitfalls
//! - An upload that never sends its last chunk leaves its staged chunks in the bucket; nothing
//!   sweeps them yet (docs/documents.md, "Limits").

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
use std::collections::HashMap;
use tokio::io::AsyncReadExt;

/// The object store bucket (stream `OBJ_CYRENE_DOCUMENTS`).
pub const BUCKET: &str = "CYRENE_DOCUMENTS";
pub use cyrene_protocol::document::MAX_CHUNK_BYTES;
/// Default largest document.
pub const DEFAULT_MAX_DOCUMENT_BYTES: u64 = 8 * 1024 * 1024;

const META_SESSION: &str = "cyrene-session";
const META_TITLE: &str = "cyrene-title";
const META_MIME: &str = "cyrene-mime";
const META_TOTAL: &str = "cyrene-total";
const UPLOAD_PREFIX: &str = "u-";

/// The document store: one object store bucket and its limits.
#[derive(Clone)]
pub struct Documents {
    bucket: object_store::ObjectStore,
    max_bytes: u64,
}

impl std::fmt::Debug for Documents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Documents")
            .field("bucket", &BUCKET)
            .field("max_bytes", &self.max_bytes)
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
    /// turns stream).
    pub async fn open(
        js: &jetstream::Context,
        replicas: usize,
        max_bytes: u64,
    ) -> Result<Documents, String> {
        let bucket = match js.get_object_store(BUCKET).await {
            Ok(bucket) => bucket,
            Err(_) => js
                .create_object_store(object_store::Config {
                    bucket: BUCKET.to_owned(),
                    description: Some("Cyrene documents (docs/documents.md)".to_owned()),
                    num_replicas: replicas,
                    ..Default::default()
                })
                .await
                .map_err(|e| format!("cannot create the document bucket: {e}"))?,
        };
        Ok(Documents { bucket, max_bytes })
    }

    /// The largest document accepted.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
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
                self.max_bytes
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
        if total > self.max_bytes {
            return Err(self.too_large());
        }
        let upload_id = format!("{UPLOAD_PREFIX}{}", ids::new_id());
        let title = title(&req.name);
        if req.last {
            let document = self.finish(&req.session_id, &title, data).await?;
            return Ok(UploadAck {
                upload_id,
                seq: 0,
                received: total,
                document: Some(document),
            });
        }
        self.stage(upload_id, 0, &req.session_id, title, total, &data)
            .await
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
        let total = meta(META_TOTAL).parse::<u64>().unwrap_or(u64::MAX) + data.len() as u64;
        if total > self.max_bytes {
            self.drop_upload(&req.upload_id, req.seq).await;
            return Err(self.too_large());
        }
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
                return Err(ErrorBody::new(
                    ErrorCode::Conflict,
                    "the staged chunks changed during the upload; upload again",
                ));
            }
            let document = self.finish(&req.session_id, &title, all).await?;
            self.drop_upload(&req.upload_id, req.seq).await;
            return Ok(UploadAck {
                upload_id: req.upload_id,
                seq: req.seq,
                received: total,
                document: Some(document),
            });
        }
        self.stage(req.upload_id, req.seq, &req.session_id, title, total, &data)
            .await
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

    /// Deletes the staged chunks `0..upto` of an upload (best effort).
    async fn drop_upload(&self, upload_id: &str, upto: u32) {
        for seq in 0..upto {
            if let Err(err) = self.bucket.delete(chunk_name(upload_id, seq)).await {
                tracing::debug!(error = %err, upload_id, seq, "cannot delete a staged chunk");
            }
        }
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

    /// Stores a whole document under a fresh server name and issues its reference.
    async fn finish(
        &self,
        session_id: &str,
        title: &str,
        bytes: Vec<u8>,
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
        self.put(&name, metadata, &bytes).await?;
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
