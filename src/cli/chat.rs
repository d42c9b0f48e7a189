//! `cyrene chat` (interactive) and `cyrene demo` (a short scripted conversation).
//!
//! Both print the session's live events as they happen — tool calls, steer acks, answers — while
//! sending what is typed. Typing while a turn runs does not wait: the message is acknowledged as
//! `pending` and steered into the running turn at its next boundary (or answered next).

use super::CliError;
use super::session::{describe, send_message};
use async_nats::Client;
use clap::Args;
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::session::{Disposition, SendRequest, SessionEvent, SessionEventType};
use cyrene_protocol::{ids, subjects};
use futures::StreamExt;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Notify;

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// The session (one is made up when absent).
    #[arg(long, short)]
    pub session: Option<String>,
    /// This client's id.
    #[arg(long, default_value = "cli")]
    pub client: String,
    /// Show every step, not only tool calls, steering and answers.
    #[arg(long, short)]
    pub verbose: bool,
}

/// What the event stream has shown so far: turns in flight and messages not yet taken in.
#[derive(Default)]
struct Progress {
    running: HashSet<String>,
    waiting: HashSet<String>,
    seen_tool_call: bool,
    changed: Arc<Notify>,
}

impl Progress {
    fn idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }
}

struct Session {
    client: Client,
    id: String,
    client_id: String,
    progress: Arc<Mutex<Progress>>,
    changed: Arc<Notify>,
}

impl Session {
    async fn open(
        client: Client,
        id: String,
        client_id: String,
        verbose: bool,
    ) -> Result<Session, CliError> {
        let subject = subjects::session_events(&id).map_err(|e| CliError::Failed(e.to_string()))?;
        let mut events = client
            .subscribe(subject)
            .await
            .map_err(|e| CliError::Failed(e.to_string()))?;
        let _ = client.flush().await;
        let changed = Arc::new(Notify::new());
        let progress = Arc::new(Mutex::new(Progress {
            changed: changed.clone(),
            ..Default::default()
        }));
        let p = progress.clone();
        tokio::spawn(async move {
            let mut live = super::live::LiveText::default();
            while let Some(m) = events.next().await {
                let Ok(event) = serde_json::from_slice::<SessionEvent>(&m.payload) else {
                    continue;
                };
                if (verbose || event.kind != SessionEventType::Step)
                    && live.handle(&event, "  ")
                    && let Some(line) = describe(&event)
                {
                    println!("  {line}");
                }
                let Ok(mut p) = p.lock() else { break };
                match event.kind {
                    SessionEventType::TurnStarted => {
                        p.running.insert(event.turn_id.clone());
                        for id in &event.message_ids {
                            p.waiting.remove(id);
                        }
                    }
                    SessionEventType::SteerAck => {
                        for id in &event.message_ids {
                            p.waiting.remove(id);
                        }
                    }
                    SessionEventType::TurnEnded => {
                        p.running.remove(&event.turn_id);
                    }
                    SessionEventType::ToolCall => p.seen_tool_call = true,
                    _ => {}
                }
                p.changed.notify_waiters();
            }
        });
        Ok(Session {
            client,
            id,
            client_id,
            progress,
            changed,
        })
    }

    /// Sends `text`; `echo` prints it first (the demo; a terminal already shows what was typed).
    async fn say(&self, text: &str, echo: bool) -> Result<(), CliError> {
        self.say_with(text, Vec::new(), String::new(), echo).await
    }

    /// Sends `text` with `attachments` (document parts) after it, addressed to `persona` (empty:
    /// the persona the session last used; docs/orchestrator.md, "Several personas").
    async fn say_with(
        &self,
        text: &str,
        attachments: Vec<Part>,
        persona: String,
        echo: bool,
    ) -> Result<(), CliError> {
        let mut message = Message::text(Role::User, text);
        if text.is_empty() {
            message.content.clear();
        }
        message.content.extend(attachments);
        let request = SendRequest {
            session_id: self.id.clone(),
            message,
            client_id: self.client_id.clone(),
            idempotency_key: ids::new_id(),
            env: None,
            parallel: false,
            when_busy: None,
            persona,
            context_only: false,
        };
        if echo {
            println!("you: {text}");
        }
        let ack = send_message(&self.client, &request, Duration::from_secs(10)).await?;
        if let Ok(mut p) = self.progress.lock() {
            match ack.disposition {
                Disposition::Pending => {
                    p.waiting.insert(ack.message_id.clone());
                    println!("  (a turn is running: this message will be steered into it)");
                }
                Disposition::ParallelLeg => println!("  (answered in a parallel leg)"),
                // Only the bridge sends context-only messages; the CLI never does.
                Disposition::ContextOnly => {}
                Disposition::TurnStarted => {
                    p.running.insert(ack.turn_id.clone());
                }
            }
        }
        Ok(())
    }

    /// Waits until `done` holds, at most `within`.
    async fn wait(&self, within: Duration, done: impl Fn(&Progress) -> bool) -> bool {
        tokio::time::timeout(within, async {
            loop {
                let notified = self.changed.notified();
                if self.progress.lock().map(|p| done(&p)).unwrap_or(true) {
                    return;
                }
                notified.await;
            }
        })
        .await
        .is_ok()
    }
}

pub async fn chat(client: Client, args: ChatArgs) -> Result<(), CliError> {
    let id = super::person::session(
        &args
            .session
            .unwrap_or_else(|| format!("chat-{}", ids::new_id())),
    );
    let session = Session::open(client, id.clone(), args.client, args.verbose).await?;
    eprintln!(
        "cyrene: chatting in session {id} (Ctrl-D to leave). Type while she works: it is steered in. \
         /attach PATH uploads a file; it goes with your next message. /persona ID: your next \
         message (and the session from then on) is answered by that persona."
    );
    let mut attachments: Vec<Part> = Vec::new();
    let mut persona = String::new();
    let interactive = std::io::IsTerminal::is_terminal(&std::io::stdin());
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    loop {
        let line = tokio::select! {
            _ = cyrene_runtime::signal::signalled() => break,
            line = lines.next_line() => line,
        };
        match line {
            Ok(Some(text)) if text.trim().is_empty() => continue,
            Ok(Some(text)) if text.trim_start().starts_with("/persona") => {
                let id = text.trim_start().trim_start_matches("/persona").trim();
                if id.is_empty() {
                    eprintln!("cyrene: /persona ID");
                    continue;
                }
                persona = id.to_owned();
                eprintln!("cyrene: your next message goes to persona {id}");
            }
            Ok(Some(text)) if text.trim_start().starts_with("/attach") => {
                let path = text.trim_start().trim_start_matches("/attach").trim();
                if path.is_empty() {
                    eprintln!("cyrene: /attach PATH");
                    continue;
                }
                let upload = super::documents::upload_file(
                    &session.client,
                    &session.id,
                    std::path::Path::new(path),
                    Duration::from_secs(30),
                );
                match upload.await {
                    Ok(document) => {
                        if let Part::Document {
                            name, mime, size, ..
                        } = &document.part
                        {
                            eprintln!(
                                "cyrene: attached {path} as {name} ({mime}, {size} bytes); it goes with your next message"
                            );
                        }
                        attachments.push(document.part);
                    }
                    Err(err) => eprintln!("cyrene: cannot attach {path}: {err}"),
                }
            }
            Ok(Some(text)) => {
                let parts = std::mem::take(&mut attachments);
                let to = std::mem::take(&mut persona);
                session
                    .say_with(text.trim(), parts, to, !interactive)
                    .await?;
            }
            Ok(None) | Err(_) => break,
        }
    }
    if !session.wait(Duration::from_secs(120), Progress::idle).await {
        eprintln!("cyrene: leaving with turns still running");
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// The session to play in (a fresh one when absent).
    #[arg(long, short)]
    pub session: Option<String>,
}

/// Plays: a question that makes her call a (slow) tool; a second message typed while the tool
/// runs, which is steered into the same turn; then the checkpoints and the transcript.
pub async fn demo(client: Client, args: DemoArgs) -> Result<(), CliError> {
    let id = super::person::session(
        &args
            .session
            .unwrap_or_else(|| format!("demo-{}", ids::new_id())),
    );
    super::wait_for_services(
        &client,
        &[
            "cyrene-orchestrator",
            "cyrene-loop-worker",
            "cyrene-model-gateway",
            "cyrene-checkpoint-store",
            // The offline demo's search_notes tool (`cyrene up` without real providers).
            "cyrene-demo-tools",
        ],
    )
    .await?;
    let session = Session::open(client.clone(), id.clone(), "demo".into(), false).await?;
    println!("== session {id}");
    session
        .say("Could you search my notes about the picnic?", true)
        .await?;
    if !session
        .wait(Duration::from_secs(30), |p| p.seen_tool_call)
        .await
    {
        return Err(CliError::Timeout("no tool call within 30s".into()));
    }
    session.say("Oh, and what time is it?", true).await?;
    if !session.wait(Duration::from_secs(60), Progress::idle).await {
        return Err(CliError::Timeout(
            "the conversation did not settle within 60s".into(),
        ));
    }
    println!("== checkpoints of {id} (cyrene checkpoints {id})");
    super::session::checkpoints(
        client.clone(),
        super::session::CheckpointsArgs {
            owner: id.clone(),
            limit: 20,
            json: false,
        },
    )
    .await?;
    println!("== transcript (cyrene history -s {id})");
    super::session::history(
        client,
        super::session::HistoryArgs {
            session: id,
            limit: 50,
            before_seq: None,
            json: false,
        },
    )
    .await
}
