//! The auto-approver: a client deciding every tool call that waits for approval over the bus
//! (`cyrene.session.approve`), as a person at a web page would. It learns of a call from its
//! `approval_requested` event, and — since events are at most once (a nats-server restart loses
//! some) — by listing the approvals of every session it has seen (`cyrene.session.approvals`)
//! every two seconds, as a page reloaded would. After a think time of 50–400 ms it approves
//! three calls in four and denies the rest with a reason, retrying until a reply comes (the
//! orchestrator may be down). For one call in five it then sends the opposite decision too: the
//! reply must name the first one, `already_decided`.

use crate::script::{self, Rng};
use cyrene_bus::{RequestError, request_json};
use cyrene_protocol::approval::{
    ApprovalsRequest, ApprovalsResponse, ApproveRequest, ApproveResponse, Decision,
};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::subjects;
use futures::StreamExt;
use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One answer the orchestrator gave the approver.
#[derive(Debug, Clone)]
pub struct Answer {
    pub session_id: String,
    pub call_id: String,
    /// What the approver asked for.
    pub asked: Decision,
    /// The decision that holds, as the reply says.
    pub held: Decision,
    pub already_decided: bool,
    /// When the approver first learnt that the call waits.
    pub requested_at: Instant,
    pub answered_at: Instant,
}

#[derive(Debug, Default)]
struct State {
    answers: Vec<Answer>,
    /// Calls being decided or decided (by session and call id).
    taken: HashSet<(String, String)>,
    sessions: BTreeSet<String>,
}

/// The running approver.
#[derive(Debug, Clone)]
pub struct Approver {
    state: Arc<Mutex<State>>,
}

/// One request to the orchestrator, as a page would make it: an answer within five seconds.
async fn ask<Req, Resp>(
    client: &async_nats::Client,
    subject: &str,
    request: &Req,
) -> Result<Resp, RequestError>
where
    Req: serde::Serialize,
    Resp: serde::de::DeserializeOwned,
{
    request_json(client, subject, request, Duration::from_secs(5)).await
}

/// Whether the approver approves `call_id` (three in four) — a stable choice per call.
pub fn approves(call_id: &str) -> bool {
    !script::hash(&format!("{call_id}/deny")).is_multiple_of(4)
}

impl Approver {
    pub async fn start(client: &async_nats::Client, seed: u64) -> Approver {
        let approver = Approver {
            state: Arc::default(),
        };
        let mut events = client
            .subscribe(subjects::SESSION_EVENTS_ALL)
            .await
            .unwrap();
        let (a, c) = (approver.clone(), client.clone());
        let rng = Arc::new(Mutex::new(Rng::new(seed)));
        let r = rng.clone();
        tokio::spawn(async move {
            while let Some(m) = events.next().await {
                let Ok(event) = serde_json::from_slice::<SessionEvent>(&m.payload) else {
                    continue;
                };
                a.state
                    .lock()
                    .unwrap()
                    .sessions
                    .insert(event.session_id.clone());
                if event.kind == SessionEventType::ApprovalRequested
                    && let Some(call_id) = event.call_id
                {
                    a.decide(&c, &r, event.session_id, call_id);
                }
            }
        });
        let (a, c) = (approver.clone(), client.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let sessions: Vec<String> =
                    a.state.lock().unwrap().sessions.iter().cloned().collect();
                for session_id in sessions {
                    let request = ApprovalsRequest {
                        session_id: session_id.clone(),
                    };
                    let listed: Result<ApprovalsResponse, _> =
                        ask(&c, subjects::SESSION_APPROVALS, &request).await;
                    for waiting in listed.map(|l| l.approvals).unwrap_or_default() {
                        if waiting.decision.is_none() {
                            a.decide(&c, &rng, session_id.clone(), waiting.call_id);
                        }
                    }
                }
            }
        });
        client.flush().await.unwrap();
        approver
    }

    /// Decides `call_id` of `session_id` once (a task of its own), unless it is being decided.
    fn decide(
        &self,
        client: &async_nats::Client,
        rng: &Mutex<Rng>,
        session_id: String,
        call_id: String,
    ) {
        let requested_at = Instant::now();
        if !self
            .state
            .lock()
            .unwrap()
            .taken
            .insert((session_id.clone(), call_id.clone()))
        {
            return;
        }
        let (think, twice) = {
            let mut rng = rng.lock().unwrap();
            (
                rng.between(Duration::from_millis(50), Duration::from_millis(400)),
                rng.percent(20),
            )
        };
        let first = match approves(&call_id) {
            true => Decision::Approve,
            false => Decision::Deny,
        };
        let second = match first {
            Decision::Approve => Decision::Deny,
            Decision::Deny => Decision::Approve,
        };
        let (this, client) = (self.clone(), client.clone());
        tokio::spawn(async move {
            tokio::time::sleep(think).await;
            let asks = if twice {
                vec![first, second]
            } else {
                vec![first]
            };
            for asked in asks {
                let request = ApproveRequest {
                    session_id: session_id.clone(),
                    call_id: call_id.clone(),
                    decision: asked,
                    reason: (asked == Decision::Deny).then(|| "chaos says no".to_owned()),
                };
                let give_up = Instant::now() + Duration::from_secs(120);
                while Instant::now() < give_up {
                    let reply: Result<ApproveResponse, _> =
                        ask(&client, subjects::SESSION_APPROVE, &request).await;
                    match reply {
                        Ok(reply) => {
                            this.state.lock().unwrap().answers.push(Answer {
                                session_id: session_id.clone(),
                                call_id: call_id.clone(),
                                asked,
                                held: reply.decision,
                                already_decided: reply.already_decided,
                                requested_at,
                                answered_at: Instant::now(),
                            });
                            break;
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            }
        });
    }

    /// Every answer so far, in the order they came.
    pub fn answers(&self) -> Vec<Answer> {
        self.state.lock().unwrap().answers.clone()
    }
}
