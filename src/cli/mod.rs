//! Command definitions and dispatch for the `cyrene` CLI.

mod agent;
mod approvals;
mod chat;
mod comm;
mod documents;
mod live;
mod mcp;
mod memory;
mod person;
mod probe;
mod session;
mod up;
mod web;

use clap::{Parser, Subcommand};
use cyrene_bus::{ConnectMode, RequestError};
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "cyrene",
    version,
    about = "Client of a Cyrene agent runtime on NATS"
)]
pub struct Cli {
    #[command(flatten)]
    pub bus: cyrene_bus::BusArgs,
    /// Act as this person (docs/security.md, "People"): sessions `<person>.<name>` (a session
    /// given without a dot is taken as theirs), requests on `cyrene.person.<person>.…`, replies
    /// on the private inbox prefix `_INBOX_person-<person>`.
    #[arg(long, env = "CYRENE_CLI_PERSON", global = true)]
    pub person: Option<String>,
    /// Inbox prefix for replies: `_INBOX_cyrene-cli`, `_INBOX_cyrene-operator` for `probe`, or
    /// `_INBOX_person-<person>` with --person.
    #[arg(long, env = "CYRENE_CLI_INBOX_PREFIX", global = true)]
    pub inbox_prefix: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Ask agent TO a question as agent FROM and print the reply text.
    Ask(comm::AskArgs),
    /// Send an event as agent FROM: to agent TO, or broadcast without --to.
    Emit(comm::EmitArgs),
    /// Run a smoke-test agent: answer every ask with TEXT, print every ask and event as JSON.
    Agent(agent::AgentArgs),
    /// List the micro services on the bus ($SRV.INFO and $SRV.STATS), like `nats micro ls`.
    Probe(probe::ProbeArgs),
    /// Run every service in this process (SQLite and the offline scripted demo by default).
    Up(up::UpArgs),
    /// Chat in a session: type while a turn runs and it is steered in; tool calls show live.
    Chat(chat::ChatArgs),
    /// Play a short scripted conversation: a tool call, a steered message, the checkpoints.
    Demo(chat::DemoArgs),
    /// Send one user message to a session and print the ack (message id, seq, disposition).
    Send(session::SendArgs),
    /// Follow live session events (tool calls, steer acks, answers).
    Events(session::EventsArgs),
    /// Print a session's transcript.
    History(session::HistoryArgs),
    /// List a session's tool calls that wait for approval, then the last decided ones.
    Approvals(approvals::ApprovalsArgs),
    /// Approve a tool call that waits (the turn continues with it).
    Approve(approvals::DecideArgs),
    /// Deny a tool call that waits (the model is told it did not run, with --reason).
    Deny(approvals::DecideArgs),
    /// List the checkpoints of a session (or `session#leg`), most recently written first.
    Checkpoints(session::CheckpointsArgs),
    /// A persona's memory (operators): list, show and forget entries (docs/memory.md).
    Memory(memory::MemoryArgs),
    /// Serve the web chat (docs/web.md); the browser talks to NATS itself, over WebSocket.
    Web(web::WebArgs),
    /// Serve Cyrene over MCP on stdio (docs/tools.md): a tool ask_<persona> per persona, your
    /// sessions' transcripts as resources; speaks as --person.
    Mcp(mcp::McpArgs),
}

/// A failed command, with the exit code it maps to.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("{0}")]
    Failed(String),
    /// A setting that cannot work (an unparsable `NATS_URL`, contradicting credentials).
    #[error("{0}")]
    Usage(String),
    #[error("timeout: {0}")]
    Timeout(String),
    #[error("no responder: {0}")]
    NoResponder(String),
    #[error("error reply: {0}")]
    Remote(String),
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Failed(_) => 1,
            CliError::Usage(_) => 2,
            CliError::Timeout(_) => 3,
            CliError::NoResponder(_) => 4,
            CliError::Remote(_) => 5,
        }
    }
}

/// Maps a request failure onto the CLI's exit codes.
pub fn request_error(err: RequestError) -> CliError {
    match err {
        RequestError::Timeout { .. } => CliError::Timeout(err.to_string()),
        RequestError::NoResponders { .. } => CliError::NoResponder(err.to_string()),
        RequestError::Remote(body) => CliError::Remote(body.to_string()),
        other => CliError::Failed(other.to_string()),
    }
}

pub async fn run(cli: Cli) -> Result<(), CliError> {
    person::set(cli.person.clone()).map_err(CliError::Failed)?;
    // The web server serves files and never connects to NATS (docs/web.md).
    if let Command::Web(args) = cli.command {
        return web::run(args).await;
    }
    // `probe` is an operator's command: its replies (every service's $SRV.STATS) come to the
    // operator's own inbox prefix, which no client user may subscribe to.
    let name = match (&cli.command, person::person()) {
        (Command::Probe(_) | Command::Memory(_), None) => person::OPERATOR_CONNECTION.to_owned(),
        _ => person::connection_name(),
    };
    let mut config = cli
        .bus
        .config(&name, ConnectMode::Client)
        .map_err(CliError::Usage)?;
    config.inbox = cli.inbox_prefix.clone();
    let client = cyrene_bus::connect(&config).await.map_err(|e| {
        let at = config.redacted_urls().join(",");
        CliError::Failed(format!("cannot connect to NATS at {at}: {e}"))
    })?;
    let result = match cli.command {
        Command::Ask(args) => comm::ask(client.clone(), args).await,
        Command::Emit(args) => comm::emit(client.clone(), args).await,
        Command::Agent(args) => agent::run(client.clone(), args).await,
        Command::Probe(args) => probe::run(client.clone(), args).await,
        Command::Memory(args) => memory::run(client.clone(), args).await,
        Command::Mcp(args) => mcp::run(client.clone(), args).await,
        Command::Up(args) => up::run(&cli.bus, args).await,
        Command::Chat(args) => chat::chat(client.clone(), args).await,
        Command::Demo(args) => chat::demo(client.clone(), args).await,
        Command::Send(args) => session::send(client.clone(), args).await,
        Command::Events(args) => session::events(client.clone(), args).await,
        Command::History(args) => session::history(client.clone(), args).await,
        Command::Checkpoints(args) => session::checkpoints(client.clone(), args).await,
        Command::Approvals(args) => approvals::list(client.clone(), args).await,
        Command::Approve(args) => {
            approvals::decide(
                client.clone(),
                args,
                cyrene_protocol::approval::Decision::Approve,
            )
            .await
        }
        Command::Deny(args) => {
            approvals::decide(
                client.clone(),
                args,
                cyrene_protocol::approval::Decision::Deny,
            )
            .await
        }
        Command::Web(_) => Ok(()),
    };
    // Make sure published messages leave before the process exits.
    let _ = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
    result
}

/// Waits (at most 30 s) until every named micro service answers `$SRV.PING`.
pub async fn wait_for_services(
    client: &async_nats::Client,
    names: &[&str],
) -> Result<(), CliError> {
    for name in names {
        let answered = cyrene_bus::discovery::wait_for(
            client,
            name,
            Duration::from_secs(30),
            Duration::from_millis(500),
        )
        .await;
        if !answered {
            return Err(CliError::NoResponder(format!(
                "{name} did not answer within 30s (is `cyrene up` running?)"
            )));
        }
    }
    Ok(())
}

/// Parses `5s`, `250ms`, `1m` (humantime).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// Parses a JSON argument.
pub fn parse_json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("invalid JSON {s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        // every subcommand's flags are unique (`cyrene up` flattens the web page's flags too)
        Cli::command().debug_assert();
    }
}
