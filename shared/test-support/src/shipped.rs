//! `deploy/nats/cyrene.conf` as shipped (users, permissions, WebSocket block) with the tests'
//! passwords: the one list of them, so a user added to `deploy/nats/users.conf` is added here
//! once, and a config with a password left unfilled fails loudly instead of refusing a login.

use std::path::Path;

/// Each shipped user's password variable and the password the tests give it.
pub const SHIPPED_PASSWORDS: [(&str, &str); 13] = [
    ("CYRENE_GATEWAY_PASSWORD", "pw-gateway"),
    ("CYRENE_CHECKPOINT_STORE_PASSWORD", "pw-store"),
    ("CYRENE_ORCHESTRATOR_PASSWORD", "pw-orchestrator"),
    ("CYRENE_LOOP_WORKER_PASSWORD", "pw-worker"),
    ("CYRENE_TOOLS_PASSWORD", "pw-tools"),
    ("CYRENE_CLIENT_PASSWORD", "pw-client"),
    ("CYRENE_OPERATOR_PASSWORD", "pw-operator"),
    ("CYRENE_AGENT_HOSHI_PASSWORD", "pw-hoshi"),
    ("CYRENE_PERSON_ALICE_PASSWORD", "pw-alice"),
    ("CYRENE_PERSON_BOB_PASSWORD", "pw-bob"),
    ("CYRENE_BRIDGE_PASSWORD", "pw-bridge"),
    ("CYRENE_MCP_BRIDGE_PASSWORD", "pw-mcp-bridge"),
    ("CYRENE_GUARD_PASSWORD", "pw-guard"),
];

/// The shipped server config of the repository at `repo`, for [`crate::NatsServerBuilder::config`]:
/// the harness's store dir in place of the deployed one, the WebSocket listener on
/// `websocket_port` (`-1`: a free one), `users.conf` inlined with `extra_users` (user, password)
/// first, and every password filled from [`SHIPPED_PASSWORDS`].
pub fn shipped_config(repo: &Path, websocket_port: i32, extra_users: &[(&str, &str)]) -> String {
    let read = |name: &str| std::fs::read_to_string(repo.join("deploy/nats").join(name)).unwrap();
    let mut config = read("cyrene.conf").replace("  store_dir: \"/data/jetstream\"\n", "");
    assert!(config.contains("websocket {\n  port: 8080\n"), "{config}");
    config = config.replace(
        "websocket {\n  port: 8080\n",
        &format!("websocket {{\n  port: {websocket_port}\n"),
    );
    let extra: String = extra_users
        .iter()
        .map(|(user, password)| format!("    {{user: {user}, password: \"{password}\"}}\n"))
        .collect();
    let users = read("users.conf").replacen("  users = [\n", &format!("  users = [\n{extra}"), 1);
    config = config.replace("include ./users.conf\n", &users);
    for (var, password) in SHIPPED_PASSWORDS {
        config = config.replace(&format!("${var}"), &format!("\"{password}\""));
    }
    assert!(
        !config.contains("$CYRENE_"),
        "a password of deploy/nats/users.conf has no test password: add it to \
         cyrene_test_support::shipped::SHIPPED_PASSWORDS"
    );
    config
}
