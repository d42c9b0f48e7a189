//! `cyrene memory`: an operator lists, shows and forgets a persona's memory (docs/memory.md),
//! on `cyrene.memory.read` and `cyrene.memory.forget` — subjects only the `cyrene-operator`
//! NATS user may publish besides the loop worker's reads, so this command connects as the
//! operator (replies on `_INBOX_cyrene-operator`).

use super::request_error;
use super::{CliError, parse_duration};
use async_nats::Client;
use clap::{Args, Subcommand};
use cyrene_bus::request_json;
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::memory::{
    MEMORY_FORGET, MEMORY_READ, MemoryEntry, MemoryForgetAck, MemoryForgetRequest,
    MemoryReadRequest, MemoryReadResponse,
};
use std::time::Duration;

#[derive(Debug, Args)]
pub struct MemoryArgs {
    #[command(subcommand)]
    pub command: MemoryCommand,
    /// The persona whose memory it is.
    #[arg(long, global = true, default_value = "cyrene")]
    pub persona: String,
    /// How long to wait for the answer.
    #[arg(long, global = true, default_value = "5s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Subcommand)]
pub enum MemoryCommand {
    /// List the persona's long-term memory (and a session's working memory with --session),
    /// one entry a line: id, when, where it came from, text. The newest 50 of each kind.
    List {
        /// Also the working memory of this session.
        #[arg(long)]
        session: Option<String>,
        /// One JSON object per entry.
        #[arg(long)]
        json: bool,
    },
    /// Print one entry as JSON (among the entries `list` shows).
    Show {
        id: String,
        /// The session whose working memory holds it.
        #[arg(long)]
        session: Option<String>,
    },
    /// Delete one entry.
    Forget { id: String },
}

/// Checks an entry id as the memory service issues them before anything is sent.
fn check_id(id: &str) -> Result<(), CliError> {
    let ok = id.strip_prefix("m-").is_some_and(|rest| {
        !rest.is_empty() && rest.len() <= 64 && rest.chars().all(ids::is_token_char)
    });
    match ok {
        true => Ok(()),
        false => Err(CliError::Usage(
            "not a memory entry id (m- and up to 64 of A-Z a-z 0-9 _ -)".to_owned(),
        )),
    }
}

async fn read(
    client: &Client,
    args: &MemoryArgs,
    session: Option<&str>,
) -> Result<MemoryReadResponse, CliError> {
    if let Some(s) = session {
        ids::validate(IdKind::Session, s)
            .map_err(|e| CliError::Usage(format!("--session: {e}")))?;
    }
    let req = MemoryReadRequest {
        persona_id: args.persona.clone(),
        session_id: session.unwrap_or_default().to_owned(),
    };
    request_json(client, MEMORY_READ, &req, args.timeout)
        .await
        .map_err(request_error)
}

/// One line of `list`: id, time, source (or `by hand`), text.
fn line(kind: &str, entry: &MemoryEntry) -> String {
    let when = std::time::UNIX_EPOCH + Duration::from_millis(entry.created_unix_ms);
    let source = match &entry.source {
        Some(s) => format!("turn {} of {}", s.turn_id, s.session_id),
        None => "by hand".to_owned(),
    };
    format!(
        "{}  {kind}  {}  {source}  {}",
        entry.id,
        humantime::format_rfc3339_seconds(when),
        entry.text
    )
}

pub async fn run(client: Client, args: MemoryArgs) -> Result<(), CliError> {
    ids::validate(IdKind::Agent, &args.persona)
        .map_err(|e| CliError::Usage(format!("--persona: {e}")))?;
    match &args.command {
        MemoryCommand::List { session, json } => {
            let read = read(&client, &args, session.as_deref()).await?;
            let entries = read
                .working_memory
                .iter()
                .map(|e| ("working", e))
                .chain(read.memory.iter().map(|e| ("long-term", e)));
            let mut any = false;
            for (kind, entry) in entries {
                any = true;
                match json {
                    true => println!("{}", serde_json::to_string(entry).unwrap_or_default()),
                    false => println!("{}", line(kind, entry)),
                }
            }
            if !any {
                eprintln!("no memory for persona {}", args.persona);
            }
            Ok(())
        }
        MemoryCommand::Show { id, session } => {
            check_id(id)?;
            let read = read(&client, &args, session.as_deref()).await?;
            let entry = read
                .working_memory
                .iter()
                .chain(&read.memory)
                .find(|e| &e.id == id)
                .ok_or_else(|| {
                    CliError::Failed(format!(
                        "no entry {id} among the newest of persona {}",
                        args.persona
                    ))
                })?;
            println!(
                "{}",
                serde_json::to_string_pretty(entry).unwrap_or_default()
            );
            Ok(())
        }
        MemoryCommand::Forget { id } => {
            check_id(id)?;
            let req = MemoryForgetRequest {
                persona_id: args.persona.clone(),
                id: id.clone(),
            };
            let ack: MemoryForgetAck = request_json(&client, MEMORY_FORGET, &req, args.timeout)
                .await
                .map_err(request_error)?;
            match ack.forgotten {
                true => {
                    println!("forgotten {id}");
                    Ok(())
                }
                false => Err(CliError::Failed(format!(
                    "persona {} has no entry {id}",
                    args.persona
                ))),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_ids_are_refused_before_anything_is_sent() {
        assert!(check_id("m-0192abc").is_ok());
        for bad in ["", "m-", "x-1", "m-a\u{0}b", "m-a.b", "m-a b"] {
            assert!(matches!(check_id(bad), Err(CliError::Usage(_))), "{bad:?}");
        }
        assert!(check_id(&format!("m-{}", "x".repeat(65))).is_err());
    }
}
