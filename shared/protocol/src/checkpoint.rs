//! `cyrene.checkpoint.*` shapes (docs/architecture.md §3, §5, §9;
//! docs/semantics.md#checkpoints-and-resume).
//!
//! The owner key (`agent_id`) is the session id for a single leg and `{session}#{leg}` for a true
//! parallel leg, so two legs never see each other's rows.
//!
//! A row written by a turn (a fenced save, carrying `turn_id` and `attempt`) has the id
//! `{owner}:{turn_id}:{step}`, so the turns of one owner never overwrite or mask each other; an
//! unfenced save keeps `{owner}:{step}`. `latest` is the owner's most recently *written* row, and
//! can be narrowed to one turn (docs/checkpoint-store.md).

use crate::ids::{self, IdError, IdKind};
use crate::json::JsonObject;
use crate::message::Message;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;

/// One per-step snapshot as saved and returned.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub id: String,
    pub agent_id: String,
    pub step: u32,
    /// A JSON object, carried as text; see [`CheckpointState`] for what the loop worker puts
    /// there.
    pub state: JsonObject,
    /// Fencing: the turn that wrote it …
    pub turn_id: Option<String>,
    /// … and that turn's delivery attempt, from 1; older attempts are refused once a newer one
    /// wrote.
    pub attempt: Option<u32>,
    /// Only in a fenced save whose `state` is a step's delta: the turn's base window
    /// (`{"messages":[…]}`), stored once per turn; never in a reply (docs/checkpoint-store.md,
    /// "Incremental checkpoints").
    pub base: Option<JsonObject>,
    /// RFC 3339, set by the store.
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
}

impl Checkpoint {
    /// An unfenced save of `agent_id`'s `state` at `step`, as a caller sends it: id
    /// [`checkpoint_id`]`(agent_id, None, step)`, no fence, no base, no timestamps.
    pub fn unfenced(agent_id: &str, step: u32, state: JsonObject) -> Self {
        Checkpoint {
            id: checkpoint_id(agent_id, None, step),
            agent_id: agent_id.to_owned(),
            step,
            state,
            turn_id: None,
            attempt: None,
            base: None,
            created_at: None,
            updated_at: None,
        }
    }
}

/// What the loop worker saves after every step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointState {
    pub step: u32,
    pub messages: Vec<Message>,
    /// The loop's own stop reason (docs/loop-worker.md): only `tool_calls` is resumable.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stop_reason: String,
    /// The provider's raw finish reason of the answering call (`stop`, `length`, `end_turn`,
    /// even `tool_calls` from a provider that says so without calls), kept beside the loop's
    /// `stop_reason` for reading only: it never decides a resume.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub finish_reason: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub turn_id: String,
    /// The ids of the messages steered into the turn so far (they live only in the view, never in
    /// `messages`), so a settled turn can be reported again exactly as it ended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steered_ids: Vec<String>,
    /// Why the turn's guard ended it (stop reason `guardrail`): the guard's own reason, or why
    /// the guard failed (docs/loop-worker.md, "Guardrails"). For operators: it never reaches the
    /// person, and it never decides a resume.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub guard_reason: String,
    /// The call ids of the row's tool batch that were never sent: they waited for a person's
    /// approval (stop reason `awaiting_approval`, docs/reliability.md, "Approval"). Any other
    /// call of a started batch without a result may have run.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unsent: Vec<String>,
}

/// [`CheckpointState`] borrowed: encodes to the same JSON without copying the window. With
/// `from`, it is a step's *delta*: `messages` are the window's messages from position `from` on,
/// and the store rebuilds the full window from the turn's base and its earlier rows.
#[skip_serializing_none]
#[derive(Debug, Clone, Copy, Serialize)]
pub struct CheckpointStateRef<'a> {
    pub step: u32,
    pub from: Option<usize>,
    pub messages: &'a [Message],
    #[serde(skip_serializing_if = "str::is_empty")]
    pub stop_reason: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub finish_reason: &'a str,
    #[serde(skip_serializing_if = "str::is_empty")]
    pub turn_id: &'a str,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    pub steered_ids: &'a [String],
    #[serde(skip_serializing_if = "str::is_empty")]
    pub guard_reason: &'a str,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    pub unsent: &'a [String],
}

/// `cyrene.checkpoint.latest` request.
///
/// Without `turn_id`: the owner's most recently written checkpoint. With `turn_id`: the most
/// recently written checkpoint of that turn. With `turn_id` and `attempt` (a *fenced read*, what
/// a loop worker does before it runs a delivery): the store first records `attempt` as the turn's
/// newest, so no older attempt can write after the read, and answers `conflict` when a newer
/// attempt already has. Attempts count from 1; the first has no older one to shut out, so its read
/// records nothing.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LatestRequest {
    pub agent_id: String,
    pub turn_id: Option<String>,
    pub attempt: Option<u32>,
}

impl LatestRequest {
    /// The owner's most recently written checkpoint.
    pub fn owner(agent_id: impl Into<String>) -> Self {
        LatestRequest {
            agent_id: agent_id.into(),
            ..LatestRequest::default()
        }
    }
}

/// `cyrene.checkpoint.get` request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetRequest {
    pub id: String,
}

/// `cyrene.checkpoint.list` request (most recently written first).
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    pub agent_id: String,
    pub limit: Option<u32>,
    /// Continue a listing: only rows written before the row with this id (a previous page's
    /// `next_before`).
    pub before: Option<String>,
}

/// `cyrene.checkpoint.list` default page size when `limit` is absent.
pub const LIST_DEFAULT_LIMIT: u32 = 50;
/// `cyrene.checkpoint.list` largest page; a larger `limit` is clamped to it.
pub const LIST_MAX_LIMIT: u32 = 1000;

/// `cyrene.checkpoint.list` reply: most recently written first. A page holds at most `limit`
/// rows and at most what the bus carries in one message; `next_before` is set when more rows
/// follow (pass it as `before` for the next page).
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListResponse {
    pub checkpoints: Vec<Checkpoint>,
    pub next_before: Option<String>,
}

/// `cyrene.checkpoint.retain` request: one of two explicit retention operations.
///
/// - `{"agent_id":"s1","keep_last":10}`: keep the `keep_last` most recently written rows of that
///   owner, delete the rest (`keep_last: 0` deletes every row of the owner);
/// - `{"older_than_secs":86400}`: delete every row of each owner whose newest row was last
///   written more than that long ago.
///
/// Any other combination is a `bad_request`; see [`RetainRequest::mode`].
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetainRequest {
    pub agent_id: Option<String>,
    pub keep_last: Option<u32>,
    pub older_than_secs: Option<u64>,
}

/// What a [`RetainRequest`] asks for, once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RetainMode {
    /// Keep the `keep_last` most recently written rows of `agent_id`.
    KeepLast { agent_id: String, keep_last: u32 },
    /// Drop owners whose newest row is older than this many seconds.
    OlderThan { secs: u64 },
}

impl RetainRequest {
    /// Keep the newest `keep_last` steps of `agent_id`.
    pub fn keep_last(agent_id: impl Into<String>, keep_last: u32) -> Self {
        RetainRequest {
            agent_id: Some(agent_id.into()),
            keep_last: Some(keep_last),
            older_than_secs: None,
        }
    }

    /// Drop owners whose newest row is older than `secs` seconds.
    pub fn older_than(secs: u64) -> Self {
        RetainRequest {
            older_than_secs: Some(secs),
            ..RetainRequest::default()
        }
    }

    /// The operation asked for; the owner key is validated too. The error is a human message.
    pub fn mode(&self) -> Result<RetainMode, String> {
        match (&self.agent_id, self.keep_last, self.older_than_secs) {
            (Some(agent_id), Some(keep_last), None) => {
                validate_owner(agent_id).map_err(|e| format!("agent_id: {e}"))?;
                Ok(RetainMode::KeepLast {
                    agent_id: agent_id.clone(),
                    keep_last,
                })
            }
            (None, None, Some(secs)) => Ok(RetainMode::OlderThan { secs }),
            _ => Err(
                "retain takes either {\"agent_id\",\"keep_last\"} or {\"older_than_secs\"}".into(),
            ),
        }
    }
}

/// `cyrene.checkpoint.retain` reply: how many checkpoint rows were deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RetainResponse {
    pub deleted: u64,
}

/// `cyrene.checkpoint.progress` request: how far some turns have got, as of their last saved
/// step (docs/checkpoint-store.md, "Progress of running turns"). The orchestrator asks it to
/// build a parallel leg's notice and the `step` of `cyrene.turns.running`.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProgressRequest {
    /// At most [`PROGRESS_MAX_TURNS`] turns, each named by its owner key and turn id.
    pub turns: Vec<TurnRef>,
    /// Also name the tools each turn has called (then at most [`PROGRESS_MAX_TOOL_TURNS`]
    /// turns): every row of the turn is read, not only its newest step.
    #[serde(default)]
    pub tool_names: bool,
}

/// One turn of one owner.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TurnRef {
    pub agent_id: String,
    pub turn_id: String,
}

impl TurnRef {
    /// Turn `turn_id` of a session's leg (`leg_id` empty: its main line), under its owner key.
    pub fn of_leg(session_id: &str, leg_id: &str, turn_id: impl Into<String>) -> TurnRef {
        TurnRef {
            agent_id: owner_key(session_id, Some(leg_id)),
            turn_id: turn_id.into(),
        }
    }
}

/// The most turns one progress request names.
pub const PROGRESS_MAX_TURNS: usize = 1000;
/// The most turns one progress request may ask tool names of.
pub const PROGRESS_MAX_TOOL_TURNS: usize = 16;
/// The most tool names a turn's progress gives (the first ones called).
pub const PROGRESS_MAX_TOOLS: usize = 16;
/// The longest tool name a turn's progress gives, in characters (a model names the tools it
/// calls; a longer name is cut).
pub const PROGRESS_MAX_TOOL_NAME_CHARS: usize = 64;

/// `cyrene.checkpoint.progress` reply: one entry for each turn asked, in the order asked.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ProgressResponse {
    pub turns: Vec<TurnProgress>,
}

/// How far one turn has got: metadata only, never any text of the turn.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TurnProgress {
    pub agent_id: String,
    pub turn_id: String,
    /// The highest step saved (0: none yet).
    pub step: u32,
    /// With `tool_names`: the tools the turn's saved steps called, in call order, each once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_names: Vec<String>,
}

/// The owner key for a session and an optional parallel leg.
pub fn owner_key(session_id: &str, leg_id: Option<&str>) -> String {
    match leg_id {
        Some(leg) if !leg.is_empty() => format!("{session_id}#{leg}"),
        _ => session_id.to_owned(),
    }
}

/// The row id of an owner's step: `{owner}:{turn_id}:{step}` for a turn's (fenced) save,
/// `{owner}:{step}` for an unfenced one.
pub fn checkpoint_id(owner: &str, turn_id: Option<&str>, step: u32) -> String {
    match turn_id {
        Some(turn) => format!("{owner}:{turn}:{step}"),
        None => format!("{owner}:{step}"),
    }
}

/// The person whose session an owner key (`session` or `session#leg`) or a checkpoint id
/// (`{owner}:…`) belongs to: `alice` for `alice.s1#l1:3`; `None` for a session of nobody in
/// particular.
pub fn owner_person(owner_or_id: &str) -> Option<&str> {
    let owner = owner_or_id.split(':').next().unwrap_or_default();
    let session = owner.split('#').next().unwrap_or_default();
    ids::session_person(session)
}

/// Validates an owner key: `session` or `session#leg`, each part a valid id.
pub fn validate_owner(owner: &str) -> Result<(), IdError> {
    match owner.split_once('#') {
        Some((session, leg)) => {
            ids::validate(IdKind::Session, session)?;
            ids::validate(IdKind::Leg, leg)
        }
        None => ids::validate(IdKind::Session, owner),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::Role;
    use serde_json::json;

    #[test]
    fn save_body_matches_design() {
        let state = CheckpointState {
            step: 3,
            messages: vec![Message::text(Role::User, "hi")],
            stop_reason: "tool_calls".into(),
            finish_reason: String::new(),
            turn_id: "t1".into(),
            steered_ids: vec![],
            guard_reason: String::new(),
            unsent: vec!["c2".into()],
        };
        let borrowed = CheckpointStateRef {
            step: state.step,
            from: None,
            messages: &state.messages,
            stop_reason: &state.stop_reason,
            finish_reason: &state.finish_reason,
            turn_id: &state.turn_id,
            steered_ids: &state.steered_ids,
            guard_reason: &state.guard_reason,
            unsent: &state.unsent,
        };
        assert_eq!(
            serde_json::to_value(borrowed).unwrap(),
            serde_json::to_value(&state).unwrap()
        );
        let state = JsonObject::encode(&borrowed).unwrap();
        let cp = Checkpoint::unfenced("s1", 3, state);
        let doc = json!({"id":"s1:3","agent_id":"s1","step":3,"state":{"step":3,"messages":[
            {"role":"user","content":[{"type":"text","text":"hi"}]}],"stop_reason":"tool_calls",
            "turn_id":"t1","unsent":["c2"]}});
        assert_eq!(serde_json::to_value(&cp).unwrap(), doc);
        assert_eq!(serde_json::from_value::<Checkpoint>(doc).unwrap(), cp);
    }

    #[test]
    fn state_must_be_an_object() {
        let err = serde_json::from_value::<Checkpoint>(
            json!({"id":"s1:1","agent_id":"s1","step":1,"state":[1]}),
        );
        assert!(err.is_err());
    }

    #[test]
    fn requests_match_design() {
        let l: LatestRequest = serde_json::from_value(json!({"agent_id":"s1"})).unwrap();
        assert_eq!(l, LatestRequest::owner("s1"));
        assert_eq!(serde_json::to_value(&l).unwrap(), json!({"agent_id":"s1"}));
        let fenced = json!({"agent_id":"s1","turn_id":"t1","attempt":2});
        let l: LatestRequest = serde_json::from_value(fenced.clone()).unwrap();
        assert_eq!(l.turn_id.as_deref(), Some("t1"));
        assert_eq!(l.attempt, Some(2));
        assert_eq!(serde_json::to_value(&l).unwrap(), fenced);
        let g: GetRequest = serde_json::from_value(json!({"id":"s1:3"})).unwrap();
        assert_eq!(serde_json::to_value(&g).unwrap(), json!({"id":"s1:3"}));
        let doc = json!({"agent_id":"s1","limit":50});
        let li: ListRequest = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(serde_json::to_value(&li).unwrap(), doc);
    }

    #[test]
    fn list_and_retain_shapes_round_trip() {
        let doc = json!({"checkpoints":[{"id":"s1:2","agent_id":"s1","step":2,"state":{},
            "turn_id":"t1","attempt":2,"created_at":"2026-01-01T00:00:00.000000Z",
            "updated_at":"2026-01-01T00:00:01.000000Z"}]});
        let list: ListResponse = serde_json::from_value(doc.clone()).unwrap();
        assert_eq!(list.checkpoints[0].attempt, Some(2));
        assert_eq!(serde_json::to_value(&list).unwrap(), doc);

        let keep = json!({"agent_id":"s1","keep_last":10});
        let r: RetainRequest = serde_json::from_value(keep.clone()).unwrap();
        assert_eq!(r, RetainRequest::keep_last("s1", 10));
        assert_eq!(serde_json::to_value(&r).unwrap(), keep);
        assert_eq!(
            r.mode().unwrap(),
            RetainMode::KeepLast {
                agent_id: "s1".into(),
                keep_last: 10
            }
        );
        let age = json!({"older_than_secs":86400});
        let r: RetainRequest = serde_json::from_value(age.clone()).unwrap();
        assert_eq!(r, RetainRequest::older_than(86400));
        assert_eq!(serde_json::to_value(&r).unwrap(), age);
        assert_eq!(r.mode().unwrap(), RetainMode::OlderThan { secs: 86400 });

        let resp = json!({"deleted":3});
        let d: RetainResponse = serde_json::from_value(resp.clone()).unwrap();
        assert_eq!(d.deleted, 3);
        assert_eq!(serde_json::to_value(d).unwrap(), resp);
    }

    #[test]
    fn retain_refuses_mixed_or_partial_modes() {
        for bad in [
            json!({}),
            json!({"agent_id":"s1"}),
            json!({"keep_last":3}),
            json!({"agent_id":"s1","keep_last":3,"older_than_secs":5}),
            json!({"agent_id":"s1","older_than_secs":5}),
            json!({"agent_id":"s.1.2","keep_last":3}),
        ] {
            let r: RetainRequest = serde_json::from_value(bad.clone()).unwrap();
            assert!(r.mode().is_err(), "{bad}");
        }
        assert!(serde_json::from_value::<RetainRequest>(json!({"keep":1})).is_err());
    }

    #[test]
    fn turn_rows_have_their_own_ids() {
        assert_eq!(checkpoint_id("s1", Some("t1"), 3), "s1:t1:3");
        assert_eq!(checkpoint_id("s1#a", Some("t1"), 3), "s1#a:t1:3");
        assert_eq!(checkpoint_id("s1", None, 3), "s1:3");
        assert_ne!(
            checkpoint_id("s1", Some("t1"), 1),
            checkpoint_id("s1", Some("t2"), 1)
        );
    }

    #[test]
    fn the_person_of_an_owner_or_a_checkpoint_is_its_session_s() {
        // A session of alice's, a leg of it and a checkpoint of that leg.
        for key in ["alice.s1", "alice.s1#l1", "alice.s1#l1:t1:3"] {
            assert_eq!(owner_person(key), Some("alice"), "owner_person({key:?})");
        }
        for key in ["s1#l1:3", ""] {
            assert_eq!(owner_person(key), None, "owner_person({key:?})");
        }
    }

    #[test]
    fn owner_keys_separate_legs() {
        assert_eq!(owner_key("s1", None), "s1");
        assert_eq!(owner_key("s1", Some("leg2")), "s1#leg2");
        assert!(validate_owner("s1#leg2").is_ok());
        assert!(validate_owner("s1").is_ok());
        assert!(validate_owner("s1#").is_err());
        assert!(validate_owner("alice.s1#leg2").is_ok());
        assert!(validate_owner("s.1.2").is_err());
        assert!(validate_owner("s1#a.b").is_err());
        assert!(validate_owner("s1#a#b").is_err());
    }
}
