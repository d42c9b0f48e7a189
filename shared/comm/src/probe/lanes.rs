//! The asks an agent accepts: [`AskLimits`] bounds them, [`serve_asks`] reads and admits them
//! (or refuses them as they arrive), and one lane per asker ([`Lanes`]) runs an asker's asks one
//! at a time, in arrival order.

use super::{Handler, Probe};
use async_nats::Subscriber;
use cyrene_bus::trace;
use cyrene_protocol::comm::Ask;
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

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
pub(super) async fn serve_asks<H: Handler>(
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
