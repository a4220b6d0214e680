//! `hilum tools`: list the tools, or call one directly without any model.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Subcommand;
use serde_json::{json, Value};

use hilum_agent::{Environment, ToolCall, ToolContext};
use hilum_imaging::ImageStore;

use crate::render::write_artifacts;

#[derive(Subcommand)]
pub enum ToolsCmd {
    /// List the tools with their descriptions (and JSON Schemas with --json).
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        mcp: crate::remote::McpFlag,
    },
    /// Call one tool and print its JSON output. Exits non-zero when the call fails.
    #[command(
        after_help = "Example: hilum tools call image_info --image chest.png\n\
--image ingests the file and fills the tool's image argument with its id when --args leaves it out."
    )]
    Call {
        /// Tool name, as in `hilum tools list`.
        name: String,
        /// Arguments as a JSON object.
        #[arg(long, default_value = "{}")]
        args: String,
        /// Image files to ingest (PNG, JPEG, DICOM).
        #[arg(long)]
        image: Vec<PathBuf>,
        /// Write artifacts (masks, overlays) into this folder; their paths appear in the output.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Seconds before the call is stopped.
        #[arg(long, default_value_t = 300)]
        timeout: u64,
        #[command(flatten)]
        devices: crate::config::DeviceFlag,
        #[command(flatten)]
        mcp: crate::remote::McpFlag,
    },
}

pub async fn run(cmd: ToolsCmd) -> anyhow::Result<()> {
    let store = Arc::new(ImageStore::default());
    let file = crate::config::load_file(None)?;
    let deps = crate::config::tool_deps(store.clone(), file.vlm)?;
    let mut toolbox = crate::toolbox(&deps)?;
    let flag = match &cmd {
        ToolsCmd::List { mcp, .. } | ToolsCmd::Call { mcp, .. } => mcp,
    };
    let remote = crate::remote::connect(&file.mcp, flag).await?;
    crate::remote::add(&mut toolbox, remote.as_deref(), &store);
    // Remote tools' servers, by toolbox name.
    let servers: std::collections::BTreeMap<String, String> = remote
        .as_deref()
        .map(|r| r.listing())
        .unwrap_or_default()
        .into_iter()
        .map(|l| (l.name, l.server))
        .collect();
    let env = Environment::default();
    match cmd {
        ToolsCmd::List { json, .. } => {
            let specs = toolbox.specs(&env);
            if json {
                // Each spec with what the tool declares it needs and what of that is missing here.
                let facts = hilum_tools::environment(&deps, &[]);
                let listed: Vec<Value> = specs
                    .iter()
                    .map(|s| {
                        let tool = toolbox.get(&s.name);
                        let req = tool.as_ref().map(|t| t.requirements()).unwrap_or_default();
                        // The topics it answers (see `hilum_agent::coverage`).
                        let topics: Vec<&str> = tool
                            .iter()
                            .flat_map(|t| t.capabilities())
                            .map(|c| c.topic.id)
                            .collect();
                        json!({
                            "name": s.name,
                            "description": s.description,
                            "parameters": s.parameters,
                            "requirements": req,
                            "unmet": req.unmet(&facts),
                            "server": servers.get(&s.name),
                            "capabilities": topics,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&listed)?);
            } else {
                for s in specs {
                    match servers.get(&s.name) {
                        Some(server) => println!(
                            "{}  [MCP server `{server}`]\n    {}\n",
                            s.name, s.description
                        ),
                        None => println!("{}\n    {}\n", s.name, s.description),
                    }
                }
            }
            Ok(())
        }
        ToolsCmd::Call {
            name,
            args,
            image,
            out,
            timeout,
            ..
        } => {
            let mut args: Value = serde_json::from_str(&args)
                .context("--args must be a JSON object, e.g. '{\"image\": \"img_…\"}'")?;
            let mut ids = Vec::new();
            for path in &image {
                ids.push(
                    store
                        .ingest_file(path)
                        .with_context(|| format!("cannot use {}", path.display()))?,
                );
            }
            fill_image_args(&toolbox, &env, &name, &mut args, &ids)?;
            let call = ToolCall::new("cli", &name, &args);
            let ctx = ToolContext {
                call_id: "cli".into(),
                ..Default::default()
            };
            let result = toolbox
                .execute(&call, &env, ctx, Duration::from_secs(timeout))
                .await;
            match result.result {
                Ok(output) => {
                    let paths = match &out {
                        Some(dir) => write_artifacts(dir, "cli", &output.artifacts)?,
                        None => vec![],
                    };
                    let printed = json!({
                        "tool": name,
                        "ms": result.ms,
                        "summary": output.summary,
                        "data": output.data,
                        "artifacts": output.artifacts.iter().map(|a| json!({
                            "name": a.name, "kind": a.kind, "media_type": a.media_type, "bytes": a.bytes.len()
                        })).collect::<Vec<_>>(),
                        "artifact_paths": paths,
                    });
                    println!("{}", serde_json::to_string_pretty(&printed)?);
                    Ok(())
                }
                Err(f) => anyhow::bail!("{} ({})", f.message, f.kind.as_str()),
            }
        }
    }
}

/// Puts the ingested image ids into the tool's image arguments that `--args` left out:
/// a string property named like `image` gets the first id, an array one gets all.
pub(crate) fn fill_image_args(
    toolbox: &hilum_agent::Toolbox,
    env: &Environment,
    name: &str,
    args: &mut Value,
    ids: &[String],
) -> anyhow::Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    let spec = toolbox
        .specs(env)
        .into_iter()
        .find(|s| s.name == name)
        .with_context(|| format!("no tool named `{name}`; see `hilum tools list`"))?;
    let obj = args
        .as_object_mut()
        .context("--args must be a JSON object")?;
    if let Some(props) = spec.parameters.get("properties").and_then(Value::as_object) {
        for (key, schema) in props {
            if obj.contains_key(key) || !key.starts_with("image") {
                continue;
            }
            match schema.get("type").and_then(Value::as_str) {
                Some("string") => {
                    obj.insert(key.clone(), json!(ids[0]));
                }
                Some("array") => {
                    obj.insert(key.clone(), json!(ids));
                }
                _ => {}
            }
        }
    }
    Ok(())
}
