//! Guardrails (docs/loop-worker.md, "Guardrails"): asking a persona's guard (crate::guard) about a
//! step's tool calls and about the answer, and what the person is told when it says no.
//!
//! # Invariants
//! A turn whose job names a guard asks it about every call of a tool batch (concurrently,
//! `args_error` calls excepted) before any of them runs, and about the answer (a step's or the
//! safety net's) before it is settled. A deny, or a failure under `closed`, runs none of the
//! batch / sends nothing of the answer: the turn settles with stop reason `guardrail`, the
//! persona's configured message as its answer (the guard's reason only in the log and the
//! checkpoint's `guard_reason`), and a redelivery reports that again. Such a turn publishes no
//! `delta` events (crate::deltas), so no text of an answer reaches the session before the guard
//! allowed it.

use super::{Exit, Turn};
use crate::ports::TurnPorts;
use cyrene_protocol::message::{Message, Role, ToolCall};

impl<P: TurnPorts> Turn<'_, P> {
    /// Asks the guard about every call of a batch at once, `args_error` calls excepted (they do
    /// not run anyway): the first deny (or closed failure), in call order, as the reason the turn
    /// ends; `None` when every call may run or the turn has no guard.
    pub(super) async fn guard_calls(&self, calls: &[ToolCall]) -> Option<String> {
        let spec = self.job.guard.as_ref()?;
        let asked = calls.iter().filter(|c| c.args_error.is_none()).map(|call| {
            let request = crate::guard::tool_call(self.job, call);
            async move { (call, crate::guard::check(self.ports, spec, &request).await) }
        });
        for (call, verdict) in futures::future::join_all(asked).await {
            if let crate::guard::Verdict::Deny { reason, failed } = verdict {
                tracing::warn!(turn = %self.job.turn_id, tool = %call.name, call_id = %call.id,
                    failed, reason = %reason, "the guard stopped a tool call; no call of the batch runs");
                return Some(format!("tool_call {}: {reason}", call.name));
            }
        }
        None
    }

    /// Asks the guard about an answer before it is settled (and so before any of it reaches the
    /// session): a deny (or closed failure) turns it into [`Exit::Guardrail`].
    pub(super) async fn guard_answer(&self, exit: Exit) -> Exit {
        let (Some(spec), Exit::Final { message, .. }) = (self.job.guard.as_ref(), &exit) else {
            return exit;
        };
        let request = crate::guard::answer(self.job, message.text_content());
        match crate::guard::check(self.ports, spec, &request).await {
            crate::guard::Verdict::Allow => exit,
            crate::guard::Verdict::Deny { reason, failed } => {
                tracing::warn!(turn = %self.job.turn_id, failed, reason = %reason,
                    "the guard stopped the answer; the person gets the persona's message");
                Exit::Guardrail {
                    reason: format!("answer: {reason}"),
                }
            }
        }
    }

    /// The answer a guard's deny gives the person: the persona's configured message.
    pub(super) fn guard_message(&self) -> Message {
        let text = self
            .job
            .guard
            .as_ref()
            .map_or(cyrene_protocol::guard::DEFAULT_GUARD_MESSAGE, |g| {
                g.message.as_str()
            });
        let mut message = Message::text(Role::Assistant, text);
        message.sender_name = self.job.env.persona.clone();
        message
    }
}
