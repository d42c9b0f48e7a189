//! NATS micro services as tests stand them up: a service, its named endpoints, and tool
//! endpoints carrying the metadata the loop worker discovers tools by
//! (docs/loop-worker.md, Tools).

use async_nats::service::endpoint::Endpoint;
use async_nats::service::{Service, ServiceExt};
use std::collections::HashMap;

/// Starts the micro service `name` at `version` on `client`.
pub async fn start_service(client: &async_nats::Client, name: &str, version: &str) -> Service {
    client.service_builder().start(name, version).await.unwrap()
}

/// Like [`start_service`], with the service's `description`.
pub async fn start_described_service(
    client: &async_nats::Client,
    name: &str,
    version: &str,
    description: &str,
) -> Service {
    client
        .service_builder()
        .description(description)
        .start(name, version)
        .await
        .unwrap()
}

/// What the micro service `name` answers to `$SRV.<verb>.<name>` (`verb`: `PING`, `INFO` or
/// `STATS`), as JSON.
pub async fn answer(client: &async_nats::Client, verb: &str, name: &str) -> serde_json::Value {
    let reply = client
        .request(format!("$SRV.{verb}.{name}"), "".into())
        .await
        .unwrap();
    serde_json::from_slice(&reply.payload).unwrap()
}

/// Adds the endpoint `name` on `subject` to `service`.
pub async fn add_endpoint(service: &Service, name: &str, subject: &str) -> Endpoint {
    service
        .endpoint_builder()
        .name(name)
        .add(subject.to_owned())
        .await
        .unwrap()
}

/// Adds the tool `name` to `service`: the endpoint on `cyrene.tool.<name>` whose metadata
/// holds its `description` and its JSON-schema `parameters`.
pub async fn add_tool(
    service: &Service,
    name: &str,
    description: &str,
    parameters: &str,
) -> Endpoint {
    add_tool_declaring(service, name, description, parameters, &[]).await
}

/// [`add_tool`] whose metadata also holds `declared` (e.g. `cyrene.tool.idempotent`).
pub async fn add_tool_declaring(
    service: &Service,
    name: &str,
    description: &str,
    parameters: &str,
    declared: &[(&str, &str)],
) -> Endpoint {
    let mut metadata: HashMap<String, String> = [
        ("cyrene.tool.description".to_owned(), description.to_owned()),
        ("cyrene.tool.parameters".to_owned(), parameters.to_owned()),
    ]
    .into();
    metadata.extend(
        declared
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    service
        .endpoint_builder()
        .name(name)
        .metadata(metadata)
        .add(format!("cyrene.tool.{name}"))
        .await
        .unwrap()
}
