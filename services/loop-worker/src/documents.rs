//! Documents in the view (docs/loop-worker.md, "Documents"): a `document` part is resolved on
//! the server side only — its `cyrene-doc://` reference read from the orchestrator's document
//! service in the turn's own session — and its text extracted, bounded, and put in place of the
//! part; a document whose text cannot be read keeps the manifest line
//! ([`crate::assemble::manifest_line`]).
//!
//! # Invariants
//! - No URL is ever fetched: only `cyrene-doc://d-…` references, read over the bus with the
//!   turn's session id (the service refuses another session's document).
//! - Text is extracted for plain text, Markdown, CSV, JSON and PDF; every other type gets the
//!   manifest line. The text is cut to [`MAX_TEXT_CHARS`] characters, with [`TRUNCATED_NOTE`].
//! - Each reference is resolved at most once per turn attempt ([`DocumentTexts`] caches it,
//!   failures included), so every step of the turn shows the same text.
//! - Extraction never takes the worker down: PDF text is read under the fixed budgets of
//!   [`crate::pdf::PdfLimits`] (bytes inflated, objects, operations, fonts), so a PDF bomb fails
//!   the same way every time, as "could not extract" (the manifest line); it runs on a blocking
//!   thread, a panic there is a failed extraction, and [`EXTRACT_TIMEOUT`] is a last backstop.
//! - A PDF whose extraction stopped workers before is not extracted again
//!   ([`crate::extractions`]: recorded before, cleared after).
//! - What replaces a document is deterministic: a read that fails for a reason that may pass
//!   (`unavailable`, `timeout`: the document service is down or slow) is tried again
//!   ([`READ_TRIES`] times in all) and, still failing, is an error of the attempt, which hands
//!   the job back ([`DocumentTexts::fill`]) — never "could not extract" for a document that is
//!   there. Only a lasting answer (`not_found`, `forbidden`, too large, an unreadable type or
//!   text) gives the manifest line, and is cached for the attempt.

use crate::assemble::{DocumentExtractor, DocumentRef};
use crate::extractions::Start;
use crate::ports::{FetchedDocument, TurnPorts};
use cyrene_protocol::ErrorBody;
use cyrene_protocol::document;
use cyrene_protocol::message::{Message, Part};
use cyrene_protocol::names::display_name;
use std::collections::HashMap;

/// The most characters of one document's text that reach the model.
pub const MAX_TEXT_CHARS: usize = 32_000;

// A PDF's extraction stops only past what the view keeps (each character at most 4 bytes).
const _: () = assert!(crate::pdf::PdfLimits::DEFAULT.max_text_bytes > MAX_TEXT_CHARS * 4);
/// The most bytes the worker reads of one document (the orchestrator's default limit).
pub const MAX_FETCH_BYTES: u64 = 8 * 1024 * 1024;
/// The longest the worker waits for one extraction (a backstop: the budgets of
/// [`crate::pdf::PdfLimits`] already bound the work; a timed-out thread finishes within them).
pub const EXTRACT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How many times a document read that failed for a passing reason is tried, in all.
pub const READ_TRIES: u32 = 3;
/// The wait before the second read; each further one waits twice as long.
pub const READ_RETRY_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Appended to a text cut at [`MAX_TEXT_CHARS`] (ours: docs/semantics.md#our-wording).
pub const TRUNCATED_NOTE: &str = "[文档过长，以上只是开头部分]";

/// Whether text is extracted for `mime`.
pub fn readable(mime: &str) -> bool {
    matches!(
        mime,
        "text/plain" | "text/markdown" | "text/csv" | "application/json" | "application/pdf"
    )
}

/// The raw text of a document, `None` when its type has no extractor or extraction fails.
pub async fn extract_text(mime: &str, bytes: Vec<u8>) -> Option<String> {
    match mime {
        "text/plain" | "text/markdown" | "text/csv" | "application/json" => {
            let body = bytes.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(&bytes);
            Some(String::from_utf8_lossy(body).into_owned())
        }
        "application/pdf" => {
            let work = tokio::task::spawn_blocking(move || pdf_text(&bytes));
            match tokio::time::timeout(EXTRACT_TIMEOUT, work).await {
                Ok(Ok(text)) => text,
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "PDF extraction panicked");
                    None
                }
                Err(_) => {
                    tracing::warn!(timeout = ?EXTRACT_TIMEOUT, "PDF extraction timed out");
                    None
                }
            }
        }
        _ => None,
    }
}

/// The text of a PDF's pages in page order, within [`crate::pdf::PdfLimits::DEFAULT`]; `None`
/// when it is not a readable PDF or goes over a budget.
pub fn pdf_text(bytes: &[u8]) -> Option<String> {
    match crate::pdf::text(bytes, &crate::pdf::PdfLimits::DEFAULT) {
        Ok(text) => Some(text),
        Err(err) => {
            tracing::info!(error = %err, "no text extracted from a PDF");
            None
        }
    }
}

/// What replaces a readable document in the view: a header line naming it, then its text cut
/// to [`MAX_TEXT_CHARS`]: `[文档] d-…「title」（mime，N 字节）：` + newline + text.
pub fn render(document: &FetchedDocument, text: &str) -> String {
    // The header is the runtime's; the document's own text never reads as a runtime note.
    let text = crate::attribution::defuse(text.trim());
    let text = text.as_ref();
    let title = display_name(&document.title);
    let label = if title.is_empty() {
        String::new()
    } else {
        format!("「{title}」")
    };
    let mut out = format!(
        "[文档] {}{label}（{}，{} 字节）：\n",
        document.name, document.mime, document.size
    );
    match text.char_indices().nth(MAX_TEXT_CHARS) {
        Some((cut, _)) => {
            out.push_str(&text[..cut]);
            out.push('\n');
            out.push_str(TRUNCATED_NOTE);
        }
        None => out.push_str(text),
    }
    out
}

/// The texts of a turn's documents, by URL; `None` = no text (the manifest line).
#[derive(Debug, Clone, Default)]
pub struct DocumentTexts {
    texts: HashMap<String, Option<String>>,
}

impl DocumentTexts {
    /// Resolves every document part of `messages` not resolved yet. `Err` when a document
    /// could not be read for a reason that may pass ([`READ_TRIES`] tries): the attempt hands
    /// its job back rather than show "could not extract" for a document that is there.
    pub async fn fill<'m, P: TurnPorts>(
        &mut self,
        ports: &P,
        session_id: &str,
        messages: impl Iterator<Item = &'m Message>,
    ) -> Result<(), ErrorBody> {
        for message in messages {
            for part in &message.content {
                let Part::Document { url, mime, .. } = part else {
                    continue;
                };
                if self.texts.contains_key(url) {
                    continue;
                }
                let text = self.resolve(ports, session_id, url, mime).await?;
                self.texts.insert(url.clone(), text);
            }
        }
        Ok(())
    }

    async fn resolve<P: TurnPorts>(
        &self,
        ports: &P,
        session_id: &str,
        url: &str,
        mime: &str,
    ) -> Result<Option<String>, ErrorBody> {
        let Some(name) = document::name_of_url(url) else {
            // Never fetched: only server-issued references are resolved.
            tracing::warn!(%url, "document part without a server-issued reference");
            return Ok(None);
        };
        if !readable(mime) {
            return Ok(None);
        }
        let mut wait = READ_RETRY_WAIT;
        let mut tries = 1;
        let fetched = loop {
            match ports.document(session_id, url).await {
                Ok(fetched) => break fetched,
                Err(err) if err.code.is_retryable() && tries < READ_TRIES => {
                    tracing::warn!(%url, error = %err, tries, "document read failed; trying again");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                    tries += 1;
                }
                Err(err) if err.code.is_retryable() => {
                    tracing::warn!(%url, error = %err, tries, "document service unreachable; the attempt hands its job back");
                    return Err(err);
                }
                Err(err) => {
                    tracing::warn!(%url, error = %err, "cannot read a document");
                    return Ok(None);
                }
            }
        };
        // The stored type decides, not the part's. Only PDF parsing is risky enough to record
        // (crate::extractions): the text types are a bounded copy.
        let risky = fetched.mime == "application/pdf";
        if risky && let Start::Poison(earlier) = ports.extraction_start(name).await {
            tracing::warn!(
                document = name,
                earlier,
                "document stopped workers before; not extracted again"
            );
            return Ok(None);
        }
        let text = extract_text(&fetched.mime, fetched.bytes.clone()).await;
        if risky {
            ports.extraction_end(name).await;
        }
        let Some(text) = text else {
            return Ok(None);
        };
        if text.trim().is_empty() {
            return Ok(None);
        }
        Ok(Some(render(&fetched, &text)))
    }
}

impl DocumentExtractor for DocumentTexts {
    fn extract(&self, document: DocumentRef<'_>) -> Option<String> {
        self.texts.get(document.url).cloned().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fetched(mime: &str, title: &str) -> FetchedDocument {
        FetchedDocument {
            name: "d-1".into(),
            mime: mime.into(),
            size: 10,
            title: title.into(),
            bytes: Vec::new(),
        }
    }

    #[tokio::test]
    async fn text_formats_and_pdf_have_text() {
        for mime in [
            "text/plain",
            "text/markdown",
            "text/csv",
            "application/json",
        ] {
            assert_eq!(
                extract_text(mime, b"\xEF\xBB\xBFa,b".to_vec())
                    .await
                    .as_deref(),
                Some("a,b")
            );
        }
        let pdf = extract_text(
            "application/pdf",
            cyrene_test_support::pdf::tiny_pdf("Quarterly revenue 42"),
        )
        .await;
        assert!(pdf.unwrap().contains("Quarterly revenue 42"));
    }

    #[tokio::test]
    async fn other_types_and_broken_pdfs_have_none() {
        assert_eq!(extract_text("image/png", b"\x89PNG".to_vec()).await, None);
        assert_eq!(
            extract_text("application/octet-stream", b"x".to_vec()).await,
            None
        );
        assert_eq!(
            extract_text("application/pdf", b"%PDF-1.4 junk".to_vec()).await,
            None
        );
        assert!(!readable("application/vnd.microsoft.portable-executable"));
    }

    #[test]
    fn rendering_names_the_document_and_bounds_the_text() {
        let doc = fetched("text/plain", "notes [1].txt");
        assert_eq!(
            render(&doc, "  hello \n"),
            "[文档] d-1「notes 1 .txt」（text/plain，10 字节）：\nhello"
        );
        assert_eq!(
            render(&fetched("text/plain", ""), "x"),
            "[文档] d-1（text/plain，10 字节）：\nx"
        );
        let long = "字".repeat(MAX_TEXT_CHARS + 10);
        let out = render(&doc, &long);
        assert!(out.ends_with(TRUNCATED_NOTE));
        let body = out.split_once('\n').unwrap().1;
        assert_eq!(body.matches('字').count(), MAX_TEXT_CHARS);
    }
}
