//! The built binary: flags and env configure it, it serves over NATS with the default SQLite
//! database in its data directory, and SIGTERM stops it cleanly (exit 0).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use cyrene_protocol::subjects;
use cyrene_test_support::NatsServer;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Kills the child if the test fails before it stopped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_and_stops_cleanly_on_sigterm() {
    let nats = NatsServer::start();
    let dir = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_cyrene-checkpoint-store"))
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .env("NATS_URL", nats.url())
        .env_remove("DATABASE_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let client = nats.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let reply = loop {
        let asked = client
            .request(subjects::CHECKPOINT_LATEST, r#"{"agent_id":"s1"}"#.into())
            .await;
        if let Ok(reply) = asked {
            break reply;
        }
        assert!(tokio::time::Instant::now() < deadline, "not ready in 30s");
        assert!(
            child.0.try_wait().unwrap().is_none(),
            "the binary exited early"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(String::from_utf8_lossy(&reply.payload).contains("not_found"));
    assert!(dir.path().join("data/checkpoints.db").is_file());

    let killed = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.0.kill();
            panic!("the binary did not stop within 30s of SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}

#[test]
fn an_unsupported_database_url_exits_with_status_2() {
    let status = Command::new(env!("CARGO_BIN_EXE_cyrene-checkpoint-store"))
        .args([
            "--database-url",
            "mysql://x",
            "--nats-url",
            "nats://127.0.0.1:1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(2));
}
