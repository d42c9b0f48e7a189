//! A PDF bomb costs the worker a bounded amount of memory and reads as "could not extract"
//! (docs/security.md, "PDF extraction"; issue 30, H2). The test binary counts every heap byte
//! (a wrapper around the system allocator) so the bound is measured, not assumed.
#![allow(clippy::unwrap_used, clippy::expect_used, unsafe_code)]

use cyrene_test_support::pdf::{pdf_bomb, tiny_pdf};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes live and the most live at once.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to `System` unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            if new_size >= layout.size() {
                let grown = new_size - layout.size();
                let live = LIVE.fetch_add(grown, Ordering::Relaxed) + grown;
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// One measurement at a time (the test harness runs tests on several threads).
static MEASURING: Mutex<()> = Mutex::new(());

/// What `f` returns and the most heap bytes it held at once above what was live before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let _one = MEASURING.lock().unwrap_or_else(|p| p.into_inner());
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(before))
}

const MIB: usize = 1024 * 1024;

#[test]
fn a_pdf_bomb_is_not_extracted_and_costs_bounded_memory() {
    // 900,000 empty `Tj`s: a ~10 KB file that an unbounded extractor decodes into ~500 MB.
    let bomb = pdf_bomb(900_000);
    assert!(bomb.len() < 64 * 1024, "{} bytes", bomb.len());
    let (text, peak) = peak_of(|| cyrene_loop_worker::documents::pdf_text(&bomb));
    assert_eq!(text, None, "a bomb reads as \"could not extract\"");
    assert!(peak < 48 * MIB, "the extraction held {} MiB", peak / MIB);
    // Deterministic: the same file gives the same answer again.
    assert_eq!(cyrene_loop_worker::documents::pdf_text(&bomb), None);
}

#[test]
fn an_ordinary_pdf_still_reads() {
    let (text, peak) = peak_of(|| cyrene_loop_worker::documents::pdf_text(&tiny_pdf("Hello 42")));
    assert!(text.unwrap().contains("Hello 42"));
    assert!(peak < 8 * MIB, "{peak} bytes");
}
