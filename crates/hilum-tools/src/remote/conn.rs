//! One remote MCP server: its connection (a stdio child or streamable HTTP), the tools it
//! listed at start, and a reconnection after the connection is lost.

use std::process::Stdio;
use std::sync::Arc;

use rmcp::model::{CallToolRequestParams, CallToolResult, JsonObject, Tool as McpTool};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;
use tokio::sync::Mutex;

use super::McpServerConfig;

/// A live session; the child (stdio) is killed when the session is dropped.
struct Conn {
    service: RunningService<RoleClient, ()>,
    _child: Option<tokio::process::Child>,
}

/// A remote server the program talks to.
pub struct Server {
    config: McpServerConfig,
    tools: Vec<McpTool>,
    conn: Mutex<Option<Arc<Conn>>>,
}

impl Server {
    /// Connects and lists the tools, within the entry's connect timeout.
    pub(crate) async fn start(config: McpServerConfig) -> Result<Server, String> {
        let limit = config.connect_timeout();
        let started = tokio::time::timeout(limit, async {
            let conn = connect(&config).await?;
            let tools = conn
                .service
                .list_all_tools()
                .await
                .map_err(|e| format!("cannot list its tools: {e}"))?;
            Ok::<_, String>((conn, tools))
        })
        .await
        .map_err(|_| format!("no answer within {} s", limit.as_secs()))??;
        let (conn, tools) = started;
        Ok(Server {
            config,
            tools,
            conn: Mutex::new(Some(Arc::new(conn))),
        })
    }

    /// The entry's name, the prefix of its tools' names.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The entry it was started from.
    pub fn config(&self) -> &McpServerConfig {
        &self.config
    }

    /// The tools it listed at start.
    pub fn tools(&self) -> &[McpTool] {
        &self.tools
    }

    /// Whether it listed a tool of this name.
    pub(crate) fn offers(&self, name: &str) -> bool {
        self.tools.iter().any(|t| t.name == name)
    }

    /// The live session, connecting again when the last one was lost.
    async fn session(&self) -> Result<Arc<Conn>, String> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.service.is_closed()) {
            return Ok(c.clone());
        }
        *slot = None;
        let limit = self.config.connect_timeout();
        let conn = tokio::time::timeout(limit, connect(&self.config))
            .await
            .map_err(|_| format!("no answer within {} s", limit.as_secs()))?
            .map_err(|e| format!("cannot reconnect: {e}"))?;
        let conn = Arc::new(conn);
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Drops `conn` if it is still the current session, so the next call reconnects.
    async fn forget(&self, conn: &Arc<Conn>) {
        let mut slot = self.conn.lock().await;
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *slot = None;
        }
    }

    /// Calls `tool` with `args`. Errors name the server and say what happened.
    pub(crate) async fn call(
        &self,
        tool: &str,
        args: JsonObject,
    ) -> Result<CallToolResult, String> {
        let name = &self.config.name;
        let conn = self
            .session()
            .await
            .map_err(|e| format!("MCP server `{name}` is unreachable: {e}"))?;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
        match conn.service.call_tool(params).await {
            Ok(r) => Ok(r),
            Err(ServiceError::McpError(e)) => Err(format!(
                "MCP server `{name}` refused the call to `{tool}`: {}",
                e.message
            )),
            Err(e) => {
                self.forget(&conn).await;
                Err(format!(
                    "MCP server `{name}` failed during the call to `{tool}` ({}); it is connected \
                     again on its next call",
                    explain(&e.to_string())
                ))
            }
        }
    }
}

/// Plain words for the transport errors people meet.
fn explain(error: &str) -> String {
    // rmcp's transport errors start with the transport's full type name: keep what follows.
    let error = error.rsplit("] error: ").next().unwrap_or(error);
    if error.contains("401") || error.contains("Auth") || error.contains("403") {
        format!("the server refused the bearer token: check `token` / `token_env`; {error}")
    } else {
        error.to_string()
    }
}

async fn connect(cfg: &McpServerConfig) -> Result<Conn, String> {
    if let Some(command) = &cfg.command {
        let mut cmd = tokio::process::Command::new(command);
        // The child gets only what its entry names: no tokens, keys or paths of ours.
        cmd.args(&cfg.args)
            .env_clear()
            .envs(&cfg.env)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot start `{command}`: {e}"))?;
        let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
            return Err(format!("`{command}` has no stdin/stdout"));
        };
        // Big enough that a result over the entry's limit still arrives and is refused with
        // its size (rmcp drops a longer line silently and the call would wait to its timeout);
        // text and structured content often carry the same payload twice.
        let line_limit = (8 * cfg.max_result_bytes()).max(16 << 20);
        let transport =
            AsyncRwTransport::new_client(stdout, stdin).with_max_line_length(line_limit);
        let service = ()
            .serve(transport)
            .await
            .map_err(|e| format!("the MCP handshake with `{command}` failed: {e}"))?;
        return Ok(Conn {
            service,
            _child: Some(child),
        });
    }
    let url = cfg.url.as_deref().unwrap_or_default();
    // reqwest (through rmcp) is built without a TLS provider of its own: use ring, as the
    // rest of the program does.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut http = StreamableHttpClientTransportConfig::with_uri(url.to_string());
    if let Some(token) = cfg.bearer() {
        http = http.auth_header(token);
    }
    let service =
        ().serve(StreamableHttpClientTransport::from_config(http))
            .await
            .map_err(|e| {
                format!(
                    "the MCP handshake with {url} failed: {}",
                    explain(&e.to_string())
                )
            })?;
    Ok(Conn {
        service,
        _child: None,
    })
}
