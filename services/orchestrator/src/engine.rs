//! [`Engine`]: the orchestrator's behaviour behind the endpoints — input checks, the store calls,
//! session events, turn dispatch to `CYRENE_TURNS`, and the completion notifications of asks.
//!
//! # Invariants
//! - A send is acknowledged only after its message is committed; when the database fails or
//!   does not answer in time the caller gets `unavailable` (and may resend with the same key).
//! - Dispatch happens after the turn is committed: the job is published to JetStream with
//!   `Nats-Msg-Id` = turn id and the publish ack awaited, then the turn is marked dispatched.
//!   The sweeper ([`Engine::sweep`]) republishes running turns never marked, so a crash or a bus
//!   failure between commit and publish delays a turn but never loses it; JetStream drops the
//!   duplicates within its window ([`cyrene_bus::streams::TURNS_DUPLICATE_WINDOW`]).
//! - `turn_started` is published before the job, `turn_ended` after the completion commits.
//!
//! # Pitfalls
//! - A turn whose publish was acknowledged but not marked (crash in between) is republished by
//!   the sweeper; past the duplicate window that is a second delivery of a possibly running job,
//!   which the workers' fencing (`attempt`) and the completed-turn check absorb.

use crate::config::Config;
use crate::documents::Documents;
use crate::identity::{self, Caller};
use crate::store::{NewMessage, NewTurn, Pushed, Store};
use async_nats::jetstream;
use async_nats::{Client, HeaderMap};
use bytes::Bytes;
use cyrene_bus::service::{page_within, reply_budget};
use cyrene_bus::trace;
use cyrene_checkpoint_client::CheckpointClient;
use cyrene_protocol::checkpoint::{ProgressRequest, TurnProgress, TurnRef};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::message::{Message, Part, Role, SenderKind};
use cyrene_protocol::session::{
    BusyPolicy, Disposition, HISTORY_DEFAULT_LIMIT, HISTORY_MAX_LIMIT, HistoryRequest,
    HistoryResponse, SESSION_LIST_DEFAULT_LIMIT, SESSION_LIST_MAX_LIMIT, SendAck, SendRequest,
    SessionEnv, SessionEvent, SessionEventType, SessionListRequest, SessionListResponse,
};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::{
    RUNNING_TURNS_DEFAULT_LIMIT, RUNNING_TURNS_MAX_LIMIT, RunningTurn, RunningTurnsRequest,
    RunningTurnsResponse, SteerRequest, SteerResponse, TurnComplete, TurnCompleteAck, TurnOutcome,
};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_sql::bounded;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;
use std::sync::Arc;
use std::time::Duration;

/// Longest idempotency key accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 256;
/// Longest `sender_name` accepted on a user message.
pub const MAX_SENDER_NAME: usize = 128;
/// How long a JetStream publish (including its ack) may take.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a progress read of the checkpoint store may take (a parallel leg's notice, the
/// steps of `cyrene.turns.running`); past it the notice or the steps go without.
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(2);

/// The completion notification of a turn that answers an ask, published on the ask's private
/// core NATS subject by whichever replica records the completion.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnDone {
    pub turn_id: String,
    pub outcome: TurnOutcome,
    /// The final answer's text (empty when there is none).
    #[serde(default)]
    pub text: String,
    pub error: Option<ErrorBody>,
}

/// The orchestrator's shared state.
#[derive(Debug)]
pub struct Engine {
    pub(crate) store: Store,
    client: Client,
    js: jetstream::Context,
    config: Arc<Config>,
    /// Progress of running turns, as of their last saved step (`cyrene.checkpoint.progress`).
    checkpoints: CheckpointClient,
    documents: Documents,
}

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::BadRequest, message)
}

fn check_id(kind: IdKind, field: &str, id: &str) -> Result<(), ErrorBody> {
    ids::validate(kind, id).map_err(|e| bad(format!("{field}: {e}")))
}

/// Turn ids are server-issued, but workers send them back: same token rule as other ids.
fn check_turn_id(id: &str) -> Result<(), ErrorBody> {
    ids::validate(IdKind::Leg, id).map_err(|e| {
        bad(format!(
            "turn_id: {}",
            e.to_string().replace("leg id", "turn id")
        ))
    })
}

/// Checks the ids a worker's steer or completion names its turn by: session, turn and (for a
/// parallel leg) leg.
fn check_turn_ref(session_id: &str, turn_id: &str, leg_id: &str) -> Result<(), ErrorBody> {
    check_id(IdKind::Session, "session_id", session_id)?;
    check_turn_id(turn_id)?;
    if !leg_id.is_empty() {
        check_id(IdKind::Leg, "leg_id", leg_id)?;
    }
    Ok(())
}

/// The most image parts one user message may hold (each may cost a vision call in every turn it
/// is seen by; the loop worker also sends at most 32 per model request).
pub const MAX_MESSAGE_IMAGES: usize = 16;

/// Checks a user message: role, non-empty content of user-side parts, sizes, at most
/// [`MAX_MESSAGE_IMAGES`] images.
pub fn check_user_message(message: &Message, max_bytes: usize) -> Result<(), ErrorBody> {
    if message.role != Role::User {
        return Err(bad(format!(
            "message role must be user, not {}",
            serde_json::to_value(message.role)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        )));
    }
    if !message.tool_call_id.is_empty() || !message.tool_call_name.is_empty() {
        return Err(bad(
            "a user message cannot carry tool_call_id or tool_call_name",
        ));
    }
    if message.sender_name.chars().count() > MAX_SENDER_NAME {
        return Err(bad(format!(
            "sender_name is longer than {MAX_SENDER_NAME} characters"
        )));
    }
    let mut substantive = false;
    for part in &message.content {
        match part {
            Part::Text { text } => substantive |= !text.trim().is_empty(),
            Part::ImageUrl { image_url } => {
                let ok = image_url.starts_with("data:image/")
                    || image_url.starts_with("https://")
                    || image_url.starts_with("http://");
                if !ok {
                    return Err(bad(
                        "image_url must be a data:image/… URI or an http(s) URL",
                    ));
                }
                substantive = true;
            }
            Part::Document { url, .. } => {
                if !url.starts_with("cyrene-doc://") {
                    return Err(bad(
                        "document url must be a server-issued cyrene-doc:// URL",
                    ));
                }
                substantive = true;
            }
            Part::ToolCall { .. } | Part::ToolResult { .. } | Part::Reasoning { .. } => {
                return Err(bad(
                    "a user message may only hold text, image_url and document parts",
                ));
            }
        }
    }
    if !substantive {
        return Err(bad("message content is empty"));
    }
    let images = message
        .content
        .iter()
        .filter(|p| matches!(p, Part::ImageUrl { .. }))
        .count();
    if images > MAX_MESSAGE_IMAGES {
        return Err(bad(format!(
            "the message holds {images} images; at most {MAX_MESSAGE_IMAGES}"
        )));
    }
    let size = serde_json::to_vec(message).map(|v| v.len()).unwrap_or(0);
    if size > max_bytes {
        return Err(ErrorBody::new(
            ErrorCode::TooLarge,
            format!("message is {size} bytes; the limit is {max_bytes}"),
        ));
    }
    Ok(())
}

impl Engine {
    pub fn new(store: Store, client: Client, config: Arc<Config>, documents: Documents) -> Self {
        let js = jetstream::new(client.clone());
        let checkpoints = CheckpointClient::new(client.clone(), PROGRESS_TIMEOUT);
        Engine {
            store,
            client,
            js,
            config,
            checkpoints,
            documents,
        }
    }

    /// The document service (docs/documents.md).
    pub fn documents(&self) -> &Documents {
        &self.documents
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// `cyrene.session.send`, `cyrene.person.<id>.session.send` and
    /// `cyrene.bridge.session.send`: `caller` is who the request subject says asks.
    pub async fn send(&self, req: SendRequest, caller: Caller<'_>) -> Result<SendAck, ErrorBody> {
        let sent = self.send_checked(req, caller).await;
        let disposition = match &sent {
            Ok(ack) => match ack.disposition {
                Disposition::TurnStarted => "turn_started",
                Disposition::Pending => "pending",
                Disposition::ParallelLeg => "parallel_leg",
                Disposition::ContextOnly => "context_only",
            },
            Err(_) => "rejected",
        };
        metrics::counter!("cyrene_messages_total", "disposition" => disposition).increment(1);
        sent
    }

    async fn send_checked(
        &self,
        req: SendRequest,
        caller: Caller<'_>,
    ) -> Result<SendAck, ErrorBody> {
        check_id(IdKind::Session, "session_id", &req.session_id)?;
        if !req.client_id.is_empty() {
            check_id(IdKind::Client, "client_id", &req.client_id)?;
        }
        if req.idempotency_key.chars().count() > MAX_IDEMPOTENCY_KEY
            || req.idempotency_key.chars().any(char::is_control)
        {
            return Err(bad(format!(
                "idempotency_key must be at most {MAX_IDEMPOTENCY_KEY} printable characters"
            )));
        }
        check_user_message(&req.message, self.config.max_message_bytes)?;
        // Document references: of this session, and described as stored, not as claimed.
        let mut req = req;
        self.documents
            .bind(&req.session_id, &mut req.message)
            .await?;
        if req.message.sender_kind != SenderKind::Person {
            // The agent lane means "asked over the comm protocol": only the ask path sets it.
            return Err(bad(
                "sender_kind agent is set by the agent endpoints only; send a person's message",
            ));
        }
        identity::speaker(caller, &self.config, &mut req)?;
        let env = req.env.clone().unwrap_or_default();
        if !env.persona.is_empty() && self.config.personas.get(&env.persona).is_none() {
            return Err(bad(format!(
                "env.persona: unknown persona {:?}",
                env.persona
            )));
        }
        // Several personas in one session (docs/orchestrator.md, "Several personas"): the
        // addressed persona must be configured; whether the session may switch is the store's
        // to say, under the session's lock.
        if !req.persona.is_empty() && self.config.personas.get(&req.persona).is_none() {
            return Err(bad(format!("persona: unknown persona {:?}", req.persona)));
        }
        // The message's own choice first (`parallel: true` is `when_busy: parallel`), then the
        // configured lists of its client and its session.
        let policy = match (req.when_busy, req.parallel) {
            (Some(policy), false) | (Some(policy @ BusyPolicy::Parallel), true) => policy,
            (Some(_), true) => {
                return Err(bad(
                    "parallel: true and when_busy disagree; send one of them",
                ));
            }
            (None, true) => BusyPolicy::Parallel,
            (None, false) => self.config.busy_policy(&req.session_id, &req.client_id),
        };
        let input = NewMessage {
            session_id: req.session_id,
            message: req.message,
            client_id: req.client_id,
            idempotency_key: (!req.idempotency_key.is_empty()).then_some(req.idempotency_key),
            env,
            policy,
            solo: false,
            reply_to: None,
            ask_chain: Vec::new(),
            persona: (!req.persona.is_empty()).then_some(req.persona),
            context_only: req.context_only,
        };
        self.store_message(input).await
    }

    /// Stores a checked message and dispatches the turn it started, if any.
    pub(crate) async fn store_message(&self, input: NewMessage) -> Result<SendAck, ErrorBody> {
        // A parallel leg is told what the session's newest running leg has done, as of that
        // leg's last saved step (docs/semantics.md#parallel-notice). Read before the send's
        // transaction, which holds the session's lock: a leg that starts or ends meanwhile
        // yields the emptier, still valid notice.
        let newest = match input.policy == BusyPolicy::Parallel && !input.solo {
            true => self.newest_leg_progress(&input.session_id).await,
            false => None,
        };
        let snapshot = move |turn_id: &str| match &newest {
            Some(leg) if leg.turn_id == turn_id => (leg.step, leg.tool_names.clone()),
            _ => (0, Vec::new()),
        };
        let sent = bounded(self.config.db_timeout, self.store.send(input, &snapshot)).await?;
        if sent.duplicate {
            tracing::debug!(message_id = %sent.ack.message_id, "idempotent resend");
        }
        if let Some(turn) = &sent.started {
            self.dispatch(turn).await;
        }
        if let Some(pushed) = &sent.pushed {
            self.push(pushed).await;
        }
        Ok(sent.ack)
    }

    /// The progress of the session's newest running turn (step and tool names, from the
    /// checkpoint store); `None` when none runs or either store did not answer.
    async fn newest_leg_progress(&self, session_id: &str) -> Option<TurnProgress> {
        let newest = bounded(
            self.config.db_timeout,
            self.store.newest_running(session_id),
        );
        let (turn_id, leg_id) = newest.await.ok().flatten()?;
        let request = ProgressRequest {
            turns: vec![TurnRef::of_leg(session_id, &leg_id, turn_id)],
            tool_names: true,
        };
        match self.checkpoints.progress(&request).await {
            Ok(mut turns) => turns.pop(),
            Err(err) => {
                tracing::warn!(session = session_id, error = %err,
                    "no progress of the running leg: its parallel notice goes without");
                None
            }
        }
    }

    /// Pushes messages already claimed for a running turn to the worker running it (core NATS,
    /// at most once): the turn takes them in at its next boundary with no request of its own.
    /// A push that is lost — no worker subscribed yet, a crash, a full buffer — costs only
    /// latency: the worker's first steer of each delivery returns everything claimed for it,
    /// and the completion hands back what the turn never took in (docs/orchestrator.md).
    async fn push(&self, pushed: &Pushed) {
        let Ok(subject) = subjects::turn_input(&pushed.turn_id) else {
            return;
        };
        for message in &pushed.messages {
            let payload: Bytes = serde_json::to_vec(message).unwrap_or_default().into();
            if let Err(err) = self.client.publish(subject.clone(), payload).await {
                tracing::warn!(turn = %pushed.turn_id, error = %err, "could not push a steered message");
            }
        }
        metrics::counter!("cyrene_steer_pushes_total").increment(pushed.messages.len() as u64);
    }

    /// `cyrene.turn.steer`.
    pub async fn steer(&self, req: SteerRequest) -> Result<SteerResponse, ErrorBody> {
        check_turn_ref(&req.session_id, &req.turn_id, &req.leg_id)?;
        let messages = bounded(self.config.db_timeout, self.store.steer(&req)).await?;
        metrics::counter!("cyrene_messages_total", "disposition" => "steered")
            .increment(messages.len() as u64);
        Ok(SteerResponse { messages })
    }

    /// `cyrene.turn.complete`.
    pub async fn complete(&self, req: TurnComplete) -> Result<TurnCompleteAck, ErrorBody> {
        check_turn_ref(&req.session_id, &req.turn_id, &req.leg_id)?;
        if req.outcome == TurnOutcome::AwaitingApproval {
            return self.await_approval(req).await;
        }
        if !req.approvals.is_empty() {
            return Err(bad(
                "only an awaiting_approval completion names calls that wait",
            ));
        }
        let done = bounded(self.config.db_timeout, self.store.complete(&req)).await?;
        if !done.first {
            // A repeat may follow a publish that failed: publish again (deduplicated).
            self.publish_memory_job(&done).await?;
            return Ok(TurnCompleteAck { first: false });
        }
        if let Some(waited) = done.waited_ms {
            let persona = match done.persona.as_str() {
                "" => self.config.personas.default.clone(),
                id => id.to_owned(),
            };
            let outcome = match req.outcome {
                TurnOutcome::Final => "final",
                TurnOutcome::BudgetExhausted => "budget_exhausted",
                TurnOutcome::Cancelled => "cancelled",
                TurnOutcome::Error => "error",
                TurnOutcome::AwaitingApproval => "awaiting_approval",
            };
            metrics::histogram!("cyrene_answer_seconds", "persona" => persona, "outcome" => outcome)
                .record(waited as f64 / 1000.0);
        }
        let mut ended = SessionEvent::new(SessionEventType::TurnEnded, &done.session_id);
        ended.turn_id = req.turn_id.clone();
        ended.leg_id = done.leg_id.clone();
        ended.message = req.message.clone();
        ended.error = req.error.clone().or_else(|| match req.outcome {
            TurnOutcome::Final => None,
            TurnOutcome::BudgetExhausted => Some(ErrorBody::new(
                ErrorCode::Internal,
                "the turn ran out of steps",
            )),
            TurnOutcome::Cancelled => {
                Some(ErrorBody::new(ErrorCode::Timeout, "the turn was cancelled"))
            }
            TurnOutcome::Error => Some(ErrorBody::new(ErrorCode::Internal, "the turn failed")),
            TurnOutcome::AwaitingApproval => None,
        });
        self.publish_event(&ended).await;
        if !done.reply_to.is_empty() {
            let note = TurnDone {
                turn_id: req.turn_id.clone(),
                outcome: req.outcome,
                text: req
                    .message
                    .as_ref()
                    .map(Message::text_content)
                    .unwrap_or_default(),
                error: ended.error.clone(),
            };
            let payload: Bytes = serde_json::to_vec(&note).unwrap_or_default().into();
            for subject in &done.reply_to {
                if let Err(err) = self.client.publish(subject.clone(), payload.clone()).await {
                    tracing::warn!(%subject, error = %err, "could not report an ask's answer");
                }
            }
        }
        if let Some(next) = &done.next {
            self.dispatch(next).await;
        }
        if let Some(pushed) = &done.pushed {
            self.push(pushed).await;
        }
        self.publish_memory_job(&done).await?;
        Ok(TurnCompleteAck { first: true })
    }

    /// Publishes the completion's memory extraction job when its persona extracts memory
    /// (docs/memory.md, "Memory she gathers herself"). Failing, the completion is answered
    /// `unavailable`: the worker resends it, and the repeat publishes again. The answer itself
    /// is committed either way.
    async fn publish_memory_job(&self, done: &crate::store::Completed) -> Result<(), ErrorBody> {
        let Some(job) = &done.memory_job else {
            return Ok(());
        };
        if !self.config.personas.extracts_memory(&job.persona) {
            return Ok(());
        }
        crate::extraction::publish(&self.js, job)
            .await
            .map_err(|err| {
                tracing::warn!(turn_id = %job.turn_id, error = %err,
                "memory extraction job not published; the completion will be resent");
                ErrorBody::new(
                    ErrorCode::Unavailable,
                    "the turn is recorded, but its memory extraction job could not be queued yet: \
                 resend the completion",
                )
            })
    }

    /// `cyrene.session.history`.
    pub async fn history(&self, req: HistoryRequest) -> Result<HistoryResponse, ErrorBody> {
        check_id(IdKind::Session, "session_id", &req.session_id)?;
        let limit = match req.limit {
            None => HISTORY_DEFAULT_LIMIT,
            Some(0) => return Err(bad("limit must be at least 1")),
            Some(n) => n.min(HISTORY_MAX_LIMIT),
        };
        // One entry more than asked tells whether an older page exists.
        let mut newest_last = bounded(
            self.config.db_timeout,
            self.store
                .history(&req.session_id, limit + 1, req.before_seq),
        )
        .await?;
        let more = newest_last.len() > limit as usize;
        if more {
            newest_last.remove(0);
        }
        // The page is oldest → newest; when the bus cannot carry all of it, keep the newest.
        newest_last.reverse();
        let (mut messages, cut) = page_within(newest_last, reply_budget(&self.client));
        messages.reverse();
        let next_before_seq = (more || cut)
            .then(|| messages.first().map(|m| m.seq))
            .flatten();
        Ok(HistoryResponse {
            messages,
            next_before_seq,
        })
    }

    /// `cyrene.turns.running` (operators only, by NATS permission): the turns running now, the
    /// oldest first, each with its last saved step (docs/orchestrator.md, "Turns in flight").
    pub async fn running_turns(
        &self,
        req: RunningTurnsRequest,
    ) -> Result<RunningTurnsResponse, ErrorBody> {
        let limit = match req.limit {
            None => RUNNING_TURNS_DEFAULT_LIMIT,
            Some(0) => return Err(bad("limit must be at least 1")),
            Some(n) => n.min(RUNNING_TURNS_MAX_LIMIT),
        };
        // One more than asked tells whether more run.
        let mut turns = bounded(
            self.config.db_timeout,
            self.store.turns_in_flight(limit + 1),
        )
        .await?;
        let mut more = turns.len() > limit as usize;
        turns.truncate(limit as usize);
        self.fill_steps(&mut turns).await;
        // Every reply fits the bus: the oldest turns that fit, and `more` says some were left.
        let (turns, cut) = page_within(turns, reply_budget(&self.client));
        more |= cut;
        Ok(RunningTurnsResponse { turns, more })
    }

    /// Sets each turn's `step` to its last saved step (one read of the checkpoint store); left
    /// at 0 when the store does not answer.
    async fn fill_steps(&self, turns: &mut [RunningTurn]) {
        if turns.is_empty() {
            return;
        }
        let request = ProgressRequest {
            turns: turns
                .iter()
                .map(|t| TurnRef::of_leg(&t.session_id, &t.leg_id, t.turn_id.clone()))
                .collect(),
            tool_names: false,
        };
        match self.checkpoints.progress(&request).await {
            Ok(progress) => {
                for (turn, known) in turns.iter_mut().zip(progress) {
                    if known.turn_id == turn.turn_id {
                        turn.step = known.step;
                    }
                }
            }
            Err(err) => tracing::warn!(error = %err,
                "no progress of the running turns: their steps are left at 0"),
        }
    }

    /// The sessions of `person`, the newest first (`cyrene.person.<person>.session.list`).
    pub async fn sessions(
        &self,
        person: &str,
        req: SessionListRequest,
    ) -> Result<SessionListResponse, ErrorBody> {
        check_id(IdKind::Person, "person", person)?;
        let limit = match req.limit {
            None => SESSION_LIST_DEFAULT_LIMIT,
            Some(0) => return Err(bad("limit must be at least 1")),
            Some(n) => n.min(SESSION_LIST_MAX_LIMIT),
        };
        let sessions = bounded(
            self.config.db_timeout,
            self.store.sessions_of(person, limit),
        )
        .await?;
        Ok(SessionListResponse { sessions })
    }

    pub(crate) async fn publish_event(&self, event: &SessionEvent) {
        let Ok(subject) = subjects::session_events(&event.session_id) else {
            return;
        };
        let payload: Bytes = serde_json::to_vec(event).unwrap_or_default().into();
        if let Err(err) = self
            .client
            .publish_with_headers(subject, trace::current_headers(), payload)
            .await
        {
            tracing::warn!(error = %err, "could not publish a session event");
        }
    }

    /// Announces a new turn and publishes its job; marks it dispatched once JetStream has it.
    pub(crate) async fn dispatch(&self, turn: &NewTurn) {
        let mut started = SessionEvent::new(SessionEventType::TurnStarted, &turn.session_id);
        started.turn_id = turn.turn_id.clone();
        started.leg_id = turn.leg_id.clone();
        started.message_ids = turn.message_ids.clone();
        self.publish_event(&started).await;
        self.publish_job(&turn.turn_id, &turn.msg_id(), &turn.job)
            .await;
    }

    /// Publishes a turn's job under `msg_id` (`crate::store::job_msg_id`) and marks it
    /// dispatched once JetStream has it.
    pub(crate) async fn publish_job(&self, turn_id: &str, msg_id: &str, job: &str) -> bool {
        let headers: HeaderMap = trace::current_headers();
        let publish = jetstream::message::PublishMessage::build()
            .payload(Bytes::from(job.to_owned()))
            .headers(headers)
            .message_id(msg_id);
        let result = tokio::time::timeout(PUBLISH_TIMEOUT, async {
            let ack = self.js.send_publish(subjects::TURN_RUN, publish).await?;
            ack.await
        })
        .await;
        match result {
            Ok(Ok(ack)) => {
                if ack.duplicate {
                    tracing::debug!(turn_id, "turn job was already in the stream");
                } else if msg_id == turn_id
                    && let Some(created) = cyrene_protocol::ids::id_unix_ms(turn_id)
                {
                    let lag = cyrene_protocol::ids::unix_ms().saturating_sub(created);
                    metrics::histogram!("cyrene_dispatch_lag_seconds").record(lag as f64 / 1000.0);
                }
                match bounded(self.config.db_timeout, self.store.mark_dispatched(msg_id)).await {
                    Ok(()) => true,
                    Err(err) => {
                        tracing::warn!(turn_id, error = %err.message,
                            "turn published but not marked; the sweeper will republish it");
                        false
                    }
                }
            }
            Ok(Err(err)) => {
                tracing::warn!(turn_id, error = %err, "turn dispatch failed; will retry");
                false
            }
            Err(_) => {
                tracing::warn!(turn_id, "turn dispatch timed out; will retry");
                false
            }
        }
    }

    /// Republishes running turns whose dispatch was never confirmed; returns how many were
    /// published now.
    pub async fn sweep(&self) -> usize {
        let turns = match bounded(
            self.config.db_timeout,
            self.store.undispatched(self.config.dispatch_grace),
        )
        .await
        {
            Ok(t) => t,
            Err(err) => {
                tracing::debug!(error = %err.message, "sweep skipped");
                return 0;
            }
        };
        let mut published = 0;
        for turn in turns {
            tracing::info!(turn_id = %turn.turn_id, "republishing an unconfirmed turn");
            let msg_id = crate::store::job_msg_id(&turn.turn_id, turn.resumes);
            if self.publish_job(&turn.turn_id, &msg_id, &turn.job).await {
                published += 1;
            }
        }
        published
    }

    /// Sets `cyrene_sessions_active` and `cyrene_messages_waiting` from the database (every
    /// replica reports the same figures: take their max, not their sum).
    pub async fn sample_gauges(&self) {
        match bounded(self.config.db_timeout, self.store.gauges()).await {
            Ok((active, waiting)) => {
                metrics::gauge!("cyrene_sessions_active").set(active as f64);
                metrics::gauge!("cyrene_messages_waiting").set(waiting as f64);
            }
            Err(err) => tracing::debug!(error = %err.message, "gauges not sampled"),
        }
        match bounded(self.config.db_timeout, self.store.approvals_pending()).await {
            Ok(pending) => metrics::gauge!("cyrene_approvals_pending").set(pending as f64),
            Err(err) => tracing::debug!(error = %err.message, "approval gauge not sampled"),
        }
    }

    /// The env an ask session of `persona` runs with.
    pub(crate) fn ask_env(&self, persona: &str) -> SessionEnv {
        SessionEnv {
            restricted: self
                .config
                .personas
                .get(persona)
                .is_some_and(|p| p.restricted),
            persona: persona.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// issue 30, M6: one message cannot carry thousands of images.
    #[test]
    fn a_message_holds_at_most_sixteen_images() {
        let with = |n: usize| {
            let parts = (0..n)
                .map(|i| Part::ImageUrl {
                    image_url: format!("https://x/{i}.png"),
                })
                .collect();
            Message::with_parts(Role::User, parts)
        };
        assert!(check_user_message(&with(MAX_MESSAGE_IMAGES), 1 << 20).is_ok());
        let err = check_user_message(&with(MAX_MESSAGE_IMAGES + 1), 1 << 20).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
        assert!(err.message.contains("at most 16"), "{}", err.message);
    }

    #[test]
    fn user_messages_are_checked() {
        let ok = Message::text(Role::User, "hi");
        assert!(check_user_message(&ok, 1000).is_ok());
        let img = Message::image(Role::User, "", "data:image/png;base64,AAAA");
        assert!(check_user_message(&img, 1000).is_ok());
        let cases = [
            (Message::text(Role::Assistant, "hi"), "role"),
            (Message::text(Role::User, "  "), "empty"),
            (Message::with_parts(Role::User, vec![]), "empty"),
            (
                Message::image(Role::User, "x", "file:///etc/passwd"),
                "image_url",
            ),
            (Message::tool_result("c", "t", "x", false), "role"),
        ];
        for (m, needle) in cases {
            let err = check_user_message(&m, 1000).unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest);
            assert!(err.message.contains(needle), "{needle}: {}", err.message);
        }
        let big = Message::text(Role::User, "x".repeat(2000));
        assert_eq!(
            check_user_message(&big, 1000).unwrap_err().code,
            ErrorCode::TooLarge
        );
    }
}
