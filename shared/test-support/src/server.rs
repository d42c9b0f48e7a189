//! One `nats-server` process: start, readiness, kill, restart, drop.

use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::binary::nats_server_binary;
use crate::probe;

/// How often readiness is polled.
const POLL: Duration = Duration::from_millis(15);
/// Default readiness deadline of a single server.
const SINGLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of server log shown when a start fails.
const LOG_TAIL_LINES: usize = 60;
/// Attempts to bind a fixed port that is briefly still taken.
const BIND_ATTEMPTS: u32 = 5;

/// What "ready" means for a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// The client port answers with `INFO`.
    Client,
    /// Plus JetStream is enabled on this server (no cluster-wide check).
    JetStreamServer,
    /// Plus `/healthz` is fully healthy (JetStream meta layer and assets).
    JetStreamFull,
}

impl Readiness {
    fn health_path(self) -> Option<&'static str> {
        match self {
            Readiness::Client => None,
            Readiness::JetStreamServer => Some("/healthz?js-server-only=true"),
            Readiness::JetStreamFull => Some("/healthz"),
        }
    }
}

/// Why a start failed.
#[derive(Debug)]
pub(crate) struct StartError {
    pub(crate) message: String,
    /// The server could not bind one of its ports.
    pub(crate) addr_in_use: bool,
}

/// A running (or killed, restartable) `nats-server` bound to `127.0.0.1`.
///
/// Owns a temporary directory with the JetStream store, the config file, the
/// ports file and the server log. Dropping it kills the process (SIGKILL),
/// waits for it and deletes the directory.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    /// Client port; 0 until the first start learned it.
    port: u16,
    /// Monitoring port of the current process (random per start).
    monitor_port: Option<u16>,
    /// Arguments besides host, ports and ports file dir.
    args: Vec<OsString>,
    jetstream: bool,
    readiness: Readiness,
    timeout: Duration,
    starts: u32,
    dir: TempDir,
}

/// Options for a [`NatsServer`]; created by [`NatsServer::builder`].
#[derive(Debug, Clone)]
pub struct NatsServerBuilder {
    config: Option<String>,
    jetstream: bool,
    args: Vec<OsString>,
    timeout: Duration,
}

impl Default for NatsServerBuilder {
    fn default() -> Self {
        Self {
            config: None,
            jetstream: true,
            args: Vec::new(),
            timeout: SINGLE_TIMEOUT,
        }
    }
}

impl NatsServerBuilder {
    /// Contents of a server config file, written to the temporary directory and
    /// passed with `-c`. Command-line settings of the harness (host, port,
    /// JetStream store directory) take precedence over the file.
    pub fn config(mut self, contents: impl Into<String>) -> Self {
        self.config = Some(contents.into());
        self
    }

    /// Turns JetStream on (the default) or off.
    pub fn jetstream(mut self, enabled: bool) -> Self {
        self.jetstream = enabled;
        self
    }

    /// Adds a raw command-line argument for `nats-server`.
    pub fn arg(mut self, arg: impl Into<OsString>) -> Self {
        self.args.push(arg.into());
        self
    }

    /// How long start and restart wait for readiness (default 10 s).
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts the server on a free port and waits until it is ready (and, with
    /// JetStream, until `/healthz` is OK). Panics with the log tail on failure.
    pub fn start(self) -> NatsServer {
        let readiness = if self.jetstream {
            Readiness::JetStreamFull
        } else {
            Readiness::Client
        };
        let mut server = NatsServer::new(
            self.config.as_deref(),
            self.jetstream,
            self.args,
            readiness,
            self.timeout,
            None,
        );
        if let Err(err) = server.spawn_ready() {
            panic!("{}", err.message);
        }
        server
    }
}

impl NatsServer {
    /// Starts a server with JetStream on a free port and waits until it is ready.
    pub fn start() -> NatsServer {
        Self::builder().start()
    }

    /// Options for a server: config file contents, JetStream on/off, extra args.
    pub fn builder() -> NatsServerBuilder {
        NatsServerBuilder::default()
    }

    /// A server not yet started. `port` fixes the client port (else `-p -1`).
    pub(crate) fn new(
        config: Option<&str>,
        jetstream: bool,
        extra_args: Vec<OsString>,
        readiness: Readiness,
        timeout: Duration,
        port: Option<u16>,
    ) -> NatsServer {
        let dir = tempfile::Builder::new()
            .prefix("cyrene-nats-")
            .tempdir()
            .expect("create a temporary directory for nats-server");
        let mut args: Vec<OsString> = Vec::new();
        if jetstream {
            let store = dir.path().join("store");
            args.extend(["-js".into(), "--store_dir".into(), store.into_os_string()]);
        }
        if let Some(contents) = config {
            let path = dir.path().join("nats-server.conf");
            std::fs::write(&path, contents).expect("write the nats-server config file");
            args.extend(["-c".into(), path.into_os_string()]);
        }
        args.extend(extra_args);
        NatsServer {
            child: None,
            port: port.unwrap_or(0),
            monitor_port: None,
            args,
            jetstream,
            readiness,
            timeout,
            starts: 0,
            dir,
        }
    }

    /// Client URL, `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Client port; stays the same across restarts.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Client port (same as [`NatsServer::port`]).
    pub fn client_port(&self) -> u16 {
        self.port
    }

    /// HTTP monitoring port of the running process (`None` when killed). It is
    /// chosen anew on every start.
    pub fn monitor_port(&self) -> Option<u16> {
        self.monitor_port
    }

    /// `GET path` on the monitoring port (e.g. `/connz?subs=1`), parsed as JSON; `None` when the
    /// server is killed or the endpoint does not answer 200 with JSON.
    pub fn monitor_json(&self, path: &str) -> Option<serde_json::Value> {
        probe::http_json(self.monitor_port?, path)
    }

    /// The subjects each client connection open now subscribes to, one list a connection
    /// (`/connz?subs=1`; blocking); empty when the server is killed or does not answer.
    pub fn subscriptions(&self) -> Vec<Vec<String>> {
        let Some(connz) = self.monitor_json("/connz?subs=1&limit=4096") else {
            return Vec::new();
        };
        connz["connections"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                c["subscriptions_list"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|s| s.as_str().map(str::to_owned))
                    .collect()
            })
            .collect()
    }

    /// The ids (`cid`) of the client connections open now, ascending (`/connz`; blocking). A
    /// client that lost its connection and reconnected has a new id, so an unchanged list means
    /// no client reconnected.
    pub fn connection_ids(&self) -> Vec<u64> {
        let monitor = self.monitor_port.expect("the server is running");
        let (status, body) = probe::http_get(monitor, "/connz?limit=1024").expect("GET /connz");
        assert_eq!(status, 200, "GET /connz: {body}");
        let connz: serde_json::Value = serde_json::from_str(&body).expect("/connz is JSON");
        let mut ids: Vec<u64> = connz["connections"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["cid"].as_u64())
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Whether JetStream is enabled.
    pub fn jetstream_enabled(&self) -> bool {
        self.jetstream
    }

    /// Process id of the running server (`None` when killed).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Whether the harness has a running process (false after [`NatsServer::kill`]).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// JetStream store directory (kept across restarts).
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// Server log file (stdout and stderr of every start, appended).
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("nats-server.log")
    }

    /// The last `lines` lines of the server log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Kills the process (SIGKILL) and waits for it; the port and store
    /// directory are kept for [`NatsServer::start_again`]. No-op when killed.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.monitor_port = None;
    }

    /// Starts a killed server again on the same port and store directory and
    /// waits for readiness. Panics if it is running.
    pub fn start_again(&mut self) {
        assert!(
            self.child.is_none(),
            "nats-server on port {} is already running",
            self.port
        );
        let mut attempt = 1;
        loop {
            match self.spawn_ready() {
                Ok(()) => return,
                Err(err) if err.addr_in_use && attempt < BIND_ATTEMPTS => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(err) => panic!("{}", err.message),
            }
        }
    }

    /// Kills the process and starts it again on the same port and store
    /// directory, waiting for readiness. Works after [`NatsServer::kill`] too.
    pub fn restart(&mut self) {
        self.kill();
        self.start_again();
    }

    /// Connects an `async_nats` client to this server (panics on failure).
    pub async fn connect(&self) -> async_nats::Client {
        let url = self.url();
        async_nats::connect(&url)
            .await
            .unwrap_or_else(|err| panic!("connecting to nats-server at {url}: {err}"))
    }

    /// Spawns the process and waits for readiness; kills it on failure.
    pub(crate) fn spawn_ready(&mut self) -> Result<(), StartError> {
        let log_start = std::fs::metadata(self.log_path()).map_or(0, |m| m.len());
        self.spawn();
        let result = self.wait_ready();
        if let Err(err) = result {
            self.kill();
            let new_log = std::fs::read(self.log_path()).unwrap_or_default();
            let new_log = String::from_utf8_lossy(
                new_log
                    .get(usize::try_from(log_start).unwrap_or(0)..)
                    .unwrap_or(&[]),
            )
            .into_owned();
            return Err(StartError {
                message: format!(
                    "{err}\n--- nats-server log ({}), last {LOG_TAIL_LINES} lines ---\n{}",
                    self.log_path().display(),
                    self.log_tail(LOG_TAIL_LINES)
                ),
                addr_in_use: new_log.contains("address already in use"),
            });
        }
        Ok(())
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let port = if self.port == 0 {
            "-1".to_owned()
        } else {
            self.port.to_string()
        };
        let mut command = Command::new(nats_server_binary());
        command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &port,
                "-m",
                "-1",
                "--ports_file_dir",
            ])
            .arg(self.dir.path())
            .args(&self.args)
            .stdin(Stdio::null());

        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the nats-server log file");
        let _ = writeln!(log, "--- harness: start #{}: {command:?}", self.starts);
        let stderr = log.try_clone().expect("clone the nats-server log file");
        command.stdout(log).stderr(stderr);

        let child = command.spawn().unwrap_or_else(|err| {
            panic!(
                "cannot spawn {}: {err}; run `make tools`",
                nats_server_binary().display()
            )
        });
        self.child = Some(child);
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + self.timeout;
        let Some(pid) = self.pid() else {
            return Err("nats-server is not running".to_owned());
        };
        let ports_file = self.dir.path().join(format!("nats-server_{pid}.ports"));
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!(
                    "nats-server (port {}) exited during start-up with {status}",
                    self.port_text()
                ));
            }
            let pending = self.pending(&ports_file);
            let Some(pending) = pending else {
                return Ok(());
            };
            if Instant::now() >= deadline {
                return Err(format!(
                    "nats-server (port {}) not ready after {:?}: {pending}",
                    self.port_text(),
                    self.timeout
                ));
            }
            std::thread::sleep(POLL);
        }
    }

    /// What readiness is still waiting for, or `None` when ready.
    fn pending(&mut self, ports_file: &Path) -> Option<&'static str> {
        if self.monitor_port.is_none() {
            let Some((client, monitor)) = read_ports_file(ports_file) else {
                return Some("no ports file yet");
            };
            self.port = client;
            self.monitor_port = Some(monitor);
        }
        if !probe::client_port_ready(self.port) {
            return Some("client port does not answer with INFO");
        }
        if let (Some(path), Some(monitor)) = (self.readiness.health_path(), self.monitor_port)
            && !probe::http_ok(monitor, path)
        {
            return Some("JetStream /healthz not OK");
        }
        None
    }

    fn port_text(&self) -> String {
        if self.port == 0 {
            "random".to_owned()
        } else {
            self.port.to_string()
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Reads `{"nats":["nats://127.0.0.1:P"],"monitoring":["http://127.0.0.1:M"],...}`.
fn read_ports_file(path: &Path) -> Option<(u16, u16)> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    let port_of = |key: &str| -> Option<u16> {
        json.get(key)?
            .get(0)?
            .as_str()?
            .rsplit(':')
            .next()?
            .trim_end_matches('/')
            .parse()
            .ok()
    };
    Some((port_of("nats")?, port_of("monitoring")?))
}

#[cfg(test)]
mod tests {
    use super::read_ports_file;

    #[test]
    fn reads_ports_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.ports");
        std::fs::write(
            &path,
            r#"{"nats":["nats://127.0.0.1:35953"],"monitoring":["http://127.0.0.1:36525"]}"#,
        )
        .unwrap();
        assert_eq!(read_ports_file(&path), Some((35953, 36525)));
        std::fs::write(&path, r#"{"nats":["nats://127.0.0.1:35"#).unwrap();
        assert_eq!(read_ports_file(&path), None);
    }
}
