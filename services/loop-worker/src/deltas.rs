//! Live answer text: the model call of a step is streamed through the gateway
//! (`cyrene.model.complete.stream`) and each piece of user-visible text is published on the
//! session's events as a `delta` event (docs/loop-worker.md, "Deltas").
//!
//! # Invariants
//! - Deltas are a preview, never state: nothing here is checkpointed, and the step's response is
//!   the gateway's end marker (the same response the non-streamed call gives), so a completed
//!   step is saved exactly as before.
//! - Only `text` deltas are published (reasoning and tool-call arguments are not answer text).
//! - `seq` counts from 0 within one (turn, attempt, step); `attempt` is the turn's delivery, so a
//!   client seeing a higher attempt knows the text is being streamed again after a redelivery
//!   (the resumed step restarts from its checkpoint).
//!
//! The runner's only hook is [`complete`], called where it calls the model for a step.

use crate::ports::TurnPorts;
use cyrene_protocol::ErrorBody;
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::turn::TurnJob;
use futures::future::Either;
use std::future::Future;

/// Where the deltas of one model call belong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaTag {
    pub session_id: String,
    pub turn_id: String,
    pub leg_id: String,
    pub step: u32,
    pub attempt: u32,
    /// The persona speaking (what the step's message carries as `sender_name`).
    pub sender_name: String,
}

impl DeltaTag {
    pub fn new(job: &TurnJob, attempt: u32, step: u32) -> DeltaTag {
        DeltaTag {
            session_id: job.session_id.clone(),
            turn_id: job.turn_id.clone(),
            leg_id: job.leg_id.clone(),
            step,
            attempt,
            sender_name: job.env.persona.clone(),
        }
    }

    /// The `delta` event for text piece number `seq`.
    pub fn event(&self, seq: u64, text: String) -> SessionEvent {
        let mut event = SessionEvent::new(SessionEventType::Delta, self.session_id.clone());
        event.turn_id.clone_from(&self.turn_id);
        event.leg_id.clone_from(&self.leg_id);
        event.at_step = Some(self.step);
        event.attempt = Some(self.attempt);
        event.seq = Some(seq);
        event.delta = Some(text);
        event.sender_name.clone_from(&self.sender_name);
        event
    }
}

/// The runner's hook: a step's model call, streamed with its deltas published when `tag` is
/// given (a turn's steps), a plain call otherwise (the image resolver, the safety net).
pub fn complete<'a, P: TurnPorts>(
    ports: &'a P,
    request: ModelRequest,
    tag: Option<DeltaTag>,
) -> impl Future<Output = Result<ModelResponse, ErrorBody>> + Send + 'a {
    match tag {
        Some(tag) => Either::Left(ports.complete_streamed(request, tag)),
        None => Either::Right(ports.complete(request)),
    }
}
