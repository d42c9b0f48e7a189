//! The error envelope every endpoint answers with, and its closed set of codes
//! (docs/architecture.md §1).
//!
//! On the wire a failed request carries the micro headers `Nats-Service-Error` (the message) and
//! `Nats-Service-Error-Code` (the numeric status of [`ErrorCode::status`]) **and** a JSON body
//! `{"error":{"code":"not_found","message":"…"}}`.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The closed set of error codes. Adding one is a protocol change: update `docs/errors.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Malformed JSON, wrong types, missing or unknown fields, invalid ids.
    BadRequest,
    /// The caller may not do this: e.g. it speaks as someone else (a comm message whose `from`
    /// is not the sender's subject token).
    Forbidden,
    /// The addressed thing does not exist.
    NotFound,
    /// A write lost a race or was fenced off (an older attempt, a duplicate).
    Conflict,
    /// A dependency (database, provider chain, peer) is down; retrying later may succeed.
    Unavailable,
    /// An upstream provider rejected the request; its message is kept.
    Upstream,
    /// The operation did not finish within its deadline.
    Timeout,
    /// The payload exceeds the size limit.
    TooLarge,
    /// A bug on our side.
    Internal,
}

impl ErrorCode {
    /// Every code, in documentation order.
    pub const ALL: [ErrorCode; 9] = [
        ErrorCode::BadRequest,
        ErrorCode::Forbidden,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::Unavailable,
        ErrorCode::Upstream,
        ErrorCode::Timeout,
        ErrorCode::TooLarge,
        ErrorCode::Internal,
    ];

    /// The wire spelling (`bad_request`, …).
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Upstream => "upstream",
            ErrorCode::Timeout => "timeout",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP-like status put in the `Nats-Service-Error-Code` header.
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Forbidden => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::TooLarge => 413,
            ErrorCode::Internal => 500,
            ErrorCode::Upstream => 502,
            ErrorCode::Unavailable => 503,
            ErrorCode::Timeout => 504,
        }
    }

    /// The code for a `Nats-Service-Error-Code` status, for peers that send headers only.
    pub fn from_status(status: u16) -> ErrorCode {
        match status {
            400 => ErrorCode::BadRequest,
            403 => ErrorCode::Forbidden,
            404 => ErrorCode::NotFound,
            409 => ErrorCode::Conflict,
            413 => ErrorCode::TooLarge,
            502 => ErrorCode::Upstream,
            503 => ErrorCode::Unavailable,
            504 | 408 => ErrorCode::Timeout,
            _ => ErrorCode::Internal,
        }
    }

    /// Whether the same request may succeed if sent again later.
    pub const fn is_retryable(self) -> bool {
        matches!(self, ErrorCode::Unavailable | ErrorCode::Timeout)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `{"code":"…","message":"…"}`: the inner object of the envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

/// The longest error message sent, in bytes: messages may quote client input (a field name, a
/// value), so they are cut — on a character boundary — to keep every error reply small whatever
/// the request held.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 1024;

/// What ends a message that was cut.
const CUT_MARK: &str = " …(truncated)";

impl ErrorBody {
    /// An error; `message` is cut to [`MAX_ERROR_MESSAGE_BYTES`].
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            code,
            message: bounded_message(message.into()),
        }
    }
}

/// `message` unchanged when it fits, else its longest prefix that fits with the cut mark.
fn bounded_message(mut message: String) -> String {
    if message.len() <= MAX_ERROR_MESSAGE_BYTES {
        return message;
    }
    let mut end = MAX_ERROR_MESSAGE_BYTES - CUT_MARK.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str(CUT_MARK);
    message
}

impl fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ErrorBody {}

/// `{"error":{…}}`: the body of every failed reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorEnvelope {
    pub error: ErrorBody,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelope_matches_documented_shape() {
        let env = ErrorEnvelope {
            error: ErrorBody::new(ErrorCode::NotFound, "no checkpoint"),
        };
        assert_eq!(
            serde_json::to_value(&env).unwrap(),
            json!({"error":{"code":"not_found","message":"no checkpoint"}})
        );
        let back: ErrorEnvelope =
            serde_json::from_str(r#"{"error":{"code":"too_large","message":"x"}}"#).unwrap();
        assert_eq!(back.error.code, ErrorCode::TooLarge);
    }

    #[test]
    fn messages_are_cut_on_a_character_boundary() {
        let short = ErrorBody::new(ErrorCode::BadRequest, "unknown field `x`");
        assert_eq!(short.message, "unknown field `x`");
        for filler in ["x", "é", "昔", "🦀"] {
            let long = ErrorBody::new(
                ErrorCode::BadRequest,
                format!("unknown field `{}`", filler.repeat(600_000)),
            );
            assert!(long.message.len() <= MAX_ERROR_MESSAGE_BYTES, "{filler}");
            assert!(long.message.starts_with("unknown field `"));
            assert!(long.message.ends_with("…(truncated)"));
        }
        let exact = "a".repeat(MAX_ERROR_MESSAGE_BYTES);
        assert_eq!(
            ErrorBody::new(ErrorCode::Internal, exact.clone()).message,
            exact
        );
    }

    #[test]
    fn every_code_round_trips_through_its_status_and_name() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_status(code.status()), code);
            let v = serde_json::to_value(code).unwrap();
            assert_eq!(v, json!(code.as_str()));
        }
        assert!(serde_json::from_value::<ErrorCode>(json!("teapot")).is_err());
    }
}
