//! Tracing setup shared by every Cyrene binary (DESIGN §1 "Logs via tracing").
//!
//! Owns the process-wide subscriber: human-readable logs when stderr is a terminal, one JSON
//! object per line otherwise, `RUST_LOG` filtering (default `info`), and an OpenTelemetry layer so
//! every `tracing` span has a W3C trace context that `cyrene-bus` can inject into NATS headers.
//!
//! # Pitfalls
//! - Without the OpenTelemetry layer, spans carry no trace id and nothing is propagated; so the
//!   layer is always installed, even when nothing is exported.
//! - [`init`] may be called more than once (tests); only the first call installs anything.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::io::IsTerminal;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Keeps the tracer provider alive; dropping it flushes and shuts it down.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        // Nothing is exported yet, so a failed shutdown loses nothing worth reporting.
        let _ = self.provider.shutdown();
    }
}

/// Installs the global subscriber for `service` at `info` unless `RUST_LOG` says otherwise.
/// Log lines go to stderr.
pub fn init(service: &'static str) -> Telemetry {
    init_with(service, "info")
}

/// Like [`init`] with another default filter (the CLI keeps quiet below `warn`).
pub fn init_with(service: &'static str, default_filter: &str) -> Telemetry {
    let provider = SdkTracerProvider::builder().build();
    let tracer = provider.tracer(service);
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let fmt = if std::io::stderr().is_terminal() {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed()
    };
    // A second init (tests) keeps the first subscriber: not an error worth surfacing.
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init();
    Telemetry { provider }
}
