//! Tracing setup shared by every Cyrene binary (docs/architecture.md §1 "Logs via tracing").
//!
//! Owns the process-wide subscriber: human-readable logs when stderr is a terminal, one JSON
//! object per line otherwise, `RUST_LOG` filtering (default `info`), and an OpenTelemetry layer so
//! every `tracing` span has a W3C trace context that `cyrene-bus` can inject into NATS headers.
//!
//! Spans are exported over OTLP (HTTP, protobuf) when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used
//! as given) or `OTEL_EXPORTER_OTLP_ENDPOINT` (`/v1/traces` appended) is set, with the service
//! name as `service.name` (or `OTEL_SERVICE_NAME` when set); `OTEL_EXPORTER_OTLP_HEADERS` and
//! `OTEL_EXPORTER_OTLP_TIMEOUT` are honoured by the exporter. Export runs on the batch
//! processor's own thread, off the request path; an unreachable collector costs dropped spans (silently: the SDK's own logs are off), never
//! a request. At exit the queued spans are flushed, bounded by `OTEL_EXPORTER_OTLP_TIMEOUT`.
//!
//! # Pitfalls
//! - Without the OpenTelemetry layer, spans carry no trace id and nothing is propagated; so the
//!   layer is always installed, even when nothing is exported.
//! - `RUST_LOG` filters the *logs* only: spans are recorded at `info` and above whatever it says,
//!   so a service with quiet logs still propagates and exports its traces.
//! - [`init`] may be called more than once (tests); only the first call installs anything.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::io::IsTerminal;
use tracing_subscriber::filter::LevelFilter;
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
        // Flushes the spans still queued; a collector that is gone by now loses them, and the
        // process is exiting anyway.
        let _ = self.provider.shutdown();
    }
}

/// Where spans go, from the standard OpenTelemetry variables: the traces endpoint as given, or
/// the base endpoint with `/v1/traces`; `None` (no export) when neither is set or both are empty.
pub fn otlp_traces_endpoint(
    traces_endpoint: Option<&str>,
    endpoint: Option<&str>,
) -> Option<String> {
    fn given(v: Option<&str>) -> Option<&str> {
        v.map(str::trim).filter(|v| !v.is_empty())
    }
    if let Some(url) = given(traces_endpoint) {
        return Some(url.to_owned());
    }
    given(endpoint).map(|base| format!("{}/v1/traces", base.trim_end_matches('/')))
}

/// The tracer provider of `service`, exporting to `otlp` (a traces URL) when given. An exporter
/// that cannot be built leaves the provider without one and says why.
pub fn tracer_provider(
    service: &'static str,
    otlp: Option<&str>,
) -> (SdkTracerProvider, Option<String>) {
    // `OTEL_SERVICE_NAME` (the OpenTelemetry convention) names the service when set: several
    // deployments of one binary can be told apart; the binary's name otherwise.
    let name = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|n| !n.trim().is_empty())
        .unwrap_or_else(|| service.to_owned());
    let resource = Resource::builder().with_service_name(name).build();
    let builder = SdkTracerProvider::builder().with_resource(resource);
    let Some(url) = otlp else {
        return (builder.build(), None);
    };
    // reqwest is built without a default TLS provider (no aws-lc C build): install ring's for
    // an https collector, unless the process already installed one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .build()
    {
        Ok(exporter) => (builder.with_batch_exporter(exporter).build(), None),
        Err(err) => (
            builder.build(),
            Some(format!("OTLP export to {url} disabled: {err}")),
        ),
    }
}

/// Installs the global subscriber for `service` at `info` unless `RUST_LOG` says otherwise.
/// Log lines go to stderr.
pub fn init(service: &'static str) -> Telemetry {
    init_with(service, "info")
}

/// Like [`init`] with another default filter (the CLI keeps quiet below `warn`).
pub fn init_with(service: &'static str, default_filter: &str) -> Telemetry {
    let env = |name: &str| std::env::var(name).ok();
    let otlp = otlp_traces_endpoint(
        env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").as_deref(),
        env("OTEL_EXPORTER_OTLP_ENDPOINT").as_deref(),
    );
    let (provider, problem) = tracer_provider(service, otlp.as_deref());
    let tracer = provider.tracer(service);
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // CYRENE_LOG_FORMAT: `json` or `text` forces one; otherwise text on a terminal, JSON else.
    let json = match env("CYRENE_LOG_FORMAT").as_deref().map(str::trim) {
        Some("json") => true,
        Some("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let fmt = if !json {
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
    let spans = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(LevelFilter::INFO);
    let _ = tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(spans)
        .try_init();
    match (problem, otlp) {
        (Some(problem), _) => tracing::warn!("{problem}"),
        (None, Some(url)) => tracing::info!(endpoint = %url, "exporting spans over OTLP"),
        (None, None) => {}
    }
    Telemetry { provider }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::Tracer as _;

    #[test]
    fn the_endpoint_comes_from_the_standard_variables() {
        assert_eq!(otlp_traces_endpoint(None, None), None);
        assert_eq!(otlp_traces_endpoint(Some(" "), Some("")), None);
        assert_eq!(
            otlp_traces_endpoint(None, Some("http://otel:4318/")).as_deref(),
            Some("http://otel:4318/v1/traces")
        );
        assert_eq!(
            otlp_traces_endpoint(Some("http://c/x"), Some("http://otel:4318")).as_deref(),
            Some("http://c/x")
        );
    }

    #[test]
    fn spans_reach_an_otlp_collector_with_the_service_name() {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let collector = runtime.block_on(cyrene_test_support::otlp::collector());
        let url = format!("{}/v1/traces", collector.uri());
        let (provider, problem) = tracer_provider("cyrene-telemetry-test", Some(&url));
        assert_eq!(problem, None);
        provider
            .tracer("test")
            .in_span("turn-span-under-test", |_| {});
        provider.shutdown().unwrap();

        let requests = runtime
            .block_on(collector.received_requests())
            .unwrap_or_default();
        assert_eq!(requests.len(), 1, "one export batch");
        let request = &requests[0];
        assert_eq!(
            request
                .headers
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/x-protobuf")
        );
        let body = String::from_utf8_lossy(&request.body);
        assert!(
            body.contains("turn-span-under-test"),
            "span name in {body:?}"
        );
        assert!(
            body.contains("cyrene-telemetry-test"),
            "service.name in {body:?}"
        );
    }

    #[test]
    fn without_an_endpoint_nothing_is_exported() {
        let (provider, problem) = tracer_provider("cyrene-telemetry-test", None);
        assert_eq!(problem, None);
        provider.tracer("test").in_span("quiet", |_| {});
        provider.shutdown().unwrap();
    }
}
