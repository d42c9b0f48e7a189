//! The system under test as processes: a real nats-server (one node, or a 3-node cluster), the
//! real service binaries (gateway, checkpoint store, orchestrator, loop workers), the machine's
//! PostgreSQL (or SQLite files), plus the in-process mock provider, tool service and wire
//! watcher. Every fault the chaos loop injects is a method here.
//!
//! # Pitfalls
//! - Processes are stopped with SIGKILL (a crash); `kill_on_drop` cleans up after a panic.
//! - Each service's stderr (JSON log lines) is kept under `target/tmp/chaos-<run>/` for a
//!   post-mortem; the directory is printed at start.
//! - A loop worker is known on the wire by its request inbox (`_INBOX_cyrene-loop-worker.<id>`),
//!   learnt from the server's `/connz` right after it starts.
//! - PostgreSQL is the machine's shared server: [`PostgresGuard`] starts it again when the test
//!   ends, also on a panic.

use crate::approver::Approver;
use crate::provider::MockProvider;
use crate::tools::ToolService;
use crate::wire::{WORKER_INBOX_PREFIX, Wire};
use cyrene_bus::request_json;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::session::{
    HistoryEntry, HistoryRequest, HistoryResponse, SendAck, SendRequest,
};
use cyrene_protocol::subjects;
use cyrene_test_support::{NatsCluster, NatsServer};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

/// The bus: one restartable server or a cluster.
#[derive(Debug)]
pub enum Bus {
    Single(NatsServer),
    Cluster(NatsCluster),
}

impl Bus {
    fn nodes(&self) -> Vec<&NatsServer> {
        match self {
            Bus::Single(server) => vec![server],
            Bus::Cluster(cluster) => cluster.nodes().iter().collect(),
        }
    }
}

/// How to build a world.
#[derive(Debug, Clone)]
pub struct Options {
    /// A 3-node cluster with the turn stream at 3 replicas (else one node, 1 replica).
    pub cluster: bool,
    /// PostgreSQL (a fresh database) for the store and the orchestrator; else SQLite files.
    pub postgres: bool,
    pub workers: usize,
    pub seed: u64,
    /// Label of the run (log directory, database name).
    pub label: String,
}

/// A loop worker process.
#[derive(Debug)]
pub struct WorkerProc {
    pub n: usize,
    pub pid: u32,
    pub inbox: Option<String>,
    child: Child,
}

/// A SIGKILL of a loop worker.
#[derive(Debug, Clone)]
pub struct WorkerKill {
    pub at: Instant,
    pub n: usize,
    pub pid: u32,
    pub inbox: Option<String>,
    /// The killed worker's other reply inboxes (its streamed model calls' shared inbox), from
    /// the same connection: requests from them are the killed worker's too.
    pub also: Vec<String>,
}

/// A service the world runs as one process (loop workers are many: [`World::spawn_worker`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Service {
    Gateway,
    Store,
    Orchestrator,
}

impl Service {
    /// Its binary, which is also its micro service name.
    fn binary(self) -> &'static str {
        match self {
            Service::Gateway => "cyrene-model-gateway",
            Service::Store => "cyrene-checkpoint-store",
            Service::Orchestrator => "cyrene-orchestrator",
        }
    }

    /// Its log file under the run's log directory, without `.log`.
    fn log(self) -> &'static str {
        match self {
            Service::Gateway => "gateway",
            Service::Store => "checkpoint-store",
            Service::Orchestrator => "orchestrator",
        }
    }

    /// What the timeline calls it.
    pub fn name(self) -> &'static str {
        match self {
            Service::Gateway => "model gateway",
            Service::Store => "checkpoint store",
            Service::Orchestrator => "orchestrator",
        }
    }
}

#[derive(Debug, Default)]
struct Procs {
    services: BTreeMap<Service, Child>,
    workers: Vec<WorkerProc>,
    next_worker: usize,
}

/// Everything a chaos test runs against.
#[derive(Debug)]
pub struct World {
    pub options: Options,
    pub bus: Arc<Mutex<Bus>>,
    pub nats_url: String,
    pub client: async_nats::Client,
    pub provider: MockProvider,
    pub tools: ToolService,
    pub wire: Wire,
    /// Decides every tool call that waits for approval.
    pub approver: Approver,
    pub database_url: Option<String>,
    /// The run's PostgreSQL database, dropped with the world.
    _database: Option<cyrene_sql::testing::TestDatabase>,
    pub logs: PathBuf,
    pub started: Instant,
    data: tempfile::TempDir,
    models: PathBuf,
    procs: tokio::sync::Mutex<Procs>,
    pub kills: Mutex<Vec<WorkerKill>>,
    /// What the chaos loop did, for the report: (seconds since start, what).
    pub faults: Mutex<Vec<(f64, String)>>,
    /// Inboxes of every worker ever started (to tell the next one's apart).
    known_inboxes: Mutex<BTreeSet<String>>,
}

/// Replicas of the turn stream.
fn replicas(options: &Options) -> usize {
    if options.cluster { 3 } else { 1 }
}

impl World {
    pub async fn start(options: Options) -> Arc<World> {
        let started = Instant::now();
        let bus = if options.cluster {
            Bus::Cluster(
                tokio::task::spawn_blocking(|| NatsCluster::start(3))
                    .await
                    .unwrap(),
            )
        } else {
            Bus::Single(
                tokio::task::spawn_blocking(NatsServer::start)
                    .await
                    .unwrap(),
            )
        };
        // The harness watches through the first node, which the cluster variant never kills.
        let (nats_url, watch_url) = match &bus {
            Bus::Single(server) => (server.url(), server.url()),
            Bus::Cluster(cluster) => (cluster.urls(), cluster.node(0).url()),
        };
        let client = async_nats::ConnectOptions::new()
            .max_reconnects(None)
            .reconnect_delay_callback(|_| Duration::from_millis(50))
            .connect(watch_url)
            .await
            .unwrap();
        let provider = MockProvider::start(options.seed).await;
        let tools = ToolService::start(&client).await;
        let wire = Wire::start(&client).await;
        let approver = Approver::start(&client, options.seed ^ 0xa11).await;

        let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        // Logs of earlier runs with this label go (each run keeps only its own); a run whose
        // process is still alive (a second run of the same binary beside this one) keeps them.
        let earlier = format!("chaos-{}-", options.label);
        for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let running = name
                .strip_prefix(&earlier)
                .is_some_and(|pid| Path::new("/proc").join(pid).exists());
            if name.starts_with(&earlier) && !running {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        let logs = tmp.join(format!("chaos-{}-{}", options.label, std::process::id()));
        std::fs::create_dir_all(&logs).unwrap();
        println!("chaos: service logs in {}", logs.display());
        let data = tempfile::tempdir().unwrap();
        let models = data.path().join("models.json");
        std::fs::write(&models, provider.models_config().to_string()).unwrap();
        let database = if options.postgres {
            let prefix = format!("cyrene_chaos_{}", options.label.replace('-', "_"));
            Some(cyrene_sql::testing::TestDatabase::create(&prefix).await)
        } else {
            None
        };
        let database_url = database.as_ref().map(|db| db.url.clone());
        let workers = options.workers;
        let world = Arc::new(World {
            options,
            bus: Arc::new(Mutex::new(bus)),
            nats_url,
            client,
            provider,
            tools,
            wire,
            approver,
            database_url,
            _database: database,
            logs,
            started,
            data,
            models,
            procs: tokio::sync::Mutex::new(Procs::default()),
            kills: Mutex::new(Vec::new()),
            faults: Mutex::new(Vec::new()),
            known_inboxes: Mutex::new(BTreeSet::new()),
        });
        for service in [Service::Gateway, Service::Store, Service::Orchestrator] {
            world.start_service(service).await;
        }
        for _ in 0..workers {
            world.spawn_worker().await;
        }
        world
    }

    /// Seconds since the world started.
    pub fn clock(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.started).as_secs_f64()
    }

    pub fn note(&self, what: impl Into<String>) {
        let what = what.into();
        let t = self.clock(Instant::now());
        println!("chaos: {t:7.1}s {what}");
        self.faults.lock().unwrap().push((t, what));
    }

    fn command(&self, binary: &str, log: &str) -> Command {
        let mut cmd = Command::new(crate::common::workspace_binary(binary));
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("{log}.log")))
            .unwrap();
        cmd.env("NATS_URL", &self.nats_url)
            .env("RUST_LOG", "info")
            .env("CYRENE_STORE_DATA_DIR", self.data.path())
            .env("CYRENE_ORCHESTRATOR_DATA_DIR", self.data.path())
            .env(
                "CYRENE_WORKER_TURNS_REPLICAS",
                replicas(&self.options).to_string(),
            )
            .env(
                "CYRENE_ORCHESTRATOR_TURNS_REPLICAS",
                replicas(&self.options).to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .kill_on_drop(true);
        if let Some(url) = &self.database_url {
            cmd.env("DATABASE_URL", url);
        }
        cmd
    }

    /// Starts `service`'s process and waits until it answers on the bus.
    pub async fn start_service(&self, service: Service) {
        let mut cmd = self.command(service.binary(), service.log());
        if service == Service::Gateway {
            cmd.env("CYRENE_GATEWAY_MODELS", &self.models);
        }
        let child = cmd.spawn().unwrap();
        self.procs.lock().await.services.insert(service, child);
        self.wait_for_service(service.binary()).await;
    }

    /// SIGKILLs `service`'s process, if it runs.
    pub async fn kill_service(&self, service: Service) {
        if let Some(mut child) = self.procs.lock().await.services.remove(&service) {
            let _ = child.kill().await;
        }
    }

    /// Starts a loop worker and learns its inbox; returns its number.
    pub async fn spawn_worker(&self) -> usize {
        let mut procs = self.procs.lock().await;
        let n = procs.next_worker;
        procs.next_worker += 1;
        let mut cmd = self.command("cyrene-loop-worker", &format!("worker-{n}"));
        if let Ok(max_deliver) = std::env::var("CHAOS_WORKER_MAX_DELIVER") {
            cmd.env("CYRENE_WORKER_MAX_DELIVER", max_deliver);
        }
        if let Ok(ack_wait) = std::env::var("CHAOS_WORKER_ACK_WAIT") {
            cmd.env("CYRENE_WORKER_ACK_WAIT", ack_wait);
        }
        for (key, value) in extra_env("CHAOS_WORKER_ENV") {
            cmd.env(key, value);
        }
        let child = cmd.spawn().unwrap();
        let pid = child.id().unwrap_or_default();
        let inbox = self.learn_worker_inbox().await;
        if inbox.is_none() {
            self.note(format!(
                "worker {n} (pid {pid}): inbox not learnt; its kills are not timed"
            ));
        }
        procs.workers.push(WorkerProc {
            n,
            pid,
            inbox,
            child,
        });
        n
    }

    /// Waits (bounded) for a loop worker connection with an inbox not seen before.
    async fn learn_worker_inbox(&self) -> Option<String> {
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            let connections = {
                let bus = self.bus.lock().unwrap();
                worker_inboxes(&bus)
            };
            {
                // A new worker is a connection none of whose inboxes is known yet (a known
                // worker's stream inbox appears later, beside its request inbox).
                let mut known = self.known_inboxes.lock().unwrap();
                if let Some(new) = connections
                    .into_iter()
                    .find(|c| !c.is_empty() && c.iter().all(|i| !known.contains(i)))
                {
                    known.extend(new.iter().cloned());
                    return new.into_iter().next();
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Number of loop workers running.
    pub async fn workers(&self) -> usize {
        self.procs.lock().await.workers.len()
    }

    /// SIGKILLs a worker: the `pick`-th (modulo their number) of those that sent a model
    /// request in the last second (so the kill lands mid-turn), else of all; returns the kill.
    pub async fn kill_worker(&self, pick: usize) -> Option<WorkerKill> {
        let mut procs = self.procs.lock().await;
        if procs.workers.is_empty() {
            return None;
        }
        let busy: BTreeSet<String> = {
            let log = self.wire.log.lock().unwrap();
            let since = Instant::now() - Duration::from_secs(1);
            log.model_requests
                .iter()
                .rev()
                .take_while(|r| r.at >= since)
                .map(|r| r.inbox.clone())
                .collect()
        };
        let connections = {
            let bus = self.bus.lock().unwrap();
            worker_inboxes(&bus)
        };
        // Every inbox of a worker's connection (request inbox first, stream inbox beside it).
        let inboxes_of = |inbox: &Option<String>| -> Vec<String> {
            let Some(inbox) = inbox else {
                return Vec::new();
            };
            connections
                .iter()
                .find(|c| c.contains(inbox))
                .cloned()
                .unwrap_or_else(|| vec![inbox.clone()])
        };
        let candidates: Vec<usize> = (0..procs.workers.len())
            .filter(|i| {
                inboxes_of(&procs.workers[*i].inbox)
                    .iter()
                    .any(|inbox| busy.contains(inbox))
            })
            .collect();
        let index = if candidates.is_empty() {
            pick % procs.workers.len()
        } else {
            candidates[pick % candidates.len()]
        };
        let mut worker = procs.workers.remove(index);
        let also: Vec<String> = inboxes_of(&worker.inbox)
            .into_iter()
            .filter(|i| Some(i) != worker.inbox.as_ref())
            .collect();
        let _ = worker.child.start_kill();
        let at = Instant::now();
        let _ = worker.child.wait().await;
        let kill = WorkerKill {
            at,
            n: worker.n,
            pid: worker.pid,
            inbox: worker.inbox.clone(),
            also,
        };
        self.kills.lock().unwrap().push(kill.clone());
        Some(kill)
    }

    /// Kills nats-server (single node), keeps it down for `outage`, starts it on the same port
    /// and store directory.
    pub async fn restart_nats(&self, outage: Duration) {
        let bus = self.bus.clone();
        tokio::task::spawn_blocking(move || {
            let mut bus = bus.lock().unwrap();
            if let Bus::Single(server) = &mut *bus {
                server.kill();
                std::thread::sleep(outage);
                server.start_again();
            }
        })
        .await
        .unwrap();
    }

    /// Kills cluster node `i`, keeps it down for `outage`, restarts it and waits for the cluster.
    pub async fn restart_node(&self, i: usize, outage: Duration) {
        let bus = self.bus.clone();
        tokio::task::spawn_blocking(move || {
            let mut bus = bus.lock().unwrap();
            if let Bus::Cluster(cluster) = &mut *bus {
                cluster.node_mut(i).kill();
                std::thread::sleep(outage);
                cluster.restart_node(i);
            }
        })
        .await
        .unwrap();
    }

    /// Waits (bounded, never failing) until a micro service answers `$SRV.PING`.
    pub async fn wait_for_service(&self, name: &str) -> bool {
        let answered = cyrene_bus::discovery::wait_for(
            &self.client,
            name,
            Duration::from_secs(30),
            Duration::from_millis(300),
        )
        .await;
        if answered {
            return true;
        }
        self.note(format!("{name} did not answer $SRV.PING within 30 s"));
        false
    }

    /// Sends until acknowledged or `give_up` passes (idempotent by key: a resend after a lost
    /// ack gets the first ack back).
    pub async fn send(&self, request: &SendRequest, give_up: Duration) -> Option<SendAck> {
        crate::common::send_until_acked(&self.client, request, give_up)
            .await
            .ok()
    }

    /// A session's transcript (bounded retries; `None` when it cannot be read).
    pub async fn history(&self, session: &str) -> Option<Vec<HistoryEntry>> {
        let request = HistoryRequest {
            session_id: session.to_owned(),
            limit: Some(1000),
            before_seq: None,
        };
        for _ in 0..10 {
            let got: Result<HistoryResponse, _> = request_json(
                &self.client,
                subjects::SESSION_HISTORY,
                &request,
                Duration::from_secs(5),
            )
            .await;
            if let Ok(h) = got {
                return Some(h.messages);
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        None
    }
}

/// A user message request.
pub fn send_request(
    session: &str,
    text: &str,
    client: &str,
    key: &str,
    parallel: bool,
) -> SendRequest {
    SendRequest {
        session_id: session.to_owned(),
        message: Message::text(Role::User, text),
        client_id: client.to_owned(),
        idempotency_key: key.to_owned(),
        env: None,
        parallel,
        when_busy: None,
        persona: String::new(),
        context_only: false,
    }
}

/// Inboxes of the loop worker connections on every running node (`/connz`).
fn worker_inboxes(bus: &Bus) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    for node in bus.nodes() {
        for subs in node.subscriptions() {
            let mut inboxes: Vec<String> = subs
                .iter()
                .filter(|sub| sub.starts_with(WORKER_INBOX_PREFIX))
                .filter_map(|sub| sub.strip_suffix(".*"))
                .map(str::to_owned)
                .collect();
            inboxes.sort();
            if !inboxes.is_empty() {
                found.push(inboxes);
            }
        }
    }
    found
}

/// `name`'s value, or `default`.
pub fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// `K=V,K=V` pairs from the environment variable `name`.
fn extra_env(name: &str) -> Vec<(String, String)> {
    std::env::var(name)
        .unwrap_or_default()
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// The machine's PostgreSQL cluster, when the tests use it and this process may restart it.
#[derive(Debug, Clone)]
pub struct LocalPostgres {
    version: String,
}

impl LocalPostgres {
    /// The local cluster `main` (Debian's `pg_ctlcluster`), when the test database is local.
    pub fn find() -> Option<LocalPostgres> {
        let admin = cyrene_sql::testing::admin_url();
        if !(admin.contains("@127.0.0.1:5432/") || admin.contains("@localhost:5432/")) {
            return None;
        }
        let mut versions: Vec<String> = std::fs::read_dir("/etc/postgresql")
            .ok()?
            .filter_map(|e| e.ok())
            .filter(|e| e.path().join("main").is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        versions.sort_by_key(|v| v.parse::<u32>().unwrap_or(0));
        let version = versions.pop()?;
        std::process::Command::new("pg_ctlcluster")
            .arg("--help")
            .output()
            .ok()?;
        Some(LocalPostgres { version })
    }

    fn ctl(&self, action: &str) -> bool {
        std::process::Command::new("pg_ctlcluster")
            .args(["--skip-systemctl-redirect", &self.version, "main", action])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success() || (action == "start" && s.code() == Some(2)))
    }

    pub fn stop(&self) -> bool {
        self.ctl("stop")
    }

    /// Starts the cluster (a no-op when it runs) and waits (bounded) until it takes connections.
    pub fn start(&self) -> bool {
        let started = self.ctl("start");
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if std::net::TcpStream::connect("127.0.0.1:5432").is_ok() {
                return started;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

/// Starts the local PostgreSQL again when dropped, whatever happened (also on a panic).
#[derive(Debug)]
pub struct PostgresGuard(pub Option<LocalPostgres>);

impl Drop for PostgresGuard {
    fn drop(&mut self) {
        if let Some(pg) = &self.0
            && !pg.start()
        {
            eprintln!("chaos: could not start PostgreSQL again; run scripts/postgres.sh");
        }
    }
}
