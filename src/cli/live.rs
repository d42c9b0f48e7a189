//! Live answer text in `cyrene chat` and `cyrene events`: `delta` events are printed inline as
//! they arrive, one line per (turn, attempt, step), and the `final` event that repeats the
//! streamed text is not printed again (docs/loop-worker.md, "Deltas").
//!
//! A line of a higher attempt of the same turn is marked `(attempt N, again)`: the turn was
//! redelivered and the resumed step streams its answer again. A step whose model call was sent
//! again after its gateway replica died mid-call (`retry`) is marked `(retry N, again)`.

use cyrene_protocol::session::{SessionEvent, SessionEventType};
use std::io::Write;

/// The streamed line being printed, and the last streamed text per turn.
#[derive(Debug, Default)]
pub struct LiveText {
    open: Option<(String, u32, u32, u32)>,
    /// (turn, text streamed in the turn's latest streamed step).
    last: Option<(String, String)>,
}

impl LiveText {
    /// Prints `event` if it is a delta (with `lead` before a new line) and returns `false`;
    /// otherwise ends an open streamed line and returns whether the event's own line should
    /// still be printed (`false` for a `final` whose text was just streamed).
    pub fn handle(&mut self, event: &SessionEvent, lead: &str) -> bool {
        let mut out = std::io::stdout().lock();
        if event.kind == SessionEventType::Delta {
            let attempt = event.attempt.unwrap_or(1);
            let retry = event.retry.unwrap_or(0);
            let key = (
                event.turn_id.clone(),
                attempt,
                event.at_step.unwrap_or_default(),
                retry,
            );
            if self.open.as_ref() != Some(&key) {
                if self.open.is_some() {
                    let _ = writeln!(out);
                }
                let again = if retry > 0 {
                    format!(" (retry {retry}, again)")
                } else if attempt > 1 {
                    format!(" (attempt {attempt}, again)")
                } else {
                    String::new()
                };
                let who = if event.sender_name.is_empty() {
                    "assistant"
                } else {
                    event.sender_name.as_str()
                };
                let _ = write!(out, "{lead}{who}{again}: ");
                self.open = Some(key);
                self.last = Some((event.turn_id.clone(), String::new()));
            }
            let text = event.delta.as_deref().unwrap_or_default();
            let _ = write!(out, "{text}");
            let _ = out.flush();
            if let Some((_, shown)) = &mut self.last {
                shown.push_str(text);
            }
            return false;
        }
        if self.open.take().is_some() {
            let _ = writeln!(out);
        }
        if event.kind == SessionEventType::Final
            && let (Some((turn, shown)), Some(message)) = (&self.last, &event.message)
            && *turn == event.turn_id
            && !shown.is_empty()
            && *shown == message.text_content()
        {
            return false;
        }
        true
    }
}
