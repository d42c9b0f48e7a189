//! Test (and bench) helpers: a fresh PostgreSQL database per fixture, an SQLite file in a temp
//! dir, the service running in-process, and a cuttable TCP proxy for outage tests.
//!
//! PostgreSQL is reached through `CYRENE_TEST_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); each fixture creates `cyrene_ckpt_test_<uuid>` and
//! drops it (best effort, `WITH (FORCE)`) when dropped, also after a panic.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use cyrene_checkpoint_store::{Config, Error, PgStore, SqliteStore, StoreOptions, run};
use cyrene_protocol::JsonObject;
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_protocol::subjects;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A fresh PostgreSQL database per fixture (`cyrene_ckpt_test_<uuid>`), dropped afterwards.
pub use cyrene_sql::testing::TestDatabase as PgTestDb;

/// The name prefix of this crate's test databases.
pub const PG_PREFIX: &str = "cyrene_ckpt_test";

/// An SQLite database file in a temporary directory.
#[derive(Debug)]
pub struct SqliteTestDb {
    pub dir: tempfile::TempDir,
    pub url: String,
}

impl SqliteTestDb {
    pub fn new() -> SqliteTestDb {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("checkpoints.db").display());
        SqliteTestDb { dir, url }
    }

    pub async fn open(&self, options: &StoreOptions) -> SqliteStore {
        SqliteStore::open(&self.url, options).await.unwrap()
    }
}

/// Opens a store on a fresh PostgreSQL database.
pub async fn pg_store(options: &StoreOptions) -> (PgStore, PgTestDb) {
    let db = PgTestDb::create(PG_PREFIX).await;
    let store = PgStore::connect(&db.url, options).await.unwrap();
    (store, db)
}

/// A save body: `{owner}:{step}` with `state` `{"step":step,"note":note}`.
pub fn checkpoint(owner: &str, step: u32, note: &str) -> Checkpoint {
    let Value::Object(state) = json!({"step": step, "messages": [], "note": note}) else {
        unreachable!()
    };
    Checkpoint::unfenced(owner, step, state.into())
}

/// `checkpoint` with a fencing token.
pub fn fenced(owner: &str, step: u32, note: &str, turn: &str, attempt: u32) -> Checkpoint {
    Checkpoint {
        id: cyrene_protocol::checkpoint::checkpoint_id(owner, Some(turn), step),
        turn_id: Some(turn.to_owned()),
        attempt: Some(attempt),
        ..checkpoint(owner, step, note)
    }
}

/// The `note` of a checkpoint's state.
pub fn note(cp: &Checkpoint) -> &str {
    #[derive(serde::Deserialize)]
    struct Note<'a> {
        #[serde(borrow)]
        note: Option<&'a str>,
    }
    serde_json::from_str::<Note<'_>>(cp.state.as_str())
        .ok()
        .and_then(|n| n.note)
        .unwrap_or("")
}

/// A state of roughly `bytes` bytes.
pub fn big_state(bytes: usize) -> JsonObject {
    JsonObject::encode(&json!({"blob": "x".repeat(bytes)})).unwrap()
}

/// The service running in-process on its own task.
#[derive(Debug)]
pub struct RunningService {
    pub shutdown: CancellationToken,
    handle: JoinHandle<Result<(), Error>>,
}

impl RunningService {
    /// Starts `run(config)` and waits (bounded) until `latest` answers.
    pub async fn start(nats_url: &str, config: Config) -> RunningService {
        let client = async_nats::connect(nats_url).await.unwrap();
        let probe = async_nats::connect(nats_url).await.unwrap();
        let shutdown = CancellationToken::new();
        let mut handle = tokio::spawn(run(config, client, shutdown.clone()));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let asked = probe
                .request(
                    subjects::CHECKPOINT_LATEST,
                    r#"{"agent_id":"readiness-probe"}"#.into(),
                )
                .await;
            if asked.is_ok() {
                break;
            }
            if handle.is_finished() {
                let result = (&mut handle).await;
                panic!("the service stopped before it was ready: {result:?}");
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the service did not become ready within 30s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        RunningService { shutdown, handle }
    }

    /// Cancels and waits (bounded) for `run` to return.
    pub async fn stop(self) -> Result<(), Error> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.handle)
            .await
            .expect("the service stops within 30s")
            .expect("the service task does not panic")
    }
}

/// A TCP proxy in front of `upstream` that can be cut (every relayed connection closed, new ones
/// accepted and closed at once), stalled (connections kept open but silent: a hung database) and
/// restored.
#[derive(Debug)]
pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: Arc<AtomicU8>,
    live: Arc<Mutex<CancellationToken>>,
    held: Arc<Mutex<Vec<TcpStream>>>,
    accept: JoinHandle<()>,
}

const OPEN: u8 = 0;
const CUT: u8 = 1;
const STALLED: u8 = 2;

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mode = Arc::new(AtomicU8::new(OPEN));
        let live = Arc::new(Mutex::new(CancellationToken::new()));
        let held = Arc::new(Mutex::new(Vec::new()));
        let (mode2, live2, held2) = (mode.clone(), live.clone(), held.clone());
        let accept = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    continue;
                };
                match mode2.load(Ordering::SeqCst) {
                    CUT => continue,
                    STALLED => {
                        held2.lock().unwrap().push(inbound);
                        continue;
                    }
                    _ => {}
                }
                let token = live2.lock().unwrap().clone();
                let (mode3, held3) = (mode2.clone(), held2.clone());
                tokio::spawn(async move {
                    let Ok(mut outbound) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    // `biased`: once `stall` or `cut` has cancelled the token, nothing more is
                    // relayed. Polled in random order, a request sent right after `stall` could
                    // still reach the database (and commit) before the cancellation was seen.
                    tokio::select! {
                        biased;
                        _ = token.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => return,
                    }
                    if mode3.load(Ordering::SeqCst) == STALLED {
                        let mut held = held3.lock().unwrap();
                        held.push(inbound);
                        held.push(outbound);
                    }
                });
            }
        });
        TcpProxy {
            addr,
            mode,
            live,
            held,
            accept,
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
        let mut live = self.live.lock().unwrap();
        live.cancel();
        *live = CancellationToken::new();
    }

    /// Closes every relayed connection and refuses new ones.
    pub fn cut(&self) {
        self.set(CUT);
    }

    /// Stops relaying but keeps every connection open: the database looks hung.
    pub fn stall(&self) {
        self.set(STALLED);
    }

    /// Relays new connections again (stalled ones are closed).
    pub fn restore(&self) {
        self.mode.store(OPEN, Ordering::SeqCst);
        self.held.lock().unwrap().clear();
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.live.lock().unwrap().cancel();
        self.held.lock().unwrap().clear();
    }
}
