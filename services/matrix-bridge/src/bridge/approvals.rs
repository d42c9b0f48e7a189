//! Approving in a room (docs/matrix-bridge.md, "Approving"): the notices that ask for a decision,
//! the owner's decision replies passed on as `cyrene.bridge.session.approve`, and the notice of
//! the decision that holds. What the notices say and how a reply reads is [`approval`] (pure);
//! this is its I/O.
//!
//! # Invariants
//! - An `approval_requested` event is posted as a notice in the session's room once
//!   (transaction `cyrene-approval-<call>`, and `asked` in the state across restarts; at start
//!   the pending approvals of every known session are posted if they were not).
//! - Only the owner's decision reply ([`approval::parse`]) about a call of the room's session
//!   sends `cyrene.bridge.session.approve`, and is not passed on as a message; anyone else's is
//!   an ordinary message.
//! - The decision that holds is posted once per call (transaction `cyrene-decided-<call>`), by
//!   the answer or by the `approval_decided` event, whichever comes first, with the same text.

use super::{Bridge, Envelope, Retry, txn_safe};
use crate::approval::{self, Reply};
use crate::rooms::MessageEvent;
use cyrene_bus::RequestError;
use cyrene_protocol::approval::{
    ApprovalsRequest, ApprovalsResponse, ApproveRequest, ApproveResponse, DECIDED_BY_BRIDGE,
};
use cyrene_protocol::session::SessionEvent;
use cyrene_protocol::{ErrorCode, subjects};
use ruma::api::client::room::get_room_event;
use ruma::{OwnedEventId, OwnedRoomId};

impl Bridge {
    /// The approvals of `session_id`, decided or not.
    async fn approvals(&self, session_id: &str) -> Result<ApprovalsResponse, RequestError> {
        let request = ApprovalsRequest {
            session_id: session_id.to_owned(),
        };
        self.request(subjects::BRIDGE_SESSION_APPROVALS, &request)
            .await
    }

    /// The decision the owner's `event` states, and the session of its call: a reply to the
    /// bridge's notice, or `approve <call>` / `deny <call> [reason]` naming a call of
    /// `session_id` (listed by `cyrene.bridge.session.approvals`, pending or decided). `None`:
    /// an ordinary message.
    pub(super) async fn decision_in(
        &self,
        room_id: &OwnedRoomId,
        session_id: &str,
        event: &MessageEvent,
    ) -> Result<Option<(String, Reply)>, Retry> {
        let content = &event.content;
        if content.msgtype != "m.text" {
            return Ok(None);
        }
        let text = content.text();
        if !approval::starts_like_a_decision(&text) {
            return Ok(None);
        }
        if let Some(event_id) = content.reply_to()
            && let Some((session, call)) = self.quoted_notice(room_id, event_id).await
        {
            return Ok(approval::parse(&text, Some(&call)).map(|reply| (session, reply)));
        }
        let Some(reply) = approval::parse(&text, None) else {
            return Ok(None);
        };
        match self.approvals(session_id).await {
            Ok(listed) if listed.approvals.iter().any(|a| a.call_id == reply.call_id) => {
                Ok(Some((session_id.to_owned(), reply)))
            }
            Ok(_) => Ok(None),
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => Ok(None),
            Err(err) => Err(Retry(format!("approvals of {session_id}: {err}"))),
        }
    }

    /// The session and call of the bridge's approval notice `event_id`, if it is one.
    async fn quoted_notice(
        &self,
        room_id: &OwnedRoomId,
        event_id: &str,
    ) -> Option<(String, String)> {
        let event_id = OwnedEventId::try_from(event_id).ok()?;
        let request = get_room_event::v3::Request::new(room_id.clone(), event_id);
        let found = self.hs.call(request).await.ok()?;
        let envelope = serde_json::from_str::<Envelope>(found.event.json().get()).ok()?;
        if envelope.sender != self.bot.as_str() {
            return None;
        }
        let field = |name: &str| envelope.content.get(name)?.as_str().map(str::to_owned);
        Some((
            field(approval::SESSION_ID_FIELD)?,
            field(approval::CALL_ID_FIELD)?,
        ))
    }

    /// Sends the owner's decision (`cyrene.bridge.session.approve`) and posts the decision that
    /// holds; a refusal is told to the room.
    pub(super) async fn decide(
        &self,
        room_id: &OwnedRoomId,
        session_id: &str,
        event_id: &str,
        reply: Reply,
    ) -> Result<(), Retry> {
        let request = ApproveRequest {
            session_id: session_id.to_owned(),
            call_id: reply.call_id.clone(),
            decision: reply.decision,
            reason: reply.reason.clone(),
        };
        let sent: Result<ApproveResponse, RequestError> = self
            .request(subjects::BRIDGE_SESSION_APPROVE, &request)
            .await;
        let (txn, body) = match sent {
            Ok(held) => {
                // A batch read again repeats the bridge's own decision: still its own.
                let mine = !held.already_decided
                    || (held.decided_by == DECIDED_BY_BRIDGE && held.decision == reply.decision);
                metrics::counter!("cyrene_matrix_bridge_decisions_total",
                    "outcome" => if mine { "decided" } else { "already_decided" })
                .increment(1);
                if mine {
                    let text = approval::decision_text(
                        held.decision,
                        &held.call_id,
                        &held.decided_by,
                        reply.reason.as_deref(),
                    );
                    (decided_txn(&held.call_id), text)
                } else {
                    let text = approval::decision_text(
                        held.decision,
                        &held.call_id,
                        &held.decided_by,
                        None,
                    );
                    (
                        format!("cyrene-already-{}", txn_safe(event_id)),
                        format!("Already decided: {text}"),
                    )
                }
            }
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => {
                tracing::warn!(session = %session_id, code = %body.code, error = %body.message,
                    "the orchestrator refused a decision");
                metrics::counter!("cyrene_matrix_bridge_decisions_total", "outcome" => "refused")
                    .increment(1);
                let text = if body.code == ErrorCode::NotFound {
                    format!("No call {} waits for a decision here.", reply.call_id)
                } else {
                    format!(
                        "I couldn't take that decision about {} ({}). A reason may have at most \
                         {} bytes.",
                        reply.call_id,
                        body.code,
                        approval::MAX_REASON_BYTES
                    )
                };
                (format!("cyrene-refused-{}", txn_safe(event_id)), text)
            }
            Err(err) => return Err(Retry(format!("decision in {session_id}: {err}"))),
        };
        if let Err(err) = self
            .post_content(room_id, &txn, approval::notice(&body))
            .await
        {
            tracing::warn!(error = %err, "cannot post a decision");
        }
        Ok(())
    }

    /// Posts the notice asking for a decision about `call_id`, unless it was posted before.
    pub(super) async fn ask(
        &self,
        session_id: &str,
        call_id: &str,
        tool: &str,
        arguments: &serde_json::Map<String, serde_json::Value>,
    ) {
        let asked = {
            let state = self.state.lock().await;
            state
                .sessions
                .get(session_id)
                .is_some_and(|s| s.asked.contains(call_id))
        };
        let Some(room_id) = self.room_of(session_id).await else {
            return;
        };
        if asked {
            return;
        }
        let content = approval::request_content(session_id, tool, call_id, arguments);
        let txn = format!("cyrene-approval-{}", txn_safe(call_id));
        if let Err(err) = self.post_content(&room_id, &txn, content).await {
            tracing::warn!(session = %session_id, error = %err, "cannot ask for a decision");
            return;
        }
        metrics::counter!("cyrene_matrix_bridge_approvals_asked_total").increment(1);
        let mut state = self.state.lock().await;
        if let Some(session) = state.sessions.get_mut(session_id) {
            session.asked.insert(call_id.to_owned());
        }
        if let Err(err) = state.save(&self.config.data_dir) {
            tracing::error!(error = %err, "cannot save what was asked");
        }
    }

    /// Posts the decision that holds (an `approval_decided` event), once per call.
    pub(super) async fn decided(&self, event: &SessionEvent) {
        let (Some(call_id), Some(decision)) = (&event.call_id, event.decision) else {
            return;
        };
        let Some(room_id) = self.room_of(&event.session_id).await else {
            return;
        };
        let text = approval::decision_text(
            decision,
            call_id,
            event.decided_by.as_deref().unwrap_or_default(),
            event.reason.as_deref(),
        );
        if let Err(err) = self
            .post_content(&room_id, &decided_txn(call_id), approval::notice(&text))
            .await
        {
            tracing::warn!(error = %err, "cannot post a decision");
        }
        let mut state = self.state.lock().await;
        if let Some(session) = state.sessions.get_mut(&event.session_id)
            && session.asked.remove(call_id)
            && let Err(err) = state.save(&self.config.data_dir)
        {
            tracing::error!(error = %err, "cannot save what was decided");
        }
    }

    /// Posts the calls of `session_id` that wait for a decision and were not asked about yet
    /// (they were requested while the bridge was down), and forgets those decided since.
    pub async fn ask_pending(&self, session_id: &str) {
        let listed = match self.approvals(session_id).await {
            Ok(listed) => listed,
            Err(err) => {
                tracing::debug!(session = %session_id, error = %err, "cannot list the approvals");
                return;
            }
        };
        let pending: Vec<_> = listed
            .approvals
            .iter()
            .filter(|a| a.decision.is_none())
            .collect();
        for a in &pending {
            self.ask(session_id, &a.call_id, &a.tool, &a.arguments)
                .await;
        }
        let mut state = self.state.lock().await;
        if let Some(session) = state.sessions.get_mut(session_id) {
            let before = session.asked.len();
            session
                .asked
                .retain(|call| pending.iter().any(|a| a.call_id == *call));
            if session.asked.len() != before
                && let Err(err) = state.save(&self.config.data_dir)
            {
                tracing::error!(error = %err, "cannot save what was decided");
            }
        }
    }
}

/// The transaction of the notice of the decision that holds about `call_id`.
fn decided_txn(call_id: &str) -> String {
    format!("cyrene-decided-{}", txn_safe(call_id))
}
