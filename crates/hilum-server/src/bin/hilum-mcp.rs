//! `hilum-mcp`: the Hilum toolbox over MCP on stdio, without the rest of the CLI (the same
//! server as `hilum mcp`; handy for MCP client configs and for tests).

use std::time::Duration;

#[tokio::main]
async fn main() {
    let result = hilum_server::mcp::serve_stdio(
        &hilum_server::default_toolbox_factory(),
        hilum_agent::Environment::default(),
        Duration::from_secs(300),
    )
    .await;
    if let Err(e) = result {
        eprintln!("hilum-mcp: {e}");
        std::process::exit(1);
    }
}
