//! The one service host: starts a micro service (name, version, description, metadata), adds
//! its endpoints — each a [`serve_json`] loop with its own options and metadata — and keeps their
//! tasks until shutdown. Wire behaviour is the micro protocol's: every endpoint is in the
//! service's queue group (`q`), so replicas share requests.

use crate::service::{RequestContext, ServeOptions, serve_json};
use async_nats::Client;
use async_nats::service::{Service, ServiceExt};
use cyrene_protocol::ErrorBody;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::future::Future;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// What a micro service says about itself in `$SRV.INFO`.
#[derive(Debug, Clone, Default)]
pub struct ServiceSpec {
    pub name: &'static str,
    pub version: &'static str,
    pub description: String,
    pub metadata: HashMap<String, String>,
}

/// One endpoint of the table: its name, subject and `$SRV.INFO` metadata.
#[derive(Debug, Clone, Copy)]
pub struct EndpointSpec<'a> {
    pub name: &'a str,
    pub subject: &'a str,
    pub metadata: &'a [(&'a str, &'a str)],
}

/// A started micro service and its endpoints' serving loops.
#[derive(Debug)]
pub struct Host {
    service: Service,
    tasks: JoinSet<()>,
    shutdown: CancellationToken,
}

/// Why a service or an endpoint could not be registered.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct HostError(pub String);

impl Host {
    /// Starts the micro service described by `spec`.
    pub async fn start(
        client: &Client,
        spec: ServiceSpec,
        shutdown: CancellationToken,
    ) -> Result<Host, HostError> {
        let mut builder = client.service_builder().description(spec.description);
        if !spec.metadata.is_empty() {
            builder = builder.metadata(spec.metadata);
        }
        let service = builder
            .start(spec.name, spec.version)
            .await
            .map_err(|e| HostError(format!("cannot start the micro service: {e}")))?;
        Ok(Host {
            service,
            tasks: JoinSet::new(),
            shutdown,
        })
    }

    /// Adds endpoint `spec` and serves it with `handler` until shutdown.
    pub async fn serve<Req, Resp, F, Fut>(
        &mut self,
        spec: EndpointSpec<'_>,
        options: ServeOptions,
        handler: F,
    ) -> Result<(), HostError>
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        F: Fn(Req, RequestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, ErrorBody>> + Send + 'static,
    {
        let mut builder = self.service.endpoint_builder().name(spec.name);
        if !spec.metadata.is_empty() {
            builder = builder.metadata(
                spec.metadata
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            );
        }
        let endpoint = builder.add(spec.subject.to_owned()).await.map_err(|e| {
            HostError(format!(
                "cannot add endpoint {} on {}: {e}",
                spec.name, spec.subject
            ))
        })?;
        self.tasks.spawn(serve_json(
            endpoint,
            options,
            self.shutdown.clone(),
            handler,
        ));
        Ok(())
    }

    /// Runs until shutdown and every serving loop has drained; then leaves the micro service.
    pub async fn run(mut self) {
        while self.tasks.join_next().await.is_some() {}
        let _ = self.service.stop().await;
    }

    /// The serving loops, for a caller that joins them with its own tasks; the micro service
    /// stays registered until the returned [`Service`] is stopped or dropped.
    pub fn into_parts(self) -> (Service, JoinSet<()>) {
        (self.service, self.tasks)
    }
}
