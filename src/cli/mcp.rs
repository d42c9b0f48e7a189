//! `cyrene mcp`: Cyrene as an MCP server on stdin/stdout (docs/tools.md, "Using Cyrene from MCP
//! clients"), for desktop assistants and IDEs.
//!
//! # Invariants
//! - Identity is the NATS identity it runs with: `--person <id>` asks as that person (a comm ask
//!   `cyrene.agent.<id>.<persona>.ask`, answered through a real turn in the person's own ask
//!   session) and lists only that person's sessions; nothing an MCP client sends names who asks.
//! - stdout carries MCP only: logs go to stderr.
//! - A failed ask is an error result (`isError`), never a broken connection.

use super::CliError;
use super::person;
use clap::Args;
use cyrene_bus::request_json;
use cyrene_comm::{AskOptions, Probe};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::session::{
    HistoryRequest, HistoryResponse, SessionListRequest, SessionListResponse,
};
use cyrene_protocol::subjects;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListResourcesResult, ListToolsResult, PaginatedRequestParams, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::{ErrorData, ServerHandler, ServiceExt};
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// The URI prefix of a session's transcript resource.
const TRANSCRIPT_URI: &str = "cyrene://session/";
/// The most transcript entries one resource read returns (the newest).
const TRANSCRIPT_LIMIT: u32 = 200;

#[derive(Debug, Args)]
pub struct McpArgs {
    /// The personas offered as tools `ask_<persona>` (comma-separated).
    #[arg(
        long,
        env = "CYRENE_MCP_PERSONAS",
        value_delimiter = ',',
        default_value = "cyrene"
    )]
    pub personas: Vec<String>,
    /// How long one ask may take (the comm protocol caps every ask at 30 s).
    #[arg(long, env = "CYRENE_MCP_ASK_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub ask_timeout: Duration,
    /// Serve MCP over streamable HTTP on this address (`http://<addr>/mcp`) instead of stdio;
    /// every request must carry `Authorization: Bearer <key>` (--key).
    #[arg(long, env = "CYRENE_MCP_HTTP_ADDR")]
    pub http: Option<std::net::SocketAddr>,
    /// The key HTTP clients must present (at least 16 characters); required with --http.
    #[arg(long, env = "CYRENE_MCP_KEY", hide_env_values = true)]
    pub key: Option<String>,
    /// Host names the HTTP server answers to (its DNS-rebinding guard); behind a proxy, the name
    /// clients use.
    #[arg(
        long,
        env = "CYRENE_MCP_ALLOWED_HOSTS",
        value_delimiter = ',',
        default_value = "localhost,127.0.0.1,::1"
    )]
    pub allowed_hosts: Vec<String>,
}

/// The shortest key `--http` accepts.
const MIN_KEY_CHARS: usize = 16;

/// Serves MCP on stdio until the client closes it.
pub async fn run(client: async_nats::Client, args: McpArgs) -> Result<(), CliError> {
    let Some(asker) = person::person() else {
        return Err(CliError::Usage(
            "cyrene mcp speaks as a person: give --person <id> (CYRENE_CLI_PERSON), the NATS \
             identity it runs with"
                .into(),
        ));
    };
    for persona in &args.personas {
        ids::validate(IdKind::Agent, persona)
            .map_err(|e| CliError::Usage(format!("--personas: {e}")))?;
    }
    let server = CyreneMcp {
        client,
        asker: asker.to_owned(),
        personas: Arc::new(args.personas),
        ask_timeout: args.ask_timeout,
    };
    if let Some(addr) = args.http {
        let key = args.key.unwrap_or_default();
        if key.chars().count() < MIN_KEY_CHARS {
            return Err(CliError::Usage(format!(
                "--http needs --key (CYRENE_MCP_KEY) of at least {MIN_KEY_CHARS} characters"
            )));
        }
        return serve_http(server, addr, key, args.allowed_hosts).await;
    }
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| CliError::Failed(format!("MCP handshake: {e}")))?;
    running
        .waiting()
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    Ok(())
}

/// Serves MCP over streamable HTTP at `/mcp` until Ctrl-C; a request without the key is `401`
/// before MCP sees it.
async fn serve_http(
    server: CyreneMcp,
    addr: std::net::SocketAddr,
    key: String,
    allowed_hosts: Vec<String>,
) -> Result<(), CliError> {
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    let config = StreamableHttpServerConfig::default().with_allowed_hosts(allowed_hosts);
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let expected = Arc::new(format!("Bearer {key}"));
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let expected = expected.clone();
                async move {
                    let given = request
                        .headers()
                        .get(axum::http::header::AUTHORIZATION)
                        .map(|v| v.as_bytes())
                        .unwrap_or_default();
                    if !same_key(given, expected.as_bytes()) {
                        return axum::http::Response::builder()
                            .status(axum::http::StatusCode::UNAUTHORIZED)
                            .body(axum::body::Body::from("missing or wrong key\n"))
                            .unwrap_or_default();
                    }
                    next.run(request).await
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::Failed(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| CliError::Failed(e.to_string()))?;
    eprintln!("cyrene mcp: MCP over streamable HTTP on http://{bound}/mcp");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(|e| CliError::Failed(e.to_string()))
}

/// Compares a presented key with the expected one in time independent of where they differ.
fn same_key(given: &[u8], expected: &[u8]) -> bool {
    given.len() == expected.len()
        && given
            .iter()
            .zip(expected)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

#[derive(Debug, Clone)]
struct CyreneMcp {
    client: async_nats::Client,
    asker: String,
    personas: Arc<Vec<String>>,
    ask_timeout: Duration,
}

impl CyreneMcp {
    fn tools(&self) -> Vec<Tool> {
        let schema = json!({"type": "object",
            "properties": {"question": {"type": "string", "description": "what to ask"}},
            "required": ["question"]});
        let schema = Arc::new(schema.as_object().cloned().unwrap_or_default());
        self.personas
            .iter()
            .map(|p| {
                Tool::new(
                    format!("ask_{p}"),
                    format!("Ask {p} a question; the answer comes from a turn in your own session with {p}."),
                    schema.clone(),
                )
            })
            .collect()
    }

    async fn ask(&self, persona: &str, question: &str) -> CallToolResult {
        let probe = Probe::new(self.client.clone(), self.asker.clone());
        let options = AskOptions {
            timeout: Some(self.ask_timeout),
            ..Default::default()
        };
        match probe.ask_with(persona, question, options).await {
            Ok(reply) => CallToolResult::success(vec![ContentBlock::text(reply.text)]),
            Err(err) => CallToolResult::error(vec![ContentBlock::text(err.to_string())]),
        }
    }

    async fn sessions(&self) -> Result<SessionListResponse, ErrorData> {
        let subject = subjects::person(&self.asker, subjects::PERSON_SESSION_LIST)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        request_json(
            &self.client,
            &subject,
            &SessionListRequest { limit: None },
            Duration::from_secs(10),
        )
        .await
        .map_err(|e| ErrorData::internal_error(e.to_string(), None))
    }

    async fn transcript(&self, session_id: &str) -> Result<String, ErrorData> {
        // Only the person's own sessions: the subject is theirs, the orchestrator checks it.
        let subject = subjects::person(&self.asker, subjects::PERSON_SESSION_HISTORY)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let history: HistoryResponse = request_json(
            &self.client,
            &subject,
            &HistoryRequest {
                session_id: session_id.to_owned(),
                limit: Some(TRANSCRIPT_LIMIT),
                before_seq: None,
            },
            Duration::from_secs(10),
        )
        .await
        .map_err(|e| ErrorData::resource_not_found(e.to_string(), None))?;
        let mut text = String::new();
        for entry in &history.messages {
            let who = match entry.message.sender_name.as_str() {
                "" => format!("{:?}", entry.message.role).to_lowercase(),
                name => name.to_owned(),
            };
            text.push_str(&format!(
                "#{} {who}: {}\n",
                entry.seq,
                entry.message.text_content()
            ));
        }
        Ok(text)
    }
}

impl ServerHandler for CyreneMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new("cyrene", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "Cyrene's personas as tools (ask_<persona>); your sessions' transcripts as resources.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let persona = request
            .name
            .strip_prefix("ask_")
            .filter(|p| self.personas.iter().any(|known| known == p));
        let Some(persona) = persona else {
            return Err(ErrorData::invalid_params(
                format!(
                    "no tool {:?}",
                    request.name.chars().take(80).collect::<String>()
                ),
                None,
            ));
        };
        let question = request
            .arguments
            .as_ref()
            .and_then(|a| a.get("question"))
            .and_then(|q| q.as_str());
        // A wrong argument is the model's to correct: an error result, not a protocol error.
        let Some(question) = question.filter(|q| !q.trim().is_empty()) else {
            return Ok(CallToolResult::error(vec![ContentBlock::text(
                "give a non-empty string `question`",
            )])
            .into());
        };
        Ok(self.ask(persona, question).await.into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        let sessions = self.sessions().await?;
        let resources = sessions
            .sessions
            .into_iter()
            .map(|s| {
                let mut r = Resource::new(
                    format!("{TRANSCRIPT_URI}{}", s.session_id),
                    format!("transcript of {}", s.session_id),
                );
                r.mime_type = Some("text/plain".into());
                r
            })
            .collect();
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        let Some(session_id) = request
            .uri
            .strip_prefix(TRANSCRIPT_URI)
            .filter(|s| ids::validate(IdKind::Session, s).is_ok())
        else {
            return Err(ErrorData::resource_not_found(
                "no such resource: transcripts are cyrene://session/<session id>",
                None,
            ));
        };
        let text = self.transcript(session_id).await?;
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, request.uri.clone())]).into())
    }
}
