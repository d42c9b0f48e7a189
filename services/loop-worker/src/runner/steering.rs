//! Steering at a turn's boundaries (docs/semantics.md, "Steering: messages that arrive while a
//! turn runs"; docs/loop-worker.md, "What \"taken in\" means"; the push: docs/orchestrator.md,
//! "Steering: claimed at `send`, pushed to the turn"). Owns [`Steering`]: the messages steered
//! into this turn, which of them it has taken in, and how the next boundary gets its input.
//!
//! # Invariants
//! - **Steering never cancels** (I1–I3): it happens only at boundaries, after the whole tool batch
//!   finished, and only adds to the next view. The first boundary of a delivery asks
//!   `cyrene.turn.steer`; later ones take what the orchestrator pushed meanwhile, with no round
//!   trip. A failed steer or a lost push yields nothing; the messages are handed back at
//!   completion and answered later.
//! - **Taken in means answered.** A steered message counts as taken in (checkpointed and
//!   reported in `steered_ids`) only once a model call whose view held it has answered; a turn
//!   past its deadline steers no more. Any other claimed message is handed back at completion
//!   and gets a turn of its own (D16: never consumed by a turn that ends first).
//! - **A resumed turn reads its steered messages again.** A checkpoint keeps the ids of the
//!   messages a turn took in, not their text: a redelivery gets them back from its first steer.
//!   If that steer fails, the job is handed back ([`Exit::Retry`]) rather than answered without
//!   them (which would report them answered).
//! - **Fenced.** A `conflict` from a steer means a newer attempt owns the turn: [`Exit::Stale`].

use super::{Exit, Turn};
use crate::assemble::{SteeredMessage, merge_steered};
use crate::ports::{TurnInput, TurnPorts};
use cyrene_protocol::session::SessionEventType;
use cyrene_protocol::turn::{SteerRequest, SteerResponse};
use cyrene_protocol::{ErrorBody, ErrorCode};

/// What this turn was steered, and how its next boundary gets input.
pub(super) struct Steering {
    /// Every message steered into this turn, in the order merged (only the view holds them).
    pub steered: Vec<SteeredMessage>,
    /// The ids of `steered` messages this turn has taken in: a model call whose view held them
    /// answered (or, for a resumed turn, the resumed checkpoint says one did). Only these are
    /// reported and checkpointed as `steered_ids`; every other claimed message goes back to
    /// pending at completion and is answered as a turn of its own (docs/loop-worker.md,
    /// "Steering").
    pub taken_in: Vec<String>,
    /// The highest sequence number merged so far: a steer asks only for what follows.
    after_seq: u64,
    /// What the orchestrator pushes to this turn; once the first steer of the delivery has
    /// answered, later boundaries take from here instead of asking.
    input: TurnInput,
    /// Whether this delivery's first steer has been asked.
    asked: bool,
}

impl Steering {
    /// A delivery's steering: `taken_in` as the resumed checkpoint says, input pushed to `input`
    /// (subscribed before the first steer, so nothing claimed after that steer's read is lost).
    pub fn new(taken_in: Vec<String>, after_seq: u64, input: TurnInput) -> Steering {
        Steering {
            steered: Vec::new(),
            taken_in,
            after_seq,
            input,
            asked: false,
        }
    }

    /// Whether a message this turn has taken in (a resumed checkpoint's `steered_ids`) is not in
    /// this delivery's view yet: only the delivery's first steer brings such messages back.
    pub fn misses_taken_in(&self) -> bool {
        self.taken_in
            .iter()
            .any(|id| !self.steered.iter().any(|s| s.id == *id))
    }

    /// The first `seen` steered messages were in the view of a model call that answered: they
    /// are taken in (reported in `steered_ids`, no longer handed back).
    pub fn took_in(&mut self, seen: usize) {
        for message in &self.steered[..seen.min(self.steered.len())] {
            if !self.taken_in.contains(&message.id) {
                self.taken_in.push(message.id.clone());
            }
        }
    }
}

impl<P: TurnPorts> Turn<'_, P> {
    fn steer_request(
        &self,
        step: u32,
    ) -> impl std::future::Future<Output = Result<SteerResponse, ErrorBody>> + '_ {
        self.ports.steer(SteerRequest {
            session_id: self.job.session_id.clone(),
            turn_id: self.job.turn_id.clone(),
            leg_id: self.job.leg_id.clone(),
            step,
            after_seq: self.steering.after_seq,
            attempt: self.attempt,
        })
    }

    /// A boundary's input. The delivery's first boundary asks `cyrene.turn.steer` (it claims
    /// what is pending and returns everything already claimed for the turn — all of it again
    /// for a resumed turn); every later one takes what was pushed since, with no round trip.
    /// Without a live subscription every boundary asks.
    pub(super) async fn steer(&mut self, step: u32) -> Result<(), Exit> {
        if self.steering.asked && self.steering.input.is_live() {
            let mut messages = self.steering.input.take();
            messages.sort_by_key(|m| m.seq);
            return self.merge(Ok(SteerResponse { messages }), step).await;
        }
        let steered = self.steer_request(step).await;
        if let Err(err) = &steered
            && err.code != ErrorCode::Conflict
            && !self.steering.asked
            && self.steering.misses_taken_in()
        {
            // A resumed delivery's earlier steered messages are held by the orchestrator alone
            // (a checkpoint keeps their ids, not their text): going on without them would
            // answer the turn as if they had been read. The job goes back instead.
            tracing::warn!(turn = %self.job.turn_id, step, error = %err,
                "the steer that returns this turn's steered messages failed; the job will be redelivered");
            return Err(Exit::Retry(err.clone()));
        }
        self.steering.asked = true;
        self.merge(steered, step).await
    }

    /// Takes a steer reply into the view; failures yield nothing (the messages stay pending).
    async fn merge(
        &mut self,
        steered: Result<SteerResponse, ErrorBody>,
        step: u32,
    ) -> Result<(), Exit> {
        let response = match steered {
            Ok(response) => response,
            Err(err) if err.code == ErrorCode::Conflict => {
                tracing::warn!(turn = %self.job.turn_id, attempt = self.attempt, error = %err,
                    "steer refused: a newer attempt owns this turn; stopping");
                return Err(Exit::Stale);
            }
            Err(err) => {
                tracing::debug!(turn = %self.job.turn_id, error = %err, "steer yielded nothing");
                return Ok(());
            }
        };
        let steering = &mut self.steering;
        if let Some(max) = response.messages.iter().map(|m| m.seq).max() {
            steering.after_seq = steering.after_seq.max(max);
        }
        let added = merge_steered(&mut steering.steered, response.messages);
        if !added.is_empty() {
            tracing::info!(turn = %self.job.turn_id, step, messages = added.len(), "input steered");
            self.event(SessionEventType::SteerAck, |e| {
                e.at_step = Some(step);
                e.message_ids = added;
            })
            .await;
        }
        Ok(())
    }
}
