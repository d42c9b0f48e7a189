//! `cyrene up`: every service in one process, for local use — the [`cyrene::stack::Stack`].
//!
//! Embedded defaults: SQLite files in the data directory, and — unless `--models` or the
//! gateway's `CYRENE_GATEWAY_MODELS` names a real provider config — the offline demo
//! ([`cyrene::stack::demo`]: the scripted model's demo script, the demo tools `search_notes`,
//! which takes a moment, so a message typed meanwhile is visibly steered into the running turn,
//! and `send_postcard`, which waits for the person's approval). Every service gets its own NATS
//! connection, exactly as when they run as separate processes, and its configuration from its
//! own `Args` read from the environment, so every env var of a service binary works under
//! `cyrene up` too.

use super::CliError;
use clap::Args;
use cyrene::stack::{Stack, demo};
use cyrene_bus::ConnectMode;
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_runtime::entry::ServiceArgs;
use std::path::PathBuf;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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

pub async fn run(bus: &cyrene_bus::BusArgs, args: UpArgs) -> Result<(), CliError> {
    let bus = bus
        .config("cyrene", ConnectMode::Client)
        .map_err(CliError::Failed)?;
    let nats_url = bus.redacted_urls().join(",");
    let fail = |what: &str, e: &dyn std::fmt::Display| CliError::Failed(format!("{what}: {e}"));
    if !args.no_web {
        super::web::check(&args.page)?;
    }
    // Each service starts from its own Args as the environment sets them, so every env var a
    // service binary honours applies here too; `cyrene up`'s own flags then take precedence.
    let gateway_args = service_args::<cyrene_model_gateway::Args>("cyrene-model-gateway")?;
    let store_args = service_args::<cyrene_checkpoint_store::Args>("cyrene-checkpoint-store")?;
    let orchestrator_args = service_args::<cyrene_orchestrator::Args>("cyrene-orchestrator")?;
    let worker_args = service_args::<cyrene_loop_worker::Args>("cyrene-loop-worker")?;
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
        None => demo::models().map_err(|e| fail("built-in model config", &e))?,
    };
    let secrets = Secrets::resolve(&models, |name| std::env::var(name).ok());
    let personas: cyrene_orchestrator::Personas = match &personas_path {
        Some(path) => {
            cyrene_orchestrator::Personas::load(path).map_err(|e| fail("personas", &e))?
        }
        None => demo::personas(),
    };
    let personas_offered: Vec<String> = personas.names().into_keys().collect();

    let mut gateway = service_config("cyrene-model-gateway", gateway_args)?;
    gateway.models = models;
    gateway.secrets = secrets;
    let mut store = service_config("cyrene-checkpoint-store", store_args)?;
    store.data_dir = store_dir.clone();
    let mut orchestrator = service_config("cyrene-orchestrator", orchestrator_args)?;
    orchestrator.data_dir = orchestrator_dir;
    orchestrator.personas = personas;
    let mut worker = service_config("cyrene-loop-worker", worker_args)?;
    // Tools registered after start show up within seconds, not half a minute.
    worker.tool_refresh = Duration::from_secs(5);
    let mut stack = Stack::builder(bus, &store_dir)
        .gateway(Some(gateway))
        .store(Some(store))
        .orchestrator(Some(orchestrator))
        .database_url(args.database_url.clone())
        .workers(args.workers.max(1), worker)
        .demo_tools(offline)
        .start()
        .await
        .map_err(|e| CliError::Failed(e.to_string()))?;

    let web = if args.no_web {
        None
    } else {
        let mut page = args.page.clone();
        if page.web_personas.is_empty() {
            page.web_personas = personas_offered.clone();
        }
        start_web(&mut stack, args.web_addr, page).await
    };

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
        Some((name, result)) = stack.exited() => {
            let why = result.err().map_or_else(|| "without an error".to_owned(), |e| e.to_string());
            failed = Some(format!("{name} stopped: {why}"));
        }
    }
    stack.stop(Duration::from_secs(15)).await;
    match failed {
        Some(message) => Err(CliError::Failed(message)),
        None => Ok(()),
    }
}

/// Serves the web chat among the services; its URL, or `None` (said on stderr) when the address
/// cannot be bound — a second `cyrene up` on one machine runs without a page.
async fn start_web(
    stack: &mut Stack,
    addr: std::net::SocketAddr,
    page: super::web::PageArgs,
) -> Option<String> {
    let served = async {
        let listener = super::web::bind(addr).await?;
        let url = super::web::page_url(&listener)?;
        Ok::<_, CliError>((listener, url))
    };
    match served.await {
        Ok((listener, url)) => {
            let shutdown: CancellationToken = stack.shutdown().clone();
            let stop = async move { shutdown.cancelled().await };
            stack.spawn("web", super::web::serve(listener, page, stop));
            Some(url)
        }
        Err(e) => {
            eprintln!("cyrene: not serving the web chat: {e}");
            None
        }
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
