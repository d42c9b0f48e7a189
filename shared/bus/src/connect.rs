//! Connecting to NATS from configuration.

use async_nats::{Client, ConnectOptions, Event};
use std::time::Duration;

/// How hard to try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// Services: connect in the background and reconnect forever; `connect` returns at once.
    Service,
    /// Interactive clients: fail fast when no server answers, but reconnect forever once up.
    Client,
}

/// What a process needs to reach the bus.
#[derive(Debug, Clone)]
pub struct BusConfig {
    /// Comma-separated server URLs (`NATS_URL`).
    pub url: String,
    /// Connection name shown by `nats server report connections`; also names the inbox prefix.
    pub name: String,
    pub mode: ConnectMode,
}

impl BusConfig {
    pub fn new(url: impl Into<String>, name: impl Into<String>, mode: ConnectMode) -> Self {
        BusConfig {
            url: url.into(),
            name: name.into(),
            mode,
        }
    }

    /// The server URLs: `url` split at commas (async-nats takes a list, not a joined string).
    pub fn urls(&self) -> Vec<String> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// `user:password` of the first URL that carries them.
    pub fn url_credentials(&self) -> Option<(String, String)> {
        self.urls().iter().find_map(|url| {
            let addr: async_nats::ServerAddr = url.parse().ok()?;
            let user = addr.username()?.to_owned();
            Some((user, addr.password().unwrap_or_default().to_owned()))
        })
    }

    /// Per-service inbox prefix (`_INBOX_<name>`), so the server config can grant each service
    /// exactly its own reply subjects.
    pub fn inbox_prefix(&self) -> String {
        format!("_INBOX_{}", cyrene_protocol::subjects::token(&self.name))
    }
}

/// Connects with reconnect-forever, the per-service inbox prefix and connection logging.
pub async fn connect(config: &BusConfig) -> Result<Client, async_nats::ConnectError> {
    let name = config.name.clone();
    let mut options = ConnectOptions::new()
        .name(&config.name)
        .custom_inbox_prefix(config.inbox_prefix())
        .max_reconnects(None)
        .connection_timeout(Duration::from_secs(5))
        // Requests always pass their own deadline; this is only the backstop.
        .request_timeout(Some(Duration::from_secs(30)))
        .reconnect_delay_callback(|attempts| {
            Duration::from_millis((50u64 << attempts.min(5)).min(2_000))
        })
        .event_callback(move |event| {
            let name = name.clone();
            async move {
                match event {
                    Event::Connected => tracing::info!(connection = %name, "nats connected"),
                    Event::Disconnected => tracing::warn!(connection = %name, "nats disconnected"),
                    other => tracing::debug!(connection = %name, event = %other, "nats event"),
                }
            }
        });
    if config.mode == ConnectMode::Service {
        options = options.retry_on_initial_connect();
    }
    // Credentials in the URL (`nats://user:pass@host:4222`, e.g. from a Kubernetes secret):
    // async-nats does not take them from the URL by itself.
    if let Some((user, pass)) = config.url_credentials() {
        options = options.user_and_password(user, pass);
    }
    options.connect(config.urls()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comma_separated_urls_become_a_list_and_the_inbox_is_per_service() {
        let c = BusConfig::new(
            "nats://a:1, nats://b:2,",
            "cyrene-model-gateway",
            ConnectMode::Client,
        );
        assert_eq!(c.urls(), ["nats://a:1", "nats://b:2"]);
        assert_eq!(c.inbox_prefix(), "_INBOX_cyrene-model-gateway");
        assert_eq!(c.url_credentials(), None);
        let with = BusConfig::new(
            "nats://gw:s3cret@n1:4222,nats://n2:4222",
            "x",
            ConnectMode::Client,
        );
        assert_eq!(with.url_credentials(), Some(("gw".into(), "s3cret".into())));
    }
}
