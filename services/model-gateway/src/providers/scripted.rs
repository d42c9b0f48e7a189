//! The offline provider: deterministic replies and tool calls from a small script, for demos and
//! tests. Every response it gives is marked `offline: true`, so nothing downstream can mistake it
//! for a real model.
//!
//! A rule matches the *last user text* (`equals` after trimming, or `contains`), first match wins.
//! A rule with `tool_calls` asks for them while no tool result follows the last user message, and
//! answers `after_tools` once results arrived — so one rule drives a whole tool round trip
//! (`more_rounds` adds further rounds: round k is asked for when k assistant messages follow the
//! last user message, so a script can drive a multi-step turn). No
//! match → `default_reply`. A rule with `fail` makes the call fail (not retryable). Templates: `{input}` (the last user text), `{tool_results}` (the
//! texts of the tool results after it, one per line).
//!
//! # Invariants
//! - Same request in, same response out: ids are `call_<turn>_<n>_<i>` with `<turn>` 8 hex digits
//!   of a digest of the conversation up to the message being answered (its user, assistant and
//!   tool messages, not the system blocks, which hold the time), `n` the number of assistant
//!   messages so far plus one, `i` the call's position from 1; token counts are word counts. The
//!   id is a tool's idempotency key (docs/loop-worker.md), so it differs from turn to turn even
//!   when a window is cut, and stays the same when a step is asked again after a crash.
//! - A held view's call is answered as the same view sent whole: what an earlier call of the
//!   view's lineage counted over its first messages (`Prefix`) stands in for reading them only
//!   while the gateway says it still holds them ([`HeldPrefix`]: `base` at least as many).
//! - Every request received is appended to the [`RequestLog`], which tests read, once someone
//!   watches it ([`RequestLog::watch`], what [`crate::Gateway::request_log`] hands out): before
//!   that nothing is copied, so a provider nobody reads (`make run`, a benchmark) does not copy
//!   every view it answers. It is bounded by requests and by the messages they hold together
//!   (the oldest go first, the newest always stays), so a long conversation run offline does not
//!   keep a thousand copies of its view.

use super::ProviderError;
use crate::config::{Rule, Script, ScriptedCall, Step};
use cyrene_protocol::message::{Message, Part, Role, ToolCall};
use cyrene_protocol::model::{HeldPrefix, ModelRequest, ModelResponse};
use cyrene_protocol::stream::Delta;
use futures::future::BoxFuture;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// How many requests a [`RequestLog`] keeps.
pub const LOG_CAPACITY: usize = 1000;

/// How many messages the requests a [`RequestLog`] keeps may hold together.
pub const LOG_MESSAGES: usize = 10_000;

/// The requests a scripted provider received since the log was first watched, oldest first.
/// Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct RequestLog(Arc<Mutex<Logged>>);

#[derive(Debug, Default)]
struct Logged {
    watched: bool,
    requests: VecDeque<ModelRequest>,
    messages: usize,
}

impl RequestLog {
    /// This log, recording every request from now on.
    pub fn watch(&self) -> RequestLog {
        self.logged().watched = true;
        self.clone()
    }

    /// A copy of every logged request.
    pub fn snapshot(&self) -> Vec<ModelRequest> {
        self.logged().requests.iter().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.logged().requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn logged(&self) -> std::sync::MutexGuard<'_, Logged> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn push(&self, request: &ModelRequest) {
        let mut log = self.logged();
        if !log.watched {
            return;
        }
        let request = request.clone();
        log.messages += request.messages.len();
        log.requests.push_back(request);
        while log.requests.len() > LOG_CAPACITY
            || (log.messages > LOG_MESSAGES && log.requests.len() > 1)
        {
            if let Some(oldest) = log.requests.pop_front() {
                log.messages -= oldest.messages.len();
            }
        }
    }
}

/// The offline provider.
#[derive(Debug)]
pub struct ScriptedProvider {
    script: Script,
    log: RequestLog,
    /// What it read of each held view's messages, by lineage ([`HeldPrefix`]).
    prefixes: Mutex<BTreeMap<u64, Prefix>>,
}

/// How many held views' [`Prefix`] a provider keeps; the oldest lineage goes first.
const PREFIXES_KEPT: usize = 1024;

/// What answering a call read from its view's first `len` messages, so that the view's next
/// call (its first `len` messages the same, [`HeldPrefix`]) reads only the ones after: a turn's
/// step then costs the same whatever the window (docs/performance.md, "The window ratio met on
/// PostgreSQL").
#[derive(Debug, Clone, Default)]
struct Prefix {
    len: usize,
    /// The prompt's word count.
    words: u64,
    assistants: usize,
    /// The conversation digest of the first so many messages, when one was taken.
    digest: Option<(usize, String)>,
}

/// 8 hex digits of SHA-256 over the user, assistant and tool messages of `messages` (the
/// system blocks hold the time and would change the ids of a step asked again).
///
/// Each field goes into the hash as its length and its bytes, not as the message's JSON: this
/// runs on every tool round over the whole window, and encoding a 1,000-message window as JSON
/// took ≈ 0.3 ms a call, against ≈ 0.09 ms now (docs/performance.md, "The window ratio, the
/// checkpoint statement and the door's CPU").
fn conversation_digest(messages: &[Message]) -> String {
    use sha2::{Digest, Sha256};
    fn field(out: &mut Vec<u8>, bytes: &[u8]) {
        out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        out.extend_from_slice(bytes);
    }
    // Written into one buffer and hashed at once: a hash update per field cost more than the
    // hashing.
    let mut hashed = Vec::with_capacity(64 * messages.len());
    for m in messages.iter().filter(|m| m.role != Role::System) {
        hashed.extend_from_slice(&[m.role as u8, m.sender_kind as u8]);
        field(&mut hashed, m.sender_name.as_bytes());
        field(&mut hashed, m.tool_call_id.as_bytes());
        field(&mut hashed, m.tool_call_name.as_bytes());
        for part in &m.content {
            match part {
                Part::Text { text } => {
                    hashed.extend_from_slice(&[0]);
                    field(&mut hashed, text.as_bytes());
                }
                Part::ImageUrl { image_url } => {
                    hashed.extend_from_slice(&[1]);
                    field(&mut hashed, image_url.as_bytes());
                }
                Part::ToolCall {
                    id,
                    name,
                    args,
                    args_error,
                } => {
                    hashed.extend_from_slice(&[2]);
                    field(&mut hashed, id.as_bytes());
                    field(&mut hashed, name.as_bytes());
                    // A map of JSON values always encodes.
                    field(&mut hashed, &serde_json::to_vec(args).unwrap_or_default());
                    field(&mut hashed, args_error.as_deref().unwrap_or("").as_bytes());
                }
                Part::ToolResult {
                    tool_call_id,
                    text,
                    is_error,
                } => {
                    hashed.extend_from_slice(&[3, u8::from(*is_error)]);
                    field(&mut hashed, tool_call_id.as_bytes());
                    field(&mut hashed, text.as_bytes());
                }
                Part::Document {
                    name,
                    mime,
                    url,
                    size,
                } => {
                    hashed.extend_from_slice(&[4]);
                    field(&mut hashed, name.as_bytes());
                    field(&mut hashed, mime.as_bytes());
                    field(&mut hashed, url.as_bytes());
                    hashed.extend_from_slice(&size.to_le_bytes());
                }
                Part::Reasoning {
                    family,
                    text,
                    signature,
                    redacted,
                } => {
                    hashed.extend_from_slice(&[5, *family as u8]);
                    field(&mut hashed, text.as_bytes());
                    field(&mut hashed, signature.as_deref().unwrap_or("").as_bytes());
                    field(&mut hashed, redacted.as_deref().unwrap_or("").as_bytes());
                }
            }
        }
        hashed.extend_from_slice(&[0xff]);
    }
    let digest = Sha256::digest(&hashed);
    digest[..4].iter().map(|b| format!("{b:02x}")).collect()
}

impl ScriptedProvider {
    pub fn new(script: Script) -> ScriptedProvider {
        ScriptedProvider {
            script,
            log: RequestLog::default(),
            prefixes: Mutex::default(),
        }
    }

    /// The log of received requests (shared with the provider).
    pub fn log(&self) -> RequestLog {
        self.log.clone()
    }

    /// The failure a matching rule's `fail` scripts for `req`, if any (not retryable).
    fn scripted_failure(&self, req: &ModelRequest) -> Option<ProviderError> {
        let input = req
            .messages
            .iter()
            .rfind(|m| m.role == Role::User)
            .map(Message::text_content)
            .unwrap_or_default();
        let rule = self.script.rules.iter().find(|r| matches(r, &input))?;
        rule.fail.clone().map(ProviderError::Invalid)
    }

    /// What an earlier call of `held`'s view read of its first messages, when it is known and
    /// covers no more than the `len` messages of this call.
    fn prefix(&self, held: HeldPrefix, len: usize) -> Prefix {
        let known = match held.lineage {
            0 => None,
            lineage => self
                .prefixes
                .lock()
                .ok()
                .and_then(|p| p.get(&lineage).cloned()),
        };
        known
            .filter(|p| p.len <= held.base.min(len))
            .unwrap_or_default()
    }

    /// Keeps what this call of `held`'s view read.
    fn remember(&self, held: HeldPrefix, prefix: Prefix) {
        if held.lineage == 0 {
            return;
        }
        if let Ok(mut kept) = self.prefixes.lock() {
            kept.insert(held.lineage, prefix);
            while kept.len() > PREFIXES_KEPT {
                kept.pop_first();
            }
        }
    }

    /// The deterministic answer to `req`.
    pub fn answer(&self, req: &ModelRequest, model: &str) -> ModelResponse {
        // The counts over the whole view: what is known of its held messages and the rest read.
        let known = self.prefix(req.held, req.messages.len());
        let unread = &req.messages[known.len..];
        let prompt = known.words + unread.iter().map(message_words).sum::<u64>();
        let assistants =
            known.assistants + unread.iter().filter(|m| m.role == Role::Assistant).count();
        let mut digest = known.digest;
        let last_user = req.messages.iter().rposition(|m| m.role == Role::User);
        let input = last_user
            .map(|i| req.messages[i].text_content())
            .unwrap_or_default();
        let rule = self.script.rules.iter().find(|r| matches(r, &input));
        // The rounds a rule asks for: `tool_calls`, then each of `more_rounds`.
        let rounds: Vec<Vec<ScriptedCall>> = match rule {
            Some(r) if !r.tool_calls.is_empty() => std::iter::once(r.tool_calls.clone())
                .chain(r.more_rounds.iter().cloned())
                .collect(),
            _ => Vec::new(),
        };
        // The conversation this input is answered in starts after the last user message that
        // was already answered by an assistant message. Steered messages sit at the very end of
        // the view, after the tool rounds of their turn, so "after the last user message" would
        // never see a round answered for them.
        let anchor = (0..req.messages.len())
            .rev()
            .find(|&i| {
                req.messages[i].role == Role::User
                    && req.messages[i + 1..]
                        .iter()
                        .any(|m| m.role == Role::Assistant)
            })
            .or(last_user);
        let after = anchor.map_or(0, |i| i + 1);
        // Rounds already answered: assistant messages after the anchor whose first call is the
        // next round's first tool, in order; their results feed `{tool_results}`.
        let mut rounds_done = 0;
        let mut own_calls: Vec<&str> = Vec::new();
        for m in req.messages[after..]
            .iter()
            .filter(|m| m.role == Role::Assistant)
        {
            let first = m.content.iter().find_map(|p| match p {
                Part::ToolCall { name, .. } => Some(name.as_str()),
                _ => None,
            });
            let expected = rounds
                .get(rounds_done)
                .and_then(|r| r.first())
                .map(|c| c.name.as_str());
            if first.is_some() && first == expected {
                rounds_done += 1;
                own_calls.extend(m.content.iter().filter_map(|p| match p {
                    Part::ToolCall { id, .. } => Some(id.as_str()),
                    _ => None,
                }));
            }
        }
        let results: Vec<&str> = req.messages[after..]
            .iter()
            .flat_map(|m| &m.content)
            .filter_map(|p| match p {
                Part::ToolResult {
                    tool_call_id, text, ..
                } if rounds.is_empty() || own_calls.contains(&tool_call_id.as_str()) => {
                    Some(text.as_str())
                }
                _ => None,
            })
            .collect();
        let fill = |template: &str| {
            template
                .replace("{input}", &input)
                .replace("{tool_results}", &results.join("\n"))
        };
        let round = |_: &Rule| -> Option<Vec<ScriptedCall>> { rounds.get(rounds_done).cloned() };
        let (text, calls) = match rule {
            Some(r) if round(r).is_some() => {
                let turn = assistants + 1;
                let conversation = match &digest {
                    Some((len, known)) if *len == after => known.clone(),
                    _ => {
                        let taken = conversation_digest(&req.messages[..after]);
                        digest = Some((after, taken.clone()));
                        taken
                    }
                };
                let calls = round(r)
                    .unwrap_or_default()
                    .iter()
                    .enumerate()
                    .map(|(i, c)| ToolCall {
                        id: format!("call_{conversation}_{turn}_{}", i + 1),
                        name: c.name.clone(),
                        args: c.args.clone(),
                        args_error: None,
                    })
                    .collect();
                (String::new(), calls)
            }
            Some(r) if !rounds.is_empty() => (
                fill(r.after_tools.as_deref().unwrap_or("{tool_results}")),
                Vec::new(),
            ),
            Some(r) => (fill(r.reply.as_deref().unwrap_or_default()), Vec::new()),
            None => (
                fill(
                    self.script
                        .default_reply
                        .as_deref()
                        .unwrap_or(crate::config::FALLBACK_REPLY),
                ),
                Vec::new(),
            ),
        };
        self.remember(
            req.held,
            Prefix {
                len: req.messages.len(),
                words: prompt,
                assistants,
                digest,
            },
        );
        let completion = words(&text) + calls.len() as u64;
        let (message, stop) = if calls.is_empty() {
            (Message::text(Role::Assistant, text.clone()), "stop")
        } else {
            (Message::assistant_tool_calls(&calls), "tool_calls")
        };
        ModelResponse {
            model: model.to_owned(),
            content: text,
            message,
            tool_calls: calls,
            stop_reason: stop.to_owned(),
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            cache_hit_tokens: 0,
            cache_miss_tokens: 0,
            reasoning_tokens: 0,
            provider: String::new(),
            offline: true,
        }
    }
}

fn matches(rule: &Rule, input: &str) -> bool {
    if let Some(e) = &rule.equals {
        return input.trim() == e;
    }
    rule.contains.as_ref().is_some_and(|c| input.contains(c))
}

fn words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}

/// `words(&message.text_content())` without building the text: a word may run on from one text
/// part into the next.
fn message_words(message: &Message) -> u64 {
    let (mut count, mut in_word) = (0, false);
    let mut step = |space: bool| {
        count += u64::from(!space && !in_word);
        in_word = !space;
    };
    for part in &message.content {
        if let Part::Text { text } = part {
            if text.is_ascii() {
                // The ASCII characters `char::is_whitespace` takes: tab to carriage return, space.
                text.bytes()
                    .for_each(|b| step(matches!(b, b'\t'..=b'\r' | b' ')));
            } else {
                text.chars().for_each(|c| step(c.is_whitespace()));
            }
        }
    }
    count
}

impl super::Provider for ScriptedProvider {
    fn complete<'a>(
        &'a self,
        request: &'a ModelRequest,
        step: &'a Step,
        _deadline: Instant,
    ) -> BoxFuture<'a, Result<ModelResponse, ProviderError>> {
        self.log.push(request);
        if let Some(failure) = self.scripted_failure(request) {
            return Box::pin(async move { Err(failure) });
        }
        let response = self.answer(request, &step.model);
        Box::pin(async move { Ok(response) })
    }

    /// The answer's text word by word (each piece keeps its trailing whitespace, so the pieces
    /// concatenate to `content`), `word_delay_ms` apart, then one delta per tool call.
    fn stream<'a>(
        &'a self,
        request: &'a ModelRequest,
        step: &'a Step,
        _deadline: Instant,
        sink: &'a super::DeltaSink,
    ) -> BoxFuture<'a, Result<ModelResponse, ProviderError>> {
        self.log.push(request);
        if let Some(failure) = self.scripted_failure(request) {
            return Box::pin(async move { Err(failure) });
        }
        let response = self.answer(request, &step.model);
        let pace = std::time::Duration::from_millis(self.script.word_delay_ms);
        Box::pin(async move {
            for (i, piece) in response
                .content
                .split_inclusive(char::is_whitespace)
                .enumerate()
            {
                if i > 0 && !pace.is_zero() {
                    tokio::time::sleep(pace).await;
                }
                sink.send(Delta::Text {
                    text: piece.to_owned(),
                });
            }
            for delta in super::response_deltas(&response) {
                if matches!(delta, Delta::ToolCall { .. }) {
                    sink.send(delta);
                }
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ScriptedCall;
    use serde_json::json;

    #[test]
    fn the_log_keeps_nothing_until_watched() {
        let log = RequestLog::default();
        log.push(&ModelRequest::default());
        assert!(log.is_empty());
        let watched = log.watch();
        log.push(&ModelRequest::default());
        assert_eq!((log.len(), watched.len()), (1, 1));
    }

    /// The digest sees every field of the conversation and where each ends: moving text from
    /// one part (or message) into the next, or any other change, gives another digest.
    #[test]
    fn the_conversation_digest_tells_fields_and_their_bounds_apart() {
        let of = |messages: Vec<Message>| conversation_digest(&messages);
        let user = |t: &str| Message::text(Role::User, t);
        let base = of(vec![user("ab"), user("c")]);
        assert_eq!(base, of(vec![user("ab"), user("c")]));
        assert_eq!(base.len(), 8);
        let two_parts = |a: &str, b: &str| Message {
            content: vec![Part::text(a), Part::text(b)],
            ..user("")
        };
        let others = [
            of(vec![user("a"), user("bc")]),
            of(vec![user("abc")]),
            of(vec![two_parts("ab", "c")]),
            of(vec![two_parts("a", "bc")]),
            of(vec![user("ab"), Message::text(Role::Assistant, "c")]),
            of(vec![user("ab"), Message::tool_result("c", "t", "", false)]),
            of(vec![user("ab"), Message::tool_result("c", "t", "", true)]),
        ];
        let mut all = vec![base.clone()];
        all.extend(others);
        let distinct: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len(), "{all:?}");
        // System blocks do not count (they hold the time).
        assert_eq!(
            base,
            of(vec![
                Message::text(Role::System, "now"),
                user("ab"),
                user("c")
            ])
        );
    }

    #[test]
    fn words_are_counted_across_text_parts_as_in_the_joined_text() {
        let text = |t: &str| Part::Text { text: t.into() };
        for parts in [
            vec![text("two words"), text("on"), text(" and  on ")],
            vec![text(""), text(" "), text("a"), text("b c")],
            vec![text("\u{3000}全角 space\n"), text("x")],
            vec![text("a\x0bb\x0cc\rd\x1fe"), text("\x0b")],
            vec![],
        ] {
            let message = Message {
                content: parts,
                ..Message::text(Role::User, "")
            };
            assert_eq!(message_words(&message), words(&message.text_content()));
        }
    }

    #[test]
    fn the_log_keeps_at_most_so_many_messages_but_always_the_newest_request() {
        let log = RequestLog::default().watch();
        let request = |n: usize| ModelRequest {
            messages: vec![Message::text(Role::User, "m"); n],
            ..Default::default()
        };
        let third = LOG_MESSAGES * 2 / 5;
        for _ in 0..3 {
            log.push(&request(third));
        }
        let sizes = |log: &RequestLog| -> Vec<usize> {
            log.snapshot().iter().map(|r| r.messages.len()).collect()
        };
        assert_eq!(sizes(&log), [third, third]);
        log.push(&request(LOG_MESSAGES + 1));
        assert_eq!(sizes(&log), [LOG_MESSAGES + 1]);
        for _ in 0..LOG_CAPACITY + 5 {
            log.push(&request(0));
        }
        assert_eq!(log.len(), LOG_CAPACITY);
    }

    fn provider() -> ScriptedProvider {
        ScriptedProvider::new(Script {
            rules: vec![
                Rule {
                    contains: Some("time".into()),
                    tool_calls: vec![ScriptedCall {
                        name: "get_time".into(),
                        args: json!({"tz":"UTC"}).as_object().unwrap().clone(),
                    }],
                    after_tools: Some("It is {tool_results}.".into()),
                    ..Default::default()
                },
                Rule {
                    equals: Some("hi".into()),
                    reply: Some("hello, {input}".into()),
                    ..Default::default()
                },
            ],
            default_reply: None,
            word_delay_ms: 0,
        })
    }

    fn ask(messages: Vec<Message>) -> ModelRequest {
        ModelRequest {
            messages,
            ..Default::default()
        }
    }

    #[test]
    fn a_tool_rule_calls_first_and_answers_after_the_result() {
        let p = provider();
        let first = p.answer(
            &ask(vec![Message::text(Role::User, "what time is it")]),
            "s",
        );
        assert!(first.offline);
        assert_eq!(first.stop_reason, "tool_calls");
        assert_eq!(first.tool_calls.len(), 1);
        let id = first.tool_calls[0].id.clone();
        assert!(id.starts_with("call_") && id.ends_with("_1_1"), "{id}");
        assert_eq!(first.tool_calls[0].args["tz"], "UTC");
        let second = p.answer(
            &ask(vec![
                Message::text(Role::User, "what time is it"),
                first.message.clone(),
                Message::tool_result(&id, "get_time", "12:00", false),
            ]),
            "s",
        );
        assert_eq!(second.content, "It is 12:00.");
        assert_eq!(second.stop_reason, "stop");
        assert!(second.tool_calls.is_empty());
    }

    /// A rule's `fail` makes the call fail, not retryable (the offline demo's failed turn).
    #[test]
    fn a_fail_rule_fails_the_call() {
        let p = ScriptedProvider::new(Script {
            rules: vec![Rule {
                contains: Some("please fail".into()),
                fail: Some("on purpose".into()),
                ..Default::default()
            }],
            default_reply: None,
            word_delay_ms: 0,
        });
        let failure = p
            .scripted_failure(&ask(vec![Message::text(Role::User, "please fail now")]))
            .expect("the rule matches");
        assert_eq!(failure.to_string(), "on purpose");
        assert!(!failure.is_retryable());
        assert!(
            p.scripted_failure(&ask(vec![Message::text(Role::User, "hello")]))
                .is_none()
        );
    }

    #[test]
    fn more_rounds_drive_a_multi_step_turn() {
        let call = |name: &str| ScriptedCall {
            name: name.into(),
            args: Default::default(),
        };
        let p = ScriptedProvider::new(Script {
            rules: vec![Rule {
                contains: Some("plan".into()),
                tool_calls: vec![call("first")],
                more_rounds: vec![vec![call("second"), call("third")]],
                after_tools: Some("done: {tool_results}".into()),
                ..Default::default()
            }],
            default_reply: None,
            word_delay_ms: 0,
        });
        let mut messages = vec![Message::text(Role::User, "plan it")];
        let one = p.answer(&ask(messages.clone()), "s");
        assert_eq!(
            one.tool_calls
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>(),
            ["first"]
        );
        messages.push(one.message.clone());
        let turn = one.tool_calls[0].id.split('_').nth(1).unwrap().to_owned();
        messages.push(Message::tool_result(
            &one.tool_calls[0].id,
            "first",
            "a",
            false,
        ));
        let two = p.answer(&ask(messages.clone()), "s");
        let names: Vec<_> = two
            .tool_calls
            .iter()
            .map(|c| (c.id.clone(), c.name.as_str()))
            .collect();
        assert_eq!(
            names,
            [
                (format!("call_{turn}_2_1"), "second"),
                (format!("call_{turn}_2_2"), "third")
            ],
            "one turn, one conversation digest"
        );
        messages.push(two.message.clone());
        messages.push(Message::tool_result(&names[0].0, "second", "b", false));
        messages.push(Message::tool_result(&names[1].0, "third", "c", false));
        let three = p.answer(&ask(messages), "s");
        assert!(three.tool_calls.is_empty());
        assert_eq!(three.content, "done: a\nb\nc");
    }

    /// A held view's calls answer exactly as the same views sent whole would (ids, text and
    /// token counts), though each reads only what was added since its view's last call.
    #[test]
    fn a_held_view_is_answered_as_the_whole_view_would_be() {
        let call = |name: &str| ScriptedCall {
            name: name.into(),
            args: Default::default(),
        };
        let script = Script {
            rules: vec![Rule {
                contains: Some("plan".into()),
                tool_calls: vec![call("first")],
                more_rounds: vec![vec![call("second")], vec![call("third")]],
                after_tools: Some("done: {tool_results}".into()),
                ..Default::default()
            }],
            default_reply: None,
            word_delay_ms: 0,
        };
        let (held, whole) = (
            ScriptedProvider::new(script.clone()),
            ScriptedProvider::new(script),
        );
        let mut messages = vec![
            Message::text(Role::User, "an earlier turn"),
            Message::text(Role::Assistant, "its answer, in five words"),
            Message::text(Role::User, "plan  it\tnow"),
        ];
        let mut base = 0;
        for round in 0..4 {
            let request = ModelRequest {
                held: HeldPrefix { lineage: 7, base },
                ..ask(messages.clone())
            };
            let got = held.answer(&request, "s");
            let want = whole.answer(&ask(messages.clone()), "s");
            assert_eq!(got, want, "round {round}");
            if got.tool_calls.is_empty() {
                assert_eq!(round, 3);
                break;
            }
            base = messages.len();
            messages.push(got.message.clone());
            for c in &got.tool_calls {
                messages.push(Message::tool_result(&c.id, &c.name, "a result", false));
            }
        }
        let kept = held.prefixes.lock().unwrap()[&7].clone();
        assert_eq!(kept.len, messages.len(), "the last call read every message");
        assert!(kept.digest.is_some());
        assert!(
            whole.prefixes.lock().unwrap().is_empty(),
            "no view, nothing kept"
        );
    }

    /// What a view's earlier call read is trusted for the messages the gateway says it held, and
    /// for nothing else: not past `base`, not for another lineage.
    #[test]
    fn what_was_read_is_used_only_for_the_messages_held() {
        let p = provider();
        let words = |lineage: u64, base: usize, texts: &[&str]| {
            let messages = texts
                .iter()
                .map(|t| Message::text(Role::User, *t))
                .collect();
            let request = ModelRequest {
                held: HeldPrefix { lineage, base },
                ..ask(messages)
            };
            p.answer(&request, "s").prompt_tokens
        };
        assert_eq!(words(1, 0, &["one two", "three"]), 3);
        // Held: the first two messages are taken as read (here they were changed, which the
        // gateway never does, to show what is trusted).
        assert_eq!(words(1, 2, &["x", "y", "four five"]), 5);
        // A base below what was read, or past the request's messages: nothing is trusted.
        assert_eq!(words(1, 1, &["x", "y", "four five"]), 4);
        assert_eq!(words(1, 9, &["x"]), 1);
        // Another lineage, or no view: everything is read.
        assert_eq!(words(2, 2, &["x", "y", "four five"]), 4);
        assert_eq!(words(0, 2, &["x", "y", "four five"]), 4);
    }

    /// Tool-call ids are tools' idempotency keys: two turns never share one, even when the
    /// window is cut to the same length, and a step asked again (a new time block) keeps them.
    #[test]
    fn tool_call_ids_differ_per_turn_and_stay_when_a_step_is_asked_again() {
        let p = provider();
        let id = |messages: Vec<Message>| p.answer(&ask(messages), "s").tool_calls[0].id.clone();
        let time = |t: &str| Message::text(Role::System, format!("[当前时间] {t}"));
        let turn1 = id(vec![
            time("03:01"),
            Message::text(Role::User, "what time is it"),
        ]);
        let again = id(vec![
            time("03:02"),
            Message::text(Role::User, "what time is it"),
        ]);
        assert_eq!(turn1, again, "the same step asked again");
        // Turn 2 of the session, its window cut to the same number of messages.
        let turn2 = id(vec![
            time("03:05"),
            Message::text(Role::User, "what time is it now"),
        ]);
        assert_ne!(turn1, turn2);
        let turn3 = id(vec![
            Message::text(Role::User, "hi"),
            Message::text(Role::Assistant, "hello"),
            Message::text(Role::User, "what time is it"),
        ]);
        assert_ne!(turn1, turn3, "the same question later in a conversation");
        assert!(turn3.ends_with("_2_1"), "{turn3}");
    }

    #[test]
    fn a_steered_tool_question_gets_its_own_round_then_its_answer() {
        // The view of a turn with a steered message: it sits after the turn's tool rounds.
        let p = provider();
        let first = p.answer(&ask(vec![Message::text(Role::User, "hi")]), "s");
        assert!(first.tool_calls.is_empty());
        let mut view = vec![
            Message::text(Role::User, "search please"),
            Message::assistant_tool_calls(&[ToolCall {
                id: "call_1_1".into(),
                name: "search".into(),
                args: Default::default(),
                args_error: None,
            }]),
            Message::tool_result("call_1_1", "search", "found", false),
            Message::text(Role::User, "and what time is it"),
        ];
        let round = p.answer(&ask(view.clone()), "s");
        assert_eq!(
            round.tool_calls.len(),
            1,
            "the steered question gets its tool round"
        );
        assert_eq!(round.tool_calls[0].name, "get_time");
        let steered = view.pop().unwrap();
        view.push(round.message.clone());
        view.push(Message::tool_result(
            &round.tool_calls[0].id,
            "get_time",
            "12:00",
            false,
        ));
        view.push(steered);
        let answer = p.answer(&ask(view), "s");
        assert!(answer.tool_calls.is_empty(), "no endless rounds");
        assert_eq!(answer.content, "It is 12:00.");
    }

    #[test]
    fn equals_rules_and_the_default_reply_fill_templates() {
        let p = provider();
        let hi = p.answer(&ask(vec![Message::text(Role::User, " hi ")]), "s");
        assert_eq!(hi.content, "hello,  hi ");
        let other = p.answer(&ask(vec![Message::text(Role::User, "hi there")]), "s");
        assert_eq!(other.content, "(offline scripted reply) You said: hi there");
        assert_eq!(other.prompt_tokens, 2);
    }

    #[tokio::test]
    async fn every_request_is_logged_once_watched() {
        use super::super::Provider;
        let p = provider();
        let log = p.log().watch();
        let req = ask(vec![Message::text(Role::User, "hi")]);
        p.complete(&req, &Step::new("offline", "s"), Instant::now())
            .await
            .unwrap();
        assert_eq!(log.snapshot(), vec![req]);
    }
}
