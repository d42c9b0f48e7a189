//! `cyrene agent`: a smoke-test responder.

use super::CliError;
use async_nats::Client;
use clap::Args;
use cyrene_comm::{Answer, Handler, Probe};
use cyrene_protocol::ErrorBody;
use cyrene_protocol::comm::{Ask, Event};
use serde_json::json;
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The agent id to answer as.
    #[arg(long)]
    pub id: String,
    /// The text every ask is answered with.
    #[arg(long)]
    pub reply: String,
}

struct Fixed {
    reply: String,
}

impl Handler for Fixed {
    async fn on_ask(&self, ask: Ask) -> Result<Answer, ErrorBody> {
        println!("{}", json!({"ask": ask}));
        Ok(Answer::text(self.reply.clone()))
    }

    async fn on_event(&self, event: Event) {
        println!("{}", json!({"event": event}));
    }
}

pub async fn run(client: Client, args: AgentArgs) -> Result<(), CliError> {
    let handle = Probe::new(client, args.id.clone())
        .serve(Arc::new(Fixed { reply: args.reply }))
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    eprintln!("cyrene: agent {:?} is listening (Ctrl-C to stop)", args.id);
    cyrene_runtime::signal::signalled().await;
    handle.stop().await;
    Ok(())
}
