//! Configuration of the Matrix bridge: the command line / environment ([`Args`], read only by
//! `main`) and the validated [`Config`] that [`crate::run`] takes (tests build it directly).

use cyrene_protocol::ids::{self, IdKind};
use cyrene_runtime::entry::{Problems, ServiceArgs};
use ruma::OwnedUserId;
use std::path::PathBuf;
use std::time::Duration;

/// Default long-poll of one `/sync`.
pub const DEFAULT_SYNC_TIMEOUT: Duration = Duration::from_secs(30);
/// Default largest image passed on to the model (raw bytes; it travels as a `data:` URI, a third
/// larger, inside a message the orchestrator takes up to 256 KiB of).
pub const DEFAULT_MAX_IMAGE_BYTES: usize = 180 * 1024;
/// Default largest file downloaded from a room and uploaded as a document (the orchestrator's
/// default largest document).
pub const DEFAULT_MAX_FILE_BYTES: usize = 8 * 1024 * 1024;

/// A password or token: never printed (`Debug` shows `***`); the bus's own type.
pub use cyrene_bus::connect::Secret;

/// Whose invitations the bot accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum JoinPolicy {
    /// Only the owner's (the default): strangers reach her in rooms the owner brought her into.
    Owner,
    /// Anybody's.
    Any,
}

/// Which messages of a group room she answers (every message enters the conversation either
/// way — see docs/matrix-bridge.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GroupAnswers {
    /// Messages that mention her (`m.mentions`, her display name or user id in the text) or
    /// reply to her.
    Mentions,
    /// Every message.
    All,
}

/// Everything [`crate::run`] needs besides the NATS client.
#[derive(Debug, Clone)]
pub struct Config {
    /// The homeserver's client-server API base URL (`https://matrix.example.org`).
    pub homeserver: String,
    /// The bot's full Matrix id (`@cyrene:example.org`).
    pub user: String,
    /// The bot's password (logged in once; the access token is kept in `data_dir`).
    pub password: Option<Secret>,
    /// Or an access token of the bot's.
    pub access_token: Option<Secret>,
    /// The owner's Matrix id: their messages are unlabelled, their DM is their own session.
    pub owner: String,
    /// The runtime person the owner is (`CYRENE_ORCHESTRATOR_OWNER`): every session of the
    /// bridge is theirs, `<owner_person>.<name>`.
    pub owner_person: String,
    /// Where the sync token, the access token and the rooms' progress are kept.
    pub data_dir: PathBuf,
    /// Whose invitations are accepted.
    pub join: JoinPolicy,
    /// Which group messages are answered.
    pub group_answers: GroupAnswers,
    /// Long-poll of one `/sync`.
    pub sync_timeout: Duration,
    /// Largest image (raw bytes) passed on as an image part; larger ones become a text note.
    pub max_image_bytes: usize,
    /// Largest file (bytes) downloaded from a room and uploaded as a document; a larger one
    /// becomes a text note, and a download is cut off past it.
    pub max_file_bytes: usize,
    /// How long one request to the orchestrator may take.
    pub request_timeout: Duration,
}

impl Config {
    /// Defaults around the required settings.
    pub fn new(
        homeserver: impl Into<String>,
        user: impl Into<String>,
        owner: impl Into<String>,
        owner_person: impl Into<String>,
        data_dir: impl Into<PathBuf>,
    ) -> Config {
        Config {
            homeserver: homeserver.into(),
            user: user.into(),
            password: None,
            access_token: None,
            owner: owner.into(),
            owner_person: owner_person.into(),
            data_dir: data_dir.into(),
            join: JoinPolicy::Owner,
            group_answers: GroupAnswers::Mentions,
            sync_timeout: DEFAULT_SYNC_TIMEOUT,
            max_image_bytes: DEFAULT_MAX_IMAGE_BYTES,
            max_file_bytes: DEFAULT_MAX_FILE_BYTES,
            request_timeout: Duration::from_secs(10),
        }
    }

    /// The bot's user id (checked by [`Config::problems`]).
    pub fn user_id(&self) -> Result<OwnedUserId, ConfigError> {
        user_id("user", &self.user)
    }

    /// The owner's user id (checked by [`Config::problems`]).
    pub fn owner_id(&self) -> Result<OwnedUserId, ConfigError> {
        user_id("owner", &self.owner)
    }

    /// Checks every value; all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(self.problems()?)
    }

    /// Every problem with the values.
    pub fn problems(&self) -> Result<(), Problems> {
        let mut problems = Vec::new();
        match reqwest::Url::parse(&self.homeserver) {
            Ok(url) if matches!(url.scheme(), "http" | "https") => {}
            _ => problems.push(format!(
                "homeserver: {:?} is not an http(s) URL",
                self.homeserver
            )),
        }
        for result in [self.user_id(), self.owner_id()] {
            if let Err(err) = result {
                problems.push(err.to_string());
            }
        }
        if let (Ok(user), Ok(owner)) = (self.user_id(), self.owner_id())
            && user == owner
        {
            problems.push("owner: the owner cannot be the bot itself".into());
        }
        match (&self.password, &self.access_token) {
            (None, None) => {
                problems.push("give the bot's password or an access token of its".into())
            }
            (Some(_), Some(_)) => {
                problems.push("give the bot's password or an access token, not both".into())
            }
            _ => {}
        }
        if let Err(e) = ids::validate(IdKind::Person, &self.owner_person) {
            problems.push(format!("owner_person: {e}"));
        }
        if self.sync_timeout.is_zero() || self.sync_timeout > Duration::from_secs(300) {
            problems.push("sync_timeout must be longer than zero and at most 5 minutes".into());
        }
        if self.max_file_bytes == 0 {
            problems.push("max_file_bytes must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            problems.push("request_timeout must be longer than zero".into());
        }
        Problems::check(problems)
    }
}

fn user_id(field: &str, text: &str) -> Result<OwnedUserId, ConfigError> {
    OwnedUserId::try_from(text).map_err(|source| ConfigError::UserId {
        field: field.to_owned(),
        text: text.to_owned(),
        source,
    })
}

/// An invalid configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Invalid(String),
    /// The values' problems ([`Config::validate`]).
    #[error(transparent)]
    Problems(#[from] Problems),
    #[error("{field}: {text:?} is not a Matrix user id (@name:server): {source}")]
    UserId {
        field: String,
        text: String,
        #[source]
        source: ruma::IdParseError,
    },
}

/// Command line and environment of the `cyrene-matrix-bridge` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "cyrene-matrix-bridge",
    version,
    about = "Cyrene's Matrix bridge: Matrix rooms into the owner's sessions (as the cyrene-bridge \
             NATS user), her answers back into the rooms."
)]
pub struct Args {
    #[command(flatten)]
    pub common: cyrene_runtime::entry::ServiceFlags,
    /// The homeserver's base URL, e.g. https://matrix.example.org.
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_HOMESERVER")]
    pub homeserver: Option<String>,
    /// The bot's full Matrix id, e.g. @cyrene:example.org.
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_USER")]
    pub user: Option<String>,
    /// The bot's password (or give an access token).
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_PASSWORD", hide_env_values = true)]
    pub password: Option<String>,
    /// An access token of the bot's (or give its password).
    #[arg(
        long,
        env = "CYRENE_MATRIX_BRIDGE_ACCESS_TOKEN",
        hide_env_values = true
    )]
    pub access_token: Option<String>,
    /// The owner's Matrix id, e.g. @alice:example.org.
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_OWNER")]
    pub owner: Option<String>,
    /// The runtime person the owner is (the orchestrator's CYRENE_ORCHESTRATOR_OWNER).
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_OWNER_PERSON")]
    pub owner_person: Option<String>,
    /// Directory of the bridge's state: sync token, access token, rooms (created if missing).
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_DATA_DIR", default_value = "./data")]
    pub data_dir: PathBuf,
    /// Whose invitations to accept: owner or any.
    #[arg(
        long,
        env = "CYRENE_MATRIX_BRIDGE_JOIN",
        value_enum,
        default_value = "owner"
    )]
    pub join: JoinPolicy,
    /// Which group messages she answers: mentions (and replies to her) or all.
    #[arg(
        long,
        env = "CYRENE_MATRIX_BRIDGE_GROUP_ANSWERS",
        value_enum,
        default_value = "mentions"
    )]
    pub group_answers: GroupAnswers,
    /// Long-poll of one /sync (e.g. 30s).
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_SYNC_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub sync_timeout: Duration,
    /// Largest image passed on to the model, in bytes.
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_MAX_IMAGE_BYTES", default_value_t = DEFAULT_MAX_IMAGE_BYTES)]
    pub max_image_bytes: usize,
    /// Largest file posted in a room that is passed on as a document, in bytes.
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_MAX_FILE_BYTES", default_value_t = DEFAULT_MAX_FILE_BYTES)]
    pub max_file_bytes: usize,
    /// How long one request to the orchestrator may take (e.g. 10s).
    #[arg(long, env = "CYRENE_MATRIX_BRIDGE_REQUEST_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
}

impl ServiceArgs for Args {
    type Config = Config;

    fn into_config(self) -> Result<Config, Problems> {
        let mut missing = Vec::new();
        let mut required = |name: &str, value: &Option<String>| {
            let value = value.clone().unwrap_or_default().trim().to_owned();
            if value.is_empty() {
                missing.push(format!("{name} is required"));
            }
            value
        };
        let homeserver = required("CYRENE_MATRIX_BRIDGE_HOMESERVER", &self.homeserver);
        let user = required("CYRENE_MATRIX_BRIDGE_USER", &self.user);
        let owner = required("CYRENE_MATRIX_BRIDGE_OWNER", &self.owner);
        let person = required("CYRENE_MATRIX_BRIDGE_OWNER_PERSON", &self.owner_person);
        let mut config = Config::new(homeserver, user, owner, person, &self.data_dir);
        let secret =
            |value: &Option<String>| value.as_deref().filter(|v| !v.is_empty()).map(Secret::new);
        config.password = secret(&self.password);
        config.access_token = secret(&self.access_token);
        config.join = self.join;
        config.group_answers = self.group_answers;
        config.sync_timeout = self.sync_timeout;
        config.max_image_bytes = self.max_image_bytes;
        config.max_file_bytes = self.max_file_bytes;
        config.request_timeout = self.request_timeout;
        if !missing.is_empty() {
            // Every problem at once: the missing ones and whatever else is wrong.
            if let Err(Problems(more)) = config.problems() {
                missing.extend(more.into_iter().filter(|p| !p.contains("\"\"")));
            }
            return Err(Problems(missing));
        }
        config.problems()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn valid() -> Config {
        let mut c = Config::new(
            "http://127.0.0.1:8008",
            "@cyrene:localhost",
            "@alice:localhost",
            "alice",
            "/tmp/x",
        );
        c.password = Some(Secret::new("pw"));
        c
    }

    #[test]
    fn a_valid_config_passes_and_every_problem_is_listed() {
        assert!(valid().validate().is_ok());
        let mut c = valid();
        c.homeserver = "matrix.example.org".into();
        c.owner = "alice".into();
        c.owner_person = "alice.x".into();
        c.access_token = Some(Secret::new("t"));
        let problems = c.problems().unwrap_err().0;
        assert_eq!(problems.len(), 4, "{problems:?}");
        let mut c = valid();
        c.owner = c.user.clone();
        assert!(c.validate().is_err());
    }

    #[test]
    fn secrets_never_print() {
        let mut c = valid();
        c.password = Some(Secret::new("hunter2"));
        c.access_token = Some(Secret::new("syt_secret"));
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("hunter2") && !shown.contains("syt_secret"),
            "{shown}"
        );
    }

    #[test]
    fn flags_build_a_config_and_missing_settings_are_named() {
        let args = Args::parse_from([
            "cyrene-matrix-bridge",
            "--homeserver",
            "https://m.example.org",
            "--user",
            "@cyrene:example.org",
            "--password",
            "pw",
            "--owner",
            "@alice:example.org",
            "--owner-person",
            "alice",
            "--join",
            "any",
        ]);
        let config = args.into_config().unwrap();
        assert_eq!(config.join, JoinPolicy::Any);
        assert_eq!(config.group_answers, GroupAnswers::Mentions);
        let args = Args::parse_from(["cyrene-matrix-bridge"]);
        let problems = args.into_config().unwrap_err().0;
        for name in [
            "HOMESERVER",
            "_USER",
            "_OWNER is",
            "OWNER_PERSON",
            "password",
        ] {
            assert!(
                problems.iter().any(|p| p.contains(name)),
                "{name}: {problems:?}"
            );
        }
    }
}
