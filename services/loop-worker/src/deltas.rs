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
//!
//! A turn's step calls also continue one **held view** ([`SentView`], docs/model-gateway.md,
//! "Held views"): after its first call the gateway replica that answered holds the view, and the
//! next step sends only the messages after what it holds, to that replica. The request the runner
//! builds is always the whole view; whether it goes whole or continued is decided here, by
//! comparing it with what was sent, so the model sees exactly the view the runner built. A
//! replica that is gone or no longer holds the view (`no responders`, `not_found`) costs one more
//! call: the whole view, to any replica.

use crate::ports::TurnPorts;
use cyrene_protocol::ErrorBody;
use cyrene_protocol::message::Message;
use cyrene_protocol::model::{ModelRequest, ModelResponse, ViewRef};
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

/// The runner's hook: a step's model call, streamed with its deltas published and continuing
/// the turn's held view when `step` is given (a turn's steps), a plain call otherwise (the image
/// resolver, the safety net).
pub fn complete<'a, P: TurnPorts>(
    ports: &'a P,
    request: ModelRequest,
    step: Option<(DeltaTag, &'a mut SentView)>,
) -> impl Future<Output = Result<ModelResponse, ErrorBody>> + Send + 'a {
    match step {
        Some((tag, view)) => Either::Left(ports.complete_streamed(request, tag, view)),
        None => Either::Right(ports.complete(request)),
    }
}

/// What a turn's step calls sent of its view, and which gateway replica holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct SentView {
    /// A new id (74 random bits): the view's name is what makes it the turn's
    /// (docs/model-gateway.md).
    id: String,
    replica: Option<String>,
    sent: Vec<Message>,
}

impl Default for SentView {
    fn default() -> SentView {
        SentView {
            id: cyrene_protocol::ids::new_id(),
            replica: None,
            sent: Vec::new(),
        }
    }
}

impl SentView {
    /// `request` cut to what follows the view its replica holds, and that replica's subject;
    /// `None` when no replica holds a view that `request`'s messages start with.
    pub fn continued(&self, request: &mut ModelRequest) -> Option<(String, ModelRequest)> {
        let replica = self.replica.as_deref()?;
        if !request.messages.starts_with(&self.sent) {
            return None;
        }
        let base = u32::try_from(self.sent.len()).ok()?;
        let whole = std::mem::take(&mut request.messages);
        let mut continued = request.clone();
        continued.messages = whole[self.sent.len()..].to_vec();
        continued.view = Some(ViewRef {
            id: self.id.clone(),
            base,
        });
        request.messages = whole;
        Some((
            cyrene_protocol::subjects::model_complete_stream_at(replica),
            continued,
        ))
    }

    /// The view named whole (`base` 0), for any replica.
    pub fn whole(&self) -> ViewRef {
        ViewRef {
            id: self.id.clone(),
            base: 0,
        }
    }

    /// A call with the view `messages` was answered, by `replica` holding it (`None`: nobody).
    pub fn answered(&mut self, messages: Vec<Message>, replica: Option<String>) {
        let replica = replica.filter(|r| {
            (1..=64).contains(&r.len()) && r.chars().all(cyrene_protocol::ids::is_token_char)
        });
        self.sent = if replica.is_some() {
            messages
        } else {
            Vec::new()
        };
        self.replica = replica;
    }

    /// No replica holds the view any more (a failed call): the next call sends it whole.
    pub fn forget(&mut self) {
        self.replica = None;
        self.sent.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::message::Role;

    fn request(texts: &[&str]) -> ModelRequest {
        ModelRequest {
            messages: texts
                .iter()
                .map(|t| Message::text(Role::User, *t))
                .collect(),
            persona_id: "cyrene".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_view_held_by_a_replica_continues_with_only_what_follows_it() {
        let mut view = SentView::default();
        let mut whole = request(&["a", "b", "c"]);
        assert_eq!(view.continued(&mut whole), None, "nothing held yet");
        view.answered(request(&["a", "b"]).messages, Some("r1".into()));
        let (subject, continued) = view.continued(&mut whole).unwrap();
        assert_eq!(subject, "cyrene.model.complete.stream.r1");
        assert_eq!(continued.messages, request(&["c"]).messages);
        assert_eq!(continued.persona_id, "cyrene");
        assert_eq!(
            continued.view,
            Some(ViewRef {
                id: view.id.clone(),
                base: 2
            })
        );
        assert_eq!(
            whole,
            request(&["a", "b", "c"]),
            "the whole view is left as built"
        );
    }

    #[test]
    fn a_view_goes_whole_when_no_replica_holds_what_it_starts_with() {
        let mut view = SentView::default();
        view.answered(request(&["a", "b"]).messages, Some("r1".into()));
        // An earlier message changed (a document read since, say): the held view is no prefix.
        assert_eq!(view.continued(&mut request(&["a", "B", "c"])), None);
        for replica in [None, Some("not.a.token".to_owned()), Some(String::new())] {
            let mut view = SentView::default();
            view.answered(request(&["a"]).messages, replica.clone());
            assert_eq!(
                view.continued(&mut request(&["a", "b"])),
                None,
                "{replica:?}"
            );
        }
        view.forget();
        assert_eq!(view.continued(&mut request(&["a", "b", "c"])), None);
        assert_eq!(view.whole().base, 0);
    }

    #[test]
    fn each_turn_attempt_names_its_own_view() {
        assert_ne!(SentView::default().id, SentView::default().id);
        assert!(ViewRef::valid_id(&SentView::default().id));
    }
}
