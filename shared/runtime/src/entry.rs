//! One entry shape for every service binary: `main` is a single call to [`main`], which owns
//! telemetry, the configuration check, the NATS connection, signals and the exit code.
//!
//! A service library exports `Args` (clap: every setting a flag with an env var) implementing
//! [`ServiceArgs`], a `Config`, and `run(config, client, shutdown)`. `cyrene up` builds the same
//! `Args` from the environment ([`ServiceArgs::from_env`]), so every env var a service honours
//! works there too.
//!
//! # Exit codes (the same for every binary)
//! - 0: stopped cleanly (SIGINT/SIGTERM) — also when the signal comes before the service got
//!   going (the bus not reachable yet): the service returns at once, and an error it reports
//!   after the signal is logged, not an exit code of 1;
//! - 1: a runtime failure (NATS unreachable at start, a database that cannot be opened, …);
//! - 2: an invalid configuration — every problem is listed on stderr at once.
//!
//! # Health
//! With `--health-addr`/`CYRENE_HEALTH_ADDR` set ([`HealthArgs`], part of every `Args`' [`ServiceFlags`]),
//! [`main`] serves `/livez`, `/readyz` and `/metrics` there ([`crate::health`]) from before the
//! NATS connection until exit. It registers the readiness checks `nats` (kept equal to the
//! connection state) and the service's name, which the service's `run` sets once it serves;
//! SIGINT/SIGTERM makes `/readyz` answer 503 while the service drains.

use async_nats::Client;
use cyrene_bus::{BusArgs, ConnectMode};
use std::future::Future;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

/// Every problem found in a configuration, so an operator fixes them in one go.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.join("; "))]
pub struct Problems(pub Vec<String>);

impl Problems {
    /// `Ok(())` when `problems` is empty.
    pub fn check(problems: Vec<String>) -> Result<(), Problems> {
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Problems(problems))
        }
    }
}

/// The health flag every service binary has: `#[command(flatten)] pub health: HealthArgs`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct HealthArgs {
    /// Address of the HTTP listener for /livez, /readyz and /metrics (Prometheus), e.g.
    /// 0.0.0.0:9090. Off when unset.
    #[arg(long, env = "CYRENE_HEALTH_ADDR")]
    pub health_addr: Option<std::net::SocketAddr>,
}

/// The flags every service binary shares, flattened once into each `Args`:
/// `#[command(flatten)] pub common: ServiceFlags`. [`main`] reads them from the same command
/// line as the `Args` ([`crate::env::parse_with_part`]).
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceFlags {
    /// How to reach the bus (URLs and credentials).
    #[command(flatten)]
    pub bus: BusArgs,
    /// Where to serve health and metrics (`None`: nowhere).
    #[command(flatten)]
    pub health: HealthArgs,
}

/// The flags and env of a service binary; they flatten [`ServiceFlags`].
pub trait ServiceArgs: clap::Parser + Sized {
    /// What the service's `run` takes.
    type Config;

    /// The checked configuration, or every problem with it.
    fn into_config(self) -> Result<Self::Config, Problems>;

    /// The arguments as the environment alone sets them (no flags): what `cyrene up` starts a
    /// service with, so the service's env vars apply there too.
    /// Old env names ([`crate::env::RENAMED`]) still apply, each with a logged warning.
    fn from_env(binary: &str) -> Result<Self, clap::Error> {
        let (args, warnings) = crate::env::parse::<Self>([binary], &crate::env::process)?;
        for warning in &warnings {
            warning.log();
        }
        Ok(args)
    }
}

/// A service failure that may be a configuration problem found only while starting (a personas
/// file that does not parse, a database URL of an unknown scheme). Services implement it with
/// [`crate::run_error!`].
pub trait RunError: std::error::Error + 'static {
    fn is_config(&self) -> bool {
        false
    }
}

/// Implements [`RunError`] for a service's error enum whose one variant `$error::$variant` holds
/// its configuration failures (they exit 2, every other failure 1): `run_error!(Error::Config);`.
#[macro_export]
macro_rules! run_error {
    ($error:ident :: $variant:ident) => {
        impl $crate::entry::RunError for $error {
            fn is_config(&self) -> bool {
                matches!(self, $error::$variant(..))
            }
        }
    };
}

/// The whole `main` of a service binary: parse `A`, set up telemetry, check the configuration,
/// connect as `service` (its inbox prefix is `_INBOX_<service>`), run until SIGINT/SIGTERM.
pub fn main<A, F, Fut, E>(service: &'static str, run: F) -> ExitCode
where
    A: ServiceArgs,
    F: FnOnce(A::Config, Client, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: RunError,
{
    let parsed =
        crate::env::parse_with_part::<A, ServiceFlags>(std::env::args_os(), &crate::env::process);
    let (args, common, warnings) = match parsed {
        Ok(parsed) => parsed,
        // --help and --version exit 0, a flag clap refuses 2.
        Err(err) => err.exit(),
    };
    let _telemetry = cyrene_telemetry::init(service);
    for warning in &warnings {
        warning.log();
    }
    let health_addr = common.health.health_addr;
    let bus = common.bus.config(service, ConnectMode::Service);
    let config = match (bus.as_ref(), args.into_config()) {
        (Ok(_), Ok(config)) => config,
        (bus, config) => {
            let mut problems = config.err().map(|p| p.0).unwrap_or_default();
            if let Err(problem) = bus {
                problems.push(problem.clone());
            }
            let problems = Problems(problems);
            tracing::error!(%problems, "invalid configuration");
            eprintln!("{service}: invalid configuration:");
            for problem in &problems.0 {
                eprintln!("  - {problem}");
            }
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("{service}: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let Ok(bus) = bus else {
        return ExitCode::from(2);
    };
    runtime.block_on(async move {
        // Signals are handled from the very start, whatever the connection's state: `signal` is
        // cancelled only by one, `shutdown` by it or by the service itself.
        let signal = CancellationToken::new();
        let shutdown = CancellationToken::new();
        tokio::spawn({
            let (signal, shutdown) = (signal.clone(), shutdown.clone());
            async move {
                crate::signal::cancel_on_signal(signal).await;
                shutdown.cancel();
            }
        });
        let health = crate::health::global();
        health.set(crate::health::NATS_CHECK, false);
        health.set(service, false);
        let listener = CancellationToken::new();
        let _stop_listener = listener.clone().drop_guard();
        if let Some(addr) = health_addr
            && let Err(err) = crate::health::serve(addr, listener.clone()).await
        {
            tracing::error!(error = %err, "cannot serve health and metrics");
            eprintln!("{service}: {err}");
            return ExitCode::FAILURE;
        }
        let client = match cyrene_bus::connect(&bus).await {
            Ok(client) => client,
            Err(err) => {
                tracing::error!(error = %err, "cannot connect to NATS");
                eprintln!("{service}: cannot connect to NATS: {err}");
                return ExitCode::FAILURE;
            }
        };
        // Aborted when dropped, at exit.
        let mut health_tasks = tokio::task::JoinSet::new();
        health_tasks.spawn(crate::health::follow_connection(
            client.clone(),
            listener.clone(),
        ));
        {
            let shutdown = shutdown.clone();
            health_tasks.spawn(async move {
                shutdown.cancelled().await;
                health.drain();
            });
        }
        match run(config, client, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) if signal.is_cancelled() && !err.is_config() => {
                let err = with_sources(&err);
                tracing::warn!(error = %err, "{service} stopped on a signal before it was running");
                ExitCode::SUCCESS
            }
            Err(err) => {
                let (config, err) = (err.is_config(), with_sources(&err));
                tracing::error!(error = %err, "{service} failed");
                eprintln!("{service}: {err}");
                ExitCode::from(if config { 2 } else { 1 })
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_all_kept() {
        assert!(Problems::check(vec![]).is_ok());
        let err = Problems::check(vec!["a must be 1".into(), "b is missing".into()]).unwrap_err();
        assert_eq!(err.0.len(), 2);
        assert_eq!(err.to_string(), "a must be 1; b is missing");
    }
}

/// `err` and each of its sources, outermost first: `a: b: c` (a source already in its
/// wrapper's text is not repeated).
pub fn with_sources(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let said = cause.to_string();
        if !text.contains(&said) {
            text = format!("{text}: {said}");
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod sources_tests {
    use super::with_sources;

    #[derive(Debug, thiserror::Error)]
    #[error("nats: cannot subscribe")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn an_error_is_told_with_its_sources_once() {
        let io = std::io::Error::other("connection refused");
        assert_eq!(
            with_sources(&Outer(io)),
            "nats: cannot subscribe: connection refused"
        );
        let said = std::io::Error::other("x");
        assert_eq!(with_sources(&said), "x");
    }
}
