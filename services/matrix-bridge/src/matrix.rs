//! The homeserver, over HTTP: ruma's typed client-server API requests and responses
//! (`ruma::api::client`), sent with the workspace's HTTP client. No protocol is written here by
//! hand; this module only carries ruma's `http::Request`s and applies the retry policy.
//!
//! # Invariants
//! - A `429` (`M_LIMIT_EXCEEDED`) is waited out: the server's `retry_after_ms` (or
//!   `Retry-After`), at least [`MIN_RATE_LIMIT_PAUSE`] and at most [`MAX_RATE_LIMIT_PAUSE`],
//!   then the same request is sent again — up to [`MAX_ATTEMPTS`] times.
//! - A connection failure or a `5xx` is retried with exponential backoff and jitter, up to
//!   [`MAX_ATTEMPTS`]; any other answer is returned as it is.
//! - A caller's body limit ([`Homeserver::call_limited`], media downloads) is kept while
//!   reading: a longer answer is never held in memory past it.
//! - The access token is never logged: errors carry the endpoint's path, never its headers.

use ruma::api::auth_scheme::{AuthScheme, SendAccessToken};
use ruma::api::path_builder::PathBuilder;
use ruma::api::{
    IncomingResponse, MatrixVersion, OutgoingRequest, OutgoingRequestExt, SupportedVersions,
};
use std::borrow::Cow;
use std::time::Duration;

/// Attempts of one request (rate limits, connection failures, 5xx).
pub const MAX_ATTEMPTS: u32 = 8;
/// The shortest pause after a `429`.
pub const MIN_RATE_LIMIT_PAUSE: Duration = Duration::from_millis(100);
/// The longest pause after a `429`.
pub const MAX_RATE_LIMIT_PAUSE: Duration = Duration::from_secs(60);

/// A cause of another crate's error type, kept whole.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a homeserver request failed.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// The request could not be built (a bug, or an id that ruma refuses).
    #[error("cannot build the request to {path}: {source}")]
    Build {
        path: String,
        #[source]
        source: BoxError,
    },
    /// The homeserver was not reachable (after retries).
    #[error("homeserver unreachable ({path}): {source}")]
    Transport {
        path: String,
        #[source]
        source: reqwest::Error,
    },
    /// The homeserver answered with an error.
    #[error("homeserver answered {status} {errcode} on {path}: {error}")]
    Status {
        path: String,
        status: u16,
        errcode: String,
        error: String,
    },
    /// The answer did not decode.
    #[error("cannot decode the answer of {path}: {source}")]
    Decode {
        path: String,
        #[source]
        source: BoxError,
    },
    /// The answer's body was longer than the caller's limit (it was not read further).
    #[error("the answer of {path} is larger than {limit} bytes")]
    TooLarge { path: String, limit: usize },
}

impl MatrixError {
    /// The Matrix `errcode`, when the homeserver gave one.
    pub fn errcode(&self) -> Option<&str> {
        match self {
            MatrixError::Status { errcode, .. } => Some(errcode),
            _ => None,
        }
    }

    /// Whether a later attempt may succeed (unreachable, overloaded).
    pub fn is_transient(&self) -> bool {
        match self {
            MatrixError::Transport { .. } => true,
            MatrixError::Status { status, .. } => *status == 429 || *status >= 500,
            MatrixError::Build { .. }
            | MatrixError::Decode { .. }
            | MatrixError::TooLarge { .. } => false,
        }
    }
}

/// The HTTP client for homeservers (ring's TLS provider installed first: the workspace's
/// reqwest brings none of its own).
pub fn http_client() -> Result<reqwest::Client, reqwest::Error> {
    // Err means a provider is installed already: fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .build()
}

/// A homeserver client: base URL, HTTP client, and (once logged in) an access token.
#[derive(Debug, Clone)]
pub struct Homeserver {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    versions: SupportedVersions,
}

impl Homeserver {
    /// A client of the homeserver at `base` (no token yet).
    pub fn new(http: reqwest::Client, base: impl Into<String>) -> Homeserver {
        // The stable paths of Matrix 1.1 to 1.12 (1.11 brought authenticated media).
        let versions = [
            MatrixVersion::V1_1,
            MatrixVersion::V1_2,
            MatrixVersion::V1_3,
            MatrixVersion::V1_4,
            MatrixVersion::V1_5,
            MatrixVersion::V1_6,
            MatrixVersion::V1_7,
            MatrixVersion::V1_8,
            MatrixVersion::V1_9,
            MatrixVersion::V1_10,
            MatrixVersion::V1_11,
            MatrixVersion::V1_12,
        ];
        Homeserver {
            http,
            base: base.into().trim_end_matches('/').to_owned(),
            token: None,
            versions: SupportedVersions {
                versions: versions.into_iter().collect(),
                features: Default::default(),
            },
        }
    }

    /// The same client with `token` as its access token.
    pub fn with_token(mut self, token: impl Into<String>) -> Homeserver {
        self.token = Some(token.into());
        self
    }

    /// The access token in use, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Sends `request`, waiting out rate limits and retrying transient failures
    /// (module docs).
    pub async fn call<R>(&self, request: R) -> Result<R::IncomingResponse, MatrixError>
    where
        R: OutgoingRequest,
        for<'a> R::Authentication: AuthScheme<Input<'a> = SendAccessToken<'a>>,
        for<'a> R::PathBuilder: PathBuilder<Input<'a> = Cow<'a, SupportedVersions>>,
    {
        self.call_limited(request, None).await
    }

    /// [`Homeserver::call`] reading at most `limit` bytes of the answer's body: a longer one is
    /// [`MatrixError::TooLarge`], cut off there (media downloads).
    pub async fn call_limited<R>(
        &self,
        request: R,
        limit: Option<usize>,
    ) -> Result<R::IncomingResponse, MatrixError>
    where
        R: OutgoingRequest,
        for<'a> R::Authentication: AuthScheme<Input<'a> = SendAccessToken<'a>>,
        for<'a> R::PathBuilder: PathBuilder<Input<'a> = Cow<'a, SupportedVersions>>,
    {
        let token = match &self.token {
            Some(token) => SendAccessToken::IfRequired(token),
            None => SendAccessToken::None,
        };
        let built = request
            .try_into_http_request::<Vec<u8>>(&self.base, token, Cow::Borrowed(&self.versions))
            .map_err(|e| MatrixError::Build {
                path: "?".into(),
                source: e.into(),
            })?;
        let (parts, body) = built.into_parts();
        let path = parts.uri.path().to_owned();
        let mut backoff = Duration::from_millis(100);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut outgoing = self
                .http
                .request(parts.method.clone(), parts.uri.to_string())
                .body(body.clone());
            for (name, value) in &parts.headers {
                outgoing = outgoing.header(name, value);
            }
            let answer = match outgoing.send().await {
                Ok(answer) => answer,
                Err(source) if attempt < MAX_ATTEMPTS => {
                    tracing::debug!(%path, error = %source, "homeserver unreachable; retrying");
                    tokio::time::sleep(jittered(backoff)).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
                Err(source) => return Err(MatrixError::Transport { path, source }),
            };
            let status = answer.status();
            let headers = answer.headers().clone();
            let bytes = match read_body(answer, limit).await {
                Ok(bytes) => bytes,
                Err(BodyError::TooLarge) => {
                    let limit = limit.unwrap_or_default();
                    return Err(MatrixError::TooLarge { path, limit });
                }
                Err(BodyError::Transport(source)) if attempt < MAX_ATTEMPTS => {
                    tracing::debug!(%path, error = %source, "answer cut off; retrying");
                    tokio::time::sleep(jittered(backoff)).await;
                    continue;
                }
                Err(BodyError::Transport(source)) => {
                    return Err(MatrixError::Transport { path, source });
                }
            };
            if status.as_u16() == 429 && attempt < MAX_ATTEMPTS {
                let pause = rate_limit_pause(&headers, &bytes);
                metrics::counter!("cyrene_matrix_bridge_rate_limited_total").increment(1);
                tracing::info!(%path, ?pause, "rate limited by the homeserver; waiting");
                tokio::time::sleep(pause).await;
                continue;
            }
            if status.is_server_error() && attempt < MAX_ATTEMPTS {
                tracing::debug!(%path, %status, "homeserver error; retrying");
                tokio::time::sleep(jittered(backoff)).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
            if status.as_u16() >= 400 {
                let (errcode, error) = error_body(&bytes);
                return Err(MatrixError::Status {
                    path,
                    status: status.as_u16(),
                    errcode,
                    error,
                });
            }
            let mut response = http::Response::builder().status(status);
            for (name, value) in &headers {
                response = response.header(name, value);
            }
            let response = response
                .body(bytes.as_slice())
                .map_err(|e| MatrixError::Decode {
                    path: path.clone(),
                    source: e.into(),
                })?;
            return <R::IncomingResponse as IncomingResponse>::try_from_http_response_inner(
                response,
            )
            .map_err(|e| MatrixError::Decode {
                path,
                source: e.into(),
            });
        }
    }
}

/// Why a body could not be read.
enum BodyError {
    TooLarge,
    Transport(reqwest::Error),
}

/// The body of `answer`, at most `limit` bytes (all of it without a limit).
async fn read_body(
    mut answer: reqwest::Response,
    limit: Option<usize>,
) -> Result<Vec<u8>, BodyError> {
    let Some(limit) = limit else {
        return Ok(answer.bytes().await.map_err(BodyError::Transport)?.to_vec());
    };
    if answer
        .content_length()
        .is_some_and(|length| length > limit as u64)
    {
        return Err(BodyError::TooLarge);
    }
    let mut body = Vec::new();
    while let Some(chunk) = answer.chunk().await.map_err(BodyError::Transport)? {
        if body.len() + chunk.len() > limit {
            return Err(BodyError::TooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// How long a `429` asks to wait: `retry_after_ms` of the body, else `Retry-After` (seconds),
/// else one second; clamped to [`MIN_RATE_LIMIT_PAUSE`]..=[`MAX_RATE_LIMIT_PAUSE`].
pub fn rate_limit_pause(headers: &reqwest::header::HeaderMap, body: &[u8]) -> Duration {
    let from_body = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("retry_after_ms").and_then(serde_json::Value::as_u64))
        .map(Duration::from_millis);
    let from_header = headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    from_body
        .or(from_header)
        .unwrap_or(Duration::from_secs(1))
        .clamp(MIN_RATE_LIMIT_PAUSE, MAX_RATE_LIMIT_PAUSE)
}

/// `errcode` and `error` of a Matrix error body (empty when it has none).
fn error_body(body: &[u8]) -> (String, String) {
    let value: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let field = |name: &str| {
        value
            .get(name)
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default()
            .chars()
            .take(300)
            .collect::<String>()
    };
    (field("errcode"), field("error"))
}

/// `pause` plus up to half of it again, so clients restarted together spread out.
fn jittered(pause: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    pause + pause.mul_f64(f64::from(nanos % 1000) / 2000.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};

    #[test]
    fn a_rate_limit_pause_follows_the_server_within_bounds() {
        let none = HeaderMap::new();
        let body = br#"{"errcode":"M_LIMIT_EXCEEDED","retry_after_ms":2500}"#;
        assert_eq!(rate_limit_pause(&none, body), Duration::from_millis(2500));
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_static("3"));
        assert_eq!(rate_limit_pause(&headers, b"{}"), Duration::from_secs(3));
        assert_eq!(rate_limit_pause(&none, b"junk"), Duration::from_secs(1));
        let huge = br#"{"retry_after_ms":99999999}"#;
        assert_eq!(rate_limit_pause(&none, huge), MAX_RATE_LIMIT_PAUSE);
        let tiny = br#"{"retry_after_ms":1}"#;
        assert_eq!(rate_limit_pause(&none, tiny), MIN_RATE_LIMIT_PAUSE);
    }

    /// A media download is bounded by its caller's limit, whatever the sender declared: past
    /// it the answer is `TooLarge` (docs/security.md, "Limits").
    #[tokio::test]
    async fn a_download_is_cut_off_past_its_limit() {
        use ruma::api::client::authenticated_media::get_content;
        use wiremock::{Mock, MockServer, ResponseTemplate, matchers::path_regex};
        let server = MockServer::start().await;
        Mock::given(path_regex(
            "^/_matrix/client/v1/media/download/localhost/abc",
        ))
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("content-type", "text/plain")
                .set_body_bytes(vec![b'x'; 10_000]),
        )
        .mount(&server)
        .await;
        let hs = Homeserver::new(http_client().unwrap(), server.uri()).with_token("t");
        let request = || {
            let server = ruma::OwnedServerName::try_from("localhost").unwrap();
            get_content::v1::Request::new("abc".to_owned(), server)
        };
        let err = hs.call_limited(request(), Some(9_999)).await.unwrap_err();
        assert!(
            matches!(err, MatrixError::TooLarge { limit: 9_999, .. }),
            "{err}"
        );
        assert!(!err.is_transient(), "not worth a retry");
        let file = hs.call_limited(request(), Some(10_000)).await.unwrap();
        assert_eq!(file.file.len(), 10_000);
    }

    #[test]
    fn errors_say_what_the_server_said() {
        assert_eq!(
            error_body(br#"{"errcode":"M_FORBIDDEN","error":"nope"}"#),
            ("M_FORBIDDEN".into(), "nope".into())
        );
        assert_eq!(error_body(b"<html>"), (String::new(), String::new()));
    }
}
