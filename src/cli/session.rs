//! `cyrene send`, `cyrene events`, `cyrene checkpoints`: thin clients of the wire API.

use super::person;
use super::{CliError, parse_duration, request_error};
use async_nats::Client;
use clap::Args;
use cyrene_bus::request_json;
use cyrene_protocol::checkpoint::{CheckpointState, ListRequest, ListResponse};
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::session::{
    BusyPolicy, HistoryRequest, HistoryResponse, SendAck, SendRequest, SessionEvent,
    SessionEventType,
};
use cyrene_protocol::{ids, subjects};
use futures::StreamExt;
use serde_json::Value;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct SendArgs {
    /// The session to send to.
    #[arg(long, short)]
    pub session: String,
    /// This client's id (parallel policy and idempotency are per client).
    #[arg(long, default_value = "cli")]
    pub client: String,
    /// Idempotency key: resending with the same key gets the first ack back (default: fresh).
    #[arg(long)]
    pub key: Option<String>,
    /// The persona this message addresses: the session answers as it from this message on
    /// (absent: the persona the session last used; docs/orchestrator.md, "Several personas").
    #[arg(long)]
    pub persona: Option<String>,
    /// Start a parallel leg when another client's turn is in flight (instead of waiting).
    #[arg(long)]
    pub parallel: bool,
    /// What this message does while a turn runs: steer, parallel, enqueue (next turn only) or
    /// reject (refused with conflict). Default: the policy configured for the client/session.
    #[arg(long, value_parser = parse_busy_policy)]
    pub when_busy: Option<BusyPolicy>,
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Upload this file into the session and attach it to the message (repeatable). The server
    /// decides its type from the bytes (docs/documents.md).
    #[arg(long = "file", value_name = "PATH")]
    pub files: Vec<std::path::PathBuf>,
    /// The message text (may be empty when a file is attached).
    #[arg(default_value = "")]
    pub text: String,
}

/// `steer`, `parallel`, `enqueue` or `reject`, as on the wire.
fn parse_busy_policy(text: &str) -> Result<BusyPolicy, String> {
    serde_json::from_value(Value::String(text.to_owned()))
        .map_err(|_| format!("{text:?}: expected steer, parallel, enqueue or reject"))
}

pub fn send_request(args: &SendArgs) -> SendRequest {
    let mut message = Message::text(Role::User, args.text.clone());
    if args.text.is_empty() && !args.files.is_empty() {
        message.content.clear();
    }
    // No `sender_name`, no `restricted`: the CLI speaks for its user, and only a chat bridge
    // labels third parties (docs/security.md, "The owner and bridges").
    SendRequest {
        session_id: person::session(&args.session),
        message,
        client_id: args.client.clone(),
        idempotency_key: args.key.clone().unwrap_or_else(ids::new_id),
        env: None,
        parallel: args.parallel,
        when_busy: args.when_busy,
        persona: args.persona.clone().unwrap_or_default(),
        context_only: false,
    }
}

pub async fn send_message(
    client: &Client,
    request: &SendRequest,
    timeout: Duration,
) -> Result<SendAck, CliError> {
    ask(
        client,
        subjects::SESSION_SEND,
        subjects::PERSON_SESSION_SEND,
        request,
        timeout,
    )
    .await
}

/// One request on `shared`, or on the person's own `cyrene.person.<person>.<own>` when acting as
/// a person; a failure is mapped onto the CLI's exit codes.
pub(super) async fn ask<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
    client: &Client,
    shared: &str,
    own: &str,
    request: &Req,
    timeout: Duration,
) -> Result<Resp, CliError> {
    request_json(client, &person::subject(shared, own), request, timeout)
        .await
        .map_err(request_error)
}

pub async fn send(client: Client, args: SendArgs) -> Result<(), CliError> {
    let mut request = send_request(&args);
    for path in &args.files {
        let document =
            super::documents::upload_file(&client, &args.session, path, args.timeout).await?;
        eprintln!(
            "uploaded {} as {}",
            path.display(),
            serde_json::to_string(&document.part).unwrap_or_default()
        );
        request.message.content.push(document.part);
    }
    let ack = send_message(&client, &request, args.timeout).await?;
    println!("{}", serde_json::to_string(&ack).unwrap_or_default());
    Ok(())
}

#[derive(Debug, Args)]
pub struct EventsArgs {
    /// The session to watch; every session when absent.
    #[arg(long, short)]
    pub session: Option<String>,
    /// Print raw JSON lines instead of a readable transcript.
    #[arg(long)]
    pub json: bool,
}

pub async fn events(client: Client, args: EventsArgs) -> Result<(), CliError> {
    let subject = match &args.session {
        Some(s) => subjects::session_events(&person::session(s))
            .map_err(|e| CliError::Failed(e.to_string()))?,
        None => person::all_events(),
    };
    let mut sub = client
        .subscribe(subject)
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;
    let _ = client.flush().await;
    let stop = cyrene_runtime::signal::signalled();
    tokio::pin!(stop);
    let mut live = super::live::LiveText::default();
    loop {
        let message = tokio::select! {
            _ = &mut stop => return Ok(()),
            m = sub.next() => match m { Some(m) => m, None => return Ok(()) },
        };
        if args.json {
            println!("{}", String::from_utf8_lossy(&message.payload));
            continue;
        }
        match serde_json::from_slice::<SessionEvent>(&message.payload) {
            Ok(event) => {
                let lead = format!("[{}] ", event.session_id);
                if live.handle(&event, &lead)
                    && let Some(line) = describe(&event)
                {
                    println!("{lead}{line}");
                }
            }
            Err(_) => println!("{}", String::from_utf8_lossy(&message.payload)),
        }
    }
}

/// One readable line for an event (None for events not worth a line).
pub fn describe(event: &SessionEvent) -> Option<String> {
    let leg = if event.leg_id.is_empty() {
        String::new()
    } else {
        format!(" (leg {})", event.leg_id)
    };
    Some(match event.kind {
        SessionEventType::TurnStarted => format!("· turn {} started{leg}", short(&event.turn_id)),
        SessionEventType::TurnEnded => format!("· turn {} ended{leg}", short(&event.turn_id)),
        SessionEventType::Step => format!("· step {}{leg}", event.at_step.unwrap_or_default()),
        // Printed inline as they come (super::live).
        SessionEventType::Delta => return None,
        SessionEventType::SteerAck => format!(
            "↪ steered {} message(s) into step {}{leg}",
            event.message_ids.len(),
            event.at_step.unwrap_or_default()
        ),
        SessionEventType::ToolCall => {
            let calls: Vec<String> = event
                .message
                .iter()
                .flat_map(|m| &m.content)
                .filter_map(|p| match p {
                    Part::ToolCall { name, args, .. } => {
                        Some(format!("{name}({})", Value::Object(args.clone())))
                    }
                    _ => None,
                })
                .collect();
            format!("⚙ {}{leg}", calls.join(", "))
        }
        SessionEventType::ToolResult => {
            let (text, is_error) = event
                .message
                .iter()
                .flat_map(|m| &m.content)
                .find_map(|p| match p {
                    Part::ToolResult { text, is_error, .. } => Some((text.clone(), *is_error)),
                    _ => None,
                })
                .unwrap_or_default();
            format!(
                "{} {}{leg}",
                if is_error { "✗" } else { "✓" },
                one_line(&text, 120)
            )
        }
        SessionEventType::Final => {
            let m = event.message.as_ref()?;
            let who = if m.sender_name.is_empty() {
                "assistant"
            } else {
                m.sender_name.as_str()
            };
            format!("{who}: {}{leg}", m.text_content())
        }
        SessionEventType::ToolOutcomeUnknown => format!(
            "? outcome unknown: {} was running when the runtime stopped; not run again{leg}",
            call_of(event)
        ),
        SessionEventType::ApprovalRequested => format!(
            "? approval wanted: {} — `cyrene approve -s {} {}` or `cyrene deny`{leg}",
            call_of(event),
            event.session_id,
            event.call_id.as_deref().unwrap_or_default()
        ),
        SessionEventType::ApprovalDecided => format!(
            "{} call {} ({}) by {}{}{leg}",
            match event.decision {
                Some(cyrene_protocol::approval::Decision::Approve) => "✓ approved:",
                _ => "✗ denied:",
            },
            event.call_id.as_deref().unwrap_or_default(),
            event.tool.as_deref().unwrap_or_default(),
            event.decided_by.as_deref().unwrap_or_default(),
            event
                .reason
                .as_deref()
                .map(|r| format!(": {}", one_line(r, 120)))
                .unwrap_or_default()
        ),
        SessionEventType::Error => format!(
            "error: {}{leg}",
            event
                .error
                .as_ref()
                .map(|e| e.to_string())
                .unwrap_or_default()
        ),
    })
}

/// The tool call an event is about: `tool({arguments}) call <id>`.
fn call_of(event: &SessionEvent) -> String {
    format!(
        "{}({}) call {}",
        event.tool.as_deref().unwrap_or_default(),
        event
            .arguments
            .clone()
            .map(Value::Object)
            .unwrap_or(Value::Null),
        event.call_id.as_deref().unwrap_or_default()
    )
}

fn short(id: &str) -> &str {
    id.get(id.len().saturating_sub(8)..).unwrap_or(id)
}

fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .collect();
    if flat.chars().count() > max {
        format!("{}…", flat.chars().take(max).collect::<String>())
    } else {
        flat
    }
}

#[derive(Debug, Args)]
pub struct HistoryArgs {
    /// The session.
    #[arg(long, short)]
    pub session: String,
    #[arg(long, default_value_t = 50)]
    pub limit: u32,
    /// Only entries before this seq (paging backwards).
    #[arg(long)]
    pub before_seq: Option<u64>,
    /// Print the entries as JSON lines.
    #[arg(long)]
    pub json: bool,
}

pub async fn history(client: Client, args: HistoryArgs) -> Result<(), CliError> {
    let request = HistoryRequest {
        session_id: person::session(&args.session),
        limit: Some(args.limit),
        before_seq: args.before_seq,
    };
    let history: HistoryResponse = ask(
        &client,
        subjects::SESSION_HISTORY,
        subjects::PERSON_SESSION_HISTORY,
        &request,
        Duration::from_secs(5),
    )
    .await?;
    for entry in &history.messages {
        if args.json {
            println!("{}", serde_json::to_string(entry).unwrap_or_default());
            continue;
        }
        let who = match (entry.message.role, entry.message.sender_name.as_str()) {
            (Role::User, "") => "you".to_owned(),
            (_, "") => format!("{:?}", entry.message.role).to_lowercase(),
            (_, name) => name.to_owned(),
        };
        println!("#{:<4} {who}: {}", entry.seq, entry.message.text_content());
    }
    Ok(())
}

#[derive(Debug, Args)]
pub struct CheckpointsArgs {
    /// The owner key: a session id, or `session#leg`.
    pub owner: String,
    #[arg(long, default_value_t = 20)]
    pub limit: u32,
    /// Print the checkpoints as JSON lines (with their state).
    #[arg(long)]
    pub json: bool,
}

pub async fn checkpoints(client: Client, args: CheckpointsArgs) -> Result<(), CliError> {
    let request = ListRequest {
        agent_id: person::session(&args.owner),
        limit: Some(args.limit),
        before: None,
    };
    let list: ListResponse = ask(
        &client,
        subjects::CHECKPOINT_LIST,
        subjects::PERSON_CHECKPOINT_LIST,
        &request,
        Duration::from_secs(5),
    )
    .await?;
    if list.checkpoints.is_empty() {
        eprintln!("no checkpoints for {}", args.owner);
        return Ok(());
    }
    for cp in &list.checkpoints {
        if args.json {
            println!("{}", serde_json::to_string(cp).unwrap_or_default());
            continue;
        }
        let state: Option<CheckpointState> = cp.state.parse().ok();
        let calls = state.as_ref().map(|s| calls_of_step(&s.messages));
        let (stop, messages) = state
            .map(|s| (s.stop_reason, s.messages.len()))
            .unwrap_or_default();
        let calls = match calls.flatten() {
            Some(c) if stop.starts_with("tool_calls") => c.to_string(),
            _ => String::new(),
        };
        println!(
            "{:<24} step {:>3}  {:<18} {:>3} messages  turn {} attempt {}  {}{calls}",
            cp.id,
            cp.step,
            stop,
            messages,
            cp.turn_id.as_deref().map(short).unwrap_or("-"),
            cp.attempt
                .map(|a| a.to_string())
                .unwrap_or_else(|| "-".into()),
            cp.updated_at.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

/// The calls of a window's last tool-call message and what became of them: what `cyrene
/// checkpoints` shows of a step's intent (docs/loop-worker.md, "Tool calls with a durable
/// intent").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCalls {
    pub calls: usize,
    pub answered: usize,
    /// Answered with the outcome-unknown result: started, not run again.
    pub unknown: usize,
}

impl std::fmt::Display for StepCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pending = self.calls - self.answered - self.unknown;
        write!(
            f,
            "  calls {}: {} answered, {} outcome unknown, {} started without a result",
            self.calls, self.answered, self.unknown, pending
        )
    }
}

/// [`StepCalls`] of `window`, `None` when it holds no tool call.
pub fn calls_of_step(window: &[Message]) -> Option<StepCalls> {
    let at = window.iter().rposition(|m| {
        m.role == Role::Assistant && m.content.iter().any(|p| matches!(p, Part::ToolCall { .. }))
    })?;
    let ids: Vec<&str> = window[at]
        .content
        .iter()
        .filter_map(|p| match p {
            Part::ToolCall { id, .. } => Some(id.as_str()),
            _ => None,
        })
        .collect();
    let mut counts = StepCalls {
        calls: ids.len(),
        answered: 0,
        unknown: 0,
    };
    for part in window[at + 1..].iter().flat_map(|m| &m.content) {
        if let Part::ToolResult {
            tool_call_id, text, ..
        } = part
            && ids.contains(&tool_call_id.as_str())
        {
            if text == cyrene_loop_worker::runner::OUTCOME_UNKNOWN {
                counts.unknown += 1;
            } else {
                counts.answered += 1;
            }
        }
    }
    Some(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_steps_calls_show_their_intent_and_outcome() {
        use cyrene_protocol::message::ToolCall;
        let call = |id: &str| ToolCall {
            id: id.into(),
            name: "send_mail".into(),
            args: serde_json::Map::new(),
            args_error: None,
        };
        let mut window = vec![
            Message::text(Role::User, "mail them"),
            Message::assistant_tool_calls(&[call("c1"), call("c2"), call("c3")]),
        ];
        assert_eq!(
            calls_of_step(&window),
            Some(StepCalls {
                calls: 3,
                answered: 0,
                unknown: 0
            })
        );
        window.push(Message::tool_result("c1", "send_mail", "sent", false));
        window.push(Message::tool_result(
            "c2",
            "send_mail",
            cyrene_loop_worker::runner::OUTCOME_UNKNOWN,
            true,
        ));
        let counts = calls_of_step(&window).unwrap();
        assert_eq!(
            counts.to_string(),
            "  calls 3: 1 answered, 1 outcome unknown, 1 started without a result"
        );
        assert_eq!(calls_of_step(&window[..1]), None);
    }

    #[test]
    fn when_busy_takes_the_wire_names() {
        assert_eq!(parse_busy_policy("enqueue"), Ok(BusyPolicy::Enqueue));
        assert_eq!(parse_busy_policy("reject"), Ok(BusyPolicy::Reject));
        assert!(parse_busy_policy("interrupt").is_err());
    }
}
