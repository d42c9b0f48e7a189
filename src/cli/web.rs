//! `cyrene web`: serves the web chat (docs/web.md) — the static page built from `web/` by
//! `build.rs` and embedded in this binary — and `/config.json`, which tells the page where NATS
//! answers over WebSocket. It never connects to NATS itself: the browser does, as the person
//! who logs in, so this server holds no session state and no credentials.
//!
//! # Invariants
//! - Every response carries the strict Content-Security-Policy of [`csp`]: scripts and styles
//!   from this origin only (no inline script or style), `connect-src` only `'self'` and the
//!   configured NATS WebSocket URL, no plugins, frames or form submissions.
//! - The WebSocket URL is checked before it goes into a header or `/config.json`: one `ws://` or
//!   `wss://` URL without spaces, quotes, commas or semicolons (nothing that could end a CSP
//!   directive).

use super::CliError;
use axum::Router;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use clap::Args;
use std::net::SocketAddr;
use std::sync::Arc;

/// The page, as `build.rs` built it into `$OUT_DIR/web`.
const INDEX_HTML: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/web/index.html"));
const APP_JS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/web/app.js"));
const APP_CSS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/web/app.css"));

/// Where `cyrene web` and `cyrene up` listen unless told otherwise.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8090";
/// The NATS WebSocket URL the page uses unless told otherwise: the local server `make run`
/// starts (scripts/run.sh).
pub const DEFAULT_NATS_WS_URL: &str = "ws://127.0.0.1:4280";

#[derive(Debug, Args)]
pub struct WebArgs {
    /// Address to listen on (host:port).
    #[arg(long, env = "CYRENE_WEB_ADDR", default_value = DEFAULT_ADDR)]
    pub addr: SocketAddr,
    #[command(flatten)]
    pub page: PageArgs,
}

/// What the page is told in `/config.json` (shared by `cyrene web` and `cyrene up`).
#[derive(Debug, Clone, Args)]
pub struct PageArgs {
    /// NATS WebSocket URL the browser connects to (the server's `websocket {}` block; wss:// in
    /// production, docs/web.md).
    #[arg(long, env = "CYRENE_WEB_NATS_WS_URL", default_value = DEFAULT_NATS_WS_URL)]
    pub nats_ws_url: String,
    /// Persona ids offered by the page's Persona picker (comma-separated; `cyrene up` offers
    /// the personas it runs).
    #[arg(long, env = "CYRENE_WEB_PERSONAS", value_delimiter = ',')]
    pub web_personas: Vec<String>,
}

/// The served page: the embedded files plus the headers and config of this deployment.
#[derive(Debug)]
struct Page {
    csp: HeaderValue,
    config: Vec<u8>,
}

pub async fn run(args: WebArgs) -> Result<(), CliError> {
    check(&args.page)?;
    let listener = bind(args.addr).await?;
    let url = page_url(&listener)?;
    eprintln!(
        "cyrene: web chat at {url} (NATS over WebSocket at {})",
        args.page.nats_ws_url
    );
    serve(listener, args.page, std::future::pending()).await
}

/// Binds the page's listener.
pub async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, CliError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::Failed(format!("web: cannot listen on {addr}: {e}")))
}

/// `http://<addr>/` of a bound listener.
pub fn page_url(listener: &tokio::net::TcpListener) -> Result<String, CliError> {
    let addr = listener
        .local_addr()
        .map_err(|e| CliError::Failed(format!("web: {e}")))?;
    Ok(format!("http://{addr}/"))
}

/// Serves the page on `listener` until `stop` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    page: PageArgs,
    stop: impl Future<Output = ()> + Send + 'static,
) -> Result<(), CliError> {
    let page = Arc::new(prepare(&page)?);
    let router = Router::new()
        .route(
            "/",
            get(|| async { file("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/app.js",
            get(|| async { file("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/app.css",
            get(|| async { file("text/css; charset=utf-8", APP_CSS) }),
        )
        .route(
            "/config.json",
            get({
                let page = page.clone();
                move || async move { file("application/json", &page.config) }
            }),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n").into_response() })
        .layer(axum::middleware::map_response(
            move |mut response: Response| {
                let page = page.clone();
                async move {
                    let headers = response.headers_mut();
                    headers.insert(header::CONTENT_SECURITY_POLICY, page.csp.clone());
                    headers.insert(
                        header::X_CONTENT_TYPE_OPTIONS,
                        HeaderValue::from_static("nosniff"),
                    );
                    headers.insert(
                        header::REFERRER_POLICY,
                        HeaderValue::from_static("no-referrer"),
                    );
                    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
                    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
                    response
                }
            },
        ));
    axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await
        .map_err(|e| CliError::Failed(format!("web: {e}")))
}

fn file(content_type: &'static str, body: &[u8]) -> Response {
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static(content_type))],
        body.to_vec(),
    )
        .into_response()
}

fn prepare(page: &PageArgs) -> Result<Page, CliError> {
    let url = checked_ws_url(&page.nats_ws_url).map_err(CliError::Failed)?;
    let csp = HeaderValue::from_str(&csp(url))
        .map_err(|e| CliError::Failed(format!("web: content security policy: {e}")))?;
    let config = serde_json::to_vec(&serde_json::json!({
        "nats_ws_url": url,
        "personas": page.web_personas,
    }))
    .map_err(|e| CliError::Failed(format!("web: {e}")))?;
    Ok(Page { csp, config })
}

/// The page's Content-Security-Policy: everything from this origin only, no inline script or
/// style, and the one NATS WebSocket URL besides `'self'` to connect to.
fn csp(nats_ws_url: &str) -> String {
    format!(
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
         connect-src 'self' {nats_ws_url}; base-uri 'none'; form-action 'none'; \
         frame-ancestors 'none'"
    )
}

/// Checks what the page will be told before anything starts (`cyrene up` checks it before its
/// services).
pub fn check(page: &PageArgs) -> Result<(), CliError> {
    checked_ws_url(&page.nats_ws_url)
        .map(|_| ())
        .map_err(CliError::Failed)
}

/// `url` when it is one plain `ws://` or `wss://` URL that can stand in a CSP directive.
fn checked_ws_url(url: &str) -> Result<&str, String> {
    let rest = url
        .strip_prefix("ws://")
        .or_else(|| url.strip_prefix("wss://"))
        .ok_or_else(|| {
            format!("web: the NATS WebSocket URL {url:?} must start with ws:// or wss://")
        })?;
    let plain = |c: char| c.is_ascii_alphanumeric() || "-._~:/[]@%".contains(c);
    if rest.is_empty() || !rest.chars().all(plain) {
        return Err(format!(
            "web: the NATS WebSocket URL {url:?} must be one URL without spaces, quotes, commas \
             or semicolons"
        ));
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_websocket_url_cannot_widen_the_policy() {
        assert_eq!(
            checked_ws_url("ws://127.0.0.1:4280"),
            Ok("ws://127.0.0.1:4280")
        );
        assert!(checked_ws_url("wss://nats.example.org/ws").is_ok());
        for bad in [
            "http://x",
            "ws://",
            "ws://a; script-src *",
            "ws://a 'unsafe-inline'",
            "ws://a,b",
            "ws://a\"",
            "ws://a\r\nX: y",
        ] {
            assert!(checked_ws_url(bad).is_err(), "{bad:?}");
        }
        let policy = csp("ws://127.0.0.1:4280");
        assert!(policy.contains("connect-src 'self' ws://127.0.0.1:4280;"));
        assert!(policy.contains("script-src 'self';"));
        assert!(!policy.contains("unsafe"));
    }

    #[test]
    fn the_embedded_page_loads_its_script_and_style_from_this_origin() {
        let html = std::str::from_utf8(INDEX_HTML).unwrap();
        assert!(html.contains(r#"<script type="module" src="/app.js"></script>"#));
        assert!(html.contains(r#"href="/app.css""#));
        assert!(!APP_JS.is_empty() && !APP_CSS.is_empty());
    }
}
