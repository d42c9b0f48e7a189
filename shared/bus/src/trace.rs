//! W3C trace context (`traceparent`, `tracestate`) in NATS headers, so one turn is one trace
//! across services (docs/architecture.md §1).
//!
//! The current `tracing` span's OpenTelemetry context is injected on every request and publish;
//! receivers extract it and make it the parent of their handling span. This needs the
//! OpenTelemetry layer that `cyrene-telemetry` installs; without it spans have no trace id and
//! nothing is injected (harmless).

use async_nats::HeaderMap;
use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        // The trace state is propagated from a received header: never let it panic a publish.
        let _ = crate::headers::insert(self.0, key, &value);
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// Writes `cx` into `headers`.
pub fn inject(cx: &Context, headers: &mut HeaderMap) {
    TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
}

/// Writes the current span's context into `headers`.
pub fn inject_current(headers: &mut HeaderMap) {
    inject(&tracing::Span::current().context(), headers);
}

/// Headers carrying the current span's context (empty when there is none).
pub fn current_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    inject_current(&mut headers);
    headers
}

/// The context carried by `headers` (an empty context when there is none).
pub fn extract(headers: Option<&HeaderMap>) -> Context {
    match headers {
        Some(h) => TraceContextPropagator::new().extract(&HeaderExtractor(h)),
        None => Context::new(),
    }
}

/// Makes the context in `headers` the parent of `span`.
pub fn set_parent(span: &tracing::Span, headers: Option<&HeaderMap>) {
    // An invalid or missing context just leaves the span a root: nothing to report.
    let _ = span.set_parent(extract(headers));
    record_trace_id(span);
}

/// Records the span's OpenTelemetry trace id in its `trace_id` field (declared
/// `trace_id = tracing::field::Empty`), so every log line inside it names the trace.
pub fn record_trace_id(span: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt;
    let context = span.context();
    let trace_id = context.span().span_context().trace_id();
    if trace_id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };

    #[test]
    fn trace_context_survives_a_header_round_trip() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap(),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let cx = Context::new().with_remote_span_context(sc.clone());
        let mut headers = HeaderMap::new();
        inject(&cx, &mut headers);
        assert_eq!(
            headers.get("traceparent").map(|v| v.as_str()),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let back = extract(Some(&headers));
        assert_eq!(back.span().span_context().trace_id(), sc.trace_id());
        assert_eq!(back.span().span_context().span_id(), sc.span_id());
    }

    #[test]
    fn junk_trace_context_is_ignored_and_never_propagated() {
        let huge = "f".repeat(1 << 20);
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let junk_parents = [
            "junk",
            "00-xyz-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra-昔涟",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "\0\t\u{7f}",
            huge.as_str(),
        ];
        for parent in junk_parents {
            let mut headers = HeaderMap::new();
            crate::headers::insert(&mut headers, "traceparent", parent).unwrap();
            crate::headers::insert(&mut headers, "tracestate", parent).unwrap();
            let cx = extract(Some(&headers));
            assert!(!cx.span().span_context().is_valid(), "{parent:.40}");
            let mut out = HeaderMap::new();
            inject(&cx, &mut out);
            assert!(out.is_empty(), "{parent:.40}");
        }
        // A valid parent with a junk or huge trace state: the parent is kept, the state is not
        // echoed unbounded.
        for state in ["a=昔涟", "=,=,=", huge.as_str(), &format!("k={huge}")] {
            let mut headers = HeaderMap::new();
            crate::headers::insert(&mut headers, "traceparent", valid).unwrap();
            crate::headers::insert(&mut headers, "tracestate", state).unwrap();
            let cx = extract(Some(&headers));
            assert!(cx.span().span_context().is_valid(), "{state:.40}");
            let mut out = HeaderMap::new();
            inject(&cx, &mut out);
            assert_eq!(out.get("traceparent").map(|v| v.as_str()), Some(valid));
            let kept = out.get("tracestate").map_or(0, |v| v.as_str().len());
            assert!(kept < 1024, "{state:.40}: {kept} bytes of trace state");
        }
    }

    #[test]
    fn missing_headers_give_an_empty_context() {
        assert!(!extract(None).span().span_context().is_valid());
        assert!(
            !extract(Some(&HeaderMap::new()))
                .span()
                .span_context()
                .is_valid()
        );
    }
}
