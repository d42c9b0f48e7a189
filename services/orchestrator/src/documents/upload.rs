//! The upload protocol, `cyrene.document.upload` (docs/documents.md, "Upload"): chunks staged
//! as objects `upload/<upload_id>/<seq>` until the last one stores the whole document under a
//! server name.
//!
//! # Invariants
//! - The server names every stored document (`d-<uuid>`) and every upload (`u-<id>`); an
//!   `upload_id` of another shape is `bad_request`.
//! - An upload never exceeds `max_document_bytes` (`too_large`, the partial upload is dropped)
//!   and no chunk exceeds [`MAX_CHUNK_BYTES`] decoded, so every request and reply fits
//!   `max_payload`.
//! - A staged chunk's metadata carries what the next chunk checks and needs (session, title,
//!   running total, when it was staged), so any replica can take the next chunk; a later chunk
//!   of another session is `forbidden`.
//! - Chunks go 0, 1, 2, … without gaps, each `seq` taken once (`claims`); every byte reserved
//!   against the quota (`quota`) is released when the chunk is not stored.

use super::claims::claim_subject;
use super::quota::{owner_of, signed};
use super::{
    Documents, MAX_CHUNK_BYTES, META_MIME, META_SESSION, META_STAGED_AT, META_TITLE, META_TOTAL,
    bad, is_not_found, sniff, title, unavailable, unix_ms,
};
use async_nats::jetstream::object_store;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_protocol::document::{self, DocumentInfo, UploadAck, UploadRequest};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::message::Part;
use cyrene_protocol::{ErrorBody, ErrorCode};
use std::collections::HashMap;
use std::time::SystemTime;
use tokio::io::AsyncReadExt;

const UPLOAD_PREFIX: &str = "u-";

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

impl Documents {
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
            // A staged chunk that cannot be read (the sweep may have taken it) gives the
            // reservation back, as every other failure here does.
            self.read_staged(&req.upload_id, req.seq, &mut all)
                .await
                .inspect_err(|_| self.release(&req.session_id, data_len))?;
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

    /// Appends the staged chunks `0..upto` of `upload_id` to `all`, in order.
    async fn read_staged(
        &self,
        upload_id: &str,
        upto: u32,
        all: &mut Vec<u8>,
    ) -> Result<(), ErrorBody> {
        for seq in 0..upto {
            let mut object = self
                .bucket
                .get(chunk_name(upload_id, seq))
                .await
                .map_err(|e| unavailable("cannot read a staged chunk", e))?;
            object
                .read_to_end(all)
                .await
                .map_err(|e| unavailable("cannot read a staged chunk", e))?;
        }
        Ok(())
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upload_ids_must_have_the_issued_shape() {
        assert!(check_upload_id("u-0190abc").is_ok());
        for bad in ["", "u-", "x-1", "u-1/../2", "u-1.2", "u-1 2"] {
            assert!(check_upload_id(bad).is_err(), "{bad}");
        }
    }
}
