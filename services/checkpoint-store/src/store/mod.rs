//! The [`CheckpointStore`] trait, the input checks every backend shares, and the two SQL backends
//! behind it: [`PgStore`] (PostgreSQL, production) and [`SqliteStore`] (the embedded default),
//! one code path ([`sql::SqlStore`]) over two dialects.
//!
//! # Invariants
//! - Every backend validates its input through the helpers here first ([`prepare_save`],
//!   [`check_owner`], [`parse_id`], [`list_limit`]), so both refuse exactly the same requests with
//!   exactly the same errors.
//! - **Identity.** A turn's row is `{owner}:{turn_id}:{step}`, an unfenced row `{owner}:{step}`
//!   ([`checkpoint_id`]): two turns of one owner never overwrite or mask each other, and every
//!   earlier turn's rows stay readable (`get`, `list`) until retention removes them.
//! - **Write order.** Every save (insert or overwrite) gives its row a new `write_seq`, larger than
//!   every other row's; `latest` is the owner's (or the turn's) row with the highest `write_seq` —
//!   the most recently written, never the highest step — and `list` and `keep_last` go by it too.
//! - A save is an upsert on `id`: `created_at` is kept from the first write, everything else is
//!   replaced. Plain reads (`latest`, `get`, `list`) never write or delete; only `retain` deletes.
//! - Rows of one owner key are only ever addressed by that key, so the legs `s1#a` and `s1#b` (and
//!   the single-leg owner `s1`) never see each other's rows.
//! - Fencing: a save carrying `{turn_id, attempt}` raises `turn_attempts.max_attempt` and upserts
//!   the row in one transaction; if the recorded max is above `attempt` the save is refused with
//!   [`StoreError::Conflict`]. A *fenced read* ([`CheckpointStore::latest_of_turn`] with an
//!   attempt) raises the record **before** it reads, so once a new delivery has looked at its
//!   turn's checkpoints, a save still in flight from the dead one can no longer land behind its
//!   back. The first attempt ([`FIRST_ATTEMPT`]) has no older one to shut out: its read only
//!   checks the record.
//!
//! # Pitfalls
//! - Timestamps are produced by the caller (`now`), not by the database, so the same code path
//!   works on both backends and tests can write "old" rows without sleeping. SQLite keeps them as
//!   fixed-width RFC 3339 text ([`format_ts`]), so comparing text compares time. Write order is
//!   `write_seq`, not a timestamp, so clock skew between store replicas cannot reorder writes.
//! - A connection that dies mid-query surfaces as an I/O or protocol error; those, pool timeouts
//!   and the backends' "server is going away / busy" codes are answered `unavailable`
//!   (retryable), every other query failure `internal` ([`cyrene_sql::QueryError`]).

mod group;
pub mod postgres;
pub mod sql;
pub mod sqlite;

pub use postgres::PgStore;
pub use sqlite::SqliteStore;

use chrono::{DateTime, Utc};
use cyrene_protocol::JsonObject;
use cyrene_protocol::checkpoint::{
    Checkpoint, LIST_DEFAULT_LIMIT, LIST_MAX_LIMIT, PROGRESS_MAX_TOOL_NAME_CHARS,
    PROGRESS_MAX_TOOL_TURNS, PROGRESS_MAX_TOOLS, PROGRESS_MAX_TURNS, ProgressRequest, RetainMode,
    RetainRequest, TurnProgress, checkpoint_id, validate_owner,
};
use cyrene_protocol::ids::{self, MAX_ID_LEN};
use std::future::Future;
use std::time::Duration;

/// The default largest serialised `state` a save accepts (4 MiB). Note that the NATS server's own
/// `max_payload` (1 MiB by default) refuses larger requests before they reach the service.
pub const DEFAULT_MAX_STATE_BYTES: usize = 4 * 1024 * 1024;

/// Connection and limit settings shared by both backends.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Largest serialised `state` accepted, in bytes; larger saves get `too_large`.
    pub max_state_bytes: usize,
    /// How long a query waits for a pooled connection before failing with `unavailable`; short,
    /// so a database outage fails requests fast instead of hanging them.
    pub acquire_timeout: Duration,
    /// Pool size.
    pub max_connections: u32,
    /// PostgreSQL: write the steps' fenced saves that arrive together in one statement and one
    /// commit (`group.rs`). Off only to measure it.
    pub group_commit: bool,
}

impl StoreOptions {
    /// The pool these options describe.
    pub fn pool(&self) -> cyrene_sql::PoolSettings {
        cyrene_sql::PoolSettings {
            max_connections: self.max_connections,
            acquire_timeout: self.acquire_timeout,
        }
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            max_state_bytes: DEFAULT_MAX_STATE_BYTES,
            acquire_timeout: Duration::from_secs(2),
            max_connections: 8,
            group_commit: true,
        }
    }
}

/// Why a store operation failed: the one error of both SQL services ([`cyrene_sql::StoreError`]).
pub use cyrene_sql::StoreError;

/// The per-step snapshot store (docs/architecture.md §3). Implemented once per SQL backend.
///
/// Methods return `Send` futures so the service can run them on any task.
pub trait CheckpointStore: Send + Sync + 'static {
    /// Upserts `checkpoint` (fenced when it carries `turn_id` and `attempt`) and returns the
    /// stored row with `created_at`/`updated_at`.
    fn save(
        &self,
        checkpoint: Checkpoint,
        now: DateTime<Utc>,
    ) -> impl Future<Output = Result<Checkpoint, StoreError>> + Send;

    /// The owner's most recently written checkpoint; `NotFound` when it has none.
    fn latest(&self, agent_id: &str)
    -> impl Future<Output = Result<Checkpoint, StoreError>> + Send;

    /// The most recently written checkpoint of one turn of the owner; `NotFound` when the turn
    /// has none. With `attempt` it is a fenced read: `attempt` is recorded as the turn's newest
    /// first (`Conflict` when a newer one already is), so no older attempt writes afterwards.
    fn latest_of_turn(
        &self,
        agent_id: &str,
        turn_id: &str,
        attempt: Option<u32>,
        now: DateTime<Utc>,
    ) -> impl Future<Output = Result<Checkpoint, StoreError>> + Send;

    /// One checkpoint by id (`{owner}:{turn_id}:{step}` or `{owner}:{step}`).
    fn get(&self, id: &str) -> impl Future<Output = Result<Checkpoint, StoreError>> + Send;

    /// The owner's checkpoints, most recently written first, at most `limit` (default 50, clamped
    /// to 1000).
    fn list(
        &self,
        agent_id: &str,
        limit: Option<u32>,
    ) -> impl Future<Output = Result<Vec<Checkpoint>, StoreError>> + Send {
        async move {
            let count = list_limit(limit)?;
            self.list_before(agent_id, count, None).await
        }
    }

    /// At most `count` of the owner's checkpoints written before the row `before` (all when
    /// `None`), most recently written first. `NotFound` when `before` is not a row of the owner.
    fn list_before(
        &self,
        agent_id: &str,
        count: u32,
        before: Option<&str>,
    ) -> impl Future<Output = Result<Vec<Checkpoint>, StoreError>> + Send;

    /// How far each turn asked has got, in the order asked: its highest saved step and, when
    /// asked, the tools its saved steps called ([`tool_names`]). A turn without rows is at step
    /// 0. Reads only; checked by [`check_progress`].
    fn progress(
        &self,
        request: &ProgressRequest,
    ) -> impl Future<Output = Result<Vec<TurnProgress>, StoreError>> + Send;

    /// Runs one explicit retention operation and returns how many checkpoint rows it deleted.
    fn retain(
        &self,
        request: &RetainRequest,
        now: DateTime<Utc>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// `postgres` or `sqlite`, for logs and benchmarks.
    fn backend(&self) -> &'static str;

    /// Closes the pool, waiting for checked-out connections to come back.
    fn close(&self) -> impl Future<Output = ()> + Send;

    /// Whether the database answers a trivial query (the `database` readiness check).
    fn ping(&self) -> impl Future<Output = bool> + Send;
}

/// A validated save, ready to bind: the checkpoint as sent (its state was checked once, when
/// the request was decoded, and is bound as its text) and what the store derives from it.
#[derive(Debug, Clone)]
pub(crate) struct SaveRow {
    /// With a canonical id, `turn_id` and `attempt` together or neither, and a `base` only with
    /// a delta state.
    pub checkpoint: Checkpoint,
    /// `turn_id` and `attempt` of a fenced save.
    pub fence: Option<Fence>,
    /// The state's `from` when it is a step's delta.
    pub delta_from: Option<i64>,
    pub now: DateTime<Utc>,
}

impl SaveRow {
    /// The row as stored, with the timestamps the database gave it (the base, stored once per
    /// turn, is never in a reply).
    pub fn stored(self, created_at: String, updated_at: String) -> Checkpoint {
        Checkpoint {
            base: None,
            created_at: Some(created_at),
            updated_at: Some(updated_at),
            ..self.checkpoint
        }
    }
}

/// The fencing token of a save.
#[derive(Debug, Clone)]
pub(crate) struct Fence {
    pub turn_id: String,
    pub attempt: i64,
}

/// The lowest attempt a fenced save or read may carry: a job's first delivery (JetStream counts
/// a message's deliveries from 1, and a turn's first job has `attempt_base` 0). No attempt is
/// older, so a fenced read by it has no one to shut out: it reads without writing, refused only
/// when a newer attempt is recorded (`SqlStore::latest_of_turn`).
pub const FIRST_ATTEMPT: u32 = 1;

/// The fence of attempt `attempt` (checked) of turn `turn_id` (checked by the caller).
pub(crate) fn fence(turn_id: &str, attempt: u32) -> Result<Fence, StoreError> {
    if attempt < FIRST_ATTEMPT {
        return Err(StoreError::BadRequest(format!(
            "attempt must be at least {FIRST_ATTEMPT} (a job's first delivery)"
        )));
    }
    Ok(Fence {
        turn_id: turn_id.to_owned(),
        attempt: i64::from(attempt),
    })
}

/// Checks an owner key (`session` or `session#leg`).
pub(crate) fn check_owner(agent_id: &str) -> Result<(), StoreError> {
    validate_owner(agent_id).map_err(|e| StoreError::BadRequest(format!("agent_id: {e}")))
}

/// Checks a turn id: 1–128 characters of `[A-Za-z0-9_-]` like every other id.
pub(crate) fn check_turn_id(turn_id: &str) -> Result<(), StoreError> {
    let len = turn_id.chars().count();
    if len == 0 || len > MAX_ID_LEN || !turn_id.chars().all(ids::is_token_char) {
        return Err(StoreError::BadRequest(format!(
            "turn_id must be 1-{MAX_ID_LEN} characters of A-Z, a-z, 0-9, '_' and '-'"
        )));
    }
    Ok(())
}

/// Validates a save and serialises its state.
pub(crate) fn prepare_save(
    checkpoint: Checkpoint,
    now: DateTime<Utc>,
    max_state_bytes: usize,
) -> Result<SaveRow, StoreError> {
    check_owner(&checkpoint.agent_id)?;
    let fence = match (&checkpoint.turn_id, checkpoint.attempt) {
        (Some(turn_id), Some(attempt)) => {
            check_turn_id(turn_id)?;
            Some(fence(turn_id, attempt)?)
        }
        (None, None) => None,
        _ => {
            return Err(StoreError::BadRequest(
                "turn_id and attempt go together: give both for a fenced save, or neither".into(),
            ));
        }
    };
    let turn_id = fence.as_ref().map(|f| f.turn_id.as_str());
    let expected = checkpoint_id(&checkpoint.agent_id, turn_id, checkpoint.step);
    if checkpoint.id != expected {
        let shown: String = checkpoint.id.chars().take(300).collect();
        let shape = if turn_id.is_some() {
            "{agent_id}:{turn_id}:{step}"
        } else {
            "{agent_id}:{step}"
        };
        return Err(StoreError::BadRequest(format!(
            "id {shown:?} must be \"{shape}\", here {expected:?}"
        )));
    }
    // Stored as sent: decoding already checked it is one JSON object.
    let state = &checkpoint.state;
    for text in std::iter::once(state).chain(checkpoint.base.as_ref()) {
        if text.as_str().len() > max_state_bytes {
            return Err(StoreError::TooLarge {
                size: text.as_str().len(),
                max: max_state_bytes,
            });
        }
    }
    let from = delta_from(state.as_str())?;
    let delta = from.is_some();
    if (delta || checkpoint.base.is_some()) && fence.is_none() {
        return Err(StoreError::BadRequest(
            "a delta state (`from`) or a `base` belongs to a turn: give turn_id and attempt".into(),
        ));
    }
    if let Some(base) = &checkpoint.base {
        if !delta {
            return Err(StoreError::BadRequest(
                "a `base` goes with a delta state (`from`)".into(),
            ));
        }
        base.parse::<Window>().map_err(|e| {
            StoreError::BadRequest(format!("base must be {{\"messages\":[…]}}: {e}"))
        })?;
    }
    Ok(SaveRow {
        checkpoint,
        fence,
        delta_from: from.map(|f| i64::try_from(f).unwrap_or(i64::MAX)),
        now,
    })
}

/// Checks a row id, `{owner}:{turn_id}:{step}` or `{owner}:{step}`; only the canonical spelling
/// is accepted. Returns the owner and the step.
pub(crate) fn parse_id(id: &str) -> Result<(&str, u32), StoreError> {
    let bad = || {
        let shown: String = id.chars().take(300).collect();
        StoreError::BadRequest(format!(
            "id {shown:?} must be \"{{agent_id}}:{{turn_id}}:{{step}}\" or \"{{agent_id}}:{{step}}\""
        ))
    };
    let (rest, step) = id.rsplit_once(':').ok_or_else(bad)?;
    let step: u32 = step.parse().map_err(|_| bad())?;
    let (owner, turn) = match rest.split_once(':') {
        Some((owner, turn)) => {
            check_turn_id(turn).map_err(|_| bad())?;
            (owner, Some(turn))
        }
        None => (rest, None),
    };
    check_owner(owner)?;
    if checkpoint_id(owner, turn, step) != id {
        return Err(bad());
    }
    Ok((owner, step))
}

/// Checks the turn and attempt of a turn-scoped `latest`.
pub(crate) fn check_turn_read(agent_id: &str, turn_id: &str) -> Result<(), StoreError> {
    check_owner(agent_id)?;
    check_turn_id(turn_id)
}

/// Checks a progress request: its size (at most [`PROGRESS_MAX_TURNS`] turns, and at most
/// [`PROGRESS_MAX_TOOL_TURNS`] when it asks tool names) and every owner key and turn id.
pub(crate) fn check_progress(request: &ProgressRequest) -> Result<(), StoreError> {
    let most = match request.tool_names {
        true => PROGRESS_MAX_TOOL_TURNS,
        false => PROGRESS_MAX_TURNS,
    };
    if request.turns.len() > most {
        let with = if request.tool_names {
            " with tool_names"
        } else {
            ""
        };
        return Err(StoreError::BadRequest(format!(
            "progress names at most {most} turns{with}, here {}",
            request.turns.len()
        )));
    }
    for (i, turn) in request.turns.iter().enumerate() {
        check_turn_read(&turn.agent_id, &turn.turn_id).map_err(|e| match e {
            StoreError::BadRequest(why) => StoreError::BadRequest(format!("turns[{i}]: {why}")),
            other => other,
        })?;
    }
    Ok(())
}

/// The tools a turn's rows called, from their states in step order: the `tool_call` parts of
/// the delta rows' messages, in call order, each name once, at most [`PROGRESS_MAX_TOOLS`] of
/// at most [`PROGRESS_MAX_TOOL_NAME_CHARS`] characters. A full row (no `from`) is skipped: its
/// messages are the whole window, earlier turns' calls among them, and a loop worker never
/// writes one for a turn. A state that does not parse adds nothing.
pub(crate) fn tool_names(states: &[String]) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Row {
        #[serde(default)]
        from: Option<u64>,
        #[serde(default)]
        messages: Vec<RowMessage>,
    }
    #[derive(serde::Deserialize)]
    struct RowMessage {
        #[serde(default)]
        content: serde_json::Value,
    }
    let mut names: Vec<String> = Vec::new();
    for state in states {
        let Ok(row) = serde_json::from_str::<Row>(state) else {
            continue;
        };
        if row.from.is_none() {
            continue;
        }
        let parts = row.messages.iter().filter_map(|m| m.content.as_array());
        for part in parts.flatten() {
            let (Some("tool_call"), Some(name)) = (
                part.get("type").and_then(|t| t.as_str()),
                part.get("name").and_then(|n| n.as_str()),
            ) else {
                continue;
            };
            let name: String = name.chars().take(PROGRESS_MAX_TOOL_NAME_CHARS).collect();
            if !names.contains(&name) {
                names.push(name);
            }
            if names.len() == PROGRESS_MAX_TOOLS {
                return names;
            }
        }
    }
    names
}

/// The effective page size of a list: default 50, at least 1, at most 1000.
pub fn list_limit(limit: Option<u32>) -> Result<u32, StoreError> {
    match limit {
        None => Ok(LIST_DEFAULT_LIMIT),
        Some(0) => Err(StoreError::BadRequest("limit must be at least 1".into())),
        Some(n) => Ok(n.min(LIST_MAX_LIMIT)),
    }
}

/// Checks the owner and the cursor of a page.
pub(crate) fn check_page(agent_id: &str, before: Option<&str>) -> Result<(), StoreError> {
    check_owner(agent_id)?;
    match before {
        Some(id) if parse_id(id)?.0 != agent_id => Err(StoreError::BadRequest(format!(
            "before: {id:?} is not a checkpoint of {agent_id}"
        ))),
        _ => Ok(()),
    }
}

/// The answer to a cursor that names no row (deleted by retention since the last page).
pub(crate) fn cursor_gone(id: &str) -> StoreError {
    StoreError::NotFound(format!("before: no checkpoint {id} (deleted since?)"))
}

/// A validated retention request.
pub(crate) fn retain_mode(request: &RetainRequest) -> Result<RetainMode, StoreError> {
    request.mode().map_err(StoreError::BadRequest)
}

/// The cut-off instant of an `older_than_secs` retention.
pub(crate) fn cutoff(now: DateTime<Utc>, secs: u64) -> Result<DateTime<Utc>, StoreError> {
    i64::try_from(secs)
        .ok()
        .and_then(chrono::TimeDelta::try_seconds)
        .and_then(|age| now.checked_sub_signed(age))
        .ok_or_else(|| StoreError::BadRequest(format!("older_than_secs {secs} is out of range")))
}

/// RFC 3339 with exactly six fraction digits and `Z`: sortable as text, exact in PostgreSQL.
pub fn format_ts(ts: DateTime<Utc>) -> String {
    ts.format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// A row as read back, before its state text is parsed.
#[derive(Debug)]
pub(crate) struct RawRow {
    pub id: String,
    pub agent_id: String,
    pub step: i64,
    pub state: String,
    pub turn_id: Option<String>,
    pub attempt: Option<i64>,
    pub delta_from: Option<i64>,
    pub created_at: String,
    pub updated_at: String,
}

impl RawRow {
    /// The wire shape; a row that cannot be represented is a corrupt row (`internal`).
    pub fn into_checkpoint(self) -> Result<Checkpoint, StoreError> {
        let id = self.id;
        let corrupt = |what: &str| StoreError::Internal(format!("row {id:?}: {what}"));
        Ok(Checkpoint {
            step: u32::try_from(self.step).map_err(|_| corrupt("step out of range"))?,
            state: JsonObject::from_text(self.state)
                .map_err(|_| corrupt("state is not a JSON object"))?,
            attempt: match self.attempt {
                Some(a) => Some(u32::try_from(a).map_err(|_| corrupt("attempt out of range"))?),
                None => None,
            },
            id,
            agent_id: self.agent_id,
            turn_id: self.turn_id,
            base: None,
            created_at: Some(self.created_at),
            updated_at: Some(self.updated_at),
        })
    }
}

/// The part of a state the store reads: `from`, present when the state is a step's delta.
#[derive(serde::Deserialize)]
struct Shape {
    #[serde(default)]
    from: Option<u64>,
}

/// Where a delta state's messages start in the turn's window; `None` for a full snapshot.
pub(crate) fn delta_from(state: &str) -> Result<Option<u64>, StoreError> {
    // Only a state that names `from` can be a delta; most full snapshots skip the parse.
    if !state.contains("\"from\"") {
        return Ok(None);
    }
    serde_json::from_str::<Shape>(state)
        .map(|shape| shape.from)
        .map_err(|e| StoreError::BadRequest(format!("state.from must be a window position: {e}")))
}

/// A window as stored: a base (`{"messages":[…]}`) or a row's messages, kept as their JSON.
#[derive(serde::Deserialize)]
struct Window {
    #[serde(default)]
    messages: Vec<Box<serde_json::value::RawValue>>,
}

/// Rebuilds the full snapshot of a delta row (docs/checkpoint-store.md, "Incremental
/// checkpoints"): the turn's `base`, then every row of the turn up to and including `target`, in
/// step order — a full row (no `from`) replaces the window, a delta cuts it at `from` and appends
/// its messages. The result has the shape of a full snapshot: `from` is gone, `messages` is the
/// whole window.
pub(crate) fn assemble(
    target: RawRow,
    base: Option<&str>,
    chain: &[String],
) -> Result<Checkpoint, StoreError> {
    let corrupt = |what: String| StoreError::Internal(format!("row {:?}: {what}", target.id));
    let mut window: Vec<Box<serde_json::value::RawValue>> = match base {
        Some(text) => {
            serde_json::from_str::<Window>(text)
                .map_err(|e| corrupt(format!("base: {e}")))?
                .messages
        }
        None => Vec::new(),
    };
    #[derive(serde::Deserialize)]
    struct Link {
        #[serde(default)]
        from: Option<usize>,
        #[serde(default)]
        messages: Vec<Box<serde_json::value::RawValue>>,
    }
    for text in chain {
        let link: Link = serde_json::from_str(text).map_err(|e| corrupt(format!("chain: {e}")))?;
        match link.from {
            None => window = link.messages,
            Some(from) if from <= window.len() => {
                window.truncate(from);
                window.extend(link.messages);
            }
            Some(from) => {
                return Err(corrupt(format!(
                    "a delta from {from} follows a window of {} messages (its base or an earlier \
                     step is missing)",
                    window.len()
                )));
            }
        }
    }
    let mut state: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&target.state).map_err(|e| corrupt(format!("state: {e}")))?;
    state.remove("from");
    state.remove("messages");
    let messages =
        serde_json::value::to_raw_value(&window).map_err(|e| corrupt(format!("window: {e}")))?;
    // `messages` goes in as its text: a map of values would parse the whole window again.
    let mut text = serde_json::to_string(&state).map_err(|e| corrupt(format!("state: {e}")))?;
    text.pop();
    if !state.is_empty() {
        text.push(',');
    }
    text.push_str("\"messages\":");
    text.push_str(messages.get());
    text.push('}');
    RawRow {
        state: text,
        ..target
    }
    .into_checkpoint()
}

/// A row as the reads give it: a delta row is rebuilt into its full snapshot from the turn's
/// base and earlier rows, which `load(agent_id, turn_id, step)` fetches (base, then every row's
/// state up to `step` in step order); a full row is given as stored.
pub(crate) async fn full<F, Fut>(raw: RawRow, load: F) -> Result<Checkpoint, StoreError>
where
    F: FnOnce(String, String, i64) -> Fut,
    Fut: Future<Output = Result<(Option<String>, Vec<String>), StoreError>>,
{
    match (&raw.turn_id, raw.delta_from) {
        (Some(turn), Some(_)) => {
            let (base, chain) = load(raw.agent_id.clone(), turn.clone(), raw.step).await?;
            assemble(raw, base.as_deref(), &chain)
        }
        _ => raw.into_checkpoint(),
    }
}

/// The refusal of a fenced-off save.
pub(crate) fn fenced(fence: &Fence, recorded: i64) -> StoreError {
    StoreError::Conflict(format!(
        "turn {} attempt {} is fenced off: attempt {recorded} has already written",
        fence.turn_id, fence.attempt
    ))
}

/// The refusal of a read that found nothing.
pub(crate) fn no_checkpoint(what: &str) -> StoreError {
    StoreError::NotFound(format!("no checkpoint for {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::ErrorCode;
    use serde_json::json;

    fn cp(id: &str, agent: &str, step: u32) -> Checkpoint {
        Checkpoint {
            id: id.into(),
            agent_id: agent.into(),
            step,
            state: JsonObject::empty(),
            turn_id: None,
            attempt: None,
            base: None,
            created_at: None,
            updated_at: None,
        }
    }

    #[test]
    fn save_checks_owner_id_fence_and_size() {
        let now = Utc::now();
        assert!(prepare_save(cp("s1#a:3", "s1#a", 3), now, 10).is_ok());
        let mut turn = cp("s1:t1:3", "s1", 3);
        turn.turn_id = Some("t1".into());
        turn.attempt = Some(1);
        assert!(prepare_save(turn.clone(), now, 10).is_ok());
        turn.id = "s1:3".into();
        let err = prepare_save(turn, now, 10).unwrap_err();
        assert!(err.to_string().contains("s1:t1:3"), "{err}");
        for bad in [
            cp("s1:4", "s1", 3),
            cp("s.1.2:3", "s.1.2", 3),
            cp("s.:3", "s.", 3),
            cp("s1#:3", "s1#", 3),
        ] {
            let err = prepare_save(bad, now, 10).unwrap_err();
            assert_eq!(err.code(), ErrorCode::BadRequest, "{err}");
        }
        let mut half = cp("s1:1", "s1", 1);
        half.attempt = Some(2);
        assert_eq!(
            prepare_save(half, now, 10).unwrap_err().code(),
            ErrorCode::BadRequest
        );
        let mut bad_turn = cp("s1:1", "s1", 1);
        bad_turn.turn_id = Some("t.1".into());
        bad_turn.attempt = Some(1);
        assert_eq!(
            prepare_save(bad_turn, now, 10).unwrap_err().code(),
            ErrorCode::BadRequest
        );
        let mut big = cp("s1:1", "s1", 1);
        big.state = JsonObject::encode(&json!({"k": "0123456789"})).unwrap();
        let err = prepare_save(big, now, 10).unwrap_err();
        assert_eq!(err.code(), ErrorCode::TooLarge);
        assert!(err.to_string().contains("limit is 10"), "{err}");
    }

    #[test]
    fn ids_must_be_canonical() {
        assert_eq!(parse_id("s1#leg:12").unwrap(), ("s1#leg", 12));
        assert_eq!(parse_id("s1#leg:t-1:12").unwrap(), ("s1#leg", 12));
        assert_eq!(parse_id("s1:3:4").unwrap(), ("s1", 4));
        // a person's session (docs/security.md, "People")
        assert_eq!(parse_id("alice.s1#l:t:4").unwrap(), ("alice.s1#l", 4));
        for bad in [
            "s1", "s1:", ":3", "s1:03", "s1:-1", "s1:x", "s.1.2:3", ".s1:3", "s1::4", "s1:t.1:4",
            "s1:t:1:4", ":t:4", "s1:t:04",
        ] {
            assert!(parse_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn list_limit_defaults_and_clamps() {
        assert_eq!(list_limit(None).unwrap(), 50);
        assert!(check_page("s1", Some("s1:t:3")).is_ok());
        assert!(check_page("s1", Some("s2:t:3")).is_err());
        assert!(check_page("s1", Some("s1")).is_err());
        assert_eq!(list_limit(Some(7)).unwrap(), 7);
        assert_eq!(list_limit(Some(5000)).unwrap(), 1000);
        assert!(list_limit(Some(0)).is_err());
    }

    #[test]
    fn timestamps_sort_as_text() {
        let a = DateTime::parse_from_rfc3339("2026-01-01T00:00:09Z").unwrap();
        let b = DateTime::parse_from_rfc3339("2026-01-01T00:00:10.5Z").unwrap();
        let (a, b) = (format_ts(a.to_utc()), format_ts(b.to_utc()));
        assert_eq!(a, "2026-01-01T00:00:09.000000Z");
        assert!(a < b);
        assert!(cutoff(Utc::now(), u64::MAX).is_err());
    }

    /// A row of messages whose assistant message calls `names`.
    fn calls(from: Option<u64>, names: &[&str]) -> String {
        let parts: Vec<serde_json::Value> = names
            .iter()
            .map(|n| serde_json::json!({"type": "tool_call", "id": "c", "name": n, "args": {}}))
            .collect();
        let mut row = serde_json::json!({"messages": [{"role": "assistant", "content": parts}]});
        if let Some(from) = from {
            row["from"] = from.into();
        }
        row.to_string()
    }

    #[test]
    fn tool_names_come_from_delta_rows_in_call_order_each_once_and_bounded() {
        let rows = [
            calls(Some(1), &["search", "read"]),
            // a full row holds the whole window, earlier turns' calls among them
            calls(None, &["older"]),
            "not json".to_owned(),
            r#"{"from":3,"messages":[{"role":"assistant","content":"text only"},
                {"role":"tool","content":[{"type":"tool_result","name":"result"}]},
                {"role":"assistant","content":[{"type":"tool_call","name":7}]}]}"#
                .to_owned(),
            calls(Some(5), &["search", "fetch"]),
        ];
        assert_eq!(tool_names(&rows), ["search", "read", "fetch"]);
        let long = "名".repeat(1000);
        let many: Vec<String> = (0..40).map(|i| format!("{i}{long}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let names = tool_names(&[calls(Some(1), &many)]);
        assert_eq!(names.len(), PROGRESS_MAX_TOOLS);
        assert!(
            names
                .iter()
                .all(|n| n.chars().count() == PROGRESS_MAX_TOOL_NAME_CHARS)
        );
        assert_eq!(names[0], format!("0{}", "名".repeat(63)));
    }
}
