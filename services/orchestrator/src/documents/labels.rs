//! What a stored document is called and what it is: the [`title`] kept from the client's file
//! name and the MIME type [`sniff`]ed from the bytes (docs/documents.md, "The rules").
//!
//! # Invariants
//! - The server names every stored document (`d-<uuid>`, see `upload`); the client's file name
//!   is kept only as a [`title`] (basename, [`display_name`] rules) in the object's metadata.
//! - The MIME type is [`sniff`]ed from the bytes; the client's claim is ignored. Pure: no I/O.

use cyrene_protocol::names::display_name;

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
}
