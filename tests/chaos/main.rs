//! The chaos suite (docs/chaos.md): the real service binaries on a real nats-server and real
//! SQL, a recording mock model and an external tool, user messages from many sessions, and
//! crashes injected under load. Each run prints its figures — lost, duplicated, tool re-runs,
//! stuck, approvals, failover — and fails when any but the failover is not zero.
//!
//! - `make test` runs the fast slice: the two-turn crash scenario on PostgreSQL and on SQLite,
//!   and a few sessions with a handful of kills.
//! - `make chaos` runs the full runs (`#[ignore]`d here): a single node and a 3-node cluster.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod approver;
#[path = "../common/mod.rs"]
mod common;
mod provider;
mod report;
mod script;
mod tools;
mod wire;
mod world;

use report::{Figures, Inputs, Sent};
use script::Rng;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;
use world::{LocalPostgres, Options, PostgresGuard, Service, World, env_or, send_request};

/// The seed of a run: `CHAOS_SEED`, else the clock (printed, so a schedule can be replayed).
fn seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}

/// A duration from the environment (`90s`, `1.5s`, `800ms`), else `default`.
fn env_duration(name: &str, default: Duration) -> Duration {
    std::env::var(name)
        .ok()
        .and_then(|v| humantime::parse_duration(&v).ok())
        .unwrap_or(default)
}

/// The user load: sessions, messages per session, and how they are spread in time.
#[derive(Debug, Clone)]
struct Load {
    sessions: usize,
    per_session: usize,
    /// Every `parallel_every`-th session uses the parallel policy with two clients.
    parallel_every: usize,
    /// Roughly how long the sends of one session are spread over.
    span: Duration,
}

/// A fault the chaos loop injects at a fraction of the load span.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Orchestrator,
    /// The model gateway, SIGKILLed mid-calls and started again 1 s later: the workers notice
    /// its silence (no heartbeat) within about a second and send the calls again.
    Gateway,
    Store,
    Nats,
    Postgres,
    Node(usize),
}

#[derive(Debug, Clone)]
struct Chaos {
    /// Gap between worker SIGKILLs (a replacement is started at once); `None`: no worker kills.
    worker_kills: Option<(Duration, Duration)>,
    /// (fraction of the load span, fault).
    faults: Vec<(f64, Fault)>,
}

/// Sends one session's messages, each retried until acknowledged (up to 2 minutes).
async fn drive_session(
    world: Arc<World>,
    session: String,
    load: Load,
    parallel: bool,
    mut rng: Rng,
) -> Vec<Sent> {
    let mut sent = Vec::new();
    // Mean gap of the long pauses so that the session's sends spread over about `span`.
    let per_gap = load.span.as_secs_f64() / load.per_session as f64;
    let long_max = ((per_gap - 0.08) / 0.65 * 2.0).max(1.2);
    tokio::time::sleep(rng.between(Duration::ZERO, Duration::from_secs_f64(per_gap))).await;
    for n in 0..load.per_session {
        if n > 0 {
            let gap = if rng.percent(35) {
                // Likely mid-turn: steered in, or a parallel leg.
                rng.between(Duration::from_millis(50), Duration::from_millis(400))
            } else {
                rng.between(Duration::from_secs(1), Duration::from_secs_f64(long_max))
            };
            tokio::time::sleep(gap).await;
        }
        let rounds = match rng.below(100) {
            0..10 => 0,
            10..45 => 1,
            45..85 => 2,
            _ => 3,
        };
        let marker = script::marker(&session, n, rounds);
        let client = if parallel && rng.percent(50) {
            "watch"
        } else {
            "phone"
        };
        let request = send_request(
            &session,
            &script::user_text(&marker),
            client,
            &format!("k-{marker}"),
            parallel,
        );
        let ack = world.send(&request, Duration::from_secs(120)).await;
        sent.push(Sent {
            session: session.clone(),
            marker,
            parallel,
            ack,
        });
    }
    sent
}

/// Injects `chaos` until `load_done` and every scheduled fault ran; leaves everything running.
async fn chaos_loop(
    world: Arc<World>,
    chaos: Chaos,
    span: Duration,
    mut rng: Rng,
    pg: Option<LocalPostgres>,
    mut load_done: watch::Receiver<bool>,
) {
    let start = Instant::now();
    let mut faults: Vec<(Instant, Fault)> = chaos
        .faults
        .iter()
        .map(|(fraction, fault)| (start + span.mul_f64(*fraction), *fault))
        .collect();
    faults.sort_by_key(|(at, _)| *at);
    faults.reverse();
    let workers = world.workers().await;
    let next_kill = |rng: &mut Rng| {
        chaos
            .worker_kills
            .map(|(lo, hi)| Instant::now() + rng.between(lo, hi))
    };
    let mut kill_at = next_kill(&mut rng);
    loop {
        let done = *load_done.borrow();
        if done && faults.is_empty() {
            break;
        }
        let fault_at = faults
            .last()
            .map(|(at, _)| if done { Instant::now() } else { *at });
        let kill = if done { None } else { kill_at };
        let wake = match (fault_at, kill) {
            (Some(f), Some(k)) => f.min(k),
            (Some(f), None) => f,
            (None, Some(k)) => k,
            (None, None) => {
                let _ = load_done.changed().await;
                continue;
            }
        };
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = load_done.changed() => continue,
        }
        if fault_at.is_some_and(|f| f <= Instant::now()) {
            let (_, fault) = faults.pop().unwrap();
            inject(&world, fault, pg.as_ref()).await;
        } else if kill.is_some() {
            let index = rng.below(1 << 16) as usize;
            if let Some(k) = world.kill_worker(index).await {
                world.note(format!("SIGKILL worker {} (pid {})", k.n, k.pid));
            }
            while world.workers().await < workers {
                world.spawn_worker().await;
            }
            kill_at = next_kill(&mut rng);
        }
    }
}

/// Kills `service`'s process, leaves it down for `down`, then starts it again, noting both in
/// the timeline.
async fn kill_and_restart(world: &World, service: Service, down: Duration) {
    let name = service.name();
    world.kill_service(service).await;
    world.note(format!("SIGKILL {name}"));
    tokio::time::sleep(down).await;
    world.start_service(service).await;
    world.note(format!("{name} started again"));
}

/// Sends `marker`'s message to `session` from the phone (idempotency key `key`), as a turn of
/// its own; returns what was sent for the report.
async fn sent_from_the_phone(world: &World, session: &str, marker: &str, key: &str) -> Sent {
    let request = send_request(session, &script::user_text(marker), "phone", key, false);
    let ack = world.send(&request, Duration::from_secs(30)).await;
    Sent {
        session: session.to_owned(),
        marker: marker.to_owned(),
        parallel: false,
        ack,
    }
}

async fn inject(world: &World, fault: Fault, pg: Option<&LocalPostgres>) {
    match fault {
        Fault::Orchestrator => {
            kill_and_restart(world, Service::Orchestrator, Duration::from_secs(1)).await;
        }
        Fault::Store => kill_and_restart(world, Service::Store, Duration::from_secs(2)).await,
        Fault::Gateway => {
            kill_and_restart(world, Service::Gateway, Duration::from_secs(1)).await;
        }
        Fault::Nats => {
            world.note("SIGKILL nats-server (2 s outage, same store dir)");
            world.restart_nats(Duration::from_secs(2)).await;
            world.note("nats-server started again");
        }
        Fault::Node(i) => {
            world.note(format!("SIGKILL nats node n{i} (4 s outage)"));
            world.restart_node(i, Duration::from_secs(4)).await;
            world.note(format!("nats node n{i} back, cluster formed"));
        }
        Fault::Postgres => {
            let Some(pg) = pg.cloned() else {
                world.note("PostgreSQL restart skipped: not the local pg_ctlcluster server");
                return;
            };
            world.note("PostgreSQL stop (fast), 2 s outage");
            let ok = tokio::task::spawn_blocking(move || {
                let stopped = pg.stop();
                std::thread::sleep(Duration::from_secs(2));
                stopped && pg.start()
            })
            .await
            .unwrap_or(false);
            world.note(format!("PostgreSQL started again (ok: {ok})"));
        }
    }
}

/// Waits (bounded) until every acknowledged message is answered and no turn is open; returns
/// the transcripts.
async fn settle(
    world: &World,
    sent: &[Sent],
    within: Duration,
) -> BTreeMap<String, Vec<cyrene_protocol::session::HistoryEntry>> {
    let deadline = Instant::now() + within;
    let sessions: std::collections::BTreeSet<&String> = sent.iter().map(|s| &s.session).collect();
    loop {
        let mut histories = BTreeMap::new();
        for s in &sessions {
            if let Some(h) = world.history(s).await {
                histories.insert((*s).clone(), h);
            }
        }
        let answered: std::collections::HashSet<String> = histories
            .values()
            .flatten()
            .filter(|e| e.message.role == cyrene_protocol::message::Role::Assistant)
            .flat_map(|e| script::answered_markers(&e.message.text_content()))
            .collect();
        let all_answered = sent
            .iter()
            .filter(|s| s.ack.is_some())
            .all(|s| answered.contains(&s.marker));
        let open = {
            let log = world.wire.log.lock().unwrap();
            let ended = log.ended();
            log.jobs
                .iter()
                .filter(|j| !ended.contains_key(&j.job.turn_id))
                .count()
        };
        if (all_answered && open == 0) || Instant::now() >= deadline {
            if !(all_answered && open == 0) {
                world.note(format!(
                    "not quiescent after {within:?}: all answered {all_answered}, turns without turn_ended {open}"
                ));
            }
            // Let the watcher take in the last events.
            tokio::time::sleep(Duration::from_secs(1)).await;
            return histories;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The figures of the world's run so far.
fn figures_of(
    world: &World,
    sent: &[Sent],
    histories: &BTreeMap<String, Vec<cyrene_protocol::session::HistoryEntry>>,
) -> Figures {
    let log = world.wire.log.lock().unwrap();
    let executions = world.tools.executions();
    let kills = world.kills.lock().unwrap().clone();
    let faults = world.faults.lock().unwrap().clone();
    let figures = report::figures(&Inputs {
        sent,
        histories,
        wire: &log,
        executions: &executions,
        kills: &kills,
        model_calls: world.provider.calls().len(),
        faults: &faults,
        started: world.started,
        surviving_slots: world.options.workers.saturating_sub(1)
            * cyrene_loop_worker::config::Config::default().concurrency,
        answers: &world.approver.answers(),
    });
    println!("{}", figures.text);
    figures
}

/// Fails the test when lost, duplicated, re-run, not-idempotent executed twice, idempotent
/// re-run under a new id, stuck, or any approval figure (decisions lost or applied twice, gated
/// calls run unapproved, turns stuck waiting) is not zero, or (when `CHAOS_FAILOVER_P50_MAX` is set) when
/// the failover median is above it.
fn assert_clean(figures: &Figures) {
    let mut problems = Vec::new();
    if figures.failed() {
        problems.push(format!(
            "lost {}, duplicated {}, tool re-runs {}, not-idempotent executed twice {}, \
             idempotent re-runs under a new id {}, stuck {}, decisions lost {}, decisions \
             applied twice {}, gated calls run unapproved {}, turns stuck waiting {} (all must \
             be 0)",
            figures.lost.len(),
            figures.duplicated.len(),
            figures.reruns.len(),
            figures.once_twice.len(),
            figures.new_id_reruns.len(),
            figures.stuck.len(),
            figures.approvals.lost.len(),
            figures.approvals.twice.len(),
            figures.approvals.unapproved.len(),
            figures.approvals.stuck_waiting.len()
        ));
    }
    if let Some(max) = std::env::var("CHAOS_FAILOVER_P50_MAX")
        .ok()
        .and_then(|v| humantime::parse_duration(&v).ok())
        && let Some(p50) = figures.failover_p50()
        && p50 > max
    {
        problems.push(format!(
            "failover p50 {:.2} s is over CHAOS_FAILOVER_P50_MAX {:.2} s",
            p50.as_secs_f64(),
            max.as_secs_f64()
        ));
    }
    assert!(
        problems.is_empty(),
        "chaos run failed: {}",
        problems.join("; ")
    );
}

/// One chaos run: load, faults, quiescence, figures.
async fn run(options: Options, load: Load, chaos: Chaos, settle_within: Duration) -> Figures {
    let seed = options.seed;
    println!(
        "chaos: {} — seed {seed} (CHAOS_SEED={seed} replays the schedule), {} sessions × {} messages over ~{:?}",
        options.label, load.sessions, load.per_session, load.span
    );
    let pg = if options.postgres
        && chaos
            .faults
            .iter()
            .any(|(_, f)| matches!(f, Fault::Postgres))
    {
        LocalPostgres::find()
    } else {
        None
    };
    let _pg_guard = PostgresGuard(pg.clone());
    let world = World::start(options.clone()).await;
    let mut rng = Rng::new(seed);
    let run_id = format!("{:x}", rng.next_u64() & 0xffff_ffff);
    let (done_tx, done_rx) = watch::channel(false);
    let chaos_task = tokio::spawn(chaos_loop(
        world.clone(),
        chaos,
        load.span,
        Rng::new(rng.next_u64()),
        pg,
        done_rx,
    ));
    let mut drivers = Vec::new();
    for i in 0..load.sessions {
        let parallel =
            load.parallel_every > 0 && i % load.parallel_every == load.parallel_every - 1;
        let session = format!("{}-{run_id}-s{i:02}", options.label);
        drivers.push(tokio::spawn(drive_session(
            world.clone(),
            session,
            load.clone(),
            parallel,
            Rng::new(rng.next_u64()),
        )));
    }
    let mut sent = Vec::new();
    for d in drivers {
        sent.extend(d.await.unwrap());
    }
    world.note(format!(
        "load done: {} sent, {} parallel-policy",
        sent.len(),
        sent.iter().filter(|s| s.parallel).count()
    ));
    let _ = done_tx.send(true);
    chaos_task.await.unwrap();
    let histories = settle(&world, &sent, settle_within).await;
    figures_of(&world, &sent, &histories)
}

fn options(label: &str, cluster: bool, postgres: bool) -> Options {
    Options {
        cluster,
        postgres,
        workers: 3,
        seed: seed(),
        label: label.to_owned(),
    }
}

/// The scenario of issue 10: turn 2's worker dies during step 2's model call, after step 1's
/// tool completed; the redelivered turn must resume at step 2 and run step 1's tool once.
async fn two_turn_scenario(postgres: bool) {
    let label = if postgres {
        "twoturn_pg"
    } else {
        "twoturn_sqlite"
    };
    let mut opts = options(label, false, postgres);
    opts.workers = 1;
    let world = World::start(opts).await;
    let session = format!("{label}-{:x}", world.options.seed & 0xffff_ffff);
    let m1 = script::marker(&session, 1, 2);
    let m2 = script::marker(&session, 2, 2);
    let mut sent = Vec::new();

    // Turn 1: two tool steps, then the answer.
    sent.push(sent_from_the_phone(&world, &session, &m1, "k1").await);
    wait_answered(&world, &session, &m1, Duration::from_secs(60)).await;

    // Turn 2: step 1's tool completes; the worker dies while step 2's model call is held.
    let mut hold = world.provider.hold(&m2, 1);
    sent.push(sent_from_the_phone(&world, &session, &m2, "k2").await);
    assert!(
        hold.reached(Duration::from_secs(60)).await,
        "turn 2 reached step 2's model call"
    );
    // Give step 1's checkpoint save (which overlaps the held call) time to be acknowledged.
    let saved = wait_until(Duration::from_secs(10), || {
        let log = world.wire.log.lock().unwrap();
        log.saves.iter().any(|s| {
            s.step == 1 && s.saved_at.is_some() && s.stop_reason == "tool_calls" && {
                world.tools.executions().iter().any(|e| {
                    e.key.starts_with(&format!("{m2}/k0/")) && s.results.contains(&e.call_id)
                })
            }
        })
    })
    .await;
    assert!(saved, "turn 2's step 1 was checkpointed before the kill");
    let kill = world.kill_worker(0).await.expect("a worker to kill");
    world.note(format!(
        "SIGKILL worker {} (pid {}) during turn 2's step 2 model call",
        kill.n, kill.pid
    ));
    world.spawn_worker().await;
    hold.release();
    wait_answered(&world, &session, &m2, Duration::from_secs(90)).await;

    let histories: BTreeMap<_, _> =
        [(session.clone(), world.history(&session).await.unwrap())].into();
    let figures = figures_of(&world, &sent, &histories);

    let step1_runs: Vec<_> = world
        .tools
        .executions()
        .into_iter()
        .filter(|e| e.key.starts_with(&format!("{m2}/k0/")))
        .collect();
    let step1_keys: std::collections::BTreeSet<_> = step1_runs.iter().map(|e| &e.key).collect();
    let after: Vec<_> = world
        .provider
        .calls()
        .into_iter()
        .filter(|c| c.primary == m2 && c.at > kill.at)
        .collect();
    println!(
        "two-turn: turn 2's step-1 tool executions {} (logical steps {}); model requests after the kill (round, tool calls): {:?}",
        step1_runs.len(),
        step1_keys.len(),
        after
            .iter()
            .map(|c| (c.round, c.tool_calls))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        step1_runs.len(),
        step1_keys.len(),
        "turn 2's step-1 tool ran exactly once per call; executions (key, call id): {:?}",
        step1_runs
            .iter()
            .map(|e| (&e.key, &e.call_id))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        after.first().map(|c| c.round),
        Some(1),
        "the redelivered turn resumed at step 2 (its first model request after the kill is round 1)"
    );
    assert_clean(&figures);
}

async fn wait_answered(world: &World, session: &str, marker: &str, within: Duration) {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Some(h) = world.history(session).await
            && h.iter().any(|e| {
                e.message.role == cyrene_protocol::message::Role::Assistant
                    && script::answered_markers(&e.message.text_content())
                        .iter()
                        .any(|m| m == marker)
            })
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("{marker} was not answered within {within:?}");
}

async fn wait_until(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_killed_in_step_two_resumes_there_and_runs_step_one_tool_once_on_postgres() {
    two_turn_scenario(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_killed_in_step_two_resumes_there_and_runs_step_one_tool_once_on_sqlite() {
    two_turn_scenario(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_chaos_slice_loses_duplicates_and_reruns_nothing() {
    let load = Load {
        sessions: 4,
        per_session: 6,
        parallel_every: 4,
        span: Duration::from_secs(15),
    };
    let chaos = Chaos {
        worker_kills: Some((Duration::from_secs(2), Duration::from_secs(4))),
        faults: vec![(0.3, Fault::Orchestrator), (0.6, Fault::Store)],
    };
    let figures = run(
        options("slice", false, true),
        load,
        chaos,
        env_duration("CHAOS_SETTLE", Duration::from_secs(40)),
    )
    .await;
    assert_clean(&figures);
}

/// The full load of `make chaos`: ≥ 300 messages into ≥ 30 sessions.
fn full_load() -> Load {
    Load {
        sessions: env_or("CHAOS_SESSIONS", "36").parse().unwrap_or(36),
        per_session: env_or("CHAOS_MESSAGES_PER_SESSION", "10")
            .parse()
            .unwrap_or(10),
        parallel_every: 4,
        span: env_duration("CHAOS_LOAD", Duration::from_secs(120)),
    }
}

fn worker_kill_gap() -> (Duration, Duration) {
    (
        env_duration("CHAOS_KILL_GAP_MIN", Duration::from_millis(1500)),
        env_duration("CHAOS_KILL_GAP_MAX", Duration::from_millis(3500)),
    )
}

/// Chaos: workers killed at random gaps ([`worker_kill_gap`]) and `faults` at their points.
fn worker_kills_and(faults: Vec<(f64, Fault)>) -> Chaos {
    Chaos {
        worker_kills: Some(worker_kill_gap()),
        faults,
    }
}

/// Runs the full load under `chaos`, settles for `CHAOS_SETTLE` (120 s by default), and asserts
/// that nothing was lost, duplicated, rerun or stranded.
async fn runs_clean(options: Options, chaos: Chaos) {
    let figures = run(
        options,
        full_load(),
        chaos,
        env_duration("CHAOS_SETTLE", Duration::from_secs(120)),
    )
    .await;
    assert_clean(&figures);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "make chaos: several minutes, restarts the machine's PostgreSQL"]
async fn chaos_single_node_loses_duplicates_reruns_and_strands_nothing() {
    let faults = vec![
        (0.2, Fault::Orchestrator),
        (0.3, Fault::Gateway),
        (0.35, Fault::Store),
        (0.45, Fault::Nats),
        (0.55, Fault::Orchestrator),
        (0.7, Fault::Postgres),
    ];
    runs_clean(options("full", false, true), worker_kills_and(faults)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "make chaos: several minutes"]
async fn chaos_on_a_three_node_cluster_loses_duplicates_reruns_and_strands_nothing() {
    let faults = vec![
        (0.25, Fault::Orchestrator),
        (0.4, Fault::Node(1)),
        (0.5, Fault::Gateway),
        (0.6, Fault::Store),
    ];
    runs_clean(options("cluster", true, true), worker_kills_and(faults)).await;
}
