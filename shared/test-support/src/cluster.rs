//! A JetStream cluster of `nats-server` nodes on `127.0.0.1`.

use std::collections::{HashMap, HashSet};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use crate::probe;
use crate::server::{NatsServer, Readiness, StartError};

/// Cluster name passed with `--cluster_name`.
const CLUSTER_NAME: &str = "cyrene-test";
/// Deadline for a node to start and for the cluster to form.
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(20);
/// Whole-cluster start attempts when a picked port was taken meanwhile.
const START_ATTEMPTS: u32 = 3;
/// How often cluster formation is polled.
const POLL: Duration = Duration::from_millis(20);

/// Several JetStream nodes routed into one cluster (`cyrene-test`).
///
/// Node `i` is named `n<i>`, has its own store directory and fixed client and
/// cluster ports, so each node can be killed and restarted on its own
/// ([`NatsCluster::node_mut`], [`NatsCluster::restart_node`]).
#[derive(Debug)]
pub struct NatsCluster {
    nodes: Vec<NatsServer>,
}

impl NatsCluster {
    /// Starts `size` nodes and waits (up to 20 s) until every node is healthy,
    /// routed to all others and agrees on the JetStream meta leader.
    pub fn start(size: usize) -> NatsCluster {
        assert!(size > 0, "a cluster needs at least one node");
        let mut attempt = 1;
        loop {
            match Self::try_start(size) {
                Ok(cluster) => {
                    cluster.wait_formed();
                    return cluster;
                }
                Err(err) if err.addr_in_use && attempt < START_ATTEMPTS => attempt += 1,
                Err(err) => panic!("starting a {size}-node nats cluster: {}", err.message),
            }
        }
    }

    fn try_start(size: usize) -> Result<NatsCluster, StartError> {
        let ports = free_ports(2 * size);
        let (client_ports, cluster_ports) = ports.split_at(size);
        let route_urls: Vec<String> = cluster_ports
            .iter()
            .map(|port| format!("nats://127.0.0.1:{port}"))
            .collect();
        let mut nodes = Vec::with_capacity(size);
        for i in 0..size {
            let others: Vec<&str> = route_urls
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, url)| url.as_str())
                .collect();
            let mut args = vec![
                "--server_name".into(),
                format!("n{i}").into(),
                "--cluster_name".into(),
                CLUSTER_NAME.into(),
                "--cluster".into(),
                route_urls[i].clone().into(),
            ];
            if !others.is_empty() {
                args.extend(["--routes".into(), others.join(",").into()]);
            }
            let mut node = NatsServer::new(
                None,
                true,
                args,
                Readiness::JetStreamServer,
                CLUSTER_TIMEOUT,
                Some(client_ports[i]),
            );
            node.spawn_ready()?;
            nodes.push(node);
        }
        Ok(NatsCluster { nodes })
    }

    /// Number of nodes (running or killed).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always false: a cluster has at least one node.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// All nodes, in order `n0`, `n1`, ...
    pub fn nodes(&self) -> &[NatsServer] {
        &self.nodes
    }

    /// Node `i` (panics when out of range).
    pub fn node(&self, i: usize) -> &NatsServer {
        &self.nodes[i]
    }

    /// Node `i`, mutable, to kill or restart it (panics when out of range).
    /// [`NatsServer::restart`] waits only for that node; see
    /// [`NatsCluster::restart_node`] to wait for the whole cluster.
    pub fn node_mut(&mut self, i: usize) -> &mut NatsServer {
        &mut self.nodes[i]
    }

    /// Client URLs of all nodes, comma-joined (for configuration strings;
    /// `async_nats::connect` does not split it — use [`NatsCluster::client_urls`]).
    pub fn urls(&self) -> String {
        self.client_urls().join(",")
    }

    /// Client URLs of all nodes.
    pub fn client_urls(&self) -> Vec<String> {
        self.nodes.iter().map(NatsServer::url).collect()
    }

    /// Restarts node `i` on its ports and store directory; when a majority of
    /// nodes is then running, also waits until the cluster has formed again.
    pub fn restart_node(&mut self, i: usize) {
        self.nodes[i].restart();
        if self.has_quorum() {
            self.wait_formed();
        }
    }

    /// Waits (up to 20 s) until every running node is healthy (`/healthz`),
    /// routed to every other running node, and all running nodes agree on a
    /// leader for the JetStream meta group and for every stream and consumer.
    /// Panics if fewer than a majority of nodes are running.
    pub fn wait_formed(&self) {
        assert!(
            self.has_quorum(),
            "only {} of {} nats cluster nodes are running: no JetStream quorum",
            self.running().count(),
            self.nodes.len()
        );
        let deadline = Instant::now() + CLUSTER_TIMEOUT;
        loop {
            let Some(pending) = self.pending() else {
                return;
            };
            if Instant::now() >= deadline {
                let logs: String = self
                    .running()
                    .map(|(i, node)| format!("\n--- n{i} log ---\n{}", node.log_tail(25)))
                    .collect();
                panic!("nats cluster not formed after {CLUSTER_TIMEOUT:?}: {pending}{logs}");
            }
            std::thread::sleep(POLL);
        }
    }

    /// Connects an `async_nats` client with all node URLs (panics on failure).
    pub async fn connect(&self) -> async_nats::Client {
        let urls = self.client_urls();
        async_nats::connect(urls.clone())
            .await
            .unwrap_or_else(|err| panic!("connecting to nats cluster {urls:?}: {err}"))
    }

    fn running(&self) -> impl Iterator<Item = (usize, &NatsServer)> {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, node)| node.is_running())
    }

    fn has_quorum(&self) -> bool {
        self.running().count() > self.nodes.len() / 2
    }

    /// What formation still waits for, or `None` when formed.
    fn pending(&self) -> Option<String> {
        let running: Vec<(usize, &NatsServer)> = self.running().collect();
        for &(i, node) in &running {
            let Some(monitor) = node.monitor_port() else {
                return Some(format!("n{i} has no monitoring port"));
            };
            if !probe::http_ok(monitor, "/healthz") {
                return Some(format!("n{i} /healthz not OK"));
            }
            let routed: HashSet<String> = probe::http_json(monitor, "/routez")
                .and_then(|routez| {
                    let routes = routez.get("routes")?.as_array()?.clone();
                    Some(
                        routes
                            .iter()
                            .filter_map(|route| route.get("remote_name")?.as_str())
                            .map(str::to_owned)
                            .collect(),
                    )
                })
                .unwrap_or_default();
            for &(j, _) in &running {
                if j != i && !routed.contains(&format!("n{j}")) {
                    return Some(format!("n{i} has no route to n{j}"));
                }
            }
        }
        // Every running node must name the same, non-empty leader for the
        // meta group and for every stream and consumer it hosts. Right after
        // a leader is killed and restarted the others still name it (stale)
        // while the restarted node names none, so agreement is required.
        let mut leaders: HashMap<String, (usize, String)> = HashMap::new();
        for &(i, node) in &running {
            let Some(jsz) = node
                .monitor_port()
                .and_then(|monitor| probe::http_json(monitor, JSZ_PATH))
            else {
                return Some(format!("n{i} /jsz not available"));
            };
            for (group, leader) in raft_leaders(&jsz) {
                if leader.is_empty() {
                    return Some(format!("n{i} sees no leader for {group}"));
                }
                match leaders.get(&group) {
                    Some((j, other)) if *other != leader => {
                        return Some(format!(
                            "n{i} sees leader {leader} for {group}, n{j} sees {other}"
                        ));
                    }
                    Some(_) => {}
                    None => {
                        leaders.insert(group, (i, leader));
                    }
                }
            }
        }
        None
    }
}

/// `/jsz` with the streams and consumers of every account.
const JSZ_PATH: &str = "/jsz?accounts=true&streams=true&consumers=true";

/// `(group, leader)` for the meta group and each replicated stream and
/// consumer in a `/jsz` answer; a missing leader is an empty string.
fn raft_leaders(jsz: &serde_json::Value) -> Vec<(String, String)> {
    use serde_json::Value;
    fn text<'a>(value: &'a Value, key: &str) -> &'a str {
        value.get(key).and_then(Value::as_str).unwrap_or_default()
    }
    fn list<'a>(value: &'a Value, key: &str) -> &'a [Value] {
        value
            .get(key)
            .and_then(Value::as_array)
            .map_or(&[], Vec::as_slice)
    }
    let mut leaders = vec![(
        "the JetStream meta group".to_owned(),
        jsz.get("meta_cluster")
            .map(|meta| text(meta, "leader"))
            .unwrap_or_default()
            .to_owned(),
    )];
    for account in list(jsz, "account_details") {
        let account_name = text(account, "name");
        for stream in list(account, "stream_detail") {
            let stream_name = text(stream, "name");
            if let Some(cluster) = stream.get("cluster") {
                leaders.push((
                    format!("stream {account_name}/{stream_name}"),
                    text(cluster, "leader").to_owned(),
                ));
            }
            for consumer in list(stream, "consumer_detail") {
                if let Some(cluster) = consumer.get("cluster") {
                    leaders.push((
                        format!(
                            "consumer {account_name}/{stream_name}/{}",
                            text(consumer, "name")
                        ),
                        text(cluster, "leader").to_owned(),
                    ));
                }
            }
        }
    }
    leaders
}

/// `count` distinct free ports on 127.0.0.1 (bound together, then released).
fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to pick a free port"))
        .collect();
    listeners
        .iter()
        .map(|listener| {
            listener
                .local_addr()
                .expect("local address of a bound listener")
                .port()
        })
        .collect()
}
