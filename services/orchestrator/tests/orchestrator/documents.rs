//! The document store's bounds (issue 30, M3 and L6) on a real nats-server: the total and
//! per-owner quotas, the bucket's JetStream limit, the sweep of abandoned uploads, chunk sizes.

use async_nats::jetstream;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_orchestrator::documents::{BUCKET, DocumentLimits, Documents, MAX_CHUNK_BYTES};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::document::{UploadAck, UploadRequest};
use cyrene_test_support::NatsServer;
use std::time::{Duration, SystemTime};

const K: u64 = 1024;

fn limits() -> DocumentLimits {
    DocumentLimits {
        max_document_bytes: 64 * K,
        owner_bytes: 100 * K,
        store_bytes: 150 * K,
        upload_ttl: Duration::from_secs(3600),
    }
}

async fn open(server: &NatsServer, limits: DocumentLimits) -> (jetstream::Context, Documents) {
    let js = jetstream::new(server.connect().await);
    let documents = Documents::open(&js, 1, limits).await.unwrap();
    (js, documents)
}

/// One chunk of `bytes` bytes of text (the whole document when `last`).
fn chunk(session: &str, upload_id: &str, seq: u32, bytes: usize, last: bool) -> UploadRequest {
    UploadRequest {
        session_id: session.into(),
        name: "notes.txt".into(),
        upload_id: upload_id.into(),
        seq,
        data: BASE64.encode(vec![b'a'; bytes]),
        last,
        ..Default::default()
    }
}

async fn whole(documents: &Documents, session: &str, bytes: u64) -> Result<UploadAck, ErrorCode> {
    let request = chunk(session, "", 0, bytes as usize, true);
    documents.upload(request).await.map_err(|e| e.code)
}

#[tokio::test(flavor = "multi_thread")]
async fn each_owner_and_the_whole_store_have_a_quota() {
    let server = NatsServer::start();
    let (js, documents) = open(&server, limits()).await;
    // The bucket itself is bounded: JetStream refuses writes past it.
    let mut stream = js.get_stream(format!("OBJ_{BUCKET}")).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().config.max_bytes,
        150 * K as i64
    );

    assert!(whole(&documents, "alice.s1", 40 * K).await.is_ok());
    assert!(whole(&documents, "alice.s2", 40 * K).await.is_ok());
    // alice stores 80 KiB of her 100: 40 more are refused, in any of her sessions.
    assert_eq!(
        whole(&documents, "alice.s3", 40 * K).await.unwrap_err(),
        ErrorCode::TooLarge
    );
    // Staged chunks count too, and a refused chunk drops its upload.
    let first = chunk("alice.s1", "", 0, 15 * K as usize, false);
    let staged = documents.upload(first).await.unwrap();
    let next = chunk("alice.s1", &staged.upload_id, 1, 15 * K as usize, true);
    assert_eq!(
        documents.upload(next.clone()).await.unwrap_err().code,
        ErrorCode::TooLarge
    );
    assert_eq!(
        documents.upload(next).await.unwrap_err().code,
        ErrorCode::NotFound
    );
    assert_eq!(documents.stored_by("alice.s1"), 80 * K);
    // bob has his own quota; sessions of nobody in particular are one owner.
    assert!(whole(&documents, "bob.s1", 40 * K).await.is_ok());
    // 120 KiB stored of 150: the store is full for 40 more, whoever asks.
    assert_eq!(
        whole(&documents, "s1", 40 * K).await.unwrap_err(),
        ErrorCode::TooLarge
    );
    assert!(whole(&documents, "s1", 20 * K).await.is_ok());
    // A sweep (or another replica opening the store) counts the same.
    let report = documents.sweep(SystemTime::now()).await.unwrap();
    assert_eq!(report.stored, 140 * K);
    assert_eq!(documents.stored_by("alice.x"), 80 * K);
    let (_, replica) = open(&server, limits()).await;
    assert_eq!(replica.stored_by("bob.s9"), 40 * K);
    assert_eq!(
        whole(&replica, "alice.s1", 30 * K).await.unwrap_err(),
        ErrorCode::TooLarge
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn abandoned_uploads_are_swept_and_give_their_bytes_back() {
    let server = NatsServer::start();
    let (_js, documents) = open(&server, limits()).await;
    let first = chunk("bob.s1", "", 0, 30 * K as usize, false);
    let staged = documents.upload(first).await.unwrap();
    let second = chunk("bob.s1", &staged.upload_id, 1, 30 * K as usize, false);
    documents.upload(second).await.unwrap();
    assert_eq!(documents.stored_by("bob.s1"), 60 * K);
    // Not yet abandoned.
    let report = documents.sweep(SystemTime::now()).await.unwrap();
    assert_eq!(report.deleted, 0);
    assert_eq!(documents.stored_by("bob.s1"), 60 * K);
    // Two hours later (the TTL is one): both staged chunks go, and their bytes with them.
    let later = SystemTime::now() + Duration::from_secs(7200);
    let report = documents.sweep(later).await.unwrap();
    assert_eq!(report.deleted, 2);
    assert_eq!(documents.stored_by("bob.s1"), 0);
    let third = chunk("bob.s1", &staged.upload_id, 2, 10, true);
    assert_eq!(
        documents.upload(third).await.unwrap_err().code,
        ErrorCode::NotFound
    );
    // A finished document is never swept.
    assert!(whole(&documents, "bob.s1", 10 * K).await.is_ok());
    let report = documents.sweep(later).await.unwrap();
    assert_eq!((report.deleted, report.stored), (0, 10 * K));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bucket_made_without_a_limit_gets_one() {
    let server = NatsServer::start();
    let js = jetstream::new(server.connect().await);
    js.create_object_store(jetstream::object_store::Config {
        bucket: BUCKET.into(),
        ..Default::default()
    })
    .await
    .unwrap();
    let _documents = Documents::open(&js, 1, limits()).await.unwrap();
    let mut stream = js.get_stream(format!("OBJ_{BUCKET}")).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().config.max_bytes,
        150 * K as i64
    );
}

/// issue 30, L6: a chunk holds at most 512 KiB — one byte more is `too_large`, even though its
/// base64 is no longer than a full chunk's.
#[tokio::test(flavor = "multi_thread")]
async fn a_chunk_one_byte_over_512_kib_is_too_large() {
    let server = NatsServer::start();
    let big = DocumentLimits {
        max_document_bytes: 8 << 20,
        owner_bytes: 16 << 20,
        store_bytes: 32 << 20,
        ..limits()
    };
    let (_js, documents) = open(&server, big).await;
    let over = chunk("s1", "", 0, MAX_CHUNK_BYTES + 1, false);
    assert_eq!(
        documents.upload(over).await.unwrap_err().code,
        ErrorCode::TooLarge
    );
    let full = chunk("s1", "", 0, MAX_CHUNK_BYTES, false);
    assert!(documents.upload(full).await.is_ok());
}

/// issue 30, L6: two requests carrying the same chunk `seq`, racing: one is taken, the other is
/// `conflict` (both were accepted before).
#[tokio::test(flavor = "multi_thread")]
async fn the_same_chunk_seq_is_taken_once_even_racing() {
    let server = NatsServer::start();
    let (_js, documents) = open(&server, limits()).await;
    let staged = documents
        .upload(chunk("s1", "", 0, 1000, false))
        .await
        .unwrap();
    for seq in 1..=3 {
        let next = chunk("s1", &staged.upload_id, seq, 1000, seq == 3);
        let (a, b) = tokio::join!(documents.upload(next.clone()), documents.upload(next));
        let codes: Vec<Option<ErrorCode>> = [a, b]
            .into_iter()
            .map(|r| r.err().map(|e| e.code))
            .collect();
        // The loser of the last chunk may come after the winner dropped the finished upload.
        let refused = [Some(ErrorCode::Conflict), Some(ErrorCode::NotFound)];
        assert!(
            codes.contains(&None)
                && codes
                    .iter()
                    .any(|c| refused[..1 + usize::from(seq == 3)].contains(c)),
            "seq {seq}: {codes:?}"
        );
    }
    // 4 chunks of 1000 bytes: the document, once.
    assert_eq!(documents.stored_by("s1"), 4000);
    let report = documents.sweep(SystemTime::now()).await.unwrap();
    assert_eq!(report.stored, 4000);
}
