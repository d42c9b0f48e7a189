//! What one five-step turn asks of the bus and of PostgreSQL, counted, as `benches/loop.rs` runs
//! its throughput case: the real gateway (scripted model), checkpoint store, orchestrator and loop
//! worker on one nats-server and one PostgreSQL database, turns started with
//! `cyrene.session.send` on fresh sessions, each followed on its session's events, five
//! `current_time` rounds and the answer (docs/performance.md, "Where a turn's messages and
//! statements go").
//!
//! Messages are counted by a `>` subscriber of its own: every message a client or the server
//! publishes, by subject (replies by the subject of the request they answer, session events and
//! stream chunks by kind). Statements are counted from sqlx's own statement log (`sqlx::query`
//! events, the services run in this process), `COMMIT` included; sqlx does not log the `BEGIN` it
//! sends, one more round trip for each of a turn's three transactions. Each test asserts an upper
//! bound per turn on what an earlier build sent more of.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cyrene::stack::Stack;
use cyrene_protocol::subjects;
use cyrene_test_support::NatsServer;
use futures::StreamExt;
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt;

const ROUNDS: usize = 5;

/// Counts by name.
type Counts = Arc<Mutex<BTreeMap<String, u64>>>;

fn bump(counts: &Counts, key: String) {
    *counts.lock().unwrap().entry(key).or_default() += 1;
}

/// Every statement the services send, by its text (whitespace folded, cut at 90 characters).
#[derive(Clone, Default)]
struct Statements(Counts);

#[derive(Default)]
struct StatementText(String);

impl tracing::field::Visit for StatementText {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        // `db.statement` is the whole text when the summary was shortened; else the summary.
        let take = match field.name() {
            "db.statement" => !value.is_empty(),
            "summary" => self.0.is_empty(),
            _ => false,
        };
        if take {
            self.0 = value.to_owned();
        }
    }
    fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Statements {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if event.metadata().target() != "sqlx::query" {
            return;
        }
        let mut text = StatementText::default();
        event.record(&mut text);
        let folded: String = text.0.split_whitespace().collect::<Vec<_>>().join(" ");
        bump(&self.0, folded.chars().take(90).collect());
    }
}

/// The statement counter, installed once for this test binary.
fn statements() -> &'static Statements {
    static STATEMENTS: OnceLock<Statements> = OnceLock::new();
    STATEMENTS.get_or_init(|| {
        let statements = Statements::default();
        let filter = tracing_subscriber::filter::Targets::new()
            .with_target("sqlx::query", tracing::Level::DEBUG);
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::Layer::with_filter(statements.clone(), filter),
        );
        tracing::subscriber::set_global_default(subscriber).unwrap();
        statements
    })
}

/// Every message on the bus, by what it is.
struct Census {
    counts: Counts,
    /// Messages it received so far (its own deliveries, taken out of the server's `out`).
    seen: Arc<std::sync::atomic::AtomicU64>,
}

/// A subject with its ids taken out.
fn shape(subject: &str) -> String {
    let tokens: Vec<&str> = subject.split('.').collect();
    match tokens.as_slice() {
        ["cyrene", "session", _, "events"] => "cyrene.session.<sid>.events".to_owned(),
        ["cyrene", "turn", "input", _] => "cyrene.turn.input.<turn>".to_owned(),
        ["cyrene", "memory", "extract", _] => "cyrene.memory.extract.<turn>".to_owned(),
        ["cyrene", "model", "complete", "stream", _] => {
            "cyrene.model.complete.stream.<replica>".to_owned()
        }
        ["$JS", "ACK", ..] => "$JS.ACK.<stream>.<consumer>…".to_owned(),
        ["_INBOX", ..] => "_INBOX…".to_owned(),
        ["$SRV", verb, ..] => format!("$SRV.{verb}…"),
        _ => subject.to_owned(),
    }
}

/// The kind of a session event or a stream chunk, from its payload.
fn kind(payload: &[u8]) -> Option<String> {
    let value: Value = serde_json::from_slice(payload).ok()?;
    if let Some(kind) = value.get("type").and_then(Value::as_str) {
        return Some(kind.to_owned());
    }
    for field in ["heartbeat", "delta", "done", "error"] {
        if value.get(field).is_some_and(|v| !v.is_null()) {
            return Some(field.to_owned());
        }
    }
    None
}

impl Census {
    async fn start(server: &NatsServer) -> Census {
        let client = server.connect().await;
        let mut all = client.subscribe(">").await.unwrap();
        client.flush().await.unwrap();
        let counts = Counts::default();
        let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let census = Census {
            counts: counts.clone(),
            seen: seen.clone(),
        };
        // Reply subject → the subject of the request it answers.
        let asked: Arc<Mutex<HashMap<String, String>>> = Arc::default();
        tokio::spawn(async move {
            let _client = client;
            while let Some(m) = all.next().await {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let subject = m.subject.as_str();
                let mut key = match asked.lock().unwrap().get(subject) {
                    Some(request) => format!("  reply to {request}"),
                    None => shape(subject),
                };
                if let Some(reply) = &m.reply {
                    asked
                        .lock()
                        .unwrap()
                        .insert(reply.to_string(), shape(subject));
                }
                if (key.ends_with(".events") || key.contains(subjects::MODEL_COMPLETE_STREAM))
                    && let Some(kind) = kind(&m.payload)
                {
                    key = format!("{key} [{kind}]");
                }
                bump(&counts, key);
            }
        });
        census
    }

    fn take(&self) -> BTreeMap<String, u64> {
        std::mem::take(&mut *self.counts.lock().unwrap())
    }
}

struct Real {
    _stack: Stack,
    server: NatsServer,
    client: async_nats::Client,
    _data: tempfile::TempDir,
    _database: cyrene_sql::testing::TestDatabase,
}

impl Real {
    async fn start() -> Real {
        statements();
        let database = common::fresh_postgres("cyrene_turn_cost")
            .await
            .expect("PostgreSQL at 127.0.0.1:5432 (make test starts one)");
        let server = NatsServer::start();
        let client = server.connect().await;
        let data = tempfile::tempdir().unwrap();
        let stack = Stack::builder(common::bus_config(&server), data.path())
            .models(common::models(common::tool_rounds_rules(ROUNDS)))
            .database_url(Some(database.url.clone()))
            .orchestrator_with(|orchestrator| {
                orchestrator.window = 10;
                orchestrator.max_steps = ROUNDS as u32 + 2;
            })
            .workers(
                1,
                cyrene_loop_worker::Config {
                    concurrency: 32,
                    ..Default::default()
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
            _data: data,
            _database: database,
        }
    }

    /// One turn as the bench runs it: follow the session's events, send, wait for `turn_ended`.
    async fn turn(&self, session: &str) {
        let within = Duration::from_secs(60);
        common::turn_steps(&self.client, session, "run the steps", "bench", within).await;
    }

    /// `turns` turns on fresh sessions, `together` at a time.
    async fn turns(&self, tag: &str, turns: usize, together: usize) {
        futures::stream::iter(0..turns)
            .for_each_concurrent(together, |i| async move {
                self.turn(&format!("cost-{tag}-{i}")).await;
            })
            .await;
    }

    fn varz(&self) -> (u64, u64) {
        let varz = self.server.monitor_json("/varz").unwrap();
        (
            varz["in_msgs"].as_u64().unwrap(),
            varz["out_msgs"].as_u64().unwrap(),
        )
    }
}

/// The orchestrator's periodic reads: the dispatch sweeper's and the approvals' deadline sweep.
const SWEEPS: [&str; 2] = [
    "SELECT turn_id, job, resumes FROM orch_turns WHERE dispatched = 0",
    "SELECT turn_id, call_id, session_id, step, tool, arguments, persona, requested_at",
];

/// Per turn: messages by what they are, statements by their text, and the server's totals.
struct PerTurn {
    messages: BTreeMap<String, f64>,
    statements: BTreeMap<String, f64>,
    bus_in: f64,
    bus_out: f64,
}

impl PerTurn {
    fn messages_on(&self, what: &str) -> f64 {
        self.messages
            .iter()
            .filter(|(k, _)| k.contains(what))
            .map(|(_, n)| n)
            .sum()
    }

    fn statements_like(&self, what: &str) -> f64 {
        self.statements
            .iter()
            .filter(|(k, _)| k.starts_with(what))
            .map(|(_, n)| n)
            .sum()
    }

    /// The statements a turn sends, one turn at a time: the sweepers' periodic reads (a few
    /// every second, whatever runs, so more a turn the slower the machine) are left out by
    /// their text, and anything else sent less than once in two turns.
    fn turn_statements(&self) -> f64 {
        self.statements
            .iter()
            .filter(|(text, n)| **n >= 0.5 && !SWEEPS.iter().any(|s| text.starts_with(s)))
            .map(|(_, n)| n)
            .sum()
    }

    /// Pull requests on the JetStream API: each consumer's pulls expire and are sent again
    /// every few seconds whatever runs, so their count a turn grows with the run's length.
    fn pulls(&self) -> f64 {
        self.messages_on("$JS.API.CONSUMER.MSG.NEXT")
    }

    fn print(&self, title: &str) {
        println!("== {title}: per turn");
        println!(
            "bus: {:.1} in, {:.1} out (nats-server /varz, the census's own deliveries taken out)",
            self.bus_in, self.bus_out
        );
        for (k, n) in &self.messages {
            println!("{n:>7.2}  {k}");
        }
        let total: f64 = self.statements.values().sum();
        println!("statements: {total:.2}");
        for (k, n) in &self.statements {
            println!("{n:>7.2}  {k}");
        }
    }
}

/// Runs `turns` turns, `together` at a time, after a warm-up, and counts them.
async fn census(turns: usize, together: usize) -> PerTurn {
    // The counters are this binary's: one census at a time.
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _one = ONE.lock().await;
    let real = Real::start().await;
    let census = Census::start(&real.server).await;
    real.turns("warm", 4, 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    census.take();
    statements().0.lock().unwrap().clear();
    let seen = census.seen.load(std::sync::atomic::Ordering::SeqCst);
    let (bus_in, bus_out) = real.varz();
    real.turns("counted", turns, together).await;
    // What a turn causes after its `turn_ended` (the store's and orchestrator's last writes).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (bus_in_after, bus_out_after) = real.varz();
    let seen = census.seen.load(std::sync::atomic::Ordering::SeqCst) - seen;
    let n = turns as f64;
    let per = |m: BTreeMap<String, u64>| m.into_iter().map(|(k, v)| (k, v as f64 / n)).collect();
    PerTurn {
        messages: per(census.take()),
        statements: per(std::mem::take(&mut *statements().0.lock().unwrap())),
        bus_in: (bus_in_after - bus_in) as f64 / n,
        bus_out: (bus_out_after - bus_out - seen) as f64 / n,
    }
}

/// One turn at a time: no write of one turn shares a commit with another's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_step_turn_one_at_a_time_on_postgres() {
    let cost = census(20, 1).await;
    cost.print("one at a time");
    // The turn's own messages: six model calls, six checkpoint saves, its events.
    assert_eq!(cost.messages_on("cyrene.checkpoint.save"), 12.0);
    // The job's ack asks for no confirmation (a lost ack is a harmless redelivery).
    assert_eq!(cost.messages_on("reply to $JS.ACK"), 0.0);
    // Every model call of the scripted model answers within one heartbeat interval: none (six a
    // turn before; "fewer than one" leaves room for a call a loaded machine stalls that long).
    assert!(cost.messages_on("[heartbeat]") < 1.0);
    // The worker asks for text deltas only: the five tool rounds send none, the answer one
    // (the first call sends the view whole, the others continue it on its replica).
    assert_eq!(cost.messages_on("stream [delta]"), 0.0);
    assert_eq!(cost.messages_on("stream.<replica> [delta]"), 1.0);
    // 79.3 in and 93.0 out before the cuts, 68.3 and 81.0 after on a quiet machine; 61.0 out
    // once no orchestrator follows every session's events (a parallel notice reads the
    // checkpoint store instead: about 20 deliveries a turn fewer, and more with each replica).
    // The slack is for what a slower run adds (expired pulls answered, sweeps), not for a
    // message a turn.
    assert!(
        cost.bus_in - cost.pulls() <= 72.0,
        "{} messages into the bus a turn, {} of them pulls",
        cost.bus_in,
        cost.pulls()
    );
    assert!(
        cost.bus_out <= 66.0,
        "{} messages out of the bus a turn",
        cost.bus_out
    );
    // Each turn is its session's first message (as in the bench's throughput case): its send
    // reads no running turn, no pending batch and no window; its completion finds in one read
    // that no other leg runs and nothing waits, so it reads neither either — and that read is
    // the read of what the turn claimed, in the statement that completes the turn and appends
    // its answer (one statement, not three).
    assert_eq!(
        cost.statements_like("SELECT turn_id, client_id, first_message_id"),
        0.0
    );
    assert_eq!(
        cost.statements_like("SELECT m.seq, m.message FROM orch_messages m"),
        0.0
    );
    assert_eq!(
        cost.statements_like("SELECT id, seq, message, solo, client_id, ask_chain"),
        0.0
    );
    // The send writes the turn it starts with its message (one statement, not two).
    assert_eq!(
        cost.statements_like("WITH turn AS (INSERT INTO orch_turns"),
        1.0
    );
    assert_eq!(cost.statements_like("INSERT INTO orch_turns"), 0.0);
    assert_eq!(
        cost.statements_like("WITH ended AS (UPDATE orch_turns"),
        1.0
    );
    assert_eq!(cost.statements_like("UPDATE orch_turns SET status"), 0.0);
    assert_eq!(cost.statements_like("SELECT CAST(CASE WHEN EXISTS"), 0.0);
    assert_eq!(cost.statements_like("SELECT id, steered, reply_to"), 0.0);
    // Each turn runs as its first attempt, whose fenced read of the checkpoint store writes
    // nothing (no older attempt to shut out): one statement reads the attempt record and the
    // turn's row together, no raise, no commit.
    assert_eq!(cost.statements_like("INSERT INTO turn_attempts"), 0.0);
    assert_eq!(
        cost.statements_like("SELECT (SELECT max_attempt FROM turn_attempts"),
        1.0
    );
    assert_eq!(
        cost.statements_like("SELECT max_attempt FROM turn_attempts"),
        0.0
    );
    assert!(cost.turn_statements() <= 19.0, "{:?}", cost.statements);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_five_step_turn_thirty_two_at_a_time_on_postgres() {
    let cost = census(96, 32).await;
    cost.print("32 at a time");
    // Checkpoint saves waiting together are written by one statement (the store's group
    // commit, docs/checkpoint-store.md): fewer than one a save.
    assert!(cost.statements_like("WITH fence AS") + cost.statements_like("WITH input AS") < 6.0);
}
