//! One tool of a remote MCP server as a toolbox tool: its arguments go out (with pixels only
//! where the server is allowed them), its result comes back as a summary, JSON and artifacts.

use std::sync::Arc;

use async_trait::async_trait;
use base64::Engine;
use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool as McpTool};
use serde_json::{json, Value};

use hilum_agent::coverage::{asked, ANY_TOPIC};
use hilum_agent::{Artifact, Capability, Tool, ToolContext, ToolError, ToolOutput, ToolSpec};
use hilum_imaging::{CxrImage, ImageStore};

use super::{namespaced, Server, CAPABILITIES_META, LOAD_IMAGE};

/// A remote tool in the toolbox, named `server__tool`.
pub struct RemoteTool {
    server: Arc<Server>,
    remote_name: String,
    spec: ToolSpec,
    images: Arc<ImageStore>,
    capabilities: Vec<Capability>,
}

impl RemoteTool {
    pub(crate) fn new(
        server: Arc<Server>,
        tool: &McpTool,
        images: Arc<ImageStore>,
    ) -> Result<Self, String> {
        let name = namespaced(server.name(), &tool.name).ok_or_else(|| {
            format!(
                "MCP tool `{}` of `{}` left out: its name does not fit 64 characters",
                tool.name,
                server.name()
            )
        })?;
        let description = format!(
            "{} (tool `{}` of the MCP server `{}`)",
            tool.description.as_deref().unwrap_or("").trim(),
            tool.name,
            server.name()
        );
        let spec = ToolSpec {
            name,
            description: description.trim_start().to_string(),
            parameters: Value::Object((*tool.input_schema).clone()),
        };
        Ok(RemoteTool {
            remote_name: tool.name.to_string(),
            capabilities: capabilities_of(tool),
            server,
            spec,
            images,
        })
    }

    /// The name of the server the tool lives on.
    pub fn server(&self) -> &str {
        self.server.name()
    }

    /// Sends the de-identified PNG of image `local` through the server's `load_image`;
    /// returns the server's id for it.
    async fn upload(&self, local: &str) -> Result<String, ToolError> {
        let img = self
            .images
            .get(local)
            .map_err(|e| ToolError::NotFound(format!("image `{local}`: {e}")))?;
        let png = model_png(&img)?;
        let mut args = JsonObject::new();
        args.insert(
            "data_base64".into(),
            Value::String(base64::engine::general_purpose::STANDARD.encode(png)),
        );
        let r = self
            .server
            .call(LOAD_IMAGE, args)
            .await
            .map_err(ToolError::Unprocessable)?;
        let text = texts(&r).join("\n");
        if r.is_error == Some(true) {
            return Err(ToolError::Unprocessable(format!(
                "MCP server `{}` did not take image `{local}`: {text}",
                self.server()
            )));
        }
        r.structured_content
            .as_ref()
            .and_then(|s| s["id"].as_str())
            .map(str::to_string)
            .or_else(|| {
                text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .find(|w| w.starts_with("img_"))
                    .map(str::to_string)
            })
            .ok_or_else(|| {
                ToolError::Unprocessable(format!(
                    "MCP server `{}`'s load_image returned no image id",
                    self.server()
                ))
            })
    }
}

#[async_trait]
impl Tool for RemoteTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn capabilities(&self) -> Vec<Capability> {
        self.capabilities.clone()
    }

    async fn call(&self, _ctx: &ToolContext, mut args: Value) -> Result<ToolOutput, ToolError> {
        // Remote id → our id, to speak of images by our ids in what comes back.
        let mut renamed = Vec::new();
        if self.server.config().allow_pixels && self.server.offers(LOAD_IMAGE) {
            let mut ids = Vec::new();
            collect_image_ids(&args, &self.images, &mut ids);
            for local in ids {
                let remote = self.upload(&local).await?;
                replace_strings(&mut args, &local, &remote);
                renamed.push((remote, local));
            }
        }
        let Value::Object(args) = args else {
            return Err(ToolError::InvalidArguments(
                "arguments must be a JSON object".into(),
            ));
        };
        let result = self
            .server
            .call(&self.remote_name, args)
            .await
            .map_err(ToolError::Unprocessable)?;
        let limit = self.server.config().max_result_bytes();
        let mut out = to_output(self.server(), &self.remote_name, result, limit)?;
        for (remote, local) in &renamed {
            out.summary = out.summary.replace(remote.as_str(), local);
            replace_strings(&mut out.data, remote, local);
        }
        Ok(out)
    }
}

/// What a remote tool answers: the topics a remote Hilum declares in its `_meta` (ids this
/// version knows; the remote checked its models), else the topics its name and description
/// name, matched as a question is. A description that names no finding covers none.
fn capabilities_of(tool: &McpTool) -> Vec<Capability> {
    let vocabulary = crate::topics::vocabulary();
    let declared = tool.meta.as_ref().and_then(|m| m.0.get(CAPABILITIES_META));
    let topics = match declared {
        Some(list) => list
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["topic"].as_str())
            .filter_map(|id| {
                if id == ANY_TOPIC.id {
                    Some(&ANY_TOPIC)
                } else {
                    vocabulary.iter().copied().find(|t| t.id == id)
                }
            })
            .collect(),
        None => {
            let name = tool.name.replace(['_', '-', '.'], " ");
            let text = format!("{name}. {}", tool.description.as_deref().unwrap_or(""));
            asked(&text, &vocabulary)
        }
    };
    let mut out: Vec<Capability> = Vec::new();
    for topic in topics {
        if !out.iter().any(|c| std::ptr::eq(c.topic, topic)) {
            out.push(Capability::new(topic, &[]));
        }
    }
    out
}

/// The PNG a reasoning model is shown of `img` (`hilum_imaging::model_view_png`: grey, 8-bit,
/// longest side at most 1024 px, no metadata).
fn model_png(img: &CxrImage) -> Result<Vec<u8>, ToolError> {
    hilum_imaging::model_view_png(img)
        .map_err(|e| ToolError::Internal(format!("cannot encode the image: {e}")))
}

/// The ids of images in `store` named anywhere in `v`, each once.
fn collect_image_ids(v: &Value, store: &ImageStore, out: &mut Vec<String>) {
    match v {
        Value::String(s) if s.starts_with("img_") && !out.contains(s) && store.get(s).is_ok() => {
            out.push(s.clone())
        }
        Value::Array(a) => a.iter().for_each(|x| collect_image_ids(x, store, out)),
        Value::Object(m) => m.values().for_each(|x| collect_image_ids(x, store, out)),
        _ => {}
    }
}

/// Replaces `from` by `to` in every string of `v`.
fn replace_strings(v: &mut Value, from: &str, to: &str) {
    match v {
        Value::String(s) if s.contains(from) => *s = s.replace(from, to),
        Value::Array(a) => a.iter_mut().for_each(|x| replace_strings(x, from, to)),
        Value::Object(m) => m.values_mut().for_each(|x| replace_strings(x, from, to)),
        _ => {}
    }
}

fn texts(r: &CallToolResult) -> Vec<String> {
    r.content
        .iter()
        .filter_map(|c| match c {
            ContentBlock::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect()
}

/// Bytes a result brings in: its text, images and structured content.
fn result_size(r: &CallToolResult) -> usize {
    let content: usize = r
        .content
        .iter()
        .map(|c| match c {
            ContentBlock::Text(t) => t.text.len(),
            ContentBlock::Image(i) => i.data.len(),
            ContentBlock::Audio(a) => a.data.len(),
            other => serde_json::to_string(other).map(|s| s.len()).unwrap_or(0),
        })
        .sum();
    let structured = r
        .structured_content
        .as_ref()
        .and_then(|s| serde_json::to_string(s).ok())
        .map_or(0, |s| s.len());
    content + structured
}

/// A remote result as a tool output: text → summary, structured content → data, images →
/// artifacts. Errors, oversized and malformed results become clear tool errors.
fn to_output(
    server: &str,
    tool: &str,
    r: CallToolResult,
    limit: usize,
) -> Result<ToolOutput, ToolError> {
    let size = result_size(&r);
    if size > limit {
        return Err(ToolError::Unprocessable(format!(
            "MCP server `{server}` returned {:.1} MB from `{tool}`, over its {:.1} MB limit \
             (`max_result_mb`); the result was dropped",
            size as f64 / 1e6,
            limit as f64 / 1e6
        )));
    }
    let summary = texts(&r).join("\n");
    if r.is_error == Some(true) {
        return Err(ToolError::Unprocessable(format!(
            "`{tool}` on MCP server `{server}` failed: {summary}"
        )));
    }
    let malformed = |what: String| {
        ToolError::Unprocessable(format!(
            "MCP server `{server}` returned malformed content from `{tool}`: {what}"
        ))
    };
    let mut artifacts = Vec::new();
    for (i, c) in r.content.iter().enumerate() {
        let ContentBlock::Image(img) = c else {
            continue;
        };
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(img.data.trim())
            .map_err(|e| malformed(format!("image #{i} is not base64 ({e})")))?;
        let format = image::guess_format(&bytes)
            .map_err(|_| malformed(format!("image #{i} ({}) is not an image", img.mime_type)))?;
        let ext = format.extensions_str().first().copied().unwrap_or("bin");
        artifacts.push(Artifact {
            name: format!("{tool}_{i}.{ext}"),
            media_type: format.to_mime_type().to_string(),
            kind: "remote".into(),
            bytes: bytes.into(),
        });
    }
    let data = match r.structured_content {
        Some(v) => v,
        None if summary.is_empty() && artifacts.is_empty() => {
            return Err(malformed("no text, structured content or image".into()))
        }
        None => json!({"text": summary}),
    };
    let summary = if summary.is_empty() {
        serde_json::to_string(&data).unwrap_or_default()
    } else {
        summary
    };
    Ok(ToolOutput {
        summary,
        data,
        artifacts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_result(t: &str) -> CallToolResult {
        CallToolResult::success(vec![ContentBlock::text(t.to_string())])
    }

    #[test]
    fn text_becomes_the_summary_and_errors_say_which_server() {
        let out = to_output("ris", "prior", text_result("CTR 0.48"), 1 << 20).unwrap();
        assert_eq!(out.summary, "CTR 0.48");
        assert_eq!(out.data["text"], "CTR 0.48");
        let err = CallToolResult::error(vec![ContentBlock::text("no such patient".to_string())]);
        let e = to_output("ris", "prior", err, 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`ris`") && e.contains("no such patient"), "{e}");
    }

    #[test]
    fn oversized_and_malformed_results_are_refused() {
        let big = text_result(&"x".repeat(2000));
        let e = to_output("s", "t", big, 1000).unwrap_err().to_string();
        assert!(e.contains("over its"), "{e}");
        let bad = CallToolResult::success(vec![ContentBlock::image(
            "not base64!".to_string(),
            "image/png".to_string(),
        )]);
        let e = to_output("s", "t", bad, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("malformed"), "{e}");
        let not_png = CallToolResult::success(vec![ContentBlock::image(
            base64::engine::general_purpose::STANDARD.encode(b"hello"),
            "image/png".to_string(),
        )]);
        assert!(to_output("s", "t", not_png, 1 << 20).is_err());
    }

    fn topics(name: &str, description: &str, meta: Option<Value>) -> Vec<&'static str> {
        let mut tool = McpTool::new(
            name.to_string(),
            description.to_string(),
            Arc::new(JsonObject::new()),
        );
        if let Some(m) = meta {
            let mut obj = JsonObject::new();
            obj.insert(CAPABILITIES_META.into(), m);
            tool.meta = Some(rmcp::model::MetaObject(obj));
        }
        capabilities_of(&tool).iter().map(|c| c.topic.id).collect()
    }

    #[test]
    fn a_site_tool_covers_the_findings_its_description_names() {
        let prior = "The prior radiology report of the patient in `image` (from the RIS).";
        assert_eq!(topics("prior_report", prior, None), ["report"]);
        assert_eq!(
            topics("nodule_ai", "Finds lung nodules and masses.", None),
            ["nodule", "mass"]
        );
        // Its name counts too; a description that names no finding covers nothing.
        assert_eq!(topics("ctr", "Measures it.", None), ["ctr"]);
        assert!(topics("lookup", "Returns the patient's last visit.", None).is_empty());
    }

    #[test]
    fn a_remote_hilums_declared_topics_win_over_its_description() {
        let declared =
            json!([{"topic": "lung_size"}, {"topic": "no_such_topic"}, {"topic": "lung_size"}]);
        assert_eq!(
            topics("segment_lungs", "Draws a pleural effusion.", Some(declared)),
            ["lung_size"]
        );
        assert!(topics("draw", "Finds nodules.", Some(json!([]))).is_empty());
        assert_eq!(topics("vqa", "", Some(json!([{"topic": "*"}]))), ["*"]);
    }

    #[test]
    fn ids_are_renamed_everywhere() {
        let mut v = json!({"image": "img_r", "list": ["a img_r b"], "n": 1});
        replace_strings(&mut v, "img_r", "img_l");
        assert_eq!(v, json!({"image": "img_l", "list": ["a img_l b"], "n": 1}));
    }
}
