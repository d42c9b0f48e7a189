//! `make bench`: what one durable step of a turn costs, with all four real services.
//!
//! A real nats-server; the real gateway (its scripted provider: no network model), the real
//! checkpoint store and the real orchestrator — both on the same database, PostgreSQL or SQLite —
//! and the real loop worker; a no-op tool (`current_time`, built in). Turns are started the way a
//! client starts them (`cyrene.session.send`), so every boundary's input comes from the real
//! orchestrator (the first by `cyrene.turn.steer`, the later ones pushed) and every step is
//! checkpointed. Per step = the time between two consecutive `step` events of one turn (five tool
//! rounds, then the answer). The window is the session's transcript, filled beforehand to the size
//! of the case; each case has its own services and database, and the cases take turns one turn
//! at a time, so the windows are measured side by side (docs/loop-worker.md, "Where a step's time
//! goes").
#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench that cannot run should stop loudly

#[path = "../tests/common/mod.rs"]
mod common;

use common::{wait_for_service, worker_config};
use cyrene::stack::Stack;
use cyrene_bus::request_json;
use cyrene_protocol::message::{Message, Role};
use cyrene_protocol::model::{ModelRequest, ViewRef};
use cyrene_protocol::subjects;
use cyrene_test_support::NatsServer;
use cyrene_test_support::cost;
use futures::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

// The services' allocator, as in their binaries.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const ROUNDS: usize = 5;
const TURNS_PER_CASE: usize = 60;
const THROUGHPUT_TURNS: usize = 300;

/// The throughput case's measured turns: [`THROUGHPUT_TURNS`], or `LOOP_BENCH_TURNS` (a longer
/// run to profile, so that the measured turns outweigh the setup).
fn throughput_turns() -> usize {
    std::env::var("LOOP_BENCH_TURNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(THROUGHPUT_TURNS)
}
const WINDOWS: [usize; 3] = [10, 200, 1000];
/// Five-round turns/s on PostgreSQL when issue 37 was filed (150–200 on this machine): its
/// target is 2.5× that.
const TURNS_PER_S_WHEN_FILED: f64 = 175.0;
/// The durable writes a five-step turn cannot do without: its message, five checkpoints and
/// its completion.
const DURABLE_WRITES_PER_TURN: f64 = 7.0;

/// All four services in this process on one bus and one database.
struct Real {
    /// Stops the services when dropped (first: before the server goes).
    _stack: Stack,
    server: NatsServer,
    client: async_nats::Client,
    data: tempfile::TempDir,
}

impl Real {
    /// `database_url` None = each service's default SQLite file in a temp dir.
    async fn start(database_url: Option<String>, window: usize, worker: bool) -> Real {
        let server = NatsServer::start();
        let client = server.connect().await;
        let data = tempfile::tempdir().unwrap();
        // The gateway's request log is not taken: a log nobody watches copies nothing.
        let stack = Stack::builder(common::bus_config(&server), data.path())
            .models(common::models(common::tool_rounds_rules(ROUNDS)))
            .database_url(database_url)
            .orchestrator_with(|orchestrator| {
                orchestrator.window = window;
                orchestrator.max_steps = ROUNDS as u32 + 2;
                // LOOP_BENCH_EXTRACTION=off: no memory extraction after each turn's answer (it
                // reads the window and calls the model beside the next turn's steps).
                if std::env::var("LOOP_BENCH_EXTRACTION").is_ok_and(|v| v == "off") {
                    for persona in &mut orchestrator.personas.personas {
                        persona.memory_extraction = Some(false);
                    }
                }
            })
            .workers(
                usize::from(worker),
                cyrene_loop_worker::Config {
                    concurrency: 16,
                    ..worker_config()
                },
            )
            .start()
            .await
            .unwrap();
        common::wait_for_stack(&stack, &client).await;
        Real {
            _stack: stack,
            server,
            client,
            data,
        }
    }

    /// Sends `text` and waits for its turn to end; returns the instants of its `step` events.
    async fn turn(&self, session: &str, text: &str) -> Vec<Instant> {
        let within = Duration::from_secs(60);
        common::turn_steps(&self.client, session, text, "bench", within).await
    }

    /// Fills `session`'s transcript to `messages` messages (one-step turns: the default reply).
    async fn fill(&self, session: &str, messages: usize) {
        for i in 0..messages / 2 {
            self.turn(
                session,
                &format!("earlier message {i} with a few words in it"),
            )
            .await;
        }
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize].as_secs_f64() * 1e3
}

/// One window's case: its own services and database, and one session filled to the window.
struct Case {
    window: usize,
    real: Real,
    session: String,
    /// The PostgreSQL database of this case (dropped with it); `None` on SQLite.
    database: Option<cyrene_sql::testing::TestDatabase>,
    deltas: Vec<Duration>,
}

impl Case {
    async fn start(backend: &str, postgres: bool, window: usize) -> Case {
        // A database per case, so no two cases' services share tables.
        let database = match postgres {
            true => Some(
                common::fresh_postgres(&format!("cyrene_bench_{window}"))
                    .await
                    .expect("PostgreSQL is reachable"),
            ),
            false => None,
        };
        let real = Real::start(database.as_ref().map(|d| d.url.clone()), window, true).await;
        let session = format!("bench-{backend}-{window}");
        real.fill(&session, window).await;
        Case {
            window,
            real,
            session,
            database,
            deltas: Vec::new(),
        }
    }

    /// One five-round turn; its steps' times are kept.
    async fn turn(&mut self) {
        let steps = self.real.turn(&self.session, "run the steps").await;
        self.deltas.extend(steps.windows(2).map(|w| w[1] - w[0]));
    }

    /// p50 and p99 per step, and how many steps.
    fn per_step(&mut self) -> (f64, f64, usize) {
        self.deltas.sort();
        (
            pct(&self.deltas, 0.5),
            pct(&self.deltas, 0.99),
            self.deltas.len(),
        )
    }
}

/// What the store wrote for `owner`: (average bytes of a step's row, average bytes of a turn's
/// base, rows).
async fn bytes_written(database: &Database, owner: &str) -> (f64, f64, i64) {
    match database {
        Database::Postgres(url) => {
            let pool = sqlx::PgPool::connect(url).await.unwrap();
            let (row, count): (Option<f64>, i64) = sqlx::query_as(
                "SELECT AVG(OCTET_LENGTH(state::text))::float8, COUNT(*) FROM checkpoints \
                 WHERE agent_id = $1",
            )
            .bind(owner)
            .fetch_one(&pool)
            .await
            .unwrap();
            let (base,): (Option<f64>,) = sqlx::query_as(
                "SELECT AVG(OCTET_LENGTH(state::text))::float8 FROM checkpoint_bases \
                 WHERE agent_id = $1",
            )
            .bind(owner)
            .fetch_one(&pool)
            .await
            .unwrap();
            (row.unwrap_or(0.0), base.unwrap_or(0.0), count)
        }
        Database::Sqlite(path) => {
            let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", path.display()))
                .await
                .unwrap();
            let (row, count): (Option<f64>, i64) = sqlx::query_as(
                "SELECT AVG(LENGTH(CAST(state AS BLOB))), COUNT(*) FROM checkpoints \
                 WHERE agent_id = ?1",
            )
            .bind(owner)
            .fetch_one(&pool)
            .await
            .unwrap();
            let (base,): (Option<f64>,) = sqlx::query_as(
                "SELECT AVG(LENGTH(CAST(state AS BLOB))) FROM checkpoint_bases WHERE agent_id = ?1",
            )
            .bind(owner)
            .fetch_one(&pool)
            .await
            .unwrap();
            (row.unwrap_or(0.0), base.unwrap_or(0.0), count)
        }
    }
}

enum Database {
    Postgres(String),
    Sqlite(std::path::PathBuf),
}

/// Five-round turns per second on fresh sessions, `workers` worker processes, and where the CPU
/// of the measured turns went.
async fn throughput(url: Option<String>, workers: usize) -> (f64, TurnCost) {
    let real = Real::start(url, 10, false).await;
    let mut children = Vec::new();
    for _ in 0..workers {
        children.push(
            tokio::process::Command::new(common::workspace_binary("cyrene-loop-worker"))
                .env("NATS_URL", real.server.url())
                .env("RUST_LOG", "error")
                .env("CYRENE_WORKER_CONCURRENCY", "32")
                .kill_on_drop(true)
                .spawn()
                .unwrap(),
        );
    }
    wait_for_service(&real.client, "cyrene-loop-worker").await;
    let run = |tag: &'static str, n: usize| {
        let real = &real;
        async move {
            let turns = (0..n).map(|i| async move {
                real.turn(&format!("tp-{tag}-{workers}-{i}"), "run the steps")
                    .await
            });
            futures::future::join_all(turns).await;
        }
    };
    run("warm", workers * 16).await;
    let worker_pids: Vec<u32> = children.iter().filter_map(|c| c.id()).collect();
    let nats_pid = real.server.pid();
    let sample = || Usage::now(nats_pid, &worker_pids, &real.server);
    let before = sample();
    let start = Instant::now();
    let turns = throughput_turns();
    run("tp", turns).await;
    let rate = turns as f64 / start.elapsed().as_secs_f64();
    let cost = sample().since(&before, turns);
    drop(children);
    (rate, cost)
}

/// CPU time used so far (clock ticks, 100 a second) by each process the bench counts, and the
/// bus's message counters. Linux only (`/proc`); elsewhere every figure stays 0.
///
/// Kept per process, not summed: a process that exits between two samples (a backend of an
/// earlier case's pool closing while this case runs) would otherwise take all the CPU it ever
/// used out of the difference, and a case would be credited with less than it used.
#[derive(Debug, Default, Clone)]
struct Usage {
    /// pid → who it is and its ticks so far.
    processes: std::collections::BTreeMap<u32, (Who, u64)>,
    /// The whole machine: every tick that was not idle.
    machine: u64,
    /// Messages into and out of the bus (`/varz`).
    bus_in: u64,
    bus_out: u64,
}

/// Whose CPU a process's is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    /// A `postgres` process of the bench (the backends of both services' pools, the WAL
    /// writer, …).
    Postgres,
    /// This case's nats-server.
    Nats,
    /// The loop worker processes.
    Workers,
    /// This process: the gateway, the checkpoint store, the orchestrator and the bench's clients.
    This,
}

/// A turn's share of a [`Usage`] difference, in ms of CPU (messages for the bus).
#[derive(Debug, Default, Clone, Copy)]
struct TurnCost {
    postgres: f64,
    nats: f64,
    workers: f64,
    this: f64,
    machine: f64,
    bus_in: f64,
    bus_out: f64,
}

impl TurnCost {
    /// The CPU of the bench's own processes (PostgreSQL, nats-server, the workers, this one).
    fn ours(&self) -> f64 {
        self.postgres + self.nats + self.workers + self.this
    }
}

impl Usage {
    fn now(nats: Option<u32>, workers: &[u32], server: &NatsServer) -> Usage {
        let me = std::process::id();
        let mut usage = Usage::default();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|p| p.parse::<u32>().ok())
            else {
                continue;
            };
            let Some((comm, ticks)) = process_ticks(pid) else {
                continue;
            };
            let who = if pid == me {
                Who::This
            } else if Some(pid) == nats {
                Who::Nats
            } else if workers.contains(&pid) {
                Who::Workers
            } else if comm == "postgres" && bench_postgres(pid) {
                Who::Postgres
            } else {
                continue;
            };
            usage.processes.insert(pid, (who, ticks));
        }
        usage.machine = machine_busy_ticks();
        if let Some(varz) = server.monitor_json("/varz") {
            usage.bus_in = varz["in_msgs"].as_u64().unwrap_or(0);
            usage.bus_out = varz["out_msgs"].as_u64().unwrap_or(0);
        }
        usage
    }

    /// What `who`'s processes used since `before`: each process alive now, less what it had
    /// used at `before` (nothing if it started since). A process gone since is left out whole.
    fn ticks_since(&self, before: &Usage, who: Who) -> u64 {
        self.processes
            .iter()
            .filter(|(_, (w, _))| *w == who)
            .map(|(pid, (_, ticks))| {
                let earlier = match before.processes.get(pid) {
                    Some((w, t)) if *w == who => *t,
                    _ => 0,
                };
                ticks.saturating_sub(earlier)
            })
            .sum()
    }

    fn since(&self, before: &Usage, turns: usize) -> TurnCost {
        let ms = |ticks: u64| ticks as f64 * 10.0 / turns as f64;
        let n = |after: u64, before: u64| after.saturating_sub(before) as f64 / turns as f64;
        TurnCost {
            postgres: ms(self.ticks_since(before, Who::Postgres)),
            nats: ms(self.ticks_since(before, Who::Nats)),
            workers: ms(self.ticks_since(before, Who::Workers)),
            this: ms(self.ticks_since(before, Who::This)),
            machine: ms(self.machine.saturating_sub(before.machine)),
            bus_in: n(self.bus_in, before.bus_in),
            bus_out: n(self.bus_out, before.bus_out),
        }
    }
}

/// Whether a `postgres` process works for this bench: a backend serving one of its databases
/// (`cyrene_bench…`), or a server process serving every database (WAL writer, checkpointer, …).
/// Backends of other databases belong to whoever else uses the shared server.
fn bench_postgres(pid: u32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let cmdline = String::from_utf8_lossy(&cmdline);
    let backend = cmdline.contains("127.0.0.1(") || cmdline.contains("[local]");
    !backend || cmdline.contains("cyrene_bench")
}

/// A process's name and its user + system ticks so far (`/proc/<pid>/stat`, every thread).
fn process_ticks(pid: u32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let comm = stat.get(stat.find('(')? + 1..stat.rfind(')')?)?.to_owned();
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((comm, utime + stime))
}

/// The machine's busy ticks so far, over all cores (`/proc/stat`: all but idle and iowait).
fn machine_busy_ticks() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    let Some(line) = stat.lines().next() else {
        return 0;
    };
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .filter_map(|t| t.parse().ok())
        .collect();
    let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
    ticks.iter().sum::<u64>().saturating_sub(idle)
}

/// The bus's own CPU cost: CPU per echo request/reply (requester, nats-server and responder
/// together: this process and the floors' nats-server) with 64 in flight, in ms.
async fn nats_echo_cpu(floors: &Floors) -> f64 {
    const N: usize = 20_000;
    let nats = floors.server.pid();
    let before = Usage::now(nats, &[], &floors.server);
    futures::stream::iter(0..N)
        .for_each_concurrent(64, |_| async {
            floors
                .client
                .request("bench.echo", vec![b'x'; 200].into())
                .await
                .unwrap();
        })
        .await;
    let used = Usage::now(nats, &[], &floors.server).since(&before, N);
    used.nats + used.this
}

/// The CPU of one small upsert commit on PostgreSQL (client and server together: this process
/// and the bench's PostgreSQL processes), 4 in flight, in ms.
async fn pg_commit_cpu(floors: &Floors) -> Option<f64> {
    const N: usize = 3_000;
    let pg = floors.pg.as_ref()?;
    let before = Usage::now(None, &[], &floors.server);
    futures::stream::iter(0..N)
        .for_each_concurrent(4, |i| async move {
            sqlx::query(
                "INSERT INTO bench_floor (id, state) VALUES ($1, $2) \
                 ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state",
            )
            .bind(format!("cpu-{}", i % 500))
            .bind("{\"step\":1}")
            .execute(pg)
            .await
            .unwrap();
        })
        .await;
    let used = Usage::now(None, &[], &floors.server).since(&before, N);
    Some(used.postgres + used.this)
}

/// The floors under a durable step: a NATS request/reply round trip with an echo responder, one
/// small upsert committed on PostgreSQL, and one on SQLite opened as the checkpoint store opens
/// its file (WAL, `synchronous = NORMAL`: a commit is written, not synced). Sampled once at the
/// start, and again between the steps cases' turns, so a step is compared with the floors of the
/// same minutes (this machine's speed drifts by 2× within them).
struct Floors {
    server: NatsServer,
    client: async_nats::Client,
    pg: Option<sqlx::PgPool>,
    sqlite: sqlx::SqlitePool,
    _dir: tempfile::TempDir,
    runs: usize,
    echo: Vec<Duration>,
    pg_commit: Vec<Duration>,
    sqlite_commit: Vec<Duration>,
}

/// The p50s of the floors sampled since the last [`Floors::take`], in ms.
struct FloorFigures {
    echo: f64,
    pg_commit: Option<f64>,
    sqlite_commit: f64,
}

impl FloorFigures {
    /// A durable step contains its checkpoint save, a request/reply to the store and a commit:
    /// no step is faster than the two floors together.
    fn step(&self, backend: &str) -> f64 {
        self.echo
            + match backend {
                "postgres" => self.pg_commit.unwrap_or_default(),
                _ => self.sqlite_commit,
            }
    }
}

const FLOOR_TABLE: &str =
    "CREATE TABLE IF NOT EXISTS bench_floor (id TEXT PRIMARY KEY, state TEXT)";

impl Floors {
    async fn start(pg_url: Option<&str>) -> Floors {
        let server = NatsServer::start();
        let client = server.connect().await;
        let responder = server.connect().await;
        let mut sub = responder.subscribe("bench.echo").await.unwrap();
        responder.flush().await.unwrap();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(reply) = m.reply {
                    let _ = responder.publish(reply, m.payload).await;
                }
            }
        });
        // The responder's interest can reach the client's side of the server a moment after its
        // flush (once seen: `no responders` on the very first request); wait for it.
        for _ in 0..100 {
            if client.request("bench.echo", "x".into()).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Pools like the checkpoint store's: no ping before a connection is handed out (sqlx's
        // default pings, one more round trip under every commit), and SQLite's commits on one
        // connection, as the store's writes are (crate docs of cyrene-checkpoint-store). Connected
        // as the services connect: in plain text unless the URL asks for TLS
        // (`cyrene_sql::without_implicit_tls`; libpq's default negotiates TLS with a server that
        // offers it, and a commit through TLS costs more than the services pay).
        let pg = match pg_url {
            Some(url) => Some(
                sqlx::postgres::PgPoolOptions::new()
                    .test_before_acquire(false)
                    .connect(&cyrene_sql::without_implicit_tls(url))
                    .await
                    .unwrap(),
            ),
            None => None,
        };
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("floor.db").display());
        let options = cyrene_sql::SqliteSettings::CHECKPOINTS
            .connect_options(&url)
            .unwrap();
        let sqlite = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::query(FLOOR_TABLE).execute(&sqlite).await.unwrap();
        if let Some(pg) = &pg {
            sqlx::query(FLOOR_TABLE).execute(pg).await.unwrap();
        }
        Floors {
            server,
            client,
            pg,
            sqlite,
            _dir: dir,
            runs: 0,
            echo: Vec::new(),
            pg_commit: Vec::new(),
            sqlite_commit: Vec::new(),
        }
    }

    /// `n` of each floor, kept for the next [`Floors::take`].
    async fn sample(&mut self, n: usize) {
        for _ in 0..n {
            self.runs += 1;
            let row = format!("row-{}", self.runs % 50);
            let start = Instant::now();
            self.client
                .request("bench.echo", vec![b'x'; 200].into())
                .await
                .unwrap();
            self.echo.push(start.elapsed());
            if let Some(pg) = &self.pg {
                let start = Instant::now();
                sqlx::query(
                    "INSERT INTO bench_floor (id, state) VALUES ($1, $2) \
                     ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state",
                )
                .bind(&row)
                .bind("{\"step\":1}")
                .execute(pg)
                .await
                .unwrap();
                self.pg_commit.push(start.elapsed());
            }
            let start = Instant::now();
            sqlx::query(
                "INSERT INTO bench_floor (id, state) VALUES (?1, ?2) \
                 ON CONFLICT (id) DO UPDATE SET state = excluded.state",
            )
            .bind(&row)
            .bind("{\"step\":1}")
            .execute(&self.sqlite)
            .await
            .unwrap();
            self.sqlite_commit.push(start.elapsed());
        }
    }

    /// The p50s of what was sampled since the last call; starts afresh.
    fn take(&mut self) -> FloorFigures {
        let p50 = |samples: &mut Vec<Duration>| {
            samples.sort();
            let p50 = pct(samples, 0.5);
            samples.clear();
            p50
        };
        FloorFigures {
            echo: p50(&mut self.echo),
            pg_commit: self.pg.is_some().then(|| p50(&mut self.pg_commit)),
            sqlite_commit: p50(&mut self.sqlite_commit),
        }
    }
}

/// How long a request on `subject` takes until its `R` reply is decoded (at most 10 s).
async fn timed_request<R: serde::de::DeserializeOwned>(
    client: &async_nats::Client,
    subject: &str,
    body: &impl serde::Serialize,
) -> Duration {
    let start = Instant::now();
    let _: R = request_json(client, subject, body, Duration::from_secs(10))
        .await
        .unwrap();
    start.elapsed()
}

/// Beside each per-step figure, its two parts measured alone through the same real services:
/// a step's fenced checkpoint save (NATS + store + database) and a step's model call with a view
/// of the window's size (NATS + gateway, scripted provider), plain, streamed, and streamed
/// continuing a view the gateway holds (two new messages a call, as a step adds; the view is sent
/// whole again, untimed, every 20 calls so it stays near the window's size). The save and the
/// call run side by side in a step, so a step costs about the larger of the two.
async fn step_parts(real: &Real, window: usize) -> (f64, f64, f64, f64) {
    let owner = format!("parts-{window}");
    let turn = format!("t-parts-{window}");
    let delta = json!({"step": 1, "from": window, "stop_reason": "tool_calls", "turn_id": turn,
        "messages": [{"role": "assistant", "content": [{"type": "tool_call", "id": "c1",
            "name": "current_time", "arguments": "{}"}]},
            {"role": "tool", "tool_call_id": "c1", "name": "current_time",
             "content": [{"type": "text", "text": "2026-12-01T18:00:00Z"}]}]});
    let mut saves = Vec::new();
    for step in 1..=400u32 {
        let checkpoint = cyrene_protocol::checkpoint::Checkpoint {
            id: cyrene_protocol::checkpoint::checkpoint_id(&owner, Some(&turn), step),
            agent_id: owner.clone(),
            step,
            state: serde_json::from_value(delta.clone()).unwrap(),
            turn_id: Some(turn.clone()),
            attempt: Some(1),
            base: (step == 1).then(|| serde_json::from_value(json!({"messages": []})).unwrap()),
            created_at: None,
            updated_at: None,
        };
        let save = timed_request::<cyrene_protocol::checkpoint::Checkpoint>(
            &real.client,
            subjects::CHECKPOINT_SAVE,
            &checkpoint,
        )
        .await;
        if step > 50 {
            saves.push(save);
        }
    }
    let messages: Vec<Message> = (0..window)
        .map(|i| match i % 2 {
            0 => Message::text(
                Role::User,
                format!("earlier message {i} with a few words in it"),
            ),
            _ => Message::text(Role::Assistant, "a default reply of a few words"),
        })
        .chain(std::iter::once(Message::text(Role::User, "hello")))
        .collect();
    let request = ModelRequest {
        messages,
        purpose: "chat".to_owned(),
        ..Default::default()
    };
    // Streamed the way the worker streams: through one shared reply subscription.
    let inbox = cyrene_model_client::StreamInbox::new(real.client.clone());
    let (mut plain, mut streamed) = (Vec::new(), Vec::new());
    for i in 0..400 {
        let call = timed_request::<cyrene_protocol::model::ModelResponse>(
            &real.client,
            subjects::MODEL_COMPLETE,
            &request,
        )
        .await;
        let start = Instant::now();
        inbox
            .complete_stream(&request, Duration::from_secs(10), |_, _| {})
            .await
            .unwrap();
        if i >= 50 {
            plain.push(call);
            streamed.push(start.elapsed());
        }
    }
    let id = cyrene_protocol::ids::new_id();
    let view = |base: usize| {
        Some(ViewRef {
            id: id.clone(),
            base: base as u32,
        })
    };
    let (mut continued, mut held) = (Vec::new(), (String::new(), 0));
    for i in 0..400 {
        if i % 20 == 0 {
            let whole = ModelRequest {
                view: view(0),
                ..request.clone()
            };
            let (_, replica) = inbox
                .complete_stream_at(
                    subjects::MODEL_COMPLETE_STREAM,
                    &whole,
                    Duration::from_secs(10),
                    |_, _| {},
                )
                .await
                .unwrap();
            held = (
                subjects::model_complete_stream_at(&replica.unwrap()),
                whole.messages.len(),
            );
            continue;
        }
        let step = ModelRequest {
            messages: vec![
                Message::text(Role::Assistant, "a default reply of a few words"),
                Message::text(Role::User, "hello"),
            ],
            purpose: "chat".to_owned(),
            view: view(held.1),
            ..Default::default()
        };
        let start = Instant::now();
        inbox
            .complete_stream_at(&held.0, &step, Duration::from_secs(10), |_, _| {})
            .await
            .unwrap();
        if i >= 50 {
            continued.push(start.elapsed());
        }
        held.1 += 2;
    }
    for times in [&mut saves, &mut plain, &mut streamed, &mut continued] {
        times.sort();
    }
    (
        pct(&saves, 0.5),
        pct(&plain, 0.5),
        pct(&streamed, 0.5),
        pct(&continued, 0.5),
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "loop worker: per durable step, all four real services (scripted model through the real \
         gateway, no-op tool, real orchestrator steer, checkpoint every step)"
    );
    let pg = common::fresh_postgres("cyrene_bench").await;
    let mut floors = Floors::start(pg.as_ref().map(|db| db.url.as_str())).await;
    floors.sample(500).await; // warm-up
    floors.take();
    floors.sample(3000).await;
    let at_start = floors.take();
    let echo_cpu = nats_echo_cpu(&floors).await;
    let commit_cpu = pg_commit_cpu(&floors).await;
    println!(
        "  floor: NATS request/reply echo p50 {:.3} ms; its CPU, 64 in flight: {:.0} µs a \
         request/reply (requester, nats-server and responder together)",
        at_start.echo,
        echo_cpu * 1000.0
    );
    if let Some(commit) = at_start.pg_commit {
        println!(
            "  floor: one PostgreSQL upsert commit p50 {commit:.3} ms; its CPU, 4 in flight: {:.0} \
             µs (client and server together)",
            commit_cpu.unwrap_or_default() * 1000.0
        );
    }
    let mut cost_rows = Vec::new();
    println!(
        "  floor: one SQLite upsert commit p50 {:.3} ms (WAL, synchronous = NORMAL, as the \
         checkpoint store opens its file)",
        at_start.sqlite_commit
    );
    let mut backends: Vec<(&str, Option<String>)> = vec![("sqlite", None)];
    match &pg {
        Some(db) => backends.insert(0, ("postgres", Some(db.url.clone()))),
        None => println!("  (PostgreSQL at 127.0.0.1:5432 unreachable: skipped)"),
    }
    // LOOP_BENCH_ONLY narrows a run while profiling: `postgres`, `sqlite`, `10`, `200`, `1000`,
    // `steps`, `throughput` (any of them, comma-separated); unset runs everything.
    // LOOP_BENCH_EXTRACTION=off turns memory extraction off (see `Real::start`).
    // LOOP_BENCH_TURNS=3000 runs the throughput case longer (see `throughput_turns`).
    let only = std::env::var("LOOP_BENCH_ONLY").unwrap_or_default();
    let picked = |what: &str| only.is_empty() || only.split(',').any(|o| o == what);
    let any_picked = |all: &[&str]| all.iter().any(|w| only.split(',').any(|o| o == *w));
    backends.retain(|(name, _)| !any_picked(&["postgres", "sqlite"]) || picked(name));
    let windows: Vec<usize> = if any_picked(&["10", "200", "1000"]) {
        WINDOWS
            .into_iter()
            .filter(|w| picked(&w.to_string()))
            .collect()
    } else {
        WINDOWS.to_vec()
    };
    let parts = |part: &str| !any_picked(&["steps", "throughput"]) || picked(part);
    for (name, url) in backends.iter().filter(|_| parts("steps")) {
        let mut cases = Vec::new();
        for &window in &windows {
            cases.push(Case::start(name, url.is_some(), window).await);
        }
        // The cases take turns, one turn each, so a change in the machine's speed during the
        // run (its floors have doubled from one hour to the next) weighs on every window alike.
        for _ in 0..TURNS_PER_CASE {
            for case in &mut cases {
                case.turn().await;
            }
            floors.sample(20).await;
        }
        let beside = floors.take();
        let mut at_ten = None;
        for case in &mut cases {
            let window = case.window;
            let (p50, p99, n) = case.per_step();
            let database = match &case.database {
                Some(db) => Database::Postgres(db.url.clone()),
                None => Database::Sqlite(case.real.data.path().join("checkpoints.db")),
            };
            let (row, base, rows) = bytes_written(&database, &case.session).await;
            let mut above_floor = |key: &'static str, margin: f64| {
                let floor = beside.step(name);
                let target = floor + margin;
                cost_rows.push(cost::Row::new(
                    key,
                    format!("{name} durable step p50, window 10 (real stack)"),
                    format!("{p50:.3} ms"),
                    format!("echo + commit {floor:.3} ms (sampled between these turns)"),
                    format!("≤ floor + {margin} ms = {target:.3} ms"),
                    p50 <= target,
                ));
                format!(
                    "  target ≤ floor + {margin} ms = {target:.3} ms: {} (floor for a durable \
                     step, echo + commit, sampled between these turns: {floor:.3} ms)",
                    met(p50 <= target)
                )
            };
            let target = match (*name, window) {
                ("postgres", 10) => above_floor("step_postgres_window_10", 0.25),
                ("sqlite", 10) => above_floor("step_sqlite_window_10", 0.2),
                (_, 1000) => {
                    let ratio = p50 / at_ten.unwrap_or(p50);
                    cost_rows.push(cost::Row::new(
                        match *name {
                            "postgres" => "window_1000_over_10_postgres",
                            _ => "window_1000_over_10_sqlite",
                        },
                        format!("{name} step p50, window 1,000 / window 10 (side by side)"),
                        format!("{ratio:.2}×"),
                        format!("window 10 p50 {:.3} ms", at_ten.unwrap_or(p50)),
                        "≤ 1.1×",
                        ratio <= 1.1,
                    ));
                    format!(
                        "  {ratio:.2}× window 10 (target ≤ 1.1×: {})",
                        met(ratio <= 1.1)
                    )
                }
                _ => String::new(),
            };
            if window == 10 {
                at_ten = Some(p50);
            }
            let (save, plain, streamed, continued) = step_parts(&case.real, window).await;
            println!(
                "  {name:<8} window {window:>4}: p50 {p50:.3} ms  p99 {p99:.3} ms  ({n} steps); \
                 {row:.0} B per step row, base {base:.0} B once per turn ({rows} rows){target}"
            );
            println!(
                "  {:<8} {:>11}  its parts alone: checkpoint save p50 {save:.3} ms, model call \
                 p50 {plain:.3} ms plain / {streamed:.3} ms streamed / {continued:.3} ms \
                 continuing a held view",
                "", ""
            );
        }
    }
    println!(
        "  for scale: LangGraph 1.2 + PostgresSaver, fake model, ~3.8 ms per step (measured on \
         this machine when the issue was filed; not rerun here)"
    );

    println!(
        "loop worker: five-round durable turns/s ({} turns on fresh sessions, \
         all four real services, worker processes)",
        throughput_turns()
    );
    for (name, url) in backends.iter().filter(|_| parts("throughput")) {
        let (one, cost_one) = throughput(url.clone(), 1).await;
        let (two, cost_two) = throughput(url.clone(), 2).await;
        let target = if *name == "postgres" {
            let target = 2.5 * TURNS_PER_S_WHEN_FILED;
            format!(
                "  target ≥ 2.5× {TURNS_PER_S_WHEN_FILED} = {target:.0} turns/s: {}",
                met(one.max(two) >= target)
            )
        } else {
            String::new()
        };
        println!(
            "  {name:<8} 1 worker process: {one:>7.1} turns/s   2 worker processes: {two:>7.1} \
             turns/s ({:.2}× one; 2 cores shared by every process){target}",
            two / one
        );
        for (workers, cost) in [(1, cost_one), (2, cost_two)] {
            if cost.machine <= 0.0 {
                continue;
            }
            // An echo request/reply is two messages in and two out; a turn's messages alone, at
            // that cost, are the bus's floor under the turn.
            let bus_floor = cost.bus_in * echo_cpu / 2.0;
            // SQLite runs inside the store and the orchestrator, so in this process.
            let database = match url {
                Some(_) => format!("PostgreSQL {:.1}, ", cost.postgres),
                None => String::new(),
            };
            println!(
                "  {:<8} {workers} worker process{}: CPU per turn {:.1} ms ({database}\
                 nats-server {:.1}, workers {:.1}, gateway + store + orchestrator + bench clients \
                 {:.1}, rest of the machine {:.1}); 2 cores allow ≤ {:.0} turns/s at that cost. \
                 Bus: {:.0} messages in, {:.0} out per turn, {bus_floor:.1} ms of CPU at the \
                 echo's cost (≤ {:.0} turns/s from the bus alone)",
                "",
                if workers == 1 { "" } else { "es" },
                cost.machine,
                cost.nats,
                cost.workers,
                cost.this,
                (cost.machine - cost.postgres - cost.nats - cost.workers - cost.this).max(0.0),
                2000.0 / cost.machine,
                cost.bus_in,
                cost.bus_out,
                2000.0 / bus_floor,
            );
        }
        if let (true, Some(commit_cpu)) = (*name == "postgres", commit_cpu) {
            // What a turn cannot do without: its durable writes at one commit's CPU each, and
            // its bus messages at the echo's cost.
            let floor = DURABLE_WRITES_PER_TURN * commit_cpu + cost_one.bus_in * echo_cpu / 2.0;
            let ours = cost_one.ours();
            cost_rows.push(cost::Row::new(
                "cpu_per_turn_postgres",
                "CPU per five-step turn, PostgreSQL, every process of the bench (1 worker process)",
                format!("{ours:.1} ms"),
                format!(
                    "{DURABLE_WRITES_PER_TURN} commits + {:.0} bus messages at their floors = \
                     {floor:.1} ms (machine-wide {:.1} ms)",
                    cost_one.bus_in + cost_one.bus_out,
                    cost_one.machine
                ),
                "≤ 4 ms",
                ours <= 4.0,
            ));
            let target = 2.5 * TURNS_PER_S_WHEN_FILED;
            cost_rows.push(cost::Row::new(
                "turns_per_s_postgres",
                "five-step turns/s, PostgreSQL (best of 1 and 2 worker processes)",
                format!("{:.0} turns/s", one.max(two)),
                format!(
                    "2 cores at the floor's CPU would allow {:.0}; at this run's CPU {:.0}",
                    2000.0 / floor,
                    2000.0 / ours
                ),
                format!("≥ 2.5× {TURNS_PER_S_WHEN_FILED} = {target:.0} turns/s"),
                one.max(two) >= target,
            ));
        }
    }
    print!(
        "{}",
        cost::summary("cargo bench -p cyrene --bench loop", &cost_rows)
    );
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}
