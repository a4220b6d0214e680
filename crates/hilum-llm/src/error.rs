use thiserror::Error;

/// Why a model call failed. Each message says what the user can do about it.
#[derive(Debug, Error, Clone)]
pub enum LlmError {
    #[error(
        "the model endpoint rejected the credentials (HTTP 401): check OPENAI_API_KEY or --api-key"
    )]
    Unauthorized,
    #[error(
        "the model endpoint answered 404 for {url}: check --base-url and the model name `{model}`"
    )]
    NotFound { url: String, model: String },
    #[error("the model endpoint is rate limiting (HTTP 429) and retries ran out: {0}")]
    RateLimited(String),
    #[error("the model endpoint failed with HTTP {status}: {body}")]
    Http { status: u16, body: String },
    #[error("could not reach the model endpoint {url}: {reason} (is the server running? is --base-url right?)")]
    Unreachable { url: String, reason: String },
    #[error("the model endpoint did not answer within {secs} s (raise --llm-timeout)")]
    Timeout { secs: u64 },
    #[error("the model endpoint sent malformed data: {0}")]
    BadResponse(String),
    #[error("the response stream ended early: {0}")]
    StreamCut(String),
    #[error("the model repeated the same {period}-byte text over its last {window} bytes of output and was stopped (the request was cancelled); try another temperature, a clearer question or a larger model")]
    Repetition { period: usize, window: usize },
    #[error("script backend: {0}")]
    Script(String),
    #[error("{0}")]
    Other(String),
}

impl LlmError {
    /// A short name of the failure, for logs: the messages may quote what the endpoint sent,
    /// and some endpoints quote the conversation.
    pub fn kind(&self) -> &'static str {
        match self {
            LlmError::Unauthorized => "unauthorized",
            LlmError::NotFound { .. } => "not_found",
            LlmError::RateLimited(_) => "rate_limited",
            LlmError::Http { status, .. } if *status >= 500 => "http_5xx",
            LlmError::Http { .. } => "http_4xx",
            LlmError::Unreachable { .. } => "unreachable",
            LlmError::Timeout { .. } => "timeout",
            LlmError::BadResponse(_) => "bad_response",
            LlmError::StreamCut(_) => "stream_cut",
            LlmError::Repetition { .. } => "repetition",
            LlmError::Script(_) => "script",
            LlmError::Other(_) => "other",
        }
    }

    /// Whether repeating the same request may succeed (rate limits, 5xx, dropped connections).
    pub fn is_transient(&self) -> bool {
        match self {
            LlmError::RateLimited(_) | LlmError::Unreachable { .. } | LlmError::Timeout { .. } => {
                true
            }
            LlmError::Http { status, .. } => *status >= 500,
            _ => false,
        }
    }
}
