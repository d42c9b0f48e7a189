//! Live progress of running turns, learnt from the session events the loop workers publish on
//! `cyrene.session.*.events`; read when a parallel leg starts, to build its notice
//! (docs/semantics.md#parallel-notice: other message id, step, tool names, queued count).
//!
//! # Invariants
//! - Metadata only: the step reached and the tool names called (in call order, deduplicated).
//!   No text of the other leg is ever kept, so none can leak into a notice.
//! - Bounded in count and in size: entries are dropped when their turn ends, and the oldest are
//!   evicted past [`MAX_TRACKED`]; an entry keeps at most [`MAX_TOOLS`] tool names of at most
//!   [`MAX_TOOL_NAME_CHARS`] characters, and a turn id longer than an id may be is not tracked
//!   (about 12 MB in all). A missing entry just yields an emptier (still valid) notice.
//!
//! # Pitfalls
//! - Every replica subscribes (no queue group) so each sees every event; a replica started
//!   mid-turn knows only what happened since. The notice is best effort by design.

use cyrene_protocol::message::Part;
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Most turns tracked at once.
pub const MAX_TRACKED: usize = 10_000;
/// Most tool names kept per turn (the first ones called).
pub const MAX_TOOLS: usize = 16;
/// Longest tool name kept, in characters (a model names the tools it calls).
pub const MAX_TOOL_NAME_CHARS: usize = 64;

#[derive(Debug)]
struct Entry {
    step: u32,
    tools: Vec<String>,
    touched: Instant,
}

/// Per-turn progress, shared by the event listener and the send path.
#[derive(Debug, Default)]
pub struct Progress {
    turns: Mutex<HashMap<String, Entry>>,
}

impl Progress {
    pub fn new() -> Progress {
        Progress::default()
    }

    /// Folds one session event into the table.
    pub fn observe(&self, event: &SessionEvent) {
        if event.turn_id.is_empty() || event.turn_id.len() > cyrene_protocol::ids::MAX_ID_LEN {
            return;
        }
        let Ok(mut turns) = self.turns.lock() else {
            return;
        };
        if event.kind == SessionEventType::TurnEnded {
            turns.remove(&event.turn_id);
            return;
        }
        let step = event.at_step.unwrap_or(0);
        let tools: Vec<&str> = match (&event.kind, &event.message) {
            (SessionEventType::ToolCall, Some(message)) => message
                .content
                .iter()
                .filter_map(|p| match p {
                    Part::ToolCall { name, .. } => Some(name.as_str()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        };
        if step == 0 && tools.is_empty() && event.kind != SessionEventType::TurnStarted {
            return;
        }
        if !turns.contains_key(&event.turn_id)
            && turns.len() >= MAX_TRACKED
            && let Some(oldest) = turns
                .iter()
                .min_by_key(|(_, e)| e.touched)
                .map(|(k, _)| k.clone())
        {
            turns.remove(&oldest);
        }
        let entry = turns.entry(event.turn_id.clone()).or_insert_with(|| Entry {
            step: 0,
            tools: Vec::new(),
            touched: Instant::now(),
        });
        entry.touched = Instant::now();
        entry.step = entry.step.max(step);
        for name in tools {
            let name: String = name.chars().take(MAX_TOOL_NAME_CHARS).collect();
            if entry.tools.len() < MAX_TOOLS && !entry.tools.contains(&name) {
                entry.tools.push(name);
            }
        }
    }

    /// `(step, tool names)` of a turn; `(0, [])` when unknown.
    pub fn snapshot(&self, turn_id: &str) -> (u32, Vec<String>) {
        self.turns
            .lock()
            .ok()
            .and_then(|t| t.get(turn_id).map(|e| (e.step, e.tools.clone())))
            .unwrap_or_default()
    }

    /// Drops entries not touched for `age` (turns whose end this replica never saw).
    pub fn prune(&self, age: Duration) {
        if let Ok(mut turns) = self.turns.lock() {
            turns.retain(|_, e| e.touched.elapsed() < age);
        }
    }
}

/// Feeds `progress` from a subscription to [`cyrene_protocol::subjects::SESSION_EVENTS_ALL`] until `shutdown`.
pub async fn track(
    mut events: async_nats::Subscriber,
    progress: std::sync::Arc<Progress>,
    shutdown: CancellationToken,
) {
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = events.next() => match next {
                Some(m) => m,
                None => break,
            },
        };
        match serde_json::from_slice::<SessionEvent>(&message.payload) {
            Ok(event) => progress.observe(&event),
            Err(err) => tracing::debug!(subject = %message.subject, error = %err,
                "ignoring an undecodable session event"),
        }
    }
    let _ = events.unsubscribe().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::message::{Message, ToolCall};
    use serde_json::Map;

    fn event(kind: SessionEventType, turn: &str) -> SessionEvent {
        let mut e = SessionEvent::new(kind, "s1");
        e.turn_id = turn.into();
        e
    }

    /// A `step` event of turn `t1` at step `at`.
    fn step_of_t1(at: u32) -> SessionEvent {
        let mut step = event(SessionEventType::Step, "t1");
        step.at_step = Some(at);
        step
    }

    fn call(name: &str) -> ToolCall {
        ToolCall {
            id: format!("c-{name}"),
            name: name.into(),
            args: Map::new(),
            args_error: None,
        }
    }

    #[test]
    fn tracks_step_and_deduplicated_tools_in_call_order() {
        let p = Progress::new();
        p.observe(&step_of_t1(2));
        let mut tools = event(SessionEventType::ToolCall, "t1");
        tools.message = Some(Message::assistant_tool_calls(&[
            call("search"),
            call("read"),
        ]));
        p.observe(&tools);
        tools.message = Some(Message::assistant_tool_calls(&[call("search")]));
        p.observe(&tools);
        p.observe(&step_of_t1(1));
        assert_eq!(
            p.snapshot("t1"),
            (2, vec!["search".to_string(), "read".to_string()])
        );
        assert_eq!(p.snapshot("t2"), (0, vec![]));
        p.observe(&event(SessionEventType::TurnEnded, "t1"));
        assert_eq!(p.snapshot("t1"), (0, vec![]));
    }

    /// issue 30, L7: an entry is bounded in size, not only the table in count.
    #[test]
    fn an_entry_is_bounded_in_size() {
        let p = Progress::new();
        let mut tools = event(SessionEventType::ToolCall, "t1");
        let calls: Vec<ToolCall> = (0..100)
            .map(|i| call(&format!("{i}{}", "x".repeat(10_000))))
            .collect();
        tools.message = Some(Message::assistant_tool_calls(&calls));
        p.observe(&tools);
        let (_, names) = p.snapshot("t1");
        assert_eq!(names.len(), MAX_TOOLS);
        assert!(
            names
                .iter()
                .all(|n| n.chars().count() <= MAX_TOOL_NAME_CHARS)
        );
        p.observe(&event(SessionEventType::TurnStarted, &"t".repeat(100_000)));
        assert_eq!(p.turns.lock().unwrap().len(), 1);
    }

    #[test]
    fn prune_drops_stale_entries() {
        let p = Progress::new();
        p.observe(&step_of_t1(1));
        p.prune(Duration::ZERO);
        assert_eq!(p.snapshot("t1"), (0, vec![]));
    }
}
