//! Protocols turn any model's output into the same [`ParsedTurn`].
//!
//! - `native`: OpenAI function calling; tool calls arrive structured.
//! - `react`: the text protocol `Thought / Action / Action Input / Observation / Final Answer`
//!   for models without function calling; several Action blocks in one turn run in parallel.
//!
//! Under both, calls a model writes as text in another form ([`textcalls`]) are calls too, and a
//! tool result it imitates is dropped: neither becomes an answer.

pub mod react;
pub mod textcalls;

use serde::{Deserialize, Serialize};

use hilum_llm::{AssistantTurn, ChatRequest, ToolCall, ToolSpec};

/// How tools are offered to a model and its calls read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// The backend's function calling.
    #[default]
    Native,
    /// ReAct text blocks (`Action:` / `Observation:`) for models without function calling.
    React,
}

impl std::str::FromStr for Protocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(Protocol::Native),
            "react" => Ok(Protocol::React),
            other => Err(format!("unknown protocol `{other}`: use native or react")),
        }
    }
}

/// What the agent reads from one model turn, whatever the protocol.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParsedTurn {
    /// The model's text (thoughts, or the answer).
    pub text: String,
    /// The calls it asked for.
    pub tool_calls: Vec<ToolCall>,
    /// The final answer, when the model gave one.
    pub answer: Option<String>,
    /// Blocks that could not be read, each with what was wrong (fed back as observations).
    pub problems: Vec<String>,
    /// Messages for the model about what was dropped from its turn (an imitated tool result).
    pub notices: Vec<String>,
}

impl Protocol {
    /// Shapes the request for the backend: native passes tools through; react moves them into
    /// the system prompt and turns tool results into observations.
    pub fn prepare(&self, mut req: ChatRequest) -> ChatRequest {
        match self {
            Protocol::Native => req,
            Protocol::React => {
                let tools = std::mem::take(&mut req.tools);
                req.messages = react::render_messages(&req.messages, &tools);
                req.stop = vec!["\nObservation:".to_string()];
                req.text_tools = tools;
                req
            }
        }
    }

    /// Reads one turn. With tools withheld (`tools_offered = false`) every text is an answer,
    /// less any call markup and imitated results in it.
    pub fn parse(&self, turn: AssistantTurn, round: usize, tools_offered: bool) -> ParsedTurn {
        if !tools_offered {
            let text = turn.text;
            let answer = match self {
                Protocol::React => react::final_answer(&text),
                Protocol::Native => None,
            }
            .unwrap_or_else(|| text.trim().to_string());
            let read = textcalls::read(&answer);
            return ParsedTurn {
                text,
                answer: Some(if read.found() { read.text } else { answer }),
                ..Default::default()
            };
        }
        let parsed = match self {
            Protocol::Native if !turn.tool_calls.is_empty() => {
                return ParsedTurn {
                    text: turn.text,
                    tool_calls: turn.tool_calls,
                    ..Default::default()
                }
            }
            Protocol::Native => ParsedTurn {
                answer: Some(turn.text.trim().to_string()),
                text: turn.text,
                ..Default::default()
            },
            Protocol::React => react::parse(&turn.text, round),
        };
        if !parsed.tool_calls.is_empty() || !parsed.problems.is_empty() {
            return parsed;
        }
        // No call in the protocol's own form: look for one written in another.
        let read = textcalls::read(&parsed.text);
        if !read.found() {
            return parsed;
        }
        let form = match self {
            Protocol::Native => "<tool_call>\n{\"name\": \"TOOL\", \"arguments\": {...}}\n</tool_call> (plain JSON, double quotes, single braces), or the function-calling interface",
            Protocol::React => "`Action: TOOL` on one line and `Action Input: {...}` (one JSON object) on the next",
        };
        ParsedTurn {
            text: read.text,
            tool_calls: read.calls,
            answer: None,
            problems: read
                .unreadable
                .iter()
                .map(|u| format!("a tool call written as `{u}` is not in a form Hilum reads; write each call exactly as {form}"))
                .collect(),
            notices: read
                .imitated
                .iter()
                .map(|r| format!("Your last turn contained a tool result you wrote yourself (`{r}`); it was dropped, with everything after it. Only Hilum runs tools and reports their results: call the tool and wait for its result before you answer."))
                .collect(),
        }
    }
}

/// Tool descriptions as text, for prompts that cannot carry structured tools.
pub fn describe_tools(tools: &[ToolSpec]) -> String {
    tools
        .iter()
        .map(|t| {
            format!(
                "- {}: {}\n  Arguments (JSON Schema): {}",
                t.name, t.description, t.parameters
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}
