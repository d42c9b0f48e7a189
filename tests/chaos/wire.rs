//! Watches the bus like an operator with `nats sub`: turn jobs, session events, model requests,
//! steers, completions and checkpoint saves with the store's replies, each with its arrival time
//! and the requester's inbox (one per worker connection).
//!
//! # Pitfalls
//! - Core NATS: what is published while the watcher is disconnected (a nats-server restart) is
//!   not seen. The report relies on the transcripts for what must be exact and on the wire for
//!   timing and attribution.

use crate::script::{self, ViewMessage};
use crate::tools::inbox_of;
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_protocol::message::{Message, Part};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::{SteerRequest, TurnComplete, TurnJob};
use futures::StreamExt;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The reply inbox prefix of every loop worker (`cyrene_bus::connect` names inboxes per service).
pub const WORKER_INBOX_PREFIX: &str = "_INBOX_cyrene-loop-worker";

#[derive(Debug, Clone)]
pub struct JobSeen {
    pub at: Instant,
    pub job: TurnJob,
}

#[derive(Debug, Clone)]
pub struct EventSeen {
    pub at: Instant,
    pub event: SessionEvent,
}

#[derive(Debug, Clone)]
pub struct ModelRequestSeen {
    pub at: Instant,
    pub inbox: String,
    pub primary: String,
    pub round: usize,
}

#[derive(Debug, Clone)]
pub struct TurnRequestSeen {
    pub at: Instant,
    pub inbox: String,
    pub turn_id: String,
}

impl TurnRequestSeen {
    fn new(at: Instant, inbox: String, turn_id: String) -> TurnRequestSeen {
        TurnRequestSeen { at, inbox, turn_id }
    }
}

#[derive(Debug, Clone)]
pub struct SaveSeen {
    pub at: Instant,
    pub inbox: String,
    pub turn_id: String,
    pub step: u32,
    pub stop_reason: String,
    /// Ids of the tool calls whose results this checkpoint holds.
    pub results: Vec<String>,
    /// When the store acknowledged it (`None`: refused, or the reply was not seen).
    pub saved_at: Option<Instant>,
}

#[derive(Debug, Default)]
pub struct WireLog {
    pub jobs: Vec<JobSeen>,
    pub events: Vec<EventSeen>,
    pub model_requests: Vec<ModelRequestSeen>,
    pub steers: Vec<TurnRequestSeen>,
    pub completes: Vec<TurnRequestSeen>,
    pub saves: Vec<SaveSeen>,
    pending_saves: HashMap<String, usize>,
}

/// The watcher; its log grows until the test ends.
#[derive(Debug, Clone)]
pub struct Wire {
    pub log: Arc<Mutex<WireLog>>,
}

/// Reduces protocol messages to what the script reads.
pub fn view_of(messages: &[Message]) -> Vec<ViewMessage> {
    messages
        .iter()
        .map(|m| ViewMessage {
            role: serde_json::to_value(m.role)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            text: m.text_content(),
            tool_calls: m
                .content
                .iter()
                .filter(|p| matches!(p, Part::ToolCall { .. }))
                .count(),
        })
        .collect()
}

impl Wire {
    pub async fn start(client: &async_nats::Client) -> Wire {
        let log: Arc<Mutex<WireLog>> = Arc::default();
        let mut subs = futures::stream::select_all([
            client.subscribe(subjects::TURN_RUN).await.unwrap(),
            client
                .subscribe(subjects::SESSION_EVENTS_ALL)
                .await
                .unwrap(),
            client.subscribe(subjects::MODEL_COMPLETE).await.unwrap(),
            // A turn's steps call the model streamed (docs/model-gateway.md, "Streaming").
            client
                .subscribe(subjects::MODEL_COMPLETE_STREAM)
                .await
                .unwrap(),
            client.subscribe(subjects::TURN_STEER).await.unwrap(),
            client.subscribe(subjects::TURN_COMPLETE).await.unwrap(),
            client.subscribe(subjects::CHECKPOINT_SAVE).await.unwrap(),
            client
                .subscribe(format!("{WORKER_INBOX_PREFIX}.>"))
                .await
                .unwrap(),
        ]);
        client.flush().await.unwrap();
        let l = log.clone();
        tokio::spawn(async move {
            while let Some(m) = subs.next().await {
                record(&l, m);
            }
        });
        Wire { log }
    }
}

fn record(log: &Mutex<WireLog>, m: async_nats::Message) {
    let at = Instant::now();
    let inbox = m
        .reply
        .as_ref()
        .map(|r| inbox_of(r.as_str()))
        .unwrap_or_default();
    let subject = m.subject.as_str();
    let mut log = log.lock().unwrap();
    match subject {
        subjects::TURN_RUN => {
            if let Ok(job) = serde_json::from_slice::<TurnJob>(&m.payload) {
                log.jobs.push(JobSeen { at, job });
            }
        }
        subjects::MODEL_COMPLETE | subjects::MODEL_COMPLETE_STREAM => {
            // Loosely on purpose: only `messages` is read, so a request `ModelRequest` would
            // refuse (it denies unknown fields) is still seen as sent.
            let Ok(body) = serde_json::from_slice::<Value>(&m.payload) else {
                return;
            };
            // The orchestrator's memory extraction reads a session's transcript, which may end
            // with a message a turn is still running for: it is no step of that turn.
            if body["purpose"] == "memory" {
                return;
            }
            let messages: Vec<Message> =
                serde_json::from_value(body["messages"].clone()).unwrap_or_default();
            let segment = script::segment(&view_of(&messages));
            log.model_requests.push(ModelRequestSeen {
                at,
                inbox,
                primary: segment.primary().unwrap_or_default().to_owned(),
                round: segment.round,
            });
        }
        subjects::TURN_STEER => {
            if let Ok(req) = serde_json::from_slice::<SteerRequest>(&m.payload) {
                log.steers
                    .push(TurnRequestSeen::new(at, inbox, req.turn_id));
            }
        }
        subjects::TURN_COMPLETE => {
            if let Ok(req) = serde_json::from_slice::<TurnComplete>(&m.payload) {
                log.completes
                    .push(TurnRequestSeen::new(at, inbox, req.turn_id));
            }
        }
        subjects::CHECKPOINT_SAVE => {
            let Ok(checkpoint) = serde_json::from_slice::<Checkpoint>(&m.payload) else {
                return;
            };
            // The state as plain JSON, not `CheckpointState`: a delta save carries only the
            // step's new messages (`from` set), and an odd state is still logged as a save.
            let state = Value::Object(checkpoint.state.to_map());
            let messages: Vec<Message> =
                serde_json::from_value(state["messages"].clone()).unwrap_or_default();
            let results = messages
                .iter()
                .flat_map(|msg| msg.content.iter())
                .filter_map(|p| match p {
                    Part::ToolResult { tool_call_id, .. } => Some(tool_call_id.clone()),
                    _ => None,
                })
                .collect();
            let turn_id = checkpoint
                .turn_id
                .clone()
                .or_else(|| state["turn_id"].as_str().map(str::to_owned))
                .unwrap_or_default();
            let index = log.saves.len();
            log.saves.push(SaveSeen {
                at,
                inbox,
                turn_id,
                step: checkpoint.step,
                stop_reason: state["stop_reason"].as_str().unwrap_or_default().to_owned(),
                results,
                saved_at: None,
            });
            if let Some(reply) = &m.reply {
                log.pending_saves.insert(reply.to_string(), index);
            }
        }
        _ if subject.starts_with(WORKER_INBOX_PREFIX) => {
            if let Some(index) = log.pending_saves.remove(subject) {
                let refused = m.headers.as_ref().is_some_and(|h| {
                    h.get("Nats-Service-Error-Code").is_some()
                        || h.get("Nats-Service-Error").is_some()
                });
                if !refused {
                    log.saves[index].saved_at = Some(at);
                }
            }
        }
        _ => {
            if let Ok(event) = serde_json::from_slice::<SessionEvent>(&m.payload) {
                log.events.push(EventSeen { at, event });
            }
        }
    }
}

impl WireLog {
    /// When each turn ended (`turn_ended` event), by turn id.
    pub fn ended(&self) -> HashMap<String, Instant> {
        let mut ended = HashMap::new();
        for e in &self.events {
            if e.event.kind == SessionEventType::TurnEnded {
                ended.entry(e.event.turn_id.clone()).or_insert(e.at);
            }
        }
        ended
    }
}
