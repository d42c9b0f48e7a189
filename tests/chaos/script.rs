//! What the mock model does, as pure functions shared by the provider, the wire watcher and the
//! report: markers in user messages, the current turn's segment of a view, the tool-round plan,
//! stable logical tool keys, and a small seeded PRNG.
//!
//! A user message carries one marker `[[<session>-m<n>-r<rounds>]]`. The model answers a view by
//! looking at its *segment*: everything after the last assistant message without tool calls (the
//! previous turn's answer). The segment's first marker is the turn's *primary* marker; it fixes
//! how many tool rounds the turn runs (`r<rounds>`). Round `k` (the number of assistant tool-call
//! messages already in the segment) calls the tool with the logical key `<primary>/k<k>/c<j>`:
//! the same logical step has the same key however often the turn is restarted, while every
//! response carries fresh call ids, as a real model's would.

use cyrene_test_support::rng::SplitMix64;
use std::time::Duration;

/// One message of a view, reduced to what the script looks at.
#[derive(Debug, Clone)]
pub struct ViewMessage {
    pub role: String,
    pub text: String,
    pub tool_calls: usize,
}

/// What the script reads from a view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Markers of the user messages of the current turn, in view order, without repeats.
    pub markers: Vec<String>,
    /// Tool rounds already taken in this turn.
    pub round: usize,
}

impl Segment {
    /// The turn's primary marker (its first message), if any.
    pub fn primary(&self) -> Option<&str> {
        self.markers.first().map(String::as_str)
    }
}

/// The marker text of message `n` of `session` asking for `rounds` tool rounds.
pub fn marker(session: &str, n: usize, rounds: usize) -> String {
    format!("{session}-m{n:03}-r{rounds}")
}

/// The user text carrying `marker`.
pub fn user_text(marker: &str) -> String {
    format!("[[{marker}]] please look this up for me")
}

/// The markers in a text (`[[…]]`), in order.
pub fn markers_in(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("[[") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("]]") else { break };
        found.push(after[..end].to_owned());
        rest = &after[end + 2..];
    }
    found
}

/// Tool rounds a turn whose primary marker is `marker` runs (0 when the marker has no `-r<n>`).
pub fn rounds_of(marker: &str) -> usize {
    marker
        .rsplit_once("-r")
        .and_then(|(_, n)| n.parse().ok())
        .unwrap_or(0)
}

/// The segment of a view (see the module docs).
pub fn segment(view: &[ViewMessage]) -> Segment {
    let start = view
        .iter()
        .rposition(|m| m.role == "assistant" && m.tool_calls == 0)
        .map_or(0, |i| i + 1);
    let mut markers: Vec<String> = Vec::new();
    let mut round = 0;
    for m in &view[start..] {
        if m.role == "assistant" && m.tool_calls > 0 {
            round += 1;
        }
        if m.role == "user" {
            for found in markers_in(&m.text) {
                if !markers.contains(&found) {
                    markers.push(found);
                }
            }
        }
    }
    Segment { markers, round }
}

/// The logical keys of round `round` of the turn with primary marker `primary`: one call, or
/// two (a concurrent batch) for some rounds.
pub fn round_keys(primary: &str, round: usize) -> Vec<String> {
    let calls = if hash(&format!("{primary}/k{round}")).is_multiple_of(4) {
        2
    } else {
        1
    };
    (0..calls)
        .map(|j| format!("{primary}/k{round}/c{j}"))
        .collect()
}

/// Whether the step `key` calls the tool that must not run twice (one key in three) rather than
/// the idempotent one (docs/chaos.md).
pub fn calls_once_tool(key: &str) -> bool {
    hash(&format!("{key}/once")).is_multiple_of(3)
}

/// Whether the step `key` calls the tool that needs approval (one key in six; before
/// [`calls_once_tool`] is asked).
pub fn calls_gated_tool(key: &str) -> bool {
    hash(&format!("{key}/gated")).is_multiple_of(6)
}

/// The turn's primary marker of a logical tool key.
pub fn primary_of_key(key: &str) -> &str {
    key.split('/').next().unwrap_or_default()
}

/// How long the tool runs for `key`: mostly 50–300 ms, one call in five 1–2.5 s.
pub fn tool_duration(key: &str) -> Duration {
    let h = hash(key);
    if h.is_multiple_of(5) {
        Duration::from_millis(1_000 + (h >> 8) % 1_500)
    } else {
        Duration::from_millis(50 + (h >> 8) % 250)
    }
}

/// The final answer naming the markers it answers.
pub fn answer_text(markers: &[String]) -> String {
    format!("ANSWERED {}", markers.join(" "))
}

/// The markers an answer names (empty for any other text).
pub fn answered_markers(text: &str) -> Vec<String> {
    text.strip_prefix("ANSWERED ")
        .map(|rest| rest.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// FNV-1a: a stable hash (the std hasher is randomly seeded per process).
pub fn hash(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A small seeded PRNG (splitmix64): the run prints its seed so a schedule can be replayed.
#[derive(Debug, Clone)]
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n)
    }

    /// Uniform in `lo..=hi`.
    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        let (lo_ms, hi_ms) = (lo.as_millis() as u64, hi.as_millis() as u64);
        Duration::from_millis(lo_ms + self.below(hi_ms.saturating_sub(lo_ms) + 1))
    }

    /// True with probability `percent` / 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, text: &str, tool_calls: usize) -> ViewMessage {
        ViewMessage {
            role: role.into(),
            text: text.into(),
            tool_calls,
        }
    }

    #[test]
    fn the_segment_starts_after_the_previous_answer() {
        let view = [
            m("system", "You are Cyrene.", 0),
            m("user", &user_text("s1-m000-r2"), 0),
            m("assistant", "ANSWERED s1-m000-r2", 0),
            m("user", &user_text("s1-m001-r2"), 0),
            m("assistant", "", 1),
            m("tool", "done s1-m001-r2/k0/c0", 0),
            m("user", &user_text("s1-m002-r0"), 0),
        ];
        let s = segment(&view);
        assert_eq!(s.markers, ["s1-m001-r2", "s1-m002-r0"]);
        assert_eq!(s.round, 1);
        assert_eq!(rounds_of(s.primary().unwrap()), 2);
        assert_eq!(
            primary_of_key(&round_keys("s1-m001-r2", 1)[0]),
            "s1-m001-r2"
        );
        assert_eq!(
            answered_markers(&answer_text(&s.markers)),
            ["s1-m001-r2", "s1-m002-r0"]
        );
    }
}
