//! What the content of a room message becomes in a session: its text, an image part (a `data:`
//! URI), a document part (a file uploaded on `cyrene.bridge.document.upload`), or a note of what
//! it was (docs/matrix-bridge.md, "Mapping": "What is passed on").
//!
//! # Invariants
//! - Media is downloaded (authenticated media) only up to its limit, declared and actual: the
//!   download is cut off past `max_image_bytes` / `max_file_bytes`; too large becomes a note.
//! - A transient failure is a [`Retry`] (the batch is read again); anything else becomes a note,
//!   never a lost message.
//! - Uploads are at least once: a crash between the upload and the send uploads the file again
//!   when the batch is read again (the first copy is then referenced by nothing).

use super::{Bridge, Retry, notices};
use crate::rooms::{self, MessageEvent};
use base64::Engine as _;
use cyrene_bus::RequestError;
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::{ErrorCode, subjects};
use ruma::OwnedMxcUri;
use ruma::api::client::authenticated_media::get_content;

impl Bridge {
    /// The user message of a room message: its text, an image part, a document part (a file,
    /// uploaded into `session_id`), or a note of what it was.
    pub(super) async fn message_of(
        &self,
        session_id: &str,
        event: &MessageEvent,
    ) -> Result<Message, Retry> {
        let content = &event.content;
        let text = |t: &str| Message::text(Role::User, t);
        Ok(match content.msgtype.as_str() {
            "m.text" | "m.notice" => text(&content.text()),
            "m.emote" => text(&format!("* {}", content.text())),
            "m.image" => match self.image(content).await? {
                Some(uri) => {
                    Message::with_parts(Role::User, vec![Part::ImageUrl { image_url: uri }])
                }
                None => text(notices::IMAGE_TOO_LARGE),
            },
            "m.file" => match self.document(session_id, content).await? {
                Ok(part) => Message::with_parts(Role::User, vec![part]),
                Err(note) => text(note),
            },
            _ => text(notices::UNSUPPORTED),
        })
    }

    /// The media of `content` (`mxc://…`, authenticated media), its bytes and type, when it is
    /// at most `max` bytes (declared and actual: the download is cut off past it). `None` when
    /// it is too large, missing or refused; a transient failure retries the batch.
    async fn download(
        &self,
        content: &rooms::MessageContent,
        max: usize,
    ) -> Result<Option<(Vec<u8>, String)>, Retry> {
        if content
            .info
            .as_ref()
            .and_then(|i| i.size)
            .is_some_and(|size| size > max as u64)
        {
            return Ok(None);
        }
        let Some(url) = content.url.clone() else {
            return Ok(None);
        };
        let mxc = OwnedMxcUri::from(url);
        let Ok((server, media_id)) = mxc.parts() else {
            return Ok(None);
        };
        let request = get_content::v1::Request::new(media_id.to_owned(), server.to_owned());
        let file = match self.hs.call_limited(request, Some(max)).await {
            Ok(file) => file,
            Err(err) if err.is_transient() => return Err(Retry(err.to_string())),
            Err(err) => {
                tracing::warn!(error = %err, "cannot download a file posted in a room");
                return Ok(None);
            }
        };
        let mime = file
            .content_type
            .clone()
            .or_else(|| content.info.as_ref().and_then(|i| i.mimetype.clone()))
            .unwrap_or_default();
        if file.file.len() > max {
            return Ok(None);
        }
        Ok(Some((file.file, mime)))
    }

    /// An image as a `data:` URI, or `None` when it is too large or not an image.
    async fn image(&self, content: &rooms::MessageContent) -> Result<Option<String>, Retry> {
        let Some((bytes, mime)) = self.download(content, self.config.max_image_bytes).await? else {
            return Ok(None);
        };
        if !mime.starts_with("image/") {
            return Ok(None);
        }
        let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
        Ok(Some(format!("data:{mime};base64,{data}")))
    }

    /// A file posted in a room, uploaded as a document of `session_id`
    /// (`cyrene.bridge.document.upload`): its `document` part, or the note of why not.
    ///
    /// At least once: a crash between the upload and the send uploads it again when the batch
    /// is read again (the first copy is then referenced by nothing).
    async fn document(
        &self,
        session_id: &str,
        content: &rooms::MessageContent,
    ) -> Result<Result<Part, &'static str>, Retry> {
        let Some((bytes, mime)) = self.download(content, self.config.max_file_bytes).await? else {
            return Ok(Err(notices::FILE_TOO_LARGE));
        };
        if bytes.is_empty() {
            return Ok(Err(notices::FILE));
        }
        let name = content
            .filename
            .clone()
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(|| content.body.clone());
        let sent = cyrene_bus::upload::upload_document(
            &self.nats,
            subjects::BRIDGE_DOCUMENT_UPLOAD,
            session_id,
            &name,
            &mime,
            &bytes,
            self.config.request_timeout,
        )
        .await;
        match sent {
            Ok(Some(document)) => Ok(Ok(document.part)),
            Ok(None) => Ok(Err(notices::FILE)),
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => {
                tracing::warn!(session = %session_id, code = %body.code, error = %body.message,
                    "the orchestrator refused a file");
                Ok(Err(if body.code == ErrorCode::TooLarge {
                    notices::FILE_TOO_LARGE
                } else {
                    notices::FILE
                }))
            }
            Err(err) => Err(Retry(format!("upload to {session_id}: {err}"))),
        }
    }
}
