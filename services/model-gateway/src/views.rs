//! Decoding a [`ModelRequest`] without decoding again the messages it shares with earlier ones
//! (docs/model-gateway.md, "Decoding a view once").
//!
//! A turn sends the model its whole view every step: the same messages as the step before, plus
//! what that step added. Decoding the view's JSON was the one part of a step's model call that
//! grew with the conversation, so the gateway keeps the messages it decoded recently, keyed by
//! their exact JSON text, and decodes only the ones it has not seen.
//!
//! # Invariants
//! - **Same bytes, same message.** A message is reused only for a byte-identical JSON text, and
//!   decoding JSON text is deterministic, so a request decodes to exactly what the plain decoder
//!   gives. Nothing is trusted from the caller: no header, no id, no claim about what it sent
//!   before. Whose message it was does not matter either: a caller gets back only the text it sent.
//! - **Errors are the plain decoder's.** Whenever this path cannot decode a request (malformed
//!   JSON, a wrong type, an unknown field, anything), the request is decoded again by
//!   [`cyrene_bus::service::decode`], so the error a caller sees is word for word the same.
//! - **Bounded memory.** Two generations of at most [`GENERATION_BYTES`] of JSON text each: new
//!   and reused messages go to the current one; when it is full it becomes the old one and the
//!   one before is dropped. A message over [`LARGEST_KEPT`] is decoded every time, not kept.
//!
//! # Pitfalls
//! - Replicas do not share what they decoded: behind a queue group of N gateways a step reaches
//!   the replica that decoded the step before about once in N, and the others decode in full.

use cyrene_bus::service::decode;
use cyrene_protocol::ErrorBody;
use cyrene_protocol::message::Message;
use cyrene_protocol::model::ModelRequest;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::HashMap;
use std::sync::Mutex;

/// JSON text kept per generation (the decoded messages take about as much again).
pub const GENERATION_BYTES: usize = 16 << 20;

/// A message whose JSON text is longer than this is decoded every time (an inlined image, say).
pub const LARGEST_KEPT: usize = 64 << 10;

type Map = HashMap<Box<str>, Message, foldhash::fast::RandomState>;

/// The messages decoded recently, by their JSON text.
#[derive(Default)]
pub struct Views {
    generations: Mutex<Generations>,
}

/// Says how many messages are kept, not what they say.
impl std::fmt::Debug for Views {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Views").field("kept", &self.kept()).finish()
    }
}

#[derive(Default)]
struct Generations {
    current: Map,
    current_bytes: usize,
    old: Map,
}

impl Generations {
    fn get(&mut self, text: &str) -> Option<Message> {
        if let Some(message) = self.current.get(text) {
            return Some(message.clone());
        }
        let (key, message) = self.old.remove_entry(text)?;
        let found = message.clone();
        self.keep(key, message);
        Some(found)
    }

    fn keep(&mut self, text: Box<str>, message: Message) {
        if self.current_bytes + text.len() > GENERATION_BYTES {
            self.old = std::mem::take(&mut self.current);
            self.current_bytes = 0;
        }
        self.current_bytes += text.len();
        self.current.insert(text, message);
    }
}

/// Only the messages, each as its JSON text; the other fields are skipped.
#[derive(Deserialize)]
struct MessagesOnly<'a> {
    #[serde(borrow)]
    messages: Vec<&'a RawValue>,
}

impl Views {
    /// `payload` as a [`ModelRequest`], exactly as [`decode`] would decode it (errors included),
    /// decoding only the messages not seen recently.
    pub fn decode(&self, payload: &[u8], max_payload: usize) -> Result<ModelRequest, ErrorBody> {
        cyrene_bus::guard::check_size(payload.len(), max_payload)?;
        match self.decode_reusing(payload) {
            Some(request) => Ok(request),
            None => decode(payload, max_payload),
        }
    }

    /// `None`: not decodable here; the plain decoder decides (and words the error).
    fn decode_reusing(&self, payload: &[u8]) -> Option<ModelRequest> {
        let text = std::str::from_utf8(payload).ok()?;
        let items = serde_json::from_str::<MessagesOnly<'_>>(text)
            .ok()?
            .messages;
        // The request with no messages in place of the real ones: its other fields decode (and
        // are checked) as usual. The items are slices of `text`, so they span the array's
        // inside from the first's start to the last's end.
        let offset = |item: &RawValue| item.get().as_ptr() as usize - text.as_ptr() as usize;
        let start = offset(items.first()?);
        let last = items.last()?;
        let end = offset(last) + last.get().len();
        let rest = [&text[..start], &text[end..]].concat();
        let mut request: ModelRequest = serde_json::from_str(&rest).ok()?;

        let mut found: Vec<Option<Message>> = {
            let mut kept = self.generations.lock().ok()?;
            items.iter().map(|item| kept.get(item.get())).collect()
        };
        let mut decoded = Vec::new();
        for (slot, item) in found.iter_mut().zip(&items) {
            if slot.is_none() {
                let message: Message = serde_json::from_str(item.get()).ok()?;
                if item.get().len() <= LARGEST_KEPT {
                    decoded.push((Box::<str>::from(item.get()), message.clone()));
                }
                *slot = Some(message);
            }
        }
        if !decoded.is_empty() {
            let mut kept = self.generations.lock().ok()?;
            for (text, message) in decoded {
                kept.keep(text, message);
            }
        }
        request.messages = found.into_iter().collect::<Option<Vec<_>>>()?;
        Some(request)
    }

    /// How many messages are kept now (both generations).
    pub fn kept(&self) -> usize {
        self.generations
            .lock()
            .map(|g| g.current.len() + g.old.len())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::message::Role;
    use serde_json::json;

    const MAX: usize = 1 << 20;

    fn request(messages: usize) -> ModelRequest {
        ModelRequest {
            messages: (0..messages)
                .map(|i| Message::text(Role::User, format!("message {i} \"quoted\" é")))
                .collect(),
            persona_id: "p".into(),
            max_tokens: Some(5),
            ..Default::default()
        }
    }

    #[test]
    fn a_growing_view_decodes_as_the_plain_decoder_does_and_keeps_each_message_once() {
        let views = Views::default();
        for n in [1, 3, 3, 10] {
            let payload = serde_json::to_vec(&request(n)).unwrap();
            let reused = views.decode(&payload, MAX).unwrap();
            assert_eq!(reused, decode::<ModelRequest>(&payload, MAX).unwrap());
            assert_eq!(reused, request(n));
        }
        assert_eq!(views.kept(), 10);
    }

    #[test]
    fn the_messages_need_not_come_first() {
        let views = Views::default();
        let payload = serde_json::to_vec(&json!({
            "persona_id": "p",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5
        }))
        .unwrap();
        let reused = views.decode(&payload, MAX).unwrap();
        assert_eq!(reused, decode::<ModelRequest>(&payload, MAX).unwrap());
        assert_eq!(reused.messages.len(), 1);
        assert_eq!(views.kept(), 1);
    }

    #[test]
    fn every_refused_request_gets_the_plain_decoders_error_word_for_word() {
        let views = Views::default();
        // Warm the memo with the message the broken requests share.
        views
            .decode(br#"{"messages":[{"role":"user","content":"hi"}]}"#, MAX)
            .unwrap();
        let cases: [&[u8]; 10] = [
            b"",
            b"not json",
            b"[]",
            br#"{"messages":[{"role":"user","content":"hi"}],"bogus":1}"#,
            br#"{"messages":[{"role":"user","content":"hi"},{"role":"nobody","content":"x"}]}"#,
            br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"five"}"#,
            br#"{"messages":{"role":"user"}}"#,
            br#"{"messages":[{"role":"user","content":"hi"}],"messages":[]}"#,
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}",
            &[b' '; MAX + 1],
        ];
        for payload in cases {
            let plain = decode::<ModelRequest>(payload, MAX).unwrap_err();
            let reused = views.decode(payload, MAX).unwrap_err();
            assert_eq!(reused, plain, "{}", String::from_utf8_lossy(payload));
        }
    }

    #[test]
    fn a_large_message_is_decoded_but_not_kept() {
        let views = Views::default();
        let big = "x".repeat(LARGEST_KEPT + 1);
        let payload = serde_json::to_vec(&json!({"messages": [
            {"role": "user", "content": big},
            {"role": "user", "content": "small"}
        ]}))
        .unwrap();
        let reused = views.decode(&payload, MAX).unwrap();
        assert_eq!(reused.messages[0].text_content(), big);
        assert_eq!(views.kept(), 1);
    }

    #[test]
    fn a_full_generation_turns_old_and_what_is_used_again_comes_back() {
        let mut generations = Generations::default();
        let first = Message::text(Role::User, "first");
        generations.keep("first".into(), first.clone());
        generations.current_bytes = GENERATION_BYTES; // as if full
        generations.keep("second".into(), Message::text(Role::User, "second"));
        assert!(generations.current.contains_key("second"));
        assert!(generations.old.contains_key("first"));
        assert_eq!(generations.get("first"), Some(first));
        assert!(generations.current.contains_key("first"));
        assert!(!generations.old.contains_key("first"));
    }
}
