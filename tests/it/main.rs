//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum --test it MODULE::`.

mod agent_loop;
mod answers_local;
mod common;
mod env_reads;
mod local_llm_agent;
mod openai_http;
