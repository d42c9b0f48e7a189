//! The Matrix bridge (`cyrene-matrix-bridge`, its built binary) against a real Synapse
//! homeserver (tests/synapse) and the real services in this process (the gateway on a scripted
//! model, the checkpoint store, the orchestrator with owner `alice`, a loop worker): people talk
//! to her from Matrix, alone or in a group, and what the model is shown keeps them apart.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;
mod synapse;

use cyrene_model_gateway::providers::scripted::RequestLog;
use cyrene_protocol::message::{Part, Role};
use cyrene_protocol::session::{HistoryRequest, HistoryResponse};
use cyrene_protocol::subjects;
use cyrene_test_support::free_port;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use synapse::world::{World, world};
use synapse::{DOT_PNG, Synapse};
use tokio::sync::Notify;

/// The bridge binary for `synapse`'s bot `@cyrene:localhost`, owner `@alice:localhost`, its
/// state in `data`; returns once it is ready (first sync done).
async fn bridge(world: &World, synapse: &Synapse, data: &Path) -> tokio::process::Child {
    bridge_on(world, synapse, data, free_port()).await
}

/// [`bridge`] with its health and metrics on `port`.
async fn bridge_on(
    world: &World,
    synapse: &Synapse,
    data: &Path,
    port: u16,
) -> tokio::process::Child {
    let child = tokio::process::Command::new(common::workspace_binary("cyrene-matrix-bridge"))
        .env("NATS_URL", world.server.url())
        .env("CYRENE_MATRIX_BRIDGE_HOMESERVER", &synapse.url)
        .env("CYRENE_MATRIX_BRIDGE_USER", "@cyrene:localhost")
        .env("CYRENE_MATRIX_BRIDGE_PASSWORD", "pw-cyrene")
        .env("CYRENE_MATRIX_BRIDGE_OWNER", "@alice:localhost")
        .env("CYRENE_MATRIX_BRIDGE_OWNER_PERSON", "alice")
        .env("CYRENE_MATRIX_BRIDGE_DATA_DIR", data)
        .env("CYRENE_MATRIX_BRIDGE_SYNC_TIMEOUT", "1s")
        .env("CYRENE_HEALTH_ADDR", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "info")
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = cyrene_matrix_bridge::matrix::http_client().unwrap();
    let start = Instant::now();
    loop {
        let ready = http
            .get(format!("http://127.0.0.1:{port}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            return child;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the bridge never got ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The third-party note (docs/semantics.md#attribution) for `name`, byte for byte.
fn third_party_note(name: &str) -> String {
    format!(
        "[发言归属] 以下发言来自「{name}」——本会话里的第三方人员（非管理员账户），不是主人，也不是你说的。"
    )
}

/// The system texts of every request the model was shown.
fn system_texts(model: &RequestLog) -> Vec<Vec<String>> {
    model
        .snapshot()
        .iter()
        .map(|request| {
            request
                .messages
                .iter()
                .filter(|m| m.role == Role::System)
                .map(|m| m.text_content())
                .collect()
        })
        .collect()
}

/// The model's view of one request: each message's role and text, in order.
fn view(request: &cyrene_protocol::model::ModelRequest) -> Vec<(Role, String)> {
    request
        .messages
        .iter()
        .map(|m| (m.role, m.text_content()))
        .collect()
}

/// Issue 33: the owner's DM is answered unlabelled, an image reaches the model as an image
/// part, strangers in a group room are answered when they mention her and are shown to the
/// model under their display name — or their user id without one — and told apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_talks_to_her_from_matrix_alone_or_in_a_group() {
    let synapse = Synapse::start().await;
    let bot = synapse.person("cyrene").await;
    let alice = synapse.person("alice").await;
    let ming = synapse.person("ming").await;
    ming.set_name("阿明").await;
    let wang = synapse.person("wang").await;
    wang.set_name("").await; // no display name: the user id names him
    let world = world().await;
    let data = tempfile::tempdir().unwrap();
    let _bridge = bridge(&world, &synapse, data.path()).await;

    // The owner's direct room: her own session, unlabelled.
    let dm = alice.create_room(&[&bot.id], true).await;
    alice.say(&dm, "hello there", &[]).await;
    let said = alice
        .wait_for(&dm, &bot.id, 1, "the owner is answered")
        .await;
    assert_eq!(said, ["echo: hello there"]);
    assert!(
        system_texts(&world.model)
            .iter()
            .flatten()
            .all(|text| !text.starts_with("[发言归属]")),
        "the owner's lines carry no attribution"
    );
    // An image posted in the room reaches the model as an image part.
    alice.post_image(&dm, DOT_PNG).await;
    let said = alice
        .wait_for(&dm, &bot.id, 2, "the image is answered")
        .await;
    let image = world.model.snapshot().iter().any(|request| {
        request.messages.iter().any(|m| {
            m.content.iter().any(|p| {
                matches!(p, Part::ImageUrl { image_url } if image_url.starts_with("data:image/png;base64,"))
            })
        })
    });
    assert!(image, "the model was shown the image: {said:?}");
    // A file posted in the room reaches the model as a document: its text is in the view.
    let notes = "Meeting notes: the password for the garden shed is periwinkle-42.\n";
    alice
        .post_media(&dm, "m.file", notes.as_bytes(), "text/plain", "notes.txt")
        .await;
    let said = alice
        .wait_for(&dm, &bot.id, 3, "the file is answered")
        .await;
    let read = world.model.snapshot().iter().any(|request| {
        request
            .messages
            .iter()
            .any(|m| m.role == Role::User && m.text_content().contains("periwinkle-42"))
    });
    assert!(read, "the model was shown the file's text: {said:?}");

    // A group room: she answers who mentions her, and tells the strangers apart.
    let group = alice
        .create_room(&[&bot.id, &ming.id, &wang.id], false)
        .await;
    ming.join(&group).await;
    wang.join(&group).await;
    alice.wait_joined(&group, &bot.id).await;
    wang.say(&group, "lunch anyone?", &[]).await;
    ming.say(&group, "hello from ming", &[&bot.id]).await;
    let said = alice
        .wait_for(&group, &bot.id, 1, "a mention is answered")
        .await;
    assert_eq!(
        said,
        ["echo: hello from ming"],
        "unaddressed lines are not answered"
    );
    let ming_note = third_party_note("阿明");
    // What was said without addressing her is in the conversation all the same, attributed.
    let wang_note = third_party_note("@wang:localhost");
    let heard = [
        (Role::System, wang_note.clone()),
        (Role::User, "lunch anyone?".to_owned()),
        (Role::System, ming_note.clone()),
        (Role::User, "hello from ming".to_owned()),
    ];
    let views: Vec<_> = world.model.snapshot().iter().map(view).collect();
    assert!(
        views.iter().any(|v| v.windows(4).any(|w| w == heard)),
        "the unaddressed line is in her view before the mention: {views:#?}"
    );
    assert!(
        system_texts(&world.model)
            .iter()
            .flatten()
            .any(|t| *t == ming_note),
        "{:#?}",
        system_texts(&world.model)
    );
    wang.say(&group, "cyrene, and me?", &[]).await;
    let said = alice
        .wait_for(&group, &bot.id, 2, "her name is a mention")
        .await;
    assert_eq!(said, ["echo: hello from ming", "echo: cyrene, and me?"]);
    let last = system_texts(&world.model).pop().unwrap();
    assert!(
        last.contains(&ming_note) && last.contains(&wang_note),
        "two strangers are told apart: {last:#?}"
    );
}

/// Issue 33: the bridge SIGKILLed while a turn runs, a message sent while it is down, then
/// restarted: every message is answered once — none dropped, nothing posted twice — and the
/// transcript holds each message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bridge_killed_mid_turn_answers_each_message_once() {
    let synapse = Synapse::start().await;
    let bot = synapse.person("cyrene").await;
    let alice = synapse.person("alice").await;
    let world = world().await;
    let data = tempfile::tempdir().unwrap();
    let mut first = bridge(&world, &synapse, data.path()).await;

    let dm = alice.create_room(&[&bot.id], true).await;
    let gate = Arc::new(Notify::new());
    *world.tools.gate.lock().unwrap() = Some(gate.clone());
    alice.say(&dm, "a slow one, please", &[]).await;
    world.tools.hold_started("the turn holds").await;
    first.start_kill().unwrap(); // SIGKILL, mid-turn
    first.wait().await.unwrap();
    alice.say(&dm, "second message", &[]).await;
    *world.tools.gate.lock().unwrap() = None;
    gate.notify_waiters(); // the turn ends while the bridge is down

    let _second = bridge(&world, &synapse, data.path()).await;
    let said = alice.wait_for(&dm, &bot.id, 2, "both are answered").await;
    assert_eq!(said, ["done after the wait", "echo: second message"]);
    alice.say(&dm, "last one", &[]).await;
    let said = alice
        .wait_for(&dm, &bot.id, 3, "the last is answered")
        .await;
    assert_eq!(
        said,
        [
            "done after the wait",
            "echo: second message",
            "echo: last one"
        ],
        "each answer posted once"
    );

    // The transcript holds each message once.
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.path().join("matrix-bridge.json")).unwrap())
            .unwrap();
    let session = state["sessions"]
        .as_object()
        .unwrap()
        .keys()
        .next()
        .unwrap();
    let request = HistoryRequest {
        session_id: session.clone(),
        limit: None,
        before_seq: None,
    };
    let history: HistoryResponse = cyrene_bus::request_json(
        &world.client,
        subjects::BRIDGE_SESSION_HISTORY,
        &request,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let users: Vec<String> = history
        .messages
        .iter()
        .filter(|e| e.message.role == Role::User)
        .map(|e| e.message.text_content())
        .collect();
    assert_eq!(users, ["a slow one, please", "second message", "last one"]);
}

/// Issue 33: the homeserver's rate limit (429) is waited out — every answer is posted, once —
/// and counted on the bridge's `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_homeservers_rate_limits_are_waited_out() {
    // One message every 10 s per user, a burst of 1: her second answer runs into it.
    let synapse = Synapse::start_with(0.1).await;
    let bot = synapse.person("cyrene").await;
    let alice = synapse.person("alice").await;
    synapse.unlimited(&alice.id).await;
    let world = world().await;
    let data = tempfile::tempdir().unwrap();
    let port = free_port();
    let _bridge = bridge_on(&world, &synapse, data.path(), port).await;

    let dm = alice.create_room(&[&bot.id], true).await;
    let mut want = Vec::new();
    for n in 1..=2 {
        let text = format!("message {n}");
        alice.say(&dm, &text, &[]).await;
        want.push(format!("echo: {text}"));
        let said = alice
            .wait_for(&dm, &bot.id, n, "every answer arrives")
            .await;
        assert_eq!(said, want, "posted once each, in order");
    }
    let metrics = cyrene_matrix_bridge::matrix::http_client()
        .unwrap()
        .get(format!("http://127.0.0.1:{port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let waited = metrics
        .lines()
        .find_map(|l| l.strip_prefix("cyrene_matrix_bridge_rate_limited_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(waited >= 1.0, "a 429 was met and waited out: {metrics}");
}
