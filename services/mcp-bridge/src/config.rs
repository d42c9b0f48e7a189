//! Configuration of the MCP bridge: the command line / environment ([`Args`], read only by
//! `main`), the validated [`Config`] that [`crate::run`] takes (tests build it directly), and the
//! servers file in the `mcpServers` JSON format MCP clients share ([`Servers`], docs/tools.md).

use cyrene_protocol::ids::{self, IdKind};
use cyrene_runtime::entry::{Problems, ServiceArgs};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// Default longest wait for one tool call's answer from its MCP server.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Default longest pause between two attempts to (re)start or (re)connect a server.
pub const DEFAULT_RESTART_MAX: Duration = Duration::from_secs(30);
/// Default longest wait for a server to start and answer `initialize` and `tools/list`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest servers file read (a paste of JSON, not a data set).
pub const MAX_SERVERS_FILE_BYTES: u64 = 1024 * 1024;

/// Everything [`crate::run`] needs besides the NATS client.
#[derive(Debug, Clone)]
pub struct Config {
    /// The servers, as read from the `mcpServers` file.
    pub servers: Servers,
    /// Longest wait for one tool call's answer.
    pub call_timeout: Duration,
    /// Longest pause between attempts to start a server again (the first is 500 ms, doubled).
    pub restart_max: Duration,
    /// Longest wait for a server to start and list its tools.
    pub connect_timeout: Duration,
}

impl Config {
    /// Defaults around the servers.
    pub fn new(servers: Servers) -> Config {
        Config {
            servers,
            call_timeout: DEFAULT_CALL_TIMEOUT,
            restart_max: DEFAULT_RESTART_MAX,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }

    /// Checks every value; all problems at once.
    pub fn validate(&self) -> Result<(), ConfigError> {
        Ok(self.problems()?)
    }

    /// Every problem with the values.
    pub fn problems(&self) -> Result<(), Problems> {
        let mut problems = self.servers.problems();
        for (name, value) in [
            ("call_timeout", self.call_timeout),
            ("restart_max", self.restart_max),
            ("connect_timeout", self.connect_timeout),
        ] {
            if value.is_zero() {
                problems.push(format!("{name} must be longer than zero"));
            }
        }
        Problems::check(problems)
    }
}

/// The `mcpServers` file: `{"mcpServers": {"<name>": {…}, …}}`, the format MCP clients share.
/// Keys other clients use that the bridge does not (`type`, `autoApprove`, …) are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Servers {
    #[serde(rename = "mcpServers", default)]
    pub servers: BTreeMap<String, Server>,
}

/// One server: a command the bridge starts (stdio) or a streamable-HTTP URL it connects to.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Server {
    Stdio(StdioServer),
    Http(HttpServer),
}

/// A server spoken to over its stdin/stdout.
#[derive(Debug, Clone, Deserialize)]
pub struct StdioServer {
    pub command: String,
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables set for the server. It inherits only `PATH`, `HOME`, `USER`, `LANG`, `LC_ALL`,
    /// `TMPDIR` and these: never the bridge's own (its NATS credentials).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The working directory (the bridge's when absent).
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    #[serde(default)]
    pub disabled: bool,
}

/// A server spoken to over streamable HTTP.
#[derive(Debug, Clone, Deserialize)]
pub struct HttpServer {
    pub url: String,
    /// Headers sent with every request (e.g. `Authorization`); never logged.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub disabled: bool,
}

impl Server {
    pub fn disabled(&self) -> bool {
        match self {
            Server::Stdio(s) => s.disabled,
            Server::Http(s) => s.disabled,
        }
    }
}

/// The longest server name: `<server>__<tool>` must stay a tool name (128 characters).
pub const MAX_SERVER_NAME: usize = 32;

impl Servers {
    /// Parses the file's text.
    pub fn parse(text: &str) -> Result<Servers, ConfigError> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(ConfigError::NotJson)?;
        if value.get("mcpServers").is_none_or(|s| !s.is_object()) {
            return Err(ConfigError::Invalid(
                "the servers file needs an object \"mcpServers\": {\"<name>\": {\"command\": …} or {\"url\": …}}".into(),
            ));
        }
        let mut servers = Servers::default();
        let mut problems = Vec::new();
        if let Some(map) = value.get("mcpServers").and_then(|m| m.as_object()) {
            for (name, spec) in map {
                match serde_json::from_value::<Server>(spec.clone()) {
                    Ok(server) => {
                        servers.servers.insert(name.clone(), server);
                    }
                    Err(_) => problems.push(format!(
                        "mcpServers.{}: give \"command\" (and \"args\", \"env\") or \"url\" (and \"headers\")",
                        shown(name)
                    )),
                }
            }
        }
        if problems.is_empty() {
            Ok(servers)
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }

    /// Reads and parses the file at `path`.
    pub fn load(path: &std::path::Path) -> Result<Servers, ConfigError> {
        let unreadable = |source| ConfigError::Read {
            path: path.to_owned(),
            source,
        };
        let size = std::fs::metadata(path).map_err(unreadable)?.len();
        if size > MAX_SERVERS_FILE_BYTES {
            return Err(ConfigError::Invalid(format!(
                "{} is {size} bytes; the servers file may be at most {MAX_SERVERS_FILE_BYTES}",
                path.display()
            )));
        }
        Servers::parse(&std::fs::read_to_string(path).map_err(unreadable)?)
    }

    /// The enabled servers.
    pub fn enabled(&self) -> impl Iterator<Item = (&String, &Server)> {
        self.servers.iter().filter(|(_, s)| !s.disabled())
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for (name, server) in &self.servers {
            let at = format!("mcpServers.{}", shown(name));
            if let Err(e) = ids::validate(IdKind::Tool, name) {
                problems.push(format!("{at}: the name must be a tool name part: {e}"));
            } else if name.len() > MAX_SERVER_NAME || name.contains("__") {
                problems.push(format!(
                    "{at}: the name may have at most {MAX_SERVER_NAME} characters and no \"__\""
                ));
            }
            match server {
                Server::Stdio(s) if s.command.trim().is_empty() => {
                    problems.push(format!("{at}: \"command\" is empty"))
                }
                Server::Http(s) => match url_scheme(&s.url) {
                    Some("http" | "https") => {}
                    _ => problems.push(format!("{at}: \"url\" must be an http(s) URL")),
                },
                Server::Stdio(_) => {}
            }
        }
        problems
    }
}

fn url_scheme(url: &str) -> Option<&str> {
    let (scheme, rest) = url.split_once("://")?;
    (!rest.is_empty()).then_some(scheme)
}

/// A name from the file as it may be shown in an error: at most 40 characters, debug-quoted.
fn shown(name: &str) -> String {
    format!("{:?}", name.chars().take(40).collect::<String>())
}

/// An invalid configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{0}")]
    Invalid(String),
    /// The values' problems ([`Config::validate`]).
    #[error(transparent)]
    Problems(#[from] Problems),
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the servers file is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
}

/// Command line and environment of the `cyrene-mcp-bridge` binary.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "cyrene-mcp-bridge",
    version,
    about = "Cyrene's MCP bridge: the tools of MCP servers (stdio or streamable HTTP) as \
             cyrene.tool.<server>__<tool> NATS micro endpoints."
)]
pub struct Args {
    #[command(flatten)]
    pub common: cyrene_runtime::entry::ServiceFlags,
    /// The servers file, in the mcpServers JSON format MCP clients share.
    #[arg(long, env = "CYRENE_MCP_BRIDGE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Longest wait for one tool call's answer (e.g. 60s).
    #[arg(long, env = "CYRENE_MCP_BRIDGE_CALL_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub call_timeout: Duration,
    /// Longest pause between attempts to start or reach a server again (e.g. 30s).
    #[arg(long, env = "CYRENE_MCP_BRIDGE_RESTART_MAX", default_value = "30s", value_parser = humantime::parse_duration)]
    pub restart_max: Duration,
    /// Longest wait for a server to start and list its tools (e.g. 60s).
    #[arg(long, env = "CYRENE_MCP_BRIDGE_CONNECT_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub connect_timeout: Duration,
}

impl ServiceArgs for Args {
    type Config = Config;

    fn into_config(self) -> Result<Config, Problems> {
        // Every problem at once: the file's and the other settings'.
        let mut problems = Vec::new();
        let servers = match &self.config {
            None => {
                problems.push("CYRENE_MCP_BRIDGE_CONFIG is required".to_owned());
                Servers::default()
            }
            Some(path) => Servers::load(path).unwrap_or_else(|e| {
                problems.push(e.to_string());
                Servers::default()
            }),
        };
        let config = Config {
            servers,
            call_timeout: self.call_timeout,
            restart_max: self.restart_max,
            connect_timeout: self.connect_timeout,
        };
        if let Err(Problems(more)) = config.problems() {
            problems.extend(more);
        }
        Problems::check(problems)?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_shared_format_parses_with_stdio_and_http_servers() {
        let servers = Servers::parse(
            r#"{"mcpServers": {
                "time": {"command": "uvx", "args": ["mcp-server-time"], "env": {"TZ": "UTC"}},
                "docs": {"url": "http://127.0.0.1:3001/mcp", "type": "http"},
                "off": {"command": "x", "disabled": true}}}"#,
        )
        .unwrap();
        assert!(
            matches!(&servers.servers["time"], Server::Stdio(s) if s.args == ["mcp-server-time"] && s.env["TZ"] == "UTC")
        );
        assert!(matches!(&servers.servers["docs"], Server::Http(s) if s.url.ends_with("/mcp")));
        assert_eq!(servers.enabled().count(), 2);
        assert!(Config::new(servers).validate().is_ok());
    }

    #[test]
    fn bad_files_and_bad_names_are_named() {
        for text in ["[]", "{", r#"{"servers": {}}"#, r#"{"mcpServers": []}"#] {
            assert!(Servers::parse(text).is_err(), "{text}");
        }
        let err = Servers::parse(r#"{"mcpServers": {"x": {"args": []}}}"#).unwrap_err();
        assert!(err.to_string().contains("mcpServers.\"x\""), "{err}");
        let servers = Servers::parse(
            r#"{"mcpServers": {"a.b": {"command": "x"}, "a__b": {"command": "x"},
                "web": {"url": "file:///etc/passwd"}, "e": {"command": " "}}}"#,
        )
        .unwrap();
        let problems = Config::new(servers).problems().unwrap_err().0;
        assert_eq!(problems.len(), 4, "{problems:?}");
    }

    #[test]
    fn flags_build_a_config_and_the_file_is_required() {
        let problems = Args::parse_from(["cyrene-mcp-bridge"])
            .into_config()
            .unwrap_err()
            .0;
        assert!(
            problems[0].contains("CYRENE_MCP_BRIDGE_CONFIG"),
            "{problems:?}"
        );
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mcp.json");
        std::fs::write(&path, r#"{"mcpServers": {"t": {"command": "t"}}}"#).unwrap();
        let config = Args::parse_from([
            "cyrene-mcp-bridge",
            "--config",
            path.to_str().unwrap(),
            "--call-timeout",
            "5s",
        ])
        .into_config()
        .unwrap();
        assert_eq!(config.call_timeout, Duration::from_secs(5));
        assert_eq!(config.servers.servers.len(), 1);
    }
}
