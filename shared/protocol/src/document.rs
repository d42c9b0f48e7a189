//! Documents: bytes uploaded over the bus into the orchestrator's object store, referenced from
//! user messages as `document` parts, read back by the loop worker (docs/documents.md).
//!
//! # Invariants
//! - Only the server issues a reference: the `document` part of an [`UploadAck`] (name `d-…`,
//!   url `cyrene-doc://d-…`, MIME sniffed from the bytes, size counted) is the only way to get
//!   one; a client's file name and type claim are never the storage name or the MIME type.
//! - A reference belongs to the session it was uploaded in; any other session is `forbidden`.
//! - Bytes travel as standard base64 in `data`, one chunk per request, so every request and
//!   reply fits `max_payload`.

use crate::message::Part;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// Upload one chunk (micro endpoint `upload` of `cyrene-orchestrator`).
pub const DOCUMENT_UPLOAD: &str = "cyrene.document.upload";
/// Read a stored document's bytes, a chunk at a time (micro endpoint `read`).
pub const DOCUMENT_READ: &str = "cyrene.document.read";

/// The scheme of every server-issued document URL.
pub const URL_SCHEME: &str = "cyrene-doc://";
/// The prefix of every server-issued document name.
pub const NAME_PREFIX: &str = "d-";
/// The largest chunk of one upload request or read reply, in bytes before base64 (base64 of
/// this plus the JSON envelope stays under the NATS default `max_payload` of 1 MiB).
pub const MAX_CHUNK_BYTES: usize = 512 * 1024;

/// One chunk of an upload. The first chunk has no `upload_id` (the reply issues one); every
/// later chunk carries it and the next `seq`; the chunk with `last: true` finishes the upload.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadRequest {
    pub session_id: String,
    /// The client's file name (first chunk): kept only in sanitised form as the title; it
    /// never names the stored object and only refines the type of text content (`.md`, `.csv`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// The client's claim of the type: logged, never trusted.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub mime: String,
    /// Empty on the first chunk; the `upload_id` of the first reply afterwards.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub upload_id: String,
    /// 0 for the first chunk, then 1, 2, … without gaps.
    #[serde(default)]
    pub seq: u32,
    /// The chunk's bytes, standard base64.
    #[serde(default)]
    pub data: String,
    /// This chunk is the last one: the document is stored and its reference issued.
    #[serde(default)]
    pub last: bool,
}

/// The reply to one chunk.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadAck {
    pub upload_id: String,
    /// The chunk just accepted.
    pub seq: u32,
    /// Bytes received so far, this chunk included.
    pub received: u64,
    /// On the last chunk: the finished document.
    pub document: Option<DocumentInfo>,
}

/// A stored document: the `document` part to put in a message, and its sanitised title.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocumentInfo {
    /// `{"type":"document","name":"d-…","mime":"…","url":"cyrene-doc://d-…","size":…}`.
    pub part: Part,
    /// The client's file name, sanitised (one line, no brackets, bounded); may be empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub title: String,
}

/// Read up to `max_bytes` of a stored document from `offset`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadRequest {
    /// The session the reference is used in: a document of another session is `forbidden`.
    pub session_id: String,
    /// `cyrene-doc://d-…`.
    pub url: String,
    #[serde(default)]
    pub offset: u64,
    /// 0 = the server's chunk size; larger values are capped to it.
    #[serde(default)]
    pub max_bytes: u32,
}

/// One chunk of a stored document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadResponse {
    pub name: String,
    pub mime: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub title: String,
    pub offset: u64,
    /// Standard base64 of the bytes from `offset`.
    pub data: String,
    /// Whether this chunk reaches the end of the document.
    pub eof: bool,
}

/// The document name in a `cyrene-doc://` URL, when the URL has that shape (`d-` then
/// `[A-Za-z0-9-]`, at most 64 characters); anything else is not a server-issued reference.
pub fn name_of_url(url: &str) -> Option<&str> {
    let name = url.strip_prefix(URL_SCHEME)?;
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let ok = !rest.is_empty()
        && name.len() <= 64
        && rest.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
    ok.then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_server_shaped_urls_name_a_document() {
        assert_eq!(name_of_url("cyrene-doc://d-0190abcd"), Some("d-0190abcd"));
        for bad in [
            "https://example.com/d-1",
            "cyrene-doc://",
            "cyrene-doc://d-",
            "cyrene-doc://x-1",
            "cyrene-doc://d-1/../../etc",
            "cyrene-doc://d-1.pdf",
            "cyrene-doc://d-1 2",
        ] {
            assert_eq!(name_of_url(bad), None, "{bad}");
        }
        let long = format!("cyrene-doc://d-{}", "a".repeat(80));
        assert_eq!(name_of_url(&long), None);
    }

    #[test]
    fn upload_ack_carries_a_document_part() {
        let ack = UploadAck {
            upload_id: "u-1".into(),
            seq: 0,
            received: 3,
            document: Some(DocumentInfo {
                part: Part::Document {
                    name: "d-1".into(),
                    mime: "text/plain".into(),
                    url: "cyrene-doc://d-1".into(),
                    size: 3,
                },
                title: "a.txt".into(),
            }),
        };
        let json = serde_json::to_value(&ack).unwrap();
        assert_eq!(json["document"]["part"]["type"], "document");
        assert_eq!(json["document"]["part"]["url"], "cyrene-doc://d-1");
    }
}
