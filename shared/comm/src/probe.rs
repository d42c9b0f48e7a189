//! [`Probe`]: one agent's end of the comm protocol.
//!
//! # Invariants
//! - One ask at a time per asker: an asker's accepted asks run in arrival order, one after the
//!   other. Asks of different askers run side by side, at most [`AskLimits::concurrent`] at once
//!   (1 by default: one ask at a time for the whole agent).
//! - What is accepted is bounded ([`AskLimits`]): in asks, in bytes, and in bytes per asker. An
//!   ask over a bound is refused `unavailable` as it arrives; the subscription is never left
//!   unread, so a flood cannot make the server drop the connection as a slow consumer.
//! - Every accepted ask is answered: with the handler's answer or error, or `unavailable` when
//!   the agent stops before running it (or after the grace period, while it ran).
//! - Refusals never queue: a malformed ask (`bad_request`), one in another agent's name
//!   (`forbidden`) and one whose `chain` holds this agent (`conflict`, a cycle: the agent is
//!   already answering an ask this one serves, so waiting would deadlock) are answered as they
//!   arrive, and the handler never sees them (docs/comm.md, "Cycles").

use crate::DEFAULT_ASK_TIMEOUT;
use async_nats::{Client, HeaderMap, Message, StatusCode, Subscriber};
use bytes::Bytes;
use cyrene_bus::{service, trace};
use cyrene_protocol::comm::{Ask, Event, Reply};
use cyrene_protocol::{ErrorBody, ErrorCode, ids, subjects};
use futures::StreamExt;
use serde_json::Value;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::sync::{OnceCell, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How many event handlers of one agent may run at once.
const MAX_CONCURRENT_EVENTS: usize = 64;

/// Why an ask got no answer.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    /// No reply before the deadline.
    #[error("comm: reply timeout: {to} did not answer within {after:?}")]
    Timeout { to: String, after: Duration },
    /// The ask could not be delivered (no responders, or the bus refused it).
    #[error("comm: no reply: {to} cannot be reached ({reason})")]
    NoReply { to: String, reason: String },
    /// The caller cancelled the ask.
    #[error("comm: ask to {to} cancelled")]
    Cancelled { to: String },
    /// The responder answered with an error envelope.
    #[error("comm: {to} answered with an error: {error}")]
    Remote { to: String, error: ErrorBody },
    /// The reply was not a valid `Reply`.
    #[error("comm: {to} sent an invalid reply: {reason}")]
    InvalidReply { to: String, reason: String },
}

/// Failures of fire-and-forget sends and of starting to serve.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error("comm: publish failed: {0}")]
    Publish(#[from] async_nats::PublishError),
    #[error("comm: subscribe failed: {0}")]
    Subscribe(#[from] async_nats::SubscribeError),
}

/// Per-ask knobs.
#[derive(Debug, Clone, Default)]
pub struct AskOptions {
    /// Structured payload sent with the question.
    pub data: Value,
    /// The caller's deadline. The ask waits for the **shorter** of this and
    /// [`DEFAULT_ASK_TIMEOUT`]: the default is a cap, so a silent agent never holds its caller
    /// longer than that, whatever deadline the caller brings.
    pub timeout: Option<Duration>,
    /// Cancelling this ends the ask with [`AskError::Cancelled`].
    pub cancel: Option<CancellationToken>,
    /// The ask chain this ask serves (the asker's own chain when it is answering an ask):
    /// sent as the ask's `chain` (docs/comm.md, "Cycles").
    pub chain: Vec<String>,
}

/// How long an ask waits: the shorter of the caller's deadline and [`DEFAULT_ASK_TIMEOUT`].
fn ask_deadline(caller: Option<Duration>) -> Duration {
    caller.map_or(DEFAULT_ASK_TIMEOUT, |t| t.min(DEFAULT_ASK_TIMEOUT))
}

/// What an ask handler answers with.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    pub text: String,
    pub data: Value,
}

impl Answer {
    pub fn text(text: impl Into<String>) -> Answer {
        Answer {
            text: text.into(),
            data: Value::Null,
        }
    }
}

/// An agent's behaviour. `on_ask` calls for one asker never overlap; with
/// [`AskLimits::concurrent`] above 1, calls for different askers may; `on_event` calls may.
pub trait Handler: Send + Sync + 'static {
    /// Answers one ask; an error is sent back as the error envelope.
    fn on_ask(&self, ask: Ask) -> impl Future<Output = Result<Answer, ErrorBody>> + Send;

    /// Receives one event (broadcast or addressed to this agent).
    fn on_event(&self, event: Event) -> impl Future<Output = ()> + Send {
        let _ = event;
        async {}
    }
}

/// One agent's end of the protocol. Clones share one reply subscription.
#[derive(Debug, Clone)]
pub struct Probe {
    client: Client,
    id: String,
    replies: Arc<OnceCell<Arc<ReplyMux>>>,
}

/// Routes replies to waiting asks by ask id.
///
/// # Invariants
/// - One wildcard subscription `cyrene.agent.*.<me>.reply.*` per probe, created (and flushed to
///   the server) before the probe's first ask is published; every ask still has its own private
///   reply subject `cyrene.agent.<to>.<me>.reply.<askId>`, registered here before publishing.
/// - An entry lives exactly as long as its ask waits ([`PendingReply`] removes it on drop), so a
///   late reply to a timed-out ask finds nobody and is discarded.
///
/// # Pitfalls
/// - Per-ask subscriptions would be simpler but cost a SUB and an UNSUB per ask, which a cluster
///   propagates to every route; the shared subscription is how NATS clients do requests.
#[derive(Debug)]
struct ReplyMux {
    /// Ask id → (the token of the agent asked, the waiting ask). A reply counts only when it
    /// arrives on a subject whose replier token is that agent's: nobody answers for another.
    waiting: Mutex<HashMap<String, Waiter>>,
    /// Stops the dispatch task when the last probe clone is gone.
    _stop: tokio_util::sync::DropGuard,
}

type Waiter = (String, oneshot::Sender<Message>);

impl ReplyMux {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Waiter>> {
        // The map stays consistent even if a holder panicked: every operation is one call.
        self.waiting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Removes its ask from the [`ReplyMux`] when the ask stops waiting, however it ends.
struct PendingReply<'a> {
    mux: &'a ReplyMux,
    ask_id: &'a str,
}

impl Drop for PendingReply<'_> {
    fn drop(&mut self) {
        self.mux.lock().remove(self.ask_id);
    }
}

/// How long [`AgentHandle::stop`] lets running handlers finish.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(5);

/// How an agent holds and runs the asks it accepts ([`Probe::serve_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AskLimits {
    /// Asks run at once, each of a different asker (an asker's own asks never overlap).
    pub concurrent: usize,
    /// Asks accepted at once (waiting or running); more are refused `unavailable`.
    pub accepted: usize,
    /// Bytes of the accepted asks' payloads; an ask that would go over is refused `unavailable`.
    pub accepted_bytes: usize,
    /// Bytes of one asker's accepted asks, so one asker cannot take the whole budget.
    pub asker_bytes: usize,
}

impl Default for AskLimits {
    /// One ask at a time, at most 256 accepted, 32 MiB, 8 MiB per asker.
    fn default() -> Self {
        AskLimits {
            concurrent: 1,
            accepted: 256,
            accepted_bytes: 32 << 20,
            asker_bytes: 8 << 20,
        }
    }
}

/// A serving agent. Dropping it aborts its tasks; [`AgentHandle::stop`] drains them first.
#[derive(Debug)]
pub struct AgentHandle {
    shutdown: CancellationToken,
    /// Fired when the grace period is over: a running ask stops and is answered `unavailable`.
    abort: CancellationToken,
    tasks: JoinSet<()>,
}

impl AgentHandle {
    /// Stops receiving and lets running handlers finish within [`DEFAULT_STOP_GRACE`].
    pub async fn stop(self) {
        self.stop_within(DEFAULT_STOP_GRACE).await;
    }

    /// Stops receiving (asks still waiting are answered `unavailable`), waits up to `grace` for
    /// running handlers, then stops them, answering their asks `unavailable`.
    pub async fn stop_within(mut self, grace: Duration) {
        self.shutdown.cancel();
        let drained = tokio::time::timeout(grace, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                ?grace,
                "agent handlers still running after the grace period; stopped"
            );
            self.abort.cancel();
            // Each stopped ask only sends its refusal; a task stuck even then is aborted.
            let refused = tokio::time::timeout(grace, async {
                while self.tasks.join_next().await.is_some() {}
            })
            .await;
            if refused.is_err() {
                self.tasks.abort_all();
                while self.tasks.join_next().await.is_some() {}
            }
        }
    }
}

impl Probe {
    /// A probe acting as agent `id` (any text: it is sanitised into subject tokens).
    pub fn new(client: Client, id: impl Into<String>) -> Probe {
        Probe {
            client,
            id: id.into(),
            replies: Arc::new(OnceCell::new()),
        }
    }

    /// The reply subscription, created on first use.
    async fn replies(&self) -> Result<&Arc<ReplyMux>, async_nats::SubscribeError> {
        self.replies
            .get_or_try_init(|| async {
                let pattern = subjects::agent_reply_receive(&self.id);
                let mut sub = self.client.subscribe(pattern).await?;
                // The subscription is on the server before any ask is published.
                if let Err(err) = self.client.flush().await {
                    tracing::warn!(agent = %self.id, error = %err, "flush after subscribe failed");
                }
                let stop = CancellationToken::new();
                let mux = Arc::new(ReplyMux {
                    waiting: Mutex::new(HashMap::new()),
                    _stop: stop.clone().drop_guard(),
                });
                let weak = Arc::downgrade(&mux);
                tokio::spawn(async move {
                    loop {
                        let message = tokio::select! {
                            _ = stop.cancelled() => break,
                            next = sub.next() => match next { Some(m) => m, None => break },
                        };
                        let Some(mux) = weak.upgrade() else { break };
                        let ask_id = message.subject.rsplit('.').next().unwrap_or_default();
                        let replier = subjects::agent_sender(&message.subject).unwrap_or_default();
                        let waiter = {
                            let mut waiting = mux.lock();
                            match waiting.get(ask_id) {
                                Some((asked, _)) if asked == replier => waiting.remove(ask_id),
                                Some(_) => {
                                    tracing::warn!(subject = %message.subject,
                                        "reply from an agent that was not asked; dropped");
                                    continue;
                                }
                                None => None,
                            }
                        };
                        match waiter {
                            Some((_, tx)) => {
                                let _ = tx.send(message);
                            }
                            None => tracing::debug!(subject = %message.subject,
                                "reply for an ask nobody waits for (late or another replica's)"),
                        }
                    }
                    let _ = sub.unsubscribe().await;
                });
                Ok(mux)
            })
            .await
    }

    /// The agent id this probe speaks for.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Asks `to` with the default deadline.
    pub async fn ask(&self, to: &str, question: &str) -> Result<Reply, AskError> {
        self.ask_with(to, question, AskOptions::default()).await
    }

    /// Asks `to` and waits for its reply, the deadline, or cancellation.
    pub async fn ask_with(
        &self,
        to: &str,
        question: &str,
        options: AskOptions,
    ) -> Result<Reply, AskError> {
        let ask_id = ids::new_id();
        let ask = Ask {
            id: ask_id.clone(),
            from: self.id.clone(),
            to: to.to_owned(),
            question: question.to_owned(),
            data: options.data,
            chain: options.chain,
        };
        let after = ask_deadline(options.timeout);
        let cancel = options.cancel.unwrap_or_default();
        let no_reply = |reason: String| AskError::NoReply {
            to: to.to_owned(),
            reason,
        };

        // Register the private reply subject first, then publish: the reply cannot outrun it.
        let mux = self.replies().await.map_err(|e| no_reply(e.to_string()))?;
        let (tx, rx) = oneshot::channel();
        mux.lock().insert(ask_id.clone(), (subjects::token(to), tx));
        let _pending = PendingReply {
            mux,
            ask_id: &ask_id,
        };
        let reply_subject = subjects::agent_reply(to, &self.id, &ask_id);
        let subject = subjects::agent_ask(&self.id, to);
        let payload = encode(&ask);
        let headers = trace::current_headers();
        let published = if headers.is_empty() {
            self.client
                .publish_with_reply(subject, reply_subject, payload)
                .await
        } else {
            self.client
                .publish_with_reply_and_headers(subject, reply_subject, headers, payload)
                .await
        };
        published.map_err(|e| no_reply(e.to_string()))?;

        let message = tokio::select! {
            biased;
            _ = cancel.cancelled() => return Err(AskError::Cancelled { to: to.to_owned() }),
            next = tokio::time::timeout(after, rx) => match next {
                Err(_) => return Err(AskError::Timeout { to: to.to_owned(), after }),
                Ok(Err(_)) => return Err(no_reply("the reply subscription closed".into())),
                Ok(Ok(message)) => message,
            },
        };
        decode_reply(to, message)
    }

    /// Sends event `name` to agent `to`.
    pub async fn emit(&self, to: &str, name: &str, data: Value) -> Result<(), CommError> {
        self.publish_event(subjects::agent_event(&self.id, to), name, data)
            .await
    }

    /// Broadcasts event `name` to every agent.
    pub async fn broadcast(&self, name: &str, data: Value) -> Result<(), CommError> {
        self.publish_event(subjects::agent_broadcast(&self.id), name, data)
            .await
    }

    async fn publish_event(
        &self,
        subject: String,
        name: &str,
        data: Value,
    ) -> Result<(), CommError> {
        let event = Event {
            from: self.id.clone(),
            name: name.to_owned(),
            data,
        };
        self.client
            .publish_with_headers(subject, trace::current_headers(), encode(&event))
            .await?;
        Ok(())
    }

    /// Answers asks to this agent and receives its events until [`AgentHandle::stop`], one ask
    /// at a time ([`AskLimits::default`]).
    ///
    /// The subscriptions exist when this returns (flushed to the server), so an ask sent after
    /// `serve` returns reaches the handler.
    pub async fn serve<H: Handler>(&self, handler: Arc<H>) -> Result<AgentHandle, CommError> {
        self.serve_with(handler, AskLimits::default()).await
    }

    /// [`Probe::serve`] with the asks held and run within `limits`.
    pub async fn serve_with<H: Handler>(
        &self,
        handler: Arc<H>,
        limits: AskLimits,
    ) -> Result<AgentHandle, CommError> {
        let queue = subjects::token(&self.id);
        let asks = self
            .client
            .queue_subscribe(subjects::agent_ask_receive(&self.id), queue.clone())
            .await?;
        let [broadcast, direct] = subjects::agent_event_receive(&self.id);
        let broadcasts = self
            .client
            .queue_subscribe(broadcast, queue.clone())
            .await?;
        let directs = self.client.queue_subscribe(direct, queue).await?;
        // A failed flush only means the subscriptions reach the server after reconnecting.
        if let Err(err) = self.client.flush().await {
            tracing::warn!(agent = %self.id, error = %err, "flush after subscribe failed");
        }

        let shutdown = CancellationToken::new();
        let abort = CancellationToken::new();
        let mut tasks = JoinSet::new();
        tasks.spawn(serve_asks(
            self.clone(),
            asks,
            handler.clone(),
            limits,
            (shutdown.clone(), abort.clone()),
        ));
        let events = futures::stream::select(broadcasts, directs);
        tasks.spawn(serve_events(
            self.client.clone(),
            events,
            handler,
            shutdown.clone(),
        ));
        Ok(AgentHandle {
            shutdown,
            abort,
            tasks,
        })
    }
}

/// The `forbidden` refusal of a message whose body `from` is not its subject's sender.
fn impersonation(subject: &str, what: &str, from: &str) -> ErrorBody {
    // Both are echoed bounded: a refusal must always fit in a reply.
    let shown: String = from.chars().take(64).collect();
    let sender: String = subjects::agent_sender(subject)
        .unwrap_or_default()
        .chars()
        .take(128)
        .collect();
    ErrorBody::new(
        ErrorCode::Forbidden,
        format!(
            "{what} from {shown:?} sent on the subject of agent {sender:?}: \
             `from` must be the sender's own id (it sanitises to the subject's <from> token)"
        ),
    )
}

/// Whether agent `me` is already answering an ask of `chain` (compared as subject tokens, as
/// the subjects address agents).
pub fn in_chain(me: &str, chain: &[String]) -> bool {
    let me = subjects::token(me);
    chain.iter().any(|id| subjects::token(id) == me)
}

/// The `conflict` refusal of an ask that would wait on its own responder: the responder is
/// already answering an ask this one serves, so answering it would deadlock until the timeout.
fn cycle(me: &str, ask: &Ask) -> ErrorBody {
    let shown: Vec<String> = ask
        .chain
        .iter()
        .take(16)
        .map(|id| id.chars().take(64).collect())
        .collect();
    let me: String = me.chars().take(64).collect();
    ErrorBody::new(
        ErrorCode::Conflict,
        format!(
            "ask cycle: {me:?} is already answering an ask this one serves (chain {shown:?}); \
             answer without asking {me:?}"
        ),
    )
}

fn encode<T: serde::Serialize>(value: &T) -> Bytes {
    // Comm messages hold strings and JSON values only: serialising cannot fail.
    serde_json::to_vec(value).unwrap_or_default().into()
}

fn decode_reply(to: &str, message: Message) -> Result<Reply, AskError> {
    if message.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(AskError::NoReply {
            to: to.to_owned(),
            reason: "no responders".into(),
        });
    }
    if let Some(error) = service::error_from_message(&message) {
        return Err(AskError::Remote {
            to: to.to_owned(),
            error,
        });
    }
    serde_json::from_slice(&message.payload).map_err(|e| AskError::InvalidReply {
        to: to.to_owned(),
        reason: e.to_string(),
    })
}

/// An accepted ask: where to answer, the ask, its span, and the bytes it counts for.
struct Accepted {
    reply_to: String,
    ask: Ask,
    span: tracing::Span,
    bytes: usize,
}

/// The accepted asks of one agent, one lane per asker (the subject's sender token).
///
/// # Invariants
/// - A lane exists while its asker has an ask waiting or running, and exactly one task runs it
///   (`run_lane`): it takes the lane's asks one at a time, in arrival order, and removes the lane
///   when it finds it empty — under the same lock the reader adds to it, so an ask is never added
///   to a lane nobody runs.
/// - `accepted` and `bytes` count every ask from acceptance until its reply is sent.
#[derive(Default)]
struct Lanes {
    by_asker: HashMap<String, Lane>,
    accepted: usize,
    bytes: usize,
}

#[derive(Default)]
struct Lane {
    waiting: std::collections::VecDeque<Accepted>,
    bytes: usize,
}

type SharedLanes = Arc<Mutex<Lanes>>;

fn lock(lanes: &SharedLanes) -> std::sync::MutexGuard<'_, Lanes> {
    // Every operation leaves the counts consistent: a poisoned lock is still usable.
    lanes
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What [`admit`] did with an ask.
enum Admitted {
    /// Queued on its asker's lane, which was running already.
    Queued,
    /// Queued on a new lane: start its task.
    NewLane,
    /// Over a bound: refuse it with this error.
    Refused(ErrorBody, Box<Accepted>),
}

/// Accepts `ask` onto `asker`'s lane within `limits`, or says why not.
fn admit(lanes: &SharedLanes, limits: &AskLimits, asker: &str, ask: Accepted) -> Admitted {
    let mut lanes = lock(lanes);
    let asker_bytes = lanes.by_asker.get(asker).map_or(0, |lane| lane.bytes);
    let over = if lanes.accepted >= limits.accepted {
        Some(format!("{} asks are waiting already", lanes.accepted))
    } else if lanes.bytes.saturating_add(ask.bytes) > limits.accepted_bytes {
        Some(format!(
            "the asks waiting hold {} bytes, at most {}",
            lanes.bytes, limits.accepted_bytes
        ))
    } else if asker_bytes.saturating_add(ask.bytes) > limits.asker_bytes {
        Some(format!(
            "this asker's asks waiting hold {asker_bytes} bytes, at most {} per asker",
            limits.asker_bytes
        ))
    } else {
        None
    };
    if let Some(why) = over {
        let err = ErrorBody::new(
            ErrorCode::Unavailable,
            format!("too busy to take this ask ({why}); ask again later"),
        );
        return Admitted::Refused(err, Box::new(ask));
    }
    lanes.accepted += 1;
    lanes.bytes += ask.bytes;
    let new = !lanes.by_asker.contains_key(asker);
    let lane = lanes.by_asker.entry(asker.to_owned()).or_default();
    lane.bytes += ask.bytes;
    lane.waiting.push_back(ask);
    if new {
        Admitted::NewLane
    } else {
        Admitted::Queued
    }
}

/// Reads asks and hands the accepted ones to their asker's lane. Refusals (a malformed ask, one
/// in another agent's name, a cycle, one over the [`AskLimits`]) never queue: they are answered
/// as they arrive, so an ask back along a chain fails at once instead of waiting on the very
/// handler it would deadlock with. Reading never waits for a handler.
async fn serve_asks<H: Handler>(
    probe: Probe,
    mut asks: Subscriber,
    handler: Arc<H>,
    limits: AskLimits,
    (shutdown, abort): (CancellationToken, CancellationToken),
) {
    let lanes: SharedLanes = Arc::default();
    let permits = Arc::new(Semaphore::new(limits.concurrent.max(1)));
    let mut running = JoinSet::new();
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = asks.next() => match next {
                Some(m) => m,
                None => break,
            },
        };
        while running.try_join_next().is_some() {}
        let span = tracing::info_span!("ask", agent = %probe.id, subject = %message.subject);
        trace::set_parent(&span, message.headers.as_ref());
        let checked = probe.check(&message).instrument(span.clone()).await;
        let Some((reply_to, ask)) = checked else {
            continue;
        };
        // `check` made sure `from` is the subject's sender.
        let asker = subjects::agent_sender(&message.subject)
            .unwrap_or_default()
            .to_owned();
        let accepted = Accepted {
            reply_to,
            ask,
            span,
            bytes: message.payload.len(),
        };
        match admit(&lanes, &limits, &asker, accepted) {
            Admitted::Queued => {}
            Admitted::NewLane => {
                let lane = run_lane(
                    probe.clone(),
                    handler.clone(),
                    (lanes.clone(), asker),
                    permits.clone(),
                    (shutdown.clone(), abort.clone()),
                );
                running.spawn(lane);
            }
            Admitted::Refused(err, refused) => {
                tracing::warn!(parent: &refused.span, error = %err, "ask refused: over its limits");
                probe.refuse(refused.reply_to, &err).await;
            }
        }
    }
    let _ = asks.unsubscribe().await;
    // Each lane answers what it holds: its running ask, then `unavailable` for the rest.
    while running.join_next().await.is_some() {}
}

/// Runs one asker's lane until it is empty (see [`Lanes`]): each ask holds one of `permits` while
/// its handler runs. Once the agent stops, waiting asks are answered `unavailable`; once `abort`
/// fires, so is the running one.
async fn run_lane<H: Handler>(
    probe: Probe,
    handler: Arc<H>,
    (lanes, asker): (SharedLanes, String),
    permits: Arc<Semaphore>,
    (shutdown, abort): (CancellationToken, CancellationToken),
) {
    loop {
        {
            let mut all = lock(&lanes);
            if all
                .by_asker
                .get(&asker)
                .is_none_or(|lane| lane.waiting.is_empty())
            {
                all.by_asker.remove(&asker);
                return;
            }
        }
        let permit = tokio::select! {
            biased;
            _ = shutdown.cancelled() => None,
            permit = permits.clone().acquire_owned() => permit.ok(),
        };
        // Only this task takes from the lane: it is not empty.
        let Some(next) = lock(&lanes)
            .by_asker
            .get_mut(&asker)
            .and_then(|lane| lane.waiting.pop_front())
        else {
            continue;
        };
        let bytes = next.bytes;
        match permit {
            None => {
                let err = ErrorBody::new(
                    ErrorCode::Unavailable,
                    format!("{} stopped before answering this ask", probe.id),
                );
                probe.refuse(next.reply_to, &err).await;
            }
            Some(_permit) => {
                let span = next.span.clone();
                probe
                    .answer(next.reply_to, next.ask, handler.as_ref(), &abort)
                    .instrument(span)
                    .await;
            }
        }
        let mut all = lock(&lanes);
        all.accepted = all.accepted.saturating_sub(1);
        all.bytes = all.bytes.saturating_sub(bytes);
        if let Some(lane) = all.by_asker.get_mut(&asker) {
            lane.bytes = lane.bytes.saturating_sub(bytes);
        }
    }
}

impl Probe {
    /// Checks an ask as it arrives: the ask and its reply subject when it is for the handler;
    /// `None` when it was refused (answered here) or cannot be answered.
    async fn check(&self, message: &Message) -> Option<(String, Ask)> {
        let Some(reply_to) = message.reply.as_ref().map(|r| r.to_string()) else {
            tracing::warn!(subject = %message.subject, bytes = message.payload.len(),
                "ask without a reply-to cannot be answered; dropped");
            return None;
        };
        let refused = match serde_json::from_slice::<Ask>(&message.payload) {
            Err(e) => ErrorBody::new(ErrorCode::BadRequest, format!("invalid ask: {e}")),
            Ok(ask) if !subjects::speaks_as(&message.subject, &ask.from) => {
                let err = impersonation(&message.subject, "ask", &ask.from);
                tracing::warn!(subject = %message.subject, error = %err, "ask refused");
                err
            }
            Ok(ask) if in_chain(&self.id, &ask.chain) => {
                let err = cycle(&self.id, &ask);
                tracing::info!(subject = %message.subject, error = %err, "ask refused: a cycle");
                err
            }
            Ok(ask) => return Some((reply_to, ask)),
        };
        self.refuse(reply_to, &refused).await;
        None
    }

    /// Answers `reply_to` with `err`.
    async fn refuse(&self, reply_to: String, err: &ErrorBody) {
        let (headers, payload) = (service::error_headers(err), service::error_payload(err));
        self.send_reply(reply_to, headers, payload).await;
    }

    /// Runs the handler on an accepted ask and sends its reply or error; `unavailable` when
    /// `abort` fires first.
    async fn answer<H: Handler>(
        &self,
        reply_to: String,
        ask: Ask,
        handler: &H,
        abort: &CancellationToken,
    ) {
        let (ask_id, asker) = (ask.id.clone(), ask.from.clone());
        let answered = tokio::select! {
            biased;
            _ = abort.cancelled() => Err(ErrorBody::new(
                ErrorCode::Unavailable,
                format!("{} stopped while answering this ask", self.id),
            )),
            answered = handler.on_ask(ask) => answered,
        };
        let (headers, payload) = match answered {
            Ok(answer) => {
                let reply = Reply {
                    ask_id,
                    from: self.id.clone(),
                    to: asker,
                    text: answer.text,
                    data: answer.data,
                };
                (HeaderMap::new(), encode(&reply))
            }
            Err(err) => (service::error_headers(&err), service::error_payload(&err)),
        };
        self.send_reply(reply_to, headers, payload).await;
    }

    async fn send_reply(&self, reply_to: String, mut headers: HeaderMap, payload: Bytes) {
        trace::inject_current(&mut headers);
        if let Err(err) = self
            .client
            .publish_with_headers(reply_to, headers, payload)
            .await
        {
            tracing::warn!(error = %err, "could not send the reply");
        }
    }
}

/// Receives events; each runs in its own task, at most [`MAX_CONCURRENT_EVENTS`] at once.
async fn serve_events<H, S>(
    client: Client,
    mut events: S,
    handler: Arc<H>,
    shutdown: CancellationToken,
) where
    H: Handler,
    S: futures::Stream<Item = Message> + Unpin,
{
    let permits = Arc::new(Semaphore::new(MAX_CONCURRENT_EVENTS));
    let mut running = JoinSet::new();
    // Dropped (aborted) with this task when the agent is stopped past its grace period.
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
        };
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = events.next() => match next { Some(m) => m, None => break },
        };
        while running.try_join_next().is_some() {}
        let event = match serde_json::from_slice::<Event>(&message.payload) {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "invalid event dropped");
                continue;
            }
        };
        if !subjects::speaks_as(&message.subject, &event.from) {
            let err = impersonation(&message.subject, "event", &event.from);
            tracing::warn!(subject = %message.subject, error = %err, "event refused");
            // Events have no reply; one sent as a request still learns why it was refused.
            if let Some(reply_to) = message.reply.clone() {
                let _ = client
                    .publish_with_headers(
                        reply_to,
                        service::error_headers(&err),
                        service::error_payload(&err),
                    )
                    .await;
            }
            continue;
        }
        let span = tracing::info_span!("event", subject = %message.subject, name = %event.name);
        trace::set_parent(&span, message.headers.as_ref());
        let handler = handler.clone();
        running.spawn(
            async move {
                let _permit = permit;
                handler.on_event(event).await;
            }
            .instrument(span),
        );
    }
    while running.join_next().await.is_some() {}
}
