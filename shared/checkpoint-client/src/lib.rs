//! Typed client of cyrene-checkpoint-store (work in progress).
