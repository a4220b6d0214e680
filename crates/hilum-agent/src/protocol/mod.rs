//! Protocols turn any model's output into the same [`ParsedTurn`].
//!
//! - `native`: OpenAI function calling; tool calls arrive structured.
//! - `react`: the text protocol `Thought / Action / Action Input / Observation / Final Answer`
//!   for models without function calling; several Action blocks in one turn run in parallel.

pub mod react;

use serde::{Deserialize, Serialize};

use hilum_llm::{AssistantTurn, ChatRequest, ToolCall, ToolSpec};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    #[default]
    Native,
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
    pub tool_calls: Vec<ToolCall>,
    /// The final answer, when the model gave one.
    pub answer: Option<String>,
    /// Blocks that could not be read, each with what was wrong (fed back as observations).
    pub problems: Vec<String>,
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
                req
            }
        }
    }

    /// Reads one turn. With tools withheld (`tools_offered = false`) every text is an answer.
    pub fn parse(&self, turn: AssistantTurn, round: usize, tools_offered: bool) -> ParsedTurn {
        match self {
            Protocol::Native => {
                let answer = if turn.tool_calls.is_empty() || !tools_offered {
                    Some(turn.text.trim().to_string())
                } else {
                    None
                };
                ParsedTurn {
                    text: turn.text,
                    tool_calls: if tools_offered {
                        turn.tool_calls
                    } else {
                        vec![]
                    },
                    answer,
                    problems: vec![],
                }
            }
            Protocol::React => {
                if tools_offered {
                    react::parse(&turn.text, round)
                } else {
                    let answer = react::final_answer(&turn.text)
                        .unwrap_or_else(|| turn.text.trim().to_string());
                    ParsedTurn {
                        text: turn.text,
                        answer: Some(answer),
                        ..Default::default()
                    }
                }
            }
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
