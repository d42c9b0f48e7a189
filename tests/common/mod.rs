//! A Cyrene stack for cross-service tests: a real nats-server, the real gateway (scripted
//! provider) and the real checkpoint store (SQLite or PostgreSQL) started by the one
//! [`cyrene::stack::Stack`], loop workers in-process or as processes, a test tool, and a test
//! double for the orchestrator's steer/complete endpoints.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)] // shared by several test crates

pub mod approval_stub;

use async_nats::jetstream;
use cyrene_bus::service::{RequestContext, ServeOptions, serve_json};
use cyrene_bus::{RequestError, request_json};
use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::{ModelCaps, ModelsConfig, Script, Secrets};
use cyrene_model_gateway::providers::scripted::RequestLog;
use cyrene_protocol::session::{SendAck, SendRequest};
use cyrene_protocol::turn::{
    SteerRequest, SteerResponse, SteeredMessage, TurnComplete, TurnCompleteAck, TurnJob,
};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use cyrene_test_support::NatsServer;
use cyrene_test_support::micro::{add_endpoint, add_tool_declaring, start_service};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Services running in this test process; stopped when dropped.
pub struct Stack {
    pub server: NatsServer,
    pub client: async_nats::Client,
    /// The real services (gateway, store).
    pub services: cyrene::stack::Stack,
    pub log: RequestLog,
    pub orchestrator: Arc<FakeOrchestrator>,
    pub tools: Arc<TestTools>,
    pub data: tempfile::TempDir,
    pub shutdown: CancellationToken,
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The scripted model config: `rules` as in docs/model-gateway.md, or
/// `{"rules": […], "vision": true}` for a scripted model that takes images (so the loop worker
/// sends them as they are instead of describing them first). What the model is not scripted for
/// it echoes (`echo: <input>`).
pub fn models(rules: Value) -> ModelsConfig {
    models_replying(rules, "echo: {input}")
}

/// [`models`] answering what it is not scripted for with `default_reply`.
pub fn models_replying(rules: Value, default_reply: &str) -> ModelsConfig {
    let (rules, vision) = match rules {
        Value::Object(mut o) => (
            o.remove("rules").unwrap_or_default(),
            o.get("vision") == Some(&json!(true)),
        ),
        rules => (rules, false),
    };
    let script = Script {
        rules: serde_json::from_value(rules).unwrap(),
        default_reply: Some(default_reply.to_owned()),
        word_delay_ms: 0,
    };
    let caps = ModelCaps {
        vision,
        ..ModelCaps::default()
    };
    ModelsConfig::offline_with(script, caps)
}

/// `models` written to `dir/models.json` (for `CYRENE_GATEWAY_MODELS`); its path.
pub fn models_file(dir: &std::path::Path, models: &ModelsConfig) -> PathBuf {
    let path = dir.join("models.json");
    std::fs::write(&path, serde_json::to_vec(models).unwrap()).unwrap();
    path
}

/// How the services of a [`cyrene::stack::Stack`] reach `server` (no credentials).
pub fn bus_config(server: &NatsServer) -> cyrene_bus::BusConfig {
    cyrene_bus::BusConfig::new(server.url(), "cyrene", cyrene_bus::ConnectMode::Client)
}

/// Waits (bounded) until every service of `stack` answers `$SRV.PING` on `client`.
pub async fn wait_for_stack(stack: &cyrene::stack::Stack, client: &async_nats::Client) {
    stack.ready(client, Duration::from_secs(20)).await.unwrap();
}

/// A nats-server, a client of it, and [`spawn_scripted_gateway`] serving on that client until
/// the bus is dropped.
pub struct Bus {
    pub server: NatsServer,
    pub client: async_nats::Client,
    /// The gateway's request log.
    pub log: RequestLog,
    /// Cancelled on drop: stops the gateway and whatever else was started with it.
    pub shutdown: CancellationToken,
}

impl Drop for Bus {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Bus {
    /// Starts the server and the gateway over the scripted model config `rules` ([`models`]).
    pub async fn with_gateway(rules: Value) -> Bus {
        let server = NatsServer::start();
        let client = server.connect().await;
        let shutdown = CancellationToken::new();
        let log = spawn_scripted_gateway(rules, client.clone(), &shutdown);
        Bus {
            server,
            client,
            log,
            shutdown,
        }
    }
}

/// Serves `endpoint` with `handler` (default options) until `shutdown`, on a task of its own.
pub fn spawn_endpoint<Req, Resp, F, Fut>(
    endpoint: async_nats::service::endpoint::Endpoint,
    shutdown: &CancellationToken,
    handler: F,
) where
    Req: serde::de::DeserializeOwned + Send + 'static,
    Resp: serde::Serialize + Send + 'static,
    F: Fn(Req, RequestContext) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Resp, ErrorBody>> + Send + 'static,
{
    tokio::spawn(serve_json(
        endpoint,
        ServeOptions::default(),
        shutdown.clone(),
        handler,
    ));
}

/// A nats-server, a client of it, and a data dir for service processes, with its path as text.
pub async fn bus_with_data_dir() -> (NatsServer, async_nats::Client, tempfile::TempDir, String) {
    let server = NatsServer::start();
    let client = server.connect().await;
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().display().to_string();
    (server, client, data, dir)
}

/// Waits until the four services answer discovery: gateway, store, orchestrator, worker.
pub async fn wait_for_the_four_services(client: &async_nats::Client) {
    for name in [
        "cyrene-model-gateway",
        "cyrene-checkpoint-store",
        "cyrene-orchestrator",
        "cyrene-loop-worker",
    ] {
        wait_for_service(client, name).await;
    }
}

/// Sends SIGTERM to `child` (a clean stop); the signal must be delivered.
pub fn terminate(child: &tokio::process::Child) {
    let pid = child.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());
}

/// Headers carrying the W3C `traceparent` of trace `trace_id`, parent span `span_id`.
pub fn traceparent(trace_id: &str, span_id: &str) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    cyrene_bus::headers::insert(
        &mut headers,
        "traceparent",
        &format!("00-{trace_id}-{span_id}-01"),
    )
    .unwrap();
    headers
}

/// Asserts that a finished process exited successfully, showing its output otherwise.
pub fn assert_success(out: &std::process::Output) {
    cyrene_test_support::process::success_stdout(out, "the process");
}

/// The real gateway over the scripted model config `rules` ([`models`]), with no secrets.
pub fn scripted_gateway(rules: Value) -> Gateway {
    Gateway::new(
        models(rules),
        &Secrets::from_pairs(Vec::<(String, String)>::new()),
        cyrene_model_gateway::http_client().unwrap(),
    )
    .unwrap()
}

/// [`scripted_gateway`] serving on `client` until `shutdown`; returns its request log.
pub fn spawn_scripted_gateway(
    rules: Value,
    client: async_nats::Client,
    shutdown: &CancellationToken,
) -> RequestLog {
    let gateway = scripted_gateway(rules);
    let log = gateway.request_log("offline").unwrap();
    tokio::spawn(cyrene_model_gateway::serve(
        Arc::new(gateway),
        client,
        ServeOptions::default(),
        shutdown.clone(),
    ));
    log
}

impl Stack {
    /// Starts everything but the workers. `database_url` None = SQLite in a temp dir.
    pub async fn start(rules: Value, database_url: Option<String>) -> Stack {
        Stack::start_with(rules, database_url, true).await
    }

    /// Like [`Stack::start`], optionally without the gateway (a model outage).
    pub async fn start_with(rules: Value, database_url: Option<String>, gateway: bool) -> Stack {
        let server = NatsServer::start();
        let client = server.connect().await;
        let shutdown = CancellationToken::new();
        let data = tempfile::tempdir().unwrap();

        // Each service on its own connection, as in production; the fake stands in for the
        // orchestrator, and the tests start their workers themselves.
        let mut services = cyrene::stack::Stack::builder(bus_config(&server), data.path())
            .shutdown(shutdown.clone())
            .models(models(rules))
            .database_url(database_url)
            .orchestrator(None)
            .workers(0, worker_config());
        if !gateway {
            services = services.gateway(None);
        }
        let services = services.start().await.unwrap();
        // Without a gateway nothing is asked of a model: an empty log.
        let log = services.model_log("offline").unwrap_or_default();

        let orchestrator = FakeOrchestrator::start(&server.connect().await, shutdown.clone()).await;
        let tools = TestTools::start(&server.connect().await, shutdown.clone()).await;

        let js = jetstream::new(client.clone());
        cyrene_bus::streams::ensure_turns_stream(&js).await.unwrap();
        wait_for_stack(&services, &client).await;
        Stack {
            server,
            client,
            services,
            log,
            orchestrator,
            tools,
            data,
            shutdown,
        }
    }

    /// A loop worker in this process (stopped with the stack).
    pub async fn spawn_worker(&self, config: cyrene_loop_worker::Config) {
        tokio::spawn(cyrene_loop_worker::run(
            config,
            self.server.connect().await,
            self.shutdown.clone(),
        ));
    }

    /// Publishes a job on CYRENE_TURNS with `Nats-Msg-Id` = turn id.
    pub async fn dispatch(&self, job: &TurnJob) {
        let js = jetstream::new(self.client.clone());
        let mut headers = async_nats::HeaderMap::new();
        cyrene_bus::headers::insert(&mut headers, "Nats-Msg-Id", &job.turn_id).unwrap();
        js.publish_with_headers(
            subjects::TURN_RUN,
            headers,
            serde_json::to_vec(job).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }

    /// A loop-worker process on this stack's bus (ack wait 1 s), killed when dropped.
    pub fn worker_process(&self, name: &str) -> tokio::process::Child {
        tokio::process::Command::new(workspace_binary("cyrene-loop-worker"))
            .env("NATS_URL", self.server.url())
            .env("CYRENE_WORKER_ACK_WAIT", "1s")
            .env("RUST_LOG", "warn")
            .env("OTEL_SERVICE_NAME", name)
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    }

    /// Waits (bounded) until the `hold` tool has started.
    pub async fn hold_started(&self, what: &str) {
        self.tools.hold_started(what).await;
    }

    /// SIGKILLs `worker`, then lets the held tool (and any later `hold`) go.
    pub async fn kill_and_release(&self, worker: &mut tokio::process::Child, gate: &Notify) {
        worker.start_kill().unwrap(); // SIGKILL
        worker.wait().await.unwrap();
        *self.tools.gate.lock().unwrap() = None;
        gate.notify_waiters();
    }

    /// The checkpoints of an owner, newest first.
    pub async fn checkpoints(&self, owner: &str) -> Vec<cyrene_protocol::checkpoint::Checkpoint> {
        let client = cyrene_checkpoint_client::CheckpointClient::new(
            self.client.clone(),
            Duration::from_secs(5),
        );
        client.list(owner, Some(100)).await.unwrap()
    }
}

/// Worker settings for tests: short ack wait so redelivery is quick.
pub fn worker_config() -> cyrene_loop_worker::Config {
    cyrene_loop_worker::Config {
        concurrency: 4,
        ack_wait: Duration::from_secs(1),
        retry_delay: Duration::from_millis(100),
        tool_refresh: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(1),
        ..Default::default()
    }
}

/// A job for session `session` answering `text`.
pub fn job(turn_id: &str, session: &str, text: &str) -> TurnJob {
    cyrene_test_support::fixtures::turn_job(turn_id, session, text)
}

/// Sends `request` on `cyrene.session.send` (5 s a try), again every 200 ms until acknowledged
/// or `give_up` has passed: the last error then. Idempotent by key: a resend after a lost ack
/// gets the first ack back.
pub async fn send_until_acked(
    client: &async_nats::Client,
    request: &SendRequest,
    give_up: Duration,
) -> Result<SendAck, RequestError> {
    let deadline = tokio::time::Instant::now() + give_up;
    loop {
        let sent = request_json(
            client,
            subjects::SESSION_SEND,
            request,
            Duration::from_secs(5),
        )
        .await;
        match sent {
            Err(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            sent => return sent,
        }
    }
}

/// Waits (bounded) until a micro service named `name` answers `$SRV.PING`.
pub async fn wait_for_service(client: &async_nats::Client, name: &str) {
    let ok = cyrene_bus::discovery::wait_for(
        client,
        name,
        Duration::from_secs(20),
        Duration::from_millis(200),
    )
    .await;
    assert!(ok, "{name} answers $SRV.PING");
}

/// The scripted model of the loop bench's turns: a message holding "run the steps" runs `rounds`
/// tool rounds of `current_time`, then answers "done"; anything else gets the default reply.
pub fn tool_rounds_rules(rounds: usize) -> Value {
    let round = json!([{"name": "current_time"}]);
    let more: Vec<_> = (1..rounds).map(|_| round.clone()).collect();
    json!([
        {"contains": "run the steps", "tool_calls": [{"name": "current_time"}],
         "more_rounds": more, "after_tools": "done"}
    ])
}

/// Sends `text` to `session` as `client_id`, following the session's events (subscribed before
/// the send), and waits up to `within` for its turn to end; the instants of its `step` events.
pub async fn turn_steps(
    client: &async_nats::Client,
    session: &str,
    text: &str,
    client_id: &str,
    within: Duration,
) -> Vec<Instant> {
    use cyrene_protocol::message::{Message, Role};
    use cyrene_protocol::session::{SessionEvent, SessionEventType};
    use futures::StreamExt;
    let mut events = client
        .subscribe(subjects::session_events(session).unwrap())
        .await
        .unwrap();
    client.flush().await.unwrap();
    let request = SendRequest {
        session_id: session.to_owned(),
        message: Message::text(Role::User, text),
        client_id: client_id.to_owned(),
        idempotency_key: String::new(),
        env: None,
        parallel: false,
        when_busy: None,
        persona: String::new(),
        context_only: false,
    };
    let ack: SendAck = request_json(
        client,
        subjects::SESSION_SEND,
        &request,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut steps = Vec::new();
    loop {
        let m = tokio::time::timeout(within, events.next())
            .await
            .expect("the turn ends in time")
            .unwrap();
        let event: SessionEvent = serde_json::from_slice(&m.payload).unwrap();
        match event.kind {
            SessionEventType::Step => steps.push(Instant::now()),
            SessionEventType::TurnEnded if event.turn_id == ack.turn_id => return steps,
            _ => {}
        }
    }
}

/// Waits (bounded) until `n` replicas of `service` list `endpoint` in `$SRV.INFO`: once one
/// replica answers, a `$SRV.PING` says nothing of a second one still starting.
pub async fn wait_for_replicas(
    client: &async_nats::Client,
    service: &str,
    endpoint: &str,
    n: usize,
) {
    let listed = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let infos = cyrene_bus::discovery::gather(
                client,
                cyrene_bus::discovery::Verb::Info,
                Some(service),
                Duration::from_millis(500),
                Some(n),
            )
            .await
            .unwrap_or_default();
            let serving = infos
                .iter()
                .filter(|info| {
                    let names = info["endpoints"].as_array().cloned().unwrap_or_default();
                    names.iter().any(|e| e["name"] == endpoint)
                })
                .count();
            if serving >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(listed.is_ok(), "{n} replicas of {service} list {endpoint}");
}

/// Waits (bounded) until `service`'s `$SRV.INFO` lists the endpoint `endpoint`. A micro service
/// answers `$SRV.PING` as soon as it is registered, before its endpoints are added one by one; an
/// endpoint in `$SRV.INFO` has its subscription on the server already (the service's connection
/// sent it before that reply), so a request to it finds a responder.
pub async fn wait_for_endpoint(client: &async_nats::Client, service: &str, endpoint: &str) {
    wait_for_replicas(client, service, endpoint, 1).await;
}

/// Waits (bounded) until `check` holds.
pub async fn eventually<F: FnMut() -> bool>(what: &str, within: Duration, mut check: F) {
    let ok = tokio::time::timeout(within, async {
        while !check() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(ok.is_ok(), "timed out waiting for: {what}");
}

/// The orchestrator's steer/complete endpoints, scripted by the test.
#[derive(Default)]
pub struct FakeOrchestrator {
    /// Messages to hand out at a boundary: (turn, step) → messages.
    pub steer_at: Mutex<HashMap<(String, u32), Vec<SteeredMessage>>>,
    claimed: Mutex<HashMap<String, Vec<SteeredMessage>>>,
    pub steer_calls: Mutex<Vec<(SteerRequest, Instant)>>,
    attempts: Mutex<HashMap<String, u32>>,
    pub completions: Mutex<Vec<TurnComplete>>,
    pub completed: Notify,
    /// While set, every completion is refused (`unavailable`) unrecorded, as if each report
    /// were lost on the way; `refused` counts them.
    pub refuse_completions: std::sync::atomic::AtomicBool,
    pub refused: std::sync::atomic::AtomicUsize,
}

impl FakeOrchestrator {
    async fn start(
        client: &async_nats::Client,
        shutdown: CancellationToken,
    ) -> Arc<FakeOrchestrator> {
        let fake = Arc::new(FakeOrchestrator::default());
        let service = start_service(client, "fake-orchestrator", "0.0.0").await;
        let steer = add_endpoint(&service, "steer", subjects::TURN_STEER).await;
        let complete = add_endpoint(&service, "complete", subjects::TURN_COMPLETE).await;
        let f = fake.clone();
        let pusher = client.clone();
        let on_steer = move |req: SteerRequest, _: RequestContext| {
            let f = f.clone();
            let pusher = pusher.clone();
            async move {
                let turn = req.turn_id.clone();
                let (reply, later) = f.steer(req);
                // Like the real orchestrator: what arrives for a later boundary is claimed
                // and pushed to the turn's input (the worker subscribed before this steer).
                let subject = subjects::turn_input(&turn).unwrap();
                for message in later {
                    let payload = serde_json::to_vec(&message).unwrap();
                    pusher
                        .publish(subject.clone(), payload.into())
                        .await
                        .unwrap();
                }
                reply
            }
        };
        spawn_endpoint(steer, &shutdown, on_steer);
        let f = fake.clone();
        let on_complete = move |req: TurnComplete, _: RequestContext| {
            let f = f.clone();
            async move { f.complete(req) }
        };
        spawn_endpoint(complete, &shutdown, on_complete);
        std::mem::forget(service);
        client.flush().await.unwrap();
        fake
    }

    fn fence(&self, turn: &str, attempt: u32) -> Result<(), ErrorBody> {
        let mut attempts = self.attempts.lock().unwrap();
        let newest = attempts.entry(turn.to_owned()).or_insert(attempt);
        if attempt < *newest {
            return Err(ErrorBody::new(
                ErrorCode::Conflict,
                format!("attempt {attempt} < {newest}"),
            ));
        }
        *newest = attempt;
        Ok(())
    }

    /// The reply, and the messages scripted for later boundaries (claimed now, to push).
    fn steer(&self, req: SteerRequest) -> (Result<SteerResponse, ErrorBody>, Vec<SteeredMessage>) {
        self.steer_calls
            .lock()
            .unwrap()
            .push((req.clone(), Instant::now()));
        if let Err(err) = self.fence(&req.turn_id, req.attempt) {
            return (Err(err), Vec::new());
        }
        let mut claimed = self.claimed.lock().unwrap();
        let mine = claimed.entry(req.turn_id.clone()).or_default();
        let messages = {
            let mut steer_at = self.steer_at.lock().unwrap();
            let due: Vec<(String, u32)> = steer_at
                .keys()
                .filter(|(t, s)| *t == req.turn_id && *s <= req.step)
                .cloned()
                .collect();
            for key in due {
                mine.extend(steer_at.remove(&key).unwrap_or_default());
            }
            mine.iter()
                .filter(|m| m.seq > req.after_seq)
                .cloned()
                .collect()
        };
        let mut steer_at = self.steer_at.lock().unwrap();
        let later: Vec<(String, u32)> = steer_at
            .keys()
            .filter(|(t, _)| *t == req.turn_id)
            .cloned()
            .collect();
        let mut pushed = Vec::new();
        for key in later {
            pushed.extend(steer_at.remove(&key).unwrap_or_default());
        }
        mine.extend(pushed.iter().cloned());
        (Ok(SteerResponse { messages }), pushed)
    }

    fn complete(&self, req: TurnComplete) -> Result<TurnCompleteAck, ErrorBody> {
        use std::sync::atomic::Ordering::SeqCst;
        if self.refuse_completions.load(SeqCst) {
            self.refused.fetch_add(1, SeqCst);
            return Err(ErrorBody::new(
                ErrorCode::Unavailable,
                "the report was lost",
            ));
        }
        self.fence(&req.turn_id, req.attempt)?;
        let mut completions = self.completions.lock().unwrap();
        let first = !completions.iter().any(|c| c.turn_id == req.turn_id);
        completions.push(req);
        self.completed.notify_waiters();
        Ok(TurnCompleteAck { first })
    }

    /// Waits (bounded) for the first completion of `turn`.
    pub async fn wait_completed(&self, turn: &str) -> TurnComplete {
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let notified = self.completed.notified();
                if let Some(c) = self
                    .completions
                    .lock()
                    .unwrap()
                    .iter()
                    .find(|c| c.turn_id == turn)
                {
                    return c.clone();
                }
                notified.await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("turn {turn} completes"))
    }
}

/// External tools on `cyrene.tool.*` that count their executions by call id.
#[derive(Default)]
pub struct TestTools {
    pub runs: Mutex<Vec<(String, String)>>,
    pub finished: Mutex<Vec<(String, Instant)>>,
    /// While set, `hold` blocks until released.
    pub gate: Mutex<Option<Arc<Notify>>>,
}

impl TestTools {
    /// Serves the tools as micro service `test-tools` on `client` until `shutdown`.
    pub async fn start(client: &async_nats::Client, shutdown: CancellationToken) -> Arc<TestTools> {
        let tools = Arc::new(TestTools::default());
        let service = start_service(client, "test-tools", "0.0.0").await;
        // `hold` may run again under its call id; `hold_once` must not run twice (docs/tools.md,
        // "Semantics"); the others declare nothing.
        for (name, description, idempotent) in [
            ("count", "counts its executions", None),
            ("hold", "waits until the test releases it", Some("true")),
            (
                "hold_once",
                "waits until released; never twice",
                Some("false"),
            ),
            ("slow", "takes 300 ms", None),
            ("broken", "always fails with a micro error", None),
        ] {
            let declared: Vec<(&str, &str)> = idempotent
                .map(|v| ("cyrene.tool.idempotent", v))
                .into_iter()
                .collect();
            let endpoint = add_tool_declaring(
                &service,
                name,
                description,
                r#"{"type":"object"}"#,
                &declared,
            )
            .await;
            let t = tools.clone();
            let name = name.to_owned();
            let on_call = move |_args: Value, ctx: RequestContext| {
                let (t, name) = (t.clone(), name.clone());
                async move {
                    let id = ctx
                        .headers
                        .get("Cyrene-Tool-Call-Id")
                        .map(|v| v.as_str().to_owned())
                        .unwrap_or_default();
                    t.runs.lock().unwrap().push((name.clone(), id.clone()));
                    if name == "hold" || name == "hold_once" {
                        let gate = t.gate.lock().unwrap().clone();
                        if let Some(gate) = gate {
                            gate.notified().await;
                        }
                    }
                    if name == "slow" {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                    }
                    if name == "broken" {
                        return Err(ErrorBody::new(ErrorCode::NotFound, "no such record"));
                    }
                    t.finished
                        .lock()
                        .unwrap()
                        .push((id.clone(), Instant::now()));
                    Ok::<_, ErrorBody>(
                        json!({"text": format!("{name} ran as {}", short_call_id(&id)), "is_error": false}),
                    )
                }
            };
            spawn_endpoint(endpoint, &shutdown, on_call);
        }
        std::mem::forget(service);
        client.flush().await.unwrap();
        tools
    }

    /// Waits (bounded) until the `hold` tool has started.
    pub async fn hold_started(&self, what: &str) {
        self.tool_started("hold", what).await;
    }

    /// Waits (bounded) until tool `tool` has started.
    pub async fn tool_started(&self, tool: &str, what: &str) {
        eventually(what, Duration::from_secs(60), || {
            self.runs
                .lock()
                .unwrap()
                .iter()
                .any(|(name, _)| name == tool)
        })
        .await;
    }

    /// The call ids `tool` ran with, in order (full ids).
    pub fn ids_of(&self, tool: &str) -> Vec<String> {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|(name, _)| name == tool)
            .map(|(_, id)| id.clone())
            .collect()
    }

    pub fn runs_of(&self, call_id: &str) -> usize {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, id)| short_call_id(id) == call_id)
            .count()
    }
}

/// A scripted provider's call id without its conversation digest: `call_<turn>_<n>_<i>` →
/// `call_<n>_<i>`, so tests can name a turn's calls by step and position. Other ids unchanged.
pub fn short_call_id(id: &str) -> String {
    let parts: Vec<&str> = id.split('_').collect();
    match parts.as_slice() {
        ["call", digest, n, i] if digest.len() == 8 => format!("call_{n}_{i}"),
        _ => id.to_owned(),
    }
}

/// Path of a workspace binary built next to the `cyrene` binary (`make test` and `make chaos`
/// build them all; `make bench` builds the release ones).
pub fn workspace_binary(name: &str) -> PathBuf {
    let cyrene = PathBuf::from(env!("CARGO_BIN_EXE_cyrene"));
    let path = cyrene.with_file_name(name);
    let release = cyrene.parent().is_some_and(|dir| dir.ends_with("release"));
    let build = if release {
        "`cargo build --release --workspace --bins` (make bench does)"
    } else {
        "`cargo build --workspace --bins` (make test and make chaos do)"
    };
    assert!(path.exists(), "{} is missing: run {build}", path.display());
    path
}

/// Turn ids of every completion, for duplicate checks.
pub fn completion_counts(fake: &FakeOrchestrator) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for c in fake.completions.lock().unwrap().iter() {
        *counts.entry(c.turn_id.clone()).or_default() += 1;
    }
    counts
}

/// A fresh PostgreSQL database (`<prefix>_<uuid>` on `CYRENE_TEST_POSTGRES_URL`'s server), dropped
/// with the value; `None` when PostgreSQL is unreachable.
pub async fn fresh_postgres(prefix: &str) -> Option<cyrene_sql::testing::TestDatabase> {
    cyrene_sql::testing::TestDatabase::try_create(prefix)
        .await
        .ok()
}

/// A service binary as a child process, killed when dropped.
pub fn service(name: &str, nats_url: &str, envs: &[(&str, &str)]) -> tokio::process::Child {
    let mut cmd = tokio::process::Command::new(workspace_binary(name));
    cmd.env("NATS_URL", nats_url)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.stdout(std::process::Stdio::null());
    cmd.spawn().unwrap()
}

/// `cyrene up` (every service in one process) on `nats_url` with its data in `data`, killed on
/// drop; its log is quiet.
pub fn cyrene_up(nats_url: &str, data: &std::path::Path) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"))
        .args(["up", "--data-dir"])
        .arg(data)
        .env("NATS_URL", nats_url)
        .env("RUST_LOG", "warn")
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}
