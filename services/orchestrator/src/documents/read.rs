//! Reading documents, `cyrene.document.read` (docs/documents.md, "Read"), and binding the
//! `document` parts of a sent message to the stored documents (docs/documents.md, "The rules").
//!
//! # Invariants
//! - Nothing is ever fetched from a URL: a reference that is not `cyrene-doc://d-…` is
//!   `bad_request`.
//! - A document is read or bound only in the session it was uploaded in; in any other session
//!   it is `forbidden`.
//! - The stored facts win: [`Documents::bind`] replaces a part's name, MIME type and size by
//!   the stored ones. A read returns at most [`MAX_CHUNK_BYTES`].

use super::{
    Documents, MAX_CHUNK_BYTES, META_MIME, META_SESSION, META_TITLE, bad, is_not_found, unavailable,
};
use async_nats::jetstream::object_store;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_protocol::document::{self, ReadRequest, ReadResponse};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::message::{Message, Part};
use cyrene_protocol::{ErrorBody, ErrorCode};
use tokio::io::AsyncReadExt;

impl Documents {
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
