//! Subscriptions a test relies on before it makes the next request.

use async_nats::{Client, Subscriber, ToSubject};

/// Subscribes `client` to `subject` and flushes: when this returns the server has the interest,
/// so nothing published after it is missed.
pub async fn subscribed(client: &Client, subject: impl ToSubject) -> Subscriber {
    let subscriber = client.subscribe(subject).await.unwrap();
    client.flush().await.unwrap();
    subscriber
}
