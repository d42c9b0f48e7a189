//! The one retry policy: exponential backoff with jitter (the schedule comes from `backon`), as
//! used by every loop that keeps trying something the bus or a peer may not be ready for yet —
//! creating the turn stream and the worker consumer at start, reporting a completed turn.
//!
//! # Invariants
//! - [`retry`]: only the pause between attempts is cut short by shutdown: an attempt under way
//!   finishes (a completion report in flight is not abandoned half-sent).
//! - [`until_ready`] (start-up calls, whose result nobody needs once the process stops): an
//!   attempt under way is abandoned too, so a process that cannot reach the bus stops at once
//!   on a signal instead of waiting out a request timeout.
//! - Jitter spreads the retries of many processes restarted together (a NATS outage ends for
//!   every worker at once).

use backon::BackoffBuilder;
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A backoff: the first pause, doubled after each failure up to `max` (each with random
/// jitter of up to one more pause), forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    pub first: Duration,
    pub max: Duration,
}

/// Start-up calls (stream, consumer): 100 ms doubling to 2 s.
pub const STARTUP: Backoff = Backoff {
    first: Duration::from_millis(100),
    max: Duration::from_secs(2),
};

/// Reports a peer must take (a turn's completion): 50 ms doubling to 2 s.
pub const REPORT: Backoff = Backoff {
    first: Duration::from_millis(50),
    max: Duration::from_secs(2),
};

impl Backoff {
    /// The pauses, one per failure.
    pub fn delays(&self) -> impl Iterator<Item = Duration> + use<> {
        let max = self.max;
        backon::ExponentialBuilder::default()
            .with_min_delay(self.first)
            .with_max_delay(self.max)
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build()
            .chain(std::iter::repeat(max))
    }
}

/// Calls `call` until it returns `Ok`, pausing by `policy` after each `Err` (given to `failed`,
/// for the log); `None` when `shutdown` fires during a pause.
pub async fn retry<T, E, F, Fut>(
    policy: Backoff,
    shutdown: &CancellationToken,
    mut call: F,
    mut failed: impl FnMut(&E),
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut delays = policy.delays();
    loop {
        match call().await {
            Ok(value) => return Some(value),
            Err(err) => failed(&err),
        }
        let delay = delays.next().unwrap_or(policy.max);
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// [`retry`] for start-up calls: shutdown also abandons the attempt under way; `None` when it
/// fired before an attempt succeeded.
pub async fn until_ready<T, E, F, Fut>(
    policy: Backoff,
    shutdown: &CancellationToken,
    mut call: F,
    failed: impl FnMut(&E),
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let attempts = retry(policy, shutdown, &mut call, failed);
    tokio::select! {
        got = attempts => got,
        _ = shutdown.cancelled() => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_within_their_bounds_and_never_end() {
        let policy = Backoff {
            first: Duration::from_millis(10),
            max: Duration::from_millis(80),
        };
        let delays: Vec<Duration> = policy.delays().take(12).collect();
        assert_eq!(delays.len(), 12);
        for d in &delays {
            assert!(*d >= policy.first && *d <= policy.max * 2, "{d:?}");
        }
        assert!(delays[6] >= Duration::from_millis(80), "{delays:?}");
    }

    #[tokio::test]
    async fn retries_until_ok_and_stops_on_shutdown() {
        let policy = Backoff {
            first: Duration::from_millis(1),
            max: Duration::from_millis(2),
        };
        let shutdown = CancellationToken::new();
        let mut calls = 0;
        let mut failures = 0;
        let got = retry(
            policy,
            &shutdown,
            || {
                calls += 1;
                let n = calls;
                async move { if n < 4 { Err("not yet") } else { Ok(n) } }
            },
            |_| failures += 1,
        )
        .await;
        assert_eq!((got, failures), (Some(4), 3));
        shutdown.cancel();
        let got: Option<()> = retry(policy, &shutdown, || async { Err("never") }, |_| {}).await;
        assert_eq!(got, None);
    }

    /// In paused time a sleep ends exactly when its deadline comes, so the gaps between
    /// attempts are the pauses the policy chose: each is the doubled base (capped at `max`) plus
    /// jitter of at most one more base, and none is shorter than its base.
    #[tokio::test(start_paused = true)]
    async fn the_pauses_between_attempts_double_up_to_the_cap() {
        let policy = Backoff {
            first: Duration::from_secs(1),
            max: Duration::from_secs(8),
        };
        let shutdown = CancellationToken::new();
        let mut at = Vec::new();
        let got = retry(
            policy,
            &shutdown,
            || {
                at.push(tokio::time::Instant::now());
                let n = at.len();
                async move { if n < 8 { Err(()) } else { Ok(n) } }
            },
            |_| {},
        )
        .await;
        assert_eq!(got, Some(8));
        let gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
        let bases = [1, 2, 4, 8, 8, 8, 8].map(Duration::from_secs);
        for (gap, base) in gaps.iter().zip(bases) {
            assert!(
                *gap >= base && *gap <= base * 2,
                "gap {gap:?} for a base of {base:?}: {gaps:?}"
            );
        }
    }

    /// Shutdown cuts a pause short — an hour-long one ends when shutdown fires, not an hour
    /// later — but never an attempt under way: one that has started finishes and its value is
    /// returned.
    #[tokio::test(start_paused = true)]
    async fn shutdown_cuts_a_pause_short_but_not_an_attempt() {
        let hour = Backoff {
            first: Duration::from_secs(3600),
            max: Duration::from_secs(3600),
        };
        let shutdown = CancellationToken::new();
        let start = tokio::time::Instant::now();
        let waiting = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { retry(hour, &shutdown, || async { Err::<(), _>(()) }, |_| {}).await }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        shutdown.cancel();
        assert_eq!(waiting.await.unwrap(), None);
        assert!(
            start.elapsed() < Duration::from_secs(6),
            "{:?}",
            start.elapsed()
        );

        let shutdown = CancellationToken::new();
        let attempt = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                retry(
                    hour,
                    &shutdown,
                    || async {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        Ok::<_, ()>("reported")
                    },
                    |_| {},
                )
                .await
            }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        shutdown.cancel();
        assert_eq!(attempt.await.unwrap(), Some("reported"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_up_attempt_under_way_is_abandoned_on_shutdown() {
        let shutdown = CancellationToken::new();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.cancel();
        });
        // An attempt that would hang for an hour (a request to a bus that is not there).
        let started = tokio::time::Instant::now();
        let got: Option<()> = until_ready(
            STARTUP,
            &shutdown,
            || async {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                Err("timed out")
            },
            |_: &&str| {},
        )
        .await;
        assert_eq!(got, None);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
}
