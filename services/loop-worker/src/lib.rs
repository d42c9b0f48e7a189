//! The loop-worker service (work in progress).
