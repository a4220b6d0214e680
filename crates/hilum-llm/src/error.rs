use thiserror::Error;

/// Why a model call failed. Each message says what the user can do about it.
#[derive(Debug, Error, Clone)]
pub enum LlmError {
    #[error(
        "the model endpoint rejected the credentials (HTTP 401): check OPENAI_API_KEY or --api-key"
    )]
    /// The endpoint refused the API key.
    Unauthorized,
    #[error(
        "the model endpoint answered 404 for {url}: check --base-url and the model name `{model}`"
    )]
    /// The endpoint or the model does not exist there.
    NotFound {
        /// The URL asked.
        url: String,
        /// The model named.
        model: String,
    },
    /// Rate limited past the retries; the endpoint's message.
    #[error("the model endpoint is rate limiting (HTTP 429) and retries ran out: {0}")]
    RateLimited(String),
    /// Any other HTTP failure, with the endpoint's status and body.
    #[error("the model endpoint failed with HTTP {status}: {body}")]
    Http {
        /// The HTTP status.
        status: u16,
        /// The response body.
        body: String,
    },
    /// No connection to the endpoint.
    #[error("could not reach the model endpoint {url}: {reason} (is the server running? is --base-url right?)")]
    Unreachable {
        /// The URL asked.
        url: String,
        /// Why.
        reason: String,
    },
    /// No answer within the request's budget.
    #[error("the model endpoint did not answer within {secs} s (raise --llm-timeout)")]
    Timeout {
        /// The budget, in seconds.
        secs: u64,
    },
    /// The endpoint answered something that is not the protocol.
    #[error("the model endpoint sent malformed data: {0}")]
    BadResponse(String),
    /// The stream stopped before its end.
    #[error("the response stream ended early: {0}")]
    StreamCut(String),
    /// The model looped on the same text and was stopped.
    #[error("the model repeated the same {period}-byte text over its last {window} bytes of output and was stopped (the request was cancelled); try another temperature, a clearer question or a larger model")]
    Repetition {
        /// Length of the repeated text, in bytes.
        period: usize,
        /// Bytes of output looked at.
        window: usize,
    },
    /// A scripted replay is malformed or ran out of turns.
    #[error("script backend: {0}")]
    Script(String),
    /// Anything else, said in full.
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
