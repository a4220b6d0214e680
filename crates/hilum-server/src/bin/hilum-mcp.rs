//! `hilum-mcp`: the Hilum toolbox over MCP on stdio, without the rest of the CLI (the same
//! server as `hilum mcp`; handy for MCP client configs and for tests).

use std::time::Duration;

#[tokio::main]
async fn main() {
    // The same variables as `hilum mcp` (HILUM_MODELS_DIR, HILUM_CPU_*, ORT_DYLIB_PATH, ...).
    let mut settings = hilum_tools::ModelSettings::from_vars(|k| std::env::var(k).ok());
    // The devices the pool routes across, as `hilum mcp --device` (a bad list stops here).
    if let Some(list) = std::env::var("HILUM_DEVICE").ok().filter(|v| !v.is_empty()) {
        match list.parse() {
            Ok(devices) => settings.devices = devices,
            Err(e) => {
                eprintln!("hilum-mcp: HILUM_DEVICE: {e}");
                std::process::exit(1);
            }
        }
    }
    settings.apply_process_wide();
    let models = std::sync::Arc::new(hilum_tools::ModelPool::from_settings(settings));
    let result = hilum_server::mcp::serve_stdio(
        &hilum_server::default_toolbox_factory(models),
        hilum_agent::Environment::default(),
        Duration::from_secs(300),
    )
    .await;
    if let Err(e) = result {
        eprintln!("hilum-mcp: {e}");
        std::process::exit(1);
    }
}
