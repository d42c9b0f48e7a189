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

#[test]
fn every_deployment_runs_a_built_binary_with_variables_it_reads() {
    let dockerfile = std::fs::read_to_string(deploy_dir().join("docker/Dockerfile")).unwrap();
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(deploy_dir().join("k8s")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.contains("kind: Deployment") {
            continue;
        }
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
    for entry in std::fs::read_dir(deploy_dir().join("k8s")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.contains("kind: Deployment") {
            continue;
        }
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

#[test]
fn the_kustomization_renders_when_kubectl_is_here() {
    let Ok(out) = Command::new("kubectl")
        .arg("kustomize")
        .arg(deploy_dir())
        .output()
    else {
        eprintln!("kubectl not found: rendering not checked (make deploy-check needs it)");
        return;
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rendered = String::from_utf8_lossy(&out.stdout);
    let kinds: Vec<&str> = rendered
        .lines()
        .filter_map(|l| l.strip_prefix("kind: "))
        .collect();
    assert_eq!(kinds.iter().filter(|k| **k == "Deployment").count(), 4);
    assert!(kinds.contains(&"StatefulSet") && kinds.contains(&"Secret"));
    // The config the permission test runs is the one deployed.
    let conf = std::fs::read_to_string(deploy_dir().join("nats/cyrene.conf")).unwrap();
    let first_user = conf.lines().find(|l| l.contains("user: ")).unwrap().trim();
    assert!(
        rendered.contains(first_user),
        "{first_user} not in the ConfigMap"
    );
}
