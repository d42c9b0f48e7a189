//! Connecting to NATS from configuration: the server URLs and the credentials, by the nats CLI's
//! conventions — `user:password@` in a URL (percent-decoded), `NATS_USER` / `NATS_PASSWORD`,
//! `NATS_CREDS` (a JWT credentials file) or `NATS_NKEY` (a file holding an nkey seed).
//!
//! # Invariants
//! - A password never reaches `--help`, a log line, a `Debug` print or an error: it is held in a
//!   [`Secret`], whose `Debug`/`Display` print `***`.

use async_nats::{Client, ConnectOptions, Event};
use std::path::PathBuf;
use std::time::Duration;

/// A value that must not be printed (a password): `Debug` and `Display` show `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }

    /// The value itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

impl std::str::FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Secret, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}

/// How a process proves who it is to the NATS server (at most one applies; see [`BusArgs`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Auth {
    /// None, or `user:password@` in the URL.
    #[default]
    Url,
    UserPassword {
        user: String,
        password: Secret,
    },
    /// A credentials file (user JWT + nkey seed), as `nats --creds`.
    CredsFile(PathBuf),
    /// A file holding an nkey seed (`SU…`), as `nats --nkey`.
    NkeyFile(PathBuf),
}

/// The bus flags every binary shares (flattened into each service's `Args` and the CLI's).
#[derive(Debug, Clone, clap::Args)]
pub struct BusArgs {
    /// NATS server URL(s), comma-separated. `nats://user:password@host:4222` works too
    /// (percent-encode special characters).
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true,
        hide_env_values = true
    )]
    pub nats_url: String,
    /// NATS user name (with --nats-password).
    #[arg(long, env = "NATS_USER", global = true)]
    pub nats_user: Option<String>,
    /// NATS password (with --nats-user).
    #[arg(long, env = "NATS_PASSWORD", global = true, hide_env_values = true)]
    pub nats_password: Option<Secret>,
    /// NATS credentials file (user JWT and nkey seed).
    #[arg(long, env = "NATS_CREDS", global = true)]
    pub nats_creds: Option<PathBuf>,
    /// File holding an nkey seed to sign the server's challenge with.
    #[arg(long, env = "NATS_NKEY", global = true)]
    pub nats_nkey: Option<PathBuf>,
}

impl BusArgs {
    /// The connection config of process `name`; `Err` when the credentials contradict each other.
    pub fn config(&self, name: &str, mode: ConnectMode) -> Result<BusConfig, String> {
        let given = [
            self.nats_user.is_some() || self.nats_password.is_some(),
            self.nats_creds.is_some(),
            self.nats_nkey.is_some(),
        ];
        if given.iter().filter(|g| **g).count() > 1 {
            return Err(
                "give one way to authenticate to NATS: user/password, a creds file or an nkey"
                    .to_owned(),
            );
        }
        let auth = match (&self.nats_user, &self.nats_password) {
            (Some(user), Some(password)) => Auth::UserPassword {
                user: user.clone(),
                password: password.clone(),
            },
            (Some(_), None) | (None, Some(_)) => {
                return Err("--nats-user and --nats-password go together".to_owned());
            }
            (None, None) => match (&self.nats_creds, &self.nats_nkey) {
                (Some(creds), _) => Auth::CredsFile(creds.clone()),
                (None, Some(nkey)) => Auth::NkeyFile(nkey.clone()),
                (None, None) => Auth::Url,
            },
        };
        let mut config = BusConfig::new(&self.nats_url, name, mode);
        config.auth = auth;
        config.check_urls()?;
        Ok(config)
    }
}

/// How hard to try.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// Services: connect in the background and reconnect forever; `connect` returns at once.
    Service,
    /// Interactive clients: fail fast when no server answers, but reconnect forever once up.
    Client,
}

/// What a process needs to reach the bus.
#[derive(Clone)]
pub struct BusConfig {
    /// Comma-separated server URLs (`NATS_URL`); may carry `user:password@`.
    pub url: String,
    /// Connection name shown by `nats server report connections`; also names the inbox prefix.
    pub name: String,
    pub mode: ConnectMode,
    pub auth: Auth,
    /// The inbox prefix when not `_INBOX_<name>` (a person's private one, given by hand).
    pub inbox: Option<String>,
}

impl std::fmt::Debug for BusConfig {
    /// The URLs without their passwords.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BusConfig")
            .field("urls", &self.redacted_urls())
            .field("name", &self.name)
            .field("mode", &self.mode)
            .field("auth", &self.auth)
            .finish()
    }
}

impl BusConfig {
    pub fn new(url: impl Into<String>, name: impl Into<String>, mode: ConnectMode) -> Self {
        BusConfig {
            url: url.into(),
            name: name.into(),
            mode,
            auth: Auth::Url,
            inbox: None,
        }
    }

    /// `Err` naming the first server URL the client could not dial (its password hidden), or
    /// saying there is none: a configuration problem (exit 2), found before any connection.
    pub fn check_urls(&self) -> Result<(), String> {
        let dial = self.dial_urls();
        if dial.is_empty() {
            return Err(format!(
                "NATS_URL (--nats-url) {:?} names no server",
                self.url
            ));
        }
        for (url, shown) in dial.iter().zip(self.redacted_urls()) {
            if let Err(err) = url.parse::<async_nats::ServerAddr>() {
                return Err(format!(
                    "NATS_URL (--nats-url) {shown:?} is not a NATS server URL: {err}"
                ));
            }
        }
        Ok(())
    }

    /// The server URLs with any password replaced by `***`, for logs and errors.
    pub fn redacted_urls(&self) -> Vec<String> {
        self.urls()
            .into_iter()
            .map(|url| match split_userinfo(&url) {
                Some((scheme, userinfo, host)) => {
                    let user = userinfo.split(':').next().unwrap_or_default();
                    format!("{scheme}://{user}:***@{host}")
                }
                None => url,
            })
            .collect()
    }

    /// The server URLs without their `user:password@`: what the client library is given (it
    /// logs the addresses it dials), the credentials going to it separately.
    fn dial_urls(&self) -> Vec<String> {
        self.urls()
            .into_iter()
            .map(|url| match split_userinfo(&url) {
                Some((scheme, _, host)) => format!("{scheme}://{host}"),
                None => url,
            })
            .collect()
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

    /// `user:password` of the first URL that carries them, percent-decoded (`p%40ss` → `p@ss`).
    pub fn url_credentials(&self) -> Option<(String, String)> {
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8_lossy()
                .into_owned()
        };
        self.urls().iter().find_map(|url| {
            let addr: async_nats::ServerAddr = url.parse().ok()?;
            let user = decode(addr.username()?);
            Some((user, decode(addr.password().unwrap_or_default())))
        })
    }

    /// Per-service inbox prefix (`_INBOX_<name>`), so the server config can grant each service
    /// exactly its own reply subjects.
    pub fn inbox_prefix(&self) -> String {
        if let Some(inbox) = &self.inbox {
            return inbox.clone();
        }
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
    options = match &config.auth {
        // Credentials in the URL (`nats://user:pass@host:4222`, e.g. from a Kubernetes secret):
        // async-nats does not take them from the URL by itself.
        Auth::Url => match config.url_credentials() {
            Some((user, pass)) => options.user_and_password(user, pass),
            None => options,
        },
        Auth::UserPassword { user, password } => {
            options.user_and_password(user.clone(), password.expose().to_owned())
        }
        Auth::CredsFile(path) => options.credentials_file(path).await.map_err(|e| {
            async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::Io, e)
        })?,
        Auth::NkeyFile(path) => {
            let seed = std::fs::read_to_string(path).map_err(|e| {
                async_nats::ConnectError::with_source(async_nats::ConnectErrorKind::Io, e)
            })?;
            options.nkey(seed.trim().to_owned())
        }
    };
    options.connect(config.dial_urls()).await
}

/// `(scheme, userinfo, rest)` of a URL that carries `userinfo@`.
fn split_userinfo(url: &str) -> Option<(&str, &str, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let (userinfo, host) = rest.rsplit_once('@')?;
    Some((scheme, userinfo, host))
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
        let encoded = BusConfig::new("nats://gw:p%40ss%3Aw@n1:4222", "x", ConnectMode::Client);
        assert_eq!(
            encoded.url_credentials(),
            Some(("gw".into(), "p@ss:w".into()))
        );
    }

    #[test]
    fn passwords_are_never_printed() {
        let with = BusConfig::new(
            "nats://gw:s3cret@n1:4222,nats://n2:4222",
            "x",
            ConnectMode::Client,
        );
        let shown = format!("{with:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("gw:***@n1:4222"), "{shown}");
        assert_eq!(with.dial_urls(), ["nats://n1:4222", "nats://n2:4222"]);
        let args = BusArgs {
            nats_url: "nats://n1:4222".into(),
            nats_user: Some("gw".into()),
            nats_password: Some(Secret::new("hunter2")),
            nats_creds: None,
            nats_nkey: None,
        };
        let config = args.config("x", ConnectMode::Client).unwrap();
        for shown in [format!("{args:?}"), format!("{config:?}")] {
            assert!(!shown.contains("hunter2"), "{shown}");
        }
        assert_eq!(
            config.auth,
            Auth::UserPassword {
                user: "gw".into(),
                password: Secret::new("hunter2")
            }
        );
    }

    #[test]
    fn one_way_to_authenticate() {
        let base = BusArgs {
            nats_url: "nats://n1:4222".into(),
            nats_user: None,
            nats_password: None,
            nats_creds: None,
            nats_nkey: None,
        };
        assert_eq!(
            base.config("x", ConnectMode::Client).unwrap().auth,
            Auth::Url
        );
        let half = BusArgs {
            nats_user: Some("gw".into()),
            ..base.clone()
        };
        assert!(half.config("x", ConnectMode::Client).is_err());
        let both = BusArgs {
            nats_creds: Some("a.creds".into()),
            nats_nkey: Some("a.nk".into()),
            ..base.clone()
        };
        assert!(both.config("x", ConnectMode::Client).is_err());
        let creds = BusArgs {
            nats_creds: Some("a.creds".into()),
            ..base
        };
        assert_eq!(
            creds.config("x", ConnectMode::Client).unwrap().auth,
            Auth::CredsFile("a.creds".into())
        );
    }

    #[test]
    fn a_url_the_client_cannot_dial_is_a_configuration_problem_that_hides_the_password() {
        let args = |url: &str| BusArgs {
            nats_url: url.into(),
            nats_user: None,
            nats_password: None,
            nats_creds: None,
            nats_nkey: None,
        };
        for url in [
            "nats://127.0.0.1:4222",
            "127.0.0.1:4222",
            "tls://a:1,nats://b:2",
            "nats://gw:s3cret@n1:4222",
        ] {
            assert!(args(url).config("x", ConnectMode::Service).is_ok(), "{url}");
        }
        for (url, says) in [
            ("http://127.0.0.1:4222", "invalid scheme"),
            ("nats://gw:s3cret@[::1", "is not a NATS server URL"),
            ("nats://a:1,nats://b:port", "nats://b:port"),
            (" , ", "names no server"),
        ] {
            let err = args(url).config("x", ConnectMode::Service).unwrap_err();
            assert!(
                err.contains("NATS_URL") && err.contains(says),
                "{url}: {err}"
            );
            assert!(!err.contains("s3cret"), "{err}");
        }
    }
}
