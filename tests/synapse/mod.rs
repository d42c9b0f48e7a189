//! A real Synapse homeserver for the Matrix bridge's tests: `matrix-synapse` from PyPI (the
//! Makefile installs it under `.tools/py`, `CYRENE_SYNAPSE_PY`), SQLite, one throwaway server on
//! a free port per test, killed on drop; users made by shared-secret registration; test users
//! driven with ruma's client-server API through the bridge's own homeserver client.
#![allow(dead_code)]

pub mod world;

use cyrene_matrix_bridge::matrix::Homeserver;
use cyrene_matrix_bridge::ruma;
use ruma::api::client::media::create_content;
use ruma::api::client::membership::join_room_by_id;
use ruma::api::client::message::{get_message_events, send_message_event};
use ruma::api::client::profile::set_display_name;
use ruma::api::client::room::create_room;
use ruma::api::client::session::login;
use ruma::api::client::uiaa::{MatrixUserIdentifier, UserIdentifier};
use ruma::events::MessageLikeEventType;
use ruma::serde::Raw;
use ruma::{OwnedRoomId, OwnedTransactionId, OwnedUserId};
use serde_json::{Value, json};
use sha1::{Digest, Sha1};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The shared secret of the test servers' registration.
const SECRET: &str = "cyrene-test-registration";

/// A running Synapse, killed and removed on drop.
pub struct Synapse {
    pub url: String,
    pub dir: tempfile::TempDir,
    child: std::process::Child,
}

impl Drop for Synapse {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where `matrix-synapse` is installed: `CYRENE_SYNAPSE_PY`, else the Makefile's `.tools` copy.
fn synapse_py() -> PathBuf {
    let path = std::env::var_os("CYRENE_SYNAPSE_PY")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".tools/py/matrix-synapse")
        });
    assert!(
        path.join("synapse").exists(),
        "matrix-synapse is not installed at {}: run `make test` (or \
         scripts/py-tool.sh matrix-synapse==1.163.2 and set CYRENE_SYNAPSE_PY)",
        path.display()
    );
    path
}

/// The config of a throwaway server. `messages_per_second`: the homeserver's message rate
/// limit per user (a low one makes it answer 429).
fn config(dir: &std::path::Path, port: u16, messages_per_second: f64) -> String {
    let d = dir.display();
    let relaxed = "{per_second: 1000, burst_count: 1000}";
    format!(
        r#"server_name: "localhost"
pid_file: {d}/homeserver.pid
listeners:
  - port: {port}
    bind_addresses: ['127.0.0.1']
    type: http
    tls: false
    x_forwarded: false
    resources:
      - names: [client]
        compress: false
database:
  name: sqlite3
  args:
    database: {d}/homeserver.db
media_store_path: {d}/media
signing_key_path: {d}/signing.key
registration_shared_secret: "{SECRET}"
macaroon_secret_key: "cyrene-test-macaroon"
form_secret: "cyrene-test-form"
report_stats: false
trusted_key_servers: []
suppress_key_server_warning: true
presence:
  enabled: false
rc_message: {{per_second: {messages_per_second}, burst_count: {burst}}}
rc_login:
  address: {relaxed}
  account: {relaxed}
  failed_attempts: {relaxed}
rc_joins:
  local: {relaxed}
rc_invites:
  per_room: {relaxed}
  per_user: {relaxed}
rc_registration: {relaxed}
rc_admin_redaction: {relaxed}
"#,
        burst = messages_per_second.max(1.0)
    )
}

impl Synapse {
    /// Starts a server with relaxed rate limits.
    pub async fn start() -> Synapse {
        Synapse::start_with(1000.0).await
    }

    /// Starts a server allowing each user `messages_per_second` messages (burst as many).
    pub async fn start_with(messages_per_second: f64) -> Synapse {
        let py = synapse_py();
        let dir = tempfile::tempdir().unwrap();
        let port = cyrene_test_support::free_port();
        let path = dir.path().join("homeserver.yaml");
        std::fs::write(&path, config(dir.path(), port, messages_per_second)).unwrap();
        let python = |args: &[&str]| {
            let mut command = std::process::Command::new("python3");
            command
                .env("PYTHONPATH", &py)
                .args(["-m", "synapse.app.homeserver", "-c"])
                .arg(&path)
                .args(args);
            command
        };
        let keys = python(&["--generate-keys"]).output().unwrap();
        assert!(
            keys.status.success(),
            "synapse --generate-keys: {}",
            String::from_utf8_lossy(&keys.stderr)
        );
        let log = std::fs::File::create(dir.path().join("synapse.log")).unwrap();
        let child = python(&[])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let synapse = Synapse {
            url: format!("http://127.0.0.1:{port}"),
            dir,
            child,
        };
        let http = cyrene_matrix_bridge::matrix::http_client().unwrap();
        let start = Instant::now();
        loop {
            let versions = format!("{}/_matrix/client/versions", synapse.url);
            if let Ok(answer) = http.get(&versions).send().await
                && answer.status().is_success()
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(90),
                "synapse did not start: {}",
                synapse.log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        synapse
    }

    /// The server's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("synapse.log")).unwrap_or_default()
    }

    /// Registers `localpart` with `password` (shared-secret registration, Synapse's admin API).
    pub async fn register(&self, localpart: &str, password: &str) {
        self.register_as(localpart, password, false).await;
    }

    /// Lifts the message rate limit of `user` (Synapse's admin API, as a fresh admin).
    pub async fn unlimited(&self, user: &OwnedUserId) {
        let admin = format!("admin-{}", cyrene_protocol::ids::new_id());
        self.register_as(&admin, "pw-admin", true).await;
        let hs = Homeserver::new(
            cyrene_matrix_bridge::matrix::http_client().unwrap(),
            &self.url,
        );
        let request =
            login::v3::Request::new(login::v3::LoginInfo::Password(login::v3::Password::new(
                UserIdentifier::Matrix(MatrixUserIdentifier::new(admin)),
                "pw-admin".into(),
            )));
        let token = hs.call(request).await.unwrap().access_token;
        let url = format!(
            "{}/_synapse/admin/v1/users/{user}/override_ratelimit",
            self.url
        );
        let answer = cyrene_matrix_bridge::matrix::http_client()
            .unwrap()
            .post(url)
            .bearer_auth(token)
            .json(&json!({"messages_per_second": 0, "burst_count": 0}))
            .send()
            .await
            .unwrap();
        assert!(
            answer.status().is_success(),
            "override_ratelimit: {}",
            answer.status()
        );
    }

    async fn register_as(&self, localpart: &str, password: &str, admin: bool) {
        let http = cyrene_matrix_bridge::matrix::http_client().unwrap();
        let url = format!("{}/_synapse/admin/v1/register", self.url);
        let nonce: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
        let nonce = nonce["nonce"].as_str().unwrap().to_owned();
        let role = if admin { "admin" } else { "notadmin" };
        let message = format!("{nonce}\0{localpart}\0{password}\0{role}");
        let mac = hmac_sha1(SECRET.as_bytes(), message.as_bytes());
        let body = json!({"nonce": nonce, "username": localpart, "password": password,
            "admin": admin, "mac": mac});
        let answer = http.post(&url).json(&body).send().await.unwrap();
        let status = answer.status();
        assert!(
            status.is_success(),
            "register {localpart}: {status} {}",
            answer.text().await.unwrap()
        );
    }

    /// Registers and logs in `localpart` (password `pw-<localpart>`).
    pub async fn person(&self, localpart: &str) -> Person {
        let password = format!("pw-{localpart}");
        self.register(localpart, &password).await;
        let hs = Homeserver::new(
            cyrene_matrix_bridge::matrix::http_client().unwrap(),
            &self.url,
        );
        let request =
            login::v3::Request::new(login::v3::LoginInfo::Password(login::v3::Password::new(
                UserIdentifier::Matrix(MatrixUserIdentifier::new(localpart.into())),
                password,
            )));
        let answer = hs.call(request).await.unwrap();
        Person {
            id: answer.user_id.clone(),
            hs: hs.with_token(answer.access_token),
            sent: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

/// HMAC-SHA1 as hex (RFC 2104), what Synapse's shared-secret registration checks.
fn hmac_sha1(key: &[u8], message: &[u8]) -> String {
    const BLOCK: usize = 64;
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..20].copy_from_slice(&Sha1::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.iter().map(|k| k ^ byte).collect::<Vec<u8>>();
    let mut inner = Sha1::new();
    inner.update(pad(0x36));
    inner.update(message);
    let mut outer = Sha1::new();
    outer.update(pad(0x5c));
    outer.update(inner.finalize());
    outer
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A test user.
pub struct Person {
    pub id: OwnedUserId,
    pub hs: Homeserver,
    sent: std::sync::atomic::AtomicU64,
}

/// One message of a room as a test reads it.
#[derive(Debug, Clone)]
pub struct Said {
    pub event_id: String,
    pub sender: String,
    pub msgtype: String,
    pub body: String,
}

impl Person {
    /// Sets this user's display name.
    pub async fn set_name(&self, name: &str) {
        #[allow(deprecated)]
        let request = set_display_name::v3::Request::new(self.id.clone(), Some(name.into()));
        self.hs.call(request).await.unwrap();
    }

    /// Creates a private room inviting `invite`; `direct` marks it a DM.
    pub async fn create_room(&self, invite: &[&OwnedUserId], direct: bool) -> OwnedRoomId {
        let mut request = create_room::v3::Request::new();
        request.invite = invite.iter().map(|u| (*u).clone()).collect();
        request.is_direct = direct;
        request.preset = Some(create_room::v3::RoomPreset::PrivateChat);
        self.hs.call(request).await.unwrap().room_id
    }

    /// Joins a room it was invited to.
    pub async fn join(&self, room: &OwnedRoomId) {
        self.hs
            .call(join_room_by_id::v3::Request::new(room.clone()))
            .await
            .unwrap();
    }

    fn txn(&self) -> OwnedTransactionId {
        let n = self.sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        OwnedTransactionId::from(format!("test-{}-{n}", cyrene_protocol::ids::new_id()))
    }

    /// Sends a message with `content`; returns its event id.
    pub async fn send(&self, room: &OwnedRoomId, content: Value) -> String {
        let raw = serde_json::value::to_raw_value(&content).unwrap();
        let request = send_message_event::v3::Request::new_raw(
            room.clone(),
            self.txn(),
            MessageLikeEventType::RoomMessage,
            Raw::from_json(raw),
        );
        self.hs.call(request).await.unwrap().event_id.to_string()
    }

    /// Says `text`, mentioning `mentions` (`m.mentions`).
    pub async fn say(&self, room: &OwnedRoomId, text: &str, mentions: &[&OwnedUserId]) -> String {
        let ids: Vec<String> = mentions.iter().map(|u| u.to_string()).collect();
        self.send(
            room,
            json!({"msgtype": "m.text", "body": text, "m.mentions": {"user_ids": ids}}),
        )
        .await
    }

    /// Uploads `png` and posts it as an image.
    pub async fn post_image(&self, room: &OwnedRoomId, png: &[u8]) -> String {
        self.post_media(room, "m.image", png, "image/png", "dot.png")
            .await
    }

    /// Uploads `bytes` (type `mime`, file name `name`) to the media repository and posts it
    /// as an `msgtype` message (`m.image`, `m.file`); returns the event id.
    pub async fn post_media(
        &self,
        room: &OwnedRoomId,
        msgtype: &str,
        bytes: &[u8],
        mime: &str,
        name: &str,
    ) -> String {
        let mut upload = create_content::v3::Request::new(bytes.to_vec());
        upload.content_type = Some(mime.into());
        upload.filename = Some(name.into());
        let uri = self.hs.call(upload).await.unwrap().content_uri;
        self.send(
            room,
            json!({"msgtype": msgtype, "body": name, "filename": name, "url": uri.to_string(),
                "info": {"mimetype": mime, "size": bytes.len()}}),
        )
        .await
    }

    /// The messages of a room, oldest first (the newest 200).
    pub async fn messages(&self, room: &OwnedRoomId) -> Vec<Said> {
        let mut request =
            get_message_events::v3::Request::new(room.clone(), ruma::api::Direction::Backward);
        request.limit = ruma::UInt::from(200u32);
        let page = self.hs.call(request).await.unwrap();
        let mut said: Vec<Said> = page
            .chunk
            .iter()
            .filter_map(|raw| {
                let event: Value = serde_json::from_str(raw.json().get()).ok()?;
                (event["type"] == "m.room.message").then(|| Said {
                    event_id: event["event_id"].as_str().unwrap_or_default().to_owned(),
                    sender: event["sender"].as_str().unwrap_or_default().to_owned(),
                    msgtype: event["content"]["msgtype"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    body: event["content"]["body"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                })
            })
            .collect();
        said.reverse();
        said
    }

    /// The messages `sender` posted in a room, oldest first.
    pub async fn messages_from(&self, room: &OwnedRoomId, sender: &OwnedUserId) -> Vec<String> {
        self.messages(room)
            .await
            .into_iter()
            .filter(|m| m.sender == sender.as_str())
            .map(|m| m.body)
            .collect()
    }

    /// Waits (up to 60 s) until `sender` has posted `n` messages in `room`; returns them.
    pub async fn wait_for(
        &self,
        room: &OwnedRoomId,
        sender: &OwnedUserId,
        n: usize,
        what: &str,
    ) -> Vec<String> {
        let start = Instant::now();
        loop {
            let said = self.messages_from(room, sender).await;
            if said.len() >= n {
                return said;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{what}: {sender} posted {said:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits until `who` has joined `room`.
    pub async fn wait_joined(&self, room: &OwnedRoomId, who: &OwnedUserId) {
        let start = Instant::now();
        loop {
            let request =
                ruma::api::client::membership::joined_members::v3::Request::new(room.clone());
            if let Ok(members) = self.hs.call(request).await
                && members.joined.contains_key(who)
            {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "{who} never joined {room}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A 1×1 PNG.
pub const DOT_PNG: &[u8] = &[
    0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0x15, 0xc4,
    0x89, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8, 0xcf, 0xc0, 0xf0,
    0x1f, 0x00, 0x05, 0x00, 0x01, 0xff, 0x89, 0x99, 0x3d, 0x1d, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
];

#[cfg(test)]
mod tests {
    #[test]
    fn hmac_sha1_matches_rfc_2202() {
        // RFC 2202, test case 2.
        assert_eq!(
            super::hmac_sha1(b"Jefe", b"what do ya want for nothing?"),
            "effcdf6ae5eb2fa2d27416d5f184df9c259a7c79"
        );
    }
}
