//! A bare NATS echo responder in its own process: the floor a benchmark compares a service with.
//!
//! A bench binary calls [`run_echo_if_asked`] first thing in `main`; [`EchoProcess::start`]
//! re-runs the same binary with [`ECHO_ENV`] set, and that child answers every request on
//! [`ECHO_SUBJECT`] with its own payload, as plainly as async-nats allows. Measuring a request to
//! it beside a request to a service gives what one NATS round trip costs on this machine.

use futures::StreamExt;
use std::process::{Child, Command};

/// Set in the child: the NATS URL to connect to.
pub const ECHO_ENV: &str = "CYRENE_BENCH_ECHO";

/// Subject the echo responder answers on.
pub const ECHO_SUBJECT: &str = "bench.echo";

/// In the child started by [`EchoProcess::start`]: echoes until killed, never returns. Anywhere
/// else: returns at once.
pub fn run_echo_if_asked() {
    let Ok(url) = std::env::var(ECHO_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a Tokio runtime for the echo responder");
    runtime.block_on(async move {
        let client = async_nats::connect(url).await.expect("echo: connect");
        let mut requests = client
            .subscribe(ECHO_SUBJECT)
            .await
            .expect("echo: subscribe");
        client.flush().await.expect("echo: flush");
        while let Some(m) = requests.next().await {
            if let Some(reply) = m.reply {
                let _ = client.publish(reply, m.payload).await;
            }
        }
    });
    std::process::exit(0);
}

/// The echo responder process; killed on drop.
#[derive(Debug)]
pub struct EchoProcess(Child);

impl EchoProcess {
    /// Starts this very binary as an echo responder on `nats_url` and waits until it answers.
    pub async fn start(nats_url: &str) -> EchoProcess {
        let exe = std::env::current_exe().expect("the current executable");
        let child = Command::new(exe)
            .env(ECHO_ENV, nats_url)
            .spawn()
            .expect("spawn the echo responder");
        let process = EchoProcess(child);
        let client = async_nats::connect(nats_url).await.expect("connect");
        for _ in 0..200 {
            let asked = tokio::time::timeout(
                std::time::Duration::from_millis(200),
                client.request(ECHO_SUBJECT, "ready?".into()),
            )
            .await;
            if matches!(asked, Ok(Ok(_))) {
                return process;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        panic!("the echo responder never answered");
    }
}

impl Drop for EchoProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
