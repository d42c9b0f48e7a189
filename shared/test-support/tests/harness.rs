//! Tests of the nats-server harness itself.
#![allow(clippy::unwrap_used)] // a failed call should fail the test

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use async_nats::connection::State;
use async_nats::jetstream;
use cyrene_test_support::{NatsCluster, NatsServer};
use futures::StreamExt;

const WAIT: Duration = Duration::from_secs(15);

fn port_accepts(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
}

/// Waits (bounded) until the client reports a connected state.
async fn wait_connected(client: &async_nats::Client) {
    let deadline = Instant::now() + WAIT;
    while client.connection_state() != State::Connected {
        assert!(Instant::now() < deadline, "client did not reconnect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publishes on `subject` via `publisher` until `subscriber` receives it.
async fn round_trip(
    publisher: &async_nats::Client,
    subscriber: &mut async_nats::Subscriber,
    subject: &str,
) {
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(Instant::now() < deadline, "no message on {subject}");
        if publisher
            .publish(subject.to_owned(), "ping".into())
            .await
            .is_err()
            || publisher.flush().await.is_err()
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        }
        if let Ok(Some(message)) =
            tokio::time::timeout(Duration::from_millis(250), subscriber.next()).await
        {
            assert_eq!(message.payload.as_ref(), b"ping");
            return;
        }
    }
}

/// Creates the stream `name` on `subjects`, with `replicas` (0: the server's default).
async fn create_stream(js: &jetstream::Context, name: &str, subjects: &str, replicas: usize) {
    js.create_stream(jetstream::stream::Config {
        name: name.to_owned(),
        subjects: vec![subjects.to_owned()],
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .unwrap();
}

/// Publishes `payload` on `subject` and waits for the stream's ack.
async fn publish_acked(js: &jetstream::Context, subject: &'static str, payload: &'static str) {
    js.publish(subject, payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

#[tokio::test]
async fn started_server_round_trips_a_message() {
    let server = NatsServer::start();
    assert_eq!(server.url(), format!("nats://127.0.0.1:{}", server.port()));
    assert_eq!(server.client_port(), server.port());
    let client = server.connect().await;
    let mut subscriber = client.subscribe("harness.ping").await.unwrap();
    client.flush().await.unwrap();
    client.publish("harness.ping", "ping".into()).await.unwrap();
    let message = tokio::time::timeout(WAIT, subscriber.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(message.payload.as_ref(), b"ping");
}

#[test]
fn two_servers_get_different_ports() {
    let a = NatsServer::start();
    let b = NatsServer::start();
    assert_ne!(a.port(), b.port());
    assert_ne!(a.store_dir(), b.store_dir());
}

#[tokio::test]
async fn config_file_and_jetstream_off_are_applied() {
    let server = NatsServer::builder()
        .config("max_payload: 2048\n")
        .jetstream(false)
        .start();
    assert!(!server.jetstream_enabled());
    let client = server.connect().await;
    assert_eq!(client.server_info().max_payload, 2048);
    assert!(!client.server_info().jetstream);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_keeps_port_and_client_reconnects() {
    let mut server = NatsServer::start();
    let port = server.port();
    let pid = server.pid();
    let client = server.connect().await;
    let mut subscriber = client.subscribe("harness.restart").await.unwrap();
    client.flush().await.unwrap();

    server.restart();
    assert_eq!(server.port(), port);
    assert_ne!(server.pid(), pid);

    wait_connected(&client).await;
    // The subscription made before the restart is re-established...
    round_trip(&client, &mut subscriber, "harness.restart").await;
    // ...and new ones work too.
    let mut fresh = client.subscribe("harness.fresh").await.unwrap();
    round_trip(&client, &mut fresh, "harness.fresh").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_stream_survives_restart() {
    let mut server = NatsServer::start();
    let client = server.connect().await;
    let js = jetstream::new(client.clone());
    create_stream(&js, "HARNESS", "harness.js.>", 0).await;
    publish_acked(&js, "harness.js.one", "kept").await;

    server.restart();

    let js = jetstream::new(server.connect().await);
    let mut stream = js.get_stream("HARNESS").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    let message = stream.get_raw_message(1).await.unwrap();
    assert_eq!(message.payload.as_ref(), b"kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_then_start_again() {
    let mut server = NatsServer::start();
    let port = server.port();
    server.kill();
    assert!(!server.is_running());
    assert!(
        !port_accepts(port),
        "killed server still accepts connections"
    );
    server.start_again();
    assert_eq!(server.port(), port);
    let client = server.connect().await;
    let mut subscriber = client.subscribe("harness.again").await.unwrap();
    round_trip(&client, &mut subscriber, "harness.again").await;
    // restart works on a killed server too
    server.kill();
    server.restart();
    assert!(port_accepts(port));
}

#[test]
fn drop_kills_the_process_and_removes_the_directory() {
    let server = NatsServer::start();
    let port = server.port();
    let store = server.store_dir();
    assert!(port_accepts(port));
    assert!(store.exists());
    drop(server);
    let deadline = Instant::now() + WAIT;
    while port_accepts(port) {
        assert!(
            Instant::now() < deadline,
            "port {port} still accepts after drop"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!store.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_routes_messages_between_nodes() {
    let mut cluster = NatsCluster::start(3);
    assert_eq!(cluster.len(), 3);
    assert_eq!(cluster.urls().split(',').count(), 3);

    let publisher = cluster.node(0).connect().await;
    let receiver = cluster.node(2).connect().await;
    let mut subscriber = receiver.subscribe("harness.cluster").await.unwrap();
    receiver.flush().await.unwrap();
    // Interest propagates over the routes asynchronously: retry the publish.
    round_trip(&publisher, &mut subscriber, "harness.cluster").await;

    // A replicated stream works, and survives one node restarting.
    let js = jetstream::new(cluster.connect().await);
    create_stream(&js, "REPLICATED", "harness.rep.>", 3).await;
    publish_acked(&js, "harness.rep.one", "r").await;
    js.get_stream("REPLICATED")
        .await
        .unwrap()
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("DURABLE".to_owned()),
            ..Default::default()
        })
        .await
        .unwrap();
    create_stream(&js, "SINGLE", "harness.single.>", 1).await;

    let port = cluster.node(1).port();
    cluster.restart_node(1);
    assert_eq!(cluster.node(1).port(), port);
    // restart_node waited for every stream and consumer to have a leader:
    // JetStream requests through the restarted node answer right away.
    let js = jetstream::new(cluster.node(1).connect().await);
    let mut stream = js.get_stream("REPLICATED").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    let mut consumer = stream
        .get_consumer::<jetstream::consumer::pull::Config>("DURABLE")
        .await
        .unwrap();
    assert_eq!(consumer.info().await.unwrap().num_pending, 1);
    js.get_stream("SINGLE").await.unwrap();
}

#[test]
#[should_panic(expected = "exited during start-up")]
fn start_failure_panics_with_the_log() {
    let _server = NatsServer::builder().config("listen: {{{ broken").start();
}
