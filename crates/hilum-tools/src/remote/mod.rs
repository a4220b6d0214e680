//! Remote tools: the tools of other MCP servers (a site's own, or another Hilum's), joined to
//! the toolbox under `server__tool` names. The client is rmcp, the official Rust MCP SDK, over
//! a stdio child process or streamable HTTP with a bearer token.
//!
//! What a remote server gets: the call's arguments, in which images are Hilum's ids
//! (`img_…`). Only a server marked `allow_pixels` also gets pixels, as the de-identified 8-bit
//! PNG a reasoning model would be shown, uploaded through its `load_image` tool (Hilum's own
//! MCP server offers one) before the call. A stdio server inherits no environment variable
//! except those its entry names.
//!
//! A server that cannot be reached at start is reported and its tools left out; one that
//! fails during a call fails that call only, and is connected again on its next call.

mod conn;
mod tool;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use hilum_agent::{Tool, Toolbox};
use hilum_imaging::ImageStore;

pub use conn::Server;
pub use tool::RemoteTool;

/// What separates a server's name from its tool's in the toolbox: OpenAI function names allow
/// only `[a-zA-Z0-9_-]{1,64}`, so no dot.
pub const SEPARATOR: &str = "__";

/// The tool a server offers for receiving pixels (Hilum's MCP server has it): `data_base64`
/// in, `{"id": …}` out. It is the client's channel, never offered to the model.
pub const LOAD_IMAGE: &str = "load_image";

/// The key of a tool's `_meta` under which Hilum's MCP server lists the topics the tool can
/// answer now: `[{"topic": "lung_size"}, …]`, ids of [`crate::topics::vocabulary`] (`*`: any
/// question). A client Hilum's coverage check counts them as the remote tool's own.
pub const CAPABILITIES_META: &str = "hilum/capabilities";

/// The `_meta` value for `capabilities` (see [`CAPABILITIES_META`]).
pub fn capabilities_meta(capabilities: &[hilum_agent::Capability]) -> serde_json::Value {
    let mut ids: Vec<&str> = Vec::new();
    for c in capabilities {
        if !ids.contains(&c.topic.id) {
            ids.push(c.topic.id);
        }
    }
    serde_json::Value::Array(
        ids.into_iter()
            .map(|id| serde_json::json!({ "topic": id }))
            .collect(),
    )
}

/// Results larger than this (text, structured content and images together) are refused
/// unless the entry sets `max_result_mb`.
pub const DEFAULT_MAX_RESULT_BYTES: usize = 4_000_000;

/// One `[[mcp.servers]]` entry: a stdio command (`command`, `args`, `env`) or a streamable
/// HTTP endpoint (`url`, `token` or `token_env`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct McpServerConfig {
    /// The prefix of its tools' names (`NAME__tool`): letters, digits, `-` and `_`.
    pub name: String,
    /// The program to start (stdio).
    pub command: Option<String>,
    /// The program's arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// The only environment the program gets.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The streamable HTTP endpoint, e.g. `https://gpu.example.org/mcp`.
    pub url: Option<String>,
    /// The bearer token (prefer `token_env`: config files get copied).
    pub token: Option<String>,
    /// The environment variable holding the bearer token.
    pub token_env: Option<String>,
    /// Send the de-identified PNG of each image a call names (see the module doc).
    #[serde(default)]
    pub allow_pixels: bool,
    /// How long connecting and listing the tools may take (default 20 s).
    pub connect_timeout_secs: Option<u64>,
    /// The largest result accepted, in MB (default 4).
    pub max_result_mb: Option<f64>,
}

/// The `[mcp]` table of the config file.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct McpSection {
    /// One entry per remote server.
    #[serde(default)]
    pub servers: Vec<McpServerConfig>,
}

impl McpServerConfig {
    /// A `--mcp` value: `NAME=URL` (http or https; the token from `$HILUM_MCP_<NAME>_TOKEN`)
    /// or `NAME=COMMAND ARG…` (stdio, split at spaces, no environment).
    pub fn parse_flag(value: &str) -> Result<Self, String> {
        let (name, target) = value
            .split_once('=')
            .ok_or_else(|| format!("--mcp `{value}`: expected NAME=URL or NAME=COMMAND ARG..."))?;
        let name = name.trim().to_string();
        let target = target.trim();
        let mut cfg = McpServerConfig {
            name: name.clone(),
            ..Default::default()
        };
        if target.starts_with("http://") || target.starts_with("https://") {
            cfg.url = Some(target.to_string());
            cfg.token_env = Some(format!(
                "HILUM_MCP_{}_TOKEN",
                name.to_uppercase().replace('-', "_")
            ));
        } else {
            let mut words = target.split_whitespace().map(str::to_string);
            cfg.command = words.next();
            cfg.args = words.collect();
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks what can be checked without connecting.
    pub fn validate(&self) -> Result<(), String> {
        let ok_char = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '_';
        if self.name.is_empty() || self.name.len() > 32 || !self.name.chars().all(ok_char) {
            return Err(format!(
                "MCP server name `{}`: use 1-32 letters, digits, `-` or `_`",
                self.name
            ));
        }
        match (&self.command, &self.url) {
            (Some(c), None) if !c.trim().is_empty() => {}
            (None, Some(u)) if u.starts_with("http://") || u.starts_with("https://") => {}
            (None, Some(u)) => {
                return Err(format!(
                    "MCP server `{}`: url `{u}` is not http:// or https://",
                    self.name
                ))
            }
            _ => {
                return Err(format!(
                    "MCP server `{}`: give either `command` (stdio) or `url` (HTTP)",
                    self.name
                ))
            }
        }
        if self
            .max_result_mb
            .is_some_and(|mb| mb.is_nan() || mb <= 0.0)
        {
            return Err(format!(
                "MCP server `{}`: max_result_mb must be positive",
                self.name
            ));
        }
        Ok(())
    }

    /// `stdio: COMMAND` or the URL, for listings.
    pub fn describe(&self) -> String {
        match (&self.command, &self.url) {
            (Some(c), _) => format!("stdio: {c}"),
            (_, Some(u)) => u.clone(),
            _ => String::new(),
        }
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        Duration::from_secs(self.connect_timeout_secs.unwrap_or(20))
    }

    pub(crate) fn max_result_bytes(&self) -> usize {
        self.max_result_mb
            .map(|mb| (mb * 1e6) as usize)
            .unwrap_or(DEFAULT_MAX_RESULT_BYTES)
    }

    /// The bearer token. The program resolves `token_env` into `token` before connecting (a
    /// library reads no environment).
    pub(crate) fn bearer(&self) -> Option<String> {
        self.token.clone().filter(|t| !t.is_empty())
    }
}

/// The entries of the file with those of `--mcp` flags (a flag replaces the file's entry of
/// the same name), checked.
pub fn merge_entries(file: &McpSection, flags: &[String]) -> Result<Vec<McpServerConfig>, String> {
    let mut entries: Vec<McpServerConfig> = Vec::new();
    let flagged = flags
        .iter()
        .map(|f| McpServerConfig::parse_flag(f))
        .collect::<Result<Vec<_>, _>>()?;
    for e in file.servers.iter().chain(&flagged) {
        e.validate()?;
        entries.retain(|old| old.name != e.name);
        entries.push(e.clone());
    }
    Ok(entries)
}

/// The toolbox name of `server`'s `tool`: `server__tool`, with any character a model provider
/// refuses replaced by `_`; `None` when it would pass 64 characters.
pub fn namespaced(server: &str, tool: &str) -> Option<String> {
    let clean: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = format!("{server}{SEPARATOR}{clean}");
    (!clean.is_empty() && name.len() <= 64).then_some(name)
}

/// The remote servers of one program: those that answered at start, with their tools.
#[derive(Default)]
pub struct RemoteServers {
    servers: Vec<Arc<Server>>,
    /// What went wrong at start, one line per server (unreachable, refused, timed out).
    pub problems: Vec<String>,
}

/// One remote tool as `hilum tools list` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct RemoteListing {
    /// The name models call it by (`SERVER__tool`).
    pub name: String,
    /// The server's name.
    pub server: String,
    /// The tool's name on the server.
    pub remote_name: String,
    /// Its description, as the server sent it.
    pub description: String,
    /// Its arguments' JSON Schema.
    pub parameters: serde_json::Value,
}

impl RemoteServers {
    /// Connects to every entry at once and lists its tools. A server that fails is reported
    /// in [`RemoteServers::problems`] and left out.
    pub async fn connect(entries: Vec<McpServerConfig>) -> RemoteServers {
        let tasks: Vec<_> = entries
            .into_iter()
            .map(|cfg| {
                let name = cfg.name.clone();
                (name, tokio::spawn(Server::start(cfg)))
            })
            .collect();
        let mut out = RemoteServers::default();
        for (name, task) in tasks {
            match task.await {
                Ok(Ok(s)) => out.servers.push(Arc::new(s)),
                Ok(Err(e)) => out
                    .problems
                    .push(format!("MCP server `{name}` left out: {e}")),
                Err(e) => out
                    .problems
                    .push(format!("MCP server `{name}` left out: {e}")),
            }
        }
        out
    }

    /// Whether no server answered.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The servers that answered.
    pub fn servers(&self) -> &[Arc<Server>] {
        &self.servers
    }

    /// One tool per remote tool, over `images` (the store whose ids the calls name).
    fn tools(&self, images: &Arc<ImageStore>) -> (Vec<Arc<dyn Tool>>, Vec<String>) {
        let mut tools: Vec<Arc<dyn Tool>> = Vec::new();
        let mut problems = Vec::new();
        let mut seen = BTreeSet::new();
        for server in &self.servers {
            for t in server.tools() {
                if t.name == LOAD_IMAGE {
                    continue;
                }
                match RemoteTool::new(server.clone(), t, images.clone()) {
                    Ok(tool) if seen.insert(tool.spec().name.clone()) => tools.push(Arc::new(tool)),
                    Ok(tool) => problems.push(format!(
                        "MCP tool `{}` of `{}` left out: another tool has the name `{}`",
                        t.name,
                        server.name(),
                        tool.spec().name
                    )),
                    Err(e) => problems.push(e),
                }
            }
        }
        (tools, problems)
    }

    /// Adds every remote tool to `toolbox`; returns the tools left out and why (a name too
    /// long, a JSON Schema that does not compile).
    pub fn register(&self, toolbox: &mut Toolbox, images: &Arc<ImageStore>) -> Vec<String> {
        let (tools, mut problems) = self.tools(images);
        for tool in tools {
            let name = tool.spec().name.clone();
            if toolbox.get(&name).is_some() {
                problems.push(format!("MCP tool `{name}` left out: the name is taken"));
                continue;
            }
            if let Err(e) = toolbox.register(tool) {
                problems.push(format!("MCP tool left out: {e}"));
            }
        }
        problems
    }

    /// The remote tools as `hilum tools list` shows them.
    pub fn listing(&self) -> Vec<RemoteListing> {
        let (tools, _) = self.tools(&Arc::new(ImageStore::default()));
        tools
            .iter()
            .filter_map(|t| {
                let spec = t.spec();
                let (server, remote) = spec.name.split_once(SEPARATOR)?;
                Some(RemoteListing {
                    name: spec.name.clone(),
                    server: server.to_string(),
                    remote_name: remote.to_string(),
                    description: spec.description.clone(),
                    parameters: spec.parameters.clone(),
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_name_an_http_or_a_stdio_server() {
        let http = McpServerConfig::parse_flag("gpu=https://gpu.example/mcp").unwrap();
        assert_eq!(http.url.as_deref(), Some("https://gpu.example/mcp"));
        assert_eq!(http.token_env.as_deref(), Some("HILUM_MCP_GPU_TOKEN"));
        let stdio = McpServerConfig::parse_flag("ris=python3 ris.py --db x").unwrap();
        assert_eq!(stdio.command.as_deref(), Some("python3"));
        assert_eq!(stdio.args, vec!["ris.py", "--db", "x"]);
        assert!(stdio.env.is_empty());
        assert!(McpServerConfig::parse_flag("no-equals").is_err());
        assert!(McpServerConfig::parse_flag("a.b=python3 x").is_err());
        assert!(McpServerConfig::parse_flag("x=ftp://h/mcp").is_ok_and(|c| c.command.is_some()));
    }

    #[test]
    fn names_fit_model_providers() {
        let re = |s: &str| {
            s.len() <= 64
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        let n = namespaced("ris", "prior.report lookup").unwrap();
        assert_eq!(n, "ris__prior_report_lookup");
        assert!(re(&n));
        assert!(namespaced("ris", &"x".repeat(80)).is_none());
        assert!(namespaced("ris", "").is_none());
    }

    #[test]
    fn a_flag_replaces_the_file_entry_of_its_name() {
        let file = McpSection {
            servers: vec![McpServerConfig {
                name: "gpu".into(),
                url: Some("http://a/mcp".into()),
                allow_pixels: true,
                ..Default::default()
            }],
        };
        let merged = merge_entries(&file, &["gpu=http://b/mcp".into()]).unwrap();
        assert_eq!(merged.len(), 1);
        assert_eq!(merged[0].url.as_deref(), Some("http://b/mcp"));
        assert!(!merged[0].allow_pixels);
        let both = McpServerConfig {
            name: "x".into(),
            url: Some("http://a".into()),
            command: Some("y".into()),
            ..Default::default()
        };
        assert!(both.validate().is_err());
    }
}
