//! One [`Stack`]: the four services — model gateway, checkpoint store, orchestrator and loop
//! workers — in this process, each on a NATS connection of its own, exactly as when each runs
//! as its own binary. `cyrene up` runs it with every service's configuration read from the
//! environment; the top-level tests and the benches run it with their overrides (a database, a
//! window, worker settings, a model script, per-service NATS users, which services run at all).
//!
//! # Invariants
//! - Every service connects on its own, named after its binary (so its inbox prefix is
//!   `_INBOX_<binary>`, which the shipped NATS permissions expect, docs/security.md), to the
//!   stack's servers with the stack's credentials or the ones given for that binary.
//! - Every service runs as a task of the stack; the first one that ends is reported by
//!   [`Stack::exited`] with its error as it is (not a text of it).
//! - [`Stack::stop`] signals shutdown and waits (bounded) for every service to drain; a stack
//!   dropped without it signals shutdown and lets its services drain on their own.
//! - Nothing here is test-only: test doubles (a fake orchestrator, test tools) are started by
//!   the tests, on connections from [`Stack::connect`].

pub mod demo;

use cyrene_bus::{Auth, BusConfig};
use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::ModelsConfig;
use cyrene_model_gateway::providers::scripted::RequestLog;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Why a service of the stack stopped: its own error type, boxed.
pub type ServiceError = Box<dyn std::error::Error + Send + Sync>;

/// A service that ended: its name and how.
pub type Exit = (&'static str, Result<(), ServiceError>);

/// Why a stack could not start, or is not ready.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("cannot connect to NATS at {url} as {connection}: {source}")]
    Connect {
        connection: String,
        /// The servers, credentials redacted.
        url: String,
        #[source]
        source: async_nats::ConnectError,
    },
    #[error("model gateway: {0}")]
    Gateway(#[from] cyrene_model_gateway::Error),
    #[error("{service} did not answer $SRV.PING within {within:?}")]
    NotReady {
        service: &'static str,
        within: Duration,
    },
}

/// The services running in this process; see the module docs.
#[derive(Debug)]
pub struct Stack {
    bus: BusConfig,
    users: BTreeMap<String, Auth>,
    services: JoinSet<Exit>,
    /// The name of each task of `services`, for one that panicked.
    tasks: HashMap<tokio::task::Id, &'static str>,
    /// The micro service names of what was started, in start order, once each.
    names: Vec<&'static str>,
    gateway: Option<Arc<Gateway>>,
    shutdown: CancellationToken,
}

/// What a [`Stack`] runs, and how; [`Builder::start`] starts it. Later calls override earlier
/// ones.
#[derive(Debug)]
pub struct Builder {
    bus: BusConfig,
    users: BTreeMap<String, Auth>,
    shutdown: CancellationToken,
    gateway: Option<cyrene_model_gateway::Config>,
    store: Option<cyrene_checkpoint_store::Config>,
    orchestrator: Option<cyrene_orchestrator::Config>,
    workers: Vec<cyrene_loop_worker::Config>,
    demo_tools: bool,
}

impl Stack {
    /// All four services with their defaults — the gateway on the built-in offline model, both
    /// stores in SQLite files in `data_dir`, one loop worker — connecting as `bus` says (its URL
    /// and credentials; each service's own name replaces the name it carries).
    pub fn builder(bus: BusConfig, data_dir: impl Into<PathBuf>) -> Builder {
        let data_dir = data_dir.into();
        Builder {
            bus,
            users: BTreeMap::new(),
            shutdown: CancellationToken::new(),
            gateway: Some(cyrene_model_gateway::Config {
                models: ModelsConfig::offline(),
                secrets: Default::default(),
                serve: Default::default(),
                http: None,
            }),
            store: Some(cyrene_checkpoint_store::Config::new(&data_dir)),
            orchestrator: Some(cyrene_orchestrator::Config::new(&data_dir)),
            workers: vec![cyrene_loop_worker::Config::default()],
            demo_tools: false,
        }
    }

    /// The micro service names of the services started, once each.
    pub fn names(&self) -> &[&'static str] {
        &self.names
    }

    /// The request log of the gateway's scripted provider `provider`, recording from now on;
    /// `None` without a gateway or such a provider.
    pub fn model_log(&self, provider: &str) -> Option<RequestLog> {
        self.gateway.as_ref()?.request_log(provider)
    }

    /// The token that stops every service of the stack.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// A connection as `connection` would make it as a service of this stack: its name, the
    /// stack's servers, the credentials given for it (else the stack's).
    pub async fn connect(&self, connection: &str) -> Result<async_nats::Client, StackError> {
        connect(&self.bus, &self.users, connection).await
    }

    /// Runs `service` among the stack's services as `name` (e.g. the web page of `cyrene up`).
    pub fn spawn<E, Fut>(&mut self, name: &'static str, service: Fut)
    where
        E: Into<ServiceError>,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
    {
        let task = self
            .services
            .spawn(async move { (name, service.await.map_err(Into::into)) });
        self.tasks.insert(task.id(), name);
    }

    /// Waits until every service started answers `$SRV.PING` on `client` (one that may reach
    /// `$SRV.>`), each within `within`.
    pub async fn ready(
        &self,
        client: &async_nats::Client,
        within: Duration,
    ) -> Result<(), StackError> {
        for &service in &self.names {
            let every = Duration::from_millis(200);
            if !cyrene_bus::discovery::wait_for(client, service, within, every).await {
                return Err(StackError::NotReady { service, within });
            }
        }
        Ok(())
    }

    /// The first service to end, and how; `None` when none runs.
    pub async fn exited(&mut self) -> Option<Exit> {
        let exit = match self.services.join_next_with_id().await? {
            Ok((_, exit)) => exit,
            // Panicked (the panic was printed) or aborted: ended all the same.
            Err(e) => (
                self.tasks.get(&e.id()).copied().unwrap_or("a service"),
                Err(e.into()),
            ),
        };
        Some(exit)
    }

    /// Signals shutdown and waits up to `grace` for every service to drain, then aborts the rest.
    pub async fn stop(mut self, grace: Duration) {
        self.shutdown.cancel();
        let mut services = std::mem::take(&mut self.services);
        let drained = tokio::time::timeout(grace, async {
            while services.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            services.abort_all();
        }
    }

    /// Connects as `binary` and runs `run(client, shutdown)` among the services.
    async fn start<E, Fut>(
        &mut self,
        binary: &'static str,
        run: impl FnOnce(async_nats::Client, CancellationToken) -> Fut,
    ) -> Result<(), StackError>
    where
        E: Into<ServiceError>,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
    {
        let client = self.connect(binary).await?;
        self.spawn(binary, run(client, self.shutdown.clone()));
        if !self.names.contains(&binary) {
            self.names.push(binary);
        }
        Ok(())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.shutdown.cancel();
        // Drained on their own: a dropped stack stops like its processes would on SIGTERM.
        self.services.detach_all();
    }
}

impl Builder {
    /// Cancelled, stops every service (default: a token of the stack's own).
    pub fn shutdown(mut self, shutdown: CancellationToken) -> Builder {
        self.shutdown = shutdown;
        self
    }

    /// The service (or other connection) `connection` authenticates with `auth` instead of the
    /// stack's credentials (a NATS user per service, docs/security.md).
    pub fn user(mut self, connection: &str, auth: Auth) -> Builder {
        self.users.insert(connection.to_owned(), auth);
        self
    }

    /// The gateway's configuration; `None` runs no gateway.
    pub fn gateway(mut self, config: Option<cyrene_model_gateway::Config>) -> Builder {
        self.gateway = config;
        self
    }

    /// The gateway's model config (its API keys as they were: none by default).
    pub fn models(mut self, models: ModelsConfig) -> Builder {
        if let Some(gateway) = &mut self.gateway {
            gateway.models = models;
        }
        self
    }

    /// The checkpoint store's configuration; `None` runs no store.
    pub fn store(mut self, config: Option<cyrene_checkpoint_store::Config>) -> Builder {
        self.store = config;
        self
    }

    /// The orchestrator's configuration; `None` runs no orchestrator.
    pub fn orchestrator(mut self, config: Option<cyrene_orchestrator::Config>) -> Builder {
        self.orchestrator = config;
        self
    }

    /// Changes the orchestrator's configuration (its window, step limit, owner, personas…).
    pub fn orchestrator_with(
        mut self,
        change: impl FnOnce(&mut cyrene_orchestrator::Config),
    ) -> Builder {
        if let Some(orchestrator) = &mut self.orchestrator {
            change(orchestrator);
        }
        self
    }

    /// The database of both stores (`postgres://…` or `sqlite://…`); `None`: SQLite files in
    /// the data directory.
    pub fn database_url(mut self, url: Option<String>) -> Builder {
        if let Some(store) = &mut self.store {
            store.database_url = url.clone();
        }
        if let Some(orchestrator) = &mut self.orchestrator {
            orchestrator.database_url = url;
        }
        self
    }

    /// `count` loop workers, each with `config`; 0 runs none.
    pub fn workers(mut self, count: usize, config: cyrene_loop_worker::Config) -> Builder {
        self.workers = vec![config; count];
        self
    }

    /// Whether the demo tools run too ([`demo::tools`]; off by default).
    pub fn demo_tools(mut self, on: bool) -> Builder {
        self.demo_tools = on;
        self
    }

    /// Connects and starts every service: gateway, store, orchestrator, workers, demo tools.
    /// Returns once each has its connection, not once each answers (see [`Stack::ready`]).
    pub async fn start(self) -> Result<Stack, StackError> {
        let mut stack = Stack {
            bus: self.bus,
            users: self.users,
            services: JoinSet::new(),
            tasks: HashMap::new(),
            names: Vec::new(),
            gateway: None,
            shutdown: self.shutdown,
        };
        if let Some(config) = self.gateway {
            let http = cyrene_model_gateway::http_client()?;
            let gateway = Arc::new(Gateway::new(config.models, &config.secrets, http)?);
            stack.gateway = Some(gateway.clone());
            stack
                .start(cyrene_model_gateway::SERVICE_NAME, |client, stop| {
                    cyrene_model_gateway::run_gateway(
                        gateway,
                        config.http,
                        config.serve,
                        client,
                        stop,
                    )
                })
                .await?;
        }
        if let Some(config) = self.store {
            stack
                .start(cyrene_checkpoint_store::SERVICE_NAME, |client, stop| {
                    cyrene_checkpoint_store::run(config, client, stop)
                })
                .await?;
        }
        if let Some(config) = self.orchestrator {
            stack
                .start(cyrene_orchestrator::SERVICE_NAME, |client, stop| {
                    cyrene_orchestrator::run(config, client, stop)
                })
                .await?;
        }
        for config in self.workers {
            stack
                .start(cyrene_loop_worker::SERVICE_NAME, |client, stop| {
                    cyrene_loop_worker::run(config, client, stop)
                })
                .await?;
        }
        if self.demo_tools {
            stack.start(demo::TOOLS_SERVICE, demo::tools).await?;
        }
        Ok(stack)
    }
}

/// Connects as `connection`: `bus` with that name (its inbox prefix follows it) and the
/// credentials `users` gives it, if any.
async fn connect(
    bus: &BusConfig,
    users: &BTreeMap<String, Auth>,
    connection: &str,
) -> Result<async_nats::Client, StackError> {
    let mut config = bus.clone();
    config.name = connection.to_owned();
    config.inbox = None;
    if let Some(auth) = users.get(connection) {
        config.auth = auth.clone();
    }
    cyrene_bus::connect(&config)
        .await
        .map_err(|source| StackError::Connect {
            connection: connection.to_owned(),
            url: config.redacted_urls().join(","),
            source,
        })
}
