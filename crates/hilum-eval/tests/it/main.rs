//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-eval --test it MODULE::`.

mod common;
mod cxr_bench_script;
mod openai_server;
