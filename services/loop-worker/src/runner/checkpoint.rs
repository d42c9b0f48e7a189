//! A turn's checkpoints as deltas (docs/checkpoint-store.md, "Incremental checkpoints";
//! docs/loop-worker.md, "Crashes, redelivery, fencing"). Owns [`Saves`]: where the turn's rows
//! live, how much of the window the store is known to hold, and what the next row says beside
//! the window.
//!
//! # Invariants
//! - **A delta from the last known point.** A row holds the window's messages past what the store
//!   is known to hold, and the turn's base (the first `seed` messages) while the base was never
//!   stored; its size does not grow with the window.
//! - **Only a landed save moves the point on.** After any other outcome the next save sends again
//!   from the last known point (and the base, if that was never stored).
//! - **Fencing.** A `conflict` from a save means a newer attempt of this turn owns it: the
//!   runner stops at once ([`Exit::Stale`]) and reports nothing.
//!
//! # Pitfalls
//! - A save failure other than `conflict` never fails the turn (WARN): losing a snapshot only
//!   costs re-running a step after a crash.

use super::{Exit, Turn};
use crate::ports::TurnPorts;
use cyrene_protocol::checkpoint::{Checkpoint, CheckpointStateRef, checkpoint_id};
use cyrene_protocol::message::Message;
use cyrene_protocol::{ErrorBody, ErrorCode, JsonObject};

/// Where this turn's rows go and what the store holds of them.
pub(super) struct Saves {
    /// The owner key (`session` or `session#leg`) the rows are saved under.
    pub owner: String,
    /// How many messages of the window the store already holds for this turn (its base and the
    /// rows saved so far): a save sends only what follows. `None` while the turn's base is not
    /// stored: the next save carries the first `seed` messages as the base.
    pub stored: Option<usize>,
    pub seed: usize,
    /// Why the guard ended the turn (saved as the settled checkpoint's `guard_reason`).
    pub guard_reason: String,
    /// The calls of the current tool batch known never to have been sent (saved as the rows'
    /// `unsent` while the batch waits for approval, intents).
    pub unsent: Vec<String>,
}

impl Saves {
    pub fn new(owner: String, stored: Option<usize>, seed: usize) -> Saves {
        Saves {
            owner,
            stored,
            seed,
            guard_reason: String::new(),
            unsent: Vec::new(),
        }
    }
}

impl<P: TurnPorts> Turn<'_, P> {
    /// Where the next row starts in the window: the last point the store is known to hold, or
    /// the end of the base when it holds nothing of this turn yet.
    pub(super) fn delta_from(&self) -> usize {
        let saves = &self.saves;
        saves.stored.unwrap_or(saves.seed).min(self.window.len())
    }

    /// The step's checkpoint as a delta (docs/checkpoint-store.md, "Incremental checkpoints"):
    /// the window's messages past what the store holds, and the turn's base when it holds none.
    /// Its size does not grow with the window.
    pub(super) fn checkpoint(&self, step: u32, stop: &str, finish: &str) -> Checkpoint {
        self.checkpoint_with(step, stop, finish, &[])
    }

    /// [`Self::checkpoint`] with `more` after the window (a started batch's results so far).
    pub(super) fn checkpoint_with(
        &self,
        step: u32,
        stop: &str,
        finish: &str,
        more: &[Message],
    ) -> Checkpoint {
        let saves = &self.saves;
        let steered_ids = &self.steering.taken_in;
        let from = self.delta_from();
        let added: std::borrow::Cow<'_, [Message]> = if more.is_empty() {
            (&self.window[from..]).into()
        } else {
            [&self.window[from..], more].concat().into()
        };
        let state = CheckpointStateRef {
            step,
            from: Some(from),
            messages: &added,
            stop_reason: stop,
            finish_reason: finish,
            turn_id: &self.job.turn_id,
            steered_ids,
            guard_reason: &saves.guard_reason,
            unsent: &saves.unsent,
        };
        #[derive(serde::Serialize)]
        struct Base<'m> {
            messages: &'m [Message],
        }
        // A struct of messages always encodes, and as an object.
        let base = saves.stored.is_none().then(|| {
            JsonObject::encode(&Base {
                messages: &self.window[..from],
            })
            .unwrap_or_default()
        });
        let state = JsonObject::encode(&state).unwrap_or_default();
        Checkpoint {
            id: checkpoint_id(&saves.owner, Some(&self.job.turn_id), step),
            agent_id: saves.owner.clone(),
            step,
            state,
            turn_id: Some(self.job.turn_id.clone()),
            attempt: Some(self.attempt),
            base,
            created_at: None,
            updated_at: None,
        }
    }

    /// Takes a save's outcome; `covered` is the window length the saved checkpoint reached.
    /// Only a save known to have landed moves `stored` on: after any other outcome the next
    /// save sends again from the last known point (and the base, if that was never stored).
    pub(super) fn saved(
        &mut self,
        result: Result<(), ErrorBody>,
        covered: usize,
    ) -> Result<(), Exit> {
        match result {
            Ok(()) => {
                self.saves.stored = Some(covered);
                Ok(())
            }
            Err(err) if err.code == ErrorCode::Conflict => {
                tracing::warn!(turn = %self.job.turn_id, attempt = self.attempt, error = %err,
                    "checkpoint refused: a newer attempt owns this turn; stopping");
                Err(Exit::Stale)
            }
            Err(err) => {
                tracing::warn!(turn = %self.job.turn_id, error = %err, "checkpoint save failed");
                Ok(())
            }
        }
    }
}
