//! An OTLP/HTTP trace collector for tests, where the telemetry crate and the service binaries
//! export their spans.

use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

/// An OTLP/HTTP collector that accepts every trace export (`POST {uri}/v1/traces`) and keeps it:
/// read them with [`MockServer::received_requests`].
pub async fn collector() -> MockServer {
    let collector = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/v1/traces"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&collector)
        .await;
    collector
}
