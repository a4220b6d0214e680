//! OpenAI-compatible chat completions over HTTP with SSE streaming: GPT-4o, Azure OpenAI,
//! vLLM, SGLang, llama.cpp server, Ollama.

use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::{
    Capabilities, ChatDelta, ChatRequest, DeltaStream, FinishReason, Llm, LlmError, Message, Usage,
};

/// Where and how to reach an OpenAI-compatible chat-completions endpoint.
#[derive(Clone, Debug)]
pub struct OpenAiConfig {
    /// Up to and including `/v1`, e.g. `https://api.openai.com/v1`.
    pub base_url: String,
    /// The model name sent with each request.
    pub model: String,
    /// Bearer token; none for servers that need none.
    pub api_key: Option<String>,
    /// Budget of one request, stream included.
    pub timeout: Duration,
    /// Retries on 429, 5xx and connection errors, before any output was streamed.
    pub max_retries: u32,
    /// First backoff; doubled after each retry.
    pub backoff: Duration,
    /// Whether the endpoint may receive pixels (set by the caller's policy).
    pub multimodal: bool,
}

impl Default for OpenAiConfig {
    fn default() -> Self {
        OpenAiConfig {
            base_url: "https://api.openai.com/v1".into(),
            model: "gpt-4o".into(),
            api_key: None,
            timeout: Duration::from_secs(120),
            max_retries: 3,
            backoff: Duration::from_millis(500),
            multimodal: true,
        }
    }
}

/// A model behind an OpenAI-compatible endpoint (OpenAI, vLLM, llama.cpp's server, ...).
pub struct OpenAiLlm {
    config: OpenAiConfig,
    http: reqwest::Client,
}

/// A whole answer, not streamed.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The answer's text.
    pub text: String,
    /// The model the server says answered (the configured one when it does not say).
    pub model: String,
    /// Tokens, when the server reports them.
    pub usage: Option<Usage>,
}

impl OpenAiLlm {
    /// A client for `config`'s endpoint (no request is made yet).
    pub fn new(config: OpenAiConfig) -> Result<Self, LlmError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| LlmError::Other(format!("cannot build the HTTP client: {e}")))?;
        Ok(OpenAiLlm { config, http })
    }

    fn url(&self) -> String {
        format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        )
    }

    /// The request body in the chat-completions format.
    pub fn body(&self, req: &ChatRequest) -> Value {
        let messages: Vec<Value> = req.messages.iter().map(|m| message_json(m, req)).collect();
        let mut body = json!({
            "model": self.config.model,
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if !req.tools.is_empty() {
            body["tools"] = Value::Array(
                req.tools
                    .iter()
                    .map(|t| {
                        json!({"type": "function", "function": {
                            "name": t.name, "description": t.description, "parameters": t.parameters}})
                    })
                    .collect(),
            );
            body["parallel_tool_calls"] = json!(true);
            if req.require_tool {
                body["tool_choice"] = json!("required");
            }
        }
        if let Some(t) = req.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(m) = req.max_tokens {
            body["max_tokens"] = json!(m);
        }
        if !req.stop.is_empty() {
            body["stop"] = json!(req.stop);
        }
        body
    }

    /// One question about one image, answered whole (a vision-language model reading a
    /// radiograph): the image comes before the question, where vision chat templates put it;
    /// no tools, no streaming.
    pub async fn ask_image(
        &self,
        system: Option<&str>,
        image_data_url: &str,
        prompt: &str,
        max_tokens: u32,
        temperature: f32,
    ) -> Result<Completion, LlmError> {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(json!({"role": "system", "content": s}));
        }
        messages.push(json!({
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url}},
                {"type": "text", "text": prompt}
            ]
        }));
        let mut body = json!({
            "model": self.config.model,
            "messages": messages,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "stream": false
        });
        let resp = self.send(&mut body).await?;
        let text = resp
            .text()
            .await
            .map_err(|e| LlmError::StreamCut(root_cause(&e)))?;
        parse_completion(&text, &self.config.model)
    }

    /// Sends `body`, retrying what may succeed on a retry (see [`OpenAiConfig::max_retries`]).
    async fn send(&self, body: &mut Value) -> Result<reqwest::Response, LlmError> {
        let mut attempt = 0;
        let mut wait = self.config.backoff;
        loop {
            match self.send_once(body).await {
                Ok(resp) => return Ok(resp),
                // A server that does not know `tool_choice: "required"` gets the request without it.
                Err((
                    LlmError::Http {
                        status: status @ (400 | 422),
                        ..
                    },
                    _,
                )) if body.get("tool_choice").is_some() => {
                    // Not the endpoint's answer: some servers quote the conversation in errors.
                    tracing::info!(
                        status,
                        "model endpoint refused tool_choice \"required\"; asking without it"
                    );
                    if let Some(o) = body.as_object_mut() {
                        o.remove("tool_choice");
                    }
                }
                Err((err, retry_after)) => {
                    if !err.is_transient() || attempt >= self.config.max_retries {
                        return Err(err);
                    }
                    attempt += 1;
                    let pause = retry_after.unwrap_or(wait);
                    tracing::warn!(
                        attempt,
                        ?pause,
                        error = err.kind(),
                        "model endpoint failed; retrying"
                    );
                    tokio::time::sleep(pause).await;
                    wait *= 2;
                }
            }
        }
    }

    async fn send_once(
        &self,
        body: &Value,
    ) -> Result<reqwest::Response, (LlmError, Option<Duration>)> {
        let mut rb = self
            .http
            .post(self.url())
            .timeout(self.config.timeout)
            .json(body);
        if let Some(key) = &self.config.api_key {
            rb = rb.bearer_auth(key);
        }
        let resp = rb.send().await.map_err(|e| {
            let err = if e.is_timeout() {
                LlmError::Timeout {
                    secs: self.config.timeout.as_secs(),
                }
            } else {
                LlmError::Unreachable {
                    url: self.url(),
                    reason: root_cause(&e),
                }
            };
            (err, None)
        })?;
        let status = resp.status().as_u16();
        if resp.status().is_success() {
            return Ok(resp);
        }
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.trim().parse::<f64>().ok())
            .map(|s| Duration::from_secs_f64(s.clamp(0.0, 30.0)));
        let text = resp.text().await.unwrap_or_default();
        let body: String = text.chars().take(500).collect();
        let err = match status {
            401 | 403 => LlmError::Unauthorized,
            404 => LlmError::NotFound {
                url: self.url(),
                model: self.config.model.clone(),
            },
            429 => LlmError::RateLimited(body),
            _ => LlmError::Http { status, body },
        };
        Err((err, retry_after))
    }
}

fn root_cause(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    msg
}

fn message_json(m: &Message, req: &ChatRequest) -> Value {
    match m {
        Message::System { content } => json!({"role": "system", "content": content}),
        Message::User { content, images } => {
            let pixels: Vec<&str> = images
                .iter()
                .filter_map(|id| req.images.iter().find(|p| &p.id == id))
                .map(|p| p.data_url.as_str())
                .collect();
            if pixels.is_empty() {
                json!({"role": "user", "content": content})
            } else {
                let mut parts = vec![json!({"type": "text", "text": content})];
                parts.extend(
                    pixels
                        .into_iter()
                        .map(|url| json!({"type": "image_url", "image_url": {"url": url}})),
                );
                json!({"role": "user", "content": parts})
            }
        }
        Message::Assistant {
            content,
            tool_calls,
        } => {
            let mut v = json!({"role": "assistant", "content": content});
            if !tool_calls.is_empty() {
                v["tool_calls"] = Value::Array(
                    tool_calls
                        .iter()
                        .map(|c| {
                            json!({"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}})
                        })
                        .collect(),
                );
            }
            v
        }
        Message::Tool {
            tool_call_id,
            content,
            ..
        } => json!({"role": "tool", "tool_call_id": tool_call_id, "content": content}),
    }
}

/// Reads one SSE `data:` payload into deltas. Returns `Ok(true)` at `[DONE]`.
fn parse_chunk(
    data: &str,
    out: &mut Vec<ChatDelta>,
    finish: &mut Option<FinishReason>,
    usage: &mut Option<Usage>,
) -> Result<bool, LlmError> {
    if data == "[DONE]" {
        return Ok(true);
    }
    let v: Value = serde_json::from_str(data).map_err(|e| {
        LlmError::BadResponse(format!("a stream chunk is not JSON ({e}): {}", short(data)))
    })?;
    if let Some(err) = v.get("error") {
        return Err(LlmError::BadResponse(format!(
            "the server reported an error mid-stream: {err}"
        )));
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        *usage = Some(Usage {
            prompt_tokens: u["prompt_tokens"].as_u64().unwrap_or(0) as u32,
            completion_tokens: u["completion_tokens"].as_u64().unwrap_or(0) as u32,
        });
    }
    let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
        return Ok(false);
    };
    // Non-streaming servers answer with `message` instead of `delta`.
    let delta = choice.get("delta").or_else(|| choice.get("message"));
    if let Some(delta) = delta {
        if let Some(text) = delta.get("content").and_then(Value::as_str) {
            if !text.is_empty() {
                out.push(ChatDelta::Text(text.to_string()));
            }
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for (pos, c) in calls.iter().enumerate() {
                let f = c.get("function");
                out.push(ChatDelta::ToolCall {
                    index: c
                        .get("index")
                        .and_then(Value::as_u64)
                        .map(|i| i as usize)
                        .unwrap_or(pos),
                    id: c.get("id").and_then(Value::as_str).map(str::to_string),
                    name: f
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    arguments: f
                        .and_then(|f| f.get("arguments"))
                        .map(|a| match a {
                            Value::String(s) => s.clone(),
                            Value::Null => String::new(),
                            other => other.to_string(),
                        })
                        .unwrap_or_default(),
                });
            }
        }
    }
    if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
        *finish = Some(match reason {
            "stop" => FinishReason::Stop,
            "tool_calls" | "function_call" => FinishReason::ToolCalls,
            "length" => FinishReason::Length,
            _ => FinishReason::Other,
        });
    }
    Ok(false)
}

/// A non-streamed chat completion: its first choice's text, the model and the usage.
fn parse_completion(text: &str, configured_model: &str) -> Result<Completion, LlmError> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| LlmError::BadResponse(format!("not JSON ({e})")))?;
    let content = v
        .pointer("/choices/0/message/content")
        .and_then(Value::as_str)
        .ok_or_else(|| LlmError::BadResponse("no choices[0].message.content".into()))?;
    let usage = v.get("usage").filter(|u| u.is_object()).map(|u| Usage {
        prompt_tokens: u["prompt_tokens"].as_u64().unwrap_or(0) as u32,
        completion_tokens: u["completion_tokens"].as_u64().unwrap_or(0) as u32,
    });
    Ok(Completion {
        text: content.to_string(),
        model: v
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or(configured_model)
            .to_string(),
        usage,
    })
}

fn short(s: &str) -> String {
    s.chars().take(200).collect()
}

#[async_trait]
impl Llm for OpenAiLlm {
    async fn chat(&self, req: ChatRequest) -> Result<DeltaStream, LlmError> {
        let mut body = self.body(&req);
        let resp = self.send(&mut body).await?;
        let is_json = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/json"));
        let (tx, rx) = mpsc::channel::<Result<ChatDelta, LlmError>>(64);
        tokio::spawn(pump(resp, is_json, tx));
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            native_tools: true,
            parallel_tool_calls: true,
            images: self.config.multimodal,
            local: is_loopback_url(&self.config.base_url),
            in_process: false,
        }
    }

    fn name(&self) -> String {
        format!("openai:{}", self.config.model)
    }
}

/// Reads the response body into deltas on `tx`.
async fn pump(
    resp: reqwest::Response,
    is_json: bool,
    tx: mpsc::Sender<Result<ChatDelta, LlmError>>,
) {
    let mut finish = None;
    let mut usage = None;
    let mut out = Vec::new();
    if is_json {
        let result = match resp.text().await {
            Ok(text) => parse_chunk(&text, &mut out, &mut finish, &mut usage),
            Err(e) => Err(LlmError::StreamCut(root_cause(&e))),
        };
        let mut items: Vec<Result<ChatDelta, LlmError>> = out.into_iter().map(Ok).collect();
        match result {
            Ok(_) => items.push(Ok(ChatDelta::Finish {
                reason: finish.unwrap_or_default(),
                usage,
            })),
            Err(e) => items.push(Err(e)),
        }
        for item in items {
            if tx.send(item).await.is_err() {
                return;
            }
        }
        return;
    }
    let mut body = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut done = false;
    'read: while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                let _ = tx.send(Err(LlmError::StreamCut(root_cause(&e)))).await;
                return;
            }
        };
        buf.extend_from_slice(&chunk);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim();
            let Some(data) = line.strip_prefix("data:") else {
                continue;
            };
            match parse_chunk(data.trim(), &mut out, &mut finish, &mut usage) {
                Ok(is_done) => {
                    for d in out.drain(..) {
                        if tx.send(Ok(d)).await.is_err() {
                            return;
                        }
                    }
                    if is_done {
                        done = true;
                        break 'read;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            }
        }
    }
    // Some servers close without `[DONE]` after a finish_reason; without either the stream was cut.
    if done || finish.is_some() {
        let _ = tx
            .send(Ok(ChatDelta::Finish {
                reason: finish.unwrap_or_default(),
                usage,
            }))
            .await;
    }
}

/// Whether a URL points at this machine (127.0.0.0/8, ::1, localhost).
pub fn is_loopback_url(url: &str) -> bool {
    let Ok(parsed) = reqwest::Url::parse(url) else {
        return false;
    };
    match parsed.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// Standard base64, for data URLs.
pub fn base64_encode(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_detection() {
        assert!(is_loopback_url("http://127.0.0.1:8080/v1"));
        assert!(is_loopback_url("http://localhost/v1"));
        assert!(is_loopback_url("http://[::1]:1/v1"));
        assert!(!is_loopback_url("https://api.openai.com/v1"));
        assert!(!is_loopback_url("http://10.0.0.5/v1"));
        assert!(!is_loopback_url("not a url"));
    }

    #[test]
    fn chunks_become_deltas() {
        let mut out = vec![];
        let (mut f, mut u) = (None, None);
        let chunk = r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"c2","type":"function","function":{"name":"x","arguments":"{\"a\""}}]},"finish_reason":null}]}"#;
        assert!(!parse_chunk(chunk, &mut out, &mut f, &mut u).unwrap());
        assert_eq!(
            out,
            vec![ChatDelta::ToolCall {
                index: 1,
                id: Some("c2".into()),
                name: Some("x".into()),
                arguments: "{\"a\"".into()
            }]
        );
        assert!(parse_chunk("[DONE]", &mut out, &mut f, &mut u).unwrap());
        assert!(parse_chunk("{not json", &mut out, &mut f, &mut u).is_err());
    }

    #[test]
    fn a_whole_completion_is_read_or_refused_with_the_reason() {
        let c = parse_completion(
            r#"{"model":"served","choices":[{"message":{"content":"Yes."}}],"usage":{"prompt_tokens":9,"completion_tokens":2}}"#,
            "configured",
        )
        .expect("completion");
        assert_eq!((c.text.as_str(), c.model.as_str()), ("Yes.", "served"));
        assert_eq!(c.usage.map(|u| u.completion_tokens), Some(2));
        let c = parse_completion(r#"{"choices":[{"message":{"content":""}}]}"#, "configured")
            .expect("completion");
        assert_eq!((c.model.as_str(), c.usage), ("configured", None));
        let e = parse_completion("<html>", "m").expect_err("not JSON");
        assert!(e.to_string().contains("not JSON"), "{e}");
        let e = parse_completion(r#"{"choices":[]}"#, "m").expect_err("no choice");
        assert!(e.to_string().contains("choices[0].message.content"), "{e}");
    }
}
