//! The crate's integration tests, one binary (one link, one set of codegen units): each
//! module is one former test file; run one with `cargo test -p hilum-server --test it MODULE::`.

#[macro_use]
mod common;
mod pacs_node;
mod pacs_peers;
mod server_api;
mod server_db;
mod server_db_tls;
mod server_mcp;
mod ui_browser;
