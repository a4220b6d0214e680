//! The ReAct text protocol.

use hilum_llm::{Message, ToolCall, ToolSpec};

use super::{describe_tools, ParsedTurn};

const FORMAT: &str = "Answer with this format. To use tools:\n\
Thought: what you need to find out\n\
Action: the tool name\n\
Action Input: the arguments as one JSON object\n\
(repeat Action / Action Input to run several tools at once; they run in parallel)\n\
Then stop and wait for the Observation lines.\n\
When you know the answer:\n\
Thought: I can answer now\n\
Final Answer: the answer";

/// The conversation as a text-only model sees it: tools described in the system prompt,
/// tool results as `Observation` lines in user messages.
pub fn render_messages(messages: &[Message], tools: &[ToolSpec]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::new();
    let mut observations: Vec<String> = Vec::new();
    let flush = |out: &mut Vec<Message>, obs: &mut Vec<String>| {
        if !obs.is_empty() {
            out.push(Message::user(obs.join("\n"), vec![]));
            obs.clear();
        }
    };
    for m in messages {
        match m {
            Message::System { content } => {
                let text = if tools.is_empty() {
                    content.clone()
                } else {
                    format!(
                        "{content}\n\nYou can use these tools:\n{}\n\n{FORMAT}",
                        describe_tools(tools)
                    )
                };
                out.push(Message::system(text));
            }
            Message::Tool {
                tool_call_id,
                name,
                content,
                ..
            } => observations.push(format!("Observation [{tool_call_id}] {name}: {content}")),
            Message::Assistant { content, .. } => {
                flush(&mut out, &mut observations);
                out.push(Message::assistant(content.clone(), vec![]));
            }
            Message::User { .. } => {
                flush(&mut out, &mut observations);
                out.push(m.clone());
            }
        }
    }
    flush(&mut out, &mut observations);
    out
}

#[derive(PartialEq)]
enum Key {
    Thought,
    Action,
    Input,
    Observation,
    Final,
}

fn key_of(line: &str) -> Option<(Key, &str)> {
    let l = line.trim_start();
    let l = l.trim_start_matches(['*', '#', ' ']);
    for (prefix, key) in [
        ("Thought:", Key::Thought),
        ("Action Input:", Key::Input),
        ("Action:", Key::Action),
        ("Observation:", Key::Observation),
        ("Final Answer:", Key::Final),
    ] {
        if let Some(rest) = l.strip_prefix(prefix) {
            return Some((key, rest.trim_start_matches('*').trim()));
        }
    }
    None
}

/// The text after `Final Answer:`, if any.
pub fn final_answer(text: &str) -> Option<String> {
    let idx = text.find("Final Answer:")?;
    Some(text[idx + "Final Answer:".len()..].trim().to_string())
}

/// Reads Action blocks (each becomes a tool call with id `react_{round}_{n}`) or a final answer.
pub fn parse(text: &str, round: usize) -> ParsedTurn {
    let mut turn = ParsedTurn {
        text: text.to_string(),
        ..Default::default()
    };
    let mut sections: Vec<(Key, String)> = Vec::new();
    for line in text.lines() {
        match key_of(line) {
            Some((k, rest)) => sections.push((k, rest.to_string())),
            None => {
                if let Some((_, body)) = sections.last_mut() {
                    body.push('\n');
                    body.push_str(line);
                }
            }
        }
    }
    let mut pending: Option<String> = None;
    let mut n = 0;
    let mut final_text: Option<String> = None;
    for (key, body) in sections {
        let body = body.trim().to_string();
        match key {
            Key::Action => {
                if let Some(name) = pending.take() {
                    turn.problems.push(format!(
                        "`Action: {name}` has no `Action Input:` line; write the arguments as one JSON object on an `Action Input:` line right after it"
                    ));
                }
                let name = body.trim_matches(['`', '"', '\'', ' ']).to_string();
                if name.is_empty() {
                    turn.problems.push(
                        "an `Action:` line names no tool; write the tool name after `Action:`"
                            .into(),
                    );
                } else {
                    pending = Some(name);
                }
            }
            Key::Input => match pending.take() {
                Some(name) => {
                    turn.tool_calls.push(ToolCall {
                        id: format!("react_{round}_{n}"),
                        name,
                        arguments: body,
                    });
                    n += 1;
                }
                None => turn.problems.push(
                    "an `Action Input:` line has no `Action:` line before it; name the tool first"
                        .into(),
                ),
            },
            Key::Final => final_text = Some(body),
            Key::Observation => {
                // The model wrote an observation itself; everything from here on is invented.
                break;
            }
            Key::Thought => {}
        }
    }
    if let Some(name) = pending {
        turn.problems.push(format!(
            "`Action: {name}` has no `Action Input:` line; write the arguments as one JSON object on an `Action Input:` line right after it"
        ));
    }
    if turn.tool_calls.is_empty() && turn.problems.is_empty() {
        turn.answer = Some(final_text.unwrap_or_else(|| text.trim().to_string()));
    }
    turn
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_actions_become_parallel_calls() {
        let t = parse(
            "Thought: check both\nAction: image_info\nAction Input: {\"image\": \"img_1\"}\nAction: classify\nAction Input: {\"image\":\n \"img_1\"}\n",
            2,
        );
        assert_eq!(t.tool_calls.len(), 2);
        assert_eq!(t.tool_calls[0].id, "react_2_0");
        assert_eq!(t.tool_calls[1].name, "classify");
        assert!(t.tool_calls[1].arguments.contains("img_1"));
        assert!(t.answer.is_none());
    }

    #[test]
    fn final_answer_is_read() {
        let t = parse(
            "Thought: done\nFinal Answer: The lungs are clear.\nMore text.",
            1,
        );
        assert_eq!(
            t.answer.as_deref(),
            Some("The lungs are clear.\nMore text.")
        );
    }

    #[test]
    fn malformed_blocks_are_reported_and_good_ones_kept() {
        let t = parse(
            "Action: image_info\nAction: classify\nAction Input: {}\nAction Input: {}",
            1,
        );
        assert_eq!(t.tool_calls.len(), 1);
        assert_eq!(t.tool_calls[0].name, "classify");
        assert_eq!(t.problems.len(), 2, "{:?}", t.problems);
        assert!(t.problems[0].contains("image_info"));
    }

    #[test]
    fn invented_observations_are_ignored() {
        let t = parse(
            "Action: a\nAction Input: {}\nObservation: made up\nAction: b\nAction Input: {}",
            1,
        );
        assert_eq!(t.tool_calls.len(), 1);
    }

    #[test]
    fn tool_results_render_as_observations() {
        let msgs = vec![
            Message::system("sys"),
            Message::user("q", vec![]),
            Message::assistant("Action: a\nAction Input: {}", vec![]),
            Message::Tool {
                tool_call_id: "react_1_0".into(),
                name: "a".into(),
                content: "42".into(),
                is_error: false,
            },
        ];
        let tools = vec![ToolSpec {
            name: "a".into(),
            description: "does a".into(),
            parameters: serde_json::json!({"type": "object"}),
        }];
        let out = render_messages(&msgs, &tools);
        assert_eq!(out.len(), 4);
        assert!(out[0].text().contains("- a: does a"));
        assert_eq!(out[3].text(), "Observation [react_1_0] a: 42");
    }
}
