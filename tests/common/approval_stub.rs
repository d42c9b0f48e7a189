//! A stand-in for the orchestrator's side of approval (docs/orchestrator.md, "Approvals"), for
//! testing a client — the web page (tests/web.rs) or the Matrix bridge (tests/matrix.rs) — on a
//! real nats-server against the wire contract alone. It answers one client's subjects
//! (`cyrene.person.<p>.…` or `cyrene.bridge.…`): `session.approve` and `.approvals` with the
//! contract's rules (the first decision holds; a later one gets it back with `already_decided`;
//! an unknown call is `not_found`), publishing `approval_decided` as the orchestrator does, and
//! the few other requests such a client makes (`session.send` acked and recorded,
//! `session.history` empty, `session.list`, `checkpoint.list` empty). The test publishes
//! `approval_requested` and `tool_outcome_unknown` events through it.

use cyrene_protocol::approval::{Approval, ApproveRequest, ApproveResponse, Decision};
use cyrene_protocol::session::{Disposition, SendAck, SendRequest, SessionEvent, SessionEventType};
use serde_json::{Map, Value, json};
use std::sync::{Arc, Mutex};

/// What the stub was told and asked.
#[derive(Debug, Default)]
struct Known {
    /// (session, approval), in the order asked.
    approvals: Vec<(String, Approval)>,
    /// Every `session.approve` body that was a valid `ApproveRequest`.
    decisions: Vec<ApproveRequest>,
    /// Every `session.send`.
    sends: Vec<SendRequest>,
}

pub struct ApprovalStub {
    client: async_nats::Client,
    /// `decided_by` of the decisions this client makes (`person:<p>`, `bridge`).
    decided_by: String,
    known: Mutex<Known>,
}

impl ApprovalStub {
    /// Answers the requests on `<prefix>…` (`cyrene.person.alice.`, `cyrene.bridge.`) until the
    /// connection closes; `decided_by` names the client's decisions.
    pub async fn start(client: async_nats::Client, prefix: &str, decided_by: &str) -> Arc<Self> {
        let stub = Arc::new(ApprovalStub {
            client: client.clone(),
            decided_by: decided_by.into(),
            known: Mutex::default(),
        });
        let mut requests = client.subscribe(format!("{prefix}>")).await.unwrap();
        client.flush().await.unwrap();
        let prefix = prefix.to_owned();
        let serving = stub.clone();
        tokio::spawn(async move {
            while let Some(m) = futures::StreamExt::next(&mut requests).await {
                let Some(reply) = m.reply.clone() else {
                    continue;
                };
                let what = m.subject.as_str().trim_start_matches(prefix.as_str());
                let answer = serving.answer(what, &m.payload).await;
                let body = serde_json::to_vec(&answer).unwrap();
                client.publish(reply, body.into()).await.unwrap();
            }
        });
        stub
    }

    async fn answer(&self, what: &str, payload: &[u8]) -> Value {
        let body: Value = serde_json::from_slice(payload).unwrap_or_default();
        let session = body["session_id"].as_str().unwrap_or_default().to_owned();
        match what {
            "session.list" => {
                let known = self.known.lock().unwrap();
                let mut sessions: Vec<&str> =
                    known.approvals.iter().map(|(s, _)| s.as_str()).collect();
                sessions.dedup();
                json!({"sessions": sessions.iter().map(|s| json!({"session_id": s})).collect::<Vec<_>>()})
            }
            "session.history" => json!({"messages": []}),
            "checkpoint.list" => json!({"checkpoints": []}),
            "session.send" => match serde_json::from_slice::<SendRequest>(payload) {
                Ok(send) => {
                    let mut known = self.known.lock().unwrap();
                    let context_only = send.context_only;
                    known.sends.push(send);
                    let ack = SendAck {
                        message_id: format!("m{}", known.sends.len()),
                        seq: known.sends.len() as u64,
                        disposition: if context_only {
                            Disposition::ContextOnly
                        } else {
                            Disposition::TurnStarted
                        },
                        turn_id: String::new(),
                    };
                    serde_json::to_value(ack).unwrap()
                }
                Err(err) => error("bad_request", &err.to_string()),
            },
            "session.approvals" => {
                let known = self.known.lock().unwrap();
                let of_session = known.approvals.iter().filter(|(s, _)| *s == session);
                let (pending, decided): (Vec<_>, Vec<_>) =
                    of_session.partition(|(_, a)| a.decision.is_none());
                let listed: Vec<&Approval> =
                    pending.into_iter().chain(decided).map(|(_, a)| a).collect();
                json!({"approvals": listed})
            }
            "session.approve" => self.approve(payload).await,
            _ => error("not_found", "not in the stub"),
        }
    }

    async fn approve(&self, payload: &[u8]) -> Value {
        let request: ApproveRequest = match serde_json::from_slice(payload) {
            Ok(request) => request,
            Err(err) => return error("bad_request", &err.to_string()),
        };
        let (response, event) = {
            let mut known = self.known.lock().unwrap();
            known.decisions.push(request.clone());
            let Some((_, a)) = known
                .approvals
                .iter_mut()
                .find(|(s, a)| *s == request.session_id && a.call_id == request.call_id)
            else {
                return error("not_found", "no such call waits");
            };
            let already_decided = a.decision.is_some();
            if !already_decided {
                a.decision = Some(request.decision);
                a.reason = request.reason.clone();
                a.decided_by = Some(self.decided_by.clone());
            }
            let response = ApproveResponse {
                session_id: request.session_id.clone(),
                call_id: a.call_id.clone(),
                decision: a.decision.unwrap(),
                already_decided,
                decided_by: a.decided_by.clone().unwrap(),
            };
            let event = (!already_decided).then(|| decided_event(&request.session_id, a));
            (response, event)
        };
        if let Some(event) = event {
            self.publish(&event).await;
        }
        serde_json::to_value(response).unwrap()
    }

    async fn publish(&self, event: &SessionEvent) {
        let subject = format!("cyrene.session.{}.events", event.session_id);
        let body = serde_json::to_vec(event).unwrap();
        self.client.publish(subject, body.into()).await.unwrap();
        self.client.flush().await.unwrap();
    }

    /// A call of `session` asks for approval: listed, and its `approval_requested` published.
    pub async fn ask(&self, session: &str, call_id: &str, tool: &str, arguments: Value) {
        let approval = Approval {
            turn_id: format!("t-{call_id}"),
            call_id: call_id.into(),
            tool: tool.into(),
            arguments: object(arguments),
            requested_at_ms: 1_764_979_200_000,
            deadline_ms: 1_765_065_600_000,
            decision: None,
            reason: None,
            decided_by: None,
        };
        let mut event = SessionEvent::new(SessionEventType::ApprovalRequested, session);
        event.turn_id = approval.turn_id.clone();
        event.call_id = Some(approval.call_id.clone());
        event.tool = Some(approval.tool.clone());
        event.arguments = Some(approval.arguments.clone());
        event.deadline_ms = Some(approval.deadline_ms);
        self.known
            .lock()
            .unwrap()
            .approvals
            .push((session.into(), approval));
        self.publish(&event).await;
    }

    /// The call is decided by someone else (`decided_by`) and its event is lost: only a request
    /// learns it.
    pub fn decided_elsewhere(&self, call_id: &str, decision: Decision, decided_by: &str) {
        let mut known = self.known.lock().unwrap();
        let (_, a) = known
            .approvals
            .iter_mut()
            .find(|(_, a)| a.call_id == call_id)
            .unwrap();
        a.decision = Some(decision);
        a.decided_by = Some(decided_by.into());
    }

    /// A `tool_outcome_unknown` event of `session`.
    pub async fn outcome_unknown(
        &self,
        session: &str,
        call_id: &str,
        tool: &str,
        arguments: Value,
    ) {
        let mut event = SessionEvent::new(SessionEventType::ToolOutcomeUnknown, session);
        event.turn_id = format!("t-{call_id}");
        event.call_id = Some(call_id.into());
        event.tool = Some(tool.into());
        event.arguments = Some(object(arguments));
        self.publish(&event).await;
    }

    /// The decisions the client sent: (session, call, decision, reason).
    pub fn decisions(&self) -> Vec<(String, String, Decision, Option<String>)> {
        let known = self.known.lock().unwrap();
        known
            .decisions
            .iter()
            .map(|r| {
                (
                    r.session_id.clone(),
                    r.call_id.clone(),
                    r.decision,
                    r.reason.clone(),
                )
            })
            .collect()
    }

    /// The texts of the messages the client sent, with their sessions.
    pub fn sends(&self) -> Vec<(String, String)> {
        let known = self.known.lock().unwrap();
        known
            .sends
            .iter()
            .map(|s| (s.session_id.clone(), s.message.text_content()))
            .collect()
    }
}

fn decided_event(session: &str, a: &Approval) -> SessionEvent {
    let mut event = SessionEvent::new(SessionEventType::ApprovalDecided, session);
    event.turn_id = a.turn_id.clone();
    event.call_id = Some(a.call_id.clone());
    event.tool = Some(a.tool.clone());
    event.decision = a.decision;
    event.reason = a.reason.clone();
    event.decided_by = a.decided_by.clone();
    event
}

fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

fn error(code: &str, message: &str) -> Value {
    json!({"error": {"code": code, "message": message}})
}
