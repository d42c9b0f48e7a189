//! The loop worker's configuration.

use cyrene_protocol::ids::{self, IdKind};
use cyrene_runtime::entry::{Problems, ServiceArgs};
use std::time::Duration;

/// In-progress acks per `ack_wait`: one every quarter, so three can be lost or late before a
/// live job is redelivered.
pub const PROGRESS_EVERY: u32 = 4;

/// The default `ack_wait`: a dead worker's turn is redelivered 190–250 ms after the kill
/// (docs/loop-worker.md, "Failover").
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_millis(250);

/// The shortest `ack_wait` accepted: in-progress acks go every [`PROGRESS_EVERY`]th of it, and
/// below 50 ms between them a busy machine's scheduling delays alone would take live jobs away.
pub const MIN_ACK_WAIT: Duration = Duration::from_millis(200);

/// Everything `run` needs; tests build it directly, `main` from flags and env.
#[derive(Debug, Clone)]
pub struct Config {
    /// Turns one worker process runs at once.
    pub concurrency: usize,
    /// The durable consumer shared by all workers.
    pub consumer: String,
    /// Redelivery after this long without an ack or an in-progress ack. It bounds failover: a
    /// SIGKILLed worker's turn moves to another worker within `ack_wait`. A live worker sends an
    /// in-progress ack every [`PROGRESS_EVERY`]th of it whatever it is waiting on, so a slow model
    /// call or tool never looks like a dead worker.
    pub ack_wait: Duration,
    /// Deliveries of one job before it is given up and reported as an error.
    pub max_deliver: u32,
    /// Extractions of one PDF that never ended (each one a worker that died extracting it)
    /// after which the document is not extracted again (crate::extractions).
    pub poison_after: u32,
    /// How long to wait for a nak'ed (retryable) job before redelivery.
    pub retry_delay: Duration,
    pub model_timeout: Duration,
    pub checkpoint_timeout: Duration,
    pub steer_timeout: Duration,
    pub tool_timeout: Duration,
    /// `ask_agent` deadline.
    pub ask_timeout: Duration,
    /// How often external tools are rediscovered.
    pub tool_refresh: Duration,
    /// How long shutdown lets running turns finish before leaving them to redelivery.
    pub shutdown_grace: Duration,
    /// Replicas of the `CYRENE_TURNS` stream; the same value as the orchestrator's.
    pub turns_replicas: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            concurrency: 8,
            consumer: "cyrene-loop-worker".to_owned(),
            ack_wait: DEFAULT_ACK_WAIT,
            max_deliver: 10,
            poison_after: 2,
            retry_delay: Duration::from_secs(1),
            model_timeout: Duration::from_secs(120),
            checkpoint_timeout: Duration::from_secs(5),
            steer_timeout: Duration::from_secs(2),
            tool_timeout: Duration::from_secs(60),
            ask_timeout: Duration::from_secs(30),
            tool_refresh: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(10),
            turns_replicas: cyrene_bus::streams::DEFAULT_TURNS_REPLICAS,
        }
    }
}

impl Config {
    /// Refuses settings that cannot work.
    pub fn validate(&self) -> Result<(), Problems> {
        let mut problems = Vec::new();
        for (name, n) in [
            ("concurrency", self.concurrency),
            ("turns_replicas", self.turns_replicas),
            ("max_deliver", self.max_deliver as usize),
        ] {
            if n == 0 {
                problems.push(format!("{name} must be at least 1"));
            }
        }
        if self.max_deliver > cyrene_protocol::turn::MAX_JOB_DELIVERIES {
            problems.push(format!(
                "max_deliver must be at most {} (a job continued after its approvals starts its \
                 attempts that far past the job before it)",
                cyrene_protocol::turn::MAX_JOB_DELIVERIES
            ));
        }
        if self.poison_after == 0 {
            problems.push("poison_after must be at least 1".to_owned());
        }
        if self.ack_wait < MIN_ACK_WAIT {
            problems.push(
                "ack_wait must be at least 200ms (in-progress acks go every quarter)".to_owned(),
            );
        }
        for (name, d) in [
            ("model_timeout", self.model_timeout),
            ("tool_timeout", self.tool_timeout),
            ("checkpoint_timeout", self.checkpoint_timeout),
            ("steer_timeout", self.steer_timeout),
            ("ask_timeout", self.ask_timeout),
            ("tool_refresh", self.tool_refresh),
        ] {
            if d.is_zero() {
                problems.push(format!("{name} must be longer than zero"));
            }
        }
        // A consumer name is one subject token.
        if ids::validate(IdKind::Leg, &self.consumer).is_err() {
            problems.push(format!(
                "consumer {:?} must be 1-128 of [A-Za-z0-9_-]",
                self.consumer
            ));
        }
        Problems::check(problems)
    }
}

/// Command line and environment of the `cyrene-loop-worker` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "cyrene-loop-worker",
    version,
    about = "Cyrene loop worker: runs turn jobs from the CYRENE_TURNS work queue."
)]
pub struct Args {
    #[command(flatten)]
    pub common: cyrene_runtime::entry::ServiceFlags,
    /// Turns this process runs at once.
    #[arg(long, env = "CYRENE_WORKER_CONCURRENCY", default_value_t = 8)]
    pub concurrency: usize,
    /// Redelivery delay of a job whose worker stopped acking: the failover time after a worker
    /// dies (live workers send in-progress acks every quarter of it).
    #[arg(long, env = "CYRENE_WORKER_ACK_WAIT", default_value = "250ms", value_parser = humantime::parse_duration)]
    pub ack_wait: Duration,
    /// Deliveries of a job before it is reported as failed.
    #[arg(long, env = "CYRENE_WORKER_MAX_DELIVER", default_value_t = 10)]
    pub max_deliver: u32,
    /// Extractions of one PDF that never ended (workers that died extracting it) before the
    /// document is not extracted again (docs/loop-worker.md, "Poison documents").
    #[arg(long, env = "CYRENE_WORKER_POISON_AFTER", default_value_t = 2)]
    pub poison_after: u32,
    /// Deadline of one model call (the whole fallback chain).
    #[arg(long, env = "CYRENE_WORKER_MODEL_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    pub model_timeout: Duration,
    /// Deadline of one external tool call.
    #[arg(long, env = "CYRENE_WORKER_TOOL_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub tool_timeout: Duration,
    /// Replicas of the CYRENE_TURNS stream (e.g. 3 on a 3-node cluster); the orchestrator's value.
    #[arg(long, env = "CYRENE_WORKER_TURNS_REPLICAS", default_value_t = cyrene_bus::streams::DEFAULT_TURNS_REPLICAS)]
    pub turns_replicas: usize,
    /// The durable JetStream consumer every worker shares (one name per deployment).
    #[arg(
        long,
        env = "CYRENE_WORKER_CONSUMER",
        default_value = "cyrene-loop-worker"
    )]
    pub consumer: String,
    /// How long a retryable (nak'ed) job waits before it is delivered again.
    #[arg(long, env = "CYRENE_WORKER_RETRY_DELAY", default_value = "1s", value_parser = humantime::parse_duration)]
    pub retry_delay: Duration,
    /// Deadline of one checkpoint store request.
    #[arg(long, env = "CYRENE_WORKER_CHECKPOINT_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub checkpoint_timeout: Duration,
    /// Deadline of one orchestrator request at a step boundary (steer, complete).
    #[arg(long, env = "CYRENE_WORKER_STEER_TIMEOUT", default_value = "2s", value_parser = humantime::parse_duration)]
    pub steer_timeout: Duration,
    /// Deadline of the ask_agent tool (one ask to another agent).
    #[arg(long, env = "CYRENE_WORKER_ASK_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub ask_timeout: Duration,
    /// How often external tools are discovered again.
    #[arg(long, env = "CYRENE_WORKER_TOOL_REFRESH", default_value = "30s", value_parser = humantime::parse_duration)]
    pub tool_refresh: Duration,
    /// How long a stopping worker lets running turns finish before leaving them to redelivery.
    #[arg(long, env = "CYRENE_WORKER_SHUTDOWN_GRACE", default_value = "10s", value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,
}

impl ServiceArgs for Args {
    type Config = Config;

    fn into_config(self) -> Result<Config, Problems> {
        let config = Config {
            concurrency: self.concurrency,
            consumer: self.consumer,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
            retry_delay: self.retry_delay,
            poison_after: self.poison_after,
            model_timeout: self.model_timeout,
            checkpoint_timeout: self.checkpoint_timeout,
            steer_timeout: self.steer_timeout,
            tool_timeout: self.tool_timeout,
            ask_timeout: self.ask_timeout,
            tool_refresh: self.tool_refresh,
            shutdown_grace: self.shutdown_grace,
            turns_replicas: self.turns_replicas,
        };
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A job continued after its approvals starts its attempts `MAX_JOB_DELIVERIES` past the job
    /// before it: more deliveries than that could take an attempt number of the new job.
    #[test]
    fn max_deliver_is_bounded_by_what_a_continued_job_skips() {
        let most = cyrene_protocol::turn::MAX_JOB_DELIVERIES;
        let at = |max_deliver| Config {
            max_deliver,
            ..Config::default()
        };
        assert!(at(most).validate().is_ok());
        assert!(at(1).validate().is_ok());
        for refused in [0, most + 1, u32::MAX] {
            assert!(at(refused).validate().is_err(), "{refused}");
        }
    }
}
