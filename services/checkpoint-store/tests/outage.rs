//! Database outages: with PostgreSQL behind a cuttable TCP proxy, `save`/`latest` answer
//! `unavailable` within a bounded time while it is cut, and succeed again once it is restored,
//! without restarting the service. A database that is down at start fails `run` promptly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{PgTestDb, RunningService, TcpProxy, checkpoint, note};
use cyrene_checkpoint_client::{CheckpointClient, Error as ClientError};
use cyrene_checkpoint_store::{Config, Error, run};
use cyrene_test_support::NatsServer;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Far above the service's own bounds (1 s acquire, 3 s per operation): a `Timeout` from the
/// client would mean the service hung.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

fn outage_config(dir: &tempfile::TempDir, url: String) -> Config {
    let mut config = Config::new(dir.path());
    config.database_url = Some(url);
    config.pool.acquire_timeout = Duration::from_secs(1);
    config.db_timeout = Duration::from_secs(3);
    config
}

/// What [`behind_a_proxy`] keeps alive for the test: the data dir, the bus, the database.
type Kept = (tempfile::TempDir, NatsServer, PgTestDb);

/// The service on a fresh PostgreSQL database reached through a [`TcpProxy`] the test can cut
/// or stall, and a typed client of it.
async fn behind_a_proxy() -> (Kept, TcpProxy, RunningService, CheckpointClient) {
    let db = PgTestDb::create(common::PG_PREFIX).await;
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let service =
        RunningService::start(&nats.url(), outage_config(&dir, db.url_via(proxy.addr))).await;
    let store = CheckpointClient::new(nats.connect().await, CLIENT_TIMEOUT);
    ((dir, nats, db), proxy, service, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_answers_unavailable_and_recovers_without_restart() {
    let (_kept, proxy, service, store) = behind_a_proxy().await;

    store.save(&checkpoint("s1", 1, "before")).await.unwrap();
    assert_eq!(note(&store.latest("s1").await.unwrap()), "before");

    proxy.cut();
    for step in 2..=3 {
        let err = store
            .save(&checkpoint("s1", step, "during"))
            .await
            .unwrap_err();
        assert!(matches!(err, ClientError::Unavailable(_)), "save: {err}");
        let err = store.latest("s1").await.unwrap_err();
        assert!(matches!(err, ClientError::Unavailable(_)), "latest: {err}");
        assert!(err.is_retryable());
    }

    proxy.restore();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let saved = loop {
        match store.save(&checkpoint("s1", 4, "after")).await {
            Ok(saved) => break saved,
            Err(ClientError::Unavailable(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("the service did not recover: {err}"),
        }
    };
    assert_eq!(saved.step, 4);
    let latest = store.latest("s1").await.unwrap();
    assert_eq!((latest.step, note(&latest)), (4, "after"));
    assert!(
        matches!(store.get("s1:2").await, Err(ClientError::NotFound(_))),
        "nothing from the outage was written"
    );
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_postgres_answers_unavailable_within_the_bound_and_recovers() {
    let (_kept, proxy, service, store) = behind_a_proxy().await;
    store.save(&checkpoint("s1", 1, "before")).await.unwrap();

    proxy.stall();
    let err = store
        .save(&checkpoint("s1", 2, "during"))
        .await
        .unwrap_err();
    assert!(matches!(err, ClientError::Unavailable(_)), "save: {err}");
    let err = store.latest("s1").await.unwrap_err();
    assert!(matches!(err, ClientError::Unavailable(_)), "latest: {err}");

    proxy.restore();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match store.latest("s1").await {
            Ok(latest) => {
                assert_eq!(latest.step, 1);
                break;
            }
            Err(ClientError::Unavailable(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(err) => panic!("the service did not recover: {err}"),
        }
    }
    store.save(&checkpoint("s1", 3, "after")).await.unwrap();
    assert_eq!(note(&store.latest("s1").await.unwrap()), "after");
    service.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_down_at_start_fails_run_promptly() {
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    proxy.cut();
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("postgres://postgres@{}/test", proxy.addr);
    let result = tokio::time::timeout(
        Duration::from_secs(30),
        run(
            outage_config(&dir, url),
            nats.connect().await,
            CancellationToken::new(),
        ),
    )
    .await
    .expect("run gives up instead of hanging");
    assert!(
        matches!(result, Err(Error::Store(ref e)) if e.code() == cyrene_protocol::ErrorCode::Unavailable),
        "{result:?}"
    );
}
