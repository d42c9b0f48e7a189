//! The client side of a chunked document upload (docs/documents.md): `cyrene.document.upload`
//! for a client, `cyrene.bridge.document.upload` for the bridge; the same chunks on both.
//!
//! # Invariants
//! - Every request carries at most [`MAX_CHUNK_BYTES`] of the document (base64), so it fits
//!   `max_payload`; the first has `seq` 0, no `upload_id`, and the name and type hints; each
//!   later one the `upload_id` the first reply issued and the next `seq`.
//! - The first refusal ends the upload: nothing is retried here (the server drops a partial
//!   upload after its TTL).

use crate::request::{RequestError, request_json};
use async_nats::Client;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_protocol::document::{DocumentInfo, MAX_CHUNK_BYTES, UploadAck, UploadRequest};
use std::time::Duration;

/// Uploads `bytes` as one document of `session_id` to `subject`, chunk by chunk, each request
/// waiting at most `timeout`. `name` and `mime` are hints sent with the first chunk (empty:
/// none). `Ok(None)` when there was nothing to upload or the last chunk was acknowledged
/// without a document.
pub async fn upload_document(
    client: &Client,
    subject: &str,
    session_id: &str,
    name: &str,
    mime: &str,
    bytes: &[u8],
    timeout: Duration,
) -> Result<Option<DocumentInfo>, RequestError> {
    let mut chunks = bytes.chunks(MAX_CHUNK_BYTES).peekable();
    let mut upload_id = String::new();
    let mut seq = 0;
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        let first = seq == 0;
        let request = UploadRequest {
            session_id: session_id.to_owned(),
            name: if first {
                name.to_owned()
            } else {
                String::new()
            },
            mime: if first {
                mime.to_owned()
            } else {
                String::new()
            },
            upload_id,
            seq,
            data: BASE64.encode(chunk),
            last,
        };
        let ack: UploadAck = request_json(client, subject, &request, timeout).await?;
        if last {
            return Ok(ack.document);
        }
        upload_id = ack.upload_id;
        seq += 1;
    }
    Ok(None)
}
