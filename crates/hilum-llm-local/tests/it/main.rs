//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-llm-local --test it MODULE::`.

mod common;
mod gemma3;
mod gemma3_vlm;
mod local_llm;
