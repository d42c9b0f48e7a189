//! Uploading a file as a document (`cyrene send --file`, `/attach` in `cyrene chat`): the
//! client side of `cyrene.document.upload` (docs/documents.md).

use super::CliError;
use super::request_error;
use async_nats::Client;
use cyrene_bus::upload::upload_document;
use cyrene_protocol::document::{DOCUMENT_UPLOAD, DocumentInfo};
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
    if bytes.is_empty() {
        return Err(CliError::Failed(format!(
            "{}: the file is empty",
            path.display()
        )));
    }
    upload_document(client, DOCUMENT_UPLOAD, session, &name, "", &bytes, timeout)
        .await
        .map_err(request_error)?
        .ok_or_else(|| {
            CliError::Failed("the last chunk was acknowledged without a document".into())
        })
}
