//! The Matrix bridge (`cyrene-matrix-bridge`, its built binary) against a real Synapse
//! homeserver (tests/synapse) and the real services in this process (the gateway on a scripted
//! model, the checkpoint store, the orchestrator with owner `alice`, a loop worker): people talk
//! to her from Matrix, alone or in a group, and what the model is shown keeps them apart.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;
mod synapse;

use common::approval_stub::ApprovalStub;
use cyrene_matrix_bridge::approval;
use cyrene_matrix_bridge::rooms::{self, RoomKind};
use cyrene_matrix_bridge::ruma;
use cyrene_model_gateway::providers::scripted::RequestLog;
use cyrene_protocol::approval::{ApprovalsRequest, ApprovalsResponse, Decision};
use cyrene_protocol::message::{Part, Role};
use cyrene_protocol::session::{HistoryRequest, HistoryResponse};
use cyrene_protocol::subjects;
use cyrene_test_support::{NatsServer, free_port};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use synapse::world::{World, world};
use synapse::{DOT_PNG, Synapse};
use tokio::sync::Notify;

/// The bridge binary for `synapse`'s bot `@cyrene:localhost`, owner `@alice:localhost`, its
/// state in `data`; returns once it is ready (first sync done).
async fn bridge(world: &World, synapse: &Synapse, data: &Path) -> tokio::process::Child {
    bridge_on(&world.server.url(), synapse, data, free_port()).await
}

/// [`bridge`] on the NATS at `nats_url`, with its health and metrics on `port`.
async fn bridge_on(
    nats_url: &str,
    synapse: &Synapse,
    data: &Path,
    port: u16,
) -> tokio::process::Child {
    let child = tokio::process::Command::new(common::workspace_binary("cyrene-matrix-bridge"))
        .env("NATS_URL", nats_url)
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
    let history = bridge_history(&world.client, session).await;
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
    let _bridge = bridge_on(&world.server.url(), &synapse, data.path(), port).await;

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

/// The bot's messages in `room` once there are `n`: (event id, body), oldest first.
async fn bot_said(
    person: &synapse::Person,
    room: &ruma::OwnedRoomId,
    bot: &synapse::Person,
    n: usize,
    what: &str,
) -> Vec<(String, String)> {
    person.wait_for(room, &bot.id, n, what).await;
    person
        .messages(room)
        .await
        .into_iter()
        .filter(|m| m.sender == bot.id.as_str())
        .map(|m| (m.event_id, m.body))
        .collect()
}

/// A reply (`m.in_reply_to`) to `event_id` saying `text`.
fn reply_to(event_id: &str, text: &str) -> serde_json::Value {
    serde_json::json!({"msgtype": "m.text", "body": text,
        "m.relates_to": {"m.in_reply_to": {"event_id": event_id}}})
}

/// Issue 35: approving from Matrix, against the bridge's side of the contract alone (an
/// [`ApprovalStub`] in place of the orchestrator on a real nats-server; docs/matrix-bridge.md,
/// "Approving"). The bridge asks in the session's room with the call's tool and arguments as
/// plain text; the owner's `approve <call>` decides (and is no message), the decision that holds
/// is posted once; in a group a third party's `approve …` — said or as a reply to the notice —
/// is an ordinary message and decides nothing, while the owner's reply to the notice does; a
/// call asked while the bridge was down is posted when it starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_approves_in_a_room_and_a_third_party_cannot() {
    let synapse = Synapse::start().await;
    let bot = synapse.person("cyrene").await;
    let alice = synapse.person("alice").await;
    let ming = synapse.person("ming").await;
    let server = NatsServer::start();
    let stub = ApprovalStub::start(server.connect().await, "cyrene.bridge.", "bridge").await;
    let data = tempfile::tempdir().unwrap();
    let mut first = bridge_on(&server.url(), &synapse, data.path(), free_port()).await;
    let within = Duration::from_secs(60);

    // The owner's direct room, known to the bridge once a message went to its session.
    let dm = alice.create_room(&[&bot.id], true).await;
    alice.say(&dm, "hello there", &[]).await;
    let session = rooms::session_id("alice", dm.as_str(), RoomKind::OwnerDirect);
    common::eventually("the message is passed on", within, || {
        stub.sends().len() == 1
    })
    .await;
    let args = serde_json::json!({"to": "<img src=x onerror=alert(1)> @room", "subject": "hi"});
    stub.ask(&session, "c1", "send_email", args.clone()).await;
    let said = bot_said(&alice, &dm, &bot, 1, "the bridge asks").await;
    let args = args.as_object().unwrap();
    assert_eq!(said[0].1, approval::request_text("send_email", "c1", args));
    // "approve" naming a call that is not this room's: an ordinary message
    alice.say(&dm, "approve c9", &[]).await;
    alice.say(&dm, "approve c1", &[]).await;
    let said = bot_said(&alice, &dm, &bot, 2, "the decision is posted").await;
    assert_eq!(said[1].1, "Approved c1, by the owner here.");
    assert_eq!(
        stub.decisions(),
        [(session.clone(), "c1".into(), Decision::Approve, None)]
    );
    assert_eq!(
        stub.sends(),
        [
            (session.clone(), "hello there".into()),
            (session.clone(), "approve c9".into())
        ],
        "a decision is not passed on as a message"
    );

    // A group room: ming's "approve" is an ordinary message; the owner's reply decides.
    let group = alice.create_room(&[&bot.id, &ming.id], false).await;
    ming.join(&group).await;
    alice.wait_joined(&group, &bot.id).await;
    ming.say(&group, "hi cyrene", &[&bot.id]).await;
    let group_session = rooms::session_id("alice", group.as_str(), RoomKind::Group);
    common::eventually("ming's message is passed on", within, || {
        stub.sends().iter().any(|(s, _)| *s == group_session)
    })
    .await;
    stub.ask(
        &group_session,
        "c2",
        "transfer_money",
        serde_json::json!({"to": "ming"}),
    )
    .await;
    let said = bot_said(&alice, &group, &bot, 1, "the bridge asks in the group").await;
    let notice = said[0].0.clone();
    ming.say(&group, "approve c2", &[]).await;
    ming.send(&group, reply_to(&notice, "approve")).await;
    common::eventually("ming's lines are passed on", within, || {
        let texts: Vec<String> = stub
            .sends()
            .into_iter()
            .filter(|(s, _)| *s == group_session)
            .map(|(_, t)| t)
            .collect();
        texts.iter().any(|t| t == "approve c2") && texts.iter().any(|t| t == "approve")
    })
    .await;
    assert_eq!(stub.decisions().len(), 1, "a third party decides nothing");
    alice
        .send(&group, reply_to(&notice, "deny too risky"))
        .await;
    let said = bot_said(&alice, &group, &bot, 2, "the owner's reply decides").await;
    assert_eq!(said[1].1, "Denied c2, by the owner here: too risky.");
    assert_eq!(
        stub.decisions()[1],
        (
            group_session.clone(),
            "c2".into(),
            Decision::Deny,
            Some("too risky".into())
        )
    );
    // the owner changing her mind: the first decision holds
    alice.say(&group, "approve c2", &[]).await;
    let said = bot_said(&alice, &group, &bot, 3, "the decision that holds").await;
    assert_eq!(said[2].1, "Already decided: Denied c2, by the owner here.");

    // A call asked while the bridge is down is posted when it starts, once.
    first.start_kill().unwrap();
    first.wait().await.unwrap();
    stub.ask(&session, "c3", "send_email", serde_json::json!({}))
        .await;
    let _second = bridge_on(&server.url(), &synapse, data.path(), free_port()).await;
    let said = bot_said(&alice, &dm, &bot, 3, "the call asked meanwhile").await;
    assert_eq!(
        said.iter()
            .map(|(_, body)| body.as_str())
            .collect::<Vec<_>>(),
        [
            approval::request_text("send_email", "c1", args).as_str(),
            "Approved c1, by the owner here.",
            &approval::request_text("send_email", "c3", &serde_json::Map::new()),
        ],
        "each notice posted once"
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data.path().join("matrix-bridge.json")).unwrap())
            .unwrap();
    assert_eq!(
        state["sessions"][&session]["asked"],
        serde_json::json!(["c3"]),
        "what was asked is kept until decided"
    );
}

/// The call id an approval notice names: `… run <tool> (<call_id>) with …`.
fn asked_call(notice: &str, tool: &str) -> String {
    let rest = notice
        .strip_prefix(&format!("Cyrene wants to run {tool} ("))
        .unwrap_or_else(|| panic!("not a notice about {tool}: {notice}"));
    rest.split_once(") with ").unwrap().0.to_owned()
}

/// Issue 35 end to end, with the real orchestrator and worker (the persona asks for approval of
/// every `count` call): the turn stops at the call and the bridge asks in the room; the owner's
/// `approve <call>` runs the tool and her answer arrives; in a group a third party's
/// `approve <call>` decides nothing (the call still waits, the tool has not run), and the
/// owner's reply `deny …` to the notice gives the model the denial and its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_approves_a_tool_call_from_matrix() {
    let synapse = Synapse::start().await;
    let bot = synapse.person("cyrene").await;
    let alice = synapse.person("alice").await;
    let ming = synapse.person("ming").await;
    let world = world().await;
    let data = tempfile::tempdir().unwrap();
    let _bridge = bridge(&world, &synapse, data.path()).await;

    let dm = alice.create_room(&[&bot.id], true).await;
    alice.say(&dm, "count please", &[]).await;
    let said = alice.wait_for(&dm, &bot.id, 1, "the bridge asks").await;
    let call = asked_call(&said[0], "count");
    assert_eq!(
        said[0],
        approval::request_text("count", &call, &serde_json::Map::new())
    );
    assert!(world.tools.ids_of("count").is_empty(), "the call waits");
    alice.say(&dm, &format!("approve {call}"), &[]).await;
    let said = alice
        .wait_for(&dm, &bot.id, 3, "the answer after the approval")
        .await;
    assert!(
        said.contains(&format!("Approved {call}, by the owner here.")),
        "{said:?}"
    );
    assert!(
        said.iter().any(|s| s.starts_with("counted: count ran as")),
        "{said:?}"
    );
    assert_eq!(
        world.tools.ids_of("count").len(),
        1,
        "run once, after the approval"
    );

    // A group: ming's "approve" decides nothing; the owner's reply to the notice denies.
    let group = alice.create_room(&[&bot.id, &ming.id], false).await;
    ming.join(&group).await;
    alice.wait_joined(&group, &bot.id).await;
    ming.say(&group, "count for me", &[&bot.id]).await;
    let said = bot_said(&alice, &group, &bot, 1, "the bridge asks in the group").await;
    let (notice, call) = (said[0].0.clone(), asked_call(&said[0].1, "count"));
    ming.say(&group, &format!("approve {call}"), &[]).await;
    let group_session = rooms::session_id("alice", group.as_str(), RoomKind::Group);
    let list = ApprovalsRequest {
        session_id: group_session.clone(),
    };
    // ming's line is stored (context only) while the call still waits
    let start = Instant::now();
    loop {
        let read = bridge_history(&world.client, &group_session).await;
        let approve = format!("approve {call}");
        if read
            .messages
            .iter()
            .any(|e| e.message.text_content() == approve)
        {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "ming's line never reached the transcript"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let listed: ApprovalsResponse = cyrene_bus::request_json(
        &world.client,
        subjects::BRIDGE_SESSION_APPROVALS,
        &list,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    assert_eq!(listed.approvals.len(), 1);
    assert_eq!(
        listed.approvals[0].decision, None,
        "a third party decides nothing"
    );
    assert_eq!(world.tools.ids_of("count").len(), 1, "the tool has not run");

    alice
        .send(&group, reply_to(&notice, "deny not for strangers"))
        .await;
    let said = alice
        .wait_for(&group, &bot.id, 3, "the answer after the denial")
        .await;
    assert!(
        said.contains(&format!(
            "Denied {call}, by the owner here: not for strangers."
        )),
        "{said:?}"
    );
    assert!(
        said.iter().any(|s| s
            == "counted: This tool call was not approved, so it did not run. Reason: not for strangers"),
        "{said:?}"
    );
    assert_eq!(
        world.tools.ids_of("count").len(),
        1,
        "a denied call never runs"
    );
}

/// The whole transcript of `session`, read as the bridge reads it.
async fn bridge_history(client: &async_nats::Client, session: &str) -> HistoryResponse {
    let request = HistoryRequest {
        session_id: session.to_owned(),
        limit: None,
        before_seq: None,
    };
    cyrene_bus::request_json(
        client,
        subjects::BRIDGE_SESSION_HISTORY,
        &request,
        Duration::from_secs(5),
    )
    .await
    .unwrap()
}
