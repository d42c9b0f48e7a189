//! `cyrene ask` and `cyrene emit`.

use super::{CliError, parse_duration, parse_json};
use async_nats::Client;
use clap::Args;
use cyrene_comm::{AskError, AskOptions, Probe};
use serde_json::Value;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct AskArgs {
    /// The asking agent id.
    #[arg(long)]
    pub from: String,
    /// The agent to ask.
    #[arg(long)]
    pub to: String,
    /// How long to wait for the reply (at most 30 s: the comm protocol caps every ask there).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Structured data sent with the question (JSON).
    #[arg(long, value_parser = parse_json)]
    pub data: Option<Value>,
    /// Print the whole reply as JSON instead of its text.
    #[arg(long)]
    pub json: bool,
    /// The question.
    pub question: String,
}

#[derive(Debug, Args)]
pub struct EmitArgs {
    /// The emitting agent id.
    #[arg(long)]
    pub from: String,
    /// The receiving agent; broadcast to every agent when absent.
    #[arg(long)]
    pub to: Option<String>,
    /// Event name, e.g. task.progress.
    pub name: String,
    /// Event data (JSON).
    #[arg(value_parser = parse_json)]
    pub data: Option<Value>,
}

pub async fn ask(client: Client, args: AskArgs) -> Result<(), CliError> {
    let probe = Probe::new(client, args.from);
    let options = AskOptions {
        data: args.data.unwrap_or(Value::Null),
        timeout: Some(args.timeout),
        cancel: None,
        chain: Vec::new(),
    };
    match probe.ask_with(&args.to, &args.question, options).await {
        Ok(reply) if args.json => {
            println!("{}", serde_json::to_string(&reply).unwrap_or_default());
            Ok(())
        }
        Ok(reply) => {
            println!("{}", reply.text);
            Ok(())
        }
        Err(err @ AskError::Timeout { .. }) => Err(CliError::Timeout(err.to_string())),
        Err(err @ AskError::NoReply { .. }) => Err(CliError::NoResponder(err.to_string())),
        Err(err @ AskError::Remote { .. }) => Err(CliError::Remote(err.to_string())),
        Err(err) => Err(CliError::Failed(err.to_string())),
    }
}

pub async fn emit(client: Client, args: EmitArgs) -> Result<(), CliError> {
    let probe = Probe::new(client, args.from);
    let data = args.data.unwrap_or(Value::Null);
    let sent = match &args.to {
        Some(to) => probe.emit(to, &args.name, data).await,
        None => probe.broadcast(&args.name, data).await,
    };
    sent.map_err(|e| CliError::Failed(e.to_string()))
}
