//! The working-memory and memory blocks of the view (docs/memory.md): read from
//! `cyrene.memory.read` once per turn attempt, before the first step, and rendered as system
//! messages after the time block (docs/semantics.md#view-order: instructions, time, working memory,
//! memory).
//!
//! # Invariants
//! - A block is empty (so left out of the view) when there is nothing to show, and when memory
//!   cannot be read: a memory outage never fails or delays a turn beyond its request timeout.
//! - Every entry is one line (line breaks and control characters become spaces), so an entry
//!   cannot start a line of its own inside the block; a block keeps its newest entries within
//!   [`MAX_BLOCK_CHARS`].

use cyrene_protocol::memory::MemoryEntry;

/// Opens the working-memory block (ours: docs/semantics.md#our-wording).
pub const WORKING_MEMORY_HEADER: &str = "[工作记忆] 本会话中记下的事：";
/// Opens the long-term memory block (ours).
pub const MEMORY_HEADER: &str = "[记忆] 你长期记得的事：";
/// The most characters of entries in one block.
pub const MAX_BLOCK_CHARS: usize = 8000;

fn one_line(text: &str) -> String {
    text.split(|c: char| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}'))
        .filter(|piece| !piece.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}

/// `header`, then one `- entry` line per entry (oldest first), the oldest left out when the
/// entries exceed [`MAX_BLOCK_CHARS`]; empty when there are no entries.
pub fn block(header: &str, entries: &[MemoryEntry]) -> String {
    let mut kept: Vec<String> = Vec::new();
    let mut used = 0;
    for entry in entries.iter().rev() {
        let line = one_line(&entry.text);
        if line.is_empty() {
            continue;
        }
        used += line.chars().count();
        if used > MAX_BLOCK_CHARS {
            break;
        }
        kept.push(line);
    }
    if kept.is_empty() {
        return String::new();
    }
    let mut out = header.to_owned();
    for line in kept.iter().rev() {
        out.push_str("\n- ");
        out.push_str(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: &str) -> MemoryEntry {
        MemoryEntry {
            id: "m-1".into(),
            text: text.into(),
            created_unix_ms: 0,
            source: None,
        }
    }

    #[test]
    fn entries_become_one_line_each_oldest_first() {
        assert_eq!(block(MEMORY_HEADER, &[]), "");
        assert_eq!(
            block(
                MEMORY_HEADER,
                &[entry("likes oolong"), entry("a\n[发言归属] b")]
            ),
            format!("{MEMORY_HEADER}\n- likes oolong\n- a [发言归属] b")
        );
        assert_eq!(block(MEMORY_HEADER, &[entry(" \n ")]), "");
    }

    #[test]
    fn a_full_block_keeps_the_newest_entries() {
        let entries: Vec<_> = (0..20)
            .map(|i| entry(&format!("{i:02}{}", "x".repeat(998))))
            .collect();
        let out = block(WORKING_MEMORY_HEADER, &entries);
        assert!(out.contains("\n- 19"));
        assert!(out.contains("\n- 12"));
        assert!(!out.contains("\n- 11"));
    }
}
