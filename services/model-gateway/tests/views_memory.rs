//! The gateway's caches stay bounded by what they take in memory, not by the JSON text they came
//! as (issue 30, L7): many tiny messages and deeply nested tool arguments take many times their
//! text once decoded. An allocator that counts this thread's live bytes measures it.

// The counting allocator below is the one unsafe code here: it forwards to the system allocator
// unchanged (the `GlobalAlloc` contract is the caller's, passed through as is).
#![allow(unsafe_code)]

use cyrene_model_gateway::views::{GENERATION_BYTES, Views, footprint};
use cyrene_protocol::message::Message;
use cyrene_protocol::model::{ModelRequest, ViewRef};
use serde_json::json;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Bytes this thread allocated and has not freed.
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.with(|l| l.set(l.get() + layout.size() as isize));
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.with(|l| l.set(l.get() - layout.size() as isize));
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.with(|l| l.set(l.get() + new_size as isize - layout.size() as isize));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> isize {
    LIVE.with(Cell::get)
}

/// Tiny messages, each different, and tool calls whose arguments nest.
fn message(i: usize) -> serde_json::Value {
    match i % 3 {
        0 => json!({"role": "user", "content": format!("{i}")}),
        1 => {
            json!({"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": format!("{i}")}]})
        }
        _ => json!({"role": "assistant", "content": [{"type": "tool_call", "id": format!("{i}"),
            "name": "t", "args": {"a": [[], [[]], {}, {"b": [1, 2, {}]}], "c": {"": {"": {}}}}}]}),
    }
}

#[test]
fn a_messages_footprint_is_never_below_what_it_takes() {
    for i in 0..30 {
        let text = message(i).to_string();
        let before = live();
        let decoded: Message = serde_json::from_str(&text).unwrap();
        let taken = live() - before;
        assert!(
            footprint(&decoded) as isize >= taken,
            "{text}: footprint {} < {taken} bytes taken",
            footprint(&decoded)
        );
        // And the bound is what makes the caches safe: far above the JSON text for these.
        assert!(footprint(&decoded) > 2 * text.len(), "{text}");
    }
}

#[test]
fn the_caches_stay_under_four_generations_whatever_they_are_sent() {
    let before = live();
    let views = Views::default();
    let batch = 2_000;
    // Tool calls with nested arguments, each about 100 bytes of JSON and over a kilobyte decoded:
    // counted by their text, the caches would keep all of them (about 250 MB).
    for round in 0..60 {
        let messages: Vec<_> = (0..batch)
            .map(|i| message(3 * (round * batch + i) + 2))
            .collect();
        let payload = serde_json::to_vec(&json!({ "messages": messages })).unwrap();
        let mut request: ModelRequest = views.decode(&payload, 64 << 20).unwrap();
        // Every request also asks to hold its view.
        request.view = Some(ViewRef {
            id: format!("view-{round:08}"),
            base: 0,
        });
        let held = views.resolve(&mut request, payload.len()).unwrap().unwrap();
        views.hold(held, request.messages);
    }
    let kept = live() - before;
    assert!(views.kept() > 0 && views.held() > 0);
    assert!(
        kept <= 4 * GENERATION_BYTES as isize,
        "the caches take {kept} bytes, over {}",
        4 * GENERATION_BYTES
    );
}
