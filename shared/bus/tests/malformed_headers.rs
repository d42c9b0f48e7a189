//! A malformed header block costs one message, never the connection (issue 12, item 1): a raw
//! client publishes every block of `MALFORMED_HEADER_BLOCKS` to a plain subscriber, to a micro
//! endpoint served by `serve_json` and to `$SRV.PING`; the receiving connection never drops and
//! every message is delivered without headers (and so answered), as nats.go does.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

use async_nats::{Client, ConnectOptions, Event};
use cyrene_bus::request_json;
use cyrene_bus::service::{RequestContext, ServeOptions, serve_json};
use cyrene_protocol::ErrorBody;
use cyrene_test_support::micro::{add_endpoint, start_service};
use cyrene_test_support::{MALFORMED_HEADER_BLOCKS, NatsServer, RawConnection};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const T: Duration = Duration::from_secs(5);

#[derive(Debug, Serialize, Deserialize)]
struct Echo {
    text: String,
}

async fn echo(req: Echo, ctx: RequestContext) -> Result<Echo, ErrorBody> {
    Ok(Echo {
        text: format!("{} ({} headers)", req.text, ctx.headers.len()),
    })
}

/// A client that counts its disconnections.
async fn watched(server: &NatsServer) -> (Client, Arc<AtomicUsize>) {
    let drops = Arc::new(AtomicUsize::new(0));
    let counter = drops.clone();
    let client = ConnectOptions::new()
        .event_callback(move |event| {
            let counter = counter.clone();
            async move {
                if matches!(event, Event::Disconnected) {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
        .connect(server.url())
        .await
        .unwrap();
    (client, drops)
}

/// Everything `raw` sent so far was accepted by the server.
async fn accepted(raw: &mut RawConnection, what: &str) {
    let errors = raw.round_trip().await;
    assert!(errors.is_empty(), "{what}: the server refused: {errors:?}");
}

/// The echo micro endpoint on one watched connection, and on another a subscriber to plain
/// messages and to the raw client's replies (`raw.reply.>`); both connections' ids as started.
struct Echoing {
    service_client: Client,
    service_drops: Arc<AtomicUsize>,
    subscriber: Client,
    subscriber_drops: Arc<AtomicUsize>,
    plain: async_nats::Subscriber,
    replies: async_nats::Subscriber,
    connections: Vec<u64>,
    shutdown: CancellationToken,
    _service: async_nats::service::Service,
}

impl Echoing {
    async fn start(server: &NatsServer, echo_subject: &str, plain_subject: &str) -> Echoing {
        let (service_client, service_drops) = watched(server).await;
        let service = start_service(&service_client, "echoer", "0.1.0").await;
        let endpoint = add_endpoint(&service, "echo", echo_subject).await;
        let shutdown = CancellationToken::new();
        tokio::spawn(serve_json(
            endpoint,
            ServeOptions::default(),
            shutdown.clone(),
            echo,
        ));
        let (subscriber, subscriber_drops) = watched(server).await;
        let plain = subscriber
            .subscribe(plain_subject.to_owned())
            .await
            .unwrap();
        let replies = subscriber.subscribe("raw.reply.>").await.unwrap();
        subscriber.flush().await.unwrap();
        service_client.flush().await.unwrap();
        let connections = server.connection_ids();
        Echoing {
            service_client,
            service_drops,
            subscriber,
            subscriber_drops,
            plain,
            replies,
            connections,
            shutdown,
            _service: service,
        }
    }

    /// The next plain message the subscriber gets.
    async fn next_plain(&mut self, what: &str) -> async_nats::Message {
        tokio::time::timeout(T, self.plain.next())
            .await
            .unwrap_or_else(|_| panic!("{what}: the subscriber got nothing"))
            .unwrap()
    }

    /// Neither connection dropped, and both are the ones from the start.
    fn assert_no_connection_lost(&self, server: &NatsServer, what: &str) {
        assert_eq!(
            self.service_drops.load(Ordering::SeqCst),
            0,
            "{what}: service reconnected"
        );
        assert_eq!(
            self.subscriber_drops.load(Ordering::SeqCst),
            0,
            "{what}: subscriber reconnected"
        );
        let mut now = server.connection_ids();
        now.retain(|id| self.connections.contains(id));
        assert_eq!(now, self.connections, "{what}: a connection was replaced");
    }

    /// Each client connected once in the whole test; then the endpoint stops.
    fn assert_connected_once(self) {
        let service = self
            .service_client
            .statistics()
            .connects
            .load(Ordering::SeqCst);
        assert_eq!(service, 1);
        let subscriber = self.subscriber.statistics().connects.load(Ordering::SeqCst);
        assert_eq!(subscriber, 1);
        self.shutdown.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_header_block_costs_no_connection_and_the_message_arrives_without_headers() {
    let server = NatsServer::start();
    let mut echoing = Echoing::start(&server, "test.echo", "test.plain").await;

    let mut raw = RawConnection::connect(server.port(), None).await;
    for (i, (what, block)) in MALFORMED_HEADER_BLOCKS.iter().enumerate() {
        let payload = format!(r#"{{"text":"case {i}"}}"#);
        raw.hpub("test.plain", None, block, payload.as_bytes())
            .await;
        raw.hpub(
            "test.echo",
            Some(&format!("raw.reply.echo.{i}")),
            block,
            payload.as_bytes(),
        )
        .await;
        raw.hpub(
            "$SRV.PING",
            Some(&format!("raw.reply.ping.{i}")),
            block,
            b"",
        )
        .await;
        accepted(&mut raw, what).await;

        // The plain subscriber gets the message, payload intact, headers dropped.
        let message = echoing.next_plain(what).await;
        assert_eq!(message.payload, payload.as_bytes(), "{what}");
        assert!(message.headers.is_none(), "{what}: {:?}", message.headers);

        // The endpoint and the service's discovery answer the raw requests.
        let mut answered = Vec::new();
        for _ in 0..2 {
            let reply = tokio::time::timeout(T, echoing.replies.next())
                .await
                .unwrap_or_else(|_| panic!("{what}: unanswered, got {answered:?}"))
                .unwrap();
            answered.push(reply.subject.to_string());
            if reply.subject.as_str() == format!("raw.reply.echo.{i}") {
                let body: Echo = serde_json::from_slice(&reply.payload).unwrap();
                assert_eq!(body.text, format!("case {i} (0 headers)"), "{what}");
            }
        }
        answered.sort();
        assert_eq!(
            answered,
            [format!("raw.reply.echo.{i}"), format!("raw.reply.ping.{i}")],
            "{what}"
        );

        // Both connections are the ones from before, and still serve well-formed traffic.
        let ok: Echo = request_json(&echoing.subscriber, "test.echo", &json!({"text": "ok"}), T)
            .await
            .unwrap_or_else(|err| panic!("{what}: the endpoint stopped answering: {err}"));
        assert!(ok.text.starts_with("ok ("), "{what}: {}", ok.text);
        echoing.assert_no_connection_lost(&server, what);
    }
    echoing.assert_connected_once();
}

/// A subject (or reply subject) that is not UTF-8 costs only its message (issue 12, item 1): the
/// server forwards any bytes in a subject, so a raw `PUB x.\xff\xfe` reaches an `x.*` subscriber
/// and a wildcard micro endpoint. Each such message is skipped; the next one arrives and no
/// connection is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subject_that_is_not_utf8_costs_only_that_message() {
    let server = NatsServer::start();
    let mut echoing = Echoing::start(&server, "test.echo.*", "x.*").await;

    let mut raw = RawConnection::connect(server.port(), None).await;
    /// What is wrong, the subject, the reply subject.
    type Unreadable<'a> = (&'a str, &'a [u8], Option<&'a [u8]>);
    let unreadable: [Unreadable; 4] = [
        ("a non-UTF-8 token", b"x.\xff\xfe", None),
        ("a truncated UTF-8 sequence", b"x.\xe6\x98", None),
        (
            "a non-UTF-8 reply subject",
            b"x.ok",
            Some(b"raw.reply.\xff"),
        ),
        ("an overlong encoding", b"x.\xc0\xae", Some(b"raw.reply.x")),
    ];
    for (i, (what, subject, reply)) in unreadable.into_iter().enumerate() {
        let payload = format!(r#"{{"text":"case {i}"}}"#);
        // A plain subscriber, a wildcard endpoint and a header message, each then a good one.
        raw.publish(subject, reply, payload.as_bytes()).await;
        let mut endpoint_subject = b"test.echo.".to_vec();
        endpoint_subject.extend_from_slice(&subject[2..]);
        let endpoint_reply = reply.unwrap_or(b"raw.reply.bad");
        raw.publish(&endpoint_subject, Some(endpoint_reply), payload.as_bytes())
            .await;
        raw.publish(b"x.after", None, payload.as_bytes()).await;
        raw.publish(
            b"test.echo.after",
            Some(format!("raw.reply.echo.{i}").as_bytes()),
            payload.as_bytes(),
        )
        .await;
        accepted(&mut raw, what).await;

        // The plain subscriber gets the next message, never the unreadable one.
        let message = echoing.next_plain(what).await;
        assert_eq!(message.subject.as_str(), "x.after", "{what}");
        assert_eq!(message.payload, payload.as_bytes(), "{what}");
        // The endpoint answers the good request after the unreadable one.
        let reply = tokio::time::timeout(T, echoing.replies.next())
            .await
            .unwrap_or_else(|_| panic!("{what}: the endpoint stopped answering"))
            .unwrap();
        assert_eq!(
            reply.subject.as_str(),
            format!("raw.reply.echo.{i}"),
            "{what}"
        );
        let body: Echo = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(body.text, format!("case {i} (0 headers)"), "{what}");

        echoing.assert_no_connection_lost(&server, what);
    }
    echoing.assert_connected_once();
}
