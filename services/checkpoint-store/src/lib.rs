//! The checkpoint-store service (work in progress).
