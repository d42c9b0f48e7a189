//! The one `$SRV` client: NATS micro discovery (`PING`, `INFO`, `STATS`), as `cyrene probe`, the
//! loop worker's tool discovery, `cyrene up` and the tests use it.
//!
//! Every instance of a service answers a discovery request once, so a request gathers answers
//! until a deadline (or until as many as wanted arrived); the server's "no responders" status is
//! not an answer.

use async_nats::Client;
use futures::StreamExt;
use serde_json::Value;
use std::time::Duration;

/// A discovery verb.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Ping,
    Info,
    Stats,
}

/// `$SRV.<VERB>` for every service, `$SRV.<VERB>.<name>` for one.
pub fn subject(verb: Verb, name: Option<&str>) -> String {
    let verb = match verb {
        Verb::Ping => "PING",
        Verb::Info => "INFO",
        Verb::Stats => "STATS",
    };
    match name {
        Some(name) => format!("$SRV.{verb}.{name}"),
        None => format!("$SRV.{verb}"),
    }
}

/// Every JSON answer to `verb` (of service `name`, or of every service) that arrives within
/// `wait`, stopping early once `up_to` arrived.
pub async fn gather(
    client: &Client,
    verb: Verb,
    name: Option<&str>,
    wait: Duration,
    up_to: Option<usize>,
) -> Result<Vec<Value>, async_nats::Error> {
    let inbox = client.new_inbox();
    let mut answers = client.subscribe(inbox.clone()).await?;
    client
        .publish_with_reply(subject(verb, name), inbox, "".into())
        .await?;
    let deadline = tokio::time::Instant::now() + wait;
    let mut out = Vec::new();
    while up_to.is_none_or(|n| out.len() < n)
        && let Ok(Some(message)) = tokio::time::timeout_at(deadline, answers.next()).await
    {
        if message.status.is_some() && message.status != Some(async_nats::StatusCode::OK) {
            continue; // e.g. no responders: nobody is there
        }
        if let Ok(value) = serde_json::from_slice::<Value>(&message.payload) {
            out.push(value);
        }
    }
    Ok(out)
}

/// Whether service `name` answers `$SRV.PING` within `within`, asking again every `every` (each
/// ask waiting up to `every` too).
pub async fn wait_for(client: &Client, name: &str, within: Duration, every: Duration) -> bool {
    let subject = subject(Verb::Ping, Some(name));
    tokio::time::timeout(within, async {
        loop {
            let ping = client.request(subject.clone(), "".into());
            if let Ok(Ok(_)) = tokio::time::timeout(every, ping).await {
                return;
            }
            tokio::time::sleep(every / 4).await;
        }
    })
    .await
    .is_ok()
}

/// `field` (e.g. `num_requests`) of endpoint `endpoint` in a `$SRV.STATS` answer.
pub fn endpoint_stat(stats: &Value, endpoint: &str, field: &str) -> Option<u64> {
    stats
        .get("endpoints")?
        .as_array()?
        .iter()
        .find(|e| e.get("name").and_then(Value::as_str) == Some(endpoint))?
        .get(field)?
        .as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_and_stats() {
        assert_eq!(subject(Verb::Ping, None), "$SRV.PING");
        assert_eq!(subject(Verb::Stats, Some("x")), "$SRV.STATS.x");
        let stats = serde_json::json!({"endpoints":[{"name":"send","num_requests":3}]});
        assert_eq!(endpoint_stat(&stats, "send", "num_requests"), Some(3));
        assert_eq!(endpoint_stat(&stats, "other", "num_requests"), None);
    }
}
