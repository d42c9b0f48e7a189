//! The one service host: every Cyrene micro service is a [`ServiceSpec`] (name, version,
//! description, metadata) plus a table of [`Endpoint`]s (name, subject, metadata, limits,
//! handler). [`Host::start`] registers the service and serves each endpoint in a task of its own;
//! [`Host::run`] waits for shutdown, lets every endpoint drain, then leaves the micro service.
//!
//! # Invariants
//! - Every endpoint is in the service's queue group (`q`, the micro default), so replicas share
//!   requests; names are explicit (a name derived from a wildcard subject breaks `nats micro ls`).
//! - A JSON endpoint ([`Endpoint::json`]) is a [`serve_json`] loop; a raw one ([`Endpoint::raw`])
//!   gets the same bounded loop ([`serve_requests`]) and answers the [`Request`] itself.
//! - The micro service is stopped only after every endpoint loop and every task given to
//!   [`Host::spawn`] has finished, so `$SRV.INFO` lists the service while it still answers.

use crate::service::{RequestContext, ServeOptions, serve_json, serve_requests};
use async_nats::Client;
use async_nats::service::{Request, Service, ServiceExt};
use cyrene_protocol::ErrorBody;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
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

impl ServiceSpec {
    /// A service named `name` at `version` (its crate's `CARGO_PKG_VERSION`), no metadata.
    pub fn new(name: &'static str, version: &'static str, description: impl Into<String>) -> Self {
        ServiceSpec {
            name,
            version,
            description: description.into(),
            metadata: HashMap::new(),
        }
    }

    /// Adds one `$SRV.INFO` metadata entry.
    pub fn with_metadata(mut self, key: &str, value: impl Into<String>) -> Self {
        self.metadata.insert(key.to_owned(), value.into());
        self
    }
}

/// Serves one added endpoint until the token fires.
type Serve = Box<
    dyn FnOnce(
            async_nats::service::endpoint::Endpoint,
            ServeOptions,
            CancellationToken,
        ) -> BoxFuture<'static, ()>
        + Send,
>;

/// One row of a service's endpoint table: its name, subject, `$SRV.INFO` metadata, limits and
/// handler.
pub struct Endpoint {
    pub name: &'static str,
    pub subject: String,
    pub metadata: HashMap<String, String>,
    pub options: ServeOptions,
    serve: Serve,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("name", &self.name)
            .field("subject", &self.subject)
            .field("metadata", &self.metadata)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// An endpoint whose requests are decoded as `Req` and answered with `handler`'s value or
    /// error ([`serve_json`]); default limits, no metadata.
    pub fn json<Req, Resp, F, Fut>(
        name: &'static str,
        subject: impl Into<String>,
        handler: F,
    ) -> Endpoint
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        F: Fn(Req, RequestContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, ErrorBody>> + Send + 'static,
    {
        Endpoint::with_serve(
            name,
            subject,
            Box::new(move |endpoint, options, shutdown| {
                Box::pin(serve_json(endpoint, options, shutdown, handler))
            }),
        )
    }

    /// An endpoint that answers each [`Request`] itself (`handler` gets the raw message, headers
    /// and reply subject included, and `max_payload` for decoding it); the bounded loop and the
    /// drain on shutdown are [`serve_requests`]'s.
    pub fn raw<F, Fut>(name: &'static str, subject: impl Into<String>, handler: F) -> Endpoint
    where
        F: Fn(Request, usize) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        Endpoint::with_serve(
            name,
            subject,
            Box::new(move |endpoint, options, shutdown| {
                Box::pin(serve_requests(
                    endpoint,
                    options.max_in_flight,
                    shutdown,
                    move |request| handler(request, options.max_payload),
                ))
            }),
        )
    }

    fn with_serve(name: &'static str, subject: impl Into<String>, serve: Serve) -> Endpoint {
        Endpoint {
            name,
            subject: subject.into(),
            metadata: HashMap::new(),
            options: ServeOptions::default(),
            serve,
        }
    }

    /// The same endpoint with limits `options`.
    pub fn options(mut self, options: ServeOptions) -> Endpoint {
        self.options = options;
        self
    }

    /// The same endpoint with `$SRV.INFO` metadata `pairs`.
    pub fn metadata(mut self, pairs: &[(&str, &str)]) -> Endpoint {
        self.metadata = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self
    }
}

/// A JSON handler over shared `state`: each request is handed its own clone of the `Arc` (so the
/// returned future owns everything it uses), as in
/// `with_state(&engine, |e, req: SteerRequest, _| async move { e.steer(req).await })`.
pub fn with_state<T, Req, Fut>(
    state: &Arc<T>,
    handler: impl Fn(Arc<T>, Req, RequestContext) -> Fut + Send + Sync + 'static,
) -> impl Fn(Req, RequestContext) -> Fut + Send + Sync + 'static
where
    T: Send + Sync + ?Sized + 'static,
{
    let state = state.clone();
    move |req, ctx| handler(state.clone(), req, ctx)
}

/// A started micro service, its endpoints' serving loops and the tasks that live as long.
#[derive(Debug)]
pub struct Host {
    service: Service,
    tasks: JoinSet<()>,
    shutdown: CancellationToken,
}

/// Why a service or an endpoint could not be registered.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("cannot start the micro service {name}: {source}")]
    Start {
        name: &'static str,
        #[source]
        source: async_nats::Error,
    },
    #[error("cannot add endpoint {name} on {subject}: {source}")]
    Endpoint {
        name: &'static str,
        subject: String,
        #[source]
        source: async_nats::Error,
    },
}

impl Host {
    /// Starts the micro service described by `spec` and serves every endpoint of `endpoints`
    /// until `shutdown` fires.
    pub async fn start(
        client: &Client,
        spec: ServiceSpec,
        endpoints: Vec<Endpoint>,
        shutdown: CancellationToken,
    ) -> Result<Host, HostError> {
        let mut builder = client.service_builder().description(spec.description);
        if !spec.metadata.is_empty() {
            builder = builder.metadata(spec.metadata);
        }
        let service = builder
            .start(spec.name, spec.version)
            .await
            .map_err(|source| HostError::Start {
                name: spec.name,
                source,
            })?;
        let mut host = Host {
            service,
            tasks: JoinSet::new(),
            shutdown,
        };
        for endpoint in endpoints {
            host.add(endpoint).await?;
        }
        Ok(host)
    }

    /// Adds `endpoint` and serves it until shutdown.
    pub async fn add(&mut self, endpoint: Endpoint) -> Result<(), HostError> {
        let mut builder = self.service.endpoint_builder().name(endpoint.name);
        if !endpoint.metadata.is_empty() {
            builder = builder.metadata(endpoint.metadata);
        }
        let added = builder
            .add(endpoint.subject.clone())
            .await
            .map_err(|source| HostError::Endpoint {
                name: endpoint.name,
                subject: endpoint.subject,
                source,
            })?;
        self.tasks.spawn((endpoint.serve)(
            added,
            endpoint.options,
            self.shutdown.clone(),
        ));
        Ok(())
    }

    /// Keeps `task` (a background loop that ends on shutdown) with the endpoints: [`Host::run`]
    /// waits for it before leaving the micro service.
    pub fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.tasks.spawn(task);
    }

    /// Runs until shutdown and every serving loop and task has finished; then leaves the micro
    /// service.
    pub async fn run(mut self) {
        while let Some(joined) = self.tasks.join_next().await {
            if let Err(err) = joined {
                tracing::error!(error = %err, "an endpoint loop or service task failed");
            }
        }
        if let Err(err) = self.service.stop().await {
            tracing::debug!(error = %err, "stopping the micro service");
        }
    }
}
