//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-cli --test it MODULE::`.

mod cli;
mod common;
mod device_flag;
mod eval;
mod import_no_python;
mod mcp_remote;
mod model_view;
mod pacs_kill9;
mod serve_durable;
mod serve_logs;
mod serve_shared_pool;
