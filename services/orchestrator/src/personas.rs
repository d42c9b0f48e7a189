//! The personas the orchestrator answers as (docs/architecture.md §9,
//! `CYRENE_ORCHESTRATOR_PERSONAS`): the config file shape, its validation, and the built-in
//! default used when no file is given.
//!
//! # Invariants
//! - Persona ids are valid agent ids (`[A-Za-z0-9_-]`, 1–128 chars) and unique; the default
//!   persona is one of them. So an id can be used as a subject token and in the ask session ids
//!   `ask-<id>-…` as is.
//! - A persona's `guard` is a subject `cyrene.guard.<name>` without wildcards
//!   (`cyrene_protocol::subjects::guard`), so NATS permissions can let the loop worker publish
//!   only there; the other `guard_*` fields are refused without it.

use cyrene_protocol::approval;
use cyrene_protocol::guard::{self, GuardFail, GuardSpec};
use cyrene_protocol::ids::{self, IdKind};
use cyrene_protocol::subjects;
use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;
use std::collections::BTreeMap;
use std::path::Path;

/// The id of the built-in persona.
pub const BUILTIN_PERSONA_ID: &str = "cyrene";
/// The display name of the built-in persona.
pub const BUILTIN_PERSONA_NAME: &str = "昔涟";
const BUILTIN_INSTRUCTIONS: &str = "You are Cyrene (昔涟), a warm and thoughtful companion. \
Answer in the language the user writes in. Be concise, honest about what you do not know, and \
use the tools you are given when they help.";

/// One persona: who answers, under which name, with which system prompt.
#[skip_serializing_none]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Persona {
    /// The persona id: the agent id on the comm protocol and the `sender_name` of its answers.
    pub id: String,
    /// The display name used in attribution labels `「name」（id）`.
    pub name: String,
    /// The system prompt (the first system message of every view).
    #[serde(default)]
    pub instructions: String,
    /// Whether the persona's ask session is restricted (its askers are treated as strangers:
    /// `env.restricted = true` on the turns it runs for asks).
    #[serde(default)]
    pub restricted: bool,
    /// The tools its turns may offer and call (built-in or discovered tool names): absent =
    /// every tool; a list = only those (`[]` = none). Sent as the turn job's `tools`; the loop
    /// worker refuses a call outside it with an `is_error` result.
    pub tools: Option<Vec<String>>,
    /// How long one of its turns may run, in milliseconds from the turn's creation: absent = no
    /// limit. Sent as the turn job's `deadline_unix_ms`.
    pub turn_timeout_ms: Option<u64>,
    /// Whether memory extraction runs after its turns (docs/memory.md, "Memory she gathers
    /// herself"): absent = on for the default persona, off for the others.
    pub memory_extraction: Option<bool>,
    /// The model the extraction asks (the gateway's explicit model route); absent = the
    /// persona's own chain.
    pub memory_model: Option<String>,
    /// Its guard (docs/loop-worker.md, "Guardrails"): the subject `cyrene.guard.<name>` the loop
    /// worker asks before each tool call runs and before each answer is sent. Absent = no guard.
    pub guard: Option<String>,
    /// How long the worker waits for the guard's reply, in milliseconds (default 2000, at most
    /// 30000).
    pub guard_timeout_ms: Option<u64>,
    /// What a guard that is down, slow or malformed means: `closed` (default: the turn ends as
    /// a deny would) or `open` (the call runs, the answer is sent).
    pub guard_fail: Option<GuardFail>,
    /// What the person is told when the guard ends the turn (a deny, or a closed failure); the
    /// guard's own reason never reaches the person.
    pub guard_message: Option<String>,
    /// Tools whose every call waits for a person's decision before it runs (docs/reliability.md,
    /// "Approval"): exact tool names. Sent as the turn job's `approval`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub approval: Vec<String>,
    /// How long a call waits for that decision, in milliseconds, before it is denied by itself
    /// (default 24 h, 1000 ms to 30 days).
    pub approval_timeout_ms: Option<u64>,
}

impl Persona {
    /// The guard its turn jobs carry, when it names one.
    pub fn guard_spec(&self) -> Option<GuardSpec> {
        let subject = self.guard.clone()?;
        Some(GuardSpec {
            subject,
            timeout_ms: self
                .guard_timeout_ms
                .unwrap_or(guard::DEFAULT_GUARD_TIMEOUT_MS),
            fail: self.guard_fail.unwrap_or_default(),
            message: self
                .guard_message
                .clone()
                .unwrap_or_else(|| guard::DEFAULT_GUARD_MESSAGE.to_owned()),
        })
    }

    /// How long one of its calls waits for a decision.
    pub fn approval_timeout(&self) -> u64 {
        self.approval_timeout_ms
            .unwrap_or(approval::DEFAULT_APPROVAL_TIMEOUT_MS)
    }

    /// The approval fields' problems.
    fn check_approval(&self) -> Result<(), String> {
        for tool in &self.approval {
            ids::validate(IdKind::Tool, tool).map_err(|e| format!("approval: {e}"))?;
        }
        if let Some(ms) = self.approval_timeout_ms
            && !(approval::MIN_APPROVAL_TIMEOUT_MS..=approval::MAX_APPROVAL_TIMEOUT_MS)
                .contains(&ms)
        {
            return Err(format!(
                "approval_timeout_ms must be {} to {}",
                approval::MIN_APPROVAL_TIMEOUT_MS,
                approval::MAX_APPROVAL_TIMEOUT_MS
            ));
        }
        Ok(())
    }

    /// The guard fields' problems.
    fn check_guard(&self) -> Result<(), String> {
        let Some(subject) = &self.guard else {
            let stray = self.guard_timeout_ms.is_some()
                || self.guard_fail.is_some()
                || self.guard_message.is_some();
            return match stray {
                true => Err("guard_timeout_ms, guard_fail and guard_message need a guard".into()),
                false => Ok(()),
            };
        };
        if !subjects::is_guard(subject) {
            return Err(format!(
                "guard {subject:?} is not a subject cyrene.guard.<name> (1 to {} tokens of \
                 A-Z, a-z, 0-9, '_' and '-'; no wildcards)",
                subjects::MAX_GUARD_NAME_TOKENS
            ));
        }
        if let Some(ms) = self.guard_timeout_ms
            && !(1..=guard::MAX_GUARD_TIMEOUT_MS).contains(&ms)
        {
            return Err(format!(
                "guard_timeout_ms must be 1 to {}",
                guard::MAX_GUARD_TIMEOUT_MS
            ));
        }
        if let Some(message) = &self.guard_message {
            if message.trim().is_empty() {
                return Err("guard_message is empty".into());
            }
            if message.len() > guard::MAX_GUARD_MESSAGE_BYTES {
                return Err(format!(
                    "guard_message is longer than {} bytes",
                    guard::MAX_GUARD_MESSAGE_BYTES
                ));
            }
        }
        Ok(())
    }
}

/// The `CYRENE_ORCHESTRATOR_PERSONAS` document: `{"default":"cyrene","personas":[…]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Personas {
    /// The persona answering sessions whose env names none.
    pub default: String,
    pub personas: Vec<Persona>,
}

/// Why a personas document was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("personas: {0}")]
pub struct PersonasError(pub String);

impl Default for Personas {
    fn default() -> Self {
        Personas::builtin()
    }
}

impl Personas {
    /// The built-in configuration: one persona, `cyrene` / 昔涟.
    pub fn builtin() -> Personas {
        Personas {
            default: BUILTIN_PERSONA_ID.to_owned(),
            personas: vec![Persona {
                id: BUILTIN_PERSONA_ID.to_owned(),
                name: BUILTIN_PERSONA_NAME.to_owned(),
                instructions: BUILTIN_INSTRUCTIONS.to_owned(),
                restricted: false,
                ..Default::default()
            }],
        }
    }

    /// Parses and validates a JSON document.
    pub fn from_json(text: &str) -> Result<Personas, PersonasError> {
        let personas: Personas =
            serde_json::from_str(text).map_err(|e| PersonasError(e.to_string()))?;
        personas.validate()?;
        Ok(personas)
    }

    /// Reads, parses and validates a JSON file.
    pub fn load(path: &Path) -> Result<Personas, PersonasError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PersonasError(format!("cannot read {}: {e}", path.display())))?;
        Personas::from_json(&text)
    }

    /// Checks ids, uniqueness and the default.
    pub fn validate(&self) -> Result<(), PersonasError> {
        if self.personas.is_empty() {
            return Err(PersonasError("at least one persona is required".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for p in &self.personas {
            ids::validate(IdKind::Agent, &p.id).map_err(|e| PersonasError(e.to_string()))?;
            if !seen.insert(p.id.as_str()) {
                return Err(PersonasError(format!("persona {:?} is listed twice", p.id)));
            }
            if p.name.trim().is_empty() {
                return Err(PersonasError(format!("persona {:?} has no name", p.id)));
            }
            for tool in p.tools.iter().flatten() {
                ids::validate(IdKind::Tool, tool)
                    .map_err(|e| PersonasError(format!("persona {:?}: tools: {e}", p.id)))?;
            }
            if p.memory_model
                .as_deref()
                .is_some_and(|m| m.trim().is_empty())
            {
                return Err(PersonasError(format!(
                    "persona {:?}: memory_model must name a model",
                    p.id
                )));
            }
            p.check_guard()
                .and_then(|()| p.check_approval())
                .map_err(|e| PersonasError(format!("persona {:?}: {e}", p.id)))?;
            if p.turn_timeout_ms == Some(0) {
                return Err(PersonasError(format!(
                    "persona {:?}: turn_timeout_ms must be at least 1",
                    p.id
                )));
            }
        }
        if self.get(&self.default).is_none() {
            return Err(PersonasError(format!(
                "the default persona {:?} is not listed",
                self.default
            )));
        }
        Ok(())
    }

    /// The persona with `id`.
    pub fn get(&self, id: &str) -> Option<&Persona> {
        self.personas.iter().find(|p| p.id == id)
    }

    /// The persona for `id`, or the default one when `id` is empty.
    pub fn resolve(&self, id: &str) -> Option<&Persona> {
        if id.is_empty() {
            self.get(&self.default)
        } else {
            self.get(id)
        }
    }

    /// Whether the turns of persona `id` have their memory extracted: its `memory_extraction`,
    /// else on for the default persona only.
    pub fn extracts_memory(&self, id: &str) -> bool {
        let id = if id.is_empty() { &self.default } else { id };
        self.get(id)
            .is_some_and(|p| p.memory_extraction.unwrap_or(*id == self.default))
    }

    /// Persona id → display name (for attribution labels in turn jobs).
    pub fn names(&self) -> BTreeMap<String, String> {
        self.personas
            .iter()
            .map(|p| (p.id.clone(), p.name.clone()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_is_valid_and_resolves_the_default() {
        let p = Personas::builtin();
        assert!(p.validate().is_ok());
        assert_eq!(p.resolve("").map(|p| p.name.as_str()), Some("昔涟"));
        assert!(p.resolve("nobody").is_none());
    }

    #[test]
    fn design_document_parses() {
        let p = Personas::from_json(
            r#"{"default":"cyrene","personas":[{"id":"cyrene","name":"昔涟","instructions":"…"},
               {"id":"hoshi","name":"星","instructions":"…","restricted":true}]}"#,
        )
        .unwrap();
        assert!(p.get("hoshi").unwrap().restricted);
        assert_eq!(p.get("hoshi").unwrap().tools, None, "no list: every tool");
        assert_eq!(p.names().get("hoshi").map(String::as_str), Some("星"));
    }

    #[test]
    fn tool_allow_lists_and_turn_timeouts_parse() {
        let p = Personas::from_json(
            r#"{"default":"a","personas":[
               {"id":"a","name":"x","tools":["current_time","search_notes"],"turn_timeout_ms":90000},
               {"id":"b","name":"y","tools":[]}]}"#,
        )
        .unwrap();
        let a = p.get("a").unwrap();
        assert_eq!(
            a.tools.as_deref(),
            Some(&["current_time".to_owned(), "search_notes".to_owned()][..])
        );
        assert_eq!(a.turn_timeout_ms, Some(90_000));
        assert_eq!(
            p.get("b").unwrap().tools,
            Some(vec![]),
            "[]: no tool at all"
        );
    }

    #[test]
    fn memory_extraction_is_on_for_the_default_persona_unless_set() {
        let p = Personas::from_json(
            r#"{"default":"a","personas":[{"id":"a","name":"x"},{"id":"b","name":"y"},
               {"id":"c","name":"z","memory_extraction":true,"memory_model":"small"},
               {"id":"d","name":"w","memory_extraction":false}]}"#,
        )
        .unwrap();
        assert!(p.extracts_memory("a"));
        assert!(p.extracts_memory(""), "empty: the default persona");
        assert!(!p.extracts_memory("b"));
        assert!(p.extracts_memory("c"));
        assert_eq!(p.get("c").unwrap().memory_model.as_deref(), Some("small"));
        assert!(!p.extracts_memory("nobody"));
        let off = Personas::from_json(
            r#"{"default":"d","personas":[{"id":"d","name":"w","memory_extraction":false}]}"#,
        )
        .unwrap();
        assert!(!off.extracts_memory("d"));
        assert!(Personas::builtin().extracts_memory("cyrene"));
    }

    #[test]
    fn refuses_bad_documents() {
        for bad in [
            r#"{"default":"a","personas":[]}"#,
            r#"{"default":"a","personas":[{"id":"a.b","name":"x"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x"},{"id":"a","name":"y"}]}"#,
            r#"{"default":"b","personas":[{"id":"a","name":"x"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":" "}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","colour":"red"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","tools":["a.b"]}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","turn_timeout_ms":0}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","memory_model":" "}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.tool.x"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.>"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.*"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.a b"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.p","guard_timeout_ms":0}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.p","guard_timeout_ms":30001}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.p","guard_fail":"maybe"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard":"cyrene.guard.p","guard_message":" "}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard_fail":"open"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","guard_message":"no"}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","approval":["a.b"]}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","approval_timeout_ms":999}]}"#,
            r#"{"default":"a","personas":[{"id":"a","name":"x","approval_timeout_ms":2592000001}]}"#,
        ] {
            assert!(Personas::from_json(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn approval_lists_parse_with_a_day_by_default() {
        let p = Personas::from_json(
            r#"{"default":"a","personas":[
               {"id":"a","name":"x","approval":["send_email"],"approval_timeout_ms":60000},
               {"id":"b","name":"y"}]}"#,
        )
        .unwrap();
        let a = p.get("a").unwrap();
        assert_eq!(a.approval, ["send_email"]);
        assert_eq!(a.approval_timeout(), 60_000);
        let b = p.get("b").unwrap();
        assert!(b.approval.is_empty());
        assert_eq!(b.approval_timeout(), 86_400_000);
    }

    #[test]
    fn a_guard_parses_with_its_defaults_and_becomes_the_jobs_spec() {
        let p = Personas::from_json(
            r#"{"default":"a","personas":[
               {"id":"a","name":"x","guard":"cyrene.guard.policy"},
               {"id":"b","name":"y","guard":"cyrene.guard.team.strict","guard_timeout_ms":500,
                "guard_fail":"open","guard_message":"I can't do that here."},
               {"id":"c","name":"z"}]}"#,
        )
        .unwrap();
        assert_eq!(
            p.get("a").unwrap().guard_spec(),
            Some(GuardSpec {
                subject: "cyrene.guard.policy".into(),
                timeout_ms: 2_000,
                fail: GuardFail::Closed,
                message: guard::DEFAULT_GUARD_MESSAGE.into(),
            })
        );
        assert_eq!(
            p.get("b").unwrap().guard_spec(),
            Some(GuardSpec {
                subject: "cyrene.guard.team.strict".into(),
                timeout_ms: 500,
                fail: GuardFail::Open,
                message: "I can't do that here.".into(),
            })
        );
        assert_eq!(p.get("c").unwrap().guard_spec(), None);
        let long = "x".repeat(guard::MAX_GUARD_MESSAGE_BYTES + 1);
        let doc = format!(
            r#"{{"default":"a","personas":[{{"id":"a","name":"x","guard":"cyrene.guard.p","guard_message":"{long}"}}]}}"#
        );
        assert!(Personas::from_json(&doc).is_err());
    }
}
