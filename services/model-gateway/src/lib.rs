//! The model-gateway service (work in progress).
