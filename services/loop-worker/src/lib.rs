//! The loop worker: runs turns from the JetStream work queue `CYRENE_TURNS` (docs/architecture.md
//! §5, §7; docs/semantics.md).
//!
//! Modules, from pure to wired:
//! - [`attribution`], [`notice`], [`resume`], [`assemble`]: the semantics of one step's view and
//!   of resuming, with their exact wording (docs/semantics.md); no I/O.
//! - [`runner`]: one turn step by step against the [`ports::TurnPorts`] trait.
//! - [`documents`]: documents resolved by reference and their text extracted for the view
//!   ([`pdf`]: PDF text within fixed budgets; [`extractions`]: the poison-document rule);
//!   [`images`]: images described for a main model without vision; [`memory`]: the
//!   working-memory and memory blocks.
//! - [`guard`]: the persona's guard, asked before each tool call and each answer.
//! - [`tools`]: built-in and discovered tools; [`nats`]: the ports over NATS.
//! - [`worker`]: the JetStream consumer; [`run`] ties it together.

pub mod assemble;
pub mod attribution;
pub mod config;
pub mod deltas;
pub mod documents;
pub mod extractions;
pub mod guard;
pub mod images;
pub mod memory;
pub mod nats;
pub mod notice;
pub mod pdf;
pub mod ports;
pub mod resume;
pub mod runner;
pub mod tools;
pub mod worker;

pub use config::{Args, Config};

/// Messages and parts the unit tests of the view modules build their transcripts from, and the
/// scripted model's text answer (the runner's and the image resolver's fakes both give it).
#[cfg(test)]
pub(crate) mod fixtures {
    use cyrene_protocol::ErrorBody;
    use cyrene_protocol::message::{Message, Part, Role};
    use cyrene_protocol::model::ModelResponse;

    /// A plain text answer of a scripted model.
    pub fn reply_text(text: &str) -> Result<ModelResponse, ErrorBody> {
        Ok(ModelResponse::offline_text("scripted", "offline", text))
    }

    pub fn user(text: &str) -> Message {
        Message::text(Role::User, text)
    }

    /// A user message of several parts (text, images, documents, ...).
    pub fn user_parts(parts: Vec<Part>) -> Message {
        Message::with_parts(Role::User, parts)
    }

    pub fn assistant(text: &str) -> Message {
        Message::text(Role::Assistant, text)
    }

    /// An image part, by URL.
    pub fn image(url: &str) -> Part {
        Part::ImageUrl {
            image_url: url.into(),
        }
    }

    /// A PDF document part of `size` bytes, by reference.
    pub fn pdf(name: &str, size: u64) -> Part {
        Part::Document {
            name: name.into(),
            mime: "application/pdf".into(),
            url: format!("cyrene-doc://{name}"),
            size,
        }
    }
}

use async_nats::Client;
use cyrene_bus::host::{Host, ServiceSpec};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The micro service name (stats and info only: the worker has no endpoints).
pub const SERVICE_NAME: &str = "cyrene-loop-worker";

/// How long a tool discovery gathers the micro services' `$SRV.INFO` answers.
const DISCOVERY_WAIT: Duration = Duration::from_millis(500);

/// How often the `CYRENE_TURNS` consumer's pending counts are sampled into the metrics.
const CONSUMER_SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// Why the worker could not run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] cyrene_runtime::entry::Problems),
    #[error(transparent)]
    Host(#[from] cyrene_bus::host::HostError),
}

cyrene_runtime::run_error!(Error::Config);

/// Runs the worker until `shutdown`; running turns get `shutdown_grace` to finish.
pub async fn run(config: Config, client: Client, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let config = Arc::new(config);
    let spec = ServiceSpec::new(
        SERVICE_NAME,
        env!("CARGO_PKG_VERSION"),
        "Cyrene loop worker: runs turn jobs from the CYRENE_TURNS work queue",
    );
    let mut host = Host::start(&client, spec, Vec::new(), shutdown.clone()).await?;
    let js = async_nats::jetstream::new(client.clone());
    // A signal before the bus is reachable is a clean stop (exit 0), at once.
    let Some(stream) = retry_until(&shutdown, "create the CYRENE_TURNS stream", || {
        cyrene_bus::streams::ensure_turns_stream_replicas(&js, config.turns_replicas)
    })
    .await
    else {
        return stopped_starting(host).await;
    };
    let consumer_config = worker::consumer_config(&config);
    // Create or update: a changed ack_wait or max_deliver must reach the existing consumer.
    let Some(consumer) = retry_until(&shutdown, "create the worker consumer", || {
        stream.create_consumer(consumer_config.clone())
    })
    .await
    else {
        return stopped_starting(host).await;
    };

    let tools = tools::Tools::new(client.clone(), config.tool_timeout, config.ask_timeout);
    let timeouts = nats::Timeouts {
        model: config.model_timeout,
        checkpoint: config.checkpoint_timeout,
        steer: config.steer_timeout,
    };
    let Some(extractions) = retry_until(&shutdown, "create the CYRENE_EXTRACTIONS bucket", || {
        extractions::Extractions::open(&js, config.turns_replicas, config.poison_after)
    })
    .await
    else {
        return stopped_starting(host).await;
    };
    let ports = Arc::new(
        nats::NatsPorts::new(client.clone(), tools.clone(), timeouts).with_extractions(extractions),
    );

    // No job before the first discovery is over: a turn started earlier would offer the model
    // none of the external tools, and a model cannot call a tool it was never offered. Until
    // then the worker is not ready (`/readyz`).
    let found = tokio::select! {
        found = tools.discover(DISCOVERY_WAIT) => found,
        _ = shutdown.cancelled() => return stopped_starting(host).await,
    };
    tracing::info!(tools = found, "external tools discovered; taking jobs");
    {
        let (tools, every, shutdown) = (tools.clone(), config.tool_refresh, shutdown.clone());
        host.spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(every) => {}
                }
                let found = tools.discover(DISCOVERY_WAIT).await;
                tracing::debug!(tools = found, "external tools discovered");
            }
        });
    }
    host.spawn(worker::exhausted_jobs(
        config.clone(),
        client.clone(),
        stream.clone(),
        ports.clone(),
        shutdown.clone(),
    ));
    host.spawn(worker::sample_consumer(
        consumer.clone(),
        CONSUMER_SAMPLE_EVERY,
        shutdown.clone(),
    ));
    tracing::info!(consumer = %config.consumer, concurrency = config.concurrency, "loop worker running");
    cyrene_runtime::health::global().set(SERVICE_NAME, true);
    worker::pull_loop(config, client.clone(), consumer, ports, shutdown.clone()).await;
    shutdown.cancel();
    host.run().await;
    Ok(())
}

/// Retries a JetStream setup call (the bus may still be connecting) until it works; `None` when
/// shutdown came first (the attempt under way is abandoned).
async fn retry_until<T, E, F, Fut>(shutdown: &CancellationToken, what: &str, call: F) -> Option<T>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    cyrene_bus::retry::until_ready(
        cyrene_bus::retry::STARTUP,
        shutdown,
        call,
        |err| tracing::warn!(error = %err, "cannot {what} yet; retrying"),
    )
    .await
}

/// A signal came before the worker took its first job: a clean stop, nothing to drain.
async fn stopped_starting(host: Host) -> Result<(), Error> {
    tracing::info!("stopped before start-up finished");
    host.run().await;
    Ok(())
}
