//! The JetStream side: pulling turn jobs from `CYRENE_TURNS`, keeping them alive while they run,
//! acking, redelivery, and giving up on exhausted jobs.
//!
//! # Invariants
//! - One durable pull consumer shared by every worker: each job runs on one worker at a time.
//!   A worker pulls no more jobs than it has free slots, so no pulled job waits unheard.
//! - While a turn runs, an in-progress ack goes out every quarter of `ack_wait` from its own task,
//!   whatever the turn is waiting on; a worker that dies stops sending them and the job is
//!   redelivered to another worker within `ack_wait` (the failover time; 250 ms by default).
//! - The consumer is created **or updated** at start, so a changed `ack_wait` or `max_deliver`
//!   takes effect; every worker of a deployment should run with the same values.
//! - A job is acked only after its completion was acknowledged by the orchestrator, so a crash
//!   between the two re-runs nothing: the redelivered job finds the settled checkpoint and
//!   reports again (completion is idempotent). For the same reason the ack asks for no
//!   confirmation: an ack the server never got is that same harmless redelivery, so waiting for
//!   the server's answer would cost a message and a round trip a turn for nothing.
//! - An exhausted job (`max_deliver` deliveries without an ack) is reported to the orchestrator
//!   as an `error` completion and a session `error` event, then deleted from the stream.
//!
//! # Pitfalls
//! - The attempt number is the JetStream delivery count (plus the job's `attempt_base`, for a
//!   job that continues a turn after its approvals); fencing relies on it growing.
//! - A stale attempt (fenced off) neither acks nor naks: the live attempt owns the job.

use crate::config::Config;
use crate::nats::NatsPorts;
use crate::ports::TurnPorts;
use crate::runner::{RunnerConfig, TurnEnd, run_turn};
use async_nats::Client;
use async_nats::jetstream::{self, AckKind, consumer::pull};
use cyrene_bus::pull::{AtShutdown, Pull};
use cyrene_bus::{RequestError, request_json, streams};
use cyrene_protocol::session::{SessionEvent, SessionEventType};
use cyrene_protocol::turn::{TurnComplete, TurnCompleteAck, TurnJob, TurnOutcome};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use futures::StreamExt;
use serde::Deserialize;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long one pull request waits for jobs.
const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// Consumer config of the shared durable consumer.
pub fn consumer_config(config: &Config) -> pull::Config {
    pull::Config {
        durable_name: Some(config.consumer.clone()),
        description: Some("Cyrene loop workers (shared)".to_owned()),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait,
        max_deliver: i64::from(config.max_deliver),
        filter_subject: subjects::TURN_RUN.to_owned(),
        max_ack_pending: 10_000,
        ..Default::default()
    }
}

/// Pulls and runs jobs until `shutdown`.
pub(crate) async fn pull_loop(
    config: Arc<Config>,
    client: Client,
    consumer: jetstream::consumer::Consumer<pull::Config>,
    ports: Arc<NatsPorts>,
    shutdown: CancellationToken,
) {
    let pull = Pull {
        what: "turn jobs",
        concurrency: config.concurrency,
        expires: PULL_EXPIRES,
        grace: config.shutdown_grace,
        // A job pulled is a job started: it runs even when shutdown fires meanwhile.
        at_shutdown: AtShutdown::RunDelivered,
    };
    cyrene_bus::pull::consume(&client, &consumer, pull, &shutdown, |message| {
        let (config, client, ports, shutdown) = (
            config.clone(),
            client.clone(),
            ports.clone(),
            shutdown.clone(),
        );
        async move { handle_job(message, &config, &client, ports.as_ref(), &shutdown).await }
    })
    .await;
}

async fn handle_job(
    message: jetstream::Message,
    config: &Config,
    client: &Client,
    ports: &NatsPorts,
    shutdown: &CancellationToken,
) {
    let delivered = message
        .info()
        .map(|i| u32::try_from(i.delivered).unwrap_or(u32::MAX))
        .unwrap_or(1);
    let job: TurnJob = match serde_json::from_slice(&message.payload) {
        Ok(job) => job,
        Err(err) => {
            // Nothing can ever run it: terminate it loudly rather than redeliver forever.
            tracing::error!(error = %err, payload = %String::from_utf8_lossy(&message.payload),
                "invalid turn job terminated");
            let _ = message.ack_with(AckKind::Term).await;
            metrics::counter!("cyrene_turns_failed_total", "reason" => "invalid_job").increment(1);
            return;
        }
    };
    // A job that continues a turn after its approvals counts on from the attempts before it.
    let attempt = job.attempt_base.saturating_add(delivered);
    metrics::counter!("cyrene_turns_started_total").increment(1);
    if delivered > 1 {
        metrics::counter!("cyrene_turn_redeliveries_total").increment(1);
    }
    let message = Arc::new(message);
    let every = config.ack_wait / crate::config::PROGRESS_EVERY;
    let heartbeat = tokio::spawn(keep_alive(message.clone(), every));
    // The turn joins the trace of the message that started it (the orchestrator publishes the
    // job with the caller's trace context), so one turn is one trace across every service.
    let span = tracing::info_span!(
        "turn",
        turn = %job.turn_id,
        session = %job.session_id,
        attempt,
        trace_id = tracing::field::Empty
    );
    cyrene_bus::trace::set_parent(&span, message.headers.as_ref());
    let runner = RunnerConfig {
        purpose: "chat".to_owned(),
        max_attempts: config.max_deliver,
    };
    let end =
        tracing::Instrument::instrument(run_turn(ports, &job, attempt, &runner), span.clone())
            .await;
    record_end(&end);
    match end {
        TurnEnd::Complete(done) => {
            match tracing::Instrument::instrument(report(client, &done, shutdown), span).await {
                Reported::Acknowledged => {
                    if let Err(err) = message.ack().await {
                        tracing::warn!(turn = %job.turn_id, error = %err, "job ack failed; a redelivery will report again");
                    }
                }
                Reported::Stale => tracing::info!(turn = %job.turn_id, "completion fenced off"),
                Reported::ShuttingDown => {}
            }
        }
        TurnEnd::Retry(err) => {
            tracing::info!(turn = %job.turn_id, error = %err, "nak for redelivery");
            let _ = message
                .ack_with(AckKind::Nak(Some(config.retry_delay)))
                .await;
        }
        TurnEnd::Stale => {}
    }
    heartbeat.abort();
}

/// How a turn attempt ended, in the metrics (docs/operations.md): `completed{outcome}` with its
/// step count when it reached an end, `failed{reason}` when it did not.
fn record_end(end: &TurnEnd) {
    match end {
        TurnEnd::Complete(done) => {
            let outcome = match done.outcome {
                TurnOutcome::Final => "final",
                TurnOutcome::BudgetExhausted => "budget_exhausted",
                TurnOutcome::Cancelled => "cancelled",
                TurnOutcome::Error => "error",
                TurnOutcome::AwaitingApproval => "awaiting_approval",
            };
            metrics::counter!("cyrene_turns_completed_total", "outcome" => outcome).increment(1);
            if done.outcome == TurnOutcome::Error {
                metrics::counter!("cyrene_turns_failed_total", "reason" => "error").increment(1);
            }
            metrics::histogram!("cyrene_turn_steps").record(f64::from(done.steps));
        }
        TurnEnd::Retry(_) => {
            metrics::counter!("cyrene_turns_failed_total", "reason" => "retry").increment(1);
        }
        TurnEnd::Stale => {
            metrics::counter!("cyrene_turns_failed_total", "reason" => "stale").increment(1);
        }
    }
}

/// Samples the consumer's `num_ack_pending` and `num_pending` into gauges every `every`, until
/// `shutdown`.
pub(crate) async fn sample_consumer(
    mut consumer: jetstream::consumer::PullConsumer,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        match consumer.info().await {
            Ok(info) => {
                metrics::gauge!("cyrene_turns_ack_pending").set(info.num_ack_pending as f64);
                metrics::gauge!("cyrene_turns_pending").set(info.num_pending as f64);
                metrics::gauge!("cyrene_turns_redelivered").set(info.num_redelivered as f64);
            }
            Err(err) => tracing::debug!(error = %err, "cannot sample the turn consumer"),
        }
    }
}

async fn keep_alive(message: Arc<jetstream::Message>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.tick().await; // the first tick is immediate
    loop {
        tick.tick().await;
        if let Err(err) = message.ack_with(AckKind::Progress).await {
            tracing::debug!(error = %err, "in-progress ack failed");
        }
    }
}

enum Reported {
    Acknowledged,
    Stale,
    ShuttingDown,
}

/// Sends the completion until the orchestrator acknowledges it (idempotent on its side).
async fn report(client: &Client, done: &TurnComplete, shutdown: &CancellationToken) -> Reported {
    let send = || async {
        let sent: Result<TurnCompleteAck, RequestError> = request_json(
            client,
            subjects::TURN_COMPLETE,
            done,
            Duration::from_secs(5),
        )
        .await;
        match sent {
            Ok(ack) => {
                tracing::info!(turn = %done.turn_id, outcome = ?done.outcome, first = ack.first, "turn completed");
                Ok(Reported::Acknowledged)
            }
            Err(RequestError::Remote(body)) if body.code == ErrorCode::Conflict => {
                Ok(Reported::Stale)
            }
            Err(RequestError::Remote(body)) if !body.code.is_retryable() => {
                // The orchestrator will never take it; keeping the job would loop forever.
                tracing::error!(turn = %done.turn_id, error = %body, "completion refused; giving up");
                Ok(Reported::Acknowledged)
            }
            Err(err) => Err(err),
        }
    };
    cyrene_bus::retry::retry(cyrene_bus::retry::REPORT, shutdown, send, |err| {
        tracing::warn!(turn = %done.turn_id, error = %err, "completion not acknowledged; retrying")
    })
    .await
    .unwrap_or(Reported::ShuttingDown)
}

#[derive(Debug, Deserialize)]
struct MaxDeliveriesAdvisory {
    stream_seq: u64,
    #[serde(default)]
    deliveries: u64,
}

/// Reports jobs JetStream gave up on (`max_deliver` reached without an ack).
pub(crate) async fn exhausted_jobs(
    config: Arc<Config>,
    client: Client,
    stream: jetstream::stream::Stream,
    ports: Arc<NatsPorts>,
    shutdown: CancellationToken,
) {
    let subject = format!(
        "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{}.{}",
        streams::TURNS_STREAM,
        config.consumer
    );
    let mut advisories = match client
        .queue_subscribe(subject, config.consumer.clone())
        .await
    {
        Ok(sub) => sub,
        Err(err) => {
            tracing::error!(error = %err, "cannot watch for exhausted jobs");
            return;
        }
    };
    loop {
        let advisory = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = advisories.next() => match next { Some(m) => m, None => break },
        };
        let Ok(advisory) = serde_json::from_slice::<MaxDeliveriesAdvisory>(&advisory.payload)
        else {
            continue;
        };
        let job = match stream.get_raw_message(advisory.stream_seq).await {
            Ok(raw) => serde_json::from_slice::<TurnJob>(&raw.payload),
            Err(err) => {
                tracing::warn!(seq = advisory.stream_seq, error = %err, "exhausted job not readable");
                continue;
            }
        };
        let Ok(job) = job else { continue };
        let error = ErrorBody::new(
            ErrorCode::Unavailable,
            format!(
                "the turn was given up after {} deliveries",
                advisory.deliveries
            ),
        );
        tracing::error!(turn = %job.turn_id, deliveries = advisory.deliveries, "turn job exhausted");
        let mut event = SessionEvent::new(SessionEventType::Error, job.session_id.clone());
        event.turn_id = job.turn_id.clone();
        event.leg_id = job.leg_id.clone();
        event.error = Some(error.clone());
        ports.publish(event).await;
        let done = TurnComplete {
            turn_id: job.turn_id.clone(),
            session_id: job.session_id.clone(),
            leg_id: job.leg_id.clone(),
            attempt: job
                .attempt_base
                .saturating_add(u32::try_from(advisory.deliveries).unwrap_or(u32::MAX)),
            outcome: TurnOutcome::Error,
            message: None,
            stop_reason: crate::resume::stop_reason::ERROR.to_owned(),
            steps: 0,
            steered_ids: Vec::new(),
            error: Some(error),
            approvals: Vec::new(),
        };
        if let Reported::Acknowledged = report(&client, &done, &shutdown).await {
            let _ = stream.delete_message(advisory.stream_seq).await;
        }
    }
}
