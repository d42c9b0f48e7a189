//! The deployment files agree with the binaries: every Deployment runs a binary the image
//! builds, and every environment variable it sets is one that binary reads (its `--help` lists
//! it) — a renamed flag cannot silently turn into an ignored setting — and its liveness and
//! readiness probes point at the port its `CYRENE_HEALTH_ADDR` opens. When `kubectl` is on the
//! machine, the kustomization also renders.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// Read by `cyrene-telemetry` in every binary, not by clap.
const TELEMETRY_ENV: &[&str] = &[
    "RUST_LOG",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

fn deploy_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy"))
}

/// `(binary, env names set, env names referenced as $(NAME))` of one Deployment file.
fn deployment(text: &str) -> (String, BTreeSet<String>, BTreeSet<String>) {
    let mut binary = None;
    let (mut set, mut referenced) = (BTreeSet::new(), BTreeSet::new());
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("command: [\"") {
            binary = rest.split('"').next().map(str::to_owned);
        }
        if let Some(name) = line.strip_prefix("- name: ")
            && name.chars().all(|c| c.is_ascii_uppercase() || c == '_')
        {
            set.insert(name.to_owned());
        }
        for piece in line.split("$(").skip(1) {
            if let Some((name, _)) = piece.split_once(')') {
                referenced.insert(name.to_owned());
            }
        }
    }
    (binary.expect("a command"), set, referenced)
}

/// Every Deployment manifest under deploy/k8s: its path and its text.
fn k8s_deployments() -> Vec<(std::path::PathBuf, String)> {
    let mut deployments = Vec::new();
    for entry in std::fs::read_dir(deploy_dir().join("k8s")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if text.contains("kind: Deployment") {
            deployments.push((path, text));
        }
    }
    deployments
}

/// Asserts that `text` holds `needle`; `what` says where, for the failure message.
fn assert_holds(text: &str, needle: &str, what: &str) {
    assert!(text.contains(needle), "{what}");
}

#[test]
fn every_deployment_runs_a_built_binary_with_variables_it_reads() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("docker/Dockerfile")).unwrap();
    let mut seen = Vec::new();
    for (path, text) in k8s_deployments() {
        let (binary, set, referenced) = deployment(&text);
        assert!(
            dockerfile.contains(&format!("target/release/{binary}")),
            "{}: the image does not build {binary}",
            path.display()
        );
        let help = Command::new(common::workspace_binary(&binary))
            .arg("--help")
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&help.stdout);
        for name in &set {
            let read = help.contains(&format!("env: {name}"))
                || TELEMETRY_ENV.contains(&name.as_str())
                || referenced.contains(name);
            assert!(read, "{}: {binary} does not read {name}", path.display());
        }
        for name in &referenced {
            assert!(
                set.contains(name),
                "{}: $({name}) is never set",
                path.display()
            );
        }
        assert!(set.contains("NATS_URL"), "{}: no NATS_URL", path.display());
        seen.push(binary);
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "cyrene-checkpoint-store",
            "cyrene-loop-worker",
            "cyrene-matrix-bridge",
            "cyrene-mcp-bridge",
            "cyrene-model-gateway",
            "cyrene-orchestrator"
        ]
    );
}

/// The port `CYRENE_HEALTH_ADDR` opens, and the ports of the `/livez` and `/readyz` probes and
/// of the declared container ports, in one Deployment file.
fn health_ports(text: &str) -> (Option<u16>, Vec<(String, u16)>, Vec<u16>) {
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let mut addr_port = None;
    let (mut probes, mut container) = (Vec::new(), Vec::new());
    for (i, line) in lines.iter().enumerate() {
        if *line == "- name: CYRENE_HEALTH_ADDR" {
            addr_port = lines
                .get(i + 1)
                .and_then(|v| v.strip_prefix("value: "))
                .and_then(|v| v.trim_matches('"').rsplit_once(':'))
                .and_then(|(_, port)| port.parse().ok());
        }
        if let Some(rest) = line.strip_prefix("httpGet: {path: ")
            && let Some((path, port)) = rest.trim_end_matches('}').split_once(", port: ")
        {
            probes.push((path.to_owned(), port.parse().expect("a numeric probe port")));
        }
        if let Some(port) = line.strip_prefix("containerPort: ") {
            container.push(port.parse().expect("a numeric container port"));
        }
    }
    (addr_port, probes, container)
}

#[test]
fn every_deployment_probes_the_port_its_health_addr_opens() {
    for (path, text) in k8s_deployments() {
        let (addr_port, probes, container) = health_ports(&text);
        let port = addr_port
            .unwrap_or_else(|| panic!("{}: no CYRENE_HEALTH_ADDR with a port", path.display()));
        let paths: Vec<&str> = probes.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(paths, ["/livez", "/readyz"], "{}", path.display());
        for (probe, probe_port) in &probes {
            assert_eq!(
                *probe_port,
                port,
                "{}: {probe} probes a port the binary does not open",
                path.display()
            );
        }
        assert!(
            container.contains(&port),
            "{}: containerPort {port} not declared",
            path.display()
        );
    }
}

#[test]
fn the_parser_sees_what_a_deployment_sets() {
    let (binary, set, referenced) = deployment(
        "command: [\"cyrene-x\"]\nenv:\n  - name: NATS_PASSWORD\n  - name: NATS_URL\n    \
         value: nats://u:$(NATS_PASSWORD)@nats:4222\n  - name: x\n",
    );
    assert_eq!(binary, "cyrene-x");
    assert_eq!(
        set.into_iter().collect::<Vec<_>>(),
        ["NATS_PASSWORD", "NATS_URL"]
    );
    assert_eq!(
        referenced.into_iter().collect::<Vec<_>>(),
        ["NATS_PASSWORD"]
    );
}

/// A copy of deploy/ with a Secret env file written by scripts/secrets.sh.
fn deploy_with_secrets() -> tempfile::TempDir {
    let copy = tempfile::tempdir().unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .arg(deploy_dir())
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    let env_file = copy.path().join("deploy/k8s/secrets.env");
    let _ = std::fs::remove_file(&env_file); // a developer's own one is not copied into the check
    let script = deploy_dir().join("../scripts/secrets.sh");
    let out = Command::new(&script)
        .arg(&env_file)
        .env("DATABASE_URL", "postgres://cyrene:pw@postgres:5432/cyrene")
        .output()
        .unwrap();
    common::assert_success(&out);
    copy
}

#[test]
fn secrets_are_generated_never_committed_placeholders() {
    let copy = deploy_with_secrets();
    let text = std::fs::read_to_string(copy.path().join("deploy/k8s/secrets.env")).unwrap();
    let example = std::fs::read_to_string(deploy_dir().join("k8s/secrets.env.example")).unwrap();
    let keys = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| !l.starts_with('#') && l.contains('='))
            .map(|l| l.split('=').next().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        keys(&text),
        keys(&example),
        "the script writes every key the example names"
    );
    let passwords: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("_PASSWORD="))
        .map(|l| l.split_once('=').unwrap().1)
        .collect();
    assert_eq!(
        passwords.len(),
        cyrene_test_support::shipped::SHIPPED_PASSWORDS.len()
    );
    for p in &passwords {
        assert_eq!(p.len(), 48, "{p}");
        assert!(!p.contains("change-me"));
    }
    let unique: std::collections::BTreeSet<_> = passwords.iter().collect();
    assert_eq!(
        unique.len(),
        passwords.len(),
        "every user gets its own password"
    );
    // No DATABASE_URL: refused; an existing file: never overwritten.
    let env_file = copy.path().join("deploy/k8s/secrets.env");
    let script = deploy_dir().join("../scripts/secrets.sh");
    let again = Command::new(&script).arg(&env_file).output().unwrap();
    assert!(!again.status.success());
    assert_eq!(std::fs::read_to_string(&env_file).unwrap(), text);
    let fresh = copy.path().join("other.env");
    let refused = Command::new(&script)
        .arg(&fresh)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    assert!(!refused.status.success() && !fresh.exists());
}

#[test]
fn the_kustomization_renders_when_kubectl_is_here() {
    let copy = deploy_with_secrets();
    let Ok(out) = Command::new("kubectl")
        .arg("kustomize")
        .arg(copy.path().join("deploy"))
        .output()
    else {
        eprintln!("kubectl not found: rendering not checked (make deploy-check needs it)");
        return;
    };
    common::assert_success(&out);
    let rendered = String::from_utf8_lossy(&out.stdout);
    let kinds: Vec<&str> = rendered
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .collect();
    assert_eq!(kinds.iter().filter(|k| **k == "Deployment").count(), 4);
    assert!(kinds.contains(&"StatefulSet") && kinds.contains(&"Secret"));
    // The config the permission test runs is the one deployed.
    let conf = std::fs::read_to_string(deploy_dir().join("nats/users.conf")).unwrap();
    let first_user = conf.lines().find(|l| l.contains("user: ")).unwrap().trim();
    assert!(
        rendered.contains(first_user),
        "{first_user} not in the ConfigMap"
    );
}

/// The KEDA ScaledObject scales the real worker Deployment on the real stream and consumer, read
/// from the monitoring port the NATS Service really exposes.
#[test]
fn the_keda_scaler_points_at_the_workers_queue() {
    let scaled = std::fs::read_to_string(deploy_dir().join("keda/scaledobject.yaml")).unwrap();
    let value = |key: &str| -> String {
        scaled
            .lines()
            .find_map(|l| {
                l.trim()
                    .trim_start_matches("- ")
                    .strip_prefix(&format!("{key}: "))
            })
            .unwrap_or_else(|| panic!("{key} missing"))
            .trim_matches('"')
            .to_owned()
    };
    assert_eq!(value("kind"), "ScaledObject");
    assert_eq!(value("type"), "nats-jetstream");
    assert_eq!(value("stream"), cyrene_bus::streams::TURNS_STREAM);
    assert_eq!(
        value("consumer"),
        cyrene_loop_worker::Config::default().consumer
    );
    let worker = std::fs::read_to_string(deploy_dir().join("k8s/loop-worker.yaml")).unwrap();
    assert!(worker.contains(&format!("  name: {}\n", value("name"))));
    let endpoint = value("natsServerMonitoringEndpoint");
    let port = endpoint.rsplit(':').next().unwrap();
    let nats = std::fs::read_to_string(deploy_dir().join("k8s/nats.yaml")).unwrap();
    assert!(endpoint.starts_with("nats."), "{endpoint}");
    assert_holds(
        &nats,
        &format!("port: {port}"),
        &format!("the Service exposes {port}"),
    );
    assert!(
        nats.contains(&format!("\"-m\", \"{port}\"")),
        "nats-server listens on {port}"
    );
}

/// Every rendered object against the Kubernetes schemas, offline (`make deploy-check` installs
/// kubernetes-validate and points CYRENE_KUBERNETES_VALIDATE at it; skipped otherwise).
#[test]
fn every_rendered_object_is_valid_for_kubernetes() {
    let Ok(validator) = std::env::var("CYRENE_KUBERNETES_VALIDATE") else {
        eprintln!("CYRENE_KUBERNETES_VALIDATE unset: schemas not checked (make deploy-check does)");
        return;
    };
    let copy = deploy_with_secrets();
    let overlay = cluster_overlay(&copy);
    for (root, least) in [(copy.path().join("deploy"), 12), (overlay, 9)] {
        validate_rendered(&validator, &copy, &root, least);
    }
}

/// Renders the kustomization at `root` and validates every object (at least `least` of them).
fn validate_rendered(validator: &str, copy: &tempfile::TempDir, root: &Path, least: usize) {
    let rendered = Command::new("kubectl")
        .arg("kustomize")
        .arg(root)
        .output()
        .expect("kubectl (make deploy-check needs it)");
    common::assert_success(&rendered);
    let file = copy.path().join("rendered.yaml");
    std::fs::write(&file, &rendered.stdout).unwrap();
    let out = Command::new("python3")
        .args([
            "-m",
            "kubernetes_validate",
            "--strict",
            "--quiet",
            "-k",
            "1.32.0",
        ])
        .arg(&file)
        .env("PYTHONPATH", validator)
        .output()
        .unwrap();
    common::assert_success(&out);
    let kinds = String::from_utf8_lossy(&rendered.stdout)
        .lines()
        .filter(|l| l.starts_with("kind: "))
        .count();
    assert!(
        kinds >= least,
        "{}: {kinds} objects rendered",
        root.display()
    );
}

/// An overlay of one's own beside the copied deploy/: the base plus the `cluster` component
/// (docs/operations.md, "A 3-node NATS with the official Helm chart").
fn cluster_overlay(copy: &tempfile::TempDir) -> std::path::PathBuf {
    let overlay = copy.path().join("my-cyrene");
    std::fs::create_dir_all(&overlay).unwrap();
    std::fs::write(
        overlay.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n\
         resources: [../deploy]\ncomponents: [../deploy/cluster]\n",
    )
    .unwrap();
    overlay
}

/// The cluster variant: no nats-server of our own (the Helm chart runs NATS), the turn queue on 3
/// replicas for the orchestrator and the workers, the Secret under the plain name the Helm
/// values read.
#[test]
fn the_cluster_component_replicates_the_turn_queue_and_leaves_nats_to_the_chart() {
    let copy = deploy_with_secrets();
    let overlay = cluster_overlay(&copy);
    let Ok(out) = Command::new("kubectl")
        .arg("kustomize")
        .arg(&overlay)
        .output()
    else {
        eprintln!(
            "kubectl not found: the cluster component is not rendered (make deploy-check does)"
        );
        return;
    };
    common::assert_success(&out);
    let rendered = String::from_utf8_lossy(&out.stdout).into_owned();
    let objects: Vec<&str> = rendered.split("\n---\n").collect();
    assert!(
        !rendered.contains("kind: StatefulSet"),
        "no nats-server of our own"
    );
    assert!(!objects.iter().any(|o| o.contains("kind: Service\n")));
    for name in ["cyrene-orchestrator", "cyrene-loop-worker"] {
        let object = objects
            .iter()
            .find(|o| o.contains("kind: Deployment") && o.contains(&format!("  name: {name}\n")))
            .unwrap_or_else(|| panic!("{name} rendered"));
        assert!(
            object.contains("- name: CYRENE_TURNS_REPLICAS\n          value: \"3\""),
            "{name} runs the turn queue on 3 replicas:\n{object}"
        );
    }
    let values = helm_values();
    let secret = values
        .iter()
        .find(|(path, _)| path.ends_with(".valueFrom.secretKeyRef.name"))
        .map(|(_, v)| v.clone())
        .unwrap();
    assert_holds(
        &rendered,
        &format!(
            "kind: Secret\nmetadata:\n  labels:\n    app.kubernetes.io/part-of: cyrene\n  name: {secret}\n"
        ),
        &format!("the Secret the Helm values read is rendered under its plain name {secret}"),
    );
    // The default kustomization stays a single node with one replica.
    let base = std::fs::read_to_string(deploy_dir().join("k8s/orchestrator.yaml")).unwrap();
    assert!(!base.contains("CYRENE_TURNS_REPLICAS"));
}

/// `(path, value)` of every leaf of a block-style YAML file (nested mappings, scalars, `|` block
/// scalars): enough for deploy/nats/values.yaml, which keeps to that style. Paths join keys with
/// `.`; a block scalar's value is its text, de-indented.
fn yaml_leaves(text: &str) -> Vec<(String, String)> {
    let mut leaves = Vec::new();
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let (key, value) = trimmed.split_once(':').expect("key: value");
        let value = value.trim();
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        let path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).chain([key]).collect();
        let path = path.join(".");
        if value == "|" {
            let mut block = String::new();
            let mut inner = None;
            while let Some(next) = lines.peek() {
                let next_indent = next.len() - next.trim_start().len();
                if !next.trim().is_empty() && next_indent <= indent {
                    break;
                }
                let inner = *inner.get_or_insert(next_indent);
                block.push_str(next.get(inner..).unwrap_or_default());
                block.push('\n');
                lines.next();
            }
            leaves.push((path, block));
        } else if value.is_empty() {
            stack.push((indent, key.to_owned()));
        } else {
            leaves.push((path, value.to_owned()));
        }
    }
    leaves
}

fn helm_values() -> Vec<(String, String)> {
    yaml_leaves(&std::fs::read_to_string(deploy_dir().join("nats/values.yaml")).unwrap())
}

/// The keys of the official NATS Helm chart's values.yaml (chart 2.14.2) that
/// deploy/nats/values.yaml sets, pinned here: the check runs offline. Below `FREE_FORM` the chart
/// takes any map (NATS config, container env, ConfigMap data).
const CHART_KEYS: &[&str] = &[
    "config.cluster.enabled",
    "config.cluster.replicas",
    "config.jetstream.enabled",
    "config.jetstream.fileStore.enabled",
    "config.jetstream.fileStore.dir",
    "config.jetstream.fileStore.pvc.enabled",
    "config.jetstream.fileStore.pvc.size",
    "config.monitor.enabled",
    "config.monitor.port",
    "config.websocket.enabled",
    "config.websocket.port",
    "service.ports.monitor.enabled",
    "service.ports.websocket.enabled",
];
const FREE_FORM: &[&str] = &["config.merge.", "container.env.", "configMap.merge.data."];

/// deploy/nats/values.yaml: only keys the chart has, 3 nodes, JetStream on file storage, the
/// monitoring port, a max_payload that fits a checkpoint, users.conf carried byte for byte and
/// included, and every password it needs from the Secret.
#[test]
fn the_helm_values_carry_the_users_and_what_cyrene_needs() {
    let values = helm_values();
    for (path, _) in &values {
        assert!(
            CHART_KEYS.contains(&path.as_str()) || FREE_FORM.iter().any(|p| path.starts_with(p)),
            "{path} is not a key of the NATS chart's values"
        );
    }
    let get = |key: &str| -> &str {
        values
            .iter()
            .find(|(path, _)| path == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("{key} missing"))
    };
    for (key, want) in [
        ("config.cluster.enabled", "true"),
        ("config.cluster.replicas", "3"),
        ("config.jetstream.enabled", "true"),
        ("config.jetstream.fileStore.enabled", "true"),
        ("config.jetstream.fileStore.pvc.enabled", "true"),
        ("config.monitor.enabled", "true"),
        ("service.ports.monitor.enabled", "true"),
    ] {
        assert_eq!(get(key), want, "{key}");
    }
    // The KEDA scaler reads the monitoring port the values open.
    let port = get("config.monitor.port");
    let scaled = std::fs::read_to_string(deploy_dir().join("keda/scaledobject.yaml")).unwrap();
    assert_holds(
        &scaled,
        &format!(":{port}"),
        &format!("KEDA reads port {port}"),
    );
    // max_payload: "<< 8MB >>" (NATS units: MB = 1024 * 1024) holds the largest checkpoint state
    // and the envelope around it.
    let payload = get("config.merge.max_payload");
    let megabytes: usize = payload
        .trim_start_matches("<< ")
        .trim_end_matches(" >>")
        .strip_suffix("MB")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("max_payload {payload} is not << NMB >>"));
    let state = cyrene_checkpoint_store::Config::new(std::env::temp_dir()).max_state_bytes;
    assert!(
        megabytes * 1024 * 1024 >= state + 8 * 1024,
        "max_payload {payload} is smaller than a checkpoint state ({state} bytes) and its envelope"
    );
    // users.conf, included and carried unchanged.
    assert_eq!(get("config.merge.$include"), "users.conf");
    let users = std::fs::read_to_string(deploy_dir().join("nats/users.conf")).unwrap();
    assert!(
        get("configMap.merge.data.users.conf") == users,
        "deploy/nats/values.yaml must carry deploy/nats/users.conf unchanged under \
         configMap.merge.data.users.conf: copy it there"
    );
    // Every password users.conf reads comes from the Secret, in the values, in the single-node
    // manifest and from scripts/secrets.sh.
    let needed: BTreeSet<String> = users
        .split('$')
        .skip(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_uppercase() || *c == '_')
                .collect()
        })
        .filter(|name: &String| name.starts_with("CYRENE_"))
        .collect();
    assert!(needed.len() >= 10, "{needed:?}");
    let nats = std::fs::read_to_string(deploy_dir().join("k8s/nats.yaml")).unwrap();
    let secrets = std::fs::read_to_string(deploy_dir().join("k8s/secrets.env.example")).unwrap();
    for name in &needed {
        assert_eq!(
            get(&format!("container.env.{name}.valueFrom.secretKeyRef.key")),
            name,
            "values.yaml: {name}"
        );
        assert_holds(
            &nats,
            &format!("- name: {name}\n"),
            &format!("k8s/nats.yaml: {name}"),
        );
        assert_holds(
            &secrets,
            &format!("\n{name}="),
            &format!("secrets.env.example: {name}"),
        );
    }
}
