//! Reading Qwen/Hermes-style tool calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

use serde_json::Value;

/// One call as the model wrote it. `arguments` is JSON text (exactly as written when it parsed;
/// the raw text otherwise, so the agent can report or repair it).
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedCall {
    /// The tool's name.
    pub name: String,
    /// The call's arguments as JSON text.
    pub arguments: String,
}

/// Parses the body between `<tool_call>` and `</tool_call>`.
pub fn parse_call_body(body: &str) -> Result<ParsedCall, String> {
    let body = body.trim();
    let v: Value = serde_json::from_str(body)
        .map_err(|e| format!("tool call is not valid JSON ({e}): {body}"))?;
    let name = v
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| format!("tool call has no \"name\": {body}"))?
        .to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models put the arguments object in a string.
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Ok(ParsedCall { name, arguments })
}

/// Splits unconstrained output into free text and the bodies of its `<tool_call>` blocks
/// (an unclosed last block is returned too: the model may have been stopped at `</tool_call>`).
pub fn split_tool_calls<'a>(text: &'a str, open: &str, close: &str) -> (String, Vec<&'a str>) {
    let mut free = String::new();
    let mut bodies = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(open) {
        free.push_str(&rest[..i]);
        let after = &rest[i + open.len()..];
        match after.find(close) {
            Some(j) => {
                bodies.push(&after[..j]);
                rest = &after[j + close.len()..];
            }
            None => {
                bodies.push(after);
                rest = "";
            }
        }
    }
    free.push_str(rest);
    (free.trim().to_string(), bodies)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_gives_name_and_argument_text() {
        let c = parse_call_body(
            "\n{\"name\": \"image_info\", \"arguments\": {\"image\": \"img_1\"}}\n",
        )
        .unwrap();
        assert_eq!(c.name, "image_info");
        assert_eq!(
            serde_json::from_str::<Value>(&c.arguments).unwrap()["image"],
            "img_1"
        );
        let c = parse_call_body("{\"name\": \"f\", \"arguments\": \"{\\\"a\\\":1}\"}").unwrap();
        assert_eq!(c.arguments, "{\"a\":1}");
        assert!(parse_call_body("{\"name\": \"f\", ").is_err());
        assert!(parse_call_body("{\"arguments\": {}}")
            .unwrap_err()
            .contains("name"));
    }

    #[test]
    fn text_and_several_calls_are_separated() {
        let (free, bodies) = split_tool_calls(
            "Let me check.<tool_call>\n{\"name\": \"a\"}\n</tool_call>\n<tool_call>{\"name\": \"b\"}",
            "<tool_call>",
            "</tool_call>",
        );
        assert_eq!(free, "Let me check.");
        assert_eq!(bodies.len(), 2);
        assert_eq!(parse_call_body(bodies[1]).unwrap().name, "b");
    }
}
