//! `[[mcp.servers]]` and `--mcp`: other MCP servers whose tools join the toolbox
//! (`hilum_tools::remote`). Connected once per command; a server that is down is reported on
//! stderr and its tools left out.

use std::sync::Arc;

use hilum_agent::Toolbox;
use hilum_imaging::ImageStore;
use hilum_tools::remote::{merge_entries, McpSection, RemoteServers};

/// The `--mcp` flag of `analyze`, `serve`, `eval` and `tools`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct McpFlag {
    /// Another MCP server whose tools the agent may call, as NAME__TOOL: NAME=URL (streamable
    /// HTTP; bearer token from $HILUM_MCP_<NAME>_TOKEN) or NAME=COMMAND ARG... (stdio, no
    /// environment). Repeatable; adds to (or replaces by name) the config file's
    /// [[mcp.servers]].
    #[arg(long = "mcp", value_name = "NAME=URL|NAME=COMMAND")]
    pub mcp: Vec<String>,
}

/// Connects to the configured servers; `None` when there are none.
pub(crate) async fn connect(
    file: &McpSection,
    flag: &McpFlag,
) -> anyhow::Result<Option<Arc<RemoteServers>>> {
    let mut entries = merge_entries(file, &flag.mcp).map_err(anyhow::Error::msg)?;
    crate::config::mcp_tokens(&mut entries);
    if entries.is_empty() {
        return Ok(None);
    }
    let remote = RemoteServers::connect(entries).await;
    for p in &remote.problems {
        eprintln!("hilum: {p}");
    }
    // The tools that cannot join (a name too long, a schema that does not compile), once.
    for p in remote.register(&mut Toolbox::new(), &Arc::new(ImageStore::default())) {
        eprintln!("hilum: {p}");
    }
    Ok(Some(Arc::new(remote)))
}

/// Adds the remote tools to `toolbox`, calling with ids of `images`.
pub(crate) fn add(toolbox: &mut Toolbox, remote: Option<&RemoteServers>, images: &Arc<ImageStore>) {
    if let Some(r) = remote {
        // Problems were reported by `connect`.
        let _ = r.register(toolbox, images);
    }
}

/// `factory`'s toolboxes with the remote tools added (`hilum serve`, per tenant).
pub(crate) fn with_remote(
    factory: hilum_server::ToolboxFactory,
    remote: Option<Arc<RemoteServers>>,
) -> hilum_server::ToolboxFactory {
    let Some(remote) = remote else {
        return factory;
    };
    Arc::new(move |images: Arc<ImageStore>| {
        let mut tb = factory(images.clone())?;
        add(&mut tb, Some(&remote), &images);
        Ok(tb)
    })
}
