//! The model-gateway service: the only component that talks to LLM providers (docs/architecture.md
//! §2, §9).
//!
//! Owns the micro service `cyrene-model-gateway` with the endpoints `complete` on
//! `cyrene.model.complete` (a [`ModelRequest`] in, a [`ModelResponse`] or the error envelope
//! out), `complete_stream` on `cyrene.model.complete.stream` (the same, with deltas first:
//! [`stream`]) and `route`, and the call records on `cyrene.model.calls`. Translation lives in [`providers`] (one
//! file per dialect behind one trait), chain choice, fallback and cooldown in [`router`], the
//! config file and its validation in [`config`].
//!
//! # Invariants
//! - One [`CallRecord`] is published per *successful* call; failed attempts publish none.
//! - Malformed or invalid requests are answered `bad_request` (`too_large` when oversized) and
//!   never reach a provider; the service keeps serving.
//! - API keys are resolved once at start into the providers; they are never logged (hand-written
//!   `Debug`) and never put on the bus.
//! - One shared `reqwest::Client` (connection pool, keep-alive) serves every provider.
//!
//! # Pitfalls
//! - reqwest is built with `rustls-no-provider`: [`http_client`] installs the ring provider
//!   first; building a `reqwest::Client` any other way in this process panics on TLS use.

pub mod config;
pub mod http;
pub mod providers;
pub mod router;
pub mod stream;
pub mod views;

use crate::config::{ModelsConfig, Protocol, Secrets};
use crate::providers::Provider;
use crate::providers::anthropic::AnthropicProvider;
use crate::providers::openai::OpenAiProvider;
use crate::providers::scripted::{RequestLog, ScriptedProvider};
use crate::router::Router;
use cyrene_bus::host::{Endpoint, Host, ServiceSpec, with_state};
use cyrene_bus::service::{RequestContext, ServeOptions};
use cyrene_protocol::model::{
    CallRecord, ModelRequest, ModelResponse, RouteRequest, RouteResponse, RouteStep,
};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use crate::config::ConfigError;

/// The micro service name.
pub const SERVICE_NAME: &str = "cyrene-model-gateway";
/// The endpoint name of `cyrene.model.complete`.
pub const ENDPOINT_NAME: &str = "complete";
/// The endpoint name of `cyrene.model.complete.stream`.
pub const STREAM_ENDPOINT_NAME: &str = "complete_stream";
/// The micro endpoint of this replica's own streamed calls (`cyrene.model.complete.stream.<replica>`:
/// held views continue there).
pub const REPLICA_STREAM_ENDPOINT_NAME: &str = "complete_stream_replica";
/// The endpoint name of `cyrene.model.route`.
pub const ROUTE_ENDPOINT_NAME: &str = "route";

/// Everything `run` needs; `main` builds it from flags, the config file and the environment.
#[derive(Debug, Clone)]
pub struct Config {
    pub models: ModelsConfig,
    /// API keys by env var name.
    pub secrets: Secrets,
    pub serve: ServeOptions,
    /// The OpenAI-compatible HTTP front door; `None` = off (the default).
    pub http: Option<http::HttpConfig>,
}

/// Command line and environment of the `cyrene-model-gateway` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "cyrene-model-gateway",
    version,
    about = "Cyrene model gateway: routes cyrene.model.complete to LLM providers (fallback, \
             cooldown, accounting)."
)]
pub struct Args {
    #[command(flatten)]
    pub common: cyrene_runtime::entry::ServiceFlags,
    /// Path to the model config (JSON, or TOML when it ends in .toml). Absent: a built-in offline
    /// config whose only provider is the scripted one (replies are marked offline).
    #[arg(long, env = "CYRENE_GATEWAY_MODELS")]
    pub models: Option<std::path::PathBuf>,
    /// Requests handled at once.
    #[arg(long, env = "CYRENE_GATEWAY_MAX_IN_FLIGHT", default_value_t = 256)]
    pub max_in_flight: usize,
    /// Serve the OpenAI-compatible HTTP front door (`POST /v1/chat/completions`,
    /// `GET /v1/models`) on this address, e.g. 127.0.0.1:8088. Off when absent.
    #[arg(long, env = "CYRENE_GATEWAY_HTTP_ADDR")]
    pub http_addr: Option<std::net::SocketAddr>,
    /// The API keys clients of the HTTP front door must send (`Authorization: Bearer <key>`),
    /// comma-separated. Set it in the environment, not on the command line.
    #[arg(
        long,
        env = "CYRENE_GATEWAY_HTTP_KEYS",
        hide_env_values = true,
        default_value = ""
    )]
    pub http_keys: http::ClientKeys,
    /// Client connections the front door holds open at once (more wait in the listen backlog);
    /// never more than a quarter of the open-file soft limit.
    #[arg(long, env = "CYRENE_GATEWAY_HTTP_MAX_CONNECTIONS", default_value_t = http::HttpLimits::default().max_connections)]
    pub http_max_connections: usize,
    /// How long a connection may take to send a request's headers, or sit idle between
    /// requests, before it is closed.
    #[arg(long, env = "CYRENE_GATEWAY_HTTP_HEADER_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub http_header_timeout: std::time::Duration,
    /// How long an authenticated request may take to send its body.
    #[arg(long, env = "CYRENE_GATEWAY_HTTP_BODY_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub http_body_timeout: std::time::Duration,
    /// Authenticated front-door requests in flight at once (more are answered 429); never more
    /// than a quarter of the open-file soft limit.
    #[arg(long, env = "CYRENE_GATEWAY_HTTP_MAX_REQUESTS", default_value_t = http::HttpLimits::default().max_requests)]
    pub http_max_requests: usize,
    /// Request body bytes the front door's requests in flight hold at once (more are answered
    /// 429); at least one largest body (16 MiB).
    #[arg(long, env = "CYRENE_GATEWAY_HTTP_BODY_BUDGET", default_value_t = http::HttpLimits::default().body_budget)]
    pub http_body_budget: usize,
}

impl cyrene_runtime::entry::ServiceArgs for Args {
    type Config = Config;

    /// Reads the model config (every problem in it is listed) and the API keys it names from the
    /// environment — the only place keys are read.
    fn into_config(self) -> Result<Config, cyrene_runtime::entry::Problems> {
        let mut problems = Vec::new();
        if self.max_in_flight == 0 {
            problems.push("max_in_flight must be at least 1".to_owned());
        }
        if self.http_addr.is_some() && self.http_keys.is_empty() {
            problems.push(
                "--http-addr/CYRENE_GATEWAY_HTTP_ADDR needs at least one client key in \
                 CYRENE_GATEWAY_HTTP_KEYS"
                    .to_owned(),
            );
        }
        let limits = http::HttpLimits {
            max_connections: self.http_max_connections,
            header_timeout: self.http_header_timeout,
            body_timeout: self.http_body_timeout,
            max_requests: self.http_max_requests,
            body_budget: self.http_body_budget,
        };
        problems.extend(limits.problems());
        let http = self.http_addr.map(|addr| http::HttpConfig {
            addr,
            keys: self.http_keys.clone(),
            limits,
        });
        let models = match &self.models {
            Some(path) => ModelsConfig::from_file(path).map_err(|e| problems.push(e.to_string())),
            None => {
                tracing::warn!(
                    "no --models/CYRENE_GATEWAY_MODELS: using the offline scripted provider only"
                );
                Ok(ModelsConfig::offline())
            }
        };
        cyrene_runtime::entry::Problems::check(problems)?;
        let models = models.unwrap_or_else(|()| ModelsConfig::offline());
        let secrets = Secrets::resolve(&models, |name| std::env::var(name).ok());
        Ok(Config {
            models,
            secrets,
            serve: ServeOptions {
                max_in_flight: self.max_in_flight,
                ..ServeOptions::default()
            },
            http,
        })
    }
}

/// Why the gateway could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot build the HTTP client: {0}")]
    HttpClient(#[source] reqwest::Error),
    #[error("cannot start the HTTP front door: {0}")]
    Http(#[source] std::io::Error),
    #[error(transparent)]
    Host(#[from] cyrene_bus::host::HostError),
}

cyrene_runtime::run_error!(Error::Config);

/// The ring-backed rustls provider is installed and one pooled client built.
pub fn http_client() -> Result<reqwest::Client, Error> {
    // Err means a provider is installed already: fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .build()
        .map_err(Error::HttpClient)
}

/// The providers and the router: everything but the bus.
#[derive(Debug)]
pub struct Gateway {
    router: Router,
    logs: BTreeMap<String, RequestLog>,
    /// The views held and the messages decoded recently (views.rs).
    pub views: views::Views,
    /// This replica's name (random, letters and digits): its own streamed-call subject is
    /// `cyrene.model.complete.stream.<replica>`, where held views are continued.
    pub replica: String,
}

impl Gateway {
    /// Validates `models` (with `secrets` as the environment) and builds one provider per entry.
    pub fn new(
        models: ModelsConfig,
        secrets: &Secrets,
        http: reqwest::Client,
    ) -> Result<Gateway, Error> {
        models.validate(&|name| secrets.has(name))?;
        let mut providers: BTreeMap<String, Arc<dyn Provider>> = BTreeMap::new();
        let mut logs = BTreeMap::new();
        for (name, p) in &models.providers {
            let key = secrets.get(&p.api_key_env).map(str::to_owned);
            let provider: Arc<dyn Provider> = match p.protocol {
                Protocol::Openai => Arc::new(OpenAiProvider::new(name, p, key, http.clone())),
                Protocol::Anthropic => Arc::new(AnthropicProvider::new(name, p, key, http.clone())),
                Protocol::Scripted => {
                    let scripted = ScriptedProvider::new(p.script.clone().unwrap_or_default());
                    logs.insert(name.clone(), scripted.log());
                    Arc::new(scripted)
                }
            };
            providers.insert(name.clone(), provider);
        }
        Ok(Gateway {
            router: Router::new(models, providers),
            logs,
            views: views::Views::default(),
            replica: cyrene_protocol::ids::new_id(),
        })
    }

    /// The request log of the scripted provider `name`, recording every request from now on
    /// (a log nobody took records nothing).
    pub fn request_log(&self, name: &str) -> Option<RequestLog> {
        self.logs.get(name).map(RequestLog::watch)
    }

    pub fn config(&self) -> &ModelsConfig {
        self.router.config()
    }

    /// The chain a text request of `req.persona_id` (or `req.model`) goes to; its first step is
    /// the main model. The loop's image resolver asks this to know whether images must become
    /// text before the main model sees them.
    pub fn route(&self, req: &RouteRequest) -> Result<RouteResponse, ErrorBody> {
        let probe = ModelRequest {
            persona_id: req.persona_id.clone(),
            model: req.model.clone(),
            ..Default::default()
        };
        let config = self.config();
        let steps = self.router.route(&probe)?;
        Ok(RouteResponse {
            steps: steps
                .into_iter()
                .map(|s| RouteStep {
                    vision: config.caps(&s).is_some_and(|c| c.vision),
                    provider: s.provider,
                    model: s.model,
                })
                .collect(),
        })
    }

    /// Checks, routes and completes one request.
    pub async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ErrorBody> {
        router::check_request(req)?;
        self.router.complete(req).await
    }

    /// [`Gateway::complete`], passing the output to `sink` as it is produced (fallback only
    /// before the first delta: [`Router::complete_stream`]).
    pub async fn complete_stream(
        &self,
        req: &ModelRequest,
        sink: &providers::DeltaSink,
    ) -> Result<ModelResponse, ErrorBody> {
        router::check_request(req)?;
        self.router.complete_stream(req, sink).await
    }

    /// One call as every front door makes it — streamed into `sink` when given — with its call
    /// record published on `cyrene.model.calls` when it succeeds.
    pub async fn call(
        &self,
        client: &async_nats::Client,
        req: &ModelRequest,
        sink: Option<&providers::DeltaSink>,
    ) -> Result<ModelResponse, ErrorBody> {
        let started = Instant::now();
        let response = match sink {
            Some(sink) => self.complete_stream(req, sink).await?,
            None => self.complete(req).await?,
        };
        let record = CallRecord {
            model: response.model.clone(),
            purpose: req.purpose.clone(),
            tokens: response.total_tokens,
            took_ms: started.elapsed().as_millis() as u64,
            provider: response.provider.clone(),
            cache_hit_tokens: response.cache_hit_tokens,
        };
        publish_record(client, &record).await;
        Ok(response)
    }

    /// Logs providers and chains (never keys).
    pub fn log_routing_table(&self) {
        let c = self.config();
        for (name, p) in &c.providers {
            let models: Vec<String> = p
                .models
                .iter()
                .map(|(m, caps)| {
                    if caps.vision {
                        format!("{m}(vision)")
                    } else {
                        m.clone()
                    }
                })
                .collect();
            tracing::info!(
                provider = %name,
                protocol = ?p.protocol,
                base_url = %p.base_url,
                key_env = %p.api_key_env,
                models = %models.join(","),
                "provider"
            );
        }
        let show = |chain: &[config::Step]| {
            chain
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" -> ")
        };
        tracing::info!(group = %c.active_group, chain = %show(c.default_chain()), "default chain");
        for (persona, chain) in &c.persona_providers {
            tracing::info!(persona = %persona, chain = %show(chain), "persona chain");
        }
        if !c.vision.is_empty() {
            tracing::info!(chain = %show(&c.vision), "vision chain");
        }
    }
}

/// Builds the gateway from `config` and serves it until `shutdown`.
pub async fn run(
    config: Config,
    client: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let gateway = Arc::new(Gateway::new(
        config.models,
        &config.secrets,
        http_client()?,
    )?);
    run_gateway(gateway, config.http, config.serve, client, shutdown).await
}

/// Serves a built `gateway` until `shutdown`: on the bus with `options`, and on the HTTP front
/// door when `http` is given. What [`run`] does once it has built the gateway; a caller that
/// builds the gateway itself can first take a scripted provider's request log
/// ([`Gateway::request_log`]).
pub async fn run_gateway(
    gateway: Arc<Gateway>,
    http: Option<http::HttpConfig>,
    options: ServeOptions,
    client: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let front_door = match http {
        Some(http) => Some(
            http::serve(http, gateway.clone(), client.clone(), shutdown.clone())
                .await
                .map_err(Error::Http)?
                .1,
        ),
        None => None,
    };
    let served = serve(gateway, client, options, shutdown).await;
    if let Some(task) = front_door {
        let _ = task.await;
    }
    served
}

/// Serves `gateway` on `cyrene.model.complete` until `shutdown`, publishing call records.
pub async fn serve(
    gateway: Arc<Gateway>,
    client: async_nats::Client,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    gateway.log_routing_table();
    let spec = ServiceSpec::new(
        SERVICE_NAME,
        env!("CARGO_PKG_VERSION"),
        "Cyrene model gateway: the only component that talks to LLM providers",
    );
    let complete = {
        let (gateway, client) = (gateway.clone(), client.clone());
        move |req: ModelRequest, _: RequestContext| {
            let (gateway, client) = (gateway.clone(), client.clone());
            async move {
                if req.view.is_some() {
                    return Err(ErrorBody::new(
                        ErrorCode::BadRequest,
                        "a view is held only for streamed calls (cyrene.model.complete.stream)",
                    ));
                }
                gateway.call(&client, &req, None).await
            }
        }
    };
    let streamed = {
        let (gateway, client) = (gateway.clone(), client.clone());
        move |request, max_payload| {
            stream::handle(request, gateway.clone(), client.clone(), max_payload)
        }
    };
    let route = with_state(&gateway, |gateway, req: RouteRequest, _| async move {
        gateway.route(&req)
    });
    let endpoints = vec![
        Endpoint::json(ENDPOINT_NAME, subjects::MODEL_COMPLETE, complete),
        Endpoint::raw(
            STREAM_ENDPOINT_NAME,
            subjects::MODEL_COMPLETE_STREAM,
            streamed.clone(),
        ),
        Endpoint::raw(
            REPLICA_STREAM_ENDPOINT_NAME,
            subjects::model_complete_stream_at(&gateway.replica),
            streamed,
        ),
        Endpoint::json(ROUTE_ENDPOINT_NAME, subjects::MODEL_ROUTE, route),
    ]
    .into_iter()
    .map(|endpoint| endpoint.options(options))
    .collect();
    let host = Host::start(&client, spec, endpoints, shutdown).await?;
    tracing::info!(subject = subjects::MODEL_COMPLETE, "model gateway serving");
    cyrene_runtime::health::global().set(SERVICE_NAME, true);
    host.run().await;
    Ok(())
}

async fn publish_record(client: &async_nats::Client, record: &CallRecord) {
    let payload = match serde_json::to_vec(record) {
        Ok(p) => p,
        Err(err) => {
            tracing::warn!(error = %err, "cannot encode a call record");
            return;
        }
    };
    let headers = cyrene_bus::trace::current_headers();
    if let Err(err) = client
        .publish_with_headers(subjects::MODEL_CALLS, headers, payload.into())
        .await
    {
        tracing::warn!(error = %err, "cannot publish a call record");
    }
}
