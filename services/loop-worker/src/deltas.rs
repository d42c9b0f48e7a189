//! Live answer text: the model call of a step is streamed through the gateway
//! (`cyrene.model.complete.stream`) and each piece of user-visible text is published on the
//! session's events as a `delta` event (docs/loop-worker.md, "Deltas").
//!
//! # Invariants
//! - Deltas are a preview, never state: nothing here is checkpointed, and the step's response is
//!   the gateway's end marker (the same response the non-streamed call gives), so a completed
//!   step is saved exactly as before.
//! - Only `text` deltas are published (reasoning and tool-call arguments are not answer text).
//! - A guarded persona's turn publishes none ([`DeltaTag::preview`] false): its answer must not
//!   reach the session before the guard has allowed it (docs/loop-worker.md, "Guardrails").
//! - `seq` counts from 0 within one (turn, attempt, step); `attempt` is the turn's delivery, so a
//!   client seeing a higher attempt knows the text is being streamed again after a redelivery
//!   (the resumed step restarts from its checkpoint).
//!
//! The runner's only hook is [`complete`], called where it calls the model for a step.
//!
//! A turn's step calls also continue one **held view** ([`SentView`], docs/model-gateway.md,
//! "Held views"): after its first call the gateway replica that answered holds the view, and the
//! next step sends only the messages after what it holds, to that replica. The runner builds
//! only those messages when its view provably appends to the held one (crate::assemble,
//! `extend_view`, checked against whole assembly by a test) and holds no more images than a
//! request keeps (crate::images), else the whole view, which goes whole. In a turn nobody steers
//! into, that is every step after the first. A replica that is gone or no longer holds the view (`no responders`, `not_found`) costs
//! one more call: the whole view (the held one followed by what was added), to any replica.

use crate::assemble::ViewShape;
use cyrene_protocol::message::Message;
use cyrene_protocol::model::{ModelRequest, ViewRef};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::turn::TurnJob;

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
    /// Whether the call's text is published as `delta` events: false when the turn has a guard,
    /// whose answer reaches the session only once the guard allowed it.
    pub preview: bool,
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
            preview: job.guard.is_none(),
        }
    }

    /// The `delta` event for text piece number `seq` of the step's call sent again `retry`
    /// times after its gateway replica died mid-call (0: the first try; a retry restarts `seq`).
    pub fn event_of_retry(&self, retry: u32, seq: u64, text: String) -> SessionEvent {
        let mut event = self.event(seq, text);
        event.retry = (retry > 0).then_some(retry);
        event
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

/// What a turn's step calls sent of its view, and which gateway replica holds it.
///
/// The runner asks [`SentView::shape`] how the held view was assembled; when the next view
/// only appends to it (crate::assemble::extend_view), the request it builds holds just the
/// appended messages, and says so with [`SentView::stage`]. Nothing then assembles, copies or
/// compares the whole view: it goes whole only on a fallback ([`SentView::whole`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SentView {
    /// A new id (74 random bits): the view's name is what makes it the turn's
    /// (docs/model-gateway.md).
    id: String,
    replica: Option<String>,
    /// The whole view `replica` holds (empty when none), and how it was assembled.
    sent: Vec<Message>,
    shape: Option<ViewShape>,
    /// How the next call's request was built: its view's shape, and whether its messages are
    /// only what follows `sent`.
    staged: Option<(ViewShape, bool)>,
}

impl Default for SentView {
    fn default() -> SentView {
        SentView {
            id: cyrene_protocol::ids::new_id(),
            replica: None,
            sent: Vec::new(),
            shape: None,
            staged: None,
        }
    }
}

impl SentView {
    /// How the view a replica holds was assembled; `None` when no replica holds one.
    pub fn shape(&self) -> Option<&ViewShape> {
        self.shape.as_ref()
    }

    /// The next call's request holds the view of `shape`: only what follows the held view
    /// (`added`, possible only while [`SentView::shape`] is `Some`), or the whole view.
    pub fn stage(&mut self, shape: ViewShape, added: bool) {
        self.staged = Some((shape, added && self.shape.is_some()));
    }

    fn added(&self) -> bool {
        self.staged.as_ref().is_some_and(|(_, added)| *added)
    }

    /// `request` (staged as only what it adds) as a call continuing the view its replica
    /// holds, and that replica's subject; its messages move to the call. `None` when the request
    /// is a whole view, or no replica holds one.
    pub fn continued(&self, request: &mut ModelRequest) -> Option<(String, ModelRequest)> {
        let replica = self.replica.as_deref()?;
        if !self.added() {
            return None;
        }
        let base = u32::try_from(self.sent.len()).ok()?;
        let mut continued = ModelRequest {
            messages: std::mem::take(&mut request.messages),
            ..request.clone()
        };
        continued.view = Some(ViewRef {
            id: self.id.clone(),
            base,
        });
        Some((
            cyrene_protocol::subjects::model_complete_stream_at(replica),
            continued,
        ))
    }

    /// Makes `request` the whole view (the held one is moved in front of what it adds) and
    /// names the view whole (`base` 0), for any replica. The held view is let go either way.
    pub fn whole(&mut self, request: &mut ModelRequest) -> ViewRef {
        let mut held = std::mem::take(&mut self.sent);
        if let Some((_, added)) = self.staged.as_mut()
            && *added
        {
            held.append(&mut request.messages);
            request.messages = held;
            *added = false;
        }
        self.replica = None;
        self.shape = None;
        ViewRef {
            id: self.id.clone(),
            base: 0,
        }
    }

    /// The staged call was answered, by `replica` holding its view (`None`: nobody); `messages`
    /// are the request's, as it was staged.
    pub fn answered(&mut self, mut messages: Vec<Message>, replica: Option<String>) {
        let replica = replica.filter(|r| {
            (1..=64).contains(&r.len()) && r.chars().all(cyrene_protocol::ids::is_token_char)
        });
        let staged = self.staged.take();
        match (replica, staged) {
            (Some(replica), Some((shape, added))) => {
                if added {
                    self.sent.append(&mut messages);
                } else {
                    self.sent = messages;
                }
                self.shape = Some(shape);
                self.replica = Some(replica);
            }
            _ => self.forget(),
        }
    }

    /// No replica holds the view any more (a failed call): the next call sends it whole.
    pub fn forget(&mut self) {
        self.replica = None;
        self.sent.clear();
        self.shape = None;
        self.staged = None;
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

    fn held(texts: &[&str], replica: &str) -> SentView {
        let mut view = SentView::default();
        view.stage(ViewShape::default(), false);
        view.answered(request(texts).messages, Some(replica.into()));
        view
    }

    #[test]
    fn what_a_step_adds_continues_the_view_its_replica_holds() {
        let mut view = SentView::default();
        view.stage(ViewShape::default(), true);
        assert_eq!(
            view.continued(&mut request(&["c"])),
            None,
            "nothing held yet: no extension can be staged"
        );
        let mut view = held(&["a", "b"], "r1");
        assert!(view.shape().is_some());
        view.stage(ViewShape::default(), true);
        let mut added = request(&["c"]);
        let (subject, continued) = view.continued(&mut added).unwrap();
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
        assert!(added.messages.is_empty(), "the messages moved to the call");
        view.answered(continued.messages, Some("r2".into()));
        assert_eq!(view.sent, request(&["a", "b", "c"]).messages);
        assert_eq!(view.replica.as_deref(), Some("r2"));
    }

    #[test]
    fn a_whole_view_goes_whole_and_a_fallback_puts_the_held_view_first() {
        let mut view = held(&["a", "b"], "r1");
        view.stage(ViewShape::default(), false);
        let mut whole = request(&["a", "B", "c"]);
        assert_eq!(view.continued(&mut whole), None);
        assert_eq!(view.whole(&mut whole).base, 0);
        assert_eq!(whole, request(&["a", "B", "c"]), "left as built");

        // The replica is gone: what was added goes again, after the view it continued.
        let mut view = held(&["a", "b"], "r1");
        view.stage(ViewShape::default(), true);
        let mut added = request(&["c"]);
        let (_, continued) = view.continued(&mut added).unwrap();
        added.messages = continued.messages;
        assert_eq!(view.whole(&mut added).base, 0);
        assert_eq!(added, request(&["a", "b", "c"]));
        view.answered(added.messages, Some("r2".into()));
        assert_eq!(view.sent, request(&["a", "b", "c"]).messages);
    }

    #[test]
    fn a_view_nobody_holds_is_forgotten() {
        for replica in [None, Some("not.a.token".to_owned()), Some(String::new())] {
            let mut view = held(&["a"], "r1");
            view.stage(ViewShape::default(), true);
            view.answered(request(&["b"]).messages, replica.clone());
            assert_eq!(view.shape(), None, "{replica:?}");
            view.stage(ViewShape::default(), true);
            assert_eq!(view.continued(&mut request(&["c"])), None, "{replica:?}");
        }
        let mut view = held(&["a"], "r1");
        view.forget();
        assert_eq!(view.shape(), None);
        assert!(view.sent.is_empty());
    }

    #[test]
    fn each_turn_attempt_names_its_own_view() {
        assert_ne!(SentView::default().id, SentView::default().id);
        assert!(ViewRef::valid_id(&SentView::default().id));
    }
}
