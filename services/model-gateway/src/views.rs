//! What the gateway keeps between calls so a turn's steps need not send, nor the gateway decode,
//! the same conversation again and again (docs/model-gateway.md, "Held views" and "Decoding a
//! view once").
//!
//! - **Held views.** A streamed request may name a view ([`ViewRef`]). Its first call sends the
//!   whole view (`base` 0); the gateway holds it afterwards, and the view's later calls send only
//!   the messages after the `base` the gateway holds, to the replica that holds it
//!   (`cyrene.model.complete.stream.<replica>`, told in the end marker). A view the replica does
//!   not hold (restarted, evicted, never sent) is `not_found`, and the caller sends it whole.
//! - **Decoded messages.** Every streamed request decodes only the messages whose exact JSON text
//!   it has not decoded recently (a turn's first call repeats its session's history).
//!
//! # Invariants
//! - **A view is the caller's.** Its id is the caller's unguessable name for it; the gateway
//!   never lists views, and a call only extends what was held under the id it names, with
//!   exactly `base` messages — anything else is `not_found` and nothing is assembled.
//! - **Same bytes, same message.** A decoded message is reused only for byte-identical JSON text,
//!   and decoding is deterministic, so a request decodes to exactly what the plain decoder gives.
//!   Whenever this path cannot decode a request, it is decoded again by
//!   [`cyrene_bus::service::decode`], so every error is word for word the plain decoder's.
//! - **Bounded memory.** Each kind is kept in two generations of at most [`GENERATION_BYTES`]:
//!   new and used entries go to the current one; when it is full it becomes the old one and the
//!   one before is dropped. An entry counts for what it takes in memory, decoded, with its key
//!   and its map slot ([`footprint`], an upper bound: many tiny messages or deeply nested tool
//!   arguments take many times their JSON text), so the caches together stay under
//!   4 × [`GENERATION_BYTES`] whatever they are sent. A message over [`LARGEST_KEPT`] is decoded
//!   every time, not kept; a view is not continued past [`LARGEST_VIEW`] of request JSON.
//!
//! # Pitfalls
//! - A held view is taken out while its call runs and put back after, so two calls naming one
//!   view at once: the second is `not_found` (a turn makes one call at a time).

use cyrene_bus::service::decode;
use cyrene_protocol::message::{Message, Part};
use cyrene_protocol::model::{HeldPrefix, ModelRequest, ViewRef};
use cyrene_protocol::{ErrorBody, ErrorCode};
use serde::Deserialize;
use serde_json::Value;
use serde_json::value::RawValue;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Memory kept per generation, of each kind, as [`footprint`] counts it.
pub const GENERATION_BYTES: usize = 16 << 20;

/// The most request JSON one held view may grow to over its calls: continuing it further is
/// `not_found`, and the caller sends it whole (which must fit the bus's max payload).
pub const LARGEST_VIEW: usize = 4 << 20;

/// A message whose JSON text is longer than this is decoded every time (an inlined image, say).
pub const LARGEST_KEPT: usize = 64 << 10;

/// The messages decoded recently (by their JSON text) and the views held (by id).
pub struct Views {
    decoded: Mutex<Generations<Box<str>, Message>>,
    held: Mutex<Generations<String, HeldView>>,
    /// The last lineage number given to a view sent whole ([`HeldPrefix::lineage`]).
    lineages: AtomicU64,
}

/// A view between its calls.
struct HeldView {
    messages: Vec<Message>,
    /// The request JSON it grew from (what [`LARGEST_VIEW`] bounds).
    bytes: usize,
    lineage: u64,
    /// What its messages take beyond their own size (each one's [`footprint`] less the size of
    /// a `Message`), kept so that holding the view again after a call counts only the messages
    /// the call added.
    heap: usize,
}

impl Default for Views {
    fn default() -> Views {
        Views {
            decoded: Mutex::new(Generations::new(GENERATION_BYTES)),
            held: Mutex::new(Generations::new(GENERATION_BYTES)),
            lineages: AtomicU64::new(0),
        }
    }
}

/// Says how much is kept, not what it says.
impl std::fmt::Debug for Views {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Views")
            .field("decoded", &self.kept())
            .field("held", &self.held())
            .finish()
    }
}

/// A view taken out for one call: put it back with [`Views::hold`] once the call is over.
#[derive(Debug)]
pub struct Held {
    id: String,
    bytes: usize,
    lineage: u64,
    /// How many messages were held before the call, and their [`HeldView::heap`].
    base: usize,
    heap: usize,
}

/// Two generations of entries, each entry with the bytes it counts for.
struct Generations<K, V> {
    current: HashMap<K, (V, usize), foldhash::fast::RandomState>,
    current_bytes: usize,
    old: HashMap<K, (V, usize), foldhash::fast::RandomState>,
    budget: usize,
}

impl<K: std::hash::Hash + Eq, V> Generations<K, V> {
    fn new(budget: usize) -> Generations<K, V> {
        Generations {
            current: HashMap::default(),
            current_bytes: 0,
            old: HashMap::default(),
            budget,
        }
    }

    fn insert(&mut self, key: K, value: V, bytes: usize) {
        if self.current_bytes + bytes > self.budget {
            self.old = std::mem::take(&mut self.current);
            self.current_bytes = 0;
        }
        self.current_bytes += bytes;
        if let Some((_, replaced)) = self.current.insert(key, (value, bytes)) {
            self.current_bytes -= replaced;
        }
    }

    /// The entry out of whichever generation holds it.
    fn take<Q>(&mut self, key: &Q) -> Option<(K, V, usize)>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        if let Some((key, (value, bytes))) = self.current.remove_entry(key) {
            self.current_bytes -= bytes;
            return Some((key, value, bytes));
        }
        let (key, (value, bytes)) = self.old.remove_entry(key)?;
        Some((key, value, bytes))
    }

    fn len(&self) -> usize {
        self.current.len() + self.old.len()
    }
}

impl Generations<Box<str>, Message> {
    /// A copy of the message decoded from `text`, moved to the current generation.
    fn get(&mut self, text: &str) -> Option<Message> {
        if let Some((message, _)) = self.current.get(text) {
            return Some(message.clone());
        }
        let (key, message, bytes) = self.take(text)?;
        let found = message.clone();
        self.insert(key, message, bytes);
        Some(found)
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
            let mut kept = self.decoded.lock().ok()?;
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
            let mut kept = self.decoded.lock().ok()?;
            for (text, message) in decoded {
                let bytes = DECODED_SLOT + text.len() + ALLOCATION + footprint(&message);
                kept.insert(text, message, bytes);
            }
        }
        request.messages = found.into_iter().collect::<Option<Vec<_>>>()?;
        Some(request)
    }

    /// How many decoded messages are kept now.
    pub fn kept(&self) -> usize {
        self.decoded.lock().map(|g| g.len()).unwrap_or(0)
    }

    /// How many views are held now.
    pub fn held(&self) -> usize {
        self.held.lock().map(|g| g.len()).unwrap_or(0)
    }

    /// Puts the view `request` names in front of its messages (a `base` above 0), taking it out
    /// until [`Views::hold`] puts it back, and tells the providers which messages were held
    /// ([`ModelRequest::held`]); `None` when the request names no view. `payload_len` is what the
    /// request's JSON counts for.
    pub fn resolve(
        &self,
        request: &mut ModelRequest,
        payload_len: usize,
    ) -> Result<Option<Held>, ErrorBody> {
        let Some(view) = request.view.take() else {
            return Ok(None);
        };
        if !ViewRef::valid_id(&view.id) {
            return Err(ErrorBody::new(
                ErrorCode::BadRequest,
                "view.id must be 8 to 64 of A-Z a-z 0-9 _ -",
            ));
        }
        if view.base == 0 {
            let lineage = self.lineages.fetch_add(1, Ordering::Relaxed) + 1;
            request.held = HeldPrefix { lineage, base: 0 };
            return Ok(Some(Held {
                id: view.id,
                bytes: payload_len,
                lineage,
                base: 0,
                heap: 0,
            }));
        }
        let taken = self.held.lock().ok().and_then(|mut g| g.take(&view.id));
        match taken {
            Some((_, held, _)) if held.bytes + payload_len > LARGEST_VIEW => Err(ErrorBody::new(
                ErrorCode::NotFound,
                format!(
                    "view {} would grow past {LARGEST_VIEW} bytes, more than a view is held for; \
                     send the whole view (base 0)",
                    view.id
                ),
            )),
            Some((id, mut held, _)) if held.messages.len() == view.base as usize => {
                let base = held.messages.len();
                held.messages.append(&mut request.messages);
                request.messages = held.messages;
                request.held = HeldPrefix {
                    lineage: held.lineage,
                    base,
                };
                Ok(Some(Held {
                    id,
                    bytes: held.bytes + payload_len,
                    lineage: held.lineage,
                    base,
                    heap: held.heap,
                }))
            }
            _ => Err(ErrorBody::new(
                ErrorCode::NotFound,
                format!(
                    "this gateway holds no view {} of {} messages; send the whole view (base 0)",
                    view.id, view.base
                ),
            )),
        }
    }

    /// Holds `messages` (the whole view of a call, its first `base` the ones held before it,
    /// unchanged) as `held`'s view.
    pub fn hold(&self, held: Held, messages: Vec<Message>) {
        let heap = |messages: &[Message]| {
            messages
                .iter()
                .map(|m| footprint(m) - size_of::<Message>())
                .sum::<usize>()
        };
        // Counting only what the call added keeps a step's cost flat in the window's length.
        let heap = match messages.get(held.base..) {
            Some(added) => held.heap + heap(added),
            None => heap(&messages),
        };
        let memory = HELD_SLOT
            + held.id.capacity()
            + ALLOCATION
            + messages.capacity() * size_of::<Message>()
            + ALLOCATION
            + heap;
        let view = HeldView {
            messages,
            bytes: held.bytes,
            lineage: held.lineage,
            heap,
        };
        if let Ok(mut g) = self.held.lock() {
            g.insert(held.id, view, memory);
        }
    }
}

/// What the allocator may add to each allocation (its header and rounding), counted generously.
const ALLOCATION: usize = 32;

/// A decoded cache entry's place in its map: key, value, weight and the map's control byte.
const DECODED_SLOT: usize = size_of::<(Box<str>, (Message, usize))>() + 1;

/// A held view's place in its map.
const HELD_SLOT: usize = size_of::<(String, (HeldView, usize))>() + 1;

/// What `message` takes in memory, itself included: an upper bound of its heap (every string's
/// and vector's capacity, each allocation counted with [`ALLOCATION`]) and its own size.
pub fn footprint(message: &Message) -> usize {
    let text = text_heap;
    let parts = message.content.iter().map(|part| match part {
        Part::Text { text: t } => text(t),
        Part::ImageUrl { image_url } => text(image_url),
        Part::ToolCall {
            id,
            name,
            args,
            args_error,
        } => text(id) + text(name) + object(args) + args_error.as_ref().map_or(0, text_heap),
        Part::ToolResult {
            tool_call_id,
            text: t,
            ..
        } => text(tool_call_id) + text(t),
        Part::Document {
            name, mime, url, ..
        } => text(name) + text(mime) + text(url),
        Part::Reasoning {
            text: t,
            signature,
            redacted,
            ..
        } => {
            text(t)
                + signature.as_ref().map_or(0, text_heap)
                + redacted.as_ref().map_or(0, text_heap)
        }
    });
    size_of::<Message>()
        + message.content.capacity() * size_of::<Part>()
        + ALLOCATION
        + parts.sum::<usize>()
        + text(&message.sender_name)
        + text(&message.tool_call_id)
        + text(&message.tool_call_name)
}

/// The heap under a JSON object's entries. The map is a B-tree whose nodes are allocated whole
/// (room for eleven entries and twelve edges) and, but for the root, at least half full: a
/// one-entry object takes a whole node.
fn object(map: &serde_json::Map<String, Value>) -> usize {
    const NODE: usize = 11 * (size_of::<String>() + size_of::<Value>()) + 12 * 8 + 16 + ALLOCATION;
    if map.is_empty() {
        return 0;
    }
    NODE * (1 + map.len() / 5)
        + map
            .iter()
            .map(|(key, value)| text_heap(key) + value_heap(value))
            .sum::<usize>()
}

/// The heap under a string.
fn text_heap(s: &String) -> usize {
    match s.capacity() {
        0 => 0,
        n => n + ALLOCATION,
    }
}

/// The heap under one JSON value.
fn value_heap(value: &Value) -> usize {
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        Value::String(s) => text_heap(s),
        Value::Array(items) if items.capacity() == 0 => 0,
        Value::Array(items) => {
            items.capacity() * size_of::<Value>()
                + ALLOCATION
                + items.iter().map(value_heap).sum::<usize>()
        }
        Value::Object(map) => object(map),
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
        let mut generations = Generations::new(10);
        let first = Message::text(Role::User, "first");
        generations.insert("first".into(), first.clone(), 6);
        generations.insert("second".into(), Message::text(Role::User, "second"), 6);
        assert!(generations.current.contains_key("second"));
        assert!(generations.old.contains_key("first"));
        assert_eq!(generations.get("first"), Some(first));
        // Moving it back filled the current generation again: it turned old in its turn.
        assert!(generations.current.contains_key("first"));
        assert!(generations.old.contains_key("second"));
        assert_eq!(generations.len(), 2);
        assert_eq!(generations.current_bytes, 6);
    }

    /// A request naming view `id` at `base`, carrying user `messages`.
    fn viewed(id: &str, base: u32, messages: &[&str]) -> ModelRequest {
        ModelRequest {
            messages: messages
                .iter()
                .map(|m| Message::text(Role::User, *m))
                .collect(),
            view: Some(ViewRef {
                id: id.into(),
                base,
            }),
            ..Default::default()
        }
    }

    fn turn(
        views: &Views,
        id: &str,
        base: u32,
        messages: &[&str],
    ) -> Result<ModelRequest, ErrorBody> {
        let mut request = viewed(id, base, messages);
        let held = views.resolve(&mut request, 100)?.expect("a view was named");
        assert_eq!(
            request.view, None,
            "the gateway's providers never see the view"
        );
        views.hold(held, request.messages.clone());
        Ok(request)
    }

    fn texts(request: &ModelRequest) -> Vec<String> {
        request.messages.iter().map(Message::text_content).collect()
    }

    #[test]
    fn a_held_view_grows_by_what_each_call_adds() {
        let views = Views::default();
        let id = "0123456789abcdef";
        assert_eq!(
            texts(&turn(&views, id, 0, &["a", "b"]).unwrap()),
            ["a", "b"]
        );
        assert_eq!(
            texts(&turn(&views, id, 2, &["c"]).unwrap()),
            ["a", "b", "c"]
        );
        assert_eq!(texts(&turn(&views, id, 3, &[]).unwrap()), ["a", "b", "c"]);
        // base 0 starts the view again.
        assert_eq!(texts(&turn(&views, id, 0, &["x"]).unwrap()), ["x"]);
        assert_eq!(texts(&turn(&views, id, 1, &["y"]).unwrap()), ["x", "y"]);
        assert_eq!(views.held(), 1);
    }

    /// Providers are told which messages were held: the same lineage while a view grows, a new
    /// one whenever it is sent whole.
    #[test]
    fn a_held_view_tells_its_lineage_and_base() {
        let views = Views::default();
        let (a, b) = ("0123456789abcdef", "fedcba9876543210");
        let held = |id, base, messages: &[&str]| turn(&views, id, base, messages).unwrap().held;
        let first = held(a, 0, &["a", "b"]);
        assert_eq!(first.base, 0);
        assert_ne!(first.lineage, 0);
        assert_eq!(held(a, 2, &["c"]), HeldPrefix { base: 2, ..first });
        assert_eq!(held(a, 3, &[]), HeldPrefix { base: 3, ..first });
        let other = held(b, 0, &["a"]);
        assert_ne!(other.lineage, first.lineage);
        let again = held(a, 0, &["a", "b"]);
        assert_ne!(again.lineage, first.lineage, "sent whole: a new lineage");
        assert_ne!(again.lineage, other.lineage);
        let mut unnamed = ModelRequest::default();
        views.resolve(&mut unnamed, 10).unwrap();
        assert_eq!(unnamed.held, HeldPrefix::default());
    }

    /// A view held again after a call counts for what its whole view takes, though only the
    /// messages the call added were measured.
    #[test]
    fn a_held_view_counts_for_its_whole_footprint() {
        let views = Views::default();
        let id = "0123456789abcdef";
        let args = json!({"q": "x".repeat(40), "n": [1, 2, 3]});
        let call = Message::assistant_tool_calls(&[cyrene_protocol::message::ToolCall {
            id: "call_1".into(),
            name: "search".into(),
            args: args.as_object().unwrap().clone(),
            args_error: None,
        }]);
        let mut request = viewed(id, 0, &["a question", "more"]);
        let held = views.resolve(&mut request, 100).unwrap().unwrap();
        views.hold(held, request.messages);
        let mut next = viewed(id, 2, &[]);
        next.messages.push(call);
        next.messages
            .push(Message::tool_result("call_1", "search", "found it", false));
        let held = views.resolve(&mut next, 100).unwrap().unwrap();
        let whole = next.messages.clone();
        let capacity = next.messages.capacity();
        views.hold(held, next.messages);
        let counted = views.held.lock().unwrap().current[id].1;
        let expected = HELD_SLOT
            + id.len()
            + ALLOCATION
            + capacity * size_of::<Message>()
            + ALLOCATION
            + whole
                .iter()
                .map(|m| footprint(m) - size_of::<Message>())
                .sum::<usize>();
        assert_eq!(counted, expected);
    }

    #[test]
    fn a_view_not_held_with_exactly_base_messages_is_not_found_and_nothing_is_assembled() {
        let views = Views::default();
        let id = "0123456789abcdef";
        turn(&views, id, 0, &["a", "b"]).unwrap();
        for (id, base) in [("fedcba9876543210", 2), (id, 1), (id, 3)] {
            let err = turn(&views, id, base, &["c"]).unwrap_err();
            assert_eq!(err.code, ErrorCode::NotFound, "{id} {base}");
            assert!(
                err.message.contains("send the whole view"),
                "{}",
                err.message
            );
        }
        // A miss on the right id with the wrong base dropped what was held: the caller sends the
        // whole view again, so nothing can be extended from a view the caller no longer means.
        assert_eq!(views.held(), 0);
    }

    #[test]
    fn a_view_is_not_continued_past_its_largest_size() {
        let views = Views::default();
        let id = "0123456789abcdef";
        let mut first = viewed(id, 0, &["a"]);
        let held = views
            .resolve(&mut first, LARGEST_VIEW - 10)
            .unwrap()
            .unwrap();
        views.hold(held, first.messages);
        let mut next = viewed(id, 1, &["b"]);
        let err = views.resolve(&mut next, 11).unwrap_err();
        assert_eq!(err.code, ErrorCode::NotFound);
        assert!(
            err.message.contains("send the whole view"),
            "{}",
            err.message
        );
        assert_eq!(views.held(), 0, "nothing is held past the limit");
    }

    #[test]
    fn a_view_id_is_checked() {
        let views = Views::default();
        for id in [
            "short",
            "has space inside",
            "dots.are.not.ok",
            &"x".repeat(65),
        ] {
            let err = turn(&views, id, 0, &["a"]).unwrap_err();
            assert_eq!(err.code, ErrorCode::BadRequest, "{id}");
        }
    }

    #[test]
    fn no_view_named_nothing_held() {
        let views = Views::default();
        let mut request = ModelRequest::default();
        assert!(views.resolve(&mut request, 10).unwrap().is_none());
        assert_eq!(views.held(), 0);
    }
}
