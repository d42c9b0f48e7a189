//! The figures of a run, computed from the transcripts (what a user sees), the wire (timing and
//! which worker did what), the tool's execution log and the mock model's request log.
//!
//! Definitions (docs/chaos.md):
//! - **lost**: an acknowledged message that no answer in its session's transcript names;
//! - **duplicated**: a message twice in a transcript, named by two answers, or a turn with two
//!   answers;
//! - **tool re-run**: an execution of a logical tool step (same key; same or new call id) that
//!   started after an earlier execution of that step had its result in a checkpoint the store
//!   acknowledged — a *completed* step's tool ran again;
//! - **in-flight re-run**: an execution of a step whose earlier execution was never checkpointed
//!   (the worker died mid-step): at-least-once, counted but not a failure;
//! - **not-idempotent executed twice**: a logical step of the tool declared not idempotent that
//!   ran more than once, under any call id;
//! - **idempotent re-run under a new id**: a logical step of the idempotent tool that ran under
//!   two call ids (a re-run must keep the step's id);
//! - **stuck**: a turn that started and neither ended on the wire nor answered in a transcript;
//! - **failover**: a worker's SIGKILL → the first model request or tool execution of a turn it
//!   was running, from another worker (a turn waiting for approval at the kill is not running);
//! - **decision lost**: a call whose approval holds (the auto-approver's reply says so) that
//!   never ran and was not reported outcome-unknown;
//! - **decision applied twice**: an approval-gated call that ran more than once, or two replies
//!   for one call naming different decisions, or two replies that both say they decided;
//! - **gated call run unapproved**: an execution of the gated tool under a call id whose holding
//!   decision is not `approve` (denied, or never decided);
//! - **stuck waiting**: a call that asked for approval and was never decided, or whose turn never
//!   ended.

use crate::approver::Answer;
use crate::script;
use crate::tools::Execution;
use crate::wire::{EventSeen, JobSeen, WireLog};
use crate::world::WorkerKill;
use cyrene_protocol::approval::Decision;
use cyrene_protocol::message::Role;
use cyrene_protocol::session::{HistoryEntry, SendAck, SessionEventType};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// One message the driver sent.
#[derive(Debug, Clone)]
pub struct Sent {
    pub session: String,
    pub marker: String,
    pub parallel: bool,
    pub ack: Option<SendAck>,
}

/// Everything the report reads.
#[derive(Debug)]
pub struct Inputs<'a> {
    pub sent: &'a [Sent],
    pub histories: &'a BTreeMap<String, Vec<HistoryEntry>>,
    pub wire: &'a WireLog,
    pub executions: &'a [Execution],
    pub kills: &'a [WorkerKill],
    pub model_calls: usize,
    pub faults: &'a [(f64, String)],
    /// When the world started: `faults` are seconds since then.
    pub started: Instant,
    /// Turn slots of the workers that survive one kill (the workers but one, times each one's
    /// concurrency): a redelivered turn waits while that many other turns run.
    pub surviving_slots: usize,
    /// The auto-approver's replies.
    pub answers: &'a [Answer],
}

/// The figures; `failed()` when any of lost, duplicated, re-run or stuck is not zero.
#[derive(Debug, Default)]
pub struct Figures {
    pub sent: usize,
    pub acknowledged: usize,
    pub lost: Vec<String>,
    pub duplicated: Vec<String>,
    pub reruns: Vec<String>,
    pub rerun_turns: BTreeSet<String>,
    pub inflight_reruns: usize,
    /// Steps of the not-idempotent tool executed more than once.
    pub once_twice: Vec<String>,
    /// Steps of the idempotent tool executed under more than one call id.
    pub new_id_reruns: Vec<String>,
    /// `tool_outcome_unknown` events seen on the wire.
    pub outcome_unknown: usize,
    pub stuck: Vec<String>,
    pub interrupted: usize,
    pub failovers: Vec<Duration>,
    /// Every failover with what else happened around it.
    pub around: Vec<Failover>,
    /// Interrupted turns whose next model request went back behind their last checkpoint.
    pub resumed_behind: usize,
    /// Each of them: turn, its checkpoint, the request that went back.
    pub behind: Vec<String>,
    pub approvals: ApprovalFigures,
    pub text: String,
}

impl Figures {
    pub fn failed(&self) -> bool {
        !(self.lost.is_empty()
            && self.duplicated.is_empty()
            && self.reruns.is_empty()
            && self.once_twice.is_empty()
            && self.new_id_reruns.is_empty()
            && self.stuck.is_empty()
            && self.approvals.clean())
    }

    /// The median failover, if any was measured.
    pub fn failover_p50(&self) -> Option<Duration> {
        percentile(&self.failovers, 50)
    }
}

/// One measured failover.
#[derive(Debug, Clone)]
pub struct Failover {
    /// From the kill to the turn's next step on another worker.
    pub took: Duration,
    /// What else happened between the kill and that step ([`faults_around`]; empty: nothing).
    pub around: Vec<String>,
    /// Which it was (the turn, the kill, the next step), to follow an outlier in the service logs.
    pub which: String,
}

/// Seconds from the run's start to `at`, as the report prints times.
fn since_start(inputs: &Inputs<'_>, at: Instant) -> f64 {
    at.saturating_duration_since(inputs.started).as_secs_f64()
}

/// A failover longer than this is an outlier, and the report says what else happened meanwhile.
const FAILOVER_OUTLIER: Duration = Duration::from_secs(1);

/// Faults noted around a failover from a kill at `from` to the next step at `to`: another
/// worker's kill in between (the turn may have moved to it), or a service, NATS or PostgreSQL
/// fault in between or in the 10 s before (a service restarted just before may still be
/// starting, and its callers backing off).
fn faults_around(inputs: &Inputs<'_>, kill: &WorkerKill, to: Instant) -> Vec<String> {
    let (from, to) = (since_start(inputs, kill.at), since_start(inputs, to));
    let this_kill = format!("(pid {})", kill.pid);
    inputs
        .faults
        .iter()
        .filter(|(at, what)| {
            if what.starts_with("SIGKILL worker") {
                !what.ends_with(&this_kill) && *at > from && *at <= to
            } else {
                *at >= from - 10.0 && *at <= to
            }
        })
        .map(|(at, what)| format!("{at:.1}s {what}"))
        .collect()
}

fn percentile(values: &[Duration], p: usize) -> Option<Duration> {
    let mut v = values.to_vec();
    v.sort();
    if v.is_empty() {
        return None;
    }
    let i = ((v.len() - 1) * p).div_ceil(100);
    Some(v[i])
}

fn secs(d: Option<Duration>) -> String {
    d.map_or("n/a".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()))
}

/// Computes and renders the figures.
pub fn figures(inputs: &Inputs<'_>) -> Figures {
    let mut f = Figures {
        sent: inputs.sent.len(),
        ..Default::default()
    };
    let acked: Vec<&Sent> = inputs.sent.iter().filter(|s| s.ack.is_some()).collect();
    f.acknowledged = acked.len();

    // Message id → marker, and marker → turn (from every job's messages and steer acks).
    let marker_of_id: HashMap<&str, &str> = acked
        .iter()
        .filter_map(|s| Some((s.ack.as_ref()?.message_id.as_str(), s.marker.as_str())))
        .collect();
    let mut turn_of_marker: HashMap<String, String> = HashMap::new();
    // When each turn's job was first published.
    let mut dispatched: HashMap<&str, Instant> = HashMap::new();
    let mut legs = BTreeSet::new();
    let mut turns = BTreeSet::new();
    for j in &inputs.wire.jobs {
        turns.insert(j.job.turn_id.clone());
        dispatched.entry(j.job.turn_id.as_str()).or_insert(j.at);
        if !j.job.leg_id.is_empty() {
            legs.insert(j.job.turn_id.clone());
        }
        for id in &j.job.message_ids {
            if let Some(m) = marker_of_id.get(id.as_str()) {
                turn_of_marker
                    .entry((*m).to_owned())
                    .or_insert(j.job.turn_id.clone());
            }
        }
    }
    let mut steered = 0;
    let mut errored = BTreeSet::new();
    let ended = inputs.wire.ended();
    for e in &inputs.wire.events {
        match e.event.kind {
            SessionEventType::SteerAck => steered += e.event.message_ids.len(),
            SessionEventType::TurnStarted => {
                turns.insert(e.event.turn_id.clone());
            }
            SessionEventType::TurnEnded if e.event.error.is_some() => {
                errored.insert(e.event.turn_id.clone());
            }
            _ => {}
        }
    }

    // Lost and duplicated, from the transcripts.
    let mut answered_by: HashMap<String, Vec<String>> = HashMap::new();
    let mut answered_turns: HashMap<String, usize> = HashMap::new();
    for entries in inputs.histories.values() {
        let mut seen_ids: HashMap<&str, usize> = HashMap::new();
        for e in entries {
            match e.message.role {
                Role::Assistant => {
                    *answered_turns.entry(e.turn_id.clone()).or_default() += 1;
                    for m in script::answered_markers(&e.message.text_content()) {
                        answered_by.entry(m).or_default().push(e.turn_id.clone());
                    }
                }
                Role::User => {
                    turns.extend((!e.turn_id.is_empty()).then(|| e.turn_id.clone()));
                    *seen_ids.entry(e.id.as_str()).or_default() += 1;
                }
                _ => {}
            }
        }
        for (id, n) in seen_ids {
            if n > 1 {
                f.duplicated
                    .push(format!("message {id} is {n} times in its transcript"));
            }
        }
    }
    for s in &acked {
        let Some(ack) = &s.ack else { continue };
        let entry = inputs.histories.get(&s.session).and_then(|h| {
            h.iter()
                .find(|e| e.id == ack.message_id && e.message.role == Role::User)
        });
        match answered_by.get(&s.marker) {
            Some(by) if by.len() > 1 => f
                .duplicated
                .push(format!("{} answered by turns {by:?}", s.marker)),
            Some(_) => {}
            None => {
                let why = match entry {
                    None => "not in its transcript".to_owned(),
                    Some(e) if e.turn_id.is_empty() => "still pending".to_owned(),
                    Some(e) if errored.contains(&e.turn_id) => {
                        format!("its turn {} ended with an error", e.turn_id)
                    }
                    Some(e) => format!("its turn {} has no answer", e.turn_id),
                };
                f.lost.push(format!("{} ({why})", s.marker));
            }
        }
    }
    for (turn, n) in &answered_turns {
        if *n > 1 {
            f.duplicated.push(format!("turn {turn} answered {n} times"));
        }
    }

    // Stuck: started, never ended on the wire, never answered.
    for t in &turns {
        if !ended.contains_key(t) && !answered_turns.contains_key(t) {
            f.stuck.push(t.clone());
        }
    }

    // Tool re-runs. A call id counts as checkpointed from the first acknowledged save holding
    // its result.
    let mut saved_at: HashMap<&str, Instant> = HashMap::new();
    for s in &inputs.wire.saves {
        if let Some(at) = s.saved_at {
            for id in &s.results {
                let e = saved_at.entry(id.as_str()).or_insert(at);
                *e = (*e).min(at);
            }
        }
    }
    let mut by_key: BTreeMap<&str, Vec<&Execution>> = BTreeMap::new();
    for e in inputs.executions {
        by_key.entry(e.key.as_str()).or_default().push(e);
    }
    for (key, runs) in &by_key {
        let ids: BTreeSet<&str> = runs.iter().map(|e| e.call_id.as_str()).collect();
        match runs[0].tool {
            crate::provider::ONCE_TOOL if runs.len() > 1 => f.once_twice.push(format!(
                "{key}: {} executions under {}",
                runs.len(),
                ids.iter().copied().collect::<Vec<_>>().join(", ")
            )),
            crate::provider::TOOL if ids.len() > 1 => f.new_id_reruns.push(format!(
                "{key}: ran under {}",
                ids.iter().copied().collect::<Vec<_>>().join(", ")
            )),
            _ => {}
        }
    }
    f.outcome_unknown = inputs
        .wire
        .events
        .iter()
        .filter(|e| e.event.kind == SessionEventType::ToolOutcomeUnknown)
        .count();
    for (key, mut runs) in by_key {
        runs.sort_by_key(|e| e.started);
        for (i, e) in runs.iter().enumerate().skip(1) {
            let earlier = &runs[..i];
            let completed = earlier.iter().find(|x| {
                saved_at
                    .get(x.call_id.as_str())
                    .is_some_and(|at| *at < e.started)
            });
            match completed {
                Some(x) => {
                    let how = if x.call_id == e.call_id {
                        "same call id"
                    } else {
                        "new call id"
                    };
                    f.reruns.push(format!(
                        "{key}: ran again as {} ({how}) {:.1} s after {} was checkpointed",
                        e.call_id,
                        e.started
                            .saturating_duration_since(saved_at[x.call_id.as_str()])
                            .as_secs_f64(),
                        x.call_id
                    ));
                    f.rerun_turns.insert(
                        turn_of_marker
                            .get(script::primary_of_key(key))
                            .cloned()
                            .unwrap_or_else(|| script::primary_of_key(key).to_owned()),
                    );
                }
                None => f.inflight_reruns += 1,
            }
        }
    }

    f.approvals = approval_figures(
        &inputs.wire.events,
        &inputs.wire.jobs,
        inputs.answers,
        inputs.executions,
        &ended,
    );
    // Waiting for approval, a turn runs nowhere: from its request to its continued job.
    let mut waiting: HashMap<&str, Vec<(Instant, Instant)>> = HashMap::new();
    for e in &inputs.wire.events {
        if e.event.kind != SessionEventType::ApprovalRequested {
            continue;
        }
        let until = inputs
            .wire
            .jobs
            .iter()
            .filter(|j| {
                j.job.turn_id == e.event.turn_id && !j.job.decisions.is_empty() && j.at >= e.at
            })
            .map(|j| j.at)
            .min()
            .unwrap_or_else(Instant::now);
        waiting
            .entry(e.event.turn_id.as_str())
            .or_default()
            .push((e.at, until));
    }
    let waited_at = |turn: &str, at: Instant| {
        waiting
            .get(turn)
            .is_some_and(|spans| spans.iter().any(|(from, to)| *from <= at && at < *to))
    };

    // Failover: who was running what when a worker died, and when the turn's next model request
    // came from someone else.
    let mut activity: HashMap<String, Vec<(Instant, &str)>> = HashMap::new();
    let turn_of_primary = |primary: &str| turn_of_marker.get(primary).cloned();
    for r in &inputs.wire.model_requests {
        if let Some(t) = turn_of_primary(&r.primary) {
            activity
                .entry(t)
                .or_default()
                .push((r.at, r.inbox.as_str()));
        }
    }
    for r in inputs.wire.steers.iter().chain(&inputs.wire.completes) {
        activity
            .entry(r.turn_id.clone())
            .or_default()
            .push((r.at, r.inbox.as_str()));
    }
    for s in &inputs.wire.saves {
        activity
            .entry(s.turn_id.clone())
            .or_default()
            .push((s.at, s.inbox.as_str()));
    }
    for e in inputs.executions {
        if let Some(t) = turn_of_primary(script::primary_of_key(&e.key)) {
            activity
                .entry(t)
                .or_default()
                .push((e.started, e.inbox.as_str()));
        }
    }
    for a in activity.values_mut() {
        a.sort_by_key(|(at, _)| *at);
    }
    let mut unmeasured = 0;
    let mut fresh = 0;
    let running_at = |turn: &str, at: Instant| {
        dispatched.get(turn).is_some_and(|d| *d <= at)
            && ended.get(turn).is_none_or(|e| *e > at)
            && !waited_at(turn, at)
    };
    for kill in inputs.kills {
        let Some(inbox) = &kill.inbox else { continue };
        let running = turns.iter().filter(|t| running_at(t, kill.at)).count();
        let (first, mut mine) = (f.around.len(), 0);
        for (turn, acts) in &activity {
            if !running_at(turn, kill.at) {
                continue;
            }
            let last = acts.iter().rev().find(|(at, _)| *at <= kill.at);
            let killed = |by: &str| by == inbox || kill.also.iter().any(|a| a == by);
            if last.is_none_or(|(_, by)| !killed(by)) {
                continue;
            }
            f.interrupted += 1;
            mine += 1;
            let next = inputs.wire.model_requests.iter().find(|r| {
                r.at > kill.at
                    && !killed(&r.inbox)
                    && turn_of_primary(&r.primary).as_deref() == Some(turn)
            });
            // A turn killed while its tool batch ran continues that batch (its calls were
            // durable) before any model request: its first tool execution elsewhere counts too.
            let next_tool = inputs
                .executions
                .iter()
                .filter(|e| {
                    e.started > kill.at
                        && !killed(&e.inbox)
                        && turn_of_primary(script::primary_of_key(&e.key)).as_deref() == Some(turn)
                })
                .map(|e| e.started)
                .min();
            let taken = match (next.map(|r| r.at), next_tool) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => {
                    unmeasured += 1;
                    continue;
                }
            };
            f.failovers.push(taken - kill.at);
            f.around.push(Failover {
                took: taken - kill.at,
                around: faults_around(inputs, kill, taken),
                which: format!(
                    "turn {turn}, SIGKILL worker {} (pid {}) at {:.2}s, its next step at {:.2}s",
                    kill.n,
                    kill.pid,
                    since_start(inputs, kill.at),
                    since_start(inputs, taken)
                ),
            });
            let Some(next) = next else {
                continue;
            };
            let checkpointed = inputs
                .wire
                .saves
                .iter()
                .filter(|s| {
                    s.turn_id == *turn
                        && s.stop_reason == "tool_calls"
                        && s.saved_at.is_some_and(|at| at <= kill.at)
                })
                .map(|s| s.step as usize)
                .max()
                .unwrap_or(0);
            if next.round < checkpointed {
                f.resumed_behind += 1;
                f.behind.push(format!(
                    "{turn}: killed at {:.2}s after its step {checkpointed} checkpoint; next request (round {}) at {:.2}s from {}",
                    since_start(inputs, kill.at),
                    next.round,
                    since_start(inputs, next.at),
                    next.inbox
                ));
                if next.round == 0 {
                    fresh += 1;
                }
            }
        }
        // A redelivered job waits for a free turn slot: with every surviving slot taken, its
        // failover is also the wait for another turn to end.
        let others = running - mine;
        if others >= inputs.surviving_slots {
            for failover in &mut f.around[first..] {
                failover.around.push(format!(
                    "the other workers' {} turn slots were all taken ({others} other turns running)",
                    inputs.surviving_slots
                ));
            }
        }
    }

    // Render.
    let mut t = String::new();
    let max = f.failovers.iter().max().copied();
    let _ = writeln!(t, "== chaos figures ==");
    let _ = writeln!(
        t,
        "messages sent {}, acknowledged {} ({} never acknowledged)",
        f.sent,
        f.acknowledged,
        f.sent - f.acknowledged
    );
    let _ = writeln!(
        t,
        "turns {} (parallel legs {}), messages steered into running turns {}, turns ended with an error {}",
        turns.len(),
        legs.len(),
        steered,
        errored.len()
    );
    let _ = writeln!(
        t,
        "model requests {}, tool executions {}, worker SIGKILLs {}",
        inputs.model_calls,
        inputs.executions.len(),
        inputs.kills.len()
    );
    let _ = writeln!(t, "LOST {}", f.lost.len());
    let _ = writeln!(t, "DUPLICATED {}", f.duplicated.len());
    let _ = writeln!(
        t,
        "TOOL RE-RUNS {} (completed steps' tools executed again, in {} turns)",
        f.reruns.len(),
        f.rerun_turns.len()
    );
    let _ = writeln!(
        t,
        "in-flight tool re-runs {} (at-least-once: the step was not checkpointed when its worker died)",
        f.inflight_reruns
    );
    let _ = writeln!(
        t,
        "NON-IDEMPOTENT TOOLS EXECUTED TWICE {}",
        f.once_twice.len()
    );
    let _ = writeln!(
        t,
        "IDEMPOTENT RE-RUNS UNDER A DIFFERENT CALL ID {}",
        f.new_id_reruns.len()
    );
    let _ = writeln!(
        t,
        "outcome-unknown results {} (not-idempotent calls in flight at a crash or whose reply was lost: never run again)",
        f.outcome_unknown
    );
    let _ = writeln!(t, "STUCK {}", f.stuck.len());
    let a = &f.approvals;
    let _ = writeln!(
        t,
        "approvals: calls asked {}, approved {}, denied {}, second decisions answered already_decided {}",
        a.asked, a.approved, a.denied, a.second_answers
    );
    let _ = writeln!(t, "DECISIONS LOST {}", a.lost.len());
    let _ = writeln!(t, "DECISIONS APPLIED TWICE {}", a.twice.len());
    let _ = writeln!(t, "GATED CALLS RUN UNAPPROVED {}", a.unapproved.len());
    let _ = writeln!(t, "TURNS STUCK WAITING {}", a.stuck_waiting.len());
    let _ = writeln!(
        t,
        "approval wait p50 {}, max {} (asked → decided, the approver thinks 50–400 ms); continued after the decision p50 {}, max {} (decided → the turn's job on the wire)",
        secs(percentile(&a.waits, 50)),
        secs(a.waits.iter().max().copied()),
        secs(percentile(&a.continued, 50)),
        secs(a.continued.iter().max().copied())
    );
    let _ = writeln!(
        t,
        "FAILOVER p50 {}, max {} over {} interrupted turns ({} measured; {} finished without another model request or tool execution)",
        secs(f.failover_p50()),
        secs(max),
        f.interrupted,
        f.failovers.len(),
        unmeasured
    );
    let outliers: Vec<_> = f
        .around
        .iter()
        .filter(|o| o.took > FAILOVER_OUTLIER)
        .collect();
    let unexplained = outliers.iter().filter(|o| o.around.is_empty()).count();
    // The failovers with nothing else going on: the worker's death alone.
    let alone: Vec<Duration> = f
        .around
        .iter()
        .filter(|o| o.around.is_empty())
        .map(|o| o.took)
        .collect();
    let _ = writeln!(
        t,
        "failovers over {} s: {} ({} with no other fault around them)",
        FAILOVER_OUTLIER.as_secs(),
        outliers.len(),
        unexplained
    );
    for o in &outliers {
        let around = if o.around.is_empty() {
            "nothing else happened: unexplained".to_owned()
        } else {
            o.around.join("; ")
        };
        let _ = writeln!(t, "  {:.2} s: {around} ({})", o.took.as_secs_f64(), o.which);
    }
    let _ = writeln!(
        t,
        "interrupted turns that went back behind their last checkpoint {} (of which started from scratch {})",
        f.resumed_behind, fresh
    );
    for line in f.behind.iter().take(10) {
        let _ = writeln!(t, "  {line}");
    }
    if let (Some(p50), Some(p99), Some(max)) = (f.failover_p50(), percentile(&f.failovers, 99), max)
    {
        // Issue 37's failover row (docs/performance.md): no floor is measured here, the anchors
        // are other runtimes' documented defaults. The p99 target is read on the failovers with
        // nothing else going on; the others are the outliers, each with its explanation above.
        let alone_p99 = percentile(&alone, 99);
        let met = p50 <= Duration::from_millis(300)
            && alone_p99.is_none_or(|p| p <= Duration::from_secs(1))
            && unexplained == 0;
        t.push_str(&cyrene_test_support::cost::summary(
            "make chaos, failover",
            &[cyrene_test_support::cost::Row::new(
                "failover",
                "SIGKILL → the turn's next step on another worker",
                format!(
                    "p50 {} p99 {} ({} with no other fault around: p99 {}) max {} ({} failovers; over 1 s {}, unexplained {})",
                    secs(Some(p50)),
                    secs(Some(p99)),
                    alone.len(),
                    secs(alone_p99),
                    secs(Some(max)),
                    f.failovers.len(),
                    outliers.len(),
                    unexplained
                ),
                "DBOS 60 s by default; LangGraph deployments minutes (not measured here)",
                "p50 ≤ 0.3 s; p99 ≤ 1 s with no other fault around; every outlier explained",
                met,
            )],
        ));
    }
    for (what, list) in [
        ("lost", &f.lost),
        ("duplicated", &f.duplicated),
        ("re-run", &f.reruns),
        ("executed twice", &f.once_twice),
        ("new call id", &f.new_id_reruns),
        ("stuck", &f.stuck),
        ("decision lost", &f.approvals.lost),
        ("decision applied twice", &f.approvals.twice),
        ("gated call run unapproved", &f.approvals.unapproved),
        ("stuck waiting", &f.approvals.stuck_waiting),
    ] {
        for line in list.iter().take(10) {
            let _ = writeln!(t, "  {what}: {line}");
        }
        if list.len() > 10 {
            let _ = writeln!(t, "  {what}: … and {} more", list.len() - 10);
        }
    }
    let _ = writeln!(t, "faults injected:");
    for (at, what) in inputs.faults {
        if !what.starts_with("SIGKILL worker") {
            let _ = writeln!(t, "  {at:7.1}s {what}");
        }
    }
    f.text = t;
    f
}

/// The approval figures (the module's definitions).
#[derive(Debug, Default)]
pub struct ApprovalFigures {
    /// Calls that asked for approval.
    pub asked: usize,
    pub approved: usize,
    pub denied: usize,
    /// Second decisions answered with the first one (`already_decided`), as they must be.
    pub second_answers: usize,
    pub lost: Vec<String>,
    pub twice: Vec<String>,
    pub unapproved: Vec<String>,
    pub stuck_waiting: Vec<String>,
    /// From a call's request to the approver's first reply.
    pub waits: Vec<Duration>,
    /// From a turn's last decision to its continued job on the wire.
    pub continued: Vec<Duration>,
}

impl ApprovalFigures {
    /// No decision lost or applied twice, no gated call run unapproved, no turn left waiting.
    pub fn clean(&self) -> bool {
        self.lost.is_empty()
            && self.twice.is_empty()
            && self.unapproved.is_empty()
            && self.stuck_waiting.is_empty()
    }
}

/// The approval figures from the wire's events and jobs, the approver's replies, the tools'
/// executions and the turns that ended (turn id → when).
pub fn approval_figures(
    events: &[EventSeen],
    jobs: &[JobSeen],
    answers: &[Answer],
    executions: &[Execution],
    ended: &HashMap<String, Instant>,
) -> ApprovalFigures {
    let mut a = ApprovalFigures::default();
    // Every call that asked, by call id: its turn and when it was first known to wait.
    let mut asked: BTreeMap<&str, (&str, Instant)> = BTreeMap::new();
    for e in events {
        if e.event.kind == SessionEventType::ApprovalRequested
            && let Some(call) = e.event.call_id.as_deref()
        {
            asked
                .entry(call)
                .or_insert((e.event.turn_id.as_str(), e.at));
        }
    }
    let mut replies: BTreeMap<&str, Vec<&Answer>> = BTreeMap::new();
    for r in answers {
        replies.entry(r.call_id.as_str()).or_default().push(r);
    }
    a.asked = asked
        .keys()
        .copied()
        .chain(replies.keys().copied())
        .collect::<BTreeSet<_>>()
        .len();
    let unknown: BTreeSet<&str> = events
        .iter()
        .filter(|e| e.event.kind == SessionEventType::ToolOutcomeUnknown)
        .filter_map(|e| e.event.call_id.as_deref())
        .collect();
    let mut runs: BTreeMap<&str, usize> = BTreeMap::new();
    for e in executions
        .iter()
        .filter(|e| e.tool == crate::provider::GATED_TOOL)
    {
        *runs.entry(e.call_id.as_str()).or_default() += 1;
    }
    let mut held: BTreeMap<&str, Decision> = BTreeMap::new();
    let mut decided_at: HashMap<&str, Instant> = HashMap::new();
    for (call, rs) in &replies {
        let holds: BTreeSet<&str> = rs.iter().map(|r| r.held.as_str()).collect();
        if holds.len() > 1 {
            a.twice.push(format!("{call}: the replies name {holds:?}"));
        }
        let firsts = rs.iter().filter(|r| !r.already_decided).count();
        if firsts > 1 {
            a.twice.push(format!(
                "{call}: {firsts} replies say they made the decision"
            ));
        }
        // A reply that says it made the decision must hold what was asked for.
        for r in rs
            .iter()
            .filter(|r| !r.already_decided && r.held != r.asked)
        {
            a.lost.push(format!(
                "{call} (session {}): asked {}, the reply made {}",
                r.session_id,
                r.asked.as_str(),
                r.held.as_str()
            ));
        }
        a.second_answers += rs.iter().filter(|r| r.already_decided).count();
        let first = rs[0];
        held.insert(call, first.held);
        match first.held {
            Decision::Approve => a.approved += 1,
            Decision::Deny => a.denied += 1,
        }
        let since = asked.get(call).map_or(first.requested_at, |(_, at)| *at);
        a.waits
            .push(first.answered_at.saturating_duration_since(since));
        decided_at.insert(call, first.answered_at);
        let ran = runs.get(call).copied().unwrap_or(0);
        if first.held == Decision::Approve && ran == 0 && !unknown.contains(call) {
            a.lost.push(format!(
                "{call}: approved, never ran nor reported outcome-unknown"
            ));
        }
        if ran > 1 {
            a.twice
                .push(format!("{call}: the approved call ran {ran} times"));
        }
    }
    for (call, n) in &runs {
        if held.get(call) != Some(&Decision::Approve) {
            a.unapproved.push(format!(
                "{call}: ran {n} times; the decision that holds is {:?}",
                held.get(call)
            ));
        }
    }
    for (call, (turn, _)) in &asked {
        if !held.contains_key(call) {
            a.stuck_waiting
                .push(format!("{call} (turn {turn}): never decided"));
        }
    }
    let turns: BTreeSet<&str> = asked.values().map(|(turn, _)| *turn).collect();
    for turn in &turns {
        if !ended.contains_key(*turn) {
            a.stuck_waiting
                .push(format!("turn {turn}: asked for approval and never ended"));
        }
        let last_decision = asked
            .iter()
            .filter(|(_, (t, _))| t == turn)
            .filter_map(|(call, _)| decided_at.get(call))
            .max();
        let continued = jobs
            .iter()
            .filter(|j| j.job.turn_id == *turn && !j.job.decisions.is_empty())
            .map(|j| j.at)
            .min();
        if let (Some(decided), Some(continued)) = (last_decision, continued) {
            a.continued
                .push(continued.saturating_duration_since(*decided));
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Execution;
    use cyrene_protocol::session::SessionEvent;
    use cyrene_protocol::turn::TurnJob;

    fn asked(call: &str, turn: &str, at: Instant) -> EventSeen {
        let mut event = SessionEvent::new(SessionEventType::ApprovalRequested, "s1");
        event.turn_id = turn.into();
        event.call_id = Some(call.into());
        EventSeen { at, event }
    }

    fn answer(call: &str, asked: Decision, held: Decision, already: bool, at: Instant) -> Answer {
        Answer {
            session_id: "s1".into(),
            call_id: call.into(),
            asked,
            held,
            already_decided: already,
            requested_at: at,
            answered_at: at + Duration::from_millis(100),
        }
    }

    fn ran(call: &str, at: Instant) -> Execution {
        Execution {
            tool: crate::provider::GATED_TOOL,
            key: format!("k-{call}"),
            call_id: call.into(),
            inbox: "_INBOX_cyrene-loop-worker.w1".into(),
            started: at,
            finished: Some(at),
        }
    }

    fn continued(turn: &str, at: Instant) -> JobSeen {
        let mut job: TurnJob = cyrene_test_support::fixtures::turn_job(turn, "s1", "x");
        job.decisions = vec![cyrene_protocol::approval::CallDecision {
            step: 1,
            call_id: "c".into(),
            decision: Decision::Approve,
            reason: None,
            decided_by: "operator".into(),
        }];
        JobSeen { at, job }
    }

    #[test]
    fn a_clean_run_counts_its_calls_and_waits() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let events = [asked("c1", "t1", t0), asked("c2", "t2", t0)];
        let answers = [
            answer("c1", Decision::Approve, Decision::Approve, false, t0),
            answer("c1", Decision::Deny, Decision::Approve, true, t0 + s),
            answer("c2", Decision::Deny, Decision::Deny, false, t0),
        ];
        let ended: HashMap<String, Instant> =
            [("t1".to_owned(), t0 + 3 * s), ("t2".to_owned(), t0 + 3 * s)].into();
        let a = approval_figures(
            &events,
            &[continued("t1", t0 + 2 * s)],
            &answers,
            &[ran("c1", t0 + 2 * s)],
            &ended,
        );
        assert!(a.clean(), "{a:?}");
        assert_eq!(
            (a.asked, a.approved, a.denied, a.second_answers),
            (2, 1, 1, 1)
        );
        assert_eq!(a.waits, [Duration::from_millis(100); 2]);
        assert_eq!(a.continued, [2 * s - Duration::from_millis(100)]);
    }

    #[test]
    fn every_kind_of_violation_is_counted() {
        let t0 = Instant::now();
        let events = [
            asked("lost", "t1", t0),
            asked("flipped", "t1", t0),
            asked("denied", "t2", t0),
            asked("waits", "t3", t0),
        ];
        let answers = [
            answer("lost", Decision::Approve, Decision::Approve, false, t0),
            answer("flipped", Decision::Approve, Decision::Approve, false, t0),
            answer("flipped", Decision::Deny, Decision::Deny, false, t0),
            answer("denied", Decision::Deny, Decision::Deny, false, t0),
        ];
        let executions = [
            ran("flipped", t0),
            ran("flipped", t0),
            ran("denied", t0),
            ran("never-asked", t0),
        ];
        let ended: HashMap<String, Instant> = [("t1".to_owned(), t0), ("t2".to_owned(), t0)].into();
        let a = approval_figures(&events, &[], &answers, &executions, &ended);
        assert!(!a.clean());
        assert_eq!(a.lost.len(), 1, "{:?}", a.lost);
        assert!(a.lost[0].starts_with("lost:"));
        // The replies disagree, both say they decided, and it ran twice.
        assert_eq!(a.twice.len(), 3, "{:?}", a.twice);
        let unapproved: Vec<&str> = a
            .unapproved
            .iter()
            .map(|u| u.split(':').next().unwrap())
            .collect();
        assert_eq!(unapproved, ["denied", "never-asked"]);
        // Never decided, and its turn never ended.
        assert_eq!(a.stuck_waiting.len(), 2, "{:?}", a.stuck_waiting);
    }

    #[test]
    fn an_approved_call_reported_outcome_unknown_is_not_lost() {
        let t0 = Instant::now();
        let mut unknown = SessionEvent::new(SessionEventType::ToolOutcomeUnknown, "s1");
        unknown.call_id = Some("c1".into());
        let events = [
            asked("c1", "t1", t0),
            EventSeen {
                at: t0,
                event: unknown,
            },
        ];
        let answers = [answer(
            "c1",
            Decision::Approve,
            Decision::Approve,
            false,
            t0,
        )];
        let ended: HashMap<String, Instant> = [("t1".to_owned(), t0)].into();
        let a = approval_figures(&events, &[], &answers, &[], &ended);
        assert!(a.clean(), "{a:?}");
    }

    #[test]
    fn a_reply_that_made_another_decision_than_asked_is_a_lost_decision() {
        let t0 = Instant::now();
        let events = [asked("c1", "t1", t0)];
        let answers = [answer("c1", Decision::Deny, Decision::Approve, false, t0)];
        let ended: HashMap<String, Instant> = [("t1".to_owned(), t0)].into();
        let a = approval_figures(&events, &[], &answers, &[ran("c1", t0)], &ended);
        assert_eq!(a.lost.len(), 1, "{:?}", a.lost);
        assert!(
            a.lost[0].contains("asked deny, the reply made approve"),
            "{:?}",
            a.lost
        );
    }
}
