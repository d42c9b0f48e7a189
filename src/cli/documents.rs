//! Uploading a file as a document (`cyrene send --file`, `/attach` in `cyrene chat`): the
//! client side of `cyrene.document.upload` (docs/documents.md).

use super::CliError;
use super::request_error;
use async_nats::Client;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_bus::request_json;
use cyrene_protocol::document::{
    DOCUMENT_UPLOAD, DocumentInfo, MAX_CHUNK_BYTES, UploadAck, UploadRequest,
};
use std::path::Path;
use std::time::Duration;

/// Uploads the file at `path` into `session`, chunk by chunk, and returns the stored document
/// (its `part` goes into a message). The server sniffs the type and sanitises the name; the
/// file name is sent only as a hint.
pub async fn upload_file(
    client: &Client,
    session: &str,
    path: &Path,
    timeout: Duration,
) -> Result<DocumentInfo, CliError> {
    let bytes = tokio::fs::read(path)
        .await
        .map_err(|e| CliError::Failed(format!("{}: {e}", path.display())))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut chunks = bytes.chunks(MAX_CHUNK_BYTES).peekable();
    if chunks.peek().is_none() {
        return Err(CliError::Failed(format!(
            "{}: the file is empty",
            path.display()
        )));
    }
    let mut upload_id = String::new();
    let mut seq = 0;
    while let Some(chunk) = chunks.next() {
        let last = chunks.peek().is_none();
        let request = UploadRequest {
            session_id: session.to_owned(),
            name: if seq == 0 {
                name.clone()
            } else {
                String::new()
            },
            mime: String::new(),
            upload_id: upload_id.clone(),
            seq,
            data: BASE64.encode(chunk),
            last,
        };
        let ack: UploadAck = request_json(client, DOCUMENT_UPLOAD, &request, timeout)
            .await
            .map_err(request_error)?;
        if last {
            return ack.document.ok_or_else(|| {
                CliError::Failed("the last chunk was acknowledged without a document".into())
            });
        }
        upload_id = ack.upload_id;
        seq += 1;
    }
    Err(CliError::Failed("nothing was uploaded".into()))
}
