//! One MCP server's life in the bridge: start or connect it, list its tools, serve them as
//! endpoints of a `cyrene-mcp-bridge` micro service of its own, follow `tools/list_changed`, and
//! start again with backoff when it dies (docs/tools.md, "Bridging MCP servers").
//!
//! # Invariants
//! - The endpoints of a server exist only while its connection does: when the server dies its
//!   micro service leaves, so calls go to another replica (same queue group) or find no
//!   responder; a call in flight gets an error result at once, never a hung turn.
//! - Every call is bounded by `call_timeout`; every answer is a reply (`is_error` on failure).
//! - A stdio server gets a clean environment (a few basics and its configured `env`): the
//!   bridge's own credentials never reach it.

use crate::SERVICE_NAME;
use crate::config::{Config, HttpServer, Server, StdioServer};
use crate::tools::{self, Reply};
use async_nats::Client;
use cyrene_bus::host::{Endpoint, Host, ServiceSpec};
use cyrene_bus::service::RequestContext;
use cyrene_protocol::{ErrorBody, ErrorCode};
use rmcp::model::{CallToolRequestParams, ClientCapabilities, ClientConfig, Implementation, Tool};
use rmcp::service::{NotificationContext, RoleClient, RunningService};
use rmcp::transport::{
    ConfigureCommandExt, StreamableHttpClientTransport, TokioChildProcess,
    streamable_http_client::StreamableHttpClientTransportConfig,
};
use rmcp::{ClientHandler, Peer, ServiceError, ServiceExt};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Variables a stdio server inherits from the bridge (everything else it gets from its `env`).
const INHERITED_ENV: &[&str] = &["PATH", "HOME", "USER", "LANG", "LC_ALL", "TMPDIR"];
/// A connection that lived this long resets the backoff.
const STABLE_AFTER: Duration = Duration::from_secs(10);
/// The first pause before starting a server again.
const FIRST_RESTART: Duration = Duration::from_millis(500);

/// The bridge's MCP client side: its name to servers, and a wake-up on `tools/list_changed`.
#[derive(Debug, Clone, Default)]
struct Client_ {
    list_changed: Arc<Notify>,
}

impl ClientHandler for Client_ {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.list_changed.notify_one();
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new(SERVICE_NAME, env!("CARGO_PKG_VERSION")),
        )
    }
}

type Running = RunningService<RoleClient, Client_>;

/// Why a server could not be started or reached.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("cannot start {command:?}: {source}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the server did not complete the MCP handshake: {0}")]
    Handshake(#[source] Box<rmcp::service::ClientInitializeError>),
    #[error("cannot list its tools: {0}")]
    List(#[source] Box<rmcp::ServiceError>),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("invalid header {0:?}")]
    Header(String),
}

/// Keeps server `name` bridged until `shutdown`. `first` is called once, after the first
/// attempt (whatever its outcome): readiness waits for every server's first attempt.
pub async fn supervise(
    name: String,
    server: Server,
    config: Arc<Config>,
    client: Client,
    shutdown: CancellationToken,
    first: impl FnOnce(),
) {
    let backoff = cyrene_bus::retry::Backoff {
        first: FIRST_RESTART,
        max: config.restart_max.max(FIRST_RESTART),
    };
    let mut delays = backoff.delays();
    let mut first = Some(first);
    loop {
        let started = Instant::now();
        let connected = tokio::select! {
            _ = shutdown.cancelled() => return,
            connected = tokio::time::timeout(config.connect_timeout, connect(&name, &server)) => {
                connected.unwrap_or(Err(ConnectError::Timeout(config.connect_timeout)))
            }
        };
        match connected {
            Ok((running, handler, tools)) => {
                serve(
                    &name,
                    running,
                    handler,
                    tools,
                    &config,
                    &client,
                    &shutdown,
                    first.take(),
                )
                .await;
                if shutdown.is_cancelled() {
                    return;
                }
                tracing::warn!(server = %name, "MCP server stopped; starting it again");
            }
            Err(err) => {
                if let Some(first) = first.take() {
                    first();
                }
                tracing::warn!(server = %name, error = %err, "MCP server unavailable");
            }
        }
        if started.elapsed() >= STABLE_AFTER {
            delays = backoff.delays();
        }
        let pause = delays.next().unwrap_or(backoff.max);
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

async fn connect(
    name: &str,
    server: &Server,
) -> Result<(Running, Client_, Vec<Tool>), ConnectError> {
    let handler = Client_::default();
    let running = match server {
        Server::Stdio(stdio) => start_stdio(name, stdio, handler.clone()).await?,
        Server::Http(http) => connect_http(http, handler.clone()).await?,
    };
    let tools = running
        .peer()
        .list_all_tools()
        .await
        .map_err(|e| ConnectError::List(Box::new(e)))?;
    tracing::info!(server = %name, tools = tools.len(), "MCP server connected");
    Ok((running, handler, tools))
}

/// A stdio server's stderr, line by line into the bridge's log, until the server closes it. A
/// line is cut at [`STDERR_LINE`] bytes (the rest logged as further lines): a server that never
/// writes a line break costs bounded memory.
async fn log_stderr(server: String, stderr: tokio::process::ChildStderr) {
    use tokio::io::AsyncBufReadExt;
    let mut reader = tokio::io::BufReader::new(stderr);
    let mut line = Vec::new();
    loop {
        let chunk = match reader.fill_buf().await {
            Ok([]) | Err(_) => break,
            Ok(chunk) => chunk,
        };
        let room = STDERR_LINE - line.len();
        let (taken, ended) = match chunk.iter().take(room).position(|b| *b == b'\n') {
            Some(at) => (at + 1, true),
            None => (
                chunk.len().min(room),
                line.len() + chunk.len() >= STDERR_LINE,
            ),
        };
        line.extend_from_slice(&chunk[..taken]);
        reader.consume(taken);
        if ended {
            let text = String::from_utf8_lossy(&line);
            tracing::info!(server = %server, line = %text.trim_end(), "MCP server stderr");
            line.clear();
        }
    }
}

/// The longest stderr line logged as one.
const STDERR_LINE: usize = 2048;

async fn start_stdio(
    name: &str,
    server: &StdioServer,
    handler: Client_,
) -> Result<Running, ConnectError> {
    let command = tokio::process::Command::new(&server.command).configure(|cmd| {
        cmd.args(&server.args).env_clear();
        for key in INHERITED_ENV {
            if let Some(value) = std::env::var_os(key) {
                cmd.env(key, value);
            }
        }
        cmd.envs(&server.env);
        if let Some(cwd) = &server.cwd {
            cmd.current_dir(cwd);
        }
    });
    let (transport, stderr) = TokioChildProcess::builder(command)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|source| ConnectError::Spawn {
            command: server.command.clone(),
            source,
        })?;
    if let Some(stderr) = stderr {
        tokio::spawn(log_stderr(name.to_owned(), stderr));
    }
    handler
        .serve(transport)
        .await
        .map_err(|e| ConnectError::Handshake(Box::new(e)))
}

async fn connect_http(server: &HttpServer, handler: Client_) -> Result<Running, ConnectError> {
    let mut headers = HashMap::new();
    for (key, value) in &server.headers {
        let bad = || ConnectError::Header(key.chars().take(40).collect());
        headers.insert(
            http::HeaderName::try_from(key.as_str()).map_err(|_| bad())?,
            http::HeaderValue::try_from(value.as_str()).map_err(|_| bad())?,
        );
    }
    let mut config = StreamableHttpClientTransportConfig::with_uri(server.url.as_str());
    config.custom_headers = headers;
    let transport = StreamableHttpClientTransport::from_config(config);
    handler
        .serve(transport)
        .await
        .map_err(|e| ConnectError::Handshake(Box::new(e)))
}

/// Serves `tools` of a connected server until it dies or `shutdown`.
#[allow(clippy::too_many_arguments)]
async fn serve(
    name: &str,
    running: Running,
    handler: Client_,
    mut tools: Vec<Tool>,
    config: &Arc<Config>,
    client: &Client,
    shutdown: &CancellationToken,
    first: Option<impl FnOnce()>,
) {
    let peer = running.peer().clone();
    let stop = running.cancellation_token();
    let mut waiting = Box::pin(running.waiting());
    // Cancelled when the connection ends: calls in flight answer at once.
    let gone = CancellationToken::new();
    let calls = Calls {
        server: name.to_owned(),
        peer,
        gone: gone.clone(),
        timeout: config.call_timeout,
    };
    let mut published = publish(&calls, &tools, client, shutdown).await;
    if let Some(first) = first {
        first();
    }
    let ended = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break false,
            quit = &mut waiting => {
                tracing::info!(server = %name, reason = ?quit, "MCP connection ended");
                break true;
            }
            _ = handler.list_changed.notified() => {
                match calls.peer.list_all_tools().await {
                    Ok(listed) if listed != tools => {
                        tools = listed;
                        if let Some(old) = published.take() { old.stop().await; }
                        published = publish(&calls, &tools, client, shutdown).await;
                        tracing::info!(server = %name, tools = tools.len(), "MCP tools changed");
                    }
                    Ok(_) => {}
                    Err(err) => tracing::warn!(server = %name, error = %err, "cannot list the changed tools"),
                }
            }
        }
    };
    gone.cancel();
    if let Some(published) = published {
        published.stop().await;
    }
    if !ended {
        stop.cancel();
        let _ = waiting.await;
    }
}

/// What a call needs of its server's connection.
#[derive(Debug, Clone)]
struct Calls {
    server: String,
    peer: Peer<RoleClient>,
    gone: CancellationToken,
    timeout: Duration,
}

impl Calls {
    async fn call(&self, tool: &str, body: Value) -> Result<Reply, ErrorBody> {
        let arguments =
            tools::arguments(body).map_err(|e| ErrorBody::new(ErrorCode::BadRequest, e))?;
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        let server = &self.server;
        let started = Instant::now();
        let reply = tokio::select! {
            _ = self.gone.cancelled() => Reply::error(stopped(server, tool)),
            answer = tokio::time::timeout(self.timeout, self.peer.call_tool(params)) => match answer {
                Ok(Ok(result)) => tools::reply(&result),
                Ok(Err(ServiceError::TransportClosed | ServiceError::Cancelled { .. })) => {
                    Reply::error(stopped(server, tool))
                }
                Ok(Err(err)) => Reply::error(format!("MCP server {server} failed the call of {tool}: {}",
                    tools::cut(&err.to_string(), 2048))),
                Err(_) => Reply::error(format!(
                    "MCP server {server} did not answer the call of {tool} within {}",
                    humantime::format_duration(self.timeout)
                )),
            },
        };
        tracing::debug!(server = %server, tool, is_error = reply.is_error,
            seconds = started.elapsed().as_secs_f64(), "MCP tool call");
        Ok(reply)
    }
}

fn stopped(server: &str, tool: &str) -> String {
    format!("MCP server {server} stopped during the call of {tool}; it is being started again")
}

/// A server's micro service, served until [`Published::stop`].
struct Published {
    token: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Published {
    async fn stop(self) {
        self.token.cancel();
        let _ = self.task.await;
    }
}

/// Registers the micro service of one server's tools (`None` when it has none or the bus
/// refused it; logged).
async fn publish(
    calls: &Calls,
    tools: &[Tool],
    client: &Client,
    shutdown: &CancellationToken,
) -> Option<Published> {
    let server = &calls.server;
    let mut endpoints = Vec::new();
    let mut seen = HashSet::new();
    for tool in tools {
        let bridged = match tools::bridge(server, tool) {
            Ok(b) => b,
            Err(why) => {
                tracing::warn!(server = %server, tool = %tools::cut(&tool.name, 80), %why, "MCP tool left out");
                continue;
            }
        };
        if !seen.insert(bridged.endpoint.clone()) {
            continue;
        }
        let calls = calls.clone();
        let tool_name = Arc::<str>::from(bridged.tool.as_str());
        let handler = move |body: Value, _ctx: RequestContext| {
            let calls = calls.clone();
            let tool_name = tool_name.clone();
            async move { calls.call(&tool_name, body).await }
        };
        let metadata: Vec<(&str, &str)> = bridged
            .metadata
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let Some(endpoint) = interned(&bridged.endpoint) else {
            tracing::warn!(server = %server, "too many distinct MCP tool names; the rest are left out");
            break;
        };
        endpoints.push(
            Endpoint::json(endpoint, format!("cyrene.tool.{endpoint}"), handler)
                .metadata(&metadata),
        );
    }
    if endpoints.is_empty() {
        return None;
    }
    let spec = ServiceSpec::new(
        SERVICE_NAME,
        env!("CARGO_PKG_VERSION"),
        format!("Tools of the MCP server {server}"),
    )
    .with_metadata("cyrene.mcp.server", server.clone());
    let token = shutdown.child_token();
    match Host::start(client, spec, endpoints, token.clone()).await {
        Ok(host) => Some(Published {
            token,
            task: tokio::spawn(host.run()),
        }),
        Err(err) => {
            tracing::error!(server = %server, error = %err, "cannot register the MCP tools");
            None
        }
    }
}

/// `name` as a `&'static str` (endpoint names are static): each distinct name is leaked once,
/// so a server that changes its list again and again costs nothing more; past
/// [`MAX_NAMES`] distinct names, `None`.
fn interned(name: &str) -> Option<&'static str> {
    static NAMES: OnceLock<Mutex<BTreeMap<String, &'static str>>> = OnceLock::new();
    let names = NAMES.get_or_init(Mutex::default);
    let mut names = names
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(kept) = names.get(name) {
        return Some(kept);
    }
    if names.len() >= MAX_NAMES {
        return None;
    }
    let kept: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.insert(name.to_owned(), kept);
    Some(kept)
}

/// The most distinct endpoint names one bridge process registers.
const MAX_NAMES: usize = 10_000;
