//! NATS credentials by the nats CLI's conventions, against a real nats-server that requires them:
//! `NATS_USER`/`NATS_PASSWORD`, `NATS_NKEY` (a seed file), `user:password@` in `NATS_URL`
//! (percent-decoded) — and the password is never printed.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use common::workspace_binary;
use cyrene_test_support::NatsServer;
use std::time::Duration;
use tokio::process::Command;

const PASSWORD: &str = "p@ss:w0rd/x";

/// `cyrene probe` with `envs`: (exit code, stdout + stderr).
async fn probe(url: &str, envs: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cyrene"));
    cmd.args(["probe"])
        .env("NATS_URL", url)
        .env_remove("NATS_USER")
        .env_remove("NATS_PASSWORD")
        .env_remove("NATS_CREDS")
        .env_remove("NATS_NKEY")
        .env("RUST_LOG", "debug")
        .kill_on_drop(true);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
        .await
        .unwrap()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_credential_convention_connects_and_no_password_is_printed() {
    let pair = nkeys::KeyPair::new_user();
    let seed = pair.seed().unwrap();
    let server = NatsServer::builder()
        .jetstream(false)
        .config(format!(
            "authorization {{ users = [ {{user: svc, password: \"{PASSWORD}\"}}, {{nkey: {}}} ] }}",
            pair.public_key()
        ))
        .start();
    let plain = server.url();
    let host = plain.trim_start_matches("nats://");
    let dir = tempfile::tempdir().unwrap();
    let nkey_file = dir.path().join("svc.nk");
    std::fs::write(&nkey_file, format!("{seed}\n")).unwrap();

    // Refused without credentials, and with a wrong password — which is not echoed.
    let (code, _) = probe(&plain, &[]).await;
    assert_ne!(code, 0, "the server requires credentials");
    let (code, text) = probe(
        &plain,
        &[("NATS_USER", "svc"), ("NATS_PASSWORD", "wrong-secret")],
    )
    .await;
    assert_ne!(code, 0);
    assert!(!text.contains("wrong-secret"), "{text}");

    // NATS_USER / NATS_PASSWORD.
    let (code, text) = probe(&plain, &[("NATS_USER", "svc"), ("NATS_PASSWORD", PASSWORD)]).await;
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains(PASSWORD), "{text}");
    // NATS_NKEY: a seed file.
    let (code, text) = probe(&plain, &[("NATS_NKEY", nkey_file.to_str().unwrap())]).await;
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains(&seed), "{text}");
    // In the URL, percent-encoded.
    let encoded: String = percent_encode(PASSWORD);
    let (code, text) = probe(&format!("nats://svc:{encoded}@{host}"), &[]).await;
    assert_eq!(code, 0, "{text}");
    assert!(
        !text.contains(&encoded) && !text.contains(PASSWORD),
        "{text}"
    );

    // A service's --help never shows the password from its environment.
    let help = Command::new(workspace_binary("cyrene-checkpoint-store"))
        .arg("--help")
        .env("NATS_PASSWORD", PASSWORD)
        .env("NATS_URL", format!("nats://svc:{encoded}@{host}"))
        .output()
        .await
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("NATS_PASSWORD") && help.contains("NATS_CREDS"),
        "{help}"
    );
    assert!(
        !help.contains(PASSWORD) && !help.contains(&encoded),
        "{help}"
    );
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}
