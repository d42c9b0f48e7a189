//! `cyrene up`: every service in one process, for local use.
//!
//! Embedded defaults: SQLite files in the data directory, and — unless `--models` or the
//! gateway's `CYRENE_GATEWAY_MODELS` names a real provider config — the offline scripted provider
//! with a small demo script plus demo tools (`search_notes`, which takes a moment, so a message typed meanwhile is visibly
//! steered into the running turn; `send_postcard`, which waits for the person's approval). Every service gets its own NATS connection, exactly as when
//! they run as separate processes, and its configuration from its own `Args` read from the
//! environment, so every env var of a service binary works under `cyrene up` too.

use super::CliError;
use clap::Args;
use cyrene_bus::ConnectMode;
use cyrene_bus::host::{Endpoint, Host, ServiceSpec};
use cyrene_bus::service::RequestContext;
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_protocol::ErrorBody;
use cyrene_runtime::entry::ServiceArgs;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The offline demo script used when no model config is given.
const OFFLINE_MODELS: &str = include_str!("offline-models.json");

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where the SQLite databases live (both stores). Absent: each service's own setting
    /// (`CYRENE_STORE_DATA_DIR`, `CYRENE_ORCHESTRATOR_DATA_DIR`; `./data` by default).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// PostgreSQL (or sqlite://) URL for both stores; SQLite files in the data dir when absent.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Model config (JSON, docs/architecture.md §9). Absent: the gateway's own setting
    /// (`CYRENE_GATEWAY_MODELS`), else the offline scripted demo.
    #[arg(long)]
    pub models: Option<PathBuf>,
    /// Personas (JSON, docs/architecture.md §9). Absent: the orchestrator's own setting
    /// (`CYRENE_ORCHESTRATOR_PERSONAS`), else 昔涟 (cyrene) and 星 (hoshi).
    #[arg(long)]
    pub personas: Option<PathBuf>,
    /// Loop workers to run.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Where the web chat is served (docs/web.md); when the address is taken, `cyrene up` says
    /// so and runs without it.
    #[arg(long, env = "CYRENE_WEB_ADDR", default_value = super::web::DEFAULT_ADDR)]
    pub web_addr: std::net::SocketAddr,
    /// Do not serve the web chat.
    #[arg(long)]
    pub no_web: bool,
    #[command(flatten)]
    pub page: super::web::PageArgs,
}

/// Two demo personas, so asks between agents can be shown.
const DEMO_PERSONAS: &str = r#"{"default":"cyrene","personas":[
 {"id":"cyrene","name":"昔涟","instructions":"You are 昔涟 (Cyrene), a warm companion. Answer briefly."},
 {"id":"hoshi","name":"星","instructions":"You are 星 (Hoshi), cheerful and curious. Answer briefly."}]}"#;

pub async fn run(bus: &cyrene_bus::BusArgs, args: UpArgs) -> Result<(), CliError> {
    let nats_url = bus
        .config("cyrene", ConnectMode::Client)
        .map_err(CliError::Failed)?
        .redacted_urls()
        .join(",");
    let fail = |what: &str, e: &dyn std::fmt::Display| CliError::Failed(format!("{what}: {e}"));
    if !args.no_web {
        super::web::check(&args.page)?;
    }
    // Each service starts from its own Args as the environment sets them, so every env var a
    // service binary honours applies here too; `cyrene up`'s own flags then take precedence.
    let gateway_args = service_args::<cyrene_model_gateway::Args>("cyrene-model-gateway")?;
    let store_args = service_args::<cyrene_checkpoint_store::Args>("cyrene-checkpoint-store")?;
    let orchestrator_args = service_args::<cyrene_orchestrator::Args>("cyrene-orchestrator")?;
    let models_path = args.models.clone().or(gateway_args.models.clone());
    let personas_path = args.personas.clone().or(orchestrator_args.personas.clone());
    let store_dir = args.data_dir.clone().unwrap_or(store_args.data_dir.clone());
    let orchestrator_dir = args
        .data_dir
        .clone()
        .unwrap_or(orchestrator_args.data_dir.clone());
    for dir in [&store_dir, &orchestrator_dir] {
        std::fs::create_dir_all(dir).map_err(|e| fail("cannot create the data dir", &e))?;
    }
    let offline = models_path.is_none();
    let models = match &models_path {
        Some(path) => ModelsConfig::from_file(path).map_err(|e| fail("model config", &e))?,
        None => {
            serde_json::from_str(OFFLINE_MODELS).map_err(|e| fail("built-in model config", &e))?
        }
    };
    let secrets = Secrets::resolve(&models, |name| std::env::var(name).ok());
    let personas: cyrene_orchestrator::Personas = match &personas_path {
        Some(path) => {
            cyrene_orchestrator::Personas::load(path).map_err(|e| fail("personas", &e))?
        }
        None => cyrene_orchestrator::Personas::from_json(DEMO_PERSONAS)
            .map_err(|e| fail("personas", &e))?,
    };

    let personas_offered: Vec<String> = personas.names().into_keys().collect();
    let mut stack = Stack {
        bus,
        nats_url: nats_url.clone(),
        services: Services::new(),
        shutdown: CancellationToken::new(),
    };

    let mut gateway = service_config("cyrene-model-gateway", gateway_args)?;
    gateway.models = models;
    gateway.secrets = secrets;
    stack
        .start("cyrene-model-gateway", |client, stop| {
            cyrene_model_gateway::run(gateway, client, stop)
        })
        .await?;

    let mut store = service_config("cyrene-checkpoint-store", store_args)?;
    store.data_dir = store_dir.clone();
    store.database_url = args.database_url.clone();
    stack
        .start("cyrene-checkpoint-store", |client, stop| {
            cyrene_checkpoint_store::run(store, client, stop)
        })
        .await?;

    let mut orchestrator = service_config("cyrene-orchestrator", orchestrator_args)?;
    orchestrator.data_dir = orchestrator_dir;
    orchestrator.database_url = args.database_url.clone();
    orchestrator.personas = personas;
    stack
        .start("cyrene-orchestrator", |client, stop| {
            cyrene_orchestrator::run(orchestrator, client, stop)
        })
        .await?;

    for _ in 0..args.workers.max(1) {
        let mut config = service_config(
            "cyrene-loop-worker",
            service_args::<cyrene_loop_worker::Args>("cyrene-loop-worker")?,
        )?;
        // Tools registered after start show up within seconds, not half a minute.
        config.tool_refresh = Duration::from_secs(5);
        stack
            .start("cyrene-loop-worker", |client, stop| {
                cyrene_loop_worker::run(config, client, stop)
            })
            .await?;
    }
    if offline {
        stack.start("cyrene-demo-tools", demo_tools).await?;
    }
    let web = if args.no_web {
        None
    } else {
        let mut page = args.page.clone();
        if page.web_personas.is_empty() {
            page.web_personas = personas_offered.clone();
        }
        start_web(
            &mut stack.services,
            args.web_addr,
            page,
            stack.shutdown.clone(),
        )
        .await
    };
    let Stack {
        mut services,
        shutdown,
        ..
    } = stack;

    eprintln!(
        "cyrene: up on {nats_url} — model-gateway ({}), checkpoint-store, orchestrator, {} loop worker(s); data in {}. Ctrl-C to stop.",
        if offline {
            "offline scripted demo"
        } else {
            "configured providers"
        },
        args.workers.max(1),
        store_dir.display()
    );
    if let Some(url) = web {
        eprintln!("cyrene: open {url} for the web chat");
    }
    let stop = cyrene_runtime::signal::signalled();
    tokio::pin!(stop);
    let mut failed = None;
    tokio::select! {
        _ = &mut stop => {}
        Some(done) = services.join_next() => {
            if let Ok((name, result)) = done {
                failed = Some(format!("{name} stopped: {}", result.err().unwrap_or_else(|| "without an error".into())));
            }
        }
    }
    shutdown.cancel();
    let drained = tokio::time::timeout(Duration::from_secs(15), async {
        while services.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        services.abort_all();
    }
    match failed {
        Some(message) => Err(CliError::Failed(message)),
        None => Ok(()),
    }
}

/// Serves the web chat among the services; its URL, or `None` (said on stderr) when the address
/// cannot be bound — a second `cyrene up` on one machine runs without a page.
async fn start_web(
    services: &mut Services,
    addr: std::net::SocketAddr,
    page: super::web::PageArgs,
    shutdown: CancellationToken,
) -> Option<String> {
    let served = async {
        let listener = super::web::bind(addr).await?;
        let url = super::web::page_url(&listener)?;
        Ok::<_, CliError>((listener, url))
    };
    match served.await {
        Ok((listener, url)) => {
            services.spawn(async move {
                let stop = async move { shutdown.cancelled().await };
                let served = super::web::serve(listener, page, stop).await;
                ("web", served.map_err(|e| e.to_string()))
            });
            Some(url)
        }
        Err(e) => {
            eprintln!("cyrene: not serving the web chat: {e}");
            None
        }
    }
}

/// The services `cyrene up` runs, each with its name and its failure as text.
type Services = JoinSet<(&'static str, Result<(), String>)>;

/// The services started so far, and how the next one connects.
struct Stack<'a> {
    bus: &'a cyrene_bus::BusArgs,
    nats_url: String,
    services: Services,
    shutdown: CancellationToken,
}

impl Stack<'_> {
    /// Connects as `binary` (its own connection, as when it runs as its own process) and runs
    /// `run(client, shutdown)` among the services.
    async fn start<E, Fut>(
        &mut self,
        binary: &'static str,
        run: impl FnOnce(async_nats::Client, CancellationToken) -> Fut,
    ) -> Result<(), CliError>
    where
        E: std::fmt::Display,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
    {
        let config = self
            .bus
            .config(binary, ConnectMode::Client)
            .map_err(CliError::Failed)?;
        let client = cyrene_bus::connect(&config).await.map_err(|e| {
            CliError::Failed(format!("cannot connect to NATS at {}: {e}", self.nats_url))
        })?;
        let service = run(client, self.shutdown.clone());
        let name = binary.trim_start_matches("cyrene-");
        self.services
            .spawn(async move { (name, service.await.map_err(|e| e.to_string())) });
        Ok(())
    }
}

/// A service's `Args` as the environment alone sets them.
fn service_args<A: ServiceArgs>(binary: &str) -> Result<A, CliError> {
    A::from_env(binary).map_err(|e| CliError::Failed(format!("{binary}: {e}")))
}

/// A service's configuration from its `Args`.
fn service_config<A: ServiceArgs>(binary: &str, args: A) -> Result<A::Config, CliError> {
    args.into_config().map_err(|problems| {
        CliError::Failed(format!("{binary}: invalid configuration: {problems}"))
    })
}

/// `search_notes`: a demo external tool on `cyrene.tool.search_notes` that takes 1.5 s;
/// `send_postcard`: one whose every call waits for the person's approval
/// (`cyrene.tool.approval` = `required`).
async fn demo_tools(client: async_nats::Client, shutdown: CancellationToken) -> Result<(), String> {
    let spec = ServiceSpec::new(
        "cyrene-demo-tools",
        env!("CARGO_PKG_VERSION"),
        "Cyrene demo tools (offline mode)",
    );
    let search_notes = |args: Value, _ctx: RequestContext| async move {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let query = args
            .get("query")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        Ok::<_, ErrorBody>(
            json!({"text": format!("3 notes mention {query:?}: the picnic, the tea shop, the lighthouse"), "is_error": false}),
        )
    };
    let send_postcard = |args: Value, _ctx: RequestContext| async move {
        let to = args
            .get("to")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        Ok::<_, ErrorBody>(
            json!({"text": format!("a postcard is on its way to {to}"), "is_error": false}),
        )
    };
    let endpoints = vec![
        Endpoint::json("send_postcard", "cyrene.tool.send_postcard", send_postcard).metadata(&[
            (
                "cyrene.tool.description",
                "Send a postcard (demo; every call waits for the person's approval).",
            ),
            (
                "cyrene.tool.parameters",
                r#"{"type":"object","properties":{"to":{"type":"string"},"text":{"type":"string"}},"required":["to","text"]}"#,
            ),
            ("cyrene.tool.approval", "required"),
        ]),
        Endpoint::json("search_notes", "cyrene.tool.search_notes", search_notes).metadata(&[
            (
                "cyrene.tool.description",
                "Search the user's notes (demo; takes 1.5 s).",
            ),
            (
                "cyrene.tool.parameters",
                r#"{"type":"object","properties":{"query":{"type":"string"}},"required":["query"]}"#,
            ),
        ]),
    ];
    Host::start(&client, spec, endpoints, shutdown)
        .await
        .map_err(|e| e.to_string())?
        .run()
        .await;
    Ok(())
}
