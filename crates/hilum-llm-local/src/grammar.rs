//! Grammar-constrained tool calls with llguidance: once the model opens a `<tool_call>`, every
//! further token must keep the output a valid call — a known tool name, arguments that match
//! that tool's JSON Schema, image arguments that name an image of this conversation.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use hilum_llm::ToolSpec;

use crate::tokenizer::GgufTokenizer;
use crate::LocalError;

/// Argument names whose values are image ids.
const IMAGE_KEYS: [&str; 3] = ["image", "image_id", "images"];

/// Narrows `image`-like string properties to the ids the user attached, when there are any.
pub fn restrict_images(schema: &Value, image_ids: &[String]) -> Value {
    let mut s = schema.clone();
    if image_ids.is_empty() {
        return s;
    }
    if let Some(props) = s.get_mut("properties").and_then(Value::as_object_mut) {
        for key in IMAGE_KEYS {
            if let Some(p) = props.get_mut(key) {
                let ids = json!(image_ids);
                if p.get("type") == Some(&json!("string")) {
                    if let Some(o) = p.as_object_mut() {
                        o.remove("pattern");
                        o.insert("enum".into(), ids);
                    }
                } else if let Some(items) = p.get_mut("items").and_then(Value::as_object_mut) {
                    items.remove("pattern");
                    items.insert("enum".into(), ids);
                }
            }
        }
    }
    s
}

/// The Lark grammar of one or more calls in Qwen/Hermes form, with llguidance's `%json`
/// for each tool's arguments. JSON is written as Python's `json.dumps` would (`", "`, `": "`),
/// which is also how the chat template renders past calls, so the KV cache stays reusable.
pub fn tool_call_grammar(
    tools: &[ToolSpec],
    image_ids: &[String],
    open: &str,
    close: &str,
) -> Result<String, LocalError> {
    if tools.is_empty() {
        return Err(LocalError::Grammar(
            "no tools to constrain a call to".into(),
        ));
    }
    let mut g = String::new();
    g.push_str(&format!(
        "start: block (\"\\n\" block)*\nblock: {open} \"\\n\" call \"\\n\" {close}\ncall: "
    ));
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&alts.join(" | "));
    g.push('\n');
    for (i, t) in tools.iter().enumerate() {
        let head = format!("{{\"name\": \"{}\", \"arguments\": ", t.name);
        let head = serde_json::to_string(&head).map_err(|e| LocalError::Grammar(e.to_string()))?;
        g.push_str(&format!("call_{i}: {head} args_{i} \"}}\"\n"));
        g.push_str(&format!("args_{i}: %json {}\n", args_schema(t, image_ids)));
    }
    Ok(g)
}

/// The Lark grammar of the ReAct protocol's call blocks (`Action: NAME` then `Action Input:`
/// and the arguments as one JSON object), one or more, each tool's arguments held to its
/// schema as in [`tool_call_grammar`]. The blocks end with the turn or with `Observation:` (the
/// protocol's stop text: the model writes it where it waits for the results).
pub fn react_call_grammar(tools: &[ToolSpec], image_ids: &[String]) -> Result<String, LocalError> {
    if tools.is_empty() {
        return Err(LocalError::Grammar(
            "no tools to constrain a call to".into(),
        ));
    }
    let mut g = String::from(
        "start: \"Action: \" call (\"\\nAction: \" call)* \"\\nObservation:\"?\ncall: ",
    );
    let alts: Vec<String> = (0..tools.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&alts.join(" | "));
    g.push('\n');
    for (i, t) in tools.iter().enumerate() {
        let head = format!("{}\nAction Input: ", t.name);
        let head = serde_json::to_string(&head).map_err(|e| LocalError::Grammar(e.to_string()))?;
        g.push_str(&format!("call_{i}: {head} args_{i}\n"));
        g.push_str(&format!("args_{i}: %json {}\n", args_schema(t, image_ids)));
    }
    Ok(g)
}

/// A tool's argument schema as the grammars use it: image ids narrowed, JSON written with
/// Python's separators.
fn args_schema(t: &ToolSpec, image_ids: &[String]) -> Value {
    let mut schema = restrict_images(&t.parameters, image_ids);
    if !schema.is_object() {
        schema = json!({"type": "object"});
    }
    if let Some(o) = schema.as_object_mut() {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}),
        );
    }
    schema
}

/// Builds matchers for one request's tools; cheap to create per request.
pub struct Constraint {
    factory: ParserFactory,
    grammar: String,
}

impl Constraint {
    /// Matchers for `<tool_call>` blocks calling `tools` (with the picture ids a call may name);
    /// fails when the vocabulary has no `<tool_call>` token.
    pub fn new(
        tok: &Arc<GgufTokenizer>,
        tools: &[ToolSpec],
        image_ids: &[String],
    ) -> Result<Self, LocalError> {
        let (open, close) = match (tok.special("<tool_call>"), tok.special("</tool_call>")) {
            (Some(_), Some(_)) => ("<tool_call>", "</tool_call>"),
            _ => {
                return Err(LocalError::Grammar(
                    "this model's vocabulary has no <tool_call> token".into(),
                ))
            }
        };
        Self::from_grammar(tok, tool_call_grammar(tools, image_ids, open, close)?)
    }

    /// Matchers for the ReAct protocol's `Action:` blocks (any vocabulary).
    pub fn react(
        tok: &Arc<GgufTokenizer>,
        tools: &[ToolSpec],
        image_ids: &[String],
    ) -> Result<Self, LocalError> {
        Self::from_grammar(tok, react_call_grammar(tools, image_ids)?)
    }

    fn from_grammar(tok: &Arc<GgufTokenizer>, grammar: String) -> Result<Self, LocalError> {
        let mut factory = ParserFactory::new_simple(&tok.env())
            .map_err(|e| LocalError::Grammar(format!("llguidance: {e}")))?;
        factory.quiet();
        Ok(Constraint { factory, grammar })
    }

    /// A fresh matcher positioned before the first `<tool_call>`.
    pub fn matcher(&self) -> Result<Matcher, LocalError> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(self.grammar.clone()));
        let m = Matcher::new(parser);
        if let Some(e) = m.get_error() {
            return Err(LocalError::Grammar(format!(
                "the tool-call grammar is invalid: {e}"
            )));
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_properties_become_an_enum_of_session_ids() {
        let s = json!({"type": "object", "properties": {
            "image": {"type": "string", "pattern": "^img_"},
            "threshold": {"type": "number"}}});
        let r = restrict_images(&s, &["img_aa".into(), "img_bb".into()]);
        assert_eq!(
            r["properties"]["image"]["enum"],
            json!(["img_aa", "img_bb"])
        );
        assert!(r["properties"]["image"].get("pattern").is_none());
        assert_eq!(r["properties"]["threshold"], json!({"type": "number"}));
        // No ids: the schema is left alone.
        assert_eq!(restrict_images(&s, &[]), s);
    }

    #[test]
    fn grammar_names_every_tool_in_order() {
        let tools = vec![
            ToolSpec {
                name: "a".into(),
                description: String::new(),
                parameters: json!({"type": "object"}),
            },
            ToolSpec {
                name: "b".into(),
                description: String::new(),
                parameters: json!({"type": "object"}),
            },
        ];
        let g = tool_call_grammar(&tools, &[], "<tool_call>", "</tool_call>").unwrap();
        assert!(g.contains("call: call_0 | call_1"), "{g}");
        assert!(
            g.contains(r#"call_1: "{\"name\": \"b\", \"arguments\": " args_1"#),
            "{g}"
        );
        assert!(tool_call_grammar(&[], &[], "<a>", "</a>").is_err());
        let r = react_call_grammar(&tools, &["img_1".into()]).unwrap();
        assert!(
            r.starts_with(
                "start: \"Action: \" call (\"\\nAction: \" call)* \"\\nObservation:\"?\n"
            ),
            "{r}"
        );
        assert!(r.contains(r#"call_1: "b\nAction Input: " args_1"#), "{r}");
        assert!(react_call_grammar(&[], &[]).is_err());
    }
}
