//! Writing NATS headers without panicking.
//!
//! async-nats' `HeaderMap::insert`/`append` take `&str`/`String` through conversions that
//! **assert**: a name that is not visible ASCII (or holds a colon) or a value with a line break
//! panics the calling task. Values we do not choose ourselves — a model's tool-call id, an echoed
//! error text, a propagated trace state — go through [`insert`], which refuses instead.
//! `clippy.toml` disallows the asserting methods everywhere else.
//!
//! Reading is safe as is: a received header block that does not parse is dropped whole by the
//! patched client (vendor/async-nats/CYRENE-PATCH.md), so every received value is a valid string.

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use std::str::FromStr;

/// A header that cannot be written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidHeader {
    #[error("a header name must be non-empty visible ASCII without a colon")]
    Name,
    #[error("the value of header {0} holds a line break")]
    Value(String),
}

/// Sets `name` to `value` (replacing earlier values), or says why it cannot be sent.
pub fn insert(headers: &mut HeaderMap, name: &str, value: &str) -> Result<(), InvalidHeader> {
    // async-nats accepts an empty name; other clients reject the `: value` line it makes.
    if name.is_empty() {
        return Err(InvalidHeader::Name);
    }
    let name = HeaderName::from_str(name).map_err(|_| InvalidHeader::Name)?;
    let value = HeaderValue::from_str(value).map_err(|_| InvalidHeader::Value(name.to_string()))?;
    #[allow(clippy::disallowed_methods)] // both halves are validated above: this cannot panic
    headers.insert(name, value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn junk_is_refused_not_panicked_on() {
        let mut headers = HeaderMap::new();
        for name in ["", "a b", "a:b", "é", "a\r\nb", "\0"] {
            assert_eq!(
                insert(&mut headers, name, "v"),
                Err(InvalidHeader::Name),
                "{name:?}"
            );
        }
        for value in ["a\rb", "a\nb", "\r\n", "ok\r\nInjected: yes"] {
            assert_eq!(
                insert(&mut headers, "Cyrene-Test", value),
                Err(InvalidHeader::Value("Cyrene-Test".into())),
                "{value:?}"
            );
        }
        assert!(headers.is_empty());

        // Anything else is a value: non-ASCII, control characters, a megabyte.
        let huge = "x".repeat(1 << 20);
        for value in ["昔涟", "\0\t\u{7f}", "", huge.as_str()] {
            insert(&mut headers, "Cyrene-Test", value).unwrap();
            assert_eq!(headers.get("Cyrene-Test").unwrap().as_str(), value);
        }
    }
}
