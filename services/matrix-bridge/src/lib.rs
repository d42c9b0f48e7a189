//! `cyrene-matrix-bridge`: people talk to her from any Matrix client, alone or in a group
//! (docs/matrix-bridge.md). The bridge logs in as her bot account, carries room messages into
//! the owner's sessions on `cyrene.bridge.session.send` — as the `cyrene-bridge` NATS user, the
//! only identity that may label a third party or create a restricted session
//! (docs/security.md, "The owner and bridges") — and posts her answers back.
//!
//! This crate owns:
//! - the configuration ([`config`]);
//! - the homeserver client: ruma's typed requests over HTTP, rate limits waited out
//!   ([`matrix`]);
//! - what a room and a message are to Cyrene: session, restriction, speaker, mention
//!   ([`rooms`]; pure);
//! - what is kept across restarts ([`state`]);
//! - what approving in a room reads and posts ([`approval`]; pure);
//! - the sync loop and the answers ([`bridge`]).
//!
//! # Invariants
//! - The bridge keeps no conversation of its own: transcripts live in the orchestrator; the
//!   state file holds only where to resume (sync token), the access token, and which answers
//!   were posted.
//! - Secrets (password, access token) never reach a log line or a room.

pub mod approval;
pub mod bridge;
pub mod config;
pub mod matrix;
pub mod rooms;
pub mod state;

pub use config::{Args, Config, ConfigError, GroupAnswers, JoinPolicy, Secret};
/// The Matrix types the bridge speaks (its callers and tests use the same ones).
pub use ruma;

use async_nats::Client;
use matrix::{Homeserver, MatrixError};
use ruma::api::client::account::whoami;
use ruma::api::client::profile::get_display_name;
use ruma::api::client::session::login;
use ruma::api::client::uiaa::{MatrixUserIdentifier, UserIdentifier};
use state::{State, StateError};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The service name (logs, health, the NATS connection and its inbox prefix).
pub const SERVICE_NAME: &str = "cyrene-matrix-bridge";

/// Why the bridge could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    #[error(transparent)]
    State(#[from] StateError),
    #[error("cannot log in to the homeserver")]
    Login(#[source] MatrixError),
    #[error("nats: cannot follow the owner's sessions")]
    Bus(#[source] async_nats::SubscribeError),
    #[error("cannot build the HTTP client")]
    Http(#[source] reqwest::Error),
}

cyrene_runtime::run_error!(Error::Config);

/// Runs the bridge until `shutdown`: logs in (or reuses its token), follows the owner's
/// sessions' events, posts answers missed while it was down, then syncs.
pub async fn run(config: Config, client: Client, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let bot = config.user_id()?;
    let http = matrix::http_client().map_err(Error::Http)?;
    let mut state = State::load(&config.data_dir)?;
    let Some(hs) = log_in(&config, http, &mut state, &shutdown).await? else {
        return Ok(());
    };
    state.save(&config.data_dir)?;
    // The display name endpoint every homeserver serves (the profile-field one of Matrix 1.16
    // is newer than many).
    #[allow(deprecated)]
    let profile = get_display_name::v3::Request::new(bot.clone());
    let bot_name = match hs.call(profile).await {
        Ok(profile) => profile.displayname.unwrap_or_default(),
        Err(_) => String::new(),
    };
    let bot_name = if bot_name.trim().is_empty() {
        bot.localpart().to_owned()
    } else {
        bot_name
    };
    let events_subject = format!("cyrene.session.{}.*.events", config.owner_person);
    let events = client.subscribe(events_subject).await.map_err(Error::Bus)?;
    let bridge = Arc::new(bridge::Bridge::new(
        config,
        client.clone(),
        hs,
        bot,
        bot_name,
        state,
    ));
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(bridge.clone().follow(events, shutdown.clone()));
    for session in bridge.sessions().await {
        bridge.catch_up(&session).await;
        bridge.ask_pending(&session).await;
    }
    tracing::info!("matrix bridge syncing");
    bridge
        .sync_loop(&shutdown, || {
            cyrene_runtime::health::global().set(SERVICE_NAME, true);
        })
        .await;
    shutdown.cancel();
    while tasks.join_next().await.is_some() {}
    tracing::info!("matrix bridge stopped");
    Ok(())
}

/// The homeserver with a working access token: the configured one, the one kept in the state,
/// or a fresh password login (kept in the state). `None` when stopped first.
async fn log_in(
    config: &Config,
    http: reqwest::Client,
    state: &mut State,
    shutdown: &CancellationToken,
) -> Result<Option<Homeserver>, Error> {
    let hs = Homeserver::new(http, &config.homeserver);
    if let Some(token) = &config.access_token {
        return Ok(Some(hs.with_token(token.expose())));
    }
    let Some(password) = &config.password else {
        // Config::validate refuses this already.
        return Err(Error::Config(ConfigError::Invalid(
            "give the bot's password or an access token of its".into(),
        )));
    };
    if let Some(token) = state.access_token.clone() {
        let kept = hs.clone().with_token(token);
        match kept.call(whoami::v3::Request::new()).await {
            Ok(_) => return Ok(Some(kept)),
            Err(MatrixError::Status { status: 401, .. }) => {
                tracing::info!("the kept access token was revoked; logging in again");
                state.access_token = None;
            }
            Err(err) => return Err(Error::Login(err)),
        }
    }
    let mut login_request =
        login::v3::Request::new(login::v3::LoginInfo::Password(login::v3::Password::new(
            UserIdentifier::Matrix(MatrixUserIdentifier::new(config.user.clone())),
            password.expose().to_owned(),
        )));
    login_request.initial_device_display_name = Some(SERVICE_NAME.into());
    let logged_in = cyrene_bus::retry::retry(
        cyrene_bus::retry::STARTUP,
        shutdown,
        || async {
            match hs.call(login_request.clone()).await {
                Ok(answer) => Ok(Ok(answer)),
                Err(err) if err.is_transient() => Err(err),
                Err(err) => Ok(Err(err)),
            }
        },
        |err| tracing::warn!(error = %err, "cannot reach the homeserver to log in yet"),
    )
    .await;
    match logged_in {
        None => Ok(None),
        Some(Ok(answer)) => {
            state.access_token = Some(answer.access_token.clone());
            Ok(Some(hs.with_token(answer.access_token)))
        }
        Some(Err(err)) => Err(Error::Login(err)),
    }
}
