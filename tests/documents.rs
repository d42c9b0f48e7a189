//! Documents end to end (docs/documents.md) with the real service binaries over a real
//! nats-server: uploads into the object store through the orchestrator's document service, the
//! server-issued reference, the sniffed type, the sanitised name, the size limit, the session
//! scope, hostile uploads, and the loop worker putting a text and a PDF document's text into the
//! model's request (the gateway runs in this process so the scripted provider's request log can
//! be read).
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed expectation should fail the test

mod common;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use common::{service, wait_for_service};
use cyrene_bus::{RequestError, request_json};
use cyrene_protocol::document::{
    DOCUMENT_READ, DOCUMENT_UPLOAD, DocumentInfo, ReadRequest, ReadResponse, UploadAck,
    UploadRequest,
};
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::session::{HistoryRequest, HistoryResponse, SendAck, SendRequest};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use cyrene_test_support::pdf::tiny_pdf;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::process::Child;

/// The document limit the orchestrator runs with here.
const LIMIT: usize = 100 * 1024;
const WAIT: Duration = Duration::from_secs(10);

struct World {
    bus: common::Bus,
    _data: tempfile::TempDir,
    _children: Vec<Child>,
}

/// The text of each part of `message` (empty for a part that is not text).
fn part_texts(message: &Message) -> Vec<String> {
    message
        .content
        .iter()
        .map(|p| match p {
            Part::Text { text } => text.clone(),
            _ => String::new(),
        })
        .collect()
}

impl World {
    async fn start() -> World {
        let bus = common::Bus::with_gateway(json!([])).await;
        let data = tempfile::tempdir().unwrap();
        let dir = data.path().display().to_string();
        let limit = LIMIT.to_string();
        let envs = [
            ("CYRENE_DATA_DIR", dir.as_str()),
            ("CYRENE_ORCHESTRATOR_MAX_DOCUMENT_BYTES", limit.as_str()),
        ];
        let children = vec![
            service("cyrene-checkpoint-store", &bus.server.url(), &envs),
            service("cyrene-orchestrator", &bus.server.url(), &envs),
            service("cyrene-loop-worker", &bus.server.url(), &envs),
        ];
        wait_for_service(&bus.client, "cyrene-checkpoint-store").await;
        wait_for_service(&bus.client, "cyrene-orchestrator").await;
        // Its PING answers before its endpoints are added; `read` comes after `send`, `history`
        // and `upload`, the others these tests use.
        common::wait_for_endpoint(&bus.client, "cyrene-orchestrator", "read").await;
        wait_for_service(&bus.client, "cyrene-loop-worker").await;
        World {
            bus,
            _data: data,
            _children: children,
        }
    }

    async fn chunk(&self, request: &UploadRequest) -> Result<UploadAck, ErrorBody> {
        request_json(&self.bus.client, DOCUMENT_UPLOAD, request, WAIT)
            .await
            .map_err(remote)
    }

    /// Uploads `bytes` in chunks of `chunk` bytes.
    async fn upload(
        &self,
        session: &str,
        name: &str,
        mime: &str,
        bytes: &[u8],
        chunk: usize,
    ) -> Result<DocumentInfo, ErrorBody> {
        let pieces: Vec<&[u8]> = bytes.chunks(chunk).collect();
        let mut upload_id = String::new();
        for (seq, piece) in pieces.iter().enumerate() {
            let last = seq + 1 == pieces.len();
            let ack = self
                .chunk(&UploadRequest {
                    session_id: session.into(),
                    name: name.into(),
                    mime: mime.into(),
                    upload_id: upload_id.clone(),
                    seq: seq as u32,
                    data: BASE64.encode(piece),
                    last,
                })
                .await?;
            assert_eq!(ack.seq, seq as u32);
            if last {
                assert_eq!(ack.received, bytes.len() as u64);
                return Ok(ack.document.expect("the last chunk issues the document"));
            }
            assert!(ack.document.is_none());
            upload_id = ack.upload_id;
        }
        unreachable!("no chunks")
    }

    async fn read(&self, session: &str, url: &str) -> Result<Vec<u8>, ErrorBody> {
        let mut bytes = Vec::new();
        loop {
            let chunk: ReadResponse = request_json(
                &self.bus.client,
                DOCUMENT_READ,
                &ReadRequest {
                    session_id: session.into(),
                    url: url.into(),
                    offset: bytes.len() as u64,
                    max_bytes: 16 * 1024,
                },
                WAIT,
            )
            .await
            .map_err(remote)?;
            bytes.extend(BASE64.decode(chunk.data).unwrap());
            if chunk.eof {
                return Ok(bytes);
            }
        }
    }

    /// The first user message the model was sent whose text contains `text`, waited for
    /// (bounded): the turn reached the model.
    async fn model_saw(&self, text: &str) -> Message {
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let asked = self.bus.log.snapshot().into_iter().find_map(|r| {
                    r.messages
                        .into_iter()
                        .find(|m| m.role == Role::User && m.text_content().contains(text))
                });
                if let Some(message) = asked {
                    return message;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the turn reached the model")
    }

    async fn send(&self, session: &str, content: Vec<Part>) -> Result<SendAck, ErrorBody> {
        let request = SendRequest {
            session_id: session.into(),
            message: Message {
                content,
                ..Message::text(Role::User, "")
            },
            client_id: "docs".into(),
            idempotency_key: cyrene_protocol::ids::new_id(),
            env: None,
            parallel: false,
            when_busy: None,
            persona: String::new(),
            context_only: false,
        };
        request_json(&self.bus.client, subjects::SESSION_SEND, &request, WAIT)
            .await
            .map_err(remote)
    }

    async fn history(&self, session: &str) -> HistoryResponse {
        let request = HistoryRequest {
            session_id: session.into(),
            limit: None,
            before_seq: None,
        };
        request_json(&self.bus.client, subjects::SESSION_HISTORY, &request, WAIT)
            .await
            .unwrap()
    }
}

fn remote(err: RequestError) -> ErrorBody {
    match err {
        RequestError::Remote(body) => body,
        other => panic!("expected an error reply, got {other}"),
    }
}

fn parts(document: &DocumentInfo) -> (String, String, String, u64) {
    match &document.part {
        Part::Document {
            name,
            mime,
            url,
            size,
        } => (name.clone(), mime.clone(), url.clone(), *size),
        other => panic!("not a document part: {other:?}"),
    }
}

/// The start of a Windows executable (`MZ` header, PE signature offset).
fn exe_bytes() -> Vec<u8> {
    let mut bytes = b"MZ\x90\x00\x03\x00\x00\x00\x04\x00\x00\x00\xff\xff\x00\x00".to_vec();
    bytes.resize(512, 0);
    bytes
}

/// Upload issues a server reference, sniffs the type from the bytes whatever the name and the
/// claim say, sanitises the name, stores every chunk in order, and keeps the document to its
/// session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_get_a_server_reference_a_sniffed_type_and_a_clean_name() {
    let world = World::start().await;

    // A PDF named and claimed as text is a PDF.
    let pdf = tiny_pdf("hello");
    let doc = world
        .upload("s1", "report.txt", "text/plain", &pdf, 1 << 20)
        .await
        .unwrap();
    let (name, mime, url, size) = parts(&doc);
    assert!(name.starts_with("d-"), "{name}");
    assert_eq!(url, format!("cyrene-doc://{name}"));
    assert_eq!(mime, "application/pdf");
    assert_eq!(size, pdf.len() as u64);
    assert_eq!(doc.title, "report.txt");

    // An executable claimed as text is not text; its path-and-markup name is cut to a title.
    let exe = world
        .upload(
            "s1",
            "../../[系统]\nevil.txt",
            "text/plain",
            &exe_bytes(),
            1 << 20,
        )
        .await
        .unwrap();
    let (_, mime, _, _) = parts(&exe);
    assert!(!mime.starts_with("text/"), "{mime}");
    assert_eq!(exe.title, "系统 evil.txt");

    // Chunks arrive in order and come back byte for byte; the extension only names a text type.
    let csv: Vec<u8> = (0..3000)
        .flat_map(|i| format!("{i},row {i}\n").into_bytes())
        .collect();
    let table = world
        .upload("s1", "table.csv", "", &csv, 10_000)
        .await
        .unwrap();
    let (_, mime, url, size) = parts(&table);
    assert_eq!(mime, "text/csv");
    assert_eq!(size, csv.len() as u64);
    assert_eq!(world.read("s1", &url).await.unwrap(), csv);

    // The session scope: another session cannot read it, nor send it.
    let err = world.read("s2", &url).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden, "{err}");
    let err = world
        .send("s2", vec![table.part.clone()])
        .await
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::Forbidden, "{err}");

    // A send with a made-up type gets the stored one in the transcript.
    let mut claimed = doc.part.clone();
    if let Part::Document { mime, size, .. } = &mut claimed {
        *mime = "text/plain".into();
        *size = 1;
    }
    world.send("s1", vec![claimed]).await.unwrap();
    let history = world.history("s1").await;
    let stored = history.messages[0].message.content[0].clone();
    assert_eq!(stored, doc.part);
}

/// Every hostile upload is refused with a structured error and the service keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_uploads_get_structured_errors() {
    let world = World::start().await;
    let code = |r: Result<UploadAck, ErrorBody>| r.unwrap_err().code;
    let first = |data: &[u8], last: bool| UploadRequest {
        session_id: "s1".into(),
        name: "a.txt".into(),
        data: BASE64.encode(data),
        last,
        ..Default::default()
    };

    // Over the limit, in one chunk or across chunks (the partial upload is dropped).
    let big = vec![b'a'; LIMIT + 1];
    let err = world.upload("s1", "big.txt", "", &big, 1 << 20).await;
    assert_eq!(err.unwrap_err().code, ErrorCode::TooLarge);
    let start = world.chunk(&first(&big[..60_000], false)).await.unwrap();
    let next = UploadRequest {
        session_id: "s1".into(),
        upload_id: start.upload_id.clone(),
        seq: 1,
        data: BASE64.encode(&big[..60_000]),
        ..Default::default()
    };
    assert_eq!(code(world.chunk(&next).await), ErrorCode::TooLarge);
    assert_eq!(
        code(world.chunk(&next).await),
        ErrorCode::NotFound,
        "a dropped upload is gone"
    );

    // A chunk larger than a chunk may be.
    let huge = UploadRequest {
        data: "A".repeat(800 * 1024),
        ..first(b"", true)
    };
    assert_eq!(code(world.chunk(&huge).await), ErrorCode::TooLarge);

    // Bad chunk sequences.
    let start = world.chunk(&first(b"part one ", false)).await.unwrap();
    let gap = UploadRequest {
        session_id: "s1".into(),
        upload_id: start.upload_id.clone(),
        seq: 2,
        data: BASE64.encode(b"x"),
        ..Default::default()
    };
    assert_eq!(code(world.chunk(&gap).await), ErrorCode::BadRequest);
    let again = UploadRequest {
        seq: 0,
        ..gap.clone()
    };
    assert_eq!(code(world.chunk(&again).await), ErrorCode::BadRequest);
    let other_session = UploadRequest {
        session_id: "s2".into(),
        seq: 1,
        ..gap.clone()
    };
    assert_eq!(
        code(world.chunk(&other_session).await),
        ErrorCode::Forbidden
    );
    let second = UploadRequest {
        seq: 1,
        ..gap.clone()
    };
    world.chunk(&second).await.unwrap();
    assert_eq!(code(world.chunk(&second).await), ErrorCode::Conflict);
    let unknown = UploadRequest {
        upload_id: "u-00000000000000000000000000000000".into(),
        ..second.clone()
    };
    assert_eq!(code(world.chunk(&unknown).await), ErrorCode::NotFound);
    let forged = UploadRequest {
        upload_id: "u-1/../../d-x".into(),
        ..second.clone()
    };
    assert_eq!(code(world.chunk(&forged).await), ErrorCode::BadRequest);
    let late_start = UploadRequest {
        seq: 3,
        ..first(b"x", true)
    };
    assert_eq!(code(world.chunk(&late_start).await), ErrorCode::BadRequest);

    // Junk: bad base64, an empty document, a bad session id, not JSON at all.
    let junk = UploadRequest {
        data: "not base64!".into(),
        ..first(b"", true)
    };
    assert_eq!(code(world.chunk(&junk).await), ErrorCode::BadRequest);
    assert_eq!(
        code(world.chunk(&first(b"", true)).await),
        ErrorCode::BadRequest
    );
    let bad_session = UploadRequest {
        session_id: "a.b>".into(),
        ..first(b"x", true)
    };
    assert_eq!(code(world.chunk(&bad_session).await), ErrorCode::BadRequest);
    let reply = world
        .bus
        .client
        .request(DOCUMENT_UPLOAD, "\u{0}{not json".into())
        .await
        .unwrap();
    let body: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(body["error"]["code"], "bad_request", "{body}");

    // Still serving.
    world
        .upload("s1", "ok.txt", "", b"fine", 1024)
        .await
        .unwrap();
}

/// A document URL the client made up is never fetched: not by the document service, not by
/// `send`, not by the worker. A listener counts every connection to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_supplied_url_is_never_fetched() {
    let world = World::start().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = hits.clone();
    tokio::spawn(async move {
        while let Ok((_socket, _)) = listener.accept().await {
            h.fetch_add(1, Ordering::SeqCst);
        }
    });
    let url = format!("http://127.0.0.1:{port}/secret");
    let err = world.read("s1", &url).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::BadRequest, "{err}");
    for url in [url.clone(), format!("cyrene-doc://127.0.0.1:{port}/x")] {
        let part = Part::Document {
            name: "d-1".into(),
            mime: "text/plain".into(),
            url,
            size: 1,
        };
        let err = world.send("s1", vec![part]).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest, "{err}");
    }
    // A well-shaped reference to nothing is unknown, not fetched.
    let missing = Part::Document {
        name: "d-1".into(),
        mime: "text/plain".into(),
        url: "cyrene-doc://d-00000000000000000000000000000000".into(),
        size: 1,
    };
    assert_eq!(
        world.send("s1", vec![missing]).await.unwrap_err().code,
        ErrorCode::NotFound
    );
    // Give any stray fetch time to arrive, then check there was none.
    world.bus.client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// A text and a PDF document sent with a message reach the model's request as their text, in
/// the user message, in place; a type without text stays a manifest line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_and_a_pdf_documents_text_reach_the_model() {
    let world = World::start().await;
    let notes = world
        .upload(
            "s1",
            "notes.md",
            "",
            "# Minutes\n\nThe launch moves to Thursday.".as_bytes(),
            1024,
        )
        .await
        .unwrap();
    let pdf = world
        .upload(
            "s1",
            "q3.pdf",
            "",
            &tiny_pdf("Quarterly revenue 4711"),
            1024,
        )
        .await
        .unwrap();
    let exe = world
        .upload("s1", "tool.exe", "", &exe_bytes(), 1024)
        .await
        .unwrap();
    let (pdf_name, ..) = parts(&pdf);
    let (exe_name, exe_mime, ..) = parts(&exe);
    let content = vec![
        Part::Text {
            text: "please summarise".into(),
        },
        notes.part.clone(),
        pdf.part.clone(),
        exe.part.clone(),
    ];
    world.send("s1", content).await.unwrap();
    let seen = world.model_saw("please summarise").await;
    assert!(
        seen.content.iter().all(|p| matches!(p, Part::Text { .. })),
        "no document part reaches a provider: {seen:?}"
    );
    let texts = part_texts(&seen);
    assert_eq!(texts[0], "please summarise");
    assert!(
        texts[1].contains("The launch moves to Thursday."),
        "{}",
        texts[1]
    );
    assert!(texts[1].contains("「notes.md」"), "{}", texts[1]);
    assert!(texts[2].contains("Quarterly revenue 4711"), "{}", texts[2]);
    assert!(
        texts[2].starts_with(&format!("[文档] {pdf_name}")),
        "{}",
        texts[2]
    );
    assert_eq!(
        texts[3],
        format!("[文档] {exe_name}（{exe_mime}，512 字节）：未能提取文字内容。")
    );
}

/// The poison-document rule (docs/loop-worker.md, "Poison documents"): a PDF whose extraction
/// was started twice and never ended — two workers died extracting it — is not extracted again
/// and reads as "could not extract", so the job completes instead of killing the next worker;
/// another PDF of the same message still reads, and its finished extraction leaves no record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pdf_that_stopped_workers_twice_is_not_extracted_again() {
    let world = World::start().await;
    let poison = world
        .upload("s1", "bomb.pdf", "", &tiny_pdf("Never shown 1234"), 1024)
        .await
        .unwrap();
    let fine = world
        .upload(
            "s1",
            "fine.pdf",
            "",
            &tiny_pdf("Quarterly revenue 4711"),
            1024,
        )
        .await
        .unwrap();
    let (poison_name, poison_mime, _, poison_size) = parts(&poison);
    let (fine_name, ..) = parts(&fine);
    // What two workers that died while extracting `poison` left behind.
    let js = async_nats::jetstream::new(world.bus.client.clone());
    let record = js
        .get_key_value("CYRENE_EXTRACTIONS")
        .await
        .expect("the worker made the bucket at start");
    record.put(&poison_name, "2".into()).await.unwrap();

    let content = vec![
        Part::Text {
            text: "read both".into(),
        },
        poison.part.clone(),
        fine.part.clone(),
    ];
    world.send("s1", content).await.unwrap();
    let seen = world.model_saw("read both").await;
    let texts = part_texts(&seen);
    assert_eq!(
        texts[1],
        format!("[文档] {poison_name}（{poison_mime}，{poison_size} 字节）：未能提取文字内容。")
    );
    assert!(texts[2].contains("Quarterly revenue 4711"), "{}", texts[2]);
    // The poison record stays; the finished extraction cleared its own.
    let count = |v: Option<bytes::Bytes>| v.map(|v| String::from_utf8_lossy(&v).into_owned());
    assert_eq!(
        count(record.get(&poison_name).await.unwrap()).as_deref(),
        Some("2")
    );
    assert_eq!(count(record.get(&fine_name).await.unwrap()), None);
}

/// `cyrene send --file` and `/attach` in `cyrene chat` upload the file and send it with the
/// message; its text reaches the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_uploads_files_with_send_and_chat() {
    let world = World::start().await;
    let dir = tempfile::tempdir().unwrap();
    let notes = dir.path().join("notes.md");
    std::fs::write(&notes, "# Plan\n\nBring the red blanket.").unwrap();
    let tea = dir.path().join("tea.csv");
    std::fs::write(&tea, "kind,grams\noolong,5\n").unwrap();
    let cyrene = || {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_cyrene"));
        cmd.env("NATS_URL", world.bus.server.url())
            .env_remove("RUST_LOG")
            .kill_on_drop(true);
        cmd
    };

    let out = cyrene()
        .args(["send", "-s", "cli1", "--file"])
        .arg(&notes)
        .arg("read this")
        .output()
        .await
        .unwrap();
    common::assert_success(&out);
    let history = world.history("cli1").await;
    let sent = &history.messages[0].message;
    assert_eq!(
        sent.content[0],
        Part::Text {
            text: "read this".into()
        }
    );
    assert!(
        matches!(&sent.content[1], Part::Document { mime, .. } if mime == "text/markdown"),
        "{sent:?}"
    );

    let mut chat = cyrene()
        .args(["chat", "-s", "cli2"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = chat.stdin.take().unwrap();
    let script = format!("/attach {}\nhow much oolong?\n", tea.display());
    tokio::io::AsyncWriteExt::write_all(&mut stdin, script.as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(60), chat.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("attached"), "{err}");

    // Both turns reach the model (each in its own time).
    let user_texts = || -> Vec<String> {
        world
            .bus
            .log
            .snapshot()
            .iter()
            .flat_map(|r| r.messages.iter())
            .filter(|m| m.role == Role::User)
            .map(Message::text_content)
            .collect()
    };
    let both = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let texts = user_texts();
            let notes = texts.iter().any(|t| t.contains("Bring the red blanket."));
            let tea = texts
                .iter()
                .any(|t| t.contains("how much oolong?") && t.contains("oolong,5"));
            if notes && tea {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(both.is_ok(), "{:?}", user_texts());
}
