//! Bounded PDF text extraction (docs/loop-worker.md, "Documents"; docs/security.md, "PDF
//! extraction"). Any client may upload a PDF, so its text is read under fixed budgets: a few
//! kilobytes of Flate-compressed content inflate to megabytes and millions of operations, and
//! an extractor that decodes them all at once holds gigabytes (issue 30, H2).
//!
//! # Invariants
//! - Every budget of [`PdfLimits`] is a count (bytes, objects, operations, fonts), never a
//!   clock: the same file always gives the same answer, on any machine and under any load.
//!   Going over one is [`PdfError`], which the caller shows as "could not extract".
//! - Memory is bounded by the budgets, not by the file: every stream is inflated against what
//!   is left of one document-wide byte budget, operations are decoded one at a time and
//!   dropped, fonts are resolved only when a `Tf` selects them, and the text stops growing at
//!   [`PdfLimits::max_text_bytes`] (extraction ends there, successfully).
//! - Extraction runs on the calling thread and holds no lock; the caller puts it on a
//!   blocking thread.
//!
//! # Pitfalls
//! - lopdf parses object streams whole before the load filter sees their objects: the
//!   transient cost of one is bounded by [`PdfLimits::max_stream_bytes`], the objects kept by
//!   [`PdfLimits::max_objects`] (counted through a thread-local, as the filter is a plain `fn`).

use lopdf::content::{Content, Operation};
use lopdf::{Document, Encoding, LoadOptions, Object, ObjectId};
use std::cell::Cell;
use std::collections::BTreeMap;

/// The budgets of one extraction; [`PdfLimits::DEFAULT`] is what the worker uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdfLimits {
    /// The most bytes one stream (object stream, cross-reference stream, page content or font
    /// CMap) may inflate to.
    pub max_stream_bytes: usize,
    /// The most bytes all page contents of the document may inflate to together.
    pub max_content_bytes: usize,
    /// The most objects the document may hold once loaded (object streams included).
    pub max_objects: usize,
    /// The most content operations read over the whole document.
    pub max_operations: usize,
    /// The most distinct fonts whose encodings are resolved.
    pub max_fonts: usize,
    /// Extraction stops, successfully, once the text is this long (a UTF-8 byte count; the
    /// view keeps less: the documents module's `MAX_TEXT_CHARS` characters, checked there).
    pub max_text_bytes: usize,
}

impl PdfLimits {
    /// Far above what a real document needs for the characters a view keeps of it; a worst
    /// case of these holds well under 100 MB at once.
    pub const DEFAULT: PdfLimits = PdfLimits {
        max_stream_bytes: 4 * 1024 * 1024,
        max_content_bytes: 16 * 1024 * 1024,
        max_objects: 200_000,
        max_operations: 1_000_000,
        max_fonts: 64,
        max_text_bytes: 128 * 1024,
    };
}

impl Default for PdfLimits {
    fn default() -> Self {
        PdfLimits::DEFAULT
    }
}

/// Why a PDF gave no text.
#[derive(Debug, thiserror::Error)]
pub enum PdfError {
    #[error("not a readable PDF: {0}")]
    Unreadable(#[source] lopdf::Error),
    #[error("more than {0} objects")]
    TooManyObjects(usize),
    #[error("page contents over {0} bytes inflated")]
    ContentTooLarge(usize),
    #[error("more than {0} content operations")]
    TooManyOperations(usize),
    #[error("more than {0} fonts")]
    TooManyFonts(usize),
}

thread_local! {
    /// Objects the current load has kept, and the most it may keep ([`count_object`]).
    static OBJECTS: Cell<(usize, usize)> = const { Cell::new((0, usize::MAX)) };
}

/// The load filter: counts the objects kept and drops every one past the budget (the load is
/// then refused as [`PdfError::TooManyObjects`]).
fn count_object(id: ObjectId, object: &mut Object) -> Option<(ObjectId, Object)> {
    let (kept, max) = OBJECTS.get();
    if kept >= max {
        OBJECTS.set((kept.saturating_add(1), max));
        return None;
    }
    OBJECTS.set((kept + 1, max));
    // lopdf keeps its own copy of a direct object and this copy of an object-stream member.
    Some((id, object.clone()))
}

/// The text of a PDF's pages, in page order, within `limits`.
pub fn text(bytes: &[u8], limits: &PdfLimits) -> Result<String, PdfError> {
    OBJECTS.set((0, limits.max_objects));
    let options = LoadOptions {
        filter: Some(count_object),
        max_decompressed_size: Some(limits.max_stream_bytes),
        ..LoadOptions::default()
    };
    let loaded = Document::load_mem_with_options(bytes, options);
    let (kept, _) = OBJECTS.replace((0, usize::MAX));
    let doc = loaded.map_err(PdfError::Unreadable)?;
    if kept > limits.max_objects {
        return Err(PdfError::TooManyObjects(limits.max_objects));
    }
    Extraction {
        doc: &doc,
        limits,
        text: String::new(),
        content_left: limits.max_content_bytes,
        operations: 0,
        fonts: 0,
    }
    .run()
}

/// One document's extraction and what it has spent.
struct Extraction<'d> {
    doc: &'d Document,
    limits: &'d PdfLimits,
    text: String,
    content_left: usize,
    operations: usize,
    fonts: usize,
}

impl<'d> Extraction<'d> {
    fn run(mut self) -> Result<String, PdfError> {
        for page in self.doc.page_iter() {
            if self.full() {
                break;
            }
            self.page(page)?;
        }
        Ok(self.text)
    }

    fn full(&self) -> bool {
        self.text.len() >= self.limits.max_text_bytes
    }

    fn page(&mut self, page: ObjectId) -> Result<(), PdfError> {
        let limit = self.content_left.min(self.limits.max_stream_bytes);
        let content = match self.doc.get_page_content_with_limit(page, limit) {
            Ok(content) => content,
            Err(lopdf::Error::Decompress(lopdf::DecompressError::MemoryLimitExceeded {
                ..
            })) => {
                return Err(PdfError::ContentTooLarge(self.limits.max_content_bytes));
            }
            Err(err) => {
                tracing::debug!(error = %err, "a page without readable content");
                return Ok(());
            }
        };
        self.content_left = self.content_left.saturating_sub(content.len());
        // Fonts by resource name: looked up when a `Tf` selects one, resolved once per page.
        let fonts = self.doc.get_page_fonts(page).unwrap_or_default();
        let mut encodings: BTreeMap<Vec<u8>, Option<Encoding<'d>>> = BTreeMap::new();
        let mut current: Option<Vec<u8>> = None;
        for operation in Content::decode_iter(&content) {
            self.operations += 1;
            if self.operations > self.limits.max_operations {
                return Err(PdfError::TooManyOperations(self.limits.max_operations));
            }
            let Ok(operation) = operation else {
                break; // the rest of the page does not parse; keep what it showed
            };
            if operation.operator == "Tf" {
                current = operation
                    .operands
                    .first()
                    .and_then(|o| o.as_name().ok())
                    .map(<[u8]>::to_vec);
                if let Some(name) = &current
                    && !encodings.contains_key(name)
                {
                    let encoding = match fonts.get(name) {
                        Some(font) => self.encoding(font)?,
                        None => None,
                    };
                    encodings.insert(name.clone(), encoding);
                }
                continue;
            }
            let encoding = current
                .as_ref()
                .and_then(|name| encodings.get(name))
                .and_then(Option::as_ref);
            self.operation(&operation, encoding);
            if self.full() {
                break;
            }
        }
        Ok(())
    }

    /// A font's encoding, charged against [`PdfLimits::max_fonts`]; `None` when it cannot be
    /// read (its text is skipped, as lopdf does).
    fn encoding(&mut self, font: &'d lopdf::Dictionary) -> Result<Option<Encoding<'d>>, PdfError> {
        self.fonts += 1;
        if self.fonts > self.limits.max_fonts {
            return Err(PdfError::TooManyFonts(self.limits.max_fonts));
        }
        match font.get_font_encoding_with_limit(self.doc, self.limits.max_stream_bytes) {
            Ok(encoding) => Ok(Some(encoding)),
            Err(lopdf::Error::Decompress(lopdf::DecompressError::MemoryLimitExceeded {
                ..
            })) => Err(PdfError::ContentTooLarge(self.limits.max_stream_bytes)),
            Err(err) => {
                tracing::debug!(error = %err, "a font without a readable encoding");
                Ok(None)
            }
        }
    }

    /// What one text operation shows (PDF 32000-1 §9.4), as lopdf's own extraction reads it.
    fn operation(&mut self, operation: &Operation, encoding: Option<&Encoding<'_>>) {
        let newline = |text: &mut String| {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
        };
        match operation.operator.as_str() {
            "Tj" | "TJ" => {
                if let Some(encoding) = encoding {
                    self.show(encoding, &operation.operands);
                }
            }
            "'" => {
                newline(&mut self.text);
                if let Some(encoding) = encoding {
                    self.show(encoding, &operation.operands);
                }
            }
            "\"" => {
                newline(&mut self.text);
                if let (Some(encoding), Some(string)) = (encoding, operation.operands.get(2)) {
                    self.show(encoding, std::slice::from_ref(string));
                }
            }
            "T*" | "ET" => newline(&mut self.text),
            _ => {}
        }
    }

    fn show(&mut self, encoding: &Encoding<'_>, operands: &[Object]) {
        for operand in operands {
            match operand {
                Object::String(bytes, _) => {
                    if let Err(err) = encoding.write_to_string(bytes, &mut self.text) {
                        tracing::debug!(error = %err, "undecodable text");
                    }
                }
                // TJ's array: strings and kerning; a large negative kerning is a word gap.
                Object::Array(items) => {
                    for item in items {
                        match item {
                            Object::String(bytes, _) => {
                                if let Err(err) = encoding.write_to_string(bytes, &mut self.text) {
                                    tracing::debug!(error = %err, "undecodable text");
                                }
                            }
                            Object::Integer(i) if *i < -100 => self.text.push(' '),
                            _ => {}
                        }
                    }
                    self.text.push(' ');
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_test_support::pdf::{pdf_bomb, tiny_pdf};

    #[test]
    fn a_small_pdf_gives_its_text() {
        let text = text(&tiny_pdf("Quarterly revenue 42"), &PdfLimits::DEFAULT).unwrap();
        assert!(text.contains("Quarterly revenue 42"), "{text:?}");
    }

    #[test]
    fn a_bomb_of_operations_is_refused_at_the_operation_budget() {
        let limits = PdfLimits {
            max_operations: 10_000,
            ..PdfLimits::DEFAULT
        };
        let bomb = pdf_bomb(10_001);
        assert!(matches!(
            text(&bomb, &limits),
            Err(PdfError::TooManyOperations(10_000))
        ));
        // Within the budget the same shape is read (and shows nothing).
        assert_eq!(text(&pdf_bomb(9_000), &limits).unwrap().trim(), "");
    }

    #[test]
    fn inflated_content_is_bounded_document_wide() {
        let limits = PdfLimits {
            max_content_bytes: 4_096,
            ..PdfLimits::DEFAULT
        };
        assert!(matches!(
            text(&pdf_bomb(2_000), &limits),
            Err(PdfError::ContentTooLarge(4_096))
        ));
    }

    #[test]
    fn objects_past_the_budget_refuse_the_load() {
        let limits = PdfLimits {
            max_objects: 3,
            ..PdfLimits::DEFAULT
        };
        assert!(matches!(
            text(&tiny_pdf("x"), &limits),
            Err(PdfError::TooManyObjects(3))
        ));
        // The budget is per load: the next one starts from zero.
        assert!(text(&tiny_pdf("x"), &PdfLimits::DEFAULT).is_ok());
    }

    #[test]
    fn text_stops_growing_at_its_budget() {
        let limits = PdfLimits {
            max_text_bytes: 8,
            ..PdfLimits::DEFAULT
        };
        let text = text(&tiny_pdf("abcdefghijklmnop"), &limits).unwrap();
        assert!(text.len() >= 8 && text.len() <= 17, "{text:?}");
    }
}
