//! Persona memory (docs/memory.md): the [`MemoryStore`] interface behind the bus endpoints
//! `cyrene.memory.read` / `write` / `forget`, and its SQL default [`SqlMemory`] (table
//! `orch_memory`, PostgreSQL or SQLite through the orchestrator's pool).
//!
//! # Invariants
//! - Memory belongs to a persona: every read, write and forget names it, and an entry of one
//!   persona is never read or deleted through another.
//! - Working memory (`session_id` set) is read only for its session; long-term memory
//!   (`session_id` empty) in every session of the persona.
//! - A read returns at most [`MAX_READ_ENTRIES`] of each kind, the newest, oldest first.
//! - Every entry is one line of at most [`MAX_ENTRY_BYTES`] bytes, checked on write.
//! - The entries extracted from one turn are written once: with the turn's done-marker (table
//!   `orch_memory_jobs`) in one transaction, so a second call for the turn writes nothing
//!   ([`MemoryStore::remember`]).

use crate::store::{StoreError, now_ms};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::memory::{
    MAX_ENTRY_BYTES, MAX_READ_ENTRIES, MemoryEntry, MemoryForgetAck, MemoryForgetRequest,
    MemoryReadRequest, MemoryReadResponse, MemorySource, MemoryWriteAck, MemoryWriteRequest,
};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_sql::WarmPool;
use cyrene_sql::bounded;
use sqlx::{Any, Row};
use std::future::Future;
use std::time::Duration;

/// Where persona memory lives. The orchestrator serves the bus endpoints through one; another
/// implementation (a vector store, a memory service) can take its place, or another service can
/// answer the same subjects instead.
pub trait MemoryStore: Send + Sync {
    /// The session's working memory and the persona's long-term memory.
    fn read(
        &self,
        req: MemoryReadRequest,
    ) -> impl Future<Output = Result<MemoryReadResponse, ErrorBody>> + Send;

    /// Remembers one entry.
    fn write(
        &self,
        req: MemoryWriteRequest,
    ) -> impl Future<Output = Result<MemoryWriteAck, ErrorBody>> + Send;

    /// Deletes one entry of the persona.
    fn forget(
        &self,
        req: MemoryForgetRequest,
    ) -> impl Future<Output = Result<MemoryForgetAck, ErrorBody>> + Send;

    /// Remembers what was extracted from the turn `source` names, as long-term memory of
    /// `source.persona`, each entry with its source — once per turn: `Remembered::Before` when
    /// that turn's entries were already written, and nothing is written again. Each text must
    /// pass [`check_text`].
    fn remember(
        &self,
        source: &MemorySource,
        texts: &[String],
    ) -> impl Future<Output = Result<Remembered, ErrorBody>> + Send;
}

/// What [`MemoryStore::remember`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remembered {
    /// This many entries were written now (0: the turn held nothing worth remembering, and
    /// nothing is written, not even the turn's done-marker).
    Now(usize),
    /// The turn's extraction had been recorded before: nothing written.
    Before,
}

fn bad(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::BadRequest, message)
}

fn check_ids(persona_id: &str, session_id: &str) -> Result<(), ErrorBody> {
    ids::validate(IdKind::Agent, persona_id).map_err(|e| bad(format!("persona_id: {e}")))?;
    if !session_id.is_empty() {
        ids::validate(IdKind::Session, session_id).map_err(|e| bad(format!("session_id: {e}")))?;
    }
    Ok(())
}

/// Checks an entry id as `write` issues them (`m-` and at most 64 id characters): anything else
/// — a NUL byte, a megabyte — is `bad_request` before the database sees it.
pub fn check_entry_id(id: &str) -> Result<(), ErrorBody> {
    let ok = id.strip_prefix("m-").is_some_and(|rest| {
        !rest.is_empty() && rest.len() <= 64 && rest.chars().all(ids::is_token_char)
    });
    if ok {
        Ok(())
    } else {
        Err(bad("id: not an entry id this service issued (m-…)"))
    }
}

/// Checks an entry's text: not blank, one line (no control character), at most
/// [`MAX_ENTRY_BYTES`] bytes.
pub fn check_text(text: &str) -> Result<(), ErrorBody> {
    if text.trim().is_empty() {
        return Err(bad("text is empty"));
    }
    if text.len() > MAX_ENTRY_BYTES {
        return Err(ErrorBody::new(
            ErrorCode::TooLarge,
            format!("an entry holds at most {MAX_ENTRY_BYTES} bytes"),
        ));
    }
    if text
        .chars()
        .any(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
    {
        return Err(bad(
            "an entry is one line: no line breaks or control characters",
        ));
    }
    Ok(())
}

/// The SQL default: table `orch_memory` in the orchestrator's database.
#[derive(Debug, Clone)]
pub struct SqlMemory {
    pool: WarmPool<Any>,
    timeout: Duration,
}

impl SqlMemory {
    /// Memory in `pool` (migrated by [`crate::Store::open`]); each operation bounded by
    /// `timeout` (then `unavailable`).
    pub fn new(pool: WarmPool<Any>, timeout: Duration) -> SqlMemory {
        SqlMemory { pool, timeout }
    }

    /// The session's working memory (none for an empty `session_id`) and the persona's
    /// long-term memory, each its newest [`MAX_READ_ENTRIES`] oldest first, in one statement:
    /// a turn reads its memory once as it starts.
    async fn read_both(&self, req: &MemoryReadRequest) -> Result<MemoryReadResponse, StoreError> {
        let rows = sqlx::query(
            "SELECT id, text, created_at, session_id, source FROM (SELECT id, text, created_at, \
               session_id, source \
               FROM orch_memory WHERE persona_id = $1 AND session_id = $2 AND $2 <> '' \
               ORDER BY created_at DESC, id DESC LIMIT $3) working \
             UNION ALL \
             SELECT id, text, created_at, session_id, source FROM (SELECT id, text, created_at, \
               session_id, source \
               FROM orch_memory WHERE persona_id = $1 AND session_id = '' \
               ORDER BY created_at DESC, id DESC LIMIT $3) long_term",
        )
        .bind(&req.persona_id)
        .bind(&req.session_id)
        .bind(MAX_READ_ENTRIES as i64)
        .fetch_all(&self.pool)
        .await?;
        let mut out = MemoryReadResponse::default();
        for r in &rows {
            let created: i64 = r.try_get(2)?;
            let session: String = r.try_get(3)?;
            // A source that does not decode (written by hand into the table) is left out.
            let source: Option<String> = r.try_get(4)?;
            let entry = MemoryEntry {
                id: r.try_get(0)?,
                text: r.try_get(1)?,
                created_unix_ms: u64::try_from(created).unwrap_or(0),
                source: source.and_then(|s| serde_json::from_str(&s).ok()),
            };
            match session.is_empty() {
                true => out.memory.push(entry),
                false => out.working_memory.push(entry),
            }
        }
        // Oldest first; the order a union hands rows back in is not promised.
        for entries in [&mut out.working_memory, &mut out.memory] {
            entries.sort_by(|a, b| (a.created_unix_ms, &a.id).cmp(&(b.created_unix_ms, &b.id)));
        }
        Ok(out)
    }

    async fn insert(&self, req: &MemoryWriteRequest, id: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO orch_memory (id, persona_id, session_id, text, created_at) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(id)
        .bind(&req.persona_id)
        .bind(&req.session_id)
        .bind(&req.text)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The turn's done-marker and its entries, in one transaction; `Before` when the marker was
    /// there (rolled back: nothing written).
    async fn insert_extracted(
        &self,
        source: &MemorySource,
        texts: &[String],
    ) -> Result<Remembered, StoreError> {
        // Nothing worth remembering: nothing to write twice, so no marker either (a
        // redelivery asks the model again whether or not one exists). Most turns end here.
        if texts.is_empty() {
            return Ok(Remembered::Now(0));
        }
        let now = now_ms();
        let encoded = serde_json::to_string(source)
            .map_err(|e| StoreError::Internal(format!("encode: {e}")))?;
        let mut tx = self.pool.begin().await?;
        // Under concurrent deliveries the second insert waits on the key and then inserts
        // nothing (PostgreSQL), or waits for the writer lock (SQLite): one of them writes.
        let marked = sqlx::query(
            "INSERT INTO orch_memory_jobs (turn_id, persona_id, entries, created_at) \
             VALUES ($1, $2, $3, $4) ON CONFLICT (turn_id) DO NOTHING",
        )
        .bind(&source.turn_id)
        .bind(&source.persona)
        .bind(texts.len() as i64)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        if marked.rows_affected() == 0 {
            tx.rollback().await?;
            return Ok(Remembered::Before);
        }
        for text in texts {
            sqlx::query(
                "INSERT INTO orch_memory (id, persona_id, session_id, text, created_at, source) \
                 VALUES ($1, $2, '', $3, $4, $5)",
            )
            .bind(format!("m-{}", ids::new_id()))
            .bind(&source.persona)
            .bind(text)
            .bind(now)
            .bind(&encoded)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Remembered::Now(texts.len()))
    }

    async fn delete(&self, req: &MemoryForgetRequest) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM orch_memory WHERE persona_id = $1 AND id = $2")
            .bind(&req.persona_id)
            .bind(&req.id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() > 0)
    }
}

impl MemoryStore for SqlMemory {
    async fn read(&self, req: MemoryReadRequest) -> Result<MemoryReadResponse, ErrorBody> {
        check_ids(&req.persona_id, &req.session_id)?;
        bounded(self.timeout, self.read_both(&req)).await
    }

    async fn write(&self, req: MemoryWriteRequest) -> Result<MemoryWriteAck, ErrorBody> {
        check_ids(&req.persona_id, &req.session_id)?;
        check_text(&req.text)?;
        let id = format!("m-{}", ids::new_id());
        bounded(self.timeout, self.insert(&req, &id)).await?;
        Ok(MemoryWriteAck { id })
    }

    async fn forget(&self, req: MemoryForgetRequest) -> Result<MemoryForgetAck, ErrorBody> {
        check_ids(&req.persona_id, "")?;
        check_entry_id(&req.id)?;
        let forgotten = bounded(self.timeout, self.delete(&req)).await?;
        Ok(MemoryForgetAck { forgotten })
    }

    async fn remember(
        &self,
        source: &MemorySource,
        texts: &[String],
    ) -> Result<Remembered, ErrorBody> {
        check_ids(&source.persona, &source.session_id)?;
        for text in texts {
            check_text(text)?;
        }
        bounded(self.timeout, self.insert_extracted(source, texts)).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::store::Store;

    async fn memory_on(url: &str) -> (Store, SqlMemory) {
        let store = crate::store::testing::store_on(url, crate::Personas::builtin()).await;
        let memory = SqlMemory::new(store.pool().clone(), Duration::from_secs(5));
        (store, memory)
    }

    fn write(persona: &str, session: &str, text: &str) -> MemoryWriteRequest {
        MemoryWriteRequest {
            persona_id: persona.into(),
            session_id: session.into(),
            text: text.into(),
        }
    }

    fn read(persona: &str, session: &str) -> MemoryReadRequest {
        MemoryReadRequest {
            persona_id: persona.into(),
            session_id: session.into(),
        }
    }

    fn texts(entries: &[MemoryEntry]) -> Vec<&str> {
        entries.iter().map(|e| e.text.as_str()).collect()
    }

    /// The memory semantics, on whichever database `memory` uses.
    async fn remembers_by_persona_and_session(memory: &SqlMemory) {
        for (persona, session, text) in [
            ("cyrene", "", "likes oolong"),
            ("cyrene", "s1", "we plan a picnic"),
            ("cyrene", "s2", "talking about exams"),
            ("hoshi", "", "likes trains"),
        ] {
            memory.write(write(persona, session, text)).await.unwrap();
        }

        let s1 = memory.read(read("cyrene", "s1")).await.unwrap();
        assert_eq!(texts(&s1.working_memory), ["we plan a picnic"]);
        assert_eq!(texts(&s1.memory), ["likes oolong"]);
        let s2 = memory.read(read("cyrene", "s2")).await.unwrap();
        assert_eq!(texts(&s2.working_memory), ["talking about exams"]);
        let none = memory.read(read("cyrene", "")).await.unwrap();
        assert!(none.working_memory.is_empty());
        let hoshi = memory.read(read("hoshi", "s1")).await.unwrap();
        assert!(hoshi.working_memory.is_empty());
        assert_eq!(texts(&hoshi.memory), ["likes trains"]);

        // The newest MAX_READ_ENTRIES, oldest first.
        for i in 0..MAX_READ_ENTRIES + 5 {
            memory
                .write(write("cyrene", "s3", &format!("note {i:03}")))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let s3 = memory.read(read("cyrene", "s3")).await.unwrap();
        assert_eq!(s3.working_memory.len(), MAX_READ_ENTRIES);
        assert_eq!(
            texts(&s3.memory),
            ["likes oolong"],
            "each kind has its own limit"
        );
        assert_eq!(s3.working_memory[0].text, "note 005");
        assert_eq!(
            s3.working_memory.last().unwrap().text,
            format!("note {:03}", MAX_READ_ENTRIES + 4)
        );

        // Forget: only through the owning persona.
        let id = s1.memory[0].id.clone();
        let other = MemoryForgetRequest {
            persona_id: "hoshi".into(),
            id: id.clone(),
        };
        assert!(!memory.forget(other).await.unwrap().forgotten);
        let own = MemoryForgetRequest {
            persona_id: "cyrene".into(),
            id,
        };
        assert!(memory.forget(own.clone()).await.unwrap().forgotten);
        assert!(!memory.forget(own).await.unwrap().forgotten);
        assert!(
            memory
                .read(read("cyrene", "s1"))
                .await
                .unwrap()
                .memory
                .is_empty()
        );

        // An id that was never issued is refused before the database sees it (issue 30, L2).
        for id in [
            "m-a\u{0}b".to_owned(),
            format!("m-{}", "x".repeat(1 << 20)),
            "x".into(),
        ] {
            let forget = MemoryForgetRequest {
                persona_id: "cyrene".into(),
                id,
            };
            let err = memory.forget(forget).await.unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest, "{err}");
            assert!(err.message.len() < 200, "{err}");
        }

        // Bad input.
        let code = |r: Result<MemoryWriteAck, ErrorBody>| r.unwrap_err().code;
        for (persona, session, text) in [
            ("cyrene", "", " "),
            ("cyrene", "", "a\nb"),
            ("a.b", "", "x"),
            ("cyrene", "s>", "x"),
        ] {
            assert_eq!(
                code(memory.write(write(persona, session, text)).await),
                ErrorCode::BadRequest,
                "{persona:?} {session:?} {text:?}"
            );
        }
        let long = "x".repeat(MAX_ENTRY_BYTES + 1);
        assert_eq!(
            code(memory.write(write("cyrene", "", &long)).await),
            ErrorCode::TooLarge
        );
    }

    /// A turn's extracted entries are written once; a turn with nothing to remember writes
    /// nothing at all, not even its done-marker.
    async fn remembers_a_turn_once(memory: &SqlMemory) {
        let source = |turn: &str| MemorySource {
            session_id: "s1".into(),
            turn_id: turn.into(),
            persona: "cyrene".into(),
        };
        let markers = || {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM orch_memory_jobs")
                .fetch_one(&memory.pool)
        };
        let entries = async || memory.read(read("cyrene", "")).await.unwrap().memory.len();
        let before = entries().await;
        let facts = ["rides a red bicycle".to_owned()];
        assert_eq!(
            memory.remember(&source("t1"), &facts).await.unwrap(),
            Remembered::Now(1)
        );
        assert_eq!(
            memory.remember(&source("t1"), &facts).await.unwrap(),
            Remembered::Before
        );
        assert_eq!(
            memory.remember(&source("t2"), &[]).await.unwrap(),
            Remembered::Now(0)
        );
        assert_eq!(
            markers().await.unwrap(),
            1,
            "an empty extraction wrote a marker"
        );
        assert_eq!(entries().await, before + 1);
    }

    #[tokio::test]
    async fn sqlite_memory_remembers_by_persona_and_session() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}/memory.db", dir.path().display());
        let (store, memory) = memory_on(&url).await;
        remembers_by_persona_and_session(&memory).await;
        remembers_a_turn_once(&memory).await;
        store.close().await;
    }

    #[tokio::test]
    async fn postgres_memory_remembers_by_persona_and_session() {
        let db = cyrene_sql::testing::TestDatabase::create("orch_memory").await;
        let (store, memory) = memory_on(&db.url).await;
        remembers_by_persona_and_session(&memory).await;
        remembers_a_turn_once(&memory).await;
        store.close().await;
    }
}
