//! The turn job, decided from plain data (docs/orchestrator.md, "Turn jobs"): which pending
//! messages a new turn takes, which answered transcript is seeded before them, which persona
//! answers. No SQL and no clock: [`crate::store`] reads the rows under the session lock, calls
//! [`batch`] and [`build`], and stores what they return.
//!
//! # Invariants
//! - **A solo message is a batch of its own.** The oldest pending message, when solo (an ask),
//!   is taken alone; a later solo message is never batched with others and waits its turn.
//! - **The byte budget** (`max_job_bytes`): the batch takes at most half of it, but its first
//!   message always goes (a message is never starved by its own size); the window takes what the
//!   batch leaves, newest first, and stops at the first message that does not fit, so it is
//!   always a contiguous run of the newest answered transcript, oldest first in the job.
//! - `base_seq` is the highest seq the job holds (window or batch), 0 when it holds none: a
//!   worker's steer cursor starts there.
//! - **Persona.** The session's persona answers; when it is empty or no longer listed, the
//!   default one does. A job is never built without a persona.
//! - An ask's chain travels only with a batch of exactly one message (an ask is solo).

use crate::personas::Personas;
use cyrene_protocol::message::Message;
use cyrene_protocol::session::SessionEnv;
use cyrene_protocol::turn::{ParallelNotice, TurnJob};

/// What a turn job is built from besides the session's transcript.
#[derive(Debug, Clone)]
pub struct JobSettings {
    pub personas: Personas,
    /// Persisted transcript messages (newest) seeded into each job.
    pub window: usize,
    pub max_steps: u32,
    /// Byte budget of the seeded messages.
    pub max_job_bytes: usize,
}

/// A pending (unclaimed) user message as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct Pending {
    pub id: String,
    pub seq: i64,
    /// The message as stored (JSON).
    pub message: String,
    pub solo: bool,
    pub client_id: String,
    /// JSON list: the ask chain of an ask's message.
    pub ask_chain: Option<String>,
    /// False for the message of the send that starts the turn: its row is written after the
    /// turn, already claimed, so there is no row to claim yet.
    pub stored: bool,
}

/// Why a job could not be built: a corrupt row or no persona at all (never the caller's fault).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("corrupt message row: {0}")]
    CorruptMessage(#[source] serde_json::Error),
    #[error("corrupt ask chain: {0}")]
    CorruptAskChain(#[source] serde_json::Error),
    #[error("no default persona")]
    NoPersona,
}

/// Decodes a stored message.
pub fn decode_message(text: &str) -> Result<Message, JobError> {
    serde_json::from_str(text).map_err(JobError::CorruptMessage)
}

/// The batch a new turn starts with, from the oldest pending messages in seq order: the first
/// one alone when it is solo, else every non-solo one while the batch stays within half of
/// `max_job_bytes` (what is left waits for the next turn).
pub fn batch(pending: impl IntoIterator<Item = Pending>, max_job_bytes: usize) -> Vec<Pending> {
    let mut batch = Vec::new();
    let mut bytes = 0usize;
    for row in pending {
        if batch.is_empty() && row.solo {
            batch.push(row);
            break;
        }
        if row.solo {
            continue;
        }
        if !batch.is_empty() && bytes + row.message.len() > max_job_bytes / 2 {
            break;
        }
        bytes += row.message.len();
        batch.push(row);
    }
    batch
}

/// The seeded window: from `answered` (`(seq, message JSON)`, newest first) the newest messages
/// that fit `budget` bytes, oldest first.
pub fn window(answered: &[(i64, String)], budget: usize) -> Result<Vec<(i64, Message)>, JobError> {
    let mut budget = budget;
    let mut window = Vec::new();
    for (seq, text) in answered {
        if text.len() > budget {
            break;
        }
        budget -= text.len();
        window.push((*seq, decode_message(text)?));
    }
    window.reverse();
    Ok(window)
}

/// What the store read for a new turn, under the session lock.
#[derive(Debug, Clone)]
pub struct TurnSeed<'a> {
    pub turn_id: &'a str,
    pub session_id: &'a str,
    pub leg_id: &'a str,
    /// The session's env (its persona may be empty or unknown).
    pub env: &'a SessionEnv,
    /// The messages this turn answers (from [`batch`]).
    pub batch: &'a [Pending],
    /// The newest answered transcript (`(seq, message JSON)`, newest first), at most
    /// [`JobSettings::window`] rows.
    pub answered: &'a [(i64, String)],
    pub notice: Option<ParallelNotice>,
    /// Unix milliseconds now: the persona's turn deadline counts from here.
    pub now_ms: i64,
}

/// A built job and the seq its turn is recorded with.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    pub job: TurnJob,
    /// The highest seq the job holds (0 when none).
    pub base_seq: i64,
}

/// Builds the job of a new turn.
pub fn build(settings: &JobSettings, seed: TurnSeed<'_>) -> Result<Built, JobError> {
    let batch_bytes: usize = seed.batch.iter().map(|m| m.message.len()).sum();
    let history = window(
        seed.answered,
        settings.max_job_bytes.saturating_sub(batch_bytes),
    )?;
    let mut base_seq = history.iter().map(|(s, _)| *s).max().unwrap_or(0);
    let mut messages: Vec<Message> = history.into_iter().map(|(_, m)| m).collect();
    let ask_chain: Vec<String> = match seed.batch {
        [only] => match &only.ask_chain {
            Some(text) => serde_json::from_str(text).map_err(JobError::CorruptAskChain)?,
            None => Vec::new(),
        },
        _ => Vec::new(),
    };
    let mut message_ids = Vec::with_capacity(seed.batch.len());
    for m in seed.batch {
        base_seq = base_seq.max(m.seq);
        messages.push(decode_message(&m.message)?);
        message_ids.push(m.id.clone());
    }
    let persona = settings
        .personas
        .resolve(&seed.env.persona)
        .or_else(|| settings.personas.resolve(""))
        .ok_or(JobError::NoPersona)?;
    let job = TurnJob {
        turn_id: seed.turn_id.to_owned(),
        session_id: seed.session_id.to_owned(),
        leg_id: seed.leg_id.to_owned(),
        env: SessionEnv {
            restricted: seed.env.restricted,
            persona: persona.id.clone(),
        },
        instructions: persona.instructions.clone(),
        persona_names: settings.personas.names(),
        messages,
        message_ids,
        base_seq: to_u64(base_seq),
        notice: seed.notice,
        max_steps: settings.max_steps,
        // The persona's limits (`CYRENE_PERSONAS`): its turn timeout from now, its tools.
        deadline_unix_ms: persona
            .turn_timeout_ms
            .map(|ms| to_u64(seed.now_ms).saturating_add(ms)),
        tools: persona.tools.clone(),
        ask_chain,
        guard: persona.guard_spec(),
        approval: persona.approval.clone(),
        decisions: Vec::new(),
        attempt_base: 0,
    };
    Ok(Built { job, base_seq })
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::personas::Persona;
    use cyrene_protocol::message::Role;

    fn text(s: &str) -> String {
        serde_json::to_string(&Message::text(Role::User, s)).unwrap()
    }

    fn pending(id: &str, seq: i64, body: &str, solo: bool) -> Pending {
        Pending {
            id: id.into(),
            seq,
            message: text(body),
            solo,
            client_id: format!("client-{id}"),
            ask_chain: None,
            stored: true,
        }
    }

    fn ids(batch: &[Pending]) -> Vec<&str> {
        batch.iter().map(|p| p.id.as_str()).collect()
    }

    fn personas() -> Personas {
        let mut p = Personas::builtin();
        p.personas.push(Persona {
            id: "hoshi".into(),
            name: "星".into(),
            instructions: "You are Hoshi.".into(),
            restricted: true,
            tools: Some(vec!["current_time".into()]),
            turn_timeout_ms: Some(5_000),
            guard: Some("cyrene.guard.hoshi".into()),
            guard_fail: Some(cyrene_protocol::guard::GuardFail::Open),
            ..Default::default()
        });
        p
    }

    fn settings(max_job_bytes: usize) -> JobSettings {
        JobSettings {
            personas: personas(),
            window: 40,
            max_steps: 7,
            max_job_bytes,
        }
    }

    fn env(persona: &str) -> SessionEnv {
        SessionEnv {
            restricted: false,
            persona: persona.into(),
        }
    }

    fn seed<'a>(
        env: &'a SessionEnv,
        batch: &'a [Pending],
        answered: &'a [(i64, String)],
    ) -> TurnSeed<'a> {
        TurnSeed {
            turn_id: "t1",
            session_id: "s1",
            leg_id: "",
            env,
            batch,
            answered,
            notice: None,
            now_ms: 1_000,
        }
    }

    #[test]
    fn an_oldest_solo_message_is_a_batch_of_its_own() {
        let rows = [pending("a", 1, "ask", true), pending("b", 2, "hi", false)];
        assert_eq!(ids(&batch(rows, 1 << 20)), ["a"]);
    }

    #[test]
    fn later_solo_messages_wait_while_the_others_are_batched() {
        let rows = [
            pending("a", 1, "hi", false),
            pending("b", 2, "ask", true),
            pending("c", 3, "there", false),
        ];
        assert_eq!(ids(&batch(rows, 1 << 20)), ["a", "c"]);
    }

    #[test]
    fn the_batch_keeps_to_half_the_budget_but_always_takes_its_first_message() {
        let len = text("12345678").len();
        let rows = || {
            [
                pending("a", 1, "12345678", false),
                pending("b", 2, "12345678", false),
                pending("c", 3, "12345678", false),
            ]
        };
        // Exactly two fit in half the budget: the third waits.
        assert_eq!(ids(&batch(rows(), 4 * len)), ["a", "b"]);
        assert_eq!(ids(&batch(rows(), 4 * len + 1)), ["a", "b"]);
        // Far too small: the first goes anyway, alone.
        assert_eq!(ids(&batch(rows(), 1)), ["a"]);
        assert!(batch(Vec::new(), 100).is_empty());
    }

    #[test]
    fn the_window_takes_the_newest_that_fit_and_stops_at_the_first_that_does_not() {
        let answered = [
            (5, text("newest")),
            (4, text("a much longer message")),
            (3, text("old")),
        ];
        let newest = answered[0].1.len();
        // Exactly the newest fits; the next does not, and the older short one is not taken
        // either (the window stays contiguous).
        let w = window(&answered, newest + answered[2].1.len()).unwrap();
        assert_eq!(w.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [5]);
        assert!(window(&answered, newest - 1).unwrap().is_empty());
        let all = answered.iter().map(|(_, t)| t.len()).sum();
        let w = window(&answered, all).unwrap();
        assert_eq!(w.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [3, 4, 5]);
    }

    #[test]
    fn the_batch_is_seeded_after_the_window_and_its_bytes_shrink_the_window() {
        let batch = [pending("m9", 9, "new question", false)];
        let answered = [(8, text("answer")), (7, text("question"))];
        let all: usize =
            answered.iter().map(|(_, t)| t.len()).sum::<usize>() + batch[0].message.len();
        let env = env("");
        let built = build(&settings(all), seed(&env, &batch, &answered)).unwrap();
        assert_eq!(built.job.messages.len(), 3);
        assert_eq!(
            built.job.messages[2],
            Message::text(Role::User, "new question")
        );
        assert_eq!(built.job.message_ids, ["m9"]);
        assert_eq!((built.base_seq, built.job.base_seq), (9, 9));
        // One byte less: the oldest answered message no longer fits.
        let built = build(&settings(all - 1), seed(&env, &batch, &answered)).unwrap();
        assert_eq!(built.job.messages.len(), 2);
        // A batch over the whole budget leaves no room for any window.
        let built = build(&settings(1), seed(&env, &batch, &answered)).unwrap();
        assert_eq!(built.job.messages.len(), 1);
        assert_eq!(built.base_seq, 9);
    }

    #[test]
    fn base_seq_is_the_highest_held_or_zero() {
        let env = env("");
        let built = build(&settings(1 << 20), seed(&env, &[], &[])).unwrap();
        assert_eq!(built.base_seq, 0);
        assert!(built.job.messages.is_empty());
        let answered = [(12, text("later answer"))];
        let batch = [pending("m3", 3, "late-claimed", false)];
        let built = build(&settings(1 << 20), seed(&env, &batch, &answered)).unwrap();
        assert_eq!(built.base_seq, 12);
    }

    #[test]
    fn the_sessions_persona_answers_with_its_limits() {
        let env = SessionEnv {
            restricted: true,
            persona: "hoshi".into(),
        };
        let batch = [pending("m1", 1, "hi", false)];
        let job = build(&settings(1 << 20), seed(&env, &batch, &[]))
            .unwrap()
            .job;
        assert_eq!(job.env.persona, "hoshi");
        assert!(job.env.restricted);
        assert_eq!(job.instructions, "You are Hoshi.");
        assert_eq!(job.tools, Some(vec!["current_time".to_owned()]));
        assert_eq!(job.deadline_unix_ms, Some(6_000));
        assert_eq!(job.max_steps, 7);
        assert_eq!(
            job.persona_names.get("hoshi").map(String::as_str),
            Some("星")
        );
        let guard = job.guard.expect("hoshi's guard");
        assert_eq!(
            (guard.subject.as_str(), guard.timeout_ms, guard.fail),
            (
                "cyrene.guard.hoshi",
                2_000,
                cyrene_protocol::guard::GuardFail::Open
            )
        );
    }

    #[test]
    fn an_empty_or_unknown_persona_falls_back_to_the_default() {
        for persona in ["", "gone"] {
            let env = env(persona);
            let job = build(&settings(1 << 20), seed(&env, &[], &[])).unwrap().job;
            assert_eq!(job.env.persona, "cyrene", "{persona:?}");
            assert_eq!(job.tools, None);
            assert_eq!(job.deadline_unix_ms, None);
            assert_eq!(job.guard, None, "the default persona has no guard");
        }
        let mut none = settings(1 << 20);
        none.personas.default = "missing".into();
        let env = env("");
        assert!(matches!(
            build(&none, seed(&env, &[], &[])),
            Err(JobError::NoPersona)
        ));
    }

    #[test]
    fn only_a_single_message_batch_carries_its_ask_chain() {
        let mut ask = pending("m1", 1, "ask", true);
        ask.ask_chain = Some(r#"["cyrene","hoshi"]"#.into());
        let env = env("");
        let one = [ask.clone()];
        let job = build(&settings(1 << 20), seed(&env, &one, &[]))
            .unwrap()
            .job;
        assert_eq!(job.ask_chain, ["cyrene", "hoshi"]);
        let two = [ask, pending("m2", 2, "hi", false)];
        let job = build(&settings(1 << 20), seed(&env, &two, &[]))
            .unwrap()
            .job;
        assert!(job.ask_chain.is_empty());
        let mut bad = pending("m1", 1, "ask", true);
        bad.ask_chain = Some("not json".into());
        assert!(matches!(
            build(&settings(1 << 20), seed(&env, &[bad], &[])),
            Err(JobError::CorruptAskChain(_))
        ));
    }
}
