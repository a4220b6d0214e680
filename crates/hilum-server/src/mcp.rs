//! Every Hilum tool over the Model Context Protocol (rmcp): on stdio for `hilum mcp`, and
//! over streamable HTTP at `/mcp` inside `hilum serve` (behind the same bearer tokens).
//!
//! Results carry the tool's summary as text, its JSON as `structuredContent`, and PNG
//! artifacts as image content. An extra tool, `load_image`, brings an image into the store
//! (a local path on stdio, base64 bytes on both transports) and returns its id.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    JsonObject, ListToolsResult, MetaObject, PaginatedRequestParams, ServerCapabilities,
    ServerConfig, Tool as McpTool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Value};
use tracing::Instrument;

use hilum_agent::coverage::capability_table;
use hilum_agent::{Artifact, Capability, Environment, ToolCall, ToolContext, ToolSpec};
use hilum_imaging::ImageStore;
use hilum_tools::remote::{capabilities_meta, CAPABILITIES_META};

use crate::api::{direct_call, ingest};
use crate::db::Caller;
use crate::request_id::RequestId;
use crate::{AppState, Space, ToolboxFactory};

const LOAD_IMAGE: &str = "load_image";

#[derive(Clone)]
enum Backend {
    /// `hilum mcp`: one local user, an in-memory store, nothing persisted.
    Local {
        space: Arc<Space>,
        env: Environment,
        timeout: Duration,
    },
    /// `/mcp` in `hilum serve`: the caller's space, calls recorded and audited.
    Http { state: AppState },
}

/// The MCP server handler.
#[derive(Clone)]
pub struct HilumMcp {
    backend: Backend,
}

impl HilumMcp {
    /// A stdio server over its own image store.
    pub fn local(
        toolbox: &ToolboxFactory,
        env: Environment,
        timeout: Duration,
    ) -> Result<Self, String> {
        let images = Arc::new(ImageStore::default());
        let toolbox = Arc::new(toolbox(images.clone())?);
        Ok(HilumMcp {
            backend: Backend::Local {
                space: Arc::new(Space { images, toolbox }),
                env,
                timeout,
            },
        })
    }

    fn http(state: AppState) -> Self {
        HilumMcp {
            backend: Backend::Http { state },
        }
    }

    fn load_image_spec(&self) -> ToolSpec {
        let local = matches!(self.backend, Backend::Local { .. });
        let mut properties = json!({
            "data_base64": {"type": "string", "description": "The file's bytes (PNG, JPEG, DICOM), base64-encoded"}
        });
        if local {
            properties["path"] =
                json!({"type": "string", "description": "Path of an image file on this machine"});
        }
        ToolSpec {
            name: LOAD_IMAGE.into(),
            description: format!(
                "Load a chest radiograph into Hilum and get its image id (img_...) for the other tools. \
                 Give {}.",
                if local { "`path` or `data_base64`" } else { "`data_base64`" }
            ),
            parameters: json!({"type": "object", "properties": properties, "additionalProperties": false}),
        }
    }

    async fn space(&self, caller: Option<&Caller>) -> Result<Arc<Space>, ErrorData> {
        match (&self.backend, caller) {
            (Backend::Local { space, .. }, _) => Ok(space.clone()),
            (Backend::Http { state }, Some(c)) => state
                .space(c)
                .await
                .map_err(|e| ErrorData::internal_error(e.to_string(), None)),
            (Backend::Http { .. }, None) => Err(unauthorized()),
        }
    }

    fn env(&self) -> Environment {
        match &self.backend {
            Backend::Local { env, .. } => env.clone(),
            Backend::Http { state } => state.cfg.env.clone(),
        }
    }

    async fn load_image(
        &self,
        caller: Option<&Caller>,
        args: &Value,
    ) -> Result<CallToolResult, ErrorData> {
        let bytes = if let Some(b64) = args.get("data_base64").and_then(Value::as_str) {
            match base64::engine::general_purpose::STANDARD.decode(b64.trim()) {
                Ok(b) => b,
                Err(e) => {
                    return Ok(tool_error(format!(
                        "`data_base64` is not valid base64: {e}"
                    )))
                }
            }
        } else if let (Some(path), Backend::Local { .. }) =
            (args.get("path").and_then(Value::as_str), &self.backend)
        {
            match tokio::fs::read(path).await {
                Ok(b) => b,
                Err(e) => return Ok(tool_error(format!("cannot read `{path}`: {e}"))),
            }
        } else {
            return Ok(tool_error(
                "give `data_base64` (or `path` with `hilum mcp`)".to_string(),
            ));
        };
        let space = self.space(caller).await?;
        let row = match (&self.backend, caller) {
            (Backend::Http { state }, Some(c)) => {
                match ingest(
                    state,
                    c,
                    &space,
                    bytes.into(),
                    "application/octet-stream".into(),
                )
                .await
                {
                    Ok(row) => json!(row),
                    Err(e) => return Ok(tool_error(e.to_string())),
                }
            }
            _ => {
                let store = space.images.clone();
                let decoded = tokio::task::spawn_blocking(move || {
                    let id = store.ingest_bytes(bytes.into(), "image")?;
                    store.get(&id).map(|img| (id, img))
                })
                .await
                .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
                match decoded {
                    Ok((id, img)) => json!({"id": id, "width": img.width, "height": img.height,
                        "bit_depth": img.meta.bit_depth, "format": img.meta.format}),
                    Err(e) => return Ok(tool_error(e.to_string())),
                }
            }
        };
        let id = row["id"].as_str().unwrap_or_default().to_string();
        let mut result =
            CallToolResult::success(vec![ContentBlock::text(format!("Loaded image {id}."))]);
        result.structured_content = Some(row);
        Ok(result)
    }
}

fn unauthorized() -> ErrorData {
    ErrorData::invalid_request("missing or invalid bearer token", None)
}

fn tool_error(message: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message)])
}

fn to_mcp_tool(spec: &ToolSpec) -> McpTool {
    let schema: JsonObject = spec.parameters.as_object().cloned().unwrap_or_default();
    McpTool::new(
        spec.name.clone(),
        spec.description.clone(),
        Arc::new(schema),
    )
}

/// Summary as text, data as structured content, PNG artifacts as images.
fn success(summary: &str, data: Value, artifacts: &[Artifact]) -> CallToolResult {
    let mut content = vec![ContentBlock::text(summary.to_string())];
    for a in artifacts
        .iter()
        .filter(|a| a.media_type.starts_with("image/"))
    {
        content.push(ContentBlock::image(
            base64::engine::general_purpose::STANDARD.encode(&a.bytes),
            a.media_type.clone(),
        ));
    }
    let mut result = CallToolResult::success(content);
    // MCP wants an object here; wrap anything else.
    result.structured_content = Some(if data.is_object() {
        data
    } else {
        json!({"value": data})
    });
    result
}

/// The id of the HTTP request that carried this MCP request.
fn request_id_of(ctx: &RequestContext<RoleServer>) -> Option<RequestId> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<RequestId>())
        .cloned()
}

/// The caller that the auth middleware put on the HTTP request.
fn caller_of(ctx: &RequestContext<RoleServer>) -> Option<Caller> {
    ctx.extensions
        .get::<axum::http::request::Parts>()
        .and_then(|p| p.extensions.get::<Caller>())
        .cloned()
}

impl ServerHandler for HilumMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("hilum", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Chest X-ray tools. Call load_image first to get an image id, then pass the id to the other tools.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        ctx: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let caller = caller_of(&ctx);
        let space = self.space(caller.as_ref()).await?;
        let env = self.env();
        let mut tools = vec![to_mcp_tool(&self.load_image_spec())];
        for spec in space.toolbox.specs(&env) {
            let mut tool = to_mcp_tool(&spec);
            // What it can answer here, so a client Hilum's coverage check counts it.
            if let Some(t) = space.toolbox.get(&spec.name) {
                let ready: Vec<Capability> = capability_table(&[t], &env)
                    .into_iter()
                    .filter(|r| r.ready)
                    .map(|r| r.capability)
                    .collect();
                let mut meta = JsonObject::new();
                meta.insert(CAPABILITIES_META.into(), capabilities_meta(&ready));
                tool.meta = Some(MetaObject(meta));
            }
            tools.push(tool);
        }
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        // rmcp runs the call on the MCP session's task, outside the HTTP request's span.
        let span = crate::request_id::span_for(request_id_of(&ctx).as_ref());
        self.run_tool_call(request, ctx).instrument(span).await
    }
}

impl HilumMcp {
    async fn run_tool_call(
        &self,
        request: CallToolRequestParams,
        ctx: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let caller = caller_of(&ctx);
        let args = Value::Object(request.arguments.unwrap_or_default());
        let name = request.name.to_string();
        if name == LOAD_IMAGE {
            return self
                .load_image(caller.as_ref(), &args)
                .await
                .map(Into::into);
        }
        let result = match &self.backend {
            Backend::Http { state } => {
                let caller = caller.ok_or_else(unauthorized)?;
                match direct_call(state, &caller, &name, args).await {
                    Ok(r) if r.ok => success(&r.summary, r.data, &r.artifact_bytes),
                    Ok(r) => tool_error(
                        r.error
                            .as_ref()
                            .and_then(|e| e["message"].as_str())
                            .unwrap_or("the tool failed")
                            .to_string(),
                    ),
                    Err(crate::ApiError::NotFound(m)) => {
                        return Err(ErrorData::invalid_params(m, None))
                    }
                    Err(e) => return Err(ErrorData::internal_error(e.to_string(), None)),
                }
            }
            Backend::Local {
                space,
                env,
                timeout,
            } => {
                if space.toolbox.get(&name).is_none() {
                    return Err(ErrorData::invalid_params(
                        format!("there is no tool named `{name}`"),
                        None,
                    ));
                }
                let call = ToolCall::new(format!("mcp_{}", ctx.id), &name, &args);
                let tctx = ToolContext {
                    session_id: String::new(),
                    call_id: call.id.clone(),
                    round: 0,
                };
                let r = space.toolbox.execute(&call, env, tctx, *timeout).await;
                match r.result {
                    Ok(out) => success(&out.summary, out.data, &out.artifacts),
                    Err(f) => tool_error(f.message),
                }
            }
        };
        Ok(result.into())
    }
}

/// Serves MCP on stdin/stdout until the client closes it.
pub async fn serve_stdio(
    toolbox: &ToolboxFactory,
    env: Environment,
    timeout: Duration,
) -> Result<(), String> {
    let handler = HilumMcp::local(toolbox, env, timeout)?;
    let running = handler
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| format!("MCP handshake failed: {e}"))?;
    running
        .waiting()
        .await
        .map_err(|e| format!("MCP server stopped: {e}"))?;
    Ok(())
}

/// The streamable HTTP endpoint mounted at `/mcp`.
pub(crate) fn http_service(
    state: AppState,
) -> StreamableHttpService<HilumMcp, LocalSessionManager> {
    let mut config = StreamableHttpServerConfig::default()
        .with_max_request_body_bytes(state.cfg.max_upload_bytes.max(state.cfg.max_json_bytes));
    if !state.cfg.bind.ip().is_loopback() {
        // Host checks guard a server on localhost against DNS rebinding; an exposed server
        // is reached by names we cannot know, and tokens guard it.
        config = config.disable_allowed_hosts();
    }
    StreamableHttpService::new(
        move || Ok(HilumMcp::http(state.clone())),
        std::sync::Arc::new(LocalSessionManager::default()),
        config,
    )
}
