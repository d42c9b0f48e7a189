//! Test harness: a real nats-server, a real database (SQLite file or a fresh PostgreSQL
//! database), orchestrator replicas running `run` in-process, a job queue for tests that play
//! the worker by hand, and the fake worker (the allowed test double for the loop worker).

use async_nats::jetstream::{self, consumer::pull};
use cyrene_bus::discovery::{self, Verb};
use cyrene_bus::{RequestError, request_json};
use cyrene_orchestrator::{Config, run};
use cyrene_protocol::ids::new_id;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{
    Disposition, HistoryEntry, HistoryRequest, HistoryResponse, SendAck, SendRequest, SessionEvent,
};
use cyrene_protocol::subjects;
use cyrene_protocol::turn::{
    SteerRequest, SteerResponse, TurnComplete, TurnCompleteAck, TurnJob, TurnOutcome,
};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_test_support::{NatsServer, subscribed};
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const TIMEOUT: Duration = Duration::from_secs(5);

/// Declares the `#[tokio::test]`s `$sqlite` and `$postgres`, which run the scenario
/// `$scenario(backend)` on SQLite and on PostgreSQL.
#[allow(unused_macros)] // the steer bench includes this file too
macro_rules! on_both_backends {
    ($scenario:ident: $sqlite:ident, $postgres:ident) => {
        #[tokio::test(flavor = "multi_thread")]
        async fn $sqlite() {
            $scenario($crate::harness::Backend::Sqlite).await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn $postgres() {
            $scenario($crate::harness::Backend::Postgres).await;
        }
    };
}
#[allow(unused_imports)]
pub(crate) use on_both_backends;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// A fresh PostgreSQL database (`cyrene_orch_<uuid>`), dropped (forcefully) with this value.
pub use cyrene_sql::testing::TestDatabase as PgDb;

/// One test's world: a nats-server, a database, a client.
pub struct World {
    pub nats: NatsServer,
    pub client: async_nats::Client,
    pub dir: tempfile::TempDir,
    pub pg: Option<PgDb>,
    pub events: Arc<Mutex<Vec<SessionEvent>>>,
    _events_task: JoinHandle<()>,
}

impl World {
    pub async fn new(backend: Backend) -> World {
        let nats = NatsServer::start();
        let client = nats.connect().await;
        let dir = tempfile::tempdir().unwrap();
        let pg = match backend {
            Backend::Sqlite => None,
            Backend::Postgres => Some(PgDb::create("cyrene_orch").await),
        };
        let events = Arc::new(Mutex::new(Vec::new()));
        let mut sub = subscribed(&client, subjects::SESSION_EVENTS_ALL).await;
        let sink = events.clone();
        let task = tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Ok(ev) = serde_json::from_slice::<SessionEvent>(&m.payload) {
                    sink.lock().unwrap().push(ev);
                }
            }
        });
        World {
            nats,
            client,
            dir,
            pg,
            events,
            _events_task: task,
        }
    }

    /// A config on this world's database, with a fast sweeper.
    pub fn config(&self) -> Config {
        let mut config = Config::new(self.dir.path().join("data"));
        config.database_url = self.pg.as_ref().map(|p| p.url.clone());
        config.sweep_interval = Duration::from_millis(200);
        config.dispatch_grace = Duration::from_millis(500);
        config
    }

    pub fn events(&self) -> Vec<SessionEvent> {
        self.events.lock().unwrap().clone()
    }

    /// Waits until an event matching `pred` was seen.
    pub async fn wait_event(
        &self,
        what: &str,
        pred: impl Fn(&SessionEvent) -> bool,
    ) -> SessionEvent {
        wait_for(what, Duration::from_secs(10), || {
            self.events().into_iter().find(|e| pred(e))
        })
        .await
    }
}

/// Polls `f` every 20 ms until it yields a value, panicking after `limit`.
pub async fn wait_for<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A world on `backend` with one replica on its default config, and the turn queue watched.
pub async fn one_replica(backend: Backend) -> (World, Replica, JobQueue) {
    one_replica_with(backend, |_| {}).await
}

/// Like [`one_replica`], the replica's config first changed by `configure`.
pub async fn one_replica_with(
    backend: Backend,
    configure: impl FnOnce(&mut Config),
) -> (World, Replica, JobQueue) {
    let world = World::new(backend).await;
    let mut config = world.config();
    configure(&mut config);
    let replica = Replica::start(&world, config).await;
    let jobs = JobQueue::new(&world.client).await;
    (world, replica, jobs)
}

/// A SQLite world with one replica on its default config.
pub async fn sqlite_replica() -> (World, Replica) {
    let world = World::new(Backend::Sqlite).await;
    let replica = Replica::start(&world, world.config()).await;
    (world, replica)
}

/// A SQLite world with one replica and a [`FakeWorker`] holding each turn for `hold`, one step.
pub async fn with_a_fake_worker(hold: Duration) -> (World, Replica, FakeWorker) {
    let world = World::new(Backend::Sqlite).await;
    let replica = Replica::start(&world, world.config()).await;
    let worker = FakeWorker::start(&world, hold, 1).await;
    (world, replica, worker)
}

/// Sends `req`, which must start a turn; returns its ack and the turn's job.
pub async fn start_turn(
    client: &async_nats::Client,
    jobs: &mut JobQueue,
    req: &SendRequest,
) -> (SendAck, TurnJob) {
    let ack = send(client, req).await.unwrap();
    assert_eq!(ack.disposition, Disposition::TurnStarted);
    let (job, _) = jobs.next().await;
    (ack, job)
}

/// Completes `job`'s `attempt` with `answer`; whether this was the first completion.
pub async fn completes_first(
    client: &async_nats::Client,
    job: &TurnJob,
    attempt: u32,
    answer: &str,
) -> bool {
    complete(client, &completion(job, attempt, answer))
        .await
        .unwrap()
        .first
}

/// One orchestrator replica (`run` in a task).
pub struct Replica {
    pub shutdown: CancellationToken,
    handle: Option<JoinHandle<Result<(), cyrene_orchestrator::Error>>>,
}

impl Replica {
    /// Starts a replica on its own connection and waits until it answers requests.
    pub async fn start(world: &World, config: Config) -> Replica {
        let client = world.nats.connect().await;
        let shutdown = CancellationToken::new();
        let agents: Vec<String> = if config.serve_agents {
            config
                .personas
                .personas
                .iter()
                .map(|p| p.id.clone())
                .collect()
        } else {
            Vec::new()
        };
        let before = ping_count(&world.client).await;
        let mut handle = tokio::spawn(run(config, client, shutdown.clone()));
        let start = Instant::now();
        while ping_count(&world.client).await <= before {
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "replica never came up"
            );
            if handle.is_finished() {
                panic!("run ended at start: {:?}", (&mut handle).await);
            }
        }
        let replica = Replica {
            shutdown,
            handle: Some(handle),
        };
        // The endpoints are added right after the service answers pings.
        let probe = HistoryRequest {
            session_id: "ready".into(),
            limit: None,
            before_seq: None,
        };
        wait_async("history endpoint", || async {
            history_raw(&world.client, &probe).await.ok()
        })
        .await;
        // Agents answer a malformed ask with an error envelope: that proves they listen.
        for agent in agents {
            let subject = subjects::agent_ask("ready-check", &agent);
            wait_async("agent registration", || async {
                let sent = world.client.request(subject.clone(), "{}".into());
                match tokio::time::timeout(Duration::from_secs(1), sent).await {
                    Ok(Ok(_)) => Some(()),
                    _ => None,
                }
            })
            .await;
        }
        replica
    }

    /// Stops the replica through its shutdown token and waits for `run` to return.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(h) = self.handle.take() {
            let result = tokio::time::timeout(Duration::from_secs(15), h)
                .await
                .expect("run returns after shutdown")
                .unwrap();
            assert!(result.is_ok(), "run failed: {result:?}");
        }
    }
}

/// The real checkpoint store (SQLite, in the world's directory) on the world's nats-server:
/// where a parallel leg's notice and the running list read how far turns have got.
pub struct CheckpointStore {
    pub client: cyrene_checkpoint_client::CheckpointClient,
    shutdown: CancellationToken,
}

impl CheckpointStore {
    /// Starts the store and waits until it answers.
    pub async fn start(world: &World) -> CheckpointStore {
        let config = cyrene_checkpoint_store::Config::new(world.dir.path().join("checkpoints"));
        let shutdown = CancellationToken::new();
        let mut handle = tokio::spawn(cyrene_checkpoint_store::run(
            config,
            world.nats.connect().await,
            shutdown.clone(),
        ));
        let client = cyrene_checkpoint_client::CheckpointClient::new(world.client.clone(), TIMEOUT);
        let probe = cyrene_protocol::checkpoint::ProgressRequest::default();
        let start = Instant::now();
        while client.progress(&probe).await.is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(15),
                "the checkpoint store never came up"
            );
            if handle.is_finished() {
                panic!(
                    "the checkpoint store ended at start: {:?}",
                    (&mut handle).await
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        CheckpointStore { client, shutdown }
    }
}

impl CheckpointStore {
    /// Saves `job`'s steps as a loop worker does (fenced deltas, the base with the first), step
    /// `i + 1` calling the tools `steps[i]`.
    pub async fn save_steps(&self, job: &TurnJob, steps: &[&[&str]]) {
        use cyrene_protocol::checkpoint::{Checkpoint, checkpoint_id, owner_key};
        use cyrene_protocol::message::ToolCall;
        let owner = owner_key(&job.session_id, Some(&job.leg_id));
        for (i, tools) in steps.iter().enumerate() {
            let step = u32::try_from(i).unwrap() + 1;
            let calls: Vec<ToolCall> = tools
                .iter()
                .map(|name| ToolCall {
                    id: format!("c-{step}-{name}"),
                    name: (*name).into(),
                    args: Default::default(),
                    args_error: None,
                })
                .collect();
            let state = serde_json::json!({
                "step": step, "from": 1 + i, "turn_id": job.turn_id, "stop_reason": "tool_calls",
                "messages": [Message::assistant_tool_calls(&calls)],
            });
            let base = serde_json::json!({"messages": job.messages});
            let object = |v: serde_json::Value| cyrene_protocol::JsonObject::encode(&v).unwrap();
            let checkpoint = Checkpoint {
                id: checkpoint_id(&owner, Some(&job.turn_id), step),
                agent_id: owner.clone(),
                step,
                state: object(state),
                turn_id: Some(job.turn_id.clone()),
                attempt: Some(1),
                base: (step == 1).then(|| object(base)),
                created_at: None,
                updated_at: None,
            };
            self.client.save(&checkpoint).await.unwrap();
        }
    }
}

impl Drop for CheckpointStore {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Polls an async `f` every 20 ms until it yields a value (10 s bound).
pub async fn wait_async<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How many `cyrene-orchestrator` instances answer `$SRV.PING`.
async fn ping_count(client: &async_nats::Client) -> usize {
    orchestrators(client, Verb::Ping, Duration::from_millis(150))
        .await
        .len()
}

/// What each `cyrene-orchestrator` instance answers to `verb` within `wait`.
async fn orchestrators(
    client: &async_nats::Client,
    verb: Verb,
    wait: Duration,
) -> Vec<serde_json::Value> {
    discovery::gather(client, verb, Some("cyrene-orchestrator"), wait, None)
        .await
        .unwrap()
}

/// `num_requests` of `endpoint` on each `cyrene-orchestrator` instance (`$SRV.STATS`).
pub async fn endpoint_requests(client: &async_nats::Client, endpoint: &str) -> Vec<u64> {
    orchestrators(client, Verb::Stats, Duration::from_millis(300))
        .await
        .iter()
        .map(|stats| discovery::endpoint_stat(stats, endpoint, "num_requests").unwrap_or(0))
        .collect()
}

pub fn user(text: &str) -> Message {
    Message::text(Role::User, text)
}

pub fn send_req(session: &str, text: &str, key: &str, client_id: &str) -> SendRequest {
    cyrene_test_support::fixtures::send_request(session, user(text), client_id, key)
}

pub async fn send(client: &async_nats::Client, req: &SendRequest) -> Result<SendAck, RequestError> {
    request_json(client, subjects::SESSION_SEND, req, TIMEOUT).await
}

pub async fn send_ok(client: &async_nats::Client, session: &str, text: &str) -> SendAck {
    send(client, &send_req(session, text, &new_id(), "cli"))
        .await
        .unwrap()
}

pub async fn history_raw(
    client: &async_nats::Client,
    req: &HistoryRequest,
) -> Result<HistoryResponse, RequestError> {
    // A session with an owner (an ask session, `<asker>.ask-…`) is read on its owner's subject.
    let subject = match cyrene_protocol::ids::session_person(&req.session_id) {
        Some(owner) => subjects::person(owner, subjects::PERSON_SESSION_HISTORY)
            .unwrap_or_else(|_| subjects::SESSION_HISTORY.to_owned()),
        None => subjects::SESSION_HISTORY.to_owned(),
    };
    request_json(client, &subject, req, TIMEOUT).await
}

pub async fn history(client: &async_nats::Client, session: &str) -> Vec<HistoryEntry> {
    let req = HistoryRequest {
        session_id: session.into(),
        limit: Some(1000),
        before_seq: None,
    };
    history_raw(client, &req).await.unwrap().messages
}

/// The text of every message in `session`'s transcript, oldest first.
pub async fn history_texts(client: &async_nats::Client, session: &str) -> Vec<String> {
    history(client, session)
        .await
        .iter()
        .map(|e| e.message.text_content())
        .collect()
}

pub async fn steer(
    client: &async_nats::Client,
    job: &TurnJob,
    attempt: u32,
    after_seq: u64,
) -> Result<SteerResponse, RequestError> {
    let req = SteerRequest {
        session_id: job.session_id.clone(),
        turn_id: job.turn_id.clone(),
        leg_id: job.leg_id.clone(),
        step: 2,
        after_seq,
        attempt,
    };
    request_json(client, subjects::TURN_STEER, &req, TIMEOUT).await
}

pub fn completion(job: &TurnJob, attempt: u32, answer: &str) -> TurnComplete {
    TurnComplete {
        turn_id: job.turn_id.clone(),
        session_id: job.session_id.clone(),
        leg_id: job.leg_id.clone(),
        attempt,
        outcome: TurnOutcome::Final,
        message: Some(Message::text(Role::Assistant, answer).sender(job.env.persona.clone())),
        stop_reason: "stop".into(),
        steps: 1,
        steered_ids: Vec::new(),
        error: None,
        approvals: Vec::new(),
    }
}

pub async fn complete(
    client: &async_nats::Client,
    req: &TurnComplete,
) -> Result<TurnCompleteAck, RequestError> {
    request_json(client, subjects::TURN_COMPLETE, req, TIMEOUT).await
}

/// The error code of a failed request.
pub fn code(err: &RequestError) -> ErrorCode {
    match err {
        RequestError::Remote(ErrorBody { code, .. }) => *code,
        other => panic!("expected an error envelope, got {other}"),
    }
}

/// Pulls turn jobs by hand (tests that play the worker step by step).
pub struct JobQueue {
    messages: pull::Stream,
}

impl JobQueue {
    pub async fn new(client: &async_nats::Client) -> JobQueue {
        let consumer = consumer(client, "manual").await;
        JobQueue {
            messages: consumer.messages().await.unwrap(),
        }
    }

    /// The next job (acknowledged) and its attempt.
    pub async fn next(&mut self) -> (TurnJob, u32) {
        let m = tokio::time::timeout(Duration::from_secs(10), self.messages.next())
            .await
            .expect("a turn job within 10 s")
            .unwrap()
            .unwrap();
        assert_eq!(
            m.headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map(|v| v.to_string()),
            serde_json::from_slice::<TurnJob>(&m.payload)
                .ok()
                .map(|j| j.turn_id),
            "Nats-Msg-Id is the turn id"
        );
        let attempt = m.info().unwrap().delivered as u32;
        let job = serde_json::from_slice(&m.payload).unwrap();
        m.ack().await.unwrap();
        (job, attempt)
    }
}

async fn consumer(client: &async_nats::Client, name: &str) -> jetstream::consumer::PullConsumer {
    let js = jetstream::new(client.clone());
    let stream = cyrene_bus::streams::ensure_turns_stream(&js).await.unwrap();
    stream
        .get_or_create_consumer(
            name,
            pull::Config {
                durable_name: Some(name.into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(60),
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await
        .unwrap()
}

/// What the fake worker saw of one turn.
#[derive(Debug, Clone, Default)]
pub struct TurnSeen {
    pub session_id: String,
    pub leg_id: String,
    pub job_ids: Vec<String>,
    pub steered_ids: BTreeSet<String>,
    pub completed: bool,
    pub job: Option<TurnJob>,
}

#[derive(Debug, Default)]
pub struct WorkerLog {
    pub turns: HashMap<String, TurnSeen>,
    in_flight: HashMap<String, u32>,
    /// Sessions where two single-leg turns ran at once (must stay empty).
    pub overlaps: Vec<String>,
}

impl WorkerLog {
    /// Message id → the turns that consumed it.
    pub fn consumers(&self) -> HashMap<String, Vec<String>> {
        let mut out: HashMap<String, Vec<String>> = HashMap::new();
        for (turn, seen) in &self.turns {
            let ids: BTreeSet<&String> = seen.job_ids.iter().chain(&seen.steered_ids).collect();
            for id in ids {
                out.entry(id.clone()).or_default().push(turn.clone());
            }
        }
        out
    }
}

/// The fake loop worker: pulls jobs from `CYRENE_TURNS`, holds each a moment, steers
/// `steers` times, then completes with an answer echoing every user text it consumed.
pub struct FakeWorker {
    pub log: Arc<Mutex<WorkerLog>>,
    shutdown: CancellationToken,
    task: JoinHandle<()>,
}

impl FakeWorker {
    pub async fn start(world: &World, hold: Duration, steers: u32) -> FakeWorker {
        let client = world.nats.connect().await;
        let consumer = consumer(&client, "fake-worker").await;
        let log = Arc::new(Mutex::new(WorkerLog::default()));
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(work(
            client,
            consumer,
            log.clone(),
            shutdown.clone(),
            hold,
            steers,
        ));
        FakeWorker {
            log,
            shutdown,
            task,
        }
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let _ = self.task.await;
    }
}

async fn work(
    client: async_nats::Client,
    consumer: jetstream::consumer::PullConsumer,
    log: Arc<Mutex<WorkerLog>>,
    shutdown: CancellationToken,
    hold: Duration,
    steers: u32,
) {
    let mut messages = consumer.messages().await.unwrap();
    let mut running = tokio::task::JoinSet::new();
    loop {
        let m = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = messages.next() => match m {
                Some(Ok(m)) => m,
                _ => continue,
            },
        };
        while running.try_join_next().is_some() {}
        let client = client.clone();
        let log = log.clone();
        let shutdown = shutdown.clone();
        running.spawn(async move {
            let attempt = m.info().map(|i| i.delivered as u32).unwrap_or(1);
            let Ok(job) = serde_json::from_slice::<TurnJob>(&m.payload) else {
                let _ = m.ack().await;
                return;
            };
            run_job(&client, &log, &shutdown, job, attempt, hold, steers).await;
            let _ = m.ack().await;
        });
    }
    running.abort_all();
}

async fn run_job(
    client: &async_nats::Client,
    log: &Mutex<WorkerLog>,
    shutdown: &CancellationToken,
    job: TurnJob,
    attempt: u32,
    hold: Duration,
    steers: u32,
) {
    let single = job.leg_id.is_empty();
    {
        let mut log = log.lock().unwrap();
        if log.turns.get(&job.turn_id).is_some_and(|t| t.completed) {
            return; // a redelivered job of a finished turn
        }
        if single {
            let n = log.in_flight.entry(job.session_id.clone()).or_default();
            *n += 1;
            if *n > 1 {
                let s = job.session_id.clone();
                log.overlaps.push(s);
            }
        }
        let seen = log.turns.entry(job.turn_id.clone()).or_default();
        seen.session_id = job.session_id.clone();
        seen.leg_id = job.leg_id.clone();
        seen.job_ids = job.message_ids.clone();
        seen.job = Some(job.clone());
    }
    let batch = job.messages.len().saturating_sub(job.message_ids.len());
    let mut texts: Vec<String> = job.messages[batch..]
        .iter()
        .map(Message::text_content)
        .collect();
    let mut after = 0;
    for _ in 0..steers {
        tokio::time::sleep(hold).await;
        if let Ok(resp) = steer(client, &job, attempt, after).await {
            let mut log = log.lock().unwrap();
            let seen = log.turns.entry(job.turn_id.clone()).or_default();
            for m in resp.messages {
                after = after.max(m.seq);
                if seen.steered_ids.insert(m.id.clone()) {
                    texts.push(m.message.text_content());
                }
            }
        }
    }
    tokio::time::sleep(hold).await;
    if single {
        let mut log = log.lock().unwrap();
        if let Some(n) = log.in_flight.get_mut(&job.session_id) {
            *n = n.saturating_sub(1);
        }
    }
    let answer = format!("echo: {}", texts.join(" | "));
    let mut req = completion(&job, attempt, &answer);
    req.steered_ids = log
        .lock()
        .unwrap()
        .turns
        .get(&job.turn_id)
        .map(|t| t.steered_ids.iter().cloned().collect())
        .unwrap_or_default();
    // Retried until acknowledged (the orchestrator may be restarting).
    let start = Instant::now();
    while !shutdown.is_cancelled() && start.elapsed() < Duration::from_secs(60) {
        match complete(client, &req).await {
            Ok(_) => {
                let mut log = log.lock().unwrap();
                if let Some(t) = log.turns.get_mut(&job.turn_id) {
                    t.completed = true;
                }
                return;
            }
            Err(RequestError::Remote(body)) if body.code == ErrorCode::Conflict => return,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
